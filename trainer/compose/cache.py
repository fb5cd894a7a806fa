"""A content-addressed cache of Hydra compositions, so that composing a run again costs a file read.

An entry is keyed (sha256) by every input the composition read that the bundle can name: the files of the
config tree (:func:`tree_digest`: symbolic links followed, as Hydra follows them, each directory once), the
structured schema registered beside it (:mod:`trainer.compose.schema`), the overrides, the Hydra and OmegaConf
versions, the Python environment they are imported from (``sys.executable``, ``sys.path``), the working directory
(Hydra records it as ``hydra.runtime.cwd``) and whether Hydra's own ``hydra`` node is kept. A composition that
read anything else is not stored (:func:`cacheable`): config sources beyond the tree and Hydra's own package
(``hydra.searchpath``), environment variables copied into the job (``hydra.job.env_copy``), secrets (an override
of a secret-named key; a value :class:`trainer.redact.Redactor` learns from the overrides, or its patterns find in
any key or string value of the composition, list elements included); nor one whose tree changed while Hydra
composed it. Only compositions that succeeded are stored; a bad override always meets Hydra itself, so its error
line is Hydra's.

An entry is data, never code: the composition's node tree as JSON (:func:`to_data`: per node its OmegaConf class,
key, flags, optional flag, reference, object, key and element types, and its value or children, interpolations
and ``???`` as the strings they are), which :func:`from_data` builds back into the same ``DictConfig`` (the same
YAML, flags, struct and read-only modes and structured types: the dataclasses of :mod:`trainer.compose.schema` and
of Hydra's ``hydra`` node). Types are named, not pickled: only builtin value types, ``typing`` containers, and
dataclasses and enums of ``trainer.compose.schema`` and Hydra's own modules are named or looked up; a composition
holding anything else is not stored. What a caching resolver remembered while Hydra composed (the time of
``${now:...}``) is not in the entry: it is resolved when the run reads it, as for a fresh composition.

An entry is this user's own statement: ``FORMAT``, then an HMAC-SHA256 (kind :data:`MAC_KIND`, the format, the
entry's key and the payload's sha256) under this user's cache key (:func:`trainer.image.stampkey.stamp_key`, the key of
the image cache's stamps and layer records, ``$XDG_CONFIG_HOME/recipe-bundle/cache-stamp.key``; its own kind, so
that no layer record or stamp MAC verifies as an entry), then the payload. It is written atomically (mode 0600
whatever the umask, in a directory of this user's that only they may write, made 0700 when the cache makes it; a
directory that group or others may write, or another user's, is not used, never chmodded, nothing in it
removed). Reading opens the entry without following a link and without blocking, and takes only a regular file of
at most :data:`MAX_ENTRY_BYTES` (checked before any byte is read) that this user owns and no one else may write,
whose MAC verifies under the key of its own name. Anything else (absent, forged without the key, edited,
truncated, renamed from another key, oversized, a FIFO, a link, foreign, an older format) is a miss: the
composition is made by Hydra again and the entry written again. Where the key cannot be read back from its file
(not a regular file of 32 bytes that only this user may read and write; a configuration directory that cannot be
written, where :func:`trainer.image.stampkey.stamp_key` falls back to a key of one process), nothing is read or stored.
When the cache next writes, it removes the entries older formats left (``KEY.composition``: pickles, never read),
whatever bears an entry's name but is not a 0600 regular file (a link, a FIFO), and temporary files of writers
killed over an hour before; only those names (:data:`ENTRY_NAME`, :data:`TEMP_NAME`), never another file.

Location: ``$TRAINER_COMPOSE_CACHE`` if set (``~`` expanded, a relative path taken from the working directory;
``off``, ``0``, ``no`` or ``false``, in any case, turn the cache off), else
``$XDG_CACHE_HOME/recipe-bundle/compose`` (``~/.cache`` without XDG_CACHE_HOME). At most :data:`MAX_ENTRIES`
entries are kept; the least recently written go first.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import re
import stat
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.errors import UserError
from trainer.image import stampkey
from trainer.publish import atomic_file
from trainer.redact import Redactor, sets_secret

# Changing how entries are keyed or laid out changes this, so that old entries are never read as new ones.
FORMAT = b"recipe-bundle compose cache 4\n"
MAC_KIND = "compose-cache-entry"  # the MAC's kind (trainer.image.cas.Cache.mac): "stamp" and "layer" are others
MAX_ENTRIES = 512
MAX_ENTRY_BYTES = 4 << 20  # an entry of the recipe with its hydra node is about 60 KB
MAX_TREE_ENTRIES = 20_000  # names under conf/ the key reads (the bundle's tree has ~50): more is not cached
MAX_TREE_BYTES = 64 << 20  # bytes of the files under conf/ and the schema together (the bundle's: ~200 KB)
SUFFIX = ".composition.json"
LEGACY_SUFFIX = ".composition"  # format 3 and older: pickles, removed when the cache next writes
DEBRIS_AGE_S = 3600  # a temporary file of a killed writer older than this (seconds) is removed on writing
OFF = ("off", "0", "no", "false")  # values of TRAINER_COMPOSE_CACHE that turn the cache off (any case)
# The only names the cache writes, and so the only ones it removes (CompositionCache._prune): an entry (this format's
# KEY.composition.json, an older format's KEY.composition), and the temporary sibling atomic_file writes it through
# (".NAME." and mkstemp's 8 characters, trainer.publish.atomic_file).
ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.composition(\.json)?$")
TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\.composition(\.json)?\.[A-Za-z0-9_]{8}$")


def default_root() -> Path | None:
    """The cache directory (see the module docstring), or None when ``TRAINER_COMPOSE_CACHE=off``."""
    chosen = os.environ.get("TRAINER_COMPOSE_CACHE", "")
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recipe-bundle" / "compose"


class TooLarge(OSError):
    """A file, or the config tree, beyond what the cache reads (it is then not cached)."""


def _read_regular(path: Path, limit: int, follow: bool = True, private: bool = False) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (``private``: owned by this user,
    mode without group or other bits), read without ever blocking: opened ``O_NONBLOCK`` (a FIFO without a writer
    opens at once), ``fstat``-ed before any byte is read, and read while still non-blocking (a file of ``/proc``
    that would wait fails instead); ``follow`` false: a symbolic link is refused (``ELOOP``). Raises ``OSError``
    (:class:`TooLarge` for a file over ``limit``, ``EINVAL`` for one that is not regular or not private).

    (A private helper rather than :func:`trainer.inputs.open_regular`: that one turns blocking back on and
    follows links, and raises :class:`~trainer.errors.UserError`, which is no miss.)"""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or private and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            raise OSError(errno.EINVAL, "not a regular file of this user's alone", str(path))
        if info.st_size > limit:
            raise TooLarge(errno.EFBIG, f"more than {limit} bytes", str(path))
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # grew while read
                raise TooLarge(errno.EFBIG, f"more than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def tree_digest(conf_dir: Path, schema_file: Path) -> bytes:
    """sha256 over the config tree ``conf_dir`` as Hydra can see it, and the schema module's source
    ``schema_file``: what a composition reads from disk.

    The tree is walked depth-first in sorted order, symbolic links followed (as Hydra follows them), each directory at
    most once by ``(st_dev, st_ino)``: a directory met again (a second link to it, a link loop such as ``conf/model/loop
    -> ..``) is recorded as the path it was first met at, not walked, so the walk is linear in the tree (``__pycache__``
    directories included: Hydra lists configs in them too). Per name it records the relative path and the bytes of a
    regular file; a FIFO, socket or device (which Hydra does not list as a config) or a dangling link is recorded by its
    kind and never opened. Raises ``OSError`` when a name cannot be read, and :class:`TooLarge` beyond
    :data:`MAX_TREE_ENTRIES` names or :data:`MAX_TREE_BYTES` bytes: the tree is then not cached."""
    digest = hashlib.sha256()
    conf_dir = Path(conf_dir)
    top = os.stat(conf_dir)
    seen: dict[tuple[int, int], bytes] = {(top.st_dev, top.st_ino): b"."}
    budget = [MAX_TREE_ENTRIES, MAX_TREE_BYTES]

    def listing(path: str, rel: str) -> list[tuple[str, str]]:
        names = sorted(os.listdir(path))
        budget[0] -= len(names)
        if budget[0] < 0:
            raise TooLarge(errno.EFBIG, f"more than {MAX_TREE_ENTRIES} names", str(conf_dir))
        return [(os.path.join(path, name), f"{rel}/{name}" if rel else name) for name in names]

    stack = [iter(listing(str(conf_dir), ""))]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            continue
        path, rel = item
        name = os.fsencode(rel)
        try:
            info = os.stat(path)
        except OSError as ex:
            if ex.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            digest.update(name + b"\0dangling\0")
            continue
        if stat.S_ISDIR(info.st_mode):
            ident = (info.st_dev, info.st_ino)
            if ident in seen:
                digest.update(name + b"\0same directory as\0" + seen[ident] + b"\0")
                continue
            seen[ident] = name
            digest.update(name + b"\0directory\0")
            stack.append(iter(listing(path, rel)))
        elif stat.S_ISREG(info.st_mode):
            data = _read_regular(Path(path), budget[1])
            budget[1] -= len(data)
            digest.update(name + b"\0" + str(len(data)).encode() + b"\0" + data)
        else:
            digest.update(name + b"\0special " + str(stat.S_IFMT(info.st_mode)).encode() + b"\0")
    data = _read_regular(Path(schema_file), budget[1])
    digest.update(b"<schema>\0" + str(len(data)).encode() + b"\0" + data)
    return digest.digest()


def cacheable(composed: DictConfig, conf_dir: Path, overrides: Sequence[str]) -> bool:
    """Whether a composition made with its ``hydra`` node read nothing the key leaves out and holds no secret:
    its config sources are the tree ``conf_dir``, Hydra's own package and the structured configs; it copies no
    environment variable into the job (``hydra.job.env_copy``); no override sets a secret-named key
    (``+env.HF_TOKEN=...``, whatever the value's length); the redactor learns nothing from the overrides
    (``launcher.job=[x,'--hf-token=V']``), and, taught the overrides and this process's environment as ``train``
    teaches the run directory's redactor (``learn_env(os.environ)``: ``HF_TOKEN=V`` in the environment makes ``V``
    secret wherever the composition holds it), finds nothing in the composition's YAML nor in any key or string
    value on a line of its own, also as ``KEY: VALUE`` with the key it is under (list elements, where YAML may fold
    a long line, and the ``hydra`` node's record of the overrides included)."""
    hydra_node = composed.hydra
    if list(hydra_node.job.env_copy):
        return False
    for source in hydra_node.runtime.config_sources:
        kind = (source.schema, source.provider)
        if kind == ("file", "main") and os.path.abspath(source.path) == os.path.abspath(conf_dir):
            continue
        if kind in (("pkg", "hydra"), ("structured", "schema")):
            continue
        return False
    if any(sets_secret(o) for o in overrides):
        return False
    if Redactor().learn_overrides(overrides).known:
        return False
    redactor = Redactor().learn_overrides(overrides).learn_env(os.environ)  # as trainer.train learns the run's
    texts = [OmegaConf.to_yaml(composed)]  # as the old cache checked it; then each key and string on its own line
    stack: list[tuple[str | None, Any]] = [(None, OmegaConf.to_container(composed, resolve=False))]
    while stack:
        name, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                texts.append(str(key))
                stack.append((str(key), item))
        elif isinstance(value, list):
            stack += [(name, item) for item in value]
        elif isinstance(value, str):
            texts += [value, f"{name}: {value}"] if name is not None else [value]
    text = "\n".join(texts)  # one scrub: a pattern meeting the next line only finds more, never less
    return redactor.scrub(text) == text


# --- the composition as data -------------------------------------------------------------------------------


class Unstorable(ValueError):
    """A composition holding a node, value or type that :func:`to_data` does not name: it is not stored."""


def _node_classes() -> dict[str, type[Any]]:
    from omegaconf import nodes

    return {
        "D": DictConfig,
        "L": ListConfig,
        "A": nodes.AnyNode,
        "S": nodes.StringNode,
        "I": nodes.IntegerNode,
        "F": nodes.FloatNode,
        "B": nodes.BooleanNode,
        "E": nodes.EnumNode,
        "P": nodes.PathNode,
    }


_BUILTIN_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "bytes": bytes,
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "None": type(None),
    "Path": Path,
}
_MODULES = ("trainer.compose.schema",)  # and Hydra's own: hydra.*, hydra_plugins.*
# The modules a type may be looked up in that are imported for it when not yet imported (the structured configs of a
# composition: the schema, Hydra's hydra node); any other allowed module is looked up only when already imported.
_IMPORTABLE = (
    "trainer.compose.schema",
    "hydra.conf",
    "hydra.types",
    "hydra._internal.core_plugins.basic_launcher",
    "hydra._internal.core_plugins.basic_sweeper",
)


