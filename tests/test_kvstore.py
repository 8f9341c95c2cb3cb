"""The KV store (kestreld/engine/kvstore.py): the memory tier's restore == the rows it copied,
deltas, the LRU bound, ids compared; an engine with the store serves the interleaved
pattern with the text of a cold run; and the memory tier then the disk tier.

Store-level tests use the synthetic arena of test_diskkv (rows are a pattern of their ids)."""
import pytest

from kestreld.engine.diskkv import DiskKV
from kestreld.engine.generate import Engine
from kestreld.engine.kvcache import KVCache, KVLayout
from kestreld.engine.kvstore import KVStore, MemoryKV, default_kv_memory
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from modelgen import prompt_ids
from test_diskkv import LAYOUT, assert_rows, fill, ids_of, settle

NAME = "qwen3_untied"
GREEDY = SamplingOptions(max_tokens=8, ignore_eos=True)
ROW = LAYOUT.row_bytes()


def cost(n: int, base: int = 0) -> int:
    """An entry's bytes: its rows and its ids."""
    return ROW * (n - base) + 8 * n


def restored(m: MemoryKV, keys, kv: KVCache) -> int:
    return kv.cache_len if m.restore(keys, kv) else 0


def test_default_budget_is_a_capped_share_of_ram():
    gib = 1 << 30
    assert default_kv_memory(8 * gib, 6 * gib) == gib            # an 8 GB board
    assert default_kv_memory(4 * gib, 3 * gib) == gib // 2
    assert default_kv_memory(64 * gib, 60 * gib) == gib          # capped
    assert default_kv_memory(8 * gib, 300 << 20) == 150 << 20    # half of what is left
    assert default_kv_memory(8 * gib, -5) == 0


def test_restore_gives_back_the_rows_copied_out():
    m = MemoryKV(1 << 20, LAYOUT)
    a, b = ids_of(1, 100), ids_of(2, 80)
    kv = KVCache(LAYOUT)
    fill(kv, a)
    m.save(kv)
    fill(kv, b)                                   # another request overwrote the arena
    m.save(kv)
    kv.truncate(0)
    assert restored(m, a + [7, 8], kv) == 100     # keep = lcp = 100 (< prompt - 1)
    assert_rows(kv, a, 100)
    kv.truncate(0)
    assert restored(m, a[:60], kv) == 59          # at least one token is prefilled
    kv.truncate(0)
    other = a[:20] + ids_of(3, 40)                # ids compared: only the first 20 match
    assert restored(m, other, kv) == 20
    assert_rows(kv, a, 20)
    kv.truncate(0)
    assert restored(m, a[:10] + ids_of(4, 30), kv) == 0          # below prefix_min
    s = m.stats()
    assert (s["entries"], s["hits"], s["misses"], s["bytes"]) == (2, 3, 1, cost(100) + cost(80))
    assert s["max_bytes"] == 1 << 20 and s["tokens"] == 180


def test_only_what_beats_the_arena_is_copied_in():
    m = MemoryKV(1 << 20, LAYOUT)
    a = ids_of(5, 120)
    kv = KVCache(LAYOUT)
    fill(kv, a)
    m.save(kv)
    kv.truncate(50)                               # the arena kept 50 rows by itself
    kv.k_q[:, :, 50:120] = 0                      # (and the rest was overwritten)
    assert restored(m, a + [1], kv) == 120
    assert_rows(kv, a, 120)
    assert m.stats()["bytes_copied_in"] == ROW * 70
    assert not m.restore(a + [1], kv)             # nothing beats 120 rows: no miss counted
    assert m.stats()["misses"] == 0


def test_a_turn_keeps_its_delta_on_its_parent():
    m = MemoryKV(1 << 20, LAYOUT)
    a = ids_of(6, 100)
    turn2 = a + ids_of(7, 30)
    kv = KVCache(LAYOUT)
    fill(kv, a)
    m.save(kv)
    fill(kv, turn2, start=100)
    m.save(kv)
    m.save(kv)                                    # held already: nothing new
    s = m.stats()
    assert s["entries"] == 2 and s["bytes"] == cost(100) + cost(130, 100)
    assert s["bytes_copied_out"] == ROW * 130
    kv.truncate(0)
    fill(kv, ids_of(8, 50))
    kv.truncate(0)
    assert restored(m, turn2 + [3], kv) == 130    # from both links of the chain
    assert_rows(kv, turn2, 130)


