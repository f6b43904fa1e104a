"""Whose fault is a bring-up that hit its deadline: the device's or the queue's (pure).

A ``provision_timeout`` too short for a deploy plus the VMs' commissioning makes every bring-up
of the queue time out, whatever the device. Counting each against its device would quarantine
healthy hardware of every queue in turn (issue 10 item 4), so once bring-ups of one queue have
timed out on :data:`QUEUE_TIMEOUT_DEVICES` distinct devices with no successful bring-up of the
queue (nor a re-apply of its definition) in between, the queue is blamed: its lending is
suspended as a VM spec that does not fit already suspends it (server/hostproto.py
``_suspend_queue``), and those failures are not counted against the devices.

:func:`judge_timeout` is the whole decision; the server (server/actions.py
``Actions._bringup_timed_out``, on MongoDB documents) and ``simulate`` (lab/sim_actions.py
``SimActions._bringup_timed_out``, on its lease records) both call it and apply its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from testflinger_magic.durations import format_duration

#: Distinct devices on which bring-ups of one queue must time out, in a row (no successful
#: bring-up of the queue in between), before the queue is blamed. Two: one device timing out
#: may be that device (a BMC that never powers on); the same timeout on a second, different
#: device is what a definition at fault looks like, and waiting for a third would cost another
#: whole provision_timeout and one more device's failure count.
QUEUE_TIMEOUT_DEVICES = 2

#: At most this many of a queue's latest timed-out leases are read per decision (one bounded
#: query; a run longer than this already names enough devices).
RECENT_TIMEOUTS = 20

#: Lease field marking a bring-up restored because it hit its deadline (set with the restore).
TIMEOUT_FIELD = "bringup_timeout"


def timed_out_devices(timeouts: list[dict]) -> list[str]:
    """Sorted distinct ``device`` names of ``timeouts`` (lease documents, or dicts with a
    ``device`` key): the leases of one queue that hit their bring-up deadline since the cutoff
    (the latest successful bring-up of the queue, or the latest apply of its definition)."""
    return sorted({t["device"] for t in timeouts if t.get("device")})


def queue_to_blame(timeouts: list[dict], min_devices: int = QUEUE_TIMEOUT_DEVICES) -> bool:
    """True when ``timeouts`` (as in :func:`timed_out_devices`) name at least ``min_devices``
    distinct devices: the queue's definition (its ``provision_timeout``), not a device, is the
    likely fault."""
    return len(timed_out_devices(timeouts)) >= min_devices


def suspension_reason(queue: str, provision_timeout: float | None, devices: list[str]) -> str:
    """The suspension reason recorded on the queue (``magic_queues.suspended.reason``) and
    shown by ``plan``/``status``: names the queue, the timeout (seconds, None if unknown) and
    the devices."""
    limit = format_duration(provision_timeout) if provision_timeout else "its provision_timeout"
    return (f"{queue}: bring-ups timed out on {len(devices)} different devices "
            f"({', '.join(devices)}) with no successful bring-up in between: provision_timeout "
            f"({limit}) is likely shorter than a deploy plus the VMs' commissioning; the "
            "devices' failures are not counted; raise policy.provision_timeout")


@dataclass(frozen=True)
class TimeoutVerdict:
    """What :func:`judge_timeout` decided. ``queue_at_fault``: suspend the queue's lending and
    count no failure for the lease that just timed out; ``devices``: the distinct devices of
    the run of timeouts (sorted); ``take_back``: ids of the run's earlier leases whose failure
    was counted against their device and is to be taken back (empty unless at fault)."""

    queue_at_fault: bool
    devices: tuple[str, ...]
    take_back: tuple[str, ...] = ()


def judge_timeout(lease_id: str, timeouts: list[dict], applied_at: float | None,
                  last_ok_created_at: float | None,
                  min_devices: int = QUEUE_TIMEOUT_DEVICES) -> TimeoutVerdict:
    """Whose fault is the bring-up of lease ``lease_id`` (already marked timed out) that hit
    its deadline.

    ``timeouts``: the queue's leases that hit their bring-up deadline (this one included), as
    dicts with ``_id``, ``device``, ``created_at`` (epoch seconds) and ``failures_counted``
    (bool: a failure was counted against the device); ``applied_at``: when the queue's
    definition was last applied (None: never / unknown); ``last_ok_created_at``: the
    ``created_at`` of the queue's latest lease that reached ``active`` (None: none did).

    The run is the timeouts created at or after both (a successful bring-up, or a re-applied
    definition that may be the fix, ends a run), the latest :data:`RECENT_TIMEOUTS` of them;
    the queue is at fault when the run names ``min_devices`` distinct devices. Pure."""
    cutoff = max(float(applied_at or 0), float(last_ok_created_at or 0))
    run = sorted((t for t in timeouts if float(t.get("created_at") or 0) >= cutoff),
                 key=lambda t: float(t.get("created_at") or 0), reverse=True)[:RECENT_TIMEOUTS]
    devices = tuple(timed_out_devices(run))
    if not queue_to_blame(run, min_devices):
        return TimeoutVerdict(False, devices)
    take_back = tuple(t["_id"] for t in run if t["_id"] != lease_id and t.get("failures_counted"))
    return TimeoutVerdict(True, devices, take_back)