def _allowed_module(module: str) -> bool:
    """Whether types may be named in ``module``: :data:`_MODULES` or Hydra's own (``hydra.*``, ``hydra_plugins.*``)."""
    return module in _MODULES or module.startswith(("hydra.", "hydra_plugins."))


def _named_class(module: str, qualname: str) -> type:
    """The dataclass or enum ``module``:``qualname`` of :func:`_allowed_module`, defined there under that name
    (its ``__module__`` and ``__qualname__`` are those: a name reaching another module through an attribute, such as
    ``re.enum.IntFlag``, is refused), no part of ``qualname`` private or dunder (``_``), looked up in a module
    already imported or one of :data:`_IMPORTABLE`; raises :class:`Unstorable`."""
    import dataclasses
    import importlib

    parts = qualname.split(".")
    if not _allowed_module(module) or not all(part and not part.startswith("_") for part in parts):
        raise Unstorable(f"type {module}:{qualname}")
    found: Any = sys.modules.get(module)
    if found is None and module in _IMPORTABLE:
        found = importlib.import_module(module)
    for part in parts:
        found = getattr(found, part, None)
    if (
        not isinstance(found, type)
        or not (dataclasses.is_dataclass(found) or issubclass(found, Enum))
        or found.__module__ != module
        or found.__qualname__ != qualname
    ):
        raise Unstorable(f"{module}:{qualname}")
    return found


