"""``simulate`` refuses a lab the server would refuse, in the server's words, and says when
jobs fall after ``until`` (TRIAL3 finding 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testflinger_magic import cli
from testflinger_magic.lab import simulate as S
from testflinger_magic.queue_clashes import device_clashes
from testflinger_magic.queues import load_file

ROOT = Path(__file__).resolve().parent.parent
QUEUES = ROOT / "examples" / "magic-queues.yaml"

CLASH = """
lab:
  devices:
    - {name: %s, gpus: 4, home_queues: [%s]}
jobs:
  - {submit: 0, queue: one-gpu-vm, duration: 10m}
"""


@pytest.mark.parametrize("device,home,says", [
    ("one-gpu-vm", "gpu-hosts", "device one-gpu-vm: its agent name is the magic queue "
                                "'one-gpu-vm'"),
    ("gpu-host-01", "one-gpu-vm", "device gpu-host-01: its home queue 'one-gpu-vm' is a magic "
                                  "queue (its agent would take that queue's jobs on bare "
                                  "metal); rename the home queue or the magic queue"),
])
def test_a_device_named_like_a_magic_queue_or_serving_one_is_refused(tmp_path, capsys, device,
                                                                     home, says):
    """Before: the device's own agent ran the magic queue's job on bare metal, counted as a
    magic job with 0 s wait. Now the replay is refused (exit 1) with the registration's words
    (queue_clashes.device_clashes, which the server's 409 uses) and no table is printed."""
    trace = tmp_path / "clash.yaml"
    trace.write_text(CLASH % (device, home))
    assert cli.main(["simulate", str(trace), "--queues", str(QUEUES)]) == 1
    out, err = capsys.readouterr()
    assert says in err and f"{trace}: lab.devices: the server would refuse this lab" in err
    assert "jobs done" not in out
    registered = [{"agent_name": device, "home_queues": [home]}]
    assert says in device_clashes(registered, {q.name for q in load_file(QUEUES)})[0]
    with pytest.raises(S.SimulationError):  # every column, baselines too
        S.compare(S.load_trace(trace), load_file(QUEUES), [], ["none"])


def test_a_lab_without_clashes_still_replays(tmp_path, capsys):
    trace = tmp_path / "ok.yaml"
    trace.write_text(CLASH % ("gpu-host-01", "gpu-hosts"))
    assert cli.main(["simulate", str(trace), "--queues", str(QUEUES)]) == 0
    out, err = capsys.readouterr()
    assert "jobs done" in out and "refuse" not in err


def test_jobs_after_until_are_named_in_a_warning(tmp_path, capsys):
    trace = tmp_path / "late.yaml"
    trace.write_text("""
until: 1h
lab:
  devices:
    - {prefix: gpu-host-, count: 2, gpus: 4, home_queues: [gpu-hosts]}
jobs:
  - {submit: 0, queue: gpu-hosts, duration: 10m}
  - {submit: 2h, queue: gpu-hosts, duration: 10m}
  - {submit: 3h, queue: one-gpu-vm, duration: 10m}
""")
    result = S.simulate(S.load_trace(trace), load_file(QUEUES))
    assert result.warnings == ["2 job(s) submitted after until (1h, first at 2h) are never "
                               "submitted: the replay stops at until, and they count as "
                               "unfinished"]
    assert result.unfinished == {"magic": 1, "home": 1}
    assert cli.main(["simulate", str(trace), "--queues", str(QUEUES)]) == 0
    assert "warning: as defined: 2 job(s) submitted after until" in capsys.readouterr().err
    # no warning when every job is within until
    trace.write_text(trace.read_text().replace("until: 1h", "until: 4h"))
    assert S.simulate(S.load_trace(trace), load_file(QUEUES)).warnings == []


LAB = """
lab:
  devices:
    - {prefix: gpu-host-, count: 3, gpus: 4, home_queues: [gpu-hosts]}
    - {name: %s, gpus: 4, home_queues: [gpu-hosts]}
jobs:
  - {submit: 0, queue: one-gpu-vm, duration: 10m}
"""


@pytest.mark.parametrize("device,says", [
    ("gpu_host.9", "device agent_name 'gpu_host.9': letters, digits and '-' only"),
    ("gpu-host-02", "device 'gpu-host-02' is listed twice: each device is registered once"),
    ("gpu-host-01-vm1", "device agent_name 'gpu-host-01-vm1' is the agent name of VM 1 of "
                        "device 'gpu-host-01'"),
    ("GPU-HOST-03", "device agent_name 'GPU-HOST-03' differs from device 'gpu-host-03' only in "
                    "case"),
])
def test_a_device_the_registration_would_refuse_is_refused(tmp_path, capsys, device, says):
    """TRIAL4 5: the registration's name rule, duplicate and VM-name checks (names.py), exit 1,
    no table."""
    trace = tmp_path / "names.yaml"
    trace.write_text(LAB % device)
    assert cli.main(["simulate", str(trace), "--queues", str(QUEUES)]) == 1
    out, err = capsys.readouterr()
    assert f"{trace}: lab.devices: the server would refuse this lab: {says}" in err, err
    assert "jobs done" not in out


def test_a_device_whose_vms_are_named_like_a_device_is_refused(tmp_path, capsys):
    """gpu-host-01-vm09 is no VM name (the claim makes -vm9); gpu-host-01-vm10 is."""
    trace = tmp_path / "vmname.yaml"
    trace.write_text(LAB.replace("{prefix: gpu-host-, count: 3,",
                                 "{prefix: gpu-host-01-vm, start: 9, count: 3,") % "gpu-host-01")
    assert cli.main(["simulate", str(trace), "--queues", str(QUEUES)]) == 1
    _out, err = capsys.readouterr()
    assert "device agent_name 'gpu-host-01' would name its VM 10 gpu-host-01-vm10 while lent, " \
           "which is device 'gpu-host-01-vm10'" in err, err
    assert "vm09" not in err
