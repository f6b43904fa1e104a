"""agent-host.yaml's device names and device count follow the server's registration rules
(testflinger_magic.names, shared; TRIAL3 finding 5)."""

from __future__ import annotations

import pytest

from testflinger_magic import names
from testflinger_magic.agent_host.config import MAX_DEVICES_PER_HOST, ConfigError, load_text
from testflinger_magic.server.api_hosts import DeviceIn

HEAD = ("server_url: http://x\nclient_id: c\nsecret_key: s\nagent_host: h\n"
        "maas: {url: http://m, api_key: a:b:c}\nagent_configs_dir: /a\nstate_dir: /s\n"
        "devices:\n")


def _issues(text: str) -> list[tuple]:
    with pytest.raises(ConfigError) as err:
        load_text(text, "ah.yaml")
    return err.value.issues


def test_the_trials_bad_names_are_refused_at_their_lines():
    text = HEAD + ('  - agent_name: "../gpu host-01"\n    supervisor_program: "gpu host:01"\n'
                   "    maas_system_id: x\n    gpus: 2\n")
    issues = _issues(text)
    by_field = {i[2]: i for i in issues}
    assert set(by_field) == {"devices.0.agent_name", "devices.0.supervisor_program"}, issues
    assert by_field["devices.0.agent_name"][1] == 9
    assert by_field["devices.0.agent_name"][3].startswith(
        "'../gpu host-01': letters, digits and '-' only")
    assert by_field["devices.0.supervisor_program"][1] == 10
    assert "supervisord refuses a space, ':' or '/'" in by_field["devices.0.supervisor_program"][3]


@pytest.mark.parametrize("value", [
    "gpu-host-01", "H100-7", "0a", "g" * names.MAX_DEVICE_NAME,
    "g" * (names.MAX_DEVICE_NAME + 1), "gpu_host", "gpu.host-01", "gpu+1", "-gpu", "a/b c",
    "..", "ü-host", "gpu host",
])
def test_the_config_and_the_server_accept_the_same_agent_names(value):
    """One rule: a name the daemon's config accepts the server's registration accepts, and the
    other way round."""
    text = HEAD + f'  - agent_name: "{value}"\n    maas_system_id: x\n    gpus: 2\n'
    try:
        load_text(text, "ah.yaml")
        config_ok = True
    except ConfigError as exc:
        assert [i[2] for i in exc.issues] == ["devices.0.agent_name"], exc.issues
        config_ok = False
    server = DeviceIn().validate({"agent_name": value, "maas_system_id": "x", "gpus": 2})
    assert config_ok == (server == {}), (value, server)
    assert config_ok == bool(names.DEVICE_NAME_RE.match(value))
    if config_ok:  # every VM name the claim can make passes the split's check
        assert names.VM_NAME_RE.match(f"{value}-vm64")


@pytest.mark.parametrize("value, ok", [
    ("gpu-host-01", True), ("agents:gpu-host-01", True), ("gpu_host.01", True),
    ("gpu host:01", False), ("a:b:c", False), ("a/b", False), (":x", False),
])
def test_supervisor_program_may_name_a_group_member(value, ok):
    text = HEAD + (f'  - agent_name: d1\n    supervisor_program: "{value}"\n'
                   "    maas_system_id: x\n    gpus: 2\n")
    if ok:
        assert load_text(text, "ah.yaml").devices[0].supervisor_program == value
    else:
        (issue,) = _issues(text)
        assert issue[1:3] == (10, "devices.0.supervisor_program")


def test_a_system_id_is_a_path_segment():
    (issue,) = _issues(HEAD + "  - agent_name: d1\n    maas_system_id: abc/../x\n    gpus: 2\n")
    assert issue[1:3] == (10, "devices.0.maas_system_id") and "path segment" in issue[3]


def test_more_devices_than_the_server_takes_are_refused():
    devices = "".join(f"  - {{agent_name: d{i}, maas_system_id: s{i}, gpus: 1}}\n"
                      for i in range(MAX_DEVICES_PER_HOST + 1))
    issues = _issues(HEAD + devices)
    assert [i[2] for i in issues] == ["devices"], issues[:3]
    assert f"at most {MAX_DEVICES_PER_HOST} items" in issues[0][3]
    ok = "".join(f"  - {{agent_name: d{i}, maas_system_id: s{i}, gpus: 1}}\n"
                 for i in range(MAX_DEVICES_PER_HOST))
    assert len(load_text(HEAD + ok, "ah.yaml").devices) == MAX_DEVICES_PER_HOST


@pytest.mark.parametrize("second,words", [
    ("gpu-host-01-vm1", "'gpu-host-01-vm1' is the agent name of VM 1 of device 'gpu-host-01' "
                        "(devices.0, line 9)"),
    ("GPU-HOST-01", "differs from device 'gpu-host-01' (devices.0, line 9) only in case"),
])
def test_a_device_named_like_another_devices_vm_is_refused_at_its_line(second, words):
    """TRIAL4 2: the server's registration refuses the same (names.vm_name_clash)."""
    text = HEAD + ("  - agent_name: gpu-host-01\n    maas_system_id: a\n    gpus: 2\n"
                   f"  - agent_name: {second}\n    maas_system_id: b\n    gpus: 2\n")
    issues = _issues(text)
    assert [(i[1], i[2]) for i in issues] == [(12, "devices.1.agent_name")], issues
    assert words in issues[0][3]
    # the same names on their own are fine
    load_text(HEAD + f"  - agent_name: {second}\n    maas_system_id: b\n    gpus: 2\n", "ah.yaml")


@pytest.mark.parametrize("second", [
    "  - agent_name: gpu-host-02\n    supervisor_program: shared\n",
    "  - agent_name: gpu-host-02\n    supervisor_program: gpu-host-01\n",  # the first's default
])
def test_two_devices_sharing_one_supervisord_program_are_refused(second):
    """TRIAL4 4: a fence stops the device agent's program; two devices sharing one would have
    the lend of either stop the other's agent."""
    first = ("  - agent_name: gpu-host-01\n"
             + ("    supervisor_program: shared\n" if "shared" in second else "")
             + "    maas_system_id: a\n    gpus: 2\n")
    issues = _issues(HEAD + first + second + "    maas_system_id: b\n    gpus: 2\n")
    assert [i[2] for i in issues] == ["devices.1.supervisor_program"], issues
    assert "is already devices.0's" in issues[0][3]
    assert "give each device its own supervisor_program" in issues[0][3]
    # distinct programs are fine
    load_text(HEAD + first + "  - agent_name: gpu-host-02\n    maas_system_id: b\n    gpus: 2\n",
              "ah.yaml")
