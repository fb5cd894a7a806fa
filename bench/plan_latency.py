"""Benchmark: wall time of `train layout=tp2pp4ep8` (a full plan run in a fresh process) against the floor
of any Hydra app, `python -c "import hydra, omegaconf"`, measured interleaved in the same run.

Usage: python bench/plan_latency.py [--repeats N] [--before DIR] [--json]
Prints a Markdown row for bench/RESULTS.md (date, machine, command, medians, ratio) or JSON with --json.
``--before DIR`` also times the plan of another checkout of the bundle (e.g. ``git worktree add DIR REV``),
interleaved with the other two, so that a change is measured against its base in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent


def timed(cmd: list[str], cwd: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="runs of each command (interleaved), default 10")
    parser.add_argument("--before", help="also time the plan of the checkout in this directory (same run)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown row")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    baseline_cmd = [sys.executable, "-c", "import hydra, omegaconf"]
    plan_cmd = [sys.executable, "-m", "trainer.train", "layout=tp2pp4ep8"]
    before_env = dict(env, PYTHONPATH=str(Path(args.before).absolute())) if args.before else None
    base, plan, before = [], [], []
    with tempfile.TemporaryDirectory() as cwd:
        timed(plan_cmd + [f"hydra.run.dir={cwd}/warm"], cwd, env)  # warm the page cache once
        if before_env:
            timed(plan_cmd + [f"hydra.run.dir={cwd}/warm-before"], cwd, before_env)
        for i in range(args.repeats):
            base.append(timed(baseline_cmd, cwd, env))
            plan.append(timed(plan_cmd + [f"hydra.run.dir={cwd}/run{i}"], cwd, env))
            if before_env:
                before.append(timed(plan_cmd + [f"hydra.run.dir={cwd}/before{i}"], cwd, before_env))
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats,
        "baseline_median_s": round(statistics.median(base), 3),
        "plan_median_s": round(statistics.median(plan), 3),
        "ratio": round(statistics.median(plan) / statistics.median(base), 2),
    }
    if before:
        result.update(before_median_s=round(statistics.median(before), 3),
                      before_ratio=round(statistics.median(before) / statistics.median(base), 2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        command = f"python bench/plan_latency.py --repeats {args.repeats}" + (" --before BASE" if before else "")
        print(
            f"| {result['date']} | {result['machine']} | `{command}` | "
            f"{result['baseline_median_s']} s | {result['plan_median_s']} s | {result['ratio']}x |"
            + (f" {result['before_median_s']} s, {result['before_ratio']}x |" if before else " |")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
