"""Pre-warmed VM agents: agent_launcher.py run for real (subprocesses with a fake
testflinger-agent installation, tests/fake_agent.py), the pure command wrapping of prewarm.py,
and AgentProcesses starting pre-warmed programs under a real supervisord."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import fake_agent
from testflinger_magic.agent_host import prewarm
from testflinger_magic.agent_host.agents import (
    AgentProcesses, parse_program_ports, program_conf_text, same_program,
)
from testflinger_magic.agent_host.supervisor_proc import Supervisord

LAUNCHER = str(prewarm.LAUNCHER_SOURCE)
#: Give-up time (s) for something that must happen; not a speed goal.
GIVE_UP = 30.0


SYSTEM_PYTHON = "/usr/bin/python3"


def system_python_ok() -> bool:
    """Whether /usr/bin/python3 is a Python 3.10+ (the launcher's floor)."""
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c",
                              "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True, timeout=GIVE_UP)
    except OSError:
        return False
    return out.stdout.strip() == "True"


def wait_until(cond, what: str):
    end = time.monotonic() + GIVE_UP
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def agent(tmp_path):
    """``(script, agent folder, trace dir)`` of a fake agent install; the folder is where its
    config (and so its go file) lives."""
    script = fake_agent.make(tmp_path / "venv")
    folder = tmp_path / "agent-configs" / "dev-vm1"
    folder.mkdir(parents=True)
    (folder / "testflinger-agent.conf").write_text("agent_id: dev-vm1\n")
    traces = tmp_path / "traces"
    traces.mkdir()
    return script, folder, traces


def launch(go: Path, command: list[str], **kw) -> subprocess.Popen:
    """``python agent_launcher.py <go> <command...>`` as a real process."""
    return subprocess.Popen([sys.executable, LAUNCHER, str(go), *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_console_script_is_imported_before_its_go_file_and_run_after(agent):
    script, folder, traces = agent
    go = prewarm.go_path(folder)
    args = ["-c", str(folder / "testflinger-agent.conf"), "-p", "8123", "--trace-dir",
            str(traces), "--exit", "7"]
    proc = launch(go, [str(script), *args])
    try:
        first = wait_until(lambda: fake_agent.events(traces, "dev-vm1"), "the pre-import")
        # Imported while there was no go file; main not run; still waiting.
        assert [e["event"] for e in first] == ["import"] and first[0]["go"] is False
        assert proc.poll() is None
        # The argv the agent's imports see is already the original command's.
        assert first[0]["argv"] == [str(script), *args]
        go.touch()
        out, err = proc.communicate(timeout=GIVE_UP)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7, err
    events = fake_agent.events(traces, "dev-vm1")
    assert [e["event"] for e in events] == ["import", "main"]  # imported once, not again
    main = events[1]
    assert main["go"] is True and main["pid"] == proc.pid
    # sys.argv as if the script was started directly (pip's script strips nothing here).
    assert main["argv"] == [str(script), *args]


def test_module_form_imports_its_dependencies_and_passes_argv_and_status(agent):
    script, folder, traces = agent
    go = prewarm.go_path(folder)
    args = ["-c", str(folder / "testflinger-agent.conf"), "-p", "8124", "--trace-dir",
            str(traces), "--exit", "3"]
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    proc = launch(go, ["-m", "fakeagent.mainmod", *args], env=env)
    try:
        seen = wait_until(lambda: len(fake_agent.events(traces, "dev-vm1")) >= 2 and
                          fake_agent.events(traces, "dev-vm1"), "the pre-import")
        assert [e["event"] for e in seen] == ["import", "import dep"]
        assert not any(e["go"] for e in seen)
        assert proc.poll() is None
        go.touch()
        _out, err = proc.communicate(timeout=GIVE_UP)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    events = fake_agent.events(traces, "dev-vm1")
    assert [e["event"] for e in events] == ["import", "import dep", "main"]
    # python -m sets sys.argv[0] to the module's file.
    assert events[-1]["argv"] == [str(script.parent / "fakeagent" / "mainmod.py"), *args]
    assert events[-1]["go"] is True


def test_a_module_without_main_guard_is_not_run_before_its_go_file(agent):
    """Like a package's ``__main__.py``: its body starts the agent, so only its imports are
    pre-imported (executing it under another name would run the agent while fenced)."""
    script, folder, traces = agent
    go = prewarm.go_path(folder)
    args = ["-c", str(folder / "testflinger-agent.conf"), "--trace-dir", str(traces),
            "--exit", "0"]
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    proc = launch(go, ["-m", "fakeagent.noguard", *args], env=env)
    try:
        wait_until(lambda: len(fake_agent.events(traces, "dev-vm1")) >= 2, "the pre-import")
        assert "main" not in [e["event"] for e in fake_agent.events(traces, "dev-vm1")]
        assert proc.poll() is None
        go.touch()
        proc.communicate(timeout=GIVE_UP)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert [e["event"] for e in fake_agent.events(traces, "dev-vm1")][-1] == "main"


def test_sigterm_while_waiting_ends_it_at_once_and_sigusr1_is_ignored(agent):
    script, folder, traces = agent
    go = prewarm.go_path(folder)
    args = ["-c", str(folder / "testflinger-agent.conf"), "--trace-dir", str(traces)]
    # SIGUSR1 (the charm's ``supervisorctl signal USR1 all``) does not end a waiting launcher:
    # it goes on to run the agent once the go file exists.
    proc = launch(go, [str(script), *args, "--exit", "5"])
    try:
        wait_until(lambda: fake_agent.events(traces, "dev-vm1"), "the pre-import")
        proc.send_signal(signal.SIGUSR1)
        go.touch()
        proc.communicate(timeout=GIVE_UP)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5
    go.unlink()
    (traces / "dev-vm1.jsonl").unlink()
    # SIGTERM (supervisord's stop) ends it: killed by the signal, the agent never ran.
    proc = launch(go, [str(script), *args, "--exit", "0"])
    try:
        wait_until(lambda: fake_agent.events(traces, "dev-vm1"), "the pre-import")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=GIVE_UP)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert [e["event"] for e in fake_agent.events(traces, "dev-vm1")] == ["import"]


def test_go_file_already_there_runs_at_once_and_errors_pass_through(agent):
    script, folder, traces = agent
    go = prewarm.go_path(folder)
    go.touch()
    args = ["-c", str(folder / "testflinger-agent.conf"), "--trace-dir", str(traces),
            "--raise"]
    proc = launch(go, [str(script), *args])
    _out, err = proc.communicate(timeout=GIVE_UP)
    # As Python itself: an uncaught exception prints its traceback and exits 1.
    assert proc.returncode == 1
    assert "RuntimeError: fake agent failed" in err
    assert [e["event"] for e in fake_agent.events(traces, "dev-vm1")] == ["import", "main"]


def test_bad_launcher_command_lines_exit_2(tmp_path):
    for argv in ([], [str(tmp_path / "go")], [str(tmp_path / "go"), "-m"]):
        proc = subprocess.run([sys.executable, LAUNCHER, *argv], capture_output=True, text=True,
                              timeout=GIVE_UP)
        assert proc.returncode == 2 and "usage:" in proc.stderr, argv


def test_the_launcher_imports_nothing_of_testflinger_magic():
    """It runs under the agent's own venv Python, where testflinger-magic is not installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='not_main'); "
            "print(sorted(m for m in sys.modules if m.startswith('testflinger_magic')))")
    out = subprocess.run([sys.executable, "-I", "-c", code, LAUNCHER], capture_output=True,
                         text=True, env=env, timeout=GIVE_UP, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- pure: which commands are pre-warmed, and how ------------------------------------------------

def test_wrap_console_script_with_python_shebang():
    argv = ["/srv/testflinger-venv/bin/testflinger-agent", "-c", "/a/vm1/c.conf", "-p", "8001"]
    wrapped = prewarm.wrap_argv(argv, "/s/agent_launcher.py", "/a/vm1/.go",
                                "#!/srv/testflinger-venv/bin/python3\n")
    assert wrapped == ["/srv/testflinger-venv/bin/python3", "/s/agent_launcher.py",
                       "/a/vm1/.go", *argv]
    assert prewarm.unwrap_argv(wrapped) == argv
    env = prewarm.wrap_argv(argv, "/s/agent_launcher.py", "/g", "#!/usr/bin/env python3\n")
    assert env[:3] == ["/usr/bin/env", "python3", "/s/agent_launcher.py"]
    assert prewarm.unwrap_argv(env) == argv


def test_wrap_module_form():
    argv = ["/venv/bin/python3.12", "-m", "testflinger_magic.lab.sim_agent", "-c", "c", "-p", "9"]
    wrapped = prewarm.wrap_argv(argv, "/s/agent_launcher.py", "/g", None)
    assert wrapped == ["/venv/bin/python3.12", "/s/agent_launcher.py", "/g", *argv[1:]]
    assert prewarm.unwrap_argv(wrapped) == argv


@pytest.mark.parametrize("argv, first_line", [
    (["/usr/bin/sleep", "3600", "-p", "8001"], "\x7fELF\x02\x01"),       # not a script
    (["/opt/agent.sh", "-p", "8001"], "#!/bin/sh\n"),                    # not Python
    (["/usr/bin/python3", "-c", "import time", "-p", "8001"], "\x7fELF"),  # -c, not -m
    (["/usr/bin/python3", "-u", "-m", "agent", "-p", "8001"], "\x7fELF"),  # options before -m
    (["testflinger-agent", "-p", "8001"], "#!/usr/bin/python3\n"),       # PATH lookup
    (["/venv/bin/agent", "-p", "8001"], None),                           # unreadable
    (["/venv/bin/agent", "-p", "8001"],                                  # pip's sh trampoline
     "#!/bin/sh\n"),
    (["/usr/bin/python3", "-m", "-p", "8001"], "\x7fELF"),
])
def test_commands_the_launcher_cannot_run_are_not_wrapped(argv, first_line):
    assert prewarm.wrap_argv(argv, "/s/agent_launcher.py", "/g", first_line) is None


def test_wrapped_command_keeps_its_port_for_the_charm_and_our_discovery(tmp_path):
    script = fake_agent.make(tmp_path)
    command = f"{script} -c /a/vm1/testflinger-agent.conf -p 8123"
    wrapped = prewarm.wrap_command(command, "/s/agent_launcher.py", "/a/vm1/.testflinger-magic-go")
    assert wrapped is not None and prewarm.is_wrapped(wrapped)
    assert shlex.split(wrapped)[:2] == [sys.executable, "/s/agent_launcher.py"]
    assert parse_program_ports(program_conf_text("vm1", wrapped)) == {"vm1": 8123}
    assert prewarm.wrap_command(command, None, "/g") is None
    # A command that is not a Python script stays as it is.
    assert prewarm.wrap_command("/bin/sleep 3600 -p 8123", "/s/agent_launcher.py", "/g") is None


def test_the_charms_port_parse_finds_the_port_of_a_pre_warmed_production_command():
    """The agent-host charm reads a conf.d program's port when its ``command=`` line holds
    ``testflinger-agent`` and ``-p N`` (src/supervisord.py ``parse_supervisor_config_file``:
    ``TESTFLINGER_AGENT_CMD in line`` then ``re.search(r"-p (\\d+)", line)``, the first match)."""
    import re

    argv = ["/srv/testflinger-venv/bin/testflinger-agent", "-c",
            "/srv/agent-configs/lab/gpu-01-vm1/testflinger-agent.conf", "-p", "8042"]
    wrapped = prewarm.wrap_argv(
        argv, "/var/snap/testflinger-magic-agent-host/common/state/agent_launcher.py",
        "/srv/agent-configs/lab/gpu-01-vm1/.testflinger-magic-go",
        "#!/srv/testflinger-venv/bin/python3\n")
    text = program_conf_text("gpu-01-vm1", shlex.join(wrapped), "root")
    line = next(raw.strip() for raw in text.splitlines() if raw.startswith("command="))
    assert "testflinger-agent" in line
    assert re.search(r"-p (\d+)", line).group(1) == "8042"
    assert parse_program_ports(text) == {"gpu-01-vm1": 8042}


def test_a_running_program_is_the_same_with_or_without_pre_warm(tmp_path):
    """Switching pre-warm (upgrade, config) never rewrites a program file, which would restart
    an agent that may be running a job; another port is another program."""
    script = fake_agent.make(tmp_path)
    plain = f"{script} -c /a/vm1/testflinger-agent.conf -p 8123"
    wrapped = prewarm.wrap_command(plain, "/s/agent_launcher.py", "/a/vm1/.testflinger-magic-go")
    assert same_program(program_conf_text("vm1", plain), program_conf_text("vm1", wrapped))
    assert same_program(program_conf_text("vm1", wrapped), program_conf_text("vm1", plain))
    other = plain.replace("8123", "8124")
    assert not same_program(program_conf_text("vm1", wrapped), program_conf_text("vm1", other))


def test_install_launcher_copies_it_readable_and_refuses_a_user_who_cannot_read_it(tmp_path):
    state = tmp_path / "state"
    path = prewarm.install_launcher(state)
    assert path == state / prewarm.LAUNCHER_NAME
    assert path.read_text() == prewarm.LAUNCHER_SOURCE.read_text()
    assert path.stat().st_mode & 0o777 == 0o644
    path.write_text("stale")
    assert prewarm.install_launcher(state).read_text() == prewarm.LAUNCHER_SOURCE.read_text()
    if os.geteuid() != 0:
        pytest.skip("needs root to judge another user's access")
    import pwd

    other = next(p.pw_name for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))
    # pytest's tmp_path is under a 0700 folder: another user's view needs one of its own.
    base = Path(tempfile.mkdtemp(prefix="tf-magic-prewarm-"))
    try:
        os.chmod(base, 0o755)
        state = base / "state"
        path = prewarm.install_launcher(state, other)
        assert path == state / prewarm.LAUNCHER_NAME
        os.chmod(base, 0o700)
        assert prewarm.unreadable_reason(path, other) == f"{other} cannot enter {base}"
        assert prewarm.install_launcher(state, other) is None
    finally:
        shutil.rmtree(base)


def test_go_files(tmp_path):
    assert prewarm.write_go(tmp_path) is True
    assert prewarm.write_go(tmp_path) is False
    assert prewarm.go_path(tmp_path).exists()
    assert prewarm.clear_go(tmp_path) is True
    assert prewarm.clear_go(tmp_path) is False


# -- under a real supervisord ------------------------------------------------------------------

def test_pre_warmed_programs_run_waiting_until_their_go_file(tmp_path, agent):
    script, _folder, traces = agent
    command = f"{script} -c {{config}} -p {{port}} --trace-dir {traces}"
    with Supervisord(tmp_path / "sv") as sv:
        procs = AgentProcesses(sv.url, sv.conf_dir, command, lock_path=tmp_path / "ports.json",
                               launcher=LAUNCHER)
        folders = {n: tmp_path / "agent-configs" / n for n in ("dev-vm1", "dev-vm2")}
        programs = [(n, d, procs.allocate_port(owner=n)) for n, d in folders.items()]
        assert procs.add_prewarmed_vm_agents(programs) == sorted(folders)
        # Spawned and waiting (their folders not even rendered yet), ports still in conf.d.
        assert {n: procs.state(n) for n in folders} == {n: "RUNNING" for n in folders}
        assert procs.ports() == {n: p for n, _d, p in programs}
        pids = {n: procs._infos()[n]["pid"] for n in folders}
        for name in folders:
            wait_until(lambda: fake_agent.events(traces, name), f"{name}'s pre-import")
        assert all(e["event"] == "import" and not e["go"]
                   for n in folders for e in fake_agent.events(traces, n))
        # Its go file lets one run: the same process, main after the go file.
        prewarm.write_go(folders["dev-vm1"])
        wait_until(lambda: len(fake_agent.events(traces, "dev-vm1")) == 2, "dev-vm1's main")
        main = fake_agent.events(traces, "dev-vm1")[-1]
        assert main["event"] == "main" and main["go"] and main["pid"] == pids["dev-vm1"]
        assert [e["event"] for e in fake_agent.events(traces, "dev-vm2")] == ["import"]
        # ensure() leaves the waiting and the running ones as they are (no restart).
        for d in folders.values():
            d.mkdir(exist_ok=True)
            (d / "testflinger-agent.conf").write_text("agent_id: x\n")
        assert procs.ensure({n: (d, p) for n, d, p in programs}) == []
        assert {n: procs._infos()[n]["pid"] for n in folders} == pids
        procs.remove_vm_agent("dev-vm2")
        assert procs.state("dev-vm2") == "ABSENT"
        assert [e["event"] for e in fake_agent.events(traces, "dev-vm2")] == ["import"]


def test_without_a_launcher_or_for_another_command_nothing_is_pre_warmed(tmp_path):
    with Supervisord(tmp_path / "sv") as sv:
        sleeper = f'{sys.executable} -c "import time; time.sleep(3600)" -c {{config}} -p {{port}}'
        for launcher in (None, LAUNCHER):
            procs = AgentProcesses(sv.url, sv.conf_dir, sleeper,
                                   lock_path=tmp_path / "ports.json", launcher=launcher)
            name = "dev-vm1"
            port = procs.allocate_port(owner=name)
            assert not prewarm.is_wrapped(procs.command_for(name, tmp_path / name, port))
            assert procs.add_prewarmed_vm_agents([(name, tmp_path / name, port)]) == []
            assert procs.state(name) in ("ABSENT", "STOPPED")
            procs.remove_vm_agent(name)


def test_a_go_file_the_agent_user_cannot_look_for_ends_the_launcher_with_the_reason(tmp_path):
    """Waiting would hide it (the program RUNNING for ever); exiting shows it failing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the launcher as another user")
    # Any Python 3.10+ runs the launcher; the test's own may sit where that user cannot go.
    python = SYSTEM_PYTHON if system_python_ok() else pytest.skip("no /usr/bin/python3 >= 3.10")
    base = Path(tempfile.mkdtemp(prefix="tf-magic-prewarm-"))
    try:
        os.chmod(base, 0o755)
        launcher = base / prewarm.LAUNCHER_NAME
        shutil.copy(LAUNCHER, launcher)
        os.chmod(launcher, 0o644)
        folder = base / "agent-configs" / "dev-vm1"
        folder.mkdir(parents=True)
        os.chmod(folder, 0o700)  # root's, as a folder rendered without the agent's owner
        proc = subprocess.run([python, str(launcher), str(prewarm.go_path(folder)),
                               "/bin/true"], capture_output=True, text=True, timeout=GIVE_UP,
                              user=65534, group=65534, cwd="/")
        assert proc.returncode == 2, proc.stderr
        assert "cannot look for the go file" in proc.stderr and "Permission denied" in proc.stderr
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("how", ["touch", "rename"])
def test_the_wait_wakes_on_the_go_file_through_inotify(tmp_path, monkeypatch, how):
    """The launcher's wait is woken by the go file's creation in its folder (inotify), not by
    its next look; without inotify it looks every POLL seconds."""
    import threading

    from testflinger_magic.agent_host import agent_launcher

    monkeypatch.setattr(agent_launcher, "WATCHED_POLL", GIVE_UP)  # only an event wakes it
    woken, waiting = [], threading.Event()
    real_wait = agent_launcher._FolderWatch.wait

    def recorded_wait(self, timeout):
        waiting.set()
        woken.append(real_wait(self, timeout))
        return woken[-1]

    monkeypatch.setattr(agent_launcher._FolderWatch, "wait", recorded_wait)
    go = tmp_path / "testflinger-agent.go"

    def write():
        waiting.wait(GIVE_UP)  # then written all the same: a wait never woken fails below
        if how == "touch":
            go.touch()
        else:  # written elsewhere and moved in
            (tmp_path / ".go.tmp").write_text("")
            os.replace(tmp_path / ".go.tmp", go)

    writer = threading.Thread(target=write)
    writer.start()
    agent_launcher.wait_for(str(go))
    writer.join()
    assert go.exists() and woken and woken[-1] is True


def test_the_wait_polls_where_inotify_cannot_be_had(tmp_path, monkeypatch):
    from testflinger_magic.agent_host import agent_launcher

    assert agent_launcher._FolderWatch.open(str(tmp_path / "no-such-folder")) is None
    monkeypatch.setattr(agent_launcher._FolderWatch, "open", classmethod(lambda cls, f: None))
    slept = []
    monkeypatch.setattr(agent_launcher.time, "sleep", lambda s: slept.append(s) or go.touch())
    go = tmp_path / "testflinger-agent.go"
    agent_launcher.wait_for(str(go))
    assert slept == [agent_launcher.POLL]
