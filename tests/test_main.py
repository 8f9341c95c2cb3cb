"""service/main.py: start-up checks, end to end (a real kestreld process)."""
import subprocess
import sys

import psutil
import pytest

from daemon import daemon_env, model_path
from kestreld.errors import InsufficientMemory
from kestreld.service.config import Config
from kestreld.service.main import MemoryCheck, placement_line
from kestreld.model.config import ModelConfig


def test_a_model_that_does_not_fit_is_refused_with_both_numbers():
    """SmolLM2's arena is 30 layers x 408 bytes a token: at 4M tokens it exceeds any memory
    this machine has, and kestreld says so before loading a weight."""
    available = psutil.virtual_memory().available
    max_seq = 4_000_000
    assert 30 * 408 * max_seq > available
    out = subprocess.run([sys.executable, "-m", "kestreld", "--model", model_path(),
                          "--max-seq", str(max_seq), "--prompt", "hi", "--config", "/dev/null"],
                         env=daemon_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "the model needs" in line and "KV arena" in line and "MiB are available" in line
    assert "--no-memory-check" in line and "max-seq 4000000" in line


def test_the_check_counts_weights_and_arena():
    c = ModelConfig(arch="qwen3", name="x", n_layers=28, hidden=2048, n_heads=16, n_kv_heads=8,
                    head_dim=128, ffn=6144, vocab=151936, rope_theta=1e6, norm_eps=1e-6,
                    tied_embeddings=True, qk_norm=True, rope_neox=True, context_length=0)
    arena = 2112 * 28 * 8192                              # the design source's 484 MB
    fits = MemoryCheck(Config(max_seq=8192, kv_memory=0), "m.gguf", available=arena + 1000,
                       total=8 << 30)
    assert fits(c, 1000) is True                          # exactly fits
    with pytest.raises(InsufficientMemory, match="weights 0 MiB \\+ KV arena 462 MiB"):
        fits(c, 1001)
    # --no-memory-check goes on, and says it does not fit (MoE experts then stay in the map)
    unchecked = MemoryCheck(Config(max_seq=8192, memory_check=False, kv_memory=0), "m.gguf",
                            available=0, total=8 << 30)
    assert unchecked(c, 10**12) is False


def test_the_check_counts_the_kv_store_budget():
    c = ModelConfig(arch="qwen3", name="x", n_layers=28, hidden=2048, n_heads=16, n_kv_heads=8,
                    head_dim=128, ffn=6144, vocab=151936, rope_theta=1e6, norm_eps=1e-6,
                    tied_embeddings=True, qk_norm=True, rope_neox=True, context_length=0)
    arena, weights, gib = 2112 * 28 * 8192, 1500 << 20, 1 << 30
    # an explicit budget counts in full: one byte short is refused, and the message says so
    exact = MemoryCheck(Config(kv_memory=gib), "m.gguf", available=weights + arena + gib,
                        total=8 << 30)
    assert exact(c, weights) is True and exact.kv_memory == gib
    with pytest.raises(InsufficientMemory, match="KV store 1,024 MiB"):
        exact(c, weights + 1)
    # by default: 1/8 of an 8 GB board's RAM, capped at 1 GiB ...
    board = MemoryCheck(Config(), "m.gguf", available=6 << 30, total=8 << 30)
    assert board(c, weights) is True and board.kv_memory == gib
    small = MemoryCheck(Config(), "m.gguf", available=6 << 30, total=4 << 30)
    assert small(c, weights) is True and small.kv_memory == 512 << 20
    # ... at most half of what weights and arena leave, so the default never fails a start
    tight = MemoryCheck(Config(), "m.gguf", available=weights + arena + (200 << 20),
                        total=8 << 30)
    assert tight(c, weights) is True and tight.kv_memory == 100 << 20
    # no prefix reuse: no store
    off = MemoryCheck(Config(prefix_kv=False), "m.gguf", available=6 << 30, total=8 << 30)
    assert off(c, weights) is True and off.kv_memory == 0


def test_the_start_up_line_says_where_the_weights_are():
    from types import SimpleNamespace
    def model(copies, experts=False):
        return SimpleNamespace(conversion=None, weights=SimpleNamespace(
            interleaved_bytes=lambda: copies, copies_experts=lambda: experts))
    line = placement_line(model({}))
    assert line == "in place from the file's map"
    line = placement_line(model({"q4_k": 677_117_952, "q6_k": 168_591_360}))
    assert line == ("in place from the file's map; q4_k 677 MB, q6_k 169 MB interleaved "
                    "(--no-interleave keeps them in the map)")
    line = placement_line(model({"q4_k": 47_000_000}, experts=True))
    assert line == ("in place from the file's map; q4_k 47 MB interleaved (--no-interleave "
                    "keeps them in the map); MoE experts interleaved as each is first chosen")
