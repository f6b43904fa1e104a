"""The benchmarks' filter emulation (lab/mongofilter.py) answers as plain mongomock does, on
random documents and filters: it decides only exact conditions, and leaves the rest to
mongomock."""

from __future__ import annotations

from datetime import datetime

import mongomock
from bson import ObjectId
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mongomock import filtering

from testflinger_magic.lab import mongofilter, mongoindex

OIDS = [ObjectId(bytes([0, 0, 0, k]) + b"\x00" * 8) for k in range(1, 5)]
scalar = st.sampled_from(["a", "b", "", "1", 1, 0, 1.0, True, False, None,
                          datetime(2026, 1, 1), *OIDS])
value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=2), st.dictionaries(st.sampled_from(["x", "y"]), inner,
                                                 max_size=2)), max_leaves=4)


@st.composite
def documents(draw):
    doc = {"_id": draw(st.sampled_from([*OIDS, "s", 3]))}
    for name in draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3)):
        doc[name] = draw(value)
    return doc


fields = st.sampled_from(["a", "b", "c", "_id", "a.x", "a.y", "b.x.y", "zz"])
conditions = st.one_of(
    scalar,
    st.builds(lambda v: {"$in": v}, st.lists(scalar, max_size=3)),
    st.builds(lambda v: {"$in": v}, st.lists(st.sampled_from(["a", "b", "1"]), min_size=1,
                                             max_size=3)),
    st.builds(lambda op, v: {op: v}, st.sampled_from(["$gt", "$gte", "$lt", "$lte"]),
              st.sampled_from(OIDS + [1, "a"])),
    st.builds(lambda v, w: {"$gte": v, "$lt": w}, st.sampled_from(OIDS), st.sampled_from(OIDS)),
    st.builds(lambda v: {"$ne": v}, scalar),
    st.builds(lambda v: {"$exists": v}, st.booleans()),
    st.just({"$bogus": 1}),
    st.just({}),
    value)
leaf = st.builds(lambda f, c: {f: c}, fields, conditions)
filters = st.recursive(leaf, lambda inner: st.one_of(
    st.builds(lambda bs: {"$or": bs}, st.lists(inner, max_size=3)),
    st.builds(lambda bs: {"$and": bs}, st.lists(inner, max_size=3)),
    st.builds(lambda a, b: {**a, **b}, inner, inner)), max_leaves=5)


def _answer(flt, doc):
    try:
        return filtering.filter_applies(flt, doc)
    except Exception as exc:  # noqa: BLE001 - an error must be the same error
        return type(exc).__name__


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents(), flt=filters)
def test_same_answer_as_mongomock(doc, flt):
    plain = _answer(flt, doc)
    mongofilter.filter_like_index_bounds()
    try:
        emulated = _answer(flt, doc)
    finally:
        mongoindex.uninstall()
    assert emulated == plain


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(documents(), max_size=8, unique_by=lambda d: repr(d["_id"])),
       flt=filters)
def test_same_documents_from_a_collection(docs, flt):
    coll = mongomock.MongoClient().db.c
    for d in docs:
        coll.insert_one(dict(d))

    def found():
        try:
            return [d["_id"] for d in coll.find(flt)], coll.count_documents(flt)
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__

    plain = found()
    mongofilter.filter_like_index_bounds()
    try:
        emulated = found()
    finally:
        mongoindex.uninstall()
    assert emulated == plain


def test_the_tick_shapes_are_decided_here_and_others_are_not():
    """The shapes a tick's reads use are decided without mongomock (else the emulation would
    measure nothing), and an operator it does not know is left to mongomock."""
    doc = {"_id": OIDS[2], "name": "gpu-1", "state": "waiting", "fenced": True,
           "result_data": {"job_state": "running", "agent_id": "gpu-1-vm1"},
           "job_data": {"job_queue": "q"}}
    decided = [
        ({"name": {"$in": ["gpu-1", "gpu-2"]}}, True),
        ({"$or": [{"fenced": True}, {"paused": True}]}, True),
        ({"$or": [{"result_data.job_state": "waiting", "job_data.job_queue": {"$in": ["q", "r"]}},
                  {"result_data.job_state": {"$in": ["running", "setup"]},
                   "$or": [{"result_data.agent_id": {"$in": ["x", "y"]}},
                           {"job_id": {"$in": ["j1", "j2"]}}]},
                  {"_id": {"$gte": OIDS[3]}, "job_data.job_queue": {"$in": ["q", "r"]}}]}, False),
        ({"_id": {"$gte": OIDS[1]}, "job_data.job_queue": "q"}, True),
    ]
    for flt, expected in decided:
        assert mongofilter.decide(flt, doc) is expected, flt
        assert filtering.filter_applies(flt, doc) is expected
    for flt in ({"name": {"$regex": "gpu"}}, {"name": {"$ne": "x"}}, {"a": [1]},
                {"name": 5}, {"$where": "1"}):
        assert mongofilter.decide(flt, doc) is mongofilter.UNDECIDED, flt


def test_arrays_on_the_path_or_at_it_are_left_to_mongomock():
    """MongoDB matches a condition on ``a.x`` against every element of an array ``a`` (and a
    string condition against every element of an array value): never decided here."""
    cases = [({"a.x": "v"}, {"_id": 1, "a": [{"x": "w"}, {"x": "v"}]}),
             ({"a.x": {"$in": ["v", "u"]}}, {"_id": 1, "a": [{"x": "v"}]}),
             ({"a": "v"}, {"_id": 1, "a": ["w", "v"]}),
             ({"a": True}, {"_id": 1, "a": [False, True]}),
             ({"a.x.y": "v"}, {"_id": 1, "a": {"x": [{"y": "v"}]}})]
    for flt, doc in cases:
        assert mongofilter.decide(flt, doc) is mongofilter.UNDECIDED, flt
        assert filtering.filter_applies(flt, doc) is True
    mongofilter.filter_like_index_bounds()
    try:
        assert all(filtering.filter_applies(flt, doc) is True for flt, doc in cases)
    finally:
        mongoindex.uninstall()


def test_a_filter_changed_between_two_reads_is_worked_out_again():
    """The compiled filter is kept for one read only: a caller that changes the dict it reuses
    gets the new answer."""
    coll = mongomock.MongoClient().db.c
    coll.insert_many([{"_id": 1, "s": "a"}, {"_id": 2, "s": "b"}])
    flt = {"s": "a"}
    mongofilter.filter_like_index_bounds()
    try:
        assert [d["_id"] for d in coll.find(flt)] == [1]
        flt["s"] = "b"
        assert [d["_id"] for d in coll.find(flt)] == [2]
    finally:
        mongoindex.uninstall()
