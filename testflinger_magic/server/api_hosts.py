"""The agent-host protocol's routes on the /v1/magic blueprint (docs/architecture.md: register,
work long-poll, report, heartbeat) and their body schemas. The blueprint, its error handlers
and the operator API are in :mod:`.api`; importing this module adds these routes to it
(server/__init__.py imports both)."""

from __future__ import annotations

import math
import time

from apiflask import Schema
from apiflask.fields import Dict, Float, Integer, Nested, String
from apiflask.validators import Length, OneOf, Range
from flask import request
from marshmallow import ValidationError, post_load, validates_schema

from testflinger_magic import fabric, names
from testflinger_magic import queues as queues_mod
from testflinger_magic.agent_host import config as hostcfg
from testflinger_magic.agent_host.instance import MAX_INSTANCE

from . import auth
from .api import _caller, _plugin, bp
from .apifields import (AGENT_LIMIT, MAX_AGENT_BODY, BoundedList, NameRule, StrictBoolean,
                        StrictInteger, body_limit)
from .engine import Invalid

#: Longest long-poll of GET work, seconds (the protocol's cap).
MAX_WAIT = 30.0
#: How often a long-poll re-reads MongoDB to see other replicas' changes, seconds.
RECHECK = 1.0


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


# ----- routes -----------------------------------------------------------------------------------
@bp.post("/agent-hosts/<host>")
@auth.require(*auth.AGENT_ROLES)
@body_limit(MAX_AGENT_BODY, AGENT_LIMIT)
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
@body_limit(MAX_AGENT_BODY, AGENT_LIMIT)
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
@body_limit(MAX_AGENT_BODY, AGENT_LIMIT)
@bp.input(HeartbeatIn, location="json")
def heartbeat(host, json_data):
    """Record that ``host`` is alive and working on ``leases``."""
    _plugin().engine.heartbeat(host, json_data["leases"], client_id=_caller(),
                               maas_unreachable_since=json_data["maas_unreachable_since"],
                               instance=json_data["instance"])
    return {}
