"""The plugin inside the REAL Testflinger server (and with the real testflinger-cli), when installed.

These tests run only where the Testflinger server package (``testflinger``, from
canonical/testflinger ``server/``; not on PyPI) is importable; elsewhere, as in CI, they skip. To
run them, install Testflinger's ``common``, ``server``, ``cli`` (and ``agent``) from a checkout
into a separate virtualenv together with this project, and run pytest from that virtualenv.

The app is built by Testflinger's own factory, ``create_flask_app``, with its database module's
``mongo`` replaced by a mongomock client, as Testflinger's ``server/tests/conftest.py`` does
(``TESTING`` skips only the Mongo connection, indexes, the metrics port and the OWASP handler; it
does not bypass auth: TESTFLINGER.md §2). Tokens come from Testflinger's own
``POST /v1/oauth2/token``; every request goes over real HTTP on 127.0.0.1. Requests are made one
at a time and the plugin's background kick is recorded instead of run, because a raw mongomock
client (which Testflinger's GridFS code needs) is not thread-safe.
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import textwrap
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import requests

tf_application = pytest.importorskip(
    "testflinger.application",
    reason="the Testflinger server package ('testflinger', canonical/testflinger server/) is not "
    "installed here; it is not on PyPI, so these compatibility tests only run where it is",
)
tf_database = pytest.importorskip("testflinger.database")
bcrypt = pytest.importorskip("bcrypt")
jwt = pytest.importorskip("jwt")
mongomock = pytest.importorskip("mongomock")

from conftest import MAGIC_YAML, seed  # noqa: E402
from conftest import report_up_to_active as conftest_report  # noqa: E402

from testflinger_magic import queues  # noqa: E402
from testflinger_magic.server import init_app  # noqa: E402

SIGNING_KEY = "real-testflinger-signing-key-0123456789abcdef"
#: client_id -> (secret, role); stored bcrypt-hashed in client_permissions as Testflinger does.
CLIENTS = {
    "ops": ("ops-secret", "admin"),
    "lead": ("lead-secret", "manager"),
    "dev": ("dev-secret", "contributor"),
    "hosts": ("hosts-secret", "agent"),
}
DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
]
#: Fields of Testflinger's schemas.AgentOut (GET /v1/queues/<q>/agents entries).
AGENT_OUT = {"name", "state", "queues", "location", "provision_type", "job_id", "comment",
             "restricted_to"}


class TestingConfig:
    """Testflinger's own test config: no Mongo connection, no metrics port."""

    TESTING = True


