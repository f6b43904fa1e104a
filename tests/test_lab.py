"""Lab.stop leaves no process behind, even when a component's own stopper fails."""

from __future__ import annotations


import pytest
import yaml

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
        # Third trial finding 4: nothing in the lab activates Fabric Manager partitions, so its
        # agent-host.yaml (which operators copy) must not opt in to 2-GPU VMs on NVSwitches.
        splitter = yaml.safe_load(lab.daemon_config.read_text())["splitter"]
        assert not splitter.get("nvswitch_multi_gpu"), splitter
        # TRIAL9: list-queues described the home queue as 8-GPU servers whatever --gpus said.
        import requests
        queues = requests.get(f"{lab.server_url}/v1/agents/queues", timeout=10).json()
        assert queues.get(lab.opt.home_queue) == "Bare-metal 2-GPU servers", queues

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


# ---------------------------------------------------------------- issue 10 item 7: work directory

def test_workdir_verdicts():
    from testflinger_magic.lab.labdir import workdir_verdict

    assert workdir_verdict([], None, False) == ("use", "")
    verdict, why = workdir_verdict(["notes.txt", "photos"], None, False)
    assert verdict == "refuse" and "not a lab's" in why and "notes.txt, photos" in why
    assert workdir_verdict([".testflinger-magic-lab", "supervisor"], {"pid": 1}, False)[0] == "clean"
    verdict, why = workdir_verdict([".testflinger-magic-lab"], {"pid": 4242}, True)
    assert verdict == "refuse" and "pid 4242" in why and "running" in why
    # A lab's folder from before the marker existed, recognised by its layout.
    assert workdir_verdict(["agent-host.yaml", "supervisor", "daemon.log"], None, False)[0] == "clean"


def test_a_folder_that_is_not_a_labs_is_refused_and_left_alone(tmp_path):
    from testflinger_magic.lab.labdir import LabError, prepare_workdir

    (tmp_path / "thesis.tex").write_text("precious")
    (tmp_path / "supervisor").mkdir()  # a lab's name, but not a lab's folder
    with pytest.raises(LabError, match=r"not a lab's work directory .*supervisor, thesis.tex"):
        prepare_workdir(tmp_path)
    assert (tmp_path / "thesis.tex").read_text() == "precious"
    assert (tmp_path / "supervisor").is_dir()


def _popen_lab_up(*extra):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "testflinger_magic.cli", "lab", "up",
                             "--devices", "1", "--gpus", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc) -> None:
    """End a `lab up` a failed assertion left running the way a person would (SIGTERM: the lab
    stops its processes), SIGKILL only if that does not work."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_until_banner(proc) -> tuple[list[str], str]:
    """Lines up to the banner's work directory line, and that directory."""
    import re

    seen = []
    for line in proc.stdout:
        seen.append(line)
        found = re.search(r"work directory: (\S+)", line)
        if found:
            return seen, found.group(1)
    raise AssertionError("lab up ended before its banner:\n" + "".join(seen)[-3000:])


def test_lab_up_on_a_crashed_labs_folder_stops_and_cleans_the_old_lab_first(tmp_path):
    """An earlier `lab up` killed outright leaves supervisord, its device agents (now polling a
    dead server) and the daemon running, and its conf.d full of programs: a new lab in that
    folder must not inherit any of it."""
    import signal

    workdir = tmp_path / "lab"
    proc = _popen_lab_up("--workdir", str(workdir))
    try:
        seen, shown = _read_until_banner(proc)
        assert shown == str(workdir), "".join(seen)
        proc.send_signal(signal.SIGKILL)  # no stopper runs
        proc.wait(30)
    finally:
        _stop(proc)
    try:
        _start_a_lab_where_a_crashed_one_ran(workdir)
    finally:  # whatever failed: no process of either lab outlives the test
        from testflinger_magic.lab.labdir import _terminate, processes_mentioning

        _terminate(processes_mentioning([str(workdir)]))


