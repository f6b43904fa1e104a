"""The embedded lab: every stand-in the product needs, started together on this machine.

What runs (each speaking the real protocol on real HTTP or sockets):

- the Testflinger-compatible job service (:mod:`.jobservice`) on mongomock, with the server plugin
  mounted by ``init_app`` exactly as on the real server;
- the MAAS 2.0 API simulator (:mod:`.maas_sim`), its delays shrunk by ``time_scale``;
- libvirt's test driver with one multi-GPU host XML per device (:mod:`.hosts`);
- a real supervisord running the device agents and, later, the VM agents (:mod:`.sim_agent`);
- the agent-host daemon itself, unchanged, as a subprocess (``testflinger-magic agent-host``).

``Lab`` is used by ``testflinger-magic demo``, ``testflinger-magic lab up`` and the tests. Its
work directory and the processes found by their paths are :mod:`.labdir`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

from .. import db as dbmod
from .hosts import BOOT_NIC
from .labdir import (  # noqa: F401 (LabError, process_command_lines...: re-exported)
    LabError, _free_port_window, _terminate, ephemeral_port_range, prepare_workdir,
    process_command_lines, processes_mentioning)

from .labopts import EXAMPLES, REPO_ROOT, LabOptions, lab_definitions, policy_summary  # noqa: F401

log = logging.getLogger(__name__)

TEMPLATES = REPO_ROOT / "agent_configs"

#: The lab MAAS rack controller's SSH public key: the simulator's virsh power driver logs in
#: with it (lab/virsh_power.py), so the agent-host config authorizes it (maas.rack_public_keys).
RACK_PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILabRackControllerKey maas@lab-rack"

#: Real MAAS times (seconds) before the lab's ``time_scale`` shrinks them.
MAAS_DELAYS = {"deploy": 600.0, "release": 120.0, "commission": 300.0}
#: The lab's one agent host (its daemon's ``agent_host``).
LAB_AGENT_HOST = "lab-agent-host-1"
#: The daemon's ``maas_poll`` default (agent_host/config.py), shrunk by ``time_scale`` like
#: MAAS' times, never under ``MAAS_POLL_FLOOR`` seconds.
DEFAULT_MAAS_POLL = 10.0
MAAS_POLL_FLOOR = 0.05


#: Storage pool capacity (GiB) the lab's agent-host tells the splitter to assume for its hosts
#: (``splitter.test_pool_gib``): libvirt's test driver reports a fixed 100 GiB for any pool,
#: smaller than the example queues' disks (two-gpu-vm: 200 GiB). VM disks are sparse volumes.
LAB_POOL_GIB = 4096


#: ``lab up`` restarts a daemon that died (Lab.check_daemon), but not once it died this many
#: times in a row each within DAEMON_YOUNG seconds of its start (a bad config would only loop):
#: the 1st and 2nd quick deaths are restarted, the 3rd is not (README: "unless it died 3 times
#: in a row within 30 s of its start").
DAEMON_RESTARTS = 3
DAEMON_YOUNG = 30.0


class Lab:
    """Start, inspect and stop the embedded lab. Use as a context manager.

    Attributes after :meth:`start`: ``server_url`` (the job service), ``maas`` (simulator),
    ``maas_url``, ``supervisor`` (the running supervisord), ``db`` (mongomock), ``admin_token``.
    """

    def __init__(self, options: LabOptions):
        self.opt = options
        self.workdir = Path(options.workdir).resolve()
        self._started: list = []  # (name, stop callable), stopped in reverse order
        self.daemon_proc: subprocess.Popen | None = None
        self._daemon_started_at = 0.0
        self._daemon_quick_deaths = 0  # deaths in a row within DAEMON_YOUNG of their start
        self.signing_key = secrets.token_hex(16)
        self.clients = {
            "lab-admin": {"secret": secrets.token_hex(8), "role": "admin", "max_priority": {"*": 100}},
            "lab-agent-host": {"secret": secrets.token_hex(8), "role": "agent"},
            "lab-user": {"secret": secrets.token_hex(8), "role": "contributor", "max_priority": {"*": 100}},
        }

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> "Lab":
        """Start every component; raises :class:`LabError` naming the one that failed.

        The work directory must be new, empty, or one an earlier lab left behind, which is
        cleaned first (:func:`prepare_workdir`); anything else is refused before anything
        starts."""
        prepare_workdir(self.workdir)
        try:
            self._step("definitions", self._load_definitions)
            self._step("job service", self._start_jobservice)
            self._step("MAAS simulator", self._start_maas)
            self._step("libvirt test hosts", self._write_hosts)
            self._step("supervisord", self._start_supervisord)
            self._step("device agents", self._start_device_agents)
            self._step("agent-host daemon", self._start_daemon)
        except BaseException:  # KeyboardInterrupt/SIGTERM during start too: nothing may leak
            self.stop()
            raise
        return self

    def _step(self, name, fn):
        log.info("lab: starting %s", name)
        try:
            fn()
        except LabError:
            raise
        except Exception as exc:  # name the component that failed
            raise LabError(f"lab component '{name}' failed to start: {exc}") from exc

    def stop(self) -> None:
        """Stop everything this lab started, newest first. Safe to call twice.

        A stopper that fails (or is interrupted) does not keep the others from running, and
        SIGINT/SIGTERM arriving meanwhile are held until the end (see ``_signals_held``).
        Last, any process still running one of this lab's programs (supervisord, the device
        and VM agents, the daemon) is terminated, then killed: supervisord puts each program in
        its own process group, so a supervisord that did not stop them leaves them behind.
        """
        with _signals_held():
            while self._started:
                name, stopper = self._started.pop()
                try:
                    stopper()
                except BaseException as exc:  # noqa: BLE001 - keep stopping the rest
                    log.warning("lab: stopping %s failed: %s: %s", name, type(exc).__name__, exc)
            try:
                self._kill_leftovers()
            except Exception as exc:  # noqa: BLE001 - best effort, never hide the real error
                log.warning("lab: looking for leftover processes failed: %s", exc)

    def _markers(self) -> list[str]:
        """Paths only this lab's processes have on their command line."""
        marks = [str(self.workdir / "refresh_token")]  # every agent's --token-file
        if getattr(self, "daemon_config", None):
            marks.append(str(self.daemon_config))
        if getattr(self, "supervisor", None) is not None:
            marks.append(str(self.supervisor.conf_path))
        return marks

    def lab_processes(self) -> list[int]:
        """PIDs of this user's live processes (not this one) running one of the lab's programs,
        found by ``_markers`` in ``/proc/<pid>/cmdline``. Empty where /proc is missing."""
        return processes_mentioning(self._markers())

    def _kill_leftovers(self, grace: float = 5.0) -> None:
        """SIGTERM what ``lab_processes`` finds, SIGKILL what is left after ``grace`` seconds."""
        pids = self.lab_processes()
        if not pids:
            return
        log.warning("lab: %d process(es) outlived their stopper; terminating %s", len(pids),
                    " ".join(map(str, pids)))
        _terminate(pids, grace)

    # -- components -------------------------------------------------------------------------
    def _load_definitions(self):
        self.definitions = lab_definitions(self.opt)

    def _start_jobservice(self):
        self.db = dbmod.connect()
        self._serve_jobservice()
        self._started.append(("job service", self._stop_jobservice))
        self.admin_token = self.token("lab-admin")
        engine = getattr(self.plugin, "engine", None)
        if getattr(engine, "binding_mode", None) == "admin-bound":
            # TESTFLINGER_MAGIC_AGENT_HOSTS=admin-bound: the lab is the lab's admin, and binds
            # its agent host before its daemon first registers, as an operator would
            # (agent-hosts rebind; TRIAL14 F8: the daemon was refused and the lab timed out).
            engine.bindings.rebind(LAB_AGENT_HOST, "lab-agent-host",
                                   "bound by the lab (admin-bound agent hosts)", by="lab-admin")

    def _serve_jobservice(self, port: int = 0) -> None:
        """A new job service app with the plugin mounted (its own ticker, caches and webhook
        sender), on ``self.db``, served on ``port`` (0: a free one)."""
        from .httpserve import serve
        from .jobservice import create_app

        app = create_app(
            self.db,
            signing_key=self.signing_key,
            clients=self.clients,
            mount_plugin=True,
            plugin_options={"definitions": self.definitions, "tick_seconds": self.opt.tick_seconds},
            newer=self.opt.newer_testflinger,
        )
        self.app = app
        self.plugin = app.extensions["jobservice"]["plugin"]
        self.plugin.engine.unservable_grace = self.opt.unservable_grace
        self._jobservice = serve(app, port=port)
        self.server_url = self._jobservice.url

    def _stop_jobservice(self) -> None:
        """Stop serving, then the plugin's ticker and webhook sender (safe to call twice)."""
        handle, self._jobservice = getattr(self, "_jobservice", None), None
        if handle is not None:
            handle.stop()
        plugin = getattr(self, "plugin", None)
        if plugin is not None and hasattr(plugin, "stop"):
            plugin.stop()
        notifier = getattr(plugin, "notifier", None)
        if notifier is not None and hasattr(notifier, "close"):
            notifier.close()

    def restart_jobservice(self) -> str:
        """Restart the Testflinger server (job service and plugin) alone, as a server or replica
        restart in a real lab: the old one stops serving and its plugin's ticker stops, then a
        new app and plugin, with nothing of the old one's memory (caches, quick-lend state;
        webhooks it had queued are sent first), serve the same database on the same port with the same clients.
        The daemon, agents and the CLI see refused connections meanwhile and retry. The lab's
        database is in memory, so it lives in the ``lab up`` process and survives only this
        kind of restart. A request the old server was answering finishes first (its thread is
        not killed): a restart between requests, not a crash in the middle of a write.
        Returns the line to print. Raises OSError if the port cannot be bound again."""
        import time

        port = self._jobservice.port
        started = time.monotonic()
        self._stop_jobservice()
        self._serve_jobservice(port)  # agent-host bindings are in the database: kept
        return (f"lab: restarted the Testflinger server at {self.server_url} in "
                f"{time.monotonic() - started:.1f}s (same database, port and clients; the "
                "plugin's memory starts empty, as after a real restart)")

    def token(self, client_id: str) -> str:
        """An access token for one of the lab's clients (``lab-admin``, ``lab-agent-host``, ...)."""
        c = self.clients[client_id]
        r = requests.post(f"{self.server_url}/v1/oauth2/token", auth=(client_id, c["secret"]), timeout=10)
        r.raise_for_status()
        return r.json()["access_token"]

    def _start_maas(self):
        from .httpserve import serve
        from .maas_sim import MaasSimulator

        self.maas_key = "lab:{}:{}".format(secrets.token_hex(9), secrets.token_hex(16))
        delays = {k: v * self.opt.time_scale for k, v in MAAS_DELAYS.items()}
        version = {"version": self.opt.maas_version} if self.opt.maas_version else {}
        self.maas = MaasSimulator(api_key=self.maas_key, time_scale=1.0, delays=delays,
                                  **version)
        self.device_system_ids = {}
        for name in self.opt.device_names():
            # Named as the lab host's boot NIC (lab.hosts.BOOT_NIC), so the bridge MAAS renders
            # at deploy (br-<ifname>) is the one the host file has.
            self.device_system_ids[name] = self.maas.add_machine(
                hostname=name, status="Ready", power_type="ipmi",
                interface_name=BOOT_NIC["hgx"][1])
        handle = serve(self.maas.app)
        self.maas_url = f"{handle.url}/MAAS/"
        self._started.append(("MAAS simulator", handle.stop))

    def _write_hosts(self):
        from .hosts import write_host_xml

        hosts = self.workdir / "hosts"
        hosts.mkdir(exist_ok=True)
        self.host_xml = {}
        for name in self.opt.device_names():
            path = hosts / f"{name}.xml"
            if path.exists():
                path.unlink()  # a fresh host each run: no domains left from a previous lab
            self.host_xml[name] = write_host_xml(path, gpus=self.opt.gpus, name=name)
            # What MAAS' commissioning found on the device: its node devices (MAAS >= 3.0),
            # whose NVSwitches the daemon's registration tells the server. Uncommissioned: none
            # recorded, so MAAS lists [] (src/maasserver/api/nodedevices.py
            # NodeDevicesHandler.read returns the machine's node_config nodedevice_set, empty
            # until a commissioning on MAAS >= 3.0 recorded them: hooks.py update_node_devices).
            if not self.opt.uncommissioned:
                self.maas.set_hardware(self.device_system_ids[name],
                                       self.host_xml[name].read_text())
            # MAAS' rack reaches the deployed device's libvirt at its address (virsh_power).
            self.maas.virsh.add(name, self.libvirt_uri(name))
        self.maas.virsh.rack_key = RACK_PUBLIC_KEY

    def libvirt_uri(self, device: str) -> str:
        return f"test://{self.workdir / 'hosts' / device}.xml"

    def _start_supervisord(self):
        from ..agent_host.supervisor_proc import Supervisord

        os.environ["SIM_AGENT_PHASE_SECONDS"] = str(self.opt.phase_seconds)
        os.environ["SIM_AGENT_NEWER"] = "1" if self.opt.newer_testflinger else ""
        self.supervisor = Supervisord(self.workdir / "supervisor")
        self.supervisor.start()
        self._started.append(("supervisord", self.supervisor.stop))
        # The agents authenticate like testflinger-agent: a refresh token file for the host.
        r = requests.post(
            f"{self.server_url}/v1/oauth2/token",
            auth=("lab-agent-host", self.clients["lab-agent-host"]["secret"]),
            timeout=10,
        )
        r.raise_for_status()
        self.token_file = self.workdir / "refresh_token"
        self.token_file.write_text(json.dumps({"refresh_token": r.json()["refresh_token"], "obtained_at": time.time()}))
        os.chmod(self.token_file, 0o600)

    def agent_command(self) -> str:
        """The supervisord command for an agent in the lab: the simulated testflinger-agent."""
        return f"{sys.executable} -m testflinger_magic.lab.sim_agent -c {{config}} -p {{port}} --token-file {self.token_file}"

    def _start_device_agents(self):
        from ..agent_host.agents import AgentProcesses

        self.metrics_ports = _free_port_window()
        procs = AgentProcesses(self.supervisor.url, self.supervisor.conf_dir, self.agent_command(),
                               port_range=self.metrics_ports)
        base = self.workdir / "device-agents"
        for name in self.opt.device_names():
            d = base / name
            d.mkdir(parents=True, exist_ok=True)
            conf = {
                "agent_id": name,
                "server_address": self.server_url,
                "job_queues": [self.opt.home_queue],
                "polling_interval": self.opt.polling_interval,
                "provision_type": "maas2",
                "location": "lab",
                "advertised_queues": {self.opt.home_queue:
                                      f"Bare-metal {self.opt.gpus}-GPU servers"},
                "execution_basedir": str(d / "run"),
                "logging_basedir": str(d / "logs"),
                "results_basedir": str(d / "results"),
            }
            (d / "testflinger-agent.conf").write_text(yaml.safe_dump(conf, sort_keys=False))
            procs.add_vm_agent(name, d, procs.allocate_port())
        self._wait(lambda: all(self.agent_doc(n) for n in self.opt.device_names()), 30, "device agents to post their state")

    def _start_daemon(self):
        cfg = {
            "server_url": self.server_url,
            "client_id": "lab-agent-host",
            "secret_key": self.clients["lab-agent-host"]["secret"],
            "agent_host": LAB_AGENT_HOST,
            "devices": [
                {
                    "agent_name": n,
                    "supervisor_program": n,
                    "maas_system_id": self.device_system_ids[n],
                    "gpus": self.opt.gpus,
                    "tags": ["nvidia", "lab"],
                    "home_queues": [self.opt.home_queue],
                }
                for n in self.opt.device_names()
            ],
            "maas": {"url": self.maas_url, "api_key": self.maas_key,
                     "rack_public_keys": [RACK_PUBLIC_KEY]},
            "libvirt_uri_template": f"test://{self.workdir / 'hosts'}/{{device}}.xml",
            # No "bridge": the VMs join the bridge MAAS renders on the boot interface at deploy
            # (bridge_all), as on a real agent host. No "nvswitch_multi_gpu": the lab's hosts
            # are HGX boards (lab.hosts) and nothing in the lab activates a Fabric Manager
            # partition, so, as on a real host without that tooling, two-gpu-vm's 2-GPU VMs
            # would be refused at split. The simulated MAAS lists the hosts' NVSwitches (node
            # devices) and the daemon's registration tells the server (server/devicefacts.py),
            # so two-gpu-vm never picks them and its waiting jobs say why
            # (testflinger_magic/fabric.py); the demo lends one-gpu-vm only.
            "splitter": {"kind": "libvirt", "test_pool_gib": LAB_POOL_GIB},
            "agent_configs_dir": str(self.workdir / "agent-configs"),
            "agent_templates_dir": str(TEMPLATES),
            "agent_command": self.agent_command(),
            "supervisor": {"url": self.supervisor.url, "conf_dir": str(self.supervisor.conf_dir),
                           "metrics_ports": list(self.metrics_ports),
                           # The lab's supervisord runs as whoever started the lab: no user=.
                           "program_user": None},
            "state_dir": str(self.workdir / "daemon-state"),
            # The lab's own folder for the one-daemon-per-agent-host lock (statedir.HostLock):
            # two labs on one machine are two systems. A copy of this file keeps it, so a second
            # daemon started from a copy with another state_dir is refused.
            "host_lock_dir": str(self.workdir / "locks"),
            "maas_user": "lab",
            "poll_wait": 2,
            # The daemon's default poll (10 s) shrunk like MAAS' times: at scale 0.01 a 6 s
            # deploy is polled every 0.1 s as a 600 s one is every 10 s (floor 0.05 s).
            "maas_poll": max(MAAS_POLL_FLOOR, DEFAULT_MAAS_POLL * self.opt.time_scale),
            "heartbeat_interval": 5,
        }
        cfg.update(self.opt.daemon_overrides)
        self.daemon_config = self.workdir / "agent-host.yaml"
        self.daemon_config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.chmod(self.daemon_config, 0o600)
        self.start_daemon_process()
        self._wait(self._devices_registered, 30, "the agent-host daemon to register its devices")

    def start_daemon_process(self) -> subprocess.Popen:
        """(Re)start the agent-host daemon subprocess; its output goes to ``workdir/daemon.log``."""
        logf = open(self.workdir / "daemon.log", "ab")
        self.daemon_proc = subprocess.Popen(
            [sys.executable, "-m", "testflinger_magic.cli", "agent-host", "--config", str(self.daemon_config)],
            stdout=logf, stderr=subprocess.STDOUT, cwd=str(self.workdir),
        )
        logf.close()
        proc = self.daemon_proc
        self._daemon_started_at = time.monotonic()

        def stop_daemon():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        self._started.append(("agent-host daemon", stop_daemon))
        return proc

    def check_daemon(self, restart: bool = True) -> str | None:
        """If the agent-host daemon subprocess has ended: reap it (no ``<defunct>`` left),
        restart it when ``restart`` (unless it died :data:`DAEMON_RESTARTS` times in a row
        within :data:`DAEMON_YOUNG` seconds of its start: then it is left down) and return a
        line for people naming its pid, exit status or signal, how long it ran, the log and
        what was done. None while it runs (or once reported as left down). ``lab up`` calls
        this every second while the lab is up."""
        proc = self.daemon_proc
        if proc is None or proc.poll() is None:  # poll() reaps an ended child
            return None
        rc = proc.returncode
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"status {rc}"
        ran = time.monotonic() - self._daemon_started_at
        self._daemon_quick_deaths = self._daemon_quick_deaths + 1 if ran < DAEMON_YOUNG else 0
        line = (f"lab: the agent-host daemon (pid {proc.pid}) exited with {how} after "
                f"{ran:.0f}s (log: {self.workdir / 'daemon.log'})")
        if restart and self._daemon_quick_deaths < DAEMON_RESTARTS:
            new = self.start_daemon_process()
            return f"{line}; restarted it (pid {new.pid}): it resumes its leases"
        self.daemon_proc = None
        why = (f"it died {self._daemon_quick_deaths} times in a row within {DAEMON_YOUNG:.0f}s "
               "of its start" if restart else "restart not asked")
        return (f"{line}; not restarted ({why}): read the log, then run it by hand "
                f"(testflinger-magic agent-host --config {self.daemon_config}) or restart the lab")

    def _devices_registered(self) -> bool:
        if self.daemon_proc is not None and self.daemon_proc.poll() is not None:
            tail = (self.workdir / "daemon.log").read_text(errors="replace")[-2000:]
            raise LabError(f"agent-host daemon exited with {self.daemon_proc.returncode}:\n{tail}")
        names = {d["_id"] for d in self.db["magic_devices"].find({}, {"_id": 1})}
        return set(self.opt.device_names()) <= names

    def _wait(self, cond, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.2)
        raise LabError(f"timed out after {timeout}s waiting for {what}")

    # -- inspection -------------------------------------------------------------------------
    def agent_doc(self, name: str) -> dict | None:
        return self.db["agents"].find_one({"name": name})

    def orphans(self) -> dict:
        """Count what a finished cycle must not leave behind (all expected 0).

        ``domains``: libvirt domains on the device hosts; ``maas_machines``: MAAS machines that are
        not devices (VMs); ``agent_programs``: supervisord programs that are not device agents;
        ``agent_folders``: VM agent config folders; ``fenced_agents``: agents still fenced, plus
        device agents whose Testflinger state is still offline or maintenance (lent: leases.LENT_AGENT_STATE).
        """
        import libvirt

        devices = set(self.opt.device_names())
        domains = 0
        for name in devices:
            conn = libvirt.open(self.libvirt_uri(name))  # a fresh read of the persisted host state
            try:
                domains += len(conn.listAllDomains())
            finally:
                conn.close()
        maas_machines = sum(1 for m in self.maas.machines().values() if m["hostname"] not in devices)
        from ..agent_host.agents import AgentProcesses

        procs = AgentProcesses(self.supervisor.url, self.supervisor.conf_dir, self.agent_command())
        programs = [p for p in procs.programs() if p not in devices]
        folders_dir = self.workdir / "agent-configs"
        folders = [p for p in folders_dir.iterdir() if p.is_dir()] if folders_dir.exists() else []
        fenced = self.db["magic_fences"].count_documents({})
        offline = self.db["agents"].count_documents({"name": {"$in": sorted(devices)},
                                                     "state": {"$in": ["offline", "maintenance"]}})
        return {
            "domains": domains,
            "maas_machines": maas_machines,
            "agent_programs": len(programs),
            "agent_folders": len(folders),
            "fenced_agents": fenced + offline,
        }


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT/SIGTERM while the lab stops (main thread only; elsewhere a no-op).

    A second Ctrl-C or ``kill`` during the stop would otherwise abort it half way and leak the
    rest. A signal received meanwhile is passed to the previous Python handler afterwards
    (SIGINT's default raises KeyboardInterrupt then); other handlers (SIG_DFL/SIG_IGN) drop it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, _frame: got.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            log.warning("lab: signal %d received while stopping; handled now", got[0])
            handler = previous.get(got[0])
            if callable(handler):
                handler(got[0], None)
