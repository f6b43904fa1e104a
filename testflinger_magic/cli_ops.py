"""The operator commands that call the server's ``/v1/magic`` API (split from cli.py): apply,
status, plan, queues, drain, quarantine, unquarantine, leases, events, lend."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import quote

from testflinger_magic.cli_api import ApiClient, CliError, _emit
from testflinger_magic.cli_output import (
    LEASE_COLUMNS,
    _cell,
    _items,
    _lease_rows,
    _needs_a_person,
    _why_jobs_wait,
    render_definitions,
    table,
)
from testflinger_magic.durations import parse_bounded_duration
from testflinger_magic.queue_issues import read_text
from testflinger_magic.queues import DefinitionError
from testflinger_magic.webhooks import AllowList


def cmd_apply(args, api: ApiClient) -> int:
    """Validate FILE offline, then ``PUT /v1/magic/queues``. The warnings ``validate`` gives
    (valid but likely wrong, queue_warnings) and the server's (queues no registered device can
    serve) are printed on stderr as ``warning: ...`` (exit status unchanged) and, with
    ``--json``, listed under ``warnings`` ([{file, line, field, message}], then the server's
    [{queue, message}]) beside the server's answer; the removed queues' open leases are printed
    as ``draining: ...`` lines (what becomes of each, with the grace); an unchanged queue whose
    lending stays suspended as a ``still suspended: ...`` line (``--unsuspend`` lifts it)."""
    from testflinger_magic import queue_warnings  # noqa: PLC0415

    try:
        # Fail fast, offline, with file:line; where webhooks may point is the server's
        # allow-list, so the server alone judges that.
        queues, warnings = queue_warnings.load_file(args.file,
                                                    webhook_allow=AllowList(everything=True))
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    try:  # read again (bounded) for the server: what was just checked, unless it changed
        text = read_text(Path(args.file))
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    body = {"yaml": text, "source": args.source or str(args.file)}
    if args.force:
        body["force"] = True
    if getattr(args, "unsuspend", False):
        body["unsuspend"] = True
    data = api.call("PUT", "/v1/magic/queues", body)
    for warning in warnings:  # likely wrong, still applied: exit status unchanged
        print(f"warning: {warning}", file=sys.stderr)
    # The server's: queues no registered device can serve (server/applycheck.py).
    served = [w for w in (data.get("warnings") or []) if isinstance(w, dict)] \
        if isinstance(data, dict) else []
    for w in served:
        print(f"warning: {w.get('queue')}: {w.get('message')}", file=sys.stderr)
    # The server's: a queue whose agent_template no registered agent host has.
    for warning in (data.get("agent_template_warnings") or []) if isinstance(data, dict) else []:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json and isinstance(data, dict):
        data = dict(data, warnings=[w.to_dict() for w in warnings] + served)

    def render(d):
        applied = d.get("applied", [q.name for q in queues])
        same = set(d.get("unchanged") or [])
        removed = d.get("removed", [])
        new = [n for n in applied if n not in same]
        out = (f"applied: {', '.join(new) or '-'}"
               + (f" (unchanged: {', '.join(n for n in applied if n in same)})" if same else "")
               + f"\nremoved: {', '.join(removed) or '-'}")
        cancelled = {q: n for q, n in (d.get("cancelled") or {}).items() if n}
        if cancelled:
            out += "\ncancelled waiting jobs: " + ", ".join(
                f"{q}: {n}" for q, n in sorted(cancelled.items()))
        for x in d.get("draining") or []:  # the removed queues' open leases
            out += (f"\ndraining: {x.get('queue')}: lease {x.get('lease_id')} on "
                    f"{x.get('device')} ({x.get('state')}): {x.get('message')}")
        for x in d.get("undraining") or []:  # queues applied again: their removal undone
            out += (f"\nundraining: {x.get('queue')}: lease {x.get('lease_id')} on "
                    f"{x.get('device')} ({x.get('state')}): {x.get('message')}")
        if removed:
            out += ("\nremoved queues are no longer advertised; new submissions to them are "
                    "refused")
        for x in d.get("keeping_old") or []:  # changed queues' leases keep what they copied
            leases = x.get("leases") or []
            # The leases whose copied values differ (``keeps``; a server before it: all).
            keeping = [h for h in leases if h.get("keeps", True)]
            if x.get("fields") and keeping:
                held = ", ".join(f"{h.get('lease_id')} ({h.get('state')} on {h.get('device')})"
                                 for h in keeping)
                out += (f"\nkeeping the old definition: {x.get('queue')}: {held} keep "
                        f"{', '.join(x.get('fields') or [])} until returned; new leases get "
                        "the new values (drain these to apply them now)")
            over = x.get("over_max_devices")
            if over is not None:
                extra = len(leases) - int(over)
                # A lease already draining or restoring is on its way back: not suggested
                # again, and counted against the excess (TRIAL16 F5).
                going = [h for h in leases if h.get("state") in ("draining", "restoring")]
                left = [h for h in leases if h not in going]
                out += (f"\nover max_devices: {x.get('queue')} holds {len(leases)} open leases, "
                        f"max_devices is now {over}: nothing more is lent to it until it holds "
                        "fewer; ")
                if going:
                    out += (f"{len(going)} of them already drain"
                            f"{'s' if len(going) == 1 else ''} ("
                            + ", ".join(str(h.get("lease_id")) for h in going) + "); ")
                if extra > len(going) and left:
                    out += (f"the {'others' if going else 'leases it holds'} return as they "
                            "go idle (idle_timeout), or drain "
                            f"{extra - len(going)} of them now: " + ", ".join(
                                f"`testflinger-magic drain {h.get('lease_id')}`" for h in left))
                else:
                    out += "nothing more to drain for it"
            gone = set(x.get("deselected") or [])
            for h in (h for h in leases if h.get("lease_id") in gone):
                out += (f"\nno longer selected: {x.get('queue')}: {h.get('device')} (lease "
                        f"{h.get('lease_id')}, {h.get('state')}) keeps serving the queue until "
                        f"drained: `testflinger-magic drain {h.get('lease_id')}`")
        for x in d.get("still_suspended") or []:  # unchanged definitions keep their suspension
            out += (f"\nstill suspended: {x.get('queue')} (definition unchanged): "
                    f"{x.get('reason')}; change its definition, or apply --unsuspend once the "
                    "cause is fixed")
        return out
    return _emit(args, data, render)


def cmd_status(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/status")

    def render(d):
        # SUSPENDED: why a queue lends nothing (its definition made a lease fail); without
        # it a queue with waiting jobs and lendable devices looks merely slow.
        queues = _items(d, "queues")
        # A suspended queue lends none of its devices: DEVICES_LENDABLE says 0, marked (the
        # JSON's devices_lendable still counts the devices, docs/api.md; TRIAL2 finding 9).
        rows = [dict(q, devices_lendable="0 (suspended)")
                if isinstance(q, dict) and q.get("suspended") else q for q in queues]
        parts = ["QUEUES", table(rows, ["name", "waiting", "vm_agents", "leases",
                                        "devices_lendable", "suspended"])]
        waiting = _why_jobs_wait(queues, d)
        if waiting:
            parts += ["", "WHY JOBS WAIT", *waiting]
        attention = _needs_a_person(d)
        if attention:
            parts += ["", "NEEDS A PERSON", *attention]
        parts += ["", "LEASES", table(_lease_rows(_items(d, "leases")),
                                      LEASE_COLUMNS + ["running_jobs"])]
        devices = [dict(x, name=x.get("name", x.get("_id")),
                        quarantined=(x.get("quarantine_reason") or "yes")
                        if x.get("quarantined") else "no")
                   for x in _items(d, "devices")]
        parts += ["", "DEVICES", table(devices, ["name", "agent_host", "gpus", "home_queues",
                                                 "tags", "failures", "quarantined"])]
        borrowed = _items(d, "borrowed")
        if borrowed:  # fairness: GPU-hours of closed leases, per magic queue and home pool
            parts += ["", "GPU-HOURS BORROWED", table(borrowed, ["queue", "home_pool",
                                                                  "gpu_hours", "leases"])]
        return "\n".join(parts)
    return _emit(args, data, render)


def cmd_plan(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/plan")

    def render(d):
        actions = _items(d, "actions")
        if not actions:
            return "nothing to do"
        return table(actions, ["kind", "queue", "device", "lease_id", "reason"])
    return _emit(args, data, render)


def cmd_queues(args, api: ApiClient) -> int:
    """The applied definitions as the server holds them (``GET /v1/magic/queues``), written as
    a definitions file; webhook URLs stay redacted as the server returns them."""
    data = api.call("GET", "/v1/magic/queues")
    return _emit(args, data, lambda d: render_definitions(_items(d, "queues"), api.server))


def cmd_drain(args, api: ApiClient) -> int:
    try:
        parse_bounded_duration(args.grace)
    except ValueError as exc:
        raise CliError(f"--grace: {exc}") from exc
    body = {"reason": args.reason, "grace": args.grace, "force": args.force}
    data = api.call("POST", f"/v1/magic/leases/{quote(args.lease_id, safe='')}/drain", body)

    def render(d):
        state = (d.get("lease") or d).get("state", "?")
        lease = d.get("lease") or d
        note = f"\n{lease['note']}" if isinstance(lease, dict) and lease.get("note") else ""
        if state == "restoring":  # a lease still in bring-up has no job: restored at once
            return (f"{args.lease_id} was still bringing up (no job ran on it): restoring now, "
                    "the device goes back to its home queue" + note)
        out = f"draining {args.lease_id}: state {state}"
        drain = (lease.get("drain") or {}) if isinstance(lease, dict) else {}
        replaced = drain.get("replaced")
        if isinstance(replaced, dict):  # it was draining already (TRIAL2 finding 8)
            at, until = drain.get("requested_at"), drain.get("grace_until")
            new = (until - at) if isinstance(at, (int, float)) and isinstance(
                until, (int, float)) else None
            out += (f"; grace changed from {_grace_text(replaced.get('grace'))} "
                    f"({replaced.get('label') or replaced.get('kind')}: "
                    f"{replaced.get('reason')}) to {_grace_text(new)} ({drain.get('reason')})")
        return out + note
    return _emit(args, data, render)


def cmd_abandon(args, api: ApiClient) -> int:
    """(admin) Close a lease its agent host will not finish as ``failed``
    (POST /v1/magic/leases/<id>/abandon): the answer's ``note`` says what to check next."""
    body = {"reason": args.reason, "force": args.force}
    data = api.call("POST", f"/v1/magic/leases/{quote(args.lease_id, safe='')}/abandon", body)

    def render(d):
        d = d if isinstance(d, dict) else {}
        out = f"abandoned {args.lease_id}: state {d.get('state', '?')}"
        return out + (f"\n{d['note']}" if d.get("note") else "")
    return _emit(args, data, render)


