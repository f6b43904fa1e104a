"""Authorization matrix over every ``/v1/magic`` route, as Testflinger's own
``test_all_v1_endpoints_have_permissions_coverage`` does for ``/v1``: each route (from the app's
url_map, so a new route without a row fails) is called by every kind of caller, each on a fresh
plugin, and each answer is asserted.

Callers: no token (Testflinger with OIDC off: an anonymous contributor, TESTFLINGER.md §2), a
forged token (``alg: none``; signed with the wrong key), each role, the agent client bound to
the agent host ``host-a``, and another agent client acting for ``host-a``.

The hooked Testflinger routes (GET /v1/job, GET /v1/queues/<q>/agents, POST /v1/job...) keep
Testflinger's own roles and are covered with the dispatch hooks, not here.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from conftest import MAGIC_YAML, mini_testflinger, seed
from testflinger_magic import db as tfdb
from testflinger_magic import queues
from testflinger_magic.server import auth, init_app

ROLES = ("admin", "manager", "contributor")
CALLERS = ("none", "alg-none", "wrong-key", *ROLES, "agent", "agent-other")
READ = {"none", "admin", "manager", "contributor"}  # no token = anonymous contributor
WRITE = {"admin", "manager"}
DEVICES = [{"agent_name": d, "maas_system_id": d, "gpus": 2, "home_queues": ["gpu-hosts"]}
           for d in ("gpu-host-01", "gpu-host-02")]
REPORT = {"agent_host": "host-a", "generation": 0, "state": "claimed", "result": "ok",
          "to_state": "fenced"}

#: (method, rule) -> (path, body, {caller: status}); callers not listed get ``default``.
#: ``L`` in a path is the open lease of gpu-host-01 (claimed, generation 0).
MATRIX = {
    ("GET", "/v1/magic/"): ("/v1/magic/", None, dict.fromkeys(READ, 200)),
    ("GET", "/v1/magic/queues"): ("/v1/magic/queues", None, dict.fromkeys(READ, 200)),
    ("PUT", "/v1/magic/queues"): ("/v1/magic/queues", {"yaml": MAGIC_YAML},
                                  dict.fromkeys(WRITE, 200)),
    ("GET", "/v1/magic/status"): ("/v1/magic/status", None, dict.fromkeys(READ, 200)),
    ("GET", "/v1/magic/plan"): ("/v1/magic/plan", None, dict.fromkeys(READ, 200)),
    ("GET", "/v1/magic/events"): ("/v1/magic/events", None, dict.fromkeys(READ, 200)),
    ("GET", "/v1/magic/metrics"): ("/v1/magic/metrics", None, dict.fromkeys(CALLERS, 200)),
    ("GET", "/v1/magic/openapi.json"): ("/v1/magic/openapi.json", None,
                                        dict.fromkeys(CALLERS, 200)),
    ("GET", "/v1/magic/leases"): ("/v1/magic/leases", None,
                                  dict.fromkeys(READ | {"agent", "agent-other"}, 200)),
    ("GET", "/v1/magic/leases/<lease_id>"): ("/v1/magic/leases/L", None,
                                             dict.fromkeys(READ | {"agent", "agent-other"}, 200)),
    ("POST", "/v1/magic/leases"): ("/v1/magic/leases",
                                   {"device": "gpu-host-02", "queue": "one-gpu-vm"},
                                   dict.fromkeys(WRITE, 201)),
    # The lease is claimed: an allowed caller's drain undoes the lend at once (restoring).
    ("POST", "/v1/magic/leases/<lease_id>/drain"): ("/v1/magic/leases/L/drain", {},
                                                    dict.fromkeys(WRITE, 200)),
    # Admin only; the claimed lease's host heartbeats, so without force it is 409 for them.
    ("POST", "/v1/magic/leases/<lease_id>/abandon"): (
        "/v1/magic/leases/L/abandon", {"reason": "host died"}, {"admin": 409}),
    ("GET", "/v1/magic/devices"): ("/v1/magic/devices", None,
                                   dict.fromkeys(READ | {"agent", "agent-other"}, 200)),
    ("POST", "/v1/magic/devices/<name>/quarantine"): (
        "/v1/magic/devices/gpu-host-02/quarantine", {"reason": "fan"}, dict.fromkeys(WRITE, 200)),
    ("DELETE", "/v1/magic/devices/<name>/quarantine"): (
        "/v1/magic/devices/gpu-host-02/quarantine", None, dict.fromkeys(WRITE, 200)),
    ("DELETE", "/v1/magic/devices/<name>/nvswitches"): (
        "/v1/magic/devices/gpu-host-02/nvswitches", None, dict.fromkeys(WRITE, 200)),
    # Agent-host protocol: only the client host-a is bound to.
    ("POST", "/v1/magic/agent-hosts/<host>"): ("/v1/magic/agent-hosts/host-a",
                                               {"devices": DEVICES}, {"agent": 200}),
    ("GET", "/v1/magic/agent-hosts/<host>/work"): ("/v1/magic/agent-hosts/host-a/work", None,
                                                   {"agent": 200}),
    ("POST", "/v1/magic/agent-hosts/<host>/heartbeat"): (
        "/v1/magic/agent-hosts/host-a/heartbeat", {"leases": []}, {"agent": 200}),
    ("POST", "/v1/magic/leases/<lease_id>/report"): ("/v1/magic/leases/L/report", REPORT,
                                                     {"agent": 200}),
    # Bindings: admin only. Forgetting host-a is refused while its device is lent.
    ("GET", "/v1/magic/agent-hosts"): ("/v1/magic/agent-hosts", None, dict.fromkeys(READ, 200)),
    ("PUT", "/v1/magic/agent-hosts/<host>/binding"): (
        "/v1/magic/agent-hosts/host-a/binding", {"client_id": "new-client", "force": True},
        {"admin": 200}),
    ("DELETE", "/v1/magic/agent-hosts/<host>"): ("/v1/magic/agent-hosts/host-a", None,
                                                 {"admin": 409}),
}
#: Every authenticated route refuses the callers it does not list with 403 (a bad token is 403
#: too: Testflinger's decode_jwt_token), never 401 (that is for an expired token only).
DEFAULT = 403


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def headers_for(caller: str, key: str) -> dict:
    now = int(time.time())
    claims = {"sub": "access_token", "iat": now, "exp": now + 600,
              "permissions": {"client_id": "admin-client", "role": "admin"}}
    if caller == "none":
        return {}
    if caller == "alg-none":
        token = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."
    elif caller == "wrong-key":
        token = auth.issue_token("not-the-servers-signing-key-32-bytes!", "admin-client", "admin")
    elif caller == "agent":
        token = auth.issue_token(key, "host-a-client", "agent")
    elif caller == "agent-other":
        token = auth.issue_token(key, "other-host-client", "agent")
    else:
        token = auth.issue_token(key, f"{caller}-client", caller)
    return {"Authorization": f"Bearer {token}"}


def fresh():
    """A plugin on a fresh database: host-a registered by client host-a-client with both
    devices, gpu-host-01 lent (lease claimed). Returns (app, lease_id)."""
    db = tfdb.connect()
    seed(db)
    app = mini_testflinger(db)
    plugin = init_app(app, db, definitions=queues.load_text(MAGIC_YAML), start_ticker=False)
    plugin.kick = lambda *a, **k: None
    key = app.config["JWT_SIGNING_KEY"]
    c = app.test_client()
    r = c.post("/v1/magic/agent-hosts/host-a", headers=headers_for("agent", key),
               json={"devices": DEVICES})
    assert r.status_code == 200, r.get_data(as_text=True)
    r = c.post("/v1/magic/leases", headers=headers_for("admin", key),
               json={"device": "gpu-host-01", "queue": "one-gpu-vm"})
    assert r.status_code == 201, r.get_data(as_text=True)
    return app, r.get_json()["_id"]


def magic_routes(app) -> set[tuple[str, str]]:
    return {(method, rule.rule) for rule in app.url_map.iter_rules()
            if rule.rule.startswith("/v1/magic")
            for method in rule.methods - {"HEAD", "OPTIONS"}}


def test_every_magic_route_has_a_row():
    app, _ = fresh()
    routes = magic_routes(app)
    assert routes - set(MATRIX) == set(), "routes without an authorization row"
    assert set(MATRIX) - routes == set(), "rows for routes that no longer exist"


@pytest.mark.parametrize("route", sorted(MATRIX), ids=lambda r: f"{r[0]} {r[1]}")
def test_authorization_matrix(route):
    path, body, allowed = MATRIX[route]
    method = route[0]
    answers = {}
    for caller in CALLERS:
        app, lease_id = fresh()
        headers = headers_for(caller, app.config["JWT_SIGNING_KEY"])
        db = app.extensions["testflinger_magic"].db
        before = {n: list(db[n].find({})) for n in ("magic_agent_hosts", "magic_devices",
                                                    "magic_leases", "magic_queues")}
        r = app.test_client().open(path.replace("/L", f"/{lease_id}"), method=method,
                                   headers=headers, json=body)
        answers[caller] = r.status_code
        if r.status_code in (401, 403):
            after = {n: list(db[n].find({})) for n in before}
            assert after == before, f"{caller}: refused but changed something"
            message = (r.get_json(silent=True) or {}).get("message", "")
            assert message, f"{caller}: a refusal says why"
    expected = {caller: allowed.get(caller, DEFAULT) for caller in CALLERS}
    assert answers == expected


#: (caller of headers_for, or an Authorization header; status; message) as canonical/testflinger
#: ``server/src/testflinger/api/auth.py`` answers on GET /v1/magic/status (the real server's
#: answers are checked against these in test_real_testflinger.py).
REFUSALS = [
    # decode_jwt_token: InvalidTokenError (here InvalidAlgorithmError) -> "Invalid Token", no
    # exception text; a token that is not a JWT at all -> DecodeError.
    ("alg-none", 403, "Invalid Token"),
    ("Bearer nonsense", 403, "Unable to decode token"),
    # `if not auth_token: abort(UNAUTHORIZED, "Unauthorized")`
    ("Bearer ", 401, "Unauthorized"),
    # require_role names the roles only, never the caller's.
    ("agent", 403, "Specified action requires role: admin, manager, contributor"),
    ("Basic dXNlcjpwYXNz", 403, "Specified action requires role: admin, manager, contributor"),
    ("bearer lower-case", 403, "Specified action requires role: admin, manager, contributor"),
]


def refusal_headers(header: str, key: str) -> dict:
    return headers_for(header, key) if header in CALLERS else {"Authorization": header}


@pytest.mark.parametrize("header, status, message", REFUSALS)
def test_fallback_refusals_are_testflingers_words(header, status, message):
    """TRIAL12 F4: the fallback (lab, tests) answers a refused caller with the status and message
    of canonical/testflinger ``server/src/testflinger/api/auth.py`` (``decode_jwt_token``,
    ``require_role``), so the lab rehearses production's answers exactly."""
    app, _ = fresh()
    r = app.test_client().get("/v1/magic/status",
                              headers=refusal_headers(header, app.config["JWT_SIGNING_KEY"]))
    assert (r.status_code, r.get_json()["message"]) == (status, message)

