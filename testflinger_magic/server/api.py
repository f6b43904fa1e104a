"""The /v1/magic APIBlueprint: operator API and agent-host protocol (docs/architecture.md).

Bodies are validated by marshmallow schemas (apiflask ``input``): a malformed body gets 422 in
apiflask's format ``{"message": "Validation error", "detail": {"json": {"<field>": [...]}}}``.
Domain errors raised by the engine map to 403/404/409/422 with a ``message`` (409 also carries
the current ``lease``). The thin handlers here only parse, authorise and translate; decisions and
writes live in engine.py.
"""

from __future__ import annotations

import math
import time

from apiflask import APIBlueprint, Schema
from apiflask.exceptions import HTTPError
from apiflask.fields import Dict, Float, Integer, Nested, String
from apiflask.validators import Length, OneOf, Range
from flask import Response, current_app, jsonify, request
from marshmallow import ValidationError, post_load, validates_schema

from testflinger_magic import queues as queues_mod
from testflinger_magic.agent_host import config as hostcfg
from testflinger_magic import fabric, names, tfstates, webhooks
from testflinger_magic.agent_host.instance import MAX_INSTANCE
from testflinger_magic.events import MAX_REASON
from testflinger_magic.fileutil import MAX_INPUT_FILE

from . import auth, templatecheck
from .apifields import BoundedList, NameRule, StrictBoolean, StrictInteger, body_limit
from .engine import Conflict, Forbidden, Invalid, NotFound, QueuesInUse
from .hostinstance import InstanceConflict

bp = APIBlueprint("testflinger_magic", __name__, url_prefix="/v1/magic")
# A body that is not JSON is a 400 saying so, not "field: Missing data": auth.require checks it
# once the caller is allowed (apifields.require_json_body), body_limit where a route has one.

#: Longest long-poll of GET work, seconds (the protocol's cap).
MAX_WAIT = 30.0
#: How often a long-poll re-reads MongoDB to see other replicas' changes, seconds.
RECHECK = 1.0


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
class DeviceIn(Schema):
    # The bounds and name rules are the daemon's config checks too (agent_host/config.py,
    # testflinger_magic.names), so a bad agent-host.yaml is refused at its line rather than here.
    agent_name = String(required=True, validate=NameRule(names.DEVICE_NAME_RE,
                                                         names.device_name_problem))
    maas_system_id = String(required=True, validate=NameRule(names.SYSTEM_ID_RE,
                                                             names.system_id_problem))
    #: strict: a JSON integer only, not "8" or 8.0 (wrong types are 422, as ReportIn's).
    gpus = Integer(required=True, strict=True, validate=Range(min=0, max=hostcfg.MAX_GPUS))
    tags = BoundedList(String(validate=Length(min=1, max=hostcfg.MAX_LABEL)),
                       max_items=hostcfg.MAX_DEVICE_LABELS, load_default=list)
    home_queues = BoundedList(String(validate=Length(min=1, max=hostcfg.MAX_LABEL)),
                              max_items=hostcfg.MAX_DEVICE_LABELS, load_default=list)
    #: The NVSwitches MAAS' commissioning listed on the device (agent_host/maas_nodedevices.py);
    #: absent or null: MAAS could not say (an older MAAS, a machine never commissioned) or an
    #: older daemon. Kept unless a split's count is known (server/devicefacts.py).
    nvswitches = StrictInteger(load_default=None, allow_none=True,
                               validate=Range(min=0, max=fabric.MAX_NVSWITCHES))


