"""The global orphan sweep (issue 12 item 5): remove what carries our marks but no open lease owns.

Per-lease restore cleans what a lease knows. This sweep looks at everything on this agent host,
and in MAAS, that carries the daemon's marks (``marks``) for this host's devices:

- ``program``: a supervisord conf.d file ``<device>-vm<N>.conf`` starting with ``agents.MARKER``
  (created: the file's mtime), or a metrics port reserved for ``<device>-vm<N>`` with no such
  file (created: the reservation's time);
- ``folder``: ``<agent_configs_dir>/<device>-vm<N>`` holding ``agents.FOLDER_MARKER`` or a
  ``testflinger-agent.conf`` (created: that file's mtime);
- ``maas``: a MAAS machine named ``<device>-vm<N>`` whose description carries our mark
  (``marks.maas_mark``: its lease id); one with the name but no mark is a person's and is only
  listed (``not ours``);
- ``domain``: a libvirt domain carrying our lease metadata on a device this host deployed and can
  reach. A device's libvirt URI is known only while it is deployed by us: its address comes from
  a lease journal on this host (fact ``device_ip``) and must still be the device's address in
  MAAS, with the device Deployed; otherwise its domains are skipped with a note (a device given
  back was released, and its disk with the domains goes at the next deploy).

It then asks the server for the open leases (``GET /v1/magic/leases?open=1``: every state but
returned/failed, draining included) and decides (:func:`decide`, pure): a thing marked with a
lease id is owned while that lease is open; a program or folder (marked only by name) is owned
while its device has any open lease (that lease's restore finds it by name). What no open lease
owns is an orphan, removed once past the grace (``sweep_grace``): its creation time is that old,
or, for things without one (MAAS machines, domains), it was first seen orphaned that long ago
(kept in ``<state_dir>/sweep.json``). Things are listed BEFORE the leases are fetched, so
anything listed existed before the lease list was taken: a lease created meanwhile cannot own
it, and bring-up makes nothing within seconds of a claim anyway (fence, deploy come first).
The orphans of a lease the server closed while this daemon worked it (an ``abandon --force``
under a live daemon: ``Daemon`` learns it from its work poll or a refused report) are removed
at once by the sweep the daemon then runs, without the grace (``decide``'s ``closed``).

Removal order: programs, domains, MAAS machines (after their domains, as restore does), folders.
Each removal is logged (logger ``testflinger_magic.agent_host.sweep``, one line naming the kind,
name, id and reason); the server has no event route for daemons, so log lines are the record.
Each removal re-checks the mark just before acting (``remove_vm_agent`` refuses an unmarked conf
file, ``remove_agent_folder`` an unmarked folder, a MAAS machine is read again).

``Sweeper(config, drivers, client).run(dry_run=False) -> dict``; ``main(args)`` is
``testflinger-magic agent-host sweep --config FILE [--dry-run] [--json]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from testflinger_magic.agent_host import agents as agents_mod
from testflinger_magic.agent_host import marks
from testflinger_magic.agent_host.journal import CorruptJournal, Journal, journaled_leases
from testflinger_magic.fileutil import atomic_write

log = logging.getLogger(__name__)

#: The order removals happen in (see the module docstring).
KINDS = ("program", "domain", "maas", "folder")


@dataclass(frozen=True)
class Item:
    """One thing the sweep found. ``kind``: one of :data:`KINDS`; ``name``: the VM name
    (``<device>-vm<N>``); ``ref``: what removal acts on (conf file path, folder path, libvirt URI,
    MAAS system_id); ``lease_id``: the lease our mark names (None: marked by name only);
    ``created_at``: epoch seconds or None; ``ours``: False for a thing with our VM name but not
    our mark (listed, never removed)."""

    kind: str
    name: str
    device: str
    ref: str
    lease_id: str | None = None
    created_at: float | None = None
    ours: bool = True

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.ref}|{self.name}"


@dataclass(frozen=True)
class Verdict:
    """What to do with an item: ``action`` ``remove``, ``wait`` (an orphan within the grace)
    or ``keep``; ``reason`` in words."""

    item: Item
    action: str
    reason: str


def decide(items: list[Item], open_leases: list[dict], now: float, grace: float,
           first_seen: dict[str, float],
           closed: dict[str, str] | None = None) -> tuple[list[Verdict], dict[str, float]]:
    """Pure decision of one sweep.

    ``open_leases``: lease documents (``_id``, ``device``) the server reports open;
    ``now``/``grace``: epoch seconds / seconds; ``first_seen``: ``{Item.key: epoch}`` when each
    orphan without a creation time was first seen (from the last sweeps). ``closed``: ``{lease
    id: device}`` of leases the server closed while this daemon worked them (an operator's
    ``abandon --force``: the daemon learnt it from the work poll or a refused report): their
    orphans (marked with the lease, or named for its device while the device has no open
    lease) are removed without the grace, which is for things whose story nobody knows.
    Returns the verdicts (in ``items`` order) and the new ``first_seen`` (orphans only; an
    owned thing is forgotten).
    """
    closed = closed or {}
    closed_devices = set(closed.values())
    open_ids = {d.get("_id") for d in open_leases}
    busy: dict[str, list[str]] = {}
    for d in open_leases:
        busy.setdefault(d.get("device") or "", []).append(d.get("_id"))
    verdicts, seen = [], {}
    for item in items:
        if not item.ours:
            verdicts.append(Verdict(item, "keep", "not ours: named like our VM but without our "
                                                  "mark; left alone"))
            continue
        if item.lease_id is not None:
            if item.lease_id in open_ids:
                verdicts.append(Verdict(item, "keep", f"lease {item.lease_id} is open"))
                continue
            why = f"its lease {item.lease_id} is not open"
        else:
            if item.device in busy:
                verdicts.append(Verdict(item, "keep", f"device {item.device} has open lease(s) "
                                        f"{', '.join(sorted(busy[item.device]))}"))
                continue
            why = f"device {item.device} has no open lease"
        if item.lease_id in closed or (item.lease_id is None and item.device in closed_devices):
            lease_id = item.lease_id or next(k for k, d in closed.items() if d == item.device)
            verdicts.append(Verdict(item, "remove", f"{why}: the server closed lease "
                                    f"{lease_id} while this daemon worked it"))
            continue
        if item.created_at is not None:
            since, what = item.created_at, "created"
        else:
            since = first_seen.get(item.key, now)
            seen[item.key] = since
            what = "first seen orphaned"
        age = now - since
        if age < grace:
            verdicts.append(Verdict(item, "wait", f"{why}; {what} {age:.0f}s ago, removable after "
                                                  f"the {grace:.0f}s grace"))
        else:
            verdicts.append(Verdict(item, "remove", f"{why} ({what} {age:.0f}s ago)"))
    return verdicts, seen


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class Sweeper:
    """The sweep's effects around :func:`decide`. ``drivers``: ``steps.Drivers``;
    ``client``: ``client.MagicClient`` (``open_leases``); ``clock``: epoch seconds."""

    def __init__(self, config, drivers, client, clock=time.time):
        self.config, self.drivers, self.client, self.clock = config, drivers, client, clock
        self.devices = [d.agent_name for d in config.devices]
        self.state_path = Path(config.state_dir) / "sweep.json"
        self._lock = threading.Lock()

    # -- listing ---------------------------------------------------------------------------------
    def _device_of(self, name: str) -> str | None:
        return marks.device_of(name, self.devices)

    def _programs(self) -> list[Item]:
        out = []
        conf_dir = Path(self.config.supervisor.conf_dir)
        for path in sorted(conf_dir.glob("*.conf")) if conf_dir.is_dir() else []:
            device = self._device_of(path.stem)
            if device is None:
                continue
            try:
                ours = path.read_text().startswith(agents_mod.MARKER)
            except OSError:
                continue
            out.append(Item("program", path.stem, device, str(path), None, _mtime(path), ours))
        # A metrics port reserved for a VM agent whose conf file was never written (a step
        # ended between the port's choice and the agent's add): owned reservations never
        # lapse, so it is listed as the program it was for (its removal drops it).
        owners = getattr(self.drivers.agents, "reservation_owners", None)
        listed = {item.name for item in out}
        for name, at in sorted((owners() if owners is not None else {}).items()):
            device = self._device_of(name)
            if device is not None and name not in listed:
                out.append(Item("program", name, device, str(conf_dir / f"{name}.conf"), None,
                                at))
        return out

    def _folders(self) -> list[Item]:
        out = []
        root = Path(self.config.agent_configs_dir)
        for path in sorted(root.iterdir()) if root.is_dir() else []:
            device = self._device_of(path.name)
            if device is None or not path.is_dir():
                continue
            mark = next((p for p in (path / agents_mod.FOLDER_MARKER, path / agents_mod.AGENT_CONF)
                         if p.exists()), None)
            created = _mtime(mark) if mark is not None else None
            out.append(Item("folder", path.name, device, str(path), None, created,
                            mark is not None))
        return out

    def _maas(self, notes: list[str]) -> list[Item]:
        out = []
        try:
            machines = self.drivers.maas.list_machines()
        except Exception as exc:  # noqa: BLE001 - one kind skipped, the rest still swept
            notes.append(f"MAAS machines not listed: {exc}")
            return out
        for m in machines:
            device = self._device_of(m.hostname)
            if device is None:
                continue
            mark = marks.parse_maas_mark(m.description)
            ours = bool(mark and mark["vm"] == m.hostname)
            out.append(Item("maas", m.hostname, device, m.system_id,
                            mark["lease"] if ours else None, None, ours))
        return out

    def _device_uris(self, notes: list[str]) -> dict[str, str]:
        """``{device: libvirt URI}`` for devices deployed by us: an address from a lease journal
        here that MAAS still gives the device, Deployed."""
        ips: dict[str, set[str]] = {}
        for lease_id in journaled_leases(self.config.state_dir):
            try:
                journal = Journal(self.config.state_dir, lease_id)
            except CorruptJournal as exc:
                notes.append(f"journal skipped: {exc}")
                continue
            ip = journal.fact("device_ip")
            if ip and journal.device in self.devices:
                ips.setdefault(journal.device, set()).add(ip)
        uris = {}
        for dev in self.config.devices:
            name = dev.agent_name
            if name not in ips:
                # No open lease journal: a returned lease's is removed with its last step (the
                # restore released the machine), and so is one the server closed under a step
                # (abandon --force), which leaves the device as it was, perhaps Deployed. MAAS
                # says which; a Deployed device without a journal is not known to be ours (a
                # home job deploys it too): its domains are not listed (TRIAL7; TRIAL19 F1:
                # "MAAS does not run it deployed by us" while it did, after an abandon).
                notes.append(self._unjournaled_note(dev))
                continue
            try:
                info = self.drivers.maas.machine(dev.maas_system_id)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name}: MAAS machine {dev.maas_system_id} not read ({exc}): "
                             "domains not listed")
                continue
            here = sorted(ips[name] & set(info.ip_addresses))
            if info.status != "Deployed" or not here:
                where = ", ".join(info.ip_addresses) or "no address"
                notes.append(f"{name}: {info.status} at {where}, not at the journaled "
                             f"{', '.join(sorted(ips[name]))}: domains not listed")
                continue
            uris[name] = self.config.libvirt_uri_template.format(
                ip=here[0], device=name, system_id=dev.maas_system_id)
        return uris

    def _unjournaled_note(self, dev) -> str:
        """The note on a device with no open lease journal here, said from MAAS' status."""
        name = dev.agent_name
        try:
            info = self.drivers.maas.machine(dev.maas_system_id)
        except Exception as exc:  # noqa: BLE001 - a note, not the sweep's failure
            return (f"{name}: no open lease journal here; MAAS machine {dev.maas_system_id} not "
                    f"read ({exc}): domains not listed")
        if info.status != "Deployed":
            return (f"{name}: no open lease journal here and MAAS has it {info.status}: no VM "
                    "of ours can be on it; domains not listed")
        return (f"{name}: Deployed in MAAS with no open lease journal here: not known to be "
                "deployed by us (a home job deploys it too; a lease the server closed under a "
                "step, e.g. abandon --force, leaves it deployed: then release it in MAAS once "
                "checked); domains not listed")

    def _domains(self, notes: list[str]) -> list[Item]:
        splitter = self.drivers.splitter
        listing = getattr(splitter, "lease_domains", None)
        out = []
        for device, uri in self._device_uris(notes).items():
            try:
                if listing is not None:
                    found = listing(uri)
                else:  # a splitter script: only the leases journaled here can be asked about
                    found = {n: lid for lid in journaled_leases(self.config.state_dir)
                             for n in splitter.domains(uri, lid)}
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{device}: domains on {uri} not listed: {exc}")
                continue
            for name, lease_id in sorted(found.items()):
                out.append(Item("domain", name, device, uri, lease_id, None, True))
        return out

    def collect(self) -> tuple[list[Item], list[str]]:
        """Everything carrying our names on this host and in MAAS; notes on what was skipped."""
        notes: list[str] = []
        items = self._programs() + self._folders() + self._domains(notes) + self._maas(notes)
        return items, notes

    # -- state -----------------------------------------------------------------------------------
    def _load_seen(self) -> dict[str, float]:
        try:
            data = json.loads(self.state_path.read_text())
            return {str(k): float(v) for k, v in (data.get("first_seen") or {}).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            return {}

    def _save_seen(self, seen: dict[str, float]) -> None:
        atomic_write(self.state_path, json.dumps({"first_seen": seen}, indent=1), mode=0o600)

    # -- removal ---------------------------------------------------------------------------------
    def _remove(self, item: Item) -> None:
        if item.kind == "program":
            self.drivers.agents.remove_vm_agent(item.name)
        elif item.kind == "folder":
            remove = self.drivers.remove_agent_folder or agents_mod.remove_agent_folder
            remove(Path(item.ref))
        elif item.kind == "domain":
            self.drivers.splitter.restore(item.ref, item.lease_id, [item.name])
        elif item.kind == "maas":
            info = self.drivers.maas.machine(item.ref)
            mark = marks.parse_maas_mark(info.description)
            if info.hostname != item.name or not mark or mark["lease"] != item.lease_id:
                raise RuntimeError(f"MAAS machine {item.ref} changed since it was listed "
                                   f"({info.hostname}, {info.description!r}); left alone")
            self.drivers.maas.delete(item.ref)
        else:  # pragma: no cover - KINDS is closed
            raise ValueError(item.kind)

    def run(self, dry_run: bool = False, log_notes: bool = True,
            closed: dict[str, str] | None = None) -> dict:
        """One sweep. ``log_notes``: log the notes too (the daemon's periodic sweep; the CLI
        prints them in its report instead, so False there keeps each note to one line).
        ``closed``: ``{lease id: device}`` whose orphans go without the grace (:func:`decide`).
        Returns ``{"dry_run", "removed"|"would_remove", "waiting", "kept",
        "failed", "notes"}``, each a list of ``{kind, name, device, ref, lease_id, reason}``
        (``failed`` adds ``error``; ``notes`` are strings). Raises ``client.ClientError`` when
        the open leases cannot be read: nothing is removed without them."""
        with self._lock:
            items, notes = self.collect()
            leases = self.client.open_leases()  # after listing: see the module docstring
            now = self.clock()
            verdicts, seen = decide(items, leases, now, self.config.sweep_grace,
                                    self._load_seen(), closed)
            if not dry_run:
                self._save_seen(seen)

            def row(v: Verdict, **extra) -> dict:
                d = asdict(v.item)
                d.pop("created_at", None)
                d.pop("ours", None)
                return {**d, "reason": v.reason, **extra}

            report = {"dry_run": dry_run, "removed": [], "would_remove": [], "failed": [],
                      "waiting": [row(v) for v in verdicts if v.action == "wait"],
                      "kept": [row(v) for v in verdicts if v.action == "keep"], "notes": notes}
            todo = sorted((v for v in verdicts if v.action == "remove"),
                          key=lambda v: KINDS.index(v.item.kind))
            for v in todo:
                it = v.item
                if dry_run:
                    report["would_remove"].append(row(v))
                    continue
                try:
                    self._remove(it)
                except Exception as exc:  # noqa: BLE001 - one failure does not stop the rest
                    log.error("sweep: could not remove %s %s (%s) on %s: %s", it.kind, it.name,
                              it.ref, it.device, exc)
                    report["failed"].append(row(v, error=str(exc)))
                    continue
                log.warning("sweep: removed orphan %s %s (%s) of device %s%s: %s", it.kind,
                            it.name, it.ref, it.device,
                            f", lease {it.lease_id}" if it.lease_id else "", v.reason)
                report["removed"].append(row(v))
            for note in notes if log_notes else ():
                log.info("sweep: %s", note)
            return report


def format_report(report: dict) -> str:
    """The sweep report as text, one line per thing."""
    lines = []
    heads = (("would_remove", "would remove"), ("removed", "removed"), ("failed", "FAILED"),
             ("waiting", "orphan, waiting"), ("kept", "kept"))
    for key, head in heads:
        for r in report.get(key, []):
            lease = f" lease {r['lease_id']}" if r.get("lease_id") else ""
            err = f" ERROR {r['error']}" if r.get("error") else ""
            lines.append(f"{head}: {r['kind']} {r['name']} ({r['ref']}) device "
                         f"{r['device']}{lease}: {r['reason']}{err}")
    lines += [f"note: {n}" for n in report.get("notes", [])]
    if not any(report.get(k) for k, _ in heads):
        lines.insert(0, "nothing of ours found")
    return "\n".join(lines)


def main(args) -> int:
    """``testflinger-magic agent-host sweep --config FILE [--dry-run] [--json]``.

    Exit status: 0 done (or nothing to do), 1 a removal failed or the server/MAAS could not be
    asked, 2 bad configuration."""
    from testflinger_magic.agent_host.client import ClientError, MagicClient
    from testflinger_magic.agent_host.daemon_cli import cli_config
    from testflinger_magic.agent_host.drivers_build import default_drivers

    config = cli_config(args.config)
    if config is None:
        return 2
    client = MagicClient(config.server_url, config.client_id, config.secret_key)
    sweeper = Sweeper(config, default_drivers(config), client)
    try:
        report = sweeper.run(dry_run=bool(getattr(args, "dry_run", False)), log_notes=False)
    except ClientError as exc:
        print(f"sweep: cannot read the open leases from the server, nothing removed: {exc}")
        return 1
    print(json.dumps(report, indent=1) if getattr(args, "json", False) else format_report(report))
    return 1 if report["failed"] else 0
