"""The /v1/magic APIBlueprint: the operator API (docs/architecture.md); the agent-host protocol's
routes are added to the same blueprint by :mod:`.api_hosts`.

Bodies are validated by marshmallow schemas (apiflask ``input``): a malformed body gets 422 in
apiflask's format ``{"message": "Validation error", "detail": {"json": {"<field>": [...]}}}``.
Domain errors raised by the engine map to 403/404/409/422 with a ``message`` (409 also carries
the current ``lease``). The thin handlers here only parse, authorise and translate; decisions and
writes live in engine.py.
"""

from __future__ import annotations

import math

from apiflask import APIBlueprint, Schema
from apiflask.exceptions import HTTPError
from apiflask.fields import String
from apiflask.validators import Length
from flask import Response, current_app, jsonify, request

from testflinger_magic import queues as queues_mod
from testflinger_magic import tfstates, webhooks
from testflinger_magic.events import MAX_REASON
from testflinger_magic.fileutil import MAX_INPUT_FILE

from . import auth, templatecheck
from .apifields import StrictBoolean, body_limit
from .engine import Conflict, Forbidden, Invalid, NotFound, QueuesInUse
from .hostinstance import InstanceConflict

bp = APIBlueprint("testflinger_magic", __name__, url_prefix="/v1/magic")
# A body that is not JSON is a 400 saying so, not "field: Missing data": auth.require checks it
# once the caller is allowed (apifields.require_json_body), body_limit where a route has one.

def _plugin():
    return current_app.extensions["testflinger_magic"]


def _caller() -> str:
    """The calling client's id for the agent-host binding checks; "" (never bound, so always
    refused) for a token without one."""
    return auth.current_client() or ""


@bp.errorhandler(HTTPError)
def _http_error(err: HTTPError):
    # Blueprint-level so the format holds on a plain Flask app too (apiflask's own handler is
    # registered only by APIFlask apps).
    body = {"message": err.message, "detail": err.detail}
    body.update(err.extra_data or {})
    return jsonify(body), err.status_code, err.headers or {}


@bp.errorhandler(Conflict)
def _conflict(err: Conflict):
    if isinstance(err, InstanceConflict):  # the daemon's client exits on it (docs/api.md)
        return jsonify(message=str(err), lease=None, instance_conflict=err.data), 409
    return jsonify(message=str(err), lease=err.lease), 409


@bp.errorhandler(Forbidden)
def _forbidden(err: Forbidden):
    return jsonify(message=str(err)), 403


@bp.errorhandler(NotFound)
def _not_found(err: NotFound):
    return jsonify(message=str(err)), 404


@bp.errorhandler(Invalid)
def _invalid(err: Invalid):
    return jsonify(message="Validation error",
                   detail={"json": {err.field: [str(err)]}}), 422


# ----- schemas ----------------------------------------------------------------------------------
class QueuesIn(Schema):
    yaml = String(required=True)
    source = String(load_default="api")
    #: Remove queues missing from the file even if jobs wait on them (they are cancelled).
    force = StrictBoolean(load_default=False)
    #: Write even definitions identical to the stored ones, lifting their suspension (without
    #: it an unchanged definition keeps its ``suspended`` state, plugin.apply).
    unsuspend = StrictBoolean(load_default=False)


class LendIn(Schema):
    device = String(required=True, validate=Length(min=1))
    queue = String(required=True, validate=Length(min=1))
    reason = String(load_default="lent by hand", validate=Length(max=MAX_REASON))
    #: Lend a device the queue's ``devices`` selection excludes or does not pick (else 409).
    force = StrictBoolean(load_default=False)


class DrainIn(Schema):
    reason = String(load_default="drain requested by operator", validate=Length(max=MAX_REASON))
    grace = String(load_default="15m", validate=Length(max=100))
    force = StrictBoolean(load_default=False)


class AbandonIn(Schema):
    reason = String(required=True, validate=Length(min=1, max=MAX_REASON))
    #: Abandon even while the lease's agent host heartbeats (a host not to be trusted).
    force = StrictBoolean(load_default=False)


class BindingIn(Schema):
    client_id = String(required=True, validate=Length(min=1, max=200))
    reason = String(load_default="rebound by admin", validate=Length(max=MAX_REASON))
    #: Bind even a client Testflinger does not know (yet) or without the agent role: without
    #: it such a rebind is 409.
    force = StrictBoolean(load_default=False)


