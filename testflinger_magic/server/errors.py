"""The server plugin's domain errors; the HTTP layer (api.py) translates them to 403/404/409/422
with a ``message`` (409 also carries the current lease, 422 the ``field``)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors the HTTP layer translates."""


class NotFound(EngineError):
    """Unknown lease or device (404)."""


class Forbidden(EngineError):
    """The agent host does not own the device (403)."""


class Conflict(EngineError):
    """Stale generation/state or a refused claim (409); ``.lease`` is the current lease."""

    def __init__(self, message: str, lease: dict | None = None):
        super().__init__(message)
        self.lease = lease


class QueuesInUse(Conflict):
    """Applying would remove magic queues that still have waiting jobs (409): a job must never
    be stranded (nothing would ever serve it). ``.waiting`` is ``{queue: waiting jobs}``."""

    def __init__(self, waiting: dict[str, int]):
        listed = ", ".join(f"{q} ({n} waiting job{'' if n == 1 else 's'})"
                           for q, n in sorted(waiting.items()))
        super().__init__(f"refusing to remove magic queue(s) with waiting jobs: {listed}; keep "
                         "them in the file, or apply with force (CLI: apply --force) to remove "
                         "them and cancel those jobs")
        self.waiting = dict(waiting)


class Invalid(EngineError):
    """A well-formed body asking for something illegal (422); ``.field`` names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def invalid_reason(exc: Exception) -> str:
    """One line saying why a stored definition does not validate: ``field: message; ...`` for a
    pydantic ValidationError, the exception text otherwise."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
                             for e in errors(include_url=False))
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return f"{type(exc).__name__}: {exc}"
