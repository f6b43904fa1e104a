"""VM agent config folders: render a template folder (``agent_configs/<name>/*.j2``) with jinja2,
validate the result against testflinger-agent's config schema and the maas2 connector's keys, and
remove a rendered folder (only one this module made). Files only, no supervisord (agents.py).

Facts honoured (canonical/testflinger, see ../shared/TESTFLINGER.md §3.1, §6):

* testflinger-agent's ``schema.py`` rejects unknown keys and requires ``agent_id``,
  ``server_address`` and ``job_queues``;
* the charm's ``tf-*`` scripts find ``default.yaml`` at ``.../$agent_id/default.yaml``, so the
  agent folder's name must equal ``agent_id`` (§6.5).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import threading
import traceback
from pathlib import Path
from typing import Any

import jinja2
import yaml

from ..fileutil import atomic_write as _atomic_write

AGENT_CONF = "testflinger-agent.conf"
CONNECTOR_CONF = "default.yaml"
#: Empty file :func:`render_agent_folder` creates before anything else: a folder a crash left
#: half-rendered (no AGENT_CONF yet, maybe a temp file) is still recognised as ours.
FOLDER_MARKER = ".testflinger-magic-agent-folder"


class AgentConfigError(ValueError):
    """A rendered agent folder is invalid. ``str()`` is ``file:line: key: message``.

    Attributes: ``file`` (path of the template or rendered file), ``line`` (1-based or None),
    ``key`` (config or context key, or None), ``message``, ``blame`` (whose fault it is, for
    the daemon's error report, docs/api.md ``blame``): ``"queue"`` by default, since the
    template folder is the queue's ``agent_template`` and a folder that is missing, does not
    render or renders an invalid config fails on every device alike (counting it against each
    device would quarantine healthy machines, TRIAL finding 1); ``"device"`` for what is not
    the template (a missing ``supervisor.program_user``, a folder not ours to remove).
    """

    def __init__(self, file: str, message: str, *, line: int | None = None, key: str | None = None,
                 blame: str = "queue"):
        self.file, self.line, self.key, self.message = str(file), line, key, message
        self.blame = blame
        where = self.file + (f":{line}" if line else "")
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")


# testflinger-agent's accepted keys and types (agent/src/testflinger_agent/schema.py, SCHEMA_V1;
# extra keys are rejected there). bool is not accepted where int is expected (stricter).
_COMMANDS = ("setup", "provision", "firmware_update", "test", "allocate", "reserve", "cleanup")
AGENT_SCHEMA: dict[str, tuple[type, bool]] = {
    "agent_id": (str, True),
    "server_address": (str, True),
    "job_queues": (list, True),
    "identifier": (str, False),
    "location": (str, False),
    "polling_interval": (int, False),
    "execution_basedir": (str, False),
    "logging_basedir": (str, False),
    "results_basedir": (str, False),
    "logging_level": (str, False),
    "logging_quiet": (bool, False),
    "provision_type": (str, False),
    "global_timeout": (int, False),
    "output_timeout": (int, False),
    "advertised_queues": (dict, False),
    "advertised_images": (dict, False),
    "output_bytes": (int, False),
    **{f"{c}_command": (str, False) for c in _COMMANDS},
}
# maas2 device connector (device-connectors/.../devices/maas2/maas2.py; TESTFLINGER.md §5.3).
# Other keys are allowed: the connector reads its config with .get().
MAAS2_REQUIRED = ("maas_user", "node_id", "agent_name", "device_ip")
MAAS2_TYPES: dict[str, type] = {**{k: str for k in MAAS2_REQUIRED}, "timeout_min": int}


def _type_ok(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _load_mapping(file: Path, text: str) -> tuple[dict, dict[str, int]]:
    """Parse YAML ``text``; return (data, {top-level key: 1-based line})."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise AgentConfigError(file, f"not valid YAML: {getattr(exc, 'problem', exc)}",
                               line=mark.line + 1 if mark else None) from None
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise AgentConfigError(file, "must be a YAML mapping")
    lines = {str(k.value): k.start_mark.line + 1 for k, _v in node.value}
    return data, lines


def validate_agent_config(file: Path | str, text: str, agent_id: str | None = None) -> dict:
    """Validate a ``testflinger-agent.conf`` text; return the parsed mapping.

    Checks testflinger-agent's schema (required keys, types, no unknown keys), that
    ``job_queues`` is a non-empty list of strings and, when given, that ``agent_id`` matches
    (the folder name). Raises :class:`AgentConfigError` naming file, line and key.
    """
    data, lines = _load_mapping(Path(file), text)
    for key, value in data.items():
        key = str(key)
        if key not in AGENT_SCHEMA:
            raise AgentConfigError(file, "not a testflinger-agent setting (the agent rejects unknown keys)",
                                   line=lines.get(key), key=key)
        kind = AGENT_SCHEMA[key][0]
        if not _type_ok(value, kind):
            raise AgentConfigError(file, f"expected {kind.__name__}, got {type(value).__name__} {value!r}",
                                   line=lines.get(key), key=key)
    for key, (_kind, required) in AGENT_SCHEMA.items():
        if required and key not in data:
            raise AgentConfigError(file, "required by testflinger-agent but missing", key=key)
    queues = data["job_queues"]
    if not queues or not all(isinstance(q, str) and q for q in queues):
        raise AgentConfigError(file, "must be a non-empty list of queue names",
                               line=lines.get("job_queues"), key="job_queues")
    if agent_id is not None and data["agent_id"] != agent_id:
        raise AgentConfigError(file, f"{data['agent_id']!r} differs from the folder name {agent_id!r} "
                               "(the charm's tf-* scripts find default.yaml by agent_id)",
                               line=lines.get("agent_id"), key="agent_id")
    return data


