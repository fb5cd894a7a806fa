"""``trainer converge``: the convergence check of a candidate run against a reference, or its prediction.

``trainer converge CANDIDATE REFERENCE`` (each a run directory or a ``metrics.jsonl``) runs
:func:`trainer.report.convergence.check`, prints each check with its value and threshold, writes
``convergence.json`` and ``convergence_loss.png`` (under ``--out``, default the candidate's directory)
and exits 0 on pass, 1 on fail.

``trainer converge --predict --candidate "layout=tp2pp4ep8" --reference "layout=tp8pp8ep8"`` spends no
GPU: it composes both runs (each a space-separated list of Hydra overrides, or a run directory) and
compares them argument by argument (:func:`trainer.compose.numerics.compare`): exit 0 when only performance
arguments differ (the check should pass), 1 when a numerics argument differs.

Exit code 2: refused input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from trainer.compose import numerics
from trainer.compose.compose import compose_run
from trainer.console import table_console
from trainer.errors import UserError
from trainer.record.record import write_json
from trainer.record.rundir import CONFIG, load_config
from trainer.report.convergence import DEFAULT_THRESHOLDS, Verdict, check, load_thresholds
from trainer.report.metrics import json_number
from trainer.report.plots import plot_convergence
from trainer.report.run import load_run


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer converge`` (see the module docstring for the two modes)."""
    p = argparse.ArgumentParser(
        prog="trainer converge",
        description="Convergence check of a candidate run against a reference run "
        "(Megatron-Bridge validate_convergence with its pipeline thresholds; steps aligned by number; "
        "a missing step or a NaN/Inf loss or grad norm fails), "
        "or with --predict, whether two composed runs should pass it.",
        epilog="examples:\n"
        "  trainer converge runs/tp2pp4ep8 runs/tp8pp8ep8\n"
        "  trainer converge cand/metrics.jsonl ref/metrics.jsonl --set final_loss_tolerance=0.03 --json\n"
        "  trainer logs cand.log -o cand.jsonl && trainer converge cand.jsonl ref/metrics.jsonl   # from a raw log\n"
        "  trainer converge --predict --candidate 'layout=tp2pp4ep8' --reference 'layout=tp8pp8ep8'\n"
        "exit codes: 0 pass (or numerics-equivalent), 1 fail (or numerics differ), 2 refused input",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "runs", nargs="*", type=Path, metavar="RUN", help="CANDIDATE REFERENCE: run directories or metrics.jsonl files"
    )
    p.add_argument(
        "--thresholds",
        default=DEFAULT_THRESHOLDS,
        metavar="NAME|FILE",
        help=f"a thresholds option (trainer/report/thresholds/) or YAML file (default {DEFAULT_THRESHOLDS})",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override one threshold (repeatable)"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="where convergence.json and convergence_loss.png go (default: the candidate's directory)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write convergence_loss.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--predict", action="store_true", help="compare two composed configs instead of two runs (no GPU)")
    p.add_argument(
        "--candidate", metavar="OVERRIDES|RUN_DIR", help="--predict: the candidate's Hydra overrides or run directory"
    )
    p.add_argument(
        "--reference", metavar="OVERRIDES|RUN_DIR", help="--predict: the reference's Hydra overrides or run directory"
    )
    return p


def compose_side(spec: str) -> DictConfig:
    """A composed config from a run directory (its ``config.yaml``) or a space-separated override list."""
    path = Path(spec)
    if spec and path.is_dir():
        if not (path / CONFIG).is_file():
            raise UserError(f"{path}: no config.yaml (not a run directory written by `train`)")
        return load_config(path / CONFIG)
    return compose_run(shlex.split(spec))


def predict(candidate: str, reference: str) -> dict[str, Any]:
    """The numerics verdict of two compositions (:meth:`trainer.compose.numerics.Verdict.as_dict`) plus their specs."""
    verdict = numerics.compare(compose_side(candidate), compose_side(reference))
    return {"candidate": candidate, "reference": reference, **verdict.as_dict()}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.5g}" if math.isfinite(value) else str(value)
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def print_prediction(result: dict[str, Any], console: Console) -> None:
    """Print a :func:`predict` result to ``console``: a table of the differing arguments with their class
    (numerics in red, performance in green), or "no argument differs", then the verdict line.
    """
    table = Table(title=f"numerics: {result['candidate'] or '(defaults)'} vs {result['reference'] or '(defaults)'}")
    for col in ("argument", "key", "candidate", "reference", "class"):
        table.add_column(col)
    for d in result["differences"]:
        style = "red" if d["class"] == numerics.NUMERICS else "green"
        table.add_row(d["flag"], d["key"], _fmt(d["candidate"]), _fmt(d["reference"]), f"[{style}]{d['class']}")
    if result["differences"]:
        console.print(table)
    else:
        console.print("no argument differs")
    console.print(("[green]" if result["equivalent"] else "[red]") + result["verdict"])


def print_check(result: Verdict, cand: str, ref: str, console: Console) -> None:
    """Print a :func:`trainer.report.convergence.check` result to ``console``: one table row per check (value,
    threshold, pass/FAIL), the pointwise failure count, then PASS or FAIL with the failed checks.

    ``cand``/``ref`` are the runs' labels for the title; raises ``KeyError`` if ``result`` lacks a key it prints.
    """
    table = Table(title=f"convergence: {cand} vs reference {ref} ({result['thresholds']['name']} thresholds)")
    for col in ("check", "value", "threshold", "result", "detail"):
        table.add_column(col)
    for ch in result["checks"]:
        table.add_row(
            ch["name"],
            _fmt(ch["value"]),
            _fmt(ch["threshold"]),
            "[green]pass" if ch["passed"] else "[red]FAIL",
            ch["text"],
        )
    console.print(table)
    m = result["metrics"]
    console.print(
        f"pointwise failures: {m['pointwise_failures']} of {m['points_checked']} points "
        f"(steps {m['steps']}, first {m['skipped']} skipped)"
    )
    console.print("[green]PASS" if result["passed"] else "[red]FAIL: " + ", ".join(result["failed_checks"]))


def main(argv: list[str]) -> int:
    """Entry point of ``trainer converge``; returns 0 pass, 1 fail (UserError propagates: exit 2)."""
    args = parser().parse_args(argv)
    console = table_console()
    if args.predict:
        if args.runs or args.candidate is None or args.reference is None:
            raise UserError("--predict takes --candidate OVERRIDES and --reference OVERRIDES and no RUN arguments")
        result = predict(args.candidate, args.reference)
        if args.json:
            print(json.dumps(result, indent=2, sort_keys=True, default=str))
        else:
            print_prediction(result, console)
        return 0 if result["equivalent"] else 1
    if len(args.runs) != 2 or args.candidate or args.reference:
        raise UserError(
            "expected two runs: CANDIDATE REFERENCE (run directories or metrics.jsonl files); "
            "--candidate/--reference go with --predict"
        )
    thresholds = load_thresholds(args.thresholds, args.set)
    cand, ref = load_run(args.runs[0]), load_run(args.runs[1])
    verdict = check(cand.steps, ref.steps, thresholds)
    verdict["candidate"] = str(cand.path)
    verdict["reference"] = str(ref.path)
    if cand.cfg is not None and ref.cfg is not None:
        verdict["prediction"] = numerics.compare(cand.cfg, ref.cfg).as_dict()
    out: Path = args.out or (cand.path if cand.path.is_dir() else cand.path.parent)
    write_json(out / "convergence.json", _jsonable(verdict))
    if not args.no_plot:
        plot_convergence(verdict, out / "convergence_loss.png", f"candidate {cand.label}", f"reference {ref.label}")
    if args.json:
        print(json.dumps(_jsonable(verdict), indent=2, sort_keys=True))
    else:
        print_check(verdict, cand.label, ref.label, console)
        if "prediction" in verdict:
            console.print(f"configs: {verdict['prediction']['verdict']}")
        console.print(f"written: {out / 'convergence.json'}")
    return 0 if verdict["passed"] else 1


def _jsonable(obj: Any) -> Any:
    """NaN/Inf become the strings "NaN"/"Infinity"/"-Infinity" so the JSON is standard (as in metrics.jsonl)."""
    if isinstance(obj, float):
        return json_number(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj
