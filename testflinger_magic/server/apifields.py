"""Strict marshmallow fields and the JSON-body check of the /v1/magic API (server/api.py).

* :class:`StrictBoolean`: JSON ``true``/``false`` only. marshmallow's ``Boolean`` (which
  Testflinger's own schemas use everywhere, canonical/testflinger
  ``server/src/testflinger/api/schemas.py``, e.g. ``Job.ephemeral``) also takes the strings and
  numbers of its ``truthy``/``falsy`` sets (``"yes"``, ``"on"``, ``1``, ``"f"``...). Our boolean
  body fields are mostly ``force`` flags that force destructive things (a lend the queue's
  selection refuses, cancelling running jobs at a drain, removing queues with waiting jobs,
  binding an unknown client), so a quoted or mistyped value is refused (422 naming the field)
  rather than guessed at.
* :class:`StrictInteger`: a JSON integer only (not ``true``, ``"4"`` nor ``4.0``).
* :class:`BoundedList`: a list refused when longer than its bound *before* its items are read
  (marshmallow's ``Length`` validator runs only after every item was deserialized: 20,000
  nested devices cost seconds of CPU before the refusal).
* :class:`NameRule`: a ``Regexp`` (so the OpenAPI document carries the ``pattern``) whose
  message is the shared rule's (testflinger_magic.names).
* :func:`require_json_body`: run by ``auth.require`` after authentication, refusing a body
  that is not JSON, or that holds a string which is not text (an unpaired surrogate or a
  control character: 422). Without it apiflask (webargs ``FlaskParser._raw_load_json``) reads
  a body whose
  Content-Type is not JSON as *no* body (422 "device: Missing data for required field"), and a
  JSON Content-Type with unparsable text as a bare 400 ``{"message": "Bad Request", "detail":
  {}}`` (apiflask drops webargs' ``{"json": ["Invalid JSON body."]}``). Testflinger's own
  endpoints answer exactly so (same apiflask ``input(location="json")``, no handler of their
  own, ``application.py``); we keep its 400 and say why in ``detail.json``.
* :func:`body_limit`: a route's body is refused (413) past a bound, judged from Content-Length
  after authentication and before the body is read (TRIAL12 F5: a 60 MB ``PUT /queues`` held a
  worker 16 s); ``auth.require`` leaves such routes' bodies to it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Callable

from apiflask.exceptions import HTTPError
from apiflask.fields import Boolean, Integer, List
from apiflask.validators import Regexp
from flask import request
from marshmallow import ValidationError

from testflinger_magic.fileutil import MAX_INPUT_FILE

#: Methods whose body an ``input(location="json")`` reads.
_BODY_METHODS = ("POST", "PUT", "PATCH")

#: Largest body of an operator write, bytes: a ``PUT /queues`` carrying a definitions file as
#: large as ``testflinger-magic apply`` reads (``fileutil.MAX_INPUT_FILE``, 1 MiB) as JSON,
#: where one byte of the file may take 6 (``\u001f``; requests escapes non-ASCII so too), plus
#: 64 KiB for the other fields. The file itself is then held to ``MAX_INPUT_FILE`` (api.py).
MAX_BODY = 6 * MAX_INPUT_FILE + 64 * 1024


class StrictBoolean(Boolean):
    """A JSON boolean: ``true`` or ``false`` only (see the module docstring)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):
            raise ValidationError(f"must be JSON true or false, not {value!r}")
        return value


class StrictInteger(Integer):
    """A JSON integer: not a string ("4"), a float (4.0) nor a boolean (marshmallow's strict
    ``Integer`` takes ``true`` as 1: ``bool`` is an ``Integral``)."""

    def __init__(self, **kwargs):
        super().__init__(strict=True, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool):
            raise ValidationError(f"must be a JSON integer, not {value!r}")
        return super()._deserialize(value, attr, data, **kwargs)


class BoundedList(List):
    """A ``List`` of at most ``max_items`` items, counted before any item is deserialized
    (also declared as a ``Length`` validator so the OpenAPI document has ``maxItems``)."""

    def __init__(self, cls_or_instance, *, max_items: int, **kwargs):
        from apiflask.validators import Length  # noqa: PLC0415

        super().__init__(cls_or_instance, validate=Length(max=max_items), **kwargs)
        self.max_items = max_items

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (list, tuple)) and len(value) > self.max_items:
            raise ValidationError(f"at most {self.max_items} items, got {len(value)}")
        return super()._deserialize(value, attr, data, **kwargs)


class NameRule(Regexp):
    """``Regexp(regex)`` whose error is ``problem(value)`` (a names.*_problem function)."""

    def __init__(self, regex, problem: Callable[[str], str | None]):
        super().__init__(regex)
        self.problem = problem

    def __call__(self, value):
        why = self.problem(value)
        if why:
            raise ValidationError(why)
        return value


