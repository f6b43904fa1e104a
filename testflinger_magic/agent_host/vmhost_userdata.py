"""The cloud-init user data that turns a freshly deployed device into a libvirt VM host (pure).

What it does, and why:

- installs KVM/libvirt and OVMF; turns the IOMMU on (``intel_iommu=on iommu=pt``; ``amd_iommu``
  is on by default); authorizes for ``qemu+ssh`` the daemon's key and the MAAS rack
  controllers' keys (MAAS powers the VMs from its rack with ``virsh``:
  provisioningserver/drivers/power/virsh.py); adds ``ubuntu`` to the libvirt and kvm groups;
  reboots once so the kernel options take effect;
- keeps the host's GPU drivers off the GPUs it lends: :data:`VFIO_SCRIPT` (run once, by
  ``runcmd``) binds every function of each GPU's slot (the GPU and its companions, e.g. the HD
  audio ``.1`` of a PCIe GPU: what discovery hands a VM with it, pcidiscovery) to ``vfio-pci``
  at boot by vendor:device id, both on the kernel command line (``vfio-pci.ids=``: Ubuntu
  builds vfio-pci into the kernel, ``CONFIG_VFIO_PCI=y``, where a modprobe.d ``options`` line
  would not apply) and in modprobe.d (``options vfio-pci ids=``, with ``softdep <driver> pre:
  vfio-pci`` so a modular vfio-pci loads first), and blacklists ``nouveau`` and the
  ``nvidia*`` modules; the vfio modules go into the initramfs (``update-initramfs -u``), ahead
  of a display driver it carries; ``nvidia-persistenced`` and ``nvidia-fabricmanager`` are
  masked (``systemctl mask`` also masks a unit that is not installed). This is the usual
  passthrough host set-up (Linux ``Documentation/driver-api/vfio.rst``, "VFIO Usage Example":
  the device must be bound to vfio-pci; the Proxmox/Ubuntu "PCIe passthrough" recipe:
  ``options vfio-pci ids=...``, ``blacklist nouveau``/``nvidia``, ``update-initramfs -u``;
  CloudRift's "Host Setup for QEMU KVM GPU Passthrough with VFIO on Linux", tested with H100
  and B200 on Ubuntu 22.04/24.04: no NVIDIA driver on a passthrough host). Without it, a GPU
  the host driver holds (``nvidia`` with ``nvidia-persistenced`` keeping every GPU open)
  cannot be detached by libvirt's managed hostdev when MAAS powers a VM on ("NVRM: ...
  non-zero usage count"), and the VM's enrolment fails, counted against the device.
  MAAS itself installs no NVIDIA driver: its ``enable_third_party_drivers`` (default on) only
  covers the drivers of ``etc/maas/drivers.yaml`` (HPVSA, HPDSA, Cisco snic; canonical/maas
  ``src/maasserver/third_party_drivers.py``, ``package-files/etc/maas/preseeds/
  curtin_userdata``), and curtin has no ubuntu-drivers step; but a custom image or an
  operator's curtin preseed may carry one, and Ubuntu loads ``nouveau`` for an NVIDIA display
  controller it supports. Every step is idempotent (files rewritten whole, the initramfs
  modules list appended only once) and harmless on a host with no GPU of ``gpu_vendors``
  (no ids: no ``vfio-pci.ids``; blacklisting drivers that are absent changes nothing).

The network is MAAS': the device is deployed with ``bridge_all``, so MAAS renders a bridge
(``br-<ifname>``) carrying the boot interface's address in the deployed netplan; nothing here
rewrites netplan.
"""

from __future__ import annotations

import textwrap

from testflinger_magic.agent_host.pcidiscovery import DEFAULT_GPU_VENDORS

#: Where the user data installs :data:`VFIO_SCRIPT`.
VFIO_SCRIPT_PATH = "/usr/local/sbin/testflinger-magic-vfio"
#: The modprobe.d file and the GRUB drop-in the script writes (relative to its root).
MODPROBE_CONF = "etc/modprobe.d/testflinger-magic-vfio.conf"
GRUB_VFIO_CFG = "etc/default/grub.d/91-testflinger-magic-vfio.cfg"
#: Host drivers kept off the GPUs: the open-source and the proprietary NVIDIA drivers (the
#: proprietary one is four modules: nvidia, nvidia_modeset, nvidia_drm, nvidia_uvm).
HOST_GPU_DRIVERS = ("nouveau", "nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm")
#: Services of the NVIDIA driver that hold the GPUs open (persistence mode) or drive the
#: NVSwitches (Fabric Manager); masked on a VM host.
NVIDIA_SERVICES = ("nvidia-persistenced.service", "nvidia-fabricmanager.service")
#: Modules the initramfs loads first (initramfs-tools ``/etc/initramfs-tools/modules``).
VFIO_MODULES = ("vfio", "vfio_iommu_type1", "vfio_pci")

