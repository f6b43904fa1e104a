"""The commands that run here without the operator API (split from cli.py): validate,
agent-host (run, check, sweep), lab up, demo, simulate, trace export."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from testflinger_magic.cli_api import CliError
from testflinger_magic.durations import format_duration
from testflinger_magic.queues import DefinitionError, load_file, load_files


def cmd_validate(args) -> int:
    """Validate each FILE offline; summary per queue on stdout, issues and warnings (valid but
    likely wrong, testflinger_magic.queue_warnings; exit status unchanged) on stderr. With
    ``--json``: one object ``{"ok", "files": [{"file", "queues": {name: definition},
    "issues": [{file, line, field, message}], "warnings": [same]}]}`` on stdout."""
    if args.json:
        return _validate_json(args.files)
    from testflinger_magic import queue_warnings  # noqa: PLC0415

    failed = False
    for path in args.files:
        try:
            queues, warnings = queue_warnings.load_file(path)
        except DefinitionError as exc:
            failed = True
            print(str(exc), file=sys.stderr)
            continue
        for warning in warnings:  # likely wrong, still valid: exit status unchanged
            print(f"warning: {warning}", file=sys.stderr)
        for q in queues:
            p = q.policy
            per = _vm_count_text(q)
            print(f"{path}: {q.name}: ok ({per}; vm {q.vm.vcpus} vCPU, {q.vm.memory_mib} MiB, "
                  f"{q.vm.disk_gib} GiB; max_devices {p.max_devices}, idle_timeout "
                  f"{format_duration(p.idle_timeout)})")
    if not failed and len(args.files) > 1:
        try:  # files meant to be used together: a queue defined twice would silently lose one
            load_files(args.files)
        except DefinitionError as exc:
            failed = True
            print(str(exc), file=sys.stderr)
    return 1 if failed else 0


def _validate_json(paths: list[str]) -> int:
    from testflinger_magic import queue_warnings  # noqa: PLC0415

    files = {str(p): {"file": str(p), "queues": {}, "issues": [], "warnings": []} for p in paths}
    for path in paths:
        try:
            queues, warnings = queue_warnings.load_file(path)
            files[str(path)]["queues"] = {q.name: q.to_yaml_dict() for q in queues}
            files[str(path)]["warnings"] = [w.to_dict() for w in warnings]
        except DefinitionError as exc:
            files[str(path)]["issues"] = [i.to_dict() for i in exc.issues]
    if len(paths) > 1 and not any(f["issues"] for f in files.values()):
        try:
            load_files(paths)
        except DefinitionError as exc:
            for issue in exc.issues:
                files.setdefault(issue.file, {"file": issue.file, "queues": {}, "issues": [],
                                              "warnings": []})
                files[issue.file]["issues"].append(issue.to_dict())
    ok = not any(f["issues"] for f in files.values())
    print(json.dumps({"ok": ok, "files": list(files.values())}, indent=2, sort_keys=True))
    return 0 if ok else 1


def cmd_agent_host(args) -> int:
    if not args.config:
        raise CliError("agent-host needs --config FILE (or the check subcommand)")
    from testflinger_magic.agent_host import daemon
    return int(daemon.main(args) or 0)


def cmd_agent_host_sweep(args) -> int:
    from testflinger_magic.agent_host import sweep

    args.config = args.sweep_config
    return int(sweep.main(args))


def cmd_agent_host_check(args) -> int:
    from testflinger_magic.agent_host import check

    args.config = args.check_config
    return int(check.main(args))


def cmd_agent_host_user_data(args) -> int:
    """``agent-host user-data --config FILE``: the user data a lend deploys a device of that
    config with (``vmhost_userdata.user_data_for``, the deploy step's own call), on stdout."""
    from testflinger_magic.agent_host.config import ConfigError
    from testflinger_magic.agent_host.config import load_file as load_config
    from testflinger_magic.agent_host.vmhost_userdata import user_data_for

    try:
        config = load_config(args.userdata_config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    sys.stdout.write(user_data_for(config))
    return 0


def cmd_lab_up(args) -> int:
    from testflinger_magic.lab import labup
    try:
        return int(labup.main_up(args) or 0)
    except labup.LabError as exc:  # a refused --workdir, a component that did not start
        raise CliError(f"lab up: {exc}") from None


def cmd_demo(args) -> int:
    from testflinger_magic.lab import demo
    return int(demo.main(args) or 0)


def cmd_simulate(args) -> int:
    """Replay TRACE in virtual time once per ``--policy`` set; a table (or JSON) of results."""
    from testflinger_magic.lab import simulate as sim

    if args.plot:  # before the replay, which may take minutes (the path is checked by argparse)
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError as exc:
            raise CliError(f"--plot needs matplotlib (pip install 'testflinger-magic[lab]'): "
                           f"{exc}") from exc
    try:
        definitions = load_file(args.queues)
        lab = sim.load_lab(args.lab) if args.lab else None
        trace = sim.load_trace(args.trace, lab=lab)
        results = sim.compare(trace, definitions, args.policy or [], args.baseline or [])
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (sim.SimulationError, OSError) as exc:
        raise CliError(str(exc)) from exc
    from testflinger_magic.lab import baselines

    versus = baselines.comparisons(results) if args.baseline else []
    for r in results:
        for warning in r.warnings:
            print(f"warning: {r.label}: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "queues": str(args.queues),
                          "jobs": len(trace.jobs), "comparisons": versus,
                          "results": [r.to_dict() for r in results]}, indent=2, sort_keys=True))
    else:
        print(f"{args.trace}: {len(trace.jobs)} jobs, "
              f"{sum(len(d.names()) for d in trace.lab.devices)} devices\n")
        print(sim.render_table(results))
        if versus:
            print("\n" + baselines.render_comparisons(versus))
    if args.plot:
        from testflinger_magic.lab import sim_plot

        try:
            sim_plot.plot(results, args.plot, title=f"{args.trace} ({len(trace.jobs)} jobs)")
        except ImportError as exc:
            raise CliError(f"--plot needs matplotlib (pip install 'testflinger-magic[lab]'): "
                           f"{exc}") from exc
        except OSError as exc:
            raise CliError(f"--plot {args.plot}: {exc}") from exc
    return 0


def _mongo_problem(uri: str, timeout: float, exc: Exception) -> str:
    """One line for a MongoDB failure of ``trace export``: the server (never the URI's
    password), what went wrong, without pymongo's topology dump."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    import pymongo.errors  # noqa: PLC0415

    try:
        where = urlsplit(uri).netloc.rpartition("@")[2] or uri
    except ValueError:
        where = "?"
    if isinstance(exc, pymongo.errors.ServerSelectionTimeoutError):
        why = str(exc).split(", Timeout:")[0].split(" (configured timeouts")[0]
        return (f"--mongo: no MongoDB server answered at {where} within {timeout:g}s "
                f"(--mongo-timeout): {why[:200]}")
    if isinstance(exc, (pymongo.errors.InvalidURI, pymongo.errors.ConfigurationError)):
        return f"--mongo: not a usable MongoDB URI: {str(exc)[:200]}"
    return f"--mongo {where}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def cmd_trace_export(args) -> int:
    """A simulate trace from a Testflinger database's ``jobs`` (lab/trace_export.py)."""
    from testflinger_magic import db as dbmod
    from testflinger_magic.lab import simulate as sim
    from testflinger_magic.lab import trace_export as tx

    import pymongo.errors  # noqa: PLC0415

    try:
        since = tx.parse_time(args.since, "--since")
        until = tx.parse_time(args.until, "--until") if args.until else time.time()
        lab = sim.load_lab(args.lab).model_dump(by_alias=True) if args.lab else None
        try:
            database = dbmod.connect(args.mongo, args.db, timeout=args.mongo_timeout)
        except ValueError as exc:  # pymongo's URI parser: a host it cannot read
            raise CliError(f"--mongo: not a usable MongoDB URI: {str(exc)[:200]}") from None
        trace = tx.export_trace(database, since, until, args.queue or None)
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (tx.ExportError, OSError) as exc:
        raise CliError(str(exc)) from exc
    except pymongo.errors.PyMongoError as exc:
        raise CliError(_mongo_problem(args.mongo, args.mongo_timeout, exc)) from None
    text = json.dumps(dict(trace, **({"lab": lab} if lab else {})), indent=1) \
        if args.out.endswith(".json") else tx.to_yaml(trace, lab)
    Path(args.out).write_text(text, encoding="utf-8")
    info = trace["exported"]
    if args.json:
        print(json.dumps(dict(info, out=args.out), sort_keys=True))
    else:
        print(f"{args.out}: {info['jobs']} jobs ({info['durations_guessed']} durations guessed)"
              + "".join(f", {n} {k}" for k, n in info["skipped"].items()))
    return 0


def _vm_count_text(q) -> str:
    """How ``validate`` words a queue's VMs per device: ``1 VM per 2 GPUs``, ``3 VMs (fewer on
    a device with under 6 GPUs: 2 per VM)``, ``2 VMs without a GPU (vm.gpus 0: CPU-only)``."""
    gpus = q.vm.gpus
    if q.vms_per_device == "gpus":
        return f"1 VM per {gpus} GPU{'s' if gpus != 1 else ''}"
    n = int(q.vms_per_device)
    text = f"{n} VM{'s' if n != 1 else ''}"
    if not gpus:
        return f"{text} without a GPU (vm.gpus 0: CPU-only)"
    need = n * gpus
    if n == 1 and gpus > 1:
        text += f" (none on a device with under {gpus} GPUs)"
    elif need > 1 and n > 1:
        text += f" (fewer on a device with under {need} GPUs: {gpus} per VM)"
    return text
