"""Per-step metrics of a run (``metrics.jsonl``) and the figures of a recipe's ``result:`` block.

``metrics.jsonl`` holds one JSON object per optimizer step, in step order:

=====================  ==========================================================================
key                    meaning
=====================  ==========================================================================
``step``               optimizer step, 1-based integer, strictly increasing (gaps allowed)
``lm_loss``            LM loss of the step (number, or ``"NaN"`` where the step has no finite loss:
                       Megatron prints ``lm loss`` only when it is > 0, so a NaN or skipped
                       iteration has none); fails the convergence check when not finite
``grad_norm``          global gradient norm (number or null)
``lr``                 learning rate (number or null)
``tokens``             tokens processed in the step by the whole job, all ranks (number or null)
``supervised_tokens``  tokens with a loss target in the step, whole job (number or null)
``step_time_s``        wall time of the step, seconds (number or null)
``max_memory_bytes``   peak allocated device memory of the step, max over ranks, bytes (or null)
``skipped_iterations`` Megatron's ``number of skipped iterations`` of the logging interval ending
                       at this step (integer or null where the log does not say)
``nan_iterations``     Megatron's ``number of nan iterations`` of that interval (integer or null)
=====================  ==========================================================================

Strict JSON: a number that is not finite is written as the string ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (the spelling of Python's ``json`` module, as a string, as ``convergence.json`` does), never
as a bare ``NaN``. Readers accept those three strings for any number key, and for compatibility the bare
tokens of files written before.

Figures (shared docs METRICS.md; the recipe's ``result:`` block):

* tokens/s per GPU = tokens in the window / window wall time / GPUs, where the window is an inclusive
  range of steps ``[first, last]`` (the recipe's is ``[5, 19]`` of 20) and its wall time is the sum of
  its steps' ``step_time_s`` (steps run back to back).
* MFU = 6 · N · (tokens/s per GPU) / peak, N = active parameters per token from the model's shapes
  (:func:`trainer.compose.params.count_params`), peak = ``cluster.gpu_peak_bf16_flops`` (989e12 for an H200 SXM,
  torchtitan's figure). The 6·N rule: 2 FLOPs per weight per token forward, 4 backward (Kaplan et al.
  2020, "Scaling Laws for Neural Language Models", sec. 2.1); attention scores are left out.
* model TFLOP/s/GPU: the Megatron-style per-layer count of :func:`model_flops_per_token` (second figure).
* $ per 1M tokens = $/node-hour / (tokens/s per GPU x GPUs per node x 3600) x 1e6.
* step-time CV = population standard deviation / mean of the window's step times, in percent.
* GPU-hours = GPUs x (scheduler admission to finish) when the run's record holds those times, else
  GPUs x the sum of all step times (startup excluded; the summary says which).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

from trainer.compose.params import CSA_RATIO, count_params
from trainer.compose.schema import ModelConfig
from trainer.errors import UserError
from trainer.inputs import kind_of, lines, parse_json
from trainer.publish import atomic_write
from trainer.record.rundir import METRICS
from trainer.report.steplines import step_line_kind

KEYS = (
    "step",
    "lm_loss",
    "grad_norm",
    "lr",
    "tokens",
    "supervised_tokens",
    "step_time_s",
    "max_memory_bytes",
    "skipped_iterations",
    "nan_iterations",
)
OPTIONAL_KEYS = KEYS[2:8]
COUNT_KEYS = KEYS[8:]  # integer counts (or null); absent from rows that do not know them
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
MAX_STEP = 2**63 - 1  # a step number is a signed 64-bit integer (Megatron's iteration counter)
MAX_STEPS = 2_000_000  # steps of one metrics.jsonl a report reads (memory ~100 bytes each)
DEFAULT_FIRST_STEP = 5  # the recipe's window starts at step 5 (steps 1-4: warm-up, JIT, allocator growth)
PEAK_SOURCE = "cluster.gpu_peak_bf16_flops (dense bf16 FLOP/s per GPU; 989e12 for H200 SXM as torchtitan uses)"


@dataclass(frozen=True, slots=True)
class Step:
    """One row of ``metrics.jsonl`` (units in the module docstring); absent optional keys are None."""

    step: int
    lm_loss: float
    grad_norm: float | None = None
    lr: float | None = None
    tokens: float | None = None
    supervised_tokens: float | None = None
    step_time_s: float | None = None
    max_memory_bytes: float | None = None
    skipped_iterations: int | None = None
    nan_iterations: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict: every key of :data:`KEYS` in that order (absent optional keys as None), except
        the Megatron counts, present only when known."""
        return {k: getattr(self, k) for k in KEYS if k not in COUNT_KEYS or getattr(self, k) is not None}

    @property
    def no_loss_reason(self) -> str | None:
        """Megatron's counts of the step's interval when its loss is not finite (``"1 skipped iteration"``),
        else None (a finite loss, or no counts logged)."""
        if math.isfinite(self.lm_loss):
            return None
        counts = [
            f"{n} {name} iteration{'s' if n != 1 else ''}"
            for name, n in (("skipped", self.skipped_iterations), ("nan", self.nan_iterations))
            if n
        ]
        return ", ".join(counts) or None


