"""Shared fixtures: a Testflinger-v1-shaped Flask app on mongomock, served over real HTTP.

``mini_testflinger(db)`` mimics the few v1 calls agents and testflinger-cli use, with the
behaviour read in canonical/testflinger ``server/src/testflinger/api/v1.py`` and ``database.py``
(TESTFLINGER.md §1.5, §1.8, §4.2): POST /v1/job (job_builder shape), GET /v1/job (pop_job: one
atomic find_one_and_update, priority order, 204 ``{}`` when empty), GET /v1/queues/<q>/agents,
POST/GET /v1/agents/data/<name> (upsert + ``agent_name`` cookie), GET /v1/agents/queues,
GET/POST /v1/result/<id>, POST /v1/job/<id>/action. Auth is modelled only where the plugin hooks
in: GET /v1/job needs the ``agent`` role and GET /v1/queues/<q>/agents a contributor, manager or
admin, as in Testflinger (``@authenticate`` + ``@require_role``; no header = anonymous
contributor), through the
plugin's Testflinger-compatible fallback (server/auth.py). The lab job service
(testflinger_magic.lab.jobservice) models every route's roles.
"""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timezone

import pytest
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from testflinger_magic import db as tfdb

TERMINAL = ("complete", "completed", "cancelled")


def mini_testflinger(database) -> Flask:
    """Return a Flask app answering Testflinger's v1 routes on ``database``."""
    from apiflask.exceptions import HTTPError

    from testflinger_magic.server import auth

    app = Flask("mini-testflinger")
    app.config["JWT_SIGNING_KEY"] = "test-signing-key-of-32-bytes-or-more!"

    @app.errorhandler(HTTPError)
    def http_error(exc):  # apiflask's error body, as an APIFlask app answers abort()
        return jsonify(detail=exc.detail, message=exc.message), exc.status_code

    @app.get("/v1/")
    def home():
        return "Testflinger Server"

    @app.post("/v1/job")
    def job_post():
        data = request.get_json()
        if not data or "job_queue" not in data:
            return jsonify(message="job_queue required"), 422
        data.setdefault("exclude_agents", [])
        job = {
            "created_at": datetime.now(timezone.utc),
            "result_data": {"job_state": "waiting"},
            "job_priority": data.get("job_priority", 0),
            "job_id": str(uuid.uuid4()),
            "job_data": data,
        }
        database.jobs.insert_one(job)
        return jsonify(job_id=job["job_id"])

    @app.get("/v1/job")
    @auth.require(*auth.AGENT_ROLES)
    def job_get():
        queues = request.args.getlist("queue")
        if not queues:
            return jsonify(message="No queue(s) specified in request"), 400
        agent = request.cookies.get("agent_name")
        if not agent:
            return jsonify(message="Agent not identified"), 401
        doc = database.jobs.find_one_and_update(
            {
                "result_data.job_state": "waiting",
                "job_data.job_queue": {"$in": queues},
                "job_data.exclude_agents": {"$nin": [agent]},
            },
            {"$set": {"result_data.job_state": "running"}},
            sort=[("job_priority", -1)],
        )
        if not doc:
            return jsonify({}), 204
        job = dict(doc["job_data"], job_id=doc["job_id"])
        database.jobs.update_one(
            {"job_id": doc["job_id"]}, {"$set": {"started_at": datetime.now(timezone.utc)}}
        )
        return jsonify(job)

    @app.post("/v1/job/<job_id>/action")
    def job_action(job_id):
        doc = database.jobs.find_one({"job_id": job_id})
        if not doc:
            return jsonify(message="not found"), 404
        if doc["result_data"]["job_state"] in TERMINAL:
            return jsonify(message="already terminal"), 400
        database.jobs.update_one(
            {"job_id": job_id}, {"$set": {"result_data.job_state": "cancelled"}}
        )
        return "OK"

    @app.get("/v1/result/<job_id>")
    def result_get(job_id):
        doc = database.jobs.find_one({"job_id": job_id})
        if not doc:
            return "", 204
        return jsonify(doc["result_data"])

    @app.post("/v1/result/<job_id>")
    def result_post(job_id):
        data = request.get_json()
        database.jobs.update_one(
            {"job_id": job_id},
            {"$set": {f"result_data.{k}": v for k, v in data.items()}},
        )
        return "OK"

    @app.get("/v1/queues/<queue>/agents")
    @auth.require(*auth.READ_ROLES)
    def queue_agents(queue):
        agents = list(database.agents.find({"queues": queue}, {"_id": 0}))
        if not agents:
            return jsonify(message=f"Queue '{queue}' does not exist."), 404
        return jsonify(agents)

    @app.get("/v1/agents/queues")
    def agents_queues():
        return jsonify(
            {q["name"]: q.get("description", "") for q in database.queues.find({}, {"_id": 0})}
        )

    @app.get("/v1/agents/data/<name>")
    def agent_get(name):
        doc = database.agents.find_one({"name": name}, {"_id": 0})
        if not doc:
            return jsonify(message="not found"), 404
        return jsonify(doc)

    @app.post("/v1/agents/data/<name>")
    def agent_post(name):
        data = request.get_json()
        log = data.pop("log", [])
        data["name"] = name
        data["updated_at"] = datetime.now(timezone.utc)
        database.agents.update_one(
            {"name": name},
            {"$set": data, "$push": {"log": {"$each": log, "$slice": -100}}},
            upsert=True,
        )
        resp = jsonify(status="OK")
        resp.set_cookie("agent_name", name, httponly=True, samesite="Strict")
        return resp

    return app


