"""``trainer cache add|path|verify``: the content-addressed input cache (see :mod:`trainer.image.cas`).

``add FILE [--sha256 HEX]`` copies a user-provided input (a git archive, a base image blob, a wheel that
cannot be downloaded) into the cache; with ``--sha256`` a mismatch is refused and nothing is added.
``fetch --lock L`` downloads every input of a lock that is not cached yet (PyPI and Debian URLs; each
checked against its locked sha256 before it enters the cache) and names those a user must add.
``verify`` re-hashes every blob and removes those whose bytes do not match their name (exit 1 if any).
Exit codes: 0 ok, 1 ``verify`` found corrupt entries or ``fetch`` left inputs missing, 2 refused input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List

from trainer.errors import UserError
from trainer.image.cas import Cache, parse_sha256


def main(argv: List[str]) -> int:
    """Entry point of ``trainer cache``; returns the exit code (see the module docstring)."""
    p = argparse.ArgumentParser(prog="trainer cache", description=__doc__.splitlines()[0])
    p.add_argument("--cache", help="cache directory (default $XDG_CACHE_HOME/recipe-bundle/cas)")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add", help="add FILE (checked against --sha256 when given); prints sha256:<hex>")
    a.add_argument("file")
    a.add_argument("--sha256", help="expected sha256 (hex or sha256:hex), e.g. from the lock")
    a.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    g = sub.add_parser("path", help="print the cache directory, or the path of one blob")
    g.add_argument("sha256", nargs="?")
    g.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    f = sub.add_parser("fetch", help="download every input of a lock into the cache (hash-checked)")
    f.add_argument("--lock", required=True)
    f.add_argument("--json", action="store_true")
    f.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    v = sub.add_parser("verify", help="re-hash every blob; remove and list corrupt ones")
    v.add_argument("--json", action="store_true")
    v.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cache = Cache(getattr(args, "cache_sub", None) or args.cache)
    if args.command == "add":
        print(f"sha256:{cache.add_file(Path(args.file), args.sha256)}")
        return 0
    if args.command == "path":
        print(cache.blob_path(parse_sha256(args.sha256, "sha256")) if args.sha256 else cache.root)
        return 0
    if args.command == "fetch":
        return _fetch(cache, Path(args.lock), args.json)
    blobs = sorted((cache.root / "sha256").glob("*")) if (cache.root / "sha256").is_dir() else []
    bad = []
    for blob in blobs:
        try:
            cache.get(blob.name, blob.name)
        except UserError as err:
            bad.append(str(err))
    if args.json:
        print(json.dumps({"blobs": len(blobs), "corrupt": bad}, indent=2))
    else:
        for line in bad:
            print(line)
        print(f"{len(blobs)} blobs, {len(bad)} corrupt")
    return 1 if bad else 0


def _fetch(cache: Cache, lock_path: Path, as_json: bool) -> int:
    from trainer.image.lockfile import inputs_of, load_lock

    lock = load_lock(lock_path)
    fetched, present, missing = 0, 0, []
    for item in inputs_of(lock):
        if cache.has(item["sha256"]):
            present += 1
            continue
        try:
            cache.ensure(item["sha256"], item["label"], item["url"])
            fetched += 1
        except UserError as err:
            missing.append(str(err))
    if as_json:
        print(json.dumps({"fetched": fetched, "present": present, "missing": missing}, indent=2))
    else:
        for line in missing:
            print(line)
        print(f"{fetched} fetched, {present} already cached, {len(missing)} missing")
    return 1 if missing else 0