def json_number(value: Any) -> Any:
    """``value`` for strict JSON: a non-finite float becomes ``"NaN"``/``"Infinity"``/``"-Infinity"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def dumps_row(row: dict[str, Any]) -> str:
    """One ``metrics.jsonl`` line (no newline) of a row dict, strict JSON (non-finite numbers as strings)."""
    return json.dumps({k: json_number(v) for k, v in row.items()}, separators=(", ", ": "), allow_nan=False)


def metrics_path(path: Path) -> Path:
    """``path`` itself if it is a file, else ``path/metrics.jsonl``; raises :class:`UserError` if missing."""
    path = Path(path)
    target = path / METRICS if path.is_dir() else path
    if target.exists() and not target.is_file():  # a FIFO, device or directory: named, never opened to block
        raise UserError(f"{target}: {kind_of(target.stat().st_mode)}, not a regular file (a metrics.jsonl must be one)")
    if not target.is_file():
        raise UserError(
            f"{target}: no such file (expected a run directory with metrics.jsonl, or a metrics.jsonl file)"
        )
    return target


@overload
def _number(value: Any, where: str, key: str, allow_null: Literal[False]) -> float: ...
@overload
def _number(value: Any, where: str, key: str, allow_null: bool) -> float | None: ...
def _number(value: Any, where: str, key: str, allow_null: bool) -> float | None:
    if value is None and allow_null:
        return None
    if isinstance(value, str) and value in NONFINITE_STRINGS:
        return NONFINITE_STRINGS[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(
            f"{where}: {key} is {str(value)[:40]!r}, expected a number" + (" or null" if allow_null else "")
        )
    try:
        return float(value)
    except OverflowError:
        raise UserError(f"{where}: {key} is an integer of {len(str(value)):,} digits, too large for a number") from None


def parse_row(obj: Any, where: str) -> Step:
    """Validate one decoded ``metrics.jsonl`` object; ``where`` names file and line for the error.

    Raises :class:`UserError` on a missing ``step``/``lm_loss``, an unknown key, a non-integer or
    non-positive step, or a non-number value.
    """
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r} (expected keys: {', '.join(KEYS)})")
    for key in ("step", "lm_loss"):
        if key not in obj:
            raise UserError(f"{where}: missing key {key!r}")
    step = obj["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
        raise UserError(
            f"{where}: step is {str(step)[:40]!r}, expected an integer in 1..{MAX_STEP:,} (steps are 1-based)"
        )
    values: dict[str, Any] = {key: _number(obj.get(key), where, key, allow_null=True) for key in OPTIONAL_KEYS}
    for key in COUNT_KEYS:
        count = obj.get(key)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise UserError(f"{where}: {key} is {repr(count)[:40]}, expected an integer >= 0 or null")
        values[key] = count
    return Step(step=step, lm_loss=_number(obj["lm_loss"], where, "lm_loss", allow_null=False), **values)


def read_metrics(path: Path) -> list[Step]:
    """Read and validate ``metrics.jsonl`` (a run directory or the file itself).

    Returns the steps in file order. Raises :class:`UserError` naming the file and line for: a missing or
    empty file, a line that is not JSON (a truncated last line included), a bad row (:func:`parse_row`),
    and steps that do not strictly increase. A file whose first line is not JSON and that holds training
    step lines (a raw Megatron or miles log) is refused with the command that makes metrics.jsonl of it.
    """
    target = metrics_path(path)
    steps: list[Step] = []
    pending: tuple[int, str] | None = None  # a line that is not JSON: an error unless it is the last one
    stream = lines(target, "metrics.jsonl")
    for number, line in stream:
        if not line.strip():
            continue
        if pending is not None:
            raise UserError(pending[1])
        where = f"{target} line {number}"
        try:
            obj = parse_json(line, where, walk=False)
        except UserError as ex:
            if not steps:  # the first line: a training log given where metrics.jsonl was expected?
                found, more = _step_line(number, line, stream)
                if found is not None:
                    raise UserError(raw_log_hint(target, *found)) from None
                if more:
                    raise UserError(str(ex)) from None
            pending = (number, f"{ex}")
            continue
        row = parse_row(obj, where)
        if steps and row.step <= steps[-1].step:
            raise UserError(f"{where}: step {row.step} after step {steps[-1].step}: steps must strictly increase")
        steps.append(row)
        if len(steps) > MAX_STEPS:
            raise UserError(f"{target}: more than {MAX_STEPS:,} steps (the most a report reads)")
    if pending is not None:
        raise UserError(f"{pending[1]} (truncated last line: the run may still be writing or was killed)")
    if not steps:
        raise UserError(f"{target}: empty (no steps)")
    return steps


LOG_SCAN_LINES = 200_000  # lines of a file that is not metrics.jsonl searched for a training step line


def _step_line(number: int, line: str, rest: Any) -> tuple[tuple[int, str] | None, bool]:
    """Search ``line`` (line ``number``) and up to :data:`LOG_SCAN_LINES` lines of the ``rest`` of a
    :func:`trainer.inputs.lines` stream for a training step line: ``((line number, kind) or None, whether
    any non-blank line followed)``."""
    kind = step_line_kind(line)
    if kind:
        return (number, kind), False
    more = False
    try:
        for count, (n, text) in enumerate(rest):
            more = more or bool(text.strip())
            kind = step_line_kind(text)
            if kind:
                return (n, kind), True
            if count >= LOG_SCAN_LINES:
                break
    except UserError:  # a later line unreadable (not UTF-8, too long): not a metrics.jsonl either way
        return None, True
    return None, more


def raw_log_hint(path: Path, number: int, kind: str) -> str:
    """The one-line refusal of a training log given where metrics.jsonl is expected, naming the command
    that makes metrics.jsonl of it (``number``: the line of a step line, ``kind``: its format)."""
    return (
        f"{path}: a training log, not metrics.jsonl (line {number} is a {kind} line); run "
        f"`trainer logs {path} -o DIR` first (add --run RUN_DIR for tokens per step) and pass DIR"
    )


def write_metrics(path: Path, steps: Sequence[Step]) -> None:
    """Write ``steps`` as ``metrics.jsonl`` atomically (one strict JSON object per line, :func:`dumps_row`)."""
    data = "".join(dumps_row(s.as_dict()) + "\n" for s in steps)
    atomic_write(Path(path), data.encode())


# ---------------------------------------------------------------------------------------------- windows


def parse_window(text: str) -> tuple[int, int]:
    """``"5:19"`` or ``"5..19"`` or ``"5,19"`` -> ``(5, 19)`` (inclusive); raises :class:`UserError`."""
    for sep in ("..", ":", ","):
        if sep in text:
            a, _, b = text.partition(sep)
            try:
                return int(a), int(b)
            except ValueError:
                break
    raise UserError(f"--window {text!r}: expected FIRST:LAST, two step numbers (inclusive), e.g. 5:19")


def default_window(steps: Sequence[Step]) -> tuple[int, int]:
    """The recipe's rule: from step 5 to the step before the last (``[5, 19]`` of 20 steps)."""
    return DEFAULT_FIRST_STEP, steps[-1].step - 1


