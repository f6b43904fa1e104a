"""A machine's NVSwitch count from MAAS' node devices: the pure rule
(agent_host/maas_nodedevices.py) and ``LibMaasDriver.nvswitch_count`` through the real
python-libmaas client over real HTTP against the simulator (HGX board, PCIe server, a machine
never commissioned, a MAAS older than 3.0, an unknown machine)."""

import logging

import pytest

from testflinger_magic.agent_host.maas import MaasDriver, MaasNotFound
from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver
from testflinger_magic.agent_host.maas_nodedevices import is_nvswitch, nvswitch_count
from testflinger_magic.lab import hosts
from testflinger_magic.lab.maas_sim import MaasSimulator, serve

KEY = "cons:tok:s3cr3t"
logging.getLogger("werkzeug").setLevel(logging.ERROR)


def doc(vendor="10de", product="22a3", name="GH100 [H100 NVSwitch]", hw=0):
    return {"vendor_id": vendor, "product_id": product, "product_name": name,
            "hardware_type": hw, "hardware_type_name": {0: "Node", 5: "GPU"}[hw]}


def test_what_counts_as_an_nvswitch():
    assert is_nvswitch(doc())
    assert is_nvswitch(doc(vendor="10DE", product="1AF1", name=""))  # an older pci.ids: no name
    assert is_nvswitch(doc(product="2b00", name="GB100 [B200 NVSwitch]"))  # by its name
    # Never an HD audio function, a GPU, another vendor's device or an unnamed NVIDIA bridge.
    assert not is_nvswitch(doc(product="22ba", name="AD102 High Definition Audio Controller"))
    assert not is_nvswitch(doc(product="2330", name="GH100 [H100 SXM5 80GB]", hw=5))
    assert not is_nvswitch(doc(product="22a3", name="GH100 [H100 NVSwitch]", hw=5))
    assert not is_nvswitch(doc(vendor="1a03", product="2000", name="ASPEED NVSwitch"))
    assert not is_nvswitch(doc(product="1ad0", name="Tegra PCIe x8 Endpoint"))
    assert nvswitch_count([]) is None
    assert nvswitch_count([doc(vendor="15b3", name="MT2910 Family [ConnectX-7]")]) is None
    assert nvswitch_count([doc(product="22ba", name="Audio")]) == 0
    assert nvswitch_count([doc(), doc(), doc(product="2330", name="GH100", hw=5)]) == 2


def make(version=None):
    sim = MaasSimulator(api_key=KEY, **({"version": version} if version else {}))
    ids = {}
    for name, kind, status in (("hgx-1", "hgx", "Ready"), ("pcie-1", "pcie", "Deployed"),
                               ("new-1", "hgx", "New")):
        ids[name] = sim.add_machine(name, status=status,
                                    interface_name=hosts.BOOT_NIC[kind][1],
                                    hardware=hosts.host_xml(kind=kind, name=name))
    return sim, ids


@pytest.fixture
def lab():
    sim, ids = make()
    handle = serve(sim)
    driver = LibMaasDriver(handle.url + "/MAAS/", KEY, request_timeout=10)
    yield sim, ids, driver
    driver.close()
    handle.stop()


def device_calls(sim):
    return [p for _, p in sim.requests if "/devices/" in p]


def test_the_driver_counts_the_nvswitches_maas_commissioning_found(lab):
    sim, ids, driver = lab
    assert driver.nvswitch_count(ids["hgx-1"]) == len(hosts.NVSWITCHES) == 4
    assert driver.nvswitch_count(ids["pcie-1"]) == 0  # 8 GPUs, 8 audio functions: none
    assert driver.nvswitch_count(ids["new-1"]) is None  # never commissioned: cannot say
    # One call each, asking MAAS for NVIDIA's devices only.
    calls = device_calls(sim)
    assert len(calls) == 3 and all("vendor_id=10de" in p for p in calls), calls
    with pytest.raises(MaasNotFound):
        driver.nvswitch_count("nope00")
    assert MaasDriver.nvswitch_count(driver, ids["hgx-1"]) is None  # the interface's default


def test_an_older_maas_cannot_say():
    sim, ids = make(version="2.9.2")
    handle = serve(sim)
    driver = LibMaasDriver(handle.url + "/MAAS/", KEY, request_timeout=10)
    try:
        assert driver.nvswitch_count(ids["hgx-1"]) is None
        assert device_calls(sim) == []  # no NodeDevices handler in describe/: no call at all
        assert driver.whoami() == "admin"
    finally:
        driver.close()
        handle.stop()


def test_an_older_maas_behind_a_stale_description_cannot_say_either(lab):
    """A describe/ listing the handler while the path is MAAS' catch-all 404 (a region
    downgraded under a connected daemon): None, not an error."""
    sim, ids, driver = lab
    sim.inject("GET", r"/devices/", 404, body="Unknown API endpoint: /MAAS/api/2.0/x.")
    assert driver.nvswitch_count(ids["hgx-1"]) is None
