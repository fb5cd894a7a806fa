"""``trainer cache add|add-image|path|fetch|verify``: the content-addressed input cache (see :mod:`trainer.image.cas`).

``add FILE [--sha256 HEX]`` copies a user-provided input (a git archive, a base image blob, a wheel that
cannot be downloaded) into the cache; with ``--sha256`` a mismatch is refused and nothing is added.
``add-image SEED [--lock L | --digest sha256:HEX]`` seeds an ``oci`` base: SEED is a skopeo ``dir:`` copy,
an OCI layout or an oci-archive of the image; its manifest must hash to the lock's ``base.digest`` and the
manifest(s), config and every layer blob are stored, each hash-checked (see :mod:`trainer.image.base`);
prints the resolved ``base`` block (config digest, layers with diff_ids) for the lock.
``add-archive FILE [--lock L ...] [--tree T]`` seeds a git source from an archive of its tree (``git archive
--prefix=NAME/``, GitHub's tarball): the files' git tree id must be one a lock pins (the commit is then the lock's).
``add-git GITDIR --commit C [--lock L ...] [--tree T]`` seeds a git source from a local clone or bare
repository: the commit's files are read from git's objects, their git tree id recomputed and checked against
the tree the locks pin for that commit (default: every ``lockfiles/*.lock.json`` and ``stack.json`` of the
bundle), then stored by tree id (see :mod:`trainer.image.sources`).
``fetch --lock L`` downloads every input of a lock that is not cached yet (PyPI and Debian URLs, each
checked against its locked sha256 before it enters the cache; git sources from GitHub's archive of the
commit, checked by tree) and names those a user must add. An input counts as cached only when its blob is
intact (re-hashed unless its stamp vouches for it): a corrupt one is removed and fetched again, or named among
the missing.
``push REMOTE --lock L --sign-key KEY`` uploads every built layer of the lock(s) (build steps' outputs among
them) to a binary cache, a registry (``docker://HOST/REPO``) or a shared directory, each entry signed;
``pull REMOTE --lock L --trusted-key KEY.pub`` downloads those missing here, each verified against the trusted
keys and its digest before it enters the cache (see :mod:`trainer.image.remote`); a refused entry is one line.
``verify`` re-hashes every blob and removes those whose bytes do not match their name, and lists the debris of
killed builds (exit 1 if either); ``gc`` removes that debris (what no live build can still use).
Exit codes: 0 ok, 1 ``verify`` found corrupt entries, ``fetch`` left inputs missing, or ``push``/``pull`` left
layers out, 2 refused input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from trainer import REPO_ROOT
from trainer.errors import UserError
from trainer.image.base import add_image, load_base
from trainer.image.build import layer_keys
from trainer.image.cas import Cache, parse_sha256
from trainer.image.remote import add_remote_options, remotes_from
from trainer.image.sources import FETCH_HOSTS, add_archive, add_git, fetch_source, pins_for
from trainer.lock.imagelock import inputs_of, load_lock
from trainer.signing import load_signer


def main(argv: list[str]) -> int:
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
    i = sub.add_parser(
        "add-image",
        help="seed an oci base image (skopeo dir: copy, OCI layout or oci-archive), every blob "
        "hash-checked; prints the lock's resolved base block",
        epilog="on a machine with registry access: skopeo copy docker://NAME@sha256:HEX dir:base-image; "
        "here: trainer cache add-image base-image --lock lockfiles/full.lock.json",
    )
    i.add_argument("seed", help="skopeo dir: directory, OCI layout directory or oci-archive tar")
    i.add_argument("--lock", help="take the manifest digest, reference and platform from this lock's base")
    i.add_argument("--digest", help="the manifest digest to add (sha256:HEX; default: the seed's only image)")
    i.add_argument("--platform", default="linux/amd64", help="OS/ARCH picked from an index (default linux/amd64)")
    i.add_argument("--json", action="store_true", help="print only the resolved base block as JSON")
    i.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    ag = sub.add_parser(
        "add-git",
        help="seed a git source from a local clone or bare repository, checked against "
        "the tree the locks pin; prints the stored tree",
        epilog="e.g. trainer cache add-git ../Megatron-LM --commit 37f91617b95c1ef4f01fc66210e502572ad97fda",
    )
    ag.add_argument("repo", help="a git work tree or bare repository holding the commit")
    ag.add_argument("--commit", required=True, help="the commit (full or abbreviated) to export")
    _pin_options(ag, "the commit")
    aa = sub.add_parser(
        "add-archive",
        help="seed a git source from an archive of its tree (git archive, GitHub's "
        "tarball), checked by the git tree id the locks pin",
        epilog="e.g. trainer cache add-archive Megatron-LM-37f91617.tar.gz",
    )
    aa.add_argument("archive", help="a tar (any compression) or zip with one top-level directory")
    _pin_options(aa, "the archive's tree")
    f = sub.add_parser("fetch", help="download every input of a lock into the cache (hash-checked)")
    f.add_argument("--lock", required=True)
    f.add_argument("--json", action="store_true")
    f.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="URL_PREFIX",
        help="also download git source archives from URLs starting with this (default: GitHub only)",
    )
    f.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    c = sub.add_parser("gc", help="remove what killed builds left (partial blobs, spools) that no live build uses")
    c.add_argument("--json", action="store_true")
    c.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    v = sub.add_parser("verify", help="re-hash every blob; remove and list corrupt ones; list debris")
    v.add_argument("--json", action="store_true")
    v.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
    for name, helptext in (
        ("push", "upload the lock's built layers to a binary cache (registry or directory), each entry signed"),
        ("pull", "download the lock's layers missing here from a binary cache, each verified before use"),
    ):
        r = sub.add_parser(
            name,
            help=helptext,
            epilog="e.g. trainer cache push docker://registry.example:5000/recipe-cache --lock "
            "lockfiles/debian-full.lock.json --sign-key team-cache.key",
        )
        r.add_argument("remote", help="docker://HOST[:PORT]/REPOSITORY, or a directory (a shared file system)")
        r.add_argument("--lock", action="append", required=True, help="the lock(s) whose layers (repeatable)")
        r.add_argument("--bundle-root", default=str(REPO_ROOT), help=argparse.SUPPRESS)
        r.add_argument("--json", action="store_true")
        r.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)
        if name == "push":
            r.add_argument("--sign-key", required=True, help="private key (`trainer keygen`) that signs each entry")
        add_remote_options(r)
    args = p.parse_args(argv)
    cache = Cache(getattr(args, "cache_sub", None) or args.cache)
    if args.command in ("push", "pull"):
        return _push_pull(cache, args)
    if args.command == "add":
        print(f"sha256:{cache.add_file(Path(args.file), args.sha256)}")
        return 0
    if args.command == "path":
        print(cache.blob_path(parse_sha256(args.sha256, "sha256")) if args.sha256 else cache.root)
        return 0
    if args.command == "fetch":
        for host in args.allow_host:
            if not re.match(r"^https?://[^/]+/", host):
                raise UserError(
                    f"--allow-host {host!r}: expected a URL prefix ending with the host's '/', "
                    "e.g. http://127.0.0.1:8000/"
                )
        return _fetch(cache, Path(args.lock), args.json, tuple(args.allow_host))
    if args.command in ("add-git", "add-archive"):
        return _add_git(cache, args)
    if args.command == "add-image":
        return _add_image(cache, args)
    if args.command == "gc":
        removed = [str(p.relative_to(cache.root)) for p in cache.gc()]
        print(json.dumps({"removed": removed}, indent=2) if args.json else f"{len(removed)} debris entries removed")
        return 0
    blobs = sorted((cache.root / "sha256").glob("*")) if (cache.root / "sha256").is_dir() else []
    bad = []
    for blob in blobs:
        try:
            cache.get(blob.name, blob.name)
        except UserError as err:
            bad.append(str(err))
    debris = [str(p.relative_to(cache.root)) for p in cache.debris()]
    if args.json:
        print(json.dumps({"blobs": len(blobs), "corrupt": bad, "debris": debris}, indent=2))
    else:
        for line in bad:
            print(line)
        for name in debris:
            print(f"debris {name} (left by a killed build; `trainer cache gc` removes it)")
        print(f"{len(blobs)} blobs, {len(bad)} corrupt, {len(debris)} debris")
    return 1 if bad or debris else 0


def _add_image(cache: Cache, args: argparse.Namespace) -> int:
    from rich.console import Console

    digest, reference, platform = args.digest, None, tuple(args.platform.split("/", 1))
    if len(platform) != 2:
        raise UserError(f"--platform: expected OS/ARCH (e.g. linux/amd64), got {args.platform!r}")
    if args.lock:
        lock = load_lock(Path(args.lock))
        if lock["base"]["type"] != "oci":
            raise UserError(f"{args.lock}: base.type is {lock['base']['type']!r}, not 'oci' (nothing to seed)")
        if digest and digest != lock["base"]["digest"]:
            raise UserError(f"--digest {digest} differs from {args.lock}'s base.digest {lock['base']['digest']}")
        digest, reference = lock["base"]["digest"], lock["base"]["reference"]
        platform = (lock.get("platform", {}).get("os", "linux"), lock.get("platform", {}).get("architecture", "amd64"))
    console = None if args.json else Console(stderr=True, highlight=False)
    block = add_image(cache, Path(args.seed), digest, platform, reference, console)
    if args.json:
        print(json.dumps(block, indent=1, sort_keys=True))
    else:
        size = sum(layer["size"] for layer in block["layers"])
        print(
            f"added {block['digest']} (config {block['config_digest']}, {len(block['layers'])} layers, {size:,} bytes)"
        )
    return 0


def _pin_options(parser: argparse.ArgumentParser, what: str) -> None:
    """The options ``add-git`` and ``add-archive`` share: the locks whose pins ``what`` must match, ``--tree``,
    ``--json``."""
    parser.add_argument(
        "--lock",
        action="append",
        default=[],
        help=f"lock(s) whose pin {what} must match (default: the bundle's lockfiles/*.lock.json and stack.json)",
    )
    parser.add_argument("--tree", help=f"the expected git tree id, for {what} when no lock pins it")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cache", dest="cache_sub", help=argparse.SUPPRESS)


def _add_git(cache: Cache, args: argparse.Namespace) -> int:

    if args.tree is not None and not re.match(r"^[0-9a-f]{40}$", args.tree):
        raise UserError(f"--tree: expected a full 40-hex git tree id, got {args.tree!r}")
    locks = [Path(p) for p in args.lock] or sorted((REPO_ROOT / "lockfiles").glob("*.lock.json")) + [
        REPO_ROOT / "lockfiles" / "stack.json"
    ]
    for lock in locks:
        if not lock.is_file():
            raise UserError(f"--lock {lock}: not found")
    if args.command == "add-archive":
        stored = add_archive(cache, Path(args.archive), pins_for(locks), args.tree)
    else:
        stored = add_git(cache, Path(args.repo), args.commit, pins_for(locks), args.tree)
    if args.json:
        print(json.dumps(stored, indent=2, sort_keys=True))
    else:
        print(
            f"added {stored['name']} {stored['commit'] or '(commit unknown)'} tree {stored['tree']} "
            f"({stored['files']} files, {stored['bytes']:,} bytes) as sha256:{stored['sha256']}"
        )
    return 0


def _remove_non_file(path: Path) -> None:
    """Remove what is at the blob path ``path`` when it is not a regular file (a link or special file unlinked,
    never followed; a directory removed whole: the cache's own name space); a regular file, or nothing, is left."""
    import shutil
    import stat

    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path)
        elif not stat.S_ISREG(info.st_mode):
            os.unlink(path)
    except OSError:
        pass


