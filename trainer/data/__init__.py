"""``trainer.data``: the fixed-length SFT rows a training run reads, and how they are built.

A build directory (``trainer data build``, :mod:`trainer.data.build`) holds ``rows.parquet`` and
``manifest.json``. :class:`Rows` opens one, verifies it against its manifest, and yields micro-batches
for one data-parallel rank::

    rows = Rows("data/dsv4-tulu3-fixed8192-v1")            # checks parquet_sha256 and rows_sha256
    for batch in rows.batches(micro_batch_size=1, dp_rank=rank, dp_size=8):
        batch.tokens, batch.labels, batch.loss_mask, batch.position_ids   # each (1, 8192) int64

Batch arrays (``B`` = micro-batch size in rows, ``S`` = row_tokens), all ``numpy.int64`` of shape ``(B, S)``:

- ``tokens[b, i]``: token ids of the row.
- ``labels[b, i] = tokens[b, i + 1]`` for ``i < S - 1``; ``labels[b, S - 1] = -100`` (``IGNORE_INDEX``: the
  row's last position has no next token in the row).
- ``loss_mask[b, i] = mask[b, i + 1]`` (1 where the prediction of ``labels[b, i]`` carries loss; the stored
  mask is token-aligned, see :mod:`trainer.data.chat`); ``loss_mask[b, S - 1] = 0``.
- ``position_ids[b, i] = i``: rows are attended causally as a whole (Megatron's default,
  ``reset_position_ids`` off), conversations packed in a row do not restart positions.

and ``row_index`` (``(B,)`` int64): the rows' indices in ``rows.parquet``.

Sharding (Megatron-LM's pretraining sampler): the rows in file order are cut into global groups of
``micro_batch_size * dp_size`` consecutive rows; rank ``r`` takes rows ``[r * B, (r + 1) * B)`` of each
group. An incomplete last group is dropped, so every rank yields the same number of batches. The order is
the build's (already a seeded global permutation); ``epoch`` > 0 reorders rows with a permutation seeded by
``(manifest seed, epoch)`` (same sha256 key rule as the build), the same on every rank and machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import UserError
from trainer.inputs import open_regular, read_json, reading

IGNORE_INDEX = -100  # label of positions without a target (torch.nn.functional.cross_entropy's default)
ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Batch:
    """One micro-batch for one data-parallel rank; shapes and meaning in the module docstring."""

    tokens: np.ndarray  # (B, S) int64
    labels: np.ndarray  # (B, S) int64
    loss_mask: np.ndarray  # (B, S) int64, 0/1
    position_ids: np.ndarray  # (B, S) int64
    row_index: np.ndarray  # (B,) int64


class Rows:
    """The rows of a build directory, held in memory (``rows x row_tokens`` x 5 bytes; 262 MB for the recipe).

    ``verify`` (default) checks ``rows.parquet`` against the manifest's ``parquet_bytes``,
    ``parquet_sha256`` and ``rows_sha256`` before use. Raises :class:`UserError` naming the file for a
    missing or inconsistent build.
    """

    def __init__(self, directory: str | Path, verify: bool = True) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST_FILE
        with reading(
            manifest_path,
            missing=f"{manifest_path}: no such file (a directory without manifest.json is an incomplete build)",
        ):
            self.manifest: dict[str, Any] = read_json(manifest_path, "rows manifest")
        try:
            self.row_tokens = int(self.manifest["row_tokens"])
            expected_rows = int(self.manifest["rows"])
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{manifest_path}: not a rows manifest ({err})") from None
        rows_path = self.directory / ROWS_FILE
        with reading(rows_path, unreadable=f"{rows_path}: cannot read"):
            with open_regular(rows_path, "rows file", None) as handle:
                data = handle.read()
        if verify:
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != self.manifest.get("parquet_bytes") or digest != self.manifest.get("parquet_sha256"):
                raise UserError(
                    f"{rows_path}: {len(data)} bytes, sha256 {digest}; the manifest says "
                    f"{self.manifest.get('parquet_bytes')} bytes, sha256 {self.manifest.get('parquet_sha256')}"
                )
        try:
            table = pq.read_table(pa.BufferReader(data), columns=["tokens", "loss_mask"])
            shape = (table.num_rows, self.row_tokens)
            self.tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(shape)
            self.mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().reshape(shape)
        except (pa.ArrowException, ValueError, KeyError) as err:
            raise UserError(f"{rows_path}: not a rows parquet of {self.row_tokens}-token rows ({err})") from None
        if table.num_rows != expected_rows:
            raise UserError(f"{rows_path}: {table.num_rows} rows; the manifest says {expected_rows}")
        if verify:
            digest = rows_sha256(self.tokens, self.mask)
            if digest != self.manifest.get("rows_sha256"):
                raise UserError(f"{rows_path}: rows_sha256 {digest} != manifest {self.manifest.get('rows_sha256')}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def order(self, epoch: int = 0) -> np.ndarray:
        """Row indices in reading order for ``epoch``: file order for epoch 0, else ascending
        ``sha256(f"{seed}:epoch{epoch}:{row}")`` (``seed`` from the manifest)."""
        if epoch == 0:
            return np.arange(len(self), dtype=np.int64)
        seed = self.manifest.get("seed", 0)
        keys = [hashlib.sha256(f"{seed}:epoch{epoch}:{row}".encode("ascii")).digest() for row in range(len(self))]
        return np.array(sorted(range(len(self)), key=keys.__getitem__), dtype=np.int64)

    def num_batches(self, micro_batch_size: int, dp_size: int = 1) -> int:
        """Micro-batches per rank per epoch: ``rows // (micro_batch_size * dp_size)``."""
        return len(self) // (micro_batch_size * dp_size)

    def batches(
        self, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, epoch: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        """Yield this rank's micro-batches of ``epoch`` from the ``start``-th on (for resuming).

        Raises :class:`UserError` for a non-positive size, a rank outside ``[0, dp_size)``, or fewer rows
        than one global group (``micro_batch_size * dp_size``).
        """
        if micro_batch_size < 1 or dp_size < 1:
            raise UserError(f"micro_batch_size {micro_batch_size}, dp_size {dp_size}: expected positive numbers")
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank {dp_rank}: expected 0 <= dp_rank < dp_size {dp_size}")
        group = micro_batch_size * dp_size
        if len(self) < group:
            raise UserError(
                f"{self.directory}: {len(self)} rows, "
                f"fewer than one global group of {group} (micro_batch_size x dp_size)"
            )
        order = self.order(epoch)
        positions = np.arange(self.row_tokens, dtype=np.int64)
        for step in range(start, self.num_batches(micro_batch_size, dp_size)):
            lo = step * group + dp_rank * micro_batch_size
            index = order[lo : lo + micro_batch_size]
            tokens = self.tokens[index].astype(np.int64)
            labels = np.full_like(tokens, IGNORE_INDEX)
            labels[:, :-1] = tokens[:, 1:]
            loss_mask = np.zeros_like(tokens)
            loss_mask[:, :-1] = self.mask[index, 1:]
            yield Batch(tokens, labels, loss_mask, np.broadcast_to(positions, tokens.shape).copy(), index.copy())


def rows_sha256(tokens: np.ndarray, mask: np.ndarray) -> str:
    """``rows_sha256`` of rows ``tokens`` ``(R, S)`` and token-aligned ``mask`` ``(R, S)``: sha256 over the
    rows in order, each as its ``S`` token ids in little-endian int32 followed by its ``S`` mask values in uint8."""
    digest = hashlib.sha256()
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    mask = np.ascontiguousarray(mask, dtype=np.uint8)
    for row in range(tokens.shape[0]):
        digest.update(tokens[row].tobytes())
        digest.update(mask[row].tobytes())
    return digest.hexdigest()
