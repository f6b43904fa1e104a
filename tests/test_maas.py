"""LibMaasDriver through the REAL python-libmaas client, over real HTTP, against the simulator."""

import logging
import threading
import time

import pytest

from testflinger_magic.agent_host.maas import (
    Interrupted, MaasAuthError, MaasConflict, MaasDriver, MaasError, MaasNotFound, MaasTimeout,
    MaasUnreachable, MachineInfo, _wait_loop, pick_subnet, static_address)
from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver
from testflinger_magic.lab.maas_sim import MaasSimulator, serve
from virsh_hosts import add_vm_host

KEY = "cons:tok:s3cr3t-value"
logging.getLogger("werkzeug").setLevel(logging.ERROR)
# Short simulated durations: wait_for polls until the status changes, never asserts on time.
DELAYS = {"commissioning": 0.2, "deploying": 0.3, "releasing": 0.1}
FAILED = {"Failed deployment", "Failed commissioning", "Releasing failed"}


#: The libvirt host the VM machines' power_address points at, and its domains (power_id).
VM_HOST = "qemu+ssh://ubuntu@10.1.2.3/system"
DOMAINS = ["dev-1-vm0", "dev-1-vm1", "dev-1-vm2", "dev-1-vm3", "a", "b", "vm0", "vm1",
           "shared-vm", "y"]


@pytest.fixture
def sim(tmp_path):
    s = MaasSimulator(api_key=KEY, delays=DELAYS)
    add_vm_host(s, tmp_path, "10.1.2.3", DOMAINS)  # MAAS' virsh driver powers these domains
    return s


@pytest.fixture
def server(sim):
    handle = serve(sim)
    yield handle
    handle.stop()


@pytest.fixture
def driver(server):
    d = LibMaasDriver(server.url + "/MAAS/", KEY, request_timeout=10)
    yield d
    d.close()


def ops(sim, op):
    return [p for m, p in sim.requests if m == "POST" and f"op={op}" in p]


def test_is_a_maas_driver_and_connects_via_describe(driver, sim):
    assert isinstance(driver, MaasDriver)
    assert driver.whoami() == "admin"
    paths = [p for _, p in sim.requests]
    assert paths[0].startswith("/MAAS/api/2.0/describe/")
    assert any(p.startswith("/MAAS/api/2.0/users/?op=whoami") for p in paths)


def test_wrong_api_key_is_a_clear_auth_error_without_the_key(server, sim, caplog):
    sid = sim.add_machine("dev-1")
    bad = LibMaasDriver(server.url + "/MAAS/", "cons:tok:wrong-secret")
    try:
        with caplog.at_level(logging.DEBUG):
            with pytest.raises(MaasAuthError, match="rejected the API key") as exc:
                bad.machine(sid)
    finally:
        bad.close()
    assert server.url in str(exc.value)
    assert "wrong-secret" not in str(exc.value) and "wrong-secret" not in caplog.text


def test_malformed_api_key_is_rejected_without_echoing_it():
    with pytest.raises(ValueError) as exc:
        LibMaasDriver("http://127.0.0.1:1/MAAS/", "only-one-part-s3cr3t")
    assert "s3cr3t" not in str(exc.value)


def test_machine_info_and_not_found(driver, sim):
    sid = sim.add_machine("dev-1", power_type="ipmi")
    info = driver.machine(sid)
    assert info == MachineInfo(sid, "dev-1", "Ready", (), "ipmi", "",
                               (sim.machine(sid)["interface_set"][0]["mac_address"],))
    with pytest.raises(MaasNotFound):
        driver.machine("nosuch")


def test_deploy_allocates_then_deploys_idempotently(driver, sim):
    sid = sim.add_machine("dev-1")
    info = driver.deploy(sid, "jammy", user_data="#cloud-config\npackages: [libvirt]\n")
    assert info.status == "Deploying"
    assert sim.machine(sid)["owner"] == "admin"
    assert driver.deploy(sid, "jammy").status in {"Deploying", "Deployed"}
    done = driver.wait_for(sid, {"Deployed"}, FAILED, timeout=30, poll=0.05)
    assert done.status == "Deployed"
    assert done.ip_addresses == tuple(sim.machine(sid)["ip_addresses"]) and done.ip_addresses
    assert driver.deploy(sid, "jammy").status == "Deployed"
    assert len(ops(sim, "allocate")) == 1 and len(ops(sim, "deploy")) == 1
    assert sim.user_data(sid) == b"#cloud-config\npackages: [libvirt]\n"  # sent base64


