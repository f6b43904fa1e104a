"""Local write-ahead journal of external effects, one file per lease.

``state_dir/leases/<lease_id>.json`` (mode 0600, replaced atomically with rename) holds::

    {"lease_id": str, "device": str, "entries": [{"at", "action", "target", "phase", "data"}],
     "sent": int, "facts": {str: any}}

Every external effect is written ``begin`` before and ``done`` after, so that after a SIGKILL the
restore step knows what may half exist. ``sent`` counts entries already mirrored to the server
(the report's ``intent``); ``facts`` keeps small things learnt on the way (the device IP, ports).

Test hook: with ``TESTFLINGER_MAGIC_KILL_AFTER=<action>`` in the environment the process SIGKILLs
itself right after that action's effect and before its ``done`` line — the worst moment to die.
Drivers mark finer points inside one effect with :func:`kill_point` (e.g.
``agent.add:conf-written``, between add_vm_agent's conf.d write and its ``addProcessGroup``).

A journal that cannot be parsed (a torn write, a full disk) raises :class:`CorruptJournal`
naming the file; :meth:`CorruptJournal.move_aside` renames it ``<file>.corrupt-<time>`` (kept for
a person) so a fresh journal can start and restore find what exists by discovery.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

from testflinger_magic.fileutil import atomic_write

KILL_ENV = "TESTFLINGER_MAGIC_KILL_AFTER"


def kill_point(name: str) -> None:
    """SIGKILL this process if ``TESTFLINGER_MAGIC_KILL_AFTER`` is ``name`` (resume tests).

    Costs one environment lookup in production, where the variable is never set.
    """
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


class CorruptJournal(ValueError):
    """The journal file ``path`` is not a journal (unparsable JSON or the wrong shape)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{self.path}: corrupt journal ({reason})")

    def move_aside(self) -> Path:
        """Rename the file ``<file>.corrupt-<epoch seconds>`` and return the new path.

        The name ends in neither ``.json`` nor matches ``lease-*.json``, so it is never read as
        a journal again; a person can still look at it.
        """
        target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{n}")
            n += 1
        os.replace(self.path, target)
        return target


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically with mode 0600 (the file may hold secrets)."""
    atomic_write(path, text, mode=0o600)


class Journal:
    """The journal of one lease. Thread-safe (VMs of one lease are worked on in parallel)."""

    def __init__(self, state_dir: str | Path, lease_id: str, device: str = ""):
        self.path = Path(state_dir) / "leases" / f"{lease_id}.json"
        self.lease_id = lease_id
        self._lock = threading.Lock()
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise CorruptJournal(self.path, str(exc)) from None
            if not (isinstance(doc, dict) and isinstance(doc.get("entries"), list)
                    and isinstance(doc.get("sent", 0), int)
                    and isinstance(doc.get("facts", {}), dict)):
                raise CorruptJournal(self.path, "not a journal document")
            doc.setdefault("sent", 0)
            doc.setdefault("facts", {})
            self._doc = doc
        else:
            self._doc = {"lease_id": lease_id, "device": device, "entries": [], "sent": 0,
                         "facts": {}}

    @property
    def device(self) -> str:
        """The device the lease is of (as given when the journal was made)."""
        return self._doc.get("device") or ""

    def _save(self) -> None:
        """Write the document (``_lock`` held): JSON, one entry per line. Each part goes
        through ``json.dumps`` without ``indent``, which is the C encoder; ``indent`` selects
        the pure-Python one, at about twice the CPU, and the whole journal is written at every
        record."""
        head = json.dumps({k: v for k, v in self._doc.items() if k != "entries"})[:-1]
        lines = ",\n  ".join(json.dumps(e) for e in self._doc["entries"])
        entries = f"[\n  {lines}\n]" if lines else "[]"
        write_private(self.path, f'{head}, "entries": {entries}}}\n')

    # -- records -------------------------------------------------------------------------------
    def _append(self, action: str, target: str, phase: str, data: dict | None) -> None:
        entry = {"at": time.time(), "action": action, "target": target, "phase": phase,
                 "data": dict(data or {})}
        with self._lock:
            self._doc["entries"].append(entry)
            self._save()

    def begin(self, action: str, target: str, data: dict | None = None) -> None:
        """Record that ``action`` on ``target`` is about to happen."""
        self._append(action, target, "begin", data)

    def done(self, action: str, target: str, data: dict | None = None) -> None:
        """Record that ``action`` on ``target`` happened."""
        self._append(action, target, "done", data)

    @contextlib.contextmanager
    def effect(self, action: str, target: str, data: dict | None = None):
        """``begin``, run the block, ``done`` (with whatever the block put in the yielded dict).

        The yielded dict starts as a copy of ``data``; nothing is written if the block raises
        (the ``begin`` line stays: the effect may have half happened).
        """
        self.begin(action, target, data)
        result = dict(data or {})
        yield result
        kill_point(action)
        self.done(action, target, result)

    # -- reads ---------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """All entries, oldest first (copies)."""
        with self._lock:
            return [dict(e) for e in self._doc["entries"]]

    def targets(self, action: str) -> list[str]:
        """Targets of every ``action`` begun (done or not), in order, without repeats."""
        seen: list[str] = []
        for e in self.entries():
            if e["action"] == action and e["target"] not in seen:
                seen.append(e["target"])
        return seen

    def last_data(self, action: str, target: str) -> dict | None:
        """``data`` of the latest entry of ``action`` on ``target`` (begin or done), or None."""
        for e in reversed(self.entries()):
            if e["action"] == action and e["target"] == target:
                return e["data"]
        return None

    def unsent(self) -> list[dict]:
        """Entries not yet mirrored to the server, in the report's ``intent`` shape."""
        with self._lock:
            return [{k: e[k] for k in ("action", "target", "phase", "data")}
                    for e in self._doc["entries"][self._doc["sent"]:]]

    def mark_sent(self, count: int) -> None:
        """Record that the first ``count`` entries reached the server."""
        with self._lock:
            if count > self._doc["sent"]:
                self._doc["sent"] = min(count, len(self._doc["entries"]))
                self._save()

    def total(self) -> int:
        """Number of entries."""
        with self._lock:
            return len(self._doc["entries"])

    # -- facts ---------------------------------------------------------------------------------
    def fact(self, key: str, default=None):
        """A remembered fact (JSON value) or ``default``."""
        with self._lock:
            return self._doc["facts"].get(key, default)

    def set_fact(self, key: str, value) -> None:
        """Remember ``value`` (JSON) under ``key``, durably."""
        with self._lock:
            self._doc["facts"][key] = value
            self._save()

    def set_facts(self, facts: dict) -> None:
        """Remember every ``{key: value}`` of ``facts`` (JSON values), durably, in one write."""
        with self._lock:
            self._doc["facts"].update(facts)
            self._save()

    def remove(self) -> None:
        """Delete the journal file (the lease is final on the server)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def journaled_leases(state_dir: str | Path) -> list[str]:
    """Lease ids that have a journal under ``state_dir``."""
    folder = Path(state_dir) / "leases"
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("lease-*.json"))
