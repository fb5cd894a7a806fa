"""SBOMs of an image, from its lock: SPDX 2.3 JSON (``spdx-tools``) and CycloneDX 1.6 JSON (``cyclonedx-python-lib``).

One package per input the lock pins (:func:`inventory`): each .deb of a ``debian-rootfs`` base, an ``oci``
base image, each wheel, sdist, git source and native build, with its sha256 (where the lock has one) and a
package URL (purl spec, github.com/package-url/purl-spec):

    deb     pkg:deb/debian/NAME@VERSION?arch=ARCH&distro=SUITE
    wheel   pkg:pypi/NAME@VERSION?file_name=FILE[&repository_url=INDEX]   (repository_url only off PyPI)
    sdist   the same, with the sdist's file name
    source  pkg:github/OWNER/REPO@COMMIT for github.com URLs, else pkg:generic/NAME@COMMIT?vcs_url=git+URL@COMMIT
    build   pkg:generic/NAME@VERSION (a build step's output; VERSION = its source's commit or its sdist's version)
    base    pkg:oci/NAME@sha256:...?repository_url=REGISTRY/REPO&tag=TAG

Git sources also carry their git tree id as a SHA-1 checksum (git's content hash of the files, which the
builder recomputes from the files it unpacks), so a source pinned by commit and tree alone has one too.

A build step's output (``builds[]``: TE's torch extension, DeepEP, aws-ofi-nccl, antlr4) is known only once it
is built, so its sha256 is the diff_id of the image layer ``build-<name>`` (:func:`build_outputs`; the
uncompressed tar of exactly what the step installs, which is also that layer blob's digest, what the layer cache
records under the step's key and what ``bench/native_builds.py`` reproduces and ``trainer image check``
compares); without a layer, the sha256 the lock's entry may carry. The build root a step runs in
(``build_root.debs``, and the wheels of its ``wheels`` list from ``build_root.wheels`` or the image's
``wheels``) and the step's input are listed too
(:func:`graph`): a build-root package that is byte-identical (same sha256) to one of the image is that same
package; the others, and an sdist a step builds, are in no image layer.

And the image itself, ``pkg:oci/LOCK_NAME@sha256:<manifest digest>``, which CONTAINS every package in its
layers. How build steps are described, in each format's own terms:

    SPDX 2.3 (clause 11.1, relationship types): OUTPUT GENERATED_FROM INPUT (the source or sdist it builds),
             each build-root .deb and wheel BUILD_DEPENDENCY_OF OUTPUT; IMAGE CONTAINS only what is in the image.
    CycloneDX 1.6 (``formulation``: "how a component or service was manufactured"): one formula whose
             ``components`` are the packages used only to build (build-root .debs and wheels not in the
             image, built sdists) and one ``workflow`` per step (taskTypes ``build``; ``inputs``: the input,
             the build root's .debs and wheels, the step's env; ``outputs``: the built component; ``steps``:
             its command). ``metadata.component`` (the image) dependsOn the components in the image.

SPDX spelling: spdx-tools 0.8 writes ``referenceCategory`` as the Python enum name (``PACKAGE_MANAGER``), which
the SPDX 2.3 JSON schema refuses (2.3 spells it ``PACKAGE-MANAGER``; 2.3.1's schema takes both): the writer
here converts with spdx-tools and writes the 2.3 spelling, which spdx-tools' parser reads too.

Lock sections are read generically (:data:`SECTIONS`): a section a lock lacks contributes nothing, and a new
kind is one entry there.

Determinism: no clock and no random ids. The SPDX ``created`` time and the CycloneDX ``timestamp`` are the
lock's ``epoch`` (as apko uses SOURCE_DATE_EPOCH); the SPDX namespace and the CycloneDX serial number derive
from the manifest digest (a UUID 5); packages are sorted. Same lock and same image: same bytes.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

from trainer import PROJECT, PROJECT_URL, __version__
from trainer.errors import UserError
from trainer.lock.imagelock import canonical_name, wheel_items

SPDX_MEDIA_TYPE = "application/spdx+json"
CYCLONEDX_MEDIA_TYPE = "application/vnd.cyclonedx+json"
PYPI_HOSTS = ("files.pythonhosted.org", "pypi.org", "pypi.python.org")
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, PROJECT_URL)


@dataclass(frozen=True)
class Item:
    """One input of an image: ``kind`` (deb, wheel, sdist, source, build, base; build-root-deb and
    build-root-wheel for build-root packages that are not also the image's), ``name``, ``version`` (a commit
    for git sources, the manifest digest for a base image), ``purl``, ``sha256`` (hex of the artifact; for a
    build, of its output layer; None when the lock pins it otherwise, e.g. a git source by commit and tree
    only), ``url`` (where it comes from), ``ref`` (a stable id, ``kind:name``), ``filename``, ``commit`` and
    ``tree`` (git sources), ``download`` (an SPDX download location) and ``note`` (what the sha256 is, or
    where the package is used, when that is not plain)."""

    kind: str
    name: str
    version: str
    purl: str
    sha256: str | None = None
    url: str | None = None
    ref: str = ""
    filename: str | None = None
    commit: str | None = None
    tree: str | None = None
    download: str | None = None  # an SPDX download location (a URL or git+URL@commit)
    note: str | None = None


def _purl(
    type_: str, namespace: str | None, name: str, version: str | None, qualifiers: dict[str, str | None] | None = None
) -> str:
    from packageurl import PackageURL

    return PackageURL(type_, namespace, name, version, {k: v for k, v in (qualifiers or {}).items() if v}).to_string()


def _deb_items(
    debs: Iterable[dict[str, Any]], suite: str | None, kind: str = "deb", note: str | None = None
) -> list[Item]:
    return [
        Item(
            kind,
            d["name"],
            d["version"],
            _purl("deb", "debian", d["name"], d["version"], {"arch": d.get("architecture"), "distro": suite}),
            d.get("sha256"),
            d.get("url"),
            f"{kind}:{d['name']}",
            (d.get("url") or "").rsplit("/", 1)[-1] or None,
            download=d.get("url"),
            note=note,
        )
        for d in debs
    ]


def _debs(lock: dict[str, Any]) -> Iterable[Item]:
    base = lock.get("base") or {}
    if base.get("type") != "debian-rootfs":
        return []
    return _deb_items(base.get("debs") or [], base.get("suite"))


def _base_image(lock: dict[str, Any]) -> Iterable[Item]:
    base = lock.get("base") or {}
    if base.get("type") != "oci":
        return []
    reference, digest = base["reference"], base["digest"]
    repository = reference.split("@", 1)[0]
    tag = None
    if ":" in repository.rsplit("/", 1)[-1]:
        repository, tag = repository.rsplit(":", 1)
    if "/" not in repository or "." not in repository.split("/", 1)[0]:
        repository = "docker.io/" + (repository if "/" in repository else f"library/{repository}")
    name = repository.rsplit("/", 1)[-1]
    return [
        Item(
            "base",
            name,
            digest,
            _purl("oci", None, name, digest, {"repository_url": repository, "tag": tag}),
            digest.split(":", 1)[1],
            f"docker://{reference}",
            f"base:{name}",
        )
    ]


def _wheel_item(d: dict[str, Any], kind: str, note: str | None = None) -> Item:
    host = urlparse(d.get("url") or "").hostname or ""
    index = None if host in PYPI_HOSTS or not d.get("url") else d["url"].rsplit("/", 1)[0]
    name = canonical_name(d["name"])
    return Item(
        kind,
        name,
        d["version"],
        _purl("pypi", None, name, d["version"], {"file_name": d.get("filename"), "repository_url": index}),
        d.get("sha256"),
        d.get("url"),
        f"{kind}:{name}",
        d.get("filename"),
        download=d.get("url"),
        note=note,
    )


def _python(section: str) -> Callable[[dict[str, Any]], Iterable[Item]]:
    def items(lock: dict[str, Any]) -> Iterable[Item]:
        return [_wheel_item(d, section[:-1]) for d in lock.get(section) or []]

    return items


def _sources(lock: dict[str, Any]) -> Iterable[Item]:
    out = []
    for s in lock.get("sources") or []:
        url, commit = s["url"], s["commit"]
        parsed = urlparse(url)
        parts = [p for p in parsed.path.split("/") if p]
        vcs = f"git+{url}@{commit}"
        if parsed.hostname == "github.com" and len(parts) >= 2:
            purl = _purl("github", parts[0].lower(), parts[1].removesuffix(".git").lower(), commit)
        else:
            purl = _purl("generic", None, s["name"], commit, {"vcs_url": vcs})
        archive = s.get("archive") or {}
        out.append(
            Item(
                "source",
                s["name"],
                commit,
                purl,
                archive.get("sha256"),
                url,
                f"source:{s['name']}",
                archive.get("filename"),
                commit,
                s.get("tree"),
                download=vcs,
            )
        )
    return out


def _first_sha256(item: dict[str, Any]) -> str | None:
    """The sha256 of a native build's output, wherever the lock's ``builds[]`` entry keeps it."""
    for holder in (item, item.get("output"), item.get("artifact"), *(item.get("outputs") or [])[:1]):
        if isinstance(holder, dict) and re.fullmatch(r"[0-9a-f]{64}", str(holder.get("sha256", ""))):
            return holder["sha256"]
    return None


def _input_version(lock: dict[str, Any], spec: Any) -> str | None:
    """A build step's version from what it builds: its source's commit, or its sdist's version."""
    if not isinstance(spec, dict):
        return None
    if spec.get("source"):
        return next((s.get("commit") for s in lock.get("sources") or [] if s.get("name") == spec["source"]), None)
    if spec.get("sdist"):
        want = re.sub(r"[-_.]+", "-", str(spec["sdist"])).lower()
        return next(
            (
                s.get("version")
                for s in lock.get("sdists") or []
                if re.sub(r"[-_.]+", "-", str(s.get("name"))).lower() == want
            ),
            None,
        )
    return None


