"""Serve a WSGI app on 127.0.0.1 from a daemon thread (the lab's HTTP servers).

Used by the lab's job service and MAAS simulator, and by tests that need real HTTP. werkzeug's
threaded ``make_server`` answers each request in its own thread, so a long-polling handler does not
block other clients.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from werkzeug.serving import BaseWSGIServer, make_server

# werkzeug logs every request at INFO on its own logger; the lab's agents poll several times a
# second, which would drown what a person wants to follow. Warnings and errors still show.
if logging.getLogger("werkzeug").level == logging.NOTSET:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)


@dataclass
class ServerHandle:
    """A running server.

    ``url``: ``http://<host>:<port>`` without a trailing slash; ``port``: the bound TCP port (the
    real one when 0 was asked for). ``stop()`` shuts the server down and joins its thread; it is
    idempotent.
    """

    host: str
    port: int
    server: BaseWSGIServer = field(repr=False)
    thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close the socket and wait up to ``timeout`` seconds for the thread."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(timeout)
        self.server.server_close()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(app, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Start serving ``app`` (any WSGI callable) on ``host:port``; port 0 picks a free port.

    Returns once the socket is bound (clients may connect at once). Raises ``OSError`` if the port
    is taken.
    """
    server = make_server(host, port, app, threaded=True)
    # Threads handling requests must not keep the interpreter alive at exit.
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2},
        name=f"httpserve-{server.server_port}", daemon=True,
    )
    thread.start()
    return ServerHandle(host=host, port=server.server_port, server=server, thread=thread)
