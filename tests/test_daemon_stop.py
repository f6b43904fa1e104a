"""Stopping the agent-host daemon (a real subprocess, real signals) while a step waits.

SIGTERM must end a daemon whose step is waiting on an unreachable MAAS promptly (the wait is
interrupted, not reported as an error) and a later start must finish the lease; a second signal
must exit at once even when the step is stuck in something that cannot be interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from daemon_lab import DaemonLab, lab, NOTHING  # noqa: F401 (lab is a fixture)
from test_daemon_resume import finish
from testflinger_magic.agent_host.daemon import Daemon

LIMIT = 60.0  # seconds: generous bound for anything that should take well under one


def wait_until(cond, what: str, limit: float = LIMIT) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {limit}s waiting for {what}")


def start_daemon(lab: DaemonLab, **config) -> tuple[subprocess.Popen, object]:
    path = lab.write_config(**config)
    log = open(lab.tmp / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "testflinger_magic.cli", "agent-host",
                             "--config", str(path)], stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def reap(proc: subprocess.Popen, log) -> None:
    """Kill the daemon if a test left it running, and close its log."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def log_text(lab: DaemonLab) -> str:
    return (lab.tmp / "daemon.log").read_text(errors="replace")


def test_sigterm_while_maas_is_unreachable_stops_at_once_and_restart_finishes(lab):
    Daemon(lab.config()).register()
    # Deploying takes an hour in the simulator and the step may wait that long for it:
    # only the stop can end the wait.
    lab.maas.delays["deploying"] = 3600.0
    proc, log = start_daemon(lab, timeouts={"deploying": "1h"})
    try:
        lease_id = lab.lend()
        wait_until(lambda: lab.lease(lease_id)["state"] == "deploying", "the deploy to start")
        lab.maas.set_unreachable(True)
        wait_until(lambda: "MAAS unreachable while waiting" in log_text(lab),
                   "the daemon to wait on the unreachable MAAS")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=LIMIT)
    finally:
        reap(proc, log)
    text = log_text(lab)
    assert rc == 0, text[-2000:]
    assert "interrupted" in text, text[-2000:]
    lease = lab.lease(lease_id)
    # Interrupted is not failed: nothing reported, the lease waits for the next start.
    assert lease["state"] == "deploying" and not lease.get("error"), lease
    assert "failed" not in text.split("signal 15", 1)[1], text[-2000:]

    # MAAS is back and the hour has passed: a new daemon resumes the wait and finishes the cycle.
    lab.maas.set_unreachable(False)
    real_clock = lab.maas._clock
    lab.maas._clock = lambda: real_clock() + 7200.0
    lease = finish(lab, lease_id)
    assert lease["state"] == "returned", lease.get("error")
    assert "active" in [h["state"] for h in lease["history"]]
    assert lab.orphans() == NOTHING
    assert lab.procs.state("gpu-host-01") == "RUNNING"


def test_second_sigterm_exits_at_once_when_a_step_cannot_be_interrupted(lab):
    marker = lab.tmp / "split-script.pid"
    # A split script that hangs: the step waits on a child process, not on an interruptible wait.
    script = (f"import os, pathlib, time; pathlib.Path({str(marker)!r}).write_text(str(os.getpid()));"
              " time.sleep(3600)")
    Daemon(lab.config()).register()
    proc, log = start_daemon(lab, splitter={"kind": "script",
                                            "command": [sys.executable, "-c", script]})
    try:
        lease_id = lab.lend()
        wait_until(marker.exists, "the split script to start")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "signal 15: stopping" in log_text(lab), "the first signal to be seen")
        assert proc.poll() is None  # the first signal waits for the step in flight
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=LIMIT)
    finally:
        reap(proc, log)
        if marker.exists() and marker.read_text():
            try:
                os.kill(int(marker.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert rc == 128 + signal.SIGTERM, log_text(lab)[-2000:]
    assert "exiting now" in log_text(lab)
    assert not lab.lease(lease_id).get("error")
