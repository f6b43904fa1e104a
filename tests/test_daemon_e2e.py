"""The daemon carries a lease claimed -> active -> returned against real parts (see daemon_lab)."""

from __future__ import annotations

import shutil
import socket

import pytest

from daemon_lab import BINDER, NOTHING, DaemonLab, lab  # noqa: F401 (lab is a fixture)
from testflinger_magic.agent_host.agents import AgentProcesses
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.journal import journaled_leases
from testflinger_magic.agent_host.marks import maas_mark

BRINGUP = ["claimed", "fenced", "deploying", "splitting", "enrolling", "active"]


def drive(daemon: Daemon, lab: DaemonLab, lease_id: str, until: set[str], limit: int = 60) -> dict:
    """Poll and work (synchronously) until the lease reaches a state in ``until``."""
    for _ in range(limit):
        lease = lab.lease(lease_id)
        if lease["state"] in until:
            return lease
        daemon.run_once(wait=0, block=True)
    raise AssertionError(f"lease stuck in {lab.lease(lease_id)['state']}")


def test_lease_claimed_to_active_and_back_to_returned(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    assert [h["state"] for h in lease["history"]] == BRINGUP
    # The server saw every effect, begun and done.
    actions = {(i["action"], i["phase"]) for i in lease["intent"]}
    for action in ("agent.stop", "maas.deploy", "libvirt.split", "maas.create", "maas.static_ip",
                   "agent.add"):
        assert {(action, "begin"), (action, "done")} <= actions
    assert len(lease["vms"]) == lab.gpus
    for vm in lease["vms"]:
        assert vm["maas_system_id"] and vm["domain"] == vm["name"] and len(vm["gpus"]) == 1
        assert lab.procs.state(vm["name"]) == "RUNNING"
        machine = lab.maas.machine(vm["maas_system_id"])
        # Enrolled, not deployed: Ready with a STATIC address, what maas2 needs as device_ip.
        assert machine["status_name"] == "Ready" and machine["ip_addresses"] == [vm["ip"]]
        assert [(link["mode"], link["ip_address"]) for link in
                machine["boot_interface"]["links"]] == [("static", vm["ip"])]
        assert machine["power_type"] == "virsh"
        assert lab.maas.power_parameters(vm["maas_system_id"])["power_id"] == vm["domain"]
        default_yaml = (lab.tmp / "agent-configs" / vm["name"] / "default.yaml").read_text()
        assert f'device_ip: "{vm["ip"]}"' in default_yaml
    assert len({vm["ip"] for vm in lease["vms"]}) == lab.gpus
    assert len({vm["metrics_port"] for vm in lease["vms"]}) == lab.gpus
    # A job's maas2 provision deploys the VM, its cleanup releases it (TESTFLINGER.md §5.4-5.5):
    # device_ip must stay among the VM's addresses throughout.
    maas, sid = daemon.drivers.maas, lease["vms"][0]["maas_system_id"]
    maas.deploy(sid, "jammy")
    assert lease["vms"][0]["ip"] in maas.wait_for(sid, {"Deployed"}, set(), 20, 0.05).ip_addresses
    maas.release(sid)
    assert maas.wait_for(sid, {"Ready"}, set(), 20, 0.05).ip_addresses == (lease["vms"][0]["ip"],)
    assert lab.procs.state("gpu-host-01") == "STOPPED"
    assert lab.orphans() == {"domains": 2, "maas_machines": 2, "programs": 2, "folders": 2,
                             "conf_files": 2, "port_reservations": 2}

    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease.get("error")
    assert lab.orphans() == {"domains": 0, "maas_machines": 0, "programs": 0, "folders": 0,
                             "conf_files": 0, "port_reservations": 0}
    assert lab.procs.state("gpu-host-01") == "RUNNING"
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    assert journaled_leases(lab.config().state_dir) == []


def test_charm_wipe_of_vm_programs_is_repaired_while_active(lab):
    daemon = Daemon(lab.config(heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring"})
    assert lease["state"] == "active", lease.get("error")
    name = lease["vms"][0]["name"]
    lab.procs.remove_vm_agent(name)  # what a charm config-changed does to our conf file
    assert lab.procs.state(name) == "ABSENT"
    daemon.run_once(wait=0, block=True)
    assert lab.procs.state(name) == "RUNNING"


def test_charm_wipe_of_programs_and_agent_folders_is_repaired_while_active(lab):
    """config-changed deletes every conf.d/*.conf and replaces the agent-configs tree
    (TESTFLINGER.md §6.1, §6.4): the next active check renders the folders and restarts both."""
    daemon = Daemon(lab.config(heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring"})
    assert lease["state"] == "active", lease.get("error")
    folders = lab.tmp / "agent-configs"
    before = {vm["name"]: (folders / vm["name"] / "default.yaml").read_text()
              for vm in lease["vms"]}
    for vm in lease["vms"]:
        lab.procs.remove_vm_agent(vm["name"])
    shutil.rmtree(folders)
    assert all(lab.procs.state(name) == "ABSENT" for name in before)

    daemon.run_once(wait=0, block=True)
    for name, text in before.items():
        assert lab.procs.state(name) == "RUNNING"
        assert (folders / name / "default.yaml").read_text() == text
        assert (folders / name / "testflinger-agent.conf").exists()
    after = lab.lease(lease_id)
    assert after["state"] == "active"
    assert {(i["action"], i["target"]) for i in after["intent"] if i["phase"] == "done"} >= {
        ("agent.folder", name) for name in before}


def test_active_check_reports_a_metrics_port_it_had_to_move(lab):
    daemon = Daemon(lab.config(heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring"})
    assert lease["state"] == "active", lease.get("error")
    vm = lease["vms"][0]
    lab.procs.remove_vm_agent(vm["name"])
    # Another program (as after a charm rewrite) now holds the VM agent's port.
    squatter = lab.tmp / "squatter"
    squatter.mkdir()
    (squatter / "testflinger-agent.conf").write_text("agent_id: squatter\n")
    lab.procs.add_vm_agent("squatter", squatter, vm["metrics_port"])

    daemon.run_once(wait=0, block=True)
    assert lab.procs.state(vm["name"]) == "RUNNING"
    moved = lab.lease(lease_id)["vms"][0]["metrics_port"]
    assert moved != vm["metrics_port"]
    assert lab.procs.ports()[vm["name"]] == moved


def test_stale_maas_machine_with_a_vm_hostname_but_another_mac_is_replaced(lab):
    # An earlier lease left gpu-host-01-vm1 in MAAS with another MAC: its power parameters
    # point at another domain. Before, enrolment took it as ours by hostname alone and gave its
    # address to our VM agent. It carries the daemon's mark, so it is ours to delete (one a
    # person made is left alone: test_daemon_trust).
    stale = lab.maas.add_machine(hostname="gpu-host-01-vm1", status="Ready",
                                 mac="00:16:3e:00:00:01", power_type="virsh",
                                 description=maas_mark("lease-earlier", "gpu-host-01-vm1"))
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    vm = next(v for v in lease["vms"] if v["name"] == "gpu-host-01-vm1")
    assert vm["maas_system_id"] != stale and stale not in lab.maas.machines()
    machine = lab.maas.machine(vm["maas_system_id"])
    assert [i["mac_address"] for i in machine["interface_set"]] == [vm["mac"]]
    assert lab.maas.power_parameters(vm["maas_system_id"])["power_id"] == vm["domain"]
    deletes = [i for i in lease["intent"] if i["action"] == "maas.delete"]
    assert {(i["target"], i["phase"], i["data"]["system_id"]) for i in deletes} == {
        ("gpu-host-01-vm1", "begin", stale), ("gpu-host-01-vm1", "done", stale)}
    lab.drain(lease_id)
    assert drive(daemon, lab, lease_id, {"returned", "failed"})["state"] == "returned"
    assert lab.orphans()["maas_machines"] == 0


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_vm_agents_whose_metrics_port_another_process_took_are_moved(lab, monkeypatch):
    """A port taken between allocation and start (enrolment), or while active: the agent exits
    "Address already in use" and supervisord restarts it forever, RUNNING in between."""
    held: dict[str, socket.socket] = {}
    real = AgentProcesses.allocate_port

    def racing(self, *args, **kwargs):
        port = real(self, *args, **kwargs)
        owner = kwargs.get("owner") or ""
        if "-vm" in owner and not held:
            held[owner] = _hold(port)  # someone else grabs it right after allocation
        return port

    monkeypatch.setattr(AgentProcesses, "allocate_port", racing)
    daemon = Daemon(lab.config(agent_command=BINDER, heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    try:
        lease = drive(daemon, lab, lease_id, {"active", "restoring"})
        assert lease["state"] == "active", lease.get("error")
        (victim, sock), = held.items()
        vm = next(v for v in lease["vms"] if v["name"] == victim)
        assert vm["metrics_port"] != sock.getsockname()[1]
        assert lab.procs.ports()[victim] == vm["metrics_port"]
        assert lab.procs.failing([v["name"] for v in lease["vms"]]) == {}

        # While active: another VM agent's port is taken and its program re-created on it.
        other = next(v for v in lease["vms"] if v["name"] != victim)
        lab.procs.remove_vm_agent(other["name"])
        held["active"] = _hold(other["metrics_port"])
        binders = AgentProcesses(lab.sv.url, lab.sv.conf_dir, BINDER)
        binders.add_vm_agent(other["name"], lab.tmp / "agent-configs" / other["name"],
                             other["metrics_port"])
        assert other["name"] in lab.procs.failing([other["name"]])
        daemon.run_once(wait=0, block=True)
        moved = next(v for v in lab.lease(lease_id)["vms"] if v["name"] == other["name"])
        assert moved["metrics_port"] != other["metrics_port"]
        assert lab.procs.ports()[other["name"]] == moved["metrics_port"]
        assert lab.procs.failing([other["name"]]) == {}
    finally:
        for s in held.values():
            s.close()


def test_a_restore_starts_at_once_when_the_server_moves_a_deploying_lease_on(lab):
    """TRIAL13 F5: MAAS never finishes a deploy (held) and the lease is drained during
    bring-up (as its provision_timeout passing does): the server moves it to restoring, and the
    daemon ends the moot deploy wait at once and restores, not after timeouts.deploying
    (here 10 minutes)."""
    import threading
    import time

    lab.maas.hold("deploy", lambda: False)
    daemon = Daemon(lab.config(timeouts={"deploying": "10m", "enrolling": "20s",
                                         "restoring": "30s"}))
    daemon.register()
    lease_id = lab.lend()
    runner = threading.Thread(target=daemon.run_forever, daemon=True)
    runner.start()
    try:
        end = time.monotonic() + 30
        while lab.lease(lease_id)["state"] != "deploying" and time.monotonic() < end:
            time.sleep(0.05)
        assert lab.lease(lease_id)["state"] == "deploying", [(h["state"], h["reason"][:300]) for h in lab.lease(lease_id)["history"]]
        time.sleep(0.5)  # the step waits for MAAS now
        lab.drain(lease_id)
        end = time.monotonic() + 30
        while lab.lease(lease_id)["state"] not in ("returned", "failed") \
                and time.monotonic() < end:
            time.sleep(0.1)
        lease = lab.lease(lease_id)
        assert lease["state"] == "returned", (lease["state"], lease.get("error"))
    finally:
        daemon.stop()
        runner.join(30)
    assert not runner.is_alive()
    assert lab.orphans() == NOTHING


def test_a_drain_and_a_return_are_not_read_as_the_server_closing_the_lease(lab, caplog):
    """TRIAL17 F8: the work poll left draining leases out, so every drain looked to the daemon
    like the server closing the lease under it: it ended the lease's step, swept at once, and
    logged a warning meant for ``abandon --force``. A draining lease is listed now, and a
    lease our own report closed is never stepped again from an older answer."""
    import logging

    import requests

    daemon = Daemon(lab.config(heartbeat_interval=0.001))
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active"
    # One VM agent in a job's test phase: the drain waits for it.
    r = requests.post(f"{lab.server.url}/v1/agents/data/{lease['vms'][0]['agent_name']}",
                      json={"state": "test", "job_id": "a-job", "queues": ["one-gpu-vm"]},
                      headers=lab._admin(), timeout=10)
    assert r.status_code == 200, r.text
    with caplog.at_level(logging.INFO, logger="testflinger_magic"):
        r = requests.post(f"{lab.server.url}/v1/magic/leases/{lease_id}/drain",
                          headers=lab._admin(), json={"reason": "test", "grace": "10m"},
                          timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "draining", r.text
        polled = daemon.run_once(wait=0, block=True)
        assert [d["state"] for d in polled if d["_id"] == lease_id] == ["draining"]
        assert daemon._closed == {}
        r = requests.post(f"{lab.server.url}/v1/agents/data/{lease['vms'][0]['agent_name']}",
                          json={"state": "waiting", "job_id": "", "queues": ["one-gpu-vm"]},
                          headers=lab._admin(), timeout=10)  # the job ended
        assert r.status_code == 200, r.text
        lab.drain(lease_id)
        assert drive(daemon, lab, lease_id, {"returned", "failed"})["state"] == "returned"
        # An answer given before the returned report still lists the lease in restoring.
        assert daemon._dispatch(dict(lab.lease(lease_id), state="restoring")) is False
        daemon.run_once(wait=0, block=True)
        assert daemon._closed == {}
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "closed the lease" in m], said


def test_our_own_returned_report_is_not_read_as_the_server_closing_the_lease(lab, caplog):
    """TRIAL18 F1: the server accepts the ``returned`` report and answers the long-poll without
    the lease before the step's thread has the report's answer; the loop then saw a lease gone
    from the poll with its step running: a warning meant for ``abandon --force``, a step
    superseded, a sweep at once. The poll is made here at exactly that moment."""
    import logging

    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    assert drive(daemon, lab, lease_id, {"active", "restoring", "failed"})["state"] == "active"
    real = daemon.client.report

    def report_then_poll(lid, body):
        new = real(lid, body)
        if body.get("to_state") == "returned":
            daemon.run_once(wait=0)  # the loop's poll, answered after the server accepted it
        return new

    daemon.client.report = report_then_poll
    with caplog.at_level(logging.INFO, logger="testflinger_magic"):
        lab.drain(lease_id)
        assert drive(daemon, lab, lease_id, {"returned", "failed"})["state"] == "returned"
        daemon.run_once(wait=0, block=True)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "closed the lease" in m], said
    assert daemon._closed == {}
