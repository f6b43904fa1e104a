"""Pre-warmed VM agents through the daemon's bring-up (real supervisord, MAAS simulator, job
service; DaemonLab): started during enrolment and waiting, released by the go file the active
check writes once the server accepted ``active``, so the first poll takes a job; a charm wipe
and a daemon killed after each effect resume correctly; restore leaves nothing."""

from __future__ import annotations

import json
import shutil
import time

import pytest

import fake_agent
from daemon_lab import NOTHING, DaemonLab, lab  # noqa: F401 (lab is a fixture)
from test_daemon_e2e import drive
from test_daemon_resume import run_until_killed
from testflinger_magic.agent_host import prewarm
from testflinger_magic.agent_host.daemon import Daemon

#: Give-up time (s) for a job to be taken or an agent to run; not a speed goal.
GIVE_UP = 60.0
#: The VM agents' polling interval: far longer than the test, so a job taken at a second poll
#: would not be taken at all.
POLLING_INTERVAL = 3600


def wait_until(cond, what: str):
    end = time.monotonic() + GIVE_UP
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def fake_command(lab: DaemonLab) -> str:
    """A pre-warmable agent command: a console script with a Python shebang (tests/
    fake_agent.py) tracing its imports and its main into ``lab.tmp/traces``."""
    traces = lab.tmp / "traces"
    if not traces.exists():
        traces.mkdir()
        fake_agent.make(lab.tmp / "venv")
    script = lab.tmp / "venv" / "bin" / "fake-agent"
    return f"{script} -c {{config}} -p {{port}} --trace-dir {traces}"


def pids(lab: DaemonLab, names) -> dict[str, int]:
    infos = lab.procs._infos()
    return {n: infos[n]["pid"] for n in names}


def test_vm_agents_wait_running_before_active_and_poll_once_released(lab):
    """With the lab's simulated testflinger-agent (``python -m ...sim_agent``: the launcher's
    ``-m`` form), which polls right after its startup posts (TESTFLINGER.md §3.2-3.3)."""
    daemon = Daemon(lab.config(agent_command=lab.sim_agent_command(),
                               agent_polling_interval=POLLING_INTERVAL))
    daemon.register()
    job_id = lab.submit()
    lab.plugin.tick()
    lease_id = lab.db.magic_leases.find_one({"device": "gpu-host-01"})["_id"]
    seen = {}
    report = daemon.client.report

    def watching(lid, body):
        if body.get("to_state") == "active":
            names = [f"gpu-host-01-vm{i}" for i in range(1, lab.gpus + 1)]
            seen["states"] = {n: lab.procs.state(n) for n in names}
            seen["pids"] = pids(lab, names)
            seen["go"] = [n for n in names if prewarm.go_path(lab.tmp / "agent-configs" / n)
                          .exists()]
            seen["posted"] = lab.db.agents.count_documents({"name": {"$in": names}})
            seen["polls"] = [a for a, _s in lab.job_polls if a in names]
        return report(lid, body)

    daemon.client.report = watching
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    daemon.wait_idle()
    assert lease["state"] == "active", lease.get("error")
    names = sorted(vm["name"] for vm in lease["vms"])
    # Before the active report: running (the launcher, its agent imported), no go file, and the
    # agents have not said a word to the server (no state post, no job poll).
    assert seen["states"] == {n: "RUNNING" for n in names}
    assert seen["go"] == [] and seen["posted"] == 0 and seen["polls"] == []
    conf = (lab.sv.conf_dir / f"{names[0]}.conf").read_text()
    assert prewarm.LAUNCHER_NAME in conf and "-m testflinger_magic.lab.sim_agent" in conf
    # After it: go files, and the very processes started during enrolment run the agents.
    assert all(prewarm.go_path(lab.tmp / "agent-configs" / n).exists() for n in names)
    wait_until(lambda: lab.job_state(job_id) != "waiting", f"the job; polls {lab.job_polls}")
    polls = [(a, s) for a, s in lab.job_polls if a in names]
    taker = next(a for a, s in polls if s == 200)
    assert [s for a, s in polls if a == taker][0] == 200, polls  # its first poll took it
    assert pids(lab, names) == seen["pids"]


def test_with_prewarm_off_vm_agents_are_started_only_after_active(lab):
    daemon = Daemon(lab.config(agent_command=lab.sim_agent_command(), agent_prewarm=False))
    daemon.register()
    lease_id = lab.lend()
    seen = {}
    report = daemon.client.report

    def watching(lid, body):
        if body.get("to_state") == "active":
            seen["states"] = {vm: lab.procs.state(vm) for vm in ("gpu-host-01-vm1",
                                                                 "gpu-host-01-vm2")}
        return report(lid, body)

    daemon.client.report = watching
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    daemon.wait_idle()
    assert lease["state"] == "active", lease.get("error")
    assert seen["states"] == {"gpu-host-01-vm1": "STOPPED", "gpu-host-01-vm2": "STOPPED"}
    for vm in lease["vms"]:
        assert lab.procs.state(vm["name"]) == "RUNNING"
        conf = (lab.sv.conf_dir / f"{vm['name']}.conf").read_text()
        assert prewarm.LAUNCHER_NAME not in conf
    assert not (lab.tmp / "state" / prewarm.LAUNCHER_NAME).exists()


