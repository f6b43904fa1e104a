"""One daemon per agent host across machines: the ``instance`` of register and heartbeat.

Two daemons configured with one ``agent_host`` on two machines both registered and
heartbeated and worked the same leases (one re-ran the restore of a returned lease: it
released the MAAS machine and restarted the device agent). On one machine the daemon's flocks
refuse the second (agent_host/statedir.py); across machines only the server sees both. Each
daemon sends its instance id (agent_host/instance.py: ``"<hostname>/<machine id>:<state_dir>"``)
and the agent host document keeps the one it accepted (``instance``, ``instance_since``).

:func:`refusal` decides (pure): a caller is accepted when the stored instance is absent, equal
to the caller's, or its host's ``last_heartbeat`` is older than ``reconcile.STALE_HOST_AFTER``
(the threshold past which reconcile reports the host stale, ``reconcile.stale_hosts``: its
leases are being worked by nobody). A caller without an instance (a daemon older than this) is
accepted as before and changes nothing. :func:`take` writes it with a compare-and-set on what
it read, so of two callers racing only one wins.
"""

from __future__ import annotations

from testflinger_magic.reconcile_model import STALE_HOST_AFTER

from .errors import Conflict

#: Tries of :func:`take`'s compare-and-set before it gives up (another writer each time).
CAS_TRIES = 3


class InstanceConflict(Conflict):
    """Another daemon instance holds the agent host (409). ``.data``: ``{"agent_host",
    "instance" (the holder), "last_heartbeat" (epoch s or None), "silent_for" (s or None),
    "stale_after" (s), "caller" (the refused instance)}``, sent in the 409 body as
    ``instance_conflict`` (docs/api.md), which the daemon's client recognises."""

    def __init__(self, message: str, data: dict):
        super().__init__(message)
        self.data = data


def refusal(host: str, stored: dict | None, caller: str | None, now: float,
            stale_after: float = STALE_HOST_AFTER) -> InstanceConflict | None:
    """Why ``caller`` (an instance id, None: an older daemon) may not act for agent host
    ``host`` whose document is ``stored`` (``{instance, last_heartbeat}``, None: not known),
    at ``now`` (epoch s): an :class:`InstanceConflict` naming the host, the other instance,
    how long ago it last heartbeated and what to do; None when accepted. Pure."""
    if caller is None or stored is None:
        return None
    holder = stored.get("instance")
    beat = stored.get("last_heartbeat")
    if holder is None or holder == caller:
        return None
    if not isinstance(beat, (int, float)) or now - beat > stale_after:
        return None
    silent = max(0.0, now - beat)
    message = (f"agent host {host} is run by another daemon instance {holder!r} (last "
               f"heartbeat {silent:.0f}s ago), not this one ({caller!r}): one daemon per agent "
               f"host. Stop one of them; if that daemon is gone (its machine swapped or "
               f"off), this one is accepted once its last heartbeat is older than "
               f"{stale_after:.0f}s")
    return InstanceConflict(message, {"agent_host": host, "instance": holder,
                                      "last_heartbeat": beat, "silent_for": silent,
                                      "stale_after": stale_after, "caller": caller})


def cas_filter(stored: dict, caller: str) -> dict:
    """The compare-and-set filter that holds while ``stored`` (a read agent host document
    :func:`refusal` accepted ``caller`` on) is unchanged in what the decision used: its
    ``instance`` (None also matches a missing one), and for a stale other instance its
    ``last_heartbeat`` too (a heartbeat meanwhile makes it fresh again). Pure."""
    filt = {"_id": stored["_id"], "instance": stored.get("instance")}
    if stored.get("instance") not in (None, caller):
        filt["last_heartbeat"] = stored.get("last_heartbeat")
    return filt


def take(db, host: str, caller: str, now: float, fields: dict,
         stale_after: float = STALE_HOST_AFTER) -> dict | None:
    """Accept ``caller`` for the existing agent host ``host`` and ``$set`` ``fields`` with it,
    in one compare-and-set (:func:`cas_filter`) on the document read; retried
    :data:`CAS_TRIES` times when another writer changed it in between.

    Sets ``instance`` (and ``instance_since`` = ``now`` when it changes). Returns the document
    as read before the write (``{instance, instance_since, last_heartbeat}``; None when the
    host has no document: nothing written, the caller decides). Raises
    :class:`InstanceConflict` (nothing written) when :func:`refusal` refuses, or
    :class:`Conflict` when every try lost its race."""
    hosts = db.magic_agent_hosts
    for _ in range(CAS_TRIES):
        stored = hosts.find_one({"_id": host}, {"instance": 1, "instance_since": 1,
                                                "last_heartbeat": 1})
        if stored is None:
            return None
        refused = refusal(host, stored, caller, now, stale_after)
        if refused is not None:
            raise refused
        update = dict(fields, instance=caller)
        if stored.get("instance") != caller:
            update["instance_since"] = now
        if hosts.update_one(cas_filter(stored, caller), {"$set": update}).matched_count:
            return stored
    raise Conflict(f"agent host {host}: its document changed under {CAS_TRIES} tries to accept "
                   f"daemon instance {caller!r} (another daemon registering at the same time?); "
                   "try again")


def takeover_message(host: str, stored: dict | None, caller: str, now: float) -> str | None:
    """The ``agent_host.instance_changed`` event text when ``caller`` replaced a different
    stale instance in ``stored`` (the document :func:`take` read), else None. Pure."""
    holder = (stored or {}).get("instance")
    if holder is None or holder == caller:
        return None
    beat = (stored or {}).get("last_heartbeat")
    silent = f"silent for {now - beat:.0f}s" if isinstance(beat, (int, float)) else \
        "never heartbeated"
    return (f"agent host {host}: daemon instance {caller!r} took over from {holder!r} "
            f"({silent}, past the {STALE_HOST_AFTER:.0f}s stale threshold)")
