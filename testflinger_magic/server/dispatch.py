"""App-level hooks on Testflinger's own /v1 routes.

They are app hooks (``before_request``/``after_request``/``teardown_request``), not blueprint
hooks, because blueprint hooks never see Testflinger's ``v1`` routes.

- ``GET /v1/job`` (agent poll, cookie ``agent_name``; TESTFLINGER.md §1.5): the dispatch handshake
  of docs/architecture.md. Insert a pending marker, **then** read the fence; a fenced agent (or a
  VM agent of a lease whose admission is ``paused``) gets 204 ``{}`` before Testflinger's handler
  runs. Otherwise the handler pops a job and ``after_request`` records it on the marker.
- ``GET /v1/queues/<magic queue>/agents`` (testflinger-cli's preflight, §4.2): the VM agents'
  documents plus one ``magic:<queue>`` entry standing for lendable capacity, or 404 saying why.
- ``POST /v1/job`` to a magic queue: wake the engine (background tick) after the job is stored.
"""

from __future__ import annotations

import logging

from apiflask.exceptions import HTTPError as APIFlaskHTTPError
from flask import Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from testflinger_magic import tfstates

log = logging.getLogger(__name__)

#: Fields of Testflinger's ``schemas.AgentOut``: what its ``get_agents_on_queue`` returns per agent
#: (its ``@v1.output`` drops the rest: ``_id``, ``log``, ``updated_at``, ``identifier``...).
AGENT_OUT_FIELDS = ("name", "state", "queues", "location", "provision_type", "job_id", "comment",
                    "restricted_to")


def _http_error(exc: APIFlaskHTTPError) -> Response:
    """apiflask's ``abort`` (raised by Testflinger's ``authenticate``/``require_role`` and by
    auth.py's fallback) as apiflask's default error body ``{"detail", "message"}``. Answered here
    because it is no werkzeug HTTPException: a plain Flask app would turn it into a 500."""
    resp = jsonify(detail=exc.detail, message=exc.message)
    resp.status_code = exc.status_code
    for key, value in (exc.headers or {}).items():
        resp.headers[key] = value
    return resp


def _no_job() -> Response:
    # Testflinger answers "no job" as jsonify({}) with 204 (v1.job_get).
    resp = jsonify({})
    resp.status_code = 204
    return resp


def capacity_entry(plugin, queue: str) -> tuple[dict | None, str]:
    """Return (the ``magic:<queue>`` agent entry, "") when ``queue`` has lendable capacity, else
    (None, reason). Lendable: a device registered by an agent host, matching the definition and
    not quarantined (busy devices count: jobs will wait for them), of a queue whose stored
    definition is valid and not suspended (``plugin.problem``)."""
    definition = plugin.definition(queue)
    problem = plugin.problem(queue)
    if problem is not None:
        return None, f"Magic queue '{queue}': {problem}."
    if definition is None:
        return None, f"'{queue}' is not a magic queue"
    registered = list(plugin.db.magic_devices.find({}))
    if not registered:
        return None, f"Magic queue '{queue}': no agent host has registered any device yet."
    eligible = [d for d in registered if definition.matches(d)]
    if not eligible:
        return None, (
            f"Magic queue '{queue}': none of the {len(registered)} registered device(s) is "
            "eligible under its 'devices' selection."
        )
    usable = [d for d in eligible if not d.get("quarantined")]
    if not usable:
        return None, (
            f"Magic queue '{queue}': all {len(eligible)} eligible device(s) are quarantined."
        )
    vms = sum(definition.vms_for(int(d.get("gpus") or 0)) for d in usable)
    max_devices = getattr(definition.policy, "max_devices", None) if hasattr(
        definition, "policy") else None
    entry = {
        "name": f"magic:{queue}",
        "state": tfstates.AGENT_WAITING,
        "queues": [queue],
        "comment": f"{len(usable)} lendable device(s), up to {vms} VMs"
        + (f" (at most {max_devices} device(s) at once)" if max_devices else ""),
        "location": "testflinger-magic",
        "provision_type": getattr(definition, "provision_type", "") or "",
        "job_id": "",
    }
    return entry, ""


