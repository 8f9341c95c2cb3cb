"""Speculation from the context: decode speed with drafts and without, beside llama.cpp's
prompt lookup on the same file and threads, and what a pass over k tokens costs.

    make bench-speculate                      # .venv/bin/python bench/speculate.py --threads 2
    .venv/bin/python bench/speculate.py --quick   # short answers, two tasks: a smoke run

Tasks, on SmolLM2-135M-Instruct (a real model, so its drafts are taken or refused for real;
`--model`, default llama.cpp's Q4_K_M of it where llama-cpp-python is installed, else the
Q8_0), each a few chat prompts answered greedily up to `--max-tokens`:
  grounded: quote a paragraph (two paragraphs), edit it, one word changed (two), summarize a
  ~600-token text (two texts), answer a question about a ~2,000-token document (three
  questions, two documents), and a second chat turn that asks the model to repeat its first
  answer with a title (two); open: a story and a poem.
A task has several prompts because one greedy answer is a draw: a last-bit change anywhere
upstream (a kernel's rounding) can turn a summary that quotes its text into one that does
not, and the task's ratio with it.
Decode speed counts the tokens after the first over the time from the first to the last
(the prefill is not in it), for both engines. Kestrel runs in-process (`Engine`, its own
prefill each run); its answers with and without speculation are asserted to be the same ids.
Each rep runs Kestrel with speculation and then without, back to back, and a prompt's on / off
is the median of those reps' ratios (a VM's speed drifts over minutes; a pair takes seconds);
a task's is the geometric mean over its prompts, as are its tok/s columns (each a median).
llama.cpp runs after all of Kestrel's reps of a prompt, so that its threads never share the
cores with Kestrel's.
llama.cpp runs through llama-cpp-python's `generate` on the same prompt ids, plainly and with
`LlamaPromptLookupDecoding` (its prompt lookup: 2-grams, 10 tokens drafted), greedy.

Then the cost of one forward pass over k = 1, 2, 4, 8, 16 tokens at depth 200, relative to
one token, on SmolLM2 and on random-weight shapes (`--shapes`, bench/common.py: 1.7B-shaped and
MoE-shaped Q4_K_M): the verification passes' price. For the shapes, whose random weights
draft nothing, the speed-up speculation would bring at SmolLM2's measured passes is projected:
the grounded tasks' decode passes (their sizes as recorded) priced by the shape's curve,
against one pass per token.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import llama_quantized, open_llama, shaped_path  # noqa: E402
from texts import island_guide, tide_gauge_manual  # noqa: E402
from vs_llamacpp import llamacpp_available  # noqa: E402

from kestreld.engine.generate import Engine  # noqa: E402
from kestreld.engine.prompt import ChatInput  # noqa: E402
from kestreld.engine.sampler import SamplingOptions  # noqa: E402
from kestreld.model.convert import smollm2_q8_0_path  # noqa: E402
from kestreld.model.load import load_model  # noqa: E402
from kestreld.service.config import default_cache_dir  # noqa: E402

PARAGRAPH = ("The lighthouse keeper climbed the stairs every evening at dusk. He trimmed the "
             "wick, filled the lamp with oil, and wiped the salt from the glass so that ships "
             "passing the rocks could see the light. In the log he wrote the wind, the state of "
             "the sea, and the names of the ships that went by. When the fog came in he rang "
             "the bell every two minutes until morning.")


PARAGRAPH_2 = ("The baker in the harbour village lit her oven two hours before dawn. She "
               "shaped the loaves by hand, brushed them with milk, and set them on long wooden "
               "boards to rise beside the fire. When the first ferry came in, the crew bought "
               "warm bread and smoked fish for the crossing. On Sundays she baked only seed "
               "cake, and the whole village could smell it from the church.")


@dataclass
class Task:
    name: str
    grounded: bool
    prompts: tuple           # chats, each a tuple of messages; a None content is the model's
                             # first answer


def _user(text: str) -> tuple:
    return ({"role": "user", "content": text},)


def tasks(count_tokens) -> list:
    """The tasks, each with a few prompts: one greedy answer is a draw (a last-bit change
    upstream can turn a summary that quotes into one that does not), several make its mean."""
    manual, guide = tide_gauge_manual(2000, count_tokens), island_guide(2000, count_tokens)
    texts = (island_guide(600, count_tokens).text, tide_gauge_manual(600, count_tokens).text)
    edits = ((PARAGRAPH, "evening", "morning"), (PARAGRAPH_2, "Sundays", "Saturdays"))
    return [
        Task("quote", True, tuple(_user(f"{p}\n\nQuote the text above exactly, word for word.")
                                  for p in (PARAGRAPH, PARAGRAPH_2))),
        Task("edit", True, tuple(_user(f"Rewrite this paragraph, changing '{a}' to '{b}' and "
                                       f"nothing else:\n\n{p}") for p, a, b in edits)),
        Task("summarize", True, tuple(_user(f"{t}\n\nSummarize this text.") for t in texts)),
        Task("document QA", True, tuple(_user(f"{d.text}\n\n{q}") for d, q in (
            (manual, manual.question), (manual, manual.follow_up), (guide, guide.question)))),
        Task("multi-turn", True, tuple(
            ({"role": "user", "content": f"Tell me about this:\n\n{p}"},
             {"role": "assistant", "content": None},
             {"role": "user", "content": "Repeat your answer, word for word, under a title."})
            for p in (PARAGRAPH, PARAGRAPH_2))),
        Task("open chat", False, (_user("Write a short story about a fox and a crow."),
                                  _user("Write a short poem about the sea."))),
    ]


class Timed:
    """Times of the streamed tokens of one answer."""

    def __init__(self):
        self.times = []

    def __call__(self, event) -> None:
        if event.ids:
            self.times.extend([time.perf_counter()] * len(event.ids))

    def tok_s(self) -> float:
        t = self.times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")


class PassLog:
    """Wraps an engine's forward pass to record the size of each decode pass."""

    def __init__(self, forward):
        self.forward, self.sizes, self.on = forward, [], False

    def __call__(self, ids, *args, **kw):
        if self.on:
            self.sizes.append(len(ids))
        return self.forward(ids, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.forward, name)


