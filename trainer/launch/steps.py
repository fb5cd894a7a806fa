"""What both workers share (:mod:`trainer.launch.cpu_worker`, :mod:`trainer.launch.megatron_worker`): the learning
rate of a step, the microbatches of a step and the ``metrics.jsonl`` row it ends with.

The schedule is Megatron-LM's: every optimizer step takes ``global_batch_size`` rows, ``micro_batch_size`` rows per
microbatch, so each of the ``dp_size`` data-parallel ranks runs ``global_batch_size // (micro_batch_size x
dp_size)`` microbatches per step, read in :class:`trainer.data.Rows`' order (rank ``r`` takes its share of every
global group); the microbatches of the run are numbered on from step to step, and an epoch of
``Rows.num_batches(micro_batch_size, dp_size)`` microbatches wraps around to the next epoch's order.

Torch is not imported here: the schedule and the row are plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from trainer.compose.checks import LR_DECAY_STYLES
from trainer.data import Batch, Rows
from trainer.report.metrics import Step, dumps_row


def megatron_lr(
    step_done: int, steps: int, lr: float, min_lr: float, warmup_fraction: float, style: str = "cosine"
) -> float:
    """Learning rate after ``step_done`` completed steps (Megatron-LM 37f91617
    ``megatron/core/optimizer_param_scheduler.py`` ``OptimizerParamScheduler.get_lr``, for the decay ``style`` of
    ``--lr-decay-style``: ``constant``, ``linear`` or ``cosine``).

    Warm-up: ``lr x step_done / warmup`` for ``step_done <= warmup`` with ``warmup = fraction x steps`` (a
    float, as Megatron's ``lr_warmup_steps = lr_warmup_fraction x lr_decay_steps``; the first step runs at 0
    when there is warm-up); then ``lr`` (constant), or ``min_lr + (lr - min_lr) x c`` with
    ``r = (step_done - warmup) / (steps - warmup)`` and ``c = 1 - r`` (linear) or ``0.5 x (1 + cos(pi x r))``
    (cosine). Raises ``ValueError`` for another style (Megatron's inverse-square-root and WSD are not followed).
    """
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"lr_decay_style {style!r}: expected one of {', '.join(LR_DECAY_STYLES)}")
    warmup = warmup_fraction * steps
    if warmup > 0 and step_done <= warmup:
        return lr * step_done / warmup
    if style == "constant":
        return lr
    if steps <= warmup:
        return min_lr
    ratio = min(1.0, (step_done - warmup) / (steps - warmup))
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + (lr - min_lr) * coeff


def microbatch_positions(step_index: int, per_step: int, per_epoch: int) -> list[tuple[int, int]]:
    """``(epoch, index)`` of each of the ``per_step`` microbatches a rank runs in step ``step_index`` (0-based):
    the run's microbatch ``step_index x per_step + k`` is microbatch ``index`` of ``epoch`` for an epoch of
    ``per_epoch`` microbatches per rank. Raises ``ZeroDivisionError`` for ``per_epoch`` 0."""
    return [divmod(step_index * per_step + k, per_epoch) for k in range(per_step)]


@dataclass(frozen=True)
class Schedule:
    """The microbatches of one data-parallel rank: ``micro_batch_size`` rows each, ``per_step`` of them per
    optimizer step, ``per_epoch`` per epoch of ``rows`` (see the module docstring)."""

    rows: Rows
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    per_step: int
    per_epoch: int

    @classmethod
    def of(cls, rows: Rows, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Schedule:
        """Rank ``dp_rank`` of ``dp_size``'s schedule for ``global_batch_size`` rows per step (the microbatches per
        step rounded down, as ``global_batch_size // (micro_batch_size x dp_size)``)."""
        per_step = global_batch_size // (micro_batch_size * dp_size)
        return cls(rows, micro_batch_size, dp_rank, dp_size, per_step, rows.num_batches(micro_batch_size, dp_size))

    def microbatches(self, step_index: int) -> list[Batch]:
        """This rank's ``per_step`` microbatches of step ``step_index`` (0-based), each ``(micro_batch_size,
        row_tokens)`` arrays (:class:`trainer.data.Batch`). Raises :class:`UserError` (from :meth:`Rows.batches`)
        for fewer rows than one global group."""
        out = []
        for epoch, index in microbatch_positions(step_index, self.per_step, self.per_epoch):
            batches = self.rows.batches(
                self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size, epoch=epoch, start=index
            )
            out.append(next(batches))
        return out


def per_token_loss(loss_sum: float, supervised_tokens: float) -> float:
    """The step's LM loss: the summed cross-entropy over ``supervised_tokens`` (the whole global batch's, at least
    1: Megatron's ``--calculate-per-token-loss``)."""
    return loss_sum / max(supervised_tokens, 1.0)


def step_line(row: Step, steps: int, grad_norm_spec: str, time_spec: str) -> str:
    """The console line of a written row: ``step N/STEPS loss L grad_norm G lr R T s``, the loss to 4 decimals,
    the learning rate to 3 significant digits, ``grad_norm`` and ``step_time_s`` (seconds) formatted with the
    worker's ``format`` specs (``""``: as ``str`` has it, ``None`` too)."""
    return (
        f"step {row.step}/{steps} loss {row.lm_loss:.4f} grad_norm {format(row.grad_norm, grad_norm_spec)} "
        f"lr {row.lr:.3g} {format(row.step_time_s, time_spec)} s"
    )


class MetricsWriter:
    """``metrics.jsonl`` of a run as one rank writes it: opened for appending at ``path``, one line per
    :meth:`write` (:func:`trainer.report.metrics.dumps_row` of the row, flushed at once so that a reader follows
    the run). ``path`` None: a rank that writes no metrics (every call does nothing). A context manager that
    closes the file."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = path.open("a") if path is not None else None

    @property
    def writes(self) -> bool:
        """Whether this rank writes the rows."""
        return self._file is not None

    def write(self, row: Step) -> None:
        """Append ``row`` (the keys of :data:`trainer.report.metrics.KEYS` that it has, in that order)."""
        if self._file is not None:
            self._file.write(dumps_row(row.as_dict()) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (once; later writes do nothing)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
