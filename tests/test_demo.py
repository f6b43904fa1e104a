"""The demo scenario end to end on the embedded lab (a shorter time scale than `make demo`)."""

import io
import json

import pytest

from testflinger_magic.lab.demo import load_jobs, run_demo
from testflinger_magic.lab.lab import EXAMPLES, LabOptions

pytestmark = pytest.mark.slow

FINAL_CYCLE = ["claimed", "fenced", "deploying", "splitting", "enrolling", "active",
               "draining", "restoring", "returned"]


def test_demo_cycle_lends_two_devices_and_returns_them(tmp_path):
    out = io.StringIO()
    opt = LabOptions(workdir=tmp_path / "lab", time_scale=0.004, phase_seconds=0.7, idle_timeout=4.0)
    summary = run_demo(opt, jobs_dir=EXAMPLES / "jobs", copies=4, timeout=200, out=out)
    text = out.getvalue()
    assert summary["errors"] == [], text[-3000:]
    magic_jobs = sum(1 for _, j in load_jobs(EXAMPLES / "jobs") if j["job_queue"] != opt.home_queue)
    assert summary["jobs_submitted"] == magic_jobs * 4 + 1
    assert summary["jobs_completed"] == summary["jobs_submitted"], text[-3000:]
    # 12 one-GPU jobs do not fit on one 8-GPU device: a second device must have been lent.
    devices = {lease["device"] for lease in summary["leases"]}
    assert len(devices) == 2, summary["leases"]
    for lease in summary["leases"]:
        assert lease["states"] == FINAL_CYCLE, lease
        assert lease["vms"] == 8
    assert summary["orphans"] == {"domains": 0, "maas_machines": 0, "agent_programs": 0,
                                  "agent_folders": 0, "fenced_agents": 0}
    assert summary["home_queue_served_after_return"] is True
    # What a person follows is printed: leases changing state, agents appearing, jobs moving.
    assert "-> deploying" in text and "appeared on one-gpu-vm" in text and ": complete" in text
    json.dumps(summary)  # the summary must be writable as JSON