class _Writer:
    """:func:`to_data`'s state: the table of types and of metadata, each named once."""

    def __init__(self) -> None:
        import typing

        self.typing = typing
        self.types: list[Any] = []
        self.type_index: dict[Any, int] = {}
        self.metas: list[list] = []
        self.meta_index: dict[str, int] = {}
        self.codes = {cls: code for code, cls in _node_classes().items()}

    def type_of(self, t: Any) -> int:
        try:
            return self.type_index[t]
        except KeyError:
            pass
        except TypeError:  # unhashable
            raise Unstorable(repr(t)) from None
        self.type_index[t] = index = len(self.types)
        self.types.append(None)
        self.types[index] = self.describe(t)
        return index

    def describe(self, t: Any) -> Any:
        typing = self.typing
        if t is None:
            return None
        if t is Any:
            return "Any"
        for name, builtin in _BUILTIN_TYPES.items():
            if t is builtin:
                return name
        origin = typing.get_origin(t)
        if origin is not None:
            generic = {dict: "Dict", list: "List", tuple: "Tuple", typing.Union: "Union"}.get(origin)
            args = typing.get_args(t)
            if generic is None or self.rebuild(generic, args) != t:  # list[int] is not typing.List[int]: not named
                raise Unstorable(repr(t))
            return [generic, *(self.type_of(a) for a in args)]
        if isinstance(t, type) and _allowed_module(t.__module__) and _named_class(t.__module__, t.__qualname__) is t:
            return f"{t.__module__}:{t.__qualname__}"
        raise Unstorable(repr(t))

    def rebuild(self, name: str, args: tuple) -> Any:
        """The ``typing`` generic ``name`` (Dict, List, Tuple, Union) of ``args`` (bare without them)."""
        typing = self.typing
        base = {"Dict": typing.Dict, "List": typing.List, "Tuple": typing.Tuple, "Union": typing.Union}[name]
        return base[args] if args else base

    def meta(self, node: Any, container: bool) -> int:
        from omegaconf.base import ContainerMetadata, Metadata

        m = node._metadata
        if type(m) is not (ContainerMetadata if container else Metadata):
            raise Unstorable(type(m).__name__)
        flags = m.flags or {}
        if not all(isinstance(k, str) and v in (True, False, None) for k, v in flags.items()):
            raise Unstorable("flags")
        record = [self.type_of(m.ref_type), self.type_of(m.object_type), bool(m.optional), flags, bool(m.flags_root)]
        if isinstance(m, ContainerMetadata):  # a container's (its type was checked above)
            record += [self.type_of(m.key_type), self.type_of(m.element_type)]
        text = json.dumps(record, sort_keys=True)
        index = self.meta_index.get(text)
        if index is None:
            self.meta_index[text] = index = len(self.metas)
            self.metas.append(record)
        return index

    def value(self, v: Any) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        if isinstance(v, Enum):
            return ["enum", self.type_of(type(v)), v.name]
        if isinstance(v, Path):
            return ["path", str(v)]
        raise Unstorable(type(v).__name__)

    def node(self, node: Any) -> list:
        code = self.codes.get(type(node))
        if code is None:
            raise Unstorable(type(node).__name__)
        state = node.__dict__
        container = code in "DL"
        expected = {"_metadata", "_parent", "_flags_cache", "_content" if container else "_val"}
        if code == "E":
            expected |= {"enum_type", "fields"}
        if set(state) != expected:
            raise Unstorable(f"{type(node).__name__} state {sorted(state)}")
        record = [code, self.meta(node, container), self.value(node._metadata.key)]
        if not container:
            record.append(self.value(state["_val"]))
            if code == "E":
                record.append(self.type_of(state["enum_type"]))
            return record
        content = state["_content"]
        if content is None or isinstance(content, str):
            record.append(content)
        elif code == "D" and isinstance(content, dict):
            record.append([[self.value(k), self.node(child)] for k, child in content.items()])
        elif code == "L" and isinstance(content, list):
            record.append([self.node(child) for child in content])
        else:
            raise Unstorable(f"{type(node).__name__} content {type(content).__name__}")
        return record


def to_data(cfg: DictConfig) -> dict:
    """``cfg`` (a composition, interpolations unresolved) as JSON-ready data: ``{"types": [...], "metas": [...],
    "root": node}`` where a node is ``[class code, metadata index, key, value or children (, enum type)]``. Raises
    :class:`Unstorable` for anything it cannot name (see the module docstring)."""
    if not isinstance(cfg, DictConfig) or cfg._get_parent() is not None:
        raise Unstorable("not a root DictConfig")
    writer = _Writer()
    root = writer.node(cfg)
    return {"types": writer.types, "metas": writer.metas, "root": root}


def from_data(data: Any) -> DictConfig:
    """The ``DictConfig`` that :func:`to_data` described: nodes made as pickle makes them (their state set, parents
    linked, the resolver cache empty). Raises ``ValueError`` (:class:`Unstorable`), ``TypeError``, ``KeyError``,
    ``IndexError`` or ``AttributeError`` for data that is not such a description."""
    from omegaconf.base import ContainerMetadata, Metadata

    if not isinstance(data, dict) or set(data) != {"types", "metas", "root"}:
        raise Unstorable("not a composition")
    classes = _node_classes()
    rebuild = _Writer().rebuild
    described: list[Any] = data["types"]
    types: list[Any] = [None] * len(described)
    made = [0] * len(described)  # 0: not yet, 1: being made, 2: made

    def type_at(index: Any) -> Any:
        if type(index) is not int or not 0 <= index < len(described):
            raise Unstorable(f"type {index!r}")
        if made[index] == 1:  # a description referring to itself, directly or not (List of itself)
            raise Unstorable(f"type {index} refers to itself")
        if not made[index]:
            made[index] = 1
            d = described[index]
            t: Any
            if d is None:
                t = None
            elif d == "Any":
                t = Any
            elif isinstance(d, str) and d in _BUILTIN_TYPES:
                t = _BUILTIN_TYPES[d]
            elif isinstance(d, str) and ":" in d:
                t = _named_class(*d.split(":", 1))
            elif isinstance(d, list) and d and d[0] in ("Dict", "List", "Tuple", "Union"):
                t = rebuild(d[0], tuple(type_at(a) for a in d[1:]))
            else:
                raise Unstorable(f"type {d!r}")
            types[index], made[index] = t, 2
        return types[index]

    metas = data["metas"]

    checked: dict[tuple[int, bool], tuple[type, dict[str, Any]]] = {}

    def metadata(index: Any, key: Any, container: bool) -> Any:
        """The metadata of table entry ``index`` for a node of ``key``: the entry is checked (and made once, through
        its dataclass's own checks); each node's is then a copy with its key, its own flags and an empty resolver
        cache, made as pickle makes it (its fields set, no ``__post_init__``)."""
        found = checked.get((index, container)) if type(index) is int else None
        if found is None:
            if type(index) is not int or not 0 <= index < len(metas):
                raise Unstorable(f"metadata {index!r}")
            record = metas[index]
            if not isinstance(record, list) or len(record) != (7 if container else 5):
                raise Unstorable("metadata")
            ref, obj, optional, flags, flags_root = record[:5]
            if (
                type(optional) is not bool
                or type(flags_root) is not bool
                or not isinstance(flags, dict)
                or not all(v in (True, False, None) for v in flags.values())
            ):
                raise Unstorable("metadata")
            fields = dict(
                ref_type=type_at(ref), object_type=type_at(obj), optional=optional, flags=flags, flags_root=flags_root
            )
            if container:
                fields.update(key_type=type_at(record[5]), element_type=type_at(record[6]))
            cls: type[Metadata] = ContainerMetadata if container else Metadata
            cls(key=None, **fields)  # raises for types OmegaConf does not take
            checked[(index, container)] = found = (cls, fields)
        cls, fields = found
        made = cls.__new__(cls)
        made.__dict__.update(fields, key=key, flags=dict(fields["flags"]), resolver_cache=defaultdict(dict))
        return made

    def value(v: Any) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        if isinstance(v, list) and len(v) == 3 and v[0] == "enum":
            enum_type = type_at(v[1])
            if not (isinstance(enum_type, type) and issubclass(enum_type, Enum)):
                raise Unstorable("enum")
            return enum_type[v[2]]
        if isinstance(v, list) and len(v) == 2 and v[0] == "path" and isinstance(v[1], str):
            return Path(v[1])
        raise Unstorable(f"value {v!r}")

    def build(record: Any, parent: Any, depth: int) -> Any:
        if depth > 64 or not isinstance(record, list) or len(record) < 4 or record[0] not in classes:
            raise Unstorable("node")
        code = record[0]
        cls = classes[code]
        container = code in "DL"
        node = object.__new__(cls)  # no node class defines __new__: as cls.__new__(cls)
        state = node.__dict__
        state["_metadata"] = metadata(record[1], value(record[2]), container)
        state["_parent"] = parent
        state["_flags_cache"] = None
        if not container:
            if len(record) != (5 if code == "E" else 4):
                raise Unstorable("node")
            state["_val"] = value(record[3])
            if code == "E":
                enum_type = type_at(record[4])
                if not (isinstance(enum_type, type) and issubclass(enum_type, Enum)):
                    raise Unstorable("enum")
                state["enum_type"] = enum_type
                state["fields"] = {name: c.value for name, c in enum_type.__members__.items()}
            return node
        if len(record) != 4:
            raise Unstorable("node")
        content = record[3]
        if content is None or isinstance(content, str):
            state["_content"] = content
        elif code == "D" and isinstance(content, list):
            children: dict[Any, Any] = {}
            for pair in content:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise Unstorable("dict item")
                children[value(pair[0])] = build(pair[1], node, depth + 1)
            state["_content"] = children
        elif code == "L" and isinstance(content, list):
            state["_content"] = [build(child, node, depth + 1) for child in content]
        else:
            raise Unstorable("content")
        return node

    root = build(data["root"], None, 0)
    if not isinstance(root, DictConfig):
        raise Unstorable("not a DictConfig")
    return root


