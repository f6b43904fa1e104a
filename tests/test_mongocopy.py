"""The benchmarks' copy and cursor emulations (lab/mongocopy.py) give plain mongomock's documents,
in the same order, on random documents, projections and cursor bounds, and every returned
document stays independent of the store."""

from __future__ import annotations

import copy
from datetime import datetime

import mongomock
import pytest
from bson import Int64, ObjectId
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testflinger_magic.lab import mongocopy, mongoindex, mongosort

leaf = st.one_of(st.sampled_from(["a", "b", "", 0, 1, -3, 2.5, True, False, None]),
                 st.sampled_from([datetime(2026, 1, 2, 3, 4, 5, 6000), ObjectId(b"x" * 12),
                                  b"raw", Int64(7)]))
value = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "c", "state"]), inner, max_size=3)),
    max_leaves=8)


@st.composite
def documents(draw, i):
    doc = {"_id": i}
    for name in draw(st.lists(st.sampled_from(["a", "b", "vms", "history", "n"]), unique=True,
                              max_size=5)):
        doc[name] = draw(value)
    return doc


paths = st.sampled_from(["a", "b", "n", "vms", "history", "a.a", "a.b", "vms.a", "vms.state",
                         "history.state", "b.c"])


@st.composite
def projections(draw):
    kind = draw(st.sampled_from(["none", "empty", "include", "exclude"]))
    if kind == "none":
        return None
    if kind == "empty":
        return {}
    fields = draw(st.lists(paths, min_size=1, max_size=3, unique=True))
    proj = {f: (1 if kind == "include" else 0) for f in fields}
    if draw(st.booleans()):
        proj["_id"] = draw(st.sampled_from([0, 1]))
    op = draw(st.sampled_from([None, "slice", "elem"]))
    if op == "slice":
        proj["history"] = {"$slice": draw(st.sampled_from([-2, 1, [1, 2]]))}
    elif op == "elem":
        proj["vms"] = {"$elemMatch": {"state": draw(st.sampled_from(["a", 1, None]))}}
    return proj


def _read(coll, flt, proj, skip, limit, sort, steps):
    """The documents of one cursor, read as a caller would (iteration, ``next``, ``rewind``,
    ``clone``), or the exception mongomock raised."""
    try:
        cur = coll.find(flt, proj)
        if sort:
            cur = cur.sort(sort, 1)
        cur = cur.skip(skip).limit(limit)
        out = []
        if steps:  # a few next() first, a rewind, then iterate a clone and the cursor
            for _ in range(steps):
                out.append(next(cur, "end"))
            cur.rewind()
            out.append(list(cur.clone()))
        out.append(list(cur))
        return out
    except Exception as exc:  # noqa: BLE001 - mongomock refusing must refuse alike
        return type(exc).__name__


def _install(with_sort: bool = False):
    mongocopy.copy_like_driver()
    mongocopy.cursor_like_driver()
    if with_sort:  # its _get_dataset copies a read's documents with one plan (copier)
        mongosort.sort_natively()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), count=st.integers(0, 6), proj=projections(),
       skip=st.integers(0, 4), limit=st.integers(-3, 4),
       sort=st.sampled_from([None, "n", "_id"]), steps=st.integers(0, 3),
       with_sort=st.booleans())
def test_same_documents_as_plain_mongomock(data, count, proj, skip, limit, sort, steps,
                                           with_sort):
    docs = [data.draw(documents(i)) for i in range(count)]
    coll = mongomock.MongoClient().db.c
    for d in docs:
        coll.insert_one(copy.deepcopy(d))
    flt = data.draw(st.sampled_from([{}, {"_id": {"$gte": 2}}, {"a": "a"}]))
    plain = _read(coll, flt, copy.deepcopy(proj), skip, limit, sort, steps)
    _install(with_sort)
    try:
        emulated = _read(coll, flt, copy.deepcopy(proj), skip, limit, sort, steps)
    finally:
        mongoindex.uninstall()
    assert repr(emulated) == repr(plain)  # repr: types too (1 vs 1.0 vs True, Int64 vs int)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), count=st.integers(1, 6), proj=projections(),
       sort=st.sampled_from([None, "n", "_id"]))
