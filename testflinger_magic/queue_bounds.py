"""Bounds of a magic queue definition's numbers (queues.py validates against them), each with
where it comes from, and what a bound means in the message that refuses a value (queue_issues.py
appends it to "must be at most N" / "must be at least N").

This module imports nothing of queues.py, which re-exports every bound here as
``queues.<name>`` (``queues.MAX_VCPUS``, ``queues.LIMITS``).
"""

from __future__ import annotations

from testflinger_magic import vm_rules

__all__ = [
    "MAX_VCPUS", "MAX_MEMORY_MIB", "MAX_DISK_GIB", "MIN_MEMORY_MIB", "MIN_DISK_GIB", "MAX_GPUS",
    "MAX_VMS_PER_DEVICE", "MIN_MMIO64_MIB", "MAX_MMIO64_MIB", "MAX_DEVICES", "MAX_FAILURES",
    "MAX_PRIORITY", "MAX_TEXT", "LIMITS", "LIMIT_NOTES", "MIN_NOTES",
]

# Upper bounds. Without them a typo (``memory_mib: 9000000000000``) passes validation and is only
# found by libvirt on every lent device (each counted as a device failure), and a value beyond
# 2**63 cannot even be stored (BSON ints are 8 bytes). Each bound says where it comes from.

#: vCPUs per VM: Linux KVM's ``CONFIG_KVM_MAX_NR_VCPUS`` allows at most 4096 vCPUs per guest
#: (arch/x86/kvm/Kconfig); QEMU's q35 machine accepts no more either. The splitter also checks
#: each VM against the real host's CPU count.
MAX_VCPUS = 4096
#: Memory per VM, MiB: 16 TiB. Passthrough (VFIO) pins all guest RAM, so a VM can never have
#: more than its host has; 16 TiB is above any GPU server we lend (they carry 0.5-4 TiB) and far
#: below libvirt's ``unsigned long long`` KiB and QEMU's ``-m`` limits. The splitter checks the
#: real host memory (``virConnect.getInfo``).
MAX_MEMORY_MIB = 16 * 1024 * 1024
#: Disk per VM, GiB: 64 TiB (vm_rules.MAX_DISK_GIB says why); at least vm_rules.MIN_DISK_GIB.
MAX_DISK_GIB = vm_rules.MAX_DISK_GIB
#: Memory per VM, MiB, at least vm_rules.MIN_MEMORY_MIB (2 GiB: MAAS's ephemeral environment).
MIN_MEMORY_MIB = vm_rules.MIN_MEMORY_MIB
MIN_DISK_GIB = vm_rules.MIN_DISK_GIB
#: GPUs: a device registers at most 64 GPUs (server/api_hosts.py ``DeviceIn.gpus``), so no VM gets
#: more and no device feeds more than 64 VMs (``vms_per_device``, CPU-only VMs included).
MAX_GPUS = 64
MAX_VMS_PER_DEVICE = 64
#: OVMF's 64-bit PCI MMIO aperture, MiB: vm_rules.MIN_MMIO64_MIB/MAX_MMIO64_MIB say why (the
#: splitter and ``agent-host check`` apply the same bounds, vm_rules.mmio64_problem).
MIN_MMIO64_MIB = vm_rules.MIN_MMIO64_MIB
MAX_MMIO64_MIB = vm_rules.MAX_MMIO64_MIB
#: Devices per queue: a sanity ceiling (a lab bigger than this splits its devices over several
#: magic queues); ``max_starting``/``min_devices`` are bounded by ``max_devices`` as well.
MAX_DEVICES = 1000
#: ``failures_before_quarantine``: a ceiling that still quarantines a broken device eventually.
MAX_FAILURES = 100
#: ``priority``: Testflinger stores ``job_priority`` as a plain int compared with ``$gt``; we
#: keep it within a 32-bit int so it round-trips through BSON, JSON and every client.
MAX_PRIORITY = 2**31 - 1
#: Text fields (description, names, URLs): characters. Keeps a definition far below MongoDB's
#: 16 MiB document limit (apply checks the encoded size as well).
MAX_TEXT = 4096

#: What an upper bound means, by last field name, appended to "must be at most N".
LIMIT_NOTES = {
    "vcpus": " vCPUs (KVM's per-guest maximum)",
    "memory_mib": " MiB (16 TiB; a passthrough VM's memory is pinned in host RAM)",
    "disk_gib": " GiB (64 TiB, above any GPU server's local storage)",
    "gpus": " GPUs (a device registers at most 64)",
    "mmio64_mib": " MiB (OVMF's limit, 16 TiB)",
    "max_devices": " devices", "max_starting": " devices", "min_devices": " devices",
}

#: What a lower bound means, by last field name, appended to "must be at least N".
MIN_NOTES = {
    "memory_mib": " MiB (MAAS commissions and deploys a VM from a RAM-based ephemeral "
                  "environment)",
    "disk_gib": " GiB (room for the deployed image, a GPU driver and the job)",
}

#: The bounds above by dotted field, for documentation and tests.
LIMITS = {
    "vm.vcpus": MAX_VCPUS, "vm.memory_mib": MAX_MEMORY_MIB, "vm.disk_gib": MAX_DISK_GIB,
    "vm.gpus": MAX_GPUS, "vm.mmio64_mib": MAX_MMIO64_MIB, "vms_per_device": MAX_VMS_PER_DEVICE,
    "policy.max_devices": MAX_DEVICES, "policy.max_starting": MAX_DEVICES,
    "policy.min_devices": MAX_DEVICES, "policy.failures_before_quarantine": MAX_FAILURES,
    "policy.priority": MAX_PRIORITY,
}
