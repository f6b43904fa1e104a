"""``testflinger-magic agent-host check`` through the real CLI, against the lab's HGX and PCIe
hosts and the MAAS simulator (read-only: nothing on the host or in MAAS changes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import libvirt
import pytest

from daemon_lab import lab  # noqa: F401 (fixture)
from testflinger_magic import cli
from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver
from testflinger_magic.lab import hosts


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["agent-host", "check", *argv])
    return code, capsys.readouterr().out


def test_hgx_host_json_lists_the_gpus_and_every_refused_device(tmp_path, capsys):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "hgx.xml"))
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", hosts.lab_bridge(), "--json")
    r = json.loads(out)
    assert code == 0 and r["ok"] is True and r["problems"] == []
    assert [g["address"] for g in r["gpus"]] == [hosts.gpu_address(i) for i in range(8)]
    assert r["gpus"][0] == {"address": "0000:18:00.0", "functions": ["0000:18:00.0"],
                            "numa_node": 0, "iommu_group": 40, "driver": "vfio-pci",
                            "host_bridges": []}
    assert r["host_gpus"] == [g["address"] for g in r["gpus"]]
    assert {x["address"] for x in r["refused"]} == {hosts.BMC_VGA, *hosts.NVSWITCHES}
    assert r["plan"]["mmio64_mib"] == 512 * 1024 and r["plan"]["firmware"] == "uefi"
    assert r["pool"]["exists"] is False
    # read-only: no pool, no domain appeared
    conn = libvirt.open(uri)
    assert conn.listAllStoragePools() == [] and conn.listAllDomains() == []
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", hosts.lab_bridge(),
                    "--gpus-per-vm", "2", "--json")
    assert code == 1 and any("Fabric Manager" in p for p in json.loads(out)["problems"])


def test_pcie_host_text_report_and_exit_status(tmp_path, capsys):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "pcie.xml", kind="pcie"))
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", hosts.lab_bridge("pcie"),
                    "--gpus-per-vm", "2")
    assert code == 0, out
    assert "0000:17:00.0  IOMMU group 40  NUMA node 0" in out and "with 0000:17:00.1" in out
    # The lab host is as the VM-host user data leaves it: GPU and audio function on vfio-pci
    # (libvirt_split reads <driver> from the host file: the test driver drops it).
    assert "NUMA node 0  driver vfio-pci  with 0000:17:00.1" in out
    assert "OK: a lend would succeed" in out
    unbound = hosts.test_uri(hosts.write_host_xml(tmp_path / "unbound.xml", kind="pcie",
                                                  gpu_driver=None))
    code, out = run(capsys, "--libvirt-uri", unbound, "--bridge", hosts.lab_bridge("pcie"))
    assert code == 0 and "driver not reported by libvirt's test driver" in out, out
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", "virbr0")
    assert code == 1 and "belongs to libvirt network default (forward mode nat)" in out


def test_unready_host_fails_naming_each_problem(tmp_path):
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "raw.xml", iommu=False, ovmf=False,
                                              bridge=None))
    proc = subprocess.run([sys.executable, "-m", "testflinger_magic.cli", "agent-host", "check",
                           "--libvirt-uri", uri, "--bridge", hosts.lab_bridge(), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    problems = json.loads(proc.stdout)["problems"]
    for start in ("IOMMU off", "no GPU to lend", "VFIO passthrough unavailable",
                  "no UEFI firmware", f"bridge {hosts.lab_bridge()} not found"):
        assert any(p.startswith(start) for p in problems), (start, problems)


def test_with_config_it_checks_maas_and_the_device(lab, capsys):
    config = lab.write_config()
    uri = f"test://{lab.tmp}/hosts/gpu-host-01.xml"
    sid = lab.system_ids["gpu-host-01"]
    # Not deployed: MAAS has made no bridge yet, and the config names none.
    code, out = run(capsys, "--config", str(config), "--device", "gpu-host-01",
                    "--libvirt-uri", uri, "--json")
    r = json.loads(out)
    assert code == 1 and any(p.startswith("device gpu-host-01: its MAAS machine is Ready, not "
                                          "Deployed") for p in r["problems"]), r["problems"]
    # Deployed as a lend deploys it (bridge_all): the check takes the bridge MAAS rendered.
    maas = LibMaasDriver(lab.config().maas.url, lab.config().maas.api_key.get_secret_value())
    maas.deploy(sid, "jammy", bridge_all=True)
    maas.wait_for(sid, {"Deployed"}, set(), 20, 0.05)
    maas.close()
    code, out = run(capsys, "--config", str(config), "--device", "gpu-host-01",
                    "--libvirt-uri", uri, "--json")
    r = json.loads(out)
    assert code == 0 and r["ok"], r["problems"]
    assert r["maas"]["user"] and r["maas"]["devices"] == [{
        "device": "gpu-host-01", "system_id": sid, "status": "Deployed",
        "hostname": "gpu-host-01", "bridges": [hosts.lab_bridge()]}]
    assert r["plan"]["bridge"] == hosts.lab_bridge()
    # TRIAL4 finding 12: the planned VMs carry the names a lend gives them (leases.claim).
    assert r["pinning"] and [p["vm"] for p in r["pinning"]] == [
        f"gpu-host-01-vm{i + 1}" for i in range(r["plan"]["vms"])]
    bad = lab.write_config(maas={"url": "http://127.0.0.1:9/MAAS/", "api_key": "a:b:c"})
    code, out = run(capsys, "--config", str(bad))
    r = json.loads(out) if out.startswith("{") else None
    assert code == 1 and "MAAS at http://127.0.0.1:9/MAAS/" in out, out
    assert r is None  # text report without --json
    assert cli.main(["agent-host", "check", "--config", str(config), "--device", "nope"]) == 2


def test_text_report_names_the_driver_or_why_there_is_none():
    """On a real host (the node device driver) a GPU with no <driver> has none bound; a driver
    it reports is shown as is."""
    from testflinger_magic.agent_host import check

    gpu = {"address": "0000:18:00.0", "functions": ["0000:18:00.0"], "numa_node": 0,
           "iommu_group": 40}
    report = {"gpus": [dict(gpu, driver=None), dict(gpu, address="0000:2a:00.0",
                                                    functions=["0000:2a:00.0"],
                                                    driver="vfio-pci")],
              "refused": [], "problems": []}
    text = check.render(report, "qemu+ssh://ubuntu@host/system")
    assert "0000:18:00.0  IOMMU group 40  NUMA node 0  driver none bound" in text
    assert "0000:2a:00.0  IOMMU group 40  NUMA node 0  driver vfio-pci" in text


def test_with_config_it_checks_the_server_answers_and_takes_the_client(lab, capsys):
    """Second trial finding 7: ``check --config`` said nothing of a server_url nobody answers
    (only "no --libvirt-uri"). Real HTTP to the lab's server: a token for the configured client;
    a closed port is unreachable; a wrong secret is refused naming the client id."""
    good = lab.write_config()
    code, out = run(capsys, "--config", str(good), "--json")
    r = json.loads(out)
    assert r["server"] == {"url": lab.server.url, "client_id": "host", "token": True}
    assert not [p for p in r["problems"] if p.startswith(("server_url", "client_id"))], r
    code, out = run(capsys, "--config", str(good))
    assert f"server {lab.server.url}: token granted to client host" in out, out
    # The daemon instance id a daemon of this config would send (agent_host/instance.py).
    from testflinger_magic.agent_host.daemon import Daemon
    from testflinger_magic.agent_host.instance import instance_id

    assert r["instance"] == instance_id(lab.config().state_dir) == Daemon(lab.config()).instance
    assert r["instance"].endswith(f":{(lab.tmp / 'state').resolve()}"), r["instance"]
    assert out.startswith(f"daemon instance {r['instance']} (one daemon per agent host"), out

    unreachable = lab.write_config(server_url="http://127.0.0.1:1")
    code, out = run(capsys, "--config", str(unreachable), "--json")
    r = json.loads(out)
    assert code == 1 and r["server"]["token"] is False
    assert any(p.startswith("server_url: http://127.0.0.1:1 unreachable (is the Testflinger "
                            "server up") for p in r["problems"]), r["problems"]
    code, out = run(capsys, "--config", str(unreachable))
    assert "server http://127.0.0.1:1: NOT reachable or refused" in out, out

    refused = lab.write_config(secret_key="not-the-secret")
    code, out = run(capsys, "--config", str(refused), "--json")
    r = json.loads(out)
    assert code == 1 and r["server"]["token"] is False
    assert any(p.startswith(f"client_id: the server at {lab.server.url} refused client id "
                            "'host'") for p in r["problems"]), r["problems"]

    not_testflinger = lab.write_config(server_url=lab.config().maas.url.rstrip("/"))
    code, out = run(capsys, "--config", str(not_testflinger), "--json")
    assert any(p.startswith("server_url: ") and "answered the token request" in p
               for p in json.loads(out)["problems"]), out


def test_trial_pcie_host_prints_each_vms_pinning_and_warns_when_not_local(tmp_path, capsys):
    """Third trial finding 3: on a PCIe server with all 4 GPUs on node 0, check showed no
    pinning. Now each planned VM's cell, memory mode and cpuset, and a warning (not a
    problem) for each VM whose memory cannot be on its GPU's cell."""
    path = tmp_path / "pcie.xml"
    shutil.copy(Path(__file__).parent / "data" / "trial3-pcie-host.xml", path)
    uri = hosts.test_uri(path)
    args = ("--libvirt-uri", uri, "--bridge", "br-enp193s0f0", "--vcpus", "48",
            "--memory-mib", "98304")
    code, out = run(capsys, *args, "--json")
    r = json.loads(out)
    assert code == 0 and r["ok"], r["problems"]
    assert [(p["vm"], p["mode"], p["nodeset"], p["cpuset"], p["local"]) for p in r["pinning"]] \
        == [("vm1", "strict", "0", "0-63", True), ("vm2", "strict", "0", "0-63", True),
            ("vm3", "strict", "1", "64-127", False), ("vm4", "strict", "1", "64-127", False)]
    assert [w.split(":")[0] for w in r["warnings"]] == [
        "VM vm3 (48 vCPU, 98304 MiB) is not local to its GPU's NUMA cell",
        "VM vm4 (48 vCPU, 98304 MiB) is not local to its GPU's NUMA cell",
        # 2 x 48 vCPUs on each 64-CPU cell (TRIAL13 F12)
        "NUMA cell 0's 64 CPUs (0-63) carry 96 vCPUs of VM(s) vm1, vm2",
        "NUMA cell 1's 64 CPUs (64-127) carry 96 vCPUs of VM(s) vm3, vm4"]
    code, out = run(capsys, *args)
    assert "vm1: GPU 0000:17:00.0 (cell 0): memory strict on cell 0, vCPUs on CPUs 0-63\n" in out
    assert "vm3: GPU 0000:4b:00.0 (cell 0): memory strict on cell 1, vCPUs on CPUs 64-127  " \
        "NOT LOCAL" in out and "WARNINGS" in out and "OK: a lend would succeed" in out
    # small VMs fit node 0: all local, no warning
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", "br-enp193s0f0", "--json")
    r = json.loads(out)
    assert all(p["local"] and p["nodeset"] == "0" for p in r["pinning"]) and not r["warnings"]


