"""Event log (``magic_events``) and webhook notifications.

Every decision and every lease change worth a person's attention is recorded as one document
``{_id, at, kind, queue, device, lease_id, message, data}`` (``at`` in epoch seconds). Events of a
queue are also POSTed as JSON to that queue's ``policy.notify`` webhooks, from a background thread,
so a slow or dead chat server never slows the server down or raises into it.
"""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Callable, Iterable

from testflinger_magic import webhooks

#: Longest free-text ``reason`` an operator may give (lend, drain, quarantine, rebind, forget):
#: it is copied into the lease's history and the events, and a MongoDB document is at most
#: 16 MB (https://www.mongodb.com/docs/manual/reference/limits/#mongodb-limit-BSON-Document-Size).
MAX_REASON = 1000

log = logging.getLogger(__name__)

#: Seconds an event is kept (30 days); MongoDB's TTL monitor deletes it after that.
RETENTION = 30 * 86400.0

#: Seconds one webhook POST may take before it is abandoned.
NOTIFY_TIMEOUT = webhooks.DEFAULT_TIMEOUT


class Notifier:
    """Deliver events to webhooks in a background thread.

    ``urls_for_queue(queue_name) -> iterable of URLs`` is asked at delivery time (so a re-applied
    definition takes effect at once). ``notify(event)`` never blocks and never raises. Each URL
    gets one POST through :func:`testflinger_magic.webhooks.post_json`: its resolved addresses
    checked against ``allow`` (a :class:`~testflinger_magic.webhooks.AllowList`; internal
    addresses are refused unless listed), no redirect followed, at most ``timeout`` seconds.
    Failures (refused, connection errors, timeouts, HTTP >= 300) are logged with the URL in its
    redacted form only (``scheme://host/…redacted``: the rest may hold the hook's token).
    Body: JSON ``{kind, message, queue, device, lease_id, at}``.
    """

    def __init__(self, urls_for_queue: Callable[[str], Iterable[str]],
                 timeout: float = NOTIFY_TIMEOUT, allow: webhooks.AllowList | None = None):
        self._urls_for_queue = urls_for_queue
        self._timeout = timeout
        self.allow = allow if allow is not None else webhooks.AllowList()
        self._pending: queue_mod.Queue = queue_mod.Queue()
        self._thread = threading.Thread(target=self._run, name="magic-notifier", daemon=True)
        self._thread.start()

    def notify(self, event: dict) -> None:
        """Queue ``event`` (an event document) for delivery; events without a queue are dropped."""
        if event.get("queue"):
            self._pending.put(event)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event was attempted; True if done within ``timeout`` seconds."""
        done = threading.Event()
        self._pending.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Stop the thread after the queued events were attempted."""
        self._pending.put(None)
        self._thread.join(timeout=self._timeout * 2 + 1)

    def _run(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._deliver(item)

    def _deliver(self, event: dict) -> None:
        body = {k: event.get(k) for k in ("kind", "message", "queue", "device", "lease_id", "at")}
        try:
            urls = list(self._urls_for_queue(event["queue"]) or ())
        except Exception:  # a bad definition lookup must not kill the thread
            log.exception("notify: cannot get webhooks of queue %s", event["queue"])
            return
        for url in urls:
            shown = webhooks.redact(url)
            try:
                status, _ = webhooks.post_json(url, body, self.allow, timeout=self._timeout)
            except webhooks.Refused as exc:
                log.warning("notify refused: %s", exc)
                continue
            except Exception as exc:  # noqa: BLE001 - OSError, HTTPException, TLS...; never raise
                # The exception text names at most the host (socket, TLS and http.client errors
                # do not carry the path); the URL is shown redacted.
                log.warning("notify %s failed: %s: %s", shown, type(exc).__name__, exc)
                continue
            if 300 <= status < 400:
                log.warning("notify %s: HTTP %s redirect not followed (webhooks must answer "
                            "at their own URL)", shown, status)
            elif status >= 400:
                log.warning("notify %s: HTTP %s", shown, status)


class EventLog:
    """Append-only event log in the ``magic_events`` collection.

    ``db``: a database from :func:`testflinger_magic.db.connect`; ``clock() -> epoch seconds``;
    ``notifier``: optional :class:`Notifier` that also gets every recorded event.
    """

    def __init__(self, db, clock: Callable[[], float] = time.time, notifier: Notifier | None = None):
        self._coll = db["magic_events"]
        self._clock = clock
        self.notifier = notifier

    def ensure_indexes(self) -> None:
        """Index ``at`` (the ``since`` queries) and expire events after :data:`RETENTION` s
        (a TTL index needs a BSON date, hence ``expire_at`` beside the epoch ``at``; Testflinger
        expires its own jobs, logs and agents the same way, TESTFLINGER.md §1.4)."""
        from . import indexes  # noqa: PLC0415 - the table (testflinger_magic.indexes)

        indexes.ensure({"magic_events": self._coll}, ("magic_events",))

    def record(self, kind: str, message: str, queue: str | None = None, device: str | None = None,
               lease_id: str | None = None, data: dict | None = None) -> dict:
        """Store one event and hand it to the notifier; returns the stored document.

        ``kind`` is a short machine word (``lease.claimed``, ``claim.refused``, ...), ``message``
        a sentence for people. ``_id`` is a string so the document is JSON-ready.
        """
        event = {"_id": uuid.uuid4().hex, "at": float(self._clock()), "kind": kind,
                 "message": message, "queue": queue, "device": device, "lease_id": lease_id,
                 "data": dict(data or {})}
        # Wall-clock time, not the injectable clock: retention is about real storage, and a
        # test or simulation clock in the past would have the TTL monitor delete at once.
        expire = datetime.fromtimestamp(time.time() + RETENTION, timezone.utc)
        self._coll.insert_one(dict(event, expire_at=expire))
        log.info("event %s: %s", kind, message)
        if self.notifier is not None:
            self.notifier.notify(dict(event))
        return event

    def list(self, since: float | None = None, limit: int = 100) -> list[dict]:
        """Events oldest first: those with ``at > since`` (the first ``limit``), or with ``since``
        None the latest ``limit``."""
        limit = max(1, int(limit))
        hide = {"expire_at": 0}
        if since is None:
            latest = list(self._coll.find({}, hide, sort=[("at", -1)], limit=limit))
            return latest[::-1]
        return list(self._coll.find({"at": {"$gt": float(since)}}, hide, sort=[("at", 1)],
                                    limit=limit))
