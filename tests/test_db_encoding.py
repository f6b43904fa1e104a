"""The lab's database refuses what pymongo cannot encode, before writing anything, as pymongo
does (TRIAL12 F2: mongomock applied an update's ``$set`` field by field, so a quarantine whose
reason held an unpaired surrogate left the device quarantined with no reason)."""

from __future__ import annotations

import bson
import pytest

from testflinger_magic import db as dbmod


@pytest.fixture
def coll():
    database = dbmod.connect()
    database.things.insert_one({"_id": "d1", "quarantined": False, "reason": None})
    return database.things


def test_an_unencodable_update_writes_nothing(coll):
    with pytest.raises(UnicodeEncodeError):
        coll.update_one({"_id": "d1"}, {"$set": {"quarantined": True, "reason": "\ud800"}})
    assert coll.find_one({"_id": "d1"}) == {"_id": "d1", "quarantined": False, "reason": None}
    with pytest.raises(UnicodeEncodeError):
        coll.find_one_and_update({"_id": "d1"}, {"$set": {"quarantined": True, "x": ["\udfff"]}})
    with pytest.raises(UnicodeEncodeError):
        coll.insert_one({"_id": "d2", "reason": "a\ud800b"})
    with pytest.raises(bson.errors.InvalidDocument):  # a set is no BSON value either
        coll.update_one({"_id": "d1"}, {"$set": {"tags": {"a", "b"}}})
    assert coll.find_one({"_id": "d1"}) == {"_id": "d1", "quarantined": False, "reason": None}
    assert coll.count_documents({}) == 1


def test_a_read_with_an_unencodable_filter_raises_as_pymongo_does(coll):
    with pytest.raises(UnicodeEncodeError):
        coll.find_one({"_id": {"$in": ["\ud800"]}})
    # Encodable calls are unchanged: options that are not BSON pass.
    assert coll.find_one({"_id": "d1"}, {"quarantined": 1}) == {"_id": "d1", "quarantined": False}
    assert coll.find_one_and_update({"_id": "d1"}, {"$set": {"reason": "ok"}},
                                    return_document=dbmod.ReturnDocument.AFTER)["reason"] == "ok"


def test_a_body_string_that_is_not_text_is_422_naming_it_after_authentication(magic):
    """TRIAL12 F2: ``"\\ud800"`` is valid JSON but no text; every route that stored it was a 500
    (and, on the lab's database, a half-written quarantine). Now 422 naming the field, nothing
    written; a caller Testflinger refuses still gets its 403 first."""
    import requests

    from test_server_api import register

    assert register(magic).status_code == 200
    raw = {"Content-Type": "application/json"}
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                      headers={**raw, **magic.headers("admin")},
                      data='{"reason": "fan \\ud800"}', timeout=10)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["json"] == {"reason": [
        "holds an unpaired UTF-16 surrogate (e.g. \\ud800), which is not text"]}
    device = magic.db.magic_devices.find_one({"_id": "gpu-host-01"})
    assert not device["quarantined"] and device["quarantine_reason"] is None
    r = requests.post(f"{magic.url}/v1/magic/agent-hosts/host-a/heartbeat",
                      headers={**raw, **magic.headers("agent")},
                      data='{"leases": ["ok", "\\udfff"]}', timeout=10)
    assert r.status_code == 422 and "leases.1" in r.json()["detail"]["json"], r.text
    # Control characters (TRIAL14 F2: NUL and ESC reached operators' terminals); tab and
    # line breaks are text.
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                      headers={**raw, **magic.headers("admin")},
                      data='{"reason": "nul\\u0000 \\u001b[31mRED"}', timeout=10)
    assert r.status_code == 422, r.text
    assert "control character U+0000" in r.json()["detail"]["json"]["reason"][0], r.text
    r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                      headers={**raw, **magic.headers("admin")},
                      data='{"reason": "fan\\tbroken\\nline two"}', timeout=10)
    assert r.status_code == 200, r.text
    # Authentication first: no token, a contributor, or an unparsable body from them: 403.
    for headers, data in (({}, '{"reason": "\\ud800"}'),
                          (magic.headers("contributor"), '{"reason": "\\ud800"}'),
                          (magic.headers("contributor"), "not json")):
        r = requests.post(f"{magic.url}/v1/magic/devices/gpu-host-01/quarantine",
                          headers={**raw, **headers}, data=data, timeout=10)
        assert r.status_code == 403, r.text
    r = requests.post(f"{magic.url}/v1/magic/agent-hosts/host-a/heartbeat", headers=raw,
                      data="not json", timeout=10)
    assert r.status_code == 403, r.text
