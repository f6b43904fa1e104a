"""App-level hooks on Testflinger's own /v1 routes.

They are app hooks (``before_request``/``after_request``), not blueprint hooks, because blueprint
hooks never see Testflinger's ``v1`` routes. Every hook acts only for a caller Testflinger would
serve on that route (:func:`served`: its own authentication and role check, run first); anyone
else gets Testflinger's own answer, from Testflinger's own handler, and the plugin reads and
writes nothing for them.

- ``GET /v1/job`` (agent poll, cookie ``agent_name``; TESTFLINGER.md §1.5): the dispatch handshake
  of docs/architecture.md. One read of the agent's gate (``magic_agent_gate`` by ``_id``); a
  fenced or admission-paused agent gets 204 ``{}`` before Testflinger's handler runs; an agent
  with no gate (not ours) costs that read, and a second one only if the handler hands it a job.
  When the handler hands a job to a watched agent,
  ``after_request`` writes the dispatch marker, reads the gate again, and gives the job back (204)
  if the agent was fenced in between.
- ``GET /v1/queues/<magic queue>/agents`` (testflinger-cli's preflight, §4.2): the VM agents'
  documents plus one ``magic:<queue>`` entry standing for lendable capacity, or 404 saying why;
  the idle VM agents of a lease that takes no new job (draining, restoring, paused for its
  quarantined device) answered ``offline`` (:mod:`.fencedagents`). For a removed magic queue
  (its removal record kept): the agents still listing it, answered the same way, or 404 saying
  it was removed when none serves; once no agent lists it, 404 saying who removed it and when
  (:func:`_removed_queue_agents`).
- ``POST /v1/job`` to a magic queue: wake the engine (background tick) after the job is stored;
  to a removed magic queue nobody serves: 422 before Testflinger's handler (:mod:`.removedqueues`);
  with ``exclude_agents``: the queue's future VM agents count for Testflinger's check, and a job
  every possible agent is excluded from gets its 422 before the handler (:mod:`.excludes`).
"""

from __future__ import annotations

import logging
import os

import jwt
from apiflask.exceptions import HTTPError as APIFlaskHTTPError
from flask import Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from testflinger_magic import lease_states as L
from testflinger_magic import tfstates

from . import auth, devicecount, excludes, fencedagents, removedqueues, staleagents
from .tokencache import VerifiedTokens

log = logging.getLogger(__name__)

#: Bearer tokens this process's authentication accepted (see :func:`served`).
TOKENS = VerifiedTokens()

#: Fields of Testflinger's ``schemas.AgentOut``: what its ``get_agents_on_queue`` returns per agent
#: (its ``@v1.output`` drops the rest: ``_id``, ``log``, ``updated_at``, ``identifier``...).
AGENT_OUT_FIELDS = ("name", "state", "queues", "location", "provision_type", "job_id", "comment",
                    "restricted_to")


def _no_job() -> Response:
    # Testflinger answers "no job" as jsonify({}) with 204 (v1.job_get).
    resp = jsonify({})
    resp.status_code = 204
    return resp


def open_leases(plugin, queue: str) -> list[dict]:
    """``queue``'s open lease documents with ``device``, ``state``, ``admission`` and
    ``vms.agent_name`` (one read: index ``magic_leases(queue, state)``)."""
    return list(plugin.db.magic_leases.find(
        {"queue": queue, "state": {"$in": sorted(L.OPEN_STATES)}},
        {"device": 1, "state": 1, "admission": 1, "vms.agent_name": 1}))


def own_leases(plugin, queue: str, leases: list[dict] | None = None) -> dict[str, str]:
    """``{device: lease state}`` of ``queue``'s open leases (``leases``: those of
    :func:`open_leases`, else read)."""
    leases = open_leases(plugin, queue) if leases is None else leases
    return {lease.get("device"): lease.get("state") for lease in leases}


