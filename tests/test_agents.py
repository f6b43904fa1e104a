"""agent_host.agents and agent_host.supervisor_proc against a real supervisord."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testflinger_magic.agent_host.agents import (
    AUTOSTART_LINE,
    same_program,
    AGENT_SCHEMA,
    FOLDER_MARKER,
    MARKER,
    AgentConfigError,
    AgentProcessError,
    AgentProcesses,
    parse_program_ports,
    program_conf_text,
    remove_agent_folder,
    render_agent_folder,
    validate_agent_config,
)
from testflinger_magic.agent_host.supervisor_proc import Supervisord

TEMPLATE = Path(__file__).resolve().parent.parent / "agent_configs" / "maas2-vm"
# A stand-in agent: a real long-running process whose argv carries -c <config> -p <port>.
COMMAND = f'{sys.executable} -c "import time; time.sleep(3600)" -c {{config}} -p {{port}}'


@pytest.fixture
def sv(tmp_path):
    with Supervisord(tmp_path / "sv") as s:
        yield s


@pytest.fixture
def procs(sv, tmp_path):
    return AgentProcesses(sv.url, sv.conf_dir, COMMAND, lock_path=tmp_path / "ports.json")


def agent_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / "agents" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "testflinger-agent.conf").write_text(f"agent_id: {name}\n")
    return d


def charm_program(sv, name: str, port: int) -> None:
    """Write a device agent program the way the agent-host charm does (no marker)."""
    (sv.conf_dir / f"{name}.conf").write_text(
        f"[program:{name}]\nstartsecs=0\nredirect_stderr=true\n"
        f'command={sys.executable} -c "import time; time.sleep(3600)" testflinger-agent -p {port}\n'
    )


def supervisorctl_update(sv) -> None:
    """What `supervisorctl update` does: apply conf.d changes to the running groups."""
    rpc = sv.rpc().supervisor
    added, changed, removed = rpc.reloadConfig()[0]
    for name in removed + changed:
        rpc.stopProcessGroup(name)
        rpc.removeProcessGroup(name)
    for name in added + changed:
        rpc.addProcessGroup(name)


def pid(sv, name: str) -> int:
    return sv.rpc().supervisor.getProcessInfo(name)["pid"]


def alive(p: int) -> bool:
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    return True


# -- Supervisord helper ----------------------------------------------------------------------------

def test_supervisord_helper_runs_programs_and_stops_them(tmp_path):
    s = Supervisord(tmp_path / "sv")
    with s:
        assert s.url.startswith("unix://") and s.conf_dir.is_dir()
        assert f"files = {s.conf_dir}/*.conf" in s.conf_path.read_text()
        charm_program(s, "dev-01", 8100)
        supervisorctl_update(s)
        p = AgentProcesses(s.url, s.conf_dir, COMMAND, lock_path=tmp_path / "p.json")
        p.start("dev-01")
        child = pid(s, "dev-01")
        assert alive(child)
        s.start()  # already started: no second supervisord
        assert s.running()
    assert not s.running()
    assert not alive(child)
    s.stop()  # idempotent


# -- pure helpers ------------------------------------------------------------------------------------

def test_program_conf_text_is_charm_format_and_parses_back():
    text = program_conf_text("gpu-01-vm0", "/srv/testflinger-venv/bin/testflinger-agent -c /a/b.conf -p 8123",
                             user="ubuntu")
    assert text.startswith(MARKER)
    for line in ("[program:gpu-01-vm0]", "startsecs=0", "redirect_stderr=true", "user=ubuntu"):
        assert line in text.splitlines()
    assert parse_program_ports(text) == {"gpu-01-vm0": 8123}
    # '%' is supervisord's interpolation character and must be doubled.
    assert "100%%" in program_conf_text("x", "echo 100% -p 8001")


# -- VM agent lifecycle --------------------------------------------------------------------------------

def test_add_stop_start_remove_are_idempotent(procs, sv, tmp_path):
    d = agent_dir(tmp_path, "gpu-01-vm0")
    port = procs.allocate_port()
    assert procs.add_vm_agent("gpu-01-vm0", d, port) is True
    first = pid(sv, "gpu-01-vm0")
    assert procs.add_vm_agent("gpu-01-vm0", d, port) is False
    assert pid(sv, "gpu-01-vm0") == first  # nothing restarted
    assert procs.state("gpu-01-vm0") == "RUNNING"
    conf = (sv.conf_dir / "gpu-01-vm0.conf").read_text()
    assert f"-c {d / 'testflinger-agent.conf'} -p {port}" in conf
    assert procs.programs("gpu-01-") == ["gpu-01-vm0"]

    procs.stop("gpu-01-vm0")
    procs.stop("gpu-01-vm0")
    assert procs.state("gpu-01-vm0") == "STOPPED"
    procs.start("gpu-01-vm0")
    procs.start("gpu-01-vm0")
    assert procs.state("gpu-01-vm0") == "RUNNING"

    procs.remove_vm_agent("gpu-01-vm0")
    procs.remove_vm_agent("gpu-01-vm0")
    assert procs.state("gpu-01-vm0") == "ABSENT"
    assert not (sv.conf_dir / "gpu-01-vm0.conf").exists()
    assert procs.programs("gpu-01-") == []


def test_program_with_user_gets_the_charm_environment(sv, tmp_path):
    import pwd

    me = pwd.getpwuid(os.getuid())
    cmd = (f'{sys.executable} -c "import os, time; print(os.environ[\'USER\'], os.environ[\'HOME\'], '
           f'flush=True); time.sleep(3600)" -p {{port}}')
    p = AgentProcesses(sv.url, sv.conf_dir, cmd, user=me.pw_name, lock_path=tmp_path / "p.json")
    p.add_vm_agent("gpu-07-vm0", agent_dir(tmp_path, "gpu-07-vm0"), p.allocate_port())
    assert f"user={me.pw_name}" in (sv.conf_dir / "gpu-07-vm0.conf").read_text().splitlines()
    # Output appears asynchronously; read it once the process has flushed it.
    out = ""
    for _ in range(200):
        out = sv.rpc().supervisor.tailProcessStdoutLog("gpu-07-vm0", 0, 1000)[0]
        if out:
            break
        threading.Event().wait(0.05)
    assert out.split() == [me.pw_name, me.pw_dir]


def test_add_with_a_new_port_replaces_the_program(procs, sv, tmp_path):
    d = agent_dir(tmp_path, "gpu-01-vm1")
    p1, p2 = procs.allocate_port(), procs.allocate_port()
    procs.add_vm_agent("gpu-01-vm1", d, p1)
    before = pid(sv, "gpu-01-vm1")
    assert procs.add_vm_agent("gpu-01-vm1", d, p2) is True
    assert procs.ports()["gpu-01-vm1"] == p2
    assert procs.state("gpu-01-vm1") == "RUNNING" and pid(sv, "gpu-01-vm1") != before


def test_program_that_cannot_run_is_an_error_naming_it(sv, tmp_path):
    bad = AgentProcesses(sv.url, sv.conf_dir, "/nonexistent/testflinger-agent -c {config} -p {port}",
                         lock_path=tmp_path / "p.json", start_timeout=10)
    with pytest.raises(AgentProcessError) as err:
        bad.add_vm_agent("gpu-09-vm0", agent_dir(tmp_path, "gpu-09-vm0"), 8999)
    assert err.value.program == "gpu-09-vm0" and "gpu-09-vm0" in str(err.value)


def test_device_agent_can_be_stopped_and_started(procs, sv):
    charm_program(sv, "gpu-host-01", 8050)
    supervisorctl_update(sv)
    procs.start("gpu-host-01")
    procs.stop("gpu-host-01")
    assert procs.state("gpu-host-01") == "STOPPED"
    procs.stop("gpu-host-01")
    procs.start("gpu-host-01")
    assert procs.state("gpu-host-01") == "RUNNING"
    # A device agent's program is never removed as if it were a VM agent.
    with pytest.raises(AgentProcessError, match="not written by testflinger-magic"):
        procs.remove_vm_agent("gpu-host-01")
    assert procs.state("gpu-host-01") == "RUNNING"


def test_xml_rpc_calls_close_their_connection(procs, sv):
    """Each XML-RPC call to supervisord closes its unix-socket connection itself (rpc_call):
    a proxy left to the garbage collector warned ``ResourceWarning: unclosed <socket ...
    supervisor.sock>`` for every call (the test suite's warnings summary)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            procs._rpc(None, "getState")
        with pytest.raises(AgentProcessError):
            procs._rpc("nosuch", "getProcessInfo", "nosuch")
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_unknown_program_errors_name_it_and_the_fault(procs):
    for call in (procs.stop, procs.start):
        with pytest.raises(AgentProcessError) as err:
            call("no-such-agent")
        assert err.value.program == "no-such-agent"
        assert err.value.fault_string == "BAD_NAME: no-such-agent"
    assert procs.state("no-such-agent") == "ABSENT"


def test_invalid_program_name_is_rejected(procs, tmp_path):
    with pytest.raises(AgentProcessError, match="invalid program name"):
        procs.add_vm_agent("../etc/passwd", tmp_path, 8001)


# -- ports ------------------------------------------------------------------------------------------

def test_concurrent_allocations_are_unique_and_avoid_conf_d_and_bound_ports(sv, tmp_path):
    charm_program(sv, "dev-a", 8000)
    charm_program(sv, "dev-b", 8002)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    held = holder.getsockname()[1]
    lock = tmp_path / "ports.json"
    # Two driver objects share only the lock file, like two daemons' threads would.
    drivers = [AgentProcesses(sv.url, sv.conf_dir, COMMAND, lock_path=lock, port_range=(8000, held + 1))
               for _ in range(2)]
    got, errors = [], []

    def grab(i):
        try:
            got.append(drivers[i % 2].allocate_port())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holder.close()
    assert errors == []
    assert len(got) == 20 and len(set(got)) == 20
    assert not set(got) & {8000, 8002, held}
    # Reservations survive: the next allocation avoids all of them.
    assert drivers[0].allocate_port() not in set(got) | {8000, 8002}


def test_adding_on_a_port_another_program_owns_fails(procs, sv, tmp_path):
    charm_program(sv, "gpu-host-02", 8077)
    with pytest.raises(AgentProcessError, match="port 8077 is already used by program 'gpu-host-02'"):
        procs.add_vm_agent("gpu-02-vm0", agent_dir(tmp_path, "gpu-02-vm0"), 8077)
    assert not (sv.conf_dir / "gpu-02-vm0.conf").exists()


def test_released_and_removed_ports_are_reusable(procs, sv, tmp_path):
    p = procs.allocate_port()
    procs.release_port(p)
    assert procs.allocate_port() == p
    procs.add_vm_agent("gpu-03-vm0", agent_dir(tmp_path, "gpu-03-vm0"), p)
    procs.remove_vm_agent("gpu-03-vm0")
    assert procs.allocate_port() == p


def test_added_without_start_it_stays_stopped_until_ensure_starts_it(procs, sv, tmp_path):
    name = "gpu-02-vm1"
    d = agent_dir(tmp_path, name)
    port = procs.allocate_port(owner=name)
    assert procs.add_vm_agent(name, d, port, start=False) is True
    assert procs.state(name) == "STOPPED"
    # supervisord's own autostart would have started it at addProcessGroup; the file says no.
    assert AUTOSTART_LINE in (sv.conf_dir / f"{name}.conf").read_text().splitlines()
    assert procs.add_vm_agent(name, d, port, start=False) is False
    assert procs.state(name) == "STOPPED"
    assert procs.failing([name]) == {}  # stopped is not failing
    assert procs.ensure({name: (d, port)}) == [name]
    assert procs.state(name) == "RUNNING"
    assert procs.ensure({name: (d, port)}) == []


def test_a_program_file_written_without_autostart_is_kept_and_not_restarted(procs, sv, tmp_path):
    """A VM agent added by a daemon before programs carried autostart=false keeps running its
    job: ensure must not rewrite its file (supervisord would replace the group, restarting it)."""
    name = "gpu-02-vm2"
    d = agent_dir(tmp_path, name)
    port = procs.allocate_port(owner=name)
    procs.add_vm_agent(name, d, port)
    path = sv.conf_dir / f"{name}.conf"
    old = "".join(line + "\n" for line in path.read_text().splitlines() if line != AUTOSTART_LINE)
    path.write_text(old)
    supervisorctl_update(sv)
    procs.start(name)
    running = pid(sv, name)
    assert procs.ensure({name: (d, port)}) == []
    assert procs.add_vm_agent(name, d, port) is False
    assert path.read_text() == old and pid(sv, name) == running
    assert same_program(old, program_conf_text(name, procs.command_for(name, d, port)))
    assert not same_program(old, program_conf_text(name, procs.command_for(name, d, port + 1)))


def counting_rpc(procs) -> list[str]:
    """Record the supervisord method names ``procs`` calls (wraps ``AgentProcesses._rpc``)."""
    calls: list[str] = []
    real = procs._rpc

    def rpc(program, method, *args, **kwargs):
        calls.append(method)
        return real(program, method, *args, **kwargs)

    procs._rpc = rpc
    return calls


def test_add_vm_agents_adds_many_with_one_reload_and_starts_them(procs, sv, tmp_path):
    names = [f"gpu-05-vm{n}" for n in range(4)]
    programs = [(n, agent_dir(tmp_path, n), procs.allocate_port(owner=n)) for n in names]
    calls = counting_rpc(procs)
    assert procs.add_vm_agents(programs, start=False) == names
    assert calls.count("reloadConfig") == 1 and calls.count("addProcessGroup") == 4
    assert "startProcess" not in calls
    assert all(procs.state(n) == "STOPPED" for n in names)
    del calls[:]
    assert procs.add_vm_agents(programs) == names  # started now, still one reload
    assert calls.count("reloadConfig") == 1 and calls.count("startProcess") == 4
    assert all(procs.state(n) == "RUNNING" for n in names)
    assert procs.add_vm_agents(programs) == []  # idempotent: nothing changes
    assert {n: procs.ports()[n] for n in names} == {n: port for n, _d, port in programs}


def test_add_vm_agents_refuses_a_port_given_twice_before_touching_supervisord(procs, sv, tmp_path):
    a, b = "gpu-06-vm0", "gpu-06-vm1"
    port = procs.allocate_port()
    calls = counting_rpc(procs)
    with pytest.raises(AgentProcessError, match="also given to program"):
        procs.add_vm_agents([(a, agent_dir(tmp_path, a), port), (b, agent_dir(tmp_path, b), port)])
    assert calls == [] and not list(sv.conf_dir.glob("gpu-06-*.conf"))


def test_ensure_starts_all_programs_with_one_reload(procs, sv, tmp_path):
    expected = {}
    for n in range(3):
        name = f"gpu-08-vm{n}"
        expected[name] = (agent_dir(tmp_path, name), procs.allocate_port(owner=name))
    procs.add_vm_agents([(n, *expected[n]) for n in sorted(expected)], start=False)
    calls = counting_rpc(procs)
    assert procs.ensure(expected) == sorted(expected)
    assert calls.count("reloadConfig") == 1 and calls.count("startProcess") == 3
    assert all(procs.state(n) == "RUNNING" for n in expected)


# -- charm wipe -----------------------------------------------------------------------------------

def test_ensure_restores_vm_agents_after_charm_wipe(procs, sv, tmp_path):
    charm_program(sv, "gpu-host-01", 8050)
    supervisorctl_update(sv)
    expected = {}
    for n in range(2):
        name = f"gpu-host-01-vm{n}"
        expected[name] = (agent_dir(tmp_path, name), procs.allocate_port(owner=name))
        procs.add_vm_agent(name, *expected[name])
    assert procs.ensure(expected) == []

    # The charm deletes every conf.d/*.conf, rewrites its own, runs `supervisorctl update`.
    for f in sv.conf_dir.glob("*.conf"):
        f.unlink()
    charm_program(sv, "gpu-host-01", 8050)
    supervisorctl_update(sv)
    assert procs.programs("gpu-host-01-vm") == []
    # A charm-side agent could now be handed a free port; ours stay reserved.
    assert procs.allocate_port() not in {port for _d, port in expected.values()}

    assert procs.ensure(expected) == sorted(expected)
    for name, (_d, port) in expected.items():
        assert procs.state(name) == "RUNNING"
        assert procs.ports()[name] == port
    assert procs.state("gpu-host-01") == "RUNNING"
    assert procs.ensure(expected) == []


def test_ensure_rewrites_files_deleted_before_update_and_restarts_stopped(procs, sv, tmp_path):
    name = "gpu-04-vm0"
    expected = {name: (agent_dir(tmp_path, name), procs.allocate_port(owner=name))}
    procs.add_vm_agent(name, *expected[name])
    running_pid = pid(sv, name)
    (sv.conf_dir / f"{name}.conf").unlink()  # wiped, `update` not yet run
    assert procs.ensure(expected) == [name]
    assert (sv.conf_dir / f"{name}.conf").exists() and pid(sv, name) == running_pid
    procs.stop(name)
    assert procs.ensure(expected) == [name]
    assert procs.state(name) == "RUNNING"


def test_ensure_reports_agent_folders_that_are_gone(procs, sv, tmp_path):
    ok = "gpu-05-vm0"
    expected = {ok: (agent_dir(tmp_path, ok), procs.allocate_port(owner=ok)),
                "gpu-05-vm1": (tmp_path / "agents" / "gpu-05-vm1", procs.allocate_port())}
    with pytest.raises(AgentProcessError, match="gpu-05-vm1: agent folder without") as err:
        procs.ensure(expected)
    assert err.value.restored == [ok]
    assert procs.state(ok) == "RUNNING"


def test_ensure_moves_off_a_port_the_charm_took(procs, sv, tmp_path):
    name = "gpu-06-vm0"
    port = procs.allocate_port(owner=name)
    expected = {name: (agent_dir(tmp_path, name), port)}
    procs.add_vm_agent(name, *expected[name])
    for f in sv.conf_dir.glob("*.conf"):
        f.unlink()
    charm_program(sv, "gpu-host-06", port)
    supervisorctl_update(sv)
    assert procs.ensure(expected) == [name]
    assert procs.ports()[name] != port and procs.state(name) == "RUNNING"


# A stand-in agent that, like testflinger-agent, binds its metrics port and dies if it cannot.
BINDER = (f'{sys.executable} -c "import socket, sys, time; s = socket.socket(); '
          f"s.bind(('127.0.0.1', int(sys.argv[-1]))); s.listen(); time.sleep(3600)\" "
          f'-c {{config}} -p {{port}}')


@pytest.fixture
def binder(sv, tmp_path):
    return AgentProcesses(sv.url, sv.conf_dir, BINDER, lock_path=tmp_path / "ports.json")


def hold(port: int) -> socket.socket:
    """Bind and listen on ``port``, as another process that took it would."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_start_vm_agent_moves_off_a_port_taken_after_allocation(binder, tmp_path):
    name = "gpu-04-vm0"
    port = binder.allocate_port(owner=name)
    with hold(port):
        got = binder.start_vm_agent(name, agent_dir(tmp_path, name), port)
        assert got != port
        assert binder.ports()[name] == got
        assert binder.state(name) == "RUNNING" and binder.failing([name]) == {}
    # Steady on the new port: nothing more to do.
    assert binder.start_vm_agent(name, agent_dir(tmp_path, name), got) == got


def test_a_restarting_program_is_failing_and_ensure_moves_its_port(binder, tmp_path):
    """startsecs=0: the program whose port is held is RUNNING, exits, RUNNING again, ..."""
    name = "gpu-05-vm0"
    port = binder.allocate_port(owner=name)
    d = agent_dir(tmp_path, name)
    with hold(port):
        binder.add_vm_agent(name, d, port)  # reaches RUNNING although it cannot bind
        assert name in binder.failing([name])
        assert binder.ensure({name: (d, port)}) == [name]
        moved = binder.ports()[name]
        assert moved != port and binder.failing([name]) == {}
        assert binder.ensure({name: (d, moved)}) == []


def test_start_vm_agent_gives_up_naming_the_ports_it_tried(sv, tmp_path):
    crash = f'{sys.executable} -c "import sys; sys.exit(2)" -c {{config}} -p {{port}}'
    p = AgentProcesses(sv.url, sv.conf_dir, crash, lock_path=tmp_path / "ports.json")
    name = "gpu-06-vm1"
    port = p.allocate_port(owner=name)
    with pytest.raises(AgentProcessError, match=rf"{name}: keeps failing on metrics ports {port}, "):
        p.start_vm_agent(name, agent_dir(tmp_path, name), port)


def charm_binder_program(sv, name: str, port: int) -> None:
    """A device agent program as the charm writes it (no marker), binding its port like
    testflinger-agent does (the metrics server on ``-p``)."""
    (sv.conf_dir / f"{name}.conf").write_text(
        f"[program:{name}]\nstartsecs=0\nredirect_stderr=true\nautostart=false\n"
        f"command={sys.executable} -c \"import socket, sys, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', int(sys.argv[-1]))); s.listen(); time.sleep(3600)\" "
        f"testflinger-agent -c /srv/x.conf -p {port}\n")


def test_a_device_agent_whose_port_was_taken_while_lent_is_moved_at_give_back(binder, sv):
    """Issue 10 item 8 / issue 7 item 10: while the device was lent another process took its
    agent's metrics port; started again it would crash-loop (seen in the lab for minutes)."""
    name = "gpu-host-07"
    port = binder.allocate_port()
    charm_binder_program(sv, name, port)
    supervisorctl_update(sv)
    with hold(port):
        got = binder.start_device_agent(name)
        assert got != port and binder.ports()[name] == got
        assert binder.state(name) == "RUNNING" and binder.failing([name]) == {}
        text = (sv.conf_dir / f"{name}.conf").read_text()
        # only its -p changed: the charm's file stays the charm's (no marker added)
        assert f"-p {got}" in text and f"-p {port}" not in text
        assert not text.startswith("; testflinger-magic")
    # Running steadily on its port: nothing to move.
    assert binder.start_device_agent(name) == got


def test_a_device_agent_failing_for_another_reason_is_an_error(sv, tmp_path):
    p = AgentProcesses(sv.url, sv.conf_dir, COMMAND, lock_path=tmp_path / "ports.json")
    (sv.conf_dir / "gpu-host-08.conf").write_text(
        f'[program:gpu-host-08]\nstartsecs=0\nautostart=false\n'
        f'command={sys.executable} -c "import sys; print(\'bad config\'); sys.exit(2)" -p 8123\n')
    supervisorctl_update(sv)
    with pytest.raises(AgentProcessError, match="gpu-host-08.*does not stay up"):
        p.start_device_agent("gpu-host-08")


# -- agent folders -----------------------------------------------------------------------------------

def context(**over):
    ctx = dict(agent_id="gpu-01-vm0", server_address="http://127.0.0.1:5000", queue="one-gpu-vm",
               queue_description="One VM with one passthrough GPU", provision_type="maas2",
               maas_user="lab", node_id="xk3e7p", device_ip="10.0.0.21", lease_id="lease-0123456789ab",
               device="gpu-01", base_dir="/var/lib/testflinger-magic/run", polling_interval=10)
    ctx.update(over)
    return ctx


def test_render_produces_valid_agent_folder(tmp_path):
    dest = render_agent_folder(TEMPLATE, tmp_path / "gpu-01-vm0", context())
    conf = yaml.safe_load((dest / "testflinger-agent.conf").read_text())
    assert set(conf) <= set(AGENT_SCHEMA)
    assert conf["agent_id"] == dest.name == "gpu-01-vm0"
    assert conf["job_queues"] == ["one-gpu-vm"]
    assert conf["identifier"] == "lease-0123456789ab"
    assert conf["advertised_queues"] == {"one-gpu-vm": "One VM with one passthrough GPU"}
    assert conf["provision_command"] == "tf-provision" and conf["cleanup_command"] == "tf-cleanup"
    assert conf["execution_basedir"].startswith("/var/lib/testflinger-magic/run/gpu-01-vm0/")
    maas = yaml.safe_load((dest / "default.yaml").read_text())
    assert (maas["node_id"], maas["device_ip"], maas["agent_name"]) == ("xk3e7p", "10.0.0.21", "gpu-01-vm0")
    for f in dest.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in dest.iterdir()) == [FOLDER_MARKER, "default.yaml",
                                                     "testflinger-agent.conf"]


