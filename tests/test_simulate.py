"""testflinger_magic.lab.simulate: virtual-time replay driving reconcile.plan and leases.TRANSITIONS."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testflinger_magic import cli
from testflinger_magic.lab import simulate as S
from testflinger_magic.queues import DefinitionError, load_file, load_text

ROOT = Path(__file__).resolve().parent.parent
WEEK = ROOT / "examples" / "traces" / "gpu-week.yaml"
QUEUES = ROOT / "examples" / "magic-queues.yaml"

ONE_QUEUE = """
magic_queues:
  one-gpu-vm:
    description: one GPU per VM
    devices: {home_queues: [gpu-hosts]}
    vms_per_device: gpus
    vm: {gpus: 1}
    policy:
      max_devices: 3
      max_starting: 3
      idle_timeout: 10m
      max_lease: 1d
      reclaim: {owner_wait: 30m, grace: 15m}
      provision_timeout: 45m
"""

LAB = """
lab:
  devices:
    - {prefix: gpu-host-, count: 3, gpus: 2, home_queues: [gpu-hosts]}
  bringup: {fence: 30s, deploy: 10m, split: 1m, enrol: 4m}
  teardown: {agents: 10s, unsplit: 1m, release: 3m}
  tick: 30s
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def two_days(tmp_path: Path, seed: int = 1) -> S.Trace:
    """Bursts of magic jobs twice a day with gaps between them, plus steady home load."""
    return S.load_trace(write(tmp_path, f"two-days-{seed}.yaml", LAB + f"""
seed: {seed}
generate:
  - {{queue: gpu-hosts, arrivals: poisson, every: 3h, until: 2d, duration: [10m, 40m]}}
  - {{queue: one-gpu-vm, from: 8h, every: 6h, until: 2d, count: 8, spread: 20m,
     duration: [5m, 30m]}}
  - {{queue: one-gpu-vm, arrivals: poisson, from: 0, every: 2h, until: 2d, duration: [5m, 10m]}}
"""))


@pytest.fixture(scope="module")
def one_queue():
    return load_text(ONE_QUEUE, "one-queue.yaml")


def test_same_trace_same_result():
    trace = S.load_trace(WEEK)
    defs = load_file(QUEUES)
    first = S.simulate(trace, defs).to_dict(with_outcomes=True)
    second = S.simulate(S.load_trace(WEEK), load_file(QUEUES)).to_dict(with_outcomes=True)
    assert first == second
    assert first["lends"] > 0 and first["jobs"] == len(trace.jobs)


def test_every_job_finishes_exactly_once_when_capacity_exists(tmp_path, one_queue):
    trace = two_days(tmp_path)
    r = S.simulate(trace, one_queue)
    assert sorted(r.outcomes) == sorted(j.id for j in trace.jobs)
    assert set(r.outcomes.values()) == {"done"}
    assert r.done["magic"] + r.done["home"] == len(trace.jobs)
    assert r.wait["magic"]["n"] == sum(1 for j in trace.jobs if j.queue == "one-gpu-vm")
    assert r.forced_cancels == 0 and r.lends > 0
    # Every lease closed, so no device stays lent after the last job.
    assert 0 < r.device_hours_idle_lent < r.device_hours_lent


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_longer_idle_timeout_never_lends_more_often(tmp_path, one_queue, seed):
    trace = two_days(tmp_path, seed)
    results = S.compare(trace, one_queue, [f"idle_timeout={t}" for t in ("1m", "10m", "1h", "4h")])
    lends = [r.lends for r in results]
    assert lends == sorted(lends, reverse=True), lends
    assert lends[0] > lends[-1]  # the knob really moves the result on this trace
    lent = [r.device_hours_lent for r in results]
    assert lent == sorted(lent), lent  # holding devices longer costs device-hours


