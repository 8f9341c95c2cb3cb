"""The disk KV cache (kestreld/engine/diskkv.py): restore == recompute, crash safety,
foreign and corrupt files, the size cap, symlinks; and one restart of the real daemon.

Store-level tests use a small synthetic arena whose rows are a pattern of their token ids,
so a restored row can be checked byte for byte without a model."""
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kestreld.engine.diskkv import HEADER_SIZE, DiskKV, Header, file_size, model_identity
from kestreld.engine.generate import Engine
from kestreld.engine.kvcache import KVCache, KVLayout
from kestreld.engine.kvstore import KVStore
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from kestreld.errors import StartupError
from modelgen import prompt_ids

NAME = "qwen3_untied"
GREEDY = SamplingOptions(max_tokens=8, ignore_eos=True)
LAYOUT = KVLayout(n_layers=2, n_kv_heads=2, head_dim=32, max_seq=256)
FP = bytes(range(32))                    # a fingerprint for the synthetic store


# ---------------------------------------------------------------- helpers

def fill(kv: KVCache, ids, start: int = 0) -> None:
    """Rows [start, len(ids)) := a pattern of their ids, as if a forward pass had run them
    after the cache's first `start` rows."""
    t = np.asarray(ids[start:], dtype=np.int64)
    rows = slice(start, len(ids))
    kv.truncate(start)
    kv.k_q[:, :, rows] = (t % 127)[None, None, :, None]
    kv.v_q[:, :, rows] = (-(t % 113))[None, None, :, None]
    kv.k_s[:, :, rows] = (t * 0.5)[None, None, :]
    kv.v_s[:, :, rows] = (t * 0.25 + 1)[None, None, :]
    kv.append(ids[start:])


def assert_rows(kv: KVCache, ids, n: int) -> None:
    """Rows [0, n) hold the pattern of ids[:n] exactly, and their keys are ids[:n]."""
    ref = KVCache(kv.layout)
    fill(ref, ids[:n])
    assert kv.keys[:n] == tuple(ids[:n])
    for got, want in ((kv.k_q, ref.k_q), (kv.v_q, ref.v_q), (kv.k_s, ref.k_s), (kv.v_s, ref.v_s)):
        np.testing.assert_array_equal(got[:, :, :n], want[:, :, :n])


def arena(layout: KVLayout = LAYOUT) -> KVCache:
    return KVCache(layout)


def restored(s: DiskKV, keys, kv: KVCache) -> int:
    """The cache's valid rows after a restore from the disk; 0 if nothing was restored."""
    return kv.cache_len if s.restore(keys, kv) else 0


def store(path, max_bytes: int = 1 << 30, fp: bytes = FP, layout: KVLayout = LAYOUT) -> DiskKV:
    return DiskKV(str(path), max_bytes, fp, layout, prefix_min=16)


def settle(s: DiskKV, timeout: float = 30) -> dict:
    """Wait until the writer has written everything queued; the stats then."""
    deadline = time.monotonic() + timeout
    while s.stats()["queued"]:
        assert time.monotonic() < deadline, "the disk KV writer did not finish"
        time.sleep(0.01)
    time.sleep(0.01)          # the writer's log line and counters follow the index update
    return s.stats()


def snapshot_files(path) -> list:
    return sorted(p for p in Path(path).iterdir() if p.name.endswith(".kv"))


def ids_of(seed: int, n: int) -> list:
    return [int(i) for i in np.random.default_rng(seed).integers(0, 50_000, n)]


# ---------------------------------------------------------------- engine: restore == recompute

@pytest.fixture(scope="module")
def model(zoo):
    return load_model(str(zoo.get(NAME).gguf["q8_0"]))


def engine(model, disk_dir=None, max_seq=512, **kw):
    """An engine whose KV store has the disk tier only (in DIR), or no tier."""
    disk = DiskKV.for_model(str(disk_dir), 1 << 30, model, max_seq) if disk_dir else None
    return Engine(model, max_seq=max_seq, threads=1, prefill_chunk=64, store=KVStore(None, disk),
                  **kw)


def turn(e: Engine, ids):
    """A request as the scheduler runs it: generate, then (the answer sent) store the KV."""
    c = e.generate(ids, GREEDY)
    e.store_kv()
    return c


