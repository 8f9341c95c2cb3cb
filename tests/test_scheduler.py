"""kestreld.service.scheduler with a scripted stand-in engine: FIFO order, queue bound, cancel,
dropped connections, shutdown, failures, and the events that reach the loop thread."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kestreld.engine.generate import Completion, TokenEvent
from kestreld.engine.prompt import TextInput
from kestreld.engine.sampler import SamplingOptions
from kestreld.errors import BadRequest
from kestreld.service.scheduler import Done, Failed, Job, Progress, Scheduler, Token


class ScriptedEngine:
    """Emits one token per step; `gate` holds each step until the test opens it."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.started = []                 # the prompt text of each run, in order
        self.loop_thread = None
        self.worker_threads = set()
        self.fail_with = None
        self.store_gate = threading.Event()   # store_kv waits on it (opened by default)
        self.store_gate.set()
        self.stored = []                      # the engine's run count at each store_kv

    def store_kv(self):
        self.worker_threads.add(threading.get_ident())
        self.store_gate.wait(10)
        self.stored.append(len(self.started))

    def run(self, request, opts, on_token=None, on_progress=None, should_stop=None):
        self.worker_threads.add(threading.get_ident())
        self.started.append(request.text)
        if self.fail_with is not None:
            raise self.fail_with
        out, finish = [], "length"
        for i in range(opts.max_tokens):
            self.gate.wait(10)
            if should_stop():
                finish = "cancelled"
                break
            out.append(i)
            on_token(TokenEvent([i], f"t{i}"))
        return Completion(text="".join(f"t{i}" for i in out), ids=out, finish_reason=finish,
                          prompt_tokens=len(request.text), cached_tokens=0, cached_source=None,
                          prefill_tokens=len(request.text), completion_tokens=len(out),
                          prefill_ms=1.0, decode_ms=2.0, ttft_ms=1.0)


def make_job(conn, msgid, events, max_tokens=3, stream=True, prompt="abc"):
    def on_event(ev):
        events.append((threading.get_ident(), msgid, ev))
    return Job(conn_id=conn, msgid=msgid, request=TextInput(text=prompt),
               options=SamplingOptions(max_tokens=max_tokens), stream=stream, on_event=on_event)


