"""The agent and queue routes of the lab's job service (split from :mod:`.jobservice`).

What testflinger-agent and testflinger-cli call about agents and queues, with Testflinger's
shapes and role checks (canonical/testflinger ``server/src/testflinger/api/v1.py``,
``database.py``): advertised queues and images, agent documents (``AgentIn``/``AgentOut``),
provision logs and streaks, queue wait-time percentiles, a queue's agents and jobs. Registered
on the ``v1`` blueprint by :func:`register`, under Testflinger's endpoint names.
"""

from __future__ import annotations

from http import HTTPStatus

from apiflask import abort
from flask import jsonify, request

from testflinger_magic.lab.jobservice_auth import (
    AGENT_ONLY, AGENT_WRITE_ROLES, ALL_ROLES, CONTRIBUTOR_ROLES, _db, _now, roles)
from testflinger_magic.lab.jobservice_schemas import (
    AgentInSchema, ProvisionLogsInSchema, _ImagesInSchema, _json_body, _StringMapSchema)

#: Fields of ``AgentOut``, what ``GET /v1/queues/<q>/agents`` returns per agent.
AGENT_OUT_FIELDS = ("name", "state", "queues", "location", "provision_type", "job_id", "comment",
                    "restricted_to")


def _restricted_to(queues) -> dict:
    """``{queue: [client_ids]}`` for the restricted ones of ``queues`` that have owners."""
    database = _db()
    restricted = set(database.restricted_queues.distinct("queue_name"))
    if not restricted:
        return {}
    owners: dict[str, list[str]] = {}
    for doc in database.client_permissions.find({}, {"allowed_queues": 1, "client_id": 1}):
        for queue in doc.get("allowed_queues", []):
            owners.setdefault(queue, []).append(doc["client_id"])
    return {q: owners[q] for q in queues or [] if q in restricted and owners.get(q)}


def percentiles(data: list) -> dict:
    """``{5, 10, 50, 90, 95: value}`` by nearest rank with interpolation
    (``database.calculate_percentiles``); ``{}`` for no data."""
    if not data:
        return {}
    data = sorted(data)
    result = {}
    for pct in (5, 10, 50, 90, 95):
        index = (len(data) - 1) * (pct / 100.0)
        lower = int(index)
        upper = lower + 1
        if upper < len(data):
            result[pct] = data[lower] * (upper - index) + data[upper] * (index - lower)
        else:
            result[pct] = data[lower]
    return result


@roles(*CONTRIBUTOR_ROLES)
def queues_get():
    """Advertised queues: ``{name: description}``."""
    docs = _db().queues.find({}, {"_id": False, "name": True, "description": True})
    return jsonify({d.get("name"): d.get("description", "") for d in docs})


@roles(*AGENT_WRITE_ROLES)
def queues_post():
    """Advertise queues ``{name: description}`` (upsert, ``updated_at``)."""
    data = _json_body(_StringMapSchema())
    now = _now()
    for queue, description in data.items():
        _db().queues.update_one({"name": queue},
                                {"$set": {"description": description, "updated_at": now}},
                                upsert=True)
    return "OK"


@roles(*CONTRIBUTOR_ROLES)
def images_get(queue):
    """Advertised images of a queue: ``{image: provision string}`` (``{}`` if none)."""
    doc = _db().queues.find_one({"name": queue}, {"_id": False, "images": True})
    return jsonify((doc or {}).get("images", {}))


@roles(*AGENT_WRITE_ROLES)
def images_post():
    """Advertise images ``{queue: {image: provision string}}``."""
    for queue, images in _json_body(_ImagesInSchema()).items():
        _db().queues.update_one({"name": queue}, {"$set": {"images": images}}, upsert=True)
    return "OK"


@roles(*CONTRIBUTOR_ROLES)
def agents_get_all():
    """Every agent document (no ``_id``/``log``) plus computed ``restricted_to``."""
    agents = list(_db().agents.find({}, {"_id": False, "log": False}))
    for agent in agents:
        agent["restricted_to"] = _restricted_to(agent.get("queues"))
    return jsonify(agents)


@roles(*ALL_ROLES)
def agents_get_one(agent_name):
    """One agent document (no ``_id``/``log``) plus ``restricted_to``; 404 ``{}`` if unknown."""
    agent = _db().agents.find_one({"name": agent_name}, {"_id": False, "log": False})
    if not agent:
        return jsonify({}), HTTPStatus.NOT_FOUND
    agent["restricted_to"] = _restricted_to(agent.get("queues"))
    return jsonify(agent)


