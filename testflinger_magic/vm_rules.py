"""What a magic queue's VMs and VM hosts may be (pure; used by queues.py and queue_warnings.py).

Three decisions, each with its reason (documented in docs/operator-guide.md, "Queue definitions"):

* ``provision_type``: the device connector of the VM agents. A VM is enrolled in MAAS with power
  type virsh and left ``Ready`` (TESTFLINGER.md §5.7: "maas2 works unchanged against MAAS-enrolled
  VMs"), so the one connector that can drive it is ``maas2``, which deploys the job's image on it
  and releases it after (§5.4, §5.5). ``noprovision`` needs a machine that is already running an
  OS at ``device_ip`` (§5.6): an enrolled VM is not (a job would fail every SSH check on every
  VM); the other connectors drive specific hardware (Raspberry Pi/CM3, Dragonboard, MuxPi,
  OEM recovery scripts, netboot boards) or a control host (``control_host_*``), or several
  devices (``multi``), and ``fake_connector`` only exists for Testflinger's own tests.
* ``vm_host_series``: the series MAAS deploys the lent device with to be the VM host. Only an
  Ubuntu LTS that MAAS 3.x has images for and that is in support: ``focal`` (20.04; standard
  support ended 2025-05, so a warning), ``jammy`` (22.04), ``noble`` (24.04). Every other
  Ubuntu codename is refused naming why (end of life, or an interim release with 9 months of
  support, too short for a lab's VM hosts); a name that is no Ubuntu codename is refused with the
  closest one. A newer LTS needs adding to :data:`VM_HOST_SERIES`.
* ``vm.memory_mib`` / ``vm.disk_gib`` lower bounds: :data:`MIN_MEMORY_MIB`, :data:`MIN_DISK_GIB`.
* a GPU VM's firmware and OVMF aperture: :func:`mmio64_problem` (the bounds, an error, shared by
  the queue definition, the splitter's ``validate_plan`` and ``agent-host check``) and
  :func:`gpu_vm_warnings` (values that are valid but leave the GPUs unusable in the VM: an
  aperture below :data:`MIN_MMIO64_MIB_PER_GPU` per GPU, ``bios`` firmware for GPUs, more than
  :data:`USUAL_MAX_GPUS` GPUs; ``validate`` and ``check`` print them).
"""

from __future__ import annotations

import difflib
import re

#: The device connectors a VM agent may use (see the module docstring).
VM_PROVISION_TYPES = ("maas2",)
#: Why each other connector of Testflinger's ``DEVICE_CONNECTORS`` (TESTFLINGER.md §5.2) cannot
#: drive a magic queue's VM.
_NOT_FOR_VMS = {
    "noprovision": "it needs a machine already running an OS at device_ip, and an enrolled VM "
                   "is only Ready in MAAS until maas2 deploys it",
    "fake_connector": "it only exists for Testflinger's own tests: nothing would be deployed",
    "multi": "it combines several other agents' devices into one job, not a VM",
    "control_host_iot": "it drives hardware through a control host, not a MAAS VM",
    "control_host_kvm": "it drives a KVM-over-IP control host, not a libvirt VM",
}
_HARDWARE = ("cm3", "dell_oemscript", "dragonboard", "hp_oemscript", "lenovo_oemscript",
             "oem_autoinstall", "muxpi", "netboot", "oemrecovery", "oemscript")

#: Series a lent device may be deployed with as a VM host (see the module docstring).
VM_HOST_SERIES = ("focal", "jammy", "noble")
#: Of those, series past their standard support (a warning, not an error).
PAST_STANDARD_SUPPORT = {"focal": "20.04's standard support ended in May 2025 (ESM only)"}
#: The older Ubuntu LTS releases (end of life or ESM only, no longer VM hosts here).
_OLD_LTS = ("dapper", "hardy", "lucid", "precise", "trusty", "xenial", "bionic")
SERIES_RE = re.compile(r"^[a-z]+$")
#: Every Ubuntu release codename's first word, warty (4.10) to questing (25.10), as MAAS names
#: its series (``maas admin boot-resources read``: ``ubuntu/jammy``).
UBUNTU_SERIES = frozenset({
    "warty", "hoary", "breezy", "dapper", "edgy", "feisty", "gutsy", "hardy", "intrepid",
    "jaunty", "karmic", "lucid", "maverick", "natty", "oneiric", "precise", "quantal", "raring",
    "saucy", "trusty", "utopic", "vivid", "wily", "xenial", "yakkety", "zesty", "artful",
    "bionic", "cosmic", "disco", "eoan", "focal", "groovy", "hirsute", "impish", "jammy",
    "kinetic", "lunar", "mantic", "noble", "oracular", "plucky", "questing",
})

