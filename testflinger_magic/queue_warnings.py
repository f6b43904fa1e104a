"""Warnings about magic queue definitions that are valid but likely wrong (pure; ``validate``).

Unlike the issues of :mod:`testflinger_magic.queues` (errors: the definition is refused), a
warning names a value that the server accepts but that will probably hurt: ``testflinger-magic
validate`` prints it and still exits 0.
"""

from __future__ import annotations

from pathlib import Path

from testflinger_magic import queues as Q
from testflinger_magic import vm_rules
from testflinger_magic.durations import format_duration
from testflinger_magic.queue_issues import read_text

#: Seconds a MAAS deploy of a bare-metal multi-GPU server can take: 30 minutes. A deploy PXE
#: boots the machine into MAAS' ephemeral environment, curtin writes the image, and the machine
#: reboots into it: two or three power cycles, and a large server's firmware (POST, memory
#: training, GPU option ROMs) alone takes 3-10 minutes each, so 15-30 minutes is usual; the
#: upper end is what a timeout must allow.
DEPLOY_SECONDS = 30 * 60
#: Seconds for the rest of a bring-up: 10 minutes. Splitting the host with libvirt (about 2
#: minutes), then enrolling each VM in MAAS, which commissions it (a VM boots the ephemeral
#: environment and runs the commissioning scripts: about 5-8 minutes), then starting its agent.
COMMISSION_SECONDS = 10 * 60
#: A ``provision_timeout`` below this warns: a bring-up that is only slow would time out, and
#: every device would be counted a failure in turn (until the server blames the queue,
#: testflinger_magic.blame). 40 minutes; the example's 45m passes.
MIN_PROVISION_TIMEOUT = DEPLOY_SECONDS + COMMISSION_SECONDS


#: GPUs of the largest usual GPU server (vm_rules.USUAL_MAX_GPUS: 8). An integer
#: ``vms_per_device`` whose VMs need more GPUs than this is capped on such a device
#: (``MagicQueue.vms_for``), so ``validate`` warns; so it does for ``vm.gpus`` above it.
USUAL_MAX_GPUS = vm_rules.USUAL_MAX_GPUS


def queue_warnings(q: Q.MagicQueue) -> list[tuple[tuple, str]]:
    """``[(field path relative to the queue, message)]`` for ``q`` (empty: nothing to say)."""
    out = []
    p = q.policy
    if series := vm_rules.series_warning(q.vm_host_series):
        out.append((("vm_host_series",), series))
    if q.vms_per_device != "gpus" and q.vm.gpus:
        need = int(q.vms_per_device) * q.vm.gpus
        if need > USUAL_MAX_GPUS:
            never = (f"; no device can (a device registers at most {Q.MAX_GPUS} GPUs)"
                     if need > Q.MAX_GPUS else "")
            out.append((("vms_per_device",),
                        f"{q.vms_per_device} VMs of {q.vm.gpus} GPU{'s' if q.vm.gpus != 1 else ''} "
                        f"need {need} GPUs per device{never}: a device with fewer is split into "
                        f"one VM per {q.vm.gpus} of its GPUs (an {USUAL_MAX_GPUS}-GPU device: "
                        f"{USUAL_MAX_GPUS // q.vm.gpus} VMs, not {q.vms_per_device}); lends and "
                        "status say the VM count used"))
    for fld, message in vm_rules.gpu_vm_warnings(q.vm.gpus, q.vm.firmware, q.vm.mmio64_mib):
        out.append((("vm", fld), message))
    if 0 < p.provision_timeout < MIN_PROVISION_TIMEOUT:
        out.append((("policy", "provision_timeout"),
                    f"{format_duration(p.provision_timeout)} is below the "
                    f"{format_duration(MIN_PROVISION_TIMEOUT)} a bring-up can take (a MAAS "
                    f"deploy of a bare-metal server, up to {format_duration(DEPLOY_SECONDS)}, "
                    f"plus splitting and the VMs' commissioning, about "
                    f"{format_duration(COMMISSION_SECONDS)}); slow bring-ups would time out "
                    "and count failures against healthy devices"))
    longest = max((_window_seconds(w) for w in p.warm), default=0.0)
    if longest and p.max_lease and p.max_lease < longest + p.idle_timeout:
        # reconcile._Planner.reclaim_reason: max_lease drains with reclaim.grace, then forces.
        out.append((("policy", "max_lease"),
                    f"{format_duration(p.max_lease)} is shorter than the longest warm window "
                    f"({format_duration(longest)}) plus idle_timeout "
                    f"({format_duration(p.idle_timeout)}): a lease lent when the window opens "
                    "reaches max_lease while it is still kept warm and busy; its drain gives "
                    f"running jobs only reclaim.grace ({format_duration(p.reclaim.grace)}), then "
                    "cancels them, and the warm level lends another device (a new bring-up)"))
    return out


def _window_seconds(w) -> float:
    """Length of a ``warm`` window's ``hours`` (``"08:00-18:00"`` -> 36000.0)."""
    start, end = (int(t[:2]) * 3600 + int(t[3:]) * 60 for t in w.hours.split("-"))
    return float(end - start)


def load_file(path: str | Path, webhook_allow=None, show_urls: bool = True
              ) -> tuple[list[Q.MagicQueue], list[Q.Issue]]:
    """:func:`testflinger_magic.queues.load_file` plus the warnings of its queues, as
    :class:`~testflinger_magic.queues.Issue` (file, line, dotted field, message). Raises
    :class:`~testflinger_magic.queues.DefinitionError` as ``load_file`` does; ``webhook_allow``
    as for :func:`testflinger_magic.queues.load_text`. This is the local check of the reader's
    own file (``validate``, and ``apply`` before it sends): ``show_urls`` (default True) names a
    bad ``policy.notify`` URL as written; the server's answers keep it redacted."""
    path = Path(path)
    queues, lines = Q._load(read_text(path), str(path), webhook_allow, show_urls)
    warnings = []
    for q in queues:
        for rel, message in queue_warnings(q):
            full = (Q.TOP_KEY, q.name, *rel)
            warnings.append(Q.Issue(str(path), Q._line_for(lines, full), Q._dotted(full),
                                    message))
    return queues, warnings
