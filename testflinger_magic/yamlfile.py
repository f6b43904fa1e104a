"""YAML with line numbers, for the files an operator writes (queue definitions, agent-host.yaml,
simulation traces and labs).

:func:`parse` composes the text into PyYAML nodes (which keep their line) and converts them by
hand into plain Python, recording the line of every value. Unlike ``yaml.safe_load`` it refuses
what would silently change the meaning of a file:

* a duplicated mapping key (PyYAML keeps the last one);
* anchors, aliases and merge keys (``&x``, ``*x``, ``<<``: a value shared between entries hides
  what each one really gets);
* collections nested deeper than :data:`MAX_DEPTH` (PyYAML composes recursively, so thousands of
  ``[`` would end in a ``RecursionError`` rather than a message);
* YAML 1.1's numbers other than plain decimal (``0x10``, ``0b101``, ``010``: octal 8, ``10_000``,
  ``1:30``: sexagesimal 90): PyYAML reads them as numbers nobody meant (``idle_timeout: 1:30`` is
  90 seconds). Write the decimal value, or quote the text.

Every problem is a :class:`YamlProblem` with the 1-based line and the dotted path of the value.
"""

from __future__ import annotations

from typing import Any

import re

import yaml

__all__ = ["MAX_DEPTH", "YamlProblem", "parse", "dotted", "line_for"]

#: Deepest nesting of YAML collections accepted. Our files need at most 5 or 6 levels
#: (``magic_queues.<q>.policy.notify.<i>``); 32 leaves room and stays far below Python's
#: recursion limit (PyYAML uses several frames per level).
MAX_DEPTH = 32
#: Most values a document with aliases may expand to: an alias repeats a whole subtree, so a few
#: nested ones ("billion laughs") would otherwise expand to billions of values.
MAX_ALIASED_VALUES = 100_000


#: The plain-decimal forms of a YAML int or float; any other text PyYAML's YAML 1.1 resolver reads as
#: a number (hex, octal, binary, ``_`` separators, base 60) is refused by :func:`parse`.
_DECIMAL = re.compile(r"[-+]?(?:0|[1-9][0-9]*)"
                      r"|[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
                      r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _number_problem(text: str) -> str | None:
    """Why the YAML 1.1 number ``text`` is refused (None: plain decimal)."""
    if _DECIMAL.fullmatch(text):
        return None
    low = text.lower().lstrip("+-")
    kind = ("hexadecimal" if low.startswith("0x") else "binary" if low.startswith("0b")
            else "base 60" if ":" in low else "with '_' separators" if "_" in low
            else "octal: a leading 0")
    return (f"{text!r} is a YAML 1.1 number ({kind}), read as a value you probably did not "
            "mean: write it in plain decimal digits (or quote it if it is text)")


class YamlProblem(Exception):
    """A file that is not acceptable YAML: ``line`` (1-based; 0 when unknown), ``path`` (a tuple
    of keys and indexes, ``()`` for the file as a whole) and a human ``message``."""

    def __init__(self, line: int, message: str, path: tuple = ()):
        super().__init__(message)
        self.line, self.message, self.path = line, message, path

    @property
    def field(self) -> str:
        """The dotted path, or ``""`` for the file as a whole."""
        return dotted(self.path)


class _StrictLoader(yaml.SafeLoader):
    """Composes nodes but refuses anchors and aliases and collections nested deeper than
    :data:`MAX_DEPTH`."""

    _depth = 0
    #: What to do instead of an anchor, appended to its message (set per call by :func:`parse`).
    hint = "write the values out"
    #: Accept anchors and aliases (set per call by :func:`parse`).
    aliases = False

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            raise YamlProblem(self.peek_event().start_mark.line + 1,
                              f"YAML nested deeper than {MAX_DEPTH} levels; this file needs "
                              "far fewer")
        self._depth += 1
        try:
            return self._compose_checked(parent, index)
        finally:
            self._depth -= 1

    def _compose_checked(self, parent, index):
        if self.aliases:
            return super().compose_node(parent, index)
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise YamlProblem(event.start_mark.line + 1,
                              f"YAML alias '*{event.anchor}' is not allowed: {self.hint}")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise YamlProblem(event.start_mark.line + 1,
                              f"YAML anchor '&{anchor}' is not allowed: {self.hint}")
        return super().compose_node(parent, index)


def _to_python(loader: yaml.SafeLoader, node: yaml.Node, path: tuple, lines: dict) -> Any:
    """Convert a composed node into plain Python, recording ``lines[path] = line`` for every
    value (the line of its key for mapping values). Rejects duplicate and merge keys."""
    lines.setdefault(path, node.start_mark.line + 1)
    if loader.aliases and len(lines) > MAX_ALIASED_VALUES:
        raise YamlProblem(node.start_mark.line + 1, f"YAML aliases expand to more than "
                          f"{MAX_ALIASED_VALUES} values", path)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"YAML merge key '<<' is not allowed: {loader.hint}", path)
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlProblem(key_node.start_mark.line + 1, "mapping keys must be scalars",
                                  path)
            key = loader.construct_object(key_node)
            if key in out:
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"duplicated key {key!r} (first on line "
                                  f"{lines[path + (key,)]})", path + (key,))
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _to_python(loader, value_node, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(loader, n, path + (i,), lines) for i, n in enumerate(node.value)]
    if node.tag in _NUMBER_TAGS and node.style is None:
        problem = _number_problem(node.value)
        if problem:
            raise YamlProblem(node.start_mark.line + 1, problem, path)
    return loader.construct_object(node)


