"""Lab.stop leaves no process behind, even when a component's own stopper fails."""

from __future__ import annotations


import pytest

from testflinger_magic import queues
from testflinger_magic.lab.lab import (EXAMPLES, LAB_POOL_GIB, Lab, LabOptions, lab_definitions,
                                       process_command_lines)

pytestmark = pytest.mark.slow


def running(marker: str) -> list[str]:
    """Command lines of live processes (zombies excluded) mentioning ``marker``."""
    return process_command_lines([marker])


def test_stop_kills_supervisord_agents_and_daemon_when_a_stopper_fails(tmp_path):
    workdir = tmp_path / "lab"
    lab = Lab(LabOptions(workdir=workdir, devices=2, gpus=2))
    lab.start()
    try:
        before = running(str(workdir))
        # supervisord, one agent per device, the daemon
        assert len(before) >= 4 and any("sim_agent" in p for p in before), before
        assert sorted(lab.lab_processes()) == sorted(int(p.split(":")[0]) for p in before)

        def broken():
            raise RuntimeError("simulated failure of the supervisord stopper")

        # The supervisord stopper fails without stopping anything: its programs, each in its
        # own process group, and supervisord itself must still go.
        lab._started = [(n, broken if n == "supervisord" else f) for n, f in lab._started]
    finally:
        lab.stop()
    assert running(str(workdir)) == []
    lab.stop()  # twice is fine


def test_example_disks_are_not_clamped_and_the_lab_splitter_assumes_a_large_pool(tmp_path):
    """`testflinger-magic apply examples/magic-queues.yaml` against `lab up` must split too."""
    opt = LabOptions(workdir=tmp_path / "lab")
    example = {q.name: q.vm.disk_gib for q in queues.load_file(EXAMPLES / "magic-queues.yaml")}
    assert {q.name: q.vm.disk_gib for q in lab_definitions(opt)} == example
    assert max(example.values()) > 100  # more than the test driver's own pool figure
    assert LAB_POOL_GIB >= max(example.values())


def test_lab_metrics_ports_stay_out_of_the_ephemeral_range(tmp_path):
    """Issue 10 item 8: ports inside Linux's ephemeral range can be taken by any outgoing
    connection's local port; the lab's metrics port windows must lie below it."""
    from testflinger_magic.lab.lab import _free_port_window, ephemeral_port_range

    low_eph, _ = ephemeral_port_range()
    for _ in range(50):
        low, high = _free_port_window()
        assert 1024 <= low < high <= low_eph, (low, high, low_eph)
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(f)) == (40000, 50000)
    assert ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