def test_vcpus_overcommitting_a_numa_cell_are_warned_about(tmp_path, capsys):
    """TRIAL13 F12: on the lab's HGX host (16 CPUs per cell) 4 VMs x 8 vCPUs were pinned to
    each cell's 16 CPUs (64 vCPUs on 32 CPUs) without a word. Now a warning per cell names
    the cell, its CPUs, the VMs and the counts; VMs that fit their cell get none."""
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "hgx.xml"))
    args = ("--libvirt-uri", uri, "--bridge", "br-x", "--json")
    code, out = run(capsys, *args, "--vcpus", "8")
    r = json.loads(out)
    over = [w for w in r["warnings"] if w.startswith("NUMA cell")]
    assert over == [
        "NUMA cell 0's 16 CPUs (0-15) carry 32 vCPUs of VM(s) vm1, vm2, vm3, vm4: "
        "overcommitted 2.0x (their vCPU threads share CPUs); at most 4 vCPUs per VM would "
        "fit it (planned with --vcpus 8; a lend uses the queue's vm.vcpus)",
        "NUMA cell 1's 16 CPUs (16-31) carry 32 vCPUs of VM(s) vm5, vm6, vm7, vm8: "
        "overcommitted 2.0x (their vCPU threads share CPUs); at most 4 vCPUs per VM would "
        "fit it (planned with --vcpus 8; a lend uses the queue's vm.vcpus)"], r["warnings"]
    assert not any("NUMA cell" in p for p in r["problems"])  # a warning, not a problem
    code, out = run(capsys, *args, "--vcpus", "4")
    assert not [w for w in json.loads(out)["warnings"] if w.startswith("NUMA cell")]


