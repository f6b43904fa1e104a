"""The agent-host daemon's chores beside the lease steps: the heartbeat (with
``maas_unreachable_since`` while MAAS refuses, and a ``whoami`` probe on a side thread to learn
it answers again) and the periodic orphan sweep on its own thread. Mixed into
:class:`.daemon.Daemon` (its ``config``, ``client``, ``drivers``, ``instance``, ``in_flight``,
``_refuse`` and the timers it sets up); the module docstring of :mod:`.daemon` says when each runs.
"""

from __future__ import annotations

import logging
import threading
import time

from testflinger_magic.agent_host.client import ClientError, InstanceConflict

log = logging.getLogger("testflinger_magic.agent_host")


class HostChores:
    """Heartbeat, MAAS probe and orphan sweep (see the module docstring)."""

    def sweep(self, dry_run: bool = False, closed: dict[str, str] | None = None) -> dict:
        """Run one orphan sweep now (``sweep.Sweeper.run``; ``closed``: ``{lease id: device}``
        whose orphans go without the grace) and return its report."""
        from testflinger_magic.agent_host.sweep import Sweeper

        return Sweeper(self.config, self.drivers, self.client).run(dry_run=dry_run,
                                                                   closed=closed)

    def _closed_by_server(self, lease_id: str) -> None:
        """Note that the server closed ``lease_id`` while this daemon worked it: once no step
        of it runs, the next poll's sweep removes what it left at once (``_maybe_sweep``)."""
        with self._lock:
            device = self._devices_of.pop(lease_id, None)
            if device:
                self._closed[lease_id] = device

    def _maybe_sweep(self) -> None:
        """Start a sweep thread when ``sweep_interval`` has passed since the last one (none
        when it is 0), or when a lease the server closed under a step here has no step running
        any more: that sweep removes the lease's orphans without the grace
        (``sweep.decide``'s ``closed``), even with periodic sweeps off: it finishes the
        lease's story as a restore would. A failed one is tried again after
        ``heartbeat_interval``."""
        interval = self.config.sweep_interval
        now = time.monotonic()
        running = set(self.in_flight())
        with self._lock:
            closed = {k: d for k, d in self._closed.items() if k not in running} \
                if now >= self._closed_not_before else {}
        due = interval > 0 and now - self._last_sweep >= interval
        if not due and not closed:
            return
        if self._sweeping is not None and self._sweeping.is_alive():
            return
        if due:
            self._last_sweep = now

        def run():
            try:
                report = self.sweep(closed=closed)
                with self._lock:
                    for lease_id in closed:
                        self._closed.pop(lease_id, None)
                if report["removed"] or report["failed"]:
                    log.info("sweep: %d orphan(s) removed, %d failed, %d waiting for the grace",
                             len(report["removed"]), len(report["failed"]),
                             len(report["waiting"]))
            except Exception as exc:  # noqa: BLE001 - the next interval tries again
                log.error("sweep failed, nothing removed: %s", exc)
                self._closed_not_before = time.monotonic() + self.config.heartbeat_interval

        self._sweeping = threading.Thread(target=run, name="sweep", daemon=True)
        self._sweeping.start()

    def maas_unreachable_since(self) -> float | None:
        """Epoch seconds since which the MAAS driver's calls have found MAAS unreachable
        (``maas.Reachability.down_since``), None while it answers (or the driver does not
        track it)."""
        reach = getattr(self.drivers.maas, "reachability", None)
        return getattr(reach, "down_since", None)

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_heartbeat < self.config.heartbeat_interval:
            return
        since = self.maas_unreachable_since()
        if since is not None:
            self._probe_maas()
        try:
            if since is None:
                self.client.heartbeat(self.config.agent_host, self.in_flight(),
                                      instance=self.instance)
            else:
                self.client.heartbeat(self.config.agent_host, self.in_flight(),
                                      maas_unreachable_since=since, instance=self.instance)
            self._last_heartbeat = time.monotonic()
        except InstanceConflict as exc:  # another machine's daemon took this host over
            self._refuse(exc)
        except ClientError as exc:
            log.warning("heartbeat failed: %s", exc)

    def _probe_maas(self) -> None:
        """Ask MAAS who we are on a side thread (never two at once), so a daemon with no step
        calling MAAS learns that it answers again (``maas.Reachability``). Errors are only
        logged: the reachability records them."""
        whoami = getattr(self.drivers.maas, "whoami", None)
        if whoami is None or (self._probing is not None and self._probing.is_alive()):
            return

        def run():
            try:
                whoami()
            except Exception as exc:  # noqa: BLE001 - recorded by the driver's reachability
                log.debug("MAAS probe: %s", exc)

        self._probing = threading.Thread(target=run, name="maas-probe", daemon=True)
        self._probing.start()
