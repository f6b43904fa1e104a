"""ScriptSplitter with real small executables (docs/script-splitter.md)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from testflinger_magic.agent_host.script_split import ScriptSplitter
from testflinger_magic.agent_host.splitplan import SplitError, VMPlan

TOY = Path(__file__).parent / "data" / "toy_splitter.py"


def plans(prefix, n, gpus=1):
    return [VMPlan(f"{prefix}-vm{i}", f"52:54:00:00:01:{i:02x}", 2, 1024, 10,
                   f"/var/lib/libvirt/images/{prefix}-vm{i}.qcow2", gpus) for i in range(n)]


def script(tmp_path, name, body) -> list[str]:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return [sys.executable, str(f)]


@pytest.fixture
def toy(tmp_path):
    return ScriptSplitter([sys.executable, str(TOY)], timeout=60,
                          env={"TOY_SPLIT_STATE": str(tmp_path / "state.json"), "TOY_GPUS": "4"})


def test_toy_round_trip(toy):
    gpus = toy.discover("toy:///host")
    assert [g.numa_node for g in gpus] == [0, 0, 1, 1]
    results = toy.split("toy:///host", "lease-a", plans("a", 2, gpus=2))
    assert [r.name for r in results] == ["a-vm0", "a-vm1"]
    assert len({g for r in results for g in r.gpus}) == 4
    assert toy.split("toy:///host", "lease-a", plans("a", 2, gpus=2)) == results  # idempotent
    assert toy.domains("toy:///host") == ["a-vm0", "a-vm1"]
    assert not toy.gpus_free("toy:///host")
    toy.restore("toy:///host", "lease-a", ["a-vm0"])
    assert toy.domains("toy:///host", "lease-a") == ["a-vm1"]
    toy.restore("toy:///host", "lease-a")
    toy.restore("toy:///host", "lease-a")
    assert toy.domains("toy:///host") == [] and toy.gpus_free("toy:///host")


def test_failure_from_stderr_with_exit_code(toy):
    with pytest.raises(SplitError, match=r"failed \(exit 2\): not enough GPUs for a-vm0"):
        toy.split("toy:///host", "lease-a", plans("a", 1, gpus=5))


def test_failure_from_json_error(toy):
    toy.split("toy:///host", "lease-a", plans("a", 1))
    with pytest.raises(SplitError, match="domain a-vm0 belongs to lease-a"):
        toy.split("toy:///host", "lease-b", plans("a", 1))


def test_exit_3_reports_stderr(tmp_path):
    cmd = script(tmp_path, "three.py", """
        import sys
        sys.stdin.read()
        print("virsh: cannot reach host", file=sys.stderr)
        sys.exit(3)
    """)
    with pytest.raises(SplitError, match=r"\(restore\) failed \(exit 3\): virsh: cannot reach"):
        ScriptSplitter(cmd, timeout=30).restore("qemu:///system", "lease-a")


def test_garbage_on_stdout_is_quoted_with_command(tmp_path):
    cmd = script(tmp_path, "garbage.py", """
        import sys
        sys.stdin.read()
        print("Domain vm0 defined from /tmp/x.xml")
    """)
    with pytest.raises(SplitError) as e:
        ScriptSplitter(cmd, timeout=30).domains("qemu:///system")
    assert "garbage.py" in str(e.value) and "Domain vm0 defined" in str(e.value)
    assert "not JSON" in str(e.value)


def test_wrong_shape_is_rejected(tmp_path):
    cmd = script(tmp_path, "shape.py", """
        import json, sys
        req = json.load(sys.stdin)
        name = req.get("vms", [{"name": "x"}])[0]["name"]
        print(json.dumps({"vms": [{"name": name, "mac": "52:54:00:ff:ff:ff"}]}))
    """)
    s = ScriptSplitter(cmd, timeout=30)
    with pytest.raises(SplitError, match="VM a-vm0 has MAC 52:54:00:ff:ff:ff"):
        s.split("x", "lease-a", plans("a", 1))
    with pytest.raises(SplitError, match=r"no result for VM\(s\) \['a-vm1'\]"):
        s.split("x", "lease-a", plans("a", 2))
    with pytest.raises(SplitError, match="'gpus_free' must be bool"):
        s.gpus_free("x")


def test_request_is_the_documented_json(tmp_path):
    seen = tmp_path / "seen.json"
    cmd = script(tmp_path, "echo.py", f"""
        import json, sys
        req = json.load(sys.stdin)
        open({str(seen)!r}, "w").write(json.dumps(req))
        print(json.dumps({{"vms": [dict(name=v["name"], domain=v["name"], mac=v["mac"],
                                        gpus=[], disk=v["disk_path"]) for v in req["vms"]]}}))
    """)
    ScriptSplitter(cmd, timeout=30).split("qemu:///system", "lease-a", plans("a", 1))
    req = json.loads(seen.read_text())
    assert req == {"action": "split", "uri": "qemu:///system", "lease_id": "lease-a",
                   "vms": [plans("a", 1)[0].to_dict()]}


def test_hang_past_timeout_is_killed(tmp_path):
    cmd = script(tmp_path, "hang.py", """
        import subprocess, sys, time
        sys.stdin.read()
        # a grandchild holding stdout: if only the child were killed, reading would never end
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        time.sleep(3600)
    """)
    with pytest.raises(SplitError, match=r"\(discover\): timed out after 1 s"):
        ScriptSplitter(cmd, timeout=1).discover("qemu:///system")


def test_missing_command(tmp_path):
    with pytest.raises(SplitError, match="cannot run"):
        ScriptSplitter([str(tmp_path / "nope")]).discover("x")
    with pytest.raises(ValueError):
        ScriptSplitter([])
