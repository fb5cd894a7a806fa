"""``trainer image build|digest|diff|check|sbom|provenance|squashfs``: build an OCI image from a lock, print its digest,
compare two images, check an image against the expected digest recorded for its lock, print the SBOM or
provenance attached to it.

Exit codes: 0 success (``diff``: identical; ``check``: the expected digest), 1 ``diff``: the images differ /
``check``: not the expected image, 2 refused input (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from trainer import REPO_ROOT
from trainer.errors import UserError
from trainer.image import provenance, referrers, sbom
from trainer.image.build import LOCK_LABEL, build_image, layer_keys, predicted_record
from trainer.image.cas import Cache
from trainer.image.diff import diff_main
from trainer.image.native import check_builds
from trainer.image.oci import open_image
from trainer.image.push import print_result, push_image
from trainer.image.remote import add_remote_options, remotes_from
from trainer.image.smoke import smoke_source
from trainer.image.squashfs import make_squashfs
from trainer.inputs import read_json
from trainer.lock.imagelock import load_lock, stale_inputs
from trainer.publish import atomic_write
from trainer.record.record import git_revision
from trainer.signing import parse_statement

EPILOG = """examples:
  trainer image build --lock lockfiles/smoke.lock.json --out build/smoke.oci --archive build/smoke.oci.tar
  trainer image digest build/smoke.oci            # last line: sha256:<manifest digest>
  trainer image digest --json build/smoke.oci.tar
  trainer image diff build/a.oci build/b.oci      # "identical" (exit 0) or the differences (exit 1)
  trainer image diff build/smoke.oci lockfiles/smoke.lock.json
  trainer image squashfs build/debian-cluster.oci --out build/debian-cluster.sqsh   # for pyxis/enroot
  trainer image diff build/smoke.oci runs/RUN/record.json   # the image a run record names
  trainer image check --lock lockfiles/debian-full.lock.json build/debian-full.oci
  trainer image check --lock lockfiles/debian-full.lock.json --predict --record   # after a conf/ change
  trainer image sbom build/smoke.oci [--format cyclonedx]   # the SBOM attached to the image
  trainer image provenance build/smoke.oci [--statement]    # its SLSA provenance (a DSSE envelope when signed)
