"""Input bounds of the /v1/magic API over real HTTP (TRIAL3 findings 5 and 6): devices per agent
host, repeated devices, device names, strict booleans, bodies that are not JSON, ``wait``."""

from __future__ import annotations

import io
import json

import pytest
import requests

from testflinger_magic import names
from testflinger_magic.agent_host import config as hostcfg

DEVICE = {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2,
          "tags": ["nvidia"], "home_queues": ["gpu-hosts"]}


def register(m, devices, host="host-a", **extra):
    return requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                         json={"devices": devices, "version": "0.1", **extra}, timeout=30)


def errors(r) -> dict:
    assert r.status_code == 422, (r.status_code, r.text)
    return r.json()["detail"]["json"]


def test_more_devices_than_an_agent_host_drives_are_refused_before_any_is_read(magic):
    """20,000 devices kept the lab server busy for minutes (TRIAL3 5): the count is refused at
    the schema, naming ``devices``, before any device is deserialized (the devices here are
    not even valid: only the count is judged) and nothing is written."""
    too_many = [{"bad": i} for i in range(hostcfg.MAX_DEVICES_PER_HOST + 1)]
    detail = errors(register(magic, too_many))
    assert list(detail) == ["devices"]
    assert detail["devices"] == [f"at most {hostcfg.MAX_DEVICES_PER_HOST} items, got "
                                 f"{hostcfg.MAX_DEVICES_PER_HOST + 1}"]
    assert magic.db.magic_devices.count_documents({}) == 0
    assert magic.db.magic_agent_hosts.count_documents({}) == 0
    # the bound itself is accepted
    many = [dict(DEVICE, agent_name=f"d{i}", maas_system_id=f"s{i}")
            for i in range(hostcfg.MAX_DEVICES_PER_HOST)]
    r = register(magic, many)
    assert r.status_code == 200, r.text
    assert magic.db.magic_devices.count_documents({}) == hostcfg.MAX_DEVICES_PER_HOST


def test_a_device_listed_twice_is_refused_naming_the_repeat(magic):
    detail = errors(register(magic, [DEVICE, dict(DEVICE, maas_system_id="other"), DEVICE]))
    assert set(detail["devices"]) == {"1", "2"}
    assert "'gpu-host-01' is already devices.0.agent_name" in detail["devices"]["1"]["agent_name"][0]
    assert "devices.0.maas_system_id" in detail["devices"]["2"]["maas_system_id"][0]
    assert magic.db.magic_devices.count_documents({}) == 0
    assert magic.db.magic_events.count_documents({"kind": "agent_host.registered"}) == 0
    assert register(magic, [DEVICE]).status_code == 200   # the same device once is fine
    assert magic.db.magic_events.count_documents({"kind": "agent_host.registered"}) == 1


@pytest.mark.parametrize("field,value,words", [
    ("agent_name", "a/b c", "letters, digits and '-' only"),
    ("agent_name", "../gpu-host", "letters, digits and '-' only"),
    ("agent_name", "gpu_host", "letters, digits and '-' only"),   # MAAS: no '_' in a host label
    ("agent_name", "gpu.host", "letters, digits and '-' only"),   # MAAS: '.' starts the domain
    ("agent_name", "-gpu", "starting with a letter or digit"),
    ("agent_name", "g" * (names.MAX_DEVICE_NAME + 1), "fit a MAAS hostname"),
    ("maas_system_id", "abc/?op=release", "path segment"),
    ("tags", ["x" * (hostcfg.MAX_LABEL + 1)], "Length must be between 1 and 100"),
    ("home_queues", ["q"] * (hostcfg.MAX_DEVICE_LABELS + 1), "at most"),
])
def test_device_names_follow_the_vm_name_rule(magic, field, value, words):
    detail = errors(register(magic, [dict(DEVICE, **{field: value})]))
    assert words in json.dumps(detail["devices"]["0"][field])
    assert magic.db.magic_devices.count_documents({}) == 0


