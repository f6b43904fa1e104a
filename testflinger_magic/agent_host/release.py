"""Release a MAAS machine and wait for Ready, recovering a failed release as Testflinger does.

A release can end in ``Releasing failed`` (MAAS could not power the machine off, or its release
scripts failed). Testflinger's maas2 device connector then does not give up
(canonical/testflinger device-connectors/src/testflinger_device_connectors/devices/maas2/
maas2.py, ``Maas2.node_release`` and ``_recover_node_control``; TESTFLINGER.md §5.5):

1. release, then poll every 10 s, up to 30 times, for Ready;
2. not Ready: ``mark-broken`` and ``mark-fixed``, then poll 3 times;
3. still not Ready: ``power-off``, then poll 3 times;
4. still not Ready: an error.

``release_to_ready`` does the same with the step's poll interval (``maas_poll``, 10 s by default)
and its remaining time. One difference: a poll that sees a failed status (``RELEASE_FAIL``)
moves to the next stage at once, since MAAS will not leave it by itself. Every MAAS call is
journaled (``maas.release``, ``maas.mark_broken``, ``maas.mark_fixed``, ``maas.power_off``).

A recovery is remembered as the journal fact ``release_recovery`` (:data:`RECOVERY_FACT`), a
sentence saying what failed and what brought the machine back, which the restore puts in its
report (the ``lease.returned`` event): mark-fixed sets a Broken machine Ready without any
release (maasserver/models/node.py ``Node.mark_fixed``), so MAAS' disk erase and release
scripts did not run, which an operator must be able to see (TRIAL13 F9).
"""

from __future__ import annotations

import logging

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host.maas import MaasConflict, MaasError, MaasTimeout

log = logging.getLogger(__name__)

#: maas2's polls: 30 after a release, 3 after each recovery action.
RELEASE_POLLS = 30
RECOVERY_POLLS = 3
#: Journal fact: how a failed release was recovered (module doc); absent when it was not.
RECOVERY_FACT = "release_recovery"


class ReleaseFailed(MaasError):
    """The machine is not Ready after release and maas2's recovery; names status and message."""


def _poll_ready(ctx, system_id: str, polls: int):
    """Wait up to ``polls`` polls for Ready; the MachineInfo, or None when it is not Ready (a
    failed status, or the polls or the step's time ran out)."""
    maas = ctx.drivers.maas
    timeout = min(ctx.remaining(f"waiting for MAAS machine {system_id} to be Ready"),
                  polls * ctx.config.maas_poll)
    try:
        return maas.wait_for(system_id, {st.READY}, set(st.RELEASE_FAIL), timeout,
                             ctx.config.maas_poll, should_stop=ctx.stop)
    except MaasTimeout:
        return None
    except MaasError as e:
        if e.status in st.RELEASE_FAIL:
            return None
        raise


def release_to_ready(ctx, system_id: str, was: str):
    """Release ``system_id`` (status ``was``) and return its MachineInfo once Ready, recovering a
    failed release as maas2 does (module doc). ``ctx`` is a ``steps.StepContext``.

    Raises ``ReleaseFailed`` (naming the status and MAAS' status message) when recovery does not
    bring it to Ready, ``StepError`` when the step's time is used up, ``Interrupted`` on stop.
    """
    maas, journal = ctx.drivers.maas, ctx.journal
    with journal.effect("maas.release", system_id, {"was": was}):
        maas.release(system_id)
    info = _poll_ready(ctx, system_id, RELEASE_POLLS)
    if info is not None:
        return info
    current = maas.machine(system_id)
    failed = (f"release failed ({current.status}"
              f"{': ' + current.status_message if current.status_message else ''})")

    def recovered(how: str):
        note = f"{failed}; {how}"
        journal.set_fact(RECOVERY_FACT, note)
        log.warning("MAAS machine %s (%s): %s", current.hostname, system_id, note)
        return info

    log.warning("MAAS machine %s (%s) is %r after release%s: recovering as maas2 does (release "
                "again, mark broken/fixed, power off)", current.hostname, system_id,
                current.status, f": {current.status_message}" if current.status_message else "")
    if current.status in st.RELEASABLE and current.status != st.BROKEN:
        # A failed release may be tried again (NODE_TRANSITIONS: FAILED_RELEASING -> RELEASING).
        with journal.effect("maas.release", system_id, {"was": current.status, "retry": True}):
            maas.release(system_id)
        info = _poll_ready(ctx, system_id, RELEASE_POLLS)
        if info is not None:
            return recovered("released on a second try")
    # maas2 _recover_node_control, method one: mark-broken, mark-fixed.
    refused = ""
    try:
        with journal.effect("maas.mark_broken", system_id):
            maas.mark_broken(system_id, "testflinger-magic: release failed")
        with journal.effect("maas.mark_fixed", system_id):
            maas.mark_fixed(system_id, "testflinger-magic: recovering a failed release")
    except MaasConflict as e:
        log.warning("MAAS machine %s: mark broken/fixed refused: %s", system_id, e)
        refused = f" (mark-broken/mark-fixed refused: {e})"
    info = _poll_ready(ctx, system_id, RECOVERY_POLLS)
    if info is not None:
        return recovered("recovered by mark-broken/mark-fixed: MAAS made it Ready without a "
                         "release, so it did not erase the disk or run its release scripts"
                         if not refused else f"Ready again without a release{refused}")
    # Method two: power off.
    with journal.effect("maas.power_off", system_id):
        maas.power_off(system_id)
    info = _poll_ready(ctx, system_id, RECOVERY_POLLS)
    if info is not None:
        return recovered(f"recovered by mark-broken/mark-fixed{refused} and power-off: MAAS "
                         "made it Ready without a release, so it did not erase the disk or "
                         "run its release scripts")
    last = maas.machine(system_id)
    raise ReleaseFailed(
        f"MAAS machine {last.hostname} ({system_id}) still {last.status!r} after release and "
        f"recovery (release again, mark broken/fixed, power off)"
        f"{': ' + last.status_message if last.status_message else ''}",
        system_id=system_id, status=last.status, status_message=last.status_message)