def test_restore_after_restart_equals_recompute(model, tmp_path):
    first = prompt_ids(NAME, 90, seed=1)
    e1 = engine(model, tmp_path)
    c1 = turn(e1, first)
    assert c1.cached_source is None
    turn2 = first + c1.ids + prompt_ids(NAME, 30, seed=2)
    c2 = turn(e1, turn2)                               # a memory hit: only a delta is saved
    assert c2.cached_source == "memory"
    e1.close()
    full, delta = sorted(snapshot_files(tmp_path), key=lambda p: -p.stat().st_size)
    assert delta.stat().st_size < full.stat().st_size / 2
    valid = turn2 + c2.ids[:-1]                        # the last sampled id has no KV

    e2 = engine(model, tmp_path)                       # "after a restart": a fresh arena
    turn3 = turn2 + c2.ids + prompt_ids(NAME, 20, seed=3)
    c3 = turn(e2, turn3)
    assert c3.cached_source == "disk"
    assert c3.cached_tokens == len(valid) and c3.prefill_tokens == len(turn3) - len(valid)
    for a, b in zip((e1.kv.k_q, e1.kv.v_q, e1.kv.k_s, e1.kv.v_s),
                    (e2.kv.k_q, e2.kv.v_q, e2.kv.k_s, e2.kv.v_s)):
        np.testing.assert_array_equal(a[:, :, :len(valid)], b[:, :, :len(valid)])
    fresh = engine(model, prefix_kv=False).generate(turn3, GREEDY)
    assert fresh.cached_tokens == 0 and c3.ids == fresh.ids
    settle(e2.store.disk)                              # turn 3's delta is written in the background
    s = e2.store.disk.stats()
    assert (s["hits"], s["misses"], s["files"]) == (1, 0, 3)
    assert s["bytes_read"] == full.stat().st_size + delta.stat().st_size
    e2.close()


def test_disk_serves_a_conversation_the_arena_lost(model, tmp_path):
    a = prompt_ids(NAME, 60, seed=4)
    b = prompt_ids(NAME, 70, seed=5)
    e = engine(model, tmp_path)
    ca = turn(e, a)
    settle(e.store.disk)
    turn(e, b)                                         # overwrites the arena: a is a miss in memory
    again = a + ca.ids + prompt_ids(NAME, 10, seed=6)
    c = turn(e, again)
    assert c.prefix_event.startswith("[KV-PREFIX] hit") and c.prefix_event.endswith("source=disk")
    assert c.cached_source == "disk" and c.cached_tokens == len(a) + len(ca.ids) - 1
    assert c.ids == engine(model, prefix_kv=False).generate(again, GREEDY).ids
    e.close()


# ---------------------------------------------------------------- format and safety

def test_rows_are_copied_before_the_next_request_overwrites_them(tmp_path):
    s, ar = store(tmp_path), arena()
    ids = ids_of(1, 100)
    fill(ar, ids)
    s.save(ar)
    fill(ar, ids_of(2, 100))                           # the next request, at once
    settle(s)
    fresh = arena()
    assert restored(s, ids + [7], fresh) == 100
    assert_rows(fresh, ids, 100)
    s.close()


def test_disk_extends_a_short_memory_hit(tmp_path):
    """Memory kept 20 tokens (say a shared system prompt): only rows [20, 100) are read."""
    s, ar = store(tmp_path), arena()
    ids = ids_of(7, 100)
    fill(ar, ids)
    s.save(ar)
    settle(s)
    out = arena()
    out.k_q[:, :, :20] = 99                             # memory's own rows, marked
    out.append(ids[:20])
    assert restored(s, ids + [5], out) == 100
    assert (out.k_q[:, :, :20] == 99).all()
    fill(ar, ids)
    np.testing.assert_array_equal(out.k_q[:, :, 20:100], ar.k_q[:, :, 20:100])
    assert s.stats()["misses"] == 0 and s.stats()["hits"] == 1
    s.close()


def test_a_delta_whose_parent_is_gone_is_removed(tmp_path, caplog):
    s, ar = store(tmp_path), arena()
    ids = ids_of(8, 100)
    fill(ar, ids[:60])
    s.save(ar)
    settle(s)
    parent = snapshot_files(tmp_path)[0]
    fill(ar, ids, 60)
    s.save(ar)                                          # rows [60, 100) only
    s.close()
    delta = [p for p in snapshot_files(tmp_path) if p != parent][0]
    assert delta.stat().st_size == file_size(LAYOUT, 100, 60)
    parent.unlink()
    with caplog.at_level(logging.WARNING, "kestreld.diskkv"):
        s = store(tmp_path)
    assert "parent is gone" in caplog.text and not delta.exists() and s.stats()["files"] == 0
    s.close()


