"""``trainer logs LOG``: per-step loss, grad norm and iteration time from a training log, as ``metrics.jsonl``.

Two line formats are read; anything else in the log is ignored (timestamps, Ray prefixes such as
``(MegatronTrainRayActor pid=123)``, other output).

Megatron-LM ``training_log`` (``megatron/training/training.py``), fields separated by ``|``::

     [2026-10-13 12:00:00] iteration        5/      20 | consumed samples:          640 | elapsed time per iteration (ms): 20270.1 | learning rate: 9.000000E-06 | global batch size:   128 | lm loss: 1.234567E+00 | loss scale: 1.0 | grad norm: 0.987 | number of skipped iterations:   0 | number of nan iterations:   0 |

  ``iteration N/ M`` is the 1-based step N (the step just finished); ``elapsed time per iteration (ms)``
  gives ``step_time_s`` (ms / 1000; with ``--log-interval`` > 1 it is the mean over the interval, and
  only every interval-th step is logged); ``lm loss``, ``grad norm`` (``nan``/``inf`` kept),
  ``learning rate``, ``global batch size``, ``number of skipped iterations`` and ``number of nan
  iterations`` are read where present; other fields are ignored.

  Every iteration line is a step. Megatron prints ``lm loss`` only when the interval's mean loss is
  > 0 (``training_log``: ``if avg > 0.0``), so an iteration whose loss was NaN, or that the optimizer
  skipped (its loss is then not summed), has a line without a loss: it becomes a step with
  ``lm_loss`` NaN (written ``"NaN"`` in metrics.jsonl) and the two counts, and fails ``trainer
  converge`` as a step without a finite loss, instead of disappearing from the run.

miles / slime (``backends/megatron_utils/model.py``), a Python dict per step and per rollout::

    step 4: {'train/loss': 1.2345, 'train/grad_norm': 0.987, 'train/lr-pg_0': 9e-06, 'train/global_batch_size': 128, 'train/step': 4}
    perf 4: {'perf/actor_train_time': 20.27, 'perf/step_time': 21.0}

  ``step K`` is 0-based (``rollout_id x steps_per_rollout + step_id``), so the step is K + 1; the loss is
  ``train/loss`` (or ``train/lm_loss``), the grad norm ``train/grad_norm``, the learning rate
  ``train/lr-pg_0``. ``perf R`` (0-based rollout R) gives the step time from ``perf/actor_train_time``
  (seconds); it is used only where a rollout holds one optimizer step (the recipe's SFT launch:
  ``--global-batch-size`` = ``--rollout-batch-size``), as step R + 1.

``tokens`` = global batch size x ``--seq-length`` when both are known (fixed-length rows), else null;
``supervised_tokens`` and ``max_memory_bytes`` are null (the logs do not print them per step).
"""

from __future__ import annotations

import argparse
import ast
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.errors import UserError
from trainer.record.rundir import METRICS, RECORD
from trainer.report.metrics import Step, write_metrics

MEGATRON_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
MILES_STEP = re.compile(r"\bstep (\d+): (\{.*\})\s*$")
MILES_PERF = re.compile(r"\bperf (\d+): (\{.*\})\s*$")
NONFINITE = re.compile(r"(?<![\w'\"])(-?)(nan|inf)(?![\w'\"])", re.IGNORECASE)
LOSS_KEYS = ("train/loss", "train/lm_loss")


