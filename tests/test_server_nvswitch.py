"""A device's NVSwitches as the server learns and keeps them (server/devicefacts.py,
testflinger_magic/fabric.py), over real HTTP with mongomock: the report contract (``blame:
hardware``, ``facts``), what a registration keeps or resets, the operator's forget, and the
preflight's words for a test engineer."""

from __future__ import annotations

import pytest
import requests

from conftest import MagicStack
from test_server_api import DEVICES, register, report, submit
from test_server_flow import Clock

#: One queue of two GPUs per VM over both registered devices (2 GPUs each).
TWO_YAML = """\
magic_queues:
  two-gpu-vm:
    description: One VM with two passthrough GPUs
    devices:
      home_queues: [gpu-hosts]
    vms_per_device: gpus
    vm: {gpus: 2, vcpus: 2, memory_mib: 4096, disk_gib: 20}
    policy:
      max_devices: 1
      max_starting: 1
      idle_timeout: 10m
"""

REFUSAL = ("splitting: MultiGPUNeedsFabric: test:///h.xml: 2 GPUs per VM on a host with 4 "
           "NVSwitch(es) need NVIDIA Fabric Manager ...")


@pytest.fixture
def stack(mongo, serve):
    s = MagicStack(mongo, serve, yaml_text=TWO_YAML, clock=Clock())
    yield s
    s.plugin.stop()


def to_splitting(m, lease):
    for to_state in ("fenced", "deploying", "splitting"):
        r = report(m, lease, to_state=to_state)
        assert r.status_code == 200, r.text
        lease = r.json()
    return lease


def kinds(m):
    return [e["kind"] for e in m.db.magic_events.find({})]