def test_nvswitch_multi_gpu_is_warned_about(tmp_path):
    """Third trial finding 4: the opt-in lets 2-GPU VMs through on NVSwitch hosts, but
    nothing activates a Fabric Manager partition: check says so whenever it is set."""
    from testflinger_magic.agent_host import check
    from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter

    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "hgx.xml"))
    for flag in (False, True):
        splitter = LibvirtSplitter(bridge=hosts.lab_bridge(), nvswitch_multi_gpu=flag)
        report, problems = check.check_host(uri, bridge=hosts.lab_bridge(), gpus_per_vm=2,
                                            splitter=splitter)
        assert bool(problems) is not flag  # refused without the opt-in
        assert (check.NVSWITCH_WARNING in report["warnings"]) is flag
        assert [len(p["gpus"]) for p in report["pinning"]] == [2] * 4
    assert "neither activates nor deactivates a Fabric Manager partition" in \
        check.NVSWITCH_WARNING


def test_one_gpu_vms_on_an_nvswitch_host_are_warned_about(tmp_path):
    """TRIAL13 F1: one GPU per VM on an HGX host is unverified here and reported to need the
    guest driver's NVLinks disabled: check says so on NVSwitch hosts, only for 1-GPU VMs."""
    from testflinger_magic.agent_host import check
    from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter

    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "hgx.xml"))
    splitter = LibvirtSplitter(bridge=hosts.lab_bridge(), nvswitch_multi_gpu=True)
    report, problems = check.check_host(uri, bridge=hosts.lab_bridge(), gpus_per_vm=1,
                                        splitter=splitter)
    assert report["nvswitches"] and not problems
    assert check.ONE_GPU_NVSWITCH_WARNING in report["warnings"]
    assert "NVreg_NvLinkDisable=1" in check.ONE_GPU_NVSWITCH_WARNING
    report, _ = check.check_host(uri, bridge=hosts.lab_bridge(), gpus_per_vm=2,
                                 splitter=splitter)
    assert check.ONE_GPU_NVSWITCH_WARNING not in report["warnings"]