def test_the_longest_device_name_makes_vm_names_maas_and_libvirt_accept(magic):
    name = "g" * names.MAX_DEVICE_NAME
    assert register(magic, [dict(DEVICE, agent_name=name)]).status_code == 200
    vm = f"{name}-vm64"
    assert names.VM_NAME_RE.match(vm) and len(vm) == names.MAX_HOST_LABEL


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, "", None])
def test_force_flags_take_json_booleans_only(magic, value):
    """marshmallow's Boolean takes "yes" as true (so does Testflinger's); a force flag forces
    destructive things, so anything but JSON true/false is 422 naming it and nothing happens."""
    assert register(magic, [DEVICE]).status_code == 200
    admin = magic.headers("admin")
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=admin, timeout=10,
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "force": value})
    why = errors(r)["force"][0]
    assert why == "Field may not be null." if value is None else \
        why == f"must be JSON true or false, not {value!r}"
    assert magic.db.magic_leases.count_documents({}) == 0
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=admin, timeout=10,
                     json={"yaml": "magic_queues: {}\n", "force": value, "unsuspend": value})
    assert set(errors(r)) == {"force", "unsuspend"}
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=admin, timeout=10,
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm", "force": False})
    assert r.status_code == 201, r.text
    drain = f"{magic.url}/v1/magic/leases/{r.json()['_id']}/drain"
    assert "force" in errors(requests.post(drain, headers=admin, json={"force": value},
                                           timeout=10))
    assert requests.post(drain, headers=admin, json={"force": True},
                         timeout=10).status_code == 200


@pytest.mark.parametrize("data,content_type,why", [
    ("{bad", None, "Content-Type is 'missing'"),
    ('{"device": "gpu-host-01", "queue": "one-gpu-vm"}', "text/plain",
     "Content-Type is 'text/plain'"),
    ("{bad", "application/json", "Expecting property name"),
    (b"\xff\xfe{}", "application/json", "not UTF-8"),
])
def test_a_body_that_is_not_json_is_400_saying_so(magic, data, content_type, why):
    """Testflinger's endpoints (apiflask) answer a JSON Content-Type with unparsable text 400
    "Bad Request" and a body of another type as if empty (422 "Missing data"); ours keep the
    400 for both and say the body is not JSON."""
    headers = dict(magic.headers("admin"))
    if content_type:
        headers["Content-Type"] = content_type
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=headers, data=data, timeout=10)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["message"].startswith("Bad Request: the body is not JSON")
    assert why in body["detail"]["json"][0]
    assert magic.db.magic_leases.count_documents({}) == 0


def test_an_empty_body_still_takes_the_defaults(magic):
    assert register(magic, [DEVICE]).status_code == 200
    r = requests.post(f"{magic.url}/v1/magic/leases", headers=magic.headers("admin"),
                      json={"device": "gpu-host-01", "queue": "one-gpu-vm"}, timeout=10)
    lease = r.json()
    r = requests.post(f"{magic.url}/v1/magic/leases/{lease['_id']}/drain",
                      headers=magic.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["drain"]["reason"] == "drain requested by operator"


@pytest.mark.parametrize("wait", ["-5", "nan", "inf", "-0.001", "soon"])
def test_work_refuses_a_negative_or_odd_wait(magic, wait):
    assert register(magic, [DEVICE]).status_code == 200
    r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work", params={"wait": wait},
                     headers=magic.headers("agent"), timeout=10)
    assert "wait" in errors(r)


def test_work_accepts_zero_and_clamps_a_long_wait_documented(magic):
    assert register(magic, [DEVICE]).status_code == 200
    for wait in ("0", "0.0"):
        r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work",
                         params={"wait": wait}, headers=magic.headers("agent"), timeout=10)
        assert r.status_code == 200 and r.json() == {"leases": []}


class _Unread(io.BytesIO):
    """A request body that must not be read (its size is said by Content-Length alone)."""

    reads = 0

    def read(self, *args):
        self.reads += 1
        return super().read(*args)

    def readline(self, *args):
        self.reads += 1
        return super().readline(*args)


