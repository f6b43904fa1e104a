"""SIGKILL the daemon right after each effect (before its journal 'done'), restart, and check the
lease still ends ``returned`` with nothing orphaned (domains, MAAS machines, programs, folders)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemon_lab import DaemonLab, HOST, lab, NOTHING  # noqa: F401 (lab is a fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.journal import KILL_ENV

BRINGUP_EFFECTS = ["agent.stop", "maas.deploy", "libvirt.split", "maas.create", "maas.static_ip",
                   "agent.folder", "agent.add"]
TEARDOWN_EFFECTS = ["agent.remove", "agent.rmdir", "maas.delete", "libvirt.restore",
                    "maas.release", "agent.start"]


def run_until_killed(lab: DaemonLab, action: str, **config) -> None:
    """Run the daemon (``lab.write_config(**config)``) as a subprocess that SIGKILLs itself
    after ``action``'s effect."""
    config = lab.write_config(**config)
    env = {**os.environ, KILL_ENV: action}
    log = open(lab.tmp / f"daemon-{action}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "testflinger_magic.agent_host.daemon",
                             "--config", str(config)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    tail = (lab.tmp / f"daemon-{action}.log").read_text()[-1500:]
    assert rc == -9, f"daemon did not die after {action} (rc {rc}):\n{tail}"


def finish(lab: DaemonLab, lease_id: str) -> dict:
    """A fresh daemon (the restart) takes the lease to active if needed, then back to returned."""
    daemon = Daemon(lab.config())
    lease = drive(daemon, lab, lease_id, {"active", "returned", "failed"})
    if lease["state"] == "active":
        lab.drain(lease_id)
        lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    return lease


@pytest.mark.parametrize("action", BRINGUP_EFFECTS)
def test_kill_during_bringup_then_resume(lab, action):
    Daemon(lab.config()).register()
    lease_id = lab.lend()
    run_until_killed(lab, action)
    lease = finish(lab, lease_id)
    assert lease["state"] == "returned", lease.get("error")
    assert "active" in [h["state"] for h in lease["history"]]
    assert lab.orphans() == NOTHING
    assert lab.procs.state("gpu-host-01") == "RUNNING"


@pytest.mark.parametrize("action", TEARDOWN_EFFECTS)
def test_kill_during_teardown_then_resume(lab, action):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    assert drive(daemon, lab, lease_id, {"active", "restoring"})["state"] == "active"
    lab.drain(lease_id)
    run_until_killed(lab, action)
    lease = finish(lab, lease_id)
    assert lease["state"] == "returned", lease.get("error")
    assert lab.orphans() == NOTHING
    assert lab.procs.state("gpu-host-01") == "RUNNING"


def test_kill_between_conf_write_and_add_process_group_then_restore(lab):
    # add_vm_agent wrote <vm>.conf into conf.d and owned its metrics port, then died before
    # supervisord added the group. If the lease then goes to restoring (here: an error report,
    # as when another VM's enrolment fails), restore must still remove the file and free the
    # port, though supervisord never listed the program. Before, it only removed listed ones.
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    run_until_killed(lab, "agent.add:conf-written")
    lease = lab.lease(lease_id)
    assert lease["state"] == "enrolling"
    conf_files = sorted(p.stem for p in lab.sv.conf_dir.glob("gpu-host-01-vm*.conf"))
    assert conf_files and not set(conf_files) & set(lab.procs.programs())
    assert lab.orphans()["port_reservations"] == lab.gpus
    daemon.client.report(lease_id, {"agent_host": HOST, "state": "enrolling",
                                    "generation": lease["generation"], "result": "error",
                                    "message": "test: enrolment of another VM failed"})
    assert lab.lease(lease_id)["state"] == "restoring"
    lease = finish(lab, lease_id)
    assert lease["state"] == "returned", lease.get("error")
    assert lab.orphans() == NOTHING
    assert lab.procs.state("gpu-host-01") == "RUNNING"
