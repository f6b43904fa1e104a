"""The benchmarks' index emulation (lab/mongoindex.py) gives plain mongomock's answers, in the
same order, on random documents, filters and writes: it only chooses which documents mongomock
tests, never whether one matches."""

from __future__ import annotations

from contextlib import contextmanager

import mongomock
import pytest
from bson import ObjectId
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testflinger_magic.lab import mongoindex

#: First keys the emulation may use here (as declared ones would be).
KEYS = {"jobs": frozenset({"job_id", "result_data.job_state", "job_data.job_queue"}),
        "magic_leases": frozenset({"state", "vms.agent_name", "device"})}

STATES = ["waiting", "running", "complete", None, 1, True]
QUEUES = ["q1", "q2", "q3"]
OIDS = [ObjectId(bytes([0, 0, 0, k]) + b"\x00" * 8) for k in range(1, 6)]

scalar = st.sampled_from(["waiting", "running", "complete", "q1", "q2", "x", 0, 1, True, False,
                          None, 1.0])
value_or_shape = st.one_of(scalar, st.lists(scalar, max_size=2),
                           st.fixed_dictionaries({"a": scalar}))


@st.composite
def documents(draw):
    doc = {"_id": draw(st.sampled_from(OIDS + ["s1", "s2", 7]))}
    if draw(st.booleans()):
        doc["job_id"] = draw(st.sampled_from(["j1", "j2", "j3"]))
    rd = draw(st.one_of(st.none(), st.just("flat"), st.fixed_dictionaries(
        {}, optional={"job_state": value_or_shape, "agent_id": st.sampled_from(["a1", "a2"])}),
        st.lists(st.fixed_dictionaries({"job_state": scalar}), max_size=2)))
    if rd is not None:
        doc["result_data"] = rd
    if draw(st.booleans()):
        doc["job_data"] = {"job_queue": draw(value_or_shape)}
    if draw(st.booleans()):
        doc["state"] = draw(scalar)
    if draw(st.booleans()):
        doc["vms"] = draw(st.lists(st.fixed_dictionaries({"agent_name": scalar}), max_size=3))
    return doc


def leaf_filters():
    field = st.sampled_from(["job_id", "result_data.job_state", "job_data.job_queue", "state",
                             "vms.agent_name", "result_data.agent_id", "other"])
    cond = st.one_of(
        scalar, st.sampled_from(["j1", "j2", "a1"]),
        st.builds(lambda v: {"$in": v}, st.lists(scalar, max_size=4)),
        st.builds(lambda v: {"$ne": v}, scalar),
        st.builds(lambda v: {"$exists": v}, st.booleans()),
        st.builds(lambda v: {"$in": v}, st.lists(st.sampled_from(["j1", "j2", "j3"]), min_size=1,
                                                 max_size=3)))
    leaf = st.builds(lambda f, c: {f: c}, field, cond)
    id_range = st.builds(lambda op, v: {"_id": {op: v}},
                         st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), st.sampled_from(OIDS))
    ranges = st.dictionaries(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), scalar,
                             min_size=1, max_size=2)
    field_range = st.builds(lambda f, r: {f: r}, field, ranges)
    # a compound prefix: a first key's condition and a later key's range (COMPOUND)
    prefix = st.builds(lambda a, f, r: {**a, f: r}, leaf,
                       st.sampled_from(["job_data.job_queue", "result_data.agent_id",
                                        "vms.agent_name", "state"]), ranges)
    return st.one_of(leaf, id_range, field_range, prefix)


