"""EventLog on mongomock and Notifier against a real HTTP server on 127.0.0.1."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from testflinger_magic import db as dbmod
from testflinger_magic.events import EventLog, Notifier
from testflinger_magic.webhooks import AllowList

LOCAL = AllowList.parse(["127.0.0.1"])


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def hook_server():
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(500 if self.path == "/broken" else 204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_record_and_list_since_and_limit():
    clock = Clock()
    log = EventLog(dbmod.connect(), clock)
    log.ensure_indexes()
    for i in range(5):
        clock.t = 1000.0 + i
        log.record("lease.claimed", f"event {i}", queue="q", device="d", lease_id="lease-1", data={"i": i})
    assert [e["message"] for e in log.list()] == [f"event {i}" for i in range(5)]
    assert [e["data"]["i"] for e in log.list(since=1002.0)] == [3, 4]
    assert [e["data"]["i"] for e in log.list(limit=2)] == [3, 4]
    assert [e["data"]["i"] for e in log.list(since=999, limit=2)] == [0, 1]
    first = log.list()[0]
    assert first["kind"] == "lease.claimed" and first["device"] == "d" and isinstance(first["_id"], str)


def test_notifier_posts_json_and_survives_failures(hook_server, caplog):
    base, received = hook_server
    urls = {"q": [base + "/broken", "http://127.0.0.1:1/refused", base + "/ok"]}
    # The receiver is on 127.0.0.1: allowed explicitly, as a lab's internal chat server would be.
    notifier = Notifier(lambda q: urls.get(q, []), timeout=2, allow=LOCAL)
    log = EventLog(dbmod.connect(), Clock(42.0), notifier=notifier)
    event = log.record("lease.draining", "q: draining", queue="q", device="gpu-1", lease_id="lease-x")
    log.record("device.quarantined", "no queue: not sent")
    log.record("lease.active", "other queue without hooks", queue="other")
    assert notifier.flush(10)
    notifier.close()
    paths = [p for p, _ in received]
    assert paths == ["/broken", "/ok"]
    assert received[1][1] == {"kind": "lease.draining", "message": "q: draining", "queue": "q",
                              "device": "gpu-1", "lease_id": "lease-x", "at": event["at"]}
    assert any("HTTP 500" in r.message for r in caplog.records)
    assert any("refused" in r.message for r in caplog.records)


def test_notifier_survives_a_failing_url_lookup(hook_server):
    base, received = hook_server

    def urls(queue):
        if queue == "bad":
            raise RuntimeError("definition store down")
        return [base + "/ok"]

    notifier = Notifier(urls, timeout=2, allow=LOCAL)
    notifier.notify({"kind": "k", "message": "m", "queue": "bad", "at": 1.0})
    notifier.notify({"kind": "k", "message": "m2", "queue": "good", "at": 2.0})
    assert notifier.flush(10)
    notifier.close()
    assert [b["message"] for _, b in received] == ["m2"]


def test_events_expire_through_a_ttl_index_and_the_api_never_shows_the_date():
    """magic_events would grow for ever: each event carries a BSON date RETENTION seconds after
    it, indexed with expireAfterSeconds=0 (real MongoDB deletes it then), and list() hides it."""
    import time

    from testflinger_magic import db as dbmod
    from testflinger_magic.events import RETENTION, EventLog

    database = dbmod.connect()
    log = EventLog(database, clock=lambda: 1_000_000.0)
    log.ensure_indexes()
    log.record("lease.claimed", "lent gpu-1")
    stored = database.magic_events.find_one({})
    assert stored["expire_at"].timestamp() == pytest.approx(time.time() + RETENTION, abs=60)
    ttl = [i for i in database.magic_events.index_information().values()
           if i.get("expireAfterSeconds") == 0]
    assert ttl and ttl[0]["key"] == [("expire_at", 1)]
    assert all("expire_at" not in e for e in log.list()) and log.list()[0]["kind"] == "lease.claimed"