class RegisterIn(Schema):
    #: At most config.MAX_DEVICES_PER_HOST, refused before any device is read (BoundedList).
    devices = BoundedList(Nested(DeviceIn), max_items=hostcfg.MAX_DEVICES_PER_HOST,
                          required=True)
    version = String(load_default="", validate=Length(max=200))
    #: The template folders the daemon has (agentfolders.template_names); None: not said.
    templates = BoundedList(String(validate=Length(max=255)), max_items=1000,
                            load_default=None, allow_none=True)
    #: The daemon's instance id (agent_host/instance.py); absent: an older daemon, accepted as
    #: before. Another instance is refused with 409 while the host's holder heartbeats.
    instance = String(load_default=None, allow_none=True, validate=Length(min=1, max=MAX_INSTANCE))
    #: The host's ``splitter.nvswitch_multi_gpu`` (testflinger_magic/fabric.py); absent: an
    #: older daemon, the stored value left as it is.
    nvswitch_multi_gpu = StrictBoolean(load_default=None, allow_none=True)

    @validates_schema
    def _no_repeats(self, data, **_kwargs):
        """A device listed twice (same ``agent_name`` or ``maas_system_id``), or whose
        ``agent_name`` clashes with an earlier one's (:func:`names.vm_name_clash`: equal but for
        case, or one is the other's VM agent name ``<device>-vm<N>``) is 422 naming the later
        one's ``devices.<i>.<key>`` and the first (the daemon's config check refuses the same,
        config._repeated_devices)."""
        errors: dict = {}
        for key in ("agent_name", "maas_system_id"):
            first: dict = {}
            for i, dev in enumerate(data.get("devices") or ()):
                if dev[key] in first:
                    errors.setdefault(i, {})[key] = [
                        f"{dev[key]!r} is already devices.{first[dev[key]]}.{key}: each "
                        f"device is registered once, with its own {key}"]
                else:
                    first[dev[key]] = i
        # A name another device's VM agents would have, or a case-only repeat (names.py
        # vm_name_clash), at the later of the two.
        index: dict = {}
        where: dict = {}
        for i, dev in enumerate(data.get("devices") or ()):
            name = dev["agent_name"]
            why = names.vm_name_clash(name, index, where)
            if why and "agent_name" not in errors.get(i, {}):
                errors.setdefault(i, {})["agent_name"] = [why]
            index.setdefault(name.lower(), []).append(name)
            where.setdefault(name, f"devices.{i}")
        if errors:
            raise ValidationError({"devices": errors})


#: Intent-log entries of one report: a restore of 64 VMs journals a few actions per VM, each
#: begin and done; far fewer than this.
MAX_REPORT_INTENT = 10_000


class IntentIn(Schema):
    action = String(required=True)
    target = String(load_default="")
    phase = String(required=True, validate=OneOf(["begin", "done"]))
    data = Dict(load_default=dict)


class ReportIn(Schema):
    agent_host = String(required=True, validate=Length(min=1))
    #: strict (TRIAL12 F8): marshmallow's lenient Integer took "6", 12.0 and 1e308 (api.md: a
    #: wrong type is 422, as the ``vms`` fields and booleans are).
    generation = Integer(required=True, strict=True, validate=Range(min=0))
    state = String(required=True)
    result = String(required=True, validate=OneOf(["progress", "ok", "error"]))
    to_state = String(load_default=None, allow_none=True)
    message = String(load_default="")
    intent = BoundedList(Nested(IntentIn), max_items=MAX_REPORT_INTENT, load_default=list)
    vms = BoundedList(Dict(), max_items=queues_mod.MAX_VMS_PER_DEVICE, load_default=list)
    #: With ``error``: whose fault it is. ``queue``: the queue's definition (e.g. its VM spec
    #: does not fit the device), so no failure is counted against the device and the queue is
    #: suspended until re-applied (engine.Engine.report). ``maas``: MAAS was unreachable (an
    #: outage of the lab's infrastructure): no failure is counted, the queue is not suspended.
    #: ``hardware``: the device's hardware cannot serve the queue's VM shape (its NVSwitches
    #: and VMs of several GPUs, ``MultiGPUNeedsFabric``): no failure counted, the queue not
    #: suspended; ``facts`` must say which (server/devicefacts.py).
    blame = String(load_default="device",
                   validate=OneOf(["device", "queue", "maas", "hardware"]))
    #: Device facts the step learnt (``{"nvswitches": N}``), kept on the device
    #: (server/devicefacts.py; checked there: 422 naming ``facts.<key>``).
    facts = Dict(load_default=None, allow_none=True)
    #: With ``error`` from ``restoring``: the restore found the device's hardware not as lent
    #: (agent_host/steps.py GiveBackRefused); the device is quarantined with the message.
    quarantine = StrictBoolean(load_default=False)

    @post_load
    def _cut_message(self, data, **_kwargs):
        """A daemon's error text (e.g. a MAAS or libvirt traceback) is kept, cut to
        :data:`MAX_REPORT_MESSAGE` characters: refusing it would leave the failure unreported,
        and it is copied into the lease's history and events (MongoDB's 16 MiB documents)."""
        message = data.get("message") or ""
        if len(message) > MAX_REPORT_MESSAGE:
            cut = len(message) - MAX_REPORT_MESSAGE
            data["message"] = message[:MAX_REPORT_MESSAGE] + f"... ({cut} characters cut)"
        return data


