"""Human summaries of plans (rich tables on stdout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from rich.console import Console
from rich.table import Table


def print_plan_summary(plan: Dict[str, Any], run_dir: Path, console: Console | None = None) -> None:
    """Print a short table of a plan: layout, per-stage layers and memory, numerics verdict, where it was written."""
    console = console or Console()
    par = plan["parallelism"]
    head = Table(title=f"plan: {plan['model']} · {plan['layout']} · {plan['cluster']}", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row(
        "world",
        f"{par['world_size']} GPUs = TP {par['tensor_model_parallel_size']} x PP {par['pipeline_model_parallel_size']}"
        f" x CP {par['context_parallel_size']} x DP {par['data_parallel_size']}",
    )
    head.add_row(
        "experts",
        f"EP {par['expert_model_parallel_size']} x ETP {par['expert_tensor_parallel_size']} x expert-DP "
        f"{par['expert_data_parallel_size']}: {plan['experts_per_ep_rank']} experts per EP rank",
    )
    head.add_row("params", f"N active/token {plan['params']['active_per_token']:,} · total {plan['params']['total']:,}")
    head.add_row("step", f"{plan['tokens_per_step']:,} tokens · {par['microbatches']} microbatches per DP rank · {plan['steps']} steps")
    verdict = plan["numerics"]
    head.add_row(
        f"vs {verdict['reference_layout']}",
        ("[green]" if verdict["equivalent"] else "[red]") + verdict["verdict"],
    )
    head.add_row("run dir", str(run_dir))
    console.print(head)

    stages = Table(title="pipeline stages: layers and estimated memory per GPU (GB)")
    for col in ("stage", "layers", "weights", "grads", "optimizer", "activations", "total"):
        stages.add_column(col, justify="right")
    for stage, mem in zip(plan["pipeline"], plan["memory"]["per_stage"]):
        lo, hi = stage["layers"]
        stages.add_row(
            str(stage["stage"]),
            f"{lo}..{hi - 1} ({stage['num_layers']})",
            f"{mem['weights_gb']:.1f}",
            f"{mem['grads_gb']:.1f}",
            f"{mem['optimizer_gb']:.1f}",
            f"{mem['activations_gb']:.1f}",
            f"{mem['total_gb']:.1f}",
        )
    console.print(stages)
    mem = plan["memory"]
    colour = "green" if mem["fits"] else "red"
    console.print(f"[{colour}]peak estimate {mem['max_gb']:.1f} GB of {mem['gpu_memory_gb']:.0f} GB per GPU")
    for warning in plan["warnings"]:
        console.print(f"[yellow]warning: {warning}")
    console.print(f"submit: {plan['submit']['how']}")
