"""The MAAS simulator's wire format alone, spoken with ``requests`` over real HTTP."""

import base64
import json
import logging
from email.mime.application import MIMEApplication
from email.mime.multipart import MIMEMultipart

import pytest
import requests

from testflinger_magic.lab.maas_sim import (
    API, STATUS_CODES, MaasSimulator, parse_form, parse_oauth_header, serve)
from virsh_hosts import add_vm_host

KEY = "cons:tok:sec"
logging.getLogger("werkzeug").setLevel(logging.ERROR)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def oauth(key=KEY, method="PLAINTEXT"):
    consumer, token, secret = key.split(":")
    return {"Authorization": (
        f'OAuth realm="OAuth", oauth_nonce="n", oauth_timestamp="1", oauth_version="1.0", '
        f'oauth_signature_method="{method}", oauth_consumer_key="{consumer}", '
        f'oauth_token="{token}", oauth_signature="%26{secret}"')}


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def sim(clock, tmp_path):
    s = MaasSimulator(api_key=KEY, delays={"commissioning": 10, "deploying": 20,
                                           "releasing": 5}, clock=clock)
    # The libvirt hosts the virsh machines' power_address reach (MAAS powers their domains).
    add_vm_host(s, tmp_path, "10.0.0.1", ["dev-1-vm0"] + [f"vm-{i}" for i in
                                                         (1, 2, 3, 4, 5, 6, 7, 8, 9, "x")])
    return s


@pytest.fixture
def base(sim):
    handle = serve(sim)
    yield handle.url + API
    handle.stop()


def post(base, path, data=None, files=None, **kw):
    return requests.post(f"{base}/{path}", data=data, files=files, headers=oauth(), **kw)


def get(base, path, **kw):
    return requests.get(f"{base}/{path}", headers=oauth(), **kw)


def test_describe_is_anonymous_and_uris_absolute_from_host_header(base):
    r = requests.get(f"{base}/describe/", headers={"Host": "maas.example:5240"})
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    doc = r.json()
    handlers = {h["name"]: h for h in doc["handlers"]}
    machine = handlers["MachineHandler"]
    assert machine["uri"] == "http://maas.example:5240/MAAS/api/2.0/machines/{system_id}/"
    assert machine["params"] == ["system_id"]
    ops = {a["op"] for a in machine["actions"]}
    assert {"deploy", "release", "commission", "mark_broken", "mark_fixed"} <= ops
    auth = {r["name"]: r for r in doc["resources"]}
    assert auth["MachinesHandler"]["auth"]["uri"].startswith("http://maas.example:5240/")
    assert auth["VersionHandler"]["anon"] is not None


def test_version_is_anonymous(base):
    r = requests.get(f"{base}/version/")
    assert r.status_code == 200 and "version" in r.json()


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer x"}, oauth("cons:tok:wrong"), oauth("x:tok:sec"),
    oauth(method="HMAC-SHA1")])
def test_bad_or_missing_oauth_is_401(base, headers):
    r = requests.get(f"{base}/machines/", headers=headers)
    assert r.status_code == 401


def test_whoami_and_list_with_good_oauth(base, sim):
    sim.add_machine("dev-1")
    assert get(base, "users/", params={"op": "whoami"}).json()["username"] == "admin"
    machines = get(base, "machines/").json()
    assert [m["hostname"] for m in machines] == ["dev-1"]


def test_404s_and_unknown_ops(base, sim):
    assert get(base, "machines/nosuch/").status_code == 404
    assert get(base, "nothing-here/").status_code == 404
    assert requests.get(f"{base[:-len(API)]}/elsewhere").status_code == 404
    sid = sim.add_machine("dev-1")
    r = post(base, f"machines/{sid}/", params={"op": "fly"}, files={"x": (None, "1")})
    assert r.status_code == 400 and "op=fly" in r.text


