"""A Testflinger-API-compatible job service for the embedded lab and the tests.

The real Testflinger server is not installable from the package registries, so the lab serves the
``/v1`` calls that testflinger-cli and testflinger-agent make, with Testflinger's document shapes
(collections ``jobs``, ``agents``, ``queues``, ``logs``, ``client_permissions``,
``refresh_tokens``, ``queue_wait_times``), status codes and role checks. Source of every rule:
canonical/testflinger ``server/src/testflinger/api/v1.py``, ``database.py``, ``api/schemas.py``,
``api/auth.py``, ``logs.py`` (summary in TESTFLINGER.md §1-§2). View functions keep Testflinger's
names, so ``request.endpoint`` is the same (``v1.job_get``, ``v1.job_post``,
``v1.get_agents_on_queue``...) and the plugin's hooks work on both servers.

Attachments and artifacts are kept as bytes in the collection ``lab_files`` (Testflinger uses
GridFS ``fs``). Not served: secrets (a job with ``test_data.secrets`` gets 422 "No secrets store",
as Testflinger without a store), job search, restricted-queue and client-permission management,
webhooks, the OIDC login flow (``oidc=True`` models only what it changes for the routes: no
anonymous callers) and ``GET /v1/result/<id>/status`` (#1285). ``provision_data`` is checked to be a mapping (or null)
only.

Two server generations (``create_app(newer=...)``): by default the contract of the commit read
(fe381ff, TESTFLINGER.md §1); with ``newer=True`` what testflinger#1253 changed (§9): ``pop_job``
stamps ``result_data.agent_id``, ``job_get`` sets ``agents.job_id`` itself (``set_agent_job``),
and a cancel or a terminal result ``$unset``s it (``clear_agent_job``); and the server-side job
events of testflinger#1297-#1299 (:mod:`.jobservice_events`: the ``jobs_events`` collection,
``job_assigned`` in ``job_get``..., ``GET /v1/events/job/<id>``).

Parts: :mod:`.jobservice_schemas` (request schemas, ``api/schemas.py``), :mod:`.jobservice_auth`
(tokens, roles and permission checks, ``api/auth.py``, the token views, and the request context
the parts share), :mod:`.jobservice_agents` (the agent and queue routes), :mod:`.jobservice_events`
(server-side job events, newer only); this module builds the app and serves the job, result and
log routes.
"""

from __future__ import annotations

import secrets
import uuid
from datetime import datetime, timezone
from http import HTTPStatus

from apiflask import APIBlueprint, APIFlask, abort
from flask import current_app, g, jsonify, request
from flask.json.provider import DefaultJSONProvider
from marshmallow import ValidationError

from testflinger_magic import db as dbmod
from testflinger_magic import tfstates
from testflinger_magic.lab import jobservice_agents as agents
from testflinger_magic.lab import jobservice_events as events
from testflinger_magic.lab.jobservice_agents import (  # noqa: F401 (re-exported)
    AGENT_OUT_FIELDS, _restricted_to, percentiles)
from testflinger_magic.lab.jobservice_auth import (  # noqa: F401 (add_client: re-exported)
    AGENT_ONLY, ALL_ROLES, CONTRIBUTOR_ROLES, _authenticate,
    _check_permissions, _db, _naive_utc, _newer, _now, add_client, refresh_access_token,
    retrieve_token, roles)
from testflinger_magic.lab.jobservice_schemas import (
    LOG_TYPES, TEST_PHASES, ActionInSchema, JobSchema, LogPostSchema, LogQuerySchema,
    ResultPostSchema, _json_body)


# ---------------------------------------------------------------- app, JSON, database


class _ISODatetimeProvider(DefaultJSONProvider):
    """Datetimes as ISO 8601 UTC with a ``Z`` suffix, as Testflinger's ``providers.py``."""

    def default(self, o):
        if isinstance(o, datetime):
            if o.tzinfo is not None:
                o = o.astimezone(timezone.utc).replace(tzinfo=None)
            return o.isoformat(timespec="seconds") + "Z"
        return super().default(o)


def _clear_agent_job(job_id: str) -> None:
    """``database.clear_agent_job`` (testflinger#1253, newer only): ``$unset`` the ``job_id`` of
    the agent running ``job_id`` when the job is cancelled or gets a terminal result."""
    if _newer():
        _db().agents.update_many({"job_id": job_id}, {"$unset": {"job_id": ""}})


