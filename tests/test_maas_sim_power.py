"""The MAAS simulator's virsh power driver, events, bridge_all, release recovery ops and
failure injection, over real HTTP, each against the MAAS behaviour it models (sources cited in
lab/virsh_power.py and lab/maas_sim.py)."""

import base64
import logging

import libvirt
import pytest

from testflinger_magic.lab.maas_sim import API, MaasSimulator, serve
from testflinger_magic.lab.maas_sim_parts import default_bridge_name
from testflinger_magic.lab.virsh_power import EXTRA_PARAMETERS, LOGIN_FAILED
from test_maas_sim import FakeClock, get, post
from virsh_hosts import add_vm_host

KEY = "cons:tok:sec"
logging.getLogger("werkzeug").setLevel(logging.ERROR)
HOST = "qemu+ssh://ubuntu@10.0.0.1/system"


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def sim(clock):
    return MaasSimulator(api_key=KEY, delays={"commissioning": 10, "deploying": 20,
                                              "releasing": 5}, clock=clock)


@pytest.fixture
def base(sim):
    handle = serve(sim)
    yield handle.url + API
    handle.stop()


def create_vm(base, name="vm-1", address=HOST, mac="52:54:00:00:00:01", **extra):
    files = [("architecture", (None, "amd64/generic")), ("mac_addresses", (None, mac)),
             ("power_type", (None, "virsh")), ("hostname", (None, name)),
             ("power_parameters_power_address", (None, address)),
             ("power_parameters_power_id", (None, name))]
    files += [(f"power_parameters_{k}", (None, v)) for k, v in extra.items()]
    r = post(base, "machines/", files=files)
    assert r.status_code == 200, r.text
    return r.json()["system_id"]


def state(uri, name):
    conn = libvirt.open(uri)  # a fresh read of the host file: what the splitter would see
    try:
        return conn.lookupByName(name).state()[0]
    finally:
        conn.close()


def events(base, sid):
    r = get(base, "events/", params={"op": "query", "id": sid})
    assert r.status_code == 200, r.text
    return r.json()["events"]


def test_commissioning_powers_the_shut_off_domain_on_and_ends_with_it_off(base, sim, clock,
                                                                          tmp_path):
    uri = add_vm_host(sim, tmp_path, "10.0.0.1", ["vm-1"])
    sid = create_vm(base)
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Commissioning"
    assert state(uri, "vm-1") == libvirt.VIR_DOMAIN_RUNNING  # MAAS started it
    clock.now += 10
    m = get(base, f"machines/{sid}/").json()
    assert (m["status_name"], m["power_state"]) == ("Ready", "off")
    assert state(uri, "vm-1") == libvirt.VIR_DOMAIN_SHUTOFF


def test_commissioning_advances_only_while_the_domain_runs(base, sim, clock, tmp_path):
    uri = add_vm_host(sim, tmp_path, "10.0.0.1", ["vm-1"])
    sid = create_vm(base)
    from testflinger_magic.agent_host.libvirt_session import session
    with session(uri) as s:  # someone destroys the domain
        s.changed = True
        s.conn.lookupByName("vm-1").destroy()
    clock.now += 100
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Commissioning"
    with session(uri) as s:
        s.changed = True
        s.conn.lookupByName("vm-1").create()
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Ready"


def test_a_query_string_in_power_address_is_refused_and_the_machine_goes_back_to_new(
        base, sim, tmp_path):
    add_vm_host(sim, tmp_path, "10.0.0.1", ["vm-1"])
    sid = create_vm(base, address=HOST + "?keyfile=/home/x/.ssh/id&no_verify=1")
    m = get(base, f"machines/{sid}/").json()
    assert m["status_name"] == "New"
    assert m["status_message"] == (
        "Failed to query node's BMC - (admin) - Aborting COMMISSIONING and reverting to NEW. "
        "Unable to power control the node. Please check power credentials.")
    ev = events(base, sid)
    assert [e["type"] for e in ev] == ["Failed to query node's BMC", "Failed to power on node"]
    assert ev[1]["description"] == EXTRA_PARAMETERS and ev[1]["level"] == "ERROR"


def test_an_unknown_host_or_a_refused_login_is_a_power_failure(base, sim, tmp_path):
    sid = create_vm(base, address="qemu+ssh://ubuntu@10.9.9.9/system")
    assert get(base, f"machines/{sid}/").json()["status_name"] == "New"
    assert events(base, sid)[1]["description"] == LOGIN_FAILED
    sim.virsh.rack_key = "ssh-ed25519 AAAArack rack@maas"
    uri = add_vm_host(sim, tmp_path, "10.0.0.2", ["vm-2", "vm-3"], authorized_keys=["other"],
                      password="s3cret")
    addr = "qemu+ssh://ubuntu@10.0.0.2/system"
    refused = create_vm(base, "vm-2", addr, "52:54:00:00:00:02")
    assert get(base, f"machines/{refused}/").json()["status_name"] == "New"
    by_pass = create_vm(base, "vm-3", addr, "52:54:00:00:00:03", power_pass="s3cret")
    assert get(base, f"machines/{by_pass}/").json()["status_name"] == "Commissioning"
    assert state(uri, "vm-3") == libvirt.VIR_DOMAIN_RUNNING
    assert state(uri, "vm-2") == libvirt.VIR_DOMAIN_SHUTOFF


