"""The splitter's VM disk storage: the ``dir`` storage pool and the VMs' volumes in it.

Disks: VM volumes live in a ``dir`` storage pool (``pool_name`` at ``pool_path``), created,
built, started and marked autostart when missing: a fresh Ubuntu ``libvirt-daemon-system`` has no
storage pool at all.

Effect code over an open libvirt connection (``libvirt_session``); errors are ``SplitError``
naming the pool, volume or domain. ``libvirt_split.LibvirtSplitter`` calls these with its
``pool_name`` and (normalised) ``pool_path``.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape

from testflinger_magic.agent_host.libvirt_session import lv
from testflinger_magic.agent_host.splitplan import SplitError, VMPlan


def find_pool(conn, pool_name: str, pool_path: str):
    """The pool whose target is ``pool_path`` (whatever its name), else the one named
    ``pool_name``, else None. SplitError when the pool named ``pool_name`` is elsewhere."""
    named = None
    for pool in lv("listing storage pools", conn.listAllStoragePools, 0):
        target = ET.fromstring(lv(f"pool {pool.name()}: XMLDesc", pool.XMLDesc, 0)
                               ).findtext("target/path")
        if target and os.path.normpath(target) == pool_path:
            return pool
        if pool.name() == pool_name:
            named = pool
    if named is not None:
        target = ET.fromstring(named.XMLDesc(0)).findtext("target/path")
        raise SplitError(f"storage pool {pool_name} exists at {target}, not at "
                         f"{pool_path} (splitter.pool_path); fix one of them")
    return None


def ensure_pool(conn, pool_name: str, pool_path: str) -> bool:
    """Define, build, start and autostart the ``dir`` pool at ``pool_path`` as needed
    (libvirt ``virStoragePoolDefineXML``/``Build``/``Create``/``SetAutostart``; a fresh
    Ubuntu libvirt has no pool). Returns True when it changed anything."""
    changed = False
    pool = find_pool(conn, pool_name, pool_path)
    if pool is None:
        xml = (f"<pool type='dir'><name>{escape(pool_name)}</name><target>"
               f"<path>{escape(pool_path)}</path></target></pool>")
        pool = lv(f"storage pool {pool_name}: define", conn.storagePoolDefineXML, xml, 0)
        # build makes the directory (dir backend: mkdir with the pool's permissions)
        lv(f"storage pool {pool_name}: build", pool.build, 0)
        changed = True
    if not pool.isActive():
        lv(f"storage pool {pool.name()}: start", pool.create, 0)
        changed = True
    if not pool.autostart():
        lv(f"storage pool {pool.name()}: autostart", pool.setAutostart, 1)
        changed = True
    return changed


def ensure_volume(conn, vm: VMPlan) -> bool:
    """Create the VM's qcow2 volume in the pool holding ``vm.disk_path`` (``split`` made sure
    it exists: ``ensure_pool``). Returns True when it created one."""
    pool = pool_for(conn, vm.disk_path)
    if pool is None:
        raise SplitError(f"VM {vm.name}: no active storage pool holds {vm.disk_path}")
    name = os.path.basename(vm.disk_path)
    # listVolumes, not a lookup that fails: libvirt prints every error on stderr.
    if name in lv(f"pool {pool.name()}: list volumes", pool.listVolumes):
        return False
    # allocation 0: a sparse qcow2 (also what lets the test driver's fixed 100 GiB pool
    # hold many VMs' disks)
    xml = (f"<volume><name>{escape(name)}</name><capacity unit='GiB'>{vm.disk_gib}</capacity>"
           "<allocation>0</allocation><target><format type='qcow2'/></target></volume>")
    lv(f"domain {vm.name}: create volume {vm.disk_path}", pool.createXML, xml, 0)
    return True


def pool_for(conn, disk_path: str):
    """The active pool whose target directory holds ``disk_path``, else None."""
    directory = os.path.dirname(disk_path)
    for pool in lv("listing storage pools", conn.listAllStoragePools, 0):
        target = ET.fromstring(pool.XMLDesc(0)).findtext("target/path")
        if target and os.path.normpath(target) == os.path.normpath(directory) and pool.isActive():
            return pool
    return None


def volume_by_path(conn, path: str):
    """The volume at ``path`` in an active pool, else None."""
    pool = pool_for(conn, path)
    if pool is None:
        return None
    name = os.path.basename(path)
    if name not in lv(f"pool {pool.name()}: list volumes", pool.listVolumes):
        return None
    return lv(f"volume {path}", pool.storageVolLookupByName, name)