def build_outputs(layers: Iterable[tuple[str, str]] | None) -> dict[str, str]:
    """step name -> sha256 hex of its output: the diff_id of each ``build-<name>`` layer of ``layers``
    ((name, "sha256:<hex>") as built; the uncompressed layer tar of what the step installed, = its blob digest)."""
    return {
        name[len("build-") :]: diff_id.split(":", 1)[1]
        for name, diff_id in layers or []
        if name.startswith("build-") and ":" in diff_id
    }


def _builds(lock: dict[str, Any], outputs: dict[str, str] | None = None) -> Iterable[Item]:
    out = []
    for b in lock.get("builds") or []:
        if not isinstance(b, dict) or not b.get("name"):
            continue
        name = str(b["name"])
        built = (outputs or {}).get(name)
        sha = built or _first_sha256(b)
        version = b.get("version") or b.get("commit") or _input_version(lock, b.get("input"))
        version = str(version or (f"sha256:{sha}" if sha else "unknown"))
        note = (
            (
                f"sha256 = diff_id of the image layer build-{name} (the uncompressed tar of what build step {name} "
                "installed)"
            )
            if built
            else None
        )
        out.append(
            Item(
                "build",
                name,
                version,
                _purl("generic", None, name, version),
                sha,
                b.get("url"),
                f"build:{name}",
                b.get("filename"),
                note=note,
            )
        )
    return out