#: The boot-time binder, a Python 3 program (Ubuntu server images carry python3). Argument:
#: the root to work under (default ``/``; tests give a directory with a fake ``sys/bus/pci``).
#: Reads ``sys/bus/pci/devices/*/{vendor,device,class}`` (Linux ABI
#: ``Documentation/ABI/testing/sysfs-bus-pci``); ``@VENDORS@``, ``@DRIVERS@`` and
#: ``@MODULES@`` are filled in by :func:`vfio_script`.
VFIO_SCRIPT = '''\
#!/usr/bin/python3
"""testflinger-magic: bind the GPUs this VM host lends to vfio-pci at boot (idempotent)."""
import glob
import os
import sys

VENDORS = @VENDORS@
DRIVERS = @DRIVERS@
MODULES = @MODULES@
root = sys.argv[1] if len(sys.argv) > 1 else "/"


def read(path):
    with open(path) as f:
        return f.read().strip().lower()


devices = {}
for d in glob.glob(os.path.join(root, "sys/bus/pci/devices/*")):
    try:
        devices[os.path.basename(d)] = (read(d + "/vendor"), read(d + "/device"),
                                        read(d + "/class"))
    except OSError:
        continue
# A GPU: a display controller (base class 0x03) of a GPU vendor; with it go the other
# functions of its slot (its HD audio), as discovery hands them to the VM.
slots = {a.rsplit(".", 1)[0] for a, (v, _, c) in devices.items()
         if v in VENDORS and c.startswith("0x03")}
ids = sorted({v[2:] + ":" + dv[2:] for a, (v, dv, _) in devices.items()
              if a.rsplit(".", 1)[0] in slots})
lines = ["# written by testflinger-magic's VM-host user data: the GPUs go to VMs (vfio-pci)"]
lines += ["blacklist " + m for m in DRIVERS]
lines += ["softdep " + m + " pre: vfio-pci" for m in DRIVERS]
if ids:
    lines.append("options vfio-pci ids=" + ",".join(ids))
conf = os.path.join(root, "@MODPROBE_CONF@")
os.makedirs(os.path.dirname(conf), exist_ok=True)
with open(conf, "w") as f:
    f.write("\\n".join(lines) + "\\n")
grub = os.path.join(root, "@GRUB_VFIO_CFG@")
if ids:
    os.makedirs(os.path.dirname(grub), exist_ok=True)
    with open(grub, "w") as f:
        f.write('GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT vfio-pci.ids='
                + ",".join(ids) + '"\\n')
elif os.path.exists(grub):
    os.remove(grub)
mods = os.path.join(root, "etc/initramfs-tools/modules")
os.makedirs(os.path.dirname(mods), exist_ok=True)
have = open(mods).read().split("\\n") if os.path.exists(mods) else []
with open(mods, "a") as f:
    for m in MODULES:
        if m not in have:
            f.write(m + "\\n")
print("vfio-pci ids: " + (",".join(ids) or "none"))
'''


def vfio_script(gpu_vendors=DEFAULT_GPU_VENDORS) -> str:
    """:data:`VFIO_SCRIPT` for ``gpu_vendors`` (PCI vendor ids like ``"0x10de"``, as
    ``splitter.gpu_vendors``)."""
    vendors = sorted({v.lower() for v in gpu_vendors})
    return (VFIO_SCRIPT.replace("@VENDORS@", repr(tuple(vendors)))
            .replace("@DRIVERS@", repr(HOST_GPU_DRIVERS))
            .replace("@MODULES@", repr(VFIO_MODULES))
            .replace("@MODPROBE_CONF@", MODPROBE_CONF)
            .replace("@GRUB_VFIO_CFG@", GRUB_VFIO_CFG))


def user_data_for(config) -> str:
    """The user data the daemon deploys a lent device of ``config`` (an ``AgentHostConfig``)
    with: :func:`vm_host_user_data` of its ``ssh_public_key``, ``maas.rack_public_keys`` and
    ``splitter.gpu_vendors``. The one call of the deploy step (agent_host/bringup.py
    ``deploy``) and of ``testflinger-magic agent-host user-data`` (for a host deployed by hand
    to run ``agent-host check`` against)."""
    return vm_host_user_data(config.ssh_public_key, config.maas.rack_public_keys,
                             config.splitter.gpu_vendors)


def vm_host_user_data(ssh_public_key: str | None, rack_public_keys=(),
                      gpu_vendors=DEFAULT_GPU_VENDORS) -> str:
    """cloud-init user data (``#cloud-config`` YAML text) for a lent device: see the module
    docstring. ``ssh_public_key``: the daemon's key (None: none); ``rack_public_keys``: the MAAS
    rack controllers' keys; ``gpu_vendors``: PCI vendor ids whose GPUs are bound to vfio-pci."""
    keys = [k for k in [ssh_public_key, *rack_public_keys] if k]
    key_lines = "".join(f"  - {k}\n" for k in keys)
    keys_block = f"ssh_authorized_keys:\n{key_lines}" if keys else ""
    script = textwrap.indent(vfio_script(gpu_vendors), " " * 6)
    return f"""#cloud-config
package_update: true
packages: [qemu-kvm, libvirt-daemon-system, libvirt-clients, ovmf]
{keys_block}write_files:
  - path: /etc/default/grub.d/90-testflinger-magic.cfg
    content: |
      GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT intel_iommu=on iommu=pt"
  - path: {VFIO_SCRIPT_PATH}
    permissions: '0755'
    content: |
{script}runcmd:
  - usermod -aG libvirt,kvm ubuntu
  - [python3, {VFIO_SCRIPT_PATH}]
  - [systemctl, mask, {', '.join(NVIDIA_SERVICES)}]
  - update-initramfs -u
  - update-grub
power_state:
  mode: reboot
  condition: true
"""