filters = st.recursive(
    leaf_filters(),
    lambda inner: st.one_of(
        st.builds(lambda bs: {"$or": bs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda bs: {"$and": bs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda a, b: {**a, **b}, inner, inner)),
    max_leaves=6)


def answers(coll, flt):
    try:
        return [d["_id"] for d in coll.find(flt)], coll.count_documents(flt)
    except Exception as exc:  # noqa: BLE001 - mongomock refusing a filter must refuse alike
        return type(exc).__name__


#: Compound indexes (their later keys narrow the candidates of a prefix), as declared ones.
COMPOUND = {"jobs": [("result_data.job_state", "job_data.job_queue"),
                     ("job_id", "result_data.agent_id", "other")],
            "magic_leases": [("vms.agent_name", "state"), ("state", "vms.agent_name")]}


def _install():
    mongoindex.index_like_in()
    mongoindex.index_like_id()
    mongoindex.index_like_fields(KEYS, COMPOUND)

def assert_same_with_the_emulation(replay):
    """``replay()`` (a fresh collection's reads and writes) gives the same answers on plain
    mongomock and with the index emulation installed."""
    seen_plain = replay()
    _install()
    try:
        seen = replay()
    finally:
        mongoindex.uninstall()
    assert seen == seen_plain


@contextmanager
def _tested(key: str = "_id"):
    """The emulations installed, and the list of ``doc[key]`` of every document mongomock's
    filter is tested on (the index's candidates) while the block runs."""
    from mongomock import collection, filtering

    tested: list = []
    original = filtering.filter_applies

    def counting(flt, doc):
        if doc:
            tested.append(doc[key])
        return original(flt, doc)

    filtering.filter_applies = collection.filter_applies = counting
    try:
        _install()
        try:
            yield tested
        finally:
            mongoindex.uninstall()
    finally:
        filtering.filter_applies = collection.filter_applies = original


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(documents(), max_size=12, unique_by=lambda d: repr(d["_id"])),
       flts=st.lists(filters, min_size=1, max_size=4))
def test_same_answers_as_plain_mongomock(docs, flts):
    coll = mongomock.MongoClient().db.jobs
    for d in docs:
        coll.insert_one(dict(d))
    plain = [answers(coll, f) for f in flts]
    _install()
    try:
        emulated = [answers(coll, f) for f in flts]
    finally:
        mongoindex.uninstall()
    assert emulated == plain


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(documents(), min_size=1, max_size=10, unique_by=lambda d: repr(d["_id"])),
       updates=st.lists(st.tuples(st.one_of(st.just({}), filters), st.sampled_from(
           ["result_data.job_state", "job_data.job_queue", "state", "job_id"]), scalar),
           min_size=1, max_size=4),
       probe=filters)
def test_reads_after_writes_see_the_writes(docs, updates, probe):
    """Updates (in place in mongomock), inserts and deletes change what the maps say: every
    read after a write gives plain mongomock's answer on the same data."""
    def replay():
        coll = mongomock.MongoClient().db.magic_leases
        for d in docs:
            coll.insert_one(dict(d))
        seen = [answers(coll, probe)]
        for flt, field, value in updates:
            try:
                coll.update_many(flt, {"$set": {field: value}})
            except Exception:  # noqa: BLE001 - a filter mongomock refuses: skip that write
                pass
            seen.append(answers(coll, probe))
        coll.delete_one({})
        seen.append(answers(coll, probe))
        coll.insert_one({"_id": "late", "state": "waiting", "job_id": "j1"})
        seen.append(answers(coll, probe))
        return seen

    assert_same_with_the_emulation(replay)


def test_an_indexed_read_tests_only_the_candidates_and_uninstall_restores_the_scan():
    """The point of it: a read on an indexed first key tests the documents with that value only
    (the rest of the collection is never given to filter_applies); uninstalled, every one is."""
    from mongomock import collection, filtering

    coll = mongomock.MongoClient().db.jobs
    coll.insert_many([{"job_id": f"j{i}", "result_data": {"job_state": "complete"}}
                      for i in range(200)]
                     + [{"job_id": "w", "result_data": {"job_state": "waiting"}}])
    tested = []
    original = filtering.filter_applies

    def counting(flt, doc):
        if doc:
            tested.append(doc.get("job_id"))
        return original(flt, doc)

    filtering.filter_applies = collection.filter_applies = counting  # mongomock's scan: the
    try:                                                               # latter
        _install()
        try:
            assert [d["job_id"] for d in coll.find({"result_data.job_state": "waiting"})] == ["w"]
            assert tested == ["w"]
            tested.clear()
            assert coll.count_documents({"other": 1}) == 0  # not indexed: scanned
            assert len(tested) == 201
        finally:
            mongoindex.uninstall()
        tested.clear()
        assert [d["job_id"] for d in coll.find({"result_data.job_state": "waiting"})] == ["w"]
        assert len(tested) == 201
    finally:
        filtering.filter_applies = collection.filter_applies = original