def validate_maas2_config(file: Path | str, text: str, agent_id: str | None = None) -> dict:
    """Validate a maas2 connector ``default.yaml`` text (required ``maas_user``, ``node_id``,
    ``agent_name``, ``device_ip``: non-empty strings; ``timeout_min`` int). Returns the mapping;
    raises :class:`AgentConfigError` naming file, line and key.
    """
    data, lines = _load_mapping(Path(file), text)
    for key in MAAS2_REQUIRED:
        if key not in data or data[key] in (None, ""):
            raise AgentConfigError(file, "required by the maas2 device connector",
                                   line=lines.get(key), key=key)
    for key, kind in MAAS2_TYPES.items():
        if key in data and not _type_ok(data[key], kind):
            raise AgentConfigError(file, f"expected {kind.__name__}, got {type(data[key]).__name__} "
                                   f"{data[key]!r}", line=lines.get(key), key=key)
    if agent_id is not None and data["agent_name"] != agent_id:
        raise AgentConfigError(file, f"{data['agent_name']!r} differs from agent_id {agent_id!r}",
                               line=lines.get("agent_name"), key="agent_name")
    return data


# A JSON surrogate pair escape (not itself preceded by an escaping backslash).
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _strict_json_dumps(obj: Any, **kwargs: Any) -> str:
    """``tojson`` for YAML templates: the result is a valid YAML flow scalar.

    ASCII-only JSON keeps YAML's reader away from characters it refuses (C1 controls, NEL);
    surrogate pairs, which PyYAML does not join, become YAML's ``\\UXXXXXXXX`` escape. A missing
    context key raises UndefinedError (jinja2's default raises TypeError).
    """
    def undefined(o: Any) -> Any:
        if isinstance(o, jinja2.Undefined):
            o._fail_with_undefined_error()
        raise TypeError(f"{type(o).__name__} is not JSON serializable")

    def join(m: re.Match) -> str:
        high, low = int(m.group(2), 16), int(m.group(3), 16)
        return m.group(1) + "\\U%08x" % (0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))

    kwargs["ensure_ascii"] = True
    return _SURROGATE_PAIR.sub(join, json.dumps(obj, default=undefined, **kwargs))


_ENVIRONMENTS: dict[str, tuple[tuple, jinja2.Environment]] = {}
_ENVIRONMENTS_LOCK = threading.Lock()


def _environment(template_dir: Path, templates: list[Path]) -> jinja2.Environment:
    """The jinja2 environment of ``template_dir``, kept per folder while its ``templates``
    (name, size, mtime in ns) stay the same, so each template is compiled once rather than
    at every VM's rendering; any change to them gives a fresh environment."""
    key = tuple((t.name, st.st_size, st.st_mtime_ns) for t in templates for st in [t.stat()])
    with _ENVIRONMENTS_LOCK:
        kept = _ENVIRONMENTS.get(str(template_dir))
        if kept is not None and kept[0] == key:
            return kept[1]
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir)),
                                 undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                 autoescape=False)
        env.policies["json.dumps_function"] = _strict_json_dumps
        _ENVIRONMENTS[str(template_dir)] = (key, env)
        return env


def _render_template(env: jinja2.Environment, template: Path, context: dict) -> str:
    try:
        return env.get_template(template.name).render(context)
    except jinja2.TemplateSyntaxError as exc:
        raise AgentConfigError(template, f"template syntax: {exc.message}", line=exc.lineno) from None
    except jinja2.UndefinedError as exc:
        line = None
        for frame in traceback.extract_tb(exc.__traceback__):
            if frame.filename == str(template):  # jinja2 maps its frames to template lines
                line = frame.lineno
        m = re.search(r"'([^']+)' is undefined|has no attribute '([^']+)'", exc.message or "")
        key = (m.group(1) or m.group(2)) if m else None
        raise AgentConfigError(template, f"context key missing ({exc.message})", line=line, key=key) from None


def template_names(templates_dir: Path | str) -> list[str]:
    """Sorted names of the template folders under ``templates_dir`` (the daemon's
    ``agent_templates_dir``): sub-folders holding a ``testflinger-agent.conf.j2``. An absent or
    unreadable ``templates_dir`` gives ``[]``."""
    try:
        return sorted(p.name for p in Path(templates_dir).iterdir()
                      if (p / f"{AGENT_CONF}.j2").is_file())
    except OSError:
        return []