def test_a_missing_domain_fails_to_get_its_power_state(base, sim, tmp_path):
    add_vm_host(sim, tmp_path, "10.0.0.1", ["other"])
    sid = create_vm(base)
    assert events(base, sid)[1]["description"] == "vm-1: Failed to get power state"


def test_a_deployed_host_is_reached_by_its_address_with_its_user_data_keys(base, sim, clock,
                                                                           tmp_path):
    from virsh_hosts import vm_host
    uri = vm_host(tmp_path / "dev-1.xml", [])
    sim.virsh.add("dev-1", uri)  # registered under the device's MAAS hostname
    sim.virsh.rack_key = "ssh-ed25519 AAAArack rack@maas"
    dev = sim.add_machine("dev-1")
    post(base, "machines/", params={"op": "allocate"}, data={"system_id": dev})
    user_data = base64.b64encode(b"#cloud-config\nssh_authorized_keys:\n"
                                 b"  - ssh-ed25519 AAAArack rack@maas\n").decode()
    post(base, f"machines/{dev}/", params={"op": "deploy"}, files={"user_data": (None, user_data)})
    clock.now += 20
    ip = get(base, f"machines/{dev}/").json()["ip_addresses"][0]
    vm_host(tmp_path / "dev-1.xml", ["dev-1-vm1"])  # the split, on the deployed host
    sid = create_vm(base, "dev-1-vm1", f"qemu+ssh://ubuntu@{ip}/system")
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Commissioning"
    assert state(uri, "dev-1-vm1") == libvirt.VIR_DOMAIN_RUNNING


def test_bridge_all_at_allocation_bridges_the_configured_interface_until_release(base, sim,
                                                                                 clock):
    sid = sim.add_machine("dev-1", status="Ready")
    r = post(base, "machines/", params={"op": "allocate"},
             data={"system_id": sid, "bridge_all": "true", "bridge_stp": "false"})
    assert r.status_code == 200, r.text
    ifaces = {i["name"]: i for i in r.json()["interface_set"]}
    assert set(ifaces) == {"eth0", "br-eth0"}
    br = ifaces["br-eth0"]
    assert (br["type"], br["parents"], br["mac_address"]) == (
        "bridge", ["eth0"], ifaces["eth0"]["mac_address"])
    assert br["params"] == {"bridge_type": "standard", "bridge_fd": 15, "bridge_stp": False}
    assert [lk["mode"] for lk in br["links"]] == ["auto"] and ifaces["eth0"]["links"] == []
    post(base, f"machines/{sid}/", params={"op": "deploy"}, files={"x": (None, "")})
    clock.now += 20
    m = get(base, f"machines/{sid}/").json()
    br = next(i for i in m["interface_set"] if i["type"] == "bridge")
    assert br["links"][0]["ip_address"] == m["ip_addresses"][0]
    post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    clock.now += 5
    m = get(base, f"machines/{sid}/").json()
    assert [i["name"] for i in m["interface_set"]] == ["eth0"]
    assert [lk["mode"] for lk in m["interface_set"][0]["links"]] == ["auto"]


def test_default_bridge_names_follow_maas():
    # maasserver/models/interface.py get_default_bridge_name (bug 1672327)
    assert default_bridge_name("eth0") == "br-eth0"
    assert default_bridge_name("enp1s0f0") == "br-enp1s0f0"
    assert default_bridge_name("enp175s0f0np0") == "b-p175s0f0np0"
    long = default_bridge_name("ethernet-long-name0")
    assert long.startswith("b-") and len(long) <= 15 and long.endswith("-name0")


def test_failed_release_is_releasing_failed_and_recovers_with_mark_broken_fixed(base, sim,
                                                                                 clock):
    sid = sim.add_machine("dev-1", status="Deployed")
    sim.fail_next(sid, "release", times=2)
    for _ in range(2):
        post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
        clock.now += 5
        assert get(base, f"machines/{sid}/").json()["status_name"] == "Releasing failed"
    r = post(base, f"machines/{sid}/", params={"op": "mark_broken"}, files={"x": (None, "")})
    assert (r.json()["status_name"], r.json()["power_state"]) == ("Broken", "off")
    r = post(base, f"machines/{sid}/", params={"op": "mark_fixed"}, files={"x": (None, "")})
    assert (r.json()["status_name"], r.json()["owner"], r.json()["ip_addresses"]) == (
        "Ready", None, [])


def test_inject_answers_matching_requests_with_the_given_error(base, sim):
    sid = sim.add_machine("dev-1")
    sim.inject("GET", rf"machines/{sid}/$", 500, "boom", times=2)
    assert [get(base, f"machines/{sid}/").status_code for _ in range(3)] == [500, 500, 200]
    sim.inject("post", r"op=release", 409, {"x": ["no"]})
    r = post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    assert r.status_code == 409 and r.json() == {"x": ["no"]}
    assert get(base, "events/", params={"op": "query", "level": "NOPE"}).status_code == 400