def select_window(steps: Sequence[Step], window: tuple[int, int], source: str = "metrics.jsonl") -> list[Step]:
    """The steps of the inclusive ``window``, each of which must be present with tokens and a step time.

    Raises :class:`UserError` for an empty window (last < first), a window outside the run's steps, a
    missing step inside it, or a step without a positive ``tokens`` and ``step_time_s``.
    """
    first, last = window
    if last < first:
        raise UserError(
            f"window [{first}, {last}] is empty (last step before first); the run has steps "
            f"{steps[0].step}..{steps[-1].step}: pass --window FIRST:LAST"
        )
    if first < steps[0].step or last > steps[-1].step:
        raise UserError(
            f"window [{first}, {last}] does not match {source}: it has steps {steps[0].step}..{steps[-1].step}"
        )
    # steps strictly increase, so the window is complete when it holds last - first + 1 of them (linear in the
    # steps the file has, never in the step numbers it claims)
    chosen = [s for s in steps if first <= s.step <= last]
    if len(chosen) != last - first + 1:
        expected = first
        for s in chosen:
            if s.step != expected:
                break
            expected += 1
        missing = last - first + 1 - len(chosen)
        raise UserError(f"window [{first}, {last}]: {source} lacks step {expected} ({missing:,} missing)")
    for s in chosen:
        for key in ("tokens", "step_time_s"):
            value = getattr(s, key)
            if value is None or not math.isfinite(value) or value <= 0:
                hint = ""
                if key == "tokens" and value is None:
                    hint = (
                        "; a log without a global batch size (miles prints none) gives no tokens: make "
                        "metrics.jsonl with `trainer logs LOG --run RUN_DIR` (or --global-batch-size ROWS "
                        "--seq-length TOKENS)"
                    )
                raise UserError(f"{source} step {s.step}: {key} is {value!r}, expected a positive number{hint}")
    return chosen


