"""Reading files a user hands in, bounded: size, encoding, JSON/YAML nesting and expansion, number length.

Every reader of a run directory, a metrics file, a log, a lock, a key, an attestation, an image's documents or a
recipe goes through these, so that hostile input (a binary or Latin-1 file, JSON nested 100,000 deep, an integer of
5,000 digits, a YAML alias bomb, a 30 GB file, a FIFO, a directory or ``/dev/zero`` where a file should be) is one
:class:`~trainer.errors.UserError` line naming the file, never a traceback, a hang or exhausted memory.

Every file is opened by :func:`open_regular`: ``O_NONBLOCK | O_NOCTTY`` (opening a FIFO without a writer or a
terminal never blocks), ``fstat``, and anything but a regular file is refused before a byte is read, naming the
kind found and the kind expected; then a size cap per kind (the ``MAX_*_BYTES`` constants below) from ``st_size``.
Large inputs are streamed instead (:func:`lines`, :func:`raw_lines`: memory bounded by a per-line cap whatever the
file's size; holes of a sparse file are skipped, not read, where only line structure matters).

A file that is missing or cannot be read is one line too, said once for every reader (:func:`reading`): a block
reading a file the user named turns ``FileNotFoundError`` and any other ``OSError`` into a :class:`UserError`
with the caller's words (``--key KEY: no such file (...)``), the system's reason in parentheses.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from trainer.errors import UserError

MAX_TEXT_BYTES = 64 << 20
"""Bytes of one config, record, lock, recipe, image index/manifest or cas tree record (64 MiB): larger is not one
this bundle wrote (its own are < 1 MiB); refused from ``fstat`` before any byte is read."""
MAX_LINE_BYTES = 1 << 20
"""Bytes of one line of ``metrics.jsonl`` or of a ``.jsonl`` conversation file (1 MiB, newline included)."""
MAX_LOG_LINE_BYTES = 64 << 10
"""Bytes of one training-log line read for metrics (64 KiB): a Megatron iteration line or a miles step/perf dict
is < 4 KiB; longer lines (printed arguments, samples) are skipped and counted, never parsed."""
MAX_KEY_BYTES = 16 << 10
"""Bytes of a signing or verification key file (16 KiB): an ed25519 PEM key is ~120 bytes, RSA-4096 ~3.3 KB."""
MAX_ATTESTATION_BYTES = 64 << 20
"""Bytes of ``attestation.json`` (64 MiB): a statement names each file of a run once (~200 bytes each, so ~300,000
files) beside every rank's probe; refused from ``fstat`` before it is read (an 8 GiB one costs nothing)."""
MAX_DEPTH = 64  # nesting of JSON/YAML documents (the bundle's own documents nest < 10 deep)
MAX_NODES = 1_000_000  # values of one document after YAML aliases are expanded (an alias bomb expands to billions)
MAX_NUMBER_CHARS = 400  # digits of one JSON number (a float has 17 significant digits; an int64 has 19)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


@contextlib.contextmanager
def reading(
    path: Path | str, missing: str | None = None, unreadable: str | None = None, prefix: str = ""
) -> Iterator[None]:
    """The block reads ``path`` (a file the user named); an ``OSError`` it raises becomes one :class:`UserError`:

    * ``FileNotFoundError``: ``missing`` (default ``PREFIXPATH: no such file``);
    * any other ``OSError`` (a permission, an I/O error, a name too long): ``UNREADABLE (REASON)``, the system's
      reason (``strerror``) in parentheses; with ``unreadable`` None it propagates as it is (the command line
      prints it as one line, :func:`trainer.errors.os_error_line`);
    * a :class:`UserError` of the block (a FIFO, a file too large, not UTF-8: :func:`open_regular`,
      :func:`decode`) is raised with ``prefix`` before it (``--key `` names the flag), unless it starts so already.

    Every message is folded to one line (:class:`UserError`)."""
    try:
        yield
    except FileNotFoundError:
        raise UserError(missing if missing is not None else f"{prefix}{path}: no such file") from None
    except UserError as err:
        text = str(err)
        if not prefix or text.startswith(prefix):
            raise
        raise UserError(prefix + text) from None
    except OSError as err:
        if unreadable is None:
            raise
        raise UserError(f"{unreadable} ({err.strerror or err})") from None


def kind_of(mode: int) -> str:
    """Words for the file type of ``mode`` (``st_mode``): ``"a FIFO"``, ``"a directory"``, ...."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def open_regular(path: Path, what: str = "file", limit: int | None = MAX_TEXT_BYTES) -> BinaryIO:
    """``path`` opened for binary reading, refusing anything but a regular file without blocking.

    Opened with ``O_NONBLOCK | O_NOCTTY`` (a FIFO without a writer, a terminal or a device never blocks the open),
    then ``fstat``-ed: a FIFO, directory, device or socket (also behind a symlink, such as one to ``/dev/zero``) is
    refused before any byte is read, and so is a file of more than ``limit`` bytes (None: no limit; readers that
    stream, such as :func:`lines`, bound memory per line instead). Raises :class:`UserError` naming ``path`` and
    the ``what`` expected (``"... is a FIFO, not a regular file (a lock must be one)"``); ``OSError`` of a missing
    or unreadable file propagates (the CLI prints it as one line).
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: {kind_of(info.st_mode)}, not a regular file (a {what} must be one)")
        if limit is not None and info.st_size > limit:
            raise UserError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} a {what} may have")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: Path, what: str = "file", limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of ``path`` (:func:`open_regular`: a regular file of at most ``limit`` bytes, also when it grows
    while read); raises :class:`UserError` otherwise."""
    with open_regular(path, what, limit) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{path}: more than the {limit:,} bytes a {what} may have")
    return data


def read_member(tar: Any, member: Any, where: str, what: str = "file", limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the regular ``tarfile`` member ``member`` of ``tar`` (``where`` names it in errors), refused
    from its header, before any byte is read, when it declares more than ``limit`` bytes (a sparse 8 GiB entry)."""
    if member.size > limit:
        raise UserError(f"{where}: {member.size:,} bytes, more than the {limit:,} a {what} may have")
    return tar.extractfile(member).read(limit + 1)