def test_rerender_overwrites_and_remove_is_idempotent(tmp_path):
    dest = tmp_path / "gpu-01-vm0"
    render_agent_folder(TEMPLATE, dest, context())
    render_agent_folder(TEMPLATE, dest, context(device_ip="10.0.0.99"))
    assert yaml.safe_load((dest / "default.yaml").read_text())["device_ip"] == "10.0.0.99"
    assert sorted(p.name for p in dest.iterdir()) == [FOLDER_MARKER, "default.yaml",
                                                     "testflinger-agent.conf"]
    remove_agent_folder(dest)
    remove_agent_folder(dest)
    assert not dest.exists()
    other = tmp_path / "precious"
    other.mkdir()
    (other / "data").write_text("x")
    with pytest.raises(AgentConfigError, match="not an agent folder"):
        remove_agent_folder(other)


def test_a_folder_half_rendered_before_a_crash_is_removable(tmp_path):
    # A SIGKILL inside render_agent_folder leaves the folder with only an atomic_write temp file
    # (no testflinger-agent.conf yet); restore refused to remove it, and failed the lease.
    dest = tmp_path / "gpu-01-vm0"
    render_agent_folder(TEMPLATE, dest, context())
    for name in ("default.yaml", "testflinger-agent.conf"):
        (dest / name).unlink()
    (dest / ".default.yaml.h1vz58pf").write_text("node_id: x\n")  # what the kill left
    remove_agent_folder(dest)
    assert not dest.exists()


