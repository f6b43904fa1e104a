"""simulate --baseline: the ``none`` and ``static:N[:queue]`` columns, GPU-hour accounting and
the closing ``vs static:N`` figures (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testflinger_magic import cli
from testflinger_magic.lab import baselines as B
from testflinger_magic.lab import simulate as S
from testflinger_magic.queues import load_text

ROOT = Path(__file__).resolve().parent.parent
QUEUES = ROOT / "examples" / "magic-queues.yaml"

ONE_QUEUE = """
magic_queues:
  one-gpu-vm:
    description: one GPU per VM
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 1}
    policy: {max_devices: 2, max_starting: 2, idle_timeout: 10m, provision_timeout: 45m}
  two-gpu-vm:
    description: two GPUs per VM
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 2}
    policy: {max_devices: 1, idle_timeout: 10m, provision_timeout: 45m}
"""

# Three devices: a 2-GPU one and two 4-GPU ones. Two one-gpu-vm jobs at 1 h, a home job at 0
# and one two-gpu-vm job at 2 h.
TRACE = """
lab:
  devices:
    - {name: small-01, gpus: 2, home_queues: [gpu-hosts]}
    - {prefix: big-, count: 2, gpus: 4, home_queues: [gpu-hosts]}
  bringup: {fence: 30s, deploy: 10m, split: 1m, enrol: 4m}
  teardown: {agents: 10s, unsplit: 1m, release: 3m}
jobs:
  - {submit: 0, queue: gpu-hosts, duration: 30m}
  - {submit: 1h, queue: one-gpu-vm, duration: 20m}
  - {submit: 1h, queue: one-gpu-vm, duration: 20m}
  - {submit: 2h, queue: two-gpu-vm, duration: 10m}