def _start_a_lab_where_a_crashed_one_ran(workdir):
    old = running(str(workdir))
    assert any("sim_agent" in p for p in old) and any("supervisord" in p for p in old), old
    # A VM agent program of the dead lab, as a lease would have left it in conf.d.
    conf_d = workdir / "supervisor" / "conf.d"
    device_conf = (conf_d / "gpu-host-01.conf").read_text()
    (conf_d / "gpu-host-01-vm1.conf").write_text(
        device_conf.replace("gpu-host-01", "gpu-host-01-vm1"))
    (workdir / "daemon-state" / "leases").mkdir(parents=True, exist_ok=True)
    (workdir / "daemon-state" / "leases" / "lease-old.json").write_text("{}")

    lab = Lab(LabOptions(workdir=workdir, devices=1, gpus=1))
    try:
        lab.start()
        old_pids = {int(p.split(":")[0]) for p in old}
        assert not old_pids & set(lab.lab_processes()), "processes of the dead lab survived"
        from testflinger_magic.agent_host.agents import AgentProcesses

        procs = AgentProcesses(lab.supervisor.url, lab.supervisor.conf_dir, lab.agent_command())
        assert procs.programs() == ["gpu-host-01"]
        assert not (workdir / "daemon-state" / "leases" / "lease-old.json").exists()
    finally:
        lab.stop()
    assert running(str(workdir)) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_lab_up_removes_its_temporary_folder_when_stopped(sig):
    import signal
    from pathlib import Path

    proc = _popen_lab_up()
    try:
        seen, shown = _read_until_banner(proc)
        workdir = Path(shown)
        assert workdir.is_dir() and "temporary" in seen[-1], "".join(seen)
        assert running(str(workdir)), "the lab should be running"
        proc.send_signal(getattr(signal, sig))
        rest = proc.communicate(timeout=120)[0]
    finally:
        _stop(proc)
    output = "".join(seen) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "Stopping the lab" in output
    assert "Lab stopped: its servers, supervisord, agents and daemon are gone; its temporary " \
           "work directory is removed" in output
    assert not workdir.exists(), output[-3000:]
    assert running(str(workdir)) == []


def test_lab_up_newer_testflinger_serves_job_events():
    """`lab up --newer-testflinger` runs the newer generation: its banner says so and the
    server keeps job events (GET /v1/events/job/<id>, testflinger#1297-#1299)."""
    import re

    import requests

    proc = _popen_lab_up("--newer-testflinger")
    try:
        seen, _ = _read_until_banner(proc)
        banner = "".join(seen)
        assert "(newer Testflinger: after fe381ff)" in banner, banner[-3000:]
        url = re.search(r"Testflinger server: (\S+)", banner).group(1)
        job_id = requests.post(f"{url}/v1/job", json={"job_queue": "gpu-hosts"},
                               timeout=10).json()["job_id"]
        events = requests.get(f"{url}/v1/events/job/{job_id}", timeout=10).json()["events"]
        assert [e["event_name"] for e in events][:1] == ["job_submitted"], events
    finally:
        _stop(proc)


# ---------------------------------------------------------------- issue 10 item 18: no false repair

def test_a_quick_re_lend_is_no_repair(tmp_path):
    """Jobs still waiting when a lease is returned make the next tick lend the device again at
    once. Nothing went wrong: no ``lease.repaired`` event may appear (the restore's own restart
    of the device agent, whose startup post says ``waiting`` while the lease is ``restoring``,
    used to be "repaired" on every return)."""
    import time

    import requests

    from testflinger_magic.lab.demo import Submitter

    lab = Lab(LabOptions(workdir=tmp_path / "lab", devices=1, gpus=2, time_scale=0.002,
                         phase_seconds=0.3))
    try:
        lab.start()
        sub = Submitter(lab.server_url, lab.token("lab-user"))
        job = {"job_queue": "one-gpu-vm", "test_data": {"test_cmds": "true"}}
        leases = lab.db["magic_leases"]

        def wait(cond, what, timeout=120):
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                found = cond()
                if found:
                    return found
                time.sleep(0.1)
            raise AssertionError(f"timed out waiting for {what}: "
                                 f"{[(x['_id'], x['state']) for x in leases.find()]}")

        sub.submit(job)
        first = wait(lambda: leases.find_one({"state": "active"}), "the first lease active")
        for _ in range(3):  # waiting when the lease is returned: it is lent again at once
            sub.submit(job)
        r = requests.post(f"{lab.server_url}/v1/magic/leases/{first['_id']}/drain",
                          json={"reason": "test", "grace": "1s", "force": True},
                          headers={"Authorization": f"Bearer {lab.admin_token}"}, timeout=10)
        assert r.status_code == 200, r.text
        wait(lambda: leases.find_one({"_id": first["_id"], "state": "returned"}),
             "the first lease returned")
        second = wait(lambda: leases.find_one({"_id": {"$ne": first["_id"]},
                                               "state": {"$nin": ["claimed"]}}),
                      "the device lent again and fenced")
        assert second["device"] == first["device"]
        time.sleep(3 * lab.opt.tick_seconds)  # a few more ticks, each running the repairs
        repaired = [e["message"] for e in lab.db["magic_events"].find({"kind": "lease.repaired"})]
        assert repaired == []
        assert lab.agent_doc(first["device"])["state"] == "maintenance"  # lent again, fenced
    finally:
        lab.stop()