def _grace_text(seconds) -> str:
    """``"15m"`` for 900 seconds; ``"?"`` when unknown."""
    from testflinger_magic.durations import format_duration  # noqa: PLC0415

    return format_duration(seconds) if isinstance(seconds, (int, float)) else "?"


def cmd_quarantine(args, api: ApiClient) -> int:
    data = api.call("POST", f"/v1/magic/devices/{quote(args.device, safe='')}/quarantine",
                    {"reason": args.reason})

    def render(d):
        previous = d.get("previous_reason") if isinstance(d, dict) else None
        if previous is None:
            text = f"quarantined {args.device}: {args.reason}"
        elif previous == args.reason:
            text = f"{args.device} was already quarantined: {args.reason}"
        else:
            text = (f"{args.device} was already quarantined ({_cell(previous)}); "
                    f"reason now: {args.reason}")
        held = d.get("open_lease") if isinstance(d, dict) else None
        if isinstance(held, dict) and held.get("state") == "restoring":
            # Nothing to drain: its agent host's daemon finishes the restore (TRIAL14 F4).
            text += (f"\n{args.device} still holds lease {held.get('_id')} ({held.get('queue')}, "
                     "restoring): its agent host's daemon gives it back when the restore ends; "
                     "if that host is gone for good: `testflinger-magic abandon "
                     f"{held.get('_id')} --reason ...`")
        elif isinstance(held, dict):
            text += (f"\n{args.device} still holds lease {held.get('_id')} ({held.get('queue')}, "
                     f"{held.get('state')}): from the next tick no new job starts there (a "
                     "bring-up is stopped), running jobs finish, then it is given back; "
                     f"`testflinger-magic drain {held.get('_id')}` gives the device back now "
                     "(running jobs cancelled after the grace)")
        return text
    return _emit(args, data, render)


