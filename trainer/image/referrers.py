"""SBOMs and provenance attached to an OCI layout as OCI 1.1 referrers; finding and reading them back.

A referrer (OCI image-spec v1.1, manifest.md "Guidelines for Artifact Usage" and image-layout.md) is an
image manifest with ``artifactType``, the empty config (``application/vnd.oci.empty.v1+json``, ``{}``),
one layer holding the document and ``subject`` = the image manifest's descriptor. ``index.json`` lists the
image first (annotated ``org.opencontainers.image.ref.name`` = ``latest``) and then each referrer with its
``artifactType`` and no ref name, so the image's manifest digest (``trainer image digest``) is unchanged and
``skopeo``/``umoci`` read the image by its name (``oci:DIR:latest``, ``umoci unpack --image DIR:latest``).

Attached by ``trainer image build`` (:func:`documents`):

===============================  =========================================  ==========================
artifactType                     document                                   written by
===============================  =========================================  ==========================
application/spdx+json            SPDX 2.3 JSON SBOM                         :mod:`trainer.image.sbom`
application/vnd.cyclonedx+json   CycloneDX 1.6 JSON SBOM                    :mod:`trainer.image.sbom`
application/vnd.in-toto+json     SLSA v1 provenance statement (unsigned)    :mod:`trainer.image.provenance`
application/vnd.dsse.envelope…   the same in a DSSE envelope (``--sign-key``)  :mod:`trainer.record.attest`
===============================  =========================================  ==========================

Provenance referrers carry the annotation ``in-toto.io/predicate-type`` (the statement's predicateType).
Reading checks every blob's sha256 and that a referrer's ``subject`` is this image's manifest.

What is bound to an image (:func:`bound`) is all of its layout's referrers or none: every referrer listed in
``index.json`` must read back (:func:`read`), there must be exactly one per artifactType and at most one
provenance (the signed and the unsigned type together count as one), else the layout is refused. So
:func:`find` (``trainer image sbom``, ``trainer image provenance``) and ``trainer verify IMAGE --key`` see the
same documents: an extra referrer inserted before or after the genuine one is refused, never picked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import UserError
from trainer.image import provenance, sbom
from trainer.image.oci import MT_MANIFEST, ImageRef, compact_json, digest_of, rfc3339
from trainer.image.provenance import INTOTO_MEDIA_TYPE
from trainer.inputs import decode, parse_json
from trainer.signing import sign

MT_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
MT_DSSE = "application/vnd.dsse.envelope.v1+json"
PREDICATE_ANNOTATION = "in-toto.io/predicate-type"
CREATED = "org.opencontainers.image.created"
TITLE = "org.opencontainers.image.title"
PROVENANCE_TYPES = (MT_DSSE, INTOTO_MEDIA_TYPE)  # one kind: an image carries at most one of them


@dataclass
class Document:
    """A document to attach: its ``artifact_type`` (= the layer's media type), ``data`` bytes, ``title`` (a
    file name for tools that save it) and ``annotations`` for the referrer manifest."""

    artifact_type: str
    data: bytes
    title: str
    annotations: dict[str, str] = field(default_factory=dict)


def referrer(doc: Document, subject: dict[str, Any], epoch: int) -> tuple[dict[str, Any], bytes, list[bytes]]:
    """The artifact manifest of ``doc`` for ``subject`` (the image manifest's descriptor): (its index
    descriptor, the manifest bytes, the blobs it needs: the empty config and the document)."""
    annotations = {CREATED: rfc3339(epoch), **doc.annotations}
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "artifactType": doc.artifact_type,
        "config": {"mediaType": MT_EMPTY, "digest": digest_of(EMPTY), "size": len(EMPTY)},
        "layers": [
            {
                "mediaType": doc.artifact_type,
                "digest": digest_of(doc.data),
                "size": len(doc.data),
                "annotations": {TITLE: doc.title},
            }
        ],
        "subject": {"mediaType": subject["mediaType"], "digest": subject["digest"], "size": subject["size"]},
        "annotations": dict(sorted(annotations.items())),
    }
    data = compact_json(manifest)
    descriptor = {
        "mediaType": MT_MANIFEST,
        "digest": digest_of(data),
        "size": len(data),
        "artifactType": doc.artifact_type,
        "annotations": dict(sorted(annotations.items())),
    }
    return descriptor, data, [EMPTY, doc.data]


def documents(
    lock: dict[str, Any],
    manifest_digest: str,
    revision: str,
    layers: list[tuple[str, str]],
    bundle_root: Path | None,
    signer=None,
) -> list[Document]:
    """The SBOMs and provenance of the image ``manifest_digest`` built from ``lock`` (in index order:
    SPDX, CycloneDX, provenance), whose layers are ``layers`` ((name, diff_id) as built: the SBOMs take the
    build steps' output sha256 from the ``build-<name>`` ones); the provenance is a DSSE envelope signed by
    ``signer`` when given (see :func:`trainer.signing.load_signer`), else the bare statement."""
    spdx = sbom.spdx_json(lock, manifest_digest, layers)  # the build-<name> layers: the build steps' outputs
    cdx = sbom.cyclonedx_json(lock, manifest_digest, layers)
    name = lock["name"]
    docs = [
        Document(sbom.SPDX_MEDIA_TYPE, spdx, f"{name}.spdx.json"),
        Document(sbom.CYCLONEDX_MEDIA_TYPE, cdx, f"{name}.cdx.json"),
    ]
    byproducts = [
        {"name": d.title, "mediaType": d.artifact_type, "digest": {"sha256": digest_of(d.data)[7:]}} for d in docs
    ]
    statement = provenance.statement(lock, manifest_digest, revision, layers, byproducts, bundle_root)
    data = provenance.to_bytes(statement)
    annotations = {PREDICATE_ANNOTATION: statement["predicateType"]}
    if signer is None:
        docs.append(Document(provenance.INTOTO_MEDIA_TYPE, data, f"{name}.provenance.json", annotations))
    else:
        docs.append(Document(MT_DSSE, sign(data, signer), f"{name}.provenance.dsse.json", annotations))
    return docs


def listed(image: ImageRef) -> list[dict[str, Any]]:
    """The index descriptors of ``image``'s layout that are referrers (they have an ``artifactType``), in
    index order; ``[]`` for a docker-archive."""
    return [d for d in (image.index or {}).get("manifests") or [] if isinstance(d, dict) and d.get("artifactType")]


def read(image: ImageRef, descriptor: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The manifest and document bytes of the referrer ``descriptor``; checks every digest, that it is an
    artifact manifest with one layer of its artifactType, and that its subject is ``image``'s manifest.
    Raises :class:`UserError` (one line naming the layout, the referrer and the digests) otherwise."""
    where = image.path
    if image.blob is None:  # a docker-archive: listed() finds no referrers in it
        raise UserError(f"{where}: a docker-archive has no referrers")
    digest = descriptor.get("digest")
    manifest_bytes = image.blob(digest)
    try:
        manifest = parse_json(decode(manifest_bytes, f"{where}: referrer {digest}"), f"{where}: referrer {digest}")
        subject = manifest.get("subject") or {}
        layers = manifest["layers"]
        layer = layers[0]
        if len(layers) != 1 or layer.get("mediaType") != manifest.get("artifactType"):
            raise ValueError
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise UserError(
            f"{where}: referrer {digest} ({descriptor.get('artifactType')}) is not an artifact manifest "
            "with one layer of its artifactType"
        ) from None
    if subject.get("digest") != image.manifest_digest:
        raise UserError(
            f"{where}: referrer {digest} ({descriptor.get('artifactType')}) has subject "
            f"{subject.get('digest')}, not this image's manifest {image.manifest_digest}"
        )
    if manifest.get("artifactType") != descriptor.get("artifactType"):
        raise UserError(
            f"{where}: referrer {digest}: artifactType {manifest.get('artifactType')!r} in the "
            f"manifest, {descriptor.get('artifactType')!r} in index.json"
        )
    return manifest, image.blob(layer.get("digest"))


class Attached(NamedTuple):
    """A referrer bound to an image: its index ``descriptor``, its ``manifest`` and its document ``data``."""

    descriptor: dict[str, Any]
    manifest: dict[str, Any]
    data: bytes


def bound(image: ImageRef) -> dict[str, Attached]:
    """artifactType -> :class:`Attached` for every referrer of ``image``'s layout (``{}`` for a docker-archive
    or a layout without referrers).

    Every referrer ``index.json`` lists must pass :func:`read` (blob digests, subject = this image's manifest);
    there must be exactly one per artifactType, and at most one provenance (:data:`PROVENANCE_TYPES`: a DSSE
    envelope and an unsigned statement both attached are refused). Raises :class:`UserError` (one line naming
    the layout, the artifactType and the digests) otherwise: a layout with an extra, duplicated or altered
    referrer binds nothing."""
    out: dict[str, Attached] = {}
    digests: dict[str, list[str]] = {}
    for descriptor in listed(image):
        manifest, data = read(image, descriptor)
        kind = descriptor["artifactType"]
        digests.setdefault(kind, []).append(str(descriptor.get("digest")))
        out.setdefault(kind, Attached(descriptor, manifest, data))
    for kind, found in digests.items():
        if len(found) > 1:
            raise UserError(
                f"{image.path}: index.json lists {len(found)} referrers of artifactType {kind} "
                f"({', '.join(found)}) for {image.manifest_digest}; exactly one is bound to an image"
            )
    provenances = [kind for kind in PROVENANCE_TYPES if kind in out]
    if len(provenances) > 1:
        both = ", ".join(f"{kind} {out[kind].descriptor.get('digest')}" for kind in provenances)
        raise UserError(
            f"{image.path}: index.json lists two provenance referrers ({both}) for "
            f"{image.manifest_digest}; at most one is bound to an image"
        )
    return out


def find(image: ImageRef, artifact_types: tuple[str, ...], predicate_type: str | None = None) -> tuple[str, bytes]:
    """(artifactType, document bytes) of the referrer of ``image`` bound to it (:func:`bound`) whose artifactType
    is one of ``artifact_types``; when ``predicate_type`` is given its ``in-toto.io/predicate-type`` annotation
    must be that.

    Raises :class:`UserError` (one line) when the layout's referrers fail :func:`bound`, when ``artifact_types``
    match more than one bound referrer or one with another predicate type, and when there is none (an image
    built before SBOMs were attached, or a docker-archive, which cannot hold referrers)."""
    attached = bound(image)
    hits = [kind for kind in artifact_types if kind in attached]
    if not hits:
        what = " or ".join(artifact_types)
        raise UserError(
            f"{image.path}: no referrer of type {what} for {image.manifest_digest or image.config_digest} "
            "(rebuild the image with this version of `trainer image build`)"
        )
    if len(hits) > 1:
        both = ", ".join(f"{kind} {attached[kind].descriptor.get('digest')}" for kind in hits)
        raise UserError(f"{image.path}: referrers {both} are both attached to {image.manifest_digest}; expected one")
    kind = hits[0]
    descriptor = attached[kind].descriptor
    annotated = (descriptor.get("annotations") or {}).get(PREDICATE_ANNOTATION)
    if predicate_type and annotated != predicate_type:
        raise UserError(
            f"{image.path}: referrer {descriptor.get('digest')} ({kind}) has predicate type {annotated!r}, "
            f"not {predicate_type}"
        )
    return kind, attached[kind].data