def check_template_folder(template_dir: Path | str) -> None:
    """Check, before a bring-up touches the device, what can be checked of a template folder
    without the per-VM context: it exists, holds ``*.j2`` templates among them
    ``testflinger-agent.conf.j2``, and every template parses (jinja2 syntax). Reads files only.

    Raises :class:`AgentConfigError` (``blame = "queue"``) naming the folder (and, when it does
    not exist, the template folders that do exist beside it) or the template and line."""
    template_dir = Path(template_dir).resolve()
    if not template_dir.is_dir():
        here = template_names(template_dir.parent)
        raise AgentConfigError(template_dir, "no such agent template folder on this agent host "
                               f"(the queue's agent_template; folders here: "
                               f"{', '.join(here) or 'none'})")
    templates = sorted(p for p in template_dir.glob("*.j2") if p.is_file())
    if not templates:
        raise AgentConfigError(template_dir, "no *.j2 templates in this folder")
    if not any(t.name == f"{AGENT_CONF}.j2" for t in templates):
        raise AgentConfigError(template_dir, f"no {AGENT_CONF}.j2 template")
    env = _environment(template_dir, templates)
    for template in templates:
        try:
            env.get_template(template.name)
        except jinja2.TemplateSyntaxError as exc:
            raise AgentConfigError(template, f"template syntax: {exc.message}",
                                   line=exc.lineno) from None


def render_agent_folder(template_dir: Path | str, dest_dir: Path | str, context: dict,
                        *, owner: str | None = None) -> Path:
    """Render every ``*.j2`` of ``template_dir`` into ``dest_dir`` (name without ``.j2``).

    ``dest_dir``'s name must equal the rendered ``agent_id`` (the charm's tf-* scripts find
    ``default.yaml`` by it). Rendering uses jinja2 with StrictUndefined, so a missing context
    key fails. ``testflinger-agent.conf`` is required and validated with
    :func:`validate_agent_config`; with ``provision_type: maas2``, ``default.yaml`` is required
    and validated with :func:`validate_maas2_config`. Nothing is written unless all of it is
    valid. Files are replaced atomically (temp file + rename) with mode 0600 since connector
    configs may carry credentials; ``owner`` chowns them (and the folder) to the agent's user.
    Re-rendering is idempotent. Returns ``dest_dir``. Raises :class:`AgentConfigError`.
    """
    template_dir, dest_dir = Path(template_dir).resolve(), Path(dest_dir)
    templates = sorted(p for p in template_dir.glob("*.j2") if p.is_file())
    if not templates:
        raise AgentConfigError(template_dir, "no *.j2 templates in this folder")
    env = _environment(template_dir, templates)
    rendered = {t.name[: -len(".j2")]: _render_template(env, t, context) for t in templates}

    if AGENT_CONF not in rendered:
        raise AgentConfigError(template_dir, f"no {AGENT_CONF}.j2 template")
    agent = validate_agent_config(dest_dir / AGENT_CONF, rendered[AGENT_CONF], agent_id=dest_dir.name)
    if agent.get("provision_type") == "maas2":
        if CONNECTOR_CONF not in rendered:
            raise AgentConfigError(template_dir, f"provision_type maas2 needs a {CONNECTOR_CONF}.j2 template")
        validate_maas2_config(dest_dir / CONNECTOR_CONF, rendered[CONNECTOR_CONF], agent_id=agent["agent_id"])
    elif CONNECTOR_CONF in rendered:
        _load_mapping(dest_dir / CONNECTOR_CONF, rendered[CONNECTOR_CONF])

    try:
        pw = pwd.getpwnam(owner) if owner else None
    except KeyError:
        raise AgentConfigError(dest_dir, f"user {owner!r} (supervisor.program_user) does not "
                               "exist on this agent host: the VM agent could not read its "
                               "folder", blame="device") from None
    dest_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(dest_dir, 0o750)
    if pw:
        os.chown(dest_dir, pw.pw_uid, pw.pw_gid)
    # Before any rendered file: creating an empty file is atomic, so from here on a SIGKILL
    # leaves a folder remove_agent_folder accepts (whatever temp files the kill left).
    (dest_dir / FOLDER_MARKER).touch(mode=0o600, exist_ok=True)
    for name, text in rendered.items():
        _atomic_write(dest_dir / name, text, 0o600, owner)
    return dest_dir


def remove_agent_folder(dest_dir: Path | str) -> None:
    """Delete a rendered agent folder; absent is fine.

    Refuses (AgentConfigError) a non-empty folder with neither ``testflinger-agent.conf`` nor
    :data:`FOLDER_MARKER`, so a wrong path can never wipe unrelated data; the marker makes a
    folder that a crash left half-rendered (a temp file, say) removable.
    """
    dest_dir = Path(dest_dir)
    if not dest_dir.exists():
        return
    if (any(dest_dir.iterdir()) and not (dest_dir / AGENT_CONF).exists()
            and not (dest_dir / FOLDER_MARKER).exists()):
        raise AgentConfigError(dest_dir, f"not an agent folder (no {AGENT_CONF}); not removing",
                               blame="device")
    shutil.rmtree(dest_dir)
