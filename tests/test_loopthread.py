"""The private asyncio loop python-libmaas runs on (agent_host/loopthread.py): a call in flight
when the loop is closed ends at once with LoopClosed, its coroutine unwound (its ``finally``
runs) rather than left suspended for the garbage collector ("coroutine ignored GeneratorExit",
seen in the test suite's warnings summary), and a coroutine that could not be scheduled is
closed, not left "never awaited"."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings

import pytest

from testflinger_magic.agent_host.loopthread import LoopClosed, LoopThread


def test_a_call_in_flight_when_the_loop_closes_ends_at_once_and_unwinds():
    lt = LoopThread("test-loop")
    unwound = threading.Event()
    started = threading.Event()

    async def slow():
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            unwound.set()

    outcome = {}

    def caller():
        t0 = time.monotonic()
        try:
            lt.run(slow(), timeout=30)
        except BaseException as exc:  # noqa: BLE001 - what it raised is the test
            outcome["exc"] = exc
        outcome["took"] = time.monotonic() - t0

    thread = threading.Thread(target=caller)
    thread.start()
    assert started.wait(5)
    lt.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(outcome["exc"], LoopClosed), outcome
    assert outcome["took"] < 5, outcome  # not the call's 30 s timeout
    assert unwound.wait(5)
    # The next call gets a new loop.

    async def answer():
        return 42

    assert lt.run(answer(), timeout=5) == 42
    lt.close()


def test_a_coroutine_that_cannot_be_scheduled_is_closed_not_left_never_awaited(monkeypatch):
    lt = LoopThread("test-loop")
    closed = asyncio.new_event_loop()
    closed.close()
    monkeypatch.setattr(lt, "_ensure", lambda: closed)

    async def never():
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coro = never()
        with pytest.raises(LoopClosed):
            lt.run(coro, timeout=1)
        del coro
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