def create_indexes(database) -> None:
    """The unique and lookup indexes Testflinger creates (``database.create_indexes``), no TTLs."""
    database.agents.create_index("name", unique=True)
    database.client_permissions.create_index("client_id", unique=True)
    database.refresh_tokens.create_index("refresh_token", unique=True)
    database.jobs.create_index("job_id")
    database.logs.create_index([("job_id", 1), ("log_type", 1), ("phase", 1),
                                ("fragment_number", 1)])


def create_app(db=None, *, signing_key: str | None = None, clients: dict | None = None,
               mount_plugin: bool = True, plugin_options: dict | None = None,
               newer: bool = False, oidc: bool = False) -> APIFlask:
    """Build the job service.

    ``db``: a database handle from :func:`testflinger_magic.db.connect` (default: a fresh mongomock
    one). ``signing_key``: HS256 key for access tokens, kept in ``app.config["JWT_SIGNING_KEY"]``
    (default: random). ``clients``: ``{client_id: {"secret": str, "role": str, optional
    "max_priority", "allowed_queues", "max_reservation_time"}}`` written to
    ``client_permissions``. ``mount_plugin``: then ``testflinger_magic.server.init_app(app, db=db,
    **plugin_options)`` runs after the ``v1`` blueprint is registered; an ImportError propagates.

    ``newer``: the server behaviours of testflinger#1253 (module docstring). ``oidc``: as a
    Testflinger with OIDC configured, a request without a token is not an anonymous contributor:
    ``require_role`` answers 401 (``api/auth.py``).

    The handle is at ``app.extensions["jobservice"]["db"]``; the plugin's return value, if any, at
    ``app.extensions["jobservice"]["plugin"]``; the authentication function the routes use at
    ``["authenticate"]`` (the plugin's hooks call it to learn whether a caller would be served).
    """
    if db is None:
        db = dbmod.connect()
    app = APIFlask(__name__, title="testflinger-magic lab job service", version="1",
                   spec_path=None, docs_path=None)
    app.json = _ISODatetimeProvider(app)
    app.url_map.strict_slashes = False
    app.config["JWT_SIGNING_KEY"] = signing_key or secrets.token_hex(32)
    app.extensions["jobservice"] = {"db": db, "plugin": None, "newer": bool(newer),
                                    "oidc": bool(oidc), "authenticate": _authenticate}
    create_indexes(db)
    if newer:
        events.create_indexes(db)
    for client_id, spec in (clients or {}).items():
        spec = dict(spec)
        add_client(db, client_id, spec.pop("secret"), spec.pop("role", tfstates.ROLE_CONTRIBUTOR),
                   **spec)
    app.register_blueprint(v1, url_prefix="/v1")
    if mount_plugin:
        from testflinger_magic.server import init_app  # noqa: PLC0415 (optional, may be absent)

        app.extensions["jobservice"]["plugin"] = init_app(app, db=db, **(plugin_options or {}))
    return app


# ---------------------------------------------------------------- helpers


def _valid_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- /v1 routes (api/v1.py)

v1 = APIBlueprint("v1", __name__)


@v1.get("/")
def home():
    """Identify ourselves (agents use this as the health check)."""
    return "Testflinger Server v1 (testflinger-magic lab job service)"


def get_agents_on_queue(queue: str) -> list[dict]:
    """Agent documents (without ``_id``) whose ``queues`` hold ``queue``, whatever their state:
    Testflinger's ``database.get_agents_on_queue``. ``job_post`` looks it up in this module at
    each call, as v1.py does in ``testflinger.database``, so the plugin's
    :mod:`testflinger_magic.server.excludes` hooks both servers the same way."""
    return list(_db().agents.find({"queues": {"$in": [queue]}}, {"_id": 0}))


@v1.post("/job")
@roles(*CONTRIBUTOR_ROLES)
def job_post():
    """Submit a job: ``{"job_id": uuid}``; 422 on a malformed body, 400 on a bad given job_id."""
    data = _json_body(JobSchema())
    queue = data["job_queue"]
    if data["exclude_agents"]:
        # v1.job_post: some agent listing the queue (database.get_agents_on_queue, called through
        # this module's attribute as v1.py calls database's) must be outside exclude_agents.
        able = [a for a in get_agents_on_queue(queue) if a["name"] not in data["exclude_agents"]]
        if not able:
            abort(HTTPStatus.UNPROCESSABLE_ENTITY,
                  "There are no agents on the specified queue that are allowed to run this job")
    if "secrets" in (data.get("test_data") or {}):
        abort(HTTPStatus.UNPROCESSABLE_ENTITY, "No secrets store")
    job_id = data.pop("job_id", None)
    if job_id:
        if not _valid_uuid(job_id):
            abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    else:
        job_id = str(uuid.uuid4())
    if any(isinstance(v, dict) and "attachments" in v
           for k, v in data.items() if k.endswith("_data")):
        data["attachments_status"] = "waiting"
    _check_permissions(g.permissions, data)
    job = {"created_at": _now(), "result_data": {"job_state": tfstates.JOB_WAITING},
           "job_priority": data.get("job_priority", 0), "job_id": job_id, "job_data": data}
    _db().jobs.insert_one(job)
    events.record(job_id, "job_submitted", client_id=events.requester(), queue_name=queue)
    return jsonify(job_id=job_id)


