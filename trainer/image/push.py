"""``trainer image push LAYOUT REGISTRY/NAME``: an image and its referrers into a registry, by digest.

The image manifest is copied with skopeo (``--preserve-digests``: its bytes, and so its digest, unchanged) to
``REGISTRY/NAME@sha256:<digest>``. Its referrers (the SBOMs and the provenance, :mod:`trainer.image.referrers`)
go with it under the referrers tag scheme of the OCI distribution-spec v1.1 ("Referrers Tag Schema"): an image
index listing them is tagged ``sha256-<hex of the image digest>``, and skopeo ``--all`` copies the index with each
referrer manifest and blob. A registry with the referrers API (distribution-spec v1.1) also indexes them by their
``subject``; one without it (distribution 2.8, Debian's ``docker-registry``) serves them from that tag, which
ORAS, cosign and regclient read as the fallback. Prints the pinned reference ``REGISTRY/NAME@sha256:<hex>``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.oci import MT_INDEX, OCI_LAYOUT, compact_json, open_image, verify_layers
from trainer.image.referrers import bound, listed
from trainer.image.remote import DEFAULT_TIMEOUT, Refused, skopeo_copy

REF_NAME = "org.opencontainers.image.ref.name"


def fallback_tag(digest: str) -> str:
    """The referrers tag of the image ``digest`` (distribution-spec v1.1): ``sha256-<hex>``."""
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}-{hexdigest}"


def referrers_index(descriptors: list[dict[str, Any]]) -> bytes:
    """The image index (canonical JSON) the referrers tag holds: one descriptor per referrer manifest, with its
    artifactType and annotations, as the referrers API would answer."""
    keep = ("mediaType", "digest", "size", "artifactType", "annotations")
    manifests = [{k: d[k] for k in keep if k in d} for d in descriptors]
    return compact_json({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": manifests})


def put_manifest(name: str, tag: str, data: bytes, media_type: str, tls_verify: bool, timeout: float) -> None:
    """``PUT /v2/<repository>/manifests/<tag>`` of ``data`` (distribution-spec "Pushing Manifests"): the one
    request skopeo cannot make, since it rewrites an index's descriptors (dropping their artifactType) unless it
    may copy the index byte for byte, which it then refuses. Anonymous push only (a registry asking for a token
    answers 401: one line). Raises :class:`trainer.image.remote.Refused`."""
    import ssl
    import urllib.error
    import urllib.request

    host, _, repository = name.partition("/")
    context = ssl.create_default_context()
    if not tls_verify:  # unverified TLS first, then plain HTTP (skopeo's --tls-verify=false does the same)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    schemes = ["https"] if tls_verify else ["https", "http"]
    for scheme in schemes:
        request = urllib.request.Request(
            f"{scheme}://{host}/v2/{repository}/manifests/{tag}",
            data=data,
            method="PUT",
            headers={"Content-Type": media_type},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context if scheme == "https" else None):
                return
        except urllib.error.HTTPError as ex:
            raise Refused(f"push of the referrers tag {tag}: the registry answered {ex.code} {ex.reason}") from None
        except (urllib.error.URLError, OSError) as ex:
            if scheme == schemes[-1]:
                raise Refused(f"push of the referrers tag {tag}: {getattr(ex, 'reason', ex)}") from None


def _referrer_blobs(layout: Path, referrers: list[dict[str, Any]]) -> list[Path]:
    """The blob files of the ``referrers`` manifests (each manifest, its config and its layers) in ``layout``
    (already read back and checked by :func:`trainer.image.referrers.bound`)."""
    blobs = layout / "blobs" / "sha256"
    paths = []
    for desc in referrers:
        manifest = json.loads((blobs / desc["digest"][7:]).read_bytes())
        paths.append(blobs / desc["digest"][7:])
        paths += [blobs / d["digest"][7:] for d in [manifest["config"], *manifest["layers"]]]
    return sorted(set(paths))


def push_image(layout: Path, target: str, tls_verify: bool = True, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """Push the OCI layout ``layout`` (``trainer image build --out``) to ``target`` (``REGISTRY/NAME``, with or
    without ``docker://``; no tag or digest). Returns {"reference": "REGISTRY/NAME@sha256:<hex>", "digest",
    "referrers": [{"artifactType", "digest"}], "referrers_tag"}. Raises :class:`UserError` for a layout that is
    not an image built here (its referrers are checked on reading, :func:`trainer.image.referrers.listed`) or a
    target with a tag or digest, :class:`trainer.image.remote.Refused` when the registry refuses or is down."""
    name = target[len("docker://") :] if target.startswith("docker://") else target
    last = name.rsplit("/", 1)[-1]
    if "/" not in name or "@" in name or ":" in last or not last:
        raise UserError(f"{target}: expected REGISTRY/NAME (e.g. 127.0.0.1:5000/recipe-bundle), no tag or digest")
    image = open_image(Path(layout))
    if image.kind != "oci-layout":
        raise UserError(f"{layout}: expected an OCI layout directory (`trainer image build --out`)")
    digest = image.manifest_digest
    if digest is None:
        raise UserError(f"{layout}: expected an OCI layout directory (`trainer image build --out`)")
    verify_layers(image)  # every blob re-hashed: nothing altered goes out under this digest
    bound(image)  # its referrers read back, one per kind, each naming this image as subject
    referrers = listed(image)
    names = [
        d["annotations"][REF_NAME]
        for d in (image.index or {}).get("manifests", [])
        if d.get("digest") == digest and isinstance(d.get("annotations"), dict) and REF_NAME in d["annotations"]
    ]
    if not names:
        raise UserError(f"{layout}: index.json names no tag ({REF_NAME}) for the image {digest}")
    skopeo_copy(
        [f"oci:{layout}:{names[0]}", f"docker://{name}@{digest}"], f"push of {digest[:19]}", tls_verify, timeout
    )
    tag = fallback_tag(digest)
    if referrers:
        work = Path(tempfile.mkdtemp(prefix=".push-referrers-", dir=Path(layout).resolve().parent))
        try:
            (work / "blobs" / "sha256").mkdir(parents=True)
            for blob in _referrer_blobs(Path(layout), referrers):  # only theirs: small documents
                try:
                    os.link(blob, work / "blobs" / "sha256" / blob.name)
                except OSError:
                    shutil.copyfile(blob, work / "blobs" / "sha256" / blob.name)
            (work / "oci-layout").write_bytes(OCI_LAYOUT)
            entries = [{**d, "annotations": {REF_NAME: f"r{i}"}} for i, d in enumerate(referrers)]
            (work / "index.json").write_bytes(
                compact_json({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": entries})
            )
            for i, d in enumerate(referrers):
                what = f"push of referrer {d.get('artifactType')} {d['digest'][:19]}"
                skopeo_copy([f"oci:{work}:r{i}", f"docker://{name}@{d['digest']}"], what, tls_verify, timeout)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        put_manifest(name, tag, referrers_index(referrers), MT_INDEX, tls_verify, timeout)
    return {
        "reference": f"{name}@{digest}",
        "digest": digest,
        "referrers": [{"artifactType": d.get("artifactType"), "digest": d["digest"]} for d in referrers],
        "referrers_tag": f"{name}:{tag}" if referrers else None,
    }


def print_result(result: dict[str, Any], as_json: bool) -> None:
    """Print what :func:`push_image` returned: the pinned reference last (or JSON)."""
    if as_json:
        print(json.dumps(result, indent=2))
        return
    for ref in result["referrers"]:
        print(f"referrer {ref['artifactType']:<40} {ref['digest']}")
    if result["referrers_tag"]:
        print(f"referrers tag {result['referrers_tag']}")
    print(result["reference"])
