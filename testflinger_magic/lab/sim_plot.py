"""``simulate --plot FILE.png``: per column (policy or baseline), over virtual time, the waiting
jobs per queue, the devices lent, and each job's wait at its start. matplotlib (the ``[lab]``
extra), drawn off-screen (Agg)."""

from __future__ import annotations

from testflinger_magic.lab.sim_results import Result

__all__ = ["plot", "x_axis"]

HOUR = 3600.0


#: Tick steps (hours) for traces up to two days, the smallest giving at most 12 ticks.
_HOUR_STEPS = (0.25, 0.5, 1, 2, 3, 6, 12)


def x_axis(seconds: float) -> tuple[list[float], float]:
    """``(ticks, right)`` in hours for a replay of ``seconds`` of virtual time: the axis runs
    from 0 to ``right``, the first tick at or past the end (so it covers the trace's whole span
    and little more); ticks every 15 min..12 h up to two days (at most 12 ticks), else whole
    days (at most about 10 ticks)."""
    end = max(float(seconds), 60.0) / HOUR
    if end <= 48:
        step = next((s for s in _HOUR_STEPS if end / s <= 12), 24)
    else:
        days = -(-end // 24)
        step = 24 * max(1, -(-days // 10))
    n = int(-(-end // step))
    ticks = [round(i * step, 4) for i in range(n + 1)]
    return ticks, ticks[-1]


def plot(results: list[Result], path: str, title: str = "") -> None:
    """Write a PNG to ``path``: one column per result, rows *waiting jobs* (a step line per
    magic queue and one for all home queues), *devices lent*, *wait at start* (minutes, a dot
    per job, coloured by queue). Shared axes, so columns compare at a glance. Raises
    ImportError without matplotlib, OSError if the file cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(4.2 * n + 1, 8.5), sharex=True, squeeze=False)
    queues = sorted({q for r in results for _, w, _ in r.series for q in w if q != "home"})
    colours = {q: f"C{i}" for i, q in enumerate(queues)}
    colours["home"] = "0.45"
    for col, r in enumerate(results):
        top, mid, low = axes[0][col], axes[1][col], axes[2][col]
        end = max(r.virtual_seconds, 1.0) / HOUR
        times = [t / HOUR for t, _, _ in r.series] + [end]
        for q in queues + ["home"]:
            ys = [w.get(q, 0) for _, w, _ in r.series]
            if ys and any(ys):
                top.step(times, ys + ys[-1:], where="post", color=colours[q], lw=1, label=q)
        lent = [n for _, _, n in r.series]
        if lent:
            mid.step(times, lent + lent[-1:], where="post", color="C3", lw=1.2)
        for q in queues + ["home"]:
            pts = [(t / HOUR, w / 60.0) for t, w, qq in r.started if qq == q]
            if pts:
                low.scatter(*zip(*pts), s=6, color=colours[q], label=q, alpha=0.7)
        top.set_title(r.label, fontsize=10)
        low.set_xlabel("hours (grey lines: days)")
        for ax in (top, mid, low):
            ax.grid(alpha=0.3)
            for day in range(24, int(end) + 1, 24):
                ax.axvline(day, color="0.8", lw=0.6, zorder=0)
    # Devices lent and waits share their scale across columns; waiting jobs do not: a baseline
    # that never serves a queue piles its jobs up and would flatten every other column.
    for row in axes[1:]:
        top = max(ax.get_ylim()[1] for ax in row)
        for ax in row:
            ax.set_ylim(bottom=min(0, ax.get_ylim()[0]), top=top)
    ticks, right = x_axis(max(r.virtual_seconds for r in results))
    for ax in axes[-1]:  # shared x: one call sets every row
        ax.set_xticks(ticks)
        ax.set_xlim(0, right)
    axes[0][0].set_ylabel("waiting jobs")
    axes[1][0].set_ylabel("devices lent")
    axes[2][0].set_ylabel("wait at start (min)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