def capacity(plugin, queue: str, stale_hosts=None,
             own: dict[str, str] | None = None,
             maas_down=None) -> tuple[dict | None, str, list[str]]:
    """Return (the ``magic:<queue>`` agent entry, "", the usable devices' names) when ``queue``
    has lendable capacity, else (None, reason, []). Capacity: a device registered by an agent
    host, matching the definition and not quarantined (lent devices count: jobs will wait for
    them), of a queue whose stored definition is valid and not suspended (``plugin.problem``).

    The comment counts the lendable devices as ``status`` does (:mod:`.devicecount`), naming
    lent, quarantined, stale-host and MAAS-down ones apart (``(1 lent, 2 on a stale agent
    host, 1 on an agent host MAAS does not answer)``; ``maas_down``: those hosts' names, None:
    read with the stale ones, :meth:`Engine.host_conditions`; with
    ``own``, :func:`own_leases`, the lent ones as ``lent to this queue`` and ``lent to other
    queues``), the VMs the usable ones give (a stale host's devices count: the jobs wait for
    its next heartbeat; with ``max_devices``, those of that many devices at most: ``up to 4
    VMs at once (max_devices 2)``), and with ``own`` the devices being brought up for the
    queue (``1 device being deployed for this queue``: its jobs wait for it; TRIAL7).
    Reads: the devices with their claims (:meth:`Engine.devices`) and the agent hosts'
    heartbeats and MAAS reachability (:meth:`Engine.host_conditions`), whatever the number of devices. When no
    registered device matches, the reason names the limiting fact: the selection picks none,
    or the devices it picks have too few GPUs for one VM (``MagicQueue.selects`` vs
    ``matches``)."""
    definition = plugin.definition(queue)
    # Worded for the test engineer testflinger-cli shows it to (operator=False): never "apply
    # the definition", which only the lab's operators can do.
    problem = plugin.problem(queue, operator=False)
    if problem is not None:
        return None, f"Magic queue '{queue}': {problem}.", []
    if definition is None:
        return None, f"'{queue}' is not a magic queue", []
    registered = plugin.engine.devices()  # with each one's lease_id (devicecount)
    no_match = devicecount.no_match_reason(definition, registered, operator=False)
    if no_match is not None:
        return None, f"Magic queue '{queue}': {no_match}.", []
    # One more bounded read (the agent hosts' heartbeats, not one per device): a stale host's
    # devices are not lendable (reconcile.plan lends none of them), as status counts them.
    if stale_hosts is None or maas_down is None:  # else: the caller read them
        stale_read, down_read = plugin.engine.host_conditions()
        stale_hosts = stale_read if stale_hosts is None else stale_hosts
        maas_down = down_read if maas_down is None else maas_down
    # And the usable devices' own agents (one read by name): one busy at home is not lent now.
    names = sorted(d["_id"] for d in registered if definition.matches(d))
    agents = {a["name"]: a for a in plugin.db.agents.find(
        {"name": {"$in": names}}, {"name": 1, "state": 1, "job_id": 1})} if names else {}
    counts = devicecount.count(definition, registered, stale_hosts,
                               devicecount.busy_at_home(names, agents), maas_down,
                               plugin.clock())
    usable = counts["usable_docs"]
    if not usable:
        return None, (
            f"Magic queue '{queue}': all {counts['eligible']} eligible device(s) are quarantined."
        ), []
    per_device = sorted((definition.vms_for(int(d.get("gpus") or 0)) for d in usable),
                        reverse=True)
    max_devices = getattr(getattr(definition, "policy", None), "max_devices", None)
    # "lendable" as status counts it (devicecount); lent, quarantined and stale-host ones are
    # named apart.
    held = [("held", "lent")]
    if own is not None:
        mine = sum(1 for d in usable if d.get("lease_id") and d["_id"] in own)
        counts = dict(counts, mine=mine, elsewhere=counts["held"] - mine)
        held = [("mine", "lent to this queue"), ("elsewhere", "lent to other queues")]
    others = [f"{counts[k]} {label}" for k, label in (*held, ("quarantined", "quarantined"),
                                                      ("stale", "on a stale agent host"),
                                                      ("maas_down", "on an agent host MAAS "
                                                                    "does not answer"),
                                                      ("held_back", "held back: MAAS refused "
                                                                    "to bring it up"),
                                                      ("busy", "busy at home"))
              if counts[k]]
    comment = f"{counts['lendable']} lendable device(s)" + (
        f" ({', '.join(others)})" if others else "")
    if max_devices and max_devices < len(per_device):
        n = sum(per_device[:max_devices])
        comment += f", up to {n} VM{'' if n == 1 else 's'} at once (max_devices {max_devices})"
    else:
        n = sum(per_device)
        comment += f", up to {n} VM{'' if n == 1 else 's'}"
    coming = sum(1 for state in (own or {}).values() if state in L.BRINGUP_STATES)
    if coming:
        comment += (f"; {coming} device{'s' if coming > 1 else ''} being deployed for this "
                    f"queue: its jobs wait for {'them' if coming > 1 else 'it'}")
    # testflinger-cli queue-status counts an agent ``waiting`` as Available and any state but
    # ``offline`` as Busy, and its pre-submit check only needs one that is not ``offline``: the
    # entry is Available only when a device can be lent for the queue now (TRIAL7: "Available:
    # 1" while every job waited for a deploy, or with nothing lendable).
    state = tfstates.AGENT_WAITING
    if coming:
        state = "provision"  # a phase (tfstates.JOB_PHASES): its VMs are being provisioned
    elif not counts["lendable"] or (max_devices and own is not None and len(own) >= max_devices):
        state = tfstates.AGENT_MAINTENANCE
    entry = {
        "name": f"magic:{queue}",
        "state": state,
        "queues": [queue],
        "comment": comment,
        "location": "testflinger-magic",
        "provision_type": getattr(definition, "provision_type", "") or "",
        "job_id": "",
    }
    return entry, "", [d["_id"] for d in usable]