#: Memory per VM, MiB, at least 2 GiB: MAAS commissions and deploys a machine by booting its
#: ephemeral environment, which runs from RAM (the squashfs image is copied into memory), and
#: 2048 MiB is what MAAS itself gives a VM it composes by default (its API's ``memory``
#: default); below it commissioning of the VM fails and every lend counts a failure.
MIN_MEMORY_MIB = 2048
#: Disk per VM, GiB, at least 10: curtin writes the Ubuntu image (about 4 GiB installed with the
#: flat layout's 512 MiB ESP), and a GPU job installs a driver and toolkit (several GiB) before
#: its own data.
MIN_DISK_GIB = 10
#: Disk per VM, GiB, at most 64 TiB: above the local storage of any GPU server (a DGX H100
#: carries 8 x 3.84 TB NVMe, about 28 TiB); a larger value is a typo. The splitter still checks
#: the real pool's capacity on the device.
MAX_DISK_GIB = 64 * 1024


def provision_type_problem(value: str) -> str | None:
    """Why ``value`` cannot be a VM agent's device connector, or None for ``maas2``."""
    if value in VM_PROVISION_TYPES:
        return None
    if value in _NOT_FOR_VMS:
        why = _NOT_FOR_VMS[value]
    elif value in _HARDWARE:
        why = "it drives a specific kind of hardware board or OEM image, not a MAAS VM"
    else:
        close = difflib.get_close_matches(value, VM_PROVISION_TYPES + _HARDWARE
                                          + tuple(_NOT_FOR_VMS), n=1)
        why = "it is no Testflinger device connector" + (
            f" (did you mean {close[0]!r}?)" if close else "")
    return (f"{value!r} cannot drive a magic queue's VM: {why}; a VM agent uses "
            f"{' or '.join(VM_PROVISION_TYPES)} (the VMs are enrolled in MAAS, power type virsh)")


