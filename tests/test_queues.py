"""Tests for testflinger_magic.queues: loading, file:line:field errors, policy rules, matching."""

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from testflinger_magic import queues
from testflinger_magic.queues import DefinitionError, Issue, MagicQueue, load_file, load_text

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "magic-queues.yaml"

GOOD = textwrap.dedent("""\
    magic_queues:
      one-gpu-vm:
        description: One VM with one GPU
        devices:
          home_queues: [gpu-hosts]
          tags: [nvidia]
          exclude: [gpu-host-09]
        vm: {gpus: 1, vcpus: 8, memory_mib: 32768, disk_gib: 100}
        policy:
          max_devices: 2
          max_starting: 1
          idle_timeout: 10m
""")


def line_of(text: str, needle: str, nth: int = 0) -> int:
    """1-based line of the nth line containing ``needle`` (so tests don't hard-code lines)."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    return hits[nth]


def issues_of(text: str, filename: str = "q.yaml") -> list[Issue]:
    with pytest.raises(DefinitionError) as info:
        load_text(text, filename)
    assert info.value.issues, "DefinitionError without issues"
    return info.value.issues


def only_issue(text: str) -> Issue:
    found = issues_of(text)
    assert len(found) == 1, found
    return found[0]


def edit(old: str, new: str, text: str = GOOD) -> str:
    assert old in text
    return text.replace(old, new, 1)


# --- good input ------------------------------------------------------------------------------

def test_example_file_loads():
    loaded = {q.name: q for q in load_file(EXAMPLE)}
    assert {"one-gpu-vm", "two-gpu-vm"} <= set(loaded)
    one, two = loaded["one-gpu-vm"], loaded["two-gpu-vm"]
    for q in (one, two):
        assert "gpu-hosts" in q.devices.home_queues and "nvidia" in q.devices.tags
    assert one.vm.gpus == 1 and two.vm.gpus == 2
    # A realistic idle timeout (the lab overrides it), stored in seconds.
    assert 60 <= one.policy.idle_timeout <= 3600
    assert one.policy.reclaim.owner_wait == 30 * 60


def test_defaults_and_seconds():
    (q,) = load_text(GOOD)
    assert q.name == "one-gpu-vm"
    assert q.vms_per_device == "gpus"
    assert q.provision_type == "maas2" and q.agent_template == "maas2-vm"
    assert q.vm_host_series == "jammy"
    assert q.policy.idle_timeout == 600.0
    assert q.policy.min_devices == 0 and q.policy.notify == []
    assert q.policy.max_lease > q.policy.provision_timeout > 0


def test_document_round_trip_is_json_safe():
    import json
    for q in load_file(EXAMPLE):
        doc = q.to_document()
        assert doc["_id"] == q.name and "name" not in doc
        assert json.loads(json.dumps(doc)) == doc
        stored = dict(doc, applied_at=1.0, source="git")
        assert MagicQueue.from_document(stored) == q


def test_dump_yaml_round_trip():
    qs = load_file(EXAMPLE)
    text = queues.dump_yaml(qs)
    assert load_text(text) == qs
    assert "10m" in text  # durations are written the operator's way


def test_integer_vms_per_device_and_cpu_only_vms():
    (q,) = load_text(edit("    vm: {gpus: 1,", "    vms_per_device: 3\n    vm: {gpus: 0,"))
    assert q.vms_per_device == 3
    assert q.vms_for(0) == 3 and q.vms_for(8) == 3


@pytest.mark.parametrize("bad", ["-1", "0", "three", "[4]", "2.5"])
def test_a_refused_value_is_not_compared_again_through_its_default(bad):
    """TRIAL9 F1: ``max_devices: -1`` was reported, then ``max_starting (2) exceeds max_devices
    (1)``: the 1 was the default standing in for the refused value, in no file."""
    text = edit("      max_devices: 2\n      max_starting: 1",
                f"      max_devices: {bad}\n      max_starting: 2")
    issue = only_issue(text)
    assert (issue.field, issue.line) == ("magic_queues.one-gpu-vm.policy.max_devices",
                                         line_of(text, f"max_devices: {bad}"))
    # The comparison still runs when both values were written and valid.
    text = edit("      max_devices: 2\n      max_starting: 1",
                "      max_devices: 1\n      max_starting: 2")
    assert only_issue(text).message == "max_starting (2) exceeds max_devices (1)"


@pytest.mark.parametrize("value, says", [
    ("yes", "got True): write a whole number, e.g. 2 (YAML reads yes, no, on, off, true and "
            "false as booleans)"),
    ("three", "got 'three'): write a whole number, e.g. 2"),
    ("2.5", "got 2.5): write a whole number, e.g. 2"),
])
def test_a_value_of_the_wrong_kind_says_what_to_write(value, says):
    """TRIAL9 F1: pydantic's "Input should be a valid integer (got True)" said what was wrong,
    not what to write."""
    text = edit("      max_starting: 1", f"      max_starting: {value}")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.policy.max_starting"
    assert issue.message.startswith("Input should be a valid integer") and says in issue.message


# --- matching and sizing ---------------------------------------------------------------------

def _queue(**over) -> MagicQueue:
    data = {"name": "q", "description": "d", "devices": {"home_queues": ["gpu-hosts"],
                                                         "tags": ["nvidia"],
                                                         "agents": ["special"],
                                                         "exclude": ["bad"]}}
    data.update(over)
    return MagicQueue.model_validate(data)


@pytest.mark.parametrize("device, expected", [
    ({"_id": "h1", "gpus": 4, "home_queues": ["gpu-hosts"], "tags": []}, True),
    ({"name": "h2", "gpus": 1, "home_queues": [], "tags": ["nvidia"]}, True),
    ({"_id": "special", "gpus": 2}, True),
    ({"_id": "other", "gpus": 4, "home_queues": ["cpu-hosts"], "tags": ["amd"]}, False),
    ({"_id": "bad", "gpus": 4, "home_queues": ["gpu-hosts"], "tags": ["nvidia"]}, False),
    ({"_id": "h0", "gpus": 0, "home_queues": ["gpu-hosts"]}, False),
    ({"_id": "hn", "home_queues": ["gpu-hosts"]}, False),  # unknown GPU count
])
def test_matches(device, expected):
    assert _queue().matches(device) is expected


def test_device_with_too_few_gpus_never_matches():
    q = _queue(vm={"gpus": 2})
    assert not q.matches({"_id": "h1", "gpus": 1, "home_queues": ["gpu-hosts"]})
    assert q.matches({"_id": "h1", "gpus": 2, "home_queues": ["gpu-hosts"]})


@given(st.integers(min_value=0, max_value=64), st.integers(min_value=1, max_value=8))
def test_vms_for_gpus_mode(device_gpus, per_vm):
    q = _queue(vm={"gpus": per_vm})
    n = q.vms_for(device_gpus)
    assert n * per_vm <= device_gpus < (n + 1) * per_vm


@given(st.integers(min_value=0, max_value=64), st.integers(min_value=1, max_value=8),
       st.integers(min_value=1, max_value=16))
def test_vms_for_integer_mode_never_oversubscribes_gpus(device_gpus, per_vm, wanted):
    q = _queue(vm={"gpus": per_vm}, vms_per_device=wanted)
    n = q.vms_for(device_gpus)
    assert n <= wanted and n * per_vm <= device_gpus
    assert n == wanted or (n + 1) * per_vm > device_gpus


# --- YAML-level errors -----------------------------------------------------------------------

def test_syntax_error_has_line():
    text = edit("    policy:\n", "    policy: [unclosed\n")
    issue = only_issue(text)
    assert issue.file == "q.yaml" and "syntax" in issue.message
    assert issue.line >= line_of(text, "[unclosed")


def test_duplicate_key_detected():
    text = edit("      max_starting: 1\n", "      max_starting: 1\n      max_devices: 5\n")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.policy.max_devices"
    assert issue.line == line_of(text, "max_devices: 5")
    assert f"line {line_of(text, 'max_devices: 2')}" in issue.message


def test_duplicate_queue_detected():
    text = GOOD + GOOD.split("\n", 1)[1]
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm"
    assert issue.line == line_of(text, "one-gpu-vm:", nth=1)


@pytest.mark.parametrize("old, new, needle, word", [
    ("    devices:\n", "    devices: &sel\n", "&sel", "anchor"),
    ("    vm: {gpus: 1,", "    vm: &v {gpus: 1,", "&v", "anchor"),
])
def test_anchor_rejected(old, new, needle, word):
    text = edit(old, new)
    issue = only_issue(text)
    assert word in issue.message and issue.line == line_of(text, needle)


def test_alias_rejected():
    text = GOOD + "  two-gpu-vm:\n    description: two\n    devices: *sel\n"
    issue = only_issue(text)
    assert "alias" in issue.message and issue.line == line_of(text, "*sel")


def test_merge_key_rejected():
    text = edit("      max_devices: 2\n", "      <<: {max_devices: 2}\n")
    issue = only_issue(text)
    assert "merge" in issue.message and issue.line == line_of(text, "<<:")
    assert issue.field == "magic_queues.one-gpu-vm.policy"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "[1, 2]\n", "magic_queues: {}\n",
                                  "magic_queues: [a]\n"])
def test_empty_or_wrong_top_level(text):
    issue = issues_of(text)[0]
    assert issue.field == "magic_queues" and issue.line >= 1


def test_unknown_top_level_key():
    text = "other: 1\n" + GOOD
    issue = only_issue(text)
    assert issue.field == "other" and issue.line == 1


# --- schema errors ---------------------------------------------------------------------------

def test_unknown_field_suggests():
    text = edit("      idle_timeout: 10m\n", "      idle_timimeout: 10m\n")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.policy.idle_timimeout"
    assert issue.line == line_of(text, "idle_timimeout")
    assert "unknown field" in issue.message and "idle_timeout" in issue.message


def test_missing_field_points_at_queue():
    text = edit("    description: One VM with one GPU\n", "")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.description"
    assert issue.line == line_of(text, "one-gpu-vm:")


@pytest.mark.parametrize("old, new, field, needle", [
    ("memory_mib: 32768", "memory_mib: lots", "vm.memory_mib", "lots"),
    ("memory_mib: 32768", "memory_mib: '32768'", "vm.memory_mib", "'32768'"),
    ("vcpus: 8", "vcpus: 0", "vm.vcpus", "vcpus: 0"),
    ("disk_gib: 100", "disk_gib: -1", "vm.disk_gib", "disk_gib: -1"),
    ("max_devices: 2", "max_devices: true", "policy.max_devices", "true"),
    ("max_devices: 2", "max_devices: 0", "policy.max_devices", "max_devices: 0"),
    ("idle_timeout: 10m", "idle_timeout: 10 minutes", "policy.idle_timeout", "10 minutes"),
    ("idle_timeout: 10m", "idle_timeout: -5", "policy.idle_timeout", "-5"),
    ("tags: [nvidia]", "tags: nvidia", "devices.tags", "tags: nvidia"),
    ("tags: [nvidia]", "tags: [nvidia, 3]", "devices.tags.1", "tags: [nvidia, 3]"),
])
def test_type_errors(old, new, field, needle):
    text = edit(old, new)
    issue = only_issue(text)
    assert issue.field == f"magic_queues.one-gpu-vm.{field}"
    assert issue.line == line_of(text, needle)


@pytest.mark.parametrize("value", ["0", "-1", "all", "1.5", "true"])
def test_bad_vms_per_device(value):
    text = edit("    vm: {", f"    vms_per_device: {value}\n    vm: {{")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.vms_per_device"
    assert issue.line == line_of(text, "vms_per_device")


@pytest.mark.parametrize("name", ["one gpu", "a/b", "-x", "", "x" * 101])
def test_bad_queue_names(name):
    text = edit("  one-gpu-vm:", f"  '{name}':")
    issue = only_issue(text)
    assert issue.field == f"magic_queues.{name}" and issue.line == 2


def test_name_key_inside_queue_rejected():
    text = edit("    description:", "    name: other\n    description:")
    issue = only_issue(text)
    assert issue.field.endswith(".name") and issue.line == line_of(text, "name: other")


def test_notify_urls():
    text = edit("      idle_timeout: 10m\n", "      idle_timeout: 10m\n      notify:\n"
                "        - https://ok.example/hook\n        - ftp://x/y\n")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.policy.notify.1"
    assert issue.line == line_of(text, "ftp://")


# --- impossible policies ---------------------------------------------------------------------

@pytest.mark.parametrize("old, new, field, needle", [
    ("max_starting: 1", "max_starting: 3", "policy.max_starting", "max_starting: 3"),
    ("max_starting: 1", "max_starting: 1\n      min_devices: 3", "policy.min_devices",
     "min_devices: 3"),
    ("idle_timeout: 10m", "idle_timeout: 10m\n      max_lease: 30m\n      provision_timeout: 45m",
     "policy.max_lease", "max_lease: 30m"),
    ("idle_timeout: 10m", "idle_timeout: 10m\n      provision_timeout: 0s",
     "policy.provision_timeout", "provision_timeout: 0s"),
    ("exclude: [gpu-host-09]", "exclude: [gpu-host-09, gpu-host-01]\n      agents: [gpu-host-01]",
     "devices.exclude.1", "exclude:"),
    ("home_queues: [gpu-hosts]", "home_queues: [gpu-hosts, one-gpu-vm]", "devices.home_queues",
     "home_queues:"),
    ("    vm: {gpus: 1,", "    vm: {gpus: 0,", "vm.gpus", "vm: {gpus: 0"),
    ("    vm: {", "    vm_host_series: Jammy 22.04\n    vm: {", "vm_host_series", "Jammy"),
    ("    vm: {", "    agent_template: ../etc\n    vm: {", "agent_template", "../etc"),
    ("    vm: {", "    provision_type: libvirt\n    vm: {", "provision_type", "libvirt"),
])
def test_impossible_policies(old, new, field, needle):
    text = edit(old, new)
    issue = only_issue(text)
    assert issue.field == f"magic_queues.one-gpu-vm.{field}"
    assert issue.line == line_of(text, needle)


def test_empty_selection():
    text = edit("      home_queues: [gpu-hosts]\n      tags: [nvidia]\n", "")
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.devices"
    assert issue.line == line_of(text, "devices:")


def test_magic_queue_as_another_home_queue():
    text = GOOD + ("  wrapper:\n"
                   "    description: bad\n"
                   "    devices: {home_queues: [one-gpu-vm]}\n")
    issue = only_issue(text)
    assert issue.field == "magic_queues.wrapper.devices.home_queues.0"
    assert issue.line == line_of(text, "[one-gpu-vm]")


def test_every_issue_reported_and_formatted():
    text = edit("max_devices: 2", "max_devices: 0", edit("vcpus: 8", "vcpus: x"))
    text += "  'bad name':\n    description: x\n"
    with pytest.raises(DefinitionError) as info:
        load_text(text, "lab.yaml")
    err = info.value
    fields = {i.field for i in err.issues}
    assert {"magic_queues.one-gpu-vm.vm.vcpus", "magic_queues.one-gpu-vm.policy.max_devices",
            "magic_queues.bad name"} <= fields
    lines = str(err).splitlines()
    assert lines == [f"lab.yaml:{i.line}: {i.field}: {i.message}" for i in err.issues]
    assert [i.line for i in err.issues] == sorted(i.line for i in err.issues)


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(DefinitionError) as info:
        load_file(missing)
    assert info.value.issues[0].file == str(missing)


def test_load_file_names_the_file(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(edit("vcpus: 8", "vcpus: x"))
    with pytest.raises(DefinitionError) as info:
        load_file(path)
    assert str(info.value).startswith(f"{path}:")


def test_in_place_override_is_validated_and_not_shared():
    # The lab shortens policies in place; assignments are validated, defaults not shared.
    a, b = load_text(GOOD + GOOD.split("\n", 1)[1].replace("one-gpu-vm", "other-vm"))
    a.policy.idle_timeout = "30s"
    a.policy.reclaim.grace = 5
    assert a.policy.idle_timeout == 30.0 and a.policy.reclaim.grace == 5.0
    assert b.policy.idle_timeout == 600.0 and b.policy.reclaim.grace == 900.0
    with pytest.raises(Exception):
        a.policy.max_devices = 0


def test_yaml_boolean_key_as_queue_name_is_explained():
    text = edit("  one-gpu-vm:", "  on:")
    issue = only_issue(text)
    assert "quote" in issue.message and issue.line == 2


# --- upper bounds, series, duplicates across files (a bad definition must fail at validate) ----

@pytest.mark.parametrize("memory", ["9000000000000", "99999999999999999999999"])
def test_users_memory_typos_fail_validation_naming_the_field(memory):
    # The user's two cases: both passed validate, then broke every lease / the apply.
    text = edit("memory_mib: 32768", f"memory_mib: {memory}")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "memory_mib"),
                                         "magic_queues.one-gpu-vm.vm.memory_mib")
    assert issue.message == (f"must be at most {queues.MAX_MEMORY_MIB} MiB (16 TiB; a passthrough "
                             f"VM's memory is pinned in host RAM), got {memory}")


@pytest.mark.parametrize("old,new,field,word", [
    ("vcpus: 8", "vcpus: 4097", "vm.vcpus", "at most 4096 vCPUs"),
    ("disk_gib: 100", "disk_gib: 1000000", "vm.disk_gib", "at most 65536 GiB (64 TiB"),
    ("gpus: 1", "gpus: 65", "vm.gpus", "at most 64 GPUs"),
    ("max_devices: 2", "max_devices: 1001", "policy.max_devices", "at most 1000 devices"),
    ("idle_timeout: 10m", "idle_timeout: 400d", "policy.idle_timeout", "longer than the limit"),
    ("idle_timeout: 10m", "priority: 99999999999999999999999", "policy.priority",
     "at most 2147483647"),
    ("idle_timeout: 10m", "failures_before_quarantine: 101",
     "policy.failures_before_quarantine", "at most 100"),
    ("    policy:", "    vms_per_device: 65\n    policy:", "vms_per_device", "integer in 1..64"),
])
def test_upper_bounds(old, new, field, word):
    issue = only_issue(edit(old, new))
    assert issue.field == f"magic_queues.one-gpu-vm.{field}" and word in issue.message, issue
    assert field in queues.LIMITS or field == "policy.idle_timeout"  # every bound is listed


def test_limits_accept_the_maximum_itself():
    text = edit("vm: {gpus: 1, vcpus: 8, memory_mib: 32768, disk_gib: 100}",
                f"vm: {{gpus: 64, vcpus: 4096, memory_mib: {queues.MAX_MEMORY_MIB}, "
                f"disk_gib: {queues.MAX_DISK_GIB}}}")
    (q,) = load_text(text)
    assert (q.vm.vcpus, q.vm.memory_mib) == (4096, 16 * 1024 * 1024)


@pytest.mark.parametrize("series,ok,hint", [
    ("noble", True, ""), ("focal", True, ""), ("jamy", False, "did you mean 'jammy'?"),
    ("ubuntu", False, "not an Ubuntu series name"), ("Jammy", False, "not a series name"),
    ("warty", False, "'warty' is an interim release"), ("bionic", False, "an older LTS"),
    ("questing", False, "an interim release"), ("xenial", False, "focal, jammy, noble"),
])
def test_vm_host_series_must_be_an_ubuntu_series(series, ok, hint):
    text = edit("    policy:", f"    vm_host_series: {series}\n    policy:")
    if ok:
        assert load_text(text)[0].vm_host_series == series
        return
    issue = only_issue(text)
    assert issue.field == "magic_queues.one-gpu-vm.vm_host_series" and hint in issue.message
    assert issue.line == line_of(text, "vm_host_series")


def test_same_queue_in_two_files_validated_together(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    other = edit("  one-gpu-vm:", "  other-vm:")
    b.write_text(other + GOOD.split("\n", 1)[1])  # other-vm, then one-gpu-vm again
    with pytest.raises(DefinitionError) as info:
        queues.load_files([a, b])
    (issue,) = info.value.issues
    assert (issue.file, issue.field) == (str(b), "magic_queues.one-gpu-vm")
    assert issue.line == line_of(b.read_text(), "one-gpu-vm:")
    assert f"already defined in {a}:2" in issue.message
    loaded = queues.load_files([a, tmp_path / "a.yaml"][:1])
    assert [q.name for q in loaded[str(a)]] == ["one-gpu-vm"]


def test_bookkeeping_keys_are_ignored_on_read():
    (q,) = load_text(GOOD)
    stored = dict(q.to_document(), applied_at=1.0, source="x", suspended={"reason": "r"},
                  invalid="why")
    assert MagicQueue.from_document(stored) == q


def test_control_characters_are_a_yaml_issue_not_a_crash():
    """PyYAML's reader refuses them while the loader is made (found by tests/test_server_fuzz)."""
    with pytest.raises(queues.DefinitionError) as err:
        queues.load_text("magic_queues:\x1f\n", "ctl.yaml")
    (issue,) = err.value.issues
    assert (issue.file, issue.field) == ("ctl.yaml", "(yaml)") and "special characters" in issue.message


