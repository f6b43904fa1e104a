"""The argparse tree of ``testflinger-magic`` (split from cli.py); its argument types are in
:mod:`.cli_types`."""

from __future__ import annotations

import argparse

from testflinger_magic import __version__
from testflinger_magic.cli_api import DEFAULT_SERVER
from testflinger_magic.cli_local import (
    cmd_agent_host,
    cmd_agent_host_check,
    cmd_agent_host_sweep,
    cmd_agent_host_user_data,
    cmd_demo,
    cmd_lab_up,
    cmd_simulate,
    cmd_trace_export,
    cmd_validate,
)
from testflinger_magic.cli_ops import (
    cmd_abandon,
    cmd_apply,
    cmd_drain,
    cmd_events,
    cmd_forget_nvswitches,
    cmd_leases,
    cmd_lend,
    cmd_plan,
    cmd_quarantine,
    cmd_queues,
    cmd_status,
    cmd_unquarantine,
)
from testflinger_magic.cli_types import (  # noqa: F401 (re-exported: cli, cli_hosts, tests)
    _refuse_empty_values,
    int_between,
    maas_version,
    mongo_uri,
    nonempty,
    output_file,
    policy_text,
    positive_float,
    positive_int,
    reason_text,
    writable_dir,
)

#: Defaults of ``lab up`` and ``demo`` as shown in their help; tests check they are the lab's
#: (lab.LabOptions, demo.DEFAULT_*), without importing the lab here (it is heavy).
LAB_DEFAULTS = {"devices": 2, "gpus": 8, "time_scale": 0.01, "phase_seconds": 1.0}
#: Upper bounds of ``lab up --devices/--gpus``. Each lab device is a simulated device agent
#: process under supervisord (~30 MB, polling the server every second) plus, when lent, one
#: VM agent process per GPU: 64 devices is ~2 GB of agents on a lab of 2 cores, past that the
#: lab's own polling starves it. GPUs: the lab host is an HGX board (lab/hosts.py MAX_GPUS).
LAB_LIMITS = {"devices": 64, "gpus": 8}
DEMO_DEFAULTS = {"copies": 4, "timeout": 240.0, "summary": "demo-summary.json"}

#: Commands that run until stopped and print logs, not a report: ``--json`` is refused.
NO_JSON = {"agent-host": "runs the agent-host daemon until stopped (its output is its log)",
           "lab up": "runs the lab until stopped (the banner is for people; the servers it "
                     "names answer JSON)"}

