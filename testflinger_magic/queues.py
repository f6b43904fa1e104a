"""Magic queue definitions: the operator YAML, its validation, and the model the server stores.

The file shape is documented in docs/architecture.md ("Queue definitions")::

    magic_queues:
      one-gpu-vm:
        description: ...
        devices: {agents: [...], home_queues: [...], tags: [...], exclude: [...]}
        vms_per_device: gpus          # or a positive integer
        vm: {gpus: 1, vcpus: 8, memory_mib: 32768, disk_gib: 100}
        ...

Every problem is reported as an :class:`Issue` naming file, line and dotted field, e.g.
``queues.yaml:12: magic_queues.one-gpu-vm.policy.max_devices: must be >= 1``. The YAML is
read by :mod:`testflinger_magic.yamlfile` (nodes keep their line), so duplicated keys,
anchors/aliases/merge keys -- which PyYAML would silently resolve -- and absurd nesting are
rejected with a line.

Split along its seams: the numeric bounds with their sources are in queue_bounds.py, the
issues and the YAML/pydantic-to-issue machinery in queue_issues.py, the smarter-lending knobs in
queue_policy.py; this module keeps the models, the cross-field rules and the loading API, and
re-exports the others' public names (``queues.DefinitionError``, ``queues.MAX_VCPUS``, ...).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from testflinger_magic import fabric, vm_rules, webhooks, yamlfile
from testflinger_magic.durations import format_duration
# Re-exported: queues.<name> is how callers and tests name the bounds and the issue types; the
# modules holding them import nothing of this one.
from testflinger_magic.queue_bounds import (  # noqa: F401 - re-exported: queues.<name>
    LIMITS, MAX_DEVICES, MAX_DISK_GIB, MAX_FAILURES, MAX_GPUS, MAX_MEMORY_MIB, MAX_MMIO64_MIB,
    MAX_PRIORITY, MAX_TEXT, MAX_VCPUS, MAX_VMS_PER_DEVICE, MIN_DISK_GIB, MIN_MEMORY_MIB,
    MIN_MMIO64_MIB,
)
from testflinger_magic.queue_issues import (  # noqa: F401 - re-exported: queues.<name>
    FILE_FIELD, MAX_YAML_DEPTH, DefinitionError, Issue,
)
from testflinger_magic.queue_issues import key_path, parse_yaml, pydantic_issues, read_text
from testflinger_magic.queue_policy import (  # noqa: F401 - re-exported: queues.<name>
    MAX_DURATION, Duration, OptDuration, Share, TimeZone, WarmLearn, WarmWindow, _seconds,
    _Strict, knob_issues,
)

__all__ = [
    "Issue",
    "DefinitionError",
    "DeviceSelection",
    "VMSpec",
    "Reclaim",
    "Policy",
    "WarmWindow",
    "WarmLearn",
    "MagicQueue",
    "load_file",
    "load_text",
    "dump_yaml",
    "check_queue_name",
    "load_files",
    "PROVISION_TYPES",
    "UBUNTU_SERIES",
    "LIMITS",
]

#: Testflinger queue names are free strings server-side (``api/schemas.py``: ``job_queue`` is a
#: non-empty String), but they travel in URL paths (``/v1/queues/<q>/agents``) and shell
#: commands, so we allow a conservative subset: no spaces, no ``/``.
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
#: A folder name under agent_configs/ (no path separators, no leading dot).
TEMPLATE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: What a VM agent's connector and a VM host's series may be (vm_rules.py says why).
SERIES_RE = vm_rules.SERIES_RE
UBUNTU_SERIES = vm_rules.UBUNTU_SERIES
#: Device connector types (canonical/testflinger
#: ``device-connectors/src/testflinger_device_connectors/devices/__init__.py::DEVICE_CONNECTORS``).
PROVISION_TYPES = frozenset({
    "cm3", "dell_oemscript", "dragonboard", "fake_connector", "hp_oemscript",
    "lenovo_oemscript", "oem_autoinstall", "maas2", "multi", "muxpi", "netboot",
    "noprovision", "oemrecovery", "oemscript", "control_host_iot", "control_host_kvm",
})
TOP_KEY = "magic_queues"


# ---------------------------------------------------------------------------------------------
# Models (pydantic v2). Shapes/types only; cross-field rules live in _policy_issues().

Text = Annotated[StrictStr, Field(max_length=MAX_TEXT)]
Names = list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT)]]


def _int(lo: int, hi: int):
    """A strict int in ``lo..hi`` (pydantic reports ``Input should be less than or equal to``)."""
    return Annotated[StrictInt, Field(ge=lo, le=hi)]


class DeviceSelection(_Strict):
    """Which devices may be lent: any device whose agent name is in ``agents``, or that has a
    home queue in ``home_queues``, or a tag in ``tags``; never one named in ``exclude``."""

    agents: Names = []
    home_queues: Names = []
    tags: Names = []
    exclude: Names = []


class VMSpec(_Strict):
    """What each VM gets: passthrough ``gpus``, ``vcpus``, ``memory_mib`` (MiB), ``disk_gib``
    (GiB), ``firmware`` (``uefi``: OVMF on q35, which large-BAR GPUs such as H100/H200 need;
    ``bios``: SeaBIOS, no 64-bit MMIO window), ``mmio64_mib`` (OVMF's 64-bit PCI aperture in
    MiB; unset: sized for ``gpus`` H200s, ``splitplan.default_mmio64_mib``; uefi only).
    ``gpus: 0`` (CPU-only VMs) is allowed only with an integer ``vms_per_device``.
    Upper bounds: :data:`MAX_GPUS`, :data:`MAX_VCPUS`, :data:`MAX_MEMORY_MIB` (16 TiB),
    :data:`MAX_DISK_GIB`, :data:`MAX_MMIO64_MIB` (where each comes from is said there)."""

    gpus: _int(0, MAX_GPUS) = 1
    vcpus: _int(1, MAX_VCPUS) = 8
    memory_mib: _int(MIN_MEMORY_MIB, MAX_MEMORY_MIB) = 32768
    disk_gib: _int(MIN_DISK_GIB, MAX_DISK_GIB) = 100
    firmware: Literal["uefi", "bios"] = "uefi"
    mmio64_mib: Optional[_int(MIN_MMIO64_MIB, MAX_MMIO64_MIB)] = None

    @model_validator(mode="after")
    def _aperture_needs_uefi(self):
        if self.firmware == "bios" and self.mmio64_mib is not None:
            raise ValueError("mmio64_mib is OVMF's (uefi) aperture; SeaBIOS (bios) has none")
        return self


class Reclaim(_Strict):
    """Owner reclaim: when home-queue jobs wait longer than ``owner_wait`` seconds, drain the
    lease, giving running jobs ``grace`` seconds before forcing. ``idle_wait`` (unset: as
    ``owner_wait``): a lease none of whose VMs runs a job is reclaimed once the owner's oldest
    job has waited this long (it cancels nothing, so it may be much shorter)."""

    owner_wait: Duration = 1800.0
    grace: Duration = 900.0
    idle_wait: OptDuration = None


def _check_url(url: str, info: ValidationInfo) -> str:
    # Shape only: where it may point depends on the server's allow-list, checked by _load
    # (webhooks.url_problem) and again when sending. The message echoes the URL only in its
    # redacted form (it may hold the hook's token), unless the validation context says the
    # reader is the file's author (``show_urls``: a local validate of their own file).
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1)
    except ValueError:
        ok = False
    if not ok:
        shown = url if (info.context or {}).get("show_urls") else webhooks.redact(url)
        raise ValueError(f"not an http(s) URL with a host: {shown}")
    return url


class Policy(_Strict):
    """Scaling and safety policy of one magic queue. Durations are seconds (float).

    ``max_devices``: devices lent at once; ``max_starting``: leases in bring-up at once;
    ``min_devices``: devices kept lent without demand (warm VMs); ``idle_timeout``: no demand
    this long -> drain; ``max_lease``: a lease older than this drains; ``reclaim``: see
    :class:`Reclaim`; ``priority``: compared with home-queue ``job_priority`` when choosing
    devices; ``provision_timeout``: claim-to-active deadline; ``failures_before_quarantine``:
    failed leases before a device is quarantined; ``notify``: webhook URLs.

    Smarter lending (queue_policy.py; each defaults to the behaviour before it): ``warm``:
    windows (:class:`WarmWindow`) keeping devices lent by schedule, in ``timezone`` (IANA name,
    default UTC); ``warm_learn``: a warm level learnt from arrivals (:class:`WarmLearn`);
    ``device_fit``: ``waste`` (fewest GPUs wasted, then least recent home use) or ``demand``
    (the smallest device whose VMs cover the unmet demand, else the largest);
    ``yield_idle``: a lease whose VMs have all been idle this long (or a partly busy one while
    the queue had no new job this long: reconcile_sharing.Sharing.plan_yields) is drained for
    another magic queue that shares its devices and has jobs waiting with no device to lend,
    its running jobs left to finish (reconcile.YIELD_GRACE), and the queue lends in turns with the other such queues (unset: never); ``max_share``: at most this share (0-1] of each home queue's registered devices
    lent at once, by all magic queues.
    """

    max_devices: _int(1, MAX_DEVICES) = 1
    max_starting: _int(1, MAX_DEVICES) = 1
    min_devices: _int(0, MAX_DEVICES) = 0
    idle_timeout: Duration = 600.0
    max_lease: Duration = 8 * 3600.0
    reclaim: Reclaim = Field(default_factory=Reclaim)
    priority: _int(-MAX_PRIORITY, MAX_PRIORITY) = 0
    provision_timeout: Duration = 2700.0
    failures_before_quarantine: _int(1, MAX_FAILURES) = 3
    #: Webhooks (http/https URLs) told about lends, drains, failures and quarantines.
    notify: list[Annotated[Text, AfterValidator(_check_url)]] = []
    warm: list[WarmWindow] = []
    timezone: TimeZone = "UTC"
    warm_learn: Optional[WarmLearn] = None
    device_fit: Literal["waste", "demand"] = "waste"
    yield_idle: OptDuration = None
    max_share: Share = 1.0


def _vms_per_device(value: Any) -> Any:
    # A plain Union would put "int"/"literal[...]" into the error loc; one validator keeps the
    # field path clean and the message readable.
    if value == "gpus" or (isinstance(value, int) and not isinstance(value, bool)
                           and 1 <= value <= MAX_VMS_PER_DEVICE):
        return value
    raise ValueError(f"must be 'gpus' or an integer in 1..{MAX_VMS_PER_DEVICE} (a device "
                     f"registers at most {MAX_GPUS} GPUs), got {value!r}")


class MagicQueue(_Strict):
    """One magic queue. ``name`` is its key under ``magic_queues``.

    ``vms_per_device`` is ``"gpus"`` (one VM per ``vm.gpus`` passthrough GPUs) or an int.
    """

    name: StrictStr
    description: Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT)]
    devices: DeviceSelection
    vms_per_device: Annotated[Union[Literal["gpus"], int], BeforeValidator(_vms_per_device)] = "gpus"
    vm: VMSpec = Field(default_factory=VMSpec)
    vm_host_series: Text = "jammy"
    agent_template: Text = "maas2-vm"
    provision_type: Text = "maas2"
    policy: Policy = Field(default_factory=Policy)

    def vms_for(self, device_gpus: int) -> int:
        """Number of VMs a device with ``device_gpus`` passthrough GPUs is split into (0: the
        device cannot serve this queue). ``gpus`` mode: ``device_gpus // vm.gpus``; integer
        mode: that integer, capped by how many VMs the GPUs can feed."""
        gpus = max(0, int(device_gpus or 0))
        if self.vms_per_device == "gpus":
            return gpus // self.vm.gpus if self.vm.gpus else 0
        if self.vm.gpus == 0:
            return int(self.vms_per_device)
        return min(int(self.vms_per_device), gpus // self.vm.gpus)

    def vms_text(self, device_gpus: int) -> str:
        """How many VMs a device with ``device_gpus`` GPUs is split into, said so that a cap is
        visible: ``"8 VMs"``, or ``"8 VMs (vms_per_device 16, capped by 8 GPUs at 1 per VM)"``
        when an integer ``vms_per_device`` asks for more than the GPUs can feed."""
        vms = self.vms_for(device_gpus)
        text = f"{vms} VM{'' if vms == 1 else 's'}"
        if self.vms_per_device != "gpus" and vms < int(self.vms_per_device):
            text += (f" (vms_per_device {self.vms_per_device}, capped by {int(device_gpus or 0)} "
                     f"GPUs at {self.vm.gpus} per VM)")
        return text

    def matches(self, device: dict) -> bool:
        """True if ``device`` (a ``magic_devices`` document or similar dict: ``_id`` or
        ``name``, ``tags``, ``home_queues``, ``gpus``, optionally ``nvswitches`` and
        ``nvswitch_multi_gpu``) may be lent to this queue: selected by agent name, home queue
        or tag, not excluded, able to host at least one VM, and not an NVSwitch device its VMs
        of several GPUs would be refused on (:func:`testflinger_magic.fabric.refuses`)."""
        return (self.selects(device) and self.vms_for(device.get("gpus") or 0) >= 1
                and not fabric.refuses(self.vm.gpus, device))

    def selects(self, device: dict) -> bool:
        """True if the ``devices`` selection picks ``device`` (by agent name, home queue or tag,
        not excluded), whatever its GPU count: :meth:`matches` adds that at least one VM fits."""
        name = device.get("_id", device.get("name"))
        sel = self.devices
        if name in sel.exclude:
            return False
        return (name in sel.agents
                or bool(set(device.get("tags") or ()) & set(sel.tags))
                or bool(set(device.get("home_queues") or ()) & set(sel.home_queues)))

    def to_document(self) -> dict:
        """JSON/Mongo-safe dict: ``_id`` = name, every field, durations in seconds."""
        doc = self.model_dump(mode="json")
        doc["_id"] = doc.pop("name")
        return doc

    @classmethod
    def from_document(cls, doc: dict) -> "MagicQueue":
        """Inverse of :meth:`to_document`; ignores the server's bookkeeping keys
        (:data:`BOOKKEEPING_KEYS`). Raises ``pydantic.ValidationError`` on a corrupt document."""
        data = {k: v for k, v in doc.items() if k != "_id" and k not in BOOKKEEPING_KEYS}
        data.setdefault("name", doc.get("_id"))
        return cls.model_validate(data)

    def to_yaml_dict(self) -> dict:
        """The queue as an operator would write it (durations as ``10m``), without ``name``."""
        data = self.model_dump(mode="json")
        del data["name"]
        pol = data["policy"]
        for key in ("idle_timeout", "max_lease", "provision_timeout", "yield_idle"):
            if pol.get(key) is not None:
                pol[key] = format_duration(pol[key])
        for key in ("owner_wait", "grace", "idle_wait"):
            if pol["reclaim"].get(key) is not None:
                pol["reclaim"][key] = format_duration(pol["reclaim"][key])
        if pol.get("warm_learn"):
            for key in ("lookback", "ahead"):
                pol["warm_learn"][key] = format_duration(pol["warm_learn"][key])
        return data


#: Keys the server adds to a stored definition (server/plugin.py, server/engine.py):
#: ``applied_at``/``source`` on apply, ``suspended`` (``{reason, at, lease_id, device}`` when a
#: lease failed because the VM spec does not fit; cleared by re-applying), ``invalid`` (why a
#: stored document no longer validates) and ``unservable`` (``{since, reason}``: it has waiting
#: jobs and no registered device can serve it, server/unservablejobs.py).
BOOKKEEPING_KEYS = frozenset({"applied_at", "source", "suspended", "invalid", "unservable"})


def check_queue_name(name: Any) -> str | None:
    """Return why ``name`` is not a usable magic queue name, or None if it is."""
    if not isinstance(name, str):
        return f"queue name must be a string, got {name!r} (quote it: YAML reads on/yes/1 as values)"
    if not QUEUE_NAME_RE.match(name):
        return (f"invalid queue name {name!r}: use 1-100 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit (no spaces, no '/')")
    return None


# ---------------------------------------------------------------------------------------------
# Cross-field rules (pure): return (relative field path, message) pairs.

def _policy_issues(q: MagicQueue) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    p, sel = q.policy, q.devices
    if p.min_devices > p.max_devices:
        out.append((("policy", "min_devices"),
                    f"min_devices ({p.min_devices}) exceeds max_devices ({p.max_devices})"))
    if p.max_starting > p.max_devices:
        out.append((("policy", "max_starting"),
                    f"max_starting ({p.max_starting}) exceeds max_devices ({p.max_devices})"))
    if p.max_lease <= 0:
        out.append((("policy", "max_lease"), "must be longer than 0s"))
    out.extend(knob_issues(p))
    if p.provision_timeout <= 0:
        out.append((("policy", "provision_timeout"), "must be longer than 0s"))
    elif p.max_lease <= p.provision_timeout:
        out.append((("policy", "max_lease"),
                    f"max_lease ({format_duration(p.max_lease)}) must be longer than "
                    f"provision_timeout ({format_duration(p.provision_timeout)}), or no lease "
                    "would ever serve a job"))
    if not (sel.agents or sel.home_queues or sel.tags):
        out.append((("devices",),
                    "selects no device: give at least one of agents, home_queues, tags"))
    for i, name in enumerate(sel.exclude):
        if name in sel.agents:
            out.append((("devices", "exclude", i),
                        f"device {name!r} is both selected in agents and excluded"))
    if q.name in sel.home_queues:
        out.append((("devices", "home_queues"),
                    f"the magic queue {q.name!r} cannot be its own devices' home queue: the "
                    "device agents would take its jobs"))
    if q.vms_per_device == "gpus" and q.vm.gpus == 0:
        out.append((("vm", "gpus"), "must be >= 1 when vms_per_device is 'gpus'"))
    if problem := vm_rules.series_problem(q.vm_host_series):
        out.append((("vm_host_series",), problem))
    if not TEMPLATE_RE.match(q.agent_template):
        out.append((("agent_template",),
                    f"{q.agent_template!r} must be a folder name under agent_configs/ "
                    "(letters, digits, '.', '_', '-'; no '/')"))
    if problem := vm_rules.provision_type_problem(q.provision_type):
        out.append((("provision_type",), problem))
    return out


# ---------------------------------------------------------------------------------------------
# Public loading API

#: yamlfile's path helpers (queue_warnings.py uses them as ``queues._dotted``/``_line_for``).
_dotted = yamlfile.dotted
_line_for = yamlfile.line_for


def _salvage(spec: dict, name: str, bad_paths: list[tuple]) -> MagicQueue | None:
    """The queue with every invalid value replaced by its default (required fields by a
    placeholder), so cross-field rules can still be checked and reported in the same run.
    None if even that does not validate."""
    data = copy.deepcopy(spec)
    for path in bad_paths:
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path:
            node.pop(path[-1], None)
    data.setdefault("description", "-")
    data.setdefault("devices", {})
    try:
        return MagicQueue.model_validate({**data, "name": name})
    except ValidationError:
        return None


def _compares_salvaged(rel: tuple, msg: str, bad: tuple) -> bool:
    """Whether the cross-field issue ``(rel, msg)`` names the field ``bad`` (a path whose value
    was refused, which :func:`_salvage` replaced by its default) in the same section of the queue:
    ``max_starting (2) exceeds max_devices (1)`` after ``max_devices: -1`` compares with a value
    the operator never wrote (TRIAL9 F1). The cross-field messages name the fields they compare
    by their key."""
    if not bad or not rel or rel[0] != bad[0] or not isinstance(bad[-1], str):
        return False
    return re.search(rf"(?<![\w.]){re.escape(bad[-1])}(?!\w)", msg) is not None


def load_text(text: str, filename: str = "<text>", *,
              webhook_allow: webhooks.AllowList | None = None) -> list[MagicQueue]:
    """Parse and validate a definition file's text; returns the queues in file order.

    ``policy.notify`` URLs must not point inside the lab (:func:`webhooks.url_problem`) unless
    ``webhook_allow`` lists them (default: the allow-list in ``$TESTFLINGER_MAGIC_WEBHOOK_ALLOW``).
    Raises :class:`DefinitionError` listing every issue (file, line, field, message).
    """
    return _load(text, filename, webhook_allow)[0]


def _load(text: str, filename: str, webhook_allow: webhooks.AllowList | None = None,
          show_urls: bool = False) -> tuple[list[MagicQueue], dict]:
    """:func:`load_text` plus the line table (``{path tuple: line}``). ``show_urls``: issues
    name a bad ``policy.notify`` URL as written, for its author validating their own file
    (``testflinger-magic validate``); otherwise (the server's answers) only in its redacted form
    (:func:`webhooks.redact`), as it may carry the hook's token."""
    allow = webhook_allow if webhook_allow is not None else webhooks.AllowList.from_env()
    data, lines = parse_yaml(text, filename)
    if not isinstance(data, dict) or TOP_KEY not in data:
        raise DefinitionError([Issue(filename, _line_for(lines, ()) or 1, TOP_KEY,
                                     f"the file must be a mapping with a '{TOP_KEY}' key")])
    issues: list[Issue] = []
    for key in data:
        if key != TOP_KEY:
            issues.append(Issue(filename, lines[(key,)], str(key),
                                f"unknown top-level key; only '{TOP_KEY}' is allowed"))
    queues_data = data[TOP_KEY]
    if not isinstance(queues_data, dict) or not queues_data:
        issues.append(Issue(filename, lines[(TOP_KEY,)], TOP_KEY,
                            "must be a non-empty mapping of queue name to definition"))
        raise DefinitionError(issues)

    queues: list[MagicQueue] = []
    for name, spec in queues_data.items():
        base = (TOP_KEY, name)
        line = lines[base]
        problem = check_queue_name(name)
        if problem:
            issues.append(Issue(filename, line, _dotted(base), problem))
            continue
        if not isinstance(spec, dict):
            issues.append(Issue(filename, line, _dotted(base),
                                "a queue definition must be a mapping"))
            continue
        if "name" in spec:
            issues.append(Issue(filename, lines[base + ("name",)], _dotted(base + ("name",)),
                                "unknown field (a queue's name is its key)"))
            continue
        bad_paths: list[tuple] = []
        try:
            queue = MagicQueue.model_validate({**spec, "name": name},
                                              context={"show_urls": show_urls})
        except ValidationError as exc:
            issues.extend(pydantic_issues(exc, base, filename, lines, MagicQueue))
            bad_paths = [key_path(e["loc"]) for e in exc.errors(include_url=False)]
            queue = _salvage(spec, name, bad_paths)
        if queue is None:
            continue
        for rel, msg in _policy_issues(queue) + _webhook_issues(queue, allow, show_urls):
            if any(rel[:len(b)] == b or b[:len(rel)] == rel for b in bad_paths):
                continue  # already reported as a type/shape error
            if any(_compares_salvaged(rel, msg, b) for b in bad_paths):
                continue  # compares with a default standing in for a value already refused
            path = base + rel
            issues.append(Issue(filename, _line_for(lines, path), _dotted(path), msg))
        if not bad_paths:
            queues.append(queue)

    # A magic queue used as another queue's home queue would make device agents serve it.
    names = {q.name for q in queues}
    for q in queues:
        for i, home in enumerate(q.devices.home_queues):
            if home in names and home != q.name:
                path = (TOP_KEY, q.name, "devices", "home_queues", i)
                issues.append(Issue(filename, _line_for(lines, path), _dotted(path),
                                    f"{home!r} is a magic queue, not a device's home queue"))
    if issues:
        raise DefinitionError(sorted(issues, key=lambda i: i.line))
    return queues, lines


def _webhook_issues(q: MagicQueue, allow: webhooks.AllowList, show_urls: bool = False
                    ) -> list[tuple[tuple, str]]:
    """``policy.notify`` URLs that point inside the lab (SSRF), judged without DNS, or that
    still carry the redaction marker (copied from ``testflinger-magic queues``: applying it
    would replace the real URL with the placeholder). ``show_urls``: as :func:`_load`."""
    out = []
    for i, url in enumerate(q.policy.notify):
        if webhooks.is_redacted(url):
            out.append((("policy", "notify", i),
                        f"{url} is the redacted form the server shows (the real URL is never "
                        "given back): put the real webhook URL back before applying"))
        elif problem := webhooks.url_problem(url, allow):
            if show_urls:
                problem = problem.replace(webhooks.redact(url), url, 1)
            out.append((("policy", "notify", i), problem))
    return out


def load_file(path: str | Path, *, webhook_allow: webhooks.AllowList | None = None
              ) -> list[MagicQueue]:
    """Read and validate a definition file (UTF-8; ``webhook_allow`` as :func:`load_text`).
    Raises :class:`DefinitionError`, also for an unreadable file (line 0)."""
    path = Path(path)
    return load_text(read_text(path), str(path), webhook_allow=webhook_allow)


def load_files(paths: list[str | Path]) -> dict[str, list[MagicQueue]]:
    """Read and validate several definition files that are meant to be used together
    (``testflinger-magic validate a.yaml b.yaml``): ``{path: [MagicQueue]}`` in the given order.

    Besides each file's own issues, a queue defined in more than one file is an issue (reported
    at its second and later definitions, naming the first): the server keeps one definition per
    name, so one of them would silently win. Raises :class:`DefinitionError` listing the issues
    of every file.
    """
    out: dict[str, list[MagicQueue]] = {}
    issues: list[Issue] = []
    first: dict[str, tuple[str, int]] = {}  # queue name -> (file, line) of its first definition
    for path in map(Path, paths):
        name = str(path)
        try:
            queues, lines = _load(read_text(path), name)
        except DefinitionError as exc:
            issues.extend(exc.issues)
            continue
        for q in queues:
            line = lines.get((TOP_KEY, q.name), 0)
            if q.name in first:
                where = "{}:{}".format(*first[q.name])
                issues.append(Issue(name, line, _dotted((TOP_KEY, q.name)),
                                    f"queue {q.name!r} is already defined in {where}; define "
                                    "each magic queue in one file only"))
            else:
                first[q.name] = (name, line)
        out[name] = queues
    if issues:
        raise DefinitionError(issues)
    return out


def dump_yaml(queues: list[MagicQueue]) -> str:
    """Render queues as a definition file that :func:`load_text` reads back to equal models
    (every field explicit, durations as ``10m``)."""
    data = {TOP_KEY: {q.name: q.to_yaml_dict() for q in queues}}
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
