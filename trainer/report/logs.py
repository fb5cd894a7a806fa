"""``trainer logs LOG``: per-step loss, grad norm and iteration time from a training log, as ``metrics.jsonl``.

Two line formats are read; anything else in the log is ignored (timestamps, Ray prefixes such as
``(MegatronTrainRayActor pid=123)``, ANSI colour codes, other output).

Megatron-LM ``training_log`` (``megatron/training/training.py``), fields separated by ``|``::

     [2026-10-13 12:00:00] iteration        5/      20 | consumed samples:          640 | elapsed time per iteration (ms): 20270.1 | learning rate: 9.000000E-06 | global batch size:   128 | lm loss: 1.234567E+00 | loss scale: 1.0 | grad norm: 0.987 | number of skipped iterations:   0 | number of nan iterations:   0 |

  ``iteration N/ M`` is the 1-based step N (the step just finished); ``elapsed time per iteration (ms)``
  gives ``step_time_s`` (ms / 1000; with ``--log-interval`` > 1 it is the mean over the interval, and
  only every interval-th step is logged); ``lm loss``, ``grad norm`` (``nan``/``inf`` kept),
  ``learning rate``, ``global batch size`` (rows), ``number of skipped iterations`` and ``number of nan
  iterations`` are read where present; other fields are ignored.

  Every complete iteration line is a step. Megatron prints ``lm loss`` only when the interval's mean loss
  is > 0 (``training_log``: ``if avg > 0.0``), so an iteration whose loss was NaN, or that the optimizer
  skipped (its loss is then not summed), has a line without a loss: it becomes a step with ``lm_loss``
  NaN (written ``"NaN"`` in metrics.jsonl) and the two counts, and fails ``trainer converge`` as a step
  without a finite loss, instead of disappearing from the run.

miles (``miles/backends/training_utils/log_utils.py`` ``log_train_step``, called by
``backends/megatron_utils/model.py``; ``miles/utils/train_metric_utils.py`` ``log_perf_data_raw``), a
Python dict per optimizer step and one per rollout, as miles 78527b91 prints them::

    (MegatronTrainRayActor pid=4711) [2026-10-13 12:00:00.123 actor_cell0_rank0] log_utils.py:542 - step 4: {'train/loss': 1.2345, 'train/grad_norm': 0.987, 'train/lr-pg_0': 9e-06, 'train/step': 4}
    (MegatronTrainRayActor pid=4711) [2026-10-13 12:00:01.456 actor_cell0_rank0] train_metric_utils.py:56 - perf 4: {'perf/actor_train_time': 20.27, 'perf/train_wait_time': 0.7, 'perf/train_time': 20.3, 'perf/step_time': 21.0}

  The step dict holds the loss function's metrics (``train/loss`` for ``--loss-type sft_loss``), the grad
  norm ``train/grad_norm``, the learning rate of each parameter group ``train/lr-pg_N``, ``train/mtp_loss``
  with MTP training, and ``train/step``: no global batch size, no tokens and no time. Tokens per step
  therefore come from the run's composition (``--run RUN_DIR`` or ``--global-batch-size`` with
  ``--seq-length``); a ``train/global_batch_size`` key, should another version print one, is read as
  the log's global batch size. ``step K`` is 0-based (``rollout_id x steps_per_rollout + step_id``), so the step is
  K + 1. miles prints a step line only for a step whose outcome is NORMAL (a step discarded for a retry
  prints none, and is then a missing step). ``perf R`` (0-based rollout R) gives the step time from
  ``perf/actor_train_time`` (seconds); it is used only where a rollout holds one optimizer step (the
  recipe's SFT launch: ``--global-batch-size`` = ``--rollout-batch-size``), as step R + 1. A
  ``critic-step K`` line (another role) has no ``train/loss`` and is not a step.

  Values are Python reprs: numbers, ``nan``, ``inf``; a numpy scalar as numpy >= 2 prints it
  (``np.float64(0.5)``, ``np.int64(3)``, ``np.True_``) and a torch scalar tensor (``tensor(0.5)``,
  ``tensor(0.5, device='cuda:0')``) are read as the number. miles 78527b91 turns the step dict's values
  into Python floats (``.item()``, ``float()``, ``tolist()``), but its rollout-side metrics keep some
  numpy scalars (``np.mean`` without ``.item()``). Another value that is not a literal makes only its key
  unreadable (an error only when that key is read).

Lines never made into steps, counted and reported (the summary line; ``--json``):

* truncated lines: a Megatron iteration line that does not end with ``|`` (every field of
  ``training_log`` is followed by `` |``; for a fork whose iteration lines all end otherwise, only a last
  line the text ends without a newline), or a miles ``step``/``perf`` line whose dict is not closed (a
  job killed while writing, a log copied while it grew). A line cut just after a field's ``|`` cannot
  be told from a complete one.
* Ray-deduplicated lines: with Ray's log deduplication on (its default; ``RAY_DEDUP_LOGS=0`` turns it
  off), lines of one pattern (words containing digits ignored) printed by more than one process within
  ``RAY_DEDUP_LOGS_AGG_WINDOW_S`` (5 s) are held back and printed once, as the latest of them followed by
  ``[repeated Nx across cluster]``. Such a line stands for N lines whose numbers may differ, of which
  only the last one's text is shown, so it is not read as a step: the lines and the N they stand for are
  counted, training-step lines among them apart (their steps may then be missing from metrics.jsonl).
* long lines: a line longer than 64 KiB (``trainer.inputs.MAX_LOG_LINE_BYTES``; a step line is < 4 KiB) is
  skipped unread and counted (printed arguments, samples, a sparse file's hole), never parsed.

The log is read as a stream (a FIFO or device is refused without blocking): memory is bounded by the line cap
and the steps kept (at most 2,000,000 step, truncated, deduplicated and long lines), whatever the file's size;
lines are numbered at ``\n`` as editors number them, and every error names the file and line. What it writes,
``trainer report`` and ``trainer converge`` read: a step outside 1..2^63-1, a step time that is not a positive
finite number of seconds, a global batch size that is not a positive integer, a Megatron count below 0 are
refused (one line naming file and line), never written. A loss or grad norm that is not finite is kept (a NaN
step fails the convergence check: a result, not bad input).

``tokens`` (per step, whole job) = global batch size (rows) x sequence length (tokens per row), fixed-length
rows: the global batch size from the log where it prints one (Megatron), else from the composition; the
sequence length from ``--seq-length`` or the run's ``data.seq_length``; else null. A log's global batch
size that differs from the composition's is refused (the log of another run?). ``supervised_tokens``
and ``max_memory_bytes`` are null (the logs do not print them per step).
"""  # noqa: E501 (the docstring quotes log lines verbatim, each one line as the trainers print it)

