"""Bench: the binary cache (issue #29): debian-full built from an empty local cache with a warm remote, against
the cold build, in one run.

Phases, on one machine:
- cold: `trainer image build` with every input cached (hard links to the blobs and git trees of ``--inputs``, a
  cache that `trainer cache fetch` and `trainer cache add-git` filled) and no layer record: every layer is made,
  the build steps compiled (the baseline);
- push: `trainer cache push` of that cache's layers to a registry (Debian's docker-registry on 127.0.0.1, fresh
  storage, stopped at the end), signed with a fresh key;
- warm remote: `trainer image build --substituter` into an empty cache (no inputs at all), the key trusted.
The digests of the cold and the warm build must be equal and no layer but the bundle built in the warm one.

Usage: python bench/remote_cache.py --inputs CACHE [--lock lockfiles/debian-full.lock.json] [--work DIR]
Prints a JSON summary (seconds, ratio warm/cold, digests, per-layer status) and the Markdown row for
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent


def trainer(*args: object) -> tuple[float, str]:
    """Run ``python -m trainer ARGS`` from the checkout; (seconds, stdout). Exits on failure."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"trainer {' '.join(map(str, args[:3]))}... failed: {proc.stderr.strip()[-400:]}")
    return time.perf_counter() - start, proc.stdout


def seed_cold(inputs: Path, cold: Path) -> int:
    """A cache at ``cold`` holding ``inputs``' blobs (hard links) and git-tree index, no layer records: every layer
    is built. Returns the number of blobs linked."""
    (cold / "sha256").mkdir(parents=True)
    count = 0
    for blob in (inputs / "sha256").iterdir():
        os.link(blob, cold / "sha256" / blob.name)
        count += 1
    if (inputs / "trees").is_dir():
        shutil.copytree(inputs / "trees", cold / "trees")
    return count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", required=True, type=Path, help="a cache holding every input of the lock")
    p.add_argument("--lock", default=str(ROOT / "lockfiles" / "debian-full.lock.json"))
    p.add_argument("--work", type=Path, help="scratch directory (default: a new one under /tmp)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="remote-cache-bench-"))
    linked = seed_cold(args.inputs, work / "cold")
    cold_s, out = trainer(
        "image", "build", "--lock", args.lock, "--out", work / "cold.oci", "--cache", work / "cold",
        "--offline", "--revision", "0.1.0", "--json", "-q",
    )  # fmt: skip
    cold = json.loads(out)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = work / "registry.yml"
    config.write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {work / 'registry'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(work / "registry.log", "wb")
    registry = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(1)
        remote = f"docker://127.0.0.1:{port}/recipe-cache"
        trainer("keygen", "--out", work / "team")
        push_s, _ = trainer(
            "cache", "--cache", work / "cold", "push", remote, "--lock", args.lock, "--sign-key", work / "team",
            "--no-tls-verify",
        )  # fmt: skip
        warm_s, out = trainer(
            "image", "build", "--lock", args.lock, "--out", work / "warm.oci", "--cache", work / "warm",
            "--offline", "--revision", "0.1.0", "--json", "-q", "--substituter", remote,
            "--trusted-key", work / "team.pub", "--no-tls-verify",
        )  # fmt: skip
        warm = json.loads(out)
    finally:
        registry.terminate()
        registry.wait(timeout=30)
        log.close()
    statuses = {layer["name"]: layer["status"] for layer in warm["layers"]}
    same = cold["manifest_digest"] == warm["manifest_digest"]
    compiled = sorted(name for name, status in statuses.items() if status == "built" and name != "bundle")
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "lock": Path(args.lock).name,
        "inputs_linked": linked,
        "cold_s": round(cold_s, 1),
        "push_s": round(push_s, 1),
        "warm_remote_s": round(warm_s, 1),
        "ratio_warm_over_cold": round(warm_s / cold_s, 4),
        "bytes": sum(layer["size"] for layer in warm["layers"]),
        "cold_digest": cold["manifest_digest"],
        "warm_digest": warm["manifest_digest"],
        "same_digest": same,
        "built_in_warm": compiled,
        "warm_statuses": statuses,
    }
    print(json.dumps(summary, indent=2))
    print(
        f"| {summary['date']} | {summary['lock']} | cold {cold_s:,.0f} s | push {push_s:,.0f} s | "
        f"warm remote {warm_s:,.0f} s ({summary['ratio_warm_over_cold']:.3f} of cold) | "
        f"{'same digest' if same else 'DIGESTS DIFFER'} {warm['manifest_digest'][:19]} | built: {compiled or 'none'} |"
    )
    return 0 if same and not compiled else 1


if __name__ == "__main__":
    raise SystemExit(main())