@v1.get("/job")
@roles(*AGENT_ONLY)
def job_get():
    """Pop the highest-priority waiting job of the ``queue`` params for the cookie's agent.

    400 without ``queue``, 401 without the ``agent_name`` cookie, 204 ``{}`` when none. The pop is
    one atomic ``find_one_and_update`` (``database.pop_job``).
    """
    queue_list = request.args.getlist("queue")
    if not queue_list:
        abort(HTTPStatus.BAD_REQUEST, "No queue(s) specified in request")
    agent_name = request.cookies.get("agent_name")
    if not agent_name:
        abort(HTTPStatus.UNAUTHORIZED, "Agent not identified")
    database = _db()
    popped = {"result_data.job_state": tfstates.JOB_RUNNING}
    if _newer():  # testflinger#1253: pop_job records which agent took the job
        popped["result_data.agent_id"] = agent_name
    doc = database.jobs.find_one_and_update(
        {
            "result_data.job_state": tfstates.JOB_WAITING,
            "job_data.job_queue": {"$in": queue_list},
            "$or": [{"job_data.attachments_status": {"$exists": False}},
                    {"job_data.attachments_status": "complete"}],
            "job_data.exclude_agents": {"$nin": [agent_name]},
        },
        {"$set": popped},
        projection={"job_id": True, "created_at": True, "job_data": True},
        sort=[("job_priority", -1)],
    )
    if not doc:
        return jsonify({}), HTTPStatus.NO_CONTENT
    job = doc["job_data"]
    job["job_id"] = doc["job_id"]
    started_at = _now()
    database.jobs.update_one({"job_id": doc["job_id"]}, {"$set": {"started_at": started_at}})
    # Testflinger pushes timedelta.seconds (wraps after a day); kept for identical statistics.
    waited = (started_at.replace(tzinfo=None) - _naive_utc(doc["created_at"])).seconds
    database.queue_wait_times.update_one({"name": job["job_queue"]},
                                         {"$push": {"wait_times": waited}}, upsert=True)
    if _newer():  # testflinger#1253: job_get -> database.set_agent_job(agent_name, job_id)
        database.agents.update_one({"name": agent_name}, {"$set": {"job_id": doc["job_id"]}})
    events.record(doc["job_id"], "job_assigned", agent_name=agent_name)  # testflinger#1297
    job["started_at"] = started_at
    return jsonify(job)


def _job_data(job_id: str) -> dict | None:
    doc = _db().jobs.find_one({"job_id": job_id}, {"job_data": True, "_id": False})
    return None if not doc else doc.get("job_data")


@v1.get("/job/<job_id>")
@roles(*CONTRIBUTOR_ROLES)
def job_get_id(job_id):
    """The submitted job (its ``Job`` schema fields plus ``job_id``); 204 ``{}`` if unknown."""
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    data = _job_data(job_id)
    if data is None:
        return jsonify({}), HTTPStatus.NO_CONTENT
    # Testflinger dumps through schemas.Job, which drops e.g. attachments_status.
    out = {k: v for k, v in data.items() if k in JobSchema().fields}
    out.setdefault("exclude_agents", [])
    out["job_id"] = job_id
    return jsonify(out)


@v1.get("/job/<job_id>/position")
@roles(*CONTRIBUTOR_ROLES)
def job_position_get(job_id):
    """0-based rank among the queue's waiting jobs (priority desc), as text; 410 if not waiting."""
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    data = _job_data(job_id)
    if data is None:
        return "Job not found or already started\n", HTTPStatus.GONE
    waiting = _db().jobs.find({"job_data.job_queue": data.get("job_queue"),
                               "result_data.job_state": tfstates.JOB_WAITING},
                              {"job_id": 1}, sort=[("job_priority", -1)])
    for pos, doc in enumerate(waiting):
        if doc.get("job_id") == job_id:
            return str(pos)
    return "Job not found or already started\n", HTTPStatus.GONE