@pytest.mark.parametrize("ctx, file, key", [
    (context(polling_interval="often"), "testflinger-agent.conf", "polling_interval"),
    (context(node_id=""), "default.yaml", "node_id"),
    ({k: v for k, v in context().items() if k != "server_address"}, "testflinger-agent.conf.j2",
     "server_address"),
])
def test_bad_context_names_file_and_key(tmp_path, ctx, file, key):
    with pytest.raises(AgentConfigError) as err:
        render_agent_folder(TEMPLATE, tmp_path / "gpu-01-vm0", ctx)
    assert Path(err.value.file).name == file and err.value.key == key
    assert err.value.line is not None and f"{file}:{err.value.line}: {key}:" in str(err.value)
    assert not (tmp_path / "gpu-01-vm0").exists()  # nothing written


def test_folder_name_must_equal_agent_id(tmp_path):
    with pytest.raises(AgentConfigError) as err:
        render_agent_folder(TEMPLATE, tmp_path / "elsewhere", context())
    assert err.value.key == "agent_id"


def write_template(folder: Path, conf: str, default: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "testflinger-agent.conf.j2").write_text(conf)
    if default is not None:
        (folder / "default.yaml.j2").write_text(default)
    return folder


def test_bad_templates_name_file_line_and_key(tmp_path):
    base = "agent_id: {{ agent_id }}\nserver_address: http://x\njob_queues: [q]\n"
    unknown = write_template(tmp_path / "t1", base + "node_name: foo\n")
    with pytest.raises(AgentConfigError) as err:
        render_agent_folder(unknown, tmp_path / "a1", {"agent_id": "a1"})
    assert (err.value.key, err.value.line) == ("node_name", 4)

    syntax = write_template(tmp_path / "t2", base + "x: {{ oops \n")
    with pytest.raises(AgentConfigError) as err:
        render_agent_folder(syntax, tmp_path / "a2", {"agent_id": "a2"})
    assert err.value.file.endswith("testflinger-agent.conf.j2") and err.value.line == 4

    no_queues = write_template(tmp_path / "t3", "agent_id: {{ agent_id }}\nserver_address: http://x\n")
    with pytest.raises(AgentConfigError, match="job_queues: required"):
        render_agent_folder(no_queues, tmp_path / "a3", {"agent_id": "a3"})

    maas_without_default = write_template(tmp_path / "t4", base + "provision_type: maas2\n")
    with pytest.raises(AgentConfigError, match="needs a default.yaml.j2"):
        render_agent_folder(maas_without_default, tmp_path / "a4", {"agent_id": "a4"})

    with pytest.raises(AgentConfigError, match=r"agent_id: expected str"):
        validate_agent_config("x.conf", "agent_id: 5\nserver_address: s\njob_queues: [q]\n")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(desc=st.text(max_size=60), queue=st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True))
