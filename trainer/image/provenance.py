"""Build provenance of an image: an in-toto Statement v1 with a SLSA Provenance v1 predicate, deterministic.

Formats: in-toto Attestation Framework, Statement v1 (github.com/in-toto/attestation, spec/v1/statement.md)
and SLSA Provenance v1 (slsa.dev/spec/v1.0/provenance). Layout of what this bundle writes::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": LOCK_NAME, "digest": {"sha256": <image manifest digest, hex>}}],
     "predicateType": "https://slsa.dev/provenance/v1",
     "predicate": {
       "buildDefinition": {
         "buildType": PROJECT_URL + "/image-build/v1",
         "externalParameters": {"lock": {"path", "sha256"}, "revision": <the bundle's revision label>},
         "internalParameters": {"epoch", "layer_format", "platform"},
         "resolvedDependencies": [{"name", "uri"?, "digest": {"sha256"} | {"gitCommit"}, "annotations"?}, ...]},
       "runDetails": {
         "builder": {"id": PROJECT_URL + "/image-build@" + VERSION, "version": {PROJECT: VERSION}},
         "metadata": {},                         # no invocationId, no startedOn/finishedOn: same inputs, same bytes
         "byproducts": [{"name", "digest", "mediaType"}, ...]}}}   # the SBOMs and the layers built

``resolvedDependencies`` holds every input of the lock (:func:`trainer.image.sbom.inventory`: .debs, the
base image, wheels, sdists, git sources by commit and archive sha256), the build root the build steps ran in
(``build_root.debs`` and ``build_root.wheels`` not already listed as the image's, annotated ``buildRoot``) and
the bundle layer (``conf/``, the lock and the stamp, by diff_id). A build step's output is made by this build,
not resolved, so it is a byproduct: the layer ``build-<name>`` by diff_id, annotated with the step's purl
(``pkg:generic/NAME@VERSION``, as in the SBOMs) and the purl of its input. No descriptor has an empty
``digest`` (SLSA v1 ResourceDescriptor: at least one of uri, digest, content); one with neither a digest nor a
uri is left out.
The lock's ``path`` is relative to the bundle root when the lock lies under it, else its file name, so the
statement does not depend on where the checkout lives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer import PROJECT, PROJECT_URL, __version__
from trainer.image import sbom
from trainer.image.layerplan import LAYER_FORMAT

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = f"{PROJECT_URL}/image-build/v1"
BUILDER_ID = f"{PROJECT_URL}/image-build@{__version__}"
INTOTO_MEDIA_TYPE = "application/vnd.in-toto+json"


def lock_path_label(lock: dict[str, Any], bundle_root: Path | None) -> str:
    """The lock's path relative to ``bundle_root`` when under it, else its file name."""
    path = Path(lock["_path"]).absolute()
    if bundle_root is not None:
        try:
            return path.relative_to(Path(bundle_root).absolute()).as_posix()
        except ValueError:
            pass
    return path.name


def _descriptor(item: sbom.Item) -> dict[str, Any] | None:
    """The ResourceDescriptor of ``item`` (see :func:`resolved_dependencies`), None when it has neither a digest
    nor a uri."""
    digest: dict[str, str] = {}
    if item.sha256:
        digest["sha256"] = item.sha256
    if item.commit:
        digest["gitCommit"] = item.commit
    entry: dict[str, Any] = {"name": item.purl}
    if digest:
        entry["digest"] = digest
    if item.url:
        entry["uri"] = f"git+{item.url}@{item.commit}" if item.kind == "source" else item.url
    annotations: dict[str, str] = {}
    if item.tree:
        annotations["gitTree"] = item.tree
    if item.kind.startswith("build-root-"):
        annotations["buildRoot"] = "build_root.debs" if item.kind == "build-root-deb" else "build_root.wheels"
    if annotations:
        entry["annotations"] = annotations
    return entry if digest or item.url else None  # SLSA: a descriptor needs a uri or a digest


def resolved_dependencies(lock: dict[str, Any], outputs: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One SLSA ResourceDescriptor per input of ``lock``: ``name`` = its purl, ``uri`` = where it comes from,
    ``digest`` = its sha256 (and ``gitCommit`` for git sources); then each build-root package that is not
    also an input of the image. The native builds whose output ``outputs`` (step -> sha256 hex,
    :func:`trainer.image.sbom.build_outputs`) names were made by this build: they are byproducts, not here."""
    found = sbom.graph(lock, outputs)
    items = [i for i in found.items() if not (i.kind == "build" and i.name in (outputs or {}))]
    return [d for d in map(_descriptor, items) if d is not None]


def statement(
    lock: dict[str, Any],
    manifest_digest: str,
    revision: str,
    layers: list[tuple[str, str]],
    byproducts: list[dict[str, Any]],
    bundle_root: Path | None = None,
) -> dict[str, Any]:
    """The provenance statement of image ``manifest_digest`` (``sha256:<hex>``) built from ``lock`` at
    ``revision``; ``layers`` (name, diff_id) as built (each is a byproduct; a ``build-<name>`` layer is also
    that build step's output), ``byproducts`` SLSA ResourceDescriptors of the SBOMs."""
    bundle_layers = [
        {
            "name": f"layer {name}",
            "digest": {"sha256": diff_id.split(":", 1)[1]},
            "annotations": {"contents": "conf/, the lock and its stamp"},
        }
        for name, diff_id in layers
        if name == "bundle"
    ]
    outputs = sbom.build_outputs(layers)
    found = sbom.graph(lock, outputs)
    purls = {i.ref: i.purl for i in found.items()}
    steps = {s.name: s for s in found.steps}
    built = []
    for name, diff_id in layers:
        entry: dict[str, Any] = {
            "name": f"layer {name}",
            "digest": {"sha256": diff_id.split(":", 1)[1]},
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
        }
        step = steps.get(name[len("build-") :]) if name.startswith("build-") else None
        if step is not None:  # the output of a build step, named as the SBOMs name it
            entry["annotations"] = {
                "buildStep": step.name,
                "purl": purls[step.output],
                **({"builtFrom": purls[step.input]} if step.input in purls else {}),
            }
        built.append(entry)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": lock["name"], "digest": {"sha256": manifest_digest.split(":", 1)[1]}}],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "lock": {"path": lock_path_label(lock, bundle_root), "sha256": lock["_sha256"]},
                    "revision": revision,
                },
                "internalParameters": {
                    "epoch": lock["epoch"],
                    "platform": lock.get("platform", {}),
                    "layer_format": LAYER_FORMAT,
                },
                "resolvedDependencies": resolved_dependencies(lock, outputs) + bundle_layers,
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID, "version": {PROJECT: __version__}},
                "metadata": {},
                "byproducts": list(byproducts) + built,
            },
        },
    }


def to_bytes(obj: dict[str, Any]) -> bytes:
    """A statement's bytes: JSON, sorted keys, two-space indent, final newline (stable for hashing)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