def test_a_hundred_conversations_in_a_small_budget():
    budget = 5 * cost(60) + 10
    m = MemoryKV(budget, LAYOUT)
    kv = KVCache(LAYOUT)
    convs = [ids_of(100 + i, 60) for i in range(100)]
    for i, c in enumerate(convs):
        fill(kv, c)
        m.save(kv)
        s = m.stats()
        assert s["bytes"] <= budget and s["entries"] == min(i + 1, 5)
        if i == 50:                               # a used entry is fresh again: it stays
            kv.truncate(0)
            assert restored(m, convs[47] + [1], kv) == 60
    s = m.stats()
    assert s["evictions"] == 95 and s["entries"] == 5
    kv.truncate(0)
    for i in (0, 47, 94):                         # the oldest went
        assert restored(m, convs[i] + [1], kv) == 0
    for i in range(95, 100):                      # the last five stay
        kv.truncate(0)
        assert restored(m, convs[i] + [1], kv) == 60
        assert_rows(kv, convs[i], 60)


def test_too_big_or_too_short_is_not_kept():
    m = MemoryKV(cost(50), LAYOUT)
    kv = KVCache(LAYOUT)
    fill(kv, ids_of(9, 51))
    m.save(kv)                                    # one token over the budget
    fill(kv, ids_of(10, 10))
    m.save(kv)                                    # below prefix_min
    assert (m.stats()["entries"], m.stats()["dropped"]) == (0, 1)
    fill(kv, ids_of(11, 50))
    m.save(kv)
    assert m.stats()["entries"] == 1


def test_a_delta_whose_parent_must_go_is_kept_whole():
    """A budget for one 100-token entry: the next turn cannot sit on its parent, so it is
    taken whole and the parent goes."""
    m = MemoryKV(cost(140), LAYOUT)
    a = ids_of(12, 100)
    kv = KVCache(LAYOUT)
    fill(kv, a)
    m.save(kv)
    fill(kv, a + ids_of(13, 40), start=100)
    m.save(kv)
    s = m.stats()
    assert (s["entries"], s["bytes"], s["evictions"]) == (1, cost(140), 1)
    kv.truncate(0)
    full = a + ids_of(13, 40)
    assert restored(m, full + [1], kv) == 140
    assert_rows(kv, full, 140)


def test_another_layout_is_refused():
    m = MemoryKV(1 << 20, LAYOUT)
    other = KVCache(type(LAYOUT)(LAYOUT.n_layers, LAYOUT.n_kv_heads, LAYOUT.head_dim, 128))
    with pytest.raises(ValueError, match="KV store made for"):
        m.save(other)
    with pytest.raises(ValueError, match="KV store made for"):
        m.restore(ids_of(1, 20), other)


# ---------------------------------------------------------------- engine with the store

@pytest.fixture(scope="module")
def model(zoo):
    return load_model(str(zoo.get(NAME).gguf["q8_0"]))


def engine(model, memory=1 << 30, disk=None, max_seq=512, **kw):
    layout = KVLayout.of(model.config, max_seq)
    store = KVStore(MemoryKV(memory, layout) if memory else None, disk)
    return Engine(model, max_seq=max_seq, threads=1, prefill_chunk=64, store=store, **kw)


def turn(e: Engine, ids):
    c = e.generate(ids, GREEDY)
    e.store_kv()
    return c