@v1.post("/job/<job_id>/action")
@roles(*CONTRIBUTOR_ROLES)
def action_post(job_id):
    """``{"action": "cancel"}``: 400 if the job is already cancelled/complete/completed."""
    if not _valid_uuid(job_id):
        return "Invalid job id\n", HTTPStatus.BAD_REQUEST
    _json_body(ActionInSchema())
    result = _db().jobs.update_one(
        {"job_id": job_id, "result_data.job_state": {"$nin": sorted(tfstates.JOB_TERMINAL)}},
        {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}},
    )
    if result.modified_count == 0:
        return "The job is already completed or cancelled", HTTPStatus.BAD_REQUEST
    _clear_agent_job(job_id)
    events.record(job_id, "job_cancelled", client_id=events.requester())
    return "OK"


@v1.post("/job/<job_id>/attachments")
@roles(*CONTRIBUTOR_ROLES)
def attachments_post(job_id):
    """Store the multipart ``file`` for a job awaiting attachments, then mark it ``complete``
    (the job becomes poppable); 422 if the job is unknown or awaits none."""
    if not _valid_uuid(job_id):
        return "Invalid job id\n", HTTPStatus.BAD_REQUEST
    database = _db()
    doc = database.jobs.find_one({"job_id": job_id}, {"job_data.attachments_status": True})
    if not doc:
        return f"Job {job_id} is not valid\n", HTTPStatus.UNPROCESSABLE_ENTITY
    status = doc.get("job_data", {}).get("attachments_status")
    if status is None:
        return f"Job {job_id} not awaiting attachments\n", HTTPStatus.UNPROCESSABLE_ENTITY
    if status == "complete":
        return "OK", HTTPStatus.OK  # a retry of a finished upload
    if "file" not in request.files:
        abort(HTTPStatus.BAD_REQUEST, "multipart field 'file' missing")
    database.lab_files.replace_one({"filename": f"{job_id}.attachments"},
                                   {"filename": f"{job_id}.attachments",
                                    "data": request.files["file"].read()}, upsert=True)
    database.jobs.update_one({"job_id": job_id, "job_data.attachments_status": "waiting"},
                             {"$set": {"job_data.attachments_status": "complete"}})
    return "OK", HTTPStatus.OK


@v1.get("/job/<job_id>/attachments")
@roles(*AGENT_ONLY)
def attachment_get(job_id):
    """The attachments tarball (``application/gzip``); 204 if none was uploaded."""
    if not _valid_uuid(job_id):
        return "Invalid job id\n", HTTPStatus.BAD_REQUEST
    doc = _db().lab_files.find_one({"filename": f"{job_id}.attachments"})
    if not doc:
        return "", HTTPStatus.NO_CONTENT
    return current_app.response_class(bytes(doc["data"]), mimetype="application/gzip")


@v1.post("/result/<job_id>")
@roles(*AGENT_ONLY)
def result_post(job_id):
    """Merge ``{status, device_info, job_state}`` into ``result_data`` (unguarded, as Testflinger:
    an outcome post turns a cancelled job ``complete``)."""
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    data = _json_body(ResultPostSchema())
    if data:
        # The pre-image feeds event detection (newer: database.update_job_results).
        before = _db().jobs.find_one_and_update(
            {"job_id": job_id}, {"$set": {f"result_data.{k}": v for k, v in data.items()}},
            projection={"result_data": True, "_id": False})
        events.record_result(job_id, (before or {}).get("result_data") or {}, data)
        if data.get("job_state") in tfstates.JOB_TERMINAL:
            _clear_agent_job(job_id)
    return "OK"


@v1.post("/result/<job_id>/artifact")
@roles(*AGENT_ONLY)
def artifacts_post(job_id):
    """Store the multipart ``file`` (the agent's ``artifacts.tar.gz``) as ``<job_id>.artifact``;
    a later upload replaces it (Testflinger keeps GridFS versions and serves the last)."""
    if not _valid_uuid(job_id):
        return "Invalid job id\n", HTTPStatus.BAD_REQUEST
    if "file" not in request.files:
        abort(HTTPStatus.BAD_REQUEST, "multipart field 'file' missing")
    _db().lab_files.replace_one({"filename": f"{job_id}.artifact"},
                                {"filename": f"{job_id}.artifact",
                                 "data": request.files["file"].read()}, upsert=True)
    return "OK"