def test_any_description_and_queue_survive_rendering(tmp_path, desc, queue):
    dest = render_agent_folder(TEMPLATE, tmp_path / "gpu-01-vm0",
                               context(queue_description=desc, queue=queue))
    conf = yaml.safe_load((dest / "testflinger-agent.conf").read_text())
    assert conf["advertised_queues"] == {queue: desc} and conf["job_queues"] == [queue]


def test_unreachable_supervisord_is_an_error_naming_the_url(tmp_path):
    p = AgentProcesses(f"unix://{tmp_path}/missing.sock", tmp_path / "conf.d", COMMAND,
                       lock_path=tmp_path / "p.json")
    with pytest.raises(AgentProcessError, match="cannot reach supervisord at unix://") as err:
        p.stop("gpu-host-01")
    assert err.value.program == "gpu-host-01"


def test_remove_retries_when_autorestart_started_the_program_again(tmp_path):
    """supervisord may restart an EXITED program between our stop (NOT_RUNNING) and
    removeProcessGroup, which then fails STILL_RUNNING (fault 91): stop again and retry."""
    import xmlrpc.client

    calls = []

    class Flaky(AgentProcesses):
        def _rpc(self, program, method, *args, ok=()):
            calls.append(method)
            if method == "removeProcessGroup" and calls.count(method) == 1:
                raise AgentProcessError(program, "removeProcessGroup failed",
                                        xmlrpc.client.Fault(91, "STILL_RUNNING"))
            return None

    Flaky("unix:///nowhere", tmp_path)._stop_and_remove("gpu-01-vm1")
    assert calls == ["stopProcess", "removeProcessGroup", "stopProcess", "removeProcessGroup"]


def test_render_uses_a_template_changed_since_the_last_render(tmp_path):
    # Compiled templates are kept per folder (agentfolders._environment) only while the files
    # stay the same: an edited template is rendered as it now reads.
    templates = tmp_path / "tpl"
    shutil.copytree(TEMPLATE, templates)
    first = render_agent_folder(templates, tmp_path / "a" / "gpu-01-vm0", context())
    assert yaml.safe_load((first / "testflinger-agent.conf").read_text())["polling_interval"] == 10
    conf = templates / "testflinger-agent.conf.j2"
    conf.write_text(conf.read_text().replace("{{ polling_interval | tojson }}",
                                        "{{ (polling_interval + 1) | tojson }}"))
    second = render_agent_folder(templates, tmp_path / "b" / "gpu-01-vm0", context())
    assert yaml.safe_load((second / "testflinger-agent.conf").read_text())["polling_interval"] == 11
