"""Authentication of the lab's job service (:mod:`.jobservice`), as Testflinger's.

Source: canonical/testflinger ``server/src/testflinger/api/auth.py`` (JWT access tokens signed
HS256, refresh tokens, role checks, the permission checks of a job submission) and the
``/v1/oauth2/token`` and ``/v1/oauth2/refresh`` views of ``api/v1.py`` (registered on the ``v1``
blueprint by :mod:`.jobservice`, under the same endpoint names). Also the request context the
service's modules share: its database (``_db``), the server generation (``_newer``), OIDC
(``_oidc``) and the time (``_now``).
"""

from __future__ import annotations

import functools
import secrets
from datetime import datetime, timedelta, timezone
from http import HTTPStatus

import jwt
from apiflask import abort
from flask import current_app, g, jsonify, request
from werkzeug.security import check_password_hash, generate_password_hash

from testflinger_magic import tfstates
from testflinger_magic.lab.jobservice_schemas import RefreshTokenInSchema, _json_body

#: Access-token and refresh-token lifetimes, seconds (Testflinger ``api/auth.py``).
ACCESS_TOKEN_TTL = 600
REFRESH_TOKEN_TTL = 6 * 24 * 3600
#: Clock skew tolerated when decoding tokens, seconds (Testflinger's JWT_LEEWAY default).
JWT_LEEWAY = 5
#: Fields of ``client_permissions`` copied into the JWT ``permissions`` claim.
PERMISSIONS_FIELDS = ("role", "max_priority", "allowed_queues", "max_reservation_time", "client_id",
                      "email")
#: werkzeug hash for client secrets. Cheap on purpose, like Testflinger's bcrypt with 8 rounds:
#: the lab's clients are throw-away and the 2-core test machine hashes on every token request.
HASH_METHOD = "pbkdf2:sha256:20000"
#: Reservations up to this many seconds need no permission (``check_max_reservation_timeout``).
FREE_RESERVATION = 6 * 3600

CONTRIBUTOR_ROLES = (tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER, tfstates.ROLE_CONTRIBUTOR)
AGENT_WRITE_ROLES = (tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER, tfstates.ROLE_AGENT)
AGENT_ONLY = (tfstates.ROLE_AGENT,)
ALL_ROLES = CONTRIBUTOR_ROLES + AGENT_ONLY


# ---------------------------------------------------------------- request context


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _db():
    return current_app.extensions["jobservice"]["db"]


def _newer() -> bool:
    """Serve the contract of testflinger#1253 (``create_app(newer=True)``)."""
    return current_app.extensions["jobservice"].get("newer", False)


def _oidc() -> bool:
    return current_app.extensions["jobservice"].get("oidc", False)


# ---------------------------------------------------------------- auth (api/auth.py)


def add_client(database, client_id: str, secret: str, role: str = tfstates.ROLE_CONTRIBUTOR, *,
               max_priority: dict | None = None, allowed_queues: list | None = None,
               max_reservation_time: dict | None = None) -> None:
    """Create or replace a ``client_permissions`` document (secret stored hashed, werkzeug).

    Testflinger hashes with bcrypt; the hash format differs but the document shape is the same.
    Raises ``ValueError`` on an unknown role.
    """
    if role not in ALL_ROLES:
        raise ValueError(f"client {client_id!r}: unknown role {role!r} (one of {ALL_ROLES})")
    database.client_permissions.update_one(
        {"client_id": client_id},
        {"$set": {
            "client_id": client_id,
            "client_secret_hash": generate_password_hash(secret, method=HASH_METHOD),
            "role": role,
            "max_priority": max_priority or {},
            "allowed_queues": allowed_queues or [],
            "max_reservation_time": max_reservation_time or {},
        }},
        upsert=True,
    )


def _authenticate() -> None:
    """Fill ``g.client_id/role/permissions/is_authenticated`` as Testflinger with OIDC off."""
    header = request.headers.get("Authorization")
    g.client_id, g.role, g.permissions, g.is_authenticated = None, None, {}, False
    if not header and not _oidc():  # anonymous contributor (only when OIDC is off)
        g.role, g.is_authenticated = tfstates.ROLE_CONTRIBUTOR, True
        return
    if not header:
        return
    if not header.startswith("Bearer "):
        return  # role stays None: require_role answers 403, as Testflinger
    if not header[len("Bearer "):]:
        abort(HTTPStatus.UNAUTHORIZED, "Unauthorized")  # decode_jwt_token: empty token
    try:
        claims = jwt.decode(header[len("Bearer "):], current_app.config["JWT_SIGNING_KEY"],
                            algorithms=["HS256"], leeway=JWT_LEEWAY,
                            options={"require": ["exp", "iat", "sub"]})
    except jwt.ExpiredSignatureError:
        abort(HTTPStatus.UNAUTHORIZED, "Token has expired")
    except jwt.ImmatureSignatureError:
        abort(HTTPStatus.UNAUTHORIZED, "Token not yet valid")
    except jwt.InvalidSignatureError:
        abort(HTTPStatus.FORBIDDEN, "Invalid Token signature")
    except jwt.MissingRequiredClaimError as exc:
        abort(HTTPStatus.FORBIDDEN, f"Token missing required claim: {exc.claim}")
    except jwt.DecodeError:
        abort(HTTPStatus.FORBIDDEN, "Unable to decode token")
    except jwt.InvalidTokenError:
        abort(HTTPStatus.FORBIDDEN, "Invalid Token")
    permissions = claims.get("permissions", {})
    g.client_id = permissions.get("client_id")
    g.role = permissions.get("role", tfstates.ROLE_CONTRIBUTOR)
    g.permissions = permissions
    g.is_authenticated = True


