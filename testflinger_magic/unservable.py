"""Which magic queues hold jobs nothing can ever run as the lab stands (pure decision).

A magic queue is *unservable* when no registered device matches its definition
(``MagicQueue.matches``: its selection picks none, the ones it picks have too few GPUs for one
VM, or they are NVSwitch devices its VMs of several GPUs are refused on,
:func:`testflinger_magic.fabric.refuses`). testflinger-cli's preflight then refuses new
submissions (404, server/dispatch.py), but a job accepted before may be waiting: the typical
case is a two-GPU-per-VM job submitted while a board's NVSwitch count was still unknown (a MAAS
older than 3.0, a machine never commissioned, after ``forget-nvswitches``); the split then
learns the count, the lease is restored, and nothing will ever lend a device for that job
(TRIAL17 F4: it waited, silently, until Testflinger's 7-day TTL).

So a queue with waiting jobs, no open lease and registered devices none of which matches it is
*marked* (``since``); if it is still so :data:`UNSERVABLE_GRACE` seconds later, its waiting jobs
are cancelled, each told why (server/unservablejobs.py), as the jobs of a removed queue are.
The grace leaves the operator time to act (an ``apply`` with a wrong selection, a device whose
agent host is re-registering, a board about to be opted in with ``nvswitch_multi_gpu``): any
device matching it again, an open lease of it, or its waiting jobs gone, clears the mark. No
device registered at all (a new lab, every agent host still starting) is never unservable:
Testflinger itself keeps jobs waiting while a queue has no agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lease_states import OPEN_STATES
from .reconcile_model import _NO_DEMAND, Inputs, _device_dict

#: Seconds a magic queue stays unservable with waiting jobs before they are cancelled (the
#: engine's ``unservable_grace``; a lab or a test may shrink it).
UNSERVABLE_GRACE = 600.0


def unservable_queues(inputs: Inputs) -> tuple[list[str], list[dict]]:
    """``(names, device dicts)``: the magic queues of ``inputs`` (definition order) with
    waiting jobs (``demand[q].waiting``), no open lease, and registered devices none of which
    matches the definition; and the registered devices as ``MagicQueue.matches`` reads them
    (``[]`` when no queue needed them: a queue with no waiting job or an open lease costs
    nothing, the tick's common case), for the caller's reasons. Each device is turned into a
    dict once."""
    devices = [d for d in inputs.devices if d.registered]
    if not devices:
        return [], []
    open_queues = {lease.queue for lease in inputs.leases if lease.state in OPEN_STATES}
    dicts: list[dict] = []
    out = []
    for q in inputs.definitions:
        if inputs.demand.get(q.name, _NO_DEMAND).waiting <= 0 or q.name in open_queues:
            continue
        if not dicts:
            dicts = [_device_dict(d) for d in devices]
        if not any(q.matches(d) for d in dicts):
            out.append(q.name)
    return out, dicts


@dataclass(frozen=True)
class Verdict:
    """What to do about unservable queues this tick: ``mark`` (newly unservable: start the
    grace), ``cancel`` (unservable for the whole grace: cancel their waiting jobs), ``clear``
    (marked, and no longer unservable: forget the mark). Queue names, sorted."""

    mark: list[str] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    clear: list[str] = field(default_factory=list)


def decide(unservable: list[str], marks: dict[str, float], now: float,
           grace: float = UNSERVABLE_GRACE) -> Verdict:
    """The :class:`Verdict` for queues ``unservable`` now (:func:`unservable_queues`' names), given
    ``marks`` (``{queue: since}``, epoch seconds, :attr:`Inputs.unservable`), ``now`` and
    ``grace`` (seconds)."""
    now_set = set(unservable)
    return Verdict(
        mark=sorted(q for q in now_set if q not in marks),
        cancel=sorted(q for q in now_set if q in marks and now - marks[q] >= grace),
        clear=sorted(q for q in marks if q not in now_set))