def test_deploy_of_allocated_machine_skips_allocate(driver, sim):
    sid = sim.add_machine("dev-1", status="Allocated")
    assert driver.deploy(sid, "noble").status == "Deploying"
    assert ops(sim, "allocate") == []


def test_deploy_refuses_failed_deployment_until_released(driver, sim):
    sid = sim.add_machine("dev-1", status="Failed deployment")
    with pytest.raises(MaasConflict, match="Failed deployment"):
        driver.deploy(sid, "jammy")
    driver.release(sid)
    assert driver.wait_for(sid, {"Ready"}, FAILED, timeout=30, poll=0.05).status == "Ready"


def test_release_goes_back_to_ready_idempotently(driver, sim):
    sid = sim.add_machine("dev-1", status="Deployed")
    assert driver.release(sid).status == "Releasing"
    assert driver.release(sid).status in {"Releasing", "Ready"}
    info = driver.wait_for(sid, {"Ready"}, FAILED, timeout=30, poll=0.05)
    assert info.ip_addresses == ()
    assert driver.release(sid).status == "Ready"
    assert len(ops(sim, "release")) == 1
    allocated = sim.add_machine("dev-2", status="Allocated")
    assert driver.release(allocated).status == "Ready"


def test_create_vm_machine_commissions_and_is_idempotent(driver, sim):
    sid = driver.create_vm_machine("dev-1-vm0", "52:54:00:AA:00:01",
                                   "qemu+ssh://ubuntu@10.1.2.3/system", "dev-1-vm0")
    assert sim.machine(sid)["power_type"] == "virsh"
    assert sim.power_parameters(sid) == {"power_address": "qemu+ssh://ubuntu@10.1.2.3/system",
                                         "power_id": "dev-1-vm0"}
    assert driver.machine(sid).status == "Commissioning"
    again = driver.create_vm_machine("dev-1-vm0", "52:54:00:aa:00:01", VM_HOST, "y")
    other_name = driver.create_vm_machine("renamed", "52:54:00:aa:00:01", VM_HOST, "y")
    assert again == other_name == sid
    creates = [p for m, p in sim.requests if m == "POST" and p.rstrip("?") ==
               "/MAAS/api/2.0/machines/"]
    assert len(creates) == 1
    with pytest.raises(MaasConflict, match="delete it first"):
        driver.create_vm_machine("dev-1-vm0", "52:54:00:aa:00:02", VM_HOST, "y")
    info = driver.wait_for(sid, {"Ready"}, FAILED, timeout=30, poll=0.05)
    assert (info.hostname, info.power_type) == ("dev-1-vm0", "virsh")


def test_find_list_and_delete(driver, sim):
    a = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:00:01", VM_HOST, "a")
    b = driver.create_vm_machine("dev-1-vm1", "52:54:00:00:00:02", VM_HOST, "b")
    sim.add_machine("dev-2")
    assert driver.find_by_hostname("dev-1-vm1") == b
    assert driver.find_by_hostname("dev-1-vm1.maas") == b
    assert driver.find_by_hostname("dev-1-vm9") is None
    assert sorted(m.system_id for m in driver.list_machines("dev-1-vm")) == sorted([a, b])
    assert len(driver.list_machines()) == 3
    driver.delete(a)
    driver.delete(a)  # missing is fine
    assert driver.find_by_hostname("dev-1-vm0") is None
    assert [m.hostname for m in driver.list_machines("dev-1-")] == ["dev-1-vm1"]


def test_injected_deploy_failure_raises_maas_error_with_status_message(driver, sim):
    sid = sim.add_machine("dev-1")
    sim.fail_next(sid, "deploy")
    driver.deploy(sid, "jammy")
    with pytest.raises(MaasError) as exc:
        driver.wait_for(sid, {"Deployed"}, FAILED, timeout=30, poll=0.05)
    err = exc.value
    assert not isinstance(err, MaasTimeout)
    assert (err.system_id, err.status) == (sid, "Failed deployment")
    assert "dev-1" in str(err) and sid in str(err) and "simulated" in err.status_message


