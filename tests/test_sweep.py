"""The global orphan sweep (issue 12 item 5): what carries our marks but no open lease owns is
removed after the grace, nothing of an open lease and nothing not ours ever is; --dry-run
changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import libvirt
import pytest

from daemon_lab import DaemonLab
from test_daemon_e2e import drive
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.marks import maas_mark
from testflinger_magic.agent_host.sweep import Item, decide


# -- the decision (pure) -----------------------------------------------------------------------
def _item(kind="maas", name="d1-vm1", device="d1", lease=None, created=None, ours=True):
    return Item(kind, name, device, f"ref-{kind}-{name}", lease, created, ours)


def test_decide_keeps_what_an_open_lease_owns_and_what_is_not_ours():
    leases = [{"_id": "L1", "device": "d1"}]
    items = [_item(lease="L1"), _item("program", created=0.0), _item(lease="L0"),
             _item("folder", "d2-vm1", "d2", created=0.0), _item(ours=False, name="d2-vm3")]
    verdicts, seen = decide(items, leases, now=1000.0, grace=100.0, first_seen={})
    got = [(v.item.kind, v.item.name, v.action) for v in verdicts]
    assert got == [("maas", "d1-vm1", "keep"), ("program", "d1-vm1", "keep"),
                   ("maas", "d1-vm1", "wait"), ("folder", "d2-vm1", "remove"),
                   ("maas", "d2-vm3", "keep")]
    assert verdicts[0].reason == "lease L1 is open"
    assert verdicts[1].reason == "device d1 has open lease(s) L1"
    assert verdicts[2].reason.startswith("its lease L0 is not open; first seen orphaned 0s ago")
    assert verdicts[4].reason.startswith("not ours")
    # Only the orphan without a creation time is remembered, from now.
    assert seen == {items[2].key: 1000.0}


def test_decide_removes_an_orphan_without_creation_time_after_two_sweeps_a_grace_apart():
    item = _item(lease="L0")
    first, seen = decide([item], [], now=1000.0, grace=100.0, first_seen={})
    assert first[0].action == "wait"
    early, seen2 = decide([item], [], now=1099.0, grace=100.0, first_seen=seen)
    assert early[0].action == "wait" and seen2 == {item.key: 1000.0}
    late, _ = decide([item], [], now=1100.0, grace=100.0, first_seen=seen2)
    assert late[0].action == "remove"
    assert late[0].reason == "its lease L0 is not open (first seen orphaned 100s ago)"
    # A file younger than the grace waits; old enough goes at the first sweep.
    young, _ = decide([_item("folder", created=950.0)], [], 1000.0, 100.0, {})
    old, _ = decide([_item("folder", created=900.0)], [], 1000.0, 100.0, {})
    assert (young[0].action, old[0].action) == ("wait", "remove")


# -- against the daemon lab --------------------------------------------------------------------
@pytest.fixture
def lab2(tmp_path):
    parts = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"))
    yield parts
    parts.stop()


def _domains(lab, device):
    conn = libvirt.open(f"test://{lab.tmp}/hosts/{device}.xml")
    try:
        return sorted(d.name() for d in conn.listAllDomains())
    finally:
        conn.close()


def _things(lab) -> dict:
    """Everything VM-like on the lab, by device."""
    conf = {p.stem for p in lab.sv.conf_dir.glob("*.conf")}
    folders = lab.tmp / "agent-configs"
    return {
        "machines": sorted((m["hostname"], sid) for sid, m in lab.maas.machines().items()
                           if "-vm" in m["hostname"]),
        "domains": {d: _domains(lab, d) for d in lab.devices},
        "programs": sorted(p for p in lab.procs.programs() if "-vm" in p),
        "conf": sorted(c for c in conf if "-vm" in c),
        "folders": sorted(p.name for p in folders.iterdir()) if folders.exists() else [],
    }


def _sweep_cli(lab, *extra) -> subprocess.CompletedProcess:
    config = lab.write_config(sweep_grace="0", sweep_interval="0")
    return subprocess.run([sys.executable, "-m", "testflinger_magic.cli", "agent-host", "sweep",
                           "--config", str(config), "--json", *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})


def test_cli_sweep_prints_each_note_once_and_the_daemon_logs_it(tmp_path, caplog):
    """The CLI prints notes in its report; logging them too printed every note twice."""
    from types import SimpleNamespace

    from testflinger_magic.agent_host.sweep import Sweeper, format_report

    config = SimpleNamespace(devices=[], state_dir=str(tmp_path), sweep_grace=0)
    client = SimpleNamespace(open_leases=lambda: [])
    sweeper = Sweeper(config, drivers=None, client=client)
    sweeper.collect = lambda: ([], ["gpu-host-02: no lease journal with its address here"])
    with caplog.at_level("INFO", logger="testflinger_magic"):
        report = sweeper.run(dry_run=True, log_notes=False)
    assert report["notes"] == ["gpu-host-02: no lease journal with its address here"]
    assert "no lease journal" not in caplog.text
    assert format_report(report).count("no lease journal") == 1
    with caplog.at_level("INFO", logger="testflinger_magic"):
        sweeper.run(dry_run=True)  # the daemon's periodic sweep logs it
    assert "sweep: gpu-host-02: no lease journal" in caplog.text


def test_sweep_removes_exactly_the_orphans_of_a_lease_the_server_closed(lab2):
    lab = lab2
    daemon = Daemon(lab.config(sweep_interval="0"))
    daemon.register()
    kept_id, gone_id = lab.lend("gpu-host-01"), lab.lend("gpu-host-02")
    for lease_id in (kept_id, gone_id):
        assert drive(daemon, lab, lease_id, {"active", "restoring", "failed"})["state"] == "active"
    gone = lab.lease(gone_id)
    # The server forgets gpu-host-02's lease (as if the daemon died mid-way and an operator
    # closed it): its VMs, domains, programs and folders are left with no lease.
    lab.db.magic_leases.update_one({"_id": gone_id}, {"$set": {"state": "returned"}})
    # Not ours: a person's machine and a folder with our VM names but without our marks.
    person = lab.maas.add_machine(hostname="gpu-host-02-vm3", status="Ready",
                                  mac="00:16:3e:00:00:03", power_type="virsh")
    (lab.tmp / "agent-configs" / "gpu-host-02-vm7").mkdir()
    (lab.tmp / "agent-configs" / "gpu-host-02-vm7" / "notes.txt").write_text("mine\n")
    # A stray of an old lease by hand: a marked MAAS machine of a lease long gone.
    stray = lab.maas.add_machine(hostname="gpu-host-01-vm9", status="Ready",
                                 mac="00:16:3e:00:00:09", power_type="virsh",
                                 description=maas_mark("lease-old", "gpu-host-01-vm9"))
    before = _things(lab)
    gone_names = sorted(vm["name"] for vm in gone["vms"])
    expected = sorted(
        [("program", n) for n in gone_names] + [("folder", n) for n in gone_names]
        + [("domain", n) for n in gone_names] + [("maas", n) for n in gone_names]
        + [("maas", "gpu-host-01-vm9")])

    dry = _sweep_cli(lab, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    report = json.loads(dry.stdout)
    assert sorted((r["kind"], r["name"]) for r in report["would_remove"]) == expected
    assert report["removed"] == [] and report["waiting"] == []
    assert _things(lab) == before  # changed nothing
    kept = {(r["kind"], r["name"]): r["reason"] for r in report["kept"]}
    assert kept[("maas", "gpu-host-02-vm3")].startswith("not ours")
    assert kept[("folder", "gpu-host-02-vm7")].startswith("not ours")
    assert kept[("program", "gpu-host-01-vm1")] == f"device gpu-host-01 has open lease(s) {kept_id}"

    real = _sweep_cli(lab)
    assert real.returncode == 0, real.stdout + real.stderr
    report = json.loads(real.stdout)
    assert sorted((r["kind"], r["name"]) for r in report["removed"]) == expected
    assert report["failed"] == []
    assert "sweep: removed orphan maas gpu-host-01-vm9" in real.stderr  # the log line
    after = _things(lab)
    # gpu-host-02's VMs are gone everywhere; gpu-host-01's lease is untouched; not-ours stays.
    assert after["domains"] == {"gpu-host-01": before["domains"]["gpu-host-01"],
                                "gpu-host-02": []}
    assert after["machines"] == sorted([m for m in before["machines"]
                                        if m[0].startswith("gpu-host-01-vm") and m[1] != stray]
                                       + [("gpu-host-02-vm3", person)])
    assert after["programs"] == [p for p in before["programs"] if p.startswith("gpu-host-01-")]
    assert after["conf"] == [c for c in before["conf"] if c.startswith("gpu-host-01-")]
    assert after["folders"] == ["gpu-host-01-vm1", "gpu-host-01-vm2", "gpu-host-02-vm7"]
    for vm in lab.lease(kept_id)["vms"]:
        assert lab.procs.state(vm["name"]) == "RUNNING"
    # A second sweep finds nothing more to remove.
    again = json.loads(_sweep_cli(lab).stdout)
    assert again["removed"] == [] and again["would_remove"] == []
    # The kept lease still returns cleanly.
    lab.drain(kept_id)
    assert drive(daemon, lab, kept_id, {"returned", "failed"})["state"] == "returned"
    # Returned: no journal left, so no domain is looked for, and the note says why in words
    # that do not disown the device (TRIAL7).
    notes = json.loads(_sweep_cli(lab, "--dry-run").stdout)["notes"]
    assert any(n.startswith("gpu-host-01: no open lease journal here and MAAS has it Ready: "
                            "no VM of ours can be on it") for n in notes), notes


def test_daemon_sweeps_periodically_and_respects_the_grace(lab2):
    lab = lab2
    folder = lab.tmp / "agent-configs" / "gpu-host-02-vm9"
    folder.mkdir(parents=True)
    (folder / ".testflinger-magic-agent-folder").touch()
    stray = lab.maas.add_machine(hostname="gpu-host-02-vm9", status="Ready",
                                 mac="00:16:3e:00:00:19", power_type="virsh",
                                 description=maas_mark("lease-old", "gpu-host-02-vm9"))
    # Within the grace: found, waiting, nothing removed.
    daemon = Daemon(lab.config(sweep_interval="0", sweep_grace="1h"))
    report = daemon.sweep()
    assert sorted((r["kind"], r["name"]) for r in report["waiting"]) == [
        ("folder", "gpu-host-02-vm9"), ("maas", "gpu-host-02-vm9")]
    assert report["removed"] == [] and folder.exists() and stray in lab.maas.machines()
    # The daemon's own loop runs it every sweep_interval (here: at every poll).
    daemon = Daemon(lab.config(sweep_interval=0.001, sweep_grace="0"))
    daemon._last_sweep = 0.0
    daemon.run_once(wait=0, block=True)
    daemon._sweeping.join(60)
    assert not folder.exists() and stray not in lab.maas.machines()


def test_decide_removes_at_once_what_a_lease_closed_under_a_step_left():
    """A lease the server closed while this daemon worked it (``closed``): its marked things and
    the things named for its device (no open lease) go without the grace; another lease's
    orphan still waits, an open lease's things stay."""
    leases = [{"_id": "L2", "device": "d2"}]
    items = [_item(lease="L1"), _item("program", created=999.0), _item("folder", created=None),
             _item(lease="L0", name="d1-vm2"), _item("program", "d2-vm1", "d2", created=999.0)]
    verdicts, _ = decide(items, leases, now=1000.0, grace=100.0, first_seen={},
                         closed={"L1": "d1"})
    assert [v.action for v in verdicts] == ["remove", "remove", "remove", "wait", "keep"]
    assert verdicts[0].reason == ("its lease L1 is not open: the server closed lease L1 while "
                                  "this daemon worked it")
    assert verdicts[1].reason.endswith("the server closed lease L1 while this daemon worked it")