@pytest.mark.parametrize("path,method", [
    ("/v1/magic/queues", "PUT"), ("/v1/magic/leases", "POST"),
    ("/v1/magic/devices/gpu-host-01/quarantine", "POST"),
    ("/v1/magic/agent-hosts/host-a/binding", "PUT"),
    ("/v1/magic/leases/lease-x/abandon", "POST"),
])
def test_an_oversized_operator_body_is_413_after_auth_and_unread(magic, path, method):
    """TRIAL12 F5: a 60 MB ``PUT /queues`` held a worker 16 s. A body over ``MAX_BODY`` is
    judged from Content-Length: 413 for an allowed caller, 403 for another (authentication
    first), and not a byte of it is read either way."""
    from testflinger_magic.server.apifields import MAX_BODY  # noqa: PLC0415

    client = magic.app.test_client()
    for role, status in (("contributor", 403), ("admin", 413)):
        body = _Unread(b"{}")
        r = client.open(path, method=method, input_stream=body, content_type="application/json",
                        headers=magic.headers(role),
                        environ_overrides={"CONTENT_LENGTH": str(MAX_BODY + 1)})
        assert r.status_code == status, r.get_data(as_text=True)
        assert body.reads == 0
    message = r.get_json()["message"]
    assert message.startswith(f"Request Entity Too Large: the request body of {MAX_BODY + 1} "
                              f"bytes is larger than {MAX_BODY} bytes")
    assert "1 MiB" in message
    assert magic.db.magic_leases.count_documents({}) == 0


@pytest.mark.parametrize("path", ["/v1/magic/agent-hosts/host-a",
                                  "/v1/magic/leases/lease-x/report",
                                  "/v1/magic/agent-hosts/host-a/heartbeat"])
def test_an_oversized_agent_host_body_is_413_after_auth_and_unread(magic, path):
    """The agent-host protocol's writes are bounded too (an agent client is a trust boundary:
    its registration, report and heartbeat bodies were read whole, however large): 413 from
    Content-Length for an agent, 403 for a contributor (authentication first), unread."""
    from testflinger_magic.server.apifields import MAX_AGENT_BODY  # noqa: PLC0415

    client = magic.app.test_client()
    for role, status in (("contributor", 403), ("agent", 413)):
        body = _Unread(b"{}")
        r = client.open(path, method="POST", input_stream=body, content_type="application/json",
                        headers=magic.headers(role),
                        environ_overrides={"CONTENT_LENGTH": str(MAX_AGENT_BODY + 1)})
        assert r.status_code == status, r.get_data(as_text=True)
        assert body.reads == 0
    assert "agent host's registration, report or heartbeat" in r.get_json()["message"]
    assert magic.db.magic_agent_hosts.count_documents({}) == 0


def test_a_definitions_file_over_the_clis_limit_is_413(magic):
    """The file in ``yaml`` is held to the limit ``testflinger-magic apply`` reads
    (fileutil.MAX_INPUT_FILE, 1 MiB), before PyYAML sees it; the limit itself is parsed."""
    from testflinger_magic.fileutil import MAX_INPUT_FILE  # noqa: PLC0415

    url = f"{magic.url}/v1/magic/queues"
    text = "#" + "x" * (MAX_INPUT_FILE - 2) + "\n"
    r = requests.put(url, headers=magic.headers("admin"), json={"yaml": text + "#"}, timeout=30)
    assert r.status_code == 413, r.text
    assert r.json()["detail"]["json"] == {"yaml": [
        f"the definitions file ('yaml') is {MAX_INPUT_FILE + 1} bytes, larger than 1 MiB, the "
        "limit testflinger-magic apply reads too (fileutil.MAX_INPUT_FILE)"]}
    r = requests.put(url, headers=magic.headers("admin"), json={"yaml": text}, timeout=30)
    assert r.status_code == 422, r.text  # parsed: a file with no queue
    assert magic.plugin.definition("one-gpu-vm") is not None


def test_a_chunked_operator_body_is_read_only_to_the_limit(magic):
    """A body without Content-Length (chunked) is read to one byte past ``MAX_BODY`` at most,
    then 413."""
    from testflinger_magic.server.apifields import MAX_BODY  # noqa: PLC0415

    body = _Unread(json.dumps({"yaml": "#" + "x" * (MAX_BODY + 10)}).encode())
    r = magic.app.test_client().put(
        "/v1/magic/queues", input_stream=body, content_type="application/json",
        headers=magic.headers("admin"),
        environ_overrides={"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input_terminated": True})
    assert r.status_code == 413, r.get_data(as_text=True)
    assert r.get_json()["message"].startswith(
        f"Request Entity Too Large: the request body is larger than {MAX_BODY} bytes")
    assert body.tell() == MAX_BODY + 1