def cmd_unquarantine(args, api: ApiClient) -> int:
    """Lift a quarantine; like ``quarantine`` of a quarantined device, lifting one that is not
    quarantined succeeds (exit 0) and says so (the answer's ``previous_reason`` is None)."""
    data = api.call("DELETE", f"/v1/magic/devices/{quote(args.device, safe='')}/quarantine")

    def render(d):
        d = d if isinstance(d, dict) else {}
        released = d.get("released_failed_lease")
        # The failed restore may have left the device agent stopped and the machine not
        # Ready: say what happens next and what to check, not that it is back (TRIAL 10).
        host = d.get("agent_host") or "its agent host"
        tail = (f"; released its failed lease {released}: {args.device} may be lent again and "
                "serves its home queues once its testflinger-agent runs and posts waiting. The "
                "failed restore may have left that agent stopped: the agent-host daemon "
                "restarts it if it finishes the give-back, else start it by hand. Check "
                f"`supervisorctl status` on {host} and that the machine is Ready in MAAS"
                ) if released else ""
        hold = d.get("lifted_hold_back")
        if hold:  # TRIAL14 F6: it said "nothing to lift" and lifted the hold
            tail = f"; lifted its hold-back from lending ({hold}){tail}"
        if "previous_reason" in d and d["previous_reason"] is None:
            lifted = "" if hold else "; nothing to lift"
            return f"{args.device} was not quarantined{lifted}{tail}"
        was = f" (was: {_cell(d['previous_reason'])})" if d.get("previous_reason") else ""
        if d.get("registered") is False:
            tail = (f"; it is not registered now: its kept quarantine is lifted, and it is "
                    f"lendable once an agent host registers it{tail}")
        return f"unquarantined {args.device}{was}{tail}"
    return _emit(args, data, render)