def test_killed_mid_write_leaves_no_torn_snapshot(tmp_path):
    """A real process writing large snapshots in a loop is killed with SIGKILL while a temp
    file is open; the next start removes the temp file and every snapshot it keeps verifies."""
    big = KVLayout(n_layers=4, n_kv_heads=4, head_dim=128, max_seq=4096)   # 17 MB a snapshot
    child = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}
        from test_diskkv import DiskKV, KVLayout, arena, fill, ids_of, FP
        layout = KVLayout(4, 4, 128, 4096)
        s, ar = DiskKV(sys.argv[1], 1 << 40, FP, layout), arena(layout)
        for seed in range(1000):
            ids = ids_of(seed, 4000)
            fill(ar, ids)
            s.save(ar)
            while s.stats()["queued"]:
                time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (snapshot_files(tmp_path) and list(tmp_path.glob("*.tmp"))):
            assert proc.poll() is None and time.monotonic() < deadline, "no write seen"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.glob("*.tmp")), "the kill did not land during a write"
    # A torn file under a final name too, as a non-atomic writer would leave it.
    whole = snapshot_files(tmp_path)[0]
    torn = tmp_path / ("kv-" + "ab" * 16 + ".kv")
    torn.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])

    s = store(tmp_path, 1 << 40, layout=big)
    assert not list(tmp_path.glob("*.tmp")) and not torn.exists()
    kept = s.stats()
    assert kept["files"] >= 1 and kept["rejected"] == 1
    for seed in range(kept["files"] + 1):               # every seed written so far
        ids = ids_of(seed, 4000)
        ar = arena(big)
        got = restored(s, ids + [1], ar)
        if got:
            assert got == 4000
            assert_rows(ar, ids, got)
    assert s.stats()["hits"] == kept["files"] and s.stats()["rejected"] == 1
    s.close()


def test_other_model_or_layout_is_ignored(model, zoo, tmp_path):
    ids = prompt_ids(NAME, 50, seed=7)
    e = engine(model, tmp_path)
    turn(e, ids)
    e.close()
    llama = load_model(str(zoo.get("llama").gguf["q8_0"]))
    for n_before, make in ((1, lambda: engine(model, tmp_path, max_seq=256)),   # another layout
                           (2, lambda: engine(llama, tmp_path))):                # another model
        other = make()
        s = other.store.disk.stats()
        assert (s["files"], s["foreign_files"]) == (0, n_before)
        c = turn(other, ids[:40] + [1, 2, 3])
        assert c.cached_source is None and c.cached_tokens == 0
        other.close()
    assert len(snapshot_files(tmp_path)) == 3              # ignored, not deleted


def test_model_identity_follows_the_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(1000))
    a = model_identity(str(f))
    os.utime(f, ns=(1, 1))
    b = model_identity(str(f))
    f.write_bytes(b"GGUF" + bytes(999) + b"x")
    os.utime(f, ns=(1, 1))
    assert len({a, b, model_identity(str(f))}) == 3


def test_corrupt_payload_byte_is_detected_and_skipped(tmp_path, caplog):
    s, ar = store(tmp_path), arena()
    ids = ids_of(3, 80)
    fill(ar, ids)
    s.save(ar)
    s.close()
    f = snapshot_files(tmp_path)[0]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01                                     # the last scale of v
    f.write_bytes(bytes(raw))
    s = store(tmp_path)                                 # header and ids are fine: indexed
    assert s.stats()["files"] == 1
    with caplog.at_level(logging.WARNING, "kestreld.diskkv"):
        assert restored(s, ids, arena()) == 0
    assert "payload checksum mismatch" in caplog.text
    assert not f.exists() and s.stats()["rejected"] == 1 and s.stats()["files"] == 0
    s.close()