class QuarantineIn(Schema):
    reason = String(required=True, validate=Length(min=1, max=MAX_REASON))


# ----- agent-host administration (the protocol itself: api_hosts.py) ---------------------------
@bp.put("/agent-hosts/<host>/binding")
@auth.require(tfstates.ROLE_ADMIN)
@body_limit()
@bp.input(BindingIn, location="json")
def rebind(host, json_data):
    """Admin: bind agent host ``host`` to Testflinger client ``client_id`` (also before its
    first registration); from now on only that client may act for it. 409 for a client
    Testflinger does not know, or whose role is not ``agent``, unless ``force``."""
    doc = _plugin().engine.bindings.rebind(host, json_data["client_id"], json_data["reason"],
                                           by=auth.current_client(), force=json_data["force"])
    return {"agent_host": host, "client_id": doc["client_id"],
            "previous_client_id": doc.get("previous_client_id"),
            "devices": list(doc.get("devices") or []),
            "last_heartbeat": doc.get("last_heartbeat")}


@bp.delete("/agent-hosts/<host>")
@auth.require(tfstates.ROLE_ADMIN)
def forget(host):
    """Admin: remove agent host ``host`` and deregister its devices (409 while one holds a
    lease), so another agent host may register them."""
    reason = request.args.get("reason") or "forgotten by admin"
    if len(reason) > MAX_REASON:
        raise Invalid("reason", f"longer than {MAX_REASON} characters ({len(reason)})")
    return _plugin().engine.bindings.forget(host, reason, by=auth.current_client())


@bp.get("/agent-hosts")
@auth.require(*auth.READ_ROLES)
def agent_hosts():
    """Registered agent hosts with their bound client, devices, version and last heartbeat."""
    return {"agent_hosts": _plugin().engine.agent_hosts()}


# ----- operator API -----------------------------------------------------------------------------
@bp.get("/queues")
@auth.require(*auth.READ_ROLES)
def queues_get():
    """Applied magic queue definitions; webhook URLs are write-only (shown redacted). Each has
    ``suspended``: null, or the stored ``{reason, at, lease_id, device}`` of a ``blame: queue``
    report that stopped its lending (TRIAL12 F3: only ``status`` showed it); one more read."""
    plugin = _plugin()
    suspended = {d["_id"]: d.get("suspended")
                 for d in plugin.db.magic_queues.find({}, {"suspended": 1})}
    return {"queues": [dict(public_queue(q), suspended=suspended.get(q.name) or None)
                       for q in plugin.definitions()]}


def public_queue(q) -> dict:
    """``q.to_document()`` with its secrets redacted: ``policy.notify`` URLs become
    ``scheme://host/…redacted`` (webhooks.redact; the rest may hold the hook's token)."""
    doc = q.to_document()
    policy = doc.get("policy") or {}
    policy["notify"] = [webhooks.redact(u) for u in policy.get("notify") or []]
    return doc


@bp.put("/queues")
@auth.require(*auth.WRITE_ROLES)
@body_limit()
@bp.input(QueuesIn, location="json")
def queues_put(json_data):
    """Apply a whole definitions file (queues not in it are removed). 409 with ``queues:
    [{name, waiting}]`` if a removed queue still has waiting jobs, unless ``force`` (then they
    are cancelled; ``cancelled: {queue: count}`` in the answer)."""
    # The file itself, as testflinger-magic apply reads it (TRIAL12 F5: PyYAML took 16 s on 60 MB).
    size = len(json_data["yaml"].encode("utf-8", "surrogatepass"))
    if size > MAX_INPUT_FILE:
        why = (f"the definitions file ('yaml') is {size} bytes, larger than "
               f"{MAX_INPUT_FILE // (1024 * 1024)} MiB, the limit testflinger-magic apply "
               "reads too (fileutil.MAX_INPUT_FILE)")
        raise HTTPError(413, "Request Entity Too Large: " + why, detail={"json": {"yaml": [why]}})
    try:
        plugin = _plugin()
        defs = queues_mod.load_text(json_data["yaml"], filename=json_data["source"],
                                    webhook_allow=plugin.webhook_allow)
        # apply re-checks what validation cannot: that every document can be stored (BSON)
        answer = plugin.apply(defs, source=json_data["source"], force=json_data["force"],
                              unsuspend=json_data["unsuspend"])
        # A queue whose agent_template no agent host has (server/templatecheck.py).
        return dict(answer, agent_template_warnings=templatecheck.template_warnings(
            defs, list(plugin.db.magic_agent_hosts.find({}, {"templates": 1}))))
    except QueuesInUse as exc:
        return {"message": str(exc), "queues": [{"name": q, "waiting": n}
                                                for q, n in sorted(exc.waiting.items())]}, 409
    except queues_mod.DefinitionError as exc:
        issues = [i.to_dict() for i in exc.issues]
        return {"message": str(exc), "issues": issues}, 422


