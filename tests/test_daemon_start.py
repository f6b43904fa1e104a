"""What the agent-host daemon refuses at its start (real subprocesses, real supervisord, the lab's
job service and MAAS simulator): a ``state_dir`` it cannot create or write (trial finding 6:
it used to register and fail every lease lent to it), and a second daemon on one ``state_dir``
(finding 7: two daemons raced on the same leases), and a second daemon of one agent host with
another ``state_dir`` (second trial finding 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from daemon_lab import lab  # noqa: F401 (fixture)
from test_daemon_stop import LIMIT, log_text, reap, start_daemon, wait_until
from testflinger_magic import cli
from testflinger_magic.agent_host.daemon import Daemon
from testflinger_magic.agent_host.statedir import LOCK_NAME, StateDirBusy, StateLock


def run_daemon(config_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testflinger_magic.cli", "agent-host",
                           "--config", str(config_path)], capture_output=True, text=True,
                          timeout=LIMIT)


def test_a_state_dir_that_cannot_be_created_is_refused_by_daemon_and_check(lab, capsys):
    path = lab.write_config(state_dir="/proc/nope")
    proc = run_daemon(path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"{path}: state_dir: cannot create /proc/nope" in proc.stdout, proc.stdout
    # Nothing was registered: no device of it could be lent.
    assert lab.db.magic_agent_hosts.count_documents({}) == 0
    code = cli.main(["agent-host", "check", "--config", str(path), "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert code == 1 and any(p.startswith("state_dir: cannot create /proc/nope")
                             for p in problems), problems


def test_a_read_only_state_dir_is_refused(lab, tmp_path):
    if os.geteuid() == 0:
        return  # root writes anyway; /proc above covers the refusal
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        proc = run_daemon(lab.write_config(state_dir=str(ro)))
    finally:
        ro.chmod(0o700)
    assert proc.returncode == 2 and f"state_dir: cannot write in {ro}" in proc.stdout, proc.stdout


def test_check_reports_a_missing_supervisor_socket(lab, capsys):
    path = lab.write_config(supervisor={"url": f"unix://{lab.tmp}/nope.sock",
                                        "conf_dir": str(lab.sv.conf_dir), "program_user": None})
    code = cli.main(["agent-host", "check", "--config", str(path), "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert code == 1 and f"supervisor.url: no supervisord socket at {lab.tmp}/nope.sock" in \
        " ".join(problems), problems


def test_a_second_daemon_on_the_same_state_dir_is_refused_naming_the_first(lab):
    proc, log = start_daemon(lab)
    try:
        wait_until(lambda: lab.db.magic_agent_hosts.count_documents({}) == 1,
                   "the first daemon to register")
        second = run_daemon(lab.tmp / "agent-host.yaml")
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert f"another agent-host daemon (pid {proc.pid} since" in second.stdout, second.stdout
        assert "one daemon per agent host and state_dir" in second.stdout
        assert proc.poll() is None  # the first one runs on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=LIMIT) == 0, log_text(lab)
    finally:
        reap(proc, log)
    # The lock went with the first: a new start gets it.
    with StateLock(lab.tmp / "state") as lock:
        assert (lab.tmp / "state" / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")
        try:
            StateLock(lab.tmp / "state").acquire()
        except StateDirBusy as exc:
            assert f"pid {os.getpid()}" in str(exc)
        else:
            raise AssertionError("a second lock in one process was granted")
        assert lock is not None


def test_the_servers_registration_refusals_name_the_field(lab):
    """What a daemon's config check now refuses, a registration sent anyway (an older daemon) is
    refused by the server naming the field (trial finding 12: "HTTP 422: Validation error",
    "not found: Not Found")."""
    import pytest

    from testflinger_magic.agent_host.client import MagicClient, ServerError

    client = MagicClient(lab.server.url, "host", lab.clients["host"]["secret"])
    device = {"agent_name": "gpu-host-01", "maas_system_id": lab.system_ids["gpu-host-01"],
              "gpus": 65, "tags": [], "home_queues": []}
    with pytest.raises(ServerError) as err:
        client.register("test-agent-host", [device])
    assert "HTTP 422: Validation error: devices.0.gpus: Must be greater than or equal to 0 " \
           "and less than or equal to 64" in str(err.value), str(err.value)
    with pytest.raises(ServerError) as err:
        client.register("bad host", [dict(device, gpus=2)])
    assert "HTTP 422: Validation error: agent_host: 'bad host': letters, digits" in \
        str(err.value), str(err.value)
    assert lab.db.magic_agent_hosts.count_documents({}) == 0


def test_a_second_daemon_of_the_same_agent_host_with_another_state_dir_is_refused(lab):
    """Second trial finding 1: a copy of the config with another state_dir started a second
    daemon of the same agent host, and both worked the same leases. The machine-wide lock keyed
    by agent_host refuses it naming the first's pid and config; a kill -9 of the first frees it
    at once (a crashed daemon's restart is never refused).

    Once the lock is free, the server still refuses the other state_dir's daemon (another
    instance, agent_host/instance.py: as a daemon on another machine would be) while the
    killed one's last heartbeat is fresh: it exits 2 with the server's message, having
    registered nothing. The killed daemon's own restart (same machine and state_dir, so the
    same instance) is accepted at once."""
    proc, log = start_daemon(lab)
    first_config = str(lab.tmp / "agent-host.yaml")
    second_path = lab.tmp / "second.yaml"
    second_path.write_text(yaml.safe_dump(lab.config_dict(state_dir=str(lab.tmp / "state2"))))
    second_path.chmod(0o600)
    try:
        wait_until(lambda: lab.db.magic_agent_hosts.count_documents({}) == 1,
                   "the first daemon to register")
        second = run_daemon(second_path)
        assert second.returncode == 2, (second.stdout, second.stderr)
        out = second.stdout
        assert f"{second_path}: agent_host: another agent-host daemon for agent host " \
               f"'{lab.config().agent_host}' runs on this machine (pid {proc.pid} since " in out, out
        assert f"config {first_config};" in out, out
        assert "one daemon per agent host, whatever its state_dir" in out, out
        assert proc.poll() is None  # the first one runs on
        # The refused one left no state_dir lock behind, and the first never lost its own.
        with StateLock(lab.tmp / "state2"):
            pass
        proc.kill()  # a crash: the kernel drops both flocks
        proc.wait(timeout=LIMIT)
    finally:
        reap(proc, log)
    first_instance = lab.db.magic_agent_hosts.find_one({})["instance"]
    assert first_instance.endswith(f":{(lab.tmp / 'state').resolve()}"), first_instance
    other = run_daemon(second_path)
    assert other.returncode == 2, (other.stdout, other.stderr)
    assert f"{second_path}: agent_host: register {lab.config().agent_host}: refused: agent " \
           f"host {lab.config().agent_host} is run by another daemon instance " \
           f"'{first_instance}' (last heartbeat " in other.stdout, other.stdout
    assert "Stop one of them" in other.stdout and "Traceback" not in other.stderr, other.stderr
    assert lab.db.magic_agent_hosts.find_one({})["instance"] == first_instance
    third, log3 = start_daemon(lab)
    try:
        lock_file = next((lab.tmp / "locks").glob("testflinger-magic-agent-host-*.lock"))
        wait_until(lambda: lock_file.read_text().startswith(f"pid {third.pid} "),
                   "the restarted daemon to take the agent host's lock")
        wait_until(lambda: log_text(lab).count("registered agent host") == 2,
                   "the restarted daemon to register")
        assert lab.db.magic_agent_hosts.find_one({})["instance"] == first_instance
        assert third.poll() is None, log_text(lab)
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=LIMIT) == 0, log_text(lab)
    finally:
        reap(third, log3)


def test_a_daemon_refused_by_the_server_works_no_lease_and_reports_nothing(lab):
    """Another machine's daemon holds the agent host (server/hostinstance.py): a daemon whose
    registration is refused stops before working any lease (run_forever returns, ``refused``
    holds the server's message, nothing of it registered); one refused at a later heartbeat
    (the other took the host over while this one was cut off) starts no step and reports
    nothing more, so the lease stays as the server has it."""
    import time

    other = "other-machine/9f00aa11bb22:/var/lib/testflinger-magic"
    first = Daemon(lab.config())
    first.register()
    mine = lab.db.magic_agent_hosts.find_one({})["instance"]
    assert mine == first.instance and mine != other
    # Another machine's daemon of this agent host starts while this one heartbeats.
    refused = Daemon(lab.config(poll_wait=1), instance=other)
    refused.run_forever()
    assert refused.stopping and refused.refused is not None
    assert f"is run by another daemon instance '{mine}'" in str(refused.refused)
    assert refused.refused.data["caller"] == other
    assert lab.db.magic_agent_hosts.find_one({})["instance"] == mine

    lease_id = lab.lend()
    # ... and takes the host over while ``first`` is cut off (its heartbeat went stale).
    lab.db.magic_agent_hosts.update_one({}, {"$set": {"instance": other,
                                                      "last_heartbeat": time.time()}})
    first._last_heartbeat = 0.0  # due now
    first._heartbeat()
    assert first.stopping and f"'{other}'" in str(first.refused)
    assert first.run_once(block=True) == [] and first.in_flight() == []
    lease = lab.lease(lease_id)
    new, accepted = first._report(lease_id, None, {"state": lease["state"],
                                                   "generation": lease["generation"],
                                                   "result": "ok", "to_state": "fenced"})
    assert (new, accepted) == (None, False)
    assert (lab.lease(lease_id)["state"], lab.lease(lease_id)["generation"]) == \
        (lease["state"], lease["generation"]) == ("claimed", 0)


def test_host_lock_folder_and_a_lock_file_of_another_user(tmp_path, monkeypatch):
    """Without host_lock_dir the lock goes to the first writable of /run/lock, /tmp; a lock
    file this user cannot write (another user's daemon made it) is opened read-only and still
    locks."""
    from testflinger_magic.agent_host import statedir

    assert statedir.host_lock_dir(None) in {Path(d) for d in statedir.HOST_LOCK_DIRS}
    monkeypatch.setattr(statedir, "HOST_LOCK_DIRS", (str(tmp_path / "missing"), str(tmp_path)))
    assert statedir.host_lock_dir(None) == tmp_path
    lock = statedir.HostLock("h1", "/etc/a.yaml")
    assert lock.path == tmp_path / "testflinger-magic-agent-host-h1.lock"
    with lock:
        assert lock.path.read_text().startswith(f"pid {os.getpid()} since ")
        assert oct(lock.path.stat().st_mode & 0o777) == oct(0o644)
        try:
            statedir.HostLock("h1", "/etc/b.yaml").acquire()
        except statedir.HostBusy as exc:
            assert "config /etc/a.yaml" in str(exc) and f"pid {os.getpid()}" in str(exc)
        else:
            raise AssertionError("a second lock of one agent host was granted")
        with statedir.HostLock("h2"):  # another agent host is another lock
            pass
    if os.geteuid() != 0:  # root writes anyway
        lock.path.chmod(0o444)
        with statedir.HostLock("h1", "/etc/c.yaml") as ro:
            assert ro.path.read_text().startswith(f"pid {os.getpid()} since ")  # not rewritten
            try:
                statedir.HostLock("h1").acquire()
            except statedir.HostBusy:
                pass
            else:
                raise AssertionError("a read-only lock file did not lock")
