"""The VM-host user data keeps the host's GPU drivers off the GPUs it lends (TRIAL3 finding 8):
its content, and its boot-time binder run for real against a fake sysfs tree."""

import subprocess
import sys

import yaml

from testflinger_magic.agent_host import vmhost_userdata as U
from testflinger_magic.agent_host.steps import vm_host_user_data


def _pci(root, address, vendor, device, cls):
    d = root / "sys/bus/pci/devices" / address
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
    (d / "class").write_text(cls + "\n")


def _run(root, vendors=("0x10DE",)):
    script = root / "binder.py"
    script.write_text(U.vfio_script(vendors))
    out = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                         text=True, check=True)
    return out.stdout


def test_user_data_binds_gpus_to_vfio_and_masks_the_nvidia_services():
    data = yaml.safe_load(vm_host_user_data("ssh-ed25519 K d", ["ssh-rsa R r"],
                                            ("0x10de", "0x1002")))
    files = {f["path"]: f for f in data["write_files"]}
    script = files[U.VFIO_SCRIPT_PATH]
    assert script["permissions"] == "0755"
    assert script["content"] == U.vfio_script(("0x10de", "0x1002"))
    assert "VENDORS = ('0x1002', '0x10de')\n" in script["content"]
    cmds = data["runcmd"]
    run = cmds.index(["python3", U.VFIO_SCRIPT_PATH])
    # The binder's files must be in the initramfs and the GRUB config before the reboot.
    assert run < cmds.index("update-initramfs -u") and run < cmds.index("update-grub")
    assert ["systemctl", "mask", *U.NVIDIA_SERVICES] in cmds
    assert "nvidia-persistenced.service" in U.NVIDIA_SERVICES
    assert data["power_state"]["mode"] == "reboot"
    assert "intel_iommu=on" in files["/etc/default/grub.d/90-testflinger-magic.cfg"]["content"]


def test_binder_on_an_hgx_and_a_pcie_host_binds_each_gpu_slot_only(tmp_path):
    _pci(tmp_path, "0000:18:00.0", "0x10de", "0x2330", "0x030200")   # H100 SXM5
    _pci(tmp_path, "0000:2a:00.0", "0x10de", "0x2330", "0x030200")
    _pci(tmp_path, "0000:c1:00.0", "0x10de", "0x26b9", "0x030000")   # L40S
    _pci(tmp_path, "0000:c1:00.1", "0x10de", "0x22ba", "0x040300")   # its HD audio
    _pci(tmp_path, "0000:05:00.0", "0x10de", "0x22a3", "0x068000")   # NVSwitch: not a GPU
    _pci(tmp_path, "0000:03:00.0", "0x1a03", "0x2000", "0x030000")   # the BMC's VGA
    out = _run(tmp_path)
    assert "10de:22ba,10de:2330,10de:26b9" in out
    conf = (tmp_path / U.MODPROBE_CONF).read_text()
    assert "options vfio-pci ids=10de:22ba,10de:2330,10de:26b9\n" in conf
    for mod in ("nouveau", "nvidia", "nvidia_drm", "nvidia_modeset", "nvidia_uvm"):
        assert f"blacklist {mod}\n" in conf and f"softdep {mod} pre: vfio-pci\n" in conf
    assert "22a3" not in conf and "1a03" not in conf
    grub = (tmp_path / U.GRUB_VFIO_CFG).read_text()
    assert grub == ('GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT '
                    'vfio-pci.ids=10de:22ba,10de:2330,10de:26b9"\n')
    mods = tmp_path / "etc/initramfs-tools/modules"
    mods.write_text("# keep\n" + mods.read_text())
    first = (conf, grub, mods.read_text())
    _run(tmp_path)  # cloud-init may run runcmd again (a new instance id): same files
    assert ((tmp_path / U.MODPROBE_CONF).read_text(), (tmp_path / U.GRUB_VFIO_CFG).read_text(),
            mods.read_text()) == first
    assert mods.read_text().split("\n") == ["# keep", *U.VFIO_MODULES, ""]


def test_binder_on_a_host_without_gpus_of_the_vendors_binds_nothing(tmp_path):
    _pci(tmp_path, "0000:03:00.0", "0x1a03", "0x2000", "0x030000")
    _pci(tmp_path, "0000:0c:00.0", "0x15b3", "0x1021", "0x020000")
    stale = tmp_path / U.GRUB_VFIO_CFG
    stale.parent.mkdir(parents=True)
    stale.write_text("old\n")
    assert "vfio-pci ids: none" in _run(tmp_path)
    assert "vfio-pci ids=" not in (tmp_path / U.MODPROBE_CONF).read_text()
    assert not stale.exists()