class Kestrel:
    def __init__(self, path: str, threads: int):
        self.model = load_model(path)
        self.engines = {spec: Engine(self.model, max_seq=4096, threads=threads, speculate=spec)
                        for spec in (True, False)}
        self.log = PassLog(self.engines[True].forward)
        self.engines[True].forward = self.log

    def prompt(self, chat: tuple, max_tokens: int) -> list:
        """A chat's prompt ids; a None message is the model's own first answer."""
        e, msgs = self.engines[False], []
        for m in chat:
            if m["content"] is None:
                ids = e.prompt(ChatInput(tuple(msgs))).ids
                e.kv.truncate(0)
                answer = e.generate(ids, SamplingOptions(max_tokens=max_tokens)).text
                m = {"role": "assistant", "content": answer}
            msgs.append(m)
        return e.prompt(ChatInput(tuple(msgs))).ids

    def answer(self, ids: list, spec: bool, max_tokens: int):
        """(ids, decode tok/s, pass sizes) of a greedy answer, the prompt prefilled anew."""
        e = self.engines[spec]
        e.kv.truncate(0)
        timed = Timed()
        self.log.sizes, self.log.on = [], False
        # the first forward pass after the prefill is the first decode pass
        c = e.generate(ids, SamplingOptions(max_tokens=max_tokens),
                       on_token=lambda ev: (timed(ev), setattr(self.log, "on", spec)))
        return c, timed.tok_s(), list(self.log.sizes)


