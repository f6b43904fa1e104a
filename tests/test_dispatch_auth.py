"""Authorization matrix of the routes the plugin hooks: a caller Testflinger would refuse gets
exactly Testflinger's answer (the same app without the plugin answers the same), fenced agent or
not, and the plugin reads nothing and writes nothing for it. A served caller is gated.

Testflinger's rules (canonical/testflinger ``server/src/testflinger/api/auth.py``:
``authenticate``, ``require_role``; ``api/v1.py``: ``job_get`` is ``ServerRoles.AGENT`` only,
``get_agents_on_queue`` admin/manager/contributor, ``job_post`` admin/manager/contributor; without
OIDC no header is an anonymous contributor, with OIDC it is 401), as the lab job service models
them (``create_app(oidc=...)``)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from conftest import MAGIC_YAML, seed
from testflinger_magic import db as tfdb
from testflinger_magic import queues
from testflinger_magic.lab.jobservice import create_app
from testflinger_magic.server import auth

KEY = "test-signing-key-of-32-bytes-or-more!"
FENCED, FREE = "gpu-host-01", "gpu-host-02"


def token(role, ttl=600):
    return {"Authorization": f"Bearer {auth.issue_token(KEY, f'{role}-client', role, ttl=ttl)}"}


#: caller -> headers
CALLERS = {
    "anonymous": {},
    "malformed": {"Authorization": "Bearer not-a-jwt"},
    "not bearer": {"Authorization": "Basic YTpi"},
    "bad signature": {"Authorization": "Bearer " + auth.issue_token("other-key-" * 4, "x",
                                                                   "agent")},
    "expired agent": token("agent", ttl=-3600),
    "contributor": token("contributor"),
    "manager": token("manager"),
    "admin": token("admin"),
    "agent": token("agent"),
}


def snapshot(database):
    """Every document of every collection (the write detector)."""
    return {name: sorted(map(repr, database[name].find({})))
            for name in sorted(database.list_collection_names())}


class Pair:
    """The lab job service with the plugin, and the same service without it, on one database
    holding a waiting job on the devices' queue; ``FENCED`` is a lent (fenced) device."""

    def __init__(self, oidc: bool):
        self.db = tfdb.connect()
        seed(self.db)
        self.magic = create_app(self.db, signing_key=KEY, oidc=oidc, plugin_options={
            "definitions": queues.load_text(MAGIC_YAML), "start_ticker": False})
        self.plain = create_app(self.db, signing_key=KEY, oidc=oidc, mount_plugin=False)
        self.plugin = self.magic.extensions["jobservice"]["plugin"]
        self.plugin.kick = lambda *a, **k: None
        self.plugin.store.gates.sync([FREE])  # a registered device: watched, not fenced
        self.plugin.store.fence_agents("lease-x", [FENCED], kind="device", reason="lent")
        self.db.jobs.insert_one({"job_id": "8d3f4b8e-0000-4000-8000-000000000001",
                                 "created_at": datetime.now(timezone.utc), "job_priority": 0,
                                 "job_data": {"job_queue": "gpu-hosts", "exclude_agents": []},
                                 "result_data": {"job_state": "waiting"}})

    def call(self, app, route, headers, agent):
        client = app.test_client()
        client.set_cookie("agent_name", agent)
        method, path, body = route
        return client.open(path, method=method, headers=headers, json=body)


ROUTES = {
    "GET /v1/job": ("GET", "/v1/job?queue=gpu-hosts", None),
    "GET /v1/queues/<magic>/agents": ("GET", "/v1/queues/one-gpu-vm/agents", None),
    "POST /v1/job (magic queue)": ("POST", "/v1/job", {"job_queue": "one-gpu-vm"}),
}
#: Who Testflinger serves on each hooked route (permissions.json).
SERVED = {
    "GET /v1/job": {"agent"},
    "GET /v1/queues/<magic>/agents": {"contributor", "manager", "admin", "anonymous"},
    "POST /v1/job (magic queue)": {"contributor", "manager", "admin", "anonymous"},
}


REFUSED = [(oidc, route, caller) for oidc in (False, True) for route in sorted(ROUTES)
           for caller in sorted(CALLERS)
           if caller not in SERVED[route] or (oidc and caller == "anonymous")]


@pytest.mark.parametrize("oidc,route,caller", REFUSED)
def test_refused_callers_get_testflingers_answer_and_cost_nothing(oidc, route, caller):
    pair = Pair(oidc)
    want = pair.call(pair.plain, ROUTES[route], CALLERS[caller], FREE)
    assert want.status_code in (401, 403), (route, caller, want.status_code)
    for agent in (FENCED, FREE):
        before = snapshot(pair.db)
        got = pair.call(pair.magic, ROUTES[route], CALLERS[caller], agent)
        assert (got.status_code, got.get_json(silent=True)) == \
            (want.status_code, want.get_json(silent=True)), (route, caller, agent)
        assert snapshot(pair.db) == before, f"{route} by {caller} as {agent} wrote"


def test_oidc_anonymous_poll_is_401_not_204_for_a_fenced_agent():
    pair = Pair(oidc=True)
    r = pair.call(pair.magic, ROUTES["GET /v1/job"], {}, FENCED)
    assert r.status_code == 401
    assert r.get_json()["message"] == "Authentication is required for specified endpoint"


def test_served_agent_is_gated_and_an_empty_poll_writes_nothing():
    pair = Pair(oidc=False)
    before = snapshot(pair.db)
    r = pair.call(pair.magic, ROUTES["GET /v1/job"], CALLERS["agent"], FENCED)
    assert r.status_code == 204 and snapshot(pair.db) == before  # fenced: refused, no write
    r = pair.call(pair.magic, ROUTES["GET /v1/job"], CALLERS["agent"], FREE)
    assert r.status_code == 200  # watched and free: takes the job, one marker written
    assert [m["agent"] for m in pair.db.magic_dispatch.find()] == [FREE]
    before = snapshot(pair.db)
    r = pair.call(pair.magic, ROUTES["GET /v1/job"], CALLERS["agent"], FREE)
    assert r.status_code == 204 and snapshot(pair.db) == before  # empty poll: no write


def test_served_reader_sees_the_magic_preflight():
    pair = Pair(oidc=True)
    r = pair.call(pair.magic, ROUTES["GET /v1/queues/<magic>/agents"], CALLERS["contributor"],
                  FREE)
    # No device registered: the plugin's answer (Testflinger's would be a bare 404 too, but
    # without the reason).
    assert r.status_code == 404 and "no agent host has registered" in r.get_json()["message"]