def test_max_devices_caps_open_leases(tmp_path, one_queue):
    trace = two_days(tmp_path)
    capped, wide = S.compare(trace, one_queue, ["max_devices=1,max_starting=1", "max_devices=3"])
    assert capped.max_open_leases == {"one-gpu-vm": 1}
    assert wide.max_open_leases["one-gpu-vm"] > 1
    assert capped.wait["magic"]["mean"] > wide.wait["magic"]["mean"]


def test_trace_without_magic_jobs_never_lends(tmp_path, one_queue):
    trace = S.load_trace(write(tmp_path, "home.csv", "submit,queue,duration,priority\n"
                               "0,gpu-hosts,30m,0\n60,gpu-hosts,1h,5\n2h,other,10m,\n"))
    r = S.simulate(trace, one_queue)
    assert (r.lends, r.device_hours_lent, r.reconciles > 0) == (0, 0.0, True)
    # `other` has no agent: that job waits forever, the others run on the default lab.
    assert r.done == {"magic": 0, "home": 2} and r.unfinished == {"magic": 0, "home": 1}


def test_owner_reclaim_forces_running_magic_jobs(tmp_path, one_queue):
    # Two devices, both lent to long magic jobs; the owners' jobs then wait past owner_wait and
    # the grace (1 s) ends before the magic jobs do: they are cancelled, counted once.
    trace = S.load_trace(write(tmp_path, "reclaim.yaml", """
lab:
  devices: [{prefix: gpu-host-, count: 2, gpus: 2, home_queues: [gpu-hosts]}]
jobs:
  - {submit: 0, queue: one-gpu-vm, duration: 6h}
  - {submit: 0, queue: one-gpu-vm, duration: 6h}
  - {submit: 0, queue: one-gpu-vm, duration: 6h}
  - {submit: 1h, queue: gpu-hosts, duration: 10m}
"""))
    r = S.simulate(trace, one_queue, {"reclaim.owner_wait": "10m", "reclaim.grace": "1s"})
    assert r.reclaims >= 1 and r.forced_cancels >= 1
    assert r.cancelled["magic"] == r.forced_cancels
    assert r.done["home"] == 1
    assert sum(r.done.values()) + sum(r.cancelled.values()) + sum(r.unfinished.values()) == 4


def test_bringup_past_deadline_fails_and_quarantines(tmp_path, one_queue):
    trace = S.load_trace(write(tmp_path, "slow.yaml", """
lab:
  devices: [{name: gpu-host-01, gpus: 2, home_queues: [gpu-hosts]}]
  bringup: {deploy: 2h}
until: 2d
jobs: [{submit: 0, queue: one-gpu-vm, duration: 10m}]
"""))
    r = S.simulate(trace, one_queue)
    # provision_timeout 45m < deploy 2h: each lease is restored at its deadline and counts a
    # failure; after failures_before_quarantine (default 3) the device is never lent again.
    assert (r.lends, r.bringup_failures, r.quarantines) == (3, 3, 1)
    assert r.unfinished["magic"] == 1 and r.virtual_seconds == 2 * 86400


def test_trace_errors_name_file_line_and_field(tmp_path):
    bad = write(tmp_path, "bad.yaml", "jobs:\n  - {submit: 0, queue: q, duration: soon}\n")
    with pytest.raises(DefinitionError) as exc:
        S.load_trace(bad)
    assert str(exc.value).startswith(f"{bad}:2: jobs.0.duration: not a duration: 'soon'")
    bad_csv = write(tmp_path, "bad.csv", "submit,queue,duration\n0,q,1m\n5,q,-3\n")
    with pytest.raises(DefinitionError, match=r"bad.csv:3: duration: duration must not be negative"):
        S.load_trace(bad_csv)
    with pytest.raises(DefinitionError, match=r"lab.devices.0.gpus: required field is missing"):
        S.load_trace(write(tmp_path, "nogpus.yaml", "lab: {devices: [{name: a}]}\njobs: []\n"))


