"""The per-process cache of accepted bearer tokens (server/tokencache.py) and its use by the
dispatch hook (server/dispatch.py ``served``): a cached verdict is used only for a token that was
accepted, under the same signing key, before its ``exp``; refused tokens are never cached; the
cache is bounded. Through the lab job service, a poll's answer with a warm cache is exactly the
answer without the plugin (Testflinger's ``authenticate`` decides from the token alone:
canonical/testflinger ``server/src/testflinger/api/auth.py``)."""

from __future__ import annotations

import time

import jwt
import pytest

from test_dispatch_auth import CALLERS, FENCED, FREE, KEY, ROUTES, Pair, snapshot, token
from testflinger_magic.server import auth, dispatch
from testflinger_magic.server.tokencache import VerifiedTokens

POLL = ROUTES["GET /v1/job"]


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def bearer(headers: dict) -> str:
    return headers["Authorization"][len("Bearer "):]


@pytest.fixture()
def tokens(monkeypatch):
    """A fresh cache in place of the process's, on a clock the test moves (starts at now)."""
    clock = Clock(time.time())
    cache = VerifiedTokens(size=8, max_age=300, clock=clock)
    monkeypatch.setattr(dispatch, "TOKENS", cache)
    return cache, clock


@pytest.fixture()
def counted(monkeypatch):
    """Count the lab job service's authentications (the hook's and the handler's)."""
    from testflinger_magic.lab import jobservice, jobservice_auth

    calls = []
    real = jobservice_auth._authenticate

    def spy():
        calls.append(1)
        return real()

    # The hook reaches it through jobservice (create_app's "authenticate"), the handlers' role
    # check through jobservice_auth, where it lives.
    monkeypatch.setattr(jobservice, "_authenticate", spy)
    monkeypatch.setattr(jobservice_auth, "_authenticate", spy)
    return calls


# ------------------------------------------------------------------ the cache itself


def test_hit_until_exp_then_gone():
    clock = Clock(1000.0)
    cache = VerifiedTokens(clock=clock)
    assert cache.put("k", "tok", ("agents", "agent", True), exp=1010)
    assert cache.get("k", "tok") == ("agents", "agent", True)
    clock.now = 1009.9
    assert cache.get("k", "tok") is not None
    clock.now = 1010.0  # at exp: never used (PyJWT would still accept within its leeway)
    assert cache.get("k", "tok") is None and len(cache) == 0


def test_other_key_or_other_token_never_hits():
    cache = VerifiedTokens(clock=Clock(1000.0))
    cache.put("key-1", "tok", ("c", "agent", True), exp=2000)
    assert cache.get("key-2", "tok") is None
    assert cache.get("key-1", "tok2") is None
    assert cache.get(None, "tok") is None
    assert not cache.put(None, "tok", ("c", "agent", True), exp=2000)


def test_max_age_and_clock_set_back():
    clock = Clock(1000.0)
    cache = VerifiedTokens(max_age=60, clock=clock)
    cache.put("k", "tok", "v", exp=5000)
    clock.now = 1061
    assert cache.get("k", "tok") is None  # older than max_age: verify again
    cache.put("k", "tok", "v", exp=5000)
    clock.now = 1000  # before it was stored: verify again
    assert cache.get("k", "tok") is None


def test_bad_exp_or_past_exp_is_not_stored():
    cache = VerifiedTokens(clock=Clock(1000.0))
    for exp in (None, "2000", True, 999, 1000):
        assert not cache.put("k", "tok", "v", exp=exp), exp
    assert len(cache) == 0


def test_bounded_lru():
    cache = VerifiedTokens(size=3, clock=Clock(1000.0))
    for i in range(3):
        cache.put("k", f"t{i}", i, exp=2000)
    assert cache.get("k", "t0") == 0  # t0 used: t1 is now the least recently used
    for i in range(3, 6):
        cache.put("k", f"t{i}", i, exp=2000)
        assert len(cache) == 3
    assert [cache.get("k", f"t{i}") for i in range(6)] == [None, None, None, 3, 4, 5]
    with pytest.raises(ValueError):
        VerifiedTokens(size=0)


