"""argparse types and checks of ``testflinger-magic`` (split from cli_parser.py): integers
and numbers in range, paths to write, a MongoDB URI, non-empty ids, reasons, ``--policy``
texts, and the rule that no option or argument takes an empty value."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def int_between(low: int, high: int, why: str = ""):
    """argparse type: an integer from ``low`` to ``high``; ``why`` says where ``high`` comes
    from in the message."""
    def check(text: str) -> int:
        value = positive_int(text) if low == 1 else int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} must be at most {high}"
                                             + (f" ({why})" if why else ""))
        return value
    check.__name__ = "integer"
    return check


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number greater than 0")
    return value


def writable_dir(text: str) -> str:
    """argparse type: a directory that exists or can be created, and is writable (it is
    created here: the lab would create it anyway)."""
    path = Path(text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: not a writable directory "
                                         f"({exc.strerror or exc})") from None
    return str(path)


def output_file(*suffixes: str):
    """argparse type: a file to write, checked before any work: its name ends with one of
    ``suffixes`` (lower case, with the dot) and its folder exists and is writable (it is not
    created: a typo in it should not make a tree)."""
    def check(text: str) -> str:
        path = Path(text).expanduser()
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: is a directory")
        if path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text}: the file name must end with "
                                             f"{' or '.join(suffixes)}")
        folder = path.parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: no such directory {str(folder)!r}")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{text}: not writable (permission denied)")
        return str(path)
    check.__name__ = "file"
    return check


def mongo_uri(text: str) -> str:
    """argparse type of ``trace export --mongo``: a ``mongodb://`` or ``mongodb+srv://`` URI
    (MongoDB's connection string format; pymongo parses the rest when connecting)."""
    if not text.strip().startswith(("mongodb://", "mongodb+srv://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a MongoDB URI: it starts with "
                                         "mongodb:// (e.g. mongodb://HOST:27017/testflinger_db)")
    return text.strip()


def maas_version(text: str) -> str:
    """argparse type of ``lab up --maas-version``: a MAAS version as ``GET version/`` gives it,
    2 or 3 dot-separated numbers (``2.9.2``, ``3.5.0``)."""
    import re  # noqa: PLC0415

    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a MAAS version: write X.Y or X.Y.Z, "
                                         "e.g. 2.9.2")
    return text.strip()


def nonempty(what: str):
    """argparse type: a non-blank string (an empty id would name no lease or device, and the
    server would answer for another route)."""
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text
    check.__name__ = what  # argparse names the type in some messages
    check.checks_blank = True  # _refuse_empty_values leaves it its own message
    return check


def reason_text(text: str) -> str:
    """argparse type: a ``--reason`` of 1 to :data:`events.MAX_REASON` characters (the server
    refuses a longer one: it is copied into the lease's history and the events)."""
    from testflinger_magic.events import MAX_REASON  # noqa: PLC0415

    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if len(text) > MAX_REASON:
        raise argparse.ArgumentTypeError(f"at most {MAX_REASON} characters (got {len(text)}): "
                                         "it is recorded with the lease and its events")
    return text


def policy_text(text: str) -> str:
    """argparse type of ``simulate --policy``: not blank (``''`` would be a second column of
    the definitions as they are under no name; ``as-defined`` is that column). The overrides
    themselves are checked by lab/sim_policy.parse_policy before the first replay."""
    if not any(part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} has no KEY=VALUE; for a column of the "
                                         "definitions as they are write --policy as-defined "
                                         "(without --policy that column is the only one)")
    return text


policy_text.checks_blank = True  # type: ignore[attr-defined]
reason_text.checks_blank = True  # type: ignore[attr-defined]


def _refuse_empty_values(parser: argparse.ArgumentParser, seen: set | None = None) -> None:
    """Every option or argument that takes a value refuses ``""`` (and blanks) at parsing, in
    ``parser`` and its subcommands: an empty ``--server`` would silently mean the default, an
    empty FILE the current directory (".: is a directory"), an empty ``--workdir`` the current
    directory. The action's own type (if any) then checks the value."""
    seen = set() if seen is None else seen
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                _refuse_empty_values(sub, seen)
            continue
        if id(action) in seen or action.nargs == 0 or action.dest in ("help", "version") \
                or getattr(action.type, "checks_blank", False) \
                or not isinstance(action, (argparse._StoreAction, argparse._AppendAction)):
            continue
        seen.add(id(action))
        action.type = _not_blank(action.type, None if action.option_strings
                                 else str(action.metavar or action.dest))


def _not_blank(inner, positional: str | None):
    """argparse type: ``inner`` (or the text itself) after refusing a blank value; the message
    names ``positional`` (an argument's metavar) or, for an option, says to leave it out."""
    def check(text: str):
        if isinstance(text, str) and not text.strip():
            raise argparse.ArgumentTypeError(
                f"{positional} must not be empty" if positional else
                "must not be empty (give a value, or leave the option out for its default)")
        return inner(text) if inner else text
    check.__name__ = getattr(inner, "__name__", "value")
    return check
