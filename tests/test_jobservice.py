"""The lab job service over real HTTP: Testflinger's v1 shapes, status codes and role checks."""

from __future__ import annotations

import importlib
import threading
import uuid

import jwt
import pytest
import requests

from testflinger_magic import db as tfdb
from testflinger_magic.lab import httpserve
from testflinger_magic.lab.jobservice import add_client, create_app, percentiles

KEY = "jobservice-test-signing-key-0123456789abcdef"
CLIENTS = {
    "agents": {"secret": "agent-secret-123456", "role": "agent"},
    "alice": {"secret": "alice-secret-123456", "role": "contributor",
              "max_priority": {"q": 50}},
    "boss": {"secret": "boss-secret-1234567", "role": "admin"},
}


@pytest.fixture
def svc():
    database = tfdb.connect()
    app = create_app(database, signing_key=KEY, clients=CLIENTS, mount_plugin=False)
    handle = httpserve.serve(app)
    handle.db = database
    yield handle
    handle.stop()


def token(svc, client_id):
    secret = CLIENTS[client_id]["secret"]
    resp = requests.post(f"{svc.url}/v1/oauth2/token", auth=(client_id, secret), timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def agent_session(svc, name, queues=("q",)):
    """A session like testflinger-agent's: Bearer agent token, cookie from its first post."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token(svc, 'agents')['access_token']}"
    r = s.post(f"{svc.url}/v1/agents/data/{name}",
               json={"state": "waiting", "queues": list(queues)}, timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "OK"}
    assert s.cookies.get("agent_name") == name
    return s


def submit(svc, **job):
    job.setdefault("job_queue", "q")
    r = requests.post(f"{svc.url}/v1/job", json=job, timeout=10)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"job_id"}
    return r.json()["job_id"]


def test_full_job_lifecycle(svc):
    assert requests.get(f"{svc.url}/v1/", timeout=10).status_code == 200
    agent = agent_session(svc, "a1")
    job_id = submit(svc, test_data={"test_cmds": "echo hi"}, provision_data={"distro": "noble"})
    doc = svc.db.jobs.find_one({"job_id": job_id})
    assert doc["result_data"] == {"job_state": "waiting"}
    assert doc["job_priority"] == 0 and doc["job_data"]["exclude_agents"] == []
    assert "created_at" in doc and "started_at" not in doc

    assert requests.get(f"{svc.url}/v1/job/{job_id}/position", timeout=10).text == "0"
    shown = requests.get(f"{svc.url}/v1/job/{job_id}", timeout=10).json()
    assert shown["job_id"] == job_id and shown["job_queue"] == "q"

    r = agent.get(f"{svc.url}/v1/job", params={"queue": ["other", "q"]}, timeout=10)
    assert r.status_code == 200
    job = r.json()
    assert job["job_id"] == job_id and job["test_data"] == {"test_cmds": "echo hi"}
    assert job["started_at"].endswith("Z")
    assert svc.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "running"
    assert requests.get(f"{svc.url}/v1/job/{job_id}/position", timeout=10).status_code == 410
    wait = requests.get(f"{svc.url}/v1/queues/wait_times", timeout=10).json()
    assert set(wait["q"]) == {"5", "10", "50", "90", "95"}

    for n, phase in enumerate(("setup", "provision", "test")):
        assert agent.post(f"{svc.url}/v1/result/{job_id}", json={"job_state": phase},
                          timeout=10).status_code == 200
        assert agent.post(f"{svc.url}/v1/result/{job_id}/log/output", timeout=10, json={
            "fragment_number": n, "timestamp": "2026-01-01T00:00:00+00:00", "phase": phase,
            "log_data": f"{phase} says hi\n"}).status_code == 200
    agent.post(f"{svc.url}/v1/result/{job_id}",
               json={"status": {"setup": 0, "provision": 0, "test": 1}, "job_state": "complete"},
               timeout=10)

    result = requests.get(f"{svc.url}/v1/result/{job_id}", timeout=10).json()
    assert result["job_state"] == "complete"
    assert (result["setup_status"], result["provision_status"], result["test_status"]) == (0, 0, 1)
    assert result["test_output"] == "test says hi\n" and "status" not in result

    log = requests.get(f"{svc.url}/v1/result/{job_id}/log/output", params={"start_fragment": 1},
                       timeout=10).json()["output"]
    assert log["setup"] == {"last_fragment_number": -1, "log_data": ""}
    assert log["test"] == {"last_fragment_number": 2, "log_data": "test says hi\n"}
    jobs = requests.get(f"{svc.url}/v1/queues/q/jobs", timeout=10).json()
    assert [(j["job_id"], j["job_state"], j["job_queue"]) for j in jobs] == [
        (job_id, "complete", "q")]


def test_pop_order_exclusion_and_empty(svc):
    a1, a2 = agent_session(svc, "a1"), agent_session(svc, "a2")
    low = submit(svc)
    r = requests.post(f"{svc.url}/v1/job", json={"job_queue": "q", "job_priority": 10},
                      timeout=10)
    assert r.status_code == 401  # priority needs a token with max_priority
    alice = {"Authorization": f"Bearer {token(svc, 'alice')['access_token']}"}
    r = requests.post(f"{svc.url}/v1/job", json={"job_queue": "q", "job_priority": 99},
                      headers=alice, timeout=10)
    assert r.status_code == 403
    high = requests.post(f"{svc.url}/v1/job", json={"job_queue": "q", "job_priority": 10},
                         headers=alice, timeout=10).json()["job_id"]
    excl = submit(svc, exclude_agents=["a1"])
    assert requests.get(f"{svc.url}/v1/job/{excl}/position", timeout=10).text == "2"

    assert a1.get(f"{svc.url}/v1/job?queue=q", timeout=10).json()["job_id"] == high
    assert a1.get(f"{svc.url}/v1/job?queue=q", timeout=10).json()["job_id"] == low
    r = a1.get(f"{svc.url}/v1/job?queue=q", timeout=10)
    assert r.status_code == 204  # only the job excluding a1 is left
    assert a2.get(f"{svc.url}/v1/job?queue=q", timeout=10).json()["job_id"] == excl


def test_error_codes(svc):
    agent = agent_session(svc, "a1")
    assert agent.get(f"{svc.url}/v1/job", timeout=10).status_code == 400
    no_cookie = {"Authorization": agent.headers["Authorization"]}
    r = requests.get(f"{svc.url}/v1/job?queue=q", headers=no_cookie, timeout=10)
    assert r.status_code == 401 and r.json()["message"] == "Agent not identified"
    for body in ({"job_queue": "q", "bogus": 1}, {"test_data": {}}, {"job_queue": ""}):
        r = requests.post(f"{svc.url}/v1/job", json=body, timeout=10)
        assert r.status_code == 422, body
    r = requests.post(f"{svc.url}/v1/job", json={"job_queue": "q", "exclude_agents": ["a1"]},
                      timeout=10)
    assert r.status_code == 422  # a1 is the only agent on q
    r = requests.post(f"{svc.url}/v1/job", json={"job_queue": "q", "job_id": "nope"}, timeout=10)
    assert r.status_code == 400
    r = requests.get(f"{svc.url}/v1/queues/nowhere/agents", timeout=10)
    assert r.status_code == 404 and r.json()["message"] == "Queue 'nowhere' does not exist."
    listed = requests.get(f"{svc.url}/v1/queues/q/agents", timeout=10).json()
    assert [a["name"] for a in listed] == ["a1"] and "updated_at" not in listed[0]
    assert requests.get(f"{svc.url}/v1/agents/data/ghost", timeout=10).status_code == 404
    unknown = str(uuid.uuid4())
    assert requests.get(f"{svc.url}/v1/job/{unknown}", timeout=10).status_code == 204
    assert requests.get(f"{svc.url}/v1/result/{unknown}", timeout=10).status_code == 204
    assert requests.get(f"{svc.url}/v1/job/{unknown}/position", timeout=10).status_code == 410
    assert requests.get(f"{svc.url}/v1/job/not-a-uuid", timeout=10).status_code == 400
    r = agent.post(f"{svc.url}/v1/agents/data/a1", json={"state": "x", "colour": "red"},
                   timeout=10)
    assert r.status_code == 422


def test_cancel_rules(svc):
    job_id = submit(svc)
    action = f"{svc.url}/v1/job/{job_id}/action"
    assert requests.post(action, json={"action": "pause"}, timeout=10).status_code == 422
    assert requests.post(action, json={"action": "cancel"}, timeout=10).status_code == 200
    assert requests.get(f"{svc.url}/v1/result/{job_id}", timeout=10).json() == {
        "job_state": "cancelled"}
    assert requests.post(action, json={"action": "cancel"}, timeout=10).status_code == 400
    done = submit(svc)
    svc.db.jobs.update_one({"job_id": done}, {"$set": {"result_data.job_state": "complete"}})
    r = requests.post(f"{svc.url}/v1/job/{done}/action", json={"action": "cancel"}, timeout=10)
    assert r.status_code == 400


def test_roles_and_tokens(svc):
    job_id = submit(svc)
    # Anonymous is a contributor: agent-only endpoints answer 403.
    assert requests.get(f"{svc.url}/v1/job?queue=q", timeout=10).status_code == 403
    assert requests.post(f"{svc.url}/v1/result/{job_id}", json={"job_state": "x"},
                         timeout=10).status_code == 403
    # Exact membership: an admin is not an agent.
    admin = {"Authorization": f"Bearer {token(svc, 'boss')['access_token']}"}
    assert requests.get(f"{svc.url}/v1/job?queue=q", headers=admin, timeout=10).status_code == 403
    assert requests.post(f"{svc.url}/v1/agents/data/x", json={"state": "offline"}, headers=admin,
                         timeout=10).status_code == 200
    # Agents cannot submit or read contributor endpoints.
    agent = agent_session(svc, "a1")
    assert agent.post(f"{svc.url}/v1/job", json={"job_queue": "q"}, timeout=10).status_code == 403
    assert agent.get(f"{svc.url}/v1/result/{job_id}", timeout=10).status_code == 200

    tokens = token(svc, "agents")
    assert set(tokens) == {"access_token", "token_type", "expires_in", "refresh_token"}
    assert tokens["token_type"] == "Bearer" and tokens["expires_in"] == 600
    claims = jwt.decode(tokens["access_token"], KEY, algorithms=["HS256"])
    assert claims["sub"] == "access_token"
    assert claims["permissions"]["role"] == "agent"
    assert claims["permissions"]["client_id"] == "agents"
    stored = svc.db.client_permissions.find_one({"client_id": "agents"})
    assert "agent-secret" not in str(stored) and stored["client_secret_hash"]

    bad = requests.post(f"{svc.url}/v1/oauth2/token", auth=("agents", "wrong-secret-x"),
                        timeout=10)
    assert bad.status_code == 401
    assert requests.post(f"{svc.url}/v1/oauth2/token", timeout=10).status_code == 401

    refreshed = requests.post(f"{svc.url}/v1/oauth2/refresh",
                              json={"refresh_token": tokens["refresh_token"]}, timeout=10)
    assert refreshed.status_code == 200
    assert set(refreshed.json()) == {"access_token", "token_type", "expires_in"}
    assert requests.post(f"{svc.url}/v1/oauth2/refresh", json={"refresh_token": "nope"},
                         timeout=10).status_code == 400
    assert requests.post(f"{svc.url}/v1/oauth2/refresh", json={}, timeout=10).status_code == 422

    forged = jwt.encode({"sub": "access_token", "iat": 0, "exp": 2**33,
                         "permissions": {"role": "agent", "client_id": "x"}},
                        "other-signing-key-0123456789abcdef0123", algorithm="HS256")
    r = requests.get(f"{svc.url}/v1/job?queue=q", headers={"Authorization": f"Bearer {forged}"},
                     timeout=10)
    assert r.status_code == 403
    expired = jwt.encode({"sub": "access_token", "iat": 0, "exp": 1,
                          "permissions": {"role": "agent", "client_id": "x"}}, KEY,
                         algorithm="HS256")
    r = requests.get(f"{svc.url}/v1/job?queue=q", headers={"Authorization": f"Bearer {expired}"},
                     timeout=10)
    assert r.status_code == 401
    # An empty bearer token: 401 "Unauthorized", as Testflinger's decode_jwt_token.
    r = requests.get(f"{svc.url}/v1/job?queue=q", headers={"Authorization": "Bearer "}, timeout=10)
    assert (r.status_code, r.json()["message"]) == (401, "Unauthorized")


def test_agent_documents_and_queues(svc):
    agent = agent_session(svc, "a1")
    agent.post(f"{svc.url}/v1/agents/data/a1", json={"log": [f"l{i}" for i in range(150)],
                                                     "location": "rack 1"}, timeout=10)
    doc = svc.db.agents.find_one({"name": "a1"})
    assert len(doc["log"]) == 100 and doc["log"][-1] == "l149" and doc["log"][0] == "l50"
    one = requests.get(f"{svc.url}/v1/agents/data/a1", timeout=10).json()
    assert one["state"] == "waiting" and one["location"] == "rack 1"
    assert "log" not in one and one["restricted_to"] == {}
    assert [a["name"] for a in requests.get(f"{svc.url}/v1/agents/data", timeout=10).json()] == [
        "a1"]

    assert agent.post(f"{svc.url}/v1/agents/queues", json={"q": "the q queue"},
                      timeout=10).status_code == 200
    assert requests.get(f"{svc.url}/v1/agents/queues", timeout=10).json() == {"q": "the q queue"}
    assert agent.post(f"{svc.url}/v1/agents/queues", json={"q": 3}, timeout=10).status_code == 422


def test_concurrent_pops_never_share_a_job(svc):
    jobs = {submit(svc) for _ in range(30)}
    sessions = [agent_session(svc, f"a{i}") for i in range(2)]
    got: list[list[str]] = [[], []]

    def drain(i):
        while True:
            r = sessions[i].get(f"{svc.url}/v1/job?queue=q", timeout=30)
            if r.status_code == 204:
                return
            got[i].append(r.json()["job_id"])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    popped = got[0] + got[1]
    assert sorted(popped) == sorted(jobs)  # every job exactly once


def test_attachments_gate_the_pop(svc):
    agent = agent_session(svc, "a1")
    job_id = submit(svc, test_data={"attachments": [{"agent": "script.sh"}]})
    assert svc.db.jobs.find_one({"job_id": job_id})["job_data"]["attachments_status"] == "waiting"
    assert agent.get(f"{svc.url}/v1/job?queue=q", timeout=10).status_code == 204
    url = f"{svc.url}/v1/job/{job_id}/attachments"
    assert requests.post(url, files={"file": ("file", b"tarball-bytes")},
                         timeout=10).status_code == 200
    assert agent.get(url, timeout=10).content == b"tarball-bytes"
    assert agent.get(f"{svc.url}/v1/job?queue=q", timeout=10).json()["job_id"] == job_id
    plain = submit(svc)
    r = requests.post(f"{svc.url}/v1/job/{plain}/attachments", files={"file": ("f", b"x")},
                      timeout=10)
    assert r.status_code == 422


def test_artifacts_round_trip(svc):
    """The agent uploads ``artifacts.tar.gz`` (multipart ``file``); testflinger-cli ``artifacts``
    downloads it, and reads 204 as "No artifacts tarball found" (not an error status)."""
    agent = agent_session(svc, "a1")
    job_id = submit(svc)
    url = f"{svc.url}/v1/result/{job_id}/artifact"
    assert requests.get(url, timeout=10).status_code == 204
    # Only agents upload (Testflinger: require_role(AGENT)).
    assert requests.post(url, files={"file": ("f", b"x")}, timeout=10).status_code == 403
    assert agent.post(url, files={"file": ("artifacts.tar.gz", b"tar-1")},
                      timeout=10).status_code == 200
    assert agent.post(url, files={"file": ("artifacts.tar.gz", b"tar-2")},
                      timeout=10).status_code == 200
    r = requests.get(url, timeout=10)
    assert (r.status_code, r.content) == (200, b"tar-2")
    assert "artifact.tar.gz" in r.headers["Content-Disposition"]
    assert requests.get(f"{svc.url}/v1/result/not-a-uuid/artifact",
                        timeout=10).status_code == 400


def test_provision_logs_and_streaks(svc):
    agent = agent_session(svc, "a1")
    url = f"{svc.url}/v1/agents/provision_logs/a1"
    for code in (0, 0, 1):
        r = agent.post(url, json={"job_id": str(uuid.uuid4()), "exit_code": code}, timeout=10)
        assert r.status_code == 200, r.text
    doc = svc.db.agents.find_one({"name": "a1"})
    assert (doc["provision_streak_type"], doc["provision_streak_count"]) == ("fail", 1)
    assert [e["exit_code"] for e in svc.db.provision_logs.find_one({"name": "a1"})["provision_log"]] \
        == [0, 0, 1]
    assert agent.post(url, json={"exit_code": 0}, timeout=10).status_code == 422
    assert agent.post(f"{svc.url}/v1/agents/provision_logs/ghost",
                      json={"job_id": "x", "exit_code": 0}, timeout=10).status_code == 404
    assert requests.post(url, json={"job_id": "x", "exit_code": 0}, timeout=10).status_code == 403


def test_percentiles_match_testflinger_interpolation():
    assert percentiles([]) == {}
    assert percentiles([7]) == {5: 7, 10: 7, 50: 7, 90: 7, 95: 7}
    got = percentiles([10, 0])
    assert got[50] == pytest.approx(5.0) and got[90] == pytest.approx(9.0)


def test_plugin_mounts_when_available():
    try:
        server = importlib.import_module("testflinger_magic.server")
    except ImportError:
        server = None
    if server is None or not hasattr(server, "init_app"):
        pytest.skip("testflinger_magic.server.init_app not written yet")
    app = create_app(signing_key=KEY, plugin_options={"start_ticker": False})
    plugin = app.extensions["jobservice"]["plugin"]
    assert plugin is not None and app.extensions.get("testflinger_magic") is plugin
    assert any(r.rule.startswith("/v1/magic") for r in app.url_map.iter_rules())
    # The plugin's hooks run around our routes: an agent poll still pops the job.
    with httpserve.serve(app) as handle:
        handle.db = app.extensions["jobservice"]["db"]
        add_client(handle.db, "agents", CLIENTS["agents"]["secret"], "agent")
        agent = agent_session(handle, "a1")
        job_id = submit(handle)
        r = agent.get(f"{handle.url}/v1/job?queue=q", timeout=10)
        assert r.status_code == 200 and r.json()["job_id"] == job_id


def test_missing_plugin_raises(monkeypatch):
    server = importlib.import_module("testflinger_magic.server")
    if hasattr(server, "init_app"):
        monkeypatch.delattr(server, "init_app")
    with pytest.raises(ImportError):
        create_app(signing_key=KEY)


def test_newer_generation_keeps_job_events():
    """testflinger#1297-#1299 (tfevents): a newer server records job_submitted, job_assigned,
    the events a result post adds and job_cancelled in ``jobs_events``, and serves them at GET
    /v1/events/job/<id>; the older one has neither the collection nor the route."""
    old_db = tfdb.connect()
    old = httpserve.serve(create_app(old_db, signing_key=KEY, clients=CLIENTS, mount_plugin=False))
    database = tfdb.connect()
    new = httpserve.serve(create_app(database, signing_key=KEY, clients=CLIENTS,
                                     mount_plugin=False, newer=True))
    try:
        assert "jobs_events" in database.list_collection_names()
        old.db = old_db
        job_old = submit(old)
        assert requests.get(f"{old.url}/v1/events/job/{job_old}", timeout=10).status_code == 404
        assert "jobs_events" not in old_db.list_collection_names()

        new.db = database
        alice = {"Authorization": f"Bearer {token(new, 'alice')['access_token']}"}
        r = requests.post(f"{new.url}/v1/job", json={"job_queue": "q"}, headers=alice, timeout=10)
        job_id = r.json()["job_id"]
        agent = agent_session(new, "a1")
        assert agent.get(f"{new.url}/v1/job", params={"queue": "q"}, timeout=10).status_code == 200
        for body in ({"job_state": "setup"}, {"job_state": "setup"},
                     {"job_state": "provision", "status": {"setup": 0}}):
            assert agent.post(f"{new.url}/v1/result/{job_id}", json=body,
                              timeout=10).status_code == 200
        r = requests.post(f"{new.url}/v1/job/{job_id}/action", json={"action": "cancel"},
                          headers=alice, timeout=10)
        assert r.status_code == 200
        r = requests.get(f"{new.url}/v1/events/job/{job_id}", timeout=10)
        assert r.status_code == 200, r.text
        events = r.json()["events"]
        assert [(e["event_name"], e.get("phase")) for e in events] == [
            ("job_submitted", None), ("job_assigned", None), ("job_phase_started", "setup"),
            ("job_phase_completed", "setup"), ("job_phase_started", "provision"),
            ("job_cancelled", None)]
        assert events[0]["message"] == "Job submitted by user alice into queue q."
        assert events[1]["message"] == "Job assigned to agent a1."
        assert events[3]["status"] == 0
        assert events[3]["message"] == "Phase setup completed with exit code 0"
        assert events[5]["message"] == "Job cancellation requested by user alice."
        assert all(set(e["timestamp"]) == {"$date"} for e in events)
        unknown = requests.get(f"{new.url}/v1/events/job/{uuid.uuid4()}", timeout=10)
        assert unknown.status_code == 404 and unknown.json() == {"message": "Job not found"}
    finally:
        old.stop()
        new.stop()
