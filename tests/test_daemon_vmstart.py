"""VM agents start only once their lease is ``active`` (their fences lifted), so their first job
poll can take a job (issue 9); a daemon that dies before starting them leaves that to its next
``active`` check."""

from __future__ import annotations

import time

from daemon_lab import DaemonLab, lab  # noqa: F401 (lab is a fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.agents import AUTOSTART_LINE
from testflinger_magic.agent_host.daemon import Daemon

#: Give-up time (s) for a job to be taken; not a speed goal: the VM agents' polling_interval is
#: far longer, so a job taken at a second poll would not be taken before it.
GIVE_UP = 60.0
POLLING_INTERVAL = 3600


def vm_states(lab: DaemonLab, lease: dict) -> dict[str, str]:
    return {vm["name"]: lab.procs.state(vm["name"]) for vm in lease.get("vms") or []}


def test_vm_agents_start_only_after_the_active_report_is_accepted(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    seen = {}
    report = daemon.client.report

    def watching(lid, body):
        if body.get("to_state") == "active":
            names = [f"gpu-host-01-vm{i}" for i in range(1, lab.gpus + 1)]
            seen["before"] = {n: lab.procs.state(n) for n in names}
            seen["fences_before"] = sorted(f["_id"] for f in lab.db.magic_fences.find())
        answer = report(lid, body)
        if body.get("to_state") == "active":
            seen["after"] = {n: lab.procs.state(n) for n in seen["before"]}
        return answer

    daemon.client.report = watching
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    daemon.wait_idle()
    assert lease["state"] == "active", lease.get("error")
    names = sorted(vm["name"] for vm in lease["vms"])
    # Added (supervisord knows them) but not started while the server still fenced them.
    assert seen["before"] == {n: "STOPPED" for n in names}
    assert set(names) <= set(seen["fences_before"])
    # The server's answer came back before any was started ...
    assert seen["after"] == {n: "STOPPED" for n in names}
    # ... and the daemon started them right after, in the same step.
    assert vm_states(lab, lease) == {n: "RUNNING" for n in names}
    assert lab.db.magic_fences.count_documents({"_id": {"$in": names}}) == 0
    for n in names:
        assert AUTOSTART_LINE in (lab.sv.conf_dir / f"{n}.conf").read_text().splitlines()


def test_a_daemon_that_dies_before_starting_them_leaves_it_to_the_next_active_check(lab,
                                                                                   monkeypatch):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    # The daemon "dies" between the accepted active report and the start.
    monkeypatch.setattr(Daemon, "_after_report", lambda self, lease, step: None)
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    daemon.wait_idle()
    assert lease["state"] == "active", lease.get("error")
    names = sorted(vm["name"] for vm in lease["vms"])
    assert vm_states(lab, lease) == {n: "STOPPED" for n in names}
    monkeypatch.undo()

    restarted = Daemon(lab.config())
    restarted.run_once(wait=0, block=True)
    assert vm_states(lab, lease) == {n: "RUNNING" for n in names}
    assert lab.procs.failing(names) == {}
    after = lab.lease(lease_id)
    assert after["state"] == "active"
    assert {vm["metrics_port"] for vm in after["vms"]} == {vm["metrics_port"] for vm in lease["vms"]}


def test_a_fresh_vm_agent_takes_its_first_job_at_its_first_poll(lab):
    """With the lab's simulated testflinger-agent (lab/sim_agent.py), which polls for a job right
    after its startup and then every ``polling_interval`` (TESTFLINGER.md §3.2-3.4)."""
    daemon = Daemon(lab.config(agent_command=lab.sim_agent_command(),
                               agent_polling_interval=POLLING_INTERVAL))
    daemon.register()
    job_id = lab.submit()  # the server claims a device for it
    lease = lab.db.magic_leases.find_one({"device": "gpu-host-01"})
    if lease is None:
        lab.plugin.tick()
        lease = lab.db.magic_leases.find_one({"device": "gpu-host-01"})
    lease_id = lease["_id"]
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    daemon.wait_idle()
    assert lease["state"] == "active", lease.get("error")
    names = {vm["name"] for vm in lease["vms"]}
    end = time.monotonic() + GIVE_UP
    while lab.job_state(job_id) == "waiting" and time.monotonic() < end:
        time.sleep(0.1)
    assert lab.job_state(job_id) != "waiting", f"job not taken; polls: {lab.job_polls}"
    polls = [(agent, status) for agent, status in lab.job_polls if agent in names]
    taker = next(agent for agent, status in polls if status == 200)
    # The agent that took the job did so at its very first poll: none of its polls was answered
    # with 204 (fenced, or no job) before.
    assert [status for agent, status in polls if agent == taker][0] == 200, polls
