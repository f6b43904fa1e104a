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
    # TRIAL2 finding 9: its lendable devices are shown as 0, marked, not as a count it lends.
    row = next(line for line in page.splitlines() if "<td>one-gpu-vm</td>" in line)
    assert "<td>0 (suspended)</td>" in row, row


def _lab_app(queues_text=QUEUES):
    db = dbmod.connect()
    app = create_app(db, plugin_options={"definitions": load_text(queues_text),
                                         "start_ticker": False})
    plugin = app.extensions["testflinger_magic"]
    db["agents"].insert_one({"name": "gpu-host-01", "state": "waiting", "job_id": "",
                             "queues": ["gpu-hosts"]})
    plugin.engine.register("host-a", [{"agent_name": "gpu-host-01", "maas_system_id": "abc123",
                                        "gpus": 8, "tags": [], "home_queues": ["gpu-hosts"]}],
                           "test")
    db["jobs"].insert_one({"job_id": "j1", "job_priority": 0, "created_at": None,
                           "job_data": {"job_queue": "one-gpu-vm", "exclude_agents": []},
                           "result_data": {"job_state": "waiting"}})
    return db, app, plugin


def test_status_page_says_why_jobs_wait_with_the_quarantine_reason():
    db, app, plugin = _lab_app()
    plugin.engine.set_quarantine("gpu-host-01", True, "PSU replaced, burn-in pending")
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    assert "no device can be lent: 1 quarantined" in page
    assert "gpu-host-01 quarantined: PSU replaced, burn-in pending" in page


def test_status_page_shows_running_jobs_and_the_grace_deadline():
    db, app, plugin = _lab_app()
    plugin.tick()
    lease = db["magic_leases"].find_one({})
    store = plugin.engine.store
    for state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], state, "test")
    vm = lease["vms"][0]["agent_name"]  # its VM agents are named at the claim
    db["agents"].insert_one({"name": vm, "state": "test", "job_id": "job-123",
                             "queues": ["one-gpu-vm"]})
    plugin.engine.drain_by_hand(lease["_id"], "maintenance", "5m", False)
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    assert f"job-123 on {vm}" in page
    assert "drain: grace until " in page and "(5m left); then running jobs are cancelled" in page


def test_status_page_links_work_without_the_trailing_slash():
    """Testflinger (like the lab's job service) serves /v1/magic as well as /v1/magic/: its
    url_map has strict_slashes off. A relative link would then point at /v1/status."""
    import re

    db = dbmod.connect()
    client = create_app(db, plugin_options={"start_ticker": False}).test_client()
    for path in ("/v1/magic", "/v1/magic/"):
        resp = client.get(path, follow_redirects=True)
        assert resp.status_code == 200
        links = re.findall(r'href="([^"]+)"', resp.get_data(as_text=True))
        assert links == ["/v1/magic/status", "/v1/magic/metrics"]
        for link in links:
            assert client.get(link).status_code == 200


def test_status_page_needs_a_person_for_a_failed_lease_and_a_never_registered_host():
    """TRIAL (2026-12-02) 3 and 23 on the page: a failed lease holding its device is listed
    with what to do; a bound host that never registered "never sent a heartbeat"."""
    db = dbmod.connect()
    app = create_app(db, plugin_options={"definitions": load_text(QUEUES), "start_ticker": False})
    plugin = app.extensions["testflinger_magic"]
    db["agents"].insert_one({"name": "gpu-host-01", "state": "waiting", "job_id": "", "queues": ["gpu-hosts"]})
    plugin.engine.register("host-a", [{"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 8,
                                        "tags": [], "home_queues": ["gpu-hosts"]}], "test")
    lease = plugin.engine.lend_by_hand("gpu-host-01", "one-gpu-vm", "test")
    lease = plugin.engine.report(lease["_id"], {"agent_host": "host-a", "state": "claimed",
                                                "generation": lease["generation"],
                                                "result": "error", "message": "fence: boom"})
    plugin.engine.report(lease["_id"], {"agent_host": "host-a", "state": "restoring",
                                        "generation": lease["generation"], "result": "error",
                                        "message": "restoring: MaasError: still boom"})
    plugin.engine.bindings.rebind("new-host-x", "someone", "new rack", by="op", force=True)
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    assert (f"lease {lease['_id']} on gpu-host-01 (one-gpu-vm) failed " in page
            and "restoring: MaasError: still boom" in page
            and "testflinger-magic unquarantine gpu-host-01</code> releases the lease" in page), page
    assert "agent host new-host-x: never sent a heartbeat (bound, never registered)" in page


def test_status_page_says_a_waiting_jobs_lease_is_still_bringing_up():
    """TRIAL7 (LOW): the page's "why jobs wait" cell was empty while the queue's lease was
    deploying; it now says what ``status``' WHY JOBS WAIT says."""
    db, app, plugin = _lab_app()
    plugin.tick()  # lends gpu-host-01 for the waiting job
    lease = db["magic_leases"].find_one({})
    store = plugin.engine.store
    for state in ("fenced", "deploying"):
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], state, "t")
    page = app.test_client().get("/v1/magic/").get_data(as_text=True)
    row = page[page.index("<td>one-gpu-vm</td>"):page.index("</tr>", page.index("<td>one-gpu-vm</td>"))]
    assert (f'<div class="problem">one-gpu-vm: 1 waiting, lease {lease["_id"]} on gpu-host-01 '
            "still deploying for ") in row, row
