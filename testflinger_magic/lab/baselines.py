"""Baselines for ``testflinger-magic simulate --baseline``: what the lab does without magic queues.

* ``none``: no lending at all; magic-queue jobs never run, home queues keep every device.
* ``static:N[:queue]``: N devices permanently split for ``queue`` (default: the magic queue with
  the most jobs in the trace, ties by name), taken from its eligible devices at time 0 (fewest
  GPUs wasted, then name) and never returned; the other magic queues get nothing.

Both replay the trace with :class:`testflinger_magic.lab.simulate.Simulation` with planning off
(``lending=False``), so their columns carry the same metrics as the policies'.

:func:`comparisons` gives, for each policy column, the figures of the closing lines
``vs static:1: <policy>: magic wait xR, home p95 +P%, busy xB, starved S, forced cancels F``:

* ``magic_wait_ratio`` R: mean wait of the jobs of the reference static baseline's queue under
  the policy / under the baseline (only jobs that started; None when either has none or the
  baseline's mean is 0);
* ``home_p95_change`` P: home-queue p95 wait under the policy against the ``none`` baseline,
  in percent (None when ``none`` has a p95 of 0: an increase of 0 s is then ``+0%``);
* ``busy_ratio`` B: the policy's share of lent GPU-hours that ran jobs / the baseline's;
* ``starved_seconds`` S: time magic queues starved under the policy, summed over the queues
  (``Result.starved``: jobs waiting beyond the queue's supply while another magic queue had
  idle VMs on an open active lease on a device it may use; lab/sim_starve.py);
* ``forced_cancels`` F: jobs the policy's drains cancelled when their grace ended
  (``Result.forced_cancels``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from testflinger_magic.lab.sim_results import Result, _d, busy_share

__all__ = ["Baseline", "parse_baseline", "comparisons", "render_comparisons"]

_STATIC = re.compile(r"^static:(\d+)(?::(.+))?$")


class BaselineError(ValueError):
    """A ``--baseline`` text that is not ``none`` or ``static:N[:queue]``."""


@dataclass(frozen=True)
class Baseline:
    """A parsed ``--baseline``: ``label`` (the text as given), ``static`` N (0 for ``none``),
    ``queue`` (None: chosen from the trace by :meth:`resolve`)."""

    label: str
    static: int = 0
    queue: str | None = None

    def resolve(self, trace, queue_names) -> dict[str, int]:
        """``{queue: N}`` for the replay (empty for ``none``). Raises BaselineError for a queue
        that is not a magic queue or a trace with no magic-queue jobs."""
        if not self.static:
            return {}
        names = sorted(queue_names)
        if self.queue is not None:
            if self.queue not in names:
                raise BaselineError(f"--baseline {self.label}: {self.queue!r} is not a magic queue "
                                    f"in the definitions ({', '.join(names)})")
            return {self.queue: self.static}
        counts = Counter(j.queue for j in trace.jobs if j.queue in names)
        if not counts:
            raise BaselineError(f"--baseline {self.label}: the trace has no magic-queue jobs; "
                                "name the queue (static:N:QUEUE)")
        queue = min(counts, key=lambda q: (-counts[q], q))
        return {queue: self.static}


def parse_baseline(text: str) -> Baseline:
    """``"none"`` or ``"static:N[:queue]"`` (N >= 1) -> :class:`Baseline`. Raises BaselineError."""
    text = text.strip()
    if text == "none":
        return Baseline("none")
    m = _STATIC.match(text)
    if not m or int(m.group(1)) < 1:
        raise BaselineError(f"--baseline {text!r}: want 'none' or 'static:N[:QUEUE]' with N >= 1 "
                            "(N devices permanently split for QUEUE)")
    return Baseline(text, int(m.group(1)), m.group(2))


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def comparisons(results: list[Result]) -> list[dict]:
    """The closing figures, one dict per policy column against the first static baseline
    column (``Result.static`` set) and the ``none`` column (a baseline labelled ``none``). Keys: ``reference``, ``policy``,
    ``queue``, ``magic_wait_ratio``, ``home_p95_change`` (percent), ``busy_ratio``; a figure
    is None when it cannot be computed (see the module docstring)."""
    none = next((r for r in results if r.kind == "baseline" and r.label == "none"), None)
    ref = next((r for r in results if r.kind == "baseline" and r.static), None)
    ref_label = ref.label if ref is not None else None
    queues = sorted(ref.static) if ref is not None else []
    out = []
    for r in results:
        if r.kind != "policy":
            continue
        row = {"reference": ref_label or "none", "policy": r.label, "queue": ",".join(queues) or None,
               "magic_wait_ratio": None, "home_p95_change": None, "busy_ratio": None,
               "starved_seconds": sum(r.starved.values()),
               "forced_cancels": r.forced_cancels}
        if ref is not None:
            row["magic_wait_ratio"] = _ratio(_mean_wait(r, queues), _mean_wait(ref, queues))
            row["busy_ratio"] = _ratio(busy_share(r), busy_share(ref))
        if none is not None:
            base = (none.wait.get("home") or {}).get("p95")
            mine = (r.wait.get("home") or {}).get("p95")
            if base is not None and mine is not None:
                if base > 0:
                    row["home_p95_change"] = 100.0 * (mine - base) / base
                elif mine == 0:
                    row["home_p95_change"] = 0.0
        out.append(row)
    return out


def _mean_wait(r: Result, queues: list[str]) -> float | None:
    """Mean wait (seconds) of the started jobs of ``queues`` (weighted by job count)."""
    total = n = 0.0
    for q in queues:
        w = r.wait_by_queue.get(q) or {}
        if w.get("n"):
            total += w["mean"] * w["n"]
            n += w["n"]
    return total / n if n else None


def render_comparisons(rows: list[dict]) -> str:
    """``vs static:1: <policy>: magic wait xR, home p95 +P%, busy xB, starved S, forced cancels
    F`` lines (``-``
    for a figure that cannot be computed)."""
    def x(v):
        return "-" if v is None else f"x{v:.2f}"

    def pct(v):
        return "-" if v is None else f"{v:+.0f}%"

    return "\n".join(f"vs {r['reference']}: {r['policy']}: magic wait {x(r['magic_wait_ratio'])}, "
                     f"home p95 {pct(r['home_p95_change'])}, busy {x(r['busy_ratio'])}, "
                     f"starved {_d(r.get('starved_seconds') or 0.0)}, "
                     f"forced cancels {r.get('forced_cancels') or 0}"
                     for r in rows)