def test_injected_commission_failure_armed_by_hostname(driver, sim):
    sim.fail_next("dev-1-vm1", "commission")  # armed before the machine exists
    ok = driver.create_vm_machine("dev-1-vm0", "52:54:00:00:00:07", VM_HOST, "vm0")
    bad = driver.create_vm_machine("dev-1-vm1", "52:54:00:00:00:08", VM_HOST, "vm1")
    assert driver.wait_for(ok, {"Ready"}, FAILED, timeout=30, poll=0.05).status == "Ready"
    with pytest.raises(MaasError, match="Failed commissioning") as exc:
        driver.wait_for(bad, {"Ready"}, FAILED, timeout=30, poll=0.05)
    assert exc.value.system_id == bad and "dev-1-vm1" in str(exc.value)


def test_wait_for_timeout(driver, sim):
    sid = sim.add_machine("dev-1", status="Allocated")
    with pytest.raises(MaasTimeout, match="still 'Allocated'") as exc:
        driver.wait_for(sid, {"Deployed"}, FAILED, timeout=0, poll=0.01)
    assert exc.value.status == "Allocated"


def test_unreachable_simulated_and_real(driver, sim, server):
    sid = sim.add_machine("dev-1")
    sim.set_unreachable(True)
    with pytest.raises(MaasUnreachable, match="503"):
        driver.machine(sid)
    sim.set_unreachable(False)
    assert driver.machine(sid).status == "Ready"
    url = server.url
    server.stop()
    with pytest.raises(MaasUnreachable) as exc:
        driver.machine(sid)
    assert url in str(exc.value)
    fresh = LibMaasDriver(url + "/MAAS/", KEY, request_timeout=5)
    try:
        with pytest.raises(MaasUnreachable, match="unreachable"):
            fresh.find_by_hostname("dev-1")  # fails already fetching describe/
    finally:
        fresh.close()


def test_wait_loop_retries_transient_unreachable():
    answers = [MaasUnreachable("blip"), MachineInfo("s", "h", "Deploying", (), "ipmi"),
               MachineInfo("s", "h", "Deployed", ("10.0.0.1",), "ipmi")]
    sleeps = []

    def read(_):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    info = _wait_loop(read, "s", {"Deployed"}, set(), timeout=100, poll=3,
                      clock=lambda: 0.0, sleep=sleeps.append)
    assert info.ip_addresses == ("10.0.0.1",) and sleeps == [3, 3]

    def down(_):
        raise MaasUnreachable("down")

    with pytest.raises(MaasUnreachable):
        _wait_loop(down, "s", {"Deployed"}, set(), timeout=0, poll=1,
                   clock=lambda: 0.0, sleep=sleeps.append)


def test_wait_loop_stops_when_asked_even_in_a_long_pause():
    stop = threading.Event()
    reads = []

    def down(sid):
        reads.append(sid)
        raise MaasUnreachable("down")

    outcome = []

    def wait():
        try:
            # An hour between polls and an hour of deadline: only the stop event ends this.
            _wait_loop(down, "s", {"Deployed"}, set(), timeout=3600, poll=3600,
                       should_stop=stop)
        except Interrupted as exc:
            outcome.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    while len(reads) < 1:
        time.sleep(0.01)
    stop.set()
    t.join(60)
    assert not t.is_alive() and len(outcome) == 1 and "stopped while waiting" in str(outcome[0])
    assert not isinstance(outcome[0], MaasError)  # nothing failed: not reported as an error
    # A callable works too, checked before the first read.
    with pytest.raises(Interrupted):
        _wait_loop(down, "s", {"Deployed"}, set(), timeout=10, poll=1, should_stop=lambda: True)
    assert len(reads) == 1


