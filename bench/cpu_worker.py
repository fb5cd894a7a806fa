"""Benchmark: a CPU rank's start-up and microbatch cost (``trainer/launch/cpu_worker.py``), each setting against
the way the worker ran before it, every variant in a fresh process, interleaved, in the same run.

Usage: python bench/cpu_worker.py [--repeats 3] [--rows 16] [--json]

- ``start``: ``import torch``, transformers' ``DeepseekV4ForCausalLM``, the tiny model of ``experiment=smoke``
  built; ``collector on`` (the baseline) against :func:`cpu_worker.collector_paused` around it. CPU seconds
  (user + system) of the process from its start.
- ``microbatch``: ``--rows`` microbatches of one 256-token row (the smoke rows' shape, 82% of positions
  supervised as in ``conf/data/smoke-synthetic.yaml``), forward and backward on one thread, after one untimed
  warm-up row. ``all positions`` (the baseline: logits at every position, the masked sum) against
  ``supervised only`` (:func:`cpu_worker._microbatch_backward`), each with glibc's defaults and after
  :func:`cpu_worker.keep_freed_memory`. Wall and system seconds per row, minor page faults per row.

Prints Markdown rows for bench/RESULTS.md (medians over ``--repeats``), or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent

START = """
import json, resource, sys
from trainer.compose.compose import compose_run, validate
from trainer.launch import cpu_worker
cfg = validate(compose_run(["experiment=smoke"]))
def start():
    import torch
    from transformers import DeepseekV4ForCausalLM
    cpu_worker.build_model(cfg)
if sys.argv[1] == "paused":
    with cpu_worker.collector_paused():
        start()
else:
    start()
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": use.ru_utime + use.ru_stime}))
"""

MICROBATCH = """
import json, resource, sys, time
import numpy as np, torch
from trainer.compose.compose import compose_run, validate
from trainer.data import IGNORE_INDEX, Batch
from trainer.launch import cpu_worker
variant, malloc, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
if malloc == "kept":
    assert cpu_worker.keep_freed_memory()
torch.set_num_threads(1)
model = cpu_worker.build_model(validate(compose_run(["experiment=smoke"])))
rng = np.random.default_rng(0)
def row():
    tokens = rng.integers(0, 129_280, size=(1, 256), dtype=np.int64)
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    mask = (rng.random((1, 256)) < 0.82).astype(np.int64)
    mask[:, -1] = 0
    return Batch(tokens, labels, mask, np.arange(256, dtype=np.int64)[None].copy(), np.zeros(1, dtype=np.int64))
def all_positions(mb):
    logits = model(input_ids=torch.from_numpy(mb.tokens), position_ids=torch.from_numpy(mb.position_ids)).logits
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), torch.from_numpy(mb.labels).clamp(min=0).reshape(-1),
        reduction="none")
    (ce * torch.from_numpy(mb.loss_mask).float().reshape(-1)).sum().backward()
def supervised_only(mb):
    cpu_worker._microbatch_backward(model, mb, 1.0)
step = all_positions if variant == "all" else supervised_only
batches = [row() for _ in range(rows + 1)]
step(batches[0])
use0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for mb in batches[1:]:
    step(mb)
wall, use1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall / rows, "sys_s": (use1.ru_stime - use0.ru_stime) / rows,
                  "faults": (use1.ru_minflt - use0.ru_minflt) / rows, "peak_rss_mb": use1.ru_maxrss / 1024}))
"""

START_VARIANTS = {"collector on": ["on"], "collector paused": ["paused"]}
MICROBATCH_VARIANTS = {
    "all positions, glibc defaults": ["all", "default"],
    "supervised only, glibc defaults": ["supervised", "default"],
    "all positions, freed memory kept": ["all", "kept"],
    "supervised only, freed memory kept": ["supervised", "kept"],
}


def child(code: str, args: list[str]) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter with ``args``; its last stdout line as JSON. Exits on failure."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}
    )
    if result.returncode != 0:
        raise SystemExit(f"bench/cpu_worker.py: a child failed ({' '.join(args)}):\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def positive(text: str) -> int:
    """``text`` as an integer of at least 1, for argparse (its ``ArgumentTypeError``: one line, exit 2)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive, default=3, help="fresh processes per variant (default 3)")
    parser.add_argument("--rows", type=positive, default=16, help="timed microbatches per process (default 16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown rows")
    args = parser.parse_args()
    start: dict[str, list[dict]] = {name: [] for name in START_VARIANTS}
    step: dict[str, list[dict]] = {name: [] for name in MICROBATCH_VARIANTS}
    for _ in range(args.repeats):  # interleaved: a drift of the machine touches every variant alike
        for name, argv in START_VARIANTS.items():
            start[name].append(child(START, argv))
        for name, argv in MICROBATCH_VARIANTS.items():
            step[name].append(child(MICROBATCH, [*argv, str(args.rows)]))
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in step.items()}
    start_cpu = {name: statistics.median(r["cpu_s"] for r in runs) for name, runs in start.items()}
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()} {os.cpu_count()} cores"
    if args.json:
        print(json.dumps({"date": stamp, "machine": machine, "start_cpu_s": start_cpu, "microbatch": median}))
        return 0
    base_start = start_cpu["collector on"]
    print("| date | machine | start-up | CPU s | / collector on |\n|---|---|---|---|---|")
    for name, cpu in start_cpu.items():
        print(f"| {stamp} | {machine} | {name} | {cpu:.2f} | {cpu / base_start:.2f} |")
    base = median["all positions, glibc defaults"]["wall_s"]
    print(
        "\n| date | machine | microbatch (1 x 256 tokens, 1 thread) | wall s/row | system s/row | page faults/row "
        "| peak RSS MB | / all positions, glibc defaults |\n|---|---|---|---|---|---|---|---|"
    )
    for name, m in median.items():
        print(
            f"| {stamp} | {machine} | {name} | {m['wall_s']:.3f} | {m['sys_s']:.3f} | {m['faults']:.0f} "
            f"| {m['peak_rss_mb']:.0f} | {m['wall_s'] / base:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
