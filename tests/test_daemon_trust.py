"""The daemon trusts nothing it did not create (issue 12 item 2): a lease the server returns is
not proof. Restore deletes a MAAS machine only if its hostname is this lease's
``<device>-vm<N>`` and it carries the daemon's mark or a MAC the daemon gave; it removes agent
folders and programs only of ``<device>-vm<N>`` names.

The forged leases are written straight into the server's store: what a compromised server, or a
report the server should have refused, would hand the daemon."""

from __future__ import annotations

from daemon_lab import lab  # noqa: F401 (fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.marks import maas_mark


def _bring_up(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    return daemon, lease_id, lease


def _forge(lab, lease_id: str, index: int, **fields) -> None:
    lab.db.magic_leases.update_one(
        {"_id": lease_id}, {"$set": {f"vms.{index}.{k}": v for k, v in fields.items()}})


def test_vm_machines_carry_the_daemons_mark(lab):
    _daemon, lease_id, lease = _bring_up(lab)
    for vm in lease["vms"]:
        machine = lab.maas.machine(vm["maas_system_id"])
        assert machine["description"] == maas_mark(lease_id, vm["name"], "test-agent-host")


def test_forged_maas_system_ids_do_not_delete_the_device_or_a_stranger(lab):
    stranger = lab.maas.add_machine(hostname="someone-elses-server", status="Deployed")
    daemon, lease_id, lease = _bring_up(lab)
    device_sid = lab.system_ids["gpu-host-01"]
    # The lease now names the device itself and a stranger as its VMs' MAAS machines.
    _forge(lab, lease_id, 0, maas_system_id=device_sid)
    _forge(lab, lease_id, 1, maas_system_id=stranger)
    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease["history"][-1]
    machines = lab.maas.machines()
    assert device_sid in machines and machines[device_sid]["status_name"] == "Ready"
    assert stranger in machines and machines[stranger]["status_name"] == "Deployed"
    # The VMs the daemon made are gone all the same (found by name, proven by mark/MAC).
    assert lab.orphans()["maas_machines"] == 1  # the stranger
    assert {vm["maas_system_id"] for vm in lease["vms"]} & set(machines) == {device_sid, stranger}
    kept = {(i["data"]["system_id"]) for i in lease["intent"] if i["action"] == "maas.keep"}
    assert kept == {device_sid, stranger}


def test_forged_vm_name_does_not_remove_the_device_agents_folder_or_program(lab):
    # In production the charm keeps the device agent's folder in the same agent-configs tree.
    folder = lab.tmp / "agent-configs" / "gpu-host-01"
    daemon, lease_id, _lease = _bring_up(lab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "testflinger-agent.conf").write_text("agent_id: gpu-host-01\n")
    _forge(lab, lease_id, 0, name="gpu-host-01")
    lab.drain(lease_id)
    lease = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert lease["state"] == "returned", lease["history"][-1]
    assert (folder / "testflinger-agent.conf").read_text() == "agent_id: gpu-host-01\n"
    assert lab.procs.state("gpu-host-01") == "RUNNING"
    # The real VMs went, found by discovery (journal, programs, folders, MAAS names).
    orphans = lab.orphans()
    assert (orphans["domains"], orphans["maas_machines"], orphans["programs"]) == (0, 0, 0)
    assert sorted(p.name for p in (lab.tmp / "agent-configs").iterdir()) == ["gpu-host-01"]


def test_an_unmarked_machine_holding_a_vm_name_is_left_alone_and_named(lab):
    # A person's machine (no mark, another MAC) already holds gpu-host-01-vm1.
    theirs = lab.maas.add_machine(hostname="gpu-host-01-vm1", status="Ready",
                                  mac="00:16:3e:00:00:01", power_type="virsh")
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "returned", "failed"})
    assert lease["state"] == "returned"
    (why,) = [h["reason"] for h in lease["history"] if h["state"] == "restoring"]
    assert why.startswith(f"enrolling: StepError: MAAS machine gpu-host-01-vm1 ({theirs})"), why
    assert "no testflinger-magic mark" in why
    # Restore found it by name too and left it, named in the intent the server keeps.
    assert lab.maas.machine(theirs)["hostname"] == "gpu-host-01-vm1"
    assert [i["data"]["system_id"] for i in lease["intent"] if i["action"] == "maas.keep"] \
        == [theirs]