def test_calls_from_many_threads_at_once(driver, sim):
    ids = [sim.add_machine(f"dev-{i}") for i in range(6)]
    results, errors = {}, []
    start = threading.Barrier(len(ids) * 2)

    def deploy(sid):
        try:
            start.wait()
            results[sid] = driver.deploy(sid, "jammy").status
        except Exception as e:  # reported below
            errors.append(e)

    def create(i):
        try:
            start.wait()
            results[f"vm{i}"] = driver.create_vm_machine(
                "shared-vm", "52:54:00:00:01:00", VM_HOST, "shared-vm")
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=deploy, args=(s,)) for s in ids]
    threads += [threading.Thread(target=create, args=(i,)) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(results[s] in {"Deploying", "Deployed"} for s in ids)
    vm_ids = {results[f"vm{i}"] for i in range(len(ids))}
    assert len(vm_ids) == 1  # concurrent creates of the same VM converge on one machine
    assert [m.hostname for m in driver.list_machines("shared-vm")] == ["shared-vm"]


def test_create_converges_when_a_racing_create_lands_between_its_reads(driver, sim):
    """The MAC read saw nothing, a racing call then created the machine: the hostname read
    finds it with our MAC, which is ours to reuse, not a conflict (a flaky failure of the
    many-threads test above)."""
    first = driver.create_vm_machine("race-vm", "52:54:00:00:02:00", VM_HOST, "race-vm")
    real_list = driver._list

    def mac_read_before_the_create(**query):
        return [] if "mac_address" in query else real_list(**query)

    driver._list = mac_read_before_the_create
    try:
        again = driver.create_vm_machine("race-vm", "52:54:00:00:02:00", VM_HOST, "race-vm")
    finally:
        driver._list = real_list
    assert again == first
    assert [m.hostname for m in driver.list_machines("race-vm")] == ["race-vm"]


def ready_vm(driver, mac="52:54:00:00:03:01", name="dev-1-vm0"):
    sid = driver.create_vm_machine(name, mac, "qemu+ssh://ubuntu@10.1.2.3/system", name)
    driver.wait_for(sid, {"Ready"}, FAILED, timeout=30, poll=0.05)
    return sid


def test_assign_static_ip_replaces_auto_link_and_is_idempotent(driver, sim):
    sid = ready_vm(driver)
    assert [lk["mode"] for lk in sim.machine(sid)["boot_interface"]["links"]] == ["auto"]
    ip = driver.assign_static_ip(sid)
    assert driver.assign_static_ip(sid) == ip
    links = sim.machine(sid)["boot_interface"]["links"]
    assert [(lk["mode"], lk["ip_address"]) for lk in links] == [("static", ip)]
    info = driver.machine(sid)
    assert (info.status, info.ip_addresses) == ("Ready", (ip,))  # stays Ready, not deployed
    assert len(ops(sim, "link_subnet")) == 1 and len(ops(sim, "unlink_subnet")) == 1
    # A deploy (what the maas2 connector does per job) and a release keep the address.
    driver.deploy(sid, "jammy")
    assert ip in driver.wait_for(sid, {"Deployed"}, FAILED, 30, 0.05).ip_addresses
    driver.release(sid)
    assert driver.wait_for(sid, {"Ready"}, FAILED, 30, 0.05).ip_addresses == (ip,)


def test_assign_static_ip_gives_each_vm_its_own_address_even_concurrently(driver, sim):
    sids = [ready_vm(driver, f"52:54:00:00:04:0{i}", f"dev-1-vm{i}") for i in range(4)]
    results, errors = {}, []

    def assign(sid):
        try:
            results[sid] = driver.assign_static_ip(sid)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=assign, args=(s,)) for s in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results.values())) == len(sids)


def test_assign_static_ip_on_a_named_subnet_and_errors_name_machine_and_interface(tmp_path):
    sim2 = MaasSimulator(api_key=KEY, delays=DELAYS, subnets=["10.5.0.0/24", "10.6.0.0/24"])
    add_vm_host(sim2, tmp_path, "10.1.2.3", DOMAINS)
    handle = serve(sim2)
    d = LibMaasDriver(handle.url + "/MAAS/", KEY, request_timeout=10)
    try:
        sid = ready_vm(d)
        with pytest.raises(MaasError, match="no subnet '10.99.0.0/24'") as exc:
            d.assign_static_ip(sid, subnet="10.99.0.0/24")
        assert "dev-1-vm0" in str(exc.value) and sid in str(exc.value)
        # The second subnet is on another VLAN: MAAS refuses it (HTTP 400) without force.
        with pytest.raises(MaasError) as exc:
            d.assign_static_ip(sid, subnet="10.6.0.0/24")
        msg = str(exc.value)
        assert "dev-1-vm0" in msg and sid in msg and "interface eth0" in msg and "400" in msg
        assert d.assign_static_ip(sid, subnet=1).startswith("10.5.0.")
        deployed = sim2.add_machine("busy", status="Deployed")
        with pytest.raises(MaasConflict, match="busy .* interface eth0") as exc:
            d.assign_static_ip(deployed)
        assert exc.value.system_id == deployed
    finally:
        d.close()
        handle.stop()


