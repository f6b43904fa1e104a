"""A VM agent restarted mid-job (TRIAL3 finding 12), over real HTTP against the lab job service
of both server generations: the restarted agent's startup post (fe381ff ``agent.py``:
``waiting``, then identity, no ``job_id``) leaves its document naming the dead job. The lease
must see it idle once it has posted nothing for ``STALE_AFTER`` s, the orphaned job must be
cancelled with a note, and status must not list the job as running."""

from __future__ import annotations

import requests

from conftest import MagicStack
from test_server_flow import SERVERS, Clock, active_vm_agent_with_a_job, agent_post, result_post
from test_server_status import status

from testflinger_magic import stalejob


def _running(m):
    (lease,) = status(m)["leases"]
    return lease["running_jobs"]


def _start_job(m, name, job_id, phase="provision"):
    """What the agent posts until it is in ``phase`` (agent.py::process_jobs): its job_id, then
    per phase the job's state followed by its own."""
    agent_post(m, name, job_id=job_id)
    for p in ("setup", "provision"):
        result_post(m, job_id, job_state=p)
        agent_post(m, name, state=p, comment="")
        if p == phase:
            return


def _restart(m, name):
    """testflinger-agent's startup (agent.py::TestflingerAgent.__init__): set_agent_state
    (WAITING) then _post_initial_agent_data: no job_id."""
    agent_post(m, name, state="waiting", comment="")
    agent_post(m, name, location="", queues=["one-gpu-vm"], provision_type="")


def _lease(m, lease):
    return m.db.magic_leases.find_one({"_id": lease["_id"]})


def _past_stale(clock) -> None:
    """Move the plugin's clock past STALE_AFTER after the agent's last post. The job service
    stamps ``agents.updated_at`` with the real time (as Testflinger does), and this test's
    clock started at the real time of its creation: under load the posts come seconds after
    it, so advancing by STALE_AFTER + 1 from the clock alone left the agent "not yet quiet"
    (a flake seen once in a fresh clone's make test)."""
    import time

    clock.advance(stalejob.STALE_AFTER + 1 + max(0.0, time.time() - clock()))


@SERVERS
def test_a_restarted_vm_agent_frees_its_lease_and_its_orphaned_job_is_cancelled(
        mongo, serve, server):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        _start_job(m, name, job_id)
        _restart(m, name)
        assert m.db.agents.find_one({"name": name})["job_id"] == job_id  # the bug's premise
        m.plugin.tick()  # posted just now: the pair of posts may be in flight, still busy
        assert _lease(m, lease)["idle_since"] is None
        assert _running(m) == [{"agent": name, "job_id": job_id}]
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "provision"
        _past_stale(clock)
        m.plugin.tick()
        job = m.db.jobs.find_one({"job_id": job_id})
        assert job["result_data"]["job_state"] == "cancelled"
        assert _lease(m, lease)["idle_since"] is not None
        assert _running(m) == []
        events = list(m.db.magic_events.find({"kind": "job.orphan_cancelled"}))
        assert len(events) == 1 and events[0]["data"]["job_id"] == job_id
        r = requests.get(f"{m.url}/v1/result/{job_id}/log/output",
                         headers=m.headers("contributor"), timeout=10)
        text = r.json()["output"]["provision"]["log_data"]
        assert name in text and "restarted while the job was in provision" in text
        m.plugin.tick()  # once only: the job is terminal now
        assert m.db.magic_events.count_documents({"kind": "job.orphan_cancelled"}) == 1
    finally:
        m.plugin.stop()


@SERVERS
def test_a_job_cancelled_by_its_submitter_after_the_restart_is_not_running(mongo, serve, server):
    """The trial's sequence: restart in provision, then testflinger-cli cancel."""
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        _start_job(m, name, job_id)
        _restart(m, name)
        r = requests.post(f"{m.url}/v1/job/{job_id}/action", json={"action": "cancel"},
                          headers=m.headers("contributor"), timeout=10)
        assert r.status_code == 200, r.text
        _past_stale(clock)
        m.plugin.tick()
        assert _running(m) == []
        assert _lease(m, lease)["idle_since"] is not None
        assert m.db.magic_events.count_documents({"kind": "job.orphan_cancelled"}) == 0
    finally:
        m.plugin.stop()


@SERVERS
def test_a_live_agent_in_a_long_phase_or_fetching_its_job_is_never_idle(mongo, serve, server):
    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, job_id = active_vm_agent_with_a_job(m)
        agent_post(m, name, job_id=job_id)  # popped: running, attachments being fetched
        clock.advance(3600)
        m.plugin.tick()
        assert _lease(m, lease)["idle_since"] is None
        _start_job(m, name, job_id)  # in provision for an hour, posting nothing
        clock.advance(3600)
        m.plugin.tick()
        assert _lease(m, lease)["idle_since"] is None
        assert m.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] == "provision"
        assert _running(m) == [{"agent": name, "job_id": job_id}]
    finally:
        m.plugin.stop()


@SERVERS
def test_restarted_then_ran_another_job_the_first_is_cancelled_once_idle(mongo, serve, server):
    """TRIAL4 finding 7: the restarted agent took a second job and finished it before the first
    was judged; its document then names no job (or the second), so only its marker (or the
    server's attribution) names the first, left in setup. Once the agent has been quiet and
    waiting for STALE_AFTER, the first is an orphan: cancelled with the note, the lease idle."""
    from test_server_api import poll_job, submit

    clock = Clock()
    m = MagicStack(mongo, serve, clock=clock, server=server)
    try:
        lease, name, first = active_vm_agent_with_a_job(m)
        _start_job(m, name, first, phase="setup")
        _restart(m, name)
        second = submit(m, "one-gpu-vm")
        assert poll_job(m, name, ["one-gpu-vm"]).status_code == 200
        agent_post(m, name, job_id=second)
        result_post(m, second, job_state="setup")
        agent_post(m, name, state="setup", comment="")
        m.plugin.tick()  # running the second: busy (its state is a phase), the first not judged
        assert m.db.jobs.find_one({"job_id": first})["result_data"]["job_state"] == "setup"
        assert _lease(m, lease)["idle_since"] is None
        result_post(m, second, job_state="complete")
        agent_post(m, name, job_id="")
        agent_post(m, name, state="waiting")
        m.plugin.tick()  # just finished: not judged yet
        assert m.db.jobs.find_one({"job_id": first})["result_data"]["job_state"] == "setup"
        _past_stale(clock)
        m.plugin.tick()
        assert m.db.jobs.find_one({"job_id": first})["result_data"]["job_state"] == "cancelled"
        assert m.db.jobs.find_one({"job_id": second})["result_data"]["job_state"] == "complete"
        assert _lease(m, lease)["idle_since"] is not None
        assert _running(m) == []
        (event,) = m.db.magic_events.find({"kind": "job.orphan_cancelled"})
        assert event["data"]["job_id"] == first and event["data"]["agent"] == name
    finally:
        m.plugin.stop()