def read_text(path: Path, what: str = "file", limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of ``path``; raises :class:`UserError` when it is not a regular file (a FIFO is refused
    without blocking), is larger than ``limit`` bytes, or is not UTF-8 (naming the byte offset). ``OSError`` of a
    missing file propagates."""
    return decode(read_bytes(path, what, limit), str(path), what)


def decode(data: bytes, where: str, what: str = "file") -> str:
    """``data`` as UTF-8; raises :class:`UserError` naming the first bad byte and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as ex:
        raise UserError(
            f"{where}: not UTF-8 text (byte 0x{data[ex.start]:02x} at offset {ex.start}; a {what} is UTF-8)"
        ) from None


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
            raise yaml.constructor.ConstructorError(
                None, None, f"a number of {len(node.value):,} characters", node.start_mark
            )
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


def raw_lines(
    path: Path, what: str = "JSON lines file", max_line: int = MAX_LINE_BYTES, long: str = "refuse"
) -> Iterator[tuple]:
    """``(line number, bytes)`` of a file read as a stream (:func:`open_regular` without a size limit: memory is
    bounded by ``max_line`` bytes whatever the file's size; the newline is kept). A line longer than ``max_line``
    bytes raises :class:`UserError` naming the file and line (``long="refuse"``), or (``long="skip"``) is skipped
    to its end (:func:`_skip_line`: 1 MiB pieces, holes jumped) and yielded as ``(line number, None)``, so that a
    caller can count it."""
    with open_regular(path, what, None) as handle:
        number = 0
        for raw in iter(lambda: handle.readline(max_line + 1), b""):
            number += 1
            if len(raw) > max_line and not raw.endswith(b"\n"):
                if long != "skip":
                    raise UserError(f"{path} line {number}: longer than {max_line:,} bytes (a {what} line is shorter)")
                _skip_line(handle)
                yield number, None
                continue
            yield number, raw


def _skip_line(handle: BinaryIO, chunk: int = 1 << 20) -> None:
    """Move ``handle`` (a regular file) past the next newline, or to its end: read in ``chunk``-byte pieces, and
    past holes of a sparse file without reading them (``SEEK_DATA``: a hole reads as NUL bytes, never a newline),
    so that skipping an 8 GiB hole costs no time."""
    fd = handle.fileno()
    while True:
        pos = handle.tell()
        block = handle.read(chunk)
        if not block:
            return
        newline = block.find(b"\n")
        if newline >= 0:
            handle.seek(pos + newline + 1)
            return
        after = pos + len(block)
        if hasattr(os, "SEEK_DATA"):
            try:
                after = max(after, os.lseek(fd, after, os.SEEK_DATA))
            except OSError as ex:  # ENXIO: only a hole after this point; else a file system without SEEK_DATA
                if ex.errno == errno.ENXIO:
                    after = max(after, os.fstat(fd).st_size)
        handle.seek(after)


def line_blocks(handle: BinaryIO, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of ``handle`` (a regular file, from its position) in blocks of at most ``chunk``, for readers that
    need only the line structure (counting lines): each hole of a sparse file is one ``b"\\0"`` block instead of
    its NUL bytes (``SEEK_DATA``/``SEEK_HOLE``; a hole holds no newline), so an 8 GiB hole costs no time."""
    fd = handle.fileno()
    pos = handle.tell()
    seekable = hasattr(os, "SEEK_DATA")
    while True:
        end = pos + chunk
        if seekable:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as ex:
                if ex.errno != errno.ENXIO:
                    seekable, data = False, pos
                else:  # a hole to the end of the file, or the end itself
                    if os.fstat(fd).st_size > pos:
                        yield b"\0"
                    return
            if data > pos:
                yield b"\0"
                pos = data
            if seekable:
                end = min(pos + chunk, max(os.lseek(fd, pos, os.SEEK_HOLE), pos + 1))
        handle.seek(pos)
        block = handle.read(end - pos)
        if not block:
            return
        yield block
        pos += len(block)


def lines(path: Path, what: str = "JSON lines file", max_line: int = MAX_LINE_BYTES) -> Iterator[tuple]:
    """``(line number, text)`` of a text file read as a stream (memory bounded by ``max_line``; opened
    non-blocking and refused unless a regular file, :func:`open_regular`); raises :class:`UserError` on a longer
    line or one that is not UTF-8."""
    for number, raw in raw_lines(path, what, max_line):
        yield number, decode(raw, f"{path} line {number}", what)


def optional(kind: type, value: Any, where: str) -> Any | None:
    """``value`` when it is None or of ``kind``; else :class:`UserError` naming ``where`` and both types."""
    if value is None or isinstance(value, kind):
        return value
    raise UserError(f"{where}: {type(value).__name__} {str(value)[:40]!r}, expected {kind.__name__}")