# ------------------------------------------------------------------ through the hook


def test_second_poll_authenticates_once_and_is_gated_the_same(tokens, counted):
    cache, _ = tokens
    pair = Pair(oidc=False)
    headers = CALLERS["agent"]
    r = pair.call(pair.magic, POLL, headers, FENCED)
    assert r.status_code == 204 and len(cache) == 1
    assert len(counted) == 1  # fenced: the hook authenticated, the handler never ran
    counted.clear()
    before = snapshot(pair.db)
    r = pair.call(pair.magic, POLL, headers, FENCED)  # cached: still refused by the gate
    assert r.status_code == 204 and snapshot(pair.db) == before and not counted
    r = pair.call(pair.magic, POLL, headers, FREE)  # cached: the handler authenticates, once
    assert r.status_code == 200 and r.get_json()["job_id"] and len(counted) == 1


def test_expired_token_is_refused_even_if_cached(tokens):
    cache, clock = tokens
    cache.max_age = 10 ** 6  # only its exp may end the entry here
    pair = Pair(oidc=False)
    expired = token("agent", ttl=-3600)
    # As if it had been accepted while it was valid, two hours ago on this clock.
    exp = jwt.decode(bearer(expired), options={"verify_signature": False})["exp"]
    clock.now = exp - 60
    assert cache.put(KEY, bearer(expired), ("agent-client", "agent", True), exp)
    assert cache.get(KEY, bearer(expired)) is not None
    clock.now = time.time()
    want = pair.call(pair.plain, POLL, expired, FREE)
    assert want.status_code == 401
    before = snapshot(pair.db)
    for agent in (FENCED, FREE):
        got = pair.call(pair.magic, POLL, expired, agent)
        assert (got.status_code, got.get_json()) == (want.status_code, want.get_json())
    assert snapshot(pair.db) == before and len(cache) == 0


def test_token_of_another_key_never_hits(tokens):
    cache, _ = tokens
    pair = Pair(oidc=False)
    good = CALLERS["agent"]
    assert pair.call(pair.magic, POLL, good, FENCED).status_code == 204
    assert len(cache) == 1
    forged = {"Authorization": "Bearer " + auth.issue_token("other-key-" * 4, "agent-client",
                                                            "agent")}
    want = pair.call(pair.plain, POLL, forged, FREE)
    assert want.status_code == 403
    got = pair.call(pair.magic, POLL, forged, FENCED)
    assert (got.status_code, got.get_json()) == (want.status_code, want.get_json())
    assert len(cache) == 1  # refused: not cached
    # The server's key rotated: the cached token is no longer accepted, exactly as without us.
    for app in (pair.magic, pair.plain):
        app.config["JWT_SIGNING_KEY"] = "rotated-key-" * 3
    want = pair.call(pair.plain, POLL, good, FREE)
    assert want.status_code == 403
    before = snapshot(pair.db)
    got = pair.call(pair.magic, POLL, good, FENCED)
    assert (got.status_code, got.get_json()) == (want.status_code, want.get_json())
    assert snapshot(pair.db) == before and len(cache) == 1  # the old entry, unreachable


@pytest.mark.parametrize("oidc", [False, True])
def test_warm_cache_keeps_the_refusal_matrix(tokens, oidc):
    """Every caller polls twice (the second time its token is cached if it was accepted): each
    answer is Testflinger's own, fenced or not, and nothing is written."""
    cache, _ = tokens
    pair = Pair(oidc)
    for caller, headers in sorted(CALLERS.items()):
        if caller == "agent":
            continue
        want = pair.call(pair.plain, POLL, headers, FREE)
        before = snapshot(pair.db)
        for agent in (FENCED, FREE, FENCED):
            got = pair.call(pair.magic, POLL, headers, agent)
            assert (got.status_code, got.get_json(silent=True)) == \
                (want.status_code, want.get_json(silent=True)), (caller, agent)
        assert snapshot(pair.db) == before, caller
    # Only accepted tokens (the contributor, manager, admin ones) were cached.
    assert len(cache) == 3