# --- durations: one grammar, errors with file:line:field (issue: trial finding 13) -------------

@pytest.mark.parametrize("value, says", [
    ("10M", "did you mean '10m'"),
    ("1m1m", "the unit 'm' appears twice"),
    ("'\u0663m'", "ASCII digits"),
    ("0x10", "YAML 1.1 number (hexadecimal)"),
    ("10_000", "YAML 1.1 number (with '_' separators)"),
    ("'0x10'", "plain decimal digits"),
    (".nan", "not a finite number"),
])
def test_bad_durations_are_refused_with_file_line_field(value, says):
    text = edit("idle_timeout: 10m", f"idle_timeout: {value}")
    issue = only_issue(text)
    assert (issue.file, issue.line, issue.field) == (
        "q.yaml", line_of(text, "idle_timeout"), "magic_queues.one-gpu-vm.policy.idle_timeout")
    assert says in issue.message, issue.message


def test_a_bare_number_and_the_same_number_quoted_are_both_seconds():
    as_number = load_text(edit("idle_timeout: 10m", "idle_timeout: 600"))[0]
    as_text = load_text(edit("idle_timeout: 10m", "idle_timeout: '600'"))[0]
    assert as_number.policy.idle_timeout == as_text.policy.idle_timeout == 600.0


@pytest.mark.parametrize("url, says", [
    ("ftp://example.com/x/secret-token", "not an http(s) URL with a host"),
    ("http://127.0.0.1:9/hook/secret-token", "loopback"),
])
def test_a_local_validate_shows_the_author_their_url_the_server_path_redacts(tmp_path, url,
                                                                            says):
    """Trial finding 22: ``validate`` of one's own file names the bad webhook URL as written;
    load_text/load_file (the server's apply, whose answer others may read) keep it redacted."""
    from testflinger_magic import queue_warnings

    text = edit("      idle_timeout: 10m\n", f"      idle_timeout: 10m\n      notify: ['{url}']\n")
    path = tmp_path / "q.yaml"
    path.write_text(text)
    with pytest.raises(DefinitionError) as local:
        queue_warnings.load_file(path)
    (issue,) = local.value.issues
    assert url in issue.message and says in issue.message
    assert issue.field == "magic_queues.one-gpu-vm.policy.notify.0"
    for load in (lambda: load_text(text, "q.yaml"), lambda: load_file(path)):
        with pytest.raises(DefinitionError) as served:
            load()
        (issue,) = served.value.issues
        assert "secret-token" not in issue.message and "redacted" in issue.message
        assert says in issue.message


