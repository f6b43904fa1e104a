"""The embedded lab: every stand-in the product needs, started together on this machine.

What runs (each speaking the real protocol on real HTTP or sockets):

- the Testflinger-compatible job service (:mod:`.jobservice`) on mongomock, with the server plugin
  mounted by ``init_app`` exactly as on the real server;
- the MAAS 2.0 API simulator (:mod:`.maas_sim`), its delays shrunk by ``time_scale``;
- libvirt's test driver with one multi-GPU host XML per device (:mod:`.hosts`);
- a real supervisord running the device agents and, later, the VM agents (:mod:`.sim_agent`);
- the agent-host daemon itself, unchanged, as a subprocess (``testflinger-magic agent-host``).

``Lab`` is used by ``testflinger-magic demo``, ``testflinger-magic lab up`` and the tests.
"""

from __future__ import annotations

import dataclasses
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
from .. import queues as queuesmod

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
TEMPLATES = REPO_ROOT / "agent_configs"

#: Real MAAS times (seconds) before the lab's ``time_scale`` shrinks them.
MAAS_DELAYS = {"deploy": 600.0, "release": 120.0, "commission": 300.0}


class LabError(RuntimeError):
    """A lab component failed; the message names the component."""


@dataclasses.dataclass
class LabOptions:
    """What the lab looks like.

    ``devices``: number of bare-metal GPU devices; ``gpus``: passthrough GPUs per device;
    ``home_queue``: the devices' own queue; ``queues_file``: operator YAML of magic queues;
    ``time_scale``: factor applied to MAAS delays (0.01 = a 600 s deploy takes 6 s);
    ``phase_seconds``: how long a simulated agent spends in each job phase;
    ``idle_timeout``/``owner_wait``/``grace``: policy overrides (seconds) so the cycle fits a demo;
    ``tick_seconds``: reconcile period of the plugin.
    """

    workdir: Path
    devices: int = 2
    gpus: int = 8
    home_queue: str = "gpu-hosts"
    queues_file: Path = EXAMPLES / "magic-queues.yaml"
    time_scale: float = 0.01
    phase_seconds: float = 1.0
    idle_timeout: float | None = 8.0
    owner_wait: float | None = 60.0
    grace: float | None = 15.0
    max_starting: int | None = 2
    tick_seconds: float = 1.0
    polling_interval: int = 1

    def device_names(self) -> list[str]:
        return [f"gpu-host-{i:02d}" for i in range(1, self.devices + 1)]


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
        """Start every component; raises :class:`LabError` naming the one that failed."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._step("definitions", self._load_definitions)
            self._step("job service", self._start_jobservice)
            self._step("MAAS simulator", self._start_maas)
            self._step("libvirt test hosts", self._write_hosts)
            self._step("supervisord", self._start_supervisord)
            self._step("device agents", self._start_device_agents)
            self._step("agent-host daemon", self._start_daemon)
        except Exception:
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
        """Stop everything this lab started, newest first. Safe to call twice."""
        while self._started:
            name, stopper = self._started.pop()
            try:
                stopper()
            except Exception as exc:  # keep stopping the rest
                log.warning("lab: stopping %s failed: %s", name, exc)

    # -- components -------------------------------------------------------------------------
    def _load_definitions(self):
        self.definitions = queuesmod.load_file(self.opt.queues_file)
        for q in self.definitions:
            pol = q.policy
            pol.notify = []  # the lab never calls out of this machine
            if self.opt.idle_timeout is not None:
                pol.idle_timeout = self.opt.idle_timeout
            if self.opt.owner_wait is not None and pol.reclaim is not None:
                pol.reclaim.owner_wait = self.opt.owner_wait
            if self.opt.grace is not None and pol.reclaim is not None:
                pol.reclaim.grace = self.opt.grace
            if self.opt.max_starting is not None:
                pol.max_starting = min(self.opt.max_starting, pol.max_devices)
            # Bring-up in the lab takes seconds; keep the deadline proportionate but generous.
            pol.provision_timeout = max(60.0, pol.provision_timeout * self.opt.time_scale * 4)

    def _start_jobservice(self):
        from .httpserve import serve
        from .jobservice import create_app

        self.db = dbmod.connect()
        app = create_app(
            self.db,
            signing_key=self.signing_key,
            clients=self.clients,
            mount_plugin=True,
            plugin_options={"definitions": self.definitions, "tick_seconds": self.opt.tick_seconds},
        )
        self.app = app
        self.plugin = app.extensions["jobservice"]["plugin"]
        handle = serve(app)
        self.server_url = handle.url
        self._started.append(("job service", handle.stop))
        if self.plugin is not None and hasattr(self.plugin, "stop"):
            self._started.append(("plugin ticker", self.plugin.stop))
        self.admin_token = self.token("lab-admin")

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
        self.maas = MaasSimulator(api_key=self.maas_key, time_scale=1.0, delays=delays)
        self.device_system_ids = {}
        for name in self.opt.device_names():
            self.device_system_ids[name] = self.maas.add_machine(hostname=name, status="Ready", power_type="ipmi")
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

    def libvirt_uri(self, device: str) -> str:
        return f"test://{self.workdir / 'hosts' / device}.xml"

    def _start_supervisord(self):
        from ..agent_host.supervisor_proc import Supervisord

        os.environ["SIM_AGENT_PHASE_SECONDS"] = str(self.opt.phase_seconds)
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
                "advertised_queues": {self.opt.home_queue: "Bare-metal 8-GPU servers"},
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
            "agent_host": "lab-agent-host-1",
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
            "maas": {"url": self.maas_url, "api_key": self.maas_key},
            "libvirt_uri_template": f"test://{self.workdir / 'hosts'}/{{device}}.xml",
            "splitter": {"kind": "libvirt"},
            "agent_configs_dir": str(self.workdir / "agent-configs"),
            "agent_templates_dir": str(TEMPLATES),
            "agent_command": self.agent_command(),
            "supervisor": {"url": self.supervisor.url, "conf_dir": str(self.supervisor.conf_dir),
                           "metrics_ports": list(self.metrics_ports)},
            "state_dir": str(self.workdir / "daemon-state"),
            "maas_user": "lab",
            "poll_wait": 2,
            "maas_poll": 0.3,
            "heartbeat_interval": 5,
        }
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
        device agents whose Testflinger state is still offline.
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
        offline = self.db["agents"].count_documents({"name": {"$in": sorted(devices)}, "state": "offline"})
        return {
            "domains": domains,
            "maas_machines": maas_machines,
            "agent_programs": len(programs),
            "agent_folders": len(folders),
            "fenced_agents": fenced + offline,
        }


def _free_port_window(size: int = 200) -> tuple[int, int]:
    """A ``[low, high)`` window of metrics ports for this lab's agents.

    A production agent host has one allocator (its daemon) over the charm's 8000-9999. Several
    labs on one machine (tests, a demo next to ``lab up``) would each allocate from 8000 and race
    between "bindable" and "bound"; a window starting at a random free port keeps them apart.
    """
    import random
    import socket

    rng = random.Random()
    for _ in range(50):
        low = rng.randrange(20000, 60000 - size, 100)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", low))
            except OSError:
                continue
        return low, low + size
    return 8000, 10000


def main_up(args) -> int:
    """``testflinger-magic lab up``: start the lab and keep it running until Ctrl-C."""
    import tempfile

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    workdir = Path(getattr(args, "workdir", None) or tempfile.mkdtemp(prefix="tf-magic-lab-"))
    opt = LabOptions(workdir=workdir)
    for key in ("devices", "gpus", "time_scale", "phase_seconds"):
        if getattr(args, key, None) is not None:
            setattr(opt, key, getattr(args, key))
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    with Lab(opt) as lab:
        user = f"--client-id lab-user --secret-key {lab.clients['lab-user']['secret']}"
        admin = f"--client-id lab-admin --secret-key {lab.clients['lab-admin']['secret']}"
        print(f"Lab is up. Testflinger server: {lab.server_url}")
        print(f"  status page:  {lab.server_url}/v1/magic/")
        print(f"  testflinger-cli --server {lab.server_url} list-queues")
        print(f"  testflinger-cli --server {lab.server_url} submit {user} --poll examples/jobs/gpu-smoke.yaml")
        print(f"  testflinger-magic --server {lab.server_url} status")
        print(f"  testflinger-magic --server {lab.server_url} {admin} drain LEASE_ID")
        print(f"  work directory: {workdir}   (Ctrl-C stops everything)")
        sys.stdout.flush()
        stop.wait()
        print("Stopping the lab...")
    return 0