def test_static_address_and_pick_subnet_are_pure():
    assert static_address({"links": [{"mode": "auto", "id": 1},
                                     {"mode": "static", "ip_address": "10.0.0.5"}]}) == "10.0.0.5"
    assert static_address({"links": [{"mode": "dhcp", "ip_address": "10.0.0.6"}]}) is None
    subnets = [{"id": 1, "cidr": "10.1.0.0/24", "name": "a", "vlan": {"id": 7}},
               {"id": 2, "cidr": "10.2.0.0/24", "name": "b", "vlan": {"id": 8}}]
    assert pick_subnet(subnets, {"id": 8})["id"] == 2
    assert pick_subnet(subnets, None)["id"] == 1
    assert pick_subnet(subnets, {"id": 9})["id"] == 1
    assert pick_subnet(subnets, None, "10.2.0.0/24")["id"] == 2
    assert pick_subnet(subnets, None, 1)["id"] == 1
    assert pick_subnet(subnets, None, "nope") is None and pick_subnet([], None) is None


def test_concurrent_waits_share_one_list_read_per_round(driver, sim):
    # Four VMs commissioning together: their waits are answered by shared rounds, each one
    # GET machines/?id=..&id=.. (maas_watch.StatusWatch), never a read of one machine.
    macs = [f"52:54:00:00:01:0{i}" for i in range(4)]
    sids = [driver.create_vm_machine(f"dev-1-vm{i}", macs[i], VM_HOST, f"dev-1-vm{i}")
            for i in range(4)]
    sim.requests.clear()
    found, errors = {}, []

    def wait(sid):
        try:
            found[sid] = driver.wait_for(sid, {"Ready"}, FAILED, timeout=30, poll=0.05)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and {s: i.status for s, i in found.items()} == dict.fromkeys(sids, "Ready")
    reads = [p for m, p in sim.requests if m == "GET"]
    assert reads and all(p.startswith("/MAAS/api/2.0/machines/?") and "id=" in p for p in reads)
    assert not any(f"/machines/{sid}/" in p for p in reads for sid in sids)
    assert driver._watch.rounds == len(reads)
    # A round covers every machine waited on at that time: fewer reads than one per wait
    # per round would make.
    assert max(p.count("id=") for p in reads) > 1


def test_wait_for_a_machine_that_is_gone_raises_not_found(driver, sim):
    with pytest.raises(MaasNotFound, match="nosuch"):
        driver.wait_for("nosuch", {"Ready"}, FAILED, timeout=30, poll=0.05)


def test_shared_wait_stops_when_asked(driver, sim):
    sid = sim.add_machine("dev-1", status="Allocated")
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(Interrupted):
        driver.wait_for(sid, {"Deployed"}, FAILED, timeout=3600, poll=3600, should_stop=stop)


def test_status_watch_never_answers_a_wait_from_a_round_begun_before_it():
    # A wait joining while a round is in flight must not take that round's (older) answer: the
    # deploy it follows may have been asked for after that read began.
    from testflinger_magic.agent_host.maas_watch import StatusWatch

    entered, release = threading.Event(), threading.Event()
    answers = iter(["Allocated", "Deploying"])
    calls = []

    def read_many(ids):
        calls.append(list(ids))
        status = next(answers)
        if status == "Allocated":
            entered.set()
            assert release.wait(10)
        return {sid: status for sid in ids}

    watch = StatusWatch(read_many, not_found=KeyError, interrupted=RuntimeError)
    got = {}

    def first():
        with watch.watching("m1", 5) as next_info:
            got["first"] = next_info()

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)  # round 1 is reading
    with watch.watching("m1", 5) as next_info:
        release.set()
        got["second"] = next_info()
    t.join(10)
    assert got["second"] == "Deploying"  # never round 1's answer
    assert got["first"] in ("Allocated", "Deploying")  # the newest round it could see
    assert calls == [["m1"], ["m1"]]
