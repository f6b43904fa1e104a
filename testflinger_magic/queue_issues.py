"""Problems in an operator's YAML file as :class:`Issue` (file, line, dotted field, message) and
:class:`DefinitionError`, and the machinery that finds them: reading the file, parsing it with
line numbers (:mod:`testflinger_magic.yamlfile`) and turning pydantic's validation errors into
issues at the line of the offending key.

Used by queues.py (magic queue definitions, which re-exports :class:`Issue`,
:class:`DefinitionError` and :data:`FILE_FIELD` as ``queues.<name>``) and by lab/trace.py
(simulation traces and labs). This module imports nothing of queues.py.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from testflinger_magic import yamlfile
from testflinger_magic.queue_bounds import LIMIT_NOTES, MIN_NOTES

__all__ = [
    "FILE_FIELD",
    "Issue",
    "DefinitionError",
    "MAX_YAML_DEPTH",
    "parse_yaml",
    "pydantic_issues",
    "suggest_field",
    "key_path",
    "read_text",
]

# ---------------------------------------------------------------------------------------------
# Errors

#: ``Issue.field`` of a problem with a whole file (missing, unreadable): no line, no key.
FILE_FIELD = "(file)"


@dataclass(frozen=True)
class Issue:
    """One problem in a definition file: ``file``, 1-based ``line`` (0 if unknown), dotted
    ``field`` (``magic_queues.<queue>.policy.max_devices``) and a human ``message``."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        """``file:line: field: message``; without a line (0) ``file: field: message``, and a
        problem with the whole file (field ``(file)``: missing, unreadable) ``file: message``."""
        if self.line > 0:
            return f"{self.file}:{self.line}: {self.field}: {self.message}"
        if self.field == FILE_FIELD:
            return f"{self.file}: {self.message}"
        return f"{self.file}: {self.field}: {self.message}"

    def to_dict(self) -> dict:
        """JSON shape used by the operator API's 422 answer."""
        return {"file": self.file, "line": self.line, "field": self.field,
                "message": self.message}


class DefinitionError(Exception):
    """Raised for an invalid definition file; ``.issues`` lists every problem found."""

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


# ---------------------------------------------------------------------------------------------
# YAML with line numbers

#: Deepest nesting of YAML collections accepted (a definition needs 5; yamlfile.MAX_DEPTH).
MAX_YAML_DEPTH = yamlfile.MAX_DEPTH


def parse_yaml(text: str, filename: str) -> tuple[Any, dict]:
    """:func:`yamlfile.parse` with its problems as a :class:`DefinitionError` (file, line,
    dotted field or ``(yaml)``): ``(data, {path tuple: line})``."""
    try:
        return yamlfile.parse(text, hint="write the values out in each queue")
    except yamlfile.YamlProblem as exc:
        raise DefinitionError([Issue(filename, exc.line, exc.field or "(yaml)",
                                     exc.message)]) from None


#: pydantic v2 error types (``ValidationError.errors()[i]["type"]``) of a value of the wrong
#: kind, and what to write instead.
TYPE_HINTS = {
    "int_type": "write a whole number, e.g. 2", "int_parsing": "write a whole number, e.g. 2",
    "int_from_float": "write a whole number, e.g. 2",
    "float_type": "write a number, e.g. 0.5", "float_parsing": "write a number, e.g. 0.5",
    "bool_type": "write true or false", "bool_parsing": "write true or false",
    "string_type": "write text; quote it if YAML reads it as a number or a boolean "
                   "(e.g. \"1.0\", \"on\")",
    "list_type": "write a list, e.g. [a, b]",
    "dict_type": "write a mapping of keys to values (key: value)",
    "model_type": "write a mapping of keys to values (key: value)",
}


def pydantic_issues(exc: ValidationError, base: tuple, filename: str, lines: dict,
                    model: type[BaseModel]) -> list[Issue]:
    """``exc``'s errors as issues of ``filename``: each at the line (``lines``, from
    :func:`parse_yaml`) and dotted field of ``base`` + the error's loc, ``model`` being what
    was validated at ``base`` (it names the known fields of a misspelt key). A bound names what
    it means (queue_bounds.LIMIT_NOTES/MIN_NOTES); a webhook URL (``notify``) is never echoed."""
    issues = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path = base + loc
        kind = err["type"]
        if kind == "missing":
            msg = "required field is missing"
        elif kind == "extra_forbidden":
            msg = "unknown field" + suggest_field(model, loc)
        elif kind == "less_than_equal":
            note = LIMIT_NOTES.get(str(loc[-1]), "")
            msg = f"must be at most {err['ctx']['le']}{note}, got {err['input']!r}"
        elif kind == "greater_than_equal" and str(loc[-1]) in MIN_NOTES:
            msg = (f"must be at least {err['ctx']['ge']}{MIN_NOTES[str(loc[-1])]}, "
                   f"got {err['input']!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            # Never echo a webhook URL: it may hold the hook's token.
            if "input" in err and kind not in ("value_error",) and "notify" not in loc:
                msg += f" (got {err['input']!r})"
            if kind in TYPE_HINTS:  # what to write instead (TRIAL9: said only what was wrong)
                msg += f": {TYPE_HINTS[kind]}"
                if isinstance(err.get("input"), bool):
                    msg += " (YAML reads yes, no, on, off, true and false as booleans)"
        issues.append(Issue(filename, yamlfile.line_for(lines, path), yamlfile.dotted(path),
                            msg))
    return issues


def suggest_field(model: type[BaseModel], loc: tuple) -> str:
    """' (did you mean ...?)' for a misspelt key, found by walking the model along ``loc``."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None or not isinstance(field.annotation, type):
            return ""
        cls = field.annotation
    known = list(getattr(cls, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known fields: {', '.join(known)}"


def key_path(loc) -> tuple:
    """An error loc cut at its first list index: the mapping key that holds the bad value."""
    out = []
    for part in loc:
        if not isinstance(part, str):
            break
        out.append(part)
    return tuple(out)


def read_text(path: Path, limit: int | None = None) -> str:
    """The file's text; DefinitionError naming the file (no line) when it is missing, a
    directory, not a regular file, larger than ``limit`` bytes (default
    fileutil.MAX_INPUT_FILE), unreadable or not UTF-8."""
    from testflinger_magic.fileutil import (  # noqa: PLC0415
        MAX_INPUT_FILE, InputFileError, read_input_text)

    try:
        return read_input_text(path, MAX_INPUT_FILE if limit is None else limit)
    except InputFileError as exc:
        raise DefinitionError([Issue(str(path), 0, FILE_FIELD, str(exc))]) from exc
    except FileNotFoundError as exc:
        why = "no such file (missing)"
        raise DefinitionError([Issue(str(path), 0, FILE_FIELD, why)]) from exc
    except IsADirectoryError as exc:
        why = "is a directory, not a definition file"
        raise DefinitionError([Issue(str(path), 0, FILE_FIELD, why)]) from exc
    except OSError as exc:
        why = f"cannot read: {exc.strerror or exc}"
        raise DefinitionError([Issue(str(path), 0, FILE_FIELD, why)]) from exc
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise DefinitionError([Issue(str(path), 0, FILE_FIELD, why)]) from exc