GLOBAL_HELP = """\
global options (accepted before or after the command):
  --json                every command that reports prints JSON on stdout (agent-host and
                        lab up, which run until stopped, refuse it)
  --server URL          Testflinger server URL, http:// or https:// (env TESTFLINGER_SERVER;
                        default {server}); commands that call the server
  --client-id ID        client id (env TESTFLINGER_CLIENT_ID)
  --secret-key KEY      secret key (env TESTFLINGER_SECRET_KEY)
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree; each command's parser sets ``func``, ``needs_api`` and ``cmd``.

    One rule for the global options: ``--json`` and the connection options (``--server``,
    ``--client-id``, ``--secret-key``) are accepted before the command or after it, like
    testflinger-cli's (``testflinger-magic --json status`` = ``testflinger-magic status
    --json``). The command's own value wins over the one before it. ``--json`` is offered by
    every command; the connection options by the commands that call the server.
    """
    parser = argparse.ArgumentParser(
        prog="testflinger-magic",
        description="Magic queues for Testflinger: define, apply and watch on-demand VM queues.",
        epilog=GLOBAL_HELP.format(server=DEFAULT_SERVER),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", metavar="URL",
                        help="Testflinger server URL, http:// or https:// (env "
                        f"TESTFLINGER_SERVER; default {DEFAULT_SERVER})")
    parser.add_argument("--client-id", metavar="ID", help="client id (env TESTFLINGER_CLIENT_ID)")
    parser.add_argument("--secret-key", metavar="KEY",
                        help="secret key (env TESTFLINGER_SECRET_KEY)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON on stdout (every command that reports)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # The same options after the command. SUPPRESS: not given there, the value before the
    # command (or the default) stays.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON on stdout")
    # agent-host and lab up refuse --json (NO_JSON): accepted to say so, but not listed.
    no_json = argparse.ArgumentParser(add_help=False)
    no_json.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
    api = argparse.ArgumentParser(add_help=False, parents=[common])
    api.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                     help="Testflinger server URL, http:// or https:// (env TESTFLINGER_SERVER; "
                     f"default {DEFAULT_SERVER})")
    api.add_argument("--client-id", metavar="ID", default=argparse.SUPPRESS,
                     help="client id (env TESTFLINGER_CLIENT_ID)")
    api.add_argument("--secret-key", metavar="KEY", default=argparse.SUPPRESS,
                     help="secret key (env TESTFLINGER_SECRET_KEY)")

    def add(name, func, help_, needs_api=True, description=None, parent=None, **kw):
        p = sub.add_parser(name, help=help_, description=description or help_,
                           parents=[parent or (api if needs_api else common)], **kw)
        p.set_defaults(func=func, needs_api=needs_api, cmd=name)
        return p

    p = add("validate", cmd_validate, "check definition files offline", needs_api=False)
    p.add_argument("files", nargs="+", metavar="FILE", help="definition files (YAML)")

    p = add("apply", cmd_apply, "validate a definition file and store it on the server")
    p.add_argument("file", metavar="FILE", help="definition file (YAML)")
    p.add_argument("--source", help="name recorded with the definitions (default: FILE)")
    p.add_argument("--force", action="store_true", help="remove queues missing from FILE even "
                   "if jobs wait on them, cancelling those jobs (without it the server refuses)")
    p.add_argument("--unsuspend", action="store_true", help="lift the suspension of queues "
                   "whose definition is unchanged (once the cause was fixed elsewhere, e.g. the "
                   "agent template installed); a changed definition always lifts it")

    add("queues", cmd_queues, "the magic queue definitions applied on the server",
        description="The magic queue definitions the server holds now, written as a "
        "definitions file (policy.notify URLs are redacted by the server).")
    add("status", cmd_status, "queues (and why their jobs wait), leases and devices")
    add("plan", cmd_plan, "what the reconciler would do now, with reasons (dry run)")

    p = add("drain", cmd_drain, "stop giving a lease new jobs, then give the device back")
    p.add_argument("lease_id", metavar="LEASE_ID", type=nonempty("LEASE_ID"),
                   help="the lease (testflinger-magic leases)")
    p.add_argument("--reason", default="operator drain", type=reason_text,
                   help="why, recorded with the lease and its events (default: %(default)s)")
    p.add_argument("--grace", default="15m", help="time running jobs get before they are "
                   "cancelled, e.g. 30s, 15m, 2h; 0 cancels them at once (default %(default)s)")
    # Every drain cancels the jobs still running when --grace ends (drain with grace, then
    # force); --force only keeps new demand from cancelling the drain.
    p.add_argument("--force", action="store_true", help="never cancel this drain for new "
                   "demand (every drain cancels the jobs still running when --grace ends)")

    p = add("abandon", cmd_abandon, "(admin) close as failed a lease in bring-up or restoring "
            "that its agent host will not finish (the host is gone or not to be trusted)",
            description="Close LEASE_ID as failed now, without its agent host: for a lease "
            "whose host died or should never have registered. Only a lease in bring-up or "
            "restoring (drain an active one first); refused while its agent host heartbeats "
            "unless --force. Its device stays fenced and is quarantined: check it in MAAS "
            "(release it, delete its VMs' MAAS machines), then unquarantine it.")
    p.add_argument("lease_id", metavar="LEASE_ID", type=nonempty("LEASE_ID"),
                   help="the lease (testflinger-magic leases)")
    p.add_argument("--reason", required=True, type=reason_text,
                   help="why, recorded with the lease, its events and the quarantine")
    p.add_argument("--force", action="store_true", help="abandon it although its agent host "
                   "heartbeats (a host that must not be trusted)")

    p = add("quarantine", cmd_quarantine, "never lend DEVICE until unquarantined")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"),
                   help="device agent name")
    p.add_argument("--reason", default="operator quarantine", type=reason_text,
                   help="why, shown by status (a quarantined device gets the new reason; "
                   "default: %(default)s)")

    p = add("unquarantine", cmd_unquarantine, "make DEVICE lendable again")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"),
                   help="device agent name")

    p = add("forget-nvswitches", cmd_forget_nvswitches, "forget the NVSwitches the splits "
            "found on DEVICE (it may be lent to queues of several GPUs per VM again)")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"),
                   help="device agent name")

    p = add("leases", cmd_leases, "list leases (open ones unless --all)")
    p.add_argument("--queue", type=nonempty("--queue"), help="only this magic queue")
    p.add_argument("--all", action="store_true", help="include returned and failed leases")

    p = add("events", cmd_events, "recent events")
    p.add_argument("--limit", type=positive_int, default=50, metavar="N",
                   help="most recent N events (default %(default)s)")

    p = add("lend", cmd_lend, "lend DEVICE to magic QUEUE by hand")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"), help="device agent name")
    p.add_argument("queue", metavar="QUEUE", type=nonempty("QUEUE"), help="magic queue")
    p.add_argument("--reason", default="operator lend", type=reason_text,
                   help="why, recorded with the lease (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="lend even a device the queue's devices selection excludes or does "
                   "not pick (never a quarantined one)")

    p = add("agent-host", cmd_agent_host, "run the agent-host daemon (or: agent-host check)",
            needs_api=False, parent=no_json)
    p.add_argument("--config", metavar="FILE", help="agent-host.yaml (required to run)")
    ah = p.add_subparsers(dest="agent_host_command", metavar="SUBCOMMAND")
    chk = ah.add_parser("check", parents=[common],
                        help="what a lend would do on a device and what would fail "
                        "(reads MAAS and libvirt, changes nothing; exit 0: a lend would succeed)",
                        description="Read-only pre-flight for an agent host: MAAS reachable and "
                        "the devices' machines known (--config); on a libvirt URI the GPUs a "
                        "split would lend with their functions, IOMMU group and NUMA node, "
                        "every refused device and why, the firmware/MMIO plan, bridge, pool "
                        "and readiness; with --config and --device, whether the device's gpus "
                        "is the number of GPUs that can be lent. Exit 0 when a lend would "
                        "succeed, 1 otherwise.")
    chk.add_argument("--config", dest="check_config", metavar="FILE", help="agent-host.yaml")
    chk.add_argument("--device", metavar="NAME", help="only this device of the config (and "
                     "compare its gpus with the GPUs --libvirt-uri can lend)")
    chk.add_argument("--libvirt-uri", metavar="URI",
                     help="the deployed host (qemu+ssh://ubuntu@HOST/system) or test:///FILE")
    chk.add_argument("--bridge", help="bridge the VMs join (default: the config's)")
    chk.add_argument("--gpus-per-vm", type=int, default=1, metavar="N",
                     help="GPUs per VM to plan for (default %(default)s)")
    chk.add_argument("--firmware", choices=["uefi", "bios"], default="uefi",
                     help="VM firmware to plan for (default %(default)s)")
    chk.add_argument("--mmio64-mib", type=positive_int, metavar="MIB",
                     help="OVMF 64-bit aperture (default: sized for H200s)")
    chk.add_argument("--vcpus", type=positive_int, metavar="N",
                     help="vCPUs per VM to plan NUMA pinning for (default 8, a queue's default)")
    chk.add_argument("--memory-mib", type=positive_int, metavar="MIB",
                     help="memory per VM to plan NUMA pinning for (default 32768)")
    chk.set_defaults(func=cmd_agent_host_check, needs_api=False, cmd="agent-host check")
    ud = ah.add_parser("user-data", parents=[no_json],
                       help="print the VM-host user data a lend deploys a device with",
                       description="Print the cloud-init user data (#cloud-config) the daemon "
                       "deploys a lent device with (its ssh_public_key, maas.rack_public_keys "
                       "and splitter.gpu_vendors): deploy a host with it by hand (MAAS: "
                       "deploy with this user data) to run 'agent-host check' against it.")
    ud.add_argument("--config", dest="userdata_config", metavar="FILE", required=True,
                    help="agent-host.yaml")
    ud.set_defaults(func=cmd_agent_host_user_data, needs_api=False, cmd="agent-host user-data")
    swp = ah.add_parser("sweep", parents=[common],
                        help="remove what carries our marks but no open lease owns (MAAS VM "
                        "machines, libvirt domains, VM agent programs and folders)",
                        description="The daemon's orphan sweep, once: lists the VM agent "
                        "programs and folders, libvirt domains and MAAS machines carrying "
                        "testflinger-magic's marks for this host's devices, asks the server for "
                        "the open leases, and removes what none owns once past sweep_grace "
                        "(docs/operator-guide.md, 'Orphan sweep'). Exit 1 when a removal failed "
                        "or the server could not be asked.")
    swp.add_argument("--config", dest="sweep_config", metavar="FILE", required=True,
                     help="agent-host.yaml")
    swp.add_argument("--dry-run", action="store_true",
                     help="show what would be removed; change nothing")
    swp.set_defaults(func=cmd_agent_host_sweep, needs_api=False, cmd="agent-host sweep")

    from testflinger_magic import cli_hosts  # noqa: PLC0415

    cli_hosts.add_parsers(sub, api)

    lab = sub.add_parser("lab", help="the embedded lab", description="The embedded lab: the "
                         "Testflinger-compatible job service with the plugin, the MAAS "
                         "simulator, libvirt test-driver hosts, simulated agents and the "
                         "agent-host daemon, on this machine.")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True, metavar="LAB_COMMAND")
    d = LAB_DEFAULTS
    p = lab_sub.add_parser("up", parents=[no_json],
                           help="start the embedded lab (servers, MAAS simulator, daemon)",
                           description="Start the embedded lab and keep it running until "
                           "Ctrl-C: a Testflinger-compatible server with the plugin and the "
                           "example magic queues applied (their policy shortened so a cycle "
                           "takes about a minute), the MAAS simulator, device agents and the "
                           "agent-host daemon. Prints the server URL and the credentials to "
                           "use with testflinger-cli and testflinger-magic.")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files, kept: a new or empty folder, or an earlier lab's (cleaned "
                   "first; any other folder is refused) (default: a new temporary dir, removed "
                   "when the lab stops)")
    lim = LAB_LIMITS
    p.add_argument("--devices", metavar="N", type=int_between(
                       1, lim["devices"], "each lab device is an agent process; more starve "
                       "the lab"),
                   help=f"bare-metal GPU devices, 1-{lim['devices']}: each is a simulated "
                   "agent process (~30 MB) and, when lent, one more per GPU "
                   f"(default {d['devices']})")
    p.add_argument("--gpus", metavar="N", type=int_between(
                       1, lim["gpus"], "the lab hosts are HGX boards"),
                   help=f"passthrough GPUs per device, 1-{lim['gpus']}: the lab hosts are HGX "
                   f"boards (default {d['gpus']})")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays, 0.01: a 600 s deploy takes "
                   f"6 s (default {d['time_scale']})")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase "
                   f"(default {d['phase_seconds']:g})")
    p.add_argument("--newer-testflinger", action="store_true",
                   help="the job service and simulated agents behave as Testflinger after "
                   "fe381ff: agent job_id set by the server (#1253), a restarted agent keeps "
                   "offline (#1291), restart state (#1304), server-side job events "
                   "(#1297-#1299) (default: the fe381ff generation)")
    p.add_argument("--maas-version", type=maas_version, metavar="X.Y.Z",
                   help="the version the MAAS simulator says it is; below 3.0 (e.g. 2.9.2) "
                   "it has no node devices API, so the daemon registers the devices without "
                   "an NVSwitch count (default: the simulator's, 3.x)")
    p.add_argument("--uncommissioned", action="store_true",
                   help="MAAS lists no node devices for the lab's machines, as for machines "
                   "its commissioning never recorded: registered without an NVSwitch count")
    p.set_defaults(func=cmd_lab_up, needs_api=False, cmd="lab up")

    d = DEMO_DEFAULTS
    p = add("demo", cmd_demo, "run the end-to-end demo in the embedded lab", needs_api=False,
            description="Run the whole magic-queue cycle in the embedded lab: submit the job "
            "files, lend, split, run, drain, restore, check the home queue is served again; "
            "print a summary (with --json: progress on stderr, the summary as JSON on stdout).")
    p.add_argument("--summary", metavar="PATH",
                   help=f"write the JSON summary here (default {d['summary']})")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays "
                   f"(default {LAB_DEFAULTS['time_scale']})")
    p.add_argument("--jobs-dir", metavar="DIR", help="job files to submit (default examples/jobs)")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files, kept: a new or empty folder, or an earlier lab's (cleaned first) "
                   "(default: a temporary dir, removed after success)")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase "
                   f"(default {LAB_DEFAULTS['phase_seconds']:g})")
    p.add_argument("--copies", type=positive_int, metavar="N",
                   help=f"submissions of each job file (default {d['copies']})")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help=f"give up after S seconds (default {d['timeout']:g})")

    p = add("simulate", cmd_simulate, "replay a job trace in virtual time to compare policies",
            needs_api=False)
    p.add_argument("trace", metavar="TRACE", help="trace file (.yaml, .json or .csv; "
                   "docs/simulate.md)")
    p.add_argument("--queues", required=True, metavar="FILE", help="magic queue definitions")
    p.add_argument("--policy", action="append", metavar="KEY=VALUE[,...]", type=policy_text,
                   help="policy overrides for one column, e.g. idle_timeout=30m,max_devices=3 "
                   "or one-gpu-vm:max_devices=1, checked like the definitions file (repeat "
                   "for more columns; 'as-defined' is a column of the definitions as they "
                   "are; default: that column alone)")
    p.add_argument("--lab", metavar="FILE", help="lab file (devices, step durations, tick) "
                   "replacing the trace's own (default: the trace's)")
    p.add_argument("--baseline", action="append", metavar="none|static:N[:QUEUE]",
                   help="a column without magic queues: 'none' (no lending) or 'static:N[:QUEUE]' "
                   "(N devices split for QUEUE for good); ends with 'vs static:N' lines "
                   "(repeatable)")
    p.add_argument("--plot", metavar="FILE.png", type=output_file(".png"),
                   help="also draw, per column, waiting jobs, devices lent and waits over time "
                   "(the folder must exist; checked before the replay)")

    tr = sub.add_parser("trace", help="job traces for simulate",
                        description="Job traces for simulate (docs/simulate.md).")
    tr_sub = tr.add_subparsers(dest="trace_command", required=True, metavar="TRACE_COMMAND")
    p = tr_sub.add_parser("export", parents=[common], help="build a trace from a Testflinger "
                          "database's jobs over a time range",
                          description="Build a simulate trace from the jobs created in "
                          "[--since, --until) in a Testflinger MongoDB (created/started times, "
                          "priority; durations from the jobs' log fragments).")
    p.add_argument("--mongo", required=True, metavar="URI", type=mongo_uri,
                   help="MongoDB URI of Testflinger's database "
                   "(mongodb://host:27017/testflinger_db; the embedded lab's database is in "
                   "its memory, not reachable by URI)")
    p.add_argument("--mongo-timeout", type=positive_float, default=5.0, metavar="S",
                   help="give up when no MongoDB server answers within S seconds "
                   "(default %(default)g)")
    p.add_argument("--db", default="testflinger_db", metavar="NAME",
                   help="database name when the URI names none (default testflinger_db)")
    p.add_argument("--since", required=True, metavar="TIME", help="ISO 8601, UTC unless a zone "
                   "is given (2024-05-06 or 2024-05-06T09:00)")
    p.add_argument("--until", metavar="TIME", help="ISO 8601 (default: now)")
    p.add_argument("--queue", action="append", metavar="Q", help="only this queue (repeatable)")
    p.add_argument("--lab", metavar="FILE", help="lab file to embed in the trace")
    p.add_argument("--out", required=True, metavar="FILE",
                   type=output_file(".yaml", ".yml", ".json"),
                   help="trace to write (.yaml or .json; its folder must exist)")
    p.set_defaults(func=cmd_trace_export, needs_api=False, cmd="trace export")

    _refuse_empty_values(parser)
    return parser
