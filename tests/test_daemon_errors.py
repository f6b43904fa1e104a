"""Bad input during bring-up: a clear error reaches the server, then restore returns the device."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from daemon_lab import HOST, DaemonLab, lab, NOTHING  # noqa: F401 (lab is a fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import RESTORE_ATTEMPTS, Daemon
from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter
from testflinger_magic.agent_host.splitplan import SplitError



def fail_then_return(lab: DaemonLab, daemon: Daemon) -> tuple[dict, dict]:
    """Lend, drive to restoring (the error), then to the end. Returns (errored, final) leases."""
    daemon.register()
    lease_id = lab.lend()
    errored = drive(daemon, lab, lease_id, {"restoring", "active", "returned", "failed"})
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    return errored, final


def test_unreachable_maas(lab):
    """A MAAS outage (the trial's finding 2): the bring-up that hits it is restored with no
    failure counted against the device; the restore keeps trying with a back-off while MAAS is
    down (never ``failed`` after RESTORE_ATTEMPTS), saying so in the lease; the heartbeat tells
    the server, which lends none of the host's devices meanwhile; once MAAS answers, the device
    is given back and lending resumes."""
    lab.maas.set_unreachable(True)
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    errored = drive(daemon, lab, lease_id, {"restoring", "active"})
    assert errored["state"] == "restoring"
    assert "fenced" in errored["error"] and "Maas" in errored["error"], errored["error"]
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert device["failures"] == 0, "an outage of MAAS counted against the device"
    kinds = [e["kind"] for e in lab.db.magic_events.find({})]
    assert "lease.maas_unreachable" in kinds and "device.failure" not in kinds

    # MAAS stays down: the restore is tried again and again, well past RESTORE_ATTEMPTS.
    tries = 0
    for _ in range(400):
        daemon.run_once(wait=0, block=True)
        lease = lab.lease(lease_id)
        assert lease["state"] == "restoring", lease.get("error")
        note = (lease.get("progress_note") or {}).get("message", "")
        if "restore try" in note:
            tries = int(note.split("restore try ")[1].split(")")[0])
        if tries > RESTORE_ATTEMPTS + 1:
            break
        time.sleep(0.05)
    assert tries > RESTORE_ATTEMPTS + 1, note
    assert note.startswith("MAAS unreachable since "), note
    assert "retrying in" in note and "given back once MAAS answers" in note, note

    # The heartbeat says MAAS is down; the server lends none of this host's devices.
    daemon._last_heartbeat = 0.0
    daemon._heartbeat()
    host = lab.db.magic_agent_hosts.find_one({"_id": HOST})
    assert host["maas_unreachable_since"] is not None
    inputs = lab.plugin.engine.gather(read_only=True)
    assert HOST in inputs.maas_down_hosts

    lab.maas.set_unreachable(False)  # MAAS is back: restore can finish
    final = drive(daemon, lab, lease_id, {"returned", "failed"}, limit=400)
    assert final["state"] == "returned", final.get("error")
    assert lab.procs.state("gpu-host-01") == "RUNNING"
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-01"})["failures"] == 0
    daemon._last_heartbeat = 0.0
    daemon._heartbeat()
    assert lab.db.magic_agent_hosts.find_one({"_id": HOST})["maas_unreachable_since"] is None


def test_restore_gives_up_after_a_long_outage_and_says_the_device_agent_is_stopped(lab):
    """Past ``timeouts.maas_outage`` the restore is given up (``failed``); the error says the
    device agent is left stopped and what starts it (finding 10: nothing restarts it)."""
    lab.maas.set_unreachable(True)
    daemon = Daemon(lab.config(timeouts={"maas_outage": "1s", "restoring": "30s",
                                         "deploying": "20s"}))
    daemon.register()
    lease_id = lab.lend()
    drive(daemon, lab, lease_id, {"restoring"})
    for _ in range(400):
        daemon.run_once(wait=0, block=True)
        if lab.lease(lease_id)["state"] == "failed":
            break
        time.sleep(0.05)
    final = lab.lease(lease_id)
    assert final["state"] == "failed", final["state"]
    assert "timeouts.maas_outage" in final["history"][-1]["reason"], final["history"][-1]
    assert "device agent gpu-host-01 left STOPPED" in final["history"][-1]["reason"]
    assert "supervisorctl start gpu-host-01" in final["history"][-1]["reason"]


def test_failed_deployment(lab):
    lab.maas.fail_next(lab.system_ids["gpu-host-01"], "deploy")
    errored, final = fail_then_return(lab, Daemon(lab.config()))
    assert errored["state"] == "restoring"
    assert "Failed deployment" in errored["error"], errored["error"]
    assert final["state"] == "returned", final.get("error")
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    assert lab.orphans() == NOTHING


class _DomainWillNotStart(LibvirtSplitter):
    """Defines the domains for real, then fails as a start refused by QEMU would."""

    def split(self, uri, lease_id, vms):
        results = super().split(uri, lease_id, vms)
        raise SplitError(f"domain {results[-1].name}: start: internal error: "
                         "qemu unexpectedly closed the monitor")


def test_domain_that_will_not_start(lab):
    errored, final = fail_then_return(lab, Daemon(lab.config(), splitter=_DomainWillNotStart()))
    assert errored["state"] == "restoring"
    assert "qemu unexpectedly closed the monitor" in errored["error"], errored["error"]
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans() == NOTHING  # the defined domains were found and removed


GARBAGE_SCRIPT = """
import json, sys
req = json.load(sys.stdin)
answers = {"domains": {"domains": []}, "restore": {}, "gpus_free": {"gpus_free": True}}
if req["action"] in answers:
    print(json.dumps(answers[req["action"]]))
else:
    print("Traceback? no: <html>garbage</html>")
"""


def test_script_splitter_printing_garbage(lab):
    script = lab.tmp / "split.py"
    script.write_text(GARBAGE_SCRIPT)
    config = lab.config(splitter={"kind": "script", "command": [sys.executable, str(script)]},
                        timeouts={"splitting": "1s", "restoring": "30s", "deploying": "20s"},
                        maas_poll=0.05)
    errored, final = fail_then_return(lab, Daemon(config))
    assert errored["state"] == "restoring"
    assert "splitting" in errored["error"] and "garbage" in errored["error"], errored["error"]
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans() == NOTHING


def test_vm_spec_too_big_for_the_device_is_blamed_on_the_queue(lab):
    # The user's case: a definition that validates but whose VMs no device can hold (the lab
    # host has 512 GiB; 2 VMs x 1 TiB). Before: libvirt failed at define on every lent device,
    # each counted as a device failure until every device was quarantined.
    from daemon_lab import QUEUES_YAML
    from testflinger_magic import queues

    big = QUEUES_YAML.replace("memory_mib: 2048", "memory_mib: 1048576")
    lab.plugin.apply(queues.load_text(big), source="big.yaml")
    errored, final = fail_then_return(lab, Daemon(lab.config()))
    assert errored["state"] == "restoring"
    assert "VMSpecDoesNotFit" in errored["error"] and "does not fit" in errored["error"]
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans() == NOTHING  # nothing was defined
    (back,) = [e["message"] for e in lab.db.magic_events.find(
        {"kind": "lease.returned", "lease_id": errored["_id"]})]
    assert "no VM had been made" in back and "removed" not in back, back  # TRIAL17 F7
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert (device["failures"], device["quarantined"]) == (0, False)
    stored = lab.db.magic_queues.find_one({"_id": "one-gpu-vm"})
    assert "VMSpecDoesNotFit" in stored["suspended"]["reason"]
    kinds = [e["kind"] for e in lab.db.magic_events.find({})]
    assert "queue.misconfigured" in kinds and "device.failure" not in kinds


#: The queue of daemon_lab.QUEUES_YAML with VMs of two GPUs, one device at a time, and a
#: second such queue that selects only the HGX board.
TWO_GPU_YAML = """
magic_queues:
  one-gpu-vm:
    description: two GPUs per VM
    devices: {home_queues: [gpu-hosts]}
    vms_per_device: gpus
    vm: {gpus: 2, vcpus: 2, memory_mib: 2048, disk_gib: 10}
    vm_host_series: jammy
    agent_template: maas2-vm
    provision_type: maas2
    policy: {max_devices: 1, max_starting: 1, min_devices: 0, idle_timeout: 1h}
  hgx-only:
    description: two GPUs per VM, on the HGX board only
    devices: {agents: [gpu-host-01]}
    vms_per_device: gpus
    vm: {gpus: 2, vcpus: 2, memory_mib: 2048, disk_gib: 10}
    vm_host_series: jammy
    agent_template: maas2-vm
    provision_type: maas2
    policy: {max_devices: 1, max_starting: 1, min_devices: 0, idle_timeout: 1h}
"""


@pytest.fixture
def mixed(tmp_path):
    """gpu-host-01: an HGX board (4 NVSwitches); gpu-host-02: a PCIe server (none); a MAAS
    older than 3.0, which lists no node devices: the splits learn the NVSwitches (a newer
    MAAS tells the registration: test_daemon_nvswitches.py)."""
    parts = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"),
                      kinds={"gpu-host-01": "hgx", "gpu-host-02": "pcie"},
                      maas_version="2.9.2")
    yield parts
    parts.stop()


def test_an_nvswitch_refusal_is_the_devices_fact_not_the_queues_suspension(mixed, caplog):
    """Fresh-user trial: 2-GPU VMs on an HGX board have no NVLink unless the operator's own
    tooling activates a Fabric Manager partition; without splitter.nvswitch_multi_gpu the split
    is refused. That refusal suspended the whole queue (every device, jobs stranded until a
    person acted) and taught the server nothing, so the next lend could burn another deploy on
    the same board. Now the device's NVSwitches are kept as its fact: no failure counted, the
    queue not suspended, the next lend picks the PCIe server and the job runs; the board is
    never picked again for 2-GPU VMs, and a queue only it could serve waits saying why."""
    import requests

    from testflinger_magic import queues
    from testflinger_magic.lab import hosts

    lab = mixed
    lab.plugin.apply(queues.load_text(TWO_GPU_YAML), source="two.yaml")
    daemon = Daemon(lab.config(agent_command=lab.sim_agent_command()))
    daemon.register()
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-01"}).get("nvswitches") is None
    job_id = lab.submit()
    lab.plugin.tick()
    # Both devices waste no GPU; the board comes first by name, and nothing is known of it yet.
    (first,) = list(lab.db.magic_leases.find({}))
    assert first["device"] == "gpu-host-01"
    with caplog.at_level(logging.INFO, logger="testflinger_magic.agent_host"):
        errored = drive(daemon, lab, first["_id"], {"restoring", "active", "returned", "failed"})
    assert errored["state"] == "restoring"
    assert "MultiGPUNeedsFabric" in errored["error"] and "Fabric Manager" in errored["error"]
    # Expected, no failure counted: said as a warning, not an ERROR (TRIAL18 F7).
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "MultiGPUNeedsFabric"
            in r.getMessage()]
    assert said and all(level == logging.WARNING for level, _ in said), said
    assert "no failure is counted" in said[0][1]
    board = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert (board["failures"], board["quarantined"]) == (0, False)
    assert board["nvswitches"] == len(hosts.NVSWITCHES)
    assert board["nvswitches_found"]["lease_id"] == first["_id"]
    assert board["nvswitches_found"]["refused"] is True
    assert lab.db.magic_queues.find_one({"_id": "one-gpu-vm"}).get("suspended") is None
    kinds = [e["kind"] for e in lab.db.magic_events.find({})]
    assert "device.nvswitches" in kinds and "lease.unfit_device" in kinds
    assert "queue.misconfigured" not in kinds and "device.failure" not in kinds
    final = drive(daemon, lab, first["_id"], {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans() == NOTHING  # nothing was defined
    (back,) = [e["message"] for e in lab.db.magic_events.find(
        {"kind": "lease.returned", "lease_id": first["_id"]})]
    assert "no VM had been made" in back and "removed" not in back, back  # TRIAL17 F7

    # The next lend picks the PCIe server; its split reports 0 NVSwitches; the job runs there.
    lab.plugin.tick()
    second = lab.db.magic_leases.find_one({"_id": {"$ne": first["_id"]}})
    assert second is not None and second["device"] == "gpu-host-02", second
    active = drive(daemon, lab, second["_id"], {"active", "restoring", "failed"})
    assert active["state"] == "active", active.get("error")
    assert [len(vm["gpus"]) for vm in active["vms"]] == [2]
    assert lab.db.magic_devices.find_one({"_id": "gpu-host-02"})["nvswitches"] == 0
    end = time.monotonic() + 60
    while lab.job_state(job_id) == "waiting" and time.monotonic() < end:
        time.sleep(0.05)
    assert lab.job_state(job_id) != "waiting", lab.job_state(job_id)
    # The board is not eligible for 2-GPU VMs any more (status counts it out), and lending
    # by hand refuses it saying why, forced or not (TRIAL6: --force only wasted a deploy).
    status = {q["name"]: q for q in lab.plugin.engine.status()["queues"]}
    assert status["one-gpu-vm"]["devices_eligible"] == 1
    assert status["one-gpu-vm"]["suspended"] is None
    r = requests.post(f"{lab.server.url}/v1/magic/leases", headers=lab._admin(),
                      json={"device": "gpu-host-01", "queue": "hgx-only", "reason": "t"},
                      timeout=10)
    assert r.status_code == 409 and "NVSwitch" in r.text, r.text
    assert "--force" not in r.text
    r = requests.post(f"{lab.server.url}/v1/magic/leases", headers=lab._admin(),
                      json={"device": "gpu-host-01", "queue": "hgx-only", "reason": "t",
                            "force": True}, timeout=10)
    assert r.status_code == 409 and "NVSwitch" in r.text, r.text

    # A queue only the board could serve: the test engineer's preflight says why, naming no
    # step of theirs; jobs wait with the reason in plan and status; no deploy is tried.
    r = requests.get(f"{lab.server.url}/v1/queues/hgx-only/agents", timeout=10)
    assert r.status_code == 404 and "NVSwitch" in r.text, r.text
    assert "apply" not in r.text and "nvswitch_multi_gpu" not in r.text
    lab.submit("hgx-only")
    for _ in range(3):
        lab.plugin.tick()
    assert lab.db.magic_leases.count_documents({"queue": "hgx-only"}) == 0
    blocked = [a for a in lab.plugin.engine.plan_only(explain=True)
               if a.kind == "blocked" and a.queue == "hgx-only"]
    assert len(blocked) == 1 and blocked[0].data["nvswitch_devices"] == ["gpu-host-01"]
    reason = blocked[0].reason
    assert "gpu-host-01 (4 NVSwitches, found by lease" in reason, reason
    assert "splitter.nvswitch_multi_gpu: true" in reason and "one GPU per VM" in reason
    status = {q["name"]: q for q in lab.plugin.engine.status()["queues"]}
    assert status["hgx-only"]["blocked"]["reason"] == reason
    assert status["hgx-only"]["suspended"] is None


def test_vm_host_series_maas_has_no_images_of_is_blamed_on_the_queue(lab):
    # A supported LTS that this MAAS has not imported: MAAS refuses the deploy with HTTP 400
    # and a distro_series error (maasserver/api/machines.py MachineHandler.deploy, after it
    # allocated the machine). Before, the daemon reported it as the device's failure, on each
    # device it was lent, until they were quarantined.
    from daemon_lab import QUEUES_YAML
    from testflinger_magic import queues

    assert "focal" not in lab.maas.usable_releases
    lab.plugin.apply(queues.load_text(QUEUES_YAML.replace("vm_host_series: jammy",
                                                          "vm_host_series: focal")),
                     source="focal.yaml")
    errored, final = fail_then_return(lab, Daemon(lab.config()))
    assert errored["state"] == "restoring"
    assert "SeriesNotUsable" in errored["error"], errored["error"]
    assert "vm_host_series 'focal'" in errored["error"], errored["error"]
    assert "focal is not one of the available choices" in errored["error"], errored["error"]
    assert final["state"] == "returned", final.get("error")
    # The refused deploy left the machine Allocated; the restore released it.
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert (device["failures"], device["quarantined"]) == (0, False)
    stored = lab.db.magic_queues.find_one({"_id": "one-gpu-vm"})
    assert "SeriesNotUsable" in stored["suspended"]["reason"]
    kinds = [e["kind"] for e in lab.db.magic_events.find({})]
    assert "queue.misconfigured" in kinds and "device.failure" not in kinds


def _status(lab: DaemonLab) -> dict:
    import requests
    r = requests.get(f"{lab.server.url}/v1/magic/status", headers=lab._admin(), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_typod_agent_template_never_quarantines_devices(tmp_path):
    # TRIAL finding 1: `agent_template: does-not-exist` validated and applied; every bring-up
    # then failed at enrolling, each counted against its device, until both were quarantined.
    # Now the daemon checks the template folder before it touches the device and blames the
    # queue: no failure counted, the queue suspended with a reason naming the folder.
    from daemon_lab import QUEUE, QUEUES_YAML
    from testflinger_magic import queues

    lab = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"))
    try:
        typo = QUEUES_YAML.replace("agent_template: maas2-vm", "agent_template: does-not-exist")
        lab.plugin.apply(queues.load_text(typo), source="typo.yaml")
        daemon = Daemon(lab.config())
        daemon.register()
        for _ in range(4):
            lab.submit()
        for _ in range(12):  # the reconciler lends for the waiting jobs, the daemon works
            lab.plugin.tick()
            daemon.run_once(wait=0, block=True)
        leases = list(lab.db.magic_leases.find({"queue": QUEUE}))
        assert leases, "the reconciler lent nothing"
        assert {x["state"] for x in leases} == {"returned"}, [x.get("error") for x in leases]
        for x in leases:
            assert "AgentConfigError" in x["error"] and "does-not-exist" in x["error"]
            assert "fenced" not in [h["state"] for h in x["history"]]  # failed before the fence
        for device in lab.db.magic_devices.find({}):
            assert (device["failures"], device["quarantined"]) == (0, False), device
        for d in ("gpu-host-01", "gpu-host-02"):
            assert lab.procs.state(d) == "RUNNING"  # the device agents were never stopped
        status = _status(lab)
        q = next(q for q in status["queues"] if q["name"] == QUEUE)
        assert "does-not-exist" in q["suspended"] and "maas2-vm" in q["suspended"], q
        assert q["blocked"]["why"] == "suspended", q
        # What `testflinger-magic status` prints under WHY JOBS WAIT for it.
        from testflinger_magic.cli_output import _why_jobs_wait
        (line,) = [x for x in _why_jobs_wait(status["queues"], status) if x.startswith(QUEUE)]
        assert "lending suspended: claimed: AgentConfigError: " in line, line
        assert "does-not-exist: no such agent template folder on this agent host" in line, line
        kinds = [e["kind"] for e in lab.db.magic_events.find({})]
        assert "queue.misconfigured" in kinds and "device.failure" not in kinds
        # The daemon told the server which template folders it has (apply's warning).
        host = lab.db.magic_agent_hosts.find_one({})
        assert "maas2-vm" in host["templates"] and "does-not-exist" not in host["templates"]
    finally:
        lab.stop()


def test_template_missing_a_context_key_is_blamed_on_the_queue(lab):
    # A template that parses but names a key the daemon's context lacks fails only at
    # rendering (enrolling): the queue's fault as well.
    templates = lab.tmp / "templates"
    (templates / "needs-key").mkdir(parents=True)
    (templates / "needs-key" / "testflinger-agent.conf.j2").write_text(
        "agent_id: {{ agent_name }}\nserver_address: {{ no_such_key }}\njob_queues: [x]\n")
    from daemon_lab import QUEUES_YAML
    from testflinger_magic import queues

    lab.plugin.apply(queues.load_text(QUEUES_YAML.replace("agent_template: maas2-vm",
                                                          "agent_template: needs-key")),
                     source="needs-key.yaml")
    errored, final = fail_then_return(lab, Daemon(lab.config(agent_templates_dir=str(templates))))
    assert errored["state"] == "restoring"
    assert "enrolling" in errored["error"] and "no_such_key" in errored["error"], errored["error"]
    assert final["state"] == "returned", final.get("error")
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert (device["failures"], device["quarantined"]) == (0, False)
    assert "no_such_key" in lab.db.magic_queues.find_one({"_id": "one-gpu-vm"})["suspended"]["reason"]
