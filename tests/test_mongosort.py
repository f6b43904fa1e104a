"""The benchmarks' sort emulation (lab/mongosort.py) gives plain mongomock's order, on random
documents and sorts: same-class values sorted natively, everything else by mongomock's key."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

import mongomock
from bson import ObjectId
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testflinger_magic.lab import mongoindex, mongosort

_OIDS = [ObjectId(bytes([i]) * 12) for i in range(4)]
# Few distinct values (ties: the sort must stay stable), of every class the emulation sorts
# natively and of those it leaves to mongomock (None, bool, lists, aware datetimes).
numbers = st.sampled_from([0, 1, -3, 2.5, 1.0, 7])
strings = st.sampled_from(["a", "b", "", "B", "é", "ab"])
times = st.sampled_from([datetime(2026, 1, 2, 3, 4, 5), datetime(2026, 1, 2),
                         datetime(2025, 12, 31, 23, 59)])
odd = st.sampled_from([None, True, False, [], [2, 1], ["b"], _OIDS[0],
                       datetime(2026, 1, 1, tzinfo=timezone.utc), {"x": 1}])
same_class = st.sampled_from(["number", "string", "time", "oid", "mixed"])


_CLASSES = {"number": numbers, "string": strings, "time": times, "oid": st.sampled_from(_OIDS)}


def _values(cls):
    """Values of one class, now and then an odd one among them (a bool among numbers, an aware
    datetime among naive ones, a None, a list...); ``mixed``: anything."""
    anything = st.one_of(numbers, strings, times, st.sampled_from(_OIDS), odd)
    if cls == "mixed":
        return anything
    return st.one_of(_CLASSES[cls], _CLASSES[cls], odd)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), count=st.integers(0, 8), cls_a=same_class, cls_b=same_class,
       keys=st.sampled_from([[("a", 1)], [("a", -1)], [("a", 1), ("b", -1)],
                             [("b", 1), ("a", 1)], [("a.x", 1)], [("$natural", -1)]]),
       missing=st.booleans())
def test_same_order_as_plain_mongomock(data, count, cls_a, cls_b, keys, missing):
    coll = mongomock.MongoClient().db.c
    for i in range(count):
        doc = {"_id": i, "a": data.draw(_values(cls_a)), "b": data.draw(_values(cls_b))}
        if missing and i == count - 1:
            del doc["a"]
        coll.insert_one(copy.deepcopy(doc))

    def read():
        try:
            return list(coll.find({}, sort=keys))
        except Exception as exc:  # noqa: BLE001 - mongomock refusing must refuse alike
            return type(exc).__name__

    plain = read()
    mongosort.sort_natively()
    try:
        emulated = read()
    finally:
        mongoindex.uninstall()
    assert repr(emulated) == repr(plain)


def test_the_tick_kind_of_sort_is_native_and_uninstall_restores_mongomock(monkeypatch):
    """A sort of same-class values (the open leases by ``created_at``) never calls mongomock's
    BSON comparison; uninstall gives mongomock's own ``_get_dataset`` back."""
    from mongomock import collection, filtering

    before = collection.Collection._get_dataset
    coll = mongomock.MongoClient().db.c
    coll.insert_many([{"_id": i, "created_at": float(10 - i)} for i in range(10)])
    mongosort.sort_natively()
    try:
        calls, compare = [], filtering.bson_compare
        monkeypatch.setattr(filtering, "bson_compare",
                            lambda *a, **k: calls.append(a) or compare(*a, **k))
        got = [d["_id"] for d in coll.find({}, sort=[("created_at", 1)])]
    finally:
        mongoindex.uninstall()
    assert got == list(range(9, -1, -1)) and calls == []
    assert collection.Collection._get_dataset is before
