"""ScriptSplitter: the Splitter interface over a lab's own executable (JSON in, JSON out).

The contract is in docs/script-splitter.md. In short: one process per call, the request as one
JSON object on stdin, the answer as one JSON object on stdout, exit 0 on success; a non-zero exit
or an ``{"error": ...}`` answer is a failure whose message is the ``error`` or the end of stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

from testflinger_magic.agent_host.splitplan import GPU, SplitError, VMPlan, VMResult

DEFAULT_TIMEOUT = 1800.0  # seconds; a split of many VMs can take a while on a real host
_QUOTE = 200  # characters of bad output quoted in errors


class ScriptSplitter:
    """Splitter that runs ``command`` (argv list, e.g. ``["/usr/local/bin/lab-split"]``) once per
    call with a JSON request on stdin. ``timeout``: seconds per call; on expiry the whole process
    group is killed and SplitError raised. ``env``: extra environment variables."""

    def __init__(self, command: list[str], timeout: float = DEFAULT_TIMEOUT,
                 env: dict[str, str] | None = None):
        if not command:
            raise ValueError("ScriptSplitter needs a command (argv list)")
        self.command = list(command)
        self.timeout = timeout
        self.env = env

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run the command with ``request``; return its JSON object answer or raise SplitError."""
        action = request["action"]
        name = " ".join(self.command)
        env = {**os.environ, **(self.env or {})}
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)  # own group: kill it all on timeout
        except OSError as e:
            raise SplitError(f"split script {name!r}: cannot run: {e}") from e
        try:
            out, err = proc.communicate(json.dumps(request) + "\n", timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise SplitError(f"split script {name!r} ({action}): timed out after "
                             f"{self.timeout:g} s; stderr: {_tail(err)}") from None
        answer = None
        try:
            answer = json.loads(out) if out.strip() else None
        except json.JSONDecodeError:
            if proc.returncode == 0:
                raise SplitError(f"split script {name!r} ({action}): stdout is not JSON: "
                                 f"{out[:_QUOTE]!r}") from None
        if isinstance(answer, dict) and answer.get("error"):
            raise SplitError(f"split script {name!r} ({action}) failed (exit "
                             f"{proc.returncode}): {answer['error']}")
        if proc.returncode != 0:
            raise SplitError(f"split script {name!r} ({action}) failed (exit "
                             f"{proc.returncode}): {_tail(err) or _tail(out) or 'no output'}")
        if not isinstance(answer, dict):
            raise SplitError(f"split script {name!r} ({action}): stdout must be a JSON object, "
                             f"got {out[:_QUOTE]!r}")
        return answer

    def _field(self, answer: dict, key: str, kind: type, action: str):
        value = answer.get(key)
        if not isinstance(value, kind):
            raise SplitError(f"split script {' '.join(self.command)!r} ({action}): answer field "
                             f"{key!r} must be {kind.__name__}, got {json.dumps(value)[:_QUOTE]}")
        return value

    def discover(self, uri: str) -> list[GPU]:
        """``{"action": "discover", "uri"}`` -> ``{"gpus": [GPU dicts]}``."""
        answer = self._call({"action": "discover", "uri": uri})
        try:
            return [GPU.from_dict(g) for g in self._field(answer, "gpus", list, "discover")]
        except (KeyError, TypeError, AttributeError) as e:
            raise SplitError(f"split script {' '.join(self.command)!r} (discover): bad GPU "
                             f"entry: {e!r}") from e

    def split(self, uri: str, lease_id: str, vms: list[VMPlan]) -> list[VMResult]:
        """``{"action": "split", "uri", "lease_id", "vms": [VMPlan dicts]}`` ->
        ``{"vms": [{name, domain, mac, gpus, disk}]}``, one per planned VM (any order; returned
        in plan order). Raises SplitError when a VM is missing or a field has the wrong type."""
        answer = self._call({"action": "split", "uri": uri, "lease_id": lease_id,
                             "vms": [vm.to_dict() for vm in vms]})
        got = {}
        cmd = " ".join(self.command)
        for entry in self._field(answer, "vms", list, "split"):
            try:
                result = VMResult(name=entry["name"], domain=entry.get("domain") or entry["name"],
                                  mac=str(entry["mac"]).lower(), gpus=list(entry.get("gpus", [])),
                                  disk=entry.get("disk", ""))
            except (KeyError, TypeError, AttributeError) as e:
                raise SplitError(f"split script {cmd!r} (split): bad VM entry "
                                 f"{json.dumps(entry)[:_QUOTE]}: missing {e}") from e
            got[result.name] = result
        missing = [vm.name for vm in vms if vm.name not in got]
        if missing:
            raise SplitError(f"split script {cmd!r} (split): no result for VM(s) {missing}")
        for vm in vms:
            if got[vm.name].mac != vm.mac.lower():
                raise SplitError(f"split script {cmd!r} (split): VM {vm.name} has MAC "
                                 f"{got[vm.name].mac}, plan says {vm.mac}")
        return [got[vm.name] for vm in vms]

    def restore(self, uri: str, lease_id: str, names: list[str] | None = None) -> None:
        """``{"action": "restore", "uri", "lease_id", "names": [..] | null}`` -> ``{}``."""
        self._call({"action": "restore", "uri": uri, "lease_id": lease_id,
                    "names": list(names) if names is not None else None})

    def domains(self, uri: str, lease_id: str | None = None) -> list[str]:
        """``{"action": "domains", "uri", "lease_id": str | null}`` -> ``{"domains": [names]}``."""
        answer = self._call({"action": "domains", "uri": uri, "lease_id": lease_id})
        names = self._field(answer, "domains", list, "domains")
        if not all(isinstance(n, str) for n in names):
            raise SplitError(f"split script {' '.join(self.command)!r} (domains): names must be "
                             f"strings, got {json.dumps(names)[:_QUOTE]}")
        return sorted(names)

    def gpus_free(self, uri: str) -> bool:
        """``{"action": "gpus_free", "uri"}`` -> ``{"gpus_free": bool}``."""
        return self._field(self._call({"action": "gpus_free", "uri": uri}), "gpus_free", bool,
                           "gpus_free")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text: str | None) -> str:
    text = (text or "").strip()
    return text[-_QUOTE * 2:] if len(text) > _QUOTE * 2 else text
