"""server/cancelnote.drain_note: a cancelled job is told what happened, never "forced" unless
an operator drained with --force (trial finding 19)."""

import pytest

from testflinger_magic.server.cancelnote import drain_note


def lease(**drain):
    return {"_id": "lease-1a2b", "queue": "one-gpu-vm", "device": "gpu-host-01",
            "drain": {"reason": "maintenance", **drain}}


@pytest.mark.parametrize("drain, by", [
    ({"kind": "operator", "forced": False}, "drained by an operator's drain (maintenance)"),
    ({"kind": "operator", "forced": True}, "drained by an operator's drain (maintenance)"),
    ({"kind": "forced", "forced": True}, "drained by an immediate forced drain (no grace)"),
    ({"kind": "reclaim", "forced": False}, "drained by the device owner's reclaim"),
    ({"kind": "max_lease"}, "drained by the lease reaching its max_lease"),
    ({"kind": "orphan"}, "drained by the removal of its magic queue from the definitions"),
    ({"kind": "yield"}, "drained by a yield to another magic queue"),
    ({}, "drained by an operator's drain"),
    ({"kind": "something-new"}, "drained by a something-new drain"),
])
def test_the_note_says_who_drained_and_that_the_grace_ran_out(drain, by):
    output, detail = drain_note(lease(**drain), "gpu-hosts", "5m")
    for text in (output, detail):
        assert by in text
        for part in ("lease-1a2b", "magic queue one-gpu-vm", "device gpu-host-01",
                     "owner's queue gpu-hosts", "grace of 5m ran out"):
            assert part in text, (part, text)
    if drain.get("kind") != "forced":  # the engine sets drain.forced at every cancel
        assert "force" not in output and "force" not in detail
    assert output.startswith("\n*** testflinger-magic: this job was cancelled: ")


def test_a_planner_reason_is_not_repeated_around_the_note():
    """TRIAL11 F5: a reclaim's note pasted the planner's whole sentence, queue prefix and
    "; drain lease ... (grace 15s)" end included, in a second pair of brackets."""
    reason = ("one-gpu-vm: home queue gpu-hosts of gpu-host-01 has 1 job waiting up to 1m "
              "(owner_wait 1m); drain lease lease-1a2b on gpu-host-01 (grace 15s)")
    output, detail = drain_note(lease(kind="reclaim", reason=reason), "gpu-hosts", "15s")
    for text in (output, detail):
        assert ("drained by the device owner's reclaim (home queue gpu-hosts of gpu-host-01 "
                "has 1 job waiting up to 1m (owner_wait 1m))") in text, text
        assert "; drain lease" not in text and "one-gpu-vm: home" not in text
    output, _ = drain_note(lease(kind="idle", reason="one-gpu-vm: no waiting jobs and lease "
                                 "lease-1a2b on gpu-host-01 idle for 11m (idle_timeout 10m); "
                                 "drain"), "gpu-hosts", "15m")
    assert "(no waiting jobs and lease lease-1a2b on gpu-host-01 idle for 11m (idle_timeout " \
           "10m))" in output
    # An operator's reason stays as written.
    output, _ = drain_note(lease(kind="operator", reason="one-gpu-vm: PSU; drain"), "x", "5m")
    assert "(one-gpu-vm: PSU; drain)" in output
