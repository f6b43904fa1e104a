"""The daemon's production drivers (MAAS, splitter, VM agent processes) built from its config:
``default_drivers`` builds the ones a caller (a test, the lab) did not inject; ``folder_owner``
says whom VM agent folders belong to. Split out of daemon.py, which re-exports both."""

from __future__ import annotations

import functools
import os
import pwd

from testflinger_magic.agent_host import steps as steps_mod
from testflinger_magic.agent_host.config import AgentHostConfig


def folder_owner(program_user: str | None) -> str | None:
    """The user VM agent folders are chowned to: ``program_user`` when the daemon runs as root
    (the snap) and that user is not root, else None (nothing to chown, or no right to).

    The folders hold the agent's config and connector config with mode 0750/0600
    (agentfolders.render_agent_folder: they may carry credentials), and supervisord runs the VM
    agents as ``program_user`` (``ubuntu``, as the charm's template: TESTFLINGER.md §6.2): owned
    by root, the agent could not read its own ``testflinger-agent.conf``."""
    if not program_user or os.geteuid() != 0:
        return None
    try:
        return None if pwd.getpwnam(program_user).pw_uid == 0 else program_user
    except KeyError:
        return program_user  # render_agent_folder names the missing user


def default_drivers(config: AgentHostConfig, maas=None, splitter=None, agents=None):
    """Build the production drivers the caller did not inject (imports are lazy: libvirt and
    python-libmaas are only needed on an agent host)."""
    from testflinger_magic.agent_host import agents as agents_mod

    if maas is None:
        from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver

        maas = LibMaasDriver(config.maas.url, config.maas.api_key.get_secret_value())
    if splitter is None:
        if config.splitter.kind == "script":
            from testflinger_magic.agent_host.script_split import ScriptSplitter

            splitter = ScriptSplitter(config.splitter.command, timeout=config.splitter.timeout)
        else:
            from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter

            sc = config.splitter
            # bridge: the fallback for plans without one (steps.split names MAAS's bridge);
            # network only when the operator set one: never libvirt's NAT ``default``.
            splitter = LibvirtSplitter(test_pool_gib=sc.test_pool_gib,
                                       vendor_ids=tuple(sc.gpu_vendors), bridge=config.bridge,
                                       network=sc.network, pool_name=sc.pool_name,
                                       pool_path=sc.pool_path,
                                       nvswitch_multi_gpu=sc.nvswitch_multi_gpu)
    if agents is None:
        from testflinger_magic.agent_host.prewarm import install_launcher

        # The launcher is copied into state_dir at every start (prewarm.py says why there).
        launcher = (install_launcher(config.state_dir, config.supervisor.program_user)
                    if config.agent_prewarm else None)
        agents = agents_mod.AgentProcesses(config.supervisor.url, config.supervisor.conf_dir,
                                           config.agent_command,
                                           user=config.supervisor.program_user,
                                           port_range=tuple(config.supervisor.metrics_ports),
                                           launcher=launcher)
    render = agents_mod.render_agent_folder
    owner = folder_owner(config.supervisor.program_user)
    if owner:
        render = functools.partial(agents_mod.render_agent_folder, owner=owner)
    return steps_mod.Drivers(maas=maas, splitter=splitter, agents=agents,
                             render_agent_folder=render,
                             remove_agent_folder=agents_mod.remove_agent_folder)