def test_a_read_copied_with_one_plan_gives_plain_mongomocks_documents(data, count, proj, sort):
    """With the sort emulation installed too, a read's documents are copied with its projection
    worked out once (mongocopy's copier, lab/mongosort.py's _get_dataset): the projections it
    takes (inclusion or exclusion, no operator) give mongomock's documents."""
    if isinstance(proj, dict):
        proj = {k: v for k, v in proj.items() if not isinstance(v, dict)}
    docs = [data.draw(documents(i)) for i in range(count)]
    coll = mongomock.MongoClient().db.c
    for d in docs:
        coll.insert_one(copy.deepcopy(d))
    plain = _read(coll, {}, copy.deepcopy(proj), 0, 0, sort, 0)
    _install(with_sort=True)
    try:
        emulated = _read(coll, {}, copy.deepcopy(proj), 0, 0, sort, 0)
    finally:
        mongoindex.uninstall()
    assert repr(emulated) == repr(plain)


def _mutate(obj):
    """Change every container inside ``obj`` in place."""
    if isinstance(obj, dict):
        for v in list(obj.values()):
            _mutate(v)
        obj["mutated"] = True
    elif isinstance(obj, list):
        for v in obj:
            _mutate(v)
        obj.append("mutated")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), count=st.integers(1, 4), proj=projections(), with_sort=st.booleans())
def test_a_returned_document_changed_changes_nothing_stored(data, count, proj, with_sort):
    docs = [data.draw(documents(i)) for i in range(count)]
    coll = mongomock.MongoClient().db.c
    for d in docs:
        coll.insert_one(copy.deepcopy(d))
    _install(with_sort)
    try:
        try:
            first = list(coll.find({}, copy.deepcopy(proj)))
        except Exception:  # noqa: BLE001 - a projection mongomock refuses: nothing returned
            return
        for d in first:
            _mutate(d)
        again = list(coll.find({}))
    finally:
        mongoindex.uninstall()
    assert again == docs


def test_uninstall_restores_mongomocks_own_functions():
    from mongomock import collection

    before = (collection._copy_field, collection.Collection._copy_only_fields,
              collection.Cursor.__next__)
    _install()
    assert (collection._copy_field, collection.Collection._copy_only_fields,
            collection.Cursor.__next__) != before
    mongoindex.uninstall()
    assert (collection._copy_field, collection.Collection._copy_only_fields,
            collection.Cursor.__next__) == before


def test_a_bad_projection_is_refused_as_mongomock_refuses_it_every_time():
    coll = mongomock.MongoClient().db.c
    coll.insert_one({"_id": 1, "a": {"b": 1}})
    bad = {"a": 1, "a.b": 1}  # a path collision
    with pytest.raises(Exception) as plain:
        list(coll.find({}, dict(bad)))
    _install()
    try:
        for _ in range(2):  # not memoised as a success
            with pytest.raises(type(plain.value)):
                list(coll.find({}, dict(bad)))
    finally:
        mongoindex.uninstall()


@pytest.mark.parametrize("proj", [None, {"a": 1}, {"b": 0}, {"a.c": 1}, {"_id": 0, "a": 1},
                                  {"a": {"$slice": 1}}, {"a": {"$elemMatch": {"c": 2}}, "b": 1}])
def test_each_projection_shape_returns_copies(proj):
    """The shapes a tick uses (whole, top-level include / exclude, dotted, operators), each
    once for sure: a returned array or sub-document is never the stored one."""
    coll = mongomock.MongoClient().db.c
    stored = {"_id": 1, "a": [{"c": 2}, {"c": 3}], "b": {"d": [1]}}
    coll.insert_one(copy.deepcopy(stored))
    _install()
    try:
        for d in coll.find({}, copy.deepcopy(proj)):
            _mutate(d)
        again = list(coll.find({}))
    finally:
        mongoindex.uninstall()
    assert again == [stored]