def _vm_agent_docs(plugin, queue: str) -> list[dict]:
    """Testflinger agent documents listing ``queue``, cut to ``AgentOut`` fields as Testflinger's
    ``get_agents_on_queue`` returns them."""
    # Every agent document listing the queue is shown, as Testflinger's handler does (VM agents,
    # and any real agent an operator pointed at the queue: it pops these jobs too).
    docs = plugin.db.agents.find({"queues": queue}, {"_id": 0})
    return [{k: d[k] for k in AGENT_OUT_FIELDS if k in d} for d in docs]


def _role_name(role) -> str | None:
    return None if role is None else str(getattr(role, "value", role))


def _authenticate(tf, lab) -> bool:
    """Run the caller's authentication of this deployment (module docstring of :func:`served`);
    False if it refused the caller (an HTTP 401/403 abort), True with ``g`` filled."""
    try:
        if tf is not None:
            tf[0](lambda: None)()  # Testflinger's authenticate: fills g (or aborts)
        elif lab.get("authenticate") is not None:
            lab["authenticate"]()
        else:
            auth._fallback_authenticate()
    except (APIFlaskHTTPError, HTTPException):
        return False
    return True


def _unverified_exp(token: str):
    """The ``exp`` claim of ``token``, read without verifying it: only called on a token the
    caller's authentication has just accepted (so its payload is the signed one); None if it
    cannot be read (then nothing is cached)."""
    try:
        return jwt.decode(token, options={"verify_signature": False}).get("exp")
    except jwt.PyJWTError:
        return None


