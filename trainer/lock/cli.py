"""``trainer lock verify LOCK`` (offline) and ``trainer lock resolve`` (network: uv + PyPI's JSON API).

``verify``: the lock is well-formed (:func:`trainer.lock.imagelock.validate_lock`: every artifact hashed, no
duplicate names or hashes) and consistent with the stack pins in ``lockfiles/stack.json`` (which
``conf/stack/`` must agree with, :func:`trainer.compose.stackpins.verify_stack`). Exit 0 ok, 2 with one line otherwise.

``resolve``: runs ``uv pip compile --generate-hashes --python-version 3.12 --python-platform
x86_64-manylinux_2_28`` (or the template's Python version and ``--python-platform``) on a requirements file,
then asks PyPI's simple JSON API (PEP 691, ``https://pypi.org/simple/NAME/``; :mod:`trainer.lock.pypi`) for the
URL of the file with each locked hash (uv prints hashes, not URLs), keeping the one wheel that fits the platform,
and writes a lock (``--template`` gives every field that is not the Python closure). A ``debian-rootfs`` base in
the template also gets its
``debs`` resolved (apt on a private state directory; :func:`trainer.image.debian.resolve_debs`), and a
``build_root`` its .debs and build-only wheels (:func:`trainer.image.buildroot.resolve_build_root`);
``resolve-build-root LOCK`` does only the latter, in place. Resolution never runs during a build.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainer import REPO_ROOT
from trainer.compose.stackpins import load_stack_lock
from trainer.errors import UserError
from trainer.image.buildroot import resolve_build_root
from trainer.image.debian import resolve_debs
from trainer.inputs import read_json, read_text
from trainer.lock import imagelock
from trainer.lock.pypi import pypi_files, wheel_fits
from trainer.publish import atomic_write

REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
INDEX_URL = "https://pypi.org/simple"  # the only index a lock is resolved from (URLs then come from its JSON API)
GROUP_RULES = (
    ("torch", re.compile(r"^(torch|triton)$")),
    ("te", re.compile(r"^transformer-engine")),
    ("cuda-runtime", re.compile(r"^(nvidia-|cuda-)")),
)


def group_of(name: str) -> str:
    """The layer group of distribution ``name``: torch, te, cuda-runtime (nvidia-*, cuda-*) or rest."""
    canon = imagelock.canonical_name(name)
    for group, rule in GROUP_RULES:
        if rule.search(canon):
            return group
    return "rest"


def parse_uv_output(text: str) -> list[tuple[str, str, list[str]]]:
    """(name, version, [sha256 hex, ...]) of every ``name==version`` block in ``uv pip compile`` output."""
    out: list[tuple[str, str, list[str]]] = []
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        match = REQ_LINE.match(block.strip())
        if match:
            out.append((match.group(1), match.group(2), HASH.findall(block)))
    return out


def resolve(
    requirements: Path, template: dict[str, Any], platform: str = "x86_64-manylinux_2_28", python_version: str = "3.12"
) -> dict[str, Any]:
    """A lock: ``template`` with ``wheels`` and ``sdists`` from resolving ``requirements`` for CPython
    ``python_version`` ("3.12", "3.11") on ``platform`` (see module docstring)."""
    cp = "cp" + "".join(python_version.split(".")[:2])
    target = re.match(r"^x86_64-manylinux_(\d+)_(\d+)$", platform)
    glibc = (int(target.group(1)), int(target.group(2))) if target else (9, 99)
    cmd = [
        sys.executable,
        "-m",
        "uv",
        "pip",
        "compile",
        "--quiet",
        "--generate-hashes",
        "--no-header",
        "--python-version",
        python_version,
        "--python-platform",
        platform,
        "--index-url",
        INDEX_URL,
        str(requirements),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["uv failed"])[-1]
        raise UserError(f"{requirements}: uv pip compile failed: {last}")
    wheels, sdists = [], []
    for name, version, hashes in parse_uv_output(proc.stdout):
        files = [f for f in pypi_files(name, version) if f["sha256"] in hashes]
        fitting = [f for f in files if f["packagetype"] == "bdist_wheel" and wheel_fits(f["filename"], cp, glibc=glibc)]
        item = {"name": name, "version": version, "group": group_of(name)}
        if fitting:
            best = sorted(fitting, key=lambda f: f["filename"])[-1]
            wheels.append({**item, "filename": best["filename"], "url": best["url"], "sha256": best["sha256"]})
        else:
            sd = [f for f in files if f["packagetype"] == "sdist"]
            if not sd:
                raise UserError(f"{name}=={version}: no wheel for {cp} x86_64 and no sdist among the locked hashes")
            sdists.append({**item, "filename": sd[0]["filename"], "url": sd[0]["url"], "sha256": sd[0]["sha256"]})
    lock = {k: v for k, v in template.items() if not k.startswith("_")}
    lock["wheels"], lock["sdists"] = wheels, sdists
    if lock.get("base", {}).get("type") == "debian-rootfs":
        lock["base"] = {**lock["base"], "debs": resolve_debs(lock["base"])}
    if "build_root" in lock:
        lock["build_root"] = resolve_build_root(lock["build_root"])
    return lock


def verify(path: Path, stack_path: Path, frozen: bool = False) -> dict[str, Any]:
    """Load and check the lock at ``path`` against ``stack_path`` and, unless ``frozen``, against the
    requirements file it was resolved from (:func:`trainer.lock.imagelock.stale_inputs`); return the lock.
    Raises :class:`UserError`."""
    lock = imagelock.load_lock(path)
    stale = None if frozen else imagelock.stale_inputs(lock)
    if stale:
        raise UserError(stale)
    stack_rel = lock.get("stack")
    if stack_rel:
        stack_path = REPO_ROOT / stack_rel if not Path(stack_rel).is_absolute() else Path(stack_rel)
    problems = imagelock.find_stack_consistency(lock, load_stack_lock(stack_path))
    if problems:
        raise UserError(
            f"{path}: inconsistent with {stack_path}: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
        )
    return lock


def main(argv: list[str]) -> int:
    """Entry point of ``trainer lock``; returns the exit code."""
    p = argparse.ArgumentParser(prog="trainer lock", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="offline: well-formed, every entry hashed, no duplicates, agrees with stack.json")
    v.add_argument("lock")
    v.add_argument(
        "--stack", default=str(REPO_ROOT / "lockfiles" / "stack.json"), help="stack pins (default lockfiles/stack.json)"
    )
    v.add_argument("--json", action="store_true")
    v.add_argument(
        "--frozen",
        action="store_true",
        help="use the lock as it is even when its requirements file changed since it was resolved",
    )
    r = sub.add_parser("resolve", help="network: resolve requirements with uv, URLs from PyPI, write a lock")
    r.add_argument("--requirements", default=str(REPO_ROOT / "lockfiles" / "full.in"))
    r.add_argument(
        "--template", required=True, help="a lock whose non-Python fields (base, sources, image...) are kept"
    )
    r.add_argument("--out", required=True)
    r.add_argument(
        "--python-platform",
        default="x86_64-manylinux_2_28",
        help="uv's target platform (x86_64-manylinux_2_39 for Ubuntu 24.04 bases: glibc 2.39, "
        "x86_64-manylinux_2_36 for Debian 12)",
    )
    r.add_argument("--python-version", help="target CPython minor, e.g. 3.11 (default: the template's python.version)")
    b = sub.add_parser(
        "resolve-build-root",
        help="network: resolve only the lock's build_root (.debs by apt, "
        "build-only wheels by exact pin) and rewrite the lock in place",
    )
    b.add_argument("lock")
    args = p.parse_args(argv)
    if args.command == "resolve-build-root":
        try:
            lock = read_json(Path(args.lock), "lock")  # not validated yet: its build_root is unresolved
        except (OSError, json.JSONDecodeError) as ex:
            raise UserError(f"{args.lock}: not a readable JSON lock ({ex})") from None
        if not isinstance(lock, dict) or not isinstance(lock.get("build_root"), dict):
            raise UserError(f"{args.lock}: no build_root block to resolve")
        lock["build_root"] = resolve_build_root(lock["build_root"])
        imagelock.validate_lock(lock, args.lock)
        atomic_write(Path(args.lock), (json.dumps(lock, indent=1, sort_keys=True) + "\n").encode(), 0o644)
        print(
            f"{args.lock}: build_root {len(lock['build_root']['debs'])} .debs, "
            f"{len(lock['build_root']['wheels'])} wheels"
        )
        return 0
    if args.command == "verify" and not args.lock.endswith(".json"):  # a requirements-format lock (launcher.lock)
        expected = Path(args.lock).name[: -len(".lock")] + ".in" if args.lock.endswith(".lock") else ""
        stale = None if args.frozen else imagelock.stale_requirements_lock(Path(args.lock), expected)
        if stale:
            raise UserError(stale)
        pins = sum(1 for line in read_text(Path(args.lock), "lock").splitlines() if REQ_LINE.match(line))
        print(
            f"ok: {args.lock} ({pins} pinned packages; inputs: "
            + ("not compared: --frozen)" if args.frozen else "as resolved)")
        )
        return 0
    if args.command == "verify":
        lock = verify(Path(args.lock), Path(args.stack), frozen=args.frozen)
        inputs = lock.get(imagelock.RESOLVED_FROM)
        resolved = (
            "not recorded"
            if inputs is None
            else f"{inputs['requirements']} as resolved" + (" (not compared: --frozen)" if args.frozen else "")
        )
        summary = {
            "lock": args.lock,
            "sha256": lock["_sha256"],
            "wheels": len(lock.get("wheels", [])),
            "sdists": len(lock.get("sdists", [])),
            "sources": len(lock.get("sources", [])),
            "base": lock["base"]["type"],
            "inputs": resolved,
        }
        print(
            json.dumps(summary, indent=2)
            if args.json
            else f"ok: {args.lock} ({summary['wheels']} wheels, {summary['sdists']} sdists, "
            f"{summary['sources']} sources, "
            f"base {summary['base']}; inputs: {resolved}) sha256:{lock['_sha256']}"
        )
        return 0
    template = read_json(Path(args.template), "lock template")
    python_version = args.python_version or template.get("python", {}).get("version", "3.12")
    lock = resolve(Path(args.requirements), template, args.python_platform, python_version)
    lock["python"]["platform"] = args.python_platform
    lock[imagelock.RESOLVED_FROM] = imagelock.resolved_from(
        Path(args.requirements), Path(args.out), python_version, args.python_platform, INDEX_URL
    )
    imagelock.validate_lock(lock, args.out)
    atomic_write(Path(args.out), (json.dumps(lock, indent=1, sort_keys=True) + "\n").encode(), 0o644)
    print(f"{args.out}: {len(lock['wheels'])} wheels, {len(lock['sdists'])} sdists")
    return 0