from __future__ import annotations

import argparse
import ast
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.inputs import MAX_LOG_LINE_BYTES, raw_lines
from trainer.record.rundir import CONFIG, METRICS, RECORD, load_config
from trainer.report.metrics import MAX_STEP, MAX_STEPS, Step, write_metrics
from trainer.report.steplines import ANSI, MEGATRON_ITERATION, MILES_START, miles_partial

MILES_STEP = re.compile(r"\bstep (\d+): (\{.*\})\s*$")
MILES_PERF = re.compile(r"\bperf (\d+): (\{.*\})\s*$")
RAY_REPEATED = re.compile(r"\[repeated (\d{1,18})x across cluster\]")
LOSS_KEYS = ("train/loss", "train/lm_loss")
LISTED = 20  # line numbers listed per kind in the summary and --json (the counts are complete)

# numpy >= 2 reprs of scalars (np.float64(0.5)) and torch's of a scalar tensor (tensor(0.5, device='cuda:0'))
_NUMPY_SCALARS = {
    f"{kind}{bits}"
    for kind, sizes in (("float", (16, 32, 64, 128)), ("int", (8, 16, 32, 64)), ("uint", (8, 16, 32, 64)))
    for bits in sizes
}
_NUMPY_SCALARS |= {
    "longdouble",
    "double",
    "single",
    "half",
    "intc",
    "intp",
    "uintp",
    "longlong",
    "ulonglong",
    "bool_",
    "bool",
}
SCALAR_CALLS = {f"{prefix}.{name}" for prefix in ("np", "numpy") for name in _NUMPY_SCALARS} | {
    "tensor",
    "torch.tensor",
}
NAMED_CONSTANTS = {
    "nan": math.nan,
    "inf": math.inf,
    "np.nan": math.nan,
    "np.inf": math.inf,
    "np.True_": True,
    "np.False_": False,
    "numpy.True_": True,
    "numpy.False_": False,
}