"""

EXPECTED = REPO_ROOT / "lockfiles" / "expected-digests.json"


def _revision(value: str) -> str:
    if value != "auto":
        return value
    rev = git_revision()
    revision = rev["revision"]
    if not revision:
        return "unknown"
    return revision + ("-dirty" if rev["dirty"] else "")


def cmd_build(args: argparse.Namespace) -> int:
    """``trainer image build``: build the lock's image (:func:`trainer.image.build.build_image`) and print its
    manifest digest (or, with ``--json``, the digests and each layer's name, diff_id, size in bytes and cache
    status; ``--archive`` also prints the archive's sha256). Returns 0; refused input raises :class:`UserError`.
    """
    from rich.console import Console

    if not args.frozen:
        stale = stale_inputs(load_lock(Path(args.lock)))
        if stale:
            raise UserError(stale)
    console = Console(stderr=True, highlight=False)
    result = build_image(
        Path(args.lock),
        Path(args.out),
        Cache(args.cache),
        Path(args.bundle_root),
        Path(args.archive) if args.archive else None,
        _revision(args.revision),
        args.offline,
        None if args.quiet else console,
        args.verify_cache,
        Path(args.sign_key) if args.sign_key else None,
        args.jobs,
        remotes_from(args, args.substituter),
    )
    if args.json:
        print(
            json.dumps(
                {
                    "manifest_digest": result.manifest_digest,
                    "config_digest": result.config_digest,
                    "archive_sha256": result.archive_digest,
                    "out": args.out,
                    "referrers": [{"artifactType": t, "digest": d} for t, d in result.referrers],
                    "layers": [{"name": n, "diff_id": d, "size": s, "status": st} for n, d, s, st in result.layers],
                },
                indent=2,
            )
        )
    else:
        if args.archive:
            print(f"archive {args.archive} {result.archive_digest}")
        print(result.manifest_digest)
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """``trainer image push``: :func:`trainer.image.push.push_image`; prints the pinned reference. Returns 0;
    raises :class:`UserError` (exit 2) for a bad layout or target, :class:`trainer.image.remote.Refused` (exit 1)
    when the registry refuses or is down."""
    if not args.remote_timeout > 0:
        raise UserError(f"--remote-timeout {args.remote_timeout}: expected a positive number of seconds")
    print_result(push_image(Path(args.image), args.target, args.tls_verify, args.remote_timeout), args.json)
    return 0


def cmd_squashfs(args: argparse.Namespace) -> int:
    """``trainer image squashfs LAYOUT --out FILE``: the image (``--digest``, default the layout's only one) as a
    squashfs file for ``srun --container-image`` (:mod:`trainer.image.squashfs`); prints the record (JSON with
    ``--json``, else the file's sha256 and the digest it was made from). Returns 0; raises :class:`UserError`."""
    layout = Path(args.image)
    digest = args.digest or open_image(layout).manifest_digest
    if not digest:
        raise UserError(f"{layout}: no image manifest digest (give --digest sha256:...)")
    record = make_squashfs(layout, digest, Path(args.out), args.processors)
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
    else:
        print(f"{args.out}: sha256:{record['sha256']} ({record['bytes']:,} bytes), made from {digest}")
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    """``trainer image digest``: print the image's manifest digest (``sha256:<hex>``), or with ``--json`` its
    kind, manifest and config digests and layers (diff_id, digest, size in bytes, media type). Returns 0.

    Raises :class:`UserError` for a docker-archive without ``--json`` (it has no manifest digest).
    """

    image = open_image(Path(args.image))
    if args.json:
        print(
            json.dumps(
                {
                    "kind": image.kind,
                    "manifest_digest": image.manifest_digest,
                    "config_digest": image.config_digest,
                    "layers": [
                        {"diff_id": x.diff_id, "digest": x.digest, "size": x.size, "mediaType": x.media_type}
                        for x in image.layers
                    ],
                },
                indent=2,
            )
        )
        return 0
    if image.manifest_digest is None:
        raise UserError(
            f"{args.image}: a docker-archive has no manifest digest (its config digest, the image ID, is "
            f"{image.config_digest}); compare images with `trainer image diff`"
        )
    print(image.manifest_digest)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``trainer image diff A B``: :func:`trainer.image.diff.diff_main`; returns 0 identical, 1 different."""
    return diff_main(Path(args.a), Path(args.b), args.json)


def cmd_sbom(args: argparse.Namespace) -> int:
    """``trainer image sbom IMAGE [--format spdx|cyclonedx]``: print the SBOM bound to the image (its bytes as
    attached, digest-checked, its subject this image: :func:`trainer.image.referrers.find`). Returns 0; raises
    :class:`UserError` (one line) when there is none or the layout's referrers do not bind (an extra,
    duplicated, foreign or altered one, two provenances), or ``--validate`` fails."""

    image = open_image(Path(args.image))
    media = sbom.SPDX_MEDIA_TYPE if args.format == "spdx" else sbom.CYCLONEDX_MEDIA_TYPE
    _, data = referrers.find(image, (media,))
    if args.validate:
        (sbom.validate_spdx if args.format == "spdx" else sbom.validate_cyclonedx)(
            data, f"{args.image} {args.format} SBOM"
        )
    sys.stdout.buffer.write(data)
    return 0


def cmd_provenance(args: argparse.Namespace) -> int:
    """``trainer image provenance IMAGE [--statement]``: print the SLSA provenance bound to the image (the
    statement, or its DSSE envelope when the build was signed; ``--statement`` prints the statement inside an
    envelope). Raises :class:`UserError` (one line) as :func:`cmd_sbom` does, and for a payload that is not a
    statement; the signature is checked by ``trainer verify IMAGE --key``, not here."""

    image = open_image(Path(args.image))
    kind, data = referrers.find(image, (referrers.MT_DSSE, provenance.INTOTO_MEDIA_TYPE), provenance.SLSA_PROVENANCE)
    if args.statement and kind == referrers.MT_DSSE:
        import base64

        try:
            data = base64.b64decode(json.loads(data)["payload"], validate=True)
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{args.image}: the provenance envelope has no base64 payload") from None
    if args.statement or kind != referrers.MT_DSSE:
        parse_statement(data, f"{args.image} provenance")
    sys.stdout.buffer.write(data)
    return 0


def _layer_names(image) -> list[str]:
    prefix = "recipe-bundle layer "
    return [x.history[len(prefix) :] if x.history.startswith(prefix) else x.history for x in image.layers]


def cmd_check(args: argparse.Namespace) -> int:
    """Compare an image with the expected digest recorded for its lock (``--record`` writes that record)."""

    lock = load_lock(Path(args.lock))
    expected_path = Path(args.expected)
    try:
        table = read_json(expected_path, "expected-digests file") if expected_path.exists() else {}
    except json.JSONDecodeError as ex:
        raise UserError(f"{expected_path}: not valid JSON ({ex})") from None
    if not isinstance(table, dict):
        raise UserError(f"{expected_path}: expected a JSON object of lock names")
    if args.predict:
        return _check_predicted(args, lock, table, expected_path)
    if args.image is None:
        raise UserError("trainer image check: name the IMAGE to check (or pass --predict to check without one)")
    image = open_image(Path(args.image))
    labels = (image.config.get("config") or {}).get("Labels") or {}
    layers: list[dict[str, Any]] = [
        {"name": n, "diff_id": x.diff_id, "size": x.size}
        for n, x in zip(_layer_names(image), image.layers, strict=True)  # one name per layer
    ]
    if args.record:
        if labels.get(LOCK_LABEL) != lock["_sha256"]:
            raise UserError(
                f"{args.image}: built from lock sha256 {labels.get(LOCK_LABEL)}, not {args.lock} ({lock['_sha256']})"
            )
        builds = (table.get(lock["name"]) or {}).get("builds")
        keys = layer_keys(lock, Path(args.bundle_root))
        table[lock["name"]] = {
            "lock": Path(args.lock).name,
            "lock_sha256": lock["_sha256"],
            "manifest_digest": image.manifest_digest,
            "config_digest": image.config_digest,
            "revision": labels.get("org.opencontainers.image.revision"),
            "layers": [{**layer, "key": keys.get(layer["name"], "")} for layer in layers],
            "recorded_by": "build",
            **({"builds": builds} if builds else {}),
        }
        atomic_write(expected_path, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode(), 0o644)
        print(f"recorded {image.manifest_digest} for {lock['name']} in {expected_path}")
        return 0
    entry = table.get(lock["name"])
    if entry is None:
        raise UserError(f"{expected_path}: no expected digest for lock {lock['name']!r} (record one with --record)")
    build_lines, builds_ok = check_builds(lock, layers, entry.get("builds", {}))
    if "manifest_digest" not in entry:  # only the build steps' outputs are recorded (bench/native_builds.py)
        for line in build_lines:
            print(line)
        return 0 if builds_ok else 1
    if entry.get("lock_sha256") != lock["_sha256"]:
        raise UserError(
            f"{expected_path}: the expected digest of {lock['name']!r} was recorded for lock sha256 "
            f"{entry.get('lock_sha256')}, but {args.lock} is {lock['_sha256']} (re-record after a re-lock)"
        )
    lines = []
    if labels.get(LOCK_LABEL) != lock["_sha256"]:
        lines.append(f"lock: image built from lock sha256 {labels.get(LOCK_LABEL)}, expected {lock['_sha256']}")
    want = {x["name"]: x["diff_id"] for x in entry.get("layers", [])}
    for layer in layers:
        if layer["name"] not in want:
            lines.append(f"layer {layer['name']}: {layer['diff_id']} not expected")
        elif want[layer["name"]] == layer["diff_id"]:
            lines.append(f"layer {layer['name']}: same {layer['diff_id']}")
        else:
            lines.append(f"layer {layer['name']}: {layer['diff_id']}, expected {want[layer['name']]}")
    for name in want:
        if name not in {x["name"] for x in layers}:
            lines.append(f"layer {name}: missing, expected {want[name]}")
    lines += build_lines
    ok = image.manifest_digest == entry.get("manifest_digest") and builds_ok
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "manifest_digest": image.manifest_digest,
                    "expected": entry.get("manifest_digest"),
                    "details": lines,
                },
                indent=2,
            )
        )
        return 0 if ok else 1
    for line in lines:
        print(line)
    if ok:
        print(f"ok: {image.manifest_digest} is the expected digest")
        return 0
    print(
        f"different: {image.manifest_digest}, expected {entry.get('manifest_digest')} (recorded with --revision "
        f"{entry.get('revision')}; the bundle layer also holds conf/, so a changed conf/ or revision changes only "
        "the bundle layer and the config)"
    )
    return 1


def _check_predicted(args: argparse.Namespace, lock: dict, table: dict, expected_path: Path) -> int:
    """``trainer image check --predict``: the digests a build of the lock would give now, made without building
    (:func:`trainer.image.build.predicted_record`), compared with the recorded ones (exit 0 same, 1 not) or,
    with ``--record``, recorded in their place."""

    entry = table.get(lock["name"])
    if entry is None or "manifest_digest" not in entry:
        raise UserError(
            f"{expected_path}: no recorded build of lock {lock['name']!r} to predict from (build the "
            "image and record it with `trainer image check --lock LOCK IMAGE --record`)"
        )
    predicted = predicted_record(Path(args.lock), entry, Path(args.bundle_root))
    if args.record:
        table[lock["name"]] = predicted
        atomic_write(expected_path, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode(), 0o644)
        print(
            f"recorded {predicted['manifest_digest']} for {lock['name']} in {expected_path} (predicted: bundle "
            f"layer {predicted['layers'][-1]['diff_id']}, every other layer as built)"
        )
        return 0
    same = predicted["manifest_digest"] == entry["manifest_digest"]
    if args.json:
        print(
            json.dumps(
                {"ok": same, "predicted": predicted["manifest_digest"], "expected": entry["manifest_digest"]}, indent=2
            )
        )
    else:
        print(
            f"ok: a build now gives {predicted['manifest_digest']}, the expected digest"
            if same
            else f"different: a build now gives {predicted['manifest_digest']}, expected {entry['manifest_digest']} "
            "(record the prediction with --record)"
        )
    return 0 if same else 1


def cmd_smoke_source(args: argparse.Namespace) -> int:
    """``trainer image smoke-source DIR``: :func:`trainer.image.smoke.smoke_source`, printed as one JSON line."""
    print(json.dumps(smoke_source(Path(args.dir))))
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer image`` with its ``build``, ``digest``, ``diff`` and ``check``
    subcommands; each sets ``func`` to its ``cmd_*`` handler.
    """
    p = argparse.ArgumentParser(
        prog="trainer image",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an OCI image layout (and oci-archive) from a lock; prints its digest")
    b.add_argument("--lock", required=True, help="the image lock (lockfiles/*.lock.json)")
    b.add_argument("--out", required=True, help="OCI layout directory to write (replaced atomically)")
    b.add_argument("--archive", help="also write an oci-archive tar here")
    b.add_argument("--cache", help="content-addressed cache directory (default $XDG_CACHE_HOME/recipe-bundle/cas)")
    b.add_argument("--bundle-root", default=str(REPO_ROOT), help="directory whose conf/ goes into the bundle layer")
    b.add_argument(
        "--revision",
        default="auto",
        help="org.opencontainers.image.revision label (default: git HEAD, '-dirty' when modified)",
    )
    b.add_argument(
        "--offline",
        action="store_true",
        help="never download inputs (PyPI, Debian); missing inputs are an error (a --substituter given is still asked)",
    )
    b.add_argument(
        "--verify-cache",
        action="store_true",
        help="re-hash every cached layer in full (default: trust a layer blob whose stat matches the stamp "
        "recorded when its hash was last checked; inputs are always re-hashed when read)",
    )
    b.add_argument("--sign-key", help="private key (`trainer keygen`): attach the provenance as a signed DSSE envelope")
    b.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="parallel jobs of build steps (BUILD_JOBS inside; not part of any cache key; default: the cores)",
    )
    b.add_argument("--json", action="store_true", help="print digests and layers as JSON")
    b.add_argument(
        "--frozen",
        action="store_true",
        help="build the lock as it is even when its requirements file changed since it was resolved",
    )
    b.add_argument("-q", "--quiet", action="store_true", help="no per-layer lines or progress bars")
    b.add_argument(
        "--substituter",
        action="append",
        default=[],
        metavar="REMOTE",
        help="a binary cache (docker://HOST/REPO or a directory) a missing layer is taken from when a trusted, "
        "intact entry is there (repeatable, tried in order; see `trainer cache pull`)",
    )
    add_remote_options(b)
    b.set_defaults(func=cmd_build)
    pu = sub.add_parser(
        "push",
        help="push an image layout and its SBOM/provenance referrers to a registry by digest; prints the reference",
        epilog="e.g. trainer image push build/debian-full.oci registry.example:5000/recipe-bundle",
    )
    pu.add_argument("image", help="OCI layout directory (`trainer image build --out`)")
    pu.add_argument("target", help="REGISTRY/NAME (no tag: the image goes by digest)")
    pu.add_argument("--json", action="store_true", help="the reference, digest and referrers as JSON")
    pu.add_argument(
        "--no-tls-verify", dest="tls_verify", action="store_false", help="plain HTTP / unverified TLS (a test registry)"
    )
    pu.add_argument("--remote-timeout", type=float, default=900.0, metavar="SECONDS", help="give up after this")
    pu.set_defaults(func=cmd_push)
    q = sub.add_parser(
        "squashfs",
        help="write an image of an OCI layout as a squashfs file for pyxis/enroot (srun --container-image=FILE)",
        epilog="e.g. trainer image squashfs build/debian-cluster.oci --out build/debian-cluster.sqsh; then "
        "train launcher=slurm launcher.image=$PWD/build/debian-cluster.sqsh@sha256:<manifest digest>",
    )
    q.add_argument("image", help="OCI layout directory (`trainer image build --out`)")
    q.add_argument("--out", required=True, help="the squashfs file to write (its record goes to FILE.json)")
    q.add_argument("--digest", help="the manifest digest (default: the layout's image, as `image digest` prints)")
    q.add_argument("--processors", type=int, help="mksquashfs -processors (default: every CPU)")
    q.add_argument("--json", action="store_true", help="print the record as JSON")
    q.set_defaults(func=cmd_squashfs)
    d = sub.add_parser("digest", help="print an image's manifest digest (last line: sha256:<hex>)")
    d.add_argument("image", help="OCI layout directory or oci-archive (docker-archive with --json)")
    d.add_argument("--json", action="store_true", help="also the config digest and every layer's diff_id and size")
    d.set_defaults(func=cmd_digest)
    f = sub.add_parser("diff", help="compare two images, or an image and a lock: exit 0 identical, 1 different")
    f.add_argument("a", help="image (layout dir, oci-archive, docker-archive)")
    f.add_argument("b", help="image, or an image lock (*.lock.json) / run record (record.json)")
    f.add_argument("--json", action="store_true", help="the differences as JSON")
    f.set_defaults(func=cmd_diff)
    s = sub.add_parser("sbom", help="print the SBOM attached to an image (OCI 1.1 referrer)")
    s.add_argument("image", help="OCI layout directory or oci-archive")
    s.add_argument(
        "--format", choices=("spdx", "cyclonedx"), default="spdx", help="SPDX 2.3 (default) or CycloneDX 1.6 JSON"
    )
    s.add_argument("--validate", action="store_true", help="validate it first (spdx-tools / the CycloneDX JSON schema)")
    s.set_defaults(func=cmd_sbom)
    v = sub.add_parser("provenance", help="print the SLSA provenance attached to an image (OCI 1.1 referrer)")
    v.add_argument("image", help="OCI layout directory or oci-archive")
    v.add_argument(
        "--statement", action="store_true", help="the in-toto statement even when it is signed (the DSSE payload)"
    )
    v.set_defaults(func=cmd_provenance)
    c = sub.add_parser(
        "check", help="compare an image with the expected digest recorded for its lock (exit 0 match, 1 not)"
    )
    c.add_argument("image", nargs="?", help="OCI layout directory or oci-archive (none with --predict)")
    c.add_argument("--lock", required=True, help="the lock the image was built from")
    c.add_argument(
        "--expected", default=str(EXPECTED), help="expected digests (default lockfiles/expected-digests.json)"
    )
    c.add_argument(
        "--record", action="store_true", help="record this image's digests as the expected ones for the lock"
    )
    c.add_argument(
        "--predict",
        action="store_true",
        help="no image: the digests a build would give now, from the recorded build and this checkout's "
        "conf/ (only the bundle layer may have changed); with --record, record them",
    )
    c.add_argument("--bundle-root", default=str(REPO_ROOT), help="directory whose conf/ goes into the bundle layer")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
    m = sub.add_parser(
        "smoke-source",
        help="write the smoke lock's git source archive into DIR; print path, commit, "
        "tree and sha256 as JSON (then `trainer cache add PATH --sha256 HEX`)",
    )
    m.add_argument("dir", help="directory to write the archive into")
    m.set_defaults(func=cmd_smoke_source)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``trainer image``; returns the exit code (see the module docstring)."""
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)