def test_create_multipart_plain_parts(base, sim, clock):
    files = [("architecture", (None, "amd64/generic")),
             ("mac_addresses", (None, "52:54:00:00:00:01")),
             ("mac_addresses", (None, "52:54:00:00:00:02")),
             ("power_type", (None, "virsh")),
             ("power_parameters_power_address", (None, "qemu+ssh://ubuntu@10.0.0.1/system")),
             ("power_parameters_power_id", (None, "dev-1-vm0")),
             ("hostname", (None, "dev-1-vm0"))]
    r = post(base, "machines/", files=files)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["status_name"] == "Commissioning" and m["status"] == STATUS_CODES["Commissioning"]
    assert [i["mac_address"] for i in m["interface_set"]] == ["52:54:00:00:00:01",
                                                             "52:54:00:00:00:02"]
    assert m["boot_interface"]["mac_address"] == "52:54:00:00:00:01"
    assert m["power_type"] == "virsh" and m["hostname"] == "dev-1-vm0"
    clock.now += 10
    assert get(base, f"machines/{m['system_id']}/").json()["status_name"] == "Ready"
    power = get(base, f"machines/{m['system_id']}/", params={"op": "power_parameters"}).json()
    assert power == {"power_address": "qemu+ssh://ubuntu@10.0.0.1/system",
                     "power_id": "dev-1-vm0"}
    found = get(base, "machines/", params={"mac_address": "52:54:00:00:00:02"}).json()
    assert [f["system_id"] for f in found] == [m["system_id"]]