def test_lab_up_notices_its_daemon_died_reaps_and_restarts_it():
    """Trial finding 18: after kill -9 of the lab's agent-host daemon the lab said nothing, left
    a <defunct> zombie and ran on without a daemon. Now it prints a line with the pid and the
    signal, reaps it, and starts a new daemon, which the lab's stop also ends."""
    import os
    import queue
    import re
    import signal
    import threading
    import time
    from pathlib import Path

    proc = _popen_lab_up()
    try:
        seen, shown = _read_until_banner(proc)
        workdir = Path(shown)
        config = str(workdir / "agent-host.yaml")
        (daemon,) = [int(p.split(":")[0]) for p in running(str(workdir))
                     if "agent-host --config" in p and config in p]
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        os.kill(daemon, signal.SIGKILL)
        said = ""
        while not said:
            try:
                line = lines.get(timeout=60)  # the old lab said nothing: fail, do not hang
            except queue.Empty:
                break
            seen.append(line)
            if "agent-host daemon" in line and "exited" in line:
                said = line
        assert said.startswith(f"lab: the agent-host daemon (pid {daemon}) exited with signal "
                               "SIGKILL after "), "".join(seen)[-3000:]
        new = int(re.search(r"restarted it \(pid (\d+)\)", said).group(1))
        assert new != daemon
        # Reaped: no <defunct> entry is left for the old pid.
        assert not Path(f"/proc/{daemon}").exists(), Path(f"/proc/{daemon}/stat").read_text()
        # Popen returns once exec has begun; the kernel sets the new program's command line a
        # moment later (load_elf_binary after the close-on-exec pipe closed), so /proc/<pid>/
        # cmdline can still read empty: look again for a few seconds (seen once under load).
        deadline = time.monotonic() + 10
        while not any(p.startswith(f"{new}:") for p in running(str(workdir))) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(p.startswith(f"{new}:") for p in running(str(workdir))), running(str(workdir))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 0, "".join(seen)[-3000:]
    assert running(str(workdir)) == []


def test_lab_up_leaves_its_daemon_down_on_the_third_quick_death_in_a_row(tmp_path, monkeypatch):
    """Second trial finding 6: the README says the daemon is not restarted once it died 3 times
    in a row within 30 s of its start; it was restarted after the 3rd and given up on the 4th.
    Real processes that exit at once stand in for a daemon that dies at its start."""
    import subprocess
    import sys

    from testflinger_magic.lab import lab as labmod

    lab = Lab(LabOptions(workdir=tmp_path / "lab", devices=1, gpus=1))
    lab.workdir.mkdir(parents=True)
    lab.daemon_config = lab.workdir / "agent-host.yaml"
    started = []

    def quick_death():
        lab.daemon_proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        lab._daemon_started_at = labmod.time.monotonic()
        started.append(lab.daemon_proc)
        return lab.daemon_proc

    monkeypatch.setattr(lab, "start_daemon_process", quick_death)
    quick_death()
    lines = []
    for _ in range(labmod.DAEMON_RESTARTS):
        lab.daemon_proc.wait()
        lines.append(lab.check_daemon())
    assert labmod.DAEMON_RESTARTS == 3 and labmod.DAEMON_YOUNG == 30.0  # the README's figures
    assert all("exited with status 3" in line and "; restarted it (pid " in line
               for line in lines[:-1]), lines
    assert "; not restarted (it died 3 times in a row within 30s of its start)" in lines[-1], lines
    assert len(started) == 3 and lab.daemon_proc is None
    assert lab.check_daemon() is None  # said once; left down
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert "unless it died 3 times in a row within 30 s of\n  its start" in readme


