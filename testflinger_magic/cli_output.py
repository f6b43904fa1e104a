"""Text output of the ``testflinger-magic`` commands: plain tables and the status sections.

Pure functions of the server's JSON answers (docs/api.md); :mod:`testflinger_magic.cli` prints
what they return (or the JSON itself with ``--json``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from testflinger_magic.durations import format_duration


def table(rows: list[dict], columns: list[str]) -> str:
    """Plain-text table: one header line, then one line per row (missing cells are '-'), or
    ``(none)`` under the header when there are no rows."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    out = ["  ".join(c.lstrip("_").upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    if not cells:
        out.append("(none)")
    return "\n".join(out)


def _cell(value: Any) -> str:
    """One table cell on one line: a multi-line text (a reason with the problems listed under
    it) is joined with ``; `` so the table keeps one row per line."""
    text = _cell_text(value)
    if "\n" in text or "\r" in text:
        text = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return text or "-"


def _cell_text(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.1f}"
    if isinstance(value, (list, tuple)):
        return ",".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _items(data: Any, key: str) -> list[dict]:
    """``data[key]`` when the server wraps a list in an object, or ``data`` if it is a list."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        items = data.get(key)
        return items if isinstance(items, list) else []
    return []


LEASE_COLUMNS = ["_id", "queue", "device", "state", "vms", "agent_host", "age", "drain"]


def _lease_rows(leases: list[dict], now: float | None = None) -> list[dict]:
    now = time.time() if now is None else now
    rows = []
    for lease in leases:
        row = dict(lease)
        if isinstance(row.get("vms"), list):
            row["vms"] = len(row["vms"])
        created, ended = row.get("created_at"), row.get("updated_at")
        # A closed lease shows how long it lived (its last change closed it), marked as such,
        # rather than an age that keeps growing.
        closed = row.get("state") in ("returned", "failed") and isinstance(ended, (int, float))
        row["age"] = (format_duration(max(0.0, (ended if closed else now) - created))
                      + (" (lived)" if closed else "")) \
            if isinstance(created, (int, float)) else None
        drain = row.get("drain")
        # The grace only means something while the lease drains (jobs may still run).
        row["drain"] = (_drain_cell(drain, now, row.get("state") == "draining")
                        if isinstance(drain, dict) else None)
        jobs = row.get("running_jobs")
        # Short for a terminal: a job UUID's first 8 characters, the VM agent by its part
        # after the device's name (8 VMs of full ids made a 400-character cell, TRIAL5
        # finding 10); --json has them whole.
        device = f"{row.get('device')}-"
        row["running_jobs"] = [
            f"{_short_id(j.get('job_id'))}@{str(j.get('agent')).removeprefix(device)}"
            for j in jobs if isinstance(j, dict)] if isinstance(jobs, list) else None
        rows.append(row)
    return rows


def _short_id(job_id) -> str:
    """A Testflinger job id (a UUID) by its first 8 characters, as ``git`` shortens hashes;
    other ids as they are."""
    text = str(job_id)
    return text[:8] if len(text) == 36 and text.count("-") == 4 else text


def _drain_cell(drain: dict, now: float, draining: bool = True) -> str:
    """``"maintenance (grace until 14:03:00, 4m left)"``: the drain's reason and, while the
    lease is ``draining``, its grace deadline (local time) after which running jobs are
    cancelled (a restoring or closed lease shows the reason alone); a drain that replaced
    another adds ``; replaced removed-queue drain``."""
    text = drain.get("reason") or drain.get("kind") or "yes"
    until = drain.get("grace_until")
    if draining and isinstance(until, (int, float)):
        at = time.strftime("%H:%M:%S", time.localtime(until))
        left = f"{format_duration(until - now)} left" if until > now else "grace over"
        text += f" (grace until {at}, {left})"
    replaced = drain.get("replaced")
    if isinstance(replaced, dict):  # an operator's drain over another one (TRIAL2 finding 8)
        text += f"; replaced {replaced.get('label') or replaced.get('kind') or 'a drain'}"
    return text


def _needs_a_person(d: dict, now: float | None = None) -> list[str]:
    """Lines for the status's invalid queues, failed leases still holding their device,
    overdue leases and stale agent hosts (with their leases)."""
    now = time.time() if now is None else now
    lines = [f"queue {q.get('name')}: stored definition ignored: {_cell(q.get('reason'))}; "
             "apply it again" for q in _items(d, "invalid_queues")]
    for f in _items(d, "failed_leases"):
        dev = f.get("device")
        at = f.get("failed_at")
        ago = f" {format_duration(max(0.0, now - at))} ago" if isinstance(at, (int, float)) else ""
        quarantined = ", quarantined" if f.get("quarantined") else ""
        lines.append(
            f"lease {f.get('lease_id')} on {dev} ({f.get('queue')}) failed{ago}: "
            f"{_cell(f.get('error'))}; {dev}{quarantined} stays out of its home queues, its "
            f"agent maybe stopped: check the machine (MAAS) and agent host "
            f"{f.get('agent_host')}, then `testflinger-magic unquarantine {dev}` releases the "
            "lease")
    lines += [f"device {k.get('device')} (MAAS machine {k.get('maas_system_id')}) is not "
              f"registered and stays quarantined when it is ({_cell(k.get('reason'))}): "
              f"`testflinger-magic unquarantine {k.get('device')}` lifts it once a person has "
              "looked" for k in _items(d, "kept_quarantines")]
    lines += [f"lease {o.get('lease_id')} on {o.get('device')} ({o.get('queue')}) still "
              f"{o.get('state')} {format_duration(o.get('overdue_for') or 0)} past its deadline "
              f"(agent host {o.get('agent_host')})" for o in _items(d, "overdue_leases")]
    for h in _items(d, "stale_agent_hosts"):
        name = h.get("name")
        if isinstance(h.get("silent_for"), (int, float)):
            what = f"no heartbeat for {format_duration(h['silent_for'])}"
        elif h.get("registered") is False:
            what = ("never sent a heartbeat (bound, never registered: start its daemon, or "
                    f"`testflinger-magic agent-hosts forget {name}`)")
        else:
            what = "never sent a heartbeat"
        leases = [x for x in h.get("leases") or [] if isinstance(x, dict)]
        held = (f"; its leases are not being worked: "
                + ", ".join(f"{x.get('lease_id')} {x.get('state')} on {x.get('device')} "
                            f"({x.get('queue')})" for x in leases)) if leases else ""
        if h.get("instance"):  # the daemon instance last accepted: which machine to look at
            what += f" (daemon instance {h['instance']})"
        lines.append(f"agent host {name}: {what} (devices: {', '.join(h.get('devices') or []) or '-'})"
                     + held)
    return lines


#: Lease states during which a lease is brought up (its VM agents not serving yet).
_BRINGUP = ("claimed", "fenced", "deploying", "splitting", "enrolling")


def bringup_lines(q: dict, leases: list[dict], now: float) -> list[str]:
    """For a queue of ``status`` (``q``) with waiting jobs, one line per lease of it still
    bringing up (``leases``: status' open leases), with the daemon's last progress message for
    the lease's current state (``cuda-vm: 1 waiting, lease L on D still deploying for 6s``):
    what ``status``' WHY JOBS WAIT and the status page's "why jobs wait" column both say."""
    if not q.get("waiting"):
        return []
    lines = []
    for lease in leases:
        if lease.get("queue") != q.get("name") or lease.get("state") not in _BRINGUP:
            continue
        since = _state_since(lease)
        took = f" for {format_duration(max(0.0, now - since))}" if since is not None else ""
        line = (f"{q.get('name')}: {q.get('waiting')} waiting, lease {lease.get('_id')} on "
                f"{lease.get('device')} still {lease.get('state')}{took}")
        note = lease.get("progress_note")
        if isinstance(note, dict) and note.get("state") == lease.get("state") \
                and note.get("message"):
            at = note.get("at")
            ago = (f" ({format_duration(max(0.0, now - at))} ago)"
                   if isinstance(at, (int, float)) else "")
            line += f": agent host says{ago}: {_cell(note.get('message'))}"
        lines.append(line)
    return lines


def cancel_waiting_text(at: float, now: float, utc: bool = False) -> str:
    """When an unservable queue's waiting jobs are cancelled (``cancel_waiting_at``, epoch
    seconds; server/unservablejobs.py), for ``status`` (local time) and the status page
    (``utc``)."""
    stamp = (time.strftime("%H:%M:%S UTC", time.gmtime(at)) if utc
             else time.strftime("%H:%M:%S", time.localtime(at)))
    return (f"its waiting jobs are cancelled in {format_duration(max(0, at - now))} (at "
            f"{stamp}), told why, unless a device that fits registers or the definition changes")


def _why_jobs_wait(queues: list[dict], d: dict | None = None, now: float | None = None) -> list[str]:
    """One line per queue whose waiting jobs get no device (the server's ``blocked`` reason,
    what ``plan`` says), then one indented line per quarantined device it could use. With the
    whole status ``d``: also the waiting jobs' leases still bringing up (with the daemon's last
    progress message for the lease's current state, e.g. "MAAS unreachable since ..."), and
    the home queues whose jobs wait for lent devices (``home_waits``: the reclaim's owner_wait
    and the time left for the devices the reclaim takes, "stays lent" for the others, and a
    device whose agent host is stale said so)."""
    now = time.time() if now is None else now
    leases = _items(d, "leases") if d is not None else []
    lines = []
    for q in queues:
        if not isinstance(q, dict):
            continue
        if q.get("unservable") and not isinstance(q.get("blocked"), dict):
            # No device can ever serve it: said whether or not jobs wait (the preflight refuses
            # submissions and sends the test engineer's operators here; TRIAL10).
            lines.append(_cell(f"{q.get('name')}: no registered device can serve it: "
                               f"{q['unservable']}"))
        blocked = q.get("blocked")
        if isinstance(blocked, dict):
            lines.append(_cell(blocked.get("reason") or blocked.get("why")))
            for dev in q.get("quarantined") or []:
                lines.append(f"  {dev.get('device')} quarantined: "
                             f"{_cell(dev.get('reason') or 'no reason given')}")
        at = q.get("cancel_waiting_at")
        if isinstance(at, (int, float)):
            lines.append("  " + cancel_waiting_text(at, now))
        lines.extend(bringup_lines(q, leases, now))
    for h in _items(d, "home_waits") if d is not None else []:
        parts = []
        for x in h.get("lent") or []:
            state = x.get("state")
            silent = x.get("agent_host_stale_for")
            if state == "failed":
                when = "failed: never reclaimed, see NEEDS A PERSON"
            elif isinstance(silent, (int, float)):  # nobody works the lease (TRIAL2 finding 2)
                quiet = ("sent no heartbeat yet" if silent < 0 else
                         f"no heartbeat for {format_duration(silent)}")
                when = (f"{state}; its agent host {x.get('agent_host')} is stale ({quiet}): "
                        "not coming back until its daemon runs again")
            elif state == "active" and x.get("reclaimed") is False:  # TRIAL2 finding 3
                when = "active; stays lent: the owner reclaim takes one device per waiting job"
            elif state == "active" and isinstance(x.get("reclaim_in"), (int, float)):
                wait = format_duration(x["owner_wait"]) if isinstance(
                    x.get("owner_wait"), (int, float)) else "owner_wait"
                when = (f"active; reclaimed when the oldest job has waited owner_wait {wait}: "
                        + (f"in {format_duration(x['reclaim_in'])}" if x["reclaim_in"] > 0
                           else "due now"))
            elif state in ("draining", "restoring"):
                when = f"{state}: on its way back"
            else:
                when = f"{state}: reclaimable once active, after owner_wait"
            parts.append(f"{x.get('device')} lent to {x.get('queue')} (lease "
                         f"{x.get('lease_id')} {when})")
        oldest = h.get("oldest_age")
        waited = (f", the oldest for {format_duration(oldest)}"
                  if isinstance(oldest, (int, float)) else "")
        lines.append(f"{h.get('queue')} (home queue): {h.get('waiting')} waiting{waited}; "
                     + "; ".join(parts))
    return lines


def _state_since(lease: dict) -> float | None:
    """When ``lease`` entered its current state (its last history entry), else None."""
    history = lease.get("history")
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        at = history[-1].get("at")
        if isinstance(at, (int, float)):
            return float(at)
    return None


def render_definitions(docs: list[dict], server: str) -> str:
    """Stored queue documents (``_id`` = name, durations in seconds) as a definitions file
    (durations as ``10m``), under a comment naming the server and the redaction."""
    import yaml

    from testflinger_magic.queues import MagicQueue

    if not docs:
        return f"# no magic queue is applied on {server}"
    body = {}
    for doc in docs:
        try:
            body[doc.get("_id")] = MagicQueue.from_document(doc).to_yaml_dict()
        except Exception:  # noqa: BLE001 - show what the server has, as it has it
            body[doc.get("_id")] = {k: v for k, v in doc.items() if k != "_id"}
    head = (f"# magic queues applied on {server}\n"
            "# policy.notify URLs are redacted by the server: keep the real ones in your own "
            "file\n")
    return head + yaml.safe_dump({"magic_queues": body}, sort_keys=False,
                                 default_flow_style=False).rstrip()