def _vm_agent_docs(plugin, queue: str) -> list[dict]:
    """Testflinger agent documents listing ``queue``, cut to ``AgentOut`` fields as Testflinger's
    ``get_agents_on_queue`` returns them."""
    # Every agent document listing the queue is shown, as Testflinger's handler does (VM agents,
    # and any real agent an operator pointed at the queue: it pops these jobs too).
    docs = plugin.db.agents.find({"queues": queue}, {"_id": 0})
    return [{k: d[k] for k in AGENT_OUT_FIELDS if k in d} for d in docs]


def install(app, plugin) -> None:
    """Register the hooks on ``app`` for ``plugin`` (a :class:`~.plugin.MagicPlugin`)."""

    @app.before_request
    def _magic_before():
        try:
            if request.method == "GET" and request.path.rstrip("/") == "/v1/job":
                return _before_job_get(plugin)
            if request.method == "GET" and request.path.startswith("/v1/queues/"):
                return _before_queue_agents(plugin)
        except APIFlaskHTTPError as exc:  # 401/403 from the role check: the caller's answer
            return _http_error(exc)
        except HTTPException:
            raise
        except Exception:  # never break Testflinger's own routes because of the plugin
            log.exception("testflinger-magic before_request hook failed on %s", request.path)
            if request.method == "GET" and request.path.rstrip("/") == "/v1/job":
                # Fail closed: whatever failed (the marker insert, the fence read: e.g. pymongo
                # AutoReconnect), the fence was not checked, so the poll must not reach
                # Testflinger's handler. 204 is "no job": the agent simply polls again.
                # after_request clears a marker that was inserted.
                try:
                    plugin.metrics.refusals.labels(reason="error").inc()
                except Exception:  # noqa: BLE001
                    pass
                return _no_job()
        return None

    @app.after_request
    def _magic_after(response):
        try:
            marker = getattr(g, "magic_marker", None)
            if marker is not None:
                g.magic_marker = None
                job_id = queue = None
                if response.status_code == 200 and response.is_json:
                    job = response.get_json(silent=True) or {}
                    job_id, queue = job.get("job_id"), job.get("job_queue")
                plugin.store.dispatch_end(marker, job_id, queue)
            elif (
                request.method == "POST"
                and request.path.rstrip("/") == "/v1/job"
                and response.status_code == 200
            ):
                body = request.get_json(silent=True) or {}
                if plugin.definition(body.get("job_queue")) is not None:
                    plugin.kick()
        except Exception:
            log.exception("testflinger-magic after_request hook failed on %s", request.path)
        return response

    @app.teardown_request
    def _magic_teardown(exc):
        # The handler raised: no job was handed out under this marker.
        marker = getattr(g, "magic_marker", None)
        if marker is not None:
            g.magic_marker = None
            try:
                plugin.store.dispatch_end(marker, None)
            except Exception:
                log.exception("testflinger-magic could not clear dispatch marker")


def _before_job_get(plugin):
    agent = request.cookies.get("agent_name")
    if not agent or not request.args.getlist("queue"):
        return None  # Testflinger answers 401/400 itself
    # Handshake order matters: marker first, then the fence read (docs/architecture.md).
    marker = plugin.store.dispatch_begin(agent)
    g.magic_marker = marker
    reason = None
    if not plugin.store.dispatch_allowed(agent):
        reason = "fenced"
    elif plugin.admission_paused(agent):
        reason = "paused"
    if reason is None:
        return None
    g.magic_marker = None
    plugin.store.dispatch_end(marker, None)
    plugin.metrics.refusals.labels(reason=reason).inc()
    return _no_job()


def _before_queue_agents(plugin):
    parts = request.path.strip("/").split("/")
    if len(parts) != 4 or parts[3] != "agents":
        return None
    queue = parts[2]
    if plugin.definition(queue) is None and plugin.problem(queue) is None:
        return None  # not ours: Testflinger's handler (an invalid stored queue is ours: say why)
    from . import auth  # noqa: PLC0415

    # Same roles as Testflinger's get_agents_on_queue.
    checked = auth.require(*auth.READ_ROLES)(lambda: None)
    denied = checked()
    if denied is not None:
        return denied
    agents = _vm_agent_docs(plugin, queue)
    entry, why = capacity_entry(plugin, queue)
    # The capacity entry only stands in while no agent of the queue is online, so queue-status
    # counts the real VM agents once they exist.
    if entry is not None and not any(a.get("state") != tfstates.AGENT_OFFLINE for a in agents):
        agents.append(entry)
    if not agents:
        resp = jsonify(message=why)
        resp.status_code = 404
        return resp
    return jsonify(agents)
