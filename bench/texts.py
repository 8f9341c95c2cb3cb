"""Long readable documents for the demo, made deterministically from built-in text (no downloads).

    doc = tide_gauge_manual(n_tokens=2000, count_tokens=lambda s: len(kc.tokenize(s)))
    doc.text, doc.question, doc.follow_up

A document is an introduction holding the facts its questions ask about, then sections
written from sentence templates about the parts of a made-up subject, filled in by a seeded
`random.Random`: the same arguments give the same text. Sections are added until the text
has `n_tokens` tokens by the caller's tokenizer (paragraphs are counted one by one, so the
whole may differ from the target by a few tokens).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Document:
    title: str
    text: str            # the title, the introduction and the sections, blank-line separated
    question: str        # answered by a sentence of the introduction
    follow_up: str       # another question answered there
    tokens: int          # tokens of the text, as counted by the caller's tokenizer


@dataclass(frozen=True)
class _Topic:
    title: str
    intro: str
    question: str
    follow_up: str
    heading: str         # "{n}" the section's number, "{part}" its subject
    parts: tuple         # the subjects of the sections
    sentences: tuple     # templates; slots: {part}, {other} (another part), _NUMBERS
    seed: int


# The number slots of the sentence templates and their ranges.
_NUMBERS = {"weeks": (2, 12), "milliamps": (20, 90), "peak": (100, 400), "cold": (10, 40),
            "hot": (40, 70), "torque": (2, 9), "seconds": (20, 90), "years": (3, 15),
            "hours": (24, 200), "code": (100, 999), "walk_hours": (2, 5), "minutes": (20, 90),
            "mornings": (2, 6), "year": (1700, 1990)}

_TIDE_GAUGE = _Topic(
    title="Operator's Manual for the Tern-4 Tide Gauge",
    intro=("The Tern-4 is a solar-powered tide gauge built for small harbours and river mouths. "
           "It measures the water level every six minutes, stores the readings on a memory card "
           "and sends them to the harbour office by radio once an hour. "
           "When the battery is low, the status lamp on the display panel blinks amber twice "
           "every ten seconds. "
           "A fully charged battery pack keeps the Tern-4 running for nineteen days without any sun. "
           "This manual explains how each part works and how to look after it."),
    question="According to the manual, what does the status lamp do when the battery is low?",
    follow_up=("How many days can the Tern-4 keep running on a fully charged battery without "
               "any sun? Answer in one short sentence."),
    heading="Section {n}: {part}",
    parts=("pressure sensor", "float well", "data logger", "solar panel", "battery pack",
           "radio modem", "mounting bracket", "desiccant cartridge", "GPS clock", "stilling pipe",
           "intake filter", "junction box", "display panel", "heater element", "cable gland",
           "antenna", "memory card", "temperature probe", "lightning arrester", "cabinet door"),
    sentences=(
        "The {part} should be inspected every {weeks} weeks, or sooner after a storm.",
        "When the {part} is replaced, write its serial number in the station log before "
        "closing the cabinet.",
        "A worn {part} often shows itself first as small jumps in the water level record.",
        "Clean the {part} with fresh water and a soft brush; never use solvents, which attack "
        "the seals.",
        "In normal operation the {part} draws about {milliamps} milliamps, and up to {peak} milliamps "
        "while it warms up.",
        "If the {part} reports a fault, the logger keeps the last good reading and marks the "
        "gap with a flag.",
        "Technicians should carry a spare {part} on every visit to a remote station.",
        "The {part} is rated for temperatures between minus {cold} and plus {hot} degrees Celsius.",
        "Tighten the screws that hold the {part} to {torque} newton metres; more force cracks the "
        "plastic.",
        "After a firmware update the {part} needs about {seconds} seconds to settle before its "
        "readings can be trusted.",
        "The {part} is wired to the {other}, so check both when a reading drops out.",
        "Salt crystals on the {part} are a sign that the cabinet seal needs attention.",
        "Most stations in the field have run their original {part} for more than {years} years.",
        "Do not open the {part} while the station is transmitting; wait for the radio lamp "
        "to go dark.",
        "The factory tests every {part} for {hours} hours before it leaves the workshop.",
        "A loose connector on the {other} can make the {part} look faulty when it is not.",
        "Keep a photograph of the {part} as installed, so the next visitor can see what "
        "changed.",
        "Replacement parts for the {part} are listed in the appendix under code T4-{code}.",
    ),
    seed=4,
)

_ISLAND_GUIDE = _Topic(
    title="A Visitor's Guide to the Isle of Varrow",
    intro=("The Isle of Varrow lies nine miles off the western coast and can be reached by the "
           "morning ferry from Port Ellery. The lighthouse on the northern cape was built in "
           "1847 by the stonemason Agnes Corlett and her two brothers. About six hundred "
           "people live on the island all year, most of them in the village of Kell."),
    question="In which year was the lighthouse on the Isle of Varrow built, and by whom?",
    follow_up="Which village do most of the islanders live in?",
    heading="Chapter {n}: {part}",
    parts=("the harbour at Kell", "the northern cape", "Saint Bride's chapel", "the salt marsh",
           "the old quarry", "Corlett's bakery", "the puffin cliffs", "the standing stones",
           "the walled garden", "the herring sheds", "the west beach", "the island school",
           "the weather station", "the ferry pier", "the peat bog", "the hill of Cronk Mooar"),
    sentences=(
        "Visitors who come to {part} in late spring are often alone with the birds.",
        "The path to {part} is steep in places, and walkers should allow {walk_hours} hours for the "
        "round trip.",
        "Islanders say that {part} was busier a hundred years ago than it is today.",
        "On a clear evening you can see the mainland hills from {part}.",
        "A small museum near {other} keeps old photographs of {part}.",
        "In {year} a great storm damaged {part}, and it took the village {years} years to repair it.",
        "Bring warm clothes to {part}, because the wind from the sea is cold even in summer.",
        "Children from the island school visit {part} every autumn to count the seals.",
        "The walk from {other} to {part} takes about {minutes} minutes along the coast road.",
        "Local fishermen still land their catch near {part} on {mornings} mornings a week.",
        "Wild thyme and sea pinks grow everywhere around {part} in June.",
        "The first written record of {part} dates from the year {year}.",
        "There is no shop at {part}, so carry water and something to eat.",
        "Several old songs of the island are set at {part}, and the choir still sings them.",
        "Dogs must be kept on a lead near {part} while the ewes are lambing.",
        "Painters have come to {part} for the light since the middle of the last century.",
    ),
    seed=7,
)


def _section(topic: _Topic, rng: random.Random, n: int) -> str:
    part = topic.parts[(n - 1) % len(topic.parts)]
    others = [p for p in topic.parts if p != part]
    lines = []
    for template in rng.sample(topic.sentences, rng.randint(5, 8)):
        numbers = {name: rng.randint(lo, hi) for name, (lo, hi) in _NUMBERS.items()}
        lines.append(template.format(part=part, other=rng.choice(others), **numbers))
    body = " ".join(lines)
    heading = topic.heading.format(n=n, part=_capitalized(part))
    return f"{heading}\n\n{_capitalized(body)}"


def _capitalized(s: str) -> str:
    return s[0].upper() + s[1:]


def _compose(topic: _Topic, n_tokens: int, count_tokens: CountTokens) -> Document:
    rng = random.Random(topic.seed)
    paragraphs = [topic.title, topic.intro]
    total = sum(count_tokens(p) for p in paragraphs)
    n = 0
    while total < n_tokens:
        n += 1
        paragraphs.append(_section(topic, rng, n))
        total += count_tokens(paragraphs[-1])
    return Document(topic.title, "\n\n".join(paragraphs), topic.question, topic.follow_up, total)


def tide_gauge_manual(n_tokens: int, count_tokens: CountTokens) -> Document:
    """A technical manual of about `n_tokens` tokens (at least the introduction)."""
    return _compose(_TIDE_GAUGE, n_tokens, count_tokens)


def island_guide(n_tokens: int, count_tokens: CountTokens) -> Document:
    """A travel guide of about `n_tokens` tokens (at least the introduction)."""
    return _compose(_ISLAND_GUIDE, n_tokens, count_tokens)
