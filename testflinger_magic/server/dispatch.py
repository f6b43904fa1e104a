"""App-level hooks on Testflinger's own /v1 routes.

They are app hooks (``before_request``/``after_request``), not blueprint hooks, because blueprint
hooks never see Testflinger's ``v1`` routes. Every hook acts only for a caller Testflinger would
serve on that route (:func:`served`: its own authentication and role check, run first); anyone
else gets Testflinger's own answer, from Testflinger's own handler, and the plugin reads and
writes nothing for them.

- ``GET /v1/job`` (agent poll, cookie ``agent_name``; TESTFLINGER.md §1.5): the dispatch handshake
  of docs/architecture.md. One read of the agent's gate (``magic_agent_gate`` by ``_id``); a
  fenced or admission-paused agent gets 204 ``{}`` before Testflinger's handler runs; an agent
  with no gate (not ours) is left alone. When the handler hands a job to a watched agent,
  ``after_request`` writes the dispatch marker, reads the gate again, and gives the job back (204)
  if the agent was fenced in between.
- ``GET /v1/queues/<magic queue>/agents`` (testflinger-cli's preflight, §4.2): the VM agents'
  documents plus one ``magic:<queue>`` entry standing for lendable capacity, or 404 saying why.
- ``POST /v1/job`` to a magic queue: wake the engine (background tick) after the job is stored.
"""

from __future__ import annotations

import logging

from apiflask.exceptions import HTTPError as APIFlaskHTTPError
from flask import Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from testflinger_magic import tfstates

log = logging.getLogger(__name__)

#: Fields of Testflinger's ``schemas.AgentOut``: what its ``get_agents_on_queue`` returns per agent
#: (its ``@v1.output`` drops the rest: ``_id``, ``log``, ``updated_at``, ``identifier``...).
AGENT_OUT_FIELDS = ("name", "state", "queues", "location", "provision_type", "job_id", "comment",
                    "restricted_to")


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


def served(default_roles) -> bool:
    """True if Testflinger would serve the current request's caller on its route: its own
    authentication (Testflinger's ``authenticate`` inside the real server, the lab job service's
    ``authenticate`` in the lab, else auth.py's compatible fallback) succeeds and the role is one
    the route's view requires (its ``_role_requirements``, set by Testflinger's ``require_role``
    and the lab's ``roles``; else ``default_roles``). With OIDC on, an unauthenticated caller is
    not served (``require_role``: 401). Nothing is logged or answered here: a caller refused is
    left to Testflinger's handler, which refuses it exactly as it always does (and logs it once).

    Raises only what is not an authentication refusal (the caller fails closed)."""
    from . import auth  # noqa: PLC0415

    view = current_app.view_functions.get(request.endpoint)
    roles = getattr(view, "_role_requirements", None) or default_roles
    wanted = {str(getattr(r, "value", r)) for r in roles}
    lab = current_app.extensions.get("jobservice") or {}
    try:
        tf = auth._testflinger_auth()
        if tf is not None:
            tf[0](lambda: None)()  # Testflinger's authenticate: fills g (or aborts)
            oidc = getattr(current_app, "oauth", None) is not None
        elif lab.get("authenticate") is not None:
            lab["authenticate"]()
            oidc = bool(lab.get("oidc"))
        else:
            auth._fallback_authenticate()
            oidc = False
    except (APIFlaskHTTPError, HTTPException):
        return False
    if oidc and (not getattr(g, "is_authenticated", False) or getattr(g, "client_id", None) is None):
        return False
    role = getattr(g, "role", None)
    return role is not None and str(getattr(role, "value", role)) in wanted


def _is_job_get() -> bool:
    return request.method == "GET" and request.path.rstrip("/") == "/v1/job"


def install(app, plugin) -> None:
    """Register the hooks on ``app`` for ``plugin`` (a :class:`~.plugin.MagicPlugin`)."""
    from . import auth  # noqa: PLC0415

    @app.before_request
    def _magic_before():
        g.magic_watched = None
        try:
            if _is_job_get():
                if not served(auth.AGENT_ROLES):
                    return None  # Testflinger's own 401/403; nothing read or written here
                return _before_job_get(plugin)
            if request.method == "GET" and request.path.startswith("/v1/queues/"):
                return _before_queue_agents(plugin)
        except Exception:  # never break Testflinger's own routes because of the plugin
            log.exception("testflinger-magic before_request hook failed on %s", request.path)
            if _is_job_get():
                # Fail closed: the gate was not read, so the poll must not reach Testflinger's
                # handler. 204 is "no job": the agent simply polls again.
                _count_refusal(plugin, "error")
                return _no_job()
        return None

    @app.after_request
    def _magic_after(response):
        agent = getattr(g, "magic_watched", None)
        if agent is not None:
            g.magic_watched = None
            return _after_job_get(plugin, agent, response)
        try:
            if (request.method == "POST" and request.path.rstrip("/") == "/v1/job"
                    and response.status_code == 200):
                body = request.get_json(silent=True) or {}
                if plugin.definition(body.get("job_queue")) is not None:
                    plugin.kick()
        except Exception:
            log.exception("testflinger-magic after_request hook failed on %s", request.path)
        return response


def _count_refusal(plugin, reason: str) -> None:
    try:
        plugin.metrics.refusals.labels(reason=reason).inc()
    except Exception:  # noqa: BLE001 - metrics never decide an answer
        pass


def _before_job_get(plugin):
    """The served poll: one read of the gate by ``_id`` (gates.Gates.admit); refuse (204) a
    fenced or paused agent, remember a watched one for :func:`_after_job_get`, leave everyone
    else alone."""
    agent = request.cookies.get("agent_name")
    if not agent or not request.args.getlist("queue"):
        return None  # Testflinger answers 401/400 itself
    refusal, watched = plugin.store.gates.admit(agent)
    if refusal is not None:
        _count_refusal(plugin, refusal)
        return _no_job()
    if watched:
        g.magic_watched = agent
    return None


def _after_job_get(plugin, agent: str, response):
    """A watched agent's poll after Testflinger's handler: if it handed out a job, the marker
    then the second gate read (gates.Gates.hand_out); fenced meanwhile, or any failure there,
    gives the job back and answers 204."""
    if response.status_code != 200 or not response.is_json:
        return response
    job = response.get_json(silent=True) or {}
    job_id = job.get("job_id")
    if not job_id:
        return response
    reason = plugin.store.gates.hand_out(agent, job_id, job.get("job_queue"))
    if reason is None:
        return response
    _count_refusal(plugin, reason)
    return _no_job()


def _before_queue_agents(plugin):
    parts = request.path.strip("/").split("/")
    if len(parts) != 4 or parts[3] != "agents":
        return None
    queue = parts[2]
    from . import auth  # noqa: PLC0415

    # Same roles as Testflinger's get_agents_on_queue; a refused caller gets its answer.
    if not served(auth.READ_ROLES):
        return None
    if plugin.definition(queue) is None and plugin.problem(queue) is None:
        return None  # not ours: Testflinger's handler (an invalid stored queue is ours: say why)
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