class RealStack:
    """Testflinger's app with the plugin mounted, served on 127.0.0.1; ``kicks`` counts the
    plugin's wake-ups from ``POST /v1/job``."""

    def __init__(self, monkeypatch, serve):
        monkeypatch.setenv("JWT_SIGNING_KEY", SIGNING_KEY)  # Testflinger reads it from os.environ
        client = mongomock.MongoClient()
        monkeypatch.setattr(tf_database, "mongo", client)
        self.db = client.db
        seed(self.db)
        for client_id, (secret, role) in CLIENTS.items():
            self.db.client_permissions.insert_one({
                "client_id": client_id,
                "client_secret_hash": bcrypt.hashpw(secret.encode(), bcrypt.gensalt(4)).decode(),
                "role": role, "max_priority": {}, "allowed_queues": [],
                "max_reservation_time": {},
            })
        self.app = tf_application.create_flask_app(TestingConfig)
        # db=None: the plugin must find Testflinger's database by itself.
        self.plugin = init_app(self.app, definitions=queues.load_text(MAGIC_YAML),
                               start_ticker=False)
        self.kicks = []
        monkeypatch.setattr(self.plugin, "kick", lambda queue=None: self.kicks.append(queue))
        self.url = serve(self.app).url
        self._tokens = {}

    def headers(self, client_id):
        """``Authorization`` for ``client_id``, from Testflinger's own token endpoint."""
        if client_id not in self._tokens:
            r = requests.post(f"{self.url}/v1/oauth2/token", auth=(client_id, CLIENTS[client_id][0]),
                              timeout=10)
            assert r.status_code == 200, r.text
            self._tokens[client_id] = r.json()["access_token"]
        return {"Authorization": f"Bearer {self._tokens[client_id]}"}

    def register(self):
        r = requests.post(f"{self.url}/v1/magic/agent-hosts/host-a", headers=self.headers("hosts"),
                          json={"devices": DEVICES, "version": "test"}, timeout=10)
        assert r.status_code == 200, r.text

    def poll(self, agent, queues_):
        """``GET /v1/job`` as testflinger-agent sends it: agent token, ``agent_name`` cookie."""
        return requests.get(f"{self.url}/v1/job", params={"queue": queues_},
                            headers=self.headers("hosts"), cookies={"agent_name": agent},
                            timeout=10)

    def submit(self, queue, headers=None):
        r = requests.post(f"{self.url}/v1/job", json={"job_queue": queue}, headers=headers or {},
                          timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["job_id"]


@pytest.fixture
def real(monkeypatch, serve):
    stack = RealStack(monkeypatch, serve)
    yield stack
    stack.plugin.stop()



def report_up_to_active(real, lease: dict) -> dict:
    """The agent host's bring-up steps claimed -> active through the real server (as host-a's
    daemon does); returns the active lease."""
    return conftest_report(real.url, real.headers("hosts"), lease)


def test_plugin_uses_testflinger_database_and_advertises(real):
    assert real.plugin.db is tf_database.mongo.db
    assert real.app.extensions["testflinger_magic"] is real.plugin
    # Testflinger's own handler lists the magic queue (the plugin advertised it on apply).
    r = requests.get(f"{real.url}/v1/agents/queues", timeout=10)
    assert r.status_code == 200 and "one-gpu-vm" in r.json()
    # The factory's OpenAPI spec still builds with the blueprint mounted.
    assert requests.get(f"{real.url}/openapi.json", timeout=10).status_code == 200


def test_preflight_on_the_real_handler_route(real):
    url = f"{real.url}/v1/queues/one-gpu-vm/agents"
    r = requests.get(url, timeout=10)
    assert r.status_code == 404 and "no agent host has registered" in r.json()["message"]
    real.register()
    r = requests.get(url, timeout=10)
    assert r.status_code == 200
    assert [a["name"] for a in r.json()] == ["magic:one-gpu-vm"]
    assert all(set(a) <= AGENT_OUT for a in r.json())
    # Same roles as Testflinger's get_agents_on_queue: an agent token is refused, with
    # Testflinger's own message, and a garbage token gets Testflinger's 403.
    r = requests.get(url, headers=real.headers("hosts"), timeout=10)
    assert r.status_code == 403 and "admin, manager, contributor" in r.json()["message"]
    r = requests.get(url, headers={"Authorization": "Bearer junk"}, timeout=10)
    assert r.status_code == 403 and r.json()["message"] == "Unable to decode token"
    # Non-magic queues stay with Testflinger's handler.
    r = requests.get(f"{real.url}/v1/queues/gpu-hosts/agents", timeout=10)
    assert {a["name"] for a in r.json()} == {"gpu-host-01", "gpu-host-02"}
    assert requests.get(f"{real.url}/v1/queues/nope/agents", timeout=10).status_code == 404


def test_submit_claim_fence_and_dispatch_handshake(real):
    real.register()
    magic_job = real.submit("one-gpu-vm")
    assert real.kicks == ["one-gpu-vm"]  # the after_request hook saw Testflinger's 200 {"job_id"}
    real.plugin.tick()
    lease = real.db.magic_leases.find_one({})
    assert (lease["device"], lease["state"]) == ("gpu-host-01", "claimed")
    home_job = real.submit("gpu-hosts")
    assert real.kicks == ["one-gpu-vm"]  # not a magic queue

    # The fenced device agent gets Testflinger's "no job" (204 {}) whatever it asks for, and its
    # home queue's job stays waiting for another agent.
    r = real.poll("gpu-host-01", ["gpu-hosts", "one-gpu-vm"])
    assert r.status_code == 204
    assert real.db.jobs.find_one({"job_id": home_job})["result_data"]["job_state"] == "waiting"
    assert real.db.magic_dispatch.count_documents({"agent": "gpu-host-01"}) == 0

    # An agent the plugin does not watch (gpu-host-02 is not a registered device here) costs one
    # gate read and goes through to Testflinger's pop_job untouched: no marker is written.
    r = real.poll("gpu-host-02", ["gpu-hosts"])
    assert r.status_code == 200 and r.json()["job_id"] == home_job
    assert real.db.magic_dispatch.count_documents({"agent": "gpu-host-02"}) == 0

    # A VM agent of the lease posts its state (its cookie) while the lease is only claimed: it
    # is fenced during bring-up (leases.LeaseStore.claim), so it gets 204 and the job waits.
    vm = real.plugin.db.magic_leases.find_one({"_id": lease["_id"]})["vms"][0]["agent_name"]
    assert vm == "gpu-host-01-vm1"
    r = requests.post(f"{real.url}/v1/agents/data/{vm}", headers=real.headers("hosts"),
                      json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""},
                      timeout=10)
    assert r.status_code == 200 and r.cookies.get("agent_name") == vm
    assert real.poll(vm, ["one-gpu-vm"]).status_code == 204
    assert real.db.jobs.find_one({"job_id": magic_job})["result_data"]["job_state"] == "waiting"

    # The agent host's bring-up reports up to active lift the VM agents' fences; the VM agent
    # then pops the magic job through the real handler and after_request writes its marker.
    lease = report_up_to_active(real, lease)
    assert lease["state"] == "active"
    r = real.poll(vm, ["one-gpu-vm"])
    assert r.status_code == 200 and r.json()["job_id"] == magic_job
    assert real.db.jobs.find_one({"job_id": magic_job})["result_data"]["job_state"] == "running"
    marker = real.db.magic_dispatch.find_one({"agent": vm})
    assert (marker["phase"], marker["job_id"], marker["queue"]) == ("done", magic_job, "one-gpu-vm")
    # Testflinger's own 400/401 on a malformed poll are untouched (no marker left behind).
    assert real.poll(vm, []).status_code == 400
    r = requests.get(f"{real.url}/v1/job", params={"queue": "one-gpu-vm"},
                     headers=real.headers("hosts"), timeout=10)
    assert r.status_code == 401
    assert real.db.magic_dispatch.count_documents({"phase": "pending"}) == 0


