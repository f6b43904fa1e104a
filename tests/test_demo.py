"""The demo scenario end to end on the embedded lab (a shorter time scale than `make demo`)."""

import argparse
import io
import json
import signal
import subprocess
import sys
import tempfile

import pytest

from testflinger_magic.lab import demo
from testflinger_magic.lab.demo import lease_summaries, load_jobs, print_summary, run_demo
from testflinger_magic.lab.lab import EXAMPLES, LabOptions, process_command_lines

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
        assert lease["giveback"] == "verified", lease  # its device agent posted after return
        assert lease["vms"] == 8
        assert len(lease["vm_agents"]["expected"]) == 8
        assert lease["vm_agents"]["seen"] == lease["vm_agents"]["expected"], lease
    assert summary["orphans"] == {"domains": 0, "maas_machines": 0, "agent_programs": 0,
                                  "agent_folders": 0, "fenced_agents": 0}
    assert summary["home_queue_served_after_return"] is True
    # The lab's HGX hosts: the simulated MAAS' commissioning lists their 4 NVSwitches each,
    # which the daemon's registration told the server before any lend (TRIAL13 F16); they
    # keep them out of two-gpu-vm (2 GPUs per VM), and the summary says so.
    assert summary["nvswitches"] == {d: 4 for d in devices}, summary["nvswitches"]
    assert summary["nvswitches_source"] == {d: "maas" for d in devices}
    printed = io.StringIO()
    print_summary(summary, True, printed)
    assert "NVSwitches listed by MAAS commissioning: gpu-host-01 4, gpu-host-02 4" \
        in printed.getvalue()
    # What a person follows is printed: leases changing state, agents appearing, jobs moving.
    assert "-> deploying" in text and "appeared on one-gpu-vm" in text and ": complete" in text
    assert "appeared on  (" not in text  # an agent is shown once its queues are known
    assert "idle_timeout 4s" in text.splitlines()[0]  # the shortened policy comes first
    json.dumps(summary)  # the summary must be writable as JSON


def _lab_processes(marker: str) -> list[str]:
    """Command lines of live processes (zombies excluded) mentioning ``marker``."""
    return process_command_lines([marker])


