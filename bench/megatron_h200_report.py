"""Summarise the run directories of bench/megatron_h200.sh: report, convergence against the one-GPU baseline,
verify against the recipe's stack lock, and the plan's memory estimate next to the measured peak.

Usage: python bench/megatron_h200_report.py RUNS_DIR OUT_DIR
Writes OUT_DIR/<layout>/{summary,convergence,verify,probe}.json + metrics.jsonl (no paths of the machine) and
prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent
BASELINE = "gpu1-tp1pp1ep1"


def trainer(*args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"trainer {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}") from None


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    runs, out = Path(sys.argv[1]), Path(sys.argv[2])
    layouts = sorted(p.name for p in runs.iterdir() if (p / "metrics.jsonl").is_file())
    rows = []
    for layout in [BASELINE] + [other for other in layouts if other != BASELINE]:
        run = runs / layout
        dest = out / layout
        dest.mkdir(parents=True, exist_ok=True)
        _, summary = trainer("report", str(run), "--no-cost", "--json")
        conv_rc, conv = trainer("converge", str(run), str(runs / BASELINE), "--json")
        ver_rc, ver = trainer("verify", str(run), "--lock", str(ROOT / "lockfiles" / "stack.json"), "--json")
        plan = json.loads((run / "plan.json").read_text())
        record = json.loads((run / "record.json").read_text())
        ver["lock"] = "lockfiles/stack.json"
        conv["candidate"], conv["reference"] = layout, BASELINE
        probe = record["probe"]["ranks"][0]
        for name, data in (
            ("summary.json", summary),
            ("convergence.json", conv),
            ("verify.json", ver),
            ("probe.json", probe),
        ):
            (dest / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(run / "metrics.jsonl", dest / "metrics.jsonl")
        checks = {c["name"]: c["value"] for c in conv["checks"]}
        peak = max(json.loads(line)["max_memory_bytes"] for line in (run / "metrics.jsonl").read_text().splitlines())
        drift = [r["component"] + " " + str(r["observed"]) for r in ver["rows"] if r["verdict"] in ("drift", "absent")]
        rows.append(
            f"| {plan['layout']} | {summary['tokens_per_s_per_gpu']:,.0f} | {summary['model_tflops_per_gpu']:.1f} | "
            f"{summary['mfu']:.4f} | {summary['step_time_cv_percent']:.2f}% | {peak / 1e9:.1f} | "
            f"{plan['memory']['max_gb']:.1f} ({plan['memory']['max_gb'] / (peak / 1e9):.2f}) | "
            + (
                "baseline | "
                if layout == BASELINE
                else f"{'pass' if conv_rc == 0 else 'FAIL'} (r = {checks['correlation']:.5f}, "
                f"final {checks['final_loss']:.4f}) | "
            )
            + f"{record['status']} |"
        )
        print(f"{layout}: verify exit {ver_rc}; drift/absent: {', '.join(drift)}", file=sys.stderr)
    print(
        "| layout | tokens/s/GPU | model TFLOP/s/GPU | MFU | step-time CV | peak GB (measured) "
        "| plan estimate GB (ratio) | converge vs 1 GPU | status |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