def test_a_daemon_that_ran_long_enough_resets_the_quick_deaths(tmp_path, monkeypatch):
    import subprocess
    import sys

    from testflinger_magic.lab import lab as labmod

    lab = Lab(LabOptions(workdir=tmp_path / "lab", devices=1, gpus=1))
    lab.workdir.mkdir(parents=True)
    lab.daemon_config = lab.workdir / "agent-host.yaml"

    def death(ran: float):
        lab.daemon_proc = subprocess.Popen([sys.executable, "-c", "pass"])
        lab._daemon_started_at = labmod.time.monotonic() - ran
        lab.daemon_proc.wait()

    monkeypatch.setattr(lab, "start_daemon_process", lambda: subprocess.Popen(["true"]))
    lines = []
    for ran in (0, 0, labmod.DAEMON_YOUNG + 1, 0, 0):  # the long run breaks the row
        death(ran)
        lines.append(lab.check_daemon())
    assert all("; restarted it" in line for line in lines), lines
    death(0)  # the 3rd quick death in a row since the long run
    assert "not restarted (it died 3 times in a row" in lab.check_daemon()


def test_the_lab_binds_its_agent_host_when_agent_hosts_are_admin_bound(tmp_path, monkeypatch):
    """TRIAL14 F8: with TESTFLINGER_MAGIC_AGENT_HOSTS=admin-bound the lab's daemon was refused
    (no admin had bound its host) and ``lab up`` timed out; the lab, its own admin, binds it."""
    monkeypatch.setenv("TESTFLINGER_MAGIC_AGENT_HOSTS", "admin-bound")
    lab = Lab(LabOptions(workdir=tmp_path / "lab", devices=1, gpus=1))
    try:
        lab.start()
        host = lab.db.magic_agent_hosts.find_one({})
        assert host["client_id"] == "lab-agent-host" and host["devices"] == ["gpu-host-01"]
        assert lab.plugin.engine.binding_mode == "admin-bound"
    finally:
        lab.stop()


def test_lab_up_restarts_its_testflinger_server_alone_on_sighup():
    """TRIAL15 F3: the lab had no way to restart its Testflinger server alone (its database is
    in memory, in the ``lab up`` process), so a server restart mid-bring-up could not be
    rehearsed. SIGHUP now restarts the job service and plugin on the same database, port and
    clients: a job submitted before it, whose lease was in bring-up, completes after it, and
    the lease is the same one."""
    import os
    import queue
    import re
    import signal
    import threading
    import time
    from pathlib import Path

    import requests

    proc = _popen_lab_up()
    try:
        seen, shown = _read_until_banner(proc)
        url = re.search(r"Testflinger server: (\S+)", "".join(seen)).group(1)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        job = yaml.safe_load((Path(__file__).parents[1] / "examples" / "jobs" / "gpu-smoke.yaml")
                             .read_text())
        job.pop("job_priority")  # a priority needs a client with max_priority (anonymous here)
        job_id = requests.post(f"{url}/v1/job", json=job, timeout=10).json()["job_id"]
        deadline = time.monotonic() + 60
        leases = []
        while not leases and time.monotonic() < deadline:
            leases = requests.get(f"{url}/v1/magic/leases", timeout=10).json()["leases"]
            time.sleep(0.2)
        assert leases, "no lease within 60 s"
        lease_id = leases[0]["_id"]
        os.kill(proc.pid, signal.SIGHUP)
        said = ""
        while not said:
            line = lines.get(timeout=60)
            seen.append(line)
            if line.startswith("lab: restart"):
                said = line
        assert said.startswith(f"lab: restarted the Testflinger server at {url} in "), said
        state = None
        deadline = time.monotonic() + 240
        while state != "complete" and time.monotonic() < deadline:
            r = requests.get(f"{url}/v1/result/{job_id}", timeout=10)
            state = r.json().get("job_state") if r.status_code == 200 else None
            time.sleep(0.5)
        assert state == "complete", "".join(seen)[-3000:]
        after = requests.get(f"{url}/v1/magic/leases/{lease_id}", timeout=10)
        assert after.status_code == 200 and after.json()["_id"] == lease_id
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 0, "".join(seen)[-3000:]


