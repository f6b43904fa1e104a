"""TRIAL3 finding 12 with real parts: the agent-host charm rewrites conf.d and runs
``supervisorctl update`` while a VM agent (the lab's sim_agent, run by real supervisord) is in
a job's provision; the daemon restores the program, the restarted agent posts ``waiting`` and
keeps the dead job's ``job_id`` (as testflinger-agent fe381ff). The server must then see the VM
agent idle, cancel the orphaned job with a note, and stop listing it as running."""

from __future__ import annotations

import time

import requests

from daemon_lab import QUEUE, DaemonLab
from test_agents import supervisorctl_update
from test_daemon_e2e import drive
from testflinger_magic import stalejob
from testflinger_magic.agent_host.daemon import Daemon

#: Give-up time (s) for the agents; never asserted on.
GIVE_UP = 60.0


def wait_for(predicate, what, tick=None):
    end = time.monotonic() + GIVE_UP
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if tick:
            tick()
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def test_a_vm_agent_restarted_mid_job_by_the_charm_frees_its_lease(tmp_path, monkeypatch):
    # Each phase lasts long enough for the restart to land in provision (the agents inherit
    # supervisord's environment); the quiet time the rule asks for is shortened to seconds,
    # not to wait two minutes (the live agent keeps posting its phases, never `waiting`).
    monkeypatch.setenv("SIM_AGENT_PHASE_SECONDS", "12")
    # 5 s, not less: a tick kicked by a daemon report may run at any moment, and must not judge
    # the restarted agent before the test has seen the job still in provision (the premise).
    monkeypatch.setattr(stalejob, "STALE_AFTER", 5.0)
    lab = DaemonLab(tmp_path)
    try:
        daemon = Daemon(lab.config(agent_command=lab.sim_agent_command(),
                                   agent_polling_interval=1))
        daemon.register()
        r = requests.post(f"{lab.server.url}/v1/job", timeout=10, json={
            "job_queue": QUEUE, "provision_data": {"distro": "noble"},
            "test_data": {"test_cmds": "true"}})
        job_id = r.json()["job_id"]
        lab.plugin.tick()
        lease_id = lab.db.magic_leases.find_one({"device": "gpu-host-01"})["_id"]
        lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
        assert lease["state"] == "active", lease.get("error")
        wait_for(lambda: lab.job_state(job_id) == "provision", "the job's provision phase")
        name = lab.db.agents.find_one({"job_id": job_id})["name"]

        # What the charm does when it rewrites conf.d: our program file gone, then update.
        (lab.sv.conf_dir / f"{name}.conf").unlink()
        supervisorctl_update(lab.sv)
        assert lab.procs.state(name) != "RUNNING"
        lab.db.agents.update_one({"name": name}, {"$unset": {"location": ""}})
        wait_for(lambda: lab.procs.state(name) == "RUNNING", "the daemon to restore it",
                 tick=lambda: daemon.run_once(wait=0, block=True))
        wait_for(lambda: "location" in (lab.db.agents.find_one({"name": name}) or {}),
                 "the restarted agent's startup posts")
        doc = lab.db.agents.find_one({"name": name})
        assert (doc["state"], doc["job_id"]) == ("waiting", job_id)  # the bug's premise
        assert lab.job_state(job_id) == "provision"

        time.sleep(stalejob.STALE_AFTER)  # the rule's quiet time (5 s here), not an assertion
        lab.plugin.tick()
        assert lab.job_state(job_id) == "cancelled"
        event = lab.db.magic_events.find_one({"kind": "job.orphan_cancelled"})
        assert event and event["data"] == {"job_id": job_id, "agent": name,
                                           "job_state": "provision"}
        note = lab.db.logs.find_one({"job_id": job_id, "phase": "provision",
                                     "log_data": {"$regex": "restarted while the job"}})
        assert note is not None
        status = lab.plugin.engine.status()
        (open_lease,) = status["leases"]
        assert open_lease["running_jobs"] == []
        assert lab.db.magic_leases.find_one({"_id": lease_id})["idle_since"] is not None
    finally:
        lab.stop()
