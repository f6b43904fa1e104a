"""``--policy`` overrides of ``testflinger-magic simulate``: parse ``KEY=VALUE`` texts and apply
them to copies of the magic queue definitions; the warnings ``validate`` gives for the
definitions a column replays; and the simulation's error, ``SimulationError``.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from testflinger_magic import yamlfile
from testflinger_magic.queue_warnings import queue_warnings
from testflinger_magic.queues import MagicQueue, _policy_issues

#: The ``--policy`` text of a column of the definitions as they are (beside override columns).
AS_DEFINED = "as-defined"


class SimulationError(Exception):
    """A bad ``--policy`` or an invariant the model broke (a bug: the message says which)."""


_INT_FIELDS = ("max_devices", "max_starting", "min_devices", "priority", "failures_before_quarantine")
_POLICY_KEYS = _INT_FIELDS + ("idle_timeout", "max_lease", "provision_timeout",
                              "reclaim.owner_wait", "reclaim.grace", "reclaim.idle_wait",
                              "device_fit", "yield_idle", "max_share", "timezone")


def parse_policy(text: str) -> dict[str, Any]:
    """``"idle_timeout=5m,max_devices=3"`` -> ``{"idle_timeout": "5m", "max_devices": 3}``.
    A key may name one queue: ``one-gpu-vm:max_devices=1``. Values are YAML scalars (``3`` is an
    int, ``5m`` a string). :data:`AS_DEFINED` is ``{}`` (no override). Raises SimulationError
    naming the bad part, also for a text with no ``KEY=VALUE`` (``''``: a second column of the
    definitions as they are, under a blank name)."""
    out: dict[str, Any] = {}
    if text.strip() == AS_DEFINED:
        return out
    if not any(p.strip() for p in text.split(",")):
        raise SimulationError(f"--policy {text!r}: no KEY=VALUE; for a column of the "
                              f"definitions as they are write --policy {AS_DEFINED} (without "
                              "--policy that column is the only one)")
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise SimulationError(f"--policy {text!r}: {part!r} is not KEY=VALUE")
        field_name = key.rpartition(":")[2]
        if field_name not in _POLICY_KEYS:
            close = difflib.get_close_matches(field_name, _POLICY_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(_POLICY_KEYS)}"
            raise SimulationError(f"--policy {text!r}: unknown policy field {field_name!r}{hint}")
        if key in out:
            raise SimulationError(f"--policy {text!r}: {key!r} is given twice; give each key "
                                  "once (a second column is a second --policy)")
        try:  # the definitions file's YAML rules: 0x10, 010, 10_000, 1:30 are refused
            out[key], _ = yamlfile.parse(value.strip())
        except yamlfile.YamlProblem as exc:
            raise SimulationError(f"--policy {text!r}: {key}: {exc.message}") from None
    return out


def apply_policy(definitions: list[MagicQueue], overrides: dict[str, Any]) -> list[MagicQueue]:
    """Copies of ``definitions`` with ``overrides`` (from :func:`parse_policy`) set on each
    queue's ``policy`` (or only on the named queue). Values are validated as the YAML loader
    does (``5m`` -> 300.0). Raises SimulationError on an unknown queue or a bad value."""
    out = [MagicQueue.model_validate(q.model_dump()) for q in definitions]
    names = {q.name for q in out}
    for key, value in overrides.items():
        qname, _, fname = key.rpartition(":")
        if qname and qname not in names:
            raise SimulationError(f"--policy {key}: {qname!r} is not a magic queue in the "
                                  f"definitions ({', '.join(sorted(names))})")
        for q in out:
            if qname and q.name != qname:
                continue
            target, attr = (q.policy.reclaim, fname[8:]) if fname.startswith("reclaim.") \
                else (q.policy, fname)
            try:
                setattr(target, attr, value)
            except ValidationError as exc:
                msg = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
                raise SimulationError(f"--policy {key}={value}: {msg}") from None
    # The cross-field rules of the definitions file (max_starting <= max_devices, max_lease
    # longer than provision_timeout, ...): setattr checks one field at a time.
    for q in out:
        problems = [f"{q.name}: policy.{'.'.join(map(str, rel[1:]))}: {msg}"
                    for rel, msg in _policy_issues(q) if rel[:1] == ("policy",)]
        if problems:
            given = ",".join(f"{k}={v}" for k, v in overrides.items())
            raise SimulationError(f"--policy {given}: " + "; ".join(problems)
                                  + " (checked like the definitions file)")
    return out


def definition_warnings(definitions: list[MagicQueue]) -> list[str]:
    """The warnings ``testflinger-magic validate`` prints (valid, but likely wrong:
    :func:`testflinger_magic.queue_warnings.queue_warnings`) for ``definitions`` as a column
    replays them, ``--policy`` overrides applied: ``"queue NAME: policy.FIELD: message"``,
    queues in name order."""
    return [f"queue {q.name}: {'.'.join(rel)}: {message}"
            for q in sorted(definitions, key=lambda q: q.name)
            for rel, message in queue_warnings(q)]