class LlamaCpp:
    """llama-cpp-python's `generate`, plainly or with its prompt lookup, a fresh context per
    answer."""

    def __init__(self, path: str, threads: int, lookup: bool):
        self.path, self.threads, self.lookup = path, threads, lookup

    def answer(self, ids: list, max_tokens: int):
        extra = {}
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            # its verification reads the logits of every drafted position
            extra.update(draft_model=LlamaPromptLookupDecoding(), logits_all=True)
        llm = open_llama(self.path, True, n_threads=self.threads, n_threads_batch=self.threads,
                         n_ctx=4096, n_batch=512, seed=0, verbose=False, **extra)
        times, out = [], []
        eos = llm.token_eos()
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if tok == eos:
                break
            out.append(tok)
            if len(out) >= max_tokens:
                break
        llm.close()         # its threads and buffers go now, not at some later collection
        tok_s = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
        return out, tok_s


def k_cost(path: str, threads: int, ks=(1, 2, 4, 8, 16), depth: int = 200, reps: int = 7) -> dict:
    """Seconds of one forward pass over k tokens at `depth`, relative to k = 1 (best of reps)."""
    model = load_model(path)
    e = Engine(model, max_seq=depth + max(ks) + 8, threads=threads)
    rng = np.random.default_rng(0)
    ids = rng.integers(256, min(model.config.vocab, 49152), depth + max(ks)).tolist()
    e.forward_logits(ids[:depth], 0)
    best = {}
    out = np.empty((max(ks), model.config.vocab), np.float32)
    for _ in range(reps):
        for k in ks:
            e.kv.truncate(depth)
            t0 = time.perf_counter()
            e.forward(ids[depth:depth + k], logits_out=out[:k])
            best[k] = min(best.get(k, float("inf")), time.perf_counter() - t0)
    return {k: best[k] / best[ks[0]] for k in ks} | {"one_ms": best[ks[0]] * 1e3}


def projected(curve: dict, passes: list, tokens: int) -> float:
    """Speed-up of decode passes of these sizes (interpolated on the curve) over one pass per
    token, for `tokens` tokens."""
    ks = sorted(k for k in curve if isinstance(k, int))
    cost = sum(float(np.interp(n, ks, [curve[k] for k in ks])) for n in passes)
    return tokens / cost if cost else float("nan")