# lock section -> the items it contributes, bottom of the image first; a lock without a section has none of it
# (each is called with the lock; "builds" also with the build steps' outputs)
SECTIONS: dict[str, Callable[..., Iterable[Item]]] = {
    "base.debs": _debs,
    "base": _base_image,
    "wheels": _python("wheels"),
    "sdists": _python("sdists"),
    "sources": _sources,
    "builds": _builds,
}


def inventory(lock: dict[str, Any], outputs: dict[str, str] | None = None) -> list[Item]:
    """Every input of ``lock`` as :class:`Item`, in :data:`SECTIONS` order, sorted by name within a section;
    ``outputs`` (:func:`build_outputs`) gives each build step's output sha256."""
    items: list[Item] = []
    for section, collect in SECTIONS.items():
        found = collect(lock, outputs) if section == "builds" else collect(lock)
        items += sorted(found, key=lambda i: (i.name, i.version))
    return items


@dataclass(frozen=True)
class Step:
    """A build step as the SBOMs describe it: its ``name``; ``output``, the ref of its build :class:`Item`;
    ``input``, the ref of the source or sdist it builds; ``debs`` and ``wheels``, the refs of the packages its
    build root is made of (``build_root.debs``; its ``wheels`` as :func:`trainer.lock.imagelock.wheel_items`
    picks them); ``command``, ``env`` and ``install`` (``tree`` or ``wheel``) as the lock has them."""

    name: str
    output: str
    input: str | None
    debs: tuple[str, ...]
    wheels: tuple[str, ...]
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    install: str