# --- the key that makes an entry this user's ---------------------------------------------------------------

_KEY: bytes | None = None


def key_path() -> Path:
    """Where this user's cache key lives: :func:`trainer.image.stampkey.stamp_key_path`."""
    return stampkey.stamp_key_path()


def mac_key() -> bytes | None:
    """This user's cache key (:func:`trainer.image.stampkey.stamp_key`, made by it when absent), read at most once per
    process, without blocking; None where it cannot be used (not a regular file of 32 bytes, owned by this user,
    that no one else may read or write; one :func:`trainer.image.stampkey.stamp_key` could not keep in its file, its key
    of one process: no later process could verify what this one stored): then no entry is read or stored."""
    global _KEY
    if _KEY is None:
        try:
            key = _read_regular(key_path(), 4096, private=True)
        except FileNotFoundError:
            try:
                made = stampkey.stamp_key()
                key = _read_regular(key_path(), 4096, private=True)  # kept: the file holds it
                key = key if hmac.compare_digest(key, made) else b""
            except (OSError, UserError):
                key = b""
        except OSError:
            key = b""
        _KEY = key if len(key) == 32 else b""
    return _KEY or None


def entry_mac(secret: bytes, key: str, payload: bytes) -> bytes:
    """The MAC (hex, ASCII) of an entry named ``key`` holding ``payload``: :meth:`trainer.image.cas.Cache.mac` of
    (:data:`MAC_KIND`, :data:`FORMAT`, ``key``, sha256 of ``payload``) under ``secret`` (canonical JSON, HMAC-SHA256),
    so that an entry renamed to another key, written by another format or by anyone without the key does not
    verify."""
    fields = [MAC_KIND, FORMAT.decode().strip(), key, hashlib.sha256(payload).hexdigest()]
    message = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


