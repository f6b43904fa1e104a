"""One private asyncio event loop on a daemon thread, for libraries that need a current loop.

python-libmaas' functions are wrapped by ``maas.client.utils.maas_async.asynchronous``, which
calls ``asyncio.get_event_loop()`` and fails in any thread without a loop ("There is no current
event loop"): ``maas_libmaas.LibMaasDriver`` runs all its libmaas work as coroutines on one
``LoopThread``; callers from any thread submit to it and block on the result.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout


class LoopClosed(RuntimeError):
    """The loop was closed (:meth:`LoopThread.close`) before or while a call ran."""


def _finish(loop: asyncio.AbstractEventLoop) -> None:
    """After ``run_forever`` returned: cancel the tasks still pending and let them unwind, then
    the async generators (asyncio's own shutdown steps, as ``asyncio.run`` does them), so no
    coroutine is left suspended for the garbage collector to close ("coroutine ignored
    GeneratorExit" from a python-libmaas call in flight when the loop stopped)."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


class LoopThread:
    """One private asyncio event loop on a daemon thread; ``run(coro)`` from any thread."""

    def __init__(self, name: str):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def main():
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    try:
                        loop.run_forever()
                        _finish(loop)
                    finally:
                        loop.close()

                threading.Thread(target=main, name=self._name, daemon=True).start()
                ready.wait()
                self._loop = loop
            return self._loop

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop and return its result (re-raising its exception). Raises
        ``concurrent.futures.TimeoutError`` after ``timeout`` seconds (the call is cancelled),
        and :class:`LoopClosed` when :meth:`close` stopped the loop before or while it ran
        (``coro`` is then closed or cancelled, never left pending)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._ensure())
        except RuntimeError as exc:  # the loop closed between _ensure and the scheduling
            coro.close()  # never started: no "coroutine ... was never awaited"
            raise LoopClosed(f"{self._name}: event loop closed: {exc}") from None
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise
        except FutureCancelled:  # cancelled by close()'s shutdown, not by this caller
            raise LoopClosed(f"{self._name}: event loop closed while the call ran") from None

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)  # the loop thread then closes it