@roles(*AGENT_WRITE_ROLES)
def agents_post(agent_name):
    """Upsert the agent document (``AgentIn`` fields + ``name``, ``updated_at``; ``log`` keeps the
    last 100 lines) and set the ``agent_name`` cookie (HttpOnly, SameSite=Strict)."""
    data = _json_body(AgentInSchema())
    data["name"] = agent_name
    data["updated_at"] = _now()
    log = data.pop("log", [])
    _db().agents.update_one({"name": agent_name},
                            {"$set": data, "$push": {"log": {"$each": log, "$slice": -100}}},
                            upsert=True)
    response = jsonify({"status": "OK"})
    response.set_cookie("agent_name", agent_name, httponly=True, samesite="Strict")
    return response


@roles(*AGENT_ONLY)
def agents_provision_logs_post(agent_name):
    """Record one provision outcome ``{job_id, exit_code, detail}`` (stamped ``timestamp``) in
    ``provision_logs`` (last 100 per agent) and update the agent's ``provision_streak_type``
    (``pass``/``fail``) and ``provision_streak_count``; 404 if the agent has no document.
    testflinger-agent posts this after every provision phase and ignores the answer."""
    entry = _json_body(ProvisionLogsInSchema())
    now = _now()
    entry["timestamp"] = now
    database = _db()
    database.provision_logs.update_one(
        {"name": agent_name},
        {"$set": entry, "$push": {"provision_log": {"$each": [dict(entry)], "$slice": -100}}},
        upsert=True)
    agent = database.agents.find_one({"name": agent_name},
                                     {"provision_streak_type": 1, "provision_streak_count": 1})
    if not agent:
        return "Agent not found\n", HTTPStatus.NOT_FOUND
    streak = "fail" if entry["exit_code"] != 0 else "pass"
    count = (agent.get("provision_streak_count", 0) + 1
             if agent.get("provision_streak_type") == streak else 1)
    database.agents.update_one({"name": agent_name},
                               {"$set": {"provision_streak_type": streak,
                                         "provision_streak_count": count}})
    return "OK"


@roles(*CONTRIBUTOR_ROLES)
def queue_wait_time_percentiles_get():
    """``{queue: {5, 10, 50, 90, 95: seconds}}`` for the ``queue`` params (default all)."""
    queues = request.args.getlist("queue")
    query = {"name": {"$in": queues}} if queues else {}
    return jsonify({d["name"]: percentiles(d.get("wait_times", []))
                    for d in _db().queue_wait_times.find(query, {"_id": False})})


@roles(*CONTRIBUTOR_ROLES)
def get_agents_on_queue(queue_name):
    """Agents listing the queue (``AgentOut`` fields); 404 with a message if none does."""
    agents = list(_db().agents.find({"queues": {"$in": [queue_name]}}, {"_id": 0}))
    if not agents:
        abort(HTTPStatus.NOT_FOUND, f"Queue '{queue_name}' does not exist.")
    return jsonify([{k: a[k] for k in AGENT_OUT_FIELDS if k in a} for a in agents])


@roles(*CONTRIBUTOR_ROLES)
def get_jobs_by_queue(queue_name):
    """``[{job_id, created_at, job_state, job_queue}]`` of the queue; 204 ``{}`` if none."""
    jobs = list(_db().jobs.find({"job_data.job_queue": queue_name}))
    if not jobs:
        return jsonify({}), HTTPStatus.NO_CONTENT
    return jsonify([{"job_id": j["job_id"], "created_at": j["created_at"],
                     "job_state": j["result_data"]["job_state"],
                     "job_queue": j["job_data"]["job_queue"]} for j in jobs])


def register(v1) -> None:
    """Add these routes to the ``v1`` blueprint (endpoint names = function names)."""
    v1.get("/agents/queues")(queues_get)
    v1.post("/agents/queues")(queues_post)
    v1.get("/agents/images/<queue>")(images_get)
    v1.post("/agents/images")(images_post)
    v1.get("/agents/data")(agents_get_all)
    v1.get("/agents/data/<agent_name>")(agents_get_one)
    v1.post("/agents/data/<agent_name>")(agents_post)
    v1.post("/agents/provision_logs/<agent_name>")(agents_provision_logs_post)
    v1.get("/queues/wait_times")(queue_wait_time_percentiles_get)
    v1.get("/queues/<queue_name>/agents")(get_agents_on_queue)
    v1.get("/queues/<queue_name>/jobs")(get_jobs_by_queue)
