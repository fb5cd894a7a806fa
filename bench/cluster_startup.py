"""Benchmark: time from submission to the first step of ``train experiment=smoke-cluster`` on test Ray clusters of
1, 2 and 4 nodes (two CPU slots each), split into its phases, with a one-process baseline measured in the same run.

Usage (root: the clusters run in a network namespace): python bench/cluster_startup.py [--nodes 1,2,4] [--json]

For each node count N a :class:`LocalRayCluster` of N nodes starts (not timed: its own start-up is another
figure), then ``train experiment=smoke-cluster cluster.nodes=N layout=gpuM-tp1pp1ep1 launcher.steps=2`` (M = 2N
ranks, the global batch of 8 rows fixed) runs there. Every line the launch prints is stamped as it arrives; the
phases end at these lines of the job's log:

- ``submit``: ``train`` started -> the job submitted (``Runtime env is setting up``: composition, checks, the
  rows built, ``ray job submit``);
- ``env + probe``: -> ``preflight:`` (Ray's runtime environment: the working directory packed and unpacked; then
  a probe task on every node and the comparison; train receives the job's log in chunks, and the probes' lines
  arrive with the preflight's, so the two are one phase here);
- ``place``: -> ``rendezvous:`` (the placement group, one worker actor per slot);
- ``first step``: -> ``step 1/`` (every rank imports torch and transformers, builds the model, joins the gloo
  group under DDP, and the first step runs).

The baseline is the same composition as one local process (``experiment=smoke``, DP1, the same batch):
``train`` started -> ``step 1/``. Ratios are to it. Prints Markdown rows for bench/RESULTS.md, or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).absolute().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from launch_fixtures import LocalRayCluster, NetNamespace  # noqa: E402

MARKS = (
    ("submit", "Runtime env is setting up"),
    ("env + probe", "preflight:"),  # the probes' lines reach train with the preflight's: one chunk of the log
    ("place", "rendezvous:"),
    ("first step", "step 1/"),
)


def stamped(argv: list[str], cwd: Path, env: dict[str, str], preexec=None, timeout_s: float = 900) -> list:
    """Run ``argv``; return ``[(seconds since start, line), ...]`` of its output (stdout and stderr). Exits with
    its output's tail when it fails."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec
    )
    lines: list[tuple[float, str]] = []
    output = proc.stdout
    assert output is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, x) for x in output))
    reader.start()
    proc.wait(timeout=timeout_s)
    reader.join()
    if proc.returncode:
        sys.exit(
            f"cluster_startup: {' '.join(argv[3:])} exited {proc.returncode}:\n" + "".join(x for _, x in lines[-40:])
        )
    return lines


def first(lines: list, needle: str) -> float | None:
    """Seconds at which the first line holding ``needle`` arrived, or None."""
    return next((t for t, line in lines if needle in line), None)


def train_argv(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *overrides]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,4", help="node counts, comma-separated (default 1,2,4)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    batch = ["optim.global_batch_size=8", "optim.rollout_batch_size=8", "layout.micro_batch_size=1"]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cluster-startup-") as scratch:
        work = Path(scratch)
        base = stamped(
            train_argv("experiment=smoke", "launcher.steps=2", *batch, f"hydra.run.dir={work}/dp1"), work, env
        )
        baseline = first(base, "step 1/")
        for n in (int(x) for x in args.nodes.split(",")):
            with NetNamespace() as netns, LocalRayCluster(work / f"ray{n}", netns, nodes=n) as ray:
                up = {k: v for k, v in ray.env().items() if k.startswith("RAY_") or k == "PATH"}
                lines = stamped(
                    train_argv(
                        "experiment=smoke-cluster",
                        f"cluster.nodes={n}",
                        f"layout=gpu{2 * n}-tp1pp1ep1",
                        "launcher.steps=2",
                        f"hydra.run.dir={work}/n{n}",
                    ),
                    work,
                    {**env, **up},
                    preexec=netns.enter,
                )
            ends = {name: first(lines, needle) for name, needle in MARKS}
            phases, before = {}, 0.0
            for name, end in ends.items():
                phases[name] = None if end is None else round(end - before, 1)
                before = end if end is not None else before
            results.append({"nodes": n, "ranks": 2 * n, "to_first_step_s": ends["first step"], "phases_s": phases})
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "baseline_one_process_s": baseline,
        "runs": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    head = ["date", "machine", "nodes x slots", *(name for name, _ in MARKS), "to first step", "/ one process"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        p = r["phases_s"]
        total = r["to_first_step_s"]
        ratio = f"{total / baseline:.1f}x" if total and baseline else "-"
        cells = " | ".join(f"{p[k]} s" for k, _ in MARKS)
        print(f"| {report['date']} | {report['machine']} | {r['nodes']} x 2 | {cells} | {total:.1f} s | {ratio} |")
    print(f"baseline (one process, DP1, same batch): {baseline:.1f} s from start to step 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