def test_validate_warns_when_vms_per_device_needs_more_gpus_than_a_server_has(tmp_path):
    """Trial finding 14: ``vms_per_device: 16`` with ``vm.gpus: 1`` is capped on an 8-GPU
    device; validate warns with file, line and field (still valid)."""
    from testflinger_magic import queue_warnings

    text = edit("    vm: {gpus: 1,", "    vms_per_device: 16\n    vm: {gpus: 1,")
    path = tmp_path / "q.yaml"
    path.write_text(text)
    queues_, warnings = queue_warnings.load_file(path)
    (w,) = warnings
    assert (w.line, w.field) == (line_of(text, "vms_per_device"),
                                 "magic_queues.one-gpu-vm.vms_per_device")
    assert "need 16 GPUs per device" in w.message and "8 VMs, not 16" in w.message
    assert queues_[0].vms_for(8) == 8
    path.write_text(edit("    vm: {gpus: 1,", "    vms_per_device: 8\n    vm: {gpus: 1,"))
    assert queue_warnings.load_file(path)[1] == []
    path.write_text(edit("    vm: {gpus: 1,", "    vms_per_device: 64\n    vm: {gpus: 2,"))
    (w,) = queue_warnings.load_file(path)[1]
    assert "no device can (a device registers at most 64 GPUs)" in w.message