def test_interleaved_requests_hit_with_the_text_of_a_cold_run(model):
    e = engine(model)
    cold = engine(model, memory=0, prefix_kv=False)
    conv = prompt_ids(NAME, 150, seed=20)
    c1 = turn(e, conv)
    title, tags = prompt_ids(NAME, 90, seed=21), prompt_ids(NAME, 80, seed=22)
    assert turn(e, title).cached_source is None and turn(e, tags).cached_source is None
    follow = conv + c1.ids + prompt_ids(NAME, 20, seed=23)
    c2 = turn(e, follow)
    assert c2.cached_source == "store" and c2.cached_tokens == len(conv) + len(c1.ids) - 1
    assert c2.prefix_event.endswith("source=store")
    assert c2.ids == cold.generate(follow, GREEDY).ids
    # two conversations alternating: every follow-up a hit
    other = prompt_ids(NAME, 120, seed=24)
    o1 = turn(e, other)
    hist = {"a": follow + c2.ids, "b": other + o1.ids}
    for k in range(2):
        for name in ("a", "b"):
            p = hist[name] + prompt_ids(NAME, 12, seed=30 + k)
            c = turn(e, p)
            assert c.cached_source == "store" and c.cached_tokens == len(hist[name]) - 1
            assert c.ids == cold.generate(p, GREEDY).ids
            hist[name] = p + c.ids
    s = e.stats()["kv_store"]["memory"]
    assert s["hits"] == 5 and s["misses"] == 4          # conv, title, tags, other
    # with the tier off: the follow-up of the interleaved pattern is a miss
    off = engine(model, memory=0)
    turn(off, conv), turn(off, title), turn(off, tags)
    assert turn(off, follow).cached_source is None


def test_entries_are_never_matched_across_models_or_max_seq(model, zoo):
    """Each engine has its own store, made for its model and arena: the same prompt in
    another model's engine, or an arena of another max_seq, finds nothing."""
    ids = prompt_ids(NAME, 100, seed=50)
    e = engine(model)
    c = turn(e, ids)
    again = ids + c.ids + [5]
    llama = engine(load_model(str(zoo.get("llama").gguf["q8_0"])))
    shorter = engine(model, max_seq=256)
    for other in (llama, shorter):
        turn(other, prompt_ids(NAME, 30, seed=51))
        hit = turn(other, again)
        assert hit.cached_source is None and hit.cached_tokens == 0
        with pytest.raises(ValueError, match="KV store made for"):
            other.store.memory.restore(again, e.kv)
    assert turn(e, again).cached_source == "memory"


def test_memory_first_then_disk(model, tmp_path):
    """A short memory tier keeps the newest conversation; the disk the older one."""
    max_seq = 512
    disk = DiskKV.for_model(str(tmp_path), 1 << 30, model, max_seq)
    layout = disk.layout
    one = layout.row_bytes() * 200
    e = Engine(model, max_seq=max_seq, threads=1, prefill_chunk=64,
               store=KVStore(MemoryKV(one, layout), disk))
    a, b = prompt_ids(NAME, 150, seed=40), prompt_ids(NAME, 140, seed=41)
    ca, cb = turn(e, a), turn(e, b)                     # the memory tier now holds b only
    settle(disk)
    ids_a, ids_b = a + ca.ids + [5], b + cb.ids + [5]
    e.generate(prompt_ids(NAME, 30, seed=42), GREEDY)    # the arena holds another prompt
    assert e.generate(ids_b, GREEDY).cached_source == "store"
    e.generate(prompt_ids(NAME, 30, seed=43), GREEDY)
    c = e.generate(ids_a, GREEDY)
    assert c.cached_source == "disk" and c.cached_tokens == len(ids_a) - 2
    e.close()


# ---------------------------------------------------------------- the real daemon

WIND = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")


def logbook(count, n_tokens: int, seed: int) -> str:
    """A harbour logbook of about n_tokens tokens (`count`: the daemon's tokenizer)."""
    lines, i = [], seed * 1000
    while True:
        i += 1
        lines.append(f"Day {i % 365}: station {i % 17} recorded a tide of {i * 37 % 500} cm at "
                     f"{i % 24:02d}:00, wind from the {WIND[i % 8]} at {i * 7 % 40} knots.")
        if len(lines) % 10 == 0 and count("\n".join(lines)) >= n_tokens:
            return "\n".join(lines)


def task(kind: str, question: str, answer: str) -> list:
    """An Open WebUI-style background request about a chat: its title or its tags."""
    return [{"role": "user", "content": f"### Task:\nGenerate {kind} for the chat below.\n"
             f"### Chat History:\n<chat_history>\nUSER: {question[-300:]}\n"
             f"ASSISTANT: {answer}\n</chat_history>"}]