@dataclass(frozen=True)
class Graph:
    """What the SBOMs of an image describe (:func:`graph`): ``contained``, the packages in the image's layers;
    ``transient``, those only its build steps used (build-root packages that are not also the image's, the
    sdists a step builds); ``steps``, one :class:`Step` per ``builds[]`` step."""

    contained: list[Item]
    transient: list[Item]
    steps: list[Step]

    def items(self) -> list[Item]:
        """``contained`` then ``transient``."""
        return self.contained + self.transient


def graph(lock: dict[str, Any], outputs: dict[str, str] | None = None) -> Graph:
    """The packages of the image built from ``lock`` (:func:`inventory`, builds with ``outputs``), the build
    root its steps ran in and the steps themselves (see :class:`Graph`). A build-root .deb or wheel with the
    sha256 of one of the image's .debs or wheels is that package (one entry, two roles)."""

    items = inventory(lock, outputs)
    steps_in = [
        b
        for b in lock.get("builds") or []
        if isinstance(b, dict) and b.get("name") and isinstance(b.get("input"), dict)
    ]
    built_sdists = {f"sdist:{canonical_name(str(b['input']['sdist']))}" for b in steps_in if b["input"].get("sdist")}
    contained = [i for i in items if i.ref not in built_sdists]
    transient = [i for i in items if i.ref in built_sdists]
    by_sha: dict[tuple[str, str | None], str] = {
        (i.kind, i.sha256): i.ref for i in items if i.kind in ("deb", "wheel") and i.sha256
    }
    root = lock.get("build_root") or {}
    names = ", ".join(str(b["name"]) for b in steps_in) or "none"
    deb_refs: list[str] = []
    for item in _deb_items(
        root.get("debs") or [],
        root.get("suite"),
        "build-root-deb",
        f"build_root.debs: in the build root of steps {names}, not in the image",
    ):
        ref = by_sha.get(("deb", item.sha256))
        if ref is None:
            transient.append(item)
            ref = item.ref
        deb_refs.append(ref)
    wheel_refs: dict[str, str] = {}  # sha256 -> ref, for the wheels of the steps' build roots
    for w in root.get("wheels") or []:
        item = _wheel_item(
            w, "build-root-wheel", "build_root.wheels: in the build root of the steps that name it, not in the image"
        )
        ref = by_sha.get(("wheel", item.sha256))
        if ref is None:
            transient.append(item)
            ref = item.ref
        wheel_refs[str(item.sha256)] = ref
    steps = []
    for b in steps_in:
        spec = b["input"]
        source = (
            f"source:{spec['source']}"
            if spec.get("source")
            else (f"sdist:{canonical_name(str(spec['sdist']))}" if spec.get("sdist") else None)
        )
        wheels = [
            wheel_refs.get(w["sha256"]) or by_sha.get(("wheel", w["sha256"])) or f"wheel:{canonical_name(w['name'])}"
            for w in wheel_items(lock, b.get("wheels") or [], str(b["name"]))
        ]
        steps.append(
            Step(
                str(b["name"]),
                f"build:{b['name']}",
                source,
                tuple(dict.fromkeys(deb_refs)),
                tuple(dict.fromkeys(wheels)),
                tuple(b.get("command") or ()),
                tuple(sorted((b.get("env") or {}).items())),
                str((b.get("install") or {}).get("type", "")),
            )
        )
    order = {"sdist": 0, "build-root-deb": 1, "build-root-wheel": 2}
    transient.sort(key=lambda i: (order.get(i.kind, 3), i.name, i.version))
    return Graph(contained, transient, steps)