def refuse_first_lend(m) -> dict:
    """Register, submit, and have the first lend's split refused for its NVSwitches."""
    assert register(m).status_code == 200
    submit(m, "two-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = to_splitting(m, lease)
    r = report(m, lease, result="error", message=REFUSAL, blame="hardware",
               facts={"nvswitches": 4})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_hardware_refusal_keeps_the_fact_and_the_queue_lending(stack):
    m = stack
    lease = refuse_first_lend(m)
    assert lease["state"] == "restoring" and "MultiGPUNeedsFabric" in lease["error"]
    dev = m.db.magic_devices.find_one({"_id": lease["device"]})
    assert (dev["failures"], dev["quarantined"], dev["nvswitches"]) == (0, False, 4)
    assert dev["nvswitches_found"]["lease_id"] == lease["_id"]
    assert dev["nvswitches_found"]["queue"] == "two-gpu-vm"
    assert m.db.magic_queues.find_one({"_id": "two-gpu-vm"}).get("suspended") is None
    assert {"lease.unfit_device", "device.nvswitches"} <= set(kinds(m))
    assert not {"queue.misconfigured", "device.failure"} & set(kinds(m))
    # The restore ends; the job still waits; the next lend is the other device.
    assert report(m, lease, to_state="returned").status_code == 200
    m.plugin.tick()
    (nxt,) = list(m.db.magic_leases.find({"_id": {"$ne": lease["_id"]}}))
    assert nxt["device"] != lease["device"]
    # A split's ok report carries the other device's count: 0, no event for it.
    nxt = to_splitting(m, nxt)
    vms = [{"index": 0, "domain": nxt["vms"][0]["name"], "mac": "52:54:00:00:00:01",
            "gpus": ["0000:17:00.0", "0000:31:00.0"], "disk": "/d/x.img"}]
    r = report(m, nxt, to_state="enrolling", vms=vms, facts={"nvswitches": 0})
    assert r.status_code == 200, r.text
    assert m.db.magic_devices.find_one({"_id": nxt["device"]})["nvswitches"] == 0
    assert kinds(m).count("device.nvswitches") == 1


def test_the_report_contract_refuses_what_would_teach_nothing(stack):
    m = stack
    assert register(m).status_code == 200
    submit(m, "two-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    lease = to_splitting(m, lease)
    cases = [({"blame": "hardware"}, "facts"),  # no fact: the next lend would repeat it
             ({"blame": "hardware", "facts": {"nvlinks": 3}}, "facts.nvlinks"),
             ({"blame": "hardware", "facts": {"nvswitches": -1}}, "facts.nvswitches"),
             ({"blame": "hardware", "facts": {"nvswitches": True}}, "facts.nvswitches"),
             ({"blame": "hardware", "facts": [4]}, "facts")]
    for extra, field in cases:
        r = report(m, lease, result="error", message=REFUSAL, **extra)
        assert r.status_code == 422 and field in r.text, (extra, r.text)
    assert m.db.magic_leases.find_one({"_id": lease["_id"]})["state"] == "splitting"
    assert "nvswitches" not in m.db.magic_devices.find_one({"_id": lease["device"]})


def test_only_nvswitch_devices_selected_wait_saying_why_and_lend_nothing(stack):
    m = stack
    lease = refuse_first_lend(m)
    assert report(m, lease, to_state="returned").status_code == 200
    board = lease["device"]
    other = next(d["agent_name"] for d in DEVICES if d["agent_name"] != board)
    # The other device turns out to be an HGX board too: its split refused the same way.
    m.plugin.tick()
    (nxt,) = list(m.db.magic_leases.find({"_id": {"$ne": lease["_id"]}}))
    assert nxt["device"] == other
    r = report(m, to_splitting(m, nxt), result="error", message=REFUSAL, blame="hardware",
               facts={"nvswitches": 4})
    assert r.status_code == 200, r.text
    assert report(m, r.json(), to_state="returned").status_code == 200
    for d in DEVICES:  # the device agents' startup posts after the give-back
        requests.post(f"{m.url}/v1/agents/data/{d['agent_name']}",
                      json={"state": "waiting", "queues": ["gpu-hosts"], "job_id": ""},
                      timeout=10)
    for _ in range(3):  # no deploy loop: nothing more is lent, though both agents wait
        m.plugin.tick()
    assert m.db.magic_leases.count_documents({}) == 2
    (blocked,) = [a for a in requests.get(f"{m.url}/v1/magic/plan", headers=m.headers("admin"),
                                          timeout=10).json()["actions"]
                  if a["kind"] == "blocked"]
    assert "2 GPUs per VM need NVIDIA Fabric Manager" in blocked["reason"]
    assert f"{board} (4 NVSwitches, found by lease {lease['_id']})" in blocked["reason"]
    assert "splitter.nvswitch_multi_gpu: true" in blocked["reason"]
    (row,) = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                          timeout=10).json()["queues"]
    assert row["suspended"] is None and row["devices_eligible"] == 0
    assert row["blocked"]["reason"] == blocked["reason"]
    assert "2 GPUs per VM need NVIDIA Fabric Manager" in row["unservable"]
    # TRIAL10: with no job waiting (the preflight refuses new ones and sends the test engineer's
    # operators to status), status still says why nothing can serve the queue.
    m.db.jobs.update_many({"job_data.job_queue": "two-gpu-vm"},
                          {"$set": {"result_data.job_state": "cancelled"}})
    (row,) = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                          timeout=10).json()["queues"]
    assert row["blocked"] is None and "NVIDIA Fabric Manager" in row["unservable"]
    from testflinger_magic.cli_output import _why_jobs_wait
    assert _why_jobs_wait([row])[0].startswith(
        "two-gpu-vm: no registered device can serve it: 2 GPUs per VM need NVIDIA Fabric")
    page = requests.get(f"{m.url}/v1/magic/", headers=m.headers("admin"), timeout=10).text
    assert "no registered device can serve it: 2 GPUs per VM need NVIDIA Fabric" in page
    submit(m, "two-gpu-vm")
    # The test engineer's preflight: why, and no operator step (apply, agent-host.yaml).
    pre = requests.get(f"{m.url}/v1/queues/two-gpu-vm/agents", timeout=10)
    assert pre.status_code == 404, pre.text
    msg = pre.json()["message"]
    assert "NVSwitches" in msg and "operators" in msg
    assert "apply" not in msg and "nvswitch_multi_gpu" not in msg
    # apply's warning (an operator's) names the devices and the choices.
    r = requests.put(f"{m.url}/v1/magic/queues", headers=m.headers("admin"),
                     json={"yaml": TWO_YAML.replace("10m", "20m"), "source": "q.yaml"},
                     timeout=10)
    assert r.status_code == 200 and "nvswitch_multi_gpu" in str(r.json()["warnings"]), r.text
    # The agent host's opt-in, carried by its registration, makes them eligible again.
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/host-a", headers=m.headers("agent"),
                      json={"devices": DEVICES, "version": "0.1", "nvswitch_multi_gpu": True},
                      timeout=10)
    assert r.status_code == 200, r.text
    m.plugin.tick()
    assert m.db.magic_leases.count_documents({"state": "claimed"}) == 1
    # The facts stay (the opt-in decides), and an older daemon's registration keeps the opt-in.
    assert register(m).status_code == 200
    dev = m.db.magic_devices.find_one({"_id": board})
    assert (dev["nvswitches"], dev["nvswitch_multi_gpu"]) == (4, True)