def test_trace_sizes_are_bounded_before_anything_is_built(tmp_path, monkeypatch):
    """A typo'd ``count`` or ``every`` made a raw MemoryError after minutes: devices and the
    jobs ``generate`` rules would make are counted first and refused with file, line, field
    and the limit (nothing is expanded: _expand is never reached)."""
    from testflinger_magic.lab import trace as T

    monkeypatch.setattr(T, "_expand", lambda tf: pytest.fail("expanded a refused trace"))
    job = "jobs: [{submit: 0, queue: q, duration: 1m}]\n"
    cases = [
        ("lab:\n  devices: [{prefix: h-, count: 100000000, gpus: 8}]\n" + job,
         f"t.yaml:2: lab.devices.0.count: must be at most {T.MAX_DEVICES}"),
        ("lab:\n  devices: [{prefix: h-, count: 6000, gpus: 8}, "
         "{prefix: g-, count: 6000, gpus: 8}]\n" + job,
         f"lab: devices: 12000 in all (the counts added up); the limit is {T.MAX_DEVICES}"),
        ("lab:\n  devices: [{name: a, gpus: 100}]\n" + job,
         f"lab.devices.0.gpus: must be at most {T.MAX_GPUS}"),
        ("generate:\n  - {queue: q, every: 1m, until: 1d, duration: 1m}\n"
         "  - {queue: q, every: 1s, until: 366d, count: 100000, duration: 1m}\n",
         "t.yaml:3: generate.1: these rules generate about 3,162,240,001,440 jobs (this one "
         "3,162,240,000,000"),
        ("generate:\n  - {queue: q, every: 1s, until: 30d, days: [0], duration: 1m}\n",
         "about 370,286 jobs"),
    ]
    for text, says in cases:
        path = write(tmp_path, "t.yaml", text)
        with pytest.raises(DefinitionError) as exc:
            S.load_trace(path)
        assert says in str(exc.value), str(exc.value)
    assert T.rule_jobs(T.Rule.model_validate(
        {"queue": "q", "every": "1h", "until": "1d", "count": 2, "duration": 60})) == 48
    # The CLI prints the issue (exit 1), no traceback; a --lab file is held to the same limit.
    root = Path(__file__).resolve().parent.parent
    lab = write(tmp_path, "lab.yaml", "lab: {devices: [{prefix: h-, count: 20000, gpus: 8}]}\n")
    assert cli.main(["simulate", str(root / "examples" / "traces" / "small.csv"), "--queues",
                     str(root / "examples" / "magic-queues.yaml"), "--lab", str(lab)]) == 1


def test_json_trace_and_policy_errors(tmp_path, one_queue):
    trace = S.load_trace(write(tmp_path, "t.json", json.dumps(
        [{"submit": 0, "queue": "one-gpu-vm", "duration": 600}])))
    assert [j.id for j in trace.jobs] == ["job-00001"]
    with pytest.raises(S.SimulationError, match="did you mean 'idle_timeout'"):
        S.parse_policy("idle_timout=5m")
    with pytest.raises(S.SimulationError, match="'nope' is not a magic queue"):
        S.apply_policy(one_queue, S.parse_policy("nope:max_devices=2"))
    assert S.apply_policy(one_queue, {"idle_timeout": "5m"})[0].policy.idle_timeout == 300.0
    assert one_queue[0].policy.idle_timeout == 600.0  # the originals are untouched