# ---------------------------------------------------------------------------------------------- figures


def tokens_per_s_per_gpu(tokens: float, seconds: float, gpus: int) -> float:
    """Throughput: ``tokens`` over ``seconds`` of wall time on ``gpus`` GPUs (tokens/s/GPU)."""
    if seconds <= 0 or gpus <= 0:
        raise UserError(f"throughput needs positive time and GPUs, got {seconds} s on {gpus} GPUs")
    return tokens / seconds / gpus


def mfu(active_params: int, tokens_per_s_gpu: float, peak_flops: float) -> float:
    """Model FLOPs utilisation 6·N·(tokens/s/GPU) / peak (a fraction; shared docs METRICS.md).

    ``active_params``: N, active parameters per token; ``peak_flops``: FLOP/s per GPU.
    """
    if peak_flops <= 0:
        raise UserError(f"cluster.gpu_peak_bf16_flops is {peak_flops}, expected a positive FLOP/s figure")
    return 6.0 * active_params * tokens_per_s_gpu / peak_flops


def usd_per_million_tokens(usd_per_node_hour: float | None, tokens_per_s_gpu: float, gpus_per_node: int) -> float:
    """$ per 1M tokens = $/node-hour / (tokens/s/GPU x GPUs per node x 3600) x 1e6.

    Raises :class:`UserError` when the cluster has no price (``cluster.usd_per_node_hour`` null).
    """
    if usd_per_node_hour is None:
        raise UserError(
            "cluster.usd_per_node_hour is null: the cluster has no price; pass --usd-per-node-hour DOLLARS or --no-cost"
        )
    if usd_per_node_hour < 0 or tokens_per_s_gpu <= 0 or gpus_per_node <= 0:
        raise UserError(
            f"cost needs a price >= 0 and positive throughput and GPUs per node, got ${usd_per_node_hour}/h, "
            f"{tokens_per_s_gpu} tokens/s/GPU, {gpus_per_node} GPUs per node"
        )
    return usd_per_node_hour / (tokens_per_s_gpu * gpus_per_node * 3600.0) * 1e6


def cv_percent(values: Sequence[float]) -> float:
    """Coefficient of variation in percent: population standard deviation / mean x 100 (needs >= 1 value)."""
    if not values:
        raise UserError("step-time CV of an empty window")
    return statistics.pstdev(values) / statistics.fmean(values) * 100.0


@dataclass(frozen=True)
class Flops:
    """Model FLOPs per token (forward + backward = 3 x forward), broken down; see :func:`model_flops_per_token`."""

    matmul: float  # 2 x active 2-D weights other than the output head, forward
    attention: float  # scores (QK^T) and values (AV), plus the sparse indexer's scores, forward
    logits: float  # output head 2 x V x H, forward
    per_token: float  # 3 x (matmul + attention + logits)