@dataclass(frozen=True)
class Unreadable:
    """A value of a miles dict that is not a literal nor a known number repr (its source text)."""

    text: str


@dataclass(frozen=True)
class SkippedLine:
    """A log line that looked like a step line but was not made into one: ``line`` (1-based line number),
    ``kind`` (``"megatron step"``, ``"miles step"``, ``"miles perf"`` or ``"other"``), ``step`` (1-based,
    the step the line names, when it names one) and ``repeats`` (for a Ray-deduplicated line: the N of
    ``[repeated Nx across cluster]``, the lines it stands for; else 1)."""

    line: int
    kind: str
    step: int | None = None
    repeats: int = 1

    @property
    def is_step(self) -> bool:
        """True for a training-step line (Megatron iteration or miles ``step`` with a loss), not ``perf``."""
        return self.kind in ("megatron step", "miles step")


@dataclass
class LogRead:
    """What :func:`read_log` made of a log: the steps, the lines it left out, and where tokens came from.

    ``truncated`` and ``deduplicated`` hold the lines counted but never made into steps (module
    docstring), ``long`` the lines longer than :data:`~trainer.inputs.MAX_LOG_LINE_BYTES` (64 KiB), skipped
    unread (a step line is < 4 KiB; printed arguments or samples are longer); ``tokens_from`` names the source
    of the rows per step (``"log"``, ``"composition"``, both joined by ``" and "``, or ``""`` when no step has
    tokens)."""

    steps: list[Step]
    truncated: list[SkippedLine] = field(default_factory=list)
    deduplicated: list[SkippedLine] = field(default_factory=list)
    long: list[SkippedLine] = field(default_factory=list)
    tokens_from: str = ""

    def summary(self) -> dict[str, Any]:
        """The counts as a JSON-able dict (``--json``): truncated lines, Ray-deduplicated lines and the lines
        they stand for (all, and step lines only), with the first :data:`LISTED` line numbers of each."""
        dedup_steps = [d for d in self.deduplicated if d.is_step]
        return {
            "truncated_lines": {
                "count": len(self.truncated),
                "step_lines": sum(t.is_step for t in self.truncated),
                "lines": [_skipped_json(t) for t in self.truncated[:LISTED]],
            },
            "ray_deduplicated": {
                "count": len(self.deduplicated),
                "stands_for_lines": sum(d.repeats for d in self.deduplicated),
                "step_lines": len(dedup_steps),
                "step_lines_stand_for": sum(d.repeats for d in dedup_steps),
                "lines": [
                    _skipped_json(d) for d in (dedup_steps + [d for d in self.deduplicated if not d.is_step])[:LISTED]
                ],
            },
            "long_lines": {
                "count": len(self.long),
                "max_bytes": MAX_LOG_LINE_BYTES,
                "lines": [s.line for s in self.long[:LISTED]],
            },
        }


def _skipped_json(s: SkippedLine) -> dict[str, Any]:
    return {"line": s.line, "kind": s.kind, "step": s.step, "repeats": s.repeats}