def test_sigterm_stops_the_whole_lab(tmp_path):
    workdir = tmp_path / "lab"
    summary = tmp_path / "out" / "summary.json"
    proc = subprocess.Popen([sys.executable, "-m", "testflinger_magic.cli", "demo",
                             "--workdir", str(workdir), "--summary", str(summary)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # ends once a lease is claimed (or the demo ends: asserted below)
            seen.append(line)
            if "-> claimed" in line:
                break
        assert "lab up:" in "".join(seen) and "-> claimed" in seen[-1], "".join(seen)
        # The lab is up: supervisord, the device agents and the daemon run under workdir.
        assert any("agent-host" in p for p in _lab_processes(str(workdir)))
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert _lab_processes(str(workdir)) == [], output[-3000:]
    assert "Summary" in output and "interrupted by SIGTERM" in output
    written = json.loads(summary.read_text())
    assert written["errors"] == ["interrupted by SIGTERM"]
    # Issue 10 item 6: what happened up to the interrupt is reported, not "jobs: 0/0".
    assert written["jobs_submitted"] > 0 and written["leases"], written
    assert all("claimed" in lease["states"] for lease in written["leases"]), written["leases"]
    assert f"jobs: {written['jobs_completed']}/{written['jobs_submitted']} complete" in output
    assert f"lab files kept in {workdir}" in output


def test_timeout_is_reported_and_summary_written_in_a_new_folder(tmp_path, capsys):
    summary = tmp_path / "no" / "such" / "dir" / "s.json"
    args = argparse.Namespace(summary=str(summary), workdir=str(tmp_path / "lab"), timeout=3.0,
                              time_scale=None, phase_seconds=None, jobs_dir=None, copies=None)
    assert demo.main(args) == 1
    out = capsys.readouterr().out
    data = json.loads(summary.read_text())
    assert any(e.startswith("timed out after 3s (--timeout)") for e in data["errors"]), data
    assert any("post-return check skipped" in e for e in data["errors"]), data
    assert data["home_queue_served_after_return"] is False
    assert "Summary" in out and "error: timed out after 3s" in out and "result: FAILED" in out
    assert f"lab files kept in {tmp_path / 'lab'}" in out
    assert out.splitlines()[0].split("] ", 1)[1].startswith("demo policy")
    assert _lab_processes(str(tmp_path / "lab")) == []


def test_unwritable_summary_fails_before_anything_starts(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = argparse.Namespace(summary=str(blocker / "s.json"), workdir=str(tmp_path / "lab"),
                              timeout=None, time_scale=None, phase_seconds=None, jobs_dir=None,
                              copies=None)
    assert demo.main(args) == 2
    err = capsys.readouterr().err
    assert f"--summary {blocker / 's.json'}: cannot create its folder" in err
    assert not (tmp_path / "lab" / "daemon.log").exists()


@pytest.mark.parametrize("ok", [True, False])
def test_temporary_workdir_removed_after_success_only(ok, tmp_path, monkeypatch, capsys):
    """main's bookkeeping around run_demo (replaced by a stand-in: no lab needed here)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []

    def fake_run_demo(opt, **_kw):
        made.append(opt.workdir)
        (opt.workdir / "daemon.log").write_text("log")
        return {"jobs_submitted": 1, "jobs_completed": 1 if ok else 0, "leases": [],
                "orphans": {"domains": 0}, "home_queue_served_after_return": ok,
                "errors": [] if ok else ["timed out after 1s (--timeout)"], "interrupted": None,
                "wall_seconds": 1.0}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    args = argparse.Namespace(summary=str(tmp_path / "s.json"), workdir=None, timeout=None,
                              time_scale=None, phase_seconds=None, jobs_dir=None, copies=None)
    assert demo.main(args) == (0 if ok else 1)
    (workdir,) = made
    assert workdir.name.startswith("tf-magic-demo-") and workdir.parent == tmp_path
    out = capsys.readouterr().out
    if ok:
        assert not workdir.exists() and "kept" not in out
    else:
        assert (workdir / "daemon.log").exists() and f"lab files kept in {workdir}" in out


def test_a_vm_agent_that_never_appeared_is_an_error_in_the_summary(capsys):
    """All jobs may complete on the other VMs: the missing agent must still fail the run."""
    vms = [{"index": i, "name": f"gpu-host-02-vm{i}"} for i in range(4)]
    leases = [{"_id": "lease-1", "device": "gpu-host-02", "queue": "one-gpu-vm", "vms": vms,
               "history": [{"state": s} for s in FINAL_CYCLE]},
              # Failed before enrolling: no VM agent was ever expected to run.
              {"_id": "lease-2", "device": "gpu-host-01", "queue": "one-gpu-vm",
               "vms": [{"index": 0, "name": "gpu-host-01-vm0"}],
               "history": [{"state": "claimed"}, {"state": "failed"}]}]
    seen = {"gpu-host-02-vm0", "gpu-host-02-vm1", "gpu-host-02-vm2", "gpu-host-01"}
    entries, errors = lease_summaries(leases, seen)
    assert entries[0]["vm_agents"] == {"expected": [v["name"] for v in vms],
                                       "seen": ["gpu-host-02-vm0", "gpu-host-02-vm1", "gpu-host-02-vm2"]}
    assert errors == ["lease lease-1 (gpu-host-02 -> one-gpu-vm): VM agent(s) never appeared on "
                      "the server: gpu-host-02-vm3 (3/4 seen)"]
    print_summary({"jobs_completed": 1, "jobs_submitted": 1, "leases": entries, "orphans": {},
                   "errors": errors, "wall_seconds": 1.0}, ok=not errors)
    out = capsys.readouterr().out
    assert "VM agents seen 3/4" in out and "result: FAILED" in out


# --- what the demo prints (issue 10 item 17) -------------------------------------------------

class _FakeSubmitter:
    def __init__(self, refuse: str = ""):
        self.refuse = refuse

    def submit(self, job, wait_for_available_agents=False):
        if self.refuse:
            raise RuntimeError(self.refuse)
        return "0123456789abcdef"

    def state(self, job_id):
        return "complete"


def test_a_lease_first_seen_after_its_claim_still_shows_why_it_was_claimed():
    out = io.StringIO()
    progress = demo.Progress(None, out)
    lease = {"_id": "lease-1", "device": "gpu-host-01", "queue": "one-gpu-vm", "state": "fenced",
             "history": [{"state": "claimed", "reason": "9 waiting jobs; lend gpu-host-01"},
                         {"state": "fenced", "reason": "device agent stopped"}]}
    progress.show_lease(lease)
    progress.show_lease(lease)  # nothing new: nothing printed
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "lease lease-1 gpu-host-01 -> one-gpu-vm: new -> claimed  (9 waiting jobs; lend gpu-host-01)",
        "lease lease-1 gpu-host-01 -> one-gpu-vm: claimed -> fenced  (device agent stopped)"]


@pytest.mark.parametrize("lent, words", [(True, "served again by its device agents"),
                                         (False, "no device was lent")])
def test_home_queue_is_served_again_only_after_a_lend(lent, words, tmp_path):
    out = io.StringIO()
    served, problem = demo._home_served(LabOptions(workdir=tmp_path), _FakeSubmitter(),
                                        demo.Progress(None, out), lent=lent)
    assert served and not problem
    assert words in out.getvalue() and ("again" in out.getvalue()) == lent


def test_a_refused_job_file_is_named():
    with pytest.raises(RuntimeError, match="^job file gpu-smoke.yaml: testflinger-cli would"):
        demo.submit_file(_FakeSubmitter("testflinger-cli would refuse: no online agents"),
                         "gpu-smoke.yaml", {"job_queue": "one-gpu-vm"})


def test_a_job_file_that_is_not_yaml_is_named(tmp_path):
    (tmp_path / "broken.yaml").write_text("job_queue: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML"):
        load_jobs(tmp_path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_whose_exception_was_swallowed_still_stops_the_scenario():
    """The demo's SIGTERM handler raises in the main thread; run inside a ``__del__`` (or a GC
    or weakref callback) that exception is swallowed by CPython, and the demo ran on to its
    end (seen once in test_sigterm_stops_the_whole_lab). The scenario's loop raises it itself
    from what the handler recorded."""
    demo.SIGNALLED.clear()

    class Dying:
        def __del__(self):  # where a signal handler may run: its raise goes nowhere
            demo.SIGNALLED.append(signal.SIGTERM)
            raise demo.DemoInterrupted(signal.SIGTERM)

    Dying()
    try:
        with pytest.raises(demo.DemoInterrupted) as exc:
            demo.interrupt_if_signalled()
        assert exc.value.signum == signal.SIGTERM
    finally:
        demo.SIGNALLED.clear()
    demo.interrupt_if_signalled()  # nothing recorded: nothing raised
