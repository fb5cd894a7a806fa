"""Bench: the lock's build steps (TE's torch extension, DeepEP, aws-ofi-nccl, sdists), each built twice from an
empty build cache, to show that they reproduce bit for bit, and how long they take on this machine.

    python bench/native_builds.py [--lock lockfiles/debian-full.lock.json] [--step NAME ...] [--jobs 2]
        [--runs 2] [--record] [--out bench/results/native_builds.json]

Run ``i`` uses its own cache directory ``WORK/run-i`` (the inputs, .debs, wheels and archives, hard-linked from
the main cache; no built layers, no unpacked build roots), its own TZ and umask, so a step's output depends only
on its inputs. For every step it reports the build time (seconds, build root unpacking included and shown
apart), the output layer's size and diff_id per run, and whether all runs gave the same bytes; where they differ,
the files that differ (``trainer image diff``'s file comparison). ``--record`` writes the reproduced digests
into ``lockfiles/expected-digests.json`` (``<lock name>.builds.<step>``: the step's input key and output diff_id),
which ``trainer image check`` compares with an image's ``build-<step>`` layers.
Heavy compiles: run it under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import REPO_ROOT  # noqa: E402
from trainer.image.build import plan_layers, realize_layer  # noqa: E402
from trainer.image.cas import Cache, default_root  # noqa: E402
from trainer.lock import imagelock as lockfile  # noqa: E402

TZS = ["UTC", "Asia/Kolkata", "America/Los_Angeles"]
UMASKS = [0o022, 0o077, 0o002]


def fresh_cache(main: Cache, path: Path) -> Cache:
    """A cache at ``path`` holding hard links to ``main``'s blobs (inputs) and its git-tree records (sources
    seeded with ``trainer cache add-git``), nothing built."""
    (path / "sha256").mkdir(parents=True)
    for blob in (main.root / "sha256").iterdir():
        trusted = main._stamp_of(blob.stat()) == main._read_stamp(blob.name)
        try:
            os.link(blob, path / "sha256" / blob.name)
        except OSError:
            shutil.copyfile(blob, path / "sha256" / blob.name)
        if trusted:  # linking moved the inode's ctime, not its bytes: keep the main cache's stamp valid
            main.stamp(blob.name)
    if (main.root / "trees").is_dir():
        shutil.copytree(main.root / "trees", path / "trees")
    return Cache(path)


def members(cache: Cache, diff_id: str) -> dict[str, str]:
    """path -> sha256 of each regular file in the cached layer ``diff_id`` (for naming differing files)."""
    import hashlib

    out = {}
    with tarfile.open(cache.blob_path(diff_id[7:])) as tar:
        for m in tar:
            member = tar.extractfile(m) if m.isreg() else None
            if member is not None:
                out[m.name] = hashlib.sha256(member.read()).hexdigest()
    return out


def run(lock_path: Path, steps: list[str], runs: int, jobs: int, work: Path, offset: int = 0) -> dict[str, Any]:
    lock = lockfile.load_lock(lock_path)
    main = Cache(default_root())
    names = steps or [s["name"] for s in lock.get("builds", [])]
    results: dict[str, Any] = {}
    caches = []
    for i in range(runs):
        caches.append(fresh_cache(main, work / f"run-{i}"))
    for name in names:
        rows = []
        for i, cache in enumerate(caches, start=offset):
            os.environ["TZ"] = TZS[i % len(TZS)]
            time.tzset()
            old = os.umask(UMASKS[i % len(UMASKS)])
            try:
                plans = {p.name: p for p in plan_layers(lock, cache, REPO_ROOT, offline=True, jobs=jobs)}
                spool = Path(tempfile.mkdtemp(dir=cache.tmp_dir()))
                started = time.monotonic()
                diff_id, size, status = realize_layer(lock, plans[f"build-{name}"], cache, spool)
                seconds = time.monotonic() - started
                shutil.rmtree(spool, ignore_errors=True)
            finally:
                os.umask(old)
            rows.append(
                {
                    "run": i,
                    "tz": TZS[i % len(TZS)],
                    "umask": oct(UMASKS[i % len(UMASKS)]),
                    "seconds": round(seconds, 1),
                    "size": size,
                    "diff_id": diff_id,
                    "status": status,
                }
            )
            print(json.dumps({"step": name, **rows[-1]}), flush=True)
        same = len({r["diff_id"] for r in rows}) == 1
        differing: list[str] = []
        if not same:
            a, b = members(caches[0], str(rows[0]["diff_id"])), members(caches[-1], str(rows[-1]["diff_id"]))
            differing = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
        results[name] = {"runs": rows, "reproduced": same, "differing_files": differing}
    return results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lock", default=str(REPO_ROOT / "lockfiles" / "debian-full.lock.json"))
    p.add_argument("--step", action="append", default=[])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--offset",
        type=int,
        default=0,
        help="first run's variant (TZ/umask index): run one build per invocation in parallel, "
        "e.g. --runs 1 --offset 1 beside --runs 1, and compare the printed diff_ids",
    )
    p.add_argument("--work", help="directory for the run caches (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the run caches")
    p.add_argument("--record", action="store_true", help="record reproduced digests in lockfiles/expected-digests.json")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "native_builds.json"))
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="native-bench-"))
    try:
        started = time.time()
        results = run(Path(args.lock), args.step, args.runs, args.jobs, work, args.offset)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.platform()}",
        "command": "python bench/native_builds.py " + " ".join(argv),
        "lock": Path(args.lock).name,
        "jobs": args.jobs,
        "steps": results,
    }
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.is_file() else {}
    previous.setdefault("runs", []).append(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(previous, indent=1) + "\n")
    if args.record:
        from trainer.image.cli import EXPECTED
        from trainer.image.native import step_keys

        expected = json.loads(Path(EXPECTED).read_text())
        lock = lockfile.load_lock(Path(args.lock))
        keys = step_keys(lock)
        builds = expected.setdefault(lock["name"], {}).setdefault("builds", {})
        for name, r in results.items():
            if r["reproduced"] and len(r["runs"]) >= 2:
                builds[name] = {
                    "key": keys[name],
                    "diff_id": r["runs"][0]["diff_id"],
                    "size": r["runs"][0]["size"],
                    "seconds": [x["seconds"] for x in r["runs"]],
                    "jobs": args.jobs,
                }
        Path(EXPECTED).write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(
        json.dumps(
            {
                k: {
                    "reproduced": v["reproduced"],
                    "seconds": [r["seconds"] for r in v["runs"]],
                    "size": v["runs"][0]["size"],
                    "differing_files": v["differing_files"][:20],
                }
                for k, v in results.items()
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
