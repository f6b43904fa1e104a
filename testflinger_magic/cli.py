"""``testflinger-magic``: the operator command line.

``validate`` works offline; the other operator commands call the server's ``/v1/magic`` REST API
(docs/architecture.md, "Operator API"). Credentials follow testflinger-cli's conventions
(TESTFLINGER.md §4): ``--server`` then ``TESTFLINGER_SERVER``; ``--client-id``/``--secret-key``
then ``TESTFLINGER_CLIENT_ID``/``TESTFLINGER_SECRET_KEY``, exchanged for a JWT at
``POST /v1/oauth2/token`` (HTTP Basic) and sent as ``Authorization: Bearer``. Without credentials
requests go unauthenticated (Testflinger then treats the caller as an anonymous contributor,
enough for reads).

Parts: :mod:`.cli_api` (HTTP client), :mod:`.cli_ops` (commands calling the operator API),
:mod:`.cli_local` (commands run here: validate, agent-host, lab, demo, simulate, trace),
:mod:`.cli_parser` (the argparse tree), :mod:`.cli_types` (argument types),
:mod:`.cli_output` (tables), :mod:`.cli_hosts`
(agent-hosts); this module resolves the connection and runs a command (``main``).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

# The command line is split along its seams; every name stays importable from here.
from testflinger_magic import __version__  # noqa: F401
from testflinger_magic.cli_api import (  # noqa: F401
    DEFAULT_SERVER,
    TIMEOUT,
    ApiClient,
    CliError,
    _emit,
    _error_text,
    _plugin_answer,
)
from testflinger_magic.cli_local import (  # noqa: F401
    _validate_json,
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
from testflinger_magic.cli_ops import (  # noqa: F401
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
from testflinger_magic.cli_parser import (  # noqa: F401
    DEMO_DEFAULTS,
    GLOBAL_HELP,
    LAB_DEFAULTS,
    NO_JSON,
    build_parser,
    nonempty,
    positive_float,
    positive_int,
    writable_dir,
)


def server_url(text: str) -> str:
    """``--server``/``TESTFLINGER_SERVER`` checked: an http:// or https:// URL with a host,
    as testflinger-cli requires. Raises :class:`CliError` naming the value otherwise."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"--server {text!r}: the Testflinger server URL must start with http:// "
                       f"or https:// (like testflinger-cli), e.g. http://{text.strip() or 'HOST'}"
                       if "://" not in text else
                       f"--server {text!r}: the Testflinger server URL must be http:// or "
                       "https:// with a host")
    return text.strip()


def _resolve_connection(args) -> None:
    """The option (after or before the command), else the environment, else the default."""
    env = {"server": "TESTFLINGER_SERVER", "client_id": "TESTFLINGER_CLIENT_ID",
           "secret_key": "TESTFLINGER_SECRET_KEY"}
    for key, var in env.items():
        value = getattr(args, key, None) or os.environ.get(var)
        if key == "server":
            value = value or DEFAULT_SERVER
        setattr(args, key, value)
    args.json = bool(getattr(args, "json", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 error, 2 usage, 130 Ctrl-C).

    A reader that stops early (``status | head``) closes the pipe: like other Unix tools the
    rest of the output is dropped quietly and the status is 0.
    """
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    _resolve_connection(args)
    cmd = getattr(args, "cmd", None)
    if args.json and cmd in NO_JSON:
        parser.error(f"--json: {cmd} {NO_JSON[cmd]}; it has no JSON output")
    try:
        if args.needs_api:
            args.server = server_url(args.server)
            client = ApiClient(args.server, args.client_id, args.secret_key)
            code = args.func(args, client)
        else:
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except CliError as exc:
        print(f"testflinger-magic: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except KeyboardInterrupt:
        return 130


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--grace -5m`` as ``--grace=-5m``: argparse reads a value starting with ``-`` (that is
    not a plain number) as an option and says only "expected one argument"; joined, the value
    reaches the duration check, which says what is wrong with it."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        if items[i] == "--grace" and i + 1 < len(items) and items[i + 1][:2].lstrip("-")[:1] \
                .isdigit() and items[i + 1].startswith("-"):
            out.append(f"--grace={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests capture stdout)
        pass


if __name__ == "__main__":
    sys.exit(main())