def _mean_keys(seq_length: int, window: int, ratio: int, topk: int) -> tuple[float, float]:
    """Mean over causal query positions of (keys attended, compressed entries scored by the indexer)."""
    pos = np.arange(1, seq_length + 1, dtype=np.float64)  # tokens visible to query i (itself included)
    keys = np.minimum(pos, window)
    scored = np.zeros_like(pos)
    if ratio > 0:
        compressed = np.floor(pos / ratio)
        if ratio == CSA_RATIO:
            keys = keys + np.minimum(compressed, topk)
            scored = compressed
        else:
            keys = keys + compressed
    return float(keys.mean()), float(scored.mean())


def model_flops_per_token(model: ModelConfig, seq_length: int) -> Flops:
    """Megatron-style model FLOPs per token of a DeepSeek-V4 model, forward and backward.

    Source: the per-layer structure of Megatron-LM's ``num_floating_point_operations``
    (``megatron/training/training.py``): 2 FLOPs per multiply-add of every weight a token passes
    through, plus attention score and value products, plus the logits, times 3 (backward = 2 x forward),
    without recompute. Written here for the DeepSeek-V4 shapes of :mod:`trainer.compose.params`:

    * matmul = 2 x (N - output head), N = active 2-D weights per token (attention projections,
      compressors, indexer, hyper-connection maps, router, shared expert, top-k routed experts, hc head);
    * attention = per layer, 4 x heads x qk_head_dim per attended key (QK^T and AV; V4 shares one K=V
      head of width qk_head_dim), averaged over the causal positions 1..seq_length of a row: every layer
      attends a sliding window of ``dsv4_window_size`` keys; HCA layers (ratio r != 4) also every one of
      the floor(i/r) compressed entries; CSA layers (ratio 4) the indexer's top ``dsa_indexer_topk`` of
      them, and the indexer scores all floor(i/4) entries at 2 x indexer heads x indexer head dim each;
    * logits = 2 x vocab x hidden.

    A model whose ``experimental_attention_variant`` is not ``dsv4`` (the megatron-core proxy) has plain causal
    multi-head attention: every query attends all earlier keys of the row (mean (S+1)/2), no compressor, no
    indexer.

    Assumptions: causal attention over the whole row (packed rows, no document mask); the MTP layer,
    norms, hyper-connection Sinkhorn iterations, softmax and activation functions are not counted
    (Megatron does not count elementwise work either). Units: FLOPs per token.
    """
    params = count_params(model)
    attention = 0.0
    per_key = 4.0 * model.num_attention_heads * model.qk_head_dim
    dsv4 = model.experimental_attention_variant == "dsv4"
    for layer in params.layers:
        if not dsv4:
            attention += per_key * (seq_length + 1) / 2.0
            continue
        keys, scored = _mean_keys(seq_length, model.dsv4_window_size, layer.compress_ratio, model.dsa_indexer_topk)
        attention += per_key * keys + 2.0 * model.dsa_indexer_n_heads * model.dsa_indexer_head_dim * scored
    matmul = 2.0 * (params.active_per_token - params.output)
    logits = 2.0 * model.vocab_size * model.hidden_size  # the output projection, tied or not
    return Flops(matmul=matmul, attention=attention, logits=logits, per_token=3.0 * (matmul + attention + logits))


# ---------------------------------------------------------------------------------------------- report