@bp.get("/status")
@auth.require(*auth.READ_ROLES)
def status():
    """Per-queue summary, open leases and devices."""
    return _plugin().engine.status()


@bp.get("/leases")
@auth.require(*auth.READ_ROLES + auth.AGENT_ROLES)
def leases_list():
    """Leases, filtered by ``queue``, ``state`` (one of leases.STATES) and ``open`` (a boolean:
    1/0, true/false, yes/no). A state or boolean that is none of those is 422 naming the
    parameter (not an empty or unfiltered list). A ``queue`` that is no magic queue (no stored
    definition, valid or not) and that no lease ever served is 404 naming it, as other unknown
    names are; a removed queue's past leases are still listed."""
    from testflinger_magic import leases as leases_mod  # noqa: PLC0415

    problems: dict = {}
    state = request.args.get("state")
    if state is not None and state not in leases_mod.STATES:
        problems["state"] = [f"unknown lease state {state!r}; one of: "
                             f"{', '.join(leases_mod.STATES)}"]
    try:
        open_only = _flag("open", default=False)
    except Invalid as exc:
        problems[exc.field] = [str(exc)]
    _refuse_params(problems)
    queue = request.args.get("queue")
    plugin = _plugin()
    found = plugin.engine.leases(queue=queue, state=state, open_only=open_only)
    if (queue is not None and not found
            and plugin.db.magic_queues.find_one({"_id": queue}, {"_id": 1}) is None
            and plugin.db.magic_leases.find_one({"queue": queue}, {"_id": 1}) is None):
        raise NotFound(f"{queue!r} is not a magic queue, and no lease ever served it")
    return {"leases": found}


def _refuse_params(problems: dict) -> None:
    """One 422 naming every bad query parameter (``{param: [message]}``), in the format of
    :func:`_invalid` (apiflask's), rather than the first one alone; nothing if none."""
    if problems:
        raise HTTPError(422, "Validation error", detail={"json": problems})


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _flag(name: str, default: bool) -> bool:
    """Query parameter ``name`` as a boolean (absent: ``default``); 422 for another value."""
    value = request.args.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise Invalid(name, f"{value!r} is not a boolean; use 1 or 0 (true/false, yes/no)")


@bp.get("/leases/<lease_id>")
@auth.require(*auth.READ_ROLES + auth.AGENT_ROLES)
def lease_get(lease_id):
    """One lease document (404 if unknown)."""
    return _plugin().engine.lease(lease_id)


@bp.post("/leases")
@auth.require(*auth.WRITE_ROLES)
@body_limit()
@bp.input(LendIn, location="json")
def lease_create(json_data):
    """Lend ``device`` to ``queue`` by hand (409 if it cannot be claimed now, or if the
    queue's ``devices`` selection excludes or does not pick it, unless ``force``: then the
    answer's ``forced`` says what was overridden)."""
    plugin = _plugin()
    doc = plugin.engine.lend_by_hand(json_data["device"], json_data["queue"], json_data["reason"],
                                     force=json_data["force"])
    plugin.notify()
    return doc, 201


@bp.post("/leases/<lease_id>/drain")
@auth.require(*auth.WRITE_ROLES)
@body_limit()
@bp.input(DrainIn, location="json")
def lease_drain(lease_id, json_data):
    """Drain a lease with ``grace`` (a duration), optionally ``force`` after it."""
    plugin = _plugin()
    doc = plugin.engine.drain_by_hand(lease_id, json_data["reason"], json_data["grace"],
                                      json_data["force"])
    plugin.notify()
    plugin.kick()
    return doc


@bp.post("/leases/<lease_id>/abandon")
@auth.require(tfstates.ROLE_ADMIN)
@body_limit()
@bp.input(AbandonIn, location="json")
def lease_abandon(lease_id, json_data):
    """(admin) Close, as ``failed``, a lease in bring-up or restoring that its agent host
    will not finish (Engine.abandon_by_hand); its device stays fenced and quarantined until
    a person checks it and unquarantines it."""
    plugin = _plugin()
    doc = plugin.engine.abandon_by_hand(lease_id, json_data["reason"], json_data["force"],
                                        by=auth.current_client())
    plugin.notify()
    plugin.kick()
    return doc


