"""Real parts for the agent-host daemon tests (imported by tests/test_daemon_*.py).

``DaemonLab(tmp_path)`` starts, on 127.0.0.1 only: the lab job service with the server plugin
mounted (mongomock, real HTTP), the MAAS simulator (real HTTP, spoken to by python-libmaas),
a libvirt test-driver host file per device, and a real supervisord running the device agent
programs. ``config()`` gives an agent-host.yaml dict for them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import libvirt
import pytest
import requests
import yaml

from testflinger_magic import db as dbmod
from testflinger_magic import queues
from testflinger_magic.agent_host.agents import AgentProcesses
from testflinger_magic.agent_host.config import AgentHostConfig
from testflinger_magic.agent_host.supervisor_proc import Supervisord
from testflinger_magic.lab.hosts import BOOT_NIC, write_host_xml
from testflinger_magic.lab.httpserve import serve
from testflinger_magic.lab.jobservice import create_app
from testflinger_magic.lab.maas_sim import MaasSimulator

REPO = Path(__file__).resolve().parents[1]
HOST = "test-agent-host"
QUEUE = "one-gpu-vm"
HOME = "gpu-hosts"
MAAS_KEY = "tc:tk:ts"
#: The simulated MAAS rack controller's SSH public key (virsh power logins).
RACK_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIRackControllerKey maas@rack"

QUEUES_YAML = f"""
magic_queues:
  {QUEUE}:
    description: one VM per GPU
    devices: {{home_queues: [{HOME}]}}
    vms_per_device: gpus
    vm: {{gpus: 1, vcpus: 2, memory_mib: 2048, disk_gib: 10}}
    vm_host_series: jammy
    agent_template: maas2-vm
    provision_type: maas2
    policy: {{max_devices: 2, max_starting: 2, min_devices: 0, idle_timeout: 1h}}