def _fetch(cache: Cache, lock_path: Path, as_json: bool, extra_hosts: tuple = ()) -> int:

    lock = load_lock(lock_path)
    fetched, present, missing = 0, 0, []

    def cached(sha: str, label: str) -> bool:
        """Whether the cache holds blob ``sha`` intact: re-hashed unless its stamp vouches for it
        (:meth:`~trainer.image.cas.Cache.get`); a corrupt one is removed, reported in ``missing`` unless it is
        fetched again, and not counted as cached. What is not a regular file at the blob's path (a directory, a
        FIFO, a link: refused by ``get`` without blocking) is removed too, never followed, so that the blob can
        be fetched again."""
        try:
            return cache.get(sha, label, trust_stamp=True) is not None
        except UserError as err:
            corrupt.append(str(err))
            _remove_non_file(cache.blob_path(sha))
            return False

    def missing_line(err: UserError) -> str:
        """The corrupt blobs of the input and ``err``, each said once (``ensure`` may refuse what ``get`` did)."""
        return "; ".join(dict.fromkeys([*corrupt, str(err)]))

    corrupt: list[str] = []  # the corrupt blobs of the input at hand
    repaired: list[str] = []  # those fetched again
    if lock["base"]["type"] == "oci":
        try:
            load_base(cache, lock["base"], lock.get("platform", {}), str(lock_path))
            present += 1
        except UserError as err:
            missing.append(str(err))
    for item in inputs_of(lock, sources=False):
        corrupt.clear()
        if cached(item["sha256"], item["label"]):
            present += 1
            continue
        try:
            cache.ensure(item["sha256"], item["label"], item["url"])
            fetched += 1
            repaired.extend(f"{line}; fetched again" for line in corrupt)
        except UserError as err:
            missing.append(missing_line(err))
    for src in lock.get("sources", []):  # git sources: by archive sha256 or by tree, each tree-checked on use
        corrupt.clear()
        record = cache.tree_record(src["tree"])
        label = f"source {src['name']}@{src['commit'][:12]}"
        if ("archive" in src and cached(src["archive"]["sha256"], f"{label} ({src['archive']['filename']})")) or (
            record and cached(record["sha256"], f"{label} (git tree {src['tree']})")
        ):
            present += 1
            continue
        try:
            fetch_source(cache, src, FETCH_HOSTS + extra_hosts)
            fetched += 1
            repaired.extend(f"{line}; fetched again" for line in corrupt)
        except UserError as err:
            missing.append(missing_line(err))
    if as_json:
        print(json.dumps({"fetched": fetched, "present": present, "missing": missing, "repaired": repaired}, indent=2))
    else:
        for line in repaired + missing:
            print(line)
        print(f"{fetched} fetched, {present} already cached, {len(missing)} missing")
    return 1 if missing else 0


