"""An admin abandons a lease its agent host will not finish (TRIAL12 F1: a host whose machine
died, or one that should never have registered): ``POST /v1/magic/leases/<id>/abandon``,
then ``unquarantine`` gives the device back and ``agent-hosts forget`` frees it."""

from __future__ import annotations

import requests

from test_server_api import lend, poll_job, register, submit
from testflinger_magic import leases as L


def abandon(m, lease_id, role="admin", **body):
    return requests.post(f"{m.url}/v1/magic/leases/{lease_id}/abandon", headers=m.headers(role),
                         json={"reason": "host gpu-rack-3 burnt", **body}, timeout=10)


def drain(m, lease_id, grace="0s"):
    r = requests.post(f"{m.url}/v1/magic/leases/{lease_id}/drain", headers=m.headers("admin"),
                      json={"reason": "test", "grace": grace}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _stale(m, host="host-a"):
    """The host's daemon went silent long ago (reconcile.STALE_HOST_AFTER is 120 s)."""
    m.db.magic_agent_hosts.update_one({"_id": host},
                                      {"$set": {"last_heartbeat": m.plugin.clock() - 3600}})


def test_a_restoring_lease_of_a_dead_host_is_abandoned_then_the_device_comes_back(magic):
    assert register(magic).status_code == 200
    lease = lend(magic)
    assert drain(magic, lease["_id"])["state"] == L.RESTORING  # in bring-up: restoring at once
    job = submit(magic, "gpu-hosts")
    # The host heartbeats: its daemon would finish the restore; not without --force.
    r = abandon(magic, lease["_id"])
    assert r.status_code == 409 and "is not stale" in r.json()["message"], r.text
    # A restoring lease cannot be drained; the refusal says what will end it (TRIAL14 F4).
    r = requests.post(f"{magic.url}/v1/magic/leases/{lease['_id']}/drain",
                      headers=magic.headers("admin"), json={"reason": "x"}, timeout=10)
    assert r.status_code == 409 and f"testflinger-magic abandon {lease['_id']}" in \
        r.json()["message"], r.text
    _stale(magic)
    r = abandon(magic, lease["_id"])
    assert r.status_code == 200, r.text
    done = r.json()
    assert "no VM of it was enrolled in MAAS" in done["note"]
    r = abandon(magic, lease["_id"])
    assert r.status_code == 409 and "unquarantine gpu-host-01 releases" in r.json()["message"]
    assert done["state"] == L.FAILED
    assert "unquarantine gpu-host-01" in done["note"]
    assert "abandoned by admin-client: host gpu-rack-3 burnt" in done["history"][-1]["reason"]
    device = magic.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["quarantined"] and lease["_id"] in device["quarantine_reason"]
    assert device["failures"] == 0  # nothing says the device failed
    # Still fenced and claimed until a person looked: no job, and the host cannot be forgotten.
    assert poll_job(magic, "gpu-host-01", ["gpu-hosts"]).status_code == 204
    r = requests.delete(f"{magic.url}/v1/magic/agent-hosts/host-a", headers=magic.headers("admin"),
                        timeout=10)
    assert r.status_code == 409, r.text
    def failed_gauge():
        text = requests.get(f"{magic.url}/v1/magic/metrics", timeout=10).text
        return [line for line in text.splitlines()
                if line.startswith('magic_leases{state="failed"}')]

    assert failed_gauge() == ['magic_leases{state="failed"} 1.0']
    r = requests.delete(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                        headers=magic.headers("admin"), timeout=10)
    assert r.status_code == 200 and r.json()["released_failed_lease"] == lease["_id"], r.text
    # Released: not counted any more (TRIAL19 F6: the gauge counted every failed lease ever).
    assert failed_gauge() == []
    # Offline until its agent posts (TRIAL14 F5: a stopped agent was listed as waiting); its
    # fence is lifted, so a running agent's next poll takes the job.
    agent = magic.db.agents.find_one({"name": "gpu-host-01"})
    assert agent["state"] == "offline" and "until its testflinger-agent posts" in agent["comment"]
    got = poll_job(magic, "gpu-host-01", ["gpu-hosts"])
    assert got.status_code == 200 and got.json()["job_id"] == job
    r = requests.delete(f"{magic.url}/v1/magic/agent-hosts/host-a", headers=magic.headers("admin"),
                        timeout=10)
    assert r.status_code == 200, r.text


def test_a_lease_in_bring_up_of_an_untrusted_host_is_abandoned_with_force(magic):
    """The host heartbeats (an untrusted client keeps it alive): --force."""
    assert register(magic).status_code == 200
    lease = lend(magic)
    r = abandon(magic, lease["_id"], force=True)
    assert r.status_code == 200, r.text
    assert [h["state"] for h in r.json()["history"]][-2:] == [L.RESTORING, L.FAILED]
    # Its late report is refused: the lease moved on.
    r = requests.post(f"{magic.url}/v1/magic/leases/{lease['_id']}/report",
                      headers=magic.headers("agent"),
                      json={"agent_host": "host-a", "generation": lease["generation"],
                            "state": L.CLAIMED, "result": "ok", "to_state": L.FENCED}, timeout=10)
    assert r.status_code == 409, r.text


def test_abandon_refuses_a_lease_jobs_may_run_on_and_callers_other_than_admins(magic):
    assert register(magic).status_code == 200
    lease = lend(magic)
    for role in ("manager", "contributor", "agent"):
        assert abandon(magic, lease["_id"], role=role).status_code == 403
    _stale(magic)
    store = magic.plugin.store
    for to_state in (L.FENCED, L.DEPLOYING, L.SPLITTING, L.ENROLLING, L.ACTIVE):
        lease = store.transition(lease["_id"], lease["state"], lease["generation"], to_state, "t")
    r = abandon(magic, lease["_id"], force=True)
    assert r.status_code == 409 and "drain it first" in r.json()["message"], r.text
    assert magic.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == L.ACTIVE
    r = requests.post(f"{magic.url}/v1/magic/leases/{lease['_id']}/abandon",
                      headers=magic.headers("admin"), json={}, timeout=10)
    assert r.status_code == 422 and "reason" in r.text  # why is required
    assert abandon(magic, "lease-nope").status_code == 404


def test_a_host_cannot_register_another_queues_agent_as_its_device(magic):
    """TRIAL12 F1: a registration naming an agent that serves none of the device's declared
    home queues (another machine's agent, or a typo) is refused and writes nothing."""
    magic.db.agents.insert_one({"name": "victim-agent", "state": "waiting", "job_id": "",
                                "queues": ["victim-q"], "comment": ""})
    device = {"agent_name": "victim-agent", "maas_system_id": "victim1", "gpus": 8,
              "tags": ["nvidia"], "home_queues": ["gpu-hosts"]}
    r = register(magic, host="evil-host", devices=[device])
    assert r.status_code == 409, r.text
    assert "devices.0.home_queues" in r.json()["message"]
    assert "serves ['victim-q']" in r.json()["message"]
    assert magic.db.magic_devices.find_one({"_id": "victim-agent"}) is None
    assert magic.db.magic_agent_hosts.find_one({"_id": "evil-host"}) is None
    # Its own queue among the home queues passes; so does an agent that has not posted yet.
    assert register(magic, host="evil-host", devices=[
        dict(device, home_queues=["victim-q"]),
        dict(device, agent_name="new-agent", maas_system_id="new1")]).status_code == 200


def test_admin_bound_agent_hosts_register_only_once_an_admin_bound_them(monkeypatch):
    """``TESTFLINGER_MAGIC_AGENT_HOSTS=admin-bound``: an agent client cannot make itself a new
    agent host (TRIAL12 F1); once an admin bound the host to it, it registers."""
    import pytest

    from conftest import MAGIC_YAML, mini_testflinger, seed
    from test_server_authz import DEVICES, headers_for
    from testflinger_magic import db as tfdb
    from testflinger_magic import queues
    from testflinger_magic.server import init_app

    monkeypatch.setenv("TESTFLINGER_MAGIC_AGENT_HOSTS", "admin-bound")
    db = tfdb.connect()
    seed(db)
    app = mini_testflinger(db)
    plugin = init_app(app, db, definitions=queues.load_text(MAGIC_YAML), start_ticker=False)
    key, c = app.config["JWT_SIGNING_KEY"], app.test_client()
    r = c.post("/v1/magic/agent-hosts/host-a", headers=headers_for("agent", key),
               json={"devices": DEVICES})
    assert r.status_code == 403, r.get_data(as_text=True)
    assert "agent-hosts rebind host-a host-a-client" in r.get_json()["message"]
    assert db.magic_agent_hosts.find_one({"_id": "host-a"}) is None
    assert db.magic_devices.count_documents({}) == 0
    r = c.put("/v1/magic/agent-hosts/host-a/binding", headers=headers_for("admin", key),
              json={"client_id": "host-a-client", "force": True})
    assert r.status_code == 200, r.get_data(as_text=True)
    r = c.post("/v1/magic/agent-hosts/host-a", headers=headers_for("agent", key),
               json={"devices": DEVICES})
    assert r.status_code == 200, r.get_data(as_text=True)
    plugin.stop()
    monkeypatch.setenv("TESTFLINGER_MAGIC_AGENT_HOSTS", "admin")
    with pytest.raises(ValueError, match="TESTFLINGER_MAGIC_AGENT_HOSTS: 'admin' is not"):
        init_app(mini_testflinger(db), db, start_ticker=False)
