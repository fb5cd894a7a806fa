"""``trainer image build|digest|diff``: build an OCI image from a lock, print its digest, compare two images.

Exit codes: 0 success (``diff``: identical), 1 ``diff``: the images differ, 2 refused input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List

from trainer import REPO_ROOT
from trainer.image.cas import Cache

EPILOG = """examples:
  trainer image build --lock lockfiles/smoke.lock.json --out build/smoke.oci --archive build/smoke.oci.tar
  trainer image digest build/smoke.oci            # last line: sha256:<manifest digest>
  trainer image digest --json build/smoke.oci.tar
  trainer image diff build/a.oci build/b.oci      # "identical" (exit 0) or the differences (exit 1)
  trainer image diff build/smoke.oci lockfiles/smoke.lock.json
"""


def _revision(value: str) -> str:
    if value != "auto":
        return value
    from trainer.record import git_revision

    rev = git_revision()
    if not rev.get("revision"):
        return "unknown"
    return rev["revision"] + ("-dirty" if rev.get("dirty") else "")


def cmd_build(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trainer.image.build import build_image

    console = Console(stderr=True, highlight=False)
    result = build_image(Path(args.lock), Path(args.out), Cache(args.cache), Path(args.bundle_root),
                         Path(args.archive) if args.archive else None, _revision(args.revision), args.offline,
                         None if args.quiet else console)
    if args.json:
        print(json.dumps({"manifest_digest": result.manifest_digest, "config_digest": result.config_digest,
                          "archive_sha256": result.archive_digest, "out": args.out,
                          "layers": [{"name": n, "diff_id": d, "size": s, "status": st} for n, d, s, st in result.layers]},
                         indent=2))
    else:
        if args.archive:
            print(f"archive {args.archive} {result.archive_digest}")
        print(result.manifest_digest)
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    from trainer.errors import UserError
    from trainer.image.oci import open_image

    image = open_image(Path(args.image))
    if args.json:
        print(json.dumps({"kind": image.kind, "manifest_digest": image.manifest_digest,
                          "config_digest": image.config_digest,
                          "layers": [{"diff_id": l.diff_id, "digest": l.digest, "size": l.size, "mediaType": l.media_type}
                                     for l in image.layers]}, indent=2))
        return 0
    if image.manifest_digest is None:
        raise UserError(f"{args.image}: a docker-archive has no manifest digest (its config digest, the image ID, is "
                        f"{image.config_digest}); compare images with `trainer image diff`")
    print(image.manifest_digest)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from trainer.image.diff import diff_main

    return diff_main(Path(args.a), Path(args.b), args.json)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainer image", description=__doc__.splitlines()[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an OCI image layout (and oci-archive) from a lock; prints its digest")
    b.add_argument("--lock", required=True, help="the image lock (lockfiles/*.lock.json)")
    b.add_argument("--out", required=True, help="OCI layout directory to write (replaced atomically)")
    b.add_argument("--archive", help="also write an oci-archive tar here")
    b.add_argument("--cache", help="content-addressed cache directory (default $XDG_CACHE_HOME/recipe-bundle/cas)")
    b.add_argument("--bundle-root", default=str(REPO_ROOT), help="directory whose conf/ goes into the bundle layer")
    b.add_argument("--revision", default="auto",
                   help="org.opencontainers.image.revision label (default: git HEAD, '-dirty' when modified)")
    b.add_argument("--offline", action="store_true", help="never download; missing inputs are an error")
    b.add_argument("--json", action="store_true", help="print digests and layers as JSON")
    b.add_argument("-q", "--quiet", action="store_true", help="no per-layer lines or progress bars")
    b.set_defaults(func=cmd_build)
    d = sub.add_parser("digest", help="print an image's manifest digest (last line: sha256:<hex>)")
    d.add_argument("image", help="OCI layout directory or oci-archive (docker-archive with --json)")
    d.add_argument("--json", action="store_true", help="also the config digest and every layer's diff_id and size")
    d.set_defaults(func=cmd_digest)
    f = sub.add_parser("diff", help="compare two images, or an image and a lock: exit 0 identical, 1 different")
    f.add_argument("a", help="image (layout dir, oci-archive, docker-archive)")
    f.add_argument("b", help="image, or an image lock (*.lock.json) / run record (record.json)")
    f.add_argument("--json", action="store_true", help="the differences as JSON")
    f.set_defaults(func=cmd_diff)
    return p


def main(argv: List[str]) -> int:
    """Entry point of ``trainer image``; returns the exit code (see the module docstring)."""
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)