def _push_pull(cache: Cache, args: argparse.Namespace) -> int:
    """``cache push`` / ``cache pull``: one line per layer of the locks (JSON with ``--json``); exit 1 when a
    layer was left out (not built here, refused by the remote, or untrusted)."""
    (remote,) = remotes_from(args, [args.remote])
    signer = load_signer(Path(args.sign_key)) if args.command == "push" else None
    wanted: dict[str, str] = {}
    for lock_path in args.lock:
        lock = load_lock(Path(lock_path))
        for layer, key in layer_keys(lock, Path(args.bundle_root)).items():
            if layer != "bundle":  # made from conf/ at every build, never cached
                wanted.setdefault(key, layer)
    rows, failed = [], 0
    for key, layer in wanted.items():
        row = {"layer": layer, "key": key}
        try:
            if args.command == "push":
                row.update(status="pushed", entry=remote.push(cache, key, layer, signer))
            elif _intact(cache, key, layer):
                row.update(status="present")
            else:
                row.update(status="pulled", diff_id=remote.fetch(cache, key, layer)["diff_id"])
        except UserError as err:
            failed += 1
            row.update(status="refused" if args.command == "pull" else "not pushed", reason=str(err))
        rows.append(row)
        if not args.json:
            shown = row.get("entry") or row.get("diff_id") or key
            print(row.get("reason") or f"{row['status']:<8} layer {layer:<32} {shown}")
    if args.json:
        print(json.dumps({"remote": args.remote, "layers": rows, "failed": failed}, indent=2))
    else:
        counts = {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)}
        print(", ".join(f"{n} {s}" for s, n in counts.items()) or "no layers")
    return 1 if failed else 0


def _intact(cache: Cache, key: str, layer: str) -> bool:
    """Whether the cache holds the layer of ``key`` with its blob intact (re-hashed unless its stamp vouches for
    it; a corrupt blob is removed, so that a pull fetches it again)."""
    record = cache.layer_record(key)
    if record is None:
        return False
    try:
        return cache.get(record["diff_id"][7:], f"layer {layer}", trust_stamp=True) is not None
    except UserError:
        return False