@v1.get("/result/<job_id>/artifact")
@roles(*CONTRIBUTOR_ROLES)
def artifacts_get(job_id):
    """The artifacts tarball (``application/gzip``, download name ``artifact.tar.gz``); 204 if
    none was uploaded (testflinger-cli ``artifacts`` then says "No artifacts tarball found")."""
    if not _valid_uuid(job_id):
        return "Invalid job id\n", HTTPStatus.BAD_REQUEST
    doc = _db().lab_files.find_one({"filename": f"{job_id}.artifact"})
    if not doc:
        return "", HTTPStatus.NO_CONTENT
    response = current_app.response_class(bytes(doc["data"]), mimetype="application/gzip")
    response.headers["Content-Disposition"] = "attachment; filename=artifact.tar.gz"
    return response


def _fragments(job_id, log_type=None, phase=None, start_fragment=0, start_timestamp=None):
    query = {"job_id": job_id, "fragment_number": {"$gte": start_fragment}}
    if log_type is not None:
        query["log_type"] = log_type
    if phase is not None:
        query["phase"] = phase
    if start_timestamp is not None:
        query["timestamp"] = {"$gte": _naive_utc(start_timestamp)}
    return _db().logs.find(query, {"_id": False}, sort=[("fragment_number", 1)])


@v1.get("/result/<job_id>")
@roles(*ALL_ROLES)
def result_get(job_id):
    """``result_data`` with ``status`` flattened to ``<phase>_status`` and logs joined into
    ``<phase>_output``/``<phase>_serial`` (``logs.format_logs_as_results``); 204 if none."""
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    doc = _db().jobs.find_one({"job_id": job_id}, {"result_data": True, "_id": False})
    if not doc or not (result := doc.get("result_data")):
        return "", HTTPStatus.NO_CONTENT
    logs: dict[str, str] = {}
    for frag in _fragments(job_id):
        key = f"{frag['phase']}_{frag['log_type']}"
        logs[key] = logs.get(key, "") + frag["log_data"]
    status = result.pop("status", {}) or {}
    result.update(logs)
    result.update({f"{p}_status": status[p] for p in TEST_PHASES if status.get(p) is not None})
    return jsonify(result)


@v1.post("/result/<job_id>/log/<log_type>")
@roles(*AGENT_ONLY)
def log_post(job_id, log_type):
    """Store one log fragment ``{fragment_number, timestamp, phase, log_data}``."""
    if log_type not in LOG_TYPES:
        abort(HTTPStatus.UNPROCESSABLE_ENTITY, "Invalid log type")
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job_id specified")
    data = _json_body(LogPostSchema())
    now = _now()
    _db().logs.insert_one({"job_id": job_id, "log_type": log_type, "phase": data["phase"],
                           "fragment_number": data["fragment_number"],
                           "timestamp": _naive_utc(data["timestamp"]),
                           "log_data": data["log_data"], "updated_at": now})
    return "OK"


@v1.get("/result/<job_id>/log/<log_type>")
@roles(*CONTRIBUTOR_ROLES)
def log_get(job_id, log_type):
    """``{log_type: {phase: {"last_fragment_number": int (-1 if none), "log_data": str}}}`` for
    every phase (or only ``phase``), from fragment ``start_fragment`` on."""
    if log_type not in LOG_TYPES:
        abort(HTTPStatus.UNPROCESSABLE_ENTITY, "Invalid log type")
    if not _valid_uuid(job_id):
        abort(HTTPStatus.BAD_REQUEST, "Invalid job id\n")
    try:
        query = LogQuerySchema().load(request.args)
    except ValidationError as exc:
        abort(HTTPStatus.BAD_REQUEST, exc.messages)
    phases = [query["phase"]] if "phase" in query else list(TEST_PHASES)
    out = {}
    for phase in phases:
        frags = list(_fragments(job_id, log_type, phase, query.get("start_fragment", 0),
                                query.get("start_timestamp")))
        out[phase] = {"last_fragment_number": frags[-1]["fragment_number"] if frags else -1,
                      "log_data": "".join(f["log_data"] for f in frags)}
    return jsonify({log_type: out})


agents.register(v1)
events.register(v1, _valid_uuid)

# Token views (jobservice_auth), under Testflinger's endpoint names (v1.retrieve_token, ...).
v1.post("/oauth2/token")(retrieve_token)
v1.post("/oauth2/refresh")(refresh_access_token)