def served(default_roles, req=None) -> bool:
    """True if Testflinger would serve the current request's caller on its route: its own
    authentication (Testflinger's ``authenticate`` inside the real server, the lab job service's
    ``authenticate`` in the lab, else auth.py's compatible fallback) succeeds and the role is one
    the route's view requires (its ``_role_requirements``, set by Testflinger's ``require_role``
    and the lab's ``roles``; else ``default_roles``). With OIDC on, an unauthenticated caller is
    not served (``require_role``: 401). Nothing is logged or answered here: a caller refused is
    left to Testflinger's handler, which refuses it exactly as it always does (and logs it once).

    A bearer token that authentication accepted is remembered (:data:`TOKENS`, tokencache.py:
    keyed by the signing key, until its ``exp``, at most ``MAX_AGE``), so the next poll with it
    skips the second JWT verification (Testflinger's handler still runs its own); ``g`` is then
    left to that handler. Refused tokens are never remembered.

    ``req``: the current request object (saves a proxy look-up), default ``flask.request``.
    Raises only what is not an authentication refusal (the caller fails closed)."""
    app = current_app._get_current_object()
    req = req if req is not None else request._get_current_object()
    view = app.view_functions.get(req.endpoint)
    roles = getattr(view, "_role_requirements", None) or default_roles
    tf = auth._testflinger_auth(app)
    lab = app.extensions.get("jobservice") or {}
    if tf is not None:
        oidc = getattr(app, "oauth", None) is not None
    else:
        oidc = bool(lab.get("oidc")) if lab.get("authenticate") is not None else False
    header = req.headers.get("Authorization")
    if header and header.startswith("Bearer "):
        token = header[len("Bearer "):]
        # The key Testflinger's authenticate verifies with (os.environ, api/auth.py); the lab's
        # and the fallback's (app.config).
        key = os.environ.get("JWT_SIGNING_KEY") if tf is not None else app.config.get(
            "JWT_SIGNING_KEY")
        verdict = TOKENS.get(key, token)
        if verdict is None:
            if not _authenticate(tf, lab):
                return False
            verdict = (getattr(g, "client_id", None), _role_name(getattr(g, "role", None)),
                       bool(getattr(g, "is_authenticated", False)))
            if verdict[2]:
                TOKENS.put(key, token, verdict, _unverified_exp(token))
    else:
        if not _authenticate(tf, lab):
            return False
        verdict = (getattr(g, "client_id", None), _role_name(getattr(g, "role", None)),
                   bool(getattr(g, "is_authenticated", False)))
    client_id, role, authenticated = verdict
    if oidc and (not authenticated or client_id is None):
        return False
    return role is not None and role in {_role_name(r) for r in roles}


#: ``request.environ`` key holding ``(agent name, watched)`` of a served poll that passed the first
#: gate read, between the two hooks (per request: unlike ``g``, which a test or a caller's pushed
#: app context may share between requests).
WATCHED = "testflinger_magic.watched"


def _is_job_get(req) -> bool:
    return req.method == "GET" and req.path.rstrip("/") == "/v1/job"


def install(app, plugin) -> None:
    """Register the hooks on ``app`` for ``plugin`` (a :class:`~.plugin.MagicPlugin`), and wrap
    the ``get_agents_on_queue`` its ``job_post`` checks ``exclude_agents`` with
    (:func:`.excludes.install`)."""
    excludes.install(app)

    @app.before_request
    def _magic_before():
        req = request._get_current_object()
        try:
            if req.method == "POST" and req.path.rstrip("/") == "/v1/job":
                return _before_job_post(plugin, req)
            if req.method != "GET":
                return None
            if req.path.rstrip("/") == "/v1/job":
                if not served(auth.AGENT_ROLES, req):
                    return None  # Testflinger's own 401/403; nothing read or written here
                return _before_job_get(plugin, req)
            if req.path.startswith("/v1/queues/"):
                return _before_queue_agents(plugin, req)
        except Exception:  # never break Testflinger's own routes because of the plugin
            log.exception("testflinger-magic before_request hook failed on %s", req.path)
            if _is_job_get(req):
                # Fail closed: the gate was not read, so the poll must not reach Testflinger's
                # handler. 204 is "no job": the agent simply polls again.
                _count_refusal(plugin, "error")
                return _no_job()
        return None

    @app.after_request
    def _magic_after(response):
        req = request._get_current_object()
        polled = req.environ.pop(WATCHED, None)
        if polled is not None:
            return _after_job_get(plugin, polled[0], polled[1], response)
        try:
            if (req.method == "POST" and response.status_code == 200
                    and req.path.rstrip("/") == "/v1/job"):
                body = req.get_json(silent=True) or {}
                if plugin.definition(body.get("job_queue")) is not None:
                    plugin.kick(body.get("job_queue"))  # a quick lend for it, then a tick
        except Exception:
            log.exception("testflinger-magic after_request hook failed on %s", req.path)
        return response