def seed(database, *, devices=("gpu-host-01", "gpu-host-02"), home_queue="gpu-hosts") -> None:
    """Seed Testflinger-shaped documents: idle device agents on their home queue, that queue
    advertised, and one finished job (so the collections look used)."""
    now = datetime.now(timezone.utc)
    for name in devices:
        database.agents.insert_one(
            {
                "name": name,
                "state": "waiting",
                "comment": "",
                "queues": [home_queue],
                "location": "lab",
                "provision_type": "maas2",
                "identifier": name,
                "job_id": "",
                "log": [],
                "updated_at": now,
            }
        )
    database.queues.insert_one({"name": home_queue, "description": "bare metal", "updated_at": now})
    database.jobs.insert_one(
        {
            "job_id": str(uuid.uuid4()),
            "created_at": now,
            "job_priority": 0,
            "job_data": {"job_queue": home_queue, "exclude_agents": []},
            "result_data": {"job_state": "complete"},
        }
    )


class Served:
    """A WSGI app on 127.0.0.1:<ephemeral port> in a thread; ``.url`` is its base URL."""

    def __init__(self, app):
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mongo():
    """A fresh locked mongomock database seeded with Testflinger-shaped documents."""
    database = tfdb.connect()
    seed(database)
    return database


@pytest.fixture
def serve():
    """Factory: ``serve(app) -> Served``; every server is shut down after the test."""
    started = []

    def start(app):
        s = Served(app)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


MAGIC_YAML = """\
magic_queues:
  one-gpu-vm:
    description: One VM with one passthrough GPU
    devices:
      home_queues: [gpu-hosts]
    vms_per_device: gpus
    vm: {gpus: 1, vcpus: 2, memory_mib: 4096, disk_gib: 20}
    policy:
      max_devices: 2
      max_starting: 1
      idle_timeout: 10m
"""


class MagicStack:
    """A Testflinger-like app with the plugin mounted (no ticker), served on 127.0.0.1.

    ``server``: ``"mini"`` (:func:`mini_testflinger`), ``"old"`` (the lab job service with the
    contract of the commit read, TESTFLINGER.md §1) or ``"newer"`` (the lab job service with the
    behaviours of testflinger#1253, ``create_app(newer=True)``). ``.newer`` says which agents
    to imitate (a newer agent never posts ``job_id``)."""

    def __init__(self, database, serve, yaml_text=MAGIC_YAML, clock=None, server="mini"):
        import time

        from testflinger_magic import queues
        from testflinger_magic.lab.jobservice import create_app
        from testflinger_magic.server import auth, init_app

        self.db = database
        self.newer = server == "newer"
        if server == "mini":
            self.app = mini_testflinger(database)
        else:
            self.app = create_app(database, mount_plugin=False, newer=self.newer,
                                  signing_key="test-signing-key-of-32-bytes-or-more!")
        self.plugin = init_app(self.app, database, definitions=queues.load_text(yaml_text),
                               start_ticker=False, clock=clock or time.time)
        self.server = serve(self.app)
        self.url = self.server.url
        key = self.app.config["JWT_SIGNING_KEY"]
        self.tokens = {role: auth.issue_token(key, f"{role}-client", role)
                       for role in ("admin", "manager", "contributor", "agent")}

    def headers(self, role):
        """Authorization header for ``role``."""
        return {"Authorization": f"Bearer {self.tokens[role]}"}


@pytest.fixture
def magic(mongo, serve):
    """A :class:`MagicStack` on the seeded mongomock database."""
    stack = MagicStack(mongo, serve)
    yield stack
    stack.plugin.stop()


def report_up_to_active(url: str, headers: dict, lease: dict, host: str = "host-a") -> dict:
    """Report an agent host's bring-up steps claimed -> active for ``lease`` over real HTTP to
    the server at ``url`` (as ``host``'s daemon does, with ``headers`` of an agent client);
    returns the active lease."""
    import requests  # noqa: PLC0415

    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        r = requests.post(f"{url}/v1/magic/leases/{lease['_id']}/report", headers=headers,
                          json={"agent_host": host, "generation": lease["generation"],
                                "state": lease["state"], "result": "ok", "to_state": to_state},
                          timeout=10)
        assert r.status_code == 200, r.text
        lease = r.json()
    return lease
