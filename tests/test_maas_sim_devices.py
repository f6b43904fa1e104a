"""The MAAS simulator's node devices (lab/maas_sim_devices.py) over real HTTP with ``requests``:
what ``GET nodes/<system_id>/devices/`` answers as MAAS' NodeDevicesHandler does (fields and
their types, filters, errors), for an HGX board, a PCIe server, a machine never commissioned
and a MAAS older than 3.0."""

import logging

import pytest
import requests

from testflinger_magic.lab import hosts
from testflinger_magic.lab.maas_sim import API, MaasSimulator, serve
from test_maas_sim import KEY, FakeClock, oauth

logging.getLogger("werkzeug").setLevel(logging.ERROR)

FIELDS = {"id", "bus", "bus_name", "hardware_type", "hardware_type_name", "system_id",
          "numa_node", "physical_blockdevice", "physical_interface", "vendor_id", "product_id",
          "vendor_name", "product_name", "commissioning_driver", "bus_number", "device_number",
          "pci_address", "resource_uri"}


def make(version=None, clock=None):
    kw = {"version": version} if version else {}
    sim = MaasSimulator(api_key=KEY, delays={"commissioning": 10}, clock=clock or FakeClock(),
                        **kw)
    handle = serve(sim)
    return sim, handle


@pytest.fixture
def maas():
    sim, handle = make()
    yield sim, handle.url + API
    handle.stop()


def devices(base, sid, **params):
    return requests.get(f"{base}/nodes/{sid}/devices/", params=params, headers=oauth(),
                        timeout=10)


def add(sim, name, kind, status="Ready"):
    return sim.add_machine(name, status=status, interface_name=hosts.BOOT_NIC[kind][1],
                           hardware=hosts.host_xml(kind=kind, name=name))


def test_an_hgx_board_lists_its_gpus_nvswitches_and_the_rest_as_maas_renders_them(maas):
    sim, base = maas
    sid = add(sim, "hgx-1", "hgx")
    r = devices(base, sid)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    docs = r.json()
    assert all(set(d) == FIELDS for d in docs)
    by_addr = {d["pci_address"]: d for d in docs}
    gpu = by_addr[hosts.gpu_address(0)]
    # Ints where MAAS has IntegerFields and enum values; the labels beside them.
    assert (gpu["bus"], gpu["bus_name"], gpu["hardware_type"], gpu["hardware_type_name"]) == \
        (1, "PCIE", 5, "GPU")
    assert (gpu["vendor_id"], gpu["product_id"]) == ("10de", "2330")
    assert gpu["product_name"] == "GH100 [H100 SXM5 80GB]"
    assert gpu["commissioning_driver"] == ""  # vfio-pci is the deployed host's, not commissioning's
    assert (gpu["bus_number"], gpu["device_number"]) == (0x18, 0) and gpu["numa_node"] == 0
    assert gpu["system_id"] == sid and gpu["resource_uri"] == \
        f"{API}/nodes/{sid}/devices/{gpu['id']}/"
    switches = [d for d in docs if d["product_name"] == "GH100 [H100 NVSwitch]"]
    assert sorted(d["pci_address"] for d in switches) == list(hosts.NVSWITCHES)
    assert {(d["hardware_type"], d["hardware_type_name"], d["product_id"]) for d in switches} \
        == {(0, "Node", "22a3")}
    # LXD lists every display controller as a GPU card: the BMC's VGA too.
    assert by_addr[hosts.BMC_VGA]["hardware_type_name"] == "GPU"
    assert by_addr[hosts.BMC_VGA]["commissioning_driver"] == "ast"
    nic = by_addr[hosts.BOOT_NIC["hgx"][0]]
    assert nic["hardware_type_name"] == "Network"
    assert nic["physical_interface"]["name"] == hosts.BOOT_NIC["hgx"][1]
    assert by_addr["0000:0c:00.1"]["hardware_type_name"] == "Node"  # no interface of MAAS'
    assert len([d for d in docs if d["hardware_type"] == 5]) == 9


def test_a_pcie_server_lists_the_audio_functions_as_nodes(maas):
    sim, base = maas
    sid = add(sim, "pcie-1", "pcie")
    docs = devices(base, sid, vendor_id="10DE").json()  # __iexact
    assert len(docs) == 16
    audio = [d for d in docs if d["product_id"] == "22ba"]
    assert len(audio) == 8 and {d["hardware_type_name"] for d in audio} == {"Node"}
    assert "High Definition Audio" in audio[0]["product_name"]
    assert not [d for d in docs if "NVSwitch" in d["product_name"]]


def test_the_filters_as_the_handler_applies_them(maas):
    sim, base = maas
    sid = add(sim, "hgx-1", "hgx")
    assert len(devices(base, sid, hardware_type="gpu").json()) == 9
    assert len(devices(base, sid, hardware_type="GRAPHICS").json()) == 9
    assert len(devices(base, sid, hardware_type="5").json()) == 9
    assert len(devices(base, sid, bus="usb").json()) == 0
    assert len(devices(base, sid, bus="PCIE", vendor_id="10de", hardware_type="node").json()) \
        == 4
    assert len(devices(base, sid, product_name="gh100 [h100 nvswitch]").json()) == 4
    r = devices(base, sid, bus="pci")
    assert (r.status_code, r.text) == (400, "Bus must be PCIE or USB!")
    r = devices(base, sid, hardware_type="fpga")
    assert r.status_code == 400 and "Hardware type must be" in r.text
    assert devices(base, sid, hardware_type="9").status_code == 400
    r = devices(base, "nope00")
    assert (r.status_code, r.text) == (404, "No Node matches the given query.")


def test_a_machine_never_commissioned_has_none_until_its_commissioning_ends():
    clock = FakeClock()
    sim, handle = make(clock=clock)
    base = handle.url + API
    try:
        sid = add(sim, "new-1", "hgx", status="New")
        r = devices(base, sid)
        assert (r.status_code, r.json()) == (200, [])
        r = requests.post(f"{base}/machines/{sid}/", params={"op": "commission"},
                          headers=oauth(), timeout=10)
        assert r.status_code == 200, r.text
        assert devices(base, sid).json() == []  # still commissioning
        clock.now += 11
        assert len(devices(base, sid, product_name="GH100 [H100 NVSwitch]").json()) == 4
        # A machine the simulator knows no layout of (a VM it enrolled) lists none.
        assert devices(base, sim.add_machine("plain-1")).json() == []
    finally:
        handle.stop()


def test_a_maas_older_than_3_0_has_no_node_devices():
    sim, handle = make(version="2.9.2")
    base = handle.url + API
    try:
        sid = add(sim, "hgx-1", "hgx")
        r = devices(base, sid)
        assert r.status_code == 404
        assert r.text == f"Unknown API endpoint: /MAAS/api/2.0/nodes/{sid}/devices/."
        names = {h["name"] for h in requests.get(f"{base}/describe/", timeout=10).json()
                 ["handlers"]}
        assert "NodeDevicesHandler" not in names and "MachineHandler" in names
        assert requests.get(f"{base}/version/", timeout=10).json()["version"] == "2.9.2"
    finally:
        handle.stop()
    sim, handle = make()
    try:
        names = {h["name"] for h in requests.get(f"{handle.url + API}/describe/", timeout=10)
                 .json()["handlers"]}
        assert "NodeDevicesHandler" in names
    finally:
        handle.stop()
