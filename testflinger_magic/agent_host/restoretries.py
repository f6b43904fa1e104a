"""Whether a failed restore is tried again, when, and what the lease is told meanwhile (the
daemon's ``_restore_failed`` applies it): the decision, apart from the daemon's effects.

* MAAS unreachable (``outage``): tried again, not counted among :data:`RESTORE_ATTEMPTS`, for
  up to ``timeouts.maas_outage`` since the outage began (journal fact
  ``maas_unreachable_since``), pausing ``maas_poll`` doubling up to :data:`MAAS_BACKOFF_MAX`
  (an outage is the lab's infrastructure, not the device: waited out, never counted).
* MAAS refused an operation in the machine's current state (HTTP 409, ``MaasConflict``, e.g.
  "Cannot release node because it is locked", or a machine still in a transition): tried
  again up to :data:`CONFLICT_ATTEMPTS` times (its own count, journal fact
  ``maas_conflict_tries``), pausing as for an outage (``maas_poll`` doubling up to
  :data:`MAAS_BACKOFF_MAX`): a conflict that lasts a few minutes does not fail the lease
  (TRIAL13 F14: three tries in 0.3 s did).
* Any other failure: up to :data:`RESTORE_ATTEMPTS` tries, the next at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: restore attempts before the daemon reports an error (which makes the lease ``failed``).
RESTORE_ATTEMPTS = 3
#: longest pause (seconds) between two restore tries while MAAS is unreachable; the pause
#: doubles from ``maas_poll`` up to this.
MAAS_BACKOFF_MAX = 60.0
#: restore tries that MAAS answers 409 before the lease is given up: with the default
#: ``maas_poll`` (10 s) the pauses are 10, 20, 40, then 60 s: about 5 minutes in all.
CONFLICT_ATTEMPTS = 8


def conflict_of(exc: BaseException | None):
    """The ``MaasConflict`` (HTTP 409) that ``exc`` is or was raised from (its ``__cause__`` /
    ``__context__`` chain, as ``maas.outage_of``), or None."""
    from testflinger_magic.agent_host.maas import MaasConflict, raised_from  # noqa: PLC0415

    return raised_from(exc, MaasConflict)


def utc(epoch: float) -> str:
    """``2026-12-02T01:02:03Z`` of epoch seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


@dataclass(frozen=True)
class Verdict:
    """``retried``: try again (after ``delay`` seconds, reporting ``note`` as progress), else
    give up and report ``message`` as the error. ``log``: a line for the daemon's warning log
    when retried."""

    message: str
    retried: bool
    delay: float = 0.0
    note: str = ""
    log: str = ""


def next_try(journal, message: str, took: float, outage: bool, maas_poll: float,
             maas_outage: float, now: float | None = None, *, conflict: bool = False
             ) -> Verdict:
    """The verdict on a restore try that failed with ``message`` after ``took`` seconds
    (module docstring). ``journal``: the lease's journal, whose facts count the tries
    (``maas_unreachable_since``, ``maas_outage_tries``, ``maas_conflict_since``,
    ``maas_conflict_tries``, ``restore_failures``; updated here). ``outage``: MAAS was
    unreachable; ``conflict``: MAAS answered 409 (:func:`conflict_of`). ``maas_poll``,
    ``maas_outage``: seconds (the config's). ``now``: epoch seconds."""
    now = time.time() if now is None else now
    if outage:
        since = journal.fact("maas_unreachable_since") or now
        tries = journal.fact("maas_outage_tries", 0) + 1
        journal.set_fact("maas_unreachable_since", since)
        journal.set_fact("maas_outage_tries", tries)
        down_for = now - since
        head = f"MAAS unreachable since {utc(since)} ({down_for:.0f}s, restore try {tries})"
        if down_for >= maas_outage:
            return Verdict(f"{message} ({head}; given up after timeouts.maas_outage "
                           f"{maas_outage:.0f}s)", False)
        delay = min(MAAS_BACKOFF_MAX, maas_poll * 2 ** min(tries - 1, 12))
        note = (f"{head}: retrying in {delay:.0f}s; the device is given back once MAAS "
                f"answers: {message}")
        return Verdict(message, True, delay, note, note)
    journal.set_fact("maas_unreachable_since", None)
    if conflict:
        since = journal.fact("maas_conflict_since") or now
        tries = journal.fact("maas_conflict_tries", 0) + 1
        journal.set_facts({"maas_conflict_since": since, "maas_conflict_tries": tries})
        head = (f"MAAS refused the restore (HTTP 409) {tries} time(s) since {utc(since)} "
                f"({now - since:.0f}s)")
        if tries >= CONFLICT_ATTEMPTS:
            return Verdict(f"{message} ({head}; given up after {CONFLICT_ATTEMPTS} tries)", False)
        delay = min(MAAS_BACKOFF_MAX, maas_poll * 2 ** min(tries - 1, 12))
        note = (f"{head}: retrying in {delay:.0f}s (try {tries + 1} of {CONFLICT_ATTEMPTS}): "
                f"{message}")
        return Verdict(message, True, delay, note, note)
    failures = journal.fact("restore_failures", 0) + 1
    journal.set_fact("restore_failures", failures)
    if failures >= RESTORE_ATTEMPTS:
        return Verdict(message, False)
    return Verdict(message, True, 0.0, f"retrying: {message}",  # at once: only an outage waits
                   f"restore attempt {failures}/{RESTORE_ATTEMPTS} failed in {took:.1f}s: "
                   f"{message}")