def test_magic_routes_use_testflinger_auth(real, caplog):
    caplog.set_level(logging.INFO)
    body = {"yaml": MAGIC_YAML, "source": "test"}
    put = f"{real.url}/v1/magic/queues"
    assert requests.put(put, json=body, timeout=10).status_code == 403  # anonymous contributor
    assert requests.put(put, json=body, headers=real.headers("dev"), timeout=10).status_code == 403
    r = requests.put(put, json=body, headers=real.headers("lead"), timeout=10)
    assert r.status_code == 200 and r.json()["applied"] == ["one-gpu-vm"]
    # Exact role membership: an admin is refused on the agent-host protocol.
    reg = f"{real.url}/v1/magic/agent-hosts/host-a"
    r = requests.post(reg, json={"devices": DEVICES, "version": "t"}, headers=real.headers("ops"),
                      timeout=10)
    assert r.status_code == 403 and "agent" in r.json()["message"]
    # Testflinger's OWASP logger recorded the refusals: its require_role ran, not the fallback.
    assert any("authz_fail" in rec.getMessage() for rec in caplog.records)
    # Testflinger's token checks: expired -> 401, bad signature -> 403.
    now = datetime.now(timezone.utc)
    claims = {"sub": "access_token", "iat": now - timedelta(hours=1),
              "exp": now - timedelta(minutes=30),
              "permissions": {"client_id": "hosts", "role": "agent"}}
    expired = jwt.encode(claims, SIGNING_KEY, algorithm="HS256")
    r = requests.get(f"{real.url}/v1/magic/status", headers={"Authorization": f"Bearer {expired}"},
                     timeout=10)
    assert r.status_code == 401
    claims["exp"] = now + timedelta(minutes=5)
    forged = jwt.encode(claims, "not-the-key-0123456789abcdef0123456789", algorithm="HS256")
    r = requests.get(f"{real.url}/v1/magic/status", headers={"Authorization": f"Bearer {forged}"},
                     timeout=10)
    assert r.status_code == 403
    assert requests.get(f"{real.url}/v1/magic/status", timeout=10).status_code == 200
    assert requests.get(f"{real.url}/v1/magic/status", headers=real.headers("hosts"),
                        timeout=10).status_code == 403


