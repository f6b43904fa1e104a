"""The server's gather passes reconcile the arrival history that ``policy.warm_learn`` needs
(Inputs.arrivals): the creation times of each learning queue's jobs within its lookback, from
Testflinger's ``jobs`` documents, and nothing for queues that do not learn."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from conftest import MAGIC_YAML, MagicStack

NOW = datetime(2024, 1, 8, 10, 0, tzinfo=timezone.utc)  # a Monday

LEARNING = MAGIC_YAML + """\
      warm_learn: {lookback: 2d, ahead: 1h, max_devices: 1}
  two-gpu-vm:
    description: Two GPUs
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 2}
"""


def job(queue, at, state="complete"):
    return {"job_id": f"{queue}-{at.timestamp():.0f}", "job_data": {"job_queue": queue},
            "created_at": at.replace(tzinfo=None), "result_data": {"job_state": state}}


def test_gather_reads_the_arrivals_of_learning_queues_within_their_lookback(mongo, serve):
    stack = MagicStack(mongo, serve, yaml_text=LEARNING, clock=NOW.timestamp)
    try:
        at = [NOW - timedelta(days=1, minutes=-30), NOW - timedelta(days=1, minutes=-40),
              NOW - timedelta(hours=47), NOW - timedelta(days=3)]
        mongo.jobs.insert_many([job("one-gpu-vm", t) for t in at]
                               + [job("two-gpu-vm", NOW - timedelta(hours=1))])
        arrivals = stack.plugin.engine.gather(read_only=True).arrivals
        assert set(arrivals) == {"one-gpu-vm"}  # two-gpu-vm does not learn
        assert arrivals["one-gpu-vm"] == sorted(t.timestamp() for t in at[:3])  # 3d is too old
    finally:
        stack.plugin.stop()


def test_no_learning_queue_no_arrivals(magic):
    magic.db.jobs.insert_one(job("one-gpu-vm", datetime.now(timezone.utc)))
    assert magic.plugin.engine.gather(read_only=True).arrivals == {}