# --- the trial's HGX host: a GPU behind a bridge, one sharing its group with a NIC (TRIAL3) ------

TRIAL_HGX = Path(__file__).parent / "data" / "trial3-hgx.xml"


def test_gpu_behind_a_bridge_is_lent_and_a_config_counting_the_refused_gpu_fails(lab, capsys,
                                                                               tmp_path):
    """Findings 1 and 2 of the third trial, on the tester's own host file: 7 of 8 GPUs can be
    lent (the one grouped with its switch port is; the one grouped with a ConnectX-7 is not,
    with the ACS advice), so ``gpus: 8`` fails the check naming the refused GPU and saying to
    set ``gpus: 7``; with ``gpus: 7`` the check passes."""
    # A copy: the test driver session locks (and may write back) the host file beside it.
    uri = hosts.test_uri(shutil.copy(TRIAL_HGX, tmp_path / TRIAL_HGX.name))
    argv = ["--device", "gpu-host-01", "--libvirt-uri", uri, "--bridge", "br-enp12s0f0np0"]
    device = lab.config_dict()["devices"][0]
    config = lab.write_config(devices=[{**device, "gpus": 8}])
    code, out = run(capsys, "--config", str(config), *argv, "--json")
    r = json.loads(out)
    assert code == 1, r["problems"]
    lent = {g["address"]: g for g in r["gpus"]}
    assert len(lent) == 7 and "0000:ab:00.0" not in lent and len(r["host_gpus"]) == 8
    assert lent["0000:3a:00.0"]["functions"] == ["0000:3a:00.0"]
    assert lent["0000:3a:00.0"]["host_bridges"] == ["0000:39:00.0"]
    refused = {x["address"]: x["reason"] for x in r["refused"]}
    assert "0000:3a:00.0" not in refused and "0000:39:00.0" not in refused
    assert refused["0000:ab:00.0"].startswith(
        "IOMMU group 123 also holds 0000:ac:00.0 (15b3:1021 MT2910 [ConnectX-7], class "
        "0x020700)")
    assert "enable ACS (Access Control Services) on the PCIe switch" in refused["0000:ab:00.0"]
    [problem] = [p for p in r["problems"] if p.startswith("device gpu-host-01: gpus: 8")]
    for part in ("but 7 of the host's 8 GPU(s) can be lent", "every lend would fail at split",
                 "refused: 0000:ab:00.0: IOMMU group 123",
                 "set gpus: 7 for device gpu-host-01 in the agent-host config"):
        assert part in problem, problem
    code, out = run(capsys, "--config", str(config), *argv)
    assert code == 1 and "GPUs to lend (7 of the 8 on the bus):" in out, out
    assert ("0000:3a:00.0  IOMMU group 111  NUMA node 0  driver vfio-pci  (bridge 0000:39:00.0 "
            "of its IOMMU group stays on the host)") in out
    assert "  - device gpu-host-01: gpus: 8 in the agent-host config" in out

    config = lab.write_config(devices=[{**device, "gpus": 7}])
    code, out = run(capsys, "--config", str(config), *argv, "--json")
    r = json.loads(out)
    assert code == 0 and r["ok"], r["problems"]
    assert r["plan"]["vms"] == 7
    # fewer than can be lent: GPUs left idle, also a finding
    config = lab.write_config(devices=[{**device, "gpus": 4}])
    code, out = run(capsys, "--config", str(config), *argv, "--json")
    assert code == 1 and any("leaving 3 idle" in p and "set gpus: 7" in p
                             for p in json.loads(out)["problems"]), out


@pytest.mark.parametrize("driver", ["nvidia", "nouveau"])
def test_a_gpu_still_on_a_host_driver_fails_the_check(tmp_path, capsys, driver):
    """TRIAL3 finding 8: a lendable GPU bound to nvidia (or nouveau) when the daemon would lend
    it: libvirt's managed hostdev cannot take it from nvidia while nvidia-persistenced holds it
    open, so check fails naming the GPUs and the fix, as the daemon's readiness wait does."""
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "h.xml", kind="pcie", gpus=2,
                                              gpu_driver=driver))
    code, out = run(capsys, "--libvirt-uri", uri, "--bridge", hosts.lab_bridge("pcie"), "--json")
    r = json.loads(out)
    assert code == 1 and r["gpus"][0]["driver"] == driver
    [problem] = [p for p in r["problems"] if "host GPU driver" in p]
    assert problem.startswith(f"GPU(s) still bound to a host GPU driver: 0000:17:00.0 ({driver}),")
    # the audio function stays on snd_hda_intel, which libvirt unbinds without trouble
    assert "0000:17:00.1" not in problem and "vfio-pci.ids=" in problem
    # TRIAL4 finding 12: expected on a host not deployed with the VM-host user data, and the
    # command printing that user data is named
    assert "Expected on a host not deployed with that user data" in problem
    assert "'testflinger-magic agent-host user-data --config FILE'" in problem


