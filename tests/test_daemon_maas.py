"""The daemon against MAAS as MAAS behaves (issue 7 items 1, 2, 3, 7), through the real code
path: python-libmaas against the simulator, whose virsh power driver powers the libvirt
test-driver domains the splitter defined (lab/virsh_power.py)."""

from __future__ import annotations

import re

import os

import pytest
import yaml

from daemon_lab import NOTHING, RACK_KEY, DaemonLab, lab  # noqa: F401 (lab is a fixture)
from test_daemon_e2e import drive
from testflinger_magic.agent_host.config import ConfigError, load_text
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.steps import bridge_of, vm_host_user_data
from testflinger_magic.agent_host.maas import MachineInfo
from testflinger_magic.lab.hosts import lab_bridge


def actions(lease: dict) -> list[tuple[str, str, str]]:
    return [(i["action"], i["phase"], i["target"]) for i in lease["intent"]]


def test_vms_are_powered_by_maas_through_a_plain_address_with_the_rack_key(lab):
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    lease = drive(daemon, lab, lease_id, {"active", "restoring", "failed"})
    assert lease["state"] == "active", lease.get("error")
    dev = lab.maas.machine(lab.system_ids["gpu-host-01"])
    ip = dev["ip_addresses"][0]
    for vm in lease["vms"]:
        power = lab.maas.power_parameters(vm["maas_system_id"])
        assert power == {"power_address": f"qemu+ssh://ubuntu@{ip}/system",
                         "power_id": vm["domain"]}
    user_data = yaml.safe_load(lab.maas.user_data(lab.system_ids["gpu-host-01"]))
    assert RACK_KEY in user_data["ssh_authorized_keys"]
    assert "netplan" not in yaml.safe_dump(user_data)
    # Deployed with bridge_all: MAAS' bridge on the boot interface carries the address, and
    # the daemon keeps its name for the split.
    bridge = next(i for i in dev["interface_set"] if i["type"] == "bridge")
    assert bridge["name"] == lab_bridge() and bridge["links"][0]["ip_address"] == ip
    assert Journal(lab.config().state_dir, lease_id).fact("bridge") == lab_bridge()


def test_enrolment_fails_at_once_with_maas_power_error_when_maas_cannot_log_in(lab):
    cfg = lab.config_dict()
    cfg["maas"] = {k: v for k, v in cfg["maas"].items() if k != "rack_public_keys"}
    daemon = Daemon(lab.config(**cfg))
    daemon.register()
    lease_id = lab.lend()
    errored = drive(daemon, lab, lease_id, {"restoring", "active", "returned", "failed"})
    assert errored["state"] == "restoring"
    err = errored["error"]
    # The MAAS error, not a wait that ran out of time.
    assert "put it back in New" in err and "Failed to login to virsh console." in err, err
    assert "Aborting COMMISSIONING and reverting to NEW" in err and "still 'New'" not in err
    assert "rack_public_keys" in err
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans() == NOTHING


def _active_lease(lab) -> tuple[Daemon, str]:
    """A daemon and a lease of gpu-host-01 it brought up to active."""
    daemon = Daemon(lab.config())
    daemon.register()
    lease_id = lab.lend()
    assert drive(daemon, lab, lease_id, {"active", "restoring"})["state"] == "active"
    return daemon, lease_id


def test_a_failed_release_is_recovered_as_maas2_does(lab):
    daemon, lease_id = _active_lease(lab)
    sid = lab.system_ids["gpu-host-01"]
    lab.maas.fail_next(sid, "release", times=2)  # the release and its retry end "Releasing failed"
    lab.drain(lease_id)
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    done = [(a, t) for a, p, t in actions(final) if p == "done"]
    releases = [d for d in done if d == ("maas.release", sid)]
    assert len(releases) == 2
    assert done.index(("maas.mark_broken", sid)) < done.index(("maas.mark_fixed", sid))
    assert lab.maas.machine(sid)["status_name"] == "Ready"
    assert lab.orphans() == NOTHING
    # TRIAL13 F9: the report (the lease.returned event) said only "<sid> released".
    reason = final["history"][-1]["reason"]
    assert f"{sid} release failed (Releasing failed" in reason, reason
    assert ("recovered by mark-broken/mark-fixed: MAAS made it Ready without a release, so it "
            "did not erase the disk") in reason, reason
    assert f"{sid} released" not in reason, reason


def test_a_release_that_succeeds_on_its_second_try_says_so(lab):
    daemon, lease_id = _active_lease(lab)
    sid = lab.system_ids["gpu-host-01"]
    lab.maas.fail_next(sid, "release", times=1)
    lab.drain(lease_id)
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    reason = final["history"][-1]["reason"]
    assert "release failed (Releasing failed" in reason and "released on a second try" in reason
    assert "mark-broken" not in reason, reason