def test_a_multikey_path_tests_only_the_documents_holding_the_value():
    """``vms.agent_name`` (an array of sub-documents, MongoDB's multikey index): a read of one
    VM agent's lease tests the leases holding that name, not every lease with VMs; and an
    update that renames a VM moves the document in the map."""
    coll = mongomock.MongoClient().db.magic_leases
    coll.insert_many([{"_id": f"l{i}", "vms": [{"agent_name": f"d{i}-vm1"},
                                                {"agent_name": f"d{i}-vm2"}]}
                      for i in range(100)])
    with _tested() as tested:
        flt = {"vms.agent_name": {"$in": ["d7-vm2", "d9-vm1"]}}
        assert [d["_id"] for d in coll.find(flt)] == ["l7", "l9"]
        assert sorted(tested) == ["l7", "l9"]
        coll.update_one({"_id": "l7"}, {"$set": {"vms.1.agent_name": "x"}})
        tested.clear()
        assert [d["_id"] for d in coll.find(flt)] == ["l9"]
        assert tested == ["l9"]
        assert [d["_id"] for d in coll.find({"vms.agent_name": "x"})] == ["l7"]


@pytest.mark.parametrize("flt", [
    {"job_data.job_queue": "q1"},                       # an array holding the value
    {"result_data.job_state": "waiting"},               # reached through an array
    {"state": {"$in": ["waiting", "x"]}},
    {"$or": [{"job_id": "j1"}, {"job_data.job_queue": "q2"}]},
    {"job_data.job_queue": {"a": 1}},                   # a sub-document: no index
    {"_id": {"$gte": OIDS[2]}},
])
def test_arrays_and_subdocuments_at_an_indexed_path(flt):
    coll = mongomock.MongoClient().db.jobs
    coll.insert_many([
        {"_id": OIDS[0], "job_data": {"job_queue": ["q1", "q2"]}},
        {"_id": OIDS[1], "result_data": [{"job_state": "running"}, {"job_state": "waiting"}]},
        {"_id": OIDS[2], "job_data": {"job_queue": {"a": 1}}, "state": ["waiting"]},
        {"_id": OIDS[3], "job_data": {"job_queue": "q1"}, "job_id": "j1", "state": "waiting"},
        {"_id": OIDS[4], "result_data": {"job_state": "waiting"}},
    ])
    plain = answers(coll, flt)
    assert plain[1] >= 1  # each filter matches something here
    _install()
    try:
        assert answers(coll, flt) == plain
    finally:
        mongoindex.uninstall()


