"""``trainer report RUN_DIR``: throughput, MFU, model TFLOP/s, cost, step-time CV and GPU-hours of a run.

Reads ``metrics.jsonl``, ``config.yaml`` and (if present) ``record.json`` of a run directory, computes
the figures of the recipe's ``result:`` block (definitions in :mod:`trainer.report.metrics`), writes
``summary.json`` and ``step_time.png`` next to them (or under ``--out``) and prints a table.

Exit codes: 0 written, 2 refused input (one line on stderr naming the file, row or field).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainer.compose.params import count_params
from trainer.console import table_console
from trainer.errors import UserError
from trainer.inputs import lines
from trainer.record.record import write_json
from trainer.report import metrics
from trainer.report.plots import plot_step_times
from trainer.report.run import Run, load_run
from trainer.report.steplines import step_line_kind


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer report`` (``--window`` in steps, ``--usd-per-node-hour`` in US dollars)."""
    p = argparse.ArgumentParser(
        prog="trainer report",
        description="Throughput (tokens/s/GPU), MFU, model TFLOP/s/GPU, $ per 1M tokens, step-time CV and GPU-hours "
        "of a run directory (metrics.jsonl + config.yaml [+ record.json]); writes summary.json and step_time.png.",
        epilog="The window is inclusive; the recipe's is 5:19 of 20 steps (default: 5 to the step before the last). "
        "MFU = 6 N tokens/s/GPU / peak with N from the model's shapes and peak from cluster.gpu_peak_bf16_flops.",
    )
    p.add_argument("run_dir", type=Path, help="run directory (config.yaml and metrics.jsonl)")
    p.add_argument("--window", metavar="FIRST:LAST", help="measured steps, inclusive (default 5:LAST-1)")
    p.add_argument(
        "--usd-per-node-hour",
        type=_price,
        metavar="DOLLARS",
        help="price of one node (default: cluster.usd_per_node_hour)",
    )
    p.add_argument("--no-cost", action="store_true", help="leave the cost out (for a cluster without a price)")
    p.add_argument("--out", type=Path, help="where summary.json and step_time.png go (default: the run directory)")
    p.add_argument("--no-plot", action="store_true", help="do not write step_time.png")
    p.add_argument("--json", action="store_true", help="print summary.json to stdout instead of a table")
    return p


def _price(text: str) -> float:
    """argparse type of a price: a finite number >= 0 (US dollars per node-hour)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite price >= 0")
    return value


def report_inputs(run: Run, usd_per_node_hour: float | None = None) -> metrics.ReportInputs:
    """GPUs, N, peak, price and model of a run directory's config (and admission/finish times from its record)."""
    assert run.config is not None
    cfg = run.train_config
    n = count_params(cfg.model).active_per_token
    wall = metrics.job_wall_seconds(run.record or {})
    cpu_only = run.cpu_only  # a run whose processes saw no GPU (launcher=local-cpu) has no GPU peak
    return metrics.ReportInputs(
        gpus=cfg.cluster.nodes * cfg.cluster.gpus_per_node,
        gpus_per_node=cfg.cluster.gpus_per_node,
        active_params=n,
        active_params_source=f"trainer.compose.params.count_params(model={cfg.model.name}).active_per_token"
        + (f"; shapes from {cfg.model.source}" if cfg.model.source else ""),
        peak_flops=None if cpu_only else cfg.cluster.gpu_peak_bf16_flops,
        usd_per_node_hour=usd_per_node_hour if usd_per_node_hour is not None else cfg.cluster.usd_per_node_hour,
        model=cfg.model,
        seq_length=cfg.data.seq_length,
        job_wall_s=wall[0] if wall else None,
        job_wall_basis=wall[1] if wall else "",
    )


def build_summary(
    run: Run, window: str | None = None, usd_per_node_hour: float | None = None, cost: bool = True
) -> dict[str, Any]:
    """The summary of a loaded run (see :func:`trainer.report.metrics.summarize`), with the run's identity added."""
    inputs = report_inputs(run, usd_per_node_hour)
    summary = metrics.summarize(run.steps, inputs, metrics.parse_window(window) if window else None, cost=cost)
    cfg = run.train_config
    summary["run"] = {
        "model": cfg.model.display_name,
        "layout": cfg.layout.label,
        "cluster": cfg.cluster.name,
        "gpu_type": "CPU processes" if run.cpu_only else cfg.cluster.gpu_type,
        "instance": cfg.cluster.instance,
    }
    if run.cpu_only:  # its hours are CPU processes' hours: the key stays (summary.json's schema), the note says so
        summary["gpu_hours_note"] = "CPU-process-hours, no GPU in the run: " + summary["gpu_hours_note"].replace(
            "GPUs x", "processes x", 1
        )
    return summary


