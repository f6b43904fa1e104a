"""The MongoDB handle the plugin and the lab use.

In production this is Testflinger's own database (``testflinger.database.mongo.db``, a pymongo
``Database``). With no URI (embedded lab, tests) it is a mongomock database behind one
process-wide lock: mongomock is not thread-safe (eight threads doing ``find_one_and_update`` claims
double-claimed documents and raised "dictionary changed size during iteration"), and the lab's
HTTP servers are threaded.

Code that uses the database must stick to the subset that behaves the same on both:
``find(filter, projection, sort=..., limit=...)`` (iterate the result; the locked variant returns a
list), ``find_one``, ``insert_one``, ``update_one``, ``update_many``, ``find_one_and_update``,
``delete_one``, ``delete_many``, ``count_documents``, ``create_index``, ``distinct``,
``replace_one``. Atomic single-document operations are the only concurrency primitive.
"""

from __future__ import annotations

import functools
import threading

import bson
import pymongo

try:  # the lab's and the tests' in-memory database ([lab] extra); not needed inside Testflinger
    import mongomock
except ImportError:  # pragma: no cover - a server-only install (pip install testflinger-magic)
    mongomock = None

_LOCK = threading.RLock()

#: Keyword arguments of collection methods that pymongo sends as BSON (the rest, e.g.
#: ``session`` or ``return_document``, are options of the client).
_BSON_KWARGS = frozenset({"filter", "update", "projection", "replacement", "document",
                          "documents", "sort", "array_filters", "pipeline"})
#: Methods whose arguments are not BSON values themselves (bulk_write's operation objects).
_NOT_ENCODED = frozenset({"bulk_write", "with_options", "watch"})


def _encode_like_pymongo(args, kwargs) -> None:
    """Encode a call's filter, update, documents... to BSON, as pymongo does before anything
    reaches the server (``bson.encode``, in C): a value it cannot encode raises there and
    nothing is written (``UnicodeEncodeError`` for a ``str`` holding an unpaired UTF-16
    surrogate, e.g. JSON's ``"\\ud800"``; ``bson.errors.InvalidDocument`` for a ``set``).
    mongomock would apply what it can: an update's ``$set`` field by field, half a write
    (TRIAL12 F2)."""
    body = {"args": list(args)}
    for key, value in kwargs.items():
        if key in _BSON_KWARGS:
            body[key] = value
    bson.encode(body)


def _locked(fn, name: str = ""):
    encode = name not in _NOT_ENCODED

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if encode and (args or kwargs):
            _encode_like_pymongo(args, kwargs)
        with _LOCK:
            result = fn(*args, **kwargs)
            # Cursors are lazy: materialise them while holding the lock.
            if mongomock is not None and isinstance(result, mongomock.collection.Cursor):
                return list(result)
            return result

    return wrapper


class LockedCollection:
    """A mongomock collection whose every method runs under the process-wide lock."""

    def __init__(self, coll):
        self._coll = coll

    def __getattr__(self, name):
        attr = getattr(self._coll, name)
        if callable(attr):
            # Wrapped once per handle (mongomock's bound methods do not change), so code that
            # keeps a collection handle (as it would a pymongo Collection) pays the wrapping once.
            attr = self.__dict__[name] = _locked(attr, name)
        return attr

    def __getitem__(self, name):  # sub-collections, e.g. fs.files
        return LockedCollection(self._coll[name])

    @property
    def name(self):
        return self._coll.name


class LockedDatabase:
    """A mongomock database handing out :class:`LockedCollection` objects."""

    def __init__(self, database):
        self._db = database
        self.name = database.name

    def __getitem__(self, name) -> LockedCollection:
        return LockedCollection(self._db[name])

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def list_collection_names(self):
        with _LOCK:
            return self._db.list_collection_names()


def connect(uri: str | None = None, name: str = "testflinger_db",
            timeout: float | None = None):
    """Return a database handle.

    ``uri``: a MongoDB URI (``mongodb://host:27017/db``) for pymongo against a real server; the
    database named in the URI is used (as Testflinger's ``get_mongo_uri`` does), else ``name``.
    ``timeout``: seconds to find a server before an operation fails with
    ``pymongo.errors.ServerSelectionTimeoutError`` (pymongo's ``serverSelectionTimeoutMS``;
    default pymongo's 30 s). With ``uri`` None: a fresh in-memory mongomock database behind the
    process-wide lock (RuntimeError if mongomock, of the ``[lab]`` extra, is not installed).
    Raises ``pymongo.errors.InvalidURI``/``ConfigurationError`` for a bad URI.
    """
    if uri:
        extra = {} if timeout is None else {"serverSelectionTimeoutMS": int(timeout * 1000),
                                            "connectTimeoutMS": int(timeout * 1000)}
        client = pymongo.MongoClient(uri, **extra)
        try:
            return client.get_default_database()
        except pymongo.errors.ConfigurationError:
            return client[name]
    if mongomock is None:
        raise RuntimeError(
            "testflinger_magic.db.connect: no MongoDB URI, and mongomock (the in-memory database "
            "of the lab and the tests) is not installed: pip install 'testflinger-magic[lab]', "
            "or give a URI")
    return LockedDatabase(mongomock.MongoClient()[name])


#: Unique-index violations from pymongo, and from mongomock where it is installed.
DuplicateKeyErrors = (pymongo.errors.DuplicateKeyError,) + (
    (mongomock.DuplicateKeyError,) if mongomock is not None else ())


def is_duplicate_key(exc: BaseException) -> bool:
    """True if ``exc`` is a unique-index violation from pymongo or mongomock."""
    return isinstance(exc, DuplicateKeyErrors)
ReturnDocument = pymongo.ReturnDocument