#: Characters of a daemon report's ``message`` kept (the rest is cut, said so).
MAX_REPORT_MESSAGE = 4000


class HeartbeatIn(Schema):
    #: A host works at most one lease per device.
    leases = BoundedList(String(), max_items=hostcfg.MAX_DEVICES_PER_HOST, load_default=list)
    #: Epoch seconds since which MAAS has not answered the host's daemon (absent or null: it
    #: answers). While set, reconcile lends none of the host's devices (docs/api.md).
    maas_unreachable_since = Float(load_default=None, allow_none=True,
                                   validate=Range(min=0, max=1e11))
    #: As ``RegisterIn.instance``.
    instance = String(load_default=None, allow_none=True, validate=Length(min=1, max=MAX_INSTANCE))


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


# ----- agent-host protocol ----------------------------------------------------------------------
@bp.post("/agent-hosts/<host>")
@auth.require(*auth.AGENT_ROLES)
@bp.input(RegisterIn, location="json")
def register(host, json_data):
    """Register agent host ``host`` and the devices it drives (403 if one is another host's;
    422 naming ``agent_host`` for a name outside ``config.AGENT_HOST_RE``)."""
    if not hostcfg.AGENT_HOST_RE.match(host):
        raise Invalid("agent_host", f"{host!r}: letters, digits, '.', '_' and '-' only, "
                      "starting with a letter or digit, at most 100 characters")
    names = _plugin().engine.register(host, json_data["devices"], json_data["version"],
                                      client_id=_caller(), templates=json_data["templates"],
                                      instance=json_data["instance"],
                                      nvswitch_multi_gpu=json_data["nvswitch_multi_gpu"])
    return {"agent_host": host, "devices": names}


@bp.get("/agent-hosts/<host>/work")
@auth.require(*auth.AGENT_ROLES)
def work(host):
    """Leases needing this host's attention; long-polls up to ``wait`` seconds (≤30).

    Returns at once when a lease needs action (states other than ``active``) unless the caller
    passes ``known=<id>:<generation>,...`` (an optional extension): then it returns as soon as
    the set of (id, generation) differs from ``known``, or when ``wait`` ends.
    """
    try:
        wait = float(request.args.get("wait", 0))
    except ValueError:
        raise Invalid("wait", "must be a number of seconds") from None
    if not math.isfinite(wait) or wait < 0:
        raise Invalid("wait", f"must be a number of seconds from 0 (above {MAX_WAIT:g} waits "
                      f"{MAX_WAIT:g}), got {request.args.get('wait')!r}")
    wait = min(MAX_WAIT, wait)
    known = request.args.get("known")
    known_set = None if known is None else {k for k in known.split(",") if k}
    plugin = _plugin()
    client = _caller()
    deadline = time.monotonic() + wait
    while True:
        leases = plugin.engine.work_for(host, client_id=client)
        seen = {f"{d['_id']}:{d['generation']}" for d in leases}
        if known_set is not None:
            if seen != known_set:
                break
        elif any(d["state"] != "active" for d in leases):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        with plugin.changed:
            plugin.changed.wait(min(RECHECK, remaining))
    return {"leases": leases}


@bp.post("/leases/<lease_id>/report")
@auth.require(*auth.AGENT_ROLES)
@bp.input(ReportIn, location="json")
def report(lease_id, json_data):
    """Apply one daemon report (progress/ok/error) to a lease; returns the new lease."""
    plugin = _plugin()
    doc = plugin.engine.report(lease_id, json_data, client_id=_caller())
    plugin.notify()
    plugin.kick()
    return doc


@bp.post("/agent-hosts/<host>/heartbeat")
@auth.require(*auth.AGENT_ROLES)
@bp.input(HeartbeatIn, location="json")
def heartbeat(host, json_data):
    """Record that ``host`` is alive and working on ``leases``."""
    _plugin().engine.heartbeat(host, json_data["leases"], client_id=_caller(),
                               maas_unreachable_since=json_data["maas_unreachable_since"],
                               instance=json_data["instance"])
    return {}


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
            "devices": list(doc.get("devices") or [])}


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