def test_ids_are_compared_not_only_checksummed(tmp_path, caplog):
    """A file rewritten after indexing with other ids (valid checksums) is not used."""
    import zlib
    s, ar = store(tmp_path), arena()
    ids = ids_of(4, 80)
    fill(ar, ids)
    s.save(ar)
    settle(s)
    f = snapshot_files(tmp_path)[0]
    raw = bytearray(f.read_bytes())
    h = Header.parse(bytes(raw[:HEADER_SIZE]))
    other = np.array(ids[:40] + ids_of(5, 40), dtype="<i8").tobytes()
    raw[HEADER_SIZE:HEADER_SIZE + len(other)] = other
    raw[:HEADER_SIZE] = Header(h.fingerprint, h.n_tokens, h.base, h.parent, h.layout,
                               h.payload_bytes, zlib.crc32(other), h.payload_crc).pack()
    f.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, "kestreld.diskkv"):
        assert restored(s, ids, arena()) == 0
    assert "token ids differ" in caplog.text
    s.close()


def test_size_cap_evicts_least_recently_used(tmp_path):
    one = file_size(LAYOUT, 100, 0)
    s, ar = store(tmp_path, max_bytes=int(2.5 * one)), arena()
    a, b, c = ids_of(10, 100), ids_of(11, 100), ids_of(12, 100)
    for ids in (a, b):
        fill(ar, ids)
        s.save(ar)
        settle(s)
    assert restored(s, a + [1], arena()) == 100           # a is now more recent than b
    fill(ar, c)
    s.save(ar)
    st = settle(s)
    assert st["files"] == 2 and st["evictions"] == 1 and st["bytes"] == 2 * one <= st["max_bytes"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 2 * one
    s.close()
    s = store(tmp_path, max_bytes=int(2.5 * one))      # the LRU order survives a restart
    assert restored(s, b + [1], arena()) == 0
    for ids in (a, c):
        out = arena()
        assert restored(s, ids + [1], out) == 100
        assert_rows(out, ids, 100)
    s.close()


def test_symlinks_are_not_followed(tmp_path, caplog):
    d, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    s, ar = store(d), arena()
    ids = ids_of(6, 100)
    fill(ar, ids)
    s.save(ar)
    s.close()
    real = snapshot_files(d)[0]
    moved = outside / real.name
    real.rename(moved)                                  # a valid snapshot, but outside DIR
    (d / ("kv-" + "cd" * 16 + ".kv")).symlink_to(moved)
    (d / ("kv-" + "ef" * 16 + ".tmp")).symlink_to(outside / "precious")
    (outside / "precious").write_text("keep me")
    with caplog.at_level(logging.WARNING, "kestreld.diskkv"):
        s = store(d)
    assert "a symlink, not followed" in caplog.text
    assert s.stats()["files"] == 0 and restored(s, ids + [1], arena()) == 0
    assert not (d / ("kv-" + "ef" * 16 + ".tmp")).exists()       # the link removed, not its target
    assert moved.exists() and (outside / "precious").read_text() == "keep me"
    s.close()


def test_one_daemon_per_directory(tmp_path):
    s = store(tmp_path)
    with pytest.raises(StartupError, match="in use"):
        store(tmp_path)
    s.close()


# ---------------------------------------------------------------- the real daemon, restarted

def test_daemon_restart_reuses_the_disk_snapshot(tmp_path):
    from daemon import Daemon
    prompt = ("The lighthouse keeper wrote in the log every evening: the wind, the sea, the "
              "ships that passed and the lamp's oil. ") * 12    # past a 256-key segment
    kv = tmp_path / "kv"
    with Daemon(tmp_path / "k.sock", "--disk-kv", str(kv)) as d:
        with d.client() as kc:
            cold = kc.generate(prompt=prompt, max_tokens=6, logprobs=3)
            deadline = time.monotonic() + 30
            while kc.status()["disk_kv"]["files"] < 1:
                assert time.monotonic() < deadline, d.log()
                time.sleep(0.05)
    with Daemon(tmp_path / "k.sock", "--disk-kv", str(kv)) as d:
        with d.client() as kc:
            warm = kc.generate(prompt=prompt, max_tokens=6, logprobs=3)
            st = kc.status()["disk_kv"]
        log = d.log()
    n = cold.usage["prompt_tokens"]
    assert cold.usage["cached_tokens"] == 0
    assert warm.usage["cached_tokens"] == n - 1 and warm.usage["prefill_tokens"] == 1
    assert warm.ids == cold.ids and warm.logprobs == cold.logprobs     # the same bits
    assert f"[KV-DISK] hit keep={n - 1} prompt={n} prefill=1" in log
    assert (st["hits"], st["files"]) == (1, 1) and st["bytes_read"] > 0