def _before_job_post(plugin, req):
    """A submission to a removed magic queue nobody serves (:func:`.removedqueues.refusal`: one
    read by ``_id``, more only for such a queue) is refused for a caller Testflinger would serve
    (checked first: for anyone else nothing is read),
    as Testflinger's ``job_post`` refuses a job no agent of its queue may run: 422, apiflask's
    error body ``{"message", "detail"}`` (testflinger-cli prints the message, exits 1). So is a
    job to a magic queue whose ``exclude_agents`` names every agent it has or can have
    (:func:`.excludes.check`: two more reads, only for a job with ``exclude_agents``)."""
    body = req.get_json(silent=True)
    queue = body.get("job_queue") if isinstance(body, dict) else None
    if not isinstance(queue, str) or not queue or not served(auth.READ_ROLES, req):
        return None  # Testflinger's own answer; nothing read here (module docstring)
    why = removedqueues.refusal(plugin.db, queue)
    if why is None:
        # exclude_agents on a magic queue: its future VM agents count (server/excludes.py).
        why = excludes.check(plugin, queue, body.get("exclude_agents"))
    if why is None:
        return None
    resp = jsonify(message=why, detail={})
    resp.status_code = 422
    return resp


def _count_refusal(plugin, reason: str) -> None:
    try:
        plugin.metrics.refusals.labels(reason=reason).inc()
    except Exception:  # noqa: BLE001 - metrics never decide an answer
        pass


def _before_job_get(plugin, req):
    """The served poll ``req``: one read of the gate by ``_id`` (gates.Gates.admit); refuse (204)
    a fenced or paused agent, remember the poll (agent, watched) for :func:`_after_job_get` (in
    ``req.environ[WATCHED]``), leave everyone else alone."""
    agent = req.cookies.get("agent_name")
    if not agent or not req.args.getlist("queue"):
        return None  # Testflinger answers 401/400 itself
    refusal, watched = plugin.store.gates.admit(agent)
    if refusal is not None:
        _count_refusal(plugin, refusal)
        return _no_job()
    req.environ[WATCHED] = (agent, watched)
    return None


def _after_job_get(plugin, agent: str, watched: bool, response):
    """A served poll after Testflinger's handler: if it handed out a job, the marker (only for a
    ``watched`` agent, one that had a gate at the first read) then the second gate read
    (gates.Gates.hand_out); fenced meanwhile, or any failure there, gives the job back and
    answers 204. An empty poll costs nothing here."""
    if response.status_code != 200 or not response.is_json:
        return response
    job = response.get_json(silent=True) or {}
    job_id = job.get("job_id")
    if not job_id:
        return response
    reason = plugin.store.gates.hand_out(agent, job_id, job.get("job_queue"), watched)
    if reason is None:
        return response
    _count_refusal(plugin, reason)
    return _no_job()


def _answer_agents(plugin, queue: str, docs: list[dict], leases: list[dict],
                   hosts: list[dict]) -> tuple[list[dict], dict[str, str], dict]:
    """``(agents, fenced, stale)``: ``docs`` (the agents listing ``queue``, :func:`_vm_agent_docs`)
    as the preflight answers them, a stale agent host's VM agents as :mod:`.staleagents` says
    (TRIAL finding 11) and the idle VM agents of ``leases`` (the queue's open leases,
    :func:`open_leases`) that take no new job ``offline``, saying why (:mod:`.fencedagents`);
    ``fenced`` is ``{VM agent: why}`` of those leases, ``stale`` ``{host: seconds silent}``
    (``hosts``: the agent hosts' documents, already read). Reads: the queue's leases on stale
    hosts (only when one is stale), the paused leases' devices (only when one is paused)."""
    stale = staleagents.stale_heartbeats(plugin, hosts)
    agents = staleagents.answer(plugin, queue, docs, stale)
    fenced = fencedagents.fenced_vm_agents(
        leases, fencedagents.quarantined_devices(plugin.db, leases))
    return fencedagents.annotate(agents, fenced), fenced, stale


def _read_hosts(plugin) -> list[dict]:
    return list(plugin.db.magic_agent_hosts.find(
        {}, {"last_heartbeat": 1, "maas_unreachable_since": 1}))