def print_summary(summary: dict[str, Any], where: Path, console: Console | None = None) -> None:
    """A rich table of the summary's figures, with their formulas and sources."""
    console = console or table_console()
    run = summary["run"]
    table = Table(
        title=f"report: {run['model']} · {run['layout']} · {summary['gpus']} x {run['gpu_type']}", show_header=True
    )
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    table.add_column("how")
    w = summary["window"]
    cpu = run["gpu_type"] == "CPU processes"  # a launcher=local-cpu run: its devices are CPU processes
    table.add_row(
        "tokens/s per process" if cpu else "tokens/s per GPU",
        f"{summary['tokens_per_s_per_gpu']:,.2f}",
        f"{summary['window_tokens']:,} tokens / {summary['window_seconds']:.2f} s / {summary['gpus']} "
        f"{'processes' if cpu else 'GPUs'}, steps {w[0]}..{w[1]}",
    )
    if summary["mfu"] is None:
        table.add_row("MFU", "n/a", "the run's processes saw no GPU (the probe), so there is no GPU peak to divide by")
    else:
        table.add_row(
            "MFU",
            f"{summary['mfu']:.4f}",
            f"6 x N {summary['active_params']['count']:,} x tokens/s/GPU / peak "
            f"{summary['peak_flops']['value']:.4g} FLOP/s",
        )
    if summary["model_tflops_per_gpu"] is not None:
        f = summary["model_flops_per_token"]
        table.add_row(
            "model TFLOP/s/GPU",
            f"{summary['model_tflops_per_gpu']:.2f}",
            f"Megatron-style per layer: {f['total'] / 1e9:.1f} GFLOP/token (fwd+bwd, seq {f['seq_length']})",
        )
    cost = summary["usd_per_million_tokens"]
    table.add_row(
        "$ per 1M tokens",
        "n/a" if cost is None else f"{cost:.3f}",
        "no price (--no-cost)" if cost is None else f"${summary['usd_per_node_hour']}/node-hour",
    )
    table.add_row(
        "step-time CV",
        f"{summary['step_time_cv_percent']:.2f}%",
        f"population stdev / mean over steps {w[0]}..{w[1]} (mean {summary['step_time_mean_s']:.3f} s)",
    )
    table.add_row("CPU-process-hours" if cpu else "GPU-hours", f"{summary['gpu_hours']:.2f}", summary["gpu_hours_note"])
    console.print(table)
    console.print(f"written: {where}")


def refuse_raw_log(path: Path) -> None:
    """Raise :class:`UserError` naming the commands to run when ``path`` (given as RUN_DIR) is a training
    log; return quietly for any other file (the run loader then refuses it)."""

    found = None
    try:
        for number, text in lines(path, "training log"):
            kind = step_line_kind(text)
            if kind or number >= metrics.LOG_SCAN_LINES:
                found = (number, kind) if kind else None
                break
    except UserError:  # not text this reads: not a log to hint at
        return
    if found:
        raise UserError(
            f"{path}: a training log (line {found[0]} is a {found[1]} line), and `trainer report` reads a run "
            f"directory: run `trainer logs {path} --run RUN_DIR` first, then `trainer report RUN_DIR`"
        )


def main(argv: list[str]) -> int:
    """Entry point of ``trainer report``; returns the exit code (UserError propagates to the dispatcher)."""
    args = parser().parse_args(argv)
    if args.run_dir.is_file():
        refuse_raw_log(args.run_dir)
    run = load_run(args.run_dir, need_config=True)
    summary = build_summary(run, args.window, args.usd_per_node_hour, cost=not args.no_cost)
    out = args.out or run.path
    write_json(out / "summary.json", summary)
    if not args.no_plot:
        plot_step_times(
            run.steps,
            tuple(summary["window"]),
            summary,
            out / "step_time.png",
            title=f"{summary['run']['model']} · {summary['run']['layout']}",
        )
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print_summary(summary, out / "summary.json")
    return 0
