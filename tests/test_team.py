"""The forward pass's team of threads (pyx/ks_team.h) and how it behaves beside other work.

Any thread takes any work item, and a thread the kernel has descheduled rejoins late; the
results must not change by a bit. More threads than cores (here: up to 5 on this machine's
cores), and spinning processes beside them, make descheduled and late threads the normal
case, so every pass below goes through those paths many times. (Under qemu, as arm64, an
earlier team whose late threads could count items of a phase the others had left hung here
with every thread asleep.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest

from kestreld.engine.generate import Engine
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from kestreld.service.main import CoreSharing, sharing_line
from modelgen import prompt_ids
import modelgen_moe

pytestmark = pytest.mark.arm64

SPIN = "while True: pass"


@contextmanager
def spinning(n: int):
    """n busy processes, each in a session of its own (as unrelated services are)."""
    procs = [subprocess.Popen(["setsid", sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _run(loaded, ids, threads: int, chunk: int):
    """(every token's logits, the KV arena's bytes, 12 greedy ids after ids)."""
    e = Engine(loaded, max_seq=len(ids) + 32, threads=threads, prefill_chunk=chunk)
    e.kv.truncate(0)
    logits = e.forward_logits(ids, 0)
    n = e.kv.cache_len
    kv = [a[:, :, :n].tobytes() for a in (e.kv.k_q, e.kv.v_q, e.kv.k_s, e.kv.v_s)]
    e.kv.truncate(0)
    gen = e.generate(ids, SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)).ids
    assert 1 <= e.forward.working_threads <= threads
    return logits, kv, gen


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("moe")
    return str(modelgen_moe.generate("qwen3moe_norm", root, ("q8_0",), hf=False).gguf["q8_0"])


@pytest.mark.parametrize("model", ["qwen3_untied", "qwen3moe_norm"])
def test_same_bits_whatever_the_threads_and_their_schedule(zoo, moe_path, model):
    """Each run loads the model afresh, so that its own threads make the MoE experts' copies
    (where the CPU has them), racing for the groups they share."""
    dense = model == "qwen3_untied"
    path = str(zoo.get(model).gguf["q8_0"]) if dense else moe_path
    ids = (prompt_ids if dense else modelgen_moe.prompt_ids)(model, 90, seed=11)
    want_logits, want_kv, want_gen = _run(load_model(path, interleave=False), ids, 1, 256)
    runs = [(threads, chunk, busy) for threads in (2, 3, 5) for chunk in (256, 16)
            for busy in (0, 2)]
    for threads, chunk, busy in runs:
        with spinning(busy):
            logits, kv, gen = _run(load_model(path), ids, threads, chunk)
        label = f"threads {threads}, chunk {chunk}, {busy} busy"
        if chunk == 256:      # chunking changes attention's float rounding only (test_forward)
            np.testing.assert_array_equal(logits, want_logits, err_msg=label)
            assert kv == want_kv, label
        assert gen == want_gen, label


def _team_threads() -> int:
    """This process's threads named as the team's workers name themselves."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                n += f.read().strip() == "kestrel-forward"
        except (FileNotFoundError, ProcessLookupError):   # a thread (of anything) that just
            pass                                          # ended (qemu-user says ESRCH)
    return n


def _until(predicate, timeout: float = 5.0) -> bool:
    """Waits briefly for predicate: a thread names itself once it runs, and leaves /proc a
    moment after it ends."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_teams_start_and_stop_their_threads(zoo):
    loaded = load_model(str(zoo.get("qwen3_untied").gguf["q8_0"]))
    before = _team_threads()
    engine = Engine(loaded, max_seq=64, threads=4)
    assert engine.forward.working_threads == 0            # no pass yet
    assert _until(lambda: _team_threads() == before + 3), _team_threads()
    engine.generate([1, 2, 3], SamplingOptions(max_tokens=2, ignore_eos=True))
    del engine
    for _ in range(20):
        Engine(loaded, max_seq=64, threads=3).generate([4, 5], SamplingOptions(max_tokens=2))
    # joined, but under qemu-user a joined thread's host thread can outlive the join briefly
    assert _until(lambda: _team_threads() == before), _team_threads()


def test_sharing_line_names_the_cores_and_the_load():
    assert sharing_line([0, 1], 0.2, 2) is None
    line = sharing_line([4, 5, 6, 7], 1.3, 4)
    assert line.startswith("cores 4,5,6,7 are shared: other processes kept 1.3 of 4 busy")
    assert "4 threads" in line


def test_core_sharing_sees_a_busy_process_and_not_our_own_work():
    quiet = CoreSharing()
    np.linalg.eigvals(np.random.default_rng(0).random((300, 300)))   # our own CPU time
    with spinning(1):
        busy = CoreSharing()
        time.sleep(0.5)
        others = busy.others()
    # the spinner holds one core; other tests' processes may add more, never less
    assert others >= 0.6, others
    assert quiet.others() <= len(quiet.cpus)