def geomean(xs: list) -> float:
    xs = [x for x in xs if x == x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="the SmolLM2 GGUF (default: Q4_K_M or Q8_0)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=3, help="runs of each prompt, each engine")
    ap.add_argument("--shapes", default="qwen3-1.7b:Q4_K_M,qwen3moe:Q4_K_M",
                    help="random-weight shapes for the k-cost curve (bench/common.py)")
    ap.add_argument("--quick", action="store_true", help="two tasks, short answers, no shapes")
    args = ap.parse_args(argv)
    cache = default_cache_dir(os.environ)
    have_llama = llamacpp_available()
    q8 = smollm2_q8_0_path(cache)
    path = args.model or (llama_quantized(q8, "Q4_K_M", cache) if have_llama else q8)
    if args.quick:
        args.max_tokens, args.reps, args.shapes = 48, 1, ""
    print(f"# bench/speculate.py on {os.path.basename(path)}, {args.threads} threads, greedy, "
          f"up to {args.max_tokens} tokens, medians of {args.reps}")
    k = Kestrel(path, args.threads)
    count = lambda s: len(k.engines[False].tokenize(s))  # noqa: E731
    todo = tasks(count)[:2] if args.quick else tasks(count)
    llama = {"plain": LlamaCpp(path, args.threads, False),
             "lookup": LlamaCpp(path, args.threads, True)} if have_llama else {}
    rows, grounded_passes, grounded_tokens = [], [], 0
    for task in todo:
        runs = []           # per prompt: its numbers
        for chat in task.prompts:
            ids = k.prompt(chat, args.max_tokens)
            speeds = {name: [] for name in ("on", "off", *llama)}
            paired = []     # on / off of each rep: the two runs are back to back
            for rep in range(args.reps):
                on, on_s, passes = k.answer(ids, True, args.max_tokens)
                off, off_s, _ = k.answer(ids, False, args.max_tokens)
                assert on.ids == off.ids, f"{task.name}: speculation changed the answer"
                speeds["on"].append(on_s)
                speeds["off"].append(off_s)
                paired.append(on_s / off_s)
            # after Kestrel's runs: llama.cpp's threads never share the cores with them
            for rep in range(args.reps):
                for name, runner in llama.items():
                    speeds[name].append(runner.answer(ids, args.max_tokens)[1])
            med = {name: statistics.median(v) for name, v in speeds.items()}
            runs.append(dict(prompt=len(ids), answer=len(on.ids), taken=on.accepted_tokens,
                             drafted=on.drafted_tokens, passes=len(passes) + 1, med=med,
                             ratio=statistics.median(paired)))
            if task.grounded:
                grounded_passes += passes
                grounded_tokens += len(on.ids) - 1
            print(f"  {task.name}: {len(ids)} prompt tokens, {len(on.ids)} generated, "
                  f"{on.accepted_tokens}/{on.drafted_tokens} drafts taken, on / off "
                  f"{runs[-1]['ratio']:.2f}x, " + ", ".join(f"{n} {v:.1f}" for n, v in med.items())
                  + " tok/s", flush=True)
        rows.append((task, runs))

    print("\nEach task's speeds and ratios are geometric means over its prompts; a prompt's "
          "on / off is the median of its reps' paired ratios.")
    print("\n| task | prompts | prompt tokens | answer tokens | drafts taken | tokens / pass | "
          "Kestrel on | off | on / off |" + (" llama.cpp | + lookup | on / lookup |" if llama else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if llama else ""))
    ratios = {"grounded": [], "open": [], "vs_lookup": []}
    for task, runs in rows:
        r = geomean([x["ratio"] for x in runs])
        med = {n: geomean([x["med"][n] for x in runs]) for n in runs[0]["med"]}
        ratios["grounded" if task.grounded else "open"].append(r)
        per_pass = sum(x["answer"] for x in runs) / sum(x["passes"] for x in runs)
        line = (f"| {task.name} | {len(runs)} | {'/'.join(str(x['prompt']) for x in runs)} | "
                f"{sum(x['answer'] for x in runs)} | {sum(x['taken'] for x in runs)} / "
                f"{sum(x['drafted'] for x in runs)} | {per_pass:.2f} | {med['on']:.1f} | "
                f"{med['off']:.1f} | {r:.2f}x |")
        if llama:
            vs = geomean([x["med"]["on"] / x["med"]["lookup"] for x in runs])
            if task.grounded:
                ratios["vs_lookup"].append(vs)
            line += f" {med['plain']:.1f} | {med['lookup']:.1f} | {vs:.2f}x |"
        print(line)
    print(f"\ngeometric mean, grounded tasks: on / off {geomean(ratios['grounded']):.2f}x"
          + (f", on / llama.cpp lookup {geomean(ratios['vs_lookup']):.2f}x" if llama else "")
          + f"; open chat: on / off {geomean(ratios['open']):.2f}x")

    shapes = [("smollm2", path)] + [(s, shaped_path(cache, *s.split(":"))) for s in
                                    filter(None, args.shapes.split(","))]
    print("\n| model | one token (ms) | k=2 | k=4 | k=8 | k=16 | projected at SmolLM2's passes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, p in shapes:
        curve = k_cost(p, args.threads)
        proj = projected(curve, grounded_passes, grounded_tokens)
        print(f"| {name} | {curve['one_ms']:.1f} | " + " | ".join(f"{curve[k]:.2f}" for k in (2, 4, 8, 16))
              + f" | {proj:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