def image_purl(lock: dict[str, Any], manifest_digest: str) -> str:
    """``pkg:oci/NAME@sha256:...?arch=ARCH`` of the image built from ``lock`` with ``manifest_digest``."""
    arch = (lock.get("platform") or {}).get("architecture", "amd64")
    return _purl("oci", None, lock["name"], manifest_digest, {"arch": arch})


def _epoch(lock: dict[str, Any]) -> datetime:
    return datetime.fromtimestamp(int(lock["epoch"]), tz=UTC)


def _serial(manifest_digest: str, kind: str) -> uuid.UUID:
    return uuid.uuid5(NAMESPACE, f"{kind}:{manifest_digest}")


def _spdx_id(kind: str, name: str, seen: dict[str, int]) -> str:
    base = "SPDXRef-" + re.sub(r"[^A-Za-z0-9.-]+", "-", f"{kind}-{name}")
    seen[base] = seen.get(base, 0) + 1
    return base if seen[base] == 1 else f"{base}-{seen[base]}"


def _spdx_checksums(item: Item, Checksum, ChecksumAlgorithm) -> list:
    """SHA256 of the artifact; for a git source also SHA1 = its git tree id (git's hash of the files, which the
    builder recomputes from what it unpacked), so a source pinned by commit and tree alone has a checksum."""
    out = [Checksum(ChecksumAlgorithm.SHA256, item.sha256)] if item.sha256 else []
    if item.tree:
        out.append(Checksum(ChecksumAlgorithm.SHA1, item.tree))
    return out


