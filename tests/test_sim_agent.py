"""The testflinger-agent look-alike, run as a real process against the lab job service."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import jwt
import pytest
import requests
import yaml

from testflinger_magic import db as tfdb
from testflinger_magic.lab import httpserve
from testflinger_magic.lab.jobservice import create_app
from testflinger_magic.lab.sim_agent import (
    ConfigError,
    ServerClient,
    Stopped,
    load_config,
    phase_output,
    validate_config,
)

KEY = "sim-agent-test-signing-key-0123456789abcdef"
CLIENTS = {"agents": {"secret": "agent-secret-123456", "role": "agent"},
           "boss": {"secret": "boss-secret-1234567", "role": "admin"}}
WAIT = 30.0  # seconds; an upper bound for waiting on the agent, never asserted on


class RequestLog:
    """WSGI middleware counting (method, path) so tests can see the agent poll."""

    def __init__(self, app):
        self.app, self.counts, self.lock = app, Counter(), threading.Lock()

    def __call__(self, environ, start_response):
        with self.lock:
            self.counts[(environ["REQUEST_METHOD"], environ["PATH_INFO"])] += 1
        return self.app(environ, start_response)

    def count(self, method, path):
        with self.lock:
            return self.counts[(method, path)]


#: Both server and agent generations (TESTFLINGER.md §9): ``create_app(newer=True)`` and
#: ``SIM_AGENT_NEWER=1``; a test opts in with ``@GENERATIONS``.
GENERATIONS = pytest.mark.parametrize("lab", ["old", "newer"], indirect=True)


@pytest.fixture
def lab(tmp_path, request):
    newer = getattr(request, "param", "old") == "newer"
    database = tfdb.connect()
    app = create_app(database, signing_key=KEY, clients=CLIENTS, mount_plugin=False, newer=newer)
    log = RequestLog(app)
    handle = httpserve.serve(log)
    handle.db, handle.requests, handle.newer = database, log, newer
    tokens = requests.post(f"{handle.url}/v1/oauth2/token", auth=("agents", "agent-secret-123456"),
                           timeout=10).json()
    handle.token_file = tmp_path / "refresh_token"
    handle.token_file.write_text(json.dumps({"refresh_token": tokens["refresh_token"]}))
    admin = requests.post(f"{handle.url}/v1/oauth2/token", auth=("boss", "boss-secret-1234567"),
                          timeout=10).json()
    handle.admin = {"Authorization": f"Bearer {admin['access_token']}"}
    yield handle
    handle.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start_agent(lab, tmp_path):
    procs = []

    def start(name="vm-agent-1", queues=("magic-q",), metrics_port=None, phase_seconds=0.05,
              **extra):
        conf = {"agent_id": name, "server_address": lab.url, "job_queues": list(queues),
                "polling_interval": 1, "provision_type": "maas2", "location": "lab",
                "advertised_queues": {queues[0]: "a magic queue"}, **extra}
        path = tmp_path / f"{name}.conf"
        path.write_text(yaml.safe_dump(conf))
        cmd = [sys.executable, "-m", "testflinger_magic.lab.sim_agent", "-c", str(path),
               "--token-file", str(lab.token_file)]
        if metrics_port:
            cmd += ["-p", str(metrics_port)]
        env = dict(os.environ, SIM_AGENT_PHASE_SECONDS=str(phase_seconds),
                   SIM_AGENT_NEWER="1" if lab.newer else "")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


def wait_for(predicate, what):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"gave up waiting for {what}")


def agent_doc(lab, name="vm-agent-1"):
    return lab.db.agents.find_one({"name": name}) or {}


def submit(lab, **job):
    job.setdefault("job_queue", "magic-q")
    return requests.post(f"{lab.url}/v1/job", json=job, timeout=10).json()["job_id"]


def job_state(lab, job_id):
    return lab.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"]


@GENERATIONS
def test_runs_a_job_through_its_phases(lab, start_agent):
    port = free_port()
    start_agent(metrics_port=port)
    wait_for(lambda: agent_doc(lab).get("queues") == ["magic-q"], "the agent's startup posts")
    doc = agent_doc(lab)
    assert (doc["state"], doc["comment"], doc["provision_type"], doc["location"]) == (
        "waiting", "", "maas2", "lab")
    assert lab.db.queues.find_one({"name": "magic-q"})["description"] == "a magic queue"

    job_id = submit(lab, provision_data={"distro": "noble"},
                    test_data={"test_cmds": "nvidia-smi\nrm -rf /nothing-is-run"})
    wait_for(lambda: job_state(lab, job_id) == "complete", "the job to complete")
    result = requests.get(f"{lab.url}/v1/result/{job_id}", timeout=10).json()
    assert (result["setup_status"], result["provision_status"], result["test_status"]) == (0, 0, 0)
    assert "firmware_update_status" not in result and "reserve_status" not in result
    assert "$ nvidia-smi" in result["test_output"] and "distro: noble" in result["provision_output"]
    frags = list(lab.db.logs.find({"job_id": job_id}, sort=[("fragment_number", 1)]))
    assert [f["phase"] for f in frags] == ["setup", "provision", "test"]
    assert [f["fragment_number"] for f in frags] == [0, 1, 2]

    wait_for(lambda: agent_doc(lab)["state"] == "waiting" and not agent_doc(lab).get("job_id"),
             "the agent to go back to waiting")
    # An older agent posts job_id itself ("" when done); a newer server sets and unsets it and
    # records which agent took the job (testflinger#1253).
    assert ("job_id" in agent_doc(lab)) is not lab.newer
    agent_id = lab.db.jobs.find_one({"job_id": job_id})["result_data"].get("agent_id")
    assert agent_id == ("vm-agent-1" if lab.newer else None)
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'testflinger_agent_jobs_total{agent_id="vm-agent-1"} 1.0' in metrics


def test_cancelled_job_stops_walking_phases(lab, start_agent):
    job_id = submit(lab, provision_data={"distro": "noble"}, test_data={"test_cmds": "true"},
                    reserve_data={"timeout": 60})
    start_agent(phase_seconds=3)
    wait_for(lambda: lab.db.logs.count_documents({"job_id": job_id}) >= 1, "the setup phase")
    r = requests.post(f"{lab.url}/v1/job/{job_id}/action", json={"action": "cancel"}, timeout=10)
    assert r.status_code == 200
    # The outcome post overwrites "cancelled" with "complete", as testflinger-agent does.
    wait_for(lambda: job_state(lab, job_id) == "complete", "the outcome post")
    phases = [f["phase"] for f in lab.db.logs.find({"job_id": job_id})]
    assert phases == ["setup"]


def test_a_cancel_stops_a_running_phase_except_provision(lab, start_agent, monkeypatch):
    """TRIAL16 F4: the sim agent looked for a cancel only between phases, so with long phases
    every forced drain in the lab ran into its force timeout. The real runner checks every
    10 s while a phase's command runs, except in provision (``runner.py::CommandRunner.run``,
    ``job.py::run_test_phase``): a cancel in setup stops setup (its output says so), one in
    provision waits for provision to end."""
    monkeypatch.setenv("SIM_AGENT_CANCEL_CHECK_SECONDS", "0.2")
    note = "Job cancellation was requested, exiting."
    for cancel_in, walked in (("setup", ["setup", "setup"]), ("provision", ["setup", "provision"])):
        job_id = submit(lab, provision_data={"distro": "noble"}, test_data={"test_cmds": "true"})
        proc = start_agent(phase_seconds=4)
        wait_for(lambda: job_state(lab, job_id) == cancel_in, f"the {cancel_in} phase")
        r = requests.post(f"{lab.url}/v1/job/{job_id}/action", json={"action": "cancel"},
                          timeout=10)
        assert r.status_code == 200
        wait_for(lambda: job_state(lab, job_id) == "complete", "the outcome post")
        frags = list(lab.db.logs.find({"job_id": job_id}, sort=[("fragment_number", 1)]))
        assert [f["phase"] for f in frags] == walked, frags
        said = [f["phase"] for f in frags if note in f["log_data"]]
        assert said == (["setup"] if cancel_in == "setup" else []), frags
        proc.kill()
        proc.wait(10)


@GENERATIONS
def test_restarted_agent_keeps_offline_only_when_newer(lab, start_agent):
    """testflinger#1291: a newer agent starting up keeps a server ``offline``; an older one
    posts ``waiting`` over it (TESTFLINGER.md §3.2)."""
    lab.db.agents.insert_one({"name": "vm-agent-1", "state": "offline", "comment": "fenced",
                              "queues": ["magic-q"], "log": []})
    start_agent()
    wait_for(lambda: agent_doc(lab).get("location") == "lab", "the startup posts")
    path = "/v1/agents/data/vm-agent-1"
    seen = lab.requests.count("GET", path)
    wait_for(lambda: lab.requests.count("GET", path) >= seen + 2, "the agent to check its state")
    assert agent_doc(lab)["state"] == ("offline" if lab.newer else "waiting")


def test_offline_agent_takes_no_job(lab, start_agent):
    start_agent()
    wait_for(lambda: agent_doc(lab).get("state") == "waiting", "startup")
    r = requests.post(f"{lab.url}/v1/agents/data/vm-agent-1",
                      json={"state": "offline", "comment": "fenced"}, headers=lab.admin,
                      timeout=10)
    assert r.status_code == 200
    # Once the agent has read its state twice after we set it, it cannot be between a check
    # and a job poll any more: from then on it must not ask for a job.
    path = "/v1/agents/data/vm-agent-1"
    seen = lab.requests.count("GET", path)
    wait_for(lambda: lab.requests.count("GET", path) >= seen + 2, "the agent to check its state")
    polls = lab.requests.count("GET", "/v1/job")
    job_id = submit(lab, test_data={"test_cmds": "true"})
    seen = lab.requests.count("GET", path)
    wait_for(lambda: lab.requests.count("GET", path) >= seen + 3, "more state checks")
    assert lab.requests.count("GET", "/v1/job") == polls
    assert job_state(lab, job_id) == "waiting"
    assert agent_doc(lab)["state"] == "offline"

    requests.post(f"{lab.url}/v1/agents/data/vm-agent-1", json={"state": "waiting"},
                  headers=lab.admin, timeout=10)
    wait_for(lambda: job_state(lab, job_id) == "complete", "the job once back online")


def test_sigterm_while_idle_kills_at_once_like_the_real_agent(lab, start_agent):
    # testflinger-agent installs no SIGTERM handler outside a phase (__init__.py::start_agent):
    # the default action ends it, killed by the signal, not after its current HTTP call.
    proc = start_agent()
    wait_for(lambda: agent_doc(lab).get("state") == "waiting", "startup")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT) == -signal.SIGTERM
    assert "SIGTERM received" not in proc.stdout.read()


def test_sigterm_during_a_job_ends_it_at_its_next_pause(lab, start_agent):
    proc = start_agent(phase_seconds=5)
    wait_for(lambda: agent_doc(lab).get("state") == "waiting", "startup")
    job_id = submit(lab, test_data={"test_cmds": "true"})
    wait_for(lambda: job_state(lab, job_id) == "setup", "the job's first phase")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT) == 0
    assert "SIGTERM received" in proc.stdout.read()
    assert job_state(lab, job_id) == "setup"  # nothing more posted


@GENERATIONS
def test_an_agent_restarted_mid_job_leaves_its_job_named_and_in_its_phase(lab, start_agent):
    """TRIAL3 finding 12's premise, as the real agent (agent.py: the startup posts carry no
    job_id; a newer server set it at job_get and clears it only on a cancel or terminal
    result): after a restart mid-provision the document says waiting and names the job, which
    stays in provision; testflinger_magic.stalejob calls it stale once the agent has been quiet
    for STALE_AFTER, and an orphan."""
    from testflinger_magic import stalejob

    proc = start_agent(phase_seconds=5)
    wait_for(lambda: agent_doc(lab).get("state") == "waiting", "startup")
    job_id = submit(lab, provision_data={"distro": "noble"}, test_data={"test_cmds": "true"})
    wait_for(lambda: agent_doc(lab).get("state") == "provision", "the job's provision phase")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT) == 0
    lab.db.agents.update_one({"name": "vm-agent-1"}, {"$unset": {"location": ""}})
    proc = start_agent(phase_seconds=5)
    wait_for(lambda: agent_doc(lab).get("location") == "lab", "the restarted agent's startup")
    path = "/v1/agents/data/vm-agent-1"
    seen = lab.requests.count("GET", path)
    wait_for(lambda: lab.requests.count("GET", path) >= seen + 2, "the agent's next polls")
    doc = agent_doc(lab)
    assert (doc["state"], doc["job_id"]) == ("waiting", job_id)
    assert job_state(lab, job_id) == "provision"
    posted = stalejob.epoch(doc["updated_at"])
    assert stalejob.stale_job(doc, "provision", posted + 1) is None
    assert stalejob.orphaned(doc, "provision", posted + stalejob.STALE_AFTER)


def test_bad_config_and_busy_metrics_port_exit_2(lab, start_agent, tmp_path):
    proc = start_agent(bogus_key=1)
    assert proc.wait(WAIT) == 2
    assert "bogus_key: extra keys not allowed" in proc.stdout.read()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = start_agent(name="vm-agent-2", metrics_port=taken.getsockname()[1])
        assert proc.wait(WAIT) == 2


def test_validate_config_like_the_voluptuous_schema(tmp_path):
    good = validate_config({"agent_id": "a", "server_address": "http://x", "job_queues": ["q"]})
    assert good["polling_interval"] == 10 and good["test_command"] == ""
    assert good["execution_basedir"] == "/tmp/testflinger/run" and "location" not in good
    with pytest.raises(ConfigError) as err:
        validate_config({"agent_id": 3, "job_queues": "q", "extra": 1}, "f.conf")
    text = str(err.value)
    assert "f.conf: extra: extra keys not allowed" in text
    assert "f.conf: server_address: required key not provided" in text
    assert "f.conf: agent_id: expected str, got int" in text
    assert "f.conf: job_queues: expected list, got str" in text
    bad = tmp_path / "bad.conf"
    bad.write_text("agent_id: [unclosed")
    with pytest.raises(ConfigError, match="bad.conf: not YAML"):
        load_config(bad)


def test_phase_output_skips_like_job_py():
    job = {"job_id": "j", "job_queue": "q", "provision_data": {"skip": True},
           "test_data": {"test_cmds": "a\n\nb"}, "allocate_data": {}}
    assert phase_output(job, "setup").startswith("[sim-agent] setup")
    assert phase_output(job, "provision") is None
    assert phase_output(job, "allocate") is None
    assert phase_output(job, "firmware_update") is None
    assert phase_output(job, "test").splitlines()[1:] == ["$ a", "$ b"]


def test_client_refreshes_once_after_401(lab):
    client = ServerClient(lab.url, str(lab.token_file), threading.Event())
    now = int(time.time())
    stale = jwt.encode({"sub": "access_token", "iat": now - 900, "exp": now - 600,
                        "permissions": {"role": "agent", "client_id": "agents"}}, KEY,
                       algorithm="HS256")
    client._token = stale
    resp = client.request("POST", "/v1/agents/data/x", json={"state": "waiting"})
    assert resp.status_code == 200
    assert lab.requests.count("POST", "/v1/agents/data/x") == 2  # the 401, then the replay
    assert lab.requests.count("POST", "/v1/oauth2/refresh") == 1
    assert client._token != stale
    assert jwt.decode(client._token, KEY, algorithms=["HS256"])["permissions"]["role"] == "agent"


def test_client_without_token_is_anonymous_and_honours_stop(lab):
    stop = threading.Event()
    client = ServerClient(lab.url.replace("http://", ""), None, stop)
    assert client.request("GET", "/v1/job", params={"queue": "q"}).status_code == 403
    stop.set()
    with pytest.raises(Stopped):
        client.request("GET", "/v1/")


class FailFirstOutcome:
    """WSGI middleware answering the first job outcome POST (``job_state: complete``) 503, as
    a server restarting at that moment would (TRIAL18 F4)."""

    def __init__(self, app):
        self.app, self.failed = app, 0

    def __call__(self, environ, start_response):
        import io

        path = environ["PATH_INFO"]
        if environ["REQUEST_METHOD"] == "POST" and path.startswith("/v1/result/") \
                and path.count("/") == 3:
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            if b'"complete"' in body and not self.failed:
                self.failed += 1
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"restarting"]
        return self.app(environ, start_response)


def test_an_outcome_the_server_did_not_take_is_kept_and_sent_again(lab, start_agent, tmp_path):
    """testflinger-agent keeps an outcome the server did not take in ``results_basedir`` and
    sends it again at the start of its next loop (agent.py ``retry_old_results``); the lab's
    agent dropped it, and a server restart at a job's end left the job in ``reserve`` for
    ever (TRIAL18 F4)."""
    failing = FailFirstOutcome(lab.requests.app)
    lab.requests.app = failing
    results = tmp_path / "results"
    start_agent(results_basedir=str(results))
    wait_for(lambda: agent_doc(lab).get("queues") == ["magic-q"], "the agent's startup posts")
    job_id = submit(lab, test_data={"test_cmds": "true"})
    wait_for(lambda: failing.failed == 1, "the outcome to be refused once")
    wait_for(lambda: job_state(lab, job_id) == "complete", "the kept outcome to be sent again")
    wait_for(lambda: results.is_dir() and not any(results.iterdir()),
             "the kept outcome to be removed once taken")
    wait_for(lambda: agent_doc(lab)["state"] == "waiting", "the agent to wait for jobs again")