#: (words of PyYAML's problem, what to check), first match wins: what an operator most likely
#: did, for the messages PyYAML's scanner and parser raise (yaml/scanner.py, yaml/parser.py).
_SYNTAX_HINTS = (
    ("expected <block end>", "check the indentation of this line against the keys beside "
     "it and the line above: keys of one mapping start in the same column, spaces only"),
    ("mapping values are not allowed here", "a value holding ': ' must be quoted, or "
     "this line is indented deeper than the key it belongs to"),
    ("expected ',' or '}'", "check the commas and braces of the { } mapping opened on or "
     "before this line"),
    ("expected ',' or ']'", "check the commas and brackets of the [ ] list opened on or "
     "before this line"),
    ("could not find expected ':'", "a key needs ': ' after it (or a quote is not closed)"),
    ("found unexpected end of stream", "a quote or bracket opened on or before this line "
     "is never closed"),
    ("cannot start any token", "indent with spaces, not tabs, and quote values that start "
     "with '@' or '`'"),
)


#: Longest implicit (plain or quoted, not ``? ``) key PyYAML takes: its scanner forgets a
#: possible simple key 1024 characters on (yaml/scanner.py ``stale_possible_simple_keys``;
#: YAML 1.1 spec, "implicit keys are restricted to ... 1024 characters").
MAX_IMPLICIT_KEY = 1024


def _long_key(line: str, column: int | None) -> int | None:
    """Length of the key ending at ``column`` (where PyYAML found its ':') on ``line`` when it is
    longer than :data:`MAX_IMPLICIT_KEY`, else None. Not when a ``: `` comes before it (since
    the line's start or the last ``{``, ``[``, ``,``): then it is a value holding ': '."""
    if column is None or not 0 < column <= len(line):
        return None
    key = re.split(r"[{\[,]", line[:column])[-1]
    if re.search(r":(\s|$)", key):
        return None
    key = key.strip()
    key = re.sub(r"^(?:[-?]\s+)+", "", key).strip("'\"")
    return len(key) if len(key) > MAX_IMPLICIT_KEY else None


def syntax_hint(problem: str, line: str = "", column: int | None = None) -> str | None:
    """What to check for PyYAML's syntax ``problem``, or None. ``line`` and ``column``: the
    problem line's text and PyYAML's column in it, to tell a key longer than PyYAML takes
    (TRIAL12 F6: it is refused with the words of a quoting or indentation slip)."""
    if ("mapping values are not allowed here" in problem or "but got ':'" in problem):
        length = _long_key(line, column)
        if length is not None:
            return (f"a key is at most {MAX_IMPLICIT_KEY} characters: PyYAML does not read a "
                    f"longer one as a key, and this one has {length}")
    return next((hint for words, hint in _SYNTAX_HINTS if words in problem), None)


def parse(text: str, *, hint: str = "write the values out", aliases: bool = False
          ) -> tuple[Any, dict]:
    """Parse one YAML document: ``(data, lines)`` where ``data`` is plain Python (None for an
    empty document) and ``lines`` maps every value's path tuple (``()`` for the document,
    ``("devices", 0, "gpus")``) to its 1-based line.

    ``hint`` ends the message refusing an anchor, alias or merge key (what to write instead).
    ``aliases``: accept anchors and aliases (``yaml.safe_dump`` writes them for a value shared
    in the dumped data); merge keys are refused all the same. Raises :class:`YamlProblem` for a
    YAML 1.1 number that is not plain decimal (``0x10``, ``010``, ``10_000``, ``1:30``), a syntax
    error (``"YAML syntax error: ..."``), control characters, a duplicated key, an
    anchor/alias/merge key, or nesting deeper than :data:`MAX_DEPTH`.
    """
    try:  # the reader refuses control characters as soon as the loader is made
        loader = _StrictLoader(text)
    except yaml.YAMLError as exc:
        raise YamlProblem(0, f"YAML error: {exc}") from None
    loader.hint, loader.aliases = hint, aliases
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            msg = " ".join(str(p) for p in (exc.context, exc.problem) if p)
            text_lines = text.splitlines()
            where = text_lines[mark.line] if mark and mark.line < len(text_lines) else ""
            hint = syntax_hint(str(exc.problem or ""), where, mark.column if mark else None)
            raise YamlProblem(mark.line + 1 if mark else 0,
                              f"YAML syntax error: {msg}" + (f" ({hint})" if hint else "")) from None
        except yaml.YAMLError as exc:
            raise YamlProblem(0, f"YAML error: {exc}") from None
        except RecursionError:  # a nesting the depth limit did not see (belt and braces)
            raise YamlProblem(0, "YAML nested too deeply") from None
        if node is None:
            return None, {}
        lines: dict = {}
        return _to_python(loader, node, (), lines), lines
    finally:
        loader.dispose()


def dotted(path: tuple) -> str:
    """``("devices", 0, "gpus")`` -> ``"devices.0.gpus"``."""
    return ".".join(str(p) for p in path)


def line_for(lines: dict, path: tuple) -> int:
    """Line of the deepest known prefix of ``path`` in a :func:`parse` line table (a missing
    field reports its parent's line); 0 when nothing is known."""
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return 0