class CompositionCache:
    """Compositions of one config tree (``conf_dir``, ``config_name``) stored under ``root``.

    ``get`` and ``put`` take the overrides exactly as given to Hydra's ``compose`` and the ``hydra_node`` flag
    (``return_hydra_config``); neither raises on a damaged, forged, foreign or unwritable cache: it is then a miss,
    or not stored. Raises ``OSError`` when the tree cannot be read (:func:`tree_digest`).
    """

    def __init__(self, root: Path, conf_dir: Path, config_name: str, schema_file: Path) -> None:
        import hydra
        import omegaconf

        self.root = Path(root)
        self.conf_dir, self.schema_file = Path(conf_dir), Path(schema_file)
        self.tree = tree_digest(conf_dir, schema_file)
        head = hashlib.sha256(FORMAT)
        for part in (
            hydra.__version__,
            omegaconf.__version__,
            sys.version,
            sys.executable,
            *sys.path,
            os.path.abspath(conf_dir),
            config_name,
            os.getcwd(),
        ):
            head.update(part.encode() + b"\0")
        head.update(self.tree)
        self._head = head

    def key_of(self, overrides: Sequence[str], hydra_node: bool) -> str:
        """The entry's name: sha256 (hex) of the tree's inputs, ``overrides`` (in order) and ``hydra_node``."""
        digest = self._head.copy()
        for override in overrides:
            digest.update(override.encode("utf-8", "surrogatepass") + b"\0")
        digest.update(b"hydra-node\0" if hydra_node else b"job\0")
        return digest.hexdigest()

    def usable_root(self) -> bool:
        """Whether the cache directory may hold entries: absent (:meth:`put` makes it, 0700), or a directory (a link to
        one is judged by the directory) this user owns that neither group nor others may write. Any other (``/tmp``-like
        1777, a group's, another user's) is not used: the cache is then off, and the directory never changed (not
        chmodded, nothing in it removed)."""
        try:
            info = os.stat(self.root)
        except FileNotFoundError:
            return not os.path.lexists(self.root)  # a dangling link is no place to make it
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022

    def get(self, overrides: Sequence[str], hydra_node: bool) -> DictConfig | None:
        """The stored composition, its MAC verified under its own key; None on a miss (see the module docstring:
        absent, forged, damaged, renamed, oversized, not a regular file, a link, another user's or one others may
        write, in a directory others may write, no usable key)."""
        secret = mac_key()
        if secret is None:
            return None
        key = self.key_of(overrides, hydra_node)
        try:
            blob = _read_regular(self.root / (key + SUFFIX), MAX_ENTRY_BYTES, follow=False, private=True)
        except OSError:
            return None
        if not blob.startswith(FORMAT) or not self.usable_root():
            return None
        mac, _, payload = blob[len(FORMAT) :].partition(b"\n")
        if not hmac.compare_digest(mac, entry_mac(secret, key, payload)):
            return None
        try:
            return from_data(json.loads(payload))
        except Exception:  # noqa: BLE001 - this user's entry, but naming a type this environment lacks: a miss
            return None

    def put(self, overrides: Sequence[str], hydra_node: bool, cfg: DictConfig) -> None:
        """Store ``cfg`` atomically (a reader sees the whole entry or none) as data (:func:`to_data`), without what
        resolvers remembered while Hydra composed it; nothing is stored when the tree changed since this cache read
        it, when the composition holds what :func:`to_data` cannot name, or when it is larger than
        :data:`MAX_ENTRY_BYTES`. A cache that cannot be written is left as it is."""
        secret = mac_key()
        if secret is None:
            return
        try:
            payload = json.dumps(to_data(cfg), separators=(",", ":")).encode()
        except (ValueError, TypeError, RecursionError):  # Unstorable, or a value JSON cannot hold
            return
        key = self.key_of(overrides, hydra_node)
        blob = FORMAT + entry_mac(secret, key, payload) + b"\n" + payload
        if len(blob) > MAX_ENTRY_BYTES:
            return
        try:
            if tree_digest(self.conf_dir, self.schema_file) != self.tree:  # edited while Hydra read it
                return
            if not self.usable_root():
                return
            if not os.path.lexists(self.root):
                self.root.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.root.mkdir(mode=0o700)
                    os.chmod(self.root, 0o700)  # made here: 0700 whatever the umask (0277 would leave it 0500)
                except FileExistsError:  # another process made it meanwhile: checked as any other
                    pass
                if not self.usable_root():
                    return
            # 0600 whatever the umask: an entry of another mode is no entry (get, _prune)
            with atomic_file(self.root / (key + SUFFIX), 0o600, umask_applies=False) as handle:
                handle.write(blob)
            self._prune()
        except OSError:
            return

    def _prune(self) -> None:
        """Remove what is not an entry of this format, among the names the cache writes only (:data:`ENTRY_NAME`,
        :data:`TEMP_NAME`; a user's ``symphony.composition`` or ``.x.composition.old`` is never touched): the
        pickles of older formats (``KEY.composition``), anything named as an entry that is not a 0600 regular file
        (a link, a FIFO, a file an older format's mode left), temporary files of writers killed more than
        :data:`DEBRIS_AGE_S` ago; then the least recently written entries beyond :data:`MAX_ENTRIES` (entries of
        other formats are never read: their keys and headers differ)."""
        entries = []
        now = time.time()
        with os.scandir(self.root) as listing:
            for item in listing:
                name = item.name
                named, temp = ENTRY_NAME.match(name), TEMP_NAME.match(name)
                if not named and not temp:
                    continue
                try:
                    info = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                path = self.root / name
                if stat.S_ISDIR(info.st_mode):
                    continue
                if temp:  # atomic_file's ".NAME.XXXXXXXX", any format
                    if now - info.st_mtime > DEBRIS_AGE_S:
                        path.unlink(missing_ok=True)
                elif not name.endswith(SUFFIX):  # KEY.composition: an older format's pickle
                    path.unlink(missing_ok=True)
                elif not stat.S_ISREG(info.st_mode) or info.st_mode & 0o777 != 0o600:
                    path.unlink(missing_ok=True)
                else:
                    entries.append((info.st_mtime_ns, name))
        for _, stale in sorted(entries)[:-MAX_ENTRIES]:
            (self.root / stale).unlink(missing_ok=True)
