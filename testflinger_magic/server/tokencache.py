"""A small per-process cache of bearer tokens Testflinger's authentication accepted.

Why: the dispatch hook must know whether Testflinger would serve a ``GET /v1/job`` caller before
its handler runs (dispatch.served), and Testflinger's handler then authenticates the same token
again. Verifying an HS256 JWT twice doubled the cost of every poll; with this cache the hook
verifies a token once per process (per ``MAX_AGE``), and every later poll with it costs a lookup.

Why a cached verdict equals a fresh one (canonical/testflinger ``server/src/testflinger/api/
auth.py``): ``authenticate`` decides from the ``Authorization`` header alone, with
``decode_jwt_token(token, os.environ["JWT_SIGNING_KEY"])`` (``jwt.decode``, HS256, leeway
``JWT_LEEWAY``, requiring ``exp``, ``iat``, ``sub``) and sets ``g.client_id``, ``g.role``,
``g.permissions`` from the token's ``permissions`` claim; it reads nothing from the database (the
database is read only when a token is *issued*: ``validate_client_key_pair``, refresh tokens, and
for job submission's ``check_queue_restriction``, none of which is cached here). So the verdict is
a function of (token, signing key, time), and time only matters through ``exp`` (PyJWT refuses a
token once ``exp <= now - leeway``), ``iat``/``nbf`` (refused while ``> now + leeway``, so a token
accepted at ``t`` stays accepted for every later ``now``). Hence an entry is used only

* for a token that was *accepted* (refusals are never cached: they get Testflinger's own answer,
  from its own code, every time),
* with the same signing key (the lookup key is HMAC-SHA256(signing key, token): another key, or a
  rotated one, never finds the entry; neither the token nor the key is stored),
* while ``stored_at <= now < exp`` (strictly before ``exp``: earlier than Testflinger's own
  ``exp + leeway``, after which a fresh verification answers; a clock set back before
  ``stored_at`` also re-verifies), and never more than ``MAX_AGE`` seconds after it was stored.

Bounded: at most ``size`` entries, least recently used evicted first.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict
from typing import Callable

#: Entries kept (one per live token: about one per agent and per client; ~200 bytes each).
SIZE = 4096
#: Seconds an entry is trusted at most (Testflinger's access tokens live 600 s).
MAX_AGE = 300.0


class VerifiedTokens:
    """LRU of ``HMAC(key, token) -> (verdict, exp, stored_at)``.

    ``size``: entries kept (>= 1); ``max_age``: seconds; ``clock() -> epoch seconds`` (the same
    clock PyJWT checks ``exp`` against: ``time.time``). Thread-safe. Raises ``ValueError`` on a
    ``size`` below 1 or a negative ``max_age``."""

    def __init__(self, size: int = SIZE, max_age: float = MAX_AGE,
                 clock: Callable[[], float] = time.time):
        if size < 1 or max_age < 0:
            raise ValueError(f"VerifiedTokens: size {size!r} must be >= 1 and max_age "
                             f"{max_age!r} >= 0")
        self.size, self.max_age, self.clock = size, max_age, clock
        self._entries: OrderedDict[bytes, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _slot(key: str, token: str) -> bytes:
        return hmac.digest(key.encode(), token.encode(), "sha256")

    def get(self, key: str | None, token: str):
        """The verdict stored for ``token`` under signing key ``key``, or None (not stored, stored
        under another key, expired, too old, or the clock went back). Never raises for a
        ``key`` of None (no key: nothing is ever cached)."""
        if not key:
            return None
        slot = self._slot(key, token)
        now = self.clock()
        with self._lock:
            entry = self._entries.get(slot)
            if entry is None:
                return None
            verdict, exp, stored_at = entry
            if not stored_at <= now < exp or now - stored_at > self.max_age:
                del self._entries[slot]
                return None
            self._entries.move_to_end(slot)
            return verdict

    def put(self, key: str | None, token: str, verdict, exp) -> bool:
        """Store ``verdict`` for ``token`` (which the caller's authentication just *accepted*
        under ``key``) until ``exp`` (the token's own ``exp`` claim, epoch seconds). Nothing is
        stored without a key or with an ``exp`` that is not a number. Returns whether stored."""
        if not key or isinstance(exp, bool) or not isinstance(exp, (int, float)):
            return False
        slot = self._slot(key, token)
        now = self.clock()
        if now >= exp:
            return False
        with self._lock:
            self._entries[slot] = (verdict, float(exp), now)
            self._entries.move_to_end(slot)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return True

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()