def _utc(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


ADMISSION_KEYS = ("admitted_utc", "scheduler_admitted_utc", "started_utc")
FINISH_KEYS = ("finished_utc", "ended_utc")


def job_wall_seconds(record: Mapping[str, Any]) -> tuple[float, str] | None:
    """Scheduler admission to finish from a run record (seconds, and the keys used), or None.

    Looks for ``admitted_utc``/``scheduler_admitted_utc``/``started_utc`` and ``finished_utc``/``ended_utc``
    (ISO 8601) at the top level or under ``times``; a record without them gives None.
    """
    times = record.get("times")
    for holder in (record, times if isinstance(times, dict) else {}):
        start = next(((k, t) for k in ADMISSION_KEYS if (t := _utc(holder.get(k))) is not None), None)
        end = next(((k, t) for k in FINISH_KEYS if (t := _utc(holder.get(k))) is not None), None)
        if start and end:
            seconds = (end[1] - start[1]).total_seconds()
            if seconds > 0:
                return seconds, f"{start[0]} to {end[0]}"
    return None


@dataclass
class ReportInputs:
    """What a report needs besides the steps: GPUs, N, peak, price, row length and the model (for FLOPs)."""

    gpus: int
    gpus_per_node: int
    active_params: int
    active_params_source: str
    peak_flops: float | None  # None: the run had no GPU (MFU n/a)
    usd_per_node_hour: float | None
    model: ModelConfig | None = None
    seq_length: int | None = None
    job_wall_s: float | None = None  # scheduler admission to finish
    job_wall_basis: str = ""


def summarize(
    steps: Sequence[Step], inputs: ReportInputs, window: tuple[int, int] | None = None, cost: bool = True
) -> dict[str, Any]:
    """The ``summary.json`` of a run: throughput, MFU, model TFLOP/s/GPU, cost, step-time CV, GPU-hours.

    ``window`` defaults to :func:`default_window`. ``cost=False`` leaves the cost out (null) instead of
    refusing a cluster without a price. Raises :class:`UserError` on a bad window or missing price.
    """
    if not steps:
        raise UserError("metrics.jsonl: no steps")
    window = window or default_window(steps)
    chosen = select_window(steps, window)
    # select_window refused a step without tokens or a step time: these are the window's, one per step
    step_tokens = [s.tokens for s in chosen if s.tokens is not None]
    step_times = [s.step_time_s for s in chosen if s.step_time_s is not None]
    tokens = sum(step_tokens)
    seconds = sum(step_times)
    tps = tokens_per_s_per_gpu(tokens, seconds, inputs.gpus)
    out: dict[str, Any] = {
        "schema_version": 1,
        "steps": len(steps),
        "first_step": steps[0].step,
        "last_step": steps[-1].step,
        "window": [window[0], window[1]],
        "window_steps": len(chosen),
        "window_tokens": int(tokens) if float(tokens).is_integer() else tokens,
        "window_seconds": seconds,
        "gpus": inputs.gpus,
        "tokens_per_s_per_gpu": tps,
        "mfu": mfu(inputs.active_params, tps, inputs.peak_flops) if inputs.peak_flops else None,
        "mfu_formula": "6 * N * tokens_per_s_per_gpu / peak",
        "active_params": {"count": inputs.active_params, "source": inputs.active_params_source},
        "peak_flops": {"value": inputs.peak_flops, "source": PEAK_SOURCE},
        "model_tflops_per_gpu": None,
        "model_flops_per_token": None,
        "model_flops_formula": "Megatron-style per-layer count, trainer.report.metrics.model_flops_per_token",
        "usd_per_million_tokens": None,
        "usd_per_node_hour": inputs.usd_per_node_hour,
        "step_time_cv_percent": cv_percent(step_times),
        "step_time_cv_stdev": "population (over the window's step times)",
        "step_time_mean_s": statistics.fmean(step_times),
    }
    if inputs.model is not None and inputs.seq_length:
        flops = model_flops_per_token(inputs.model, inputs.seq_length)
        out["model_flops_per_token"] = {
            "total": flops.per_token,
            "matmul_fwd": flops.matmul,
            "attention_fwd": flops.attention,
            "logits_fwd": flops.logits,
            "seq_length": inputs.seq_length,
        }
        out["model_tflops_per_gpu"] = flops.per_token * tps / 1e12
    if cost:
        out["usd_per_million_tokens"] = usd_per_million_tokens(inputs.usd_per_node_hour, tps, inputs.gpus_per_node)
    if inputs.job_wall_s:
        out["gpu_hours"] = inputs.gpus * inputs.job_wall_s / 3600.0
        out["gpu_hours_note"] = f"GPUs x (scheduler admission to finish) from record.json ({inputs.job_wall_basis})"
    else:
        all_times = [s.step_time_s for s in steps if s.step_time_s is not None and math.isfinite(s.step_time_s)]
        out["gpu_hours"] = inputs.gpus * sum(all_times) / 3600.0
        out["gpu_hours_note"] = (
            f"GPUs x sum of step times of {len(all_times)} steps: the record has no admission/finish times, "
            "so startup is not included"
        )
    return out
