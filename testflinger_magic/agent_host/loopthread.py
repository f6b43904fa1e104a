"""One private asyncio event loop on a daemon thread, for libraries that need a current loop.

python-libmaas' functions are wrapped by ``maas.client.utils.maas_async.asynchronous``, which
calls ``asyncio.get_event_loop()`` and fails in any thread without a loop ("There is no current
event loop"): ``maas_libmaas.LibMaasDriver`` runs all its libmaas work as coroutines on one
``LoopThread``; callers from any thread submit to it and block on the result.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import TimeoutError as FutureTimeout




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
                    finally:
                        loop.close()

                threading.Thread(target=main, name=self._name, daemon=True).start()
                ready.wait()
                self._loop = loop
            return self._loop

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop and return its result (re-raising its exception)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure())
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)  # the loop thread then closes it