def test_create_multipart_base64_parts_like_libmaas(base, sim):
    msg = MIMEMultipart("form-data")
    for name, value in [("architecture", "arm64/generic"), ("mac_addresses", "52:54:00:0A:0B:0C"),
                        ("power_type", "manual"), ("hostname", "b64-host")]:
        part = MIMEApplication(value.encode(), charset="utf-8")
        part.add_header("Content-Disposition", "form-data", name=name)
        msg.attach(part)
    body = msg.as_bytes().split(b"\n\n", 1)[1].replace(b"\n", b"\r\n")
    headers = {**oauth(), "Content-Type": msg["Content-Type"]}
    r = requests.post(f"{base}/machines/", data=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["architecture"] == "arm64/generic"
    assert r.json()["interface_set"][0]["mac_address"] == "52:54:00:0a:0b:0c"


def test_create_validation_errors_are_json_400(base, sim):
    r = post(base, "machines/", files={"architecture": (None, "vax"),
                                       "mac_addresses": (None, "nope"),
                                       "power_type": (None, "virsh")})
    assert r.status_code == 400
    errors = r.json()
    assert set(errors) == {"architecture", "mac_addresses", "power_parameters"}
    sim.add_machine("taken", mac="52:54:00:00:00:09")
    r = post(base, "machines/", files={"architecture": (None, "amd64/generic"),
                                       "mac_addresses": (None, "52:54:00:00:00:09"),
                                       "power_type": (None, "manual")})
    assert r.status_code == 400 and "already in use" in r.json()["mac_addresses"][0]


def test_allocate_deploy_release_cycle(base, sim, clock):
    sid = sim.add_machine("dev-1", tag_names=("nvidia",))
    r = post(base, f"machines/{sid}/", params={"op": "deploy"}, files={"x": (None, "")})
    assert r.status_code == 409  # MAAS deploys allocated machines only
    r = post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    assert r.status_code == 200 and r.json()["status_name"] == "Allocated"
    assert r.json()["owner"] == "admin"
    r = post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    assert r.status_code == 409
    user_data = base64.b64encode(b"#cloud-config\n").decode()
    r = post(base, f"machines/{sid}/", params={"op": "deploy"},
             files={"distro_series": (None, "noble"), "user_data": (None, user_data)})
    assert r.json()["status_name"] == "Deploying" and r.json()["ip_addresses"] == []
    clock.now += 20
    m = get(base, f"machines/{sid}/").json()
    assert m["status_name"] == "Deployed" and m["distro_series"] == "noble"
    assert sim.user_data(sid) == b"#cloud-config\n"
    assert len(m["ip_addresses"]) == 1 and m["ip_addresses"][0].startswith("10.")
    assert m["power_state"] == "on"
    r = post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    assert r.json()["status_name"] == "Releasing"
    clock.now += 5
    m = get(base, f"machines/{sid}/").json()
    assert (m["status_name"], m["owner"], m["ip_addresses"]) == ("Ready", None, [])
    r = post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    assert r.status_code == 409


def test_deploy_of_a_series_without_images_is_a_json_400_and_stays_allocated(base, sim):
    # maasserver/api/machines.py MachineHandler.deploy: the distro_series choice field holds
    # the usable releases only; its error is MAASAPIValidationError's JSON 400.
    sid = sim.add_machine("dev-1")
    post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    r = post(base, f"machines/{sid}/", params={"op": "deploy"},
             files={"distro_series": (None, "focal")})
    assert r.status_code == 400
    assert r.json() == {"distro_series": [
        "Select a valid choice. focal is not one of the available choices."]}
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Allocated"
    r = post(base, f"machines/{sid}/", params={"op": "deploy"},
             files={"distro_series": (None, "ubuntu/jammy")})  # osystem/release works too
    assert r.status_code == 200 and r.json()["status_name"] == "Deploying"


def test_failure_injection_and_recovery_ops(base, sim, clock):
    sid = sim.add_machine("dev-1", status="New")
    sim.fail_next(sid, "commission")
    post(base, f"machines/{sid}/", params={"op": "commission"}, files={"x": (None, "")})
    clock.now += 10
    m = get(base, f"machines/{sid}/").json()
    assert m["status_name"] == "Failed commissioning" and "simulated" in m["status_message"]
    post(base, f"machines/{sid}/", params={"op": "commission"}, files={"x": (None, "")})
    r = post(base, f"machines/{sid}/", params={"op": "abort"}, files={"x": (None, "")})
    assert r.json()["status_name"] == "Failed commissioning"
    r = post(base, f"machines/{sid}/", params={"op": "mark_broken"},
             files={"comment": (None, "fan")})
    assert (r.json()["status_name"], r.json()["status_message"]) == ("Broken", "fan")
    r = post(base, f"machines/{sid}/", params={"op": "mark_fixed"}, files={"x": (None, "")})
    assert r.json()["status_name"] == "Ready"
    r = post(base, f"machines/{sid}/", params={"op": "power_off"}, files={"x": (None, "")})
    assert r.json()["power_state"] == "off"


def test_hold_keeps_a_transition_in_progress_until_its_condition(base, sim, clock):
    sid = sim.add_machine("dev-1", status="New")
    let_go = []
    sim.hold("commission", lambda: bool(let_go))
    post(base, f"machines/{sid}/", params={"op": "commission"}, files={"x": (None, "")})
    clock.now += 100
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Commissioning"
    let_go.append(True)
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Ready"
    # The hold is dropped once its condition held: the next commissioning takes its delay.
    let_go.clear()
    post(base, f"machines/{sid}/", params={"op": "commission"}, files={"x": (None, "")})
    clock.now += 10
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Ready"
    with pytest.raises(ValueError):
        sim.hold("enlist", lambda: True)


def test_update_and_delete(base, sim):
    sid = sim.add_machine("dev-1")
    r = requests.put(f"{base}/machines/{sid}/", headers=oauth(),
                     files={"hostname": (None, "dev-2"), "cpu_count": (None, "16")})
    assert (r.json()["hostname"], r.json()["cpu_count"]) == ("dev-2", 16)
    r = requests.delete(f"{base}/machines/{sid}/", headers=oauth())
    assert r.status_code == 204
    assert requests.delete(f"{base}/machines/{sid}/", headers=oauth()).status_code == 404
    assert sim.machines() == {}


@pytest.mark.parametrize("hostname, says", [
    ("gpu_host-vm1", "Host label cannot contain underscore: 'gpu_host-vm1'."),
    ("gpu+1-vm1", "Label contains disallowed characters: 'gpu+1-vm1'."),
    ("-gpu-vm1", "Label cannot start or end with hyphen: '-gpu-vm1'."),
    ("g" * 64, f"Label is too long: '{'g' * 64}'.  Maximum allowed is 63 characters."),
    ("gpu..x", "DNS name contains an empty label."),
])
def test_hostnames_maas_refuses_are_json_400(base, sim, hostname, says):
    """MAAS' Node.hostname validator (src/maasserver/utils/dns.py validate_hostname), at create
    and update; a VM named by the shared device-name rule (testflinger_magic.names) passes."""
    from testflinger_magic import names

    def create(name, mac):
        return post(base, "machines/", files={"architecture": (None, "amd64/generic"),
                                              "mac_addresses": (None, mac),
                                              "power_type": (None, "manual"),
                                              "hostname": (None, name)})

    r = create(hostname, "52:54:00:00:01:01")
    assert r.status_code == 400 and r.json() == {"hostname": [says]}
    longest = "g" * names.MAX_DEVICE_NAME + "-vm64"
    r = create(longest, "52:54:00:00:01:02")
    assert r.status_code == 200 and r.json()["hostname"] == longest
    r = requests.put(f"{base}/machines/{r.json()['system_id']}/", headers=oauth(),
                     files={"hostname": (None, hostname)})
    assert r.status_code == 400 and r.json() == {"hostname": [says]}


def test_unreachable_answers_503(base, sim):
    sim.set_unreachable(True)
    assert requests.get(f"{base}/describe/").status_code == 503
    sim.set_unreachable(False)
    assert requests.get(f"{base}/describe/").status_code == 200


def test_parse_helpers():
    assert parse_form("application/x-www-form-urlencoded", b"a=1&a=2&b=") == [
        ("a", "1"), ("a", "2"), ("b", "")]
    assert parse_oauth_header('OAuth a="x%26y", b="2"') == {"a": "x&y", "b": "2"}
    assert parse_oauth_header("Bearer z") == {}


def test_add_machine_rejects_duplicates(sim):
    sim.add_machine("dev-1", system_id="abc123", mac="52:54:00:00:00:01")
    with pytest.raises(ValueError, match="already"):
        sim.add_machine("dev-2", system_id="abc123")
    with pytest.raises(ValueError, match="already in use"):
        sim.add_machine("dev-3", mac="52:54:00:00:00:01")
    with pytest.raises(ValueError, match="unknown MAAS status"):
        sim.add_machine("dev-4", status="Sleeping")
    assert json.dumps(sim.machines())  # snapshot is plain JSON data


def test_delays_accept_op_names_and_reject_unknown_keys(clock):
    sim = MaasSimulator(api_key=KEY, time_scale=2.0, delays={"deploy": 3, "releasing": 1},
                        clock=clock)
    sid = sim.add_machine("dev-1", status="Allocated")
    from werkzeug.test import Client
    r = Client(sim.app).post(f"{API}/machines/{sid}/?op=deploy", headers=oauth())
    assert r.status_code == 200
    clock.now += 5.9  # 3 s scaled by 2
    assert sim.machine(sid)["status_name"] == "Deploying"
    clock.now += 0.1
    assert sim.machine(sid)["status_name"] == "Deployed"
    with pytest.raises(ValueError, match="unknown key 'deploy_time'"):
        MaasSimulator(api_key=KEY, delays={"deploy_time": 1})
    with pytest.raises(ValueError, match="consumer:token:secret"):
        MaasSimulator(api_key="nope")


def _vm(base, clock, mac="52:54:00:00:00:01", hostname="vm-1"):
    """Create a virsh machine over HTTP and let it finish commissioning; returns its JSON."""
    r = post(base, "machines/", files=[
        ("architecture", (None, "amd64/generic")), ("mac_addresses", (None, mac)),
        ("power_type", (None, "virsh")), ("hostname", (None, hostname)),
        ("power_parameters_power_address", (None, "qemu+ssh://ubuntu@10.0.0.1/system")),
        ("power_parameters_power_id", (None, hostname))])
    assert r.status_code == 200, r.text
    clock.now += 10
    return get(base, f"machines/{r.json()['system_id']}/").json()


def link(base, sid, iid, **fields):
    return post(base, f"nodes/{sid}/interfaces/{iid}/", params={"op": "link_subnet"},
                files={k: (None, str(v)) for k, v in fields.items()})


def test_describe_lists_subnet_and_interface_handlers(base):
    handlers = {h["name"]: h for h in requests.get(f"{base}/describe/").json()["handlers"]}
    iface = handlers["InterfaceHandler"]
    assert iface["path"] == f"{API}/nodes/{{system_id}}/interfaces/{{id}}/"
    assert iface["params"] == ["system_id", "id"]
    assert {a["op"] for a in iface["actions"]} >= {"link_subnet", "unlink_subnet"}
    assert handlers["InterfacesHandler"]["params"] == ["system_id"]
    assert handlers["SubnetsHandler"]["path"] == f"{API}/subnets/"


def test_commissioning_leaves_an_auto_link_that_gets_an_address_only_while_deployed(
        base, sim, clock):
    m = _vm(base, clock)
    sid, boot = m["system_id"], m["boot_interface"]
    assert m["status_name"] == "Ready" and m["ip_addresses"] == []
    subnet = get(base, "subnets/").json()[0]
    assert subnet["cidr"] == "10.77.0.0/16" and boot["vlan"]["id"] == subnet["vlan"]["id"]
    assert [(lk["mode"], lk["subnet"]["id"], "ip_address" in lk) for lk in boot["links"]] == [
        ("auto", subnet["id"], False)]
    post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    post(base, f"machines/{sid}/", params={"op": "deploy"}, files={"x": (None, "")})
    clock.now += 20
    deployed = get(base, f"machines/{sid}/").json()
    assert deployed["ip_addresses"] == [deployed["boot_interface"]["links"][0]["ip_address"]]
    post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    clock.now += 5
    assert get(base, f"machines/{sid}/").json()["ip_addresses"] == []


def test_static_link_is_stable_unique_and_freed_on_delete(base, sim, clock):
    a, b = _vm(base, clock), _vm(base, clock, "52:54:00:00:00:02", "vm-2")
    ia, ib = a["boot_interface"]["id"], b["boot_interface"]["id"]
    r = link(base, a["system_id"], ia, mode="STATIC", subnet=1)
    assert r.status_code == 200, r.text
    static = [lk for lk in r.json()["links"] if lk["mode"] == "static"]
    ip_a = static[0]["ip_address"]
    assert ip_a == "10.77.0.2"  # lowest free: .1 is the gateway
    r = link(base, b["system_id"], ib, mode="static", subnet="10.77.0.0/16")
    ip_b = [lk for lk in r.json()["links"] if lk["mode"] == "static"][0]["ip_address"]
    assert ip_b != ip_a
    # Ready machines already list their static address; it survives deploy and release.
    sid = a["system_id"]
    assert ip_a in get(base, f"machines/{sid}/").json()["ip_addresses"]
    post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    post(base, f"machines/{sid}/", params={"op": "deploy"}, files={"x": (None, "")})
    clock.now += 20
    assert ip_a in get(base, f"machines/{sid}/").json()["ip_addresses"]
    post(base, f"machines/{sid}/", params={"op": "release"}, files={"x": (None, "")})
    clock.now += 5
    assert get(base, f"machines/{sid}/").json()["ip_addresses"] == [ip_a]
    # A taken address is refused; deleting the machine frees it.
    assert link(base, b["system_id"], ib, mode="STATIC", subnet=1,
                ip_address=ip_a).status_code == 409
    requests.delete(f"{base}/machines/{sid}/", headers=oauth())
    r = link(base, b["system_id"], ib, mode="STATIC", subnet=1, ip_address=ip_a)
    assert r.status_code == 200, r.text


def test_link_and_unlink_errors_follow_maas(base, sim, clock):
    m = _vm(base, clock)
    sid, iid = m["system_id"], m["boot_interface"]["id"]
    r = link(base, sid, iid, mode="STATIC")
    assert r.status_code == 400 and r.json() == {"subnet": ["This field is required."]}
    r = link(base, sid, iid, mode="STATIC", subnet=1, ip_address="192.168.1.9")
    assert r.status_code == 400 and "not in the given subnet" in r.json()["ip_address"][0]
    r = link(base, sid, iid, mode="STATIC", subnet=1, ip_address="10.77.250.1")
    assert r.status_code == 400 and "dynamic range" in r.json()["ip_address"][0]
    assert link(base, sid, iid, mode="teleport", subnet=1).status_code == 400
    assert link(base, sid, iid, mode="STATIC", subnet=99).status_code == 400
    assert get(base, f"nodes/{sid}/interfaces/999/").status_code == 404
    assert get(base, "nodes/nosuch/interfaces/").status_code == 404
    r = post(base, f"nodes/{sid}/interfaces/{iid}/", params={"op": "unlink_subnet"},
             files={"id": (None, "12345")})
    assert r.status_code == 400 and "id" in r.json()
    auto = m["boot_interface"]["links"][0]["id"]
    r = post(base, f"nodes/{sid}/interfaces/{iid}/", params={"op": "unlink_subnet"},
             files={"id": (None, str(auto))})
    assert r.status_code == 200 and r.json()["links"] == []
    assert get(base, f"nodes/{sid}/interfaces/").json()[0]["links"] == []
    # Links change only on Ready, Allocated or Broken machines.
    post(base, "machines/", params={"op": "allocate"}, data={"system_id": sid})
    post(base, f"machines/{sid}/", params={"op": "deploy"}, files={"x": (None, "")})
    r = link(base, sid, iid, mode="STATIC", subnet=1)
    assert r.status_code == 409 and "not Ready, Allocated, or Broken" in r.text


def test_small_subnet_runs_out_of_static_addresses(clock, tmp_path):
    sim = MaasSimulator(api_key=KEY, clock=clock, delays={"commissioning": 0},
                        subnets=["192.168.9.0/29", "10.9.0.0/24"])
    add_vm_host(sim, tmp_path, "10.0.0.1", [f"vm-{i}" for i in range(5)] + ["vm-x"])
    handle = serve(sim)
    try:
        base = handle.url + API
        assert [s["cidr"] for s in get(base, "subnets/").json()] == ["192.168.9.0/29",
                                                                     "10.9.0.0/24"]
        got = []
        for i in range(5):
            m = _vm(base, clock, f"52:54:00:00:01:0{i}", f"vm-{i}")
            r = link(base, m["system_id"], m["boot_interface"]["id"], mode="STATIC", subnet=1)
            got.append(r)
        # /29: .1 gateway, .6-.7 the top quarter (dynamic range): .2-.5 are static addresses.
        assert [r.json()["links"][-1]["ip_address"] for r in got[:4]] == [
            "192.168.9.2", "192.168.9.3", "192.168.9.4", "192.168.9.5"]
        assert got[4].status_code == 503 and "No more IPs" in got[4].text
        # Another VLAN's subnet is refused unless forced.
        m = _vm(base, clock, "52:54:00:00:02:00", "vm-x")
        assert link(base, m["system_id"], m["boot_interface"]["id"], mode="STATIC",
                    subnet=2).status_code == 400
        r = link(base, m["system_id"], m["boot_interface"]["id"], mode="STATIC", subnet=2,
                 force="true")
        assert [lk["mode"] for lk in r.json()["links"]] == ["static"]
        assert r.json()["vlan"]["id"] == get(base, "subnets/2/").json()["vlan"]["id"]
    finally:
        handle.stop()
    with pytest.raises(ValueError, match="at least one"):
        MaasSimulator(api_key=KEY, subnets=[])


def test_a_deploy_installs_a_fresh_os_so_a_previous_deployments_domains_are_gone(
        base, sim, clock, tmp_path):
    """MAAS deploys by writing the image to the machine's disk (curtin's storage config wipes
    and partitions the boot disk), so libvirt domains a previous deployment defined there are
    gone: a lab host whose file kept them made the next lease's split collide with a closed
    lease's leftover domain (TRIAL15 F2), which no real redeploy leaves."""
    import libvirt

    uri = add_vm_host(sim, tmp_path, "dev-9", ["dev-9-vm1", "dev-9-vm2"])
    sid = sim.add_machine("dev-9")
    assert post(base, "machines/", params={"op": "allocate"},
                data={"system_id": sid}).status_code == 200
    r = post(base, f"machines/{sid}/", params={"op": "deploy"},
             files={"distro_series": (None, "jammy")})
    assert r.json()["status_name"] == "Deploying"
    conn = libvirt.open(uri)
    try:
        assert sorted(d.name() for d in conn.listAllDomains()) == ["dev-9-vm1", "dev-9-vm2"]
    finally:
        conn.close()
    clock.now += 20
    assert get(base, f"machines/{sid}/").json()["status_name"] == "Deployed"
    conn = libvirt.open(uri)
    try:
        assert conn.listAllDomains() == []
    finally:
        conn.close()