def _cli(real, tmp_path, *args):
    """Run the unmodified testflinger-cli (its console-script entry point) against ``real``."""
    pytest.importorskip("testflinger_cli", reason="testflinger-cli is not installed here")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "PATH": "/usr/bin:/bin"}
    code = "import sys; from testflinger_cli import cli; sys.argv[0] = 'testflinger-cli'; cli()"
    return subprocess.run([sys.executable, "-c", code, "--server", real.url, *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_real_cli_submit_to_empty_magic_queue(real, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""\
        job_queue: one-gpu-vm
        provision_data: {distro: jammy}
        test_data: {test_cmds: nvidia-smi -L}
        """))
    # Nothing lendable: the CLI's preflight exits with the plugin's reason.
    out = _cli(real, tmp_path, "submit", "--quiet", str(job))
    assert out.returncode != 0 and "no agent host has registered" in out.stderr
    assert real.db.jobs.count_documents({"job_data.job_queue": "one-gpu-vm"}) == 0
    real.register()
    out = _cli(real, tmp_path, "submit", "--quiet", str(job))
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    uuid.UUID(job_id)
    assert real.db.jobs.find_one({"job_id": job_id})["job_data"]["job_queue"] == "one-gpu-vm"
    assert real.kicks == ["one-gpu-vm"]
    out = _cli(real, tmp_path, "queue-status", "one-gpu-vm")
    assert out.returncode == 0 and "Jobs waiting:    1" in out.stdout, out.stdout + out.stderr
    out = _cli(real, tmp_path, "list-queues")
    assert out.returncode == 0 and "one-gpu-vm" in out.stdout
    out = _cli(real, tmp_path, "cancel", job_id)
    assert out.returncode == 0, out.stderr
    assert real.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "cancelled"


def test_real_cli_names_the_gpu_shortfall(real, tmp_path):
    """The devices the queue selects are registered but too small for one VM: the CLI's
    preflight exits with the limiting fact (dispatch.capacity)."""
    job = tmp_path / "job.yaml"
    job.write_text("job_queue: one-gpu-vm\ntest_data: {test_cmds: nvidia-smi -L}\n")
    r = requests.post(f"{real.url}/v1/magic/agent-hosts/host-a", headers=real.headers("hosts"),
                      json={"devices": [dict(DEVICES[0], gpus=0)], "version": "test"}, timeout=10)
    assert r.status_code == 200, r.text
    out = _cli(real, tmp_path, "submit", "--quiet", str(job))
    assert out.returncode != 0
    assert ("needs 1 GPU per VM; the largest of the 1 device its devices selection picks "
            "has 0") in out.stderr, out.stderr
    assert real.db.jobs.count_documents({"job_data.job_queue": "one-gpu-vm"}) == 0


def test_real_cli_polls_and_reads_results_of_a_magic_job(real, tmp_path):
    """The unmodified CLI's ``poll`` and ``results`` on a magic job that a VM agent of an active
    lease ran; the agent's side is played over Testflinger's own endpoints as testflinger-agent
    sends them (TESTFLINGER.md §3.5: result posts, output log fragments, outcome ``complete``)."""
    real.register()
    job = tmp_path / "job.yaml"
    job.write_text("job_queue: one-gpu-vm\ntest_data: {test_cmds: nvidia-smi -L}\n")
    out = _cli(real, tmp_path, "submit", "--quiet", str(job))
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    real.plugin.tick()
    lease = real.db.magic_leases.find_one({})
    lease = report_up_to_active(real, lease)
    vm = lease["vms"][0]["agent_name"]
    agent = real.headers("hosts")
    requests.post(f"{real.url}/v1/agents/data/{vm}", headers=agent, timeout=10,
                  json={"state": "waiting", "queues": ["one-gpu-vm"], "job_id": ""})
    r = real.poll(vm, ["one-gpu-vm"])
    assert r.status_code == 200 and r.json()["job_id"] == job_id
    r = requests.post(f"{real.url}/v1/result/{job_id}", headers=agent, timeout=10,
                      json={"job_state": "test"})
    assert r.status_code == 200, r.text
    r = requests.post(f"{real.url}/v1/result/{job_id}/log/output", headers=agent, timeout=10,
                      json={"fragment_number": 0, "phase": "test",
                            "timestamp": datetime.now(timezone.utc).isoformat(),
                            "log_data": "GPU 0: NVIDIA H100 (UUID: GPU-1)\n"})
    assert r.status_code == 200, r.text
    r = requests.post(f"{real.url}/v1/result/{job_id}", headers=agent, timeout=10,
                      json={"job_state": "complete", "status": {"test": 0}})
    assert r.status_code == 200, r.text
    out = _cli(real, tmp_path, "poll", job_id)
    assert out.returncode == 0 and "GPU 0: NVIDIA H100" in out.stdout, out.stdout + out.stderr
    out = _cli(real, tmp_path, "status", job_id)
    assert out.returncode == 0 and out.stdout.strip() == "complete"
    out = _cli(real, tmp_path, "results", job_id)
    assert out.returncode == 0, out.stderr
    assert '"test_status": 0' in out.stdout and "NVIDIA H100" in out.stdout, out.stdout


def test_wsgi_module_builds_the_real_app(monkeypatch, tmp_path):
    """``testflinger_magic.server.wsgi`` as gunicorn imports it: Testflinger's secrets-store setup
    and factory (not in TESTING mode), then init_app with the definitions file from the
    environment. Mongo is mongomock and the metrics port is not opened."""
    for var in ("MONGODB_URI", "MONGODB_HOST", "TESTFLINGER_VAULT_URL",
                "TESTFLINGER_SECRETS_MASTER_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JWT_SIGNING_KEY", SIGNING_KEY)
    client = mongomock.MongoClient()

    def fake_setup_mongodb(app):  # Testflinger's would connect to MONGODB_URI
        monkeypatch.setattr(tf_database, "mongo", client)

    monkeypatch.setattr(tf_application, "setup_mongodb", fake_setup_mongodb)
    monkeypatch.setattr(tf_application.metrics, "start_http_server", lambda *a, **k: None)
    defs = tmp_path / "magic-queues.yaml"
    defs.write_text(MAGIC_YAML)
    monkeypatch.setenv("TESTFLINGER_MAGIC_QUEUES", str(defs))
    monkeypatch.setenv("TESTFLINGER_MAGIC_TICK", "3600")
    monkeypatch.delitem(sys.modules, "testflinger_magic.server.wsgi", raising=False)
    wsgi = importlib.import_module("testflinger_magic.server.wsgi")
    try:
        wsgi.plugin.stop()  # joins the ticker; requests below run alone on mongomock
        assert wsgi.app.extensions["testflinger_magic"] is wsgi.plugin
        assert wsgi.plugin.db is client.db
        assert [q.name for q in wsgi.plugin.definitions()] == ["one-gpu-vm"]
        test_client = wsgi.app.test_client()
        assert "one-gpu-vm" in test_client.get("/v1/agents/queues").get_json()
        r = test_client.get("/v1/magic/queues")
        assert r.status_code == 200
        assert [q["_id"] for q in r.get_json()["queues"]] == ["one-gpu-vm"]
    finally:
        sys.modules.pop("testflinger_magic.server.wsgi", None)


# ------------------------------------------------------------------ the real testflinger-agent

def _render_vm_agent(tmp_path, server_url, queue, **over):
    """Render a VM agent folder from agent_configs/maas2-vm the way the daemon does."""
    from test_agents import TEMPLATE, context

    from testflinger_magic.agent_host.agents import render_agent_folder

    return render_agent_folder(TEMPLATE, tmp_path / "agents" / "gpu-01-vm1", context(
        agent_id="gpu-01-vm1", server_address=server_url, queue=queue,
        base_dir=str(tmp_path / "run"), polling_interval=1, **over))


def test_rendered_vm_agent_config_passes_the_real_agent_schema(tmp_path):
    agent_schema = pytest.importorskip("testflinger_agent.schema",
                                       reason="testflinger-agent is not installed here")
    import yaml

    from testflinger_magic.agent_host.agents import AGENT_SCHEMA

    dest = _render_vm_agent(tmp_path, "http://127.0.0.1:1", "one-gpu-vm")
    conf = yaml.safe_load((dest / "testflinger-agent.conf").read_text())
    validated = agent_schema.validate(conf)  # voluptuous: raises on unknown keys or bad types
    assert validated["agent_id"] == "gpu-01-vm1" and validated["job_queues"] == ["one-gpu-vm"]
    # Our offline check knows exactly the real agent's keys.
    assert set(AGENT_SCHEMA) == {str(k) for k in agent_schema.SCHEMA_V1}


def _wait_for(predicate, what, limit=120.0):
    """Poll ``predicate`` until true (a liveness guard, not a timing assertion)."""
    import time

    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"never happened: {what}")


def test_real_agent_runs_a_job_on_the_lab_job_service(tmp_path):
    """The real ``testflinger-agent``, configured from the maas2-vm template with trivial phase
    commands, against the lab job service with the plugin mounted: it registers, pops a job of
    the magic queue through the dispatch hooks, runs the phases, posts logs, provision log,
    artifacts and outcome; once its lease drains, its polls are refused and the next job stays
    waiting. It is the VM agent of a real lease (device ``gpu-01`` lent and brought up to
    ``active`` by the agent-host protocol), so every tick a submission kicks keeps it watched."""
    pytest.importorskip("testflinger_agent", reason="testflinger-agent is not installed here")
    import json
    import tarfile

    import yaml

    from testflinger_magic.lab import httpserve
    from testflinger_magic.lab.jobservice import create_app

    key = "real-agent-test-signing-key-0123456789abcdef"
    clients = {"hosts": {"secret": "hosts-secret", "role": "agent"},
               "lead": {"secret": "lead-secret", "role": "manager"}}
    app = create_app(signing_key=key, clients=clients,
                     plugin_options={"definitions": queues.load_text(MAGIC_YAML),
                                     "start_ticker": False})
    plugin = app.extensions["jobservice"]["plugin"]
    db = app.extensions["jobservice"]["db"]
    with httpserve.serve(app) as handle:
        url = handle.url
        tokens = {c: requests.post(f"{url}/v1/oauth2/token", auth=(c, f"{c}-secret"),
                                   timeout=10).json() for c in ("hosts", "lead")}
        hosts = {"Authorization": f"Bearer {tokens['hosts']['access_token']}"}
        # The bare-metal device agent is up and idle on its home queue (only then is it lendable).
        r = requests.post(f"{url}/v1/agents/data/gpu-01", headers=hosts, timeout=10,
                          json={"state": "waiting", "queues": ["gpu-hosts"], "job_id": ""})
        assert r.status_code == 200, r.text
        r = requests.post(f"{url}/v1/magic/agent-hosts/host-a", headers=hosts, timeout=10,
                          json={"devices": [{"agent_name": "gpu-01", "maas_system_id": "abc123",
                                             "gpus": 1, "home_queues": ["gpu-hosts"]}],
                                "version": "test"})
        assert r.status_code == 200, r.text
        job_id = requests.post(f"{url}/v1/job", json={
            "job_queue": "one-gpu-vm", "provision_data": {"distro": "jammy"},
            "test_data": {"test_cmds": "true"}}, timeout=10).json()["job_id"]
        plugin.tick()  # lends gpu-01 (or finds it lent by the tick the submission kicked)
        (lease,) = db.magic_leases.find({})
        for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
            r = requests.post(f"{url}/v1/magic/leases/{lease['_id']}/report", headers=hosts,
                              json={"agent_host": "host-a", "generation": lease["generation"],
                                    "state": lease["state"], "result": "ok",
                                    "to_state": to_state}, timeout=10)
            assert r.status_code == 200, r.text
            lease = r.json()
        assert [vm["agent_name"] for vm in lease["vms"]] == ["gpu-01-vm1"]
        dest = _render_vm_agent(tmp_path, url, "one-gpu-vm", lease_id=lease["_id"])
        conf_path = dest / "testflinger-agent.conf"
        conf = yaml.safe_load(conf_path.read_text())
        conf.update(setup_command="echo setup $agent_id",
                    provision_command="echo provision $provision_type",
                    test_command="echo test-phase; mkdir -p artifacts; echo hi > artifacts/a.txt",
                    allocate_command="true", reserve_command="true",
                    cleanup_command="echo cleanup")
        conf_path.write_text(yaml.safe_dump(conf))
        token_file = tmp_path / "refresh_token"
        token_file.write_text(json.dumps({"refresh_token": tokens["hosts"]["refresh_token"]}))
        log = (tmp_path / "agent.log").open("w")
        agent = subprocess.Popen(
            [sys.executable, "-c", "import sys; from testflinger_agent.cmd import main; "
             "sys.exit(main())", "-c", str(conf_path), "--token-file", str(token_file)],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            def state(jid):
                doc = db.jobs.find_one({"job_id": jid}) or {}
                return doc.get("result_data", {}).get("job_state")

            _wait_for(lambda: state(job_id) == "complete", "the real agent completed the job")
            result = requests.get(f"{url}/v1/result/{job_id}", timeout=10).json()
            assert result["test_status"] == 0 and "test-phase" in result["test_output"]
            assert "provision maas2" in result["provision_output"]
            doc = db.agents.find_one({"name": "gpu-01-vm1"})
            assert doc["queues"] == ["one-gpu-vm"] and doc["location"] == "vm on gpu-01"
            assert doc["identifier"] == lease["_id"]
            assert doc["provision_streak_type"] == "pass"
            marker = db.magic_dispatch.find_one({"agent": "gpu-01-vm1", "job_id": job_id})
            assert marker["phase"] == "done" and marker["queue"] == "one-gpu-vm"
            r = requests.get(f"{url}/v1/result/{job_id}/artifact", timeout=10)
            assert r.status_code == 200
            artifact = tmp_path / "artifact.tar.gz"
            artifact.write_bytes(r.content)
            with tarfile.open(artifact) as tar:
                assert "artifacts/a.txt" in tar.getnames()

            # Drained: the lease's VM agent is fenced, its next polls get the plugin's 204 and
            # the next job stays waiting.
            r = requests.post(f"{url}/v1/magic/leases/{lease['_id']}/drain", timeout=10,
                              headers={"Authorization":
                                       f"Bearer {tokens['lead']['access_token']}"},
                              json={"reason": "test"})
            assert r.status_code == 200 and r.json()["state"] == "draining", r.text
            second = requests.post(f"{url}/v1/job", json={"job_queue": "one-gpu-vm"},
                                   timeout=10).json()["job_id"]
            registry = plugin.metrics.registry

            def refused():
                return registry.get_sample_value("magic_dispatch_refusals_total",
                                                 {"reason": "fenced"}) or 0

            before = refused()
            _wait_for(lambda: refused() >= before + 2, "the fenced agent polled twice")
            assert state(second) == "waiting"
        finally:
            agent.terminate()
            agent.wait(timeout=30)
            log.close()


# ------------------------------------------------------------------ authorization, real auth

def _real_app(monkeypatch, database, *, oidc=False, plugin=True):
    """Testflinger's factory app on ``database`` (mongomock), with the plugin unless ``plugin``
    is False. ``oidc``: Testflinger's OIDC configured (``oidc/__init__.py::app_register_oidc``
    needs only the three settings; the provider's metadata is fetched on first use, which no
    request here makes), so ``require_role`` answers 401 to an unauthenticated caller."""
    if oidc:
        monkeypatch.setenv("OIDC_CLIENT_ID", "testflinger")
        monkeypatch.setenv("OIDC_PROVIDER_ISSUER", "http://127.0.0.1:9")
        monkeypatch.setenv("WEB_SECRET_KEY", "web-secret-key-0123456789abcdef")
    else:
        for var in ("OIDC_CLIENT_ID", "OIDC_PROVIDER_ISSUER", "WEB_SECRET_KEY"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JWT_SIGNING_KEY", SIGNING_KEY)
    monkeypatch.setattr(tf_database, "mongo", database)
    app = tf_application.create_flask_app(TestingConfig)
    assert (app.oauth is not None) == oidc
    if plugin:
        magic = init_app(app, definitions=queues.load_text(MAGIC_YAML), start_ticker=False)
        magic.kick = lambda *a, **k: None
    return app


def test_dispatch_hooks_answer_refused_callers_as_real_testflinger(monkeypatch):
    """tests/test_dispatch_auth.py's matrix on the real server: every caller Testflinger refuses
    on a hooked route gets exactly the answer of Testflinger without the plugin, and the plugin
    writes nothing for it; with OIDC on, an anonymous poll of a fenced agent is 401, not 204."""
    import test_dispatch_auth as da

    monkeypatch.setattr(da, "KEY", SIGNING_KEY)
    callers = {name: dict(h) for name, h in da.CALLERS.items()}
    for name in ("expired agent", "contributor", "manager", "admin", "agent"):
        role = "agent" if name == "expired agent" else name
        ttl = -3600 if name == "expired agent" else 600
        from testflinger_magic.server import auth

        callers[name] = {"Authorization": "Bearer "
                         + auth.issue_token(SIGNING_KEY, f"{role}-client", role, ttl=ttl)}
    for oidc in (False, True):
        client = mongomock.MongoClient()
        database = client.db
        seed(database)
        magic = _real_app(monkeypatch, client, oidc=oidc)
        plain = _real_app(monkeypatch, client, oidc=oidc, plugin=False)
        store = magic.extensions["testflinger_magic"].store
        store.gates.sync([da.FREE])
        store.fence_agents("lease-x", [da.FENCED], kind="device", reason="lent")
        database.jobs.insert_one({"job_id": "8d3f4b8e-0000-4000-8000-000000000001",
                                  "created_at": datetime.now(timezone.utc), "job_priority": 0,
                                  "job_data": {"job_queue": "gpu-hosts", "exclude_agents": []},
                                  "result_data": {"job_state": "waiting"}})

        def call(app, route, headers, agent):
            c = app.test_client()
            c.set_cookie("agent_name", agent)
            method, path, body = da.ROUTES[route]
            return c.open(path, method=method, headers=headers, json=body)

        refused = [(route, caller) for route in sorted(da.ROUTES) for caller in sorted(callers)
                   if caller not in da.SERVED[route] or (oidc and caller == "anonymous")]
        assert refused
        for route, caller in refused:
            want = call(plain, route, callers[caller], da.FREE)
            assert want.status_code in (401, 403), (oidc, route, caller, want.status_code)
            for agent in (da.FENCED, da.FREE):
                before = da.snapshot(database)
                got = call(magic, route, callers[caller], agent)
                assert (got.status_code, got.get_json(silent=True)) == \
                    (want.status_code, want.get_json(silent=True)), (oidc, route, caller, agent)
                assert da.snapshot(database) == before, (oidc, route, caller, agent)
        # A served agent is gated: fenced -> 204 with nothing written; free -> the job, marked.
        before = da.snapshot(database)
        assert call(magic, "GET /v1/job", callers["agent"], da.FENCED).status_code == 204
        assert da.snapshot(database) == before
        r = call(magic, "GET /v1/job", callers["agent"], da.FREE)
        assert r.status_code == 200 and r.get_json()["job_queue"] == "gpu-hosts"
        assert [m["agent"] for m in database.magic_dispatch.find()] == [da.FREE]
        if oidc:
            r = call(magic, "GET /v1/job", {}, da.FENCED)
            assert r.status_code == 401
            assert r.get_json()["message"] == "Authentication is required for specified endpoint"


def test_magic_routes_authorization_matrix_on_real_testflinger(monkeypatch):
    """tests/test_server_authz.py's matrix, every /v1/magic route by every caller, with
    Testflinger's own authenticate/require_role deciding (each call on a fresh database)."""
    import test_server_authz as sa

    def fresh():
        client = mongomock.MongoClient()
        seed(client.db)
        app = _real_app(monkeypatch, client)
        c = app.test_client()
        r = c.post("/v1/magic/agent-hosts/host-a", headers=sa.headers_for("agent", SIGNING_KEY),
                   json={"devices": sa.DEVICES})
        assert r.status_code == 200, r.get_data(as_text=True)
        r = c.post("/v1/magic/leases", headers=sa.headers_for("admin", SIGNING_KEY),
                   json={"device": "gpu-host-01", "queue": "one-gpu-vm"})
        assert r.status_code == 201, r.get_data(as_text=True)
        return app, client.db, r.get_json()["_id"]

    app, _, _ = fresh()
    assert sa.magic_routes(app) == set(sa.MATRIX)
    wrong = {}
    for route, (path, body, allowed) in sorted(sa.MATRIX.items()):
        for caller in sa.CALLERS:
            app, database, lease_id = fresh()
            before = {n: list(database[n].find({})) for n in (
                "magic_agent_hosts", "magic_devices", "magic_leases", "magic_queues")}
            r = app.test_client().open(path.replace("/L", f"/{lease_id}"), method=route[0],
                                       headers=sa.headers_for(caller, SIGNING_KEY), json=body)
            if r.status_code != allowed.get(caller, sa.DEFAULT):
                wrong[(route, caller)] = (r.status_code, r.get_data(as_text=True)[:200])
            if r.status_code in (401, 403):
                assert {n: list(database[n].find({})) for n in before} == before, (route, caller)
                assert (r.get_json(silent=True) or {}).get("message"), (route, caller)
    assert wrong == {}

    # With OIDC on, Testflinger's require_role answers 401 to a caller without a token on every
    # route it guards; only the open routes (metrics, OpenAPI) still answer.
    open_routes = {r for r, (_, _, allowed) in sa.MATRIX.items() if set(allowed) == set(sa.CALLERS)}
    assert open_routes == {("GET", "/v1/magic/metrics"), ("GET", "/v1/magic/openapi.json")}
    for route, (path, body, _) in sorted(sa.MATRIX.items()):
        client = mongomock.MongoClient()
        seed(client.db)
        app = _real_app(monkeypatch, client, oidc=True)
        r = app.test_client().open(path.replace("/L", "/no-such-lease"), method=route[0],
                                   json=body)
        assert r.status_code == (200 if route in open_routes else 401), (route, r.status_code)


def test_refusals_and_body_limit_on_real_testflinger(monkeypatch):
    """The fallback's refusals (test_server_authz.REFUSALS, TRIAL12 F4) are the real server's
    word for word; an oversized operator body is 413 after Testflinger's authentication, unread
    (TRIAL12 F5)."""
    import io

    import test_server_authz as sa

    from testflinger_magic.server.apifields import MAX_BODY

    client = mongomock.MongoClient()
    seed(client.db)
    c = _real_app(monkeypatch, client).test_client()
    for header, status, message in sa.REFUSALS:
        r = c.get("/v1/magic/status", headers=sa.refusal_headers(header, SIGNING_KEY))
        assert (r.status_code, r.get_json()["message"]) == (status, message), header
    for caller, status in (("contributor", 403), ("admin", 413)):
        body = io.BytesIO(b"{}")
        r = c.put("/v1/magic/queues", input_stream=body, content_type="application/json",
                  headers=sa.headers_for(caller, SIGNING_KEY),
                  environ_overrides={"CONTENT_LENGTH": str(MAX_BODY + 1)})
        assert r.status_code == status and body.tell() == 0, r.get_data(as_text=True)
    assert r.get_json()["message"].startswith("Request Entity Too Large: ")


def test_init_app_on_an_app_built_for_testing_says_mongodb_is_missing(monkeypatch):
    """Testflinger's ``create_flask_app`` with TESTING set skips ``setup_mongodb``, so its
    ``mongo.db`` is None: the plugin refuses with the reason rather than a TypeError."""
    monkeypatch.setenv("JWT_SIGNING_KEY", SIGNING_KEY)
    monkeypatch.setattr(tf_database.mongo, "db", None, raising=False)
    app = tf_application.create_flask_app(TestingConfig)
    with pytest.raises(RuntimeError, match="database is not connected"):
        init_app(app, start_ticker=False)