def _float(text: str, where: str, field: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{where}: {field} {text!r} is not a number") from None


def parse_megatron(line: str, where: str) -> Optional[Dict[str, Any]]:
    """One Megatron ``training_log`` line -> {step, lm_loss, grad_norm, lr, global_batch_size, step_time_s,
    skipped_iterations, nan_iterations} (those present; ``lm_loss`` NaN when the line has none), or None."""
    match = MEGATRON_ITERATION.search(line)
    if not match:
        return None
    fields: Dict[str, str] = {}
    for part in line[match.end():].split("|"):
        key, sep, value = part.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    loss = _float(fields["lm loss"], where, "lm loss") if "lm loss" in fields else math.nan  # NaN or skipped
    row: Dict[str, Any] = {"step": int(match.group(1)), "lm_loss": loss}
    for field, key in (("number of skipped iterations", "skipped_iterations"), ("number of nan iterations", "nan_iterations")):
        if field in fields:
            try:
                row[key] = int(fields[field])
            except ValueError:
                raise UserError(f"{where}: {field} {fields[field]!r} is not an integer") from None
    if "grad norm" in fields:
        row["grad_norm"] = _float(fields["grad norm"], where, "grad norm")
    if "learning rate" in fields:
        row["lr"] = _float(fields["learning rate"], where, "learning rate")
    if "global batch size" in fields:
        row["global_batch_size"] = _float(fields["global batch size"], where, "global batch size")
    if "elapsed time per iteration (ms)" in fields:
        row["step_time_s"] = _float(fields["elapsed time per iteration (ms)"], where, "elapsed time per iteration (ms)") / 1000.0
    return row


def _literal_dict(text: str, where: str) -> Dict[str, Any]:
    quoted = NONFINITE.sub(lambda m: f"'{m.group(1)}{m.group(2).lower()}'", text)
    try:
        value = ast.literal_eval(quoted)
    except (ValueError, SyntaxError):
        raise UserError(f"{where}: not a Python dict literal: {text[:80]}") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a dict after the colon")
    return {k: (float(v) if isinstance(v, str) and v.lstrip("-") in ("nan", "inf") else v) for k, v in value.items()}


def parse_log(text: str, name: str = "log", seq_length: Optional[int] = None) -> List[Step]:
    """All steps of a log (both formats), sorted by step.

    Raises :class:`UserError` naming the log and line when no step line is found, a value is not a
    number, or a step appears twice with different values.
    """
    rows: Dict[int, Dict[str, Any]] = {}
    seen_at: Dict[int, int] = {}
    perf: Dict[int, float] = {}
    miles_steps = set()
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{name} line {number}"
        row = parse_megatron(line, where)
        if row is None:
            match = MILES_STEP.search(line)
            if match:
                values = _literal_dict(match.group(2), where)
                loss_key = next((k for k in LOSS_KEYS if k in values), None)
                if loss_key is None:
                    continue  # another role's step or a dict without a loss
                row = {"step": int(match.group(1)) + 1, "lm_loss": float(values[loss_key])}
                for src, dst in (("train/grad_norm", "grad_norm"), ("train/lr-pg_0", "lr"),
                                 ("train/global_batch_size", "global_batch_size")):
                    if isinstance(values.get(src), (int, float)):
                        row[dst] = float(values[src])
                miles_steps.add(row["step"])
            else:
                match = MILES_PERF.search(line)
                if match:
                    values = _literal_dict(match.group(2), where)
                    if isinstance(values.get("perf/actor_train_time"), (int, float)):
                        perf[int(match.group(1)) + 1] = float(values["perf/actor_train_time"])
                continue
        step = row["step"]
        if step in rows and _differs(rows[step], row):
            raise UserError(
                f"{where}: step {step} again (first at line {seen_at[step]}) with other values; "
                "a restarted run? cut the log at the restart"
            )
        rows[step] = row
        seen_at[step] = number
    if not rows:
        raise UserError(
            f"{name}: no training step lines found (expected Megatron 'iteration N/ M | ...' "
            "or miles 'step N: {...}' lines; see `trainer logs --help`)"
        )
    # a rollout's time is a step's time only when each rollout is one step (steps numbered like rollouts)
    one_step_per_rollout = miles_steps and max(miles_steps) <= max(perf, default=0) + 1
    steps = []
    for step in sorted(rows):
        row = rows[step]
        if "step_time_s" not in row and one_step_per_rollout and step in perf:
            row["step_time_s"] = perf[step]
        gbs = row.pop("global_batch_size", None)
        tokens = gbs * seq_length if gbs is not None and seq_length else None
        steps.append(Step(tokens=tokens, **row))
    return steps


def _differs(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            return True
    return False


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer logs`` (``--seq-length`` in tokens per row)."""
    p = argparse.ArgumentParser(
        prog="trainer logs",
        description="Read per-step LM loss, grad norm, learning rate and iteration time from a Megatron-LM or miles "
        "training log and write them as metrics.jsonl (the form `trainer report` and `trainer converge` read).",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("log", type=Path, help="training log (stdout of the training job)")
    p.add_argument("-o", "--output", type=Path, required=True, help="metrics.jsonl to write (or a directory)")
    p.add_argument("--force", action="store_true", help="replace an existing metrics.jsonl")
    p.add_argument("--seq-length", type=int, metavar="TOKENS", help="tokens per row; with the logged global batch size gives tokens per step")
    return p


def main(argv: List[str]) -> int:
    """Entry point of ``trainer logs``; writes metrics.jsonl atomically and prints what it read."""
    args = parser().parse_args(argv)
    if not args.log.is_file():
        raise UserError(f"{args.log}: no such log file")
    if args.seq_length is not None and args.seq_length <= 0:
        raise UserError(f"--seq-length {args.seq_length}: expected a positive number of tokens")
    steps = parse_log(args.log.read_text(encoding="utf-8", errors="replace"), str(args.log), args.seq_length)
    out = args.output / METRICS if args.output.is_dir() else args.output
    if out.exists() and not args.force:
        whose = " (a run's own metrics)" if (out.parent / RECORD).is_file() else ""
        raise UserError(f"{out}: exists{whose}; pass --force to replace it, or write to another file")
    write_metrics(out, steps)
    timed = sum(s.step_time_s is not None for s in steps)
    lossless = [s.step for s in steps if not math.isfinite(s.lm_loss)]
    print(f"{out}: {len(steps)} steps ({steps[0].step}..{steps[-1].step}), {timed} with a step time, "
          f"{sum(s.tokens is not None for s in steps)} with tokens"
          + (f", {len(lossless)} without a finite loss (steps {', '.join(map(str, lossless[:5]))}"
             f"{', ...' if len(lossless) > 5 else ''})" if lossless else ""))
    return 0