def _spdx_23(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (spdx-tools' JSON conversion) with each ``externalRefs[].referenceCategory`` spelt as the SPDX 2.3
    JSON schema has it (``PACKAGE-MANAGER``, ``PERSISTENT-ID``; spdx-tools writes the enum names)."""
    for package in data.get("packages") or []:
        for ref in package.get("externalRefs") or []:
            ref["referenceCategory"] = str(ref["referenceCategory"]).replace("_", "-")
    return data


def spdx_json(lock: dict[str, Any], manifest_digest: str, layers: Iterable[tuple[str, str]] | None = None) -> bytes:
    """The SPDX 2.3 JSON SBOM of the image ``manifest_digest`` built from ``lock``, whose layers (name, diff_id)
    are ``layers`` (they give the build steps' output sha256, :func:`build_outputs`). Built with spdx-tools'
    model, validated by spdx-tools before it is written; relationships as the module docstring says. Raises
    :class:`UserError` if it does not validate."""
    from spdx_tools.spdx.jsonschema.document_converter import DocumentConverter
    from spdx_tools.spdx.model import (
        Actor,
        ActorType,
        Checksum,
        ChecksumAlgorithm,
        CreationInfo,
        Document,
        ExternalPackageRef,
        ExternalPackageRefCategory,
        Package,
        PackagePurpose,
        Relationship,
        RelationshipType,
        SpdxNoAssertion,
    )
    from spdx_tools.spdx.validation.uri_validators import validate_download_location
    from spdx_tools.spdx.writer.write_utils import convert, validate_and_deduplicate

    hex_digest = manifest_digest.split(":", 1)[1]
    created = _epoch(lock).replace(tzinfo=None)
    info = CreationInfo(
        spdx_version="SPDX-2.3",
        spdx_id="SPDXRef-DOCUMENT",
        name=f"{lock['name']}@{manifest_digest}",
        document_namespace=f"{PROJECT_URL}/spdx/{lock['name']}-{_serial(manifest_digest, 'spdx')}",
        creators=[Actor(ActorType.TOOL, f"{PROJECT}-{__version__}")],
        created=created,
        data_license="CC0-1.0",
    )
    no = SpdxNoAssertion

    def purl_ref(purl: str) -> ExternalPackageRef:
        return ExternalPackageRef(ExternalPackageRefCategory.PACKAGE_MANAGER, "purl", purl)

    image_id = "SPDXRef-image"
    packages = [
        Package(
            spdx_id=image_id,
            name=lock["name"],
            download_location=no(),
            version=manifest_digest,
            files_analyzed=False,
            checksums=[Checksum(ChecksumAlgorithm.SHA256, hex_digest)],
            external_references=[purl_ref(image_purl(lock, manifest_digest))],
            license_concluded=no(),
            license_declared=no(),
            copyright_text=no(),
            primary_package_purpose=PackagePurpose.CONTAINER,
            supplier=no(),
        )
    ]
    relationships = [Relationship("SPDXRef-DOCUMENT", RelationshipType.DESCRIBES, image_id)]
    seen: dict[str, int] = {}
    ids: dict[str, str] = {}
    purposes = {
        "base": PackagePurpose.CONTAINER,
        "source": PackagePurpose.SOURCE,
        "sdist": PackagePurpose.SOURCE,
        "build": PackagePurpose.LIBRARY,
    }
    found = graph(lock, build_outputs(layers))
    contained = {i.ref for i in found.contained}
    for item in found.items():
        spdx_id = ids[item.ref] = _spdx_id(item.kind, item.name, seen)
        download = item.download if item.download and not validate_download_location(item.download) else None
        source_info = None
        if item.kind == "source":
            source_info = f"git commit {item.commit} tree {item.tree} from {item.url}"
        elif download is None and item.url:
            source_info = f"from {item.url}"
        section = {"build-root-deb": "build_root.debs", "build-root-wheel": "build_root.wheels"}.get(
            item.kind, item.kind
        )
        packages.append(
            Package(
                spdx_id=spdx_id,
                name=item.name,
                version=item.version,
                file_name=item.filename,
                download_location=download or no(),
                files_analyzed=False,
                checksums=_spdx_checksums(item, Checksum, ChecksumAlgorithm),
                external_references=[purl_ref(item.purl)],
                source_info=source_info,
                comment=f"{PROJECT} lock: {section}" + (f"; {item.note}" if item.note else ""),
                license_concluded=no(),
                license_declared=no(),
                copyright_text=no(),
                supplier=no(),
                primary_package_purpose=purposes.get(item.kind, PackagePurpose.LIBRARY),
            )
        )
        if item.ref in contained:
            relationships.append(Relationship(image_id, RelationshipType.CONTAINS, spdx_id))
    for step in found.steps:  # SPDX 2.3 clause 11.1: GENERATED_FROM, BUILD_DEPENDENCY_OF
        output = ids[step.output]
        if step.input in ids:
            relationships.append(
                Relationship(
                    output,
                    RelationshipType.GENERATED_FROM,
                    ids[step.input],
                    comment=f"build step {step.name}: its input",
                )
            )
        for ref in step.debs + step.wheels:
            relationships.append(Relationship(ids[ref], RelationshipType.BUILD_DEPENDENCY_OF, output))
    document = Document(creation_info=info, packages=packages, relationships=relationships)
    try:
        document = validate_and_deduplicate(document, validate=True, drop_duplicates=True)
    except ValueError as ex:
        raise UserError(
            f"lock {lock['name']}: its SPDX SBOM does not validate ({' '.join(str(ex).split())[:400]})"
        ) from None
    return (json.dumps(_spdx_23(convert(document, DocumentConverter())), indent=4) + "\n").encode()


def _cdx_formula(found: Graph) -> dict[str, Any] | None:
    """The CycloneDX 1.6 ``formulation`` entry of ``found``'s build steps (without its ``components``, which the
    caller moves there), or None when the lock has no steps."""
    if not found.steps:
        return None
    workflows = []
    for step in found.steps:
        inputs: list[dict[str, Any]] = [
            {"resource": {"ref": ref}}
            for ref in dict.fromkeys(([step.input] if step.input else []) + list(step.debs) + list(step.wheels))
        ]
        if step.env:
            inputs.append({"environmentVars": [{"name": k, "value": v} for k, v in step.env]})
        workflows.append(
            {
                "bom-ref": f"build-step:{step.name}",
                "uid": f"build-{step.name}",
                "name": f"build step {step.name}",
                "description": f"runs in a bubblewrap build root made only of the lock's build_root (no network); its "
                f"output is the image layer build-{step.name}, installed as a {step.install}",
                "taskTypes": ["build"],
                "inputs": inputs,
                "outputs": [{"type": "artifact", "resource": {"ref": step.output}}],
                "steps": [{"name": step.name, "commands": [{"executed": shlex.join(step.command)}]}],
            }
        )
    return {"bom-ref": "formula:build-steps", "workflows": workflows}


def cyclonedx_json(
    lock: dict[str, Any], manifest_digest: str, layers: Iterable[tuple[str, str]] | None = None
) -> bytes:
    """The CycloneDX 1.6 JSON SBOM of the image ``manifest_digest`` built from ``lock`` (layers as for
    :func:`spdx_json`), written by cyclonedx-python-lib; the ``formulation`` of the build steps (which that
    library does not model) is added to its output, see the module docstring."""
    from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, XsUri
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.tool import ToolRepository
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    def hashes(hex_: str | None, tree: str | None = None) -> list[HashType]:
        out = [HashType(alg=HashAlgorithm.SHA_256, content=hex_)] if hex_ else []
        return out + ([HashType(alg=HashAlgorithm.SHA_1, content=tree)] if tree else [])  # a git tree id

    image = Component(
        name=lock["name"],
        version=manifest_digest,
        type=ComponentType.CONTAINER,
        bom_ref="image",
        purl=PackageURL.from_string(image_purl(lock, manifest_digest)),
        hashes=hashes(manifest_digest.split(":", 1)[1]),
    )
    kinds = {"base": ComponentType.CONTAINER, "build": ComponentType.LIBRARY}
    found = graph(lock, build_outputs(layers))
    components, contained = [], []
    inside = {i.ref for i in found.contained}
    for item in found.items():
        refs = []
        if item.kind == "source" and item.url:
            refs.append(
                ExternalReference(
                    type=ExternalReferenceType.VCS,
                    url=XsUri(item.url),
                    comment=f"commit {item.commit} tree {item.tree}",
                )
            )
        elif item.url and re.match(r"^[a-z]+://", item.url) and not item.url.startswith("docker://"):
            refs.append(ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(item.url)))
        component = Component(
            name=item.name,
            version=item.version,
            type=kinds.get(item.kind, ComponentType.LIBRARY),
            bom_ref=item.ref,
            purl=PackageURL.from_string(item.purl),
            hashes=hashes(item.sha256, item.tree),
            external_references=refs,
            description=item.note,
        )
        components.append(component)
        if item.ref in inside:
            contained.append(component)
    tools = ToolRepository(components=[Component(name=PROJECT, version=__version__, type=ComponentType.APPLICATION)])
    bom = Bom(
        components=components,
        serial_number=_serial(manifest_digest, "cyclonedx"),
        metadata=BomMetaData(component=image, timestamp=_epoch(lock), tools=tools),
    )
    bom.register_dependency(image, contained)
    doc = json.loads(JsonV1Dot6(bom).output_as_string(indent=2))
    formula = _cdx_formula(found)
    transient = {i.ref for i in found.transient}
    if formula is not None or transient:
        moved = [c for c in doc.get("components", []) if c.get("bom-ref") in transient]
        doc["components"] = [c for c in doc.get("components", []) if c.get("bom-ref") not in transient]
        doc["dependencies"] = [d for d in doc.get("dependencies", []) if d.get("ref") not in transient]
        formula = formula or {"bom-ref": "formula:build-steps"}
        if moved:
            formula["components"] = moved
        doc["formulation"] = [formula]
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def validate_spdx(data: bytes, where: str) -> None:
    """Parse ``data`` with spdx-tools' JSON parser and run its full SPDX 2.3 validation.

    Raises :class:`UserError` naming ``where`` and the first problem."""
    from spdx_tools.spdx.parser.error import SPDXParsingError
    from spdx_tools.spdx.parser.jsonlikedict.json_like_dict_parser import JsonLikeDictParser
    from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

    try:
        document = JsonLikeDictParser().parse(json.loads(data))
    except (
        SPDXParsingError,
        json.JSONDecodeError,
        UnicodeDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as ex:
        message = "; ".join(ex.get_messages()) if isinstance(ex, SPDXParsingError) else str(ex)
        raise UserError(f"{where}: not a valid SPDX 2.3 JSON document ({' '.join(message.split())[:300]})") from None
    problems = validate_full_spdx_document(document, "SPDX-2.3")
    if problems:
        raise UserError(f"{where}: SPDX validation: {problems[0].validation_message}")


def validate_cyclonedx(data: bytes, where: str) -> None:
    """Validate ``data`` against the CycloneDX 1.6 JSON schema (strict) shipped with cyclonedx-python-lib.

    Raises :class:`UserError` naming ``where`` and the first problem."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    try:
        text = data.decode()
        json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as ex:
        raise UserError(f"{where}: not valid JSON ({ex})") from None
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if error is not None:
        raise UserError(f"{where}: CycloneDX 1.6 schema: {' '.join(str(error).split())[:300]}")


def packages_of_spdx(data: bytes) -> dict[str, dict[str, str | None]]:
    """The packages of an SPDX JSON SBOM keyed by purl without version and qualifiers (``pkg:pypi/six``;
    ``build-root:pkg:deb/debian/gcc-12`` for a build-root package that is not also the image's, whose name may
    be the image's at another version): ``{"version", "sha256", "purl"}``; for comparing two images' SBOMs."""
    from packageurl import PackageURL

    doc = json.loads(data)
    out: dict[str, dict[str, str | None]] = {}
    for pkg in doc.get("packages") or []:
        purls = [r["referenceLocator"] for r in pkg.get("externalRefs") or [] if r.get("referenceType") == "purl"]
        if not purls or pkg.get("SPDXID") == "SPDXRef-image":
            continue
        p = PackageURL.from_string(purls[0])
        key = PackageURL(p.type, p.namespace, p.name).to_string()
        if str(pkg.get("SPDXID", "")).startswith("SPDXRef-build-root-"):
            key = f"build-root:{key}"
        sha = next((c["checksumValue"] for c in pkg.get("checksums") or [] if c.get("algorithm") == "SHA256"), None)
        out[key] = {"version": pkg.get("versionInfo"), "sha256": sha, "purl": purls[0]}
    return out