def test_a_maas_409_on_release_is_retried_with_a_back_off_not_failed_at_once(lab):
    """TRIAL13 F14: a 409 on release ("locked") failed the lease after RESTORE_ATTEMPTS tries in
    0.3 s. Now the restore backs off (maas_poll doubling) and a conflict that ends in time
    gives the device back."""
    import time

    from testflinger_magic.agent_host.daemon import RESTORE_ATTEMPTS

    daemon, lease_id = _active_lease(lab)
    lab.maas.inject("POST", r"op=release", 409, "Cannot release node because it is locked.",
                    times=RESTORE_ATTEMPTS + 2)
    lab.drain(lease_id)
    notes = []
    for _ in range(600):
        daemon.run_once(wait=0, block=True)
        lease = lab.lease(lease_id)
        note = (lease.get("progress_note") or {}).get("message", "")
        if note and note not in notes:
            notes.append(note)
        if lease["state"] in ("returned", "failed"):
            break
        time.sleep(0.02)
    assert lease["state"] == "returned", lease.get("error")
    conflicts = [n for n in notes if n.startswith("MAAS refused the restore (HTTP 409)")]
    assert conflicts and "retrying in" in conflicts[0], notes
    assert "Cannot release node because it is locked." in conflicts[0], conflicts[0]
    # More tries than RESTORE_ATTEMPTS, each after a pause that doubles (maas_poll up).
    pauses = [float(re.search(r"retrying in ([0-9.]+)s", n).group(1)) for n in conflicts]
    assert len(pauses) > RESTORE_ATTEMPTS and pauses == sorted(pauses) and \
        pauses[-1] > pauses[0], notes
    assert lab.maas.machine(lab.system_ids["gpu-host-01"])["status_name"] == "Ready"
    assert lab.orphans() == NOTHING


def test_restore_destroys_the_domains_before_deleting_their_maas_machines(lab):
    daemon, lease_id = _active_lease(lab)
    lab.drain(lease_id)
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    seq = actions(final)
    destroyed = seq.index(("libvirt.restore", "done", lease_id))
    deletes = [i for i, (a, p, _) in enumerate(seq) if a == "maas.delete"]
    assert deletes and min(deletes) > destroyed
    assert lab.orphans() == NOTHING


def test_restore_when_the_host_is_no_longer_deployed_still_deletes_the_machines(lab):
    daemon, lease_id = _active_lease(lab)
    sid = lab.system_ids["gpu-host-01"]
    daemon.drivers.maas.release(sid)  # someone released the host under the lease
    daemon.drivers.maas.wait_for(sid, {"Ready"}, set(), 20, 0.05)
    lab.drain(lease_id)
    final = drive(daemon, lab, lease_id, {"returned", "failed"})
    assert final["state"] == "returned", final.get("error")
    assert lab.orphans()["maas_machines"] == 0


# -- configuration and pure helpers -----------------------------------------------------------

BASE = """
server_url: http://s
client_id: c
secret_key: k
agent_host: h
agent_configs_dir: /tmp/a
state_dir: /tmp/s
maas:
  url: http://m/MAAS/
  api_key: a:b:c
"""


def test_power_address_template_refuses_a_query_string():
    with pytest.raises(ConfigError, match=r"f:\d+: maas.power_address_template: .*query string"):
        load_text(BASE + "  power_address_template: qemu+ssh://ubuntu@{ip}/system?keyfile=/k\n",
                  "f")
    cfg = load_text(BASE, "f")
    assert cfg.maas.power_address_template == "qemu+ssh://ubuntu@{ip}/system"


def test_power_pass_file_must_be_private(tmp_path):
    secret = tmp_path / "power-pass"
    secret.write_text("s3cret\n")
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError) as exc:
        load_text(BASE + f"  power_pass_file: {secret}\n", "f")
    assert str(secret) in str(exc.value) and "0644" in str(exc.value)
    os.chmod(secret, 0o600)
    cfg = load_text(BASE + f"  power_pass_file: {secret}\n", "f")
    assert cfg.maas.power_pass.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cfg)
    with pytest.raises(ConfigError, match="power_pass_file"):
        load_text(BASE + "  power_pass: nope\n", "f")


def test_rack_public_keys_from_list_and_file(tmp_path):
    keys = tmp_path / "rack.pub"
    keys.write_text("# racks\nssh-rsa AAAA1 rack1\n\nssh-rsa AAAA2 rack2\n")
    cfg = load_text(BASE + f"  rack_public_keys: [ssh-ed25519 AAAA0 r0]\n"
                           f"  rack_public_keys_file: {keys}\n", "f")
    assert cfg.maas.rack_public_keys == ["ssh-ed25519 AAAA0 r0", "ssh-rsa AAAA1 rack1",
                                         "ssh-rsa AAAA2 rack2"]
    data = yaml.safe_load(vm_host_user_data("ssh-ed25519 DAEMON d", cfg.maas.rack_public_keys))
    assert data["ssh_authorized_keys"] == ["ssh-ed25519 DAEMON d", *cfg.maas.rack_public_keys]
    assert not any("netplan" in str(c) for c in data["runcmd"])
    assert data["power_state"]["mode"] == "reboot" and "ovmf" in data["packages"]


def test_bridge_of_prefers_the_configured_bridge_then_maas_boot_bridge():
    info = MachineInfo.from_json({
        "system_id": "x", "status_name": "Deployed", "boot_interface": {"name": "eth0"},
        "interface_set": [
            {"name": "eth1", "type": "physical", "mac_address": "52:54:00:00:00:02"},
            {"name": "br-eth1", "type": "bridge", "parents": ["eth1"],
             "mac_address": "52:54:00:00:00:02"},
            {"name": "eth0", "type": "physical", "mac_address": "52:54:00:00:00:01"},
            {"name": "br-eth0", "type": "bridge", "parents": ["eth0"],
             "mac_address": "52:54:00:00:00:01"}]})
    assert info.bridges == ("br-eth0", "br-eth1")
    assert info.macs == ("52:54:00:00:00:02", "52:54:00:00:00:01")
    assert bridge_of(info, None) == "br-eth0" and bridge_of(info, "br9") == "br9"
    assert bridge_of(MachineInfo("x", "h", "Deployed", (), "ipmi"), None) is None