"""

#: A process standing in for testflinger-agent under supervisord. Its arguments are the agent's
#: (``-c <config> -p <port>``) so port discovery reads conf.d as it does for the real agent.
SLEEPER = f'{sys.executable} -c "import time; time.sleep(3600)" -c {{config}} -p {{port}}'

#: A stand-in that, like testflinger-agent (and the lab's sim_agent), binds its metrics port and
#: dies if it cannot (``lab.config(agent_command=BINDER)``).
BINDER = (f'{sys.executable} -c "import socket, sys, time; s = socket.socket(); '
          f"s.bind(('127.0.0.1', int(sys.argv[-1]))); s.listen(); time.sleep(3600)\" "
          f'-c {{config}} -p {{port}}')


class DaemonLab:
    """The real parts around one agent-host daemon. Call ``stop()`` at the end."""

    def __init__(self, tmp: Path, devices=("gpu-host-01",), gpus: int = 2,
                 kinds: dict[str, str] | None = None, maas_version: str | None = None):
        """``kinds``: ``{device: "hgx" | "pcie"}`` (lab.hosts; default ``hgx``: a board with
        NVSwitches); a ``pcie`` host has none. MAAS commissioned each device's host: its node
        devices list them, unless ``maas_version`` is older than 3.0 (none served)."""
        self.tmp = Path(tmp)
        # Its own window of metrics ports, as the embedded lab takes one (lab/labdir.py): with
        # the daemon's default 8000-9999, labs of tests running at once handed the same ports
        # to their agents, which moved them while a job ran (a test waited for a phase).
        from testflinger_magic.lab.labdir import _free_port_window
        self.metrics_ports = _free_port_window()
        self.devices = list(devices)
        self.kinds = {d: (kinds or {}).get(d, "hgx") for d in self.devices}
        self.gpus = gpus
        self.db = dbmod.connect()
        self.clients = {"admin": {"secret": "admin-secret", "role": "admin"},
                        "host": {"secret": "host-secret", "role": "agent"}}
        app = create_app(self.db, clients=self.clients,
                         plugin_options={"definitions": queues.load_text(QUEUES_YAML),
                                         "start_ticker": False})
        self.plugin = app.extensions["testflinger_magic"]
        #: every ``GET /v1/job`` (an agent's job poll) in order: ``(agent_name cookie, status)``
        self.job_polls: list[tuple[str | None, int]] = []
        app.wsgi_app = _JobPollLog(app.wsgi_app, self.job_polls)
        self.server = serve(app)
        self.maas = MaasSimulator(api_key=MAAS_KEY, time_scale=1.0,
                                  delays={"commissioning": 0.2, "deploying": 0.3, "releasing": 0.2},
                                  **({"version": maas_version} if maas_version else {}))
        self.maas_http = serve(self.maas.app)
        # Boot NICs named as the host files' (lab.hosts.BOOT_NIC): MAAS' bridge_all bridge is
        # then the host's br-<ifname>, which the daemon learns from MAAS at deploy.
        self.system_ids = {d: self.maas.add_machine(hostname=d, status="Ready",
                                                    interface_name=BOOT_NIC[self.kinds[d]][1])
                           for d in devices}
        (self.tmp / "hosts").mkdir()
        for d in devices:
            path = write_host_xml(self.tmp / "hosts" / f"{d}.xml", gpus=gpus, name=d,
                                  kind=self.kinds[d])
            # What MAAS' commissioning of the device found (its node devices, MAAS >= 3.0).
            self.maas.set_hardware(self.system_ids[d], path.read_text())
            # MAAS' rack reaches a deployed device's libvirt by its address (lab/virsh_power.py)
            self.maas.virsh.add(d, f"test://{self.tmp}/hosts/{d}.xml")
        self.maas.virsh.rack_key = RACK_KEY
        self.sv = Supervisord(self.tmp / "sv")
        self.sv.start()
        self.procs = AgentProcesses(self.sv.url, self.sv.conf_dir, SLEEPER)
        for d in devices:
            folder = self.tmp / "device-agents" / d
            folder.mkdir(parents=True)
            (folder / "testflinger-agent.conf").write_text(f"agent_id: {d}\n")
            self.procs.add_vm_agent(d, folder, self.procs.allocate_port(owner=d))
            self.db.agents.insert_one({"name": d, "state": "waiting", "job_id": "",
                                       "queues": [HOME], "updated_at": time.time()})
        self._admin_token = None

    def sim_agent_command(self) -> str:
        """The supervisord command of the lab's simulated testflinger-agent (lab/sim_agent.py),
        authenticated as the agent host's client (a refresh token file, as lab.Lab does)."""
        token_file = self.tmp / "refresh_token"
        if not token_file.exists():
            r = requests.post(f"{self.server.url}/v1/oauth2/token",
                              auth=("host", self.clients["host"]["secret"]), timeout=10)
            r.raise_for_status()
            token_file.write_text(json.dumps({"refresh_token": r.json()["refresh_token"]}))
        return (f"{sys.executable} -m testflinger_magic.lab.sim_agent -c {{config}} -p {{port}} "
                f"--token-file {token_file}")

    def submit(self, queue: str = QUEUE) -> str:
        """Submit a job to ``queue`` as an anonymous contributor; returns its job_id."""
        r = requests.post(f"{self.server.url}/v1/job",
                          json={"job_queue": queue, "test_data": {"test_cmds": "true"}},
                          timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["job_id"]

    def job_state(self, job_id: str) -> str:
        doc = self.db.jobs.find_one({"job_id": job_id}) or {}
        return (doc.get("result_data") or {}).get("job_state", "unknown")

    def config_dict(self, **over) -> dict:
        cfg = {
            "server_url": self.server.url, "client_id": "host",
            "secret_key": self.clients["host"]["secret"], "agent_host": HOST,
            "devices": [{"agent_name": d, "maas_system_id": self.system_ids[d], "gpus": self.gpus,
                         "tags": ["nvidia"], "home_queues": [HOME]} for d in self.devices],
            "maas": {"url": f"{self.maas_http.url}/MAAS/", "api_key": MAAS_KEY,
                     "rack_public_keys": [RACK_KEY]},
            "libvirt_uri_template": f"test://{self.tmp}/hosts/{{device}}.xml",
            "splitter": {"kind": "libvirt"},
            "agent_configs_dir": str(self.tmp / "agent-configs"),
            "agent_templates_dir": str(REPO / "agent_configs"),
            "agent_command": SLEEPER,
            "supervisor": {"url": self.sv.url, "conf_dir": str(self.sv.conf_dir),
                           "program_user": None, "metrics_ports": list(self.metrics_ports)},
            "state_dir": str(self.tmp / "state"), "maas_user": "lab",
            # Each test's own machine-wide lock folder: tests run at once on one machine.
            "host_lock_dir": str(self.tmp / "locks"),
            "poll_wait": 0.5, "heartbeat_interval": 1, "maas_poll": 0.05,
            "timeouts": {"deploying": "20s", "enrolling": "20s", "restoring": "30s"},
        }
        cfg.update(over)
        return cfg

    def config(self, **over) -> AgentHostConfig:
        return AgentHostConfig.model_validate(self.config_dict(**over))

    def write_config(self, **over) -> Path:
        path = self.tmp / "agent-host.yaml"
        path.write_text(yaml.safe_dump(self.config_dict(**over)))
        os.chmod(path, 0o600)
        return path

    # -- operator calls --------------------------------------------------------------------
    def _admin(self) -> dict:
        if self._admin_token is None:
            r = requests.post(f"{self.server.url}/v1/oauth2/token",
                              auth=("admin", self.clients["admin"]["secret"]), timeout=10)
            r.raise_for_status()
            self._admin_token = r.json()["access_token"]
        return {"Authorization": f"Bearer {self._admin_token}"}

    def lend(self, device: str = "gpu-host-01") -> str:
        r = requests.post(f"{self.server.url}/v1/magic/leases", headers=self._admin(),
                          json={"device": device, "queue": QUEUE, "reason": "test"}, timeout=10)
        assert r.status_code in (200, 201), r.text
        return r.json()["_id"]

    def lease(self, lease_id: str) -> dict:
        r = requests.get(f"{self.server.url}/v1/magic/leases/{lease_id}", headers=self._admin(),
                         timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def drain(self, lease_id: str) -> None:
        """Drain by hand (forced) and let the server move it on to restoring."""
        r = requests.post(f"{self.server.url}/v1/magic/leases/{lease_id}/drain",
                          headers=self._admin(), json={"reason": "test", "grace": "0s",
                                                       "force": True}, timeout=10)
        assert r.status_code == 200, r.text
        for _ in range(5):
            if self.lease(lease_id)["state"] == "restoring":
                return
            self.plugin.tick()

    # -- what exists -----------------------------------------------------------------------
    def orphans(self) -> dict:
        """Counts of VM leftovers (all 0 after a clean return).

        ``programs`` are what supervisord runs; ``conf_files`` and ``port_reservations`` are
        what it may not run yet (a conf.d file written before a crash) and the metrics ports
        reserved for VM agents (owned reservations never lapse by themselves)."""
        domains = 0
        for d in self.devices:
            conn = libvirt.open(f"test://{self.tmp}/hosts/{d}.xml")
            try:
                domains += len(conn.listAllDomains())
            finally:
                conn.close()
        folders = self.tmp / "agent-configs"
        return {
            "domains": domains,
            "maas_machines": sum(1 for m in self.maas.machines().values()
                                 if m["hostname"] not in self.devices),
            "programs": len([p for p in self.procs.programs() if p not in self.devices]),
            "folders": len(list(folders.iterdir())) if folders.exists() else 0,
            "conf_files": len([p for p in Path(self.sv.conf_dir).glob("*.conf")
                               if p.stem not in self.devices]),
            "port_reservations": len([r for r in self._reservations().values()
                                      if r.get("owner") not in self.devices]),
        }

    def _reservations(self) -> dict:
        """The metrics port reservations file of ``AgentProcesses`` ({port: {owner, at}})."""
        path = self.procs.lock_path
        text = path.read_text() if path.exists() else ""
        return json.loads(text).get("reserved", {}) if text.strip() else {}

    def stop(self) -> None:
        self.sv.stop()
        self.server.stop()
        self.maas_http.stop()


class _JobPollLog:
    """WSGI middleware appending ``(agent_name cookie, HTTP status)`` of every ``GET /v1/job``
    to ``log``: how many job polls an agent made before it got a job."""

    def __init__(self, app, log: list):
        self.app, self.log = app, log

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") != "GET" or environ.get("PATH_INFO") != "/v1/job":
            return self.app(environ, start_response)
        from http.cookies import SimpleCookie

        cookie = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        agent = cookie["agent_name"].value if "agent_name" in cookie else None

        def record(status, headers, exc_info=None):
            self.log.append((agent, int(status.split()[0])))
            return start_response(status, headers, exc_info)

        return self.app(environ, record)


#: What :meth:`DaemonLab.orphans` counts after a clean return: nothing.
NOTHING = {"domains": 0, "maas_machines": 0, "programs": 0, "folders": 0, "conf_files": 0,
           "port_reservations": 0}


@pytest.fixture
def lab(tmp_path):
    """A started :class:`DaemonLab`, stopped after the test (``from daemon_lab import lab``)."""
    parts = DaemonLab(tmp_path)
    yield parts
    parts.stop()