def test_the_maps_follow_inserts_updates_deletes_and_drop():
    """MongoDB keeps an index with each write; so must the emulation: a value changed in place
    by an update (mongomock edits the stored document), a new document, a deleted one."""
    _install()
    try:
        coll = mongomock.MongoClient().db.magic_leases
        coll.insert_one({"_id": 1, "state": "a"})
        assert [d["_id"] for d in coll.find({"state": "a"})] == [1]  # the map is built
        coll.update_one({"_id": 1}, {"$set": {"state": "b"}})
        assert [d["_id"] for d in coll.find({"state": "b"})] == [1]
        assert list(coll.find({"state": "a"})) == []
        coll.find_one_and_update({"state": "b"}, {"$set": {"state": "c"}})
        assert [d["_id"] for d in coll.find({"state": {"$in": ["c", "x"]}})] == [1]
        coll.insert_many([{"_id": 2, "state": "c"}, {"_id": 3, "state": ["c", "d"]}])
        assert [d["_id"] for d in coll.find({"state": "c"})] == [1, 2, 3]
        coll.update_many({"state": "c"}, {"$unset": {"state": ""}})
        assert list(coll.find({"state": "c"})) == []
        coll.replace_one({"_id": 2}, {"state": "e"})
        coll.delete_one({"_id": 1})
        assert [d["_id"] for d in coll.find({"state": "e"})] == [2]
        coll.update_one({"_id": 9}, {"$set": {"state": "e"}}, upsert=True)
        assert [d["_id"] for d in coll.find({"state": "e"})] == [2, 9]
        coll.drop()
        coll.insert_one({"_id": 2, "state": "f"})
        assert [d["_id"] for d in coll.find({"state": "f"})] == [2]
        assert list(coll.find({"state": "e"})) == []
    finally:
        mongoindex.uninstall()


def test_a_few_candidates_of_many_come_in_mongomocks_order_after_writes():
    """Candidates that are a few of many documents are handed out in the store's order without
    a walk of it (lab/mongoindex ``_Index.in_order``), that order worked out again after every
    write: a document deleted and inserted again comes last, as in plain mongomock; an update
    in place keeps its place."""
    def reads(coll):
        coll.delete_one({"_id": 3})
        coll.insert_one({"_id": 3, "state": "a"})  # mongomock's store: now last
        first = [d["_id"] for d in coll.find({"state": "a"})]
        coll.update_one({"_id": 10}, {"$set": {"state": "a", "n": 1}})  # stays in place
        return first, [d["_id"] for d in coll.find({"state": "a"})]

    def filled():
        coll = mongomock.MongoClient().db.magic_leases
        coll.insert_many([{"_id": i, "state": "a" if i in (3, 7) else "b"} for i in range(20)])
        return coll

    plain = reads(filled())
    _install()
    try:
        coll = filled()
        assert [d["_id"] for d in coll.find({"state": "a"})] == [3, 7]  # the order worked out
        emulated = reads(coll)
    finally:
        mongoindex.uninstall()
    assert emulated == plain == ([7, 3], [7, 10, 3])


def test_ttl_expiry_runs_as_mongodbs_monitor_every_interval():
    """A TTL index's documents expire at the monitor's next pass (every ``interval`` s), as in
    MongoDB, not at each access; uninstalled, mongomock expires them at once again."""
    from datetime import datetime, timedelta, timezone

    coll = mongomock.MongoClient().db.magic_events
    coll.create_index("expire_at", expireAfterSeconds=0)
    past = datetime.now(timezone.utc) - timedelta(seconds=5)
    now = [100.0]
    mongoindex.ttl_like_mongodb(interval=60.0, clock=lambda: now[0])
    try:
        coll.insert_one({"_id": 1})
        coll.count_documents({})  # the monitor's pass
        coll.insert_one({"_id": 2, "expire_at": past})
        assert coll.count_documents({}) == 2  # expired, still there until the next pass
        now[0] += 59.0
        assert coll.count_documents({}) == 2
        now[0] += 1.0
        assert [d["_id"] for d in coll.find({})] == [1]
    finally:
        mongoindex.uninstall()
    coll.insert_one({"_id": 3, "expire_at": past})
    assert [d["_id"] for d in coll.find({})] == [1]


def test_a_compound_index_prefix_narrows_to_documents_in_bounds_on_every_key():
    """``jobs(result_data.job_state, job_data.job_queue)``: a read of one queue's waiting jobs
    tests that queue's waiting jobs, not every waiting job (an IXSCAN on both keys)."""
    coll = mongomock.MongoClient().db.jobs
    coll.insert_many([{"job_id": f"j{i}", "result_data": {"job_state": "waiting"},
                       "job_data": {"job_queue": f"q{i % 50}"}} for i in range(200)])
    with _tested("job_id") as tested:
        flt = {"result_data.job_state": "waiting", "job_data.job_queue": "q7"}
        assert [d["job_id"] for d in coll.find(flt)] == ["j7", "j57", "j107", "j157"]
        assert sorted(tested) == ["j107", "j157", "j57", "j7"]


