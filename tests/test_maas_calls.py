"""LibMaasDriver asks MAAS only what it does not know (issue 9: 8 leases in bring-up at once
share one MAAS): a deploy given the machine as just read reads it no more; a create for a VM
never created before goes first and looks only when MAAS refuses it. Through the REAL
python-libmaas client, over real HTTP, against the simulator."""

import dataclasses
import logging

import pytest

from testflinger_magic.agent_host.maas import MaasConflict
from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver
from testflinger_magic.lab.maas_sim import MaasSimulator, serve
from virsh_hosts import add_vm_host

KEY = "cons:tok:s3cr3t-value"
logging.getLogger("werkzeug").setLevel(logging.ERROR)
DELAYS = {"commissioning": 0.2, "deploying": 0.3, "releasing": 0.1}
VM_HOST = "qemu+ssh://ubuntu@10.1.2.3/system"
MACHINES = "/MAAS/api/2.0/machines/"


@pytest.fixture
def sim(tmp_path):
    s = MaasSimulator(api_key=KEY, delays=DELAYS)
    add_vm_host(s, tmp_path, "10.1.2.3", ["dev-1-vm0", "dev-1-vm1", "other"])
    return s


@pytest.fixture
def driver(sim):
    handle = serve(sim)
    d = LibMaasDriver(handle.url + "/MAAS/", KEY, request_timeout=10)
    d.connect()
    yield d
    d.close()
    handle.stop()


def _since(sim, mark):
    """The simulator's requests after the first ``mark`` of them, as (method, path)."""
    return [(m, p.split("?")[0]) for m, p in list(sim.requests)[mark:]]


def test_deploy_given_the_machine_just_read_does_not_read_it_again(driver, sim):
    sid = sim.add_machine("dev-1")
    info = driver.machine(sid)
    mark = len(sim.requests)
    assert driver.deploy(sid, "jammy", current=info).status == "Deploying"
    # allocate and deploy only: no GET of the machine before them
    assert [m for m, _p in _since(sim, mark)] == ["POST", "POST"]
    mark = len(sim.requests)
    assert driver.deploy(sid, "jammy").status in {"Deploying", "Deployed"}  # reads, no-op
    assert [m for m, _p in _since(sim, mark)] == ["GET"]


def test_deploy_with_a_stale_status_meets_maas_refusal_as_a_race(driver, sim):
    """``current`` said Allocated, but the machine was released meanwhile: MAAS refuses the
    deploy (409) and the driver reads the machine then, as for any race."""
    sid = sim.add_machine("dev-1")
    stale = dataclasses.replace(driver.machine(sid), status="Allocated")
    with pytest.raises(MaasConflict):
        driver.deploy(sid, "jammy", current=stale)
    assert sim.machine(sid)["status_name"] == "Ready"


def test_create_first_makes_the_machine_before_any_read(driver, sim):
    mark = len(sim.requests)
    sid = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:01", VM_HOST, "dev-1-vm0",
                                   look_first=False)
    assert _since(sim, mark) == [("POST", MACHINES)]
    assert sim.machine(sid)["status_name"] == "Commissioning"


def test_create_first_of_an_existing_vm_returns_it(driver, sim):
    """MAAS refuses the MAC it has (and the hostname): the driver looks then and returns the
    machine with our MAC, under its own name or another."""
    sid = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:02", VM_HOST, "dev-1-vm0")
    again = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:02", VM_HOST, "dev-1-vm0",
                                     look_first=False)
    renamed = driver.create_vm_machine("dev-1-vm1", "52:54:00:00:09:02", VM_HOST, "dev-1-vm1",
                                       look_first=False)
    assert again == renamed == sid
    assert [m.hostname for m in driver.list_machines("dev-1-vm")] == ["dev-1-vm0"]


def test_create_first_of_a_hostname_held_by_another_mac_is_a_conflict(driver, sim):
    driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:03", VM_HOST, "dev-1-vm0")
    with pytest.raises(MaasConflict, match="delete it first"):
        driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:04", VM_HOST, "other",
                                 look_first=False)
    assert [m.macs for m in driver.list_machines("dev-1-vm0")] == [("52:54:00:00:09:03",)]


def test_static_ip_given_the_machine_the_wait_read_does_not_read_it_again(driver, sim):
    sid = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:09:05", VM_HOST, "dev-1-vm0")
    ready = driver.wait_for(sid, {"Ready"}, set(), timeout=30, poll=0.05)
    assert ready.boot_interface and ready.boot_interface["id"]
    mark = len(sim.requests)
    ip = driver.assign_static_ip(sid, current=ready)
    calls = _since(sim, mark)
    # the subnets, then the interface's unlink of its AUTO link and link_subnet STATIC
    assert [p for m, p in calls if m == "GET"] == ["/MAAS/api/2.0/subnets/"]
    assert all("/interfaces/" in p for m, p in calls if m == "POST")
    assert sim.machine(sid)["ip_addresses"] == [ip]
    # Idempotent from the same (now stale) document: MAAS refuses a second link of the
    # address, and the driver reads the interface then and returns the address it has.
    assert driver.assign_static_ip(sid, current=ready) == ip
    assert driver.assign_static_ip(sid) == ip


def test_status_watch_rounds_start_every_poll_seconds_whatever_maas_takes(monkeypatch):
    """The interval between two rounds counts from the round's start: a MAAS that takes 0.3 s
    to answer, polled every 0.5 s, is read every 0.5 s (one round at a time), not every 0.8 s.
    On a fake clock: the poller's pauses are what is left of the interval."""
    import threading
    import types

    from testflinger_magic.agent_host import maas_watch

    clock = [0.0]
    monkeypatch.setattr(maas_watch, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    starts = []

    def read_many(ids):
        starts.append(clock[0])
        clock[0] += 0.3  # MAAS' answer takes 0.3 s
        return {sid: "Commissioning" for sid in ids}

    watch = maas_watch.StatusWatch(read_many, not_found=KeyError, interrupted=RuntimeError)
    pauses = []
    real_wait = watch._cond.wait

    def wait(timeout=None):
        if threading.current_thread().name != "maas-watch":
            return real_wait(timeout)
        pauses.append(round(timeout, 6))
        clock[0] += timeout  # the pause passes
        return False

    watch._cond.wait = wait
    with watch.watching("m1", 0.5) as next_info:
        for _ in range(4):
            next_info()
    assert starts[:4] == pytest.approx([0.0, 0.5, 1.0, 1.5])
    assert pauses[:3] == pytest.approx([0.2, 0.2, 0.2])