@pytest.mark.parametrize("vm, field, says", [
    ("gpus: 2, mmio64_mib: 1024,", "mmio64_mib",
     "1024 MiB for 2 GPU(s) is below 131072 MiB per GPU (262144 MiB)"),
    ("gpus: 1, firmware: bios,", "firmware", "SeaBIOS has no 64-bit PCI window"),
    ("gpus: 9,", "gpus", "9 GPUs per VM: no usual GPU server has more than 8"),
])
def test_validate_warns_of_vm_settings_that_leave_the_gpus_unusable(tmp_path, vm, field, says):
    """TRIAL3 finding 11: an OVMF aperture below 2 x 64 GiB per GPU, bios firmware for a GPU
    VM and more than 8 GPUs per VM are valid but warned of, with file, line and field."""
    from testflinger_magic import queue_warnings

    text = edit("    vm: {gpus: 1,", "    vm: {" + vm)
    path = tmp_path / "q.yaml"
    path.write_text(text)
    queues_, warnings = queue_warnings.load_file(path)
    (w,) = warnings
    assert w.field == f"magic_queues.one-gpu-vm.vm.{field}" and says in w.message, w
    assert w.line == line_of(text, "    vm: {")


def test_validate_keeps_quiet_on_a_big_enough_aperture_and_uefi_without_gpus(tmp_path):
    from testflinger_magic import queue_warnings

    path = tmp_path / "q.yaml"
    for vm in ("vm: {gpus: 2, mmio64_mib: 262144,", "vm: {gpus: 8,",
               "vms_per_device: 2\n    vm: {gpus: 0, firmware: bios,"):
        path.write_text(edit("    vm: {gpus: 1,", "    " + vm))
        assert queue_warnings.load_file(path)[1] == [], vm