def test_a_lease_abandoned_with_force_under_a_live_daemon_leaves_nothing_behind(lab2):
    """TRIAL15 F1: an operator abandons (--force) a lease whose live daemon is enrolling its
    VMs (MAAS still commissioning them): the daemon ends the step at its next poll and removes
    the VMs, their agent programs and folders and their MAAS machines at once (not after the
    sweep's grace, nor going on to enrol them); the answer says so; the device stays
    quarantined and deployed for the operator, and the other device's lease is untouched."""
    import threading
    import time

    import requests

    lab = lab2
    committed = threading.Event()
    lab.maas.hold("commission", committed.is_set)
    daemon = Daemon(lab.config(timeouts={"enrolling": "10m"}))
    daemon.register()
    lease_id = lab.lend("gpu-host-02")
    runner = threading.Thread(target=daemon.run_forever, daemon=True)
    runner.start()
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and not (
                lab.lease(lease_id)["state"] == "enrolling"
                and any(m["hostname"].startswith("gpu-host-02-vm")
                        for m in lab.maas.machines().values())):
            time.sleep(0.05)
        assert lab.lease(lease_id)["state"] == "enrolling"
        assert _domains(lab, "gpu-host-02")
        r = requests.post(f"{lab.server.url}/v1/magic/leases/{lease_id}/abandon",
                          headers=lab._admin(), json={"reason": "trial", "force": True},
                          timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "failed"
        assert "was still heartbeating" in r.json()["note"]
        assert "no VM of it was enrolled" not in r.json()["note"]
        end = time.monotonic() + 30
        while time.monotonic() < end and any(lab.orphans().values()):
            time.sleep(0.1)
        assert lab.orphans() == {k: 0 for k in lab.orphans()}, lab.orphans()
        committed.set()  # MAAS may finish now: nothing enrols again
        time.sleep(1.0)
        assert lab.orphans() == {k: 0 for k in lab.orphans()}
    finally:
        daemon.stop()
        runner.join(30)
    assert not runner.is_alive()
    lease = lab.lease(lease_id)
    assert lease["state"] == "failed"
    device = lab.db.magic_devices.find_one({"_id": "gpu-host-02"})
    assert device["quarantined"]
    status = {m["hostname"]: m["status_name"] for m in lab.maas.machines().values()}
    assert status["gpu-host-02"] == "Deployed"  # the operator's to release (the note says)



def test_a_deployed_device_without_a_journal_is_not_said_to_be_not_ours(lab2):
    """TRIAL19 F1: after an abandon --force the device stayed Deployed in MAAS with no lease
    journal left, and the sweep the abandon answer names said "MAAS does not run it deployed
    by us". Without a journal the sweep still lists no domain there (a home job deploys the
    device too), but says what MAAS shows and what to do."""
    lab = lab2
    maas = Daemon(lab.config()).drivers.maas
    sid = lab.system_ids["gpu-host-02"]
    maas.deploy(sid, "jammy")
    assert maas.wait_for(sid, {"Deployed"}, set(), 20, 0.05).status == "Deployed"
    notes = json.loads(_sweep_cli(lab, "--dry-run").stdout)["notes"]
    (note,) = [n for n in notes if n.startswith("gpu-host-02:")]
    assert note.startswith("gpu-host-02: Deployed in MAAS with no open lease journal here: not "
                           "known to be deployed by us") and "release it in MAAS" in note
    (other,) = [n for n in notes if n.startswith("gpu-host-01:")]
    assert "MAAS has it Ready: no VM of ours can be on it" in other
