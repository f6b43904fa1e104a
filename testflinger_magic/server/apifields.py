"""Strict marshmallow fields and the JSON-body check of the /v1/magic API (server/api.py).

* :class:`StrictBoolean`: JSON ``true``/``false`` only. marshmallow's ``Boolean`` (which
  Testflinger's own schemas use everywhere, canonical/testflinger
  ``server/src/testflinger/api/schemas.py``, e.g. ``Job.ephemeral``) also takes the strings and
  numbers of its ``truthy``/``falsy`` sets (``"yes"``, ``"on"``, ``1``, ``"f"``...). Our boolean
  body fields are mostly ``force`` flags that force destructive things (a lend the queue's
  selection refuses, cancelling running jobs at a drain, removing queues with waiting jobs,
  binding an unknown client), so a quoted or mistyped value is refused (422 naming the field)
  rather than guessed at.
* :class:`BoundedList`: a list refused when longer than its bound *before* its items are read
  (marshmallow's ``Length`` validator runs only after every item was deserialized: 20,000
  nested devices cost seconds of CPU before the refusal).
* :class:`NameRule`: a ``Regexp`` (so the OpenAPI document carries the ``pattern``) whose
  message is the shared rule's (testflinger_magic.names).
* :func:`require_json_body`: a blueprint ``before_request`` hook refusing a body that is not
  JSON. Without it apiflask (webargs ``FlaskParser._raw_load_json``) reads a body whose
  Content-Type is not JSON as *no* body (422 "device: Missing data for required field"), and a
  JSON Content-Type with unparsable text as a bare 400 ``{"message": "Bad Request", "detail":
  {}}`` (apiflask drops webargs' ``{"json": ["Invalid JSON body."]}``). Testflinger's own
  endpoints answer exactly so (same apiflask ``input(location="json")``, no handler of their
  own, ``application.py``); we keep its 400 and say why in ``detail.json``.
"""

from __future__ import annotations

import json
from typing import Callable

from apiflask.exceptions import HTTPError
from apiflask.fields import Boolean, List
from apiflask.validators import Regexp
from flask import request
from marshmallow import ValidationError

#: Methods whose body an ``input(location="json")`` reads.
_BODY_METHODS = ("POST", "PUT", "PATCH")


class StrictBoolean(Boolean):
    """A JSON boolean: ``true`` or ``false`` only (see the module docstring)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):
            raise ValidationError(f"must be JSON true or false, not {value!r}")
        return value


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
    ``is_json``), or not parsable as UTF-8 JSON. An empty body passes (every field then takes
    its default, or is reported missing by the schema)."""
    if request.method not in _BODY_METHODS:
        return None
    body = request.get_data(cache=True)
    if not body:
        return None
    mimetype = request.mimetype or ""
    if not (mimetype == "application/json"
            or (mimetype.startswith("application/") and mimetype.endswith("+json"))):
        why = (f"the body is not JSON: Content-Type is {mimetype or 'missing'!r}; send it as "
               "application/json")
    else:
        try:
            json.loads(body.decode("utf-8"))
            return None
        except UnicodeDecodeError as exc:
            why = f"the body is not JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            why = f"the body is not JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    raise HTTPError(400, "Bad Request: " + why, detail={"json": [why]})
