"""The HTML status page shows what an operator needs: queues, open leases, devices, events."""

from testflinger_magic import db as dbmod
from testflinger_magic.lab.jobservice import create_app
from testflinger_magic.queues import load_text
from testflinger_magic.server.status_page import _age

QUEUES = """
magic_queues:
  one-gpu-vm:
    description: one GPU
    devices: {home_queues: [gpu-hosts]}
    policy: {max_devices: 1, max_starting: 1}
"""


def test_status_page_renders_queue_device_and_lease():
    db = dbmod.connect()
    app = create_app(db, plugin_options={"definitions": load_text(QUEUES), "start_ticker": False})
    plugin = app.extensions["testflinger_magic"]
    db["agents"].insert_one({"name": "gpu-host-01", "state": "waiting", "job_id": "", "queues": ["gpu-hosts"]})
    plugin.engine.register("host-a", [{"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 8,
                                        "tags": [], "home_queues": ["gpu-hosts"]}], "test")
    db["jobs"].insert_one({"job_id": "j1", "job_priority": 0, "created_at": None,
                           "job_data": {"job_queue": "one-gpu-vm", "exclude_agents": []},
                           "result_data": {"job_state": "waiting"}})
    plugin.tick()
    resp = app.test_client().get("/v1/magic/")
    assert resp.status_code == 200
    assert resp.content_type.startswith("text/html")
    page = resp.get_data(as_text=True)
    lease = db["magic_leases"].find_one({})
    assert lease is not None and lease["_id"] in page
    assert "one-gpu-vm" in page and "gpu-host-01" in page and "host-a" in page
    assert 'class="state claimed"' in page


def test_status_page_escapes_untrusted_text():
    db = dbmod.connect()
    app = create_app(db, plugin_options={"start_ticker": False})
    app.extensions["testflinger_magic"].events.record("test", "<script>alert(1)</script>")
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page


def test_age_formats_seconds_minutes_hours():
    assert _age(100, now=142) == "42s"
    assert _age(0, now=10) == "?"
    assert _age(1000, now=1000 + 5 * 60 + 3) == "5m"
    assert _age(1000, now=1000 + 3 * 3600) == "3h"


def test_status_page_shows_a_suspended_queue():
    db = dbmod.connect()
    app = create_app(db, plugin_options={"definitions": load_text(QUEUES), "start_ticker": False})
    db["magic_queues"].update_one({"_id": "one-gpu-vm"},
                                  {"$set": {"suspended": {"reason": "VM spec does not fit"}}})
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    assert "lending suspended: VM spec does not fit" in page
