"""Benchmark: wall time of `train layout=tp2pp4ep8` (a full plan run in a fresh process) against the floor
of any Hydra app, `python -c "import hydra, omegaconf"`, measured interleaved in the same run.

Usage: python bench/plan_latency.py [--repeats N] [--before DIR] [--json]

Every command runs as bin/train runs it: bytecode cached under ``PYTHONPYCACHEPREFIX`` (here a scratch
directory, warmed by one untimed run of each command), the baseline's included. The plan command is the
user's, as typed: no ``hydra.run.dir``, so each run writes Hydra's default run
directory (``outputs/DATE/TIME-tp2pp4ep8``) under one working directory; a run starts only in a new second
(waited for untimed): the names are to the microsecond now, but a ``--before`` checkout older than that names
them by the second. It is timed four ways, interleaved:

- ``plan``: stdout a pipe, the composition cache warm (trainer/compose/cache.py; the first, untimed run fills
  it, as any earlier run of the same command line would);
- ``cold``: the same with an empty cache directory per run (``TRAINER_COMPOSE_CACHE``): Hydra composes the job
  and the reference layout, and the entries are written;
- ``tty``: the warm run on a pseudo-terminal, where the summary is drawn with rich;
- ``bin_train`` and ``nix_run``: the front doors as a user types them, ``bin/train layout=tp2pp4ep8`` and
  ``nix run ROOT#train -- layout=tp2pp4ep8`` (when ``nix`` is here), warm: these include finding the Python
  environment (``bin/python-env``'s fast path) and, for ``nix run``, evaluating the flake. The goal: 2x the
  baseline;
- ``empty_app`` (for scale, not a goal): a ``@hydra.main`` app with a one-key config and an empty task,
  Hydra's own cost of composing, making the run directory and writing ``.hydra/``;
- ``before`` (with ``--before DIR``): the plan of another checkout (e.g. ``git worktree add DIR REV``), so that
  a change is measured against its base in the same run.

Prints a Markdown row for bench/RESULTS.md (date, machine, command, medians and ratios to the baseline) and a
line with the front doors' ratios and their spread (the ratio of each run's time to the baseline's median:
quartiles), or JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent


def timed(cmd: list[str], cwd: str, env: dict, tty: bool = False) -> float:
    """Seconds of wall time of ``cmd`` run to completion (stdout a pipe to nowhere, or a pseudo-terminal)."""
    if not tty:
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        elapsed = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"plan_latency: {' '.join(cmd)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
        return elapsed
    master, slave = pty.openpty()
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=slave, stderr=subprocess.DEVNULL)
        os.close(slave)
        while True:  # drain the terminal so that the process never blocks on it
            try:
                if not os.read(master, 65536):
                    break
            except OSError:  # EIO: the process closed its end
                break
        code = proc.wait()
        elapsed = time.perf_counter() - start
    finally:
        os.close(master)
    if code:
        sys.exit(f"plan_latency: {' '.join(cmd)} exited {code} on a terminal")
    return elapsed


def plan_run(cmd: list[str], cwd: str, env: dict, last: list[int], tty: bool = False) -> float:
    """:func:`timed` for a plan run, started (after an untimed wait) in a second later than the one the previous
    plan run ended in: a checkout before 884a0a1 names the run directory by the second, and a second run in one
    directory is refused."""
    while int(time.time()) <= last[0]:
        time.sleep(0.02)
    try:
        return timed(cmd, cwd, env, tty)
    finally:
        last[0] = int(time.time())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="runs of each command (interleaved), default 10")
    parser.add_argument("--before", help="also time the plan of the checkout in this directory (same run)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown row")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(ROOT)
    baseline_cmd = [sys.executable, "-c", "import hydra, omegaconf"]
    plan_cmd = [sys.executable, "-m", "trainer.train", "layout=tp2pp4ep8"]
    times: dict[str, list[float]] = {"baseline": [], "empty_app": [], "plan": [], "cold": [], "tty": []}
    last = [0]
    with tempfile.TemporaryDirectory() as scratch:
        cwd = os.path.join(scratch, "work")
        os.mkdir(cwd)
        env["TRAINER_COMPOSE_CACHE"] = os.path.join(scratch, "cache")
        env["PYTHONPYCACHEPREFIX"] = os.path.join(scratch, "pycache")  # as bin/train has it; the baseline's too
        timed(baseline_cmd, cwd, env)
        app = Path(scratch, "empty_app")
        (app / "conf").mkdir(parents=True)
        (app / "conf" / "app.yaml").write_text("a: 1\n")
        (app / "app.py").write_text(
            'import hydra\n\n\n@hydra.main(config_path="conf", config_name="app", '
            'version_base="1.3")\ndef main(cfg):\n    pass\n\n\nmain()\n'
        )
        app_cmd = [sys.executable, str(app / "app.py")]
        timed(app_cmd + [f"hydra.run.dir={scratch}/app-warm"], cwd, env)
        variants = {
            "plan": (plan_cmd, env, False),
            "tty": (plan_cmd, env, True),
            "bin_train": ([str(ROOT / "bin" / "train"), "layout=tp2pp4ep8"], env, False),
        }
        if shutil.which("nix"):
            variants["nix_run"] = (["nix", "run", f"{ROOT}#train", "--", "layout=tp2pp4ep8"], env, False)
        if args.before:
            variants["before"] = (plan_cmd, dict(env, PYTHONPATH=str(Path(args.before).absolute())), False)
        for name in variants:
            times.setdefault(name, [])
        for cmd, variant_env, _ in variants.values():  # warm the page cache and the composition cache once
            plan_run(cmd, cwd, variant_env, last)
        for i in range(args.repeats):
            times["baseline"].append(timed(baseline_cmd, cwd, env))
            times["empty_app"].append(timed(app_cmd + [f"hydra.run.dir={scratch}/app{i}"], cwd, env))
            for name, (cmd, variant_env, tty) in variants.items():
                times[name].append(plan_run(cmd, cwd, variant_env, last, tty))
            cold_env = dict(env, TRAINER_COMPOSE_CACHE=os.path.join(scratch, f"cold{i}"))
            times["cold"].append(plan_run(plan_cmd, cwd, cold_env, last))
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats,
        **{f"{name}_median_s": round(value, 3) for name, value in medians.items()},
        **{
            f"{name}_ratio": round(value / medians["baseline"], 2)
            for name, value in medians.items()
            if name != "baseline"
        },
        **{
            f"{name}_ratio_quartiles": spread(times[name], medians["baseline"])
            for name in ("bin_train", "nix_run")
            if name in times
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    command = f"python bench/plan_latency.py --repeats {args.repeats}" + (" --before BASE" if args.before else "")
    cells = [f"{result[f'{n}_median_s']} s, {result[f'{n}_ratio']}x" for n in ("empty_app", "plan", "cold", "tty")]
    before = f"{result['before_median_s']} s, {result['before_ratio']}x" if args.before else ""
    print(
        f"| {result['date']} | {result['machine']} | `{command}` | {result['baseline_median_s']} s | "
        + " | ".join(cells)
        + f" | {before} |"
    )
    doors = (("bin_train", "bin/train layout=tp2pp4ep8"), ("nix_run", "nix run .#train -- layout=tp2pp4ep8"))
    for name, label in doors:
        if name in times:
            low, high = result[f"{name}_ratio_quartiles"]
            print(
                f"front door `{label}`: {result[f'{name}_median_s']} s, {result[f'{name}_ratio']}x the baseline "
                f"(quartiles {low}x-{high}x; goal 2x)"
            )
    return 0


def spread(values: list[float], baseline: float) -> list[float]:
    """The first and third quartiles of ``values`` (seconds) as ratios to ``baseline`` (seconds)."""
    if len(values) < 2:
        return [round(values[0] / baseline, 2)] * 2
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [round(q1 / baseline, 2), round(q3 / baseline, 2)]


if __name__ == "__main__":
    raise SystemExit(main())
