"""Split files into parts that fit one device call each, and join them again on the lent machine.

The device tool carries at most 64 MiB per call (working tree included) and the lent machine reaches no
network, so what a GPU run needs (TransformerEngine's 245 MB core wheel, tilelang, the image's build
outputs, the locked sources, the rows) travels in parts over back-to-back calls. Files are cut into chunks
and packed in the order given, so that the files of the first group arrive in the first calls and a call
can already use them while the rest is still on its way.

    python3 bench/carry_parts.py pack --out DIR [--part-mib 60] GROUP=FILE[,FILE...] ...
        writes DIR/cN/ (N = 1, 2, ...): chunks ``NAME.KK`` and a copy of ``manifest.json`` (each file's
        sha256, size, group and chunk names) in every part
    python3 bench/carry_parts.py stash PART_DIR [--to /tmp/carry]
        copies one carried part into the stash (on the lent machine; /tmp lasts while it stays warm)
    python3 bench/carry_parts.py join GROUP [--stash /tmp/carry] [--to /tmp/joined]
        joins the group's files from their chunks and checks each file's sha256 against the manifest;
        exit 1 with one line naming the first file whose chunks are missing or whose bytes differ
    python3 bench/carry_parts.py check-record WHEEL_TREE
        checks every file of an unpacked wheel against its ``*.dist-info/RECORD`` (PEP 376/427:
        ``sha256=`` urlsafe base64 without padding); exit 1 naming the first file that differs

A part holds at most ``--part-mib`` MiB of chunks; the working tree (about 2 MiB) travels beside it.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import json
import shutil
import sys
from pathlib import Path

BLOCK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path`` (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def pack(out: Path, groups: list, part_bytes: int) -> dict:
    """Cut the files of ``groups`` (``[(group, [path, ...]), ...]``, in carry order) into chunks of at most
    ``part_bytes`` bytes and fill parts ``out/c1``, ``out/c2``, ... in that order. Returns the manifest
    (``{"files": {name: {"sha256", "size", "group", "chunks": [[part, chunk_name], ...]}}, "parts": N}``),
    also written as ``manifest.json`` into every part. Raises ``ValueError`` for two files of one name and
    ``OSError`` for an unreadable one; the parts are written under ``out.tmp`` and renamed to ``out`` only when
    complete, so a failed pack leaves no parts."""
    final, out = out, out.with_name(out.name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    try:
        manifest = _pack_into(out, groups, part_bytes)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)
    return manifest


def _pack_into(out: Path, groups: list, part_bytes: int) -> dict:
    files: dict = {}
    part, used = 1, 0
    (out / "c1").mkdir(parents=True)
    for group, paths in groups:
        for path in paths:
            if path.name in files:
                raise ValueError(f"{path.name}: two files of this name in the carry")
            entry = {"sha256": sha256_file(path), "size": path.stat().st_size, "group": group, "chunks": []}
            files[path.name] = entry
            with open(path, "rb") as handle:
                k = 0
                while True:
                    if used >= part_bytes:
                        part, used = part + 1, 0
                        (out / f"c{part}").mkdir()
                    data = handle.read(part_bytes - used)
                    if not data:
                        break
                    name = f"{path.name}.{k:02d}"
                    (out / f"c{part}" / name).write_bytes(data)
                    entry["chunks"].append([part, name])
                    used += len(data)
                    k += 1
    manifest = {"files": files, "parts": part}
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for i in range(1, part + 1):
        (out / f"c{i}" / "manifest.json").write_text(text)
    return manifest


def join(group: str, stash: Path, to: Path) -> list:
    """Join every file of ``group`` (``all`` for every group) from the chunks in ``stash`` into ``to``,
    sha256-checked; a file already joined with the right hash is kept. Returns the joined paths.
    Raises ``SystemExit`` with one line for a missing chunk or a hash that differs (the partial file is removed)."""
    manifest = json.loads((stash / "manifest.json").read_text())
    to.mkdir(parents=True, exist_ok=True)
    done = []
    for name, entry in sorted(manifest["files"].items()):
        if group not in ("all", entry["group"]):
            continue
        target = to / name
        if target.exists() and target.stat().st_size == entry["size"] and sha256_file(target) == entry["sha256"]:
            done.append(target)
            continue
        missing = [c for _, c in entry["chunks"] if not (stash / c).exists()]
        if missing:
            raise SystemExit(
                f"{name}: chunk {missing[0]} not stashed yet (parts {sorted({p for p, _ in entry['chunks']})})"
            )
        tmp = to / f".{name}.tmp"
        with open(tmp, "wb") as handle:
            for _, chunk in entry["chunks"]:
                with open(stash / chunk, "rb") as src:
                    shutil.copyfileobj(src, handle, BLOCK)
        got = sha256_file(tmp)
        if got != entry["sha256"]:
            tmp.unlink()
            raise SystemExit(f"{name}: sha256 {got} differs from the manifest's {entry['sha256']}")
        tmp.rename(target)
        done.append(target)
    return done


def check_record(tree: Path) -> int:
    """Check every file listed in the ``*.dist-info/RECORD`` files under ``tree`` against its hash; returns
    the number of files checked. Raises ``SystemExit`` naming the first file that is missing or differs."""
    checked = 0
    for record in sorted(tree.glob("*.dist-info/RECORD")):
        with open(record, newline="") as handle:
            for row in csv.reader(handle):
                if len(row) < 2 or not row[1]:
                    continue  # RECORD lists itself without a hash
                algo, _, want = row[1].partition("=")
                h = hashlib.new(algo)
                try:
                    with open(tree / row[0], "rb") as f:
                        while block := f.read(BLOCK):
                            h.update(block)
                except FileNotFoundError:
                    raise SystemExit(f"{row[0]}: listed in {record.relative_to(tree)} but missing") from None
                got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
                if got != want:
                    raise SystemExit(f"{row[0]}: {algo} {got} differs from {record.relative_to(tree)}'s {want}")
                checked += 1
    if not checked:
        raise SystemExit(f"{tree}: no *.dist-info/RECORD with hashes")
    return checked


def main(argv) -> int:
    """Parse ``argv`` and run the subcommand; exit 1 with one line for a missing file, part or manifest."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--out", required=True)
    a.add_argument("--part-mib", type=float, default=60.0)
    a.add_argument("groups", nargs="+", help="GROUP=FILE[,FILE...] in carry order")
    a = sub.add_parser("stash")
    a.add_argument("part")
    a.add_argument("--to", default="/tmp/carry")
    a = sub.add_parser("join")
    a.add_argument("group")
    a.add_argument("--stash", default="/tmp/carry")
    a.add_argument("--to", default="/tmp/joined")
    a = sub.add_parser("check-record")
    a.add_argument("tree")
    args = p.parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError) as ex:  # a missing file, part or manifest: one line, nothing half-joined
        name = getattr(ex, "filename", None)
        print(
            f"carry_parts {args.cmd}: {name + ': ' if name else ''}{getattr(ex, 'strerror', None) or ex}",
            file=sys.stderr,
        )
        return 1


def run(args) -> int:
    """Carry out the parsed subcommand ``args`` (see the module docstring); returns the exit status."""
    if args.cmd == "pack":
        groups = []
        for spec in args.groups:
            group, _, names = spec.partition("=")
            groups.append((group, [Path(n) for n in names.split(",") if n]))
        m = pack(Path(args.out), groups, int(args.part_mib * (1 << 20)))
        sizes = {
            f"c{i}": sum(f.stat().st_size for f in (Path(args.out) / f"c{i}").iterdir())
            for i in range(1, m["parts"] + 1)
        }
        print(json.dumps({"parts": m["parts"], "files": len(m["files"]), "bytes": sizes}))
    elif args.cmd == "stash":
        to = Path(args.to)
        to.mkdir(parents=True, exist_ok=True)
        for f in sorted(Path(args.part).iterdir()):
            shutil.copyfile(f, to / f.name)
        print(f"stashed {args.part}: {len(list(to.iterdir()))} files in {to}")
    elif args.cmd == "join":
        for path in join(args.group, Path(args.stash), Path(args.to)):
            print(f"joined {path}")
    else:
        print(f"{check_record(Path(args.tree))} files match their RECORD")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