def test_a_lab_server_restart_keeps_what_the_operator_applied(tmp_path):
    """Trial finding: the lab's ``kill -HUP`` restart re-applied its start-up definitions over
    the operator's ``apply``: a removed one-gpu-vm came back and a changed idle_timeout fell
    back to the lab's. The restarted server (Lab.restart_jobservice, the SIGHUP path) keeps
    them (server/startup.py)."""
    import requests

    lab = Lab(LabOptions(workdir=tmp_path / "lab", devices=1, gpus=1))
    try:
        lab._load_definitions()
        lab._start_jobservice()
        assert lab.db.magic_queues.find_one({"_id": "one-gpu-vm"}) is not None
        two = next(q for q in lab.definitions if q.name == "two-gpu-vm").to_yaml_dict()
        two["policy"]["idle_timeout"] = "30s"
        headers = {"Authorization": f"Bearer {lab.admin_token}"}
        r = requests.put(f"{lab.server_url}/v1/magic/queues", headers=headers, timeout=10,
                         json={"yaml": yaml.safe_dump({"magic_queues": {"two-gpu-vm": two}}),
                               "source": "q_two_only.yaml"})
        assert r.status_code == 200 and r.json()["removed"] == ["one-gpu-vm"], r.text
        assert lab.restart_jobservice().startswith("lab: restarted the Testflinger server")
        r = requests.get(f"{lab.server_url}/v1/magic/queues", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        got = {q["_id"]: q for q in r.json()["queues"]}
        assert list(got) == ["two-gpu-vm"], r.text
        assert got["two-gpu-vm"]["policy"]["idle_timeout"] == 30
        assert lab.db.magic_removed_queues.find_one({"_id": "one-gpu-vm"}) is not None
    finally:
        lab.stop()


@pytest.mark.parametrize("option", [["--maas-version", "2.9.2"], ["--uncommissioned"]],
                         ids=["maas-2.9.2", "uncommissioned"])
def test_lab_up_rehearses_a_maas_that_cannot_count_the_nvswitches(tmp_path, option):
    """TRIAL finding: the operator guide's NVSwitch paths where MAAS cannot give the count (a
    MAAS older than 3.0, a machine whose commissioning recorded no device) could not be tried
    on the lab. ``lab up``'s options reach the MAAS simulator (no node devices API below 3.0;
    an empty list for the uncommissioned machines) and the daemon registers the lab's
    devices without an NVSwitch count (the default lab registers 4, from MAAS)."""
    import requests

    from testflinger_magic import cli
    from testflinger_magic.lab import labup

    args = cli.build_parser().parse_args(["lab", "up", "--devices", "1", "--gpus", "1", *option])
    opt = labup.lab_options(args, tmp_path / "lab")
    lab = Lab(opt)
    try:
        lab.start()
        sid = lab.device_system_ids["gpu-host-01"]
        from test_maas_sim import oauth

        headers = oauth(lab.maas_key)
        version = requests.get(f"{lab.maas_url}api/2.0/version/", timeout=10).json()["version"]
        listed = requests.get(f"{lab.maas_url}api/2.0/nodes/{sid}/devices/", timeout=10,
                              headers=headers)
        log = (lab.workdir / "daemon.log").read_text(errors="replace")
        if "--uncommissioned" in option:
            assert (version, listed.status_code, listed.json()) == ("3.5.0", 200, []), listed.text
        else:
            assert (version, listed.status_code) == ("2.9.2", 404), listed.text
            assert "has no node devices API (older than 3.0)" in log, log[-3000:]
        doc = lab.db.magic_devices.find_one({"_id": "gpu-host-01"})
        assert doc is not None and doc.get("nvswitches") is None, doc
        assert doc.get("nvswitches_found") is None, doc
        assert "no node devices" in labup.maas_flavour(opt)
    finally:
        lab.stop()