def test_charm_wipe_of_prewarmed_programs_and_folders_while_active(lab):
    """config-changed deletes every conf.d/*.conf and replaces the agent-configs tree, go files
    with it (TESTFLINGER.md §6.1, §6.4): the active check renders the folders, writes their
    go files again and re-creates the programs, which run their agents at once."""
    daemon = Daemon(lab.config(agent_command=fake_command(lab), heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring"})
    assert lease["state"] == "active", lease.get("error")
    names = [vm["name"] for vm in lease["vms"]]
    traces = lab.tmp / "traces"
    for n in names:
        wait_until(lambda: "main" in [e["event"] for e in fake_agent.events(traces, n)],
                   f"{n}'s main")
    before = pids(lab, names)
    for n in names:
        lab.procs.remove_vm_agent(n)
    shutil.rmtree(lab.tmp / "agent-configs")
    daemon.run_once(wait=0, block=True)
    for n in names:
        assert lab.procs.state(n) == "RUNNING"
        assert prewarm.go_path(lab.tmp / "agent-configs" / n).exists()
        wait_until(lambda: [e["event"] for e in fake_agent.events(traces, n)].count("main") == 2,
                   f"{n}'s main again")
        last = fake_agent.events(traces, n)[-1]
        assert last["go"] and last["pid"] != before[n]
    after = lab.lease(lease_id)
    assert {(i["action"], i["phase"]) for i in after["intent"]} >= {("agent.go", "done")}


def imported(lab: DaemonLab, names) -> bool:
    """True when every VM agent of ``names`` was imported by its launcher (trace lines)."""
    return all(any(e["event"] == "import" for e in fake_agent.events(lab.tmp / "traces", n))
               for n in names)


def explain(lab: DaemonLab, action: str, name: str, events: list[dict]) -> str:
    """What a failed assertion on ``name``'s trace shows: the trace (times), the journal and
    the killed daemon's log."""
    lines = [f"trace of {name}:"]
    lines += [f"  {e.get('at', 0):.3f} {e['event']} pid {e['pid']} go {e['go']}" for e in events]
    for path in (lab.tmp / "state" / "leases").glob("*.json"):
        lines.append(f"journal {path.name}:")
        lines += [f"  {e['at']:.3f} {e['action']} {e['target']} {e['phase']}"
                  for e in json.loads(path.read_text())["entries"]]
    log = (lab.tmp / f"daemon-{action}.log").read_text()
    return "\n".join(lines) + f"\nlog of the daemon killed after {action}:\n{log[-4000:]}"


@pytest.mark.parametrize("action", ["agent.add", "maas.static_ip", "agent.folder", "agent.go"])
def test_kill_during_prewarmed_bringup_then_resume(lab, action):
    """SIGKILL right after the pre-warmed programs were started (``agent.add``), while MAAS
    commissions and the folders are rendered, and right after the go files were written:
    the restarted daemon takes the lease to active, every agent runs its main only with its go
    file, and restore leaves nothing (go files go with their folders).

    The VMs' commissioning is held (MaasSimulator.hold) until every launcher imported its
    agent: in MAAS it takes minutes, against the lab's 0.2 s that a launcher's Python start-up
    on a loaded host can outlast. So the import comes before the go file by the order of the
    bring-up (programs started while MAAS commissions; go files only after it), not by a race;
    and a daemon that started them only after commissioning never gets past it."""
    command = fake_command(lab)
    names = [f"gpu-host-01-vm{i}" for i in range(1, lab.gpus + 1)]
    lab.maas.hold("commission", lambda: imported(lab, names))
    Daemon(lab.config(agent_command=command)).register()
    lease_id = lab.lend()
    run_until_killed(lab, action, agent_command=command)
    daemon = Daemon(lab.config(agent_command=command))
    lease = drive(daemon, lab, lease_id, {"active", "returned", "failed"})
    assert lease["state"] == "active", (lease.get("error"), "launchers imported: "
                                        f"{imported(lab, names)}")
    traces = lab.tmp / "traces"
    assert sorted(vm["name"] for vm in lease["vms"]) == names
    for n in names:
        wait_until(lambda: "main" in [e["event"] for e in fake_agent.events(traces, n)],
                   f"{n}'s main")
        events = fake_agent.events(traces, n)
        # Never run before its go file; imported (by a launcher) before it.
        assert all(e["go"] for e in events if e["event"] == "main"), \
            explain(lab, action, n, events)
        assert not events[0]["go"] and events[0]["event"] == "import", \
            explain(lab, action, n, events)
    assert {n: lab.procs.state(n) for n in names} == {n: "RUNNING" for n in names}
    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease.get("error")
    assert lab.orphans() == NOTHING
    assert lab.procs.state("gpu-host-01") == "RUNNING"
