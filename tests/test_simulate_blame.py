"""``simulate`` judges bring-up timeouts as the server does (testflinger_magic.blame): a
``provision_timeout`` too short for the lab's bring-up suspends the queue once bring-ups time out
on QUEUE_TIMEOUT_DEVICES different devices, instead of charging (and quarantining) every device;
and it prints the definition warnings ``validate`` gives for what it replays."""

from __future__ import annotations

from pathlib import Path

from testflinger_magic import blame as B
from testflinger_magic import cli
from testflinger_magic.lab import simulate as S
from testflinger_magic.queues import load_text

ROOT = Path(__file__).resolve().parent.parent
QUEUES = ROOT / "examples" / "magic-queues.yaml"
SMALL = ROOT / "examples" / "traces" / "small.csv"

ONE_QUEUE = """
magic_queues:
  one-gpu-vm:
    description: one GPU per VM
    devices: {home_queues: [gpu-hosts]}
    vms_per_device: gpus
    vm: {gpus: 1}
    policy:
      max_devices: 3
      max_starting: 1
      idle_timeout: 10m
      max_lease: 1d
      reclaim: {owner_wait: 30m, grace: 15m}
      provision_timeout: 45m
      failures_before_quarantine: 1
"""


def trace(tmp_path: Path, devices: int, deploy: str = "10m"):
    p = tmp_path / "t.yaml"
    p.write_text(f"""
lab:
  devices: [{{prefix: gpu-host-, count: {devices}, gpus: 2, home_queues: [gpu-hosts]}}]
  bringup: {{fence: 30s, deploy: {deploy}, split: 1m, enrol: 4m}}
until: 1d
jobs:
  - {{submit: 0, queue: one-gpu-vm, duration: 10m}}
  - {{submit: 0, queue: one-gpu-vm, duration: 10m}}
  - {{submit: 60, queue: gpu-hosts, duration: 10m}}
""", encoding="utf-8")
    return S.load_trace(p)


def test_timeouts_on_two_devices_suspend_the_queue_and_charge_no_device(tmp_path):
    """provision_timeout 5m < the lab's 15m bring-up. failures_before_quarantine 1 would
    quarantine each device on its first charged failure: the first timeout charges its device
    (quarantined at once, as the server would), the second, on another device, blames the
    queue, takes the first failure back and suspends lending; the magic jobs stay waiting with
    the suspension as the reason, home jobs run."""
    queues = S.apply_policy(load_text(ONE_QUEUE, "q.yaml"), {"provision_timeout": "5m"})
    sim = S.Simulation(trace(tmp_path, 3), queues, "5m")
    r = sim.run()
    assert r.lends == 2 and r.bringups == 0
    assert r.bringup_failures == 0
    # The first device was quarantined before the second timeout showed the queue at fault;
    # taking its failure back lifts that quarantine too (as the server's does).
    assert r.quarantines == 1
    assert not any(d.quarantined for d in sim.devices.values())
    (lifted,) = [w for w in r.warnings if "unquarantined" in w]
    assert lifted.startswith("device gpu-host-01: unquarantined at ") and "taken back" in lifted
    assert sorted(d.failures for d in sim.devices.values()) == [0, 0, 0]
    assert list(r.suspended) == ["one-gpu-vm"]
    assert "one-gpu-vm" in sim.suspended
    assert r.unfinished["magic"] == 2 and r.done["home"] == 1
    suspended = [w for w in r.warnings if "lending suspended at" in w]
    assert len(suspended) == 1 and "2 different devices" in suspended[0]
    assert "raise policy.provision_timeout" in suspended[0]


def test_timeouts_on_one_device_are_the_devices_fault(tmp_path):
    """One device only: every timeout is on the same device, so it is charged each time (the
    queue is never blamed) and quarantined at failures_before_quarantine, as on the server."""
    queues = S.apply_policy(load_text(ONE_QUEUE, "q.yaml"),
                            {"provision_timeout": "5m", "failures_before_quarantine": 2})
    r = S.Simulation(trace(tmp_path, 1), queues, "5m").run()
    assert r.suspended == {}
    assert (r.bringup_failures, r.quarantines) == (2, 1)


def test_a_timeout_after_a_successful_bring_up_starts_a_new_run():
    """The pure rule both the server and simulate call."""
    runs = [{"_id": "a", "device": "d1", "created_at": 10.0, "failures_counted": True},
            {"_id": "b", "device": "d2", "created_at": 20.0, "failures_counted": False}]
    v = B.judge_timeout("b", runs, applied_at=0.0, last_ok_created_at=None)
    assert v == B.TimeoutVerdict(True, ("d1", "d2"), ("a",))
    # A lease created at 15 reached active: "a" is before it, so "b" alone is the run.
    assert not B.judge_timeout("b", runs, applied_at=0.0, last_ok_created_at=15.0).queue_at_fault
    # The definition applied again at 15 (maybe the fix) ends the run the same way.
    assert not B.judge_timeout("b", runs, applied_at=15.0, last_ok_created_at=None).queue_at_fault
    same = [dict(runs[0]), dict(runs[1], device="d1")]
    assert B.judge_timeout("b", same, 0.0, None) == B.TimeoutVerdict(False, ("d1",))


def test_simulate_prints_the_definition_warnings_of_what_it_replays(tmp_path, capsys):
    """The issue's run: ``simulate small.csv --policy provision_timeout=1s`` said "bring-up
    failures 12" with no word about the timeout; now it warns as ``validate`` does (for the
    definitions as overridden) and suspends the queues instead of charging the devices."""
    rc = cli.main(["simulate", str(SMALL), "--queues", str(QUEUES),
                   "--policy", "provision_timeout=1s", "--policy", "as-defined"])
    out, err = capsys.readouterr()
    assert rc == 0
    warned = [line for line in err.splitlines() if "policy.provision_timeout: 1s is below" in line]
    assert len(warned) == 2 and all(line.startswith("warning: provision_timeout=1s: queue ")
                                    for line in warned), err
    assert not [line for line in err.splitlines()  # the example's 45m passes
                if line.startswith("warning: as defined:") and "policy.provision_timeout" in line]
    rows = {line.split("  ")[0]: line.split()[-2:] for line in out.splitlines()}
    assert rows["bring-up failures"] == ["0", "0"]
    assert rows["quarantines"] == ["0", "0"]
    suspended = next(line for line in out.splitlines() if line.startswith("queues suspended"))
    assert "one-gpu-vm@" in suspended and suspended.rstrip().endswith("-")