def test_a_range_on_a_later_key_of_an_array_keeps_elements_meeting_each_bound():
    """``{"vms.agent_name": {"$gt": "m", "$lt": "c"}}`` matches, on MongoDB, a lease whose one
    VM name is after m and another before c (each bound by its own element, without
    $elemMatch); mongomock 4.x does not. The narrowing keeps such a lease a candidate either
    way, and mongomock's answer stands."""
    coll = mongomock.MongoClient().db.magic_leases
    coll.insert_many([{"_id": "l1", "state": "active",
                       "vms": [{"agent_name": "a"}, {"agent_name": "z"}]},
                      {"_id": "l2", "state": "active", "vms": [{"agent_name": "k"}]}])
    flt = {"state": "active", "vms.agent_name": {"$gt": "m", "$lt": "c"}}
    plain = answers(coll, flt)
    _install()
    try:
        assert answers(coll, flt) == plain
    finally:
        mongoindex.uninstall()


def test_a_range_on_a_later_key_narrows_to_the_documents_in_range():
    """``(result_data.job_state, job_data.job_queue)`` with a state and a range of queues (as
    the quick lend's ``(state, updated_at)`` read of leases written since its snapshot): only
    the documents in range are tested, and the answer is mongomock's."""
    coll = mongomock.MongoClient().db.jobs
    coll.insert_many([{"_id": f"j{i}", "job_id": f"j{i}", "result_data": {"job_state": "waiting"},
                       "job_data": {"job_queue": f"q{i}"}} for i in range(1, 10)]
                     + [{"_id": "x", "job_id": "x", "result_data": {"job_state": "waiting"},
                         "job_data": {"job_queue": 5}}])  # does not compare with a string
    flt = {"result_data.job_state": "waiting", "job_data.job_queue": {"$gte": "q7"}}
    plain = answers(coll, flt)
    assert plain == (["j7", "j8", "j9"], 3)
    with _tested("job_id") as tested:
        assert answers(coll, flt) == plain
        assert sorted(set(tested)) == ["j7", "j8", "j9", "x"]

MANY_OIDS = [ObjectId(bytes([0, 0, k // 256, k % 256]) + b"\x00" * 8) for k in range(40)]
id_ranges = st.dictionaries(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]),
                            st.sampled_from(MANY_OIDS), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.sampled_from(MANY_OIDS), unique=True, max_size=12),
       steps=st.lists(st.tuples(st.sampled_from(["insert", "delete", "read"]),
                                st.sampled_from(MANY_OIDS), id_ranges), min_size=1, max_size=8))
def test_an_id_range_over_objectids_follows_inserts_and_deletes(first, steps):
    """A range of ObjectId ``_id``s is answered by bisection of the sorted keys (the _id
    index); keys inserted or deleted between two reads are in (or out of) the next answer,
    in mongomock's order."""
    def replay():
        coll = mongomock.MongoClient().db.jobs
        for oid in first:
            coll.insert_one({"_id": oid, "job_data": {"job_queue": "q1"}})
        seen = []
        for kind, oid, rng in steps:
            if kind == "insert" and coll.count_documents({"_id": oid}) == 0:
                coll.insert_one({"_id": oid, "job_data": {"job_queue": "q2"}})
            elif kind == "delete":
                coll.delete_one({"_id": oid})
            seen.append([d["_id"] for d in coll.find({"_id": rng})])
            seen.append([d["_id"] for d in coll.find({"_id": rng, "job_data.job_queue": "q2"})])
        return seen

    assert_same_with_the_emulation(replay)
