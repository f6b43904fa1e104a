"""Lab.stop leaves no process behind, even when a component's own stopper fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testflinger_magic.lab.lab import Lab, LabOptions

pytestmark = pytest.mark.slow


def running(marker: str) -> list[str]:
    """Command lines of live processes (zombies excluded) mentioning ``marker``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmd and state != b"Z":
            found.append(f"{entry.name}: {cmd}")
    return found


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
