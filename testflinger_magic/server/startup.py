"""Start-up definitions (``init_app(definitions=...)``, ``$TESTFLINGER_MAGIC_QUEUES``): applied
when new or changed, not at every process start.

Every server process applies them as it starts (each gunicorn worker imports the app; workers
are recycled; replicas restart and get upgraded). Applying them every time would silently undo
what an operator did since with ``apply`` (a queue removed comes back and its leases' removed-
queue drains are undone, a timeout raised falls back to the file's). So one ``magic_startup``
document per start-up source records the digest of what that source last applied::

    {_id: source, digest: "sha256 hex", state: "applying" | "applied",
     claimed_at, applied_at: epoch seconds, queues: [names]}

``source`` is the file's absolute path, or ``"init_app"`` for a list of MagicQueue (the lab,
tests). The digest is of the file's parsed YAML (:func:`yamlfile.parse`, keys sorted: comments,
layout and key order do not count, a changed value does) or, for a list, of the queues'
documents. At a start:

* same digest, ``applied``: nothing is applied; the stored definitions stand (an info log
  says so);
* another digest, or none: the process claims the source with a compare-and-set from the
  record it read (an insert when none), so of two replicas that read it at the same moment
  one applies the file; the other, with the same file or another one, applies nothing (a
  different file of the loser's is applied at its next start: the stored digest is not its
  own). The winner applies (``prune=False``, as before) and marks the record ``applied``;
* same digest, still ``applying``: the replica that claimed it is applying it right now, or
  stopped before it finished (a crash, a definition refused at start: ``init_app`` raised):
  applying the same file again changes nothing the first apply wrote, so it is applied again
  and marked ``applied``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from testflinger_magic import queues as queues_mod
from testflinger_magic import yamlfile
from testflinger_magic.db import DuplicateKeyErrors

log = logging.getLogger(__name__)

#: ``_id`` of the record of definitions given as a list of MagicQueue (no file).
LIST_SOURCE = "init_app"


def _coll(db):
    return db.magic_startup


def _digest(data) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def load(definitions, webhook_allow=None) -> tuple[list, str, str] | None:
    """``(queues, source, digest)`` of the start-up ``definitions`` (None, a list of
    MagicQueue, or a YAML path validated with ``webhook_allow``), or None when there are none.

    A file is read once (what is applied is what is digested); ``source`` is its absolute
    path. Raises ``queues.DefinitionError`` on a bad or unreadable file."""
    if definitions is None:
        return None
    if isinstance(definitions, (str, Path)):
        path = os.path.abspath(str(definitions))
        text = queues_mod.read_text(Path(path))
        defs = queues_mod.load_text(text, path, webhook_allow=webhook_allow)
        # Parsed as load_text did, so the text is valid here.
        return (defs, path, _digest(yamlfile.parse(text)[0])) if defs else None
    defs = list(definitions)
    if not defs:
        return None
    return defs, LIST_SOURCE, _digest([q.to_document() for q in defs])


def claim(db, source: str, digest: str, seen: dict | None, now: float) -> bool:
    """Claim the start-up apply of ``digest`` from ``source``: a compare-and-set from the
    record read (``seen``; an insert when there was none). True if this process won; False if
    another one changed the record since it was read (it applies its own)."""
    new = {"digest": digest, "state": "applying", "claimed_at": now, "applied_at": None,
           "queues": []}
    if seen is None:
        try:
            _coll(db).insert_one({"_id": source, **new})
        except DuplicateKeyErrors:
            return False
        return True
    r = _coll(db).update_one({"_id": source, "digest": seen.get("digest"),
                              "state": seen.get("state"),
                              "claimed_at": seen.get("claimed_at")}, {"$set": new})
    return r.modified_count == 1


def apply_at_start(plugin, definitions) -> dict | None:
    """Apply the start-up ``definitions`` (as :func:`load` takes them) with ``plugin``
    (``MagicPlugin.apply``, ``prune=False``) if they are new or changed since this source's
    last start-up apply (module docstring). Returns apply's answer, or None when nothing was
    applied. Raises ``queues.DefinitionError`` (bad file, a queue named like a registered
    device), as ``apply`` does."""
    loaded = load(definitions, plugin.webhook_allow)
    if loaded is None:
        return None
    defs, source, digest = loaded
    db = plugin.db
    seen = _coll(db).find_one({"_id": source})
    if seen is not None and seen.get("digest") == digest:
        if seen.get("state") == "applied":
            log.info("start-up definitions from %s unchanged since their start-up apply "
                     "(epoch %s): not applied again; the stored definitions stand (change "
                     "the file, or apply it by hand, to make it win)", source,
                     seen.get("applied_at"))
            return None
        # Claimed with this digest but not marked applied: being applied now, or the claimer
        # stopped first. Applying the same definitions again is idempotent.
    elif not claim(db, source, digest, seen, plugin.clock()):
        log.info("start-up definitions from %s: another server process claimed their start-up "
                 "apply at the same moment; this one applies nothing", source)
        return None
    out = plugin.apply(defs, source=source, prune=False)
    _coll(db).update_one({"_id": source, "digest": digest},
                         {"$set": {"state": "applied", "applied_at": plugin.clock(),
                                   "queues": [q.name for q in defs]}})
    return out