def series_problem(value: str) -> str | None:
    """Why ``value`` cannot be ``vm_host_series`` (an error), or None."""
    if not SERIES_RE.match(value):
        return f"{value!r} is not a series name (lower-case letters, e.g. jammy, noble)"
    if value in VM_HOST_SERIES:
        return None
    allowed = ", ".join(VM_HOST_SERIES)
    if value in UBUNTU_SERIES:
        kind = ("an older LTS, past its support" if value in _OLD_LTS
                else "an interim release (9 months of support), not an LTS")
        return (f"{value!r} is {kind}: a VM host is deployed with a supported LTS MAAS has "
                f"images for: {allowed}")
    close = difflib.get_close_matches(value, sorted(UBUNTU_SERIES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{value!r} is not an Ubuntu series name{hint}; a VM host is deployed with {allowed} "
            "(a newer LTS needs adding to vm_rules.VM_HOST_SERIES)")


def series_warning(value: str) -> str | None:
    """A warning for a valid ``vm_host_series`` past its standard support, or None."""
    why = PAST_STANDARD_SUPPORT.get(value)
    return None if why is None else (f"{value}: {why}; prefer {VM_HOST_SERIES[-1]} for new "
                                     "VM hosts")


#: OVMF's 64-bit PCI MMIO aperture (``vm.mmio64_mib``), MiB: edk2 accepts
#: ``opt/ovmf/X-PciMmio64Mb`` up to 0x1000000 MiB, 16 TiB
#: (OvmfPkg/Library/PlatformInitLib/MemDetect.c); below 1 GiB it is no use for a GPU (OVMF
#: rounds the aperture to 1 GiB).
MIN_MMIO64_MIB = 1024
MAX_MMIO64_MIB = 0x1000000
#: BAR1 of the smallest-BAR data-centre GPU a GPU lab lends, MiB: 64 GiB (A100 40GB; ``nvidia-smi
#: -q``, "BAR1 Memory Usage: Total 65536 MiB"). An H100 80GB has 128 GiB, an H200 256 GiB
#: (splitplan.H200_BAR1_MIB); a GPU maps its whole memory through BAR1, rounded up to a power of
#: two (PCI Express Base spec, "Base Address Registers").
SMALL_BAR1_MIB = 64 * 1024
#: An aperture below this per GPU of the VM warns: OVMF needs about 2 x BAR1 per GPU (each
#: GPU's root port window is aligned to its BAR1: ``splitplan.default_mmio64_mib``), so below
#: 2 x 64 GiB not even a 64 GiB-BAR1 GPU can be placed, and the GPU is unusable in the VM
#: (``nvidia-smi`` finds no device; the job fails, not the lend). An H100 needs 256 GiB per GPU,
#: an H200 512 GiB (the default when ``mmio64_mib`` is unset).
MIN_MMIO64_MIB_PER_GPU = 2 * SMALL_BAR1_MIB
#: GPUs of the largest usual GPU server: an HGX/DGX baseboard carries 8 (H100/H200/B200 systems
#: alike; the lab's devices have 8 too).
USUAL_MAX_GPUS = 8


def mmio64_problem(value) -> str | None:
    """Why ``value`` cannot be OVMF's 64-bit aperture in MiB (an error), or None; None is
    fine (sized for the GPUs)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not MIN_MMIO64_MIB <= value <= MAX_MMIO64_MIB:
        return (f"{value!r} is not a size in MiB from {MIN_MMIO64_MIB} to {MAX_MMIO64_MIB} "
                "(OVMF's limit)")
    return None


def gpu_vm_warnings(gpus: int, firmware: str, mmio64_mib: int | None) -> list[tuple[str, str]]:
    """``[(field, message)]`` for a VM of ``gpus`` GPUs with ``firmware`` (``uefi``/``bios``)
    and aperture ``mmio64_mib`` (MiB; None: the default, sized for H200s) whose values are
    valid but leave its GPUs unusable or are likely typos; ``field`` is ``gpus``, ``firmware``
    or ``mmio64_mib`` (the queue's ``vm.<field>``)."""
    out = []
    if gpus > USUAL_MAX_GPUS:
        out.append(("gpus", f"{gpus} GPUs per VM: no usual GPU server has more than "
                            f"{USUAL_MAX_GPUS} (HGX/DGX baseboards carry {USUAL_MAX_GPUS}), so no "
                            "device of such a lab can be split into a VM of that size"))
    if gpus > 0 and firmware == "bios":
        out.append(("firmware", "bios (SeaBIOS) for a VM with GPUs: SeaBIOS has no 64-bit PCI "
                                "window, so a GPU whose BAR1 is larger than the 32-bit window "
                                "(every data-centre GPU: A100 64 GiB, H100 128 GiB, H200 "
                                "256 GiB) cannot be mapped and is unusable in the VM; use uefi "
                                "(OVMF)"))
    floor = MIN_MMIO64_MIB_PER_GPU * gpus
    if (gpus > 0 and firmware == "uefi" and mmio64_mib is not None
            and mmio64_problem(mmio64_mib) is None and mmio64_mib < floor):
        out.append(("mmio64_mib", f"{mmio64_mib} MiB for {gpus} GPU(s) is below "
                                  f"{MIN_MMIO64_MIB_PER_GPU} MiB per GPU ({floor} MiB): OVMF "
                                  "needs about 2 x BAR1 per GPU, so not even a 64 GiB-BAR1 GPU "
                                  "(A100 40GB) can be mapped and the GPU is unusable in the VM "
                                  f"(an H100 needs {4 * SMALL_BAR1_MIB} MiB per GPU, an H200 "
                                  f"{8 * SMALL_BAR1_MIB}); leave mmio64_mib unset to size it for "
                                  "H200s"))
    return out
