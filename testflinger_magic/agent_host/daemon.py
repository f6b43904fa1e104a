"""The agent-host daemon: register, long-poll for leases, run each lease's next step, report.

``Daemon(config, *, maas=None, splitter=None, agents=None, client=None)``; drivers default to the
production ones built from the config (drivers_build.py). ``run_forever()`` loops until
``stop()``; ``run_once()`` does one poll and dispatch (tests). ``main(args)`` is
``testflinger-magic agent-host --config`` (daemon_cli.py).

Concurrency: one worker thread per lease in flight (never two for one lease). A device has at
most one open lease, so the pool has a thread for every configured device and a step never
queues behind another: a fence (``claimed``), an ``active`` check or a restore starts at once
even while other leases sit in long MAAS waits. ``config.workers`` caps only the bring-up steps
(``BRINGUP_STATES``, the MAAS- and libvirt-heavy ones) running at once; one over the cap waits
for the next poll. Each result is reported with the generation the step started from;
a 409 means the server moved on, so the result is dropped and the next poll shows the server's
view. Restarting the daemon resumes every open lease from the server's state: steps are
idempotent and the journal (journal.py) tells tear-down what may half exist.

A result's ``after_report`` step (steps.StepResult) runs in the same thread right after the server
accepted the report, on the lease it answered: ``enrolling -> active`` then lets the VM agents
run (``steps.check_active``: go files for pre-warmed ones, a start for the others) the moment
their fences are lifted. Likewise a transition into a bring-up state (``CHAINED_STATES``:
``fenced`` .. ``enrolling``) that the server accepted goes on at once, in the same thread, with
that state's step on the lease the server answered (``_may_chain``: within the ``workers`` cap,
and not once stopping), rather than waiting for the long-poll to show the new generation and
the poll loop to dispatch it (a round trip per step, longer with many leases reporting at
once). A poll that shows a lease at a newer generation than its step in flight (the step
reported, its thread has not ended yet) waits for that thread to end or to go on with the
lease's next step (``FINISHING_WAIT``); an ended one's lease is left out of the next
``known=``, so the long-poll answers at once and the loop dispatches it; with it, it would
sleep until something else changed.

Per-step timeouts (``config.timeouts``): each step gets one deadline (``StepContext.deadline``)
that all its driver waits share. A bring-up step that still overruns is reported as an error from
the side (the server moves the lease to ``restoring``, which starts only once the overrunning
thread ends) and its late result is refused with 409. A ``restoring`` step is never timed out from
the side: that error would make the lease ``failed`` at once (skipping the restore retries) while
the step carries on, and its later success would be refused, leaving the device claimed and
fenced with its agent running. A restore reports only by itself: its waits run out of time and
raise, and the daemon retries it (``RESTORE_ATTEMPTS``; a MAAS 409 up to ``CONFLICT_ATTEMPTS``
times with the outage's back-off: restoretries.py).

A MAAS outage (``maas.MaasUnreachable`` anywhere in a step's exception chain) is nobody's
fault: a bring-up step failing on it reports ``blame: maas`` (the server counts no failure
against the device), and a restore failing on it is not one of the ``RESTORE_ATTEMPTS``: it is
tried again with a back-off (``maas_poll`` doubling up to ``MAAS_BACKOFF_MAX``), each try
reported as ``progress`` ("MAAS unreachable since <time> ..."), until MAAS answers and the
device is given back, or ``timeouts.maas_outage`` has passed since the outage began (then the
error is reported and the lease is ``failed``). The heartbeat carries
``maas_unreachable_since`` while the MAAS driver's latest call was refused
(``maas.Reachability``) so the server lends none of this host's devices meanwhile; with nothing
else calling MAAS, the heartbeat probes it (``whoami``, on a side thread) to learn it is back.

Orphan sweep (``config.sweep_interval``, 0: off): every interval the poll loop starts one
``sweep.Sweeper.run`` on its own thread (never two at once); it removes what carries our marks
but no open lease owns (agent_host/sweep.py). The first runs one interval after the start, so a
restarted daemon resumes its leases first.

A journal that cannot be read is moved aside (``<file>.corrupt-<time>``) and reported as the
step's error naming the file; the next step starts a fresh journal, and restore finds what exists
by discovery.

Stopping (``stop()``, SIGTERM/SIGINT in ``main``): the poll loop ends and every step in flight
is interrupted at its next wait (``steps.Interrupted``); an interrupted step reports nothing,
since the next start resumes it (steps are idempotent and journaled). A second signal exits at
once, like SIGKILL, which the same resume covers.

One daemon per agent host across machines: every register and heartbeat carries
``self.instance`` (agent_host/instance.py: ``<hostname>/<machine id>:<state_dir>``), and the
server answers 409 (``client.InstanceConflict``) while another instance holds the host and
heartbeats (server/hostinstance.py). Refused at registration, the daemon stops before it
works any lease; refused at a heartbeat (another machine took the host over while this one
was cut off), it stops the same way: the poll loop ends, steps in flight are interrupted at
their next wait, and none reports again (``_report`` sends nothing once ``refused`` is set).
``refused`` holds the refusal; ``daemon_cli.main`` exits with status 2 and its message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from testflinger_magic.agent_host import steps as steps_mod
from testflinger_magic.agent_host.client import ClientError, InstanceConflict, MagicClient
from testflinger_magic.agent_host.instance import instance_id
from testflinger_magic.agent_host.config import AgentHostConfig
from testflinger_magic.agent_host.daemon_chores import HostChores
from testflinger_magic.agent_host.daemon_reports import FINAL_STATES, StepReports  # noqa: F401
from testflinger_magic.agent_host.drivers_build import default_drivers, folder_owner  # noqa: F401
from testflinger_magic.agent_host.agentfolders import template_names
from testflinger_magic.agent_host.journal import CorruptJournal, Journal
from testflinger_magic.agent_host.maas import outage_of
from testflinger_magic.agent_host.regfacts import with_maas_counts
from testflinger_magic.agent_host.stepstop import StepStops
from testflinger_magic.agent_host.restoretries import (  # noqa: F401 (re-exported)
    MAAS_BACKOFF_MAX, RESTORE_ATTEMPTS, conflict_of, next_try)

log = logging.getLogger("testflinger_magic.agent_host")

#: Lease states whose steps count against ``config.workers`` (deploy, MAAS and libvirt waits).
BRINGUP_STATES = frozenset({"fenced", "deploying", "splitting", "enrolling"})
#: States whose step the thread that reported the transition into them runs at once
#: (``Daemon._may_chain``): the bring-up, ``claimed`` .. ``enrolling``, one step after another.
CHAINED_STATES = BRINGUP_STATES
#: seconds the poll loop waits for steps that already reported to end, or to go on with the
#: lease's next step (``run_once``).
FINISHING_WAIT = 0.5

class Daemon(HostChores, StepReports):
    """One agent host's daemon. See the module docstring."""

    def __init__(self, config: AgentHostConfig, *, maas=None, splitter=None, agents=None,
                 client=None, instance: str | None = None):
        self.config = config
        #: This daemon's instance id (agent_host/instance.py; ``instance``: another, tests).
        self.instance = instance or instance_id(config.state_dir)
        #: The server's refusal of this instance (``client.InstanceConflict``), None while
        #: accepted: the daemon stops and reports nothing more (module docstring).
        self.refused: InstanceConflict | None = None
        self.drivers = default_drivers(config, maas, splitter, agents)
        self.client = client or MagicClient(config.server_url, config.client_id, config.secret_key)
        # One thread per device (one open lease each, one step per lease): nothing queues.
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(config.devices)),
                                        thread_name_prefix="lease")
        self._inflight: dict[str, tuple[Future, float, str, int]] = {}
        self._timed_out: set[tuple[str, int]] = set()
        self._last_active_check: dict[str, float] = {}
        self._lock = threading.Lock()
        #: notified (with ``_lock``) when a step ends or an in-flight entry moves on to the
        #: lease's next state (``_after_report``): what ``_settle`` waits for.
        self._moved = threading.Condition(self._lock)
        self._stop = threading.Event()
        #: Each step thread's stop: the daemon's, or its own once its lease moved on.
        self._step_stops = StepStops(self._stop)
        self._registered = False
        self._last_heartbeat = 0.0
        #: ``id:generation`` of the leases the last poll returned (the long-poll's ``known=``);
        #: None: ask without it (the server then answers at once while a lease needs a step).
        self._known: set[str] | None = None
        #: set by a step whose end the server did not see (its report was refused or failed):
        #: the next poll asks without ``known=`` so that lease is looked at again at once.
        self._poll_now = threading.Event()
        self._last_sweep = time.monotonic()
        self._sweeping: threading.Thread | None = None
        #: ``{lease id: device}`` of leases the server closed while this daemon worked them
        #: (an operator's ``abandon --force``): what they left is swept at once, without the
        #: grace, once no step of theirs runs (HostChores._maybe_sweep).
        self._closed: dict[str, str] = {}
        self._closed_not_before = 0.0
        #: ``{lease id: device}`` of the leases a step was started for, until the lease leaves
        #: the work poll (then in ``_closed``, unless a report of ours closed it).
        self._devices_of: dict[str, str] = {}
        #: Leases a report of ours closed (``returned``/``failed`` accepted), while a poll may
        #: still list them (an answer the server gave before that report): no step of theirs is
        #: started again, which would redo the restore and read as closed by the server.
        self._ended_here: set[str] = set()
        #: Leases with a report in flight that may close them (``returned``, an error): until
        #: its answer, a poll without the lease is not the server closing it under us.
        self._closing: set[str] = set()
        #: ``{lease id: time.monotonic()}`` before which its step is not started again (the
        #: back-off of a restore that failed).
        self._not_before: dict[str, float] = {}
        self._probing: threading.Thread | None = None

    # -- loop ----------------------------------------------------------------------------------
    def register(self) -> dict:
        """Register this host and its devices with the server, each with the NVSwitch count
        MAAS' commissioning lists when MAAS can say (regfacts.py: one MAAS call per device)."""
        devices = with_maas_counts([d.registration() for d in self.config.devices],
                                   self.drivers.maas)
        answer = self.client.register(self.config.agent_host, devices,
                                      templates=template_names(self.config.agent_templates_dir),
                                      instance=self.instance,
                                      nvswitch_multi_gpu=self.config.splitter.nvswitch_multi_gpu)
        self._registered = True
        log.info("registered agent host %s (instance %s) with devices %s",
                 self.config.agent_host, self.instance,
                 ", ".join(answer.get("devices", [])) or "(none)")
        return answer

    def _refuse(self, exc: InstanceConflict) -> None:
        """The server refused this instance: keep the refusal, log it once (no traceback) and
        stop (module docstring)."""
        if self.refused is None:
            self.refused = exc
            log.error("agent host %s: stopping: %s", self.config.agent_host, exc)
        self.stop()

    def run_once(self, wait: float = 0, block: bool = False) -> list[dict]:
        """Register if needed, poll work (long-poll ``wait`` seconds), start due steps, heartbeat.

        ``block``: wait for every step in flight to end (tests). Returns the leases polled
        (none once the server refused this instance: it works no lease any more).
        """
        if self.refused is not None:
            return []
        if not self._registered:
            self.register()
        known = None if self._poll_now.is_set() else self._known
        self._poll_now.clear()
        if self._not_before and known is not None:
            # A restore backing off: the long-poll returns in time for its next try.
            wait = max(0.0, min(wait, min(self._not_before.values()) - time.monotonic()))
        leases = self.client.work(self.config.agent_host, wait, known=known)
        polled = {d["_id"] for d in leases}
        for lease_id in [k for k in self._not_before if k not in polled]:
            del self._not_before[lease_id]  # the server closed or moved it elsewhere
        with self._lock:
            self._ended_here &= polled  # listed no more: no stale answer can list it again
        running = set(self.in_flight())
        with self._lock:
            gone = [k for k in self._devices_of if k not in polled and k not in self._closing]
        for lease_id in gone:
            # The server closed a lease this daemon worked, and no accepted report of ours
            # closed it (an operator abandoned it with --force while this host heartbeats,
            # perhaps through restoring first): its step's work is moot. End a step still
            # running at its next wait, then sweep what the lease left (TRIAL15 F1: the step
            # went on enrolling VMs in MAAS and starting their agents for a failed lease).
            if self._step_stops.supersede(lease_id, "the server closed the lease (it is no "
                                                    "longer among this host's work)") \
                    and lease_id in running:
                log.warning("%s: the server closed the lease while its step ran here: ending "
                            "the step, then removing what the lease left", lease_id)
            self._closed_by_server(lease_id)
        # The next long-poll returns as soon as the server's set of (lease, generation) differs
        # from this answer: a new claim, a drain, or a step's own report (every report bumps
        # the lease's generation), so a finished step wakes the loop at once through the
        # server. A lease over the bring-up cap is started when a running one reports.
        self._known = {f"{d['_id']}:{d.get('generation', 0)}" for d in leases}
        finishing = self._finishing(leases)
        for lease in leases:
            self._dispatch(lease)
        if finishing:
            # A step whose report the server already applied (the lease is at a newer
            # generation) but whose thread had not ended when this answer came: its lease was
            # skipped, and a long-poll with this ``known`` would not return until something
            # else changed. Let those threads end, or go on with the lease's next step (a
            # chained bring-up step, ``_may_chain``: then it is in flight for this generation);
            # leaving the ended ones out of ``known`` makes the next long-poll answer at once.
            self._known -= self._settle(finishing)
        self._check_timeouts()
        self._heartbeat()
        self._maybe_sweep()
        if block:
            self.wait_idle()
        return leases

    def run_forever(self) -> None:
        """Loop until ``stop()``; server errors are logged and retried after a pause."""
        log.info("agent host %s starting (%d device(s))", self.config.agent_host,
                 len(self.config.devices))
        self._warm_up()
        while not self._stop.is_set():
            try:
                self.run_once(wait=self.config.poll_wait)
            except InstanceConflict as exc:  # another daemon runs this agent host
                self._refuse(exc)
            except ClientError as exc:
                log.error("server: %s", exc)
                self._known = None
                if exc.status in (401, 403):
                    self._registered = False
                self._stop.wait(min(self.config.poll_wait, 5.0) or 1.0)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("unexpected error in the poll loop")
                self._stop.wait(5.0)
        self._pool.shutdown(wait=True)
        log.info("agent host %s stopped", self.config.agent_host)

    def _warm_up(self) -> None:
        """Connect the MAAS driver on a side thread (``connect()``, when it has one), so the
        first lease's deploy does not wait for it. A failure is only logged: the first step
        that needs MAAS reports it."""
        connect = getattr(self.drivers.maas, "connect", None)
        if connect is None:
            return

        def run():
            try:
                connect()
            except Exception as exc:  # noqa: BLE001 - the first MAAS step reports it
                log.warning("MAAS not reachable yet: %s", exc)

        threading.Thread(target=run, name="maas-connect", daemon=True).start()

    def stop(self) -> None:
        """Ask ``run_forever`` to end after the current poll; steps in flight end at their next
        wait (MAAS polls, retries) with ``steps.Interrupted`` and report nothing."""
        self._stop.set()
        self._step_stops.stop_all()

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` was called."""
        return self._stop.is_set()

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no step is in flight."""
        with self._lock:
            futures = [f for f, *_ in self._inflight.values()]
        for f in futures:
            f.result(timeout)

    def in_flight(self) -> list[str]:
        """Ids of leases with a step running."""
        with self._lock:
            return [k for k, (f, *_rest) in self._inflight.items() if not f.done()]

    # -- dispatch ------------------------------------------------------------------------------
    def _finishing(self, leases: list[dict]) -> dict[str, tuple[str, int, Future]]:
        """``{"id:generation": (id, generation, future)}`` of steps still running for a
        generation older than the polled lease's: they reported (the server moved the lease on)
        and are ending, or going on with the lease's next step."""
        with self._lock:
            found, moot = {}, []
            for lease in leases:
                entry = self._inflight.get(lease["_id"])
                generation = lease.get("generation", 0)
                if entry is not None and not entry[0].done() and generation > entry[3]:
                    found[f"{lease['_id']}:{generation}"] = (lease["_id"], generation, entry[0])
                    if lease.get("state") == "restoring" and entry[2] not in ("restoring",
                                                                              "active"):
                        moot.append((lease["_id"], entry[2]))
        for lease_id, state in moot:
            # The server restores the lease (deadline passed, drained): the bring-up step's
            # work is moot; end it at its next wait so the restore starts now (stepstop.py).
            if self._step_stops.supersede(lease_id, f"the server moved the lease from {state} "
                                                    "to restoring"):
                log.info("%s: ending its %s step: the server moved the lease to restoring",
                         lease_id, state)
        return found

    def _settle(self, finishing: dict[str, tuple[str, int, Future]]) -> set[str]:
        """Wait up to ``FINISHING_WAIT`` until each of ``finishing`` (``_finishing``) has
        ended or runs the step of the polled generation (its in-flight entry moved on to it);
        returns the keys of those not running that step (ended, or still ending)."""
        end = time.monotonic() + FINISHING_WAIT

        def going_on(lease_id: str, generation: int, future: Future) -> bool:
            entry = self._inflight.get(lease_id)
            return (entry is not None and entry[0] is future and not future.done()
                    and entry[3] >= generation)

        with self._moved:
            while True:
                pending = [v for v in finishing.values()
                           if not v[2].done() and not going_on(*v)]
                left = end - time.monotonic()
                if not pending or left <= 0:
                    break
                self._moved.wait(left)
            return {k for k, v in finishing.items() if not going_on(*v)}

    def _dispatch(self, lease: dict) -> bool:
        """Start the lease's step unless one is in flight; True when a step was started."""
        lease_id, state = lease["_id"], lease.get("state")
        if state not in steps_mod.STEPS:
            return False
        try:
            self.config.device(lease.get("device", ""))
        except KeyError:
            log.warning("%s: device %s is not configured on this host; ignored", lease_id,
                        lease.get("device"))
            return False
        with self._lock:
            current = self._inflight.get(lease_id)
            if current and not current[0].done():
                return False
            if time.monotonic() < self._not_before.get(lease_id, 0.0):
                return False  # a restore backing off (_restore_failed)
            if lease_id in self._ended_here:
                return False  # closed by our report; this answer predates it
            if state == "active":
                # Re-check VM agent programs at most once per heartbeat interval.
                last = self._last_active_check.get(lease_id, 0.0)
                if time.monotonic() - last < self.config.heartbeat_interval:
                    return False
                self._last_active_check[lease_id] = time.monotonic()
            if state in BRINGUP_STATES:
                running = sum(1 for f, _t, s, _g in self._inflight.values()
                              if not f.done() and s in BRINGUP_STATES)
                if running >= (self.config.workers or len(self.config.devices)):
                    return False
            future = self._pool.submit(self._work, lease)
            self._inflight[lease_id] = (future, time.monotonic(), state, lease.get("generation", 0))
            self._devices_of[lease_id] = lease.get("device", "")
        future.add_done_callback(self._step_ended)
        return True

    def _step_ended(self, _future: Future) -> None:
        """A step's thread ended: wake ``_settle``."""
        with self._moved:
            self._moved.notify_all()

    def _check_timeouts(self) -> None:
        """Report overdue bring-up steps as errors; never an ``active`` or ``restoring`` one.

        ``restoring``: see the module docstring; its thread reports by itself (its waits share
        the step's deadline), so an overdue restore is only logged, once.
        """
        now = time.monotonic()
        with self._lock:
            overdue = [(k, s, g, now - t0) for k, (f, t0, s, g) in self._inflight.items()
                       if not f.done() and now - t0 > getattr(self.config.timeouts, s)]
        for lease_id, state, generation, took in overdue:
            if (lease_id, generation) in self._timed_out or state == "active":
                continue
            self._timed_out.add((lease_id, generation))
            if state == "restoring":
                log.warning("%s restore still running after %.0fs (timeouts.restoring %.0fs); "
                            "it reports when it ends", lease_id, took,
                            self.config.timeouts.restoring)
                continue
            message = f"step {state} timed out after {took:.0f}s"
            log.error("%s %s", lease_id, message)
            self._send(lease_id, None, {"state": state, "generation": generation,
                                        "result": "error", "message": message})

    # -- one step ------------------------------------------------------------------------------
    def _open_journal(self, lease_id: str, device: str) -> Journal:
        """The lease's journal. A corrupt one is moved aside and raised as ``CorruptJournal``
        naming both files, so the step's report says what happened and the next step starts a
        fresh journal (restore then works from discovery and the lease)."""
        try:
            return Journal(self.config.state_dir, lease_id, device)
        except CorruptJournal as exc:
            aside = exc.move_aside()
            log.error("%s: %s; moved aside to %s", lease_id, exc, aside)
            raise CorruptJournal(exc.path, f"{exc.reason}; moved aside to {aside}; restore "
                                           "finds what exists by discovery") from None

    def _work(self, lease: dict, step=None) -> None:
        """:meth:`_run_step` with the step's own stop (stepstop.py), registered while it runs."""
        stop = self._step_stops.start(lease["_id"])
        try:
            self._run_step(lease, step, stop)
        finally:
            self._step_stops.end(lease["_id"], stop)

    def _run_step(self, lease: dict, step, stop) -> None:
        """Run the lease's step (``step``, default ``STEPS[state]``) and report its result.
        Everything, the journal's opening included, happens inside the ``try``: this runs in a
        pool Future nobody reads, so an escaping exception would fail the lease silently at
        every poll. A result's ``after_report`` step runs next, in this thread, on the lease
        the server answered, only when the server accepted the report (``_after_report``)."""
        lease_id, state = lease["_id"], lease["state"]
        base = {"state": state, "generation": lease.get("generation", 0)}
        started = time.monotonic()
        device = self.config.device(lease["device"])
        journal: Journal | None = None
        try:
            journal = self._open_journal(lease_id, device.agent_name)
            ctx = steps_mod.StepContext(self.config, self.drivers, device, lease, journal,
                                        stop=stop)
            result = (step or steps_mod.STEPS[state])(ctx)
        except steps_mod.Interrupted as exc:
            if stop.why is not None:  # superseded: the restore runs at the next poll
                log.info("%s %s %s ended after %.1fs: %s", lease_id, device.agent_name, state,
                         time.monotonic() - started, stop.why)
                self._poll_now.set()
                return
            # Not a failure: the server keeps the lease in ``state`` and the next daemon start
            # runs the step again (idempotent, journaled).
            log.info("%s %s %s interrupted after %.1fs (%s); resumed at the next start",
                     lease_id, device.agent_name, state, time.monotonic() - started, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a report
            took = time.monotonic() - started
            message = f"{state}: {type(exc).__name__}: {exc}"
            if journal is None:
                # The journal could not be opened (a corrupt one is moved aside by now): a fresh
                # one carries the restore attempt count and this report.
                try:
                    journal = Journal(self.config.state_dir, lease_id, device.agent_name)
                except Exception as again:  # noqa: BLE001 - report without a journal then
                    log.error("%s: journal still unusable: %s", lease_id, again)
            outage = outage_of(exc)
            if state == "restoring" and journal is not None and getattr(exc, "retry", True):
                message, retried = self._restore_failed(lease_id, device, journal, base, message,
                                                        took, outage is not None,
                                                        conflict_of(exc) is not None)
                if retried:
                    return
                message += self._agent_left_stopped(device)
            # blame: "queue" when the queue's definition is at fault (e.g. VMSpecDoesNotFit), so
            # the server does not count the failure against the device; "maas" when MAAS was
            # unreachable (an outage of the lab's infrastructure, not the device's fault).
            blame = "maas" if outage is not None else getattr(exc, "blame", "device")
            if blame == "hardware" and getattr(exc, "facts", None):
                # How the server learns a device's hardware (MultiGPUNeedsFabric: its
                # NVSwitches): expected, no failure counted (TRIAL18 F7: logged as an ERROR).
                log.warning("%s %s %s refused in %.1fs (the device cannot serve this queue; no "
                            "failure is counted): %s", lease_id, device.agent_name, state, took,
                            message)
            else:
                log.error("%s %s %s failed in %.1fs: %s", lease_id, device.agent_name, state,
                          took, message)
            body = {**base, "result": "error", "message": message, "blame": blame}
            if getattr(exc, "facts", None):  # e.g. MultiGPUNeedsFabric: {"nvswitches": N}
                body["facts"] = dict(exc.facts)
            if getattr(exc, "quarantine", False):
                body["quarantine"] = True  # e.g. steps.GiveBackRefused
            self._send(lease_id, journal, body)
            return
        took = time.monotonic() - started
        if result.to_state is None:
            log.debug("%s %s %s: %s", lease_id, device.agent_name, state, result.message)
            if journal.unsent() or result.vms:
                body = {**base, "result": "progress", "message": result.message}
                if result.vms:  # e.g. a metrics port check_active had to move
                    body["vms"] = result.vms
                self._send(lease_id, journal, body)
            return
        log.info("%s %s %s->%s ok in %.1fs: %s", lease_id, device.agent_name, state,
                 result.to_state, took, result.message)
        body = {**base, "result": "ok", "to_state": result.to_state, "message": result.message}
        if result.vms:
            body["vms"] = result.vms
        if result.facts:  # what the step learnt of the device (the split: its NVSwitches)
            body["facts"] = dict(result.facts)
        new, accepted = self._report(lease_id, journal, body)
        if not accepted or new.get("state") != result.to_state:
            return
        if result.after_report is not None:
            self._after_report(new, result.after_report)
        elif self._may_chain(new):
            # The next bring-up step, now, in this thread: waiting for the long-poll to show
            # the new generation and the poll loop to dispatch it added a round trip per step.
            self._after_report(new, steps_mod.STEPS[result.to_state])

    def _may_chain(self, lease: dict) -> bool:
        """Whether the thread that just moved ``lease`` into a bring-up state (the server
        accepted the transition) may run that state's step at once (``CHAINED_STATES``): not
        once the daemon stops, and only within the ``workers`` cap on bring-up steps, counting
        the others (this thread's own step already held a slot, but for a fence). Otherwise
        the thread ends and the poll loop dispatches the step as any other."""
        if lease.get("state") not in CHAINED_STATES or self._stop.is_set():
            return False
        with self._lock:
            running = sum(1 for k, (f, _t, s, _g) in self._inflight.items()
                          if k != lease["_id"] and not f.done() and s in BRINGUP_STATES)
            return running < (self.config.workers or len(self.config.devices))

    def _after_report(self, lease: dict, step) -> None:
        """Run ``step`` on ``lease`` (the server's answer to an accepted transition report) in
        this thread, now, as the step of the lease's new state: e.g. ``check_active`` after
        ``enrolling -> active`` starts the VM agents the moment their fences are lifted. The
        in-flight entry takes the new state and generation (timeouts are judged by them, and
        a bring-up slot is freed), and for ``active`` the periodic check counts from now."""
        lease_id, state = lease["_id"], lease.get("state")
        with self._lock:
            entry = self._inflight.get(lease_id)
            if entry is not None:
                self._inflight[lease_id] = (entry[0], time.monotonic(), state,
                                            lease.get("generation", 0))
            if state == "active":
                self._last_active_check[lease_id] = time.monotonic()
            self._moved.notify_all()
        if self._stop.is_set():
            return  # the next start runs the state's own step, which does the same work
        self._work(lease, step)


def main(args) -> int:
    """``testflinger-magic agent-host --config FILE`` (agent_host/daemon_cli.py ``main``)."""
    from testflinger_magic.agent_host.daemon_cli import main as run_main

    return run_main(args)


if __name__ == "__main__":  # python -m testflinger_magic.agent_host.daemon --config FILE
    import argparse

    parser = argparse.ArgumentParser(prog="testflinger-magic agent-host")
    parser.add_argument("--config", required=True)
    sys.exit(main(parser.parse_args()))