def _float(text: str, where: str, field: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{where}: {field} {text!r} is not a number") from None


def parse_megatron(line: str, where: str) -> dict[str, Any] | None:
    """One Megatron ``training_log`` line -> {step, lm_loss, grad_norm, lr, global_batch_size (rows),
    step_time_s (seconds), skipped_iterations, nan_iterations} (those present; ``lm_loss`` NaN when the
    line has none), or None when it is no iteration line. The caller checks that the line is complete."""
    match = MEGATRON_ITERATION.search(line)
    if not match:
        return None
    fields: dict[str, str] = {}
    for part in line[match.end() :].split("|"):
        key, sep, value = part.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    loss = _float(fields["lm loss"], where, "lm loss") if "lm loss" in fields else math.nan  # NaN or skipped
    row: dict[str, Any] = {"step": _step_number(match.group(1), where), "lm_loss": loss}
    for field_name, key in (
        ("number of skipped iterations", "skipped_iterations"),
        ("number of nan iterations", "nan_iterations"),
    ):
        if field_name in fields:
            text = fields[field_name]
            if not re.fullmatch(r"[+-]?\d{1,19}", text):
                raise UserError(f"{where}: {field_name} {text[:40]!r} is not an integer")
            row[key] = int(text)
    if "grad norm" in fields:
        row["grad_norm"] = _float(fields["grad norm"], where, "grad norm")
    if "learning rate" in fields:
        row["lr"] = _float(fields["learning rate"], where, "learning rate")
    if "global batch size" in fields:
        row["global_batch_size"] = _float(fields["global batch size"], where, "global batch size")
    if "elapsed time per iteration (ms)" in fields:
        row["step_time_s"] = (
            _float(fields["elapsed time per iteration (ms)"], where, "elapsed time per iteration (ms)") / 1000.0
        )
    return row


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _value(node: ast.AST, text: str) -> Any:
    """A miles dict value: a literal, ``nan``/``inf``, or a numpy/torch scalar repr as the number; anything
    else is :class:`Unreadable`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand, text)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, (ast.Name, ast.Attribute)):
        name = _dotted(node)
        if name in NAMED_CONSTANTS:
            return NAMED_CONSTANTS[name]
    elif isinstance(node, ast.Call) and (call := _dotted(node.func)) in SCALAR_CALLS and len(node.args) == 1:
        name = call or ""  # a name of SCALAR_CALLS
        if name.startswith(("np.", "numpy.")) and node.keywords:
            return Unreadable(ast.get_source_segment(text, node) or name)
        inner = _value(node.args[0], text)
        if isinstance(inner, str):  # np.longdouble('0.5')
            try:
                inner = float(inner)
            except ValueError:
                pass
        if isinstance(inner, (int, float)):
            if name.endswith(("bool_", ".bool")):
                return bool(inner)
            if "float" in name or name.endswith(("double", "single", "half")):
                try:
                    return float(inner)
                except OverflowError:  # an integer beyond a float's range
                    return Unreadable(ast.get_source_segment(text, node) or name)
            return inner
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item, text) for item in node.elts]
    elif isinstance(node, ast.Dict):
        return {
            _value(k, text): _value(v, text)
            for k, v in zip(node.keys, node.values, strict=True)  # a dict display: one value per key
            if k is not None and isinstance(_value(k, text), str)
        }
    return Unreadable(ast.get_source_segment(text, node) or type(node).__name__)


def _literal_dict(text: str, where: str) -> dict[str, Any]:
    """The dict a miles line prints (``{'train/loss': 1.2, ...}``) with its values read by :func:`_value`.

    Raises :class:`UserError` naming ``where`` when the text is not a dict expression."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise UserError(f"{where}: not a Python dict: {text[:80]}") from None
    if not isinstance(tree, ast.Dict):
        raise UserError(f"{where}: expected a dict after the colon")
    try:
        value = _value(tree, text.strip())
    except RecursionError:
        raise UserError(f"{where}: dict nested too deeply") from None
    return value


def _number(values: dict[str, Any], key: str, where: str) -> float | None:
    """``values[key]`` as a float, None when absent; :class:`UserError` naming ``where`` when not a number."""
    if key not in values:
        return None
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        shown = value.text if isinstance(value, Unreadable) else repr(value)
        raise UserError(f"{where}: {key} is {shown[:60]}, not a number")
    try:
        return float(value)
    except OverflowError:
        raise UserError(f"{where}: {key} is an integer of {len(str(value)):,} digits, too large for a number") from None


def _dedup_kind(text: str) -> tuple[str, int | None]:
    """What a Ray-deduplicated (or truncated) line would have been: its kind and the 1-based step it names."""
    match = MEGATRON_ITERATION.search(text)
    if match:
        return "megatron step", _shown_step(match.group(1))
    match = MILES_START.search(text)
    if match:
        if match.group(1) == "perf":
            return "miles perf", _shown_step(match.group(2), 1)
        if any(f"'{k}'" in match.group(3) or f'"{k}"' in match.group(3) for k in LOSS_KEYS):
            return "miles step", _shown_step(match.group(2), 1)
        if miles_partial(match.group(3)) and not match.group(3).rstrip().endswith("}"):
            return "miles step", _shown_step(match.group(2), 1)  # cut before its loss key
    return "other", None


def _shown_step(digits: str, offset: int = 0) -> int | None:
    """The step a line that is not read names (for the summary), None beyond a signed 64-bit integer."""
    return int(digits) + offset if len(digits) <= 18 else None


class _TextLines:
    """``(index, line number, line)`` of a log's text (``str.splitlines``); ``cut_at_end`` once iterated."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.cut_at_end = bool(text) and not text.endswith(("\n", "\r"))

    def __iter__(self) -> Iterator[tuple[int, str | None]]:
        return enumerate(self.text.splitlines(), start=1)


class _FileLines:
    """``(line number, text)`` of a log file read as a stream: lines end at ``\n`` (numbered as editors number
    them), each split again where ``str.splitlines`` would (a ``\r`` of a progress bar), decoded as UTF-8 with
    bad bytes replaced; a line longer than :data:`~trainer.inputs.MAX_LOG_LINE_BYTES` is ``(number, None)``.
    Memory is bounded by that cap whatever the file's size; a FIFO or device is refused without blocking."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cut_at_end = False

    def __iter__(self) -> Iterator[tuple[int, str | None]]:
        last = b""
        for number, raw in raw_lines(self.path, "training log", MAX_LOG_LINE_BYTES, long="skip"):
            last = raw or b"\n"
            if raw is None:
                yield number, None
                continue
            for segment in raw.decode("utf-8", errors="replace").splitlines():
                yield number, segment
        self.cut_at_end = not last.endswith((b"\n", b"\r"))


def _step_number(digits: str, where: str, offset: int = 0) -> int:
    """The 1-based step of a log's step counter ``digits`` (+ ``offset``: 1 for miles' 0-based steps); raises
    :class:`UserError` naming ``where`` unless it is one metrics.jsonl holds (1..MAX_STEP, a signed 64-bit int)."""
    step = int(digits) + offset if len(digits) <= 19 else MAX_STEP + 1
    if not 1 <= step <= MAX_STEP:
        shown = digits if len(digits) <= 40 else f"{digits[:20]}... ({len(digits):,} digits)"
        raise UserError(
            f"{where}: step {shown} (+{offset}) is not a step metrics.jsonl holds (1..{MAX_STEP:,})"
            if offset
            else f"{where}: iteration {shown} is not a step metrics.jsonl holds (1..{MAX_STEP:,})"
        )
    return step


def _check_row(row: dict[str, Any], where: str) -> None:
    """Refuse (one line naming ``where`` and the field) a value `trainer report` or `converge` would refuse in the
    metrics.jsonl written from it: a step time that is not a positive finite number of seconds, a global batch size
    that is not a positive integer, a Megatron count below 0. A loss or grad norm that is not finite is kept (the
    convergence check fails such a step: it is a result, not bad input)."""
    time_s = row.get("step_time_s")
    if time_s is not None and not (math.isfinite(time_s) and time_s > 0):
        raise UserError(f"{where}: step time {time_s!r} s, expected a positive finite number of seconds")
    gbs = row.get("global_batch_size")
    if gbs is not None and not (math.isfinite(gbs) and gbs >= 1 and gbs == int(gbs) and gbs <= MAX_STEP):
        raise UserError(f"{where}: global batch size {gbs!r}, expected a positive integer number of rows")
    for key in ("skipped_iterations", "nan_iterations"):
        if row.get(key) is not None and not 0 <= row[key] <= MAX_STEP:
            raise UserError(f"{where}: {key.replace('_', ' ')} {row[key]}, expected an integer >= 0")


def read_log(
    source: str | Path,
    name: str | None = None,
    seq_length: int | None = None,
    global_batch_size: int | None = None,
) -> LogRead:
    """All steps of a log (both formats), sorted by step, with the lines left out (:class:`LogRead`).

    ``source``: the log's text, or a :class:`~pathlib.Path` of a log file, read as a stream (:class:`_FileLines`:
    memory bounded by the line cap and the steps kept, never by the file's size; lines over the cap are skipped
    and counted in ``LogRead.long``). ``name`` (default: the path) names the log in errors. ``seq_length``:
    tokens per row; ``global_batch_size``: rows per step of the run's composition, used where the log prints none
    (miles); tokens per step = rows x ``seq_length``. Raises :class:`UserError` naming the log and line when no
    complete step line is found, a value is not a number, a step appears twice with different values, the log's
    global batch size differs from ``global_batch_size``, a value is one metrics.jsonl readers refuse
    (:func:`_check_row`, :func:`_step_number`), or the log holds more than :data:`MAX_STEPS` lines kept.
    """
    stream = _FileLines(source) if isinstance(source, Path) else _TextLines(source)
    name = str(source) if name is None and isinstance(source, Path) else (name or "log")
    perf: dict[int, float] = {}
    miles_steps = set()
    read = LogRead(steps=[])
    candidates: list[tuple[int, int, dict[str, Any], bool]] = []  # (segment index, line, row, ends without "|")
    pipe_ended = False  # Megatron-LM ends every field with " |"; a fork's lines may end otherwise
    index = 0
    for index, (number, raw) in enumerate(stream, start=1):
        where = f"{name} line {number}"
        if len(candidates) + len(read.truncated) + len(read.deduplicated) + len(read.long) > MAX_STEPS:
            raise UserError(
                f"{where}: more than {MAX_STEPS:,} step, truncated, deduplicated and over-long lines "
                f"(the most `trainer logs` keeps; a report reads at most {MAX_STEPS:,} steps)"
            )
        if raw is None:
            read.long.append(SkippedLine(number, "other"))
            continue
        line = ANSI.sub("", raw)
        repeated = RAY_REPEATED.search(line)
        if repeated:
            kind, step = _dedup_kind(line[: repeated.start()])
            read.deduplicated.append(SkippedLine(number, kind, step, int(repeated.group(1))))
            continue
        row = parse_megatron(line, where)
        if row is not None:
            unpiped = not line.rstrip().endswith("|")
            pipe_ended = pipe_ended or not unpiped
            candidates.append((index, number, row, unpiped))
            continue
        start = MILES_START.search(line)
        if start is None:
            continue
        full = (MILES_STEP if start.group(1) == "step" else MILES_PERF).search(line)
        if full is None:
            if miles_partial(start.group(3)):
                read.truncated.append(
                    SkippedLine(
                        number,
                        "miles perf" if start.group(1) == "perf" else "miles step",
                        _step_number(start.group(2), where, 1),
                    )
                )
            continue
        values = _literal_dict(full.group(2), where)
        if start.group(1) == "perf":
            time_s = _number(values, "perf/actor_train_time", where)
            if time_s is not None:
                _check_row({"step_time_s": time_s}, where)
                perf[_step_number(full.group(1), where, 1)] = time_s
            continue
        loss_key = next((k for k in LOSS_KEYS if k in values), None)
        if loss_key is None:
            continue  # another role's step or a dict without a loss
        row = {"step": _step_number(full.group(1), where, 1), "lm_loss": _number(values, loss_key, where)}
        for src, dst in (
            ("train/grad_norm", "grad_norm"),
            ("train/lr-pg_0", "lr"),
            ("train/global_batch_size", "global_batch_size"),
        ):
            value = _number(values, src, where)
            if value is not None:
                row[dst] = value
        miles_steps.add(row["step"])
        candidates.append((index, number, row, False))
    rows: dict[int, dict[str, Any]] = {}
    seen_at: dict[int, int] = {}
    for at, number, row, unpiped in candidates:  # in line order, now that the whole log is known
        where = f"{name} line {number}"
        if unpiped and (pipe_ended or (stream.cut_at_end and at == index)):
            read.truncated.append(SkippedLine(number, "megatron step", row["step"]))
            continue
        _check_row(row, where)
        logged = row.get("global_batch_size")
        if logged is not None and global_batch_size is not None and logged != global_batch_size:
            raise UserError(
                f"{where}: global batch size {logged:g} in the log, {global_batch_size} in the run's composition "
                "(optim.global_batch_size or --global-batch-size): is this the run's log?"
            )
        step = row["step"]
        if step in rows and _differs(rows[step], row):
            raise UserError(
                f"{where}: step {step} again (first at line {seen_at[step]}) with other values; "
                "a restarted run? cut the log at the restart"
            )
        rows[step] = row
        seen_at[step] = number
    read.truncated.sort(key=lambda t: t.line)
    if not rows:
        left_out = _left_out_text(read)
        raise UserError(
            f"{name}: no training step lines found (expected Megatron 'iteration N/ M | ...' "
            "or miles 'step N: {...}' lines; see `trainer logs --help`)" + (f"; {left_out}" if left_out else "")
        )
    # a rollout's time is a step's time only when each rollout is one step (steps numbered like rollouts)
    one_step_per_rollout = miles_steps and max(miles_steps) <= max(perf, default=0) + 1
    sources = set()
    for step in sorted(rows):
        row = rows[step]
        if "step_time_s" not in row and one_step_per_rollout and step in perf:
            row["step_time_s"] = perf[step]
        gbs = row.pop("global_batch_size", None)
        source = "log"
        if gbs is None:
            gbs, source = global_batch_size, "composition"
        tokens = float(gbs * seq_length) if gbs is not None and seq_length else None
        if tokens is not None and not math.isfinite(tokens):
            raise UserError(f"{name} step {step}: {gbs:g} rows x {seq_length} tokens is not a finite number of tokens")
        if tokens is not None:
            sources.add(source)
        read.steps.append(Step(tokens=tokens, **row))
    read.tokens_from = " and ".join(s for s in ("log", "composition") if s in sources)
    return read


def parse_log(
    text: str, name: str = "log", seq_length: int | None = None, global_batch_size: int | None = None
) -> list[Step]:
    """The steps of :func:`read_log` (``seq_length`` in tokens per row, ``global_batch_size`` in rows)."""
    return read_log(text, name, seq_length, global_batch_size).steps


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            return True
    return False


def _lines(items: list[SkippedLine]) -> str:
    shown = ", ".join(str(s.line) for s in items[:5])
    return f"line{'s' if len(items) > 1 else ''} {shown}{', ...' if len(items) > 5 else ''}"


def _left_out_text(read: LogRead) -> str:
    """The summary's words for the lines left out (empty when none)."""
    parts = []
    if read.truncated:
        steps = sum(t.is_step for t in read.truncated)
        parts.append(
            f"{len(read.truncated)} truncated line{'s' if len(read.truncated) > 1 else ''} not read "
            f"({_lines(read.truncated)}; {steps} of them step lines)"
        )
    if read.deduplicated:
        dedup_steps = [d for d in read.deduplicated if d.is_step]
        text = (
            f"{len(read.deduplicated)} Ray-deduplicated line{'s' if len(read.deduplicated) > 1 else ''} not read "
            f"(standing for {sum(d.repeats for d in read.deduplicated)} lines"
        )
        if dedup_steps:
            text += (
                f"; {len(dedup_steps)} of them step lines standing for {sum(d.repeats for d in dedup_steps)} "
                f"step lines, {_lines(dedup_steps)}: steps may be missing, rerun with RAY_DEDUP_LOGS=0"
            )
        parts.append(text + ")")
    if read.long:
        parts.append(
            f"{len(read.long)} line{'s' if len(read.long) > 1 else ''} longer than {MAX_LOG_LINE_BYTES:,} "
            f"bytes skipped ({_lines(read.long)}; a step line is shorter)"
        )
    return "; ".join(parts)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer logs`` (``--seq-length`` in tokens per row, ``--global-batch-size``
    in rows per optimizer step)."""
    p = argparse.ArgumentParser(
        prog="trainer logs",
        description="Read per-step LM loss, grad norm, learning rate and iteration time from a Megatron-LM or miles "
        "training log and write them as metrics.jsonl (the form `trainer report` and `trainer converge` read). "
        "Tokens per step = global batch size x sequence length: a miles log prints no global batch size, so give "
        "the run (--run RUN_DIR: its config.yaml) or --global-batch-size with --seq-length.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("log", type=Path, help="training log (stdout of the training job)")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        help="metrics.jsonl to write (or a directory); default with --run: RUN_DIR/metrics.jsonl",
    )
    p.add_argument(
        "--run",
        type=Path,
        metavar="RUN_DIR",
        help="the run the log is of: rows per step from its config.yaml optim.global_batch_size, tokens per "
        "row from data.seq_length",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        metavar="ROWS",
        help="rows per optimizer step, for a log that prints none (miles); needs --seq-length",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        metavar="TOKENS",
        help="tokens per row; with the log's (or --global-batch-size's) rows gives tokens per step",
    )
    p.add_argument("--force", action="store_true", help="replace an existing metrics.jsonl")
    p.add_argument(
        "--json",
        action="store_true",
        help="print what was read as JSON (steps, tokens, truncated and Ray-deduplicated lines)",
    )
    return p


def composition(args: argparse.Namespace) -> tuple[int | None, int | None, str]:
    """``(global batch size in rows, sequence length in tokens, source)`` from ``--run`` or the flags.

    Raises :class:`UserError` on a flag that is not positive, ``--run`` with the flags, ``--global-batch-size``
    without ``--seq-length``, or a run directory without a readable ``config.yaml``."""
    for flag, value in (("--seq-length", args.seq_length), ("--global-batch-size", args.global_batch_size)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value}: expected a positive number")
    if args.run is not None:
        if args.seq_length is not None or args.global_batch_size is not None:
            raise UserError(
                "--run takes the global batch size and sequence length from RUN_DIR/config.yaml; "
                "leave out --seq-length and --global-batch-size"
            )
        if not args.run.is_dir():
            raise UserError(f"{args.run}: no such run directory (--run RUN_DIR)")
        if not (args.run / CONFIG).is_file():
            raise UserError(f"{args.run}: no config.yaml (not a run directory written by `train`)")
        cfg = load_config(args.run / CONFIG)
        return (
            int(cfg.optim.global_batch_size),
            int(cfg.data.seq_length),
            f"{args.run / CONFIG} optim.global_batch_size x data.seq_length",
        )
    if args.global_batch_size is not None and args.seq_length is None:
        raise UserError("--global-batch-size needs --seq-length (tokens per step = rows x tokens per row)")
    return args.global_batch_size, args.seq_length, "--global-batch-size x --seq-length"


def main(argv: list[str]) -> int:
    """Entry point of ``trainer logs``; writes metrics.jsonl atomically and prints what it read (and left out)."""
    args = parser().parse_args(argv)
    if not args.log.exists():
        raise UserError(f"{args.log}: no such log file")
    gbs, seq_length, source = composition(args)
    if args.output is None:
        if args.run is None:
            raise UserError(
                "where to write? pass -o metrics.jsonl (or a directory), or --run RUN_DIR to write "
                "RUN_DIR/metrics.jsonl"
            )
        args.output = args.run
    read = read_log(args.log, str(args.log), seq_length, gbs)  # a stream: bounded memory, a FIFO refused
    steps = read.steps
    out = args.output / METRICS if args.output.is_dir() else args.output
    if out.exists() and not args.force:
        whose = " (a run's own metrics)" if (out.parent / RECORD).is_file() else ""
        raise UserError(f"{out}: exists{whose}; pass --force to replace it, or write to another file")
    write_metrics(out, steps)
    timed = sum(s.step_time_s is not None for s in steps)
    with_tokens = sum(s.tokens is not None for s in steps)
    lossless = [s.step for s in steps if not math.isfinite(s.lm_loss)]
    tokens_from = {
        "log": "the log's global batch size x --seq-length",
        "composition": source,
        "log and composition": f"the log's global batch size where printed, else {source}",
    }.get(read.tokens_from)
    if args.json:
        print(
            json.dumps(
                {
                    "metrics": str(out),
                    "steps": len(steps),
                    "first_step": steps[0].step,
                    "last_step": steps[-1].step,
                    "steps_with_step_time": timed,
                    "tokens": {
                        "steps": with_tokens,
                        "from": tokens_from,
                        "global_batch_size": gbs,
                        "seq_length": seq_length,
                    },
                    "nonfinite_loss_steps": lossless,
                    **read.summary(),
                },
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    tokens_text = f"{with_tokens} with tokens"
    if tokens_from:
        tokens_text += f" (from {tokens_from})"
    elif not with_tokens:
        tokens_text += " (pass --run RUN_DIR, or --seq-length and, for a miles log, --global-batch-size)"
    print(
        f"{out}: {len(steps)} steps ({steps[0].step}..{steps[-1].step}), {timed} with a step time, {tokens_text}"
        + (
            f", {len(lossless)} without a finite loss (steps {', '.join(map(str, lossless[:5]))}"
            f"{', ...' if len(lossless) > 5 else ''})"
            if lossless
            else ""
        )
    )
    left_out = _left_out_text(read)
    if left_out:
        print(f"{args.log}: {left_out}")
    return 0
