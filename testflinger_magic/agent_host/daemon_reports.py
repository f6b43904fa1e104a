"""The agent-host daemon's reports to the server: one step's report (with the journal's
unsent intent), what a 409 or a failed call means for the loop, a restore try that failed
(progress and back-off, :mod:`.restoretries`) and what a failed restore leaves of the device
agent. Mixed into :class:`.daemon.Daemon` (its ``config``, ``client``, ``drivers``, ``refused``,
``_lock``, ``_poll_now``, ``_not_before``, ``_devices_of``, ``_ended_here`` and
``_closing``); split from
daemon.py along that seam (pure move).
"""

from __future__ import annotations

import logging
import time

from testflinger_magic.agent_host import steps as steps_mod
from testflinger_magic.agent_host.client import ClientError, StaleLease
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.restoretries import next_try

log = logging.getLogger("testflinger_magic.agent_host")

#: Lease states a report may close the lease in.
FINAL_STATES = {"returned", "failed"}


class StepReports:
    """Reports to the server (see the module docstring)."""

    def _restore_failed(self, lease_id: str, device, journal: Journal, base: dict,
                        message: str, took: float, outage: bool,
                        conflict: bool = False) -> tuple[str, bool]:
        """A restore try failed with ``message``: report it as progress and back off
        (``_not_before``) when it is to be tried again (:func:`.restoretries.next_try`).
        Returns ``(message, retried)``; ``retried`` False: the daemon gives up (the error to
        report is ``message``)."""
        verdict = next_try(journal, message, took, outage, self.config.maas_poll,
                           self.config.timeouts.maas_outage, conflict=conflict)
        if not verdict.retried:
            return verdict.message, False
        log.warning("%s %s %s", lease_id, device.agent_name, verdict.log)
        if verdict.delay:
            self._not_before[lease_id] = time.monotonic() + verdict.delay
        self._send(lease_id, journal, {**base, "result": "progress", "message": verdict.note})
        return verdict.message, True

    def _agent_left_stopped(self, device) -> str:
        """What a failed restore leaves of the device agent, for the error report: the lease
        goes ``failed`` and no step runs for it again (unquarantine only frees the claim), so
        the program stays as the failure left it: say so when it is not running, naming what
        starts it once a person has looked. Empty when it runs or supervisord cannot say."""
        program = device.supervisor_program
        try:
            state = self.drivers.agents.state(program)
        except Exception:  # noqa: BLE001 - the report must go out anyway
            return ""
        if state in steps_mod.RUNNING_STATES:
            return ""
        return (f"; device agent {program} left {state or 'absent'} (the daemon does not "
                f"restart it for a failed lease): once the device is fixed, start it "
                f"(supervisorctl start {program}) and unquarantine the device")

    def _send(self, lease_id: str, journal: Journal | None, body: dict) -> dict | None:
        """Report ``body`` (plus unsent journal intent); returns the server's lease or None."""
        return self._report(lease_id, journal, body)[0]

    def _report(self, lease_id: str, journal: Journal | None,
                body: dict) -> tuple[dict | None, bool]:
        """Report ``body`` (plus unsent journal intent). Returns ``(lease, accepted)``: the
        server's lease (its current one after a 409; None after another failure) and whether
        the server accepted this report."""
        if self.refused is not None:  # another daemon instance works this host's leases now
            log.warning("%s: %s %s not reported: this daemon instance was refused", lease_id,
                        body.get("state"), body.get("result"))
            return None, False
        body = {"agent_host": self.config.agent_host, **body}
        count = 0
        if journal is not None:
            count = journal.total()
            body["intent"] = journal.unsent()
        # A report that may close the lease is in flight: the server may accept it and answer
        # the long-poll without the lease before this thread has the answer, which must not
        # read as the server closing it under the step (TRIAL18 F1; run_once's ``gone``).
        closing = body.get("to_state") in FINAL_STATES or body.get("result") == "error"
        if closing:
            with self._lock:
                self._closing.add(lease_id)
        try:
            new = self.client.report(lease_id, body)
            if new.get("state") in FINAL_STATES:
                with self._lock:  # closed by this report: its own story, not the server's
                    self._devices_of.pop(lease_id, None)
                    self._ended_here.add(lease_id)
        except StaleLease as exc:
            log.info("%s: report of %s/%s refused as stale; server has %s/%s", lease_id,
                     body["state"], body["generation"], exc.lease.get("state"),
                     exc.lease.get("generation"))
            # The server did not change for this: look again at once (a lease it closed
            # meanwhile leaves the poll, and run_once sweeps what it left).
            self._poll_now.set()
            return exc.lease, False
        except ClientError as exc:
            log.error("%s: report failed: %s", lease_id, exc)
            self._poll_now.set()
            return None, False
        finally:
            if closing:  # after the pop above: never a moment in neither set
                with self._lock:
                    self._closing.discard(lease_id)
        if journal is not None:
            journal.mark_sent(count)
            if new.get("state") in FINAL_STATES:
                journal.remove()
        return new, True
