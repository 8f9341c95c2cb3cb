"""text/reasoning.py: Qwen3's thinking block split from the answer, streamed piece by piece
(every split of the text into pieces gives the same parts), and through the engine."""
import pytest

from kestreld.engine.generate import Engine
from kestreld.engine.prompt import Prompt
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from kestreld.text.reasoning import ReasoningSplitter, opens_thinking, split_reasoning
from modelgen import prompt_ids

CASES = [
    ("<think>\nadd 2 and 2\n</think>\n\n4", False, ("4", "\nadd 2 and 2\n")),
    ("  <think>x</think>y", False, ("y", "x")),
    ("no block <think>x</think>", False, ("no block <think>x</think>", "")),
    ("<thin", False, ("<thin", "")),                      # ends on a partial tag: content
    ("<think>cut off by max_tokens", False, ("", "cut off by max_tokens")),
    ("\nstill thinking</think>\n\nanswer", True, ("answer", "\nstill thinking")),
    ("x</thin", True, ("", "x</thin")),
    ("", False, ("", "")),
]


@pytest.mark.parametrize("text,in_thinking,want", CASES)
def test_split_whole_and_streamed(text, in_thinking, want):
    assert split_reasoning(text, in_thinking) == want
    for step in (1, 2, 3, 5):                              # tags split across pieces
        s = ReasoningSplitter(in_thinking)
        parts = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.flush()]
        assert ("".join(c for c, _ in parts), "".join(r for _, r in parts)) == want


def test_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_engine_streams_the_split(zoo):
    """A prompt whose answer starts inside the block (no `</think>` comes from random
    weights): the whole answer is reasoning, streamed as such, and equal to the text of
    the same request without the split."""
    model = load_model(str(zoo.get("qwen3_tied").gguf["q8_0"]))
    ids = prompt_ids("qwen3_tied", 30, seed=4)
    opts = SamplingOptions(max_tokens=10, ignore_eos=True)
    plain = Engine(model, max_seq=128).generate(Prompt(ids), opts)
    events = []
    split = Engine(model, max_seq=128).generate(Prompt(ids, thinking=True, split_reasoning=True), opts,
                                                on_token=events.append)
    assert plain.reasoning is None and split.text == "" and split.ids == plain.ids
    assert split.reasoning == plain.text and "</think>" not in plain.text
    assert "".join(e.reasoning for e in events) == split.reasoning
    assert all(e.text == "" for e in events)
