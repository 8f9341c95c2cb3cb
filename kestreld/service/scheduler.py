"""The scheduler: a bounded FIFO of generation jobs and the one worker thread that owns
the engine.

Thread-safety rules:
- `submit`, `cancel`, `drop_connection`, `close`, `cancel_running` are called on the
  event-loop thread; `stats` from any thread; `wait_idle` and `join` block, so the loop
  calls them through an executor.
- Only the worker thread calls the engine's `run` (which builds the prompt, images
  included, and generates) and `store_kv` (which keeps the arena's new rows in the KV
  store, after the answer was posted: off the request's critical path). Shared state
  (the queue, the running job, counters) is guarded by `_lock`.
- A job's events are delivered on the loop thread: the worker posts them with
  `loop.call_soon_threadsafe(job.on_event, event)`; `on_event` never runs on the worker.
- A job is stopped through its `stop` event, which the engine polls (`should_stop`)
  between prefill chunks and after every token.
- Every job that was queued ends exactly once in `on_finish(job, final event)` (metrics),
  on the worker thread or the loop thread: Done, or Failed (an error, a cancel, a drop, the
  shutdown).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..engine.generate import Completion, TokenEvent
from ..engine.prompt import Request
from ..engine.sampler import SamplingOptions
from ..errors import Cancelled, KestrelError, QueueFull, ShuttingDown, internal

log = logging.getLogger("kestreld.service.scheduler")

PROGRESS_INTERVAL_S = 0.25     # prefill progress at most 4 times a second


# ---------------------------------------------------------------- events (worker -> loop)

@dataclass
class Token:
    event: TokenEvent


@dataclass
class Progress:
    phase: str                 # "queued" | "prefill"
    done: int
    total: int


@dataclass
class Done:
    completion: Completion
    queue_ms: float
    ttft_ms: float             # from arrival to the first token


@dataclass
class Failed:
    error: KestrelError


Event = Union[Token, Progress, Done, Failed]


@dataclass(eq=False)
class Job:
    """One generate/chat request on its way through the queue and the engine."""
    conn_id: int
    msgid: int
    request: Request
    options: SamplingOptions
    stream: bool                               # post a Token event per piece of text
    on_event: Callable[[Event], None]          # runs on the loop thread
    transport: str = "rpc"                     # "rpc" | "http" (metrics, log)
    endpoint: str = ""                         # the RPC method or the HTTP path (metrics)
    received: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    ahead: int = 0                             # jobs before this one when it was queued


def request_log_line(job: Job, c: Completion, queue_ms: float) -> str:
    """The one log line of a finished request (counts and times, never prompt text)."""
    decode_s = c.decode_ms / 1000.0
    rate = c.completion_tokens / decode_s if decode_s > 0 else 0.0
    return (f"request conn={job.conn_id} msgid={job.msgid} prompt={c.prompt_tokens} "
            f"cached={c.cached_tokens} prefill={c.prefill_tokens} completion={c.completion_tokens} "
            f"queue={queue_ms:.0f}ms prefill={c.prefill_ms:.0f}ms decode={c.decode_ms:.0f}ms "
            f"ttft={c.ttft_ms:.0f}ms {rate:.1f} tok/s finish={c.finish_reason}")


class Scheduler:
    """FIFO of at most `max_queue` waiting jobs in front of one engine worker thread."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, max_queue: int,
                 on_finish: Optional[Callable[[Job, Event], None]] = None):
        self._engine = engine
        self._loop = loop
        self._max_queue = max_queue
        self._on_finish = on_finish
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[Job] = collections.deque()
        self._running: Optional[Job] = None
        self._closed = False
        self._total = 0
        self._thread = threading.Thread(target=self._work, name="kestrel-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ loop-thread API

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull or ShuttingDown at once instead of waiting."""
        with self._lock:
            if self._closed:
                raise ShuttingDown("the daemon is shutting down")
            if len(self._queue) >= self._max_queue:
                raise QueueFull(f"queue full: {len(self._queue)} requests waiting "
                                f"(max-queue {self._max_queue}); try again later")
            job.ahead = len(self._queue) + (self._running is not None)
            self._queue.append(job)
            self._total += 1
            self._wake.notify()
        if job.ahead:
            self._post(job, Progress("queued", 0, job.ahead))

    def cancel(self, conn_id: int, msgid: int) -> bool:
        """Cancel a job of this connection: a queued one is answered `cancelled` now, the
        running one stops within a token and answers with finish_reason "cancelled"."""
        with self._lock:
            if self._running is not None and (self._running.conn_id, self._running.msgid) == (conn_id, msgid):
                self._running.stop.set()
                return True
            job = next((j for j in self._queue if (j.conn_id, j.msgid) == (conn_id, msgid)), None)
            if job is None:
                return False
            self._queue.remove(job)
        self._finish(job, Failed(Cancelled(f"request {msgid} cancelled before it started")))
        return True

    def drop_connection(self, conn_id: int) -> None:
        """The connection is gone: forget its queued jobs, stop its running one."""
        with self._lock:
            dropped = [j for j in self._queue if j.conn_id == conn_id]
            self._queue = collections.deque(j for j in self._queue if j.conn_id != conn_id)
            if self._running is not None and self._running.conn_id == conn_id:
                self._running.stop.set()
        self._dropped(dropped)

    def withdraw(self, job: Job) -> None:
        """Its client is gone (an HTTP request whose connection closed): forget the job if
        it is queued, stop it if it runs (within one prefill chunk or one token)."""
        with self._lock:
            if self._running is job:
                job.stop.set()
                return
            if job not in self._queue:
                return                 # already finished
            self._queue.remove(job)
        self._dropped([job])

    def _dropped(self, jobs: list) -> None:
        """Jobs forgotten while queued: nobody waits for their answer, but they count."""
        for job in jobs:
            self._count(job, Failed(Cancelled("the client went away while it was queued")))

    def close(self) -> None:
        """Refuse new jobs and answer every queued one `shutting_down`; the worker exits
        after the running job."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            self._wake.notify()
        for job in queued:
            self._finish(job, Failed(ShuttingDown("the daemon is shutting down")))

    def cancel_running(self) -> None:
        with self._lock:
            if self._running is not None:
                self._running.stop.set()

    # ------------------------------------------------------------ any thread

    def stats(self) -> dict:
        with self._lock:
            busy = self._running is not None
            return {"busy": busy, "active": int(busy), "queued": len(self._queue),
                    "total_requests": self._total}

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job runs or waits (True), or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._running is not None or self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return True

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    # ------------------------------------------------------------ worker thread

    def _post(self, job: Job, event: Event) -> None:
        self._loop.call_soon_threadsafe(job.on_event, event)

    def _finish(self, job: Job, final: Union[Done, Failed]) -> None:
        """Count a job's end, then post its answer."""
        self._count(job, final)
        self._post(job, final)

    def _count(self, job: Job, final: Union[Done, Failed]) -> None:
        if self._on_finish is not None:
            try:
                self._on_finish(job, final)
            except Exception:          # metrics must never lose an answer
                log.exception("on_finish failed for conn=%d msgid=%d", job.conn_id, job.msgid)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return            # closed and drained
                job = self._running = self._queue.popleft()
                waiting = list(self._queue)
            for i, j in enumerate(waiting):   # a request ahead has moved on: i + 1 are ahead now
                self._post(j, Progress("queued", max(0, j.ahead - i - 1), j.ahead))
            final = None
            try:
                final = self._run(job)
            finally:
                with self._lock:
                    self._running = None
                    self._wake.notify_all()
            # the answer goes out only once the job no longer counts as running, so a
            # client that has its answer never sees `busy` for it in status
            if final is not None:
                self._finish(job, final)
            self._store_kv()

    def _store_kv(self) -> None:
        """Between jobs: the KV store copies out what the last one left in the arena. A
        request queued meanwhile waits for this copy only (memory speed)."""
        try:
            self._engine.store_kv()
        except Exception:              # the store is a cache: a bug there loses no answer
            log.exception("the KV store could not keep the last request's KV")

    def _run(self, job: Job) -> Union[Done, Failed]:
        """Run one job on the engine; returns its final event (posted by the caller)."""
        start = time.monotonic()
        queue_ms = (start - job.received) * 1000.0
        first_token: list = []
        last_progress = [start]

        def on_token(ev: TokenEvent) -> None:
            if not first_token:
                first_token.append(time.monotonic())
            if job.stream:
                self._post(job, Token(ev))

        def on_progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last_progress[0] >= PROGRESS_INTERVAL_S and done < total:
                last_progress[0] = now
                self._post(job, Progress("prefill", done, total))

        try:
            c = self._engine.run(job.request, job.options, on_token=on_token,
                                 on_progress=on_progress, should_stop=job.stop.is_set)
        except KestrelError as e:
            log.info("request conn=%d msgid=%d failed: %s: %s", job.conn_id, job.msgid, e.code, e)
            return Failed(e)
        except Exception as e:   # an engine bug must not kill the worker or the daemon
            log.exception("request conn=%d msgid=%d: internal error", job.conn_id, job.msgid)
            return Failed(internal(e))
        ttft_ms = ((first_token[0] if first_token else time.monotonic()) - job.received) * 1000.0
        log.info(request_log_line(job, c, queue_ms))
        if c.prefix_event:
            log.info(c.prefix_event)
        return Done(c, queue_ms, ttft_ms)