"""


@pytest.fixture()
def trace(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(TRACE, encoding="utf-8")
    return S.load_trace(p)


@pytest.fixture(scope="module")
def queues():
    return load_text(ONE_QUEUE, "q.yaml")


def test_parse_baseline():
    assert B.parse_baseline("none") == B.Baseline("none")
    assert B.parse_baseline("static:2:one-gpu-vm") == B.Baseline("static:2:one-gpu-vm", 2, "one-gpu-vm")
    for bad in ("static", "static:0", "static:x", "some"):
        with pytest.raises(B.BaselineError, match="static:N"):
            B.parse_baseline(bad)


def test_none_lends_nothing_and_leaves_magic_jobs_unfinished(trace, queues):
    none, = S.compare(trace, queues, [], ["none"])[:1]
    assert none.kind == "baseline" and none.lends == 0 and none.gpu_hours_lent == 0.0
    assert none.done == {"magic": 0, "home": 1} and none.unfinished == {"magic": 3, "home": 0}
    assert any("one-gpu-vm: 2 job(s) never run" in w for w in none.warnings)


def test_static_splits_the_best_fitting_device_for_the_whole_replay(trace, queues):
    # static:1 brings `none` along
    none, static, policy = S.compare(trace, queues, ["as-defined"], ["static:1"])
    assert (none.label, static.label, policy.label) == ("none", "static:1", "as defined")
    # static:1 picks the queue with most jobs (one-gpu-vm) and the device wasting fewest GPUs
    # (all fit exactly: then by name, big-01), split at 0: both jobs start at once.
    assert static.static == {"one-gpu-vm": 1}
    assert static.wait_by_queue["one-gpu-vm"]["max"] == 0.0
    assert static.unfinished["magic"] == 1  # the two-gpu-vm job: nothing serves it
    end_h = static.virtual_seconds / 3600.0
    assert static.device_hours_lent == pytest.approx(end_h)
    assert static.gpu_hours_lent == pytest.approx(4 * end_h)
    assert static.gpu_hours_busy == pytest.approx(2 * 20 / 60)
    assert static.borrowed_by_home == {"gpu-hosts": pytest.approx(4 * end_h)}
    assert static.borrowed_by_queue == {"one-gpu-vm": pytest.approx(4 * end_h)}
    assert (static.lends, static.bringups, static.reconciles) == (1, 1, 0)
    # The policy lends on demand and pays a bring-up: its one-gpu-vm jobs wait about 15.5 min.
    assert policy.wait_by_queue["one-gpu-vm"]["mean"] == pytest.approx(930.0, abs=60)
    assert policy.done["magic"] == 3 and policy.bringups == policy.lends >= 2
    assert policy.gpu_hours_busy == pytest.approx(2 * 20 / 60 + 2 * 10 / 60)


def test_static_needs_enough_devices_and_a_magic_queue(trace, queues):
    with pytest.raises(S.SimulationError, match="only 3 device"):
        S.compare(trace, queues, [], ["static:4:one-gpu-vm"])
    with pytest.raises(S.SimulationError, match="'nope' is not a magic queue"):
        S.compare(trace, queues, [], ["static:1:nope"])


def test_comparisons_are_ratios_against_static_and_none(trace, queues):
    results = S.compare(trace, queues, ["as-defined", "idle_timeout=1h"], ["static:1:one-gpu-vm"])
    none, static, a, b = results
    rows = B.comparisons(results)
    assert [r["policy"] for r in rows] == ["as defined", "idle_timeout=1h"]
    row = rows[0]
    assert row["reference"] == "static:1:one-gpu-vm" and row["queue"] == "one-gpu-vm"
    # the static baseline's jobs never waited: a ratio against 0 is undefined
    assert row["magic_wait_ratio"] is None
    share = lambda r: r.gpu_hours_busy / r.gpu_hours_lent  # noqa: E731
    assert row["busy_ratio"] == pytest.approx(share(a) / share(static))
    assert row["busy_ratio"] > 1  # lending on demand keeps lent GPUs busier than a fixed split
    base, mine = none.wait["home"]["p95"], a.wait["home"]["p95"]
    assert base == mine == 0.0 and row["home_p95_change"] == 0.0
    line = B.render_comparisons(rows).splitlines()[0]
    assert line == (f"vs static:1:one-gpu-vm: as defined: magic wait -, home p95 +0%, "
                    f"busy x{row['busy_ratio']:.2f}, starved 0s, forced cancels 0")


def test_cli_baseline_lines_and_json(capsys):
    week = ROOT / "examples" / "traces" / "gpu-week.yaml"
    args = ["simulate", str(week), "--queues", str(QUEUES), "--baseline", "static:1",
            "--policy", "idle_timeout=30m"]
    assert cli.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in out["results"]]
    assert labels == ["none", "static:1", "idle_timeout=30m"]
    res = {r["label"]: r for r in out["results"]}
    cmp_, = out["comparisons"]
    want = (res["idle_timeout=30m"]["wait_by_queue"]["one-gpu-vm"]["mean"]
            / res["static:1"]["wait_by_queue"]["one-gpu-vm"]["mean"])
    assert cmp_["magic_wait_ratio"] == pytest.approx(want)
    want = 100 * (res["idle_timeout=30m"]["wait"]["home"]["p95"] / res["none"]["wait"]["home"]["p95"] - 1)
    assert cmp_["home_p95_change"] == pytest.approx(want)
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1] == B.render_comparisons([cmp_])
    assert "one-gpu-vm wait mean/p50/p95" in text and "GPU-hours busy/idle" in text
    assert cli.main(args[:4] + ["--baseline", "static:0"]) != 0


def test_series_and_plot(trace, queues, tmp_path, capsys):
    none, static, policy = S.compare(trace, queues, ["as-defined"], ["static:1"])
    assert {n for _, _, n in static.series} == {1}  # split for good
    assert {n for _, _, n in none.series} == {0}
    lent = [n for _, _, n in policy.series]
    assert max(lent) >= 1 and lent[-1] == 0  # lent on demand, all returned at the end
    # every started job is a point with its wait
    waits = [w for _, w, q in policy.started if q == "one-gpu-vm"]
    assert len(waits) == 2 and sum(waits) / 2 == pytest.approx(
        policy.wait_by_queue["one-gpu-vm"]["mean"])
    assert len([1 for _, _, q in policy.started if q == "home"]) == 1
    assert "series" not in policy.to_dict() and "started" not in policy.to_dict()
    src = tmp_path / "t.yaml"
    src.write_text(TRACE, encoding="utf-8")
    q = tmp_path / "q.yaml"
    q.write_text(ONE_QUEUE, encoding="utf-8")
    png = tmp_path / "out.png"
    assert cli.main(["simulate", str(src), "--queues", str(q), "--baseline", "none",
                     "--policy", "as-defined", "--plot", str(png)]) == 0
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[1] > img.shape[0] > 300
    # A path that cannot be written is refused before the replay (argparse: exit 2)
    for bad, says in ((tmp_path / "missing" / "x.png", "no such directory"),
                      (tmp_path / "x.jpg", "must end with .png")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["simulate", str(src), "--queues", str(q), "--plot", str(bad)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--plot" in err and says in err


@pytest.mark.parametrize("hours", [0.01, 4, 6.5, 30, 47.9, 100, 600])
def test_plot_x_axis_covers_the_trace_span_and_little_more(hours):
    """Issue 10 leftover: a 4 h trace was drawn on a 0-48 h axis (whole days, one extra). The
    axis ends at the first tick at or past the replay's end."""
    from testflinger_magic.lab import sim_plot

    ticks, right = sim_plot.x_axis(hours * 3600)
    step = ticks[1] - ticks[0]
    assert ticks[0] == 0 and right == ticks[-1]
    assert max(hours, 1 / 60) <= right < max(hours, 1 / 60) + step
    assert len(ticks) <= 13


def test_plot_draws_the_trace_span(trace, queues, tmp_path, monkeypatch):
    """The drawn x-axis of every panel is the replay's span (hours), not whole days."""
    import matplotlib.figure

    from testflinger_magic.lab import sim_plot

    results = S.compare(trace, queues, ["as-defined"], [])
    limits = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: limits.extend(ax.get_xlim() for ax in fig.axes))
    sim_plot.plot(results, str(tmp_path / "x.png"))
    end = max(r.virtual_seconds for r in results) / 3600
    _, right = sim_plot.x_axis(end * 3600)
    assert limits and all(lim == (0, right) for lim in limits), (limits, end)
    assert right < 24 or end > 12
