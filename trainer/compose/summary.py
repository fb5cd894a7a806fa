"""Human summaries of plans on stdout: rich tables on a terminal, the same rows as plain text elsewhere.

The rows are built once (:func:`summary_rows`); :func:`print_plan_summary` renders them with ``rich`` when
stdout is a terminal and as aligned plain lines when it is a pipe or a file, where box drawing and colour only
get in the way of ``grep`` and logs (and where ``rich``'s import and first render, about 35 ms, would be most
of a plan run's own time: bench/plan_latency.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TypedDict

from trainer import runlog
from trainer.compose.plan import Plan

STAGE_COLUMNS = ("stage", "layers", "weights", "grads", "optimizer", "activations", "total")


class SummaryRows(TypedDict):
    """:func:`summary_rows`: the title, ``(label, value, style)`` rows, one row of :data:`STAGE_COLUMNS` strings per
    stage and the ``(style, text)`` lines after the table (a style is a ``rich`` colour or ``""``)."""

    title: str
    head: list[tuple[str, str, str]]
    stages: list[list[str]]
    lines: list[tuple[str, str]]


def summary_rows(plan: Plan, run_dir: Path) -> SummaryRows:
    """The summary of ``plan`` as data: ``title``; ``head`` (label, value, style) rows; ``stages`` (one row of
    :data:`STAGE_COLUMNS` strings per pipeline stage, memory in GB per GPU); ``lines`` (style, text) after the
    tables (peak memory, warnings, how to submit)."""
    par = plan["parallelism"]
    verdict = plan["numerics"]
    head: list[tuple[str, str, str]] = [
        (
            "world",
            f"{par['world_size']} GPUs = TP {par['tensor_model_parallel_size']} x PP "
            f"{par['pipeline_model_parallel_size']} x CP {par['context_parallel_size']} x DP "
            f"{par['data_parallel_size']}",
            "",
        ),
        (
            "experts",
            f"EP {par['expert_model_parallel_size']} x ETP {par['expert_tensor_parallel_size']} x expert-DP "
            f"{par['expert_data_parallel_size']}: {plan['experts_per_ep_rank']} experts per EP rank",
            "",
        ),
        ("params", f"N active/token {plan['params']['active_per_token']:,} · total {plan['params']['total']:,}", ""),
        (
            "step",
            f"{plan['tokens_per_step']:,} tokens · {par['microbatches']} microbatches per DP rank · "
            f"{plan['steps']} steps",
            "",
        ),
        (f"vs {verdict['reference_layout']}", verdict["verdict"], "green" if verdict["equivalent"] else "red"),
        ("run dir", str(run_dir), ""),
    ]
    stages = []
    for stage, mem in zip(plan["pipeline"], plan["memory"]["per_stage"], strict=True):
        lo, hi = stage["layers"]
        stages.append(
            [
                str(stage["stage"]),
                f"{lo}..{hi - 1} ({stage['num_layers']})",
                *(f"{mem[k]:.1f}" for k in ("weights_gb", "grads_gb", "optimizer_gb", "activations_gb", "total_gb")),
            ]
        )
    memory = plan["memory"]
    lines = [
        (
            "green" if memory["fits"] else "red",
            f"peak estimate {memory['max_gb']:.1f} GB of {memory['gpu_memory_gb']:.0f} GB per GPU",
        )
    ]
    lines.append(throughput_line(plan))
    lines += [("yellow", f"warning: {warning}") for warning in plan["warnings"]]
    lines.append(("", f"submit: {plan['submit']['how']}"))
    return {
        "title": f"plan: {plan['model']} · {plan['layout']} · {plan['cluster']}",
        "head": head,
        "stages": stages,
        "lines": lines,
    }


def throughput_line(plan: Plan) -> tuple[str, str]:
    """The predicted tokens/s/GPU and MFU with the error against the recipe's measured run (this layout's, else
    the one the calibration was validated to), or why there is no prediction."""
    pred = plan["throughput"]
    if not pred["predicted"]:
        return ("", f"throughput: not predicted ({pred.get('why')})")
    ref = pred.get("reference", {})
    measured, error = ref.get("tokens_per_s_per_gpu"), ref.get("error", ref.get("validated_error"))
    versus = (
        f"; error {error:+.1%} against {ref.get('layout')}'s measured {measured}"
        if isinstance(error, float) and measured
        else "; not validated against a measured run"
    )
    return (
        "",
        f"throughput: predicted {pred.get('tokens_per_s_per_gpu', 0):,.0f} tokens/s/GPU, MFU {pred.get('mfu', 0):.1%}, "
        f"step {pred.get('step_s', 0):.1f} s (throughput={pred['calibration']}{versus})",
    )


def print_plan_summary(plan: Plan, run_dir: Path, console: Any = None) -> None:
    """Print a short summary of a plan: layout, per-stage layers and memory, numerics verdict, where it was
    written. ``console`` (a ``rich.console.Console``) forces the rich rendering; without it, rich is used when
    stdout is a terminal."""
    rows = summary_rows(plan, run_dir)
    plain = plain_summary(rows)
    runlog.info(plain)  # the job's log holds the plain text whatever the terminal shows
    if console is None and not sys.stdout.isatty():
        print(plain, end="")
        return
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table(title=rows["title"], show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value", overflow="fold")  # a long run directory wraps whole, never cut to "..."
    for label, value, style in rows["head"]:
        head.add_row(label, f"[{style}]{value}" if style else value)
    console.print(head)
    stages = Table(title="pipeline stages: layers and estimated memory per GPU (GB)")
    for col in STAGE_COLUMNS:
        stages.add_column(col, justify="right")
    for row in rows["stages"]:
        stages.add_row(*row)
    console.print(stages)
    for style, text in rows["lines"]:
        console.print(f"[{style}]{text}" if style else text, highlight=False, overflow="fold")


def plain_summary(rows: SummaryRows) -> str:
    """The rows of :func:`summary_rows` as plain text: ``label: value`` lines, then the stage table with
    right-aligned columns, then the closing lines."""
    width = max(len(label) for label, _, _ in rows["head"])
    out = [rows["title"]] + [f"  {label.ljust(width)}  {value}" for label, value, _ in rows["head"]]
    table = [list(STAGE_COLUMNS), *rows["stages"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(STAGE_COLUMNS))]
    out.append("pipeline stages: layers and estimated memory per GPU (GB)")
    out += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    out += [text for _, text in rows["lines"]]
    return "\n".join(out) + "\n"