async def until(predicate, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def finals(events):
    return {m: ev for _, m, ev in events if isinstance(ev, (Done, Failed))}


def run(scenario, max_queue=1):
    async def main():
        engine = ScriptedEngine()
        sched = Scheduler(engine, asyncio.get_running_loop(), max_queue=max_queue)
        sched.start()
        try:
            await scenario(engine, sched)
        finally:
            engine.gate.set()
            sched.close()
            sched.join(5)
    asyncio.run(main())


def test_fifo_events_on_loop_thread_and_stream_flag():
    async def scenario(engine, sched):
        events = []
        loop_thread = threading.get_ident()
        engine.gate.clear()
        sched.submit(make_job(1, 10, events, prompt="a"))
        await until(lambda: sched.stats()["busy"])
        sched.submit(make_job(1, 11, events, prompt="bb", stream=False))
        sched.submit(make_job(2, 12, events, prompt="ccc"))
        assert sched.stats() == {"busy": True, "active": 1, "queued": 2, "total_requests": 3}
        engine.gate.set()
        await until(lambda: len(finals(events)) == 3)
        assert engine.started == ["a", "bb", "ccc"]                 # FIFO
        assert {t for t, _, _ in events} == {loop_thread}       # delivered on the loop thread
        assert loop_thread not in engine.worker_threads
        tokens = {m: [ev.event.text for _, mm, ev in events if mm == m and isinstance(ev, Token)]
                  for m in (10, 11)}
        assert tokens == {10: ["t0", "t1", "t2"], 11: []}      # stream=False: no token events
        progress = {m: [ev for _, mm, ev in events if mm == m and isinstance(ev, Progress)]
                    for m in (10, 11, 12)}
        assert progress == {10: [], 11: [Progress("queued", 0, 1)],
                            12: [Progress("queued", 0, 2), Progress("queued", 1, 2)]}
        done = finals(events)[11]
        assert isinstance(done, Done) and done.completion.text == "t0t1t2"
        assert done.queue_ms > 0 and done.ttft_ms >= done.queue_ms
        await until(lambda: not sched.stats()["busy"])
    run(scenario, max_queue=2)


def test_the_kv_store_copies_after_the_answer_is_out():
    """store_kv runs on the worker after each job (failed ones too), once its answer is
    posted: a client has its answer while the copy still runs; the next job waits for it."""
    async def scenario(engine, sched):
        events = []
        engine.store_gate.clear()
        sched.submit(make_job(1, 1, events))
        await until(lambda: 1 in finals(events))              # answered; the copy is blocked
        assert engine.stored == [] and not sched.stats()["busy"]
        sched.submit(make_job(1, 2, events))
        await asyncio.sleep(0.05)
        assert engine.started == ["abc"]                      # job 2 waits for the copy
        engine.store_gate.set()
        await until(lambda: 2 in finals(events))
        engine.fail_with = ValueError("a bug")
        sched.submit(make_job(1, 3, events))
        await until(lambda: engine.stored == [1, 2, 3])
        assert finals(events)[3].error.code == "internal"
    run(scenario)


def test_queue_full_cancel_queued_and_running():
    async def scenario(engine, sched):
        events = []
        engine.gate.clear()
        sched.submit(make_job(1, 1, events))
        await until(lambda: sched.stats()["busy"])
        sched.submit(make_job(1, 2, events))
        with pytest.raises(Exception) as e:
            sched.submit(make_job(2, 3, events))
        assert e.value.code == "queue_full" and "max-queue 1" in str(e.value)
        assert sched.cancel(1, 2) is True and sched.cancel(1, 99) is False
        assert sched.cancel(2, 1) is False                     # another connection's request
        await until(lambda: 2 in finals(events))
        assert finals(events)[2].error.code == "cancelled"
        assert sched.cancel(1, 1) is True
        engine.gate.set()
        await until(lambda: 1 in finals(events))
        assert finals(events)[1].completion.finish_reason == "cancelled"
        assert len(engine.started) == 1                        # the queued one never ran
    run(scenario)


def test_dropped_connection_forgets_queued_and_stops_running():
    async def scenario(engine, sched):
        events = []
        engine.gate.clear()
        sched.submit(make_job(1, 1, events, max_tokens=1000))
        await until(lambda: sched.stats()["busy"])
        sched.submit(make_job(1, 2, events))
        sched.drop_connection(1)
        assert sched.stats()["queued"] == 0
        engine.gate.set()
        await until(lambda: 1 in finals(events))
        assert finals(events)[1].completion.finish_reason == "cancelled"
        assert finals(events)[1].completion.completion_tokens < 1000
        await asyncio.sleep(0.05)
        assert 2 not in finals(events) and len(engine.started) == 1
    run(scenario)


def test_close_answers_queued_shutting_down_and_lets_running_finish():
    async def scenario(engine, sched):
        events = []
        engine.gate.clear()
        sched.submit(make_job(1, 1, events))
        await until(lambda: sched.stats()["busy"])
        sched.submit(make_job(1, 2, events))
        sched.close()
        with pytest.raises(Exception) as e:
            sched.submit(make_job(1, 3, events))
        assert e.value.code == "shutting_down"
        await until(lambda: 2 in finals(events))
        assert finals(events)[2].error.code == "shutting_down"
        assert sched.wait_idle(0.05) is False
        engine.gate.set()
        assert await asyncio.get_running_loop().run_in_executor(None, sched.wait_idle, 5) is True
        await until(lambda: 1 in finals(events))
        assert finals(events)[1].completion.finish_reason == "length"
    run(scenario)


def test_engine_errors_become_failures_and_the_worker_survives():
    async def scenario(engine, sched):
        events = []
        engine.fail_with = BadRequest("no such thing")
        sched.submit(make_job(1, 1, events))
        await until(lambda: 1 in finals(events))
        assert finals(events)[1].error.code == "bad_request"
        engine.fail_with = ZeroDivisionError("bug")
        sched.submit(make_job(1, 2, events))
        await until(lambda: 2 in finals(events))
        err = finals(events)[2].error
        assert err.code == "internal" and "ZeroDivisionError" in str(err)
        engine.fail_with = None
        sched.submit(make_job(1, 3, events))
        await until(lambda: 3 in finals(events))
        assert isinstance(finals(events)[3], Done)
    run(scenario)