@pytest.mark.parametrize("connector, says", [
    ("noprovision", "already running an OS"), ("fake_connector", "Testflinger's own tests"),
    ("muxpi", "specific kind of hardware"), ("control_host_kvm", "KVM-over-IP"),
    ("maas3", "no Testflinger device connector (did you mean 'maas2'?)"),
])
def test_provision_type_is_what_a_vm_agent_can_be(connector, says):
    """Trial finding 15: only maas2 can drive an enrolled VM (vm_rules says why)."""
    text = edit("    policy:", f"    provision_type: {connector}\n    policy:")
    issue = only_issue(text)
    assert (issue.field, issue.line) == ("magic_queues.one-gpu-vm.provision_type",
                                         line_of(text, "provision_type"))
    assert says in issue.message and "uses maas2" in issue.message


@pytest.mark.parametrize("old, new, field, says", [
    ("memory_mib: 32768", "memory_mib: 1", "vm.memory_mib", "at least 2048 MiB (MAAS"),
    ("memory_mib: 32768", "memory_mib: 2047", "vm.memory_mib", "at least 2048 MiB"),
    ("disk_gib: 100", "disk_gib: 9", "vm.disk_gib", "at least 10 GiB"),
    ("disk_gib: 100", "disk_gib: 1000000", "vm.disk_gib", "at most 65536 GiB"),
])
def test_vm_size_bounds_say_why(old, new, field, says):
    issue = only_issue(edit(old, new))
    assert issue.field == f"magic_queues.one-gpu-vm.{field}" and says in issue.message, issue


def test_vm_size_bounds_are_inclusive():
    (q,) = load_text(edit("memory_mib: 32768, disk_gib: 100", "memory_mib: 2048, disk_gib: 10"))
    assert (q.vm.memory_mib, q.vm.disk_gib) == (2048, 10)
    (q,) = load_text(edit("disk_gib: 100", "disk_gib: 65536"))
    assert q.vm.disk_gib == 64 * 1024


def test_focal_is_valid_with_a_warning(tmp_path):
    from testflinger_magic import queue_warnings

    path = tmp_path / "q.yaml"
    path.write_text(edit("    policy:", "    vm_host_series: focal\n    policy:"))
    (w,) = queue_warnings.load_file(path)[1]
    assert w.field == "magic_queues.one-gpu-vm.vm_host_series"
    assert "standard support ended" in w.message