@bp.get("/devices")
@auth.require(*auth.READ_ROLES + auth.AGENT_ROLES)
def devices():
    """Registered devices."""
    return {"devices": _plugin().engine.devices()}


@bp.post("/devices/<name>/quarantine")
@auth.require(*auth.WRITE_ROLES)
@body_limit()
@bp.input(QuarantineIn, location="json")
def quarantine(name, json_data):
    """Quarantine a device (never lent until unquarantined)."""
    return _plugin().engine.set_quarantine(name, True, json_data["reason"])


@bp.delete("/devices/<name>/quarantine")
@auth.require(*auth.WRITE_ROLES)
def unquarantine(name):
    """Lift a device's quarantine (and reset its failure count)."""
    return _plugin().engine.set_quarantine(name, False, "unquarantined by operator")


@bp.delete("/devices/<name>/nvswitches")
@auth.require(*auth.WRITE_ROLES)
def forget_nvswitches(name):
    """Forget what the server knows of a device's NVSwitches (server/devicefacts.py: a split's
    count or MAAS'); the agent host's next registration or the next split learns it again."""
    from .devicefacts import forget  # noqa: PLC0415

    plugin = _plugin()
    out = forget(plugin.db, plugin.engine.events, name, by=auth.current_client())
    plugin.kick()
    return out


@bp.get("/plan")
@auth.require(*auth.READ_ROLES)
def plan():
    """What a tick would do now (dry run), with ``blocked`` entries saying why waiting jobs
    get no device (suspended queue, no lendable device, max_devices)."""
    actions = _plugin().engine.plan_only(explain=True)
    return {"actions": [
        {"kind": a.kind, "reason": a.reason, "queue": a.queue, "device": a.device,
         "lease_id": a.lease_id} for a in actions]}


@bp.get("/events")
@auth.require(*auth.READ_ROLES)
def events():
    """Events after ``since`` (epoch seconds), at most ``limit``; bad values: one 422 naming
    each (TRIAL12 F7)."""
    problems: dict = {}
    since = request.args.get("since")
    try:
        since = None if since in (None, "") else float(since)
    except ValueError:
        problems["since"], since = [f"{since!r} is not epoch seconds"], None
    if since is not None and not math.isfinite(since):
        problems["since"] = ["must be a finite number of epoch seconds"]
    limit = request.args.get("limit", "100")
    try:
        limit = int(limit)
    except ValueError:
        problems["limit"] = [f"{limit!r} is not an integer"]
    _refuse_params(problems)
    return {"events": _plugin().events.list(since=since, limit=min(max(limit, 1), 1000))}


@bp.get("/openapi.json")
def openapi():
    """The OpenAPI document of the /v1/magic routes.

    Unauthenticated, like Testflinger's /openapi.json (which also lists these routes when the
    host app is an APIFlask app)."""
    plugin = _plugin()
    if getattr(plugin, "openapi_spec", None) is None:
        plugin.openapi_spec = build_openapi()
    return jsonify(plugin.openapi_spec)


def build_openapi() -> dict:
    """The /v1/magic OpenAPI document, generated by apiflask from the routes' schemas on a
    private APIFlask app holding only this blueprint (so it works whatever the host app is)."""
    from apiflask import APIFlask  # noqa: PLC0415

    private = APIFlask("testflinger_magic_openapi", title="testflinger-magic /v1/magic",
                       version="1", spec_path=None, docs_path=None)
    private.register_blueprint(bp)
    with private.app_context():
        return private._get_spec("json", force_update=True)


@bp.get("/metrics")
def metrics():
    """Prometheus text exposition (unauthenticated, like Testflinger's METRICS_PORT exporter)."""
    plugin = _plugin()
    from .metrics import CONTENT_TYPE  # noqa: PLC0415

    return Response(plugin.metrics.render(plugin.db, plugin.engine.clock()),
                    content_type=CONTENT_TYPE)


# The blueprint's other routes (the agent-host protocol, the status page) are added by these
# modules; imported here so the blueprint is whole whoever imports this module first (a test
# collecting the OpenAPI document, build_openapi), never added to after it was registered.
from . import api_hosts, status_page  # noqa: E402,F401
