"""``agent-host.yaml``: the agent-host daemon's configuration (pydantic).

``load_file(path) -> AgentHostConfig`` and ``load_text(text, filename)`` raise ``ConfigError``
whose ``str()`` has one line per problem, ``file:line: field: message``. Secrets are
``SecretStr`` (never printed by ``repr`` or logs); a ``*_file`` variant reads the secret from a
file so the YAML itself can be world-readable. Durations are strings such as ``30m`` (see
``durations.parse_duration``; at most 366d, as everywhere) and are seconds (float) on the model.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from testflinger_magic import names, yamlfile
from testflinger_magic.durations import parse_bounded_duration

#: The repository's VM agent templates (agent_configs/ beside the package).
DEFAULT_TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "agent_configs"

#: testflinger-agent run by supervisord, as the agent-host charm writes it (TESTFLINGER.md §6.2);
#: ``{config}`` (``<agent_dir>/testflinger-agent.conf``), ``{port}``, ``{agent_dir}`` and
#: ``{name}`` are filled per VM agent by agents.AgentProcesses.
DEFAULT_AGENT_COMMAND = "/srv/testflinger-venv/bin/testflinger-agent -c {config} -p {port}"


#: What the server's registration accepts (server/api_hosts.py ``DeviceIn`` and ``RegisterIn`` use
#: these): GPUs per device, the lengths of a device's agent_name and maas_system_id (their
#: characters: testflinger_magic.names), tags and home queues per device and their lengths.
MAX_GPUS = 64
MAX_AGENT_NAME = names.MAX_DEVICE_NAME
MAX_SYSTEM_ID = names.MAX_SYSTEM_ID
MAX_DEVICE_LABELS = 64
MAX_LABEL = 100
#: Devices per agent host: one agent host drives the devices of a rack or two (the agent-host
#: charm runs one testflinger-agent per device on it, TESTFLINGER.md §6); 256 is far above any
#: lab's and keeps one registration (a few writes per device) to well under a second of server
#: work. The server refuses more before reading any device (422 naming ``devices``).
MAX_DEVICES_PER_HOST = 256
#: An agent host's name: it is a path segment of every agent-host call
#: (``/v1/magic/agent-hosts/<host>``), so no ``/``, space, ``?``, ``#`` or ``%``; the server's
#: registration refuses any other (server/api_hosts.py ``register``).
AGENT_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
#: The server reports an agent host stale after this long without a heartbeat
#: (reconcile_model.STALE_HOST_AFTER, seconds; imported from there). The daemon's heartbeat, sent
#: from its poll loop (so up to ``heartbeat_interval + poll_wait`` apart), must come at least
#: twice within it.
from testflinger_magic.reconcile_model import STALE_HOST_AFTER  # noqa: E402


def http_url(value: str, example: str) -> str:
    """``value`` if it is an http(s) URL with a host, else ValueError showing ``example``."""
    from urllib.parse import urlparse

    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL with a host, e.g. {example}")
    return value


class ConfigError(ValueError):
    """A bad agent-host.yaml; ``.issues`` is a list of ``(file, line, field, message)``; a
    problem of the whole file (it cannot be read) has line 0 and field ``-`` and prints as
    ``file: message``."""

    def __init__(self, issues: list[tuple[str, int, str, str]]):
        self.issues = issues
        super().__init__("\n".join(f"{f}:{line}: {field}: {msg}" if line else
                                   (f"{f}: {msg}" if field in ("", "-") else f"{f}: {field}: {msg}")
                                   for f, line, field, msg in issues))


def _duration(value) -> float:
    """A duration (``30m``) in seconds, at most durations.MAX_DURATION like every other."""
    return parse_bounded_duration(value)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: The rule each name field of a device follows (names.py: the server's schema uses the same).
_NAME_RULES = {"agent_name": names.device_name_problem,
               "supervisor_program": names.program_name_problem,
               "maas_system_id": names.system_id_problem}


class DeviceConfig(_Model):
    """One bare-metal device this host drives (registered with the server)."""

    #: characters and length: testflinger_magic.names (its VMs are ``<agent_name>-vmN``).
    agent_name: str = Field(min_length=1)
    #: the device agent's supervisord program; defaults to ``agent_name`` (charm: one per dir).
    supervisor_program: str | None = None
    maas_system_id: str = Field(min_length=1)
    #: the number of GPUs a split can lend (the server plans VMs with it), not the physical
    #: count: ``agent-host check --device`` compares it with the host (gpucensus). 0 is valid:
    #: such a device serves only CPU-only queues (vm.gpus 0, queues.MagicQueue.vms_for).
    gpus: int = Field(ge=0, le=MAX_GPUS)
    tags: list[Annotated[str, Field(min_length=1, max_length=MAX_LABEL)]] = Field(
        default=[], max_length=MAX_DEVICE_LABELS)
    home_queues: list[Annotated[str, Field(min_length=1, max_length=MAX_LABEL)]] = Field(
        default=[], max_length=MAX_DEVICE_LABELS)

    @field_validator("agent_name", "supervisor_program", "maas_system_id")
    @classmethod
    def _names(cls, v, info):
        # One rule per name, shared with the server's schema (names.py); an absent
        # supervisor_program defaults to agent_name below.
        problem = _NAME_RULES[info.field_name](v) if v else None
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _default_program(self):
        if not self.supervisor_program:
            self.supervisor_program = self.agent_name
        return self

    def registration(self) -> dict:
        """The device as the register call sends it (docs/architecture.md)."""
        return {
            "agent_name": self.agent_name,
            "maas_system_id": self.maas_system_id,
            "gpus": self.gpus,
            "tags": list(self.tags),
            "home_queues": list(self.home_queues),
        }


def _read_secret(value: SecretStr | None, path: str | None, what: str) -> SecretStr:
    if value is not None and path:
        raise ValueError(f"give {what} or {what}_file, not both")
    if path:
        try:
            return SecretStr(Path(path).read_text().strip())
        except OSError as exc:
            raise ValueError(f"cannot read {what}_file {path}: {exc.strerror}") from None
    if value is None:
        raise ValueError(f"{what} or {what}_file is required")
    return value


#: MAAS' virsh power driver refuses a query string in power_address
#: (src/provisioningserver/drivers/power/virsh.py, ``VirshSSH.login``).
DEFAULT_POWER_ADDRESS_TEMPLATE = "qemu+ssh://ubuntu@{ip}/system"


def _private_file(path: str, what: str) -> str:
    """The text of a secret file that only its owner may read; ``ValueError`` naming the file
    when it is group/world-readable or cannot be read."""
    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"{what} {path} is readable by others (mode {mode:04o}); "
                             f"make it 0600 (chmod 600 {path})")
        return p.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None


def _public_keys(text: str) -> list[str]:
    """Keys of an authorized_keys-style text: one per line, blank lines and ``#`` comments
    skipped."""
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


class MaasConfig(_Model):
    """MAAS API endpoint (``http://maas:5240/MAAS``) and API key ``consumer:token:secret``, and
    how MAAS' rack controller reaches the VMs' libvirt to power them (power type virsh).

    MAAS powers a VM machine from its rack controller with ``virsh --connect <power_address>``
    over SSH, logging in with the rack's own SSH key or ``power_pass``
    (src/provisioningserver/drivers/power/virsh.py ``VirshSSH.login``), so:

    - ``power_address_template``: the VM machines' ``power_address``; ``{ip}`` (the deployed
      device's address), ``{device}``, ``{system_id}``. No query string: MAAS refuses one.
    - ``rack_public_keys`` / ``rack_public_keys_file`` (authorized_keys format): the rack
      controllers' public keys (``/var/lib/maas/.ssh/id_rsa.pub`` on each rack, or the snap's
      ``/var/snap/maas/current/root/.ssh/id_rsa.pub``), put on the deployed device with the
      daemon's own key.
    - ``power_pass_file``: a password MAAS sends when the host asks for one (``power_pass``);
      the file must be 0600. Read into ``power_pass`` (never give it in the YAML).
    """

    url: str
    api_key: SecretStr | None = None
    api_key_file: str | None = None
    power_address_template: str = DEFAULT_POWER_ADDRESS_TEMPLATE
    rack_public_keys: list[str] = []
    rack_public_keys_file: str | None = None
    power_pass_file: str | None = None
    power_pass: SecretStr | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v):
        # As server_url: without a scheme python-libmaas fails later with a misleading
        # "unreachable ... InvalidUrlClientError" (TRIAL13 F3).
        return http_url(v, "http://maas.example.com:5240/MAAS")

    @field_validator("power_address_template")
    @classmethod
    def _power_address(cls, v):
        from urllib.parse import urlparse

        try:
            sample = v.format(ip="192.0.2.1", device="d", system_id="s")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"only {{ip}}, {{device}}, {{system_id}} may be used ({exc})") from None
        parsed = urlparse(sample)
        if parsed.query or "?" in v:
            raise ValueError("MAAS' virsh power driver refuses a query string in power_address "
                             "(\"Supplying extra parameters to the Virsh address is not "
                             "supported\"): use e.g. qemu+ssh://ubuntu@{ip}/system and authorize "
                             "the rack controllers' keys (rack_public_keys)")
        if not parsed.hostname:
            raise ValueError(f"{v!r} names no host for MAAS' rack controller to SSH to")
        return v

    @model_validator(mode="after")
    def _key(self):
        self.api_key = _read_secret(self.api_key, self.api_key_file, "api_key")
        if self.power_pass is not None:
            raise ValueError("give power_pass_file (a 0600 file), not power_pass")
        if self.power_pass_file:
            self.power_pass = SecretStr(_private_file(self.power_pass_file, "power_pass_file"))
        if self.rack_public_keys_file:
            try:
                text = Path(self.rack_public_keys_file).read_text()
            except OSError as exc:
                raise ValueError(f"cannot read rack_public_keys_file "
                                 f"{self.rack_public_keys_file}: {exc.strerror}") from None
            self.rack_public_keys = list(self.rack_public_keys) + _public_keys(text)
        return self


class SplitterConfig(_Model):
    """``libvirt`` (LibvirtSplitter) or ``script`` (ScriptSplitter running ``command``).

    libvirt only: ``gpu_vendors``: PCI vendor ids whose display controllers are lent as GPUs
    (default NVIDIA; a BMC's ASPEED VGA never is); ``nvswitch_multi_gpu``: allow more than one
    GPU per VM on hosts with NVSwitches (without it such a split is refused, reported as the
    device's hardware fact, and the server lends the device to no such queue again; the
    registration carries the flag, testflinger_magic/fabric.py). What it does: lets the split define those VMs, nothing more. What it does not do:
    the daemon never talks to NVIDIA Fabric Manager, never activates or deactivates a
    partition, and picks a VM's GPUs by NUMA node and PCI address, not by Fabric Manager's
    partition table; the GPUs of such a VM have NVLink only if the operator's own tooling
    activates the partition holding exactly those GPUs before the VM starts and deactivates
    it after (docs/operator-guide.md, "NVSwitch systems"). Leave it unset unless that tooling
    exists; ``agent-host check`` warns while it is set; ``pool_name``/``pool_path``: the ``dir`` storage pool for VM disks,
    created when missing; ``network``: put VM NICs on this libvirt network instead of the
    host bridge (only for labs whose VMs reach MAAS through it; never the NAT ``default``).
    """

    kind: Literal["libvirt", "script"] = "libvirt"
    command: list[str] = []
    #: ``script`` only: seconds one call of the command may take before its whole process group
    #: is killed (a duration such as ``30m``; script_split.ScriptSplitter).
    timeout: float = 1800.0
    #: Storage pool capacity (GiB) to assume on libvirt ``test:///`` URIs only. libvirt's test
    #: driver reports every pool as 100 GiB whatever its host XML says, so without this a
    #: queue with larger VM disks (two-gpu-vm's 200 GiB) fails the pool check in a lab. Real
    #: URIs always use the pool's own capacity. The embedded lab sets it.
    test_pool_gib: float | None = None
    gpu_vendors: list[str] = ["0x10de"]
    nvswitch_multi_gpu: bool = False
    pool_name: str = Field(default="testflinger-magic", min_length=1)
    pool_path: str = "/var/lib/libvirt/images/testflinger-magic"
    network: str | None = None

    @field_validator("gpu_vendors")
    @classmethod
    def _vendors(cls, value):
        out = []
        for v in value:
            if not re.fullmatch(r"0x[0-9a-fA-F]{4}", v):
                raise ValueError(f"{v!r} is not a PCI vendor id like 0x10de")
            out.append(v.lower())
        return out

    @field_validator("pool_path")
    @classmethod
    def _abs(cls, value):
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, v):
        return _duration(v)

    @model_validator(mode="after")
    def _command(self):
        if self.kind == "script" and not self.command:
            raise ValueError("splitter kind 'script' needs a command")
        return self


class SupervisorConfig(_Model):
    """supervisord XML-RPC endpoint and the conf.d where VM agent programs are written."""

    url: str = "unix:///var/run/supervisor.sock"
    conf_dir: str = "/etc/supervisor/conf.d"
    #: VM agents' metrics ports, [low, high): the agent-host charm's range by default
    #: (TESTFLINGER.md §6.3), so device agents and VM agents share one allocation.
    metrics_ports: tuple[int, int] = (8000, 10000)
    #: user VM agent programs run as, with ``HOME`` from its passwd entry (``/home/<user>`` if
    #: absent): the agent-host charm's program template runs every agent as ``ubuntu``
    #: (TESTFLINGER.md §6.2), and tf-test mounts that user's ``~/.ssh``. ``null`` writes no
    #: ``user=``: for a supervisord that does not run as root (the embedded lab).
    program_user: str | None = "ubuntu"

    @field_validator("metrics_ports")
    @classmethod
    def _port_range(cls, value):
        low, high = value
        if not 1024 <= low < high <= 65536:
            raise ValueError(f"metrics_ports must be [low, high) with 1024 <= low < high <= 65536, got {list(value)}")
        return value


class Timeouts(_Model):
    """Per-step time limits in seconds (written as durations), keyed by the lease state acted in."""

    claimed: float = 300.0
    fenced: float = 600.0
    deploying: float = 2700.0
    splitting: float = 1800.0
    enrolling: float = 2700.0
    restoring: float = 3600.0
    active: float = 300.0
    #: not a state: how long a restore keeps being tried while MAAS is unreachable (counted
    #: from the outage's first failed try) before the lease is given up as ``failed``.
    maas_outage: float = 86400.0

    @field_validator("*", mode="before")
    @classmethod
    def _parse(cls, v):
        return _duration(v)

    @field_validator("claimed", "fenced", "deploying", "splitting", "enrolling", "restoring",
                     "active")
    @classmethod
    def _positive(cls, v):
        # 0 would put every step of that state past its deadline at once (TRIAL13 F3).
        # maas_outage 0 stays allowed: give a restore up at the first failed MAAS call.
        if v <= 0:
            raise ValueError("must be more than 0s: every step would overrun its deadline at once")
        return v


class AgentHostConfig(_Model):
    """The whole agent-host.yaml. ``source`` is the file it came from (for messages)."""

    server_url: str
    client_id: str = Field(min_length=1)
    secret_key: SecretStr | None = None
    secret_key_file: str | None = None
    agent_host: str = Field(min_length=1)
    devices: list[DeviceConfig] = Field(default=[], max_length=MAX_DEVICES_PER_HOST)
    maas: MaasConfig
    libvirt_uri_template: str = "qemu+ssh://ubuntu@{ip}/system"
    splitter: SplitterConfig = SplitterConfig()
    agent_configs_dir: str
    agent_templates_dir: str = str(DEFAULT_TEMPLATES_DIR)
    agent_command: str = DEFAULT_AGENT_COMMAND
    #: where VM agents keep run/log/results dirs (``<base>/<agent>/run``); default the agent
    #: folder's parent, agent_configs_dir.
    agent_base_dir: str | None = None
    #: testflinger-agent ``polling_interval`` (seconds) written into VM agent configs.
    agent_polling_interval: int = Field(default=10, ge=1)
    #: pre-warm VM agents (agent_host/prewarm.py): start them while MAAS commissions their VMs,
    #: through ``<state_dir>/agent_launcher.py``, which imports the agent and runs it once the
    #: lease is ``active`` (its go file written). Only for an ``agent_command`` that is a
    #: Python console script (``#!...python`` first line) or ``<python> -m <module>``; any other
    #: command starts once the lease is ``active``, as with ``false``.
    agent_prewarm: bool = True
    supervisor: SupervisorConfig = SupervisorConfig()
    state_dir: str
    #: folder of the machine-wide lock keyed by ``agent_host`` (agent_host/statedir.py
    #: HostLock: one daemon per agent host on a machine, whatever its state_dir). None
    #: (default): /run/lock, else /tmp. Set it only for daemons that must not see each other
    #: (the lab and the tests, each with its own folder).
    host_lock_dir: str | None = None
    #: maas CLI profile the maas2 device connector uses (TESTFLINGER.md §5.3).
    maas_user: str = "maas"
    #: public key put on deployed devices so libvirt over SSH works (file or literal).
    ssh_public_key: str | None = None
    ssh_public_key_file: str | None = None
    #: the host bridge the VMs' NICs join. None (default): the bridge MAAS creates on the
    #: device's boot interface when it deploys it with ``bridge_all`` (``br-<ifname>``, learned
    #: from MAAS at deploy and kept as the lease's journal fact ``bridge``). Set: the VMs join
    #: this bridge instead. With neither, ``splitter.network`` (a libvirt network) must be set.
    bridge: str | None = None
    timeouts: Timeouts = Timeouts()
    poll_wait: float = 30.0
    heartbeat_interval: float = 30.0
    #: seconds between MAAS status polls while waiting.
    maas_poll: float = 10.0
    #: bring-up steps (fenced, deploying, splitting, enrolling) running at once; fences, active
    #: checks and restores are never held back by it (the daemon has a thread per device).
    #: None (default): no cap, one per device (the steps mostly wait on MAAS, so a cap below the
    #: device count only queues later leases behind whole deploys); set it to spare MAAS.
    workers: int | None = Field(default=None, ge=1)
    #: seconds between two orphan sweeps (agent_host/sweep.py) in the daemon; 0: never (the
    #: ``agent-host sweep`` command still works).
    sweep_interval: float = 600.0
    #: an orphan is removed only once it is this old (its file's mtime), or, when it has no
    #: creation time (MAAS machines, libvirt domains), once two sweeps this far apart found it.
    sweep_grace: float = 900.0
    source: str = "<config>"

    @field_validator("poll_wait", "heartbeat_interval", "maas_poll", "sweep_interval",
                     "sweep_grace", mode="before")
    @classmethod
    def _durations(cls, v):
        return _duration(v)

    @field_validator("poll_wait")
    @classmethod
    def _wait_cap(cls, v):
        if v > 30:
            raise ValueError("the server long-polls at most 30s")
        return v

    @field_validator("maas_poll", "heartbeat_interval")
    @classmethod
    def _positive(cls, v):
        if v <= 0:
            raise ValueError("must be more than 0s")
        return v

    @field_validator("heartbeat_interval")
    @classmethod
    def _beat(cls, v, info):
        # A field validator (poll_wait is declared, so validated, before it), not a model one:
        # its error then carries the field, so load_text names heartbeat_interval's line. With
        # the default heartbeat_interval the sum is at most 30s + 30s, never too much.
        wait = info.data.get("poll_wait")
        if wait is not None and v + wait > STALE_HOST_AFTER / 2:
            raise ValueError(
                f"heartbeat_interval ({v:g}s) + poll_wait ({wait:g}s) = {v + wait:g}s: heartbeats "
                f"would come too seldom; the server calls a host stale after "
                f"{STALE_HOST_AFTER:g}s without one, so keep the sum at most "
                f"{STALE_HOST_AFTER / 2:g}s")
        return v

    @field_validator("server_url")
    @classmethod
    def _server_url(cls, v):
        return http_url(v, "https://testflinger.example.com")

    @field_validator("agent_host")
    @classmethod
    def _host_name(cls, v):
        if not AGENT_HOST_RE.match(v):
            raise ValueError(f"{v!r}: letters, digits, '.', '_' and '-' only, starting with a "
                             "letter or digit, at most 100 characters (it is a path segment of "
                             "the server's URLs)")
        return v

    @field_validator("libvirt_uri_template")
    @classmethod
    def _uri(cls, v):
        try:
            v.format(ip="192.0.2.1", device="d", system_id="s")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"only {{ip}}, {{device}}, {{system_id}} may be used ({exc})") from None
        return v

    @model_validator(mode="after")
    def _checks(self):
        self.secret_key = _read_secret(self.secret_key, self.secret_key_file, "secret_key")
        if self.splitter.network and "bridge" not in self.model_fields_set:
            self.bridge = None  # the operator chose a libvirt network over the default bridge
        for key in ("agent_name", "maas_system_id"):
            values = [getattr(d, key) for d in self.devices]
            dupes = sorted({n for n in values if values.count(n) > 1})
            if dupes:
                raise ValueError(f"device {key} repeated: {', '.join(dupes)}")
        if self.ssh_public_key_file and not self.ssh_public_key:
            try:
                self.ssh_public_key = Path(self.ssh_public_key_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read ssh_public_key_file: {exc.strerror}") from None
        return self

    def device(self, agent_name: str) -> DeviceConfig:
        """The device named ``agent_name``; ``KeyError`` if this host does not drive it."""
        for dev in self.devices:
            if dev.agent_name == agent_name:
                return dev
        raise KeyError(agent_name)


def load_text(text: str, filename: str = "<text>") -> AgentHostConfig:
    """Parse and validate agent-host.yaml text; ``ConfigError`` names file, line and field.

    Read like the queue files (:func:`testflinger_magic.yamlfile.parse`): a duplicated key, a
    merge key or absurd nesting is an error with its line, not silently resolved. Anchors and
    aliases are accepted (a file written by ``yaml.safe_dump`` may hold them)."""
    try:
        data, lines = yamlfile.parse(text, hint="write the values out", aliases=True)
    except yamlfile.YamlProblem as exc:
        message = exc.message.removeprefix("YAML syntax error: ")
        if exc.message != message:
            message = f"not valid YAML: {message}"
        elif exc.path[:2] == ("splitter", "gpu_vendors") and "(hexadecimal)" in message:
            # yamlfile's advice (plain decimal) is wrong here: a vendor id is text like
            # "0x10de", and its decimal value (4318) would be refused as no vendor id.
            raw = message.split(" is a YAML", 1)[0].strip("'")
            message = (f"{raw} unquoted is a YAML 1.1 hexadecimal number, not text: quote it, "
                       f"\"{raw}\"")
        raise ConfigError([(filename, exc.line or 1, exc.field or "-", message)]) from None
    if not isinstance(data, dict):
        raise ConfigError([(filename, 1, "-", "expected a mapping at the top level")])
    repeated = _repeated_devices(data, lines, filename)
    try:
        config = AgentHostConfig.model_validate({**data, "source": filename})
    except ValidationError as exc:
        issues = list(repeated)
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            field = ".".join(str(p) for p in loc) or "-"
            msg = err["msg"].removeprefix("Value error, ")
            if repeated and msg.startswith("device ") and " repeated: " in msg:
                continue  # said above, with each repeat's line
            issues.append((filename, yamlfile.line_for(lines, loc) or 1, field, msg))
        raise ConfigError(issues) from None
    if repeated:
        raise ConfigError(repeated)
    return config


def _repeated_devices(data: dict, lines: dict, filename: str) -> list[tuple[str, int, str, str]]:
    """Issues for each device whose ``agent_name`` or ``maas_system_id`` an earlier device
    already has, or whose ``agent_name`` clashes with an earlier one's
    (:func:`names.vm_name_clash`: equal but for case, or one is the other's VM agent name
    ``<device>-vm<N>``), at the later one's line and field (``devices.<i>.<key>``), naming the
    first."""
    devices = data.get("devices")
    if not isinstance(devices, list):
        return []
    issues = []
    for key in ("agent_name", "maas_system_id"):
        first: dict = {}
        for i, dev in enumerate(devices):
            value = dev.get(key) if isinstance(dev, dict) else None
            if not isinstance(value, str) or not value:
                continue
            if value in first:
                j = first[value]
                issues.append((filename, yamlfile.line_for(lines, ("devices", i, key)) or 1,
                               f"devices.{i}.{key}",
                               f"{value!r} is already devices.{j}.{key} (line "
                               f"{yamlfile.line_for(lines, ('devices', j, key))}): each device "
                               f"needs its own {key}"))
            else:
                first[value] = i
    # A name another device's VM agents would have, or a case-only repeat: the server's
    # registration refuses the same (names.vm_name_clash; api_hosts.RegisterIn), at the later one.
    index: dict = {}
    where: dict = {}
    for i, dev in enumerate(devices):
        value = dev.get("agent_name") if isinstance(dev, dict) else None
        if not isinstance(value, str) or not value:
            continue
        why = names.vm_name_clash(value, index, where)
        if why:
            issues.append((filename, yamlfile.line_for(lines, ("devices", i, "agent_name")) or 1,
                           f"devices.{i}.agent_name", why))
        index.setdefault(value.lower(), []).append(value)
        where.setdefault(value, f"devices.{i}, line "
                         f"{yamlfile.line_for(lines, ('devices', i, 'agent_name'))}")
    # One supervisord program per device agent (supervisor_program defaults to agent_name):
    # two devices sharing one would have the fence of either stop the other's agent.
    programs: dict = {}
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            continue
        key = "supervisor_program" if dev.get("supervisor_program") else "agent_name"
        program = dev.get(key)
        if not isinstance(program, str) or not program:
            continue
        if program in programs:
            j = programs[program]
            if key == "agent_name" and devices[j].get("agent_name") == program:
                continue  # the same agent_name twice: said above
            issues.append((filename, yamlfile.line_for(lines, ("devices", i, key)) or 1,
                           f"devices.{i}.{key}",
                           f"supervisord program {program!r} is already devices.{j}'s: lending "
                           "either device would stop the other's agent; give each device its "
                           "own supervisor_program"))
        else:
            programs[program] = i
    return issues


def load_file(path: str | Path) -> AgentHostConfig:
    """Read ``path`` (agent-host.yaml); ``ConfigError`` on a missing file or invalid content."""
    from testflinger_magic.fileutil import InputFileError, read_input_text  # noqa: PLC0415

    try:
        text = read_input_text(path)
    except InputFileError as exc:
        raise ConfigError([(str(path), 0, "-", str(exc))]) from None
    except FileNotFoundError:
        raise ConfigError([(str(path), 0, "-", "no such file")]) from None
    except IsADirectoryError:
        raise ConfigError([(str(path), 0, "-", "is a directory, not an agent-host.yaml")]) \
            from None
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise ConfigError([(str(path), 0, "-", f"cannot read: {why}")]) from None
    return load_text(text, str(path))
