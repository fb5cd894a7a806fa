"""Bench: building the Debian-based full-stack image (lockfiles/debian-full.lock.json) from a warm download cache.

Measures, in one run and on one machine:
- floor: reading and sha256-hashing every input byte once (the .debs, wheels and sdists, from the cache);
- cold build: `trainer image build` with every input cached but no layer cached (a fresh cache whose input
  blobs are hard links to the warm cache's);
- no-op rebuild: the same build again (every layer cached; stamps checked, nothing re-hashed);
- one-pin rebuild: the lock with one small wheel of the `rest` group moved to another version;
- baseline: the same work done carefully by hand: `dpkg-deb -x` of every .deb, `pip install --target
  --no-deps --no-compile` of every wheel, `tar --sort=name --mtime=@EPOCH --owner=0 --group=0 --numeric-owner`
  of the tree, `sha256sum` of the tar.

Needs the inputs in the cache (`trainer cache fetch --lock L`) and, for the one-pin lock, PyPI.
Usage: python bench/image_build.py [--lock L] [--cache DIR] [--work DIR] [--skip-baseline]
Prints a JSON summary and the Markdown row for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.image.cas import Cache, default_root  # noqa: E402
from trainer.lock.imagelock import inputs_of, load_lock  # noqa: E402


def timed(cmd, **kw):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:6]}... failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - start, proc.stdout


def build(lock, out, cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return timed(
        [
            sys.executable,
            "-m",
            "trainer",
            "image",
            "build",
            "--lock",
            str(lock),
            "--out",
            str(out),
            "--cache",
            str(cache),
            "--offline",
            "--revision",
            "0.1.0",
            "--json",
            "-q",
        ],
        env=env,
        cwd=ROOT,
    )


def one_pin_lock(lock_path: Path, work: Path, cache: Cache) -> Path:
    from trainer.lock.pypi import pypi_files, wheel_fits

    lock = json.loads(lock_path.read_text())
    wheel = next(w for w in lock["wheels"] if w["name"] == "six")
    other = next(
        f
        for f in pypi_files("six", "")
        if f["filename"].endswith(".whl")
        and f["sha256"] != wheel["sha256"]
        and wheel_fits(f["filename"], "cp311")
        and "1.16.0" in f["filename"]
    )
    wheel.update(version="1.16.0", filename=other["filename"], url=other["url"], sha256=other["sha256"])
    cache.ensure(other["sha256"], other["filename"], other["url"])
    path = work / "debian-full-one-pin.lock.json"
    path.write_text(json.dumps(lock, indent=1, sort_keys=True) + "\n")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lock", default=str(ROOT / "lockfiles" / "debian-full.lock.json"))
    p.add_argument("--cache", default=str(default_root()), help="the warm cache holding every input")
    p.add_argument("--work", default="/tmp/recipe-bundle-bench-image")
    p.add_argument("--skip-baseline", action="store_true")
    args = p.parse_args()
    lock = load_lock(Path(args.lock))
    warm = Cache(Path(args.cache))
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    items = inputs_of(lock)
    paths = [warm.blob_path(i["sha256"]) for i in items]
    missing = [i["label"] for i, pth in zip(items, paths, strict=True) if not pth.is_file()]
    if missing:
        raise SystemExit(
            f"{len(missing)} inputs not cached (first: {missing[0]}); run trainer cache fetch --lock {args.lock}"
        )
    total = sum(pth.stat().st_size for pth in paths)

    start = time.perf_counter()  # floor: read and hash every input byte once (page cache warm, as for the build)
    for pth in paths:
        digest = hashlib.sha256()
        with open(pth, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    floor = time.perf_counter() - start

    cold_cache = Cache(work / "cas")  # inputs present (hard links), no layers
    (cold_cache.root / "sha256").mkdir(parents=True)
    for i, pth in zip(items, paths, strict=True):
        os.link(pth, cold_cache.blob_path(i["sha256"]))
        cold_cache.stamp(i["sha256"])
    cold, out = build(args.lock, work / "image.oci", cold_cache.root)
    result = json.loads(out)
    noop, out2 = build(args.lock, work / "image.oci", cold_cache.root)
    assert json.loads(out2)["manifest_digest"] == result["manifest_digest"]
    pin_lock = one_pin_lock(Path(args.lock), work, cold_cache)
    pin, out3 = build(pin_lock, work / "one-pin.oci", cold_cache.root)
    pin_status = {layer["name"]: layer["status"] for layer in json.loads(out3)["layers"]}
    image_bytes = sum(layer["size"] for layer in result["layers"])

    baseline = None
    if not args.skip_baseline:
        tree = work / "baseline-root"
        wheels = work / "baseline-wheels"
        wheels.mkdir()
        for i, pth in zip(items, paths, strict=True):
            if i["label"].startswith("wheel "):
                os.link(pth, wheels / i["label"][len("wheel ") :])
        start = time.perf_counter()
        tree.mkdir()
        for i, pth in zip(items, paths, strict=True):
            if i["label"].startswith("deb "):
                subprocess.run(["dpkg-deb", "-x", str(pth), str(tree)], check=True)
        site = tree / lock["python"]["site_packages"].lstrip("/")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--no-index",
                "--disable-pip-version-check",
                "--target",
                str(site),
                *sorted(map(str, wheels.iterdir())),
            ],
            check=True,
        )
        subprocess.run(
            [
                "tar",
                "--sort=name",
                f"--mtime=@{lock['epoch']}",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "-cf",
                str(work / "baseline.tar"),
                "-C",
                str(tree),
                ".",
            ],
            check=True,
        )
        subprocess.run(["sha256sum", str(work / "baseline.tar")], check=True, capture_output=True)
        baseline = time.perf_counter() - start

    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "inputs": len(items),
        "input_bytes": total,
        "image_bytes": image_bytes,
        "manifest_digest": result["manifest_digest"],
        "floor_s": round(floor, 2),
        "cold_s": round(cold, 2),
        "cold_over_floor": round(cold / floor, 1),
        "noop_s": round(noop, 2),
        "one_pin_s": round(pin, 2),
        "one_pin_layers": pin_status,
        "baseline_s": round(baseline, 2) if baseline else None,
        "baseline_over_cold": round(baseline / cold, 2) if baseline else None,
    }
    print(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