def test_a_changed_hardware_statement_or_the_operator_forgets_the_fact(stack):
    m = stack
    lease = refuse_first_lend(m)
    assert report(m, lease, to_state="returned").status_code == 200
    board = lease["device"]
    # Registered again as it was: the fact stays.
    assert register(m).status_code == 200
    assert m.db.magic_devices.find_one({"_id": board})["nvswitches"] == 4
    # Another GPU count (the board swapped or rebuilt): the fact is dropped.
    changed = [dict(d, gpus=4) if d["agent_name"] == board else d for d in DEVICES]
    assert register(m, devices=changed).status_code == 200
    assert m.db.magic_devices.find_one({"_id": board})["nvswitches"] is None
    # Learnt again, then forgotten by an operator (API; the CLI calls it).
    m.db.magic_devices.update_one({"_id": board}, {"$set": {"nvswitches": 4}})
    r = requests.delete(f"{m.url}/v1/magic/devices/{board}/nvswitches",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 200 and r.json()["previous"]["nvswitches"] == 4, r.text
    assert m.db.magic_devices.find_one({"_id": board})["nvswitches"] is None
    assert "device.facts_forgotten" in kinds(m)
    r = requests.delete(f"{m.url}/v1/magic/devices/nope/nvswitches",
                        headers=m.headers("admin"), timeout=10)
    assert r.status_code == 404
    r = requests.delete(f"{m.url}/v1/magic/devices/{board}/nvswitches",
                        headers=m.headers("agent"), timeout=10)
    assert r.status_code == 403


def register_counts(m, counts: dict, devices=DEVICES):
    """Register with the NVSwitch count MAAS gave per device (``{agent_name: N}``)."""
    body = [dict(d, **({"nvswitches": counts[d["agent_name"]]}
                       if d["agent_name"] in counts else {})) for d in devices]
    return requests.post(f"{m.url}/v1/magic/agent-hosts/host-a", headers=m.headers("agent"),
                         json={"devices": body, "version": "0.1"}, timeout=10)


def test_a_count_from_maas_commissioning_keeps_the_board_out_before_any_lend(stack):
    """TRIAL13 F16: the registration carries the count MAAS' commissioning listed, so the
    first two-GPU lend never picks the HGX board (no deploy wasted to learn it)."""
    m = stack
    r = register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 0})
    assert r.status_code == 200, r.text
    board = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert board["nvswitches"] == 4
    found = board["nvswitches_found"]
    assert (found["source"], found["lease_id"], found["queue"], found["refused"]) == \
        ("maas", None, None, False)
    assert m.db.magic_devices.find_one({"_id": "gpu-host-02"})["nvswitches"] == 0
    (event,) = [e for e in m.db.magic_events.find({"kind": "device.nvswitches"})]
    assert event["device"] == "gpu-host-01" and "MAAS" in event["message"]
    assert "abc123" in event["message"] and event["data"]["source"] == "maas"
    submit(m, "two-gpu-vm")
    m.plugin.tick()
    (lease,) = list(m.db.magic_leases.find({}))
    assert lease["device"] == "gpu-host-02"
    assert lease["device"] == "gpu-host-02"