def roles(*allowed: str):
    """Decorator = Testflinger's ``@authenticate`` + ``@require_role(*allowed)`` (exact roles)."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            _authenticate()
            if _oidc() and (not g.is_authenticated or g.client_id is None):
                abort(HTTPStatus.UNAUTHORIZED, "Authentication is required for specified endpoint")
            if g.role not in allowed:
                abort(HTTPStatus.FORBIDDEN, f"Specified action requires role: {', '.join(allowed)}")
            return func(*args, **kwargs)

        wrapper._role_requirements = list(allowed)
        return wrapper

    return decorator


def generate_access_token(permissions: dict, key: str) -> str:
    """HS256 JWT ``{exp, iat, sub: "access_token", permissions}``, valid ACCESS_TOKEN_TTL s."""
    now = _now()
    payload = {"exp": now + timedelta(seconds=ACCESS_TOKEN_TTL), "iat": now,
               "sub": "access_token", "permissions": permissions}
    return jwt.encode(payload, key, algorithm="HS256")


def _permissions(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k in PERMISSIONS_FIELDS}


def _check_permissions(permissions: dict, job: dict) -> None:
    """Priority, restricted-queue and reservation-length checks of ``auth.check_permissions``."""
    queue, priority = job["job_queue"], job.get("job_priority", 0)
    if priority != 0:
        if not permissions:
            abort(HTTPStatus.UNAUTHORIZED,
                  f"Authentication required for setting priority: {priority}")
        limits = permissions.get("max_priority", {})
        if priority > max(limits.get("*", 0), limits.get(queue, 0)):
            abort(HTTPStatus.FORBIDDEN,
                  f"Not enough permissions to push to {queue} with priority {priority}")
    if _db().restricted_queues.count_documents({"queue_name": queue}):
        if not permissions:
            abort(HTTPStatus.UNAUTHORIZED,
                  f"Authentication required to push to restricted queue: {queue}")
        if queue not in permissions.get("allowed_queues", []):
            abort(HTTPStatus.FORBIDDEN,
                  f"Not enough permissions to push to the restricted queue: {queue}")
    timeout = (job.get("reserve_data") or {}).get("timeout") or 3600
    if timeout > FREE_RESERVATION:
        if not permissions:
            abort(HTTPStatus.UNAUTHORIZED,
                  f"Authentication required for setting timeout: {timeout}")
        limits = permissions.get("max_reservation_time", {})
        if timeout > max(limits.get("*", 0), limits.get(queue, 0)):
            abort(HTTPStatus.FORBIDDEN, f"Not enough permissions to push to {queue} with "
                                        f"reservation timeout {timeout}")


def _naive_utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc).replace(tzinfo=None) if value.tzinfo else value


# ---------------------------------------------------------------- token views (api/v1.py)


def retrieve_token():
    """HTTP Basic ``client_id:secret`` -> ``{access_token, token_type, expires_in,
    refresh_token}``; 401 (text) on missing or wrong credentials."""
    auth = request.authorization
    if auth is None:
        return "No authorization header specified", HTTPStatus.UNAUTHORIZED
    client_id, secret = auth.get("username"), auth.get("password")
    if not client_id or secret is None:
        return ("Client id and key must be specified in authorization header",
                HTTPStatus.UNAUTHORIZED)
    database = _db()
    entry = database.client_permissions.find_one({"client_id": client_id}, {"_id": False})
    hashed = (entry or {}).get("client_secret_hash")
    if not hashed or not check_password_hash(hashed, secret):
        return "Invalid client id or client key", HTTPStatus.UNAUTHORIZED
    refresh_token = secrets.token_urlsafe(48)
    now = _now()
    database.refresh_tokens.insert_one({
        "client_id": client_id, "refresh_token": refresh_token, "issued_at": now,
        "expires_at": now + timedelta(seconds=REFRESH_TOKEN_TTL), "revoked": False,
        "last_accessed": now,
    })
    return jsonify({
        "access_token": generate_access_token(_permissions(entry),
                                              current_app.config["JWT_SIGNING_KEY"]),
        "token_type": "Bearer",
        "expires_in": ACCESS_TOKEN_TTL,
        "refresh_token": refresh_token,
    })


def refresh_access_token():
    """``{refresh_token}`` -> ``{access_token, token_type, expires_in}`` with permissions re-read;
    400 if the token is unknown, revoked or expired, 422 if malformed."""
    token = _json_body(RefreshTokenInSchema())["refresh_token"]
    database = _db()
    entry = database.refresh_tokens.find_one({"refresh_token": token})
    if not entry:
        abort(HTTPStatus.BAD_REQUEST, "Invalid refresh token.")
    if entry.get("revoked"):
        abort(HTTPStatus.BAD_REQUEST, "Refresh token revoked.")
    if entry.get("expires_at") and _naive_utc(entry["expires_at"]) < _now().replace(tzinfo=None):
        abort(HTTPStatus.BAD_REQUEST, "Refresh token expired")
    database.refresh_tokens.update_one({"refresh_token": token},
                                       {"$set": {"last_accessed": _now()}})
    perms = database.client_permissions.find_one({"client_id": entry["client_id"]},
                                                 {"_id": False}) or {}
    return jsonify({
        "access_token": generate_access_token(_permissions(perms),
                                              current_app.config["JWT_SIGNING_KEY"]),
        "token_type": "Bearer",
        "expires_in": ACCESS_TOKEN_TTL,
    })