def test_check_applies_the_splitters_aperture_bounds_and_validates_warnings(tmp_path, capsys):
    """TRIAL3 finding 11: --mmio64-mib below OVMF's 1024 MiB floor is a problem, as the
    splitter (validate_plan) refuses it; an aperture too small for the GPUs, bios firmware and
    more than 8 GPUs per VM are the warnings validate gives (vm_rules, one rule)."""
    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "h.xml", kind="pcie"))
    base = ("--libvirt-uri", uri, "--bridge", hosts.lab_bridge("pcie"), "--json")
    code, out = run(capsys, *base, "--gpus-per-vm", "2", "--mmio64-mib", "100")
    r = json.loads(out)
    assert code == 1 and ("--mmio64-mib: 100 is not a size in MiB from 1024 to 16777216 "
                          "(OVMF's limit); the splitter refuses such a VM") in r["problems"]
    assert not any("mmio64" in w for w in r["warnings"])  # the problem says it once
    code, out = run(capsys, *base, "--gpus-per-vm", "2", "--mmio64-mib", "2048")
    r = json.loads(out)
    assert code == 0 and r["warnings"][0].startswith(
        "--mmio64-mib: 2048 MiB for 2 GPU(s) is below 131072 MiB per GPU (262144 MiB)")
    code, out = run(capsys, *base, "--firmware", "bios")
    r = json.loads(out)
    assert code == 0 and r["warnings"][0].startswith("--firmware: bios (SeaBIOS) for a VM")
    code, out = run(capsys, *base, "--gpus-per-vm", "9")
    assert any(w.startswith("--gpus-per-vm: 9 GPUs per VM") for w in json.loads(out)["warnings"])
    code, out = run(capsys, *base, "--gpus-per-vm", "2", "--mmio64-mib", str(2 * 256 * 1024))
    assert code == 0 and json.loads(out)["warnings"] == []


