"""Reading files a user hands in, bounded: size, encoding, JSON/YAML nesting and expansion, number length.

Every reader of a run directory, a metrics file, a lock or a recipe goes through these, so that hostile input
(a binary or Latin-1 file, JSON nested 100,000 deep, an integer of 5,000 digits, a YAML alias bomb, a 30 GB file)
is one :class:`~trainer.errors.UserError` line naming the file, never a traceback, a hang or exhausted memory.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from trainer.errors import UserError

MAX_TEXT_BYTES = 64 << 20  # a config, record, lock or recipe larger than this is not one this bundle wrote
MAX_LINE_BYTES = 1 << 20  # one JSON line of metrics.jsonl / a conversation
MAX_DEPTH = 64  # nesting of JSON/YAML documents (the bundle's own documents nest < 10 deep)
MAX_NODES = 1_000_000  # values of one document after YAML aliases are expanded (an alias bomb expands to billions)
MAX_NUMBER_CHARS = 400  # digits of one JSON number (a float has 17 significant digits; an int64 has 19)


def read_text(path: Path, what: str = "file", limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of ``path``; raises :class:`UserError` when it is not a regular file, is larger than
    ``limit`` bytes, or is not UTF-8 (naming the byte offset). ``OSError`` of a missing file propagates."""
    path = Path(path)
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file (a {what} must be one)")
        if info.st_size > limit:
            raise UserError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} a {what} may have")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{path}: more than the {limit:,} bytes a {what} may have")
    return decode(data, str(path), what)


def decode(data: bytes, where: str, what: str = "file") -> str:
    """``data`` as UTF-8; raises :class:`UserError` naming the first bad byte and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as ex:
        raise UserError(f"{where}: not UTF-8 text (byte 0x{data[ex.start]:02x} at offset {ex.start}; "
                        f"a {what} is UTF-8)") from None


def _walk(obj: Any, where: str) -> None:
    """Refuse documents nested deeper than :data:`MAX_DEPTH` or larger than :data:`MAX_NODES` values, and strings
    holding lone surrogates. Iterative, stops at the first excess: bounded time even on an alias bomb."""
    stack = [(obj, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise UserError(f"{where}: more than {MAX_NODES:,} values (YAML aliases expanding without bound?)")
        if depth > MAX_DEPTH:
            raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((value, depth + 1) for value in node)
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(f"{where}: a string holds a lone surrogate ({node[:40]!r}...), not text") from None


def _bounded_number(text: str) -> Any:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text):,} characters (at most {MAX_NUMBER_CHARS})")
    return text


def _int(text: str) -> int:
    return int(_bounded_number(text))


def _float(text: str) -> float:
    return float(_bounded_number(text))


def parse_json(text: str, where: str, walk: bool = True) -> Any:
    """``json.loads`` bounded in nesting, number length and content; raises :class:`UserError` naming ``where``.

    ``walk=False`` (for flat rows whose reader checks every value's type, such as ``metrics.jsonl``) keeps Python's
    own bounds only (a recursion limit, 4,300 digits per integer) and skips the per-value walk: several times faster.
    """
    try:
        obj = json.loads(text, parse_int=_int, parse_float=_float) if walk else json.loads(text)
    except json.JSONDecodeError as ex:
        raise UserError(f"{where}: not valid JSON ({ex.msg} at line {ex.lineno} column {ex.colno})") from None
    except (ValueError, RecursionError) as ex:
        raise UserError(f"{where}: not JSON this bundle reads ({str(ex) or type(ex).__name__})") from None
    if walk:
        _walk(obj, where)
    return obj


def read_json(path: Path, what: str = "JSON file", limit: int = MAX_TEXT_BYTES) -> Any:
    """:func:`read_text` then :func:`parse_json`."""
    return parse_json(read_text(path, what, limit), str(path))


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with numbers bounded in length (PyYAML's own int/float constructors)."""


def _yaml_number(kind: str):
    base = getattr(yaml.SafeLoader, f"construct_yaml_{kind}")

    def construct(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        if len(node.value) > MAX_NUMBER_CHARS:
            raise yaml.constructor.ConstructorError(None, None, f"a number of {len(node.value):,} characters",
                                                    node.start_mark)
        return base(loader, node)

    return construct


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _yaml_number("int"))
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _yaml_number("float"))


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` bounded in number length, nesting and alias expansion; raises :class:`UserError`."""
    try:
        obj = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as ex:
        raise UserError(f"{where}: not readable YAML ({' '.join(str(ex).split())[:200]})") from None
    except RecursionError:
        raise UserError(f"{where}: YAML nested too deep") from None
    _walk(obj, where)
    return obj


def read_yaml(path: Path, what: str = "YAML file", limit: int = MAX_TEXT_BYTES) -> Any:
    """:func:`read_text` then :func:`parse_yaml`."""
    return parse_yaml(read_text(path, what, limit), str(path))


def lines(path: Path, what: str = "JSON lines file", max_line: int = MAX_LINE_BYTES) -> Iterator[tuple]:
    """``(line number, text)`` of a text file read as a stream (memory bounded by ``max_line``); raises
    :class:`UserError` on a longer line or one that is not UTF-8."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(max_line + 1), b""), start=1):
            if len(raw) > max_line and not raw.endswith(b"\n"):
                raise UserError(f"{path} line {number}: longer than {max_line:,} bytes (a {what} line is shorter)")
            yield number, decode(raw, f"{path} line {number}", what)


def optional(kind: type, value: Any, where: str) -> Optional[Any]:
    """``value`` when it is None or of ``kind``; else :class:`UserError` naming ``where`` and both types."""
    if value is None or isinstance(value, kind):
        return value
    raise UserError(f"{where}: {type(value).__name__} {str(value)[:40]!r}, expected {kind.__name__}")
