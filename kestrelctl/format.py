"""Text for people: the status table (`status`), the model sheet (`show`), and the one-line
statistics of a completion (`generate --stats`, the chat footer)."""
from __future__ import annotations

from typing import Optional

from .client import Result

# The status map's keys that `show` reports (besides `model`): the KV arena.
SHOW_KEYS = ("max_seq", "kv_bs", "kv_dtype", "kv_bytes_per_token_layer", "kv_arena_bytes")


def human_bytes(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as the daemon's log)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    """134515008 -> '134.5M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def weight_shares(types: dict) -> str:
    """{"q8_0": 0.9999, "f32": 0.0001} -> 'q8_0 99.99%, f32 0.01%'."""
    return ", ".join(f"{kind} {share * 100:.4g}%" for kind, share in types.items())


def _table(rows) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _experts_copied(by_type) -> str:
    """', MoE experts copied 1.2 GB' when the daemon has copied any (status
    `experts_copied_bytes`), else ''."""
    total = sum((by_type or {}).values())
    return f", MoE experts copied {human_bytes(total)}" if total else ""


def _speculation(sp: Optional[dict]) -> str:
    """The speculation row: on or off, and how many drafted tokens were chosen."""
    if not sp or not sp.get("enabled"):
        return "off"
    rate = f" ({sp['accepted'] / sp['drafted']:.0%})" if sp["drafted"] else ""
    return f"on, {sp['accepted']} of {sp['drafted']} drafted tokens accepted{rate}"


def format_status(s: dict) -> str:
    """The status map as a readable table (`kestrelctl status`)."""
    m, p = s["model"], s["prefix"]
    up = int(s["uptime_s"])
    rows = [
        ("daemon", f"kestreld {s['version']} (protocol {s['protocol']}), pid {s['pid']}, "
                   f"up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s"),
        ("model", f"{m['name']} ({m['arch']}, {m['n_layers']} layers, "
                  f"{m['n_params'] / 1e6:.0f}M params, weights {m['weights']})"),
        ("path", m["path"]),
        ("kv arena", f"max_seq {s['max_seq']}, kv_bs {s['kv_bs']}, {s['kv_dtype']}, "
                     f"{s['kv_bytes_per_token_layer']} B/token/layer, "
                     f"{s['kv_arena_bytes'] / 1e6:.1f} MB"),
        ("cache", f"{s['cache_len']} tokens valid"),
        ("prefix", f"{'on' if p['enabled'] else 'off'}, min {p['min_match']}, hits {p['hits']}, "
                   f"misses {p['misses']}, {p['tokens_reused']} tokens reused"),
        ("speculation", _speculation(s.get("speculation"))),
        ("requests", f"busy {'yes' if s['busy'] else 'no'}, active {s['active']}, "
                     f"queued {s['queued']}, total {s['total_requests']}"),
        ("memory", f"rss {s['rss_mb']:.0f} MB, available {s['mem_avail_mb']:.0f} MB"
                   + _experts_copied(s.get("experts_copied_bytes"))),
        ("threads", str(s["threads"])),
    ]
    tiers = []
    m = s.get("kv_memory") or {}
    if m.get("enabled"):
        tiers.append(("kv store", f"memory: {m['entries']} entries, {m['bytes'] / 1e6:.1f} of "
                                  f"{m['max_bytes'] / 1e6:.1f} MB, hits {m['hits']}, "
                                  f"misses {m['misses']}, evictions {m['evictions']}"))
    d = s.get("disk_kv") or {}
    if d.get("enabled"):
        tiers.append(("disk kv", f"{d['files']} files, {d['bytes'] / 1e6:.1f} MB, "
                                 f"hits {d['hits']}, misses {d['misses']}"))
    rows[6:6] = tiers
    return _table(rows)


def show_map(s: dict) -> dict:
    """What `show --json` prints: the status map's `model` and its KV arena keys."""
    return {"model": s["model"], **{k: s[k] for k in SHOW_KEYS}}


def format_show(s: dict) -> str:
    """The loaded model as a sheet (`kestrelctl show`), from a status map."""
    m = s["model"]
    held = "" if m["source_dtype"] == m["weights"] else f" (converted from {m['source_dtype']})"
    size = "" if m["file_bytes"] is None else f", {human_bytes(m['file_bytes'])}"
    return _table([
        ("name", m["name"]),
        ("architecture", m["arch"]),
        ("parameters", human_count(m["n_params"])),
        ("layers", str(m["n_layers"])),
        ("context", f"{m['context_length']} tokens trained; the KV arena holds {s['max_seq']} "
                    "(max_seq)"),
        ("weight types", weight_shares(m["weight_types"]) + held),
        ("chat template", m["chat_template_source"]),
        ("vision", "yes (images with /image or --image)" if m["vision"] else "no"),
        ("file", m["path"] + size),
        ("kv arena", f"{human_bytes(s['kv_arena_bytes'])}: {s['max_seq']} tokens x "
                     f"{m['n_layers']} layers x {s['kv_bytes_per_token_layer']} B "
                     f"({s['kv_dtype']})"),
    ])


def stats_line(r: Result) -> str:
    """Every count and timing of a completion on one line (`generate --stats`)."""
    u, t = r.usage, r.timings
    return (f"prompt {u['prompt_tokens']} tokens (cached {u['cached_tokens']}), prefill "
            f"{u['prefill_tokens']} in {t['prefill_ms']:.0f} ms ({t['prefill_tok_s']:.1f} tok/s), "
            f"{u['completion_tokens']} tokens in {t['decode_ms']:.0f} ms "
            f"({t['decode_tok_s']:.1f} tok/s), ttft {t['ttft_ms']:.0f} ms, "
            f"queue {t['queue_ms']:.0f} ms, finish {r.finish_reason}")


def footer(r: Result) -> str:
    """A chat turn's footer: prompt and cached tokens, time to first token, decode speed."""
    u, t = r.usage, r.timings
    source = f" from {u['cached_source']}" if u.get("cached_source") else ""
    images = f", {u['images']} image(s)" if u.get("images") else ""
    return (f"prompt {u['prompt_tokens']} tokens (cached {u['cached_tokens']}{source}){images}, "
            f"ttft {t['ttft_ms']:.0f} ms, {u['completion_tokens']} tokens at "
            f"{t['decode_tok_s']:.1f} tok/s")