def test_vms_whose_pinned_memory_exceeds_the_host_fail_the_check_as_a_split_would(tmp_path,
                                                                                 capsys):
    """TRIAL4 finding 8: check said "OK" when the planned VMs' memory (all pinned by VFIO)
    exceeded the host's, even for one VM larger than the host; the splitter refuses that
    lease (splitplan.check_fit). Now check runs the splitter's own fit rule
    (LibvirtSplitter.fit) and reports its message as a problem."""
    path = tmp_path / "pcie.xml"  # 512 GiB (524288 MiB) in 2 cells, 4 lendable GPUs
    shutil.copy(Path(__file__).parent / "data" / "trial3-pcie-host.xml", path)
    base = ("--libvirt-uri", hosts.test_uri(path), "--bridge", "br-enp193s0f0", "--json")
    code, out = run(capsys, *base, "--memory-mib", str(524288 // 4))  # exactly the host's
    assert code == 0 and json.loads(out)["ok"], out
    for memory in (524288 // 4 + 1, 600000):  # the sum above the host; one VM above it
        code, out = run(capsys, *base, "--memory-mib", str(memory))
        r = json.loads(out)
        [problem] = [p for p in r["problems"] if "does not fit" in p]
        assert code == 1 and problem.startswith(
            f"the queue's VM spec does not fit {hosts.test_uri(path)}; fix the queue "
            f"definition and apply it again:\n4 VM(s) x memory_mib need {4 * memory} MiB > "
            "the host's 524288 MiB (passthrough VMs pin all their memory)"), problem
    # the text report says it under PROBLEMS, not OK
    code, out = run(capsys, *base[:-1], "--memory-mib", "600000")
    assert code == 1 and "OK: a lend would succeed" not in out
    assert "PROBLEMS" in out and "need 2400000 MiB > the host's 524288 MiB" in out
    # more vCPUs than the host's CPUs: the same rule, the same refusal
    code, out = run(capsys, *base, "--vcpus", "129")
    assert code == 1 and any("vcpus 129 > the host's 128 CPUs" in p
                             for p in json.loads(out)["problems"]), out


def test_user_data_prints_what_the_deploy_step_deploys_a_lent_device_with(tmp_path, capsys):
    """TRIAL4 finding 12: an operator deploying a host by hand to run check against it can
    print the VM-host user data a lend deploys it with: the config's daemon key, rack keys
    and GPU vendors, through the deploy step's own call (vmhost_userdata.user_data_for)."""
    import yaml

    from testflinger_magic.agent_host.config import load_file
    from testflinger_magic.agent_host.vmhost_userdata import user_data_for, vfio_script

    config = tmp_path / "agent-host.yaml"
    config.write_text(yaml.safe_dump({
        "agent_host": "host-a", "server_url": "http://127.0.0.1:9", "client_id": "c",
        "agent_configs_dir": str(tmp_path / "agents"), "state_dir": str(tmp_path / "state"),
        "secret_key": "s", "ssh_public_key": "ssh-ed25519 DAEMON d",
        "maas": {"url": "http://127.0.0.1:9/MAAS/", "api_key": "a:b:c",
                 "rack_public_keys": ["ssh-rsa RACK r"]},
        "splitter": {"gpu_vendors": ["0x10de", "0x1002"]},
        "devices": [{"agent_name": "gpu-1", "maas_system_id": "abc123", "gpus": 2,
                     "supervisor_program": "agent-gpu-1"}]}))
    config.chmod(0o600)
    assert cli.main(["agent-host", "user-data", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out == user_data_for(load_file(str(config)))
    data = yaml.safe_load(out)
    assert out.startswith("#cloud-config\n")
    assert data["ssh_authorized_keys"] == ["ssh-ed25519 DAEMON d", "ssh-rsa RACK r"]
    assert vfio_script(("0x10de", "0x1002")) in out.replace("\n      ", "\n")
    # a bad config: its error, exit 2, nothing on stdout
    (tmp_path / "bad.yaml").write_text("agent_host: [\n")
    assert cli.main(["agent-host", "user-data", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert capsys.readouterr().out == ""


def test_a_host_whose_gpus_domains_hold_now_fails_the_check_naming_the_lease(tmp_path):
    """TRIAL16 F7: on a device lent right now, check said "OK: a lend would succeed" while
    its placement warning said 0 of 8 GPUs were free. The GPUs held by defined domains are a
    problem naming the lease whose domains hold them."""
    from testflinger_magic.agent_host.check import check_host, plan_vms
    from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter

    uri = hosts.test_uri(hosts.write_host_xml(tmp_path / "hgx.xml"))
    splitter = LibvirtSplitter(bridge=hosts.lab_bridge(), test_pool_gib=4096)
    report, problems = check_host(uri, bridge=hosts.lab_bridge(), splitter=splitter)
    assert problems == [], problems
    splitter.split(uri, "lease-0123456789ab",
                   plan_vms(8, 1, 2, 4096, "uefi", "gpu-host-01", splitter.pool_path))
    report, problems = check_host(uri, bridge=hosts.lab_bridge(), splitter=splitter)
    [held] = [p for p in problems if "held by" in p]
    assert held.startswith("8 of the 8 GPUs to lend are held by domains defined on "
                           f"{uri} now: 8 of lease lease-0123456789ab"), held
    splitter.restore(uri, "lease-0123456789ab")
    assert check_host(uri, bridge=hosts.lab_bridge(), splitter=splitter)[1] == []