def test_boards_maas_listed_nvswitches_on_wait_saying_why_with_no_lend(stack):
    m = stack
    assert register_counts(m, {"gpu-host-01": 4, "gpu-host-02": 4}).status_code == 200
    submit(m, "two-gpu-vm")
    for _ in range(2):
        m.plugin.tick()
    assert m.db.magic_leases.count_documents({}) == 0  # no deploy to learn what MAAS knew
    (blocked,) = [a for a in requests.get(f"{m.url}/v1/magic/plan",
                                          headers=m.headers("admin"), timeout=10)
                  .json()["actions"] if a["kind"] == "blocked"]
    for board in ("gpu-host-01", "gpu-host-02"):
        assert f"{board} (4 NVSwitches, listed by MAAS commissioning)" in blocked["reason"]
    assert "found by lease" not in blocked["reason"]
    (row,) = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                          timeout=10).json()["queues"]
    assert row["blocked"]["reason"] == blocked["reason"] and row["devices_eligible"] == 0
    pre = requests.get(f"{m.url}/v1/queues/two-gpu-vm/agents", timeout=10)
    assert pre.status_code == 404 and "NVSwitches" in pre.json()["message"], pre.text
    devices = requests.get(f"{m.url}/v1/magic/status", headers=m.headers("admin"),
                           timeout=10).json()["devices"]
    assert {d["nvswitches_found"]["source"] for d in devices} == {"maas"}


def test_the_registration_count_is_checked_like_the_other_fields(stack):
    m = stack
    for bad in (-1, 65, "4", True, 4.5):
        r = register_counts(m, {"gpu-host-01": bad})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["detail"]["json"]["devices"]["0"]["nvswitches"], (bad, r.text)
        assert m.db.magic_devices.count_documents({}) == 0
    assert register_counts(m, {"gpu-host-01": None}).status_code == 200
    assert m.db.magic_devices.find_one({"_id": "gpu-host-01"}).get("nvswitches") is None


def test_a_count_a_split_learnt_is_kept_over_maas(stack):
    m = stack
    lease = refuse_first_lend(m)  # gpu-host-01's split found 4
    assert report(m, lease, to_state="returned").status_code == 200
    assert register_counts(m, {lease["device"]: 0}).status_code == 200
    dev = m.db.magic_devices.find_one({"_id": lease["device"]})
    assert dev["nvswitches"] == 4 and dev["nvswitches_found"]["lease_id"] == lease["_id"]
    # A changed hardware statement clears it: MAAS' count of the new statement is taken.
    changed = [dict(d, gpus=4) if d["agent_name"] == lease["device"] else d for d in DEVICES]
    assert register_counts(m, {lease["device"]: 0}, devices=changed).status_code == 200
    dev = m.db.magic_devices.find_one({"_id": lease["device"]})
    assert dev["nvswitches"] == 0 and dev["nvswitches_found"]["source"] == "maas"


def test_maas_may_correct_its_own_count_and_a_registration_without_one_keeps_it(stack):
    m = stack
    assert register_counts(m, {"gpu-host-01": 4}).status_code == 200
    assert register(m).status_code == 200  # an older daemon, or MAAS could not say
    assert m.db.magic_devices.find_one({"_id": "gpu-host-01"})["nvswitches"] == 4
    # Re-commissioned in MAAS after the switches were taken out: MAAS' newer list wins over
    # its own older one (a split's count would not be replaced).
    assert register_counts(m, {"gpu-host-01": 0}).status_code == 200
    dev = m.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert dev["nvswitches"] == 0 and dev["nvswitches_found"]["source"] == "maas"
    assert len(list(m.db.magic_events.find({"kind": "device.nvswitches"}))) == 1