def test_cli_simulate_json_one_column_per_policy(tmp_path, capsys):
    trace = write(tmp_path, "t.csv", "submit,queue,duration\n0,one-gpu-vm,10m\n0,gpu-hosts,5m\n")
    rc = cli.main(["simulate", str(trace), "--queues", str(QUEUES), "--json",
                   "--policy", "idle_timeout=5m", "--policy", "idle_timeout=30m,max_devices=1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["results"]] == ["idle_timeout=5m", "idle_timeout=30m,max_devices=1"]
    assert all(r["done"] == {"magic": 1, "home": 1} for r in out["results"])
    rc = cli.main(["simulate", str(trace), "--queues", str(QUEUES), "--policy", "max_devices=0"])
    assert rc == 1 and "max_devices=0" in capsys.readouterr().err


BIG_VMS = ONE_QUEUE.replace("vm: {gpus: 1}", "vm: {gpus: 8}").replace("vms_per_device: gpus",
                                                                     "vms_per_device: 1")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["vm-too-big", "no-matching-device", "unknown-queue"])
def test_jobs_that_can_never_run_end_the_replay_with_a_warning(tmp_path, case):
    """Issue 10 item 1: a job that can never run (VMs need more GPUs than any device has,
    devices that match no queue, a queue nobody serves) ended in an endless replay at 100% CPU.
    The replay ends with it unfinished and a warning naming the queue and why."""
    queues = load_text(BIG_VMS if case == "vm-too-big" else ONE_QUEUE, "q.yaml")
    home = "other-hosts" if case == "no-matching-device" else "gpu-hosts"
    queue = "nobody-serves-this" if case == "unknown-queue" else "one-gpu-vm"
    trace = S.load_trace(write(tmp_path, "t.yaml", f"""
lab:
  devices: [{{prefix: gpu-host-, count: 2, gpus: 2, home_queues: [{home}]}}]
jobs:
  - {{submit: 0, queue: {queue}, duration: 10m}}
  - {{submit: 60, queue: {home}, duration: 10m}}
"""))
    r = S.simulate(trace, queues)
    assert r.outcomes == {trace.jobs[0].id: "unfinished", trace.jobs[1].id: "done"}
    assert len(r.warnings) == 1 and r.warnings[0].startswith(f"queue {queue}: 1 job(s)")
    why = {"vm-too-big": "8 GPU", "no-matching-device": "no device",
           "unknown-queue": "not a magic queue"}[case]
    assert why in r.warnings[0], r.warnings


def test_as_defined_policy_column_and_blank_or_repeated_policies(capsys):
    """``--policy as-defined`` is the definitions as they are, next to the other columns; a
    blank ``--policy ''`` (a nameless second such column) and a repeated column are refused."""
    root = Path(__file__).resolve().parent.parent
    base = ["simulate", str(root / "examples" / "traces" / "small.csv"), "--queues",
            str(root / "examples" / "magic-queues.yaml")]
    assert cli.main([*base, "--policy", "as-defined", "--policy", "max_devices=1"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("policy"))
    assert header.split() == ["policy", "as", "defined", "max_devices=1"]
    for blank in ("", " , "):
        with pytest.raises(SystemExit) as exc:
            cli.main([*base, "--policy", blank])
        assert exc.value.code == 2
        assert "--policy as-defined" in capsys.readouterr().err
    assert cli.main([*base, "--policy", "max_devices=1", "--policy", " max_devices=1"]) == 1
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(S.SimulationError, match="no KEY=VALUE"):
        S.parse_policy(" , ")


@pytest.mark.parametrize("policy, says", [
    ("max_starting=5", "max_starting (5) exceeds max_devices"),
    ("one-gpu-vm:min_devices=9", "min_devices (9) exceeds max_devices"),
    ("max_lease=30m", "max_lease (30m) must be longer than provision_timeout"),
])
def test_policy_overrides_get_the_definitions_cross_field_checks(policy, says, capsys):
    """simulate.md: --policy values are "checked like the definitions file", the rules between
    fields (queues._policy_issues) too; refused before any replay."""
    root = Path(__file__).resolve().parent.parent
    queues = load_file(root / "examples" / "magic-queues.yaml")
    with pytest.raises(S.SimulationError, match=re.escape(says)):
        S.apply_policy(queues, S.parse_policy(policy))
    assert cli.main(["simulate", str(root / "examples" / "traces" / "small.csv"), "--queues",
                     str(root / "examples" / "magic-queues.yaml"), "--policy", policy]) == 1
    err = capsys.readouterr().err
    assert says in err and "checked like the definitions file" in err


def test_a_bringup_no_job_needs_any_more_is_drained_not_finished(tmp_path, one_queue):
    """reconcile's ``unneeded`` drain in the simulation: two jobs at 40m lend gpu-host-02
    while gpu-host-01's VMs are busy; at ~45m those VMs free up and take the two jobs, so the
    second bring-up is stopped (restoring at once, no failure) instead of finishing and idling
    for idle_timeout."""
    trace = S.load_trace(write(tmp_path, "absorbed.yaml", """
lab:
  devices: [{prefix: gpu-host-, count: 2, gpus: 2, home_queues: [gpu-hosts]}]
  bringup: {fence: 30s, deploy: 10m, split: 1m, enrol: 4m}
  tick: 30s
until: 3h
jobs:
  - {submit: 0, queue: one-gpu-vm, duration: 30m}
  - {submit: 0, queue: one-gpu-vm, duration: 30m}
  - {submit: 40m, queue: one-gpu-vm, duration: 1m}
  - {submit: 40m, queue: one-gpu-vm, duration: 1m}
"""))
    r = S.simulate(trace, one_queue)
    assert (r.lends, r.bringups, r.drains.get("unneeded"), r.bringup_failures) == (2, 1, 1, 0)
    assert r.done["magic"] == 4


def test_simulate_inputs_are_refused_with_file_line_field(tmp_path):
    """Trial finding 21: a CSV row longer than the header, a [low, high] range running down, a
    generate rule ending before it starts, ``submit: .nan`` and YAML 1.1 number forms."""
    cases = [
        ("extra.csv", "submit,queue,duration\n0,one-gpu-vm,20m\n0,one-gpu-vm,20m,5\n",
         "extra.csv:3: (row): 4 fields, the header has 3 (submit,queue,duration); extra: 5"),
        ("unicode.csv", "submit,queue,duration\n\u0661,q,20m\n",
         "unicode.csv:2: submit: not a duration: '\u0661' (only the ASCII digits"),
        ("nan.csv", "submit,queue,duration\nnan,q,20m\n", "nan.csv:2: submit: not a duration: 'nan'"),
        ("range.yaml", "generate:\n  - {queue: q, every: 1h, until: 1d, duration: [2h, 1h]}\n",
         "range.yaml:2: generate.0.duration: [low, high] with low (2h) above high (1h)"),
        ("until.yaml", "generate:\n  - {queue: q, every: 1h, from: 2d, until: 1d, duration: 1h}\n",
         "until.yaml:2: generate.0.until: 1d is before from (2d)"),
        ("nan.yaml", "jobs:\n  - {submit: .nan, queue: q, duration: 1h}\n",
         "nan.yaml:2: jobs.0.submit: not a duration: nan (not a finite number"),
        ("hex.yaml", "jobs:\n  - {submit: 0x10, queue: q, duration: 1h}\n",
         "hex.yaml:2: jobs.0.submit: '0x10' is a YAML 1.1 number (hexadecimal)"),
    ]
    for name, text, says in cases:
        with pytest.raises(DefinitionError) as exc:
            S.load_trace(write(tmp_path, name, text))
        assert says in str(exc.value), str(exc.value)
    # CSV cells read by the same grammar: "90" is 90 seconds, as 90 in YAML.
    trace = S.load_trace(write(tmp_path, "ok.csv", "submit,queue,duration\n90,q,600\n"))
    assert (trace.jobs[0].submit, trace.jobs[0].duration) == (90.0, 600.0)


def test_a_policy_key_given_twice_is_refused():
    with pytest.raises(S.SimulationError, match="'idle_timeout' is given twice"):
        S.parse_policy("idle_timeout=5m,idle_timeout=10m")
    with pytest.raises(S.SimulationError, match=r"idle_timeout: '0x10' is a YAML 1.1 number"):
        S.parse_policy("idle_timeout=0x10")
    # The same field for two different queues (or all queues and one) are different keys.
    assert S.parse_policy("one-gpu-vm:max_devices=1,max_devices=2") == {
        "one-gpu-vm:max_devices": 1, "max_devices": 2}