def interleaved(kc, book_a: str, book_b: str) -> list:
    """A ~1,400-token conversation, its title and tags requests, its follow-up; then two
    conversations alternating. Returns each follow-up's result."""
    opts = dict(max_tokens=12, temperature=0)
    q = f"{book_a}\n\nWhich station saw the highest tide?"
    a = [{"role": "user", "content": q}]
    r = kc.chat(messages=a, **opts)
    kc.chat(messages=task("a title", q, r.text), **opts)
    kc.chat(messages=task("1-3 tags", q, r.text), **opts)
    a += [{"role": "assistant", "content": r.text},
          {"role": "user", "content": "And the lowest?"}]
    out = [kc.chat(messages=a, **opts)]
    b = [{"role": "user", "content": f"{book_b}\n\nWhen was the wind strongest?"}]
    rb = kc.chat(messages=b, **opts)
    hist = {"a": a + [{"role": "assistant", "content": out[0].text}],
            "b": b + [{"role": "assistant", "content": rb.text}]}
    for k in range(2):
        for name in ("a", "b"):
            msgs = hist[name] + [{"role": "user", "content": f"Say it again, {k + 1}."}]
            out.append(kc.chat(messages=msgs, **opts))
            hist[name] = msgs + [{"role": "assistant", "content": out[-1].text}]
    return out


def test_the_daemon_keeps_recent_conversations(tmp_path):
    from daemon import Daemon
    import httpx
    from test_http import metrics
    size = ("--max-seq", "2048")
    with Daemon(tmp_path / "k.sock", *size, "--http", "127.0.0.1:0") as d:
        with d.client() as kc:
            count = lambda text: len(kc.tokenize(text))                        # noqa: E731
            book_a, book_b = logbook(count, 1300, 1), logbook(count, 1000, 2)
            hits = interleaved(kc, book_a, book_b)
            st = kc.status()
        with httpx.Client(base_url=d.http_url) as http:
            m = metrics(http)
        log = d.log()
        d.stop()
        d.start()                                   # a restart: the memory tier is gone
        with d.client() as kc:
            after = kc.chat(messages=[{"role": "user", "content":
                                       f"{book_a}\n\nWhich station saw the highest tide?"}],
                            max_tokens=4, temperature=0)
            st_after = kc.status()["kv_memory"]
    with Daemon(tmp_path / "c.sock", *size, "--kv-memory", "0") as cold:
        with cold.client() as kc:
            misses = interleaved(kc, book_a, book_b)
            off = kc.status()["kv_memory"]
    assert [h.text for h in hits] == [c.text for c in misses]           # the same answers
    for h, c in zip(hits, misses):
        u = h.usage
        assert u["cached_source"] == "store", u
        assert u["cached_tokens"] >= 0.9 * u["prompt_tokens"], u
        assert c.usage["cached_tokens"] < 0.1 * c.usage["prompt_tokens"], c.usage   # tier off
    assert hits[0].usage["prompt_tokens"] > 1400
    mem = st["kv_memory"]
    assert mem["enabled"] and mem["hits"] == len(hits) and 0 < mem["bytes"] <= mem["max_bytes"]
    assert mem["entries"] >= 3 and st["disk_kv"] == {"enabled": False}
    assert "source=store" in log and "[KV-STORE] hit keep=" in log
    tier = frozenset({("tier", "memory")})
    assert m[("kestrel_kv_store_hits_total", tier)] == len(hits)
    # (the last answer's rows may have been copied out between status and the scrape)
    assert mem["bytes"] <= m[("kestrel_kv_store_bytes", tier)] <= mem["max_bytes"]
    assert m[("kestrel_kv_store_max_bytes", tier)] == mem["max_bytes"]
    assert ("kestrel_kv_store_hits_total", frozenset({("tier", "disk")})) not in m
    assert after.usage["cached_tokens"] == 0 and after.usage["cached_source"] is None
    assert (st_after["hits"], st_after["misses"]) == (0, 1)
    assert off == {"enabled": False}
