"""Request schemas of the lab's job service (:mod:`.jobservice`), as Testflinger's.

Source: canonical/testflinger ``server/src/testflinger/api/schemas.py`` (the fields and checks
the ``/v1`` routes validate bodies and queries with); :func:`_json_body` answers 422 with
marshmallow's messages in apiflask's error shape, as Testflinger does.
"""

from __future__ import annotations

from http import HTTPStatus

from apiflask import abort
from flask import request
from marshmallow import INCLUDE, Schema, ValidationError, fields, validates_schema
from marshmallow.validate import Length, OneOf, Range, Regexp

from testflinger_magic.lab.tf_duration import parse_duration

#: ``TestPhase`` from testflinger_common.enums: the phases logs and status maps may name.
TEST_PHASES = ("setup", "provision", "firmware_update", "test", "allocate", "reserve", "cleanup")
LOG_TYPES = ("output", "serial")


class _Duration(fields.Field):
    """Integer seconds or a duration string (``"2h"``), loaded as int seconds
    (Testflinger's ``DurationField``: :mod:`.tf_duration`)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if value is None:
            return None
        try:
            return int(parse_duration(value))
        except ValueError as exc:
            raise ValidationError(f"Invalid duration format: {exc}") from exc


class _Attachment(Schema):
    agent = fields.String(required=True)
    device = fields.String(required=False)


class _TestData(Schema):
    test_cmds = fields.String(required=False)
    attachments = fields.List(fields.Nested(_Attachment), required=False)
    test_username = fields.String(required=False)
    test_password = fields.String(required=False)
    secrets = fields.Dict(
        keys=fields.String(validate=Regexp(r"^[a-zA-Z_][a-zA-Z0-9_]*$")),
        values=fields.String(validate=Regexp(r"^[a-zA-Z0-9_/-]+$")),
        required=False,
    )


class _ReserveData(Schema):
    ssh_keys = fields.List(fields.String(validate=Regexp(r"^(lp|gh):(\S+)$")), required=False)
    timeout = _Duration(required=False, allow_none=True)


class JobSchema(Schema):
    """``POST /v1/job`` body (Testflinger ``schemas.Job``); undeclared keys give 422."""

    job_id = fields.String(required=False)
    parent_job_id = fields.String(required=False)
    name = fields.String(required=False)
    tags = fields.List(fields.String(), required=False)
    job_queue = fields.String(required=True, validate=Length(min=1))
    global_timeout = fields.Integer(required=False)
    output_timeout = fields.Integer(required=False)
    allocation_timeout = fields.Integer(required=False)
    provision_data = fields.Dict(required=False, allow_none=True)
    firmware_update_data = fields.Dict(required=False)
    test_data = fields.Nested(_TestData, required=False)
    allocate_data = fields.Dict(required=False)
    reserve_data = fields.Nested(_ReserveData, required=False)
    job_status_webhook = fields.String(required=False)
    job_priority = fields.Integer(required=False)
    exclude_agents = fields.List(fields.String(), required=False, load_default=list)
    debug = fields.Boolean(required=False)


class AgentInSchema(Schema):
    """``POST /v1/agents/data/<name>`` body (Testflinger ``schemas.AgentIn``)."""

    identifier = fields.String(required=False)
    job_id = fields.String(required=False)
    location = fields.String(required=False)
    log = fields.List(fields.String(), required=False)
    provision_type = fields.String(required=False)
    queues = fields.List(fields.String(), required=False)
    state = fields.String(required=False)
    comment = fields.String(required=False)


class ProvisionLogsInSchema(Schema):
    """``POST /v1/agents/provision_logs/<name>`` body (Testflinger ``schemas.ProvisionLogsIn``)."""

    job_id = fields.String(required=True)
    exit_code = fields.Integer(required=True)
    detail = fields.String(required=False)


class ActionInSchema(Schema):
    """``POST /v1/job/<id>/action`` body."""

    action = fields.String(required=True, validate=OneOf(["cancel"]))


class ResultPostSchema(Schema):
    """``POST /v1/result/<id>`` body (Testflinger ``schemas.ResultPost``)."""

    status = fields.Dict(keys=fields.String(validate=OneOf(TEST_PHASES)), values=fields.Integer(),
                         required=False)
    device_info = fields.Dict(required=False)
    job_state = fields.String(required=False)


class LogPostSchema(Schema):
    """``POST /v1/result/<id>/log/<type>`` body: one fragment."""

    fragment_number = fields.Integer(required=True)
    timestamp = fields.DateTime(required=True)
    phase = fields.String(required=True, validate=OneOf(TEST_PHASES))
    log_data = fields.String(required=True)


class LogQuerySchema(Schema):
    """``GET /v1/result/<id>/log/<type>`` query."""

    start_fragment = fields.Integer(required=False, validate=Range(min=0))
    start_timestamp = fields.DateTime(required=False)
    phase = fields.String(required=False, validate=OneOf(TEST_PHASES))


class RefreshTokenInSchema(Schema):
    """``POST /v1/oauth2/refresh`` body."""

    refresh_token = fields.String(required=True, validate=Length(min=1))


class _StringMapSchema(Schema):
    """``POST /v1/agents/queues`` body: ``{queue: description}``."""

    class Meta:
        unknown = INCLUDE

    @validates_schema
    def _strings(self, data, **_):
        for key, value in data.items():
            if not isinstance(key, str) or not key or not isinstance(value, str):
                raise ValidationError(f"queue names and descriptions must be strings: {key!r}")


class _ImagesInSchema(Schema):
    """``POST /v1/agents/images`` body: ``{queue: {image: provision string}}``."""

    class Meta:
        unknown = INCLUDE

    @validates_schema
    def _maps(self, data, **_):
        for key, value in data.items():
            if not isinstance(value, dict):
                raise ValidationError(f"images for queue {key!r} must be a mapping")


def _load(schema: Schema, data):
    """Validate ``data``; 422 with marshmallow's messages (apiflask's error shape) on failure."""
    try:
        return schema.load(data if data is not None else {})
    except ValidationError as exc:
        abort(HTTPStatus.UNPROCESSABLE_ENTITY, "Validation error", detail={"json": exc.messages})


def _json_body(schema: Schema) -> dict:
    return _load(schema, request.get_json(silent=True))
