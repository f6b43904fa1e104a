"""NVSwitch devices and VMs of several GPUs (pure): which devices cannot serve a queue whose VMs
have more than one GPU, and the words that say so.

Two or more GPUs in one VM on a host with NVSwitches (an HGX board) talk over NVLink only once
NVIDIA Fabric Manager, in its shared NVSwitch virtualization model, has activated a partition
holding exactly that VM's GPUs (NVIDIA Fabric Manager User Guide, "Shared NVSwitch
Virtualization Model"). The daemon activates none, so its splitter refuses such a split
(``agent_host/pcidiscovery.multi_gpu_problem``, ``MultiGPUNeedsFabric``) unless the agent
host's ``splitter.nvswitch_multi_gpu`` says the operator's own tooling does.

That refusal is a property of the *device*. MAAS >= 3.0 knows it from commissioning (its node
devices list the NVSwitches): the daemon's registration carries that count per device
(``agent_host/maas_nodedevices.py``), so a board is kept out before its first lend. Otherwise
it is found once the device is deployed (the splitter reads the host's PCI devices over
libvirt). The daemon reports the NVSwitch count as a device fact
(``facts: {"nvswitches": N}``, with ``blame: hardware`` when the split was refused; with the
split's ``ok`` report otherwise) and the server keeps it on the ``magic_devices`` document
(:data:`NVSWITCHES`, :data:`FOUND`). The registration carries the agent host's opt-in
(:data:`OPT_IN`). From then on :func:`refuses` keeps the device out of every queue whose VMs have
more than one GPU: reconcile never lends it there (``MagicQueue.matches``,
``reconcile_eligibility``), the preflight does not count it, and ``plan``/``status`` say why
(:func:`blocked_text`) instead of suspending the queue.
"""

from __future__ import annotations

#: ``magic_devices`` field: the NVSwitches the daemon found on the device (int; absent or None:
#: not known yet, 0: none).
NVSWITCHES = "nvswitches"
#: ``magic_devices`` field: when and how :data:`NVSWITCHES` was learnt: ``{"at": epoch seconds,
#: "source": "split" | "maas", "lease_id", "queue", "refused": bool (the split of that lease
#: was refused for it)}``; ``source`` "maas": listed by MAAS' commissioning, carried by the
#: registration (lease_id and queue None, refused False); absent in documents written before
#: it: a split's.
FOUND = "nvswitches_found"
#: :data:`FOUND` ``source`` of a count MAAS' commissioning listed (server/devicefacts.py).
FROM_MAAS = "maas"
#: ``magic_devices`` field, from the registration: the agent host's
#: ``splitter.nvswitch_multi_gpu`` (the operator's tooling activates Fabric Manager
#: partitions, so VMs of several GPUs may be defined on its NVSwitch devices).
OPT_IN = "nvswitch_multi_gpu"
#: The largest NVSwitch count a report may carry (an HGX B200 board has 2; H100 4; with slack).
MAX_NVSWITCHES = 64


def _get(device, key, default=None):
    return device.get(key, default) if isinstance(device, dict) else getattr(device, key, default)


def refuses(vm_gpus: int, device) -> bool:
    """True when ``device`` (a ``magic_devices`` document or dict with :data:`NVSWITCHES` and
    :data:`OPT_IN`, or a ``reconcile.DeviceView``) cannot host VMs of ``vm_gpus`` GPUs each:
    more than one GPU per VM, NVSwitches known on the device, and its agent host not opted in.
    A device whose NVSwitches are not known yet (never split) is not refused."""
    return (int(vm_gpus or 0) > 1 and int(_get(device, NVSWITCHES) or 0) > 0
            and not _get(device, OPT_IN))


def device_note(device) -> str:
    """``"gpu-host-01 (4 NVSwitches, found by lease L)"`` for one refused device; ``"...,
    listed by MAAS commissioning)"`` for a count the registration carried from MAAS."""
    name = _get(device, "_id") or _get(device, "name")
    count = int(_get(device, NVSWITCHES) or 0)
    found = _get(device, FOUND)
    found = found if isinstance(found, dict) else {}
    if found.get("source") == FROM_MAAS:
        by = ", listed by MAAS commissioning"
    else:
        by = f", found by lease {found['lease_id']}" if found.get("lease_id") else ""
    return f"{name} ({count} NVSwitch{'' if count == 1 else 'es'}{by})"


#: What an operator can do about devices :func:`refuses` (said once, after the devices).
CHOICES = ("lend them one GPU per VM (a queue with vm.gpus 1), select devices without "
           "NVSwitches for this queue, or set splitter.nvswitch_multi_gpu: true in their agent "
           "host's agent-host.yaml (and restart its daemon) once your own tooling activates "
           "NVIDIA Fabric Manager partitions of exactly each VM's GPUs (docs/operator-guide.md, "
           "'NVSwitch systems')")


def blocked_text(vm_gpus: int, devices: list) -> str:
    """Why ``devices`` (those a queue's selection picks that :func:`refuses`) do not serve a
    queue of ``vm_gpus`` GPUs per VM, and the operator's choices: ``"2 GPUs per VM need NVIDIA
    Fabric Manager on NVSwitch hosts, which this system does not activate: gpu-host-01 (4
    NVSwitches, found by lease L) is not lent to it; lend them ..."``. Empty for no devices."""
    if not devices:
        return ""
    notes = ", ".join(device_note(d) for d in devices)
    verb = "is" if len(devices) == 1 else "are"
    return (f"{int(vm_gpus)} GPUs per VM need NVIDIA Fabric Manager partitions on NVSwitch "
            f"hosts, which nothing here activates: {notes} {verb} not lent to it; operator: "
            f"{CHOICES}")


def user_text(vm_gpus: int, count: int) -> str:
    """The same for a test engineer (the preflight's 404): what the queue lacks, no operator
    step. ``count``: the devices :func:`refuses`."""
    return (f"its VMs have {int(vm_gpus)} GPUs each and the {count} device(s) it selects that "
            "could hold them have NVSwitches, which need NVIDIA Fabric Manager partitions this "
            "lab does not activate; no machine can serve it until the lab's operators change "
            "that (testflinger-magic status tells them why)")
