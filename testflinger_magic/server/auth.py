"""Role checks for the /v1/magic endpoints, compatible with Testflinger's.

Inside the real Testflinger server (``testflinger.api.auth`` importable and the app built by its
factory, i.e. it has an ``oauth`` attribute) the endpoints use Testflinger's own ``authenticate`` +
``require_role``, so tokens, OIDC and OWASP logging behave exactly as on ``/v1``.

Elsewhere (the embedded lab, tests) a compatible fallback runs: ``Authorization: Bearer <jwt>``,
HS256, signed with ``app.config["JWT_SIGNING_KEY"]``, role from claim ``permissions.role``; no header
means an anonymous contributor (Testflinger with OIDC off). Source: canonical/testflinger
``server/src/testflinger/api/auth.py`` (``authenticate``, ``require_role``,
``generate_access_token``); see TESTFLINGER.md §2. Roles are checked by exact membership.
"""

from __future__ import annotations

import functools
import os
import time

import jwt
from apiflask import abort
from flask import current_app, g, request

from testflinger_magic import tfstates

READ_ROLES = (tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER, tfstates.ROLE_CONTRIBUTOR)
WRITE_ROLES = (tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER)
AGENT_ROLES = (tfstates.ROLE_AGENT,)
ALL_ROLES = READ_ROLES + AGENT_ROLES

#: Seconds of clock skew tolerated on ``exp``/``iat``: Testflinger's ``JWT_LEEWAY`` default
#: (``api/auth.py``: ``int(os.environ.get("JWT_LEEWAY", "5"))``), read from the same variable.
LEEWAY = int(os.environ.get("JWT_LEEWAY", "5"))


def _testflinger_auth(app=None):
    """Testflinger's (authenticate, require_role) when running inside its server (``app``,
    default ``current_app``, was built by its factory), else None."""
    if not hasattr(current_app if app is None else app, "oauth"):
        return None
    try:
        from testflinger.api import auth as tf_auth  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return None
    return tf_auth.authenticate, tf_auth.require_role


def issue_token(secret: str, client_id: str, role: str, ttl: float = 600) -> str:
    """Return an HS256 access token shaped like Testflinger's (``sub``, ``iat``, ``exp``,
    ``permissions{client_id, role, ...}``), valid ``ttl`` seconds (Testflinger issues 600)."""
    now = int(time.time())
    payload = {
        "sub": "access_token",
        "iat": now,
        "exp": now + int(ttl),
        "permissions": {
            "client_id": client_id,
            "role": role,
            "max_priority": {},
            "allowed_queues": [],
            "max_reservation_time": {},
        },
    }
    return jwt.encode(payload, secret, algorithm="HS256")


def _fallback_authenticate() -> None:
    """Fill ``g.client_id``, ``g.role``, ``g.permissions`` from the bearer token.

    Aborts 401 for an empty, expired or not-yet-valid token (and with no signing key
    configured), 403 for a malformed, badly signed or incomplete one. Codes and texts are those
    of Testflinger's ``authenticate`` and ``decode_jwt_token`` (``api/auth.py``), so a refused
    caller gets the same answer from the lab as from production (TRIAL12 F4)."""
    header = request.headers.get("Authorization", "")
    g.client_id, g.role, g.permissions, g.is_authenticated = None, None, {}, False
    if not header:
        g.role, g.is_authenticated = tfstates.ROLE_CONTRIBUTOR, True
        return
    if not header.startswith("Bearer "):
        return  # role stays None, so require() answers 403 (as Testflinger's require_role)
    token = header[len("Bearer ") :]
    if not token:
        abort(401, "Unauthorized")  # decode_jwt_token: `if not auth_token`
    secret = current_app.config.get("JWT_SIGNING_KEY")
    if not secret:
        abort(401, "server has no JWT_SIGNING_KEY configured; cannot verify tokens")
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            leeway=LEEWAY,
            options={"require": ["exp", "iat", "sub"]},
        )
    # Status codes and messages as Testflinger's decode_jwt_token: 401 only for a token that is
    # not valid *now* (the client should fetch a new one), 403 for one that is bad.
    except jwt.ExpiredSignatureError:
        abort(401, "Token has expired")
    except jwt.ImmatureSignatureError:
        abort(401, "Token not yet valid")
    except jwt.InvalidSignatureError:
        abort(403, "Invalid Token signature")
    except jwt.MissingRequiredClaimError as exc:
        abort(403, f"Token missing required claim: {exc.claim}")
    except jwt.DecodeError:
        abort(403, "Unable to decode token")
    except jwt.InvalidTokenError:
        abort(403, "Invalid Token")  # no exception text: decode_jwt_token says only this
    permissions = claims.get("permissions") or {}
    g.client_id = permissions.get("client_id")
    g.role = permissions.get("role", tfstates.ROLE_CONTRIBUTOR)
    g.permissions = permissions
    g.is_authenticated = True


def require(*roles: str):
    """Decorator: the caller must hold one of ``roles`` (exact membership, as Testflinger).

    Aborts 401 on an expired token, 403 on a bad one or a role not in ``roles``. The chosen
    implementation (Testflinger's or the fallback) is decided per request from ``current_app``.
    """

    def decorator(func):
        # The body is looked at only once the caller is allowed (apifields.require_json_body;
        # a route with apifields.body_limit bounds and checks it itself).
        if getattr(func, "max_body", None) is None:
            @functools.wraps(func)
            def checked(*args, **kwargs):
                from .apifields import require_json_body  # noqa: PLC0415 (imports flask)

                require_json_body()
                return func(*args, **kwargs)
        else:
            checked = func

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            tf = _testflinger_auth()
            if tf is not None:
                authenticate, require_role = tf
                return authenticate(require_role(*roles)(checked))(*args, **kwargs)
            _fallback_authenticate()
            if str(g.role) not in roles:
                # Testflinger's require_role text, without the caller's role (it names none).
                abort(403, f"Specified action requires role: {', '.join(roles)}")
            return checked(*args, **kwargs)

        wrapper._role_requirements = list(roles)
        return wrapper

    return decorator


def current_role() -> str | None:
    """The role of the authenticated caller (after :func:`require` ran), as a plain string."""
    role = getattr(g, "role", None)
    return None if role is None else str(getattr(role, "value", role))


def current_client() -> str | None:
    """The authenticated caller's Testflinger client id (``permissions.client_id`` of its token,
    ``g.client_id`` as Testflinger's ``authenticate`` sets it), or None (anonymous, or a token
    without one)."""
    client = getattr(g, "client_id", None)
    return client if isinstance(client, str) and client else None