def cmd_leases(args, api: ApiClient) -> int:
    params = {}
    if args.queue:
        params["queue"] = args.queue
    if not args.all:
        params["open"] = "1"
    data = api.call("GET", "/v1/magic/leases", params=params)
    return _emit(args, data, lambda d: table(_lease_rows(_items(d, "leases")), LEASE_COLUMNS))


def cmd_events(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/events", params={"limit": str(args.limit)})

    def render(d):
        import time
        rows = []
        for e in _items(d, "events"):
            row = dict(e)
            at = e.get("at")
            row["at"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) \
                if isinstance(at, (int, float)) else at
            rows.append(row)
        return table(rows, ["at", "kind", "queue", "device", "lease_id", "message"])
    return _emit(args, data, render)


def cmd_lend(args, api: ApiClient) -> int:
    body = {"device": args.device, "queue": args.queue, "reason": args.reason}
    if getattr(args, "force", False):
        body["force"] = True
    data = api.call("POST", "/v1/magic/leases", body)
    lease = data.get("lease", data) if isinstance(data, dict) else {}
    forced = lease.get("forced")
    vms = lease.get("vms") if isinstance(lease.get("vms"), list) else None
    split = f", {len(vms)} VM{'' if len(vms) == 1 else 's'}" if vms is not None else ""
    note = lease.get("note")
    return _emit(args, data, lambda d: f"lent {args.device} to {args.queue}: lease "
                                       f"{lease.get('_id', '?')} ({lease.get('state', '?')}"
                                       f"{split})" + (f"\nforced: {forced}" if forced else "")
                 + (f"\n{note}" if note else ""))


def cmd_forget_nvswitches(args, api: ApiClient) -> int:
    """Forget what the server knows of DEVICE's NVSwitches (server/devicefacts.py: learnt by a
    split or listed by MAAS' commissioning): it may be picked for queues of several GPUs per VM
    again, and its agent host's next registration (from MAAS >= 3.0) or its next split learns
    them again. Succeeds (exit 0) saying so when nothing was known."""
    data = api.call("DELETE", f"/v1/magic/devices/{quote(args.device, safe='')}/nvswitches")

    def render(d):
        previous = ((d if isinstance(d, dict) else {}).get("previous") or {}).get("nvswitches")
        if previous is None:
            return f"nothing was known of {args.device}'s NVSwitches; nothing to forget"
        return (f"forgot {args.device}'s {previous} NVSwitch(es): it may be lent to queues of "
                "several GPUs per VM again; its agent host's next registration (what MAAS' "
                "commissioning lists: re-commission it in MAAS after a hardware change) or its "
                "next split learns them again")
    return _emit(args, data, render)