def require_json_body():
    """Refuse (400, ``detail.json`` saying why) a non-empty request body that is not JSON: sent
    without a JSON Content-Type (``application/json`` or ``application/*+json``, webargs'
    ``is_json``), or not parsable as UTF-8 JSON; and (422 naming the field) one holding a
    string that is not text (:func:`_refuse_not_text`). An empty body passes (every field
    then takes its default, or is reported missing by the schema). Called by ``auth.require``
    once the caller is authenticated (a route with :func:`body_limit` checks it there), so a
    caller Testflinger would refuse gets Testflinger's answer whatever its body."""
    if request.method not in _BODY_METHODS:
        return None
    _check_json_body()
    return None


#: Characters no body string may hold: the C0 controls but tab, newline and carriage return,
#: and DEL. NUL and ESC in a reason reached operators' terminals through ``status`` and
#: ``events`` as they were (TRIAL14 F2: escape sequences of any writer's choosing).
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _not_text(value: str) -> str | None:
    """Why ``value`` is not text, or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "holds an unpaired UTF-16 surrogate (e.g. \\ud800), which is not text"
    bad = _CONTROLS.search(value)
    if bad:
        return (f"holds the control character U+{ord(bad.group()):04X}, which is not text "
                "(only tab and line breaks are)")
    return None


def _not_text_at(value, path: str) -> tuple[str, str] | None:
    """``(path, why)`` of the first string (key or value) of ``value`` (parsed JSON) that is not
    text (:func:`_not_text`; ``a.0.b`` paths), or None."""
    if isinstance(value, str):
        why = _not_text(value)
        return (path or "(the body)", why) if why else None
    if isinstance(value, dict):
        for key, item in value.items():
            why = _not_text(key) if isinstance(key, str) else None
            if why:
                return (f"{path}.(a key)" if path else "(a key)", why)
            found = _not_text_at(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _not_text_at(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def _refuse_not_text(data) -> None:
    """422 naming the field (apiflask's ``detail.json`` format) when a string of the parsed
    body is not text: an unpaired UTF-16 surrogate, which JSON may write (``"\\ud800"``, RFC
    8259 escapes) and Python parses, but UTF-8 cannot encode, so neither can BSON (pymongo
    raises ``UnicodeEncodeError`` before a write reaches MongoDB: TRIAL12 F2, a 500 on every
    route that stored such a string); or a control character (:data:`_CONTROLS`)."""
    found = _not_text_at(data, "")
    if found is not None:
        where, why = found
        raise HTTPError(422, "Validation error", detail={"json": {where: [why]}})


def _check_json_body() -> None:
    """:func:`require_json_body`'s check of a body (read now, cached for the schema)."""
    body = request.get_data(cache=True)
    if not body:
        return
    mimetype = request.mimetype or ""
    if not (mimetype == "application/json"
            or (mimetype.startswith("application/") and mimetype.endswith("+json"))):
        why = (f"the body is not JSON: Content-Type is {mimetype or 'missing'!r}; send it as "
               "application/json")
    else:
        try:
            data = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError as exc:
            why = f"the body is not JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            why = f"the body is not JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
        else:
            _refuse_not_text(data)
            return
    raise HTTPError(400, "Bad Request: " + why, detail={"json": [why]})


#: Largest body of an agent host's registration, report or heartbeat, bytes: a registration of
#: ``MAX_DEVICES_PER_HOST`` devices or a report with a long outage's journal is well under 1 MiB
#: (a lease's bring-up journals about a hundred entries of a few hundred bytes); the same bound
#: as an operator's write, so no legitimate daemon comes near it.
MAX_AGENT_BODY = MAX_BODY

#: Why :func:`body_limit`'s bound is what it is, by route family (the 413's words).
OPERATOR_LIMIT = (f"a definitions file is at most {MAX_INPUT_FILE // (1024 * 1024)} MiB, as "
                  "testflinger-magic apply reads")
AGENT_LIMIT = "an agent host's registration, report or heartbeat takes a few KiB"


def body_limit(max_bytes: int = MAX_BODY, why_limit: str = OPERATOR_LIMIT):
    """Decorator (under ``auth.require``, over ``bp.input``): a body of more than ``max_bytes``
    is 413, said from Content-Length before a byte of it is read; of a body without one
    (chunked) one byte more than ``max_bytes`` is read at most. Then :func:`require_json_body`'s
    check runs, which ``auth.require`` leaves to it for these routes (``max_body``), so the
    body is bounded before it is read. ``why_limit``: the bound's reason, in the 413."""

    def too_large(length: int | None) -> HTTPError:
        size = "" if length is None else f" of {length} bytes"
        why = (f"the request body{size} is larger than {max_bytes} bytes, this route's limit "
               f"({why_limit})")
        return HTTPError(413, "Request Entity Too Large: " + why, detail={"json": [why]})

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            length = request.content_length
            if length is not None and length > max_bytes:
                raise too_large(length)
            # A body without a Content-Length (chunked) too: read one byte more, at most.
            try:
                request.max_content_length = max_bytes + 1
            except AttributeError:  # Flask < 3.1 (settable from 3.1): read it all
                pass
            if len(request.get_data(cache=True)) > max_bytes:
                raise too_large(None)
            _check_json_body()
            return func(*args, **kwargs)

        wrapper.max_body = max_bytes
        return wrapper

    return decorator