def _removed_queue_agents(plugin, queue: str):
    """The answer for ``queue``, not a magic queue now: None (Testflinger's own handler) unless
    an apply removed it (:func:`.removedqueues.record`: one read by ``_id`` for any queue).
    For a removed one: no agent lists it any more -> 404 saying who removed it and when
    (:func:`.removedqueues.unknown_queue_message`; Testflinger's body shape: message, detail);
    else the agents listing it as Testflinger lists them, its draining leases' idle VM agents
    answered ``offline`` (:func:`_answer_agents`: queue-status counted them Available, F2), or
    404 saying the queue was removed when every agent listed is one of its leases' VM agents
    and none takes a new job (the preflight says why instead of "no online agents"). An agent
    that is none of those (a real agent an operator pointed at the name) is listed as it is,
    and keeps the list answered. Reads: the record, the agents listing the queue, its open
    leases, the agent hosts, and :func:`_answer_agents`' conditional ones."""
    rec = removedqueues.record(plugin.db, queue)
    if rec is None:
        return None  # not ours: Testflinger's handler (an invalid stored queue is ours: say why)
    docs = _vm_agent_docs(plugin, queue)
    if not docs:
        resp = jsonify(message=removedqueues.unknown_queue_message(queue, rec), detail={})
        resp.status_code = 404
        return resp
    leases = open_leases(plugin, queue)
    agents, fenced, _stale = _answer_agents(plugin, queue, docs, leases, _read_hosts(plugin))
    ours = {vm.get("agent_name") for lease in leases for vm in lease.get("vms") or []}
    if not fencedagents.serving(agents, fenced) and all(a.get("name") in ours for a in agents):
        resp = jsonify(message=removedqueues.removed_message(queue, rec), detail={})
        resp.status_code = 404
        return resp
    return jsonify(agents)


def _before_queue_agents(plugin, req):
    """``GET /v1/queues/<queue>/agents`` for a caller Testflinger serves (module docstring): a
    magic queue's answer (valid or not), a removed one's (:func:`_removed_queue_agents`), or
    None for any other queue (Testflinger's handler)."""
    parts = req.path.strip("/").split("/")
    if len(parts) != 4 or parts[3] != "agents":
        return None
    queue = parts[2]
    # Same roles as Testflinger's get_agents_on_queue; a refused caller gets its answer.
    if not served(auth.READ_ROLES, req):
        return None
    if plugin.definition(queue) is None and plugin.problem(queue) is None:
        return _removed_queue_agents(plugin, queue)
    # One read of the agent hosts for the stale VM agents and for the capacity entry's stale
    # and MAAS-down hosts.
    hosts = _read_hosts(plugin)
    leases = open_leases(plugin, queue)
    own = own_leases(plugin, queue, leases)
    agents, fenced, stale = _answer_agents(plugin, queue, _vm_agent_docs(plugin, queue), leases,
                                           hosts)
    from testflinger_magic.reconcile_model import maas_down_hosts  # noqa: PLC0415

    maas_down = maas_down_hosts({h["_id"]: h.get("maas_unreachable_since") for h in hosts},
                                  stale, plugin.engine.clock())
    entry, why, usable = capacity(plugin, queue, set(stale), own, maas_down=set(maas_down))
    # The capacity entry stands in while no agent of the queue is online, and while the queue
    # can have VMs other than the listed ones (a usable device none of its open leases holds):
    # testflinger-cli's pre-submit check refuses a job whose exclude_agents names every online
    # agent listed, although lending would serve it (TRIAL7), as the server's own check counts
    # them (server/excludes.py). Once every usable device is the queue's, queue-status counts
    # its real VM agents only.
    serves = fencedagents.serving(agents, fenced)
    if entry is not None and (not serves or any(name not in own for name in usable)):
        agents.append(entry)
    if not agents or (entry is None and not serves):
        # Nothing serves the queue and nothing can be lent to it: the preflight says why
        # rather than letting a job in to wait for an operator (a fenced lease's busy VM
        # agents finish their jobs and take no other).
        resp = jsonify(message=why)
        resp.status_code = 404
        return resp
    return jsonify(agents)
