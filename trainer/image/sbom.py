"""SBOMs of an image, from its lock: SPDX 2.3 JSON (``spdx-tools``) and CycloneDX 1.6 JSON (``cyclonedx-python-lib``).

One package per input the lock pins (:func:`inventory`): each .deb of a ``debian-rootfs`` base, an ``oci``
base image, each wheel, sdist, git source and native build, with its sha256 (where the lock has one) and a
package URL (purl spec, github.com/package-url/purl-spec):

    deb     pkg:deb/debian/NAME@VERSION?arch=ARCH&distro=SUITE
    wheel   pkg:pypi/NAME@VERSION?file_name=FILE[&repository_url=INDEX]   (repository_url only off PyPI)
    sdist   the same, with the sdist's file name
    source  pkg:github/OWNER/REPO@COMMIT for github.com URLs, else pkg:generic/NAME@COMMIT?vcs_url=git+URL@COMMIT
    build   pkg:generic/NAME@VERSION (a native build's output, sha256 of the built artifact)
    base    pkg:oci/NAME@sha256:...?repository_url=REGISTRY/REPO&tag=TAG

Git sources also carry their git tree id as a SHA-1 checksum (git's content hash of the files, which the
builder recomputes from the files it unpacks), so a source pinned by commit and tree alone has one too.
And the image itself, ``pkg:oci/LOCK_NAME@sha256:<manifest digest>``, which CONTAINS every package (SPDX
relationships; CycloneDX ``metadata.component`` and ``dependencies``). Lock sections are read generically
(:data:`SECTIONS`): a section a lock lacks contributes nothing, and a new kind is one entry there.

Determinism: no clock and no random ids. The SPDX ``created`` time and the CycloneDX ``timestamp`` are the
lock's ``epoch`` (as apko uses SOURCE_DATE_EPOCH); the SPDX namespace and the CycloneDX serial number derive
from the manifest digest (a UUID 5); packages are sorted. Same lock and same image: same bytes.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterable, List, Optional
from urllib.parse import urlparse

from trainer import PROJECT, PROJECT_URL, __version__
from trainer.errors import UserError

SPDX_MEDIA_TYPE = "application/spdx+json"
CYCLONEDX_MEDIA_TYPE = "application/vnd.cyclonedx+json"
PYPI_HOSTS = ("files.pythonhosted.org", "pypi.org", "pypi.python.org")
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, PROJECT_URL)


@dataclass(frozen=True)
class Item:
    """One input of an image: ``kind`` (deb, wheel, sdist, source, build, base), ``name``, ``version`` (a
    commit for git sources, the manifest digest for a base image), ``purl``, ``sha256`` (hex of the artifact;
    None when the lock pins it otherwise, e.g. a git source by commit and tree only), ``url`` (where it comes
    from), ``ref`` (a stable id, ``kind:name``), ``filename``, ``commit`` and ``tree`` (git sources)."""

    kind: str
    name: str
    version: str
    purl: str
    sha256: Optional[str] = None
    url: Optional[str] = None
    ref: str = ""
    filename: Optional[str] = None
    commit: Optional[str] = None
    tree: Optional[str] = None
    download: Optional[str] = None  # an SPDX download location (a URL or git+URL@commit)


def _purl(type_: str, namespace: Optional[str], name: str, version: Optional[str],
          qualifiers: Optional[Dict[str, str]] = None) -> str:
    from packageurl import PackageURL

    return PackageURL(type_, namespace, name, version, {k: v for k, v in (qualifiers or {}).items() if v}).to_string()


def _debs(lock: Dict[str, Any]) -> Iterable[Item]:
    base = lock.get("base") or {}
    if base.get("type") != "debian-rootfs":
        return []
    suite = base.get("suite")
    return [Item("deb", d["name"], d["version"],
                 _purl("deb", "debian", d["name"], d["version"], {"arch": d.get("architecture"), "distro": suite}),
                 d.get("sha256"), d.get("url"), f"deb:{d['name']}", (d.get("url") or "").rsplit("/", 1)[-1] or None,
                 download=d.get("url")) for d in base.get("debs") or []]


def _base_image(lock: Dict[str, Any]) -> Iterable[Item]:
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
    return [Item("base", name, digest, _purl("oci", None, name, digest, {"repository_url": repository, "tag": tag}),
                 digest.split(":", 1)[1], f"docker://{reference}", f"base:{name}")]


def _python(section: str) -> Callable[[Dict[str, Any]], Iterable[Item]]:
    def items(lock: Dict[str, Any]) -> Iterable[Item]:
        from trainer.image.imagelock import canonical_name

        out = []
        for d in lock.get(section) or []:
            host = urlparse(d.get("url") or "").hostname or ""
            index = None if host in PYPI_HOSTS or not d.get("url") else d["url"].rsplit("/", 1)[0]
            name = canonical_name(d["name"])
            out.append(Item(section[:-1], name, d["version"],
                            _purl("pypi", None, name, d["version"], {"file_name": d.get("filename"), "repository_url": index}),
                            d.get("sha256"), d.get("url"), f"{section[:-1]}:{name}", d.get("filename"), download=d.get("url")))
        return out
    return items


def _sources(lock: Dict[str, Any]) -> Iterable[Item]:
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
        out.append(Item("source", s["name"], commit, purl, archive.get("sha256"), url, f"source:{s['name']}",
                        archive.get("filename"), commit, s.get("tree"), download=vcs))
    return out


def _first_sha256(item: Dict[str, Any]) -> Optional[str]:
    """The sha256 of a native build's output, wherever the lock's ``builds[]`` entry keeps it."""
    for holder in (item, item.get("output"), item.get("artifact"), *(item.get("outputs") or [])[:1]):
        if isinstance(holder, dict) and re.fullmatch(r"[0-9a-f]{64}", str(holder.get("sha256", ""))):
            return holder["sha256"]
    return None


def _input_version(lock: Dict[str, Any], spec: Any) -> Optional[str]:
    """A build step's version from what it builds: its source's commit, or its sdist's version."""
    if not isinstance(spec, dict):
        return None
    if spec.get("source"):
        return next((s.get("commit") for s in lock.get("sources") or [] if s.get("name") == spec["source"]), None)
    if spec.get("sdist"):
        want = re.sub(r"[-_.]+", "-", str(spec["sdist"])).lower()
        return next((s.get("version") for s in lock.get("sdists") or []
                     if re.sub(r"[-_.]+", "-", str(s.get("name"))).lower() == want), None)
    return None


def _builds(lock: Dict[str, Any]) -> Iterable[Item]:
    out = []
    for b in lock.get("builds") or []:
        if not isinstance(b, dict) or not b.get("name"):
            continue
        sha = _first_sha256(b)
        version = b.get("version") or b.get("commit") or _input_version(lock, b.get("input"))
        version = str(version or (f"sha256:{sha}" if sha else "unknown"))
        out.append(Item("build", str(b["name"]), version, _purl("generic", None, str(b["name"]), version),
                        sha, b.get("url"), f"build:{b['name']}", b.get("filename")))
    return out


# lock section -> the items it contributes, bottom of the image first; a lock without a section has none of it
SECTIONS: Dict[str, Callable[[Dict[str, Any]], Iterable[Item]]] = {
    "base.debs": _debs,
    "base": _base_image,
    "wheels": _python("wheels"),
    "sdists": _python("sdists"),
    "sources": _sources,
    "builds": _builds,
}


def inventory(lock: Dict[str, Any]) -> List[Item]:
    """Every input of ``lock`` as :class:`Item`, in :data:`SECTIONS` order, sorted by name within a section."""
    items: List[Item] = []
    for collect in SECTIONS.values():
        items += sorted(collect(lock), key=lambda i: (i.name, i.version))
    return items


def image_purl(lock: Dict[str, Any], manifest_digest: str) -> str:
    """``pkg:oci/NAME@sha256:...?arch=ARCH`` of the image built from ``lock`` with ``manifest_digest``."""
    arch = (lock.get("platform") or {}).get("architecture", "amd64")
    return _purl("oci", None, lock["name"], manifest_digest, {"arch": arch})


def _epoch(lock: Dict[str, Any]) -> datetime:
    return datetime.fromtimestamp(int(lock["epoch"]), tz=timezone.utc)


def _serial(manifest_digest: str, kind: str) -> uuid.UUID:
    return uuid.uuid5(NAMESPACE, f"{kind}:{manifest_digest}")


def _spdx_id(kind: str, name: str, seen: Dict[str, int]) -> str:
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


def spdx_json(lock: Dict[str, Any], manifest_digest: str) -> bytes:
    """The SPDX 2.3 JSON SBOM of the image ``manifest_digest`` built from ``lock`` (written by spdx-tools,
    which validates the document before it writes it). Raises :class:`UserError` if it does not validate."""
    from spdx_tools.spdx.model import (Actor, ActorType, Checksum, ChecksumAlgorithm, CreationInfo, Document,
                                       ExternalPackageRef, ExternalPackageRefCategory, Package, PackagePurpose,
                                       Relationship, RelationshipType, SpdxNoAssertion)
    from spdx_tools.spdx.validation.uri_validators import validate_download_location
    from spdx_tools.spdx.writer.json.json_writer import write_document_to_stream

    hex_digest = manifest_digest.split(":", 1)[1]
    created = _epoch(lock).replace(tzinfo=None)
    info = CreationInfo(spdx_version="SPDX-2.3", spdx_id="SPDXRef-DOCUMENT", name=f"{lock['name']}@{manifest_digest}",
                        document_namespace=f"{PROJECT_URL}/spdx/{lock['name']}-{_serial(manifest_digest, 'spdx')}",
                        creators=[Actor(ActorType.TOOL, f"{PROJECT}-{__version__}")], created=created,
                        data_license="CC0-1.0")
    no = SpdxNoAssertion

    def purl_ref(purl: str) -> ExternalPackageRef:
        return ExternalPackageRef(ExternalPackageRefCategory.PACKAGE_MANAGER, "purl", purl)

    image_id = "SPDXRef-image"
    packages = [Package(spdx_id=image_id, name=lock["name"], download_location=no(), version=manifest_digest,
                        files_analyzed=False, checksums=[Checksum(ChecksumAlgorithm.SHA256, hex_digest)],
                        external_references=[purl_ref(image_purl(lock, manifest_digest))],
                        license_concluded=no(), license_declared=no(), copyright_text=no(),
                        primary_package_purpose=PackagePurpose.CONTAINER, supplier=no())]
    relationships = [Relationship("SPDXRef-DOCUMENT", RelationshipType.DESCRIBES, image_id)]
    seen: Dict[str, int] = {}
    purposes = {"base": PackagePurpose.CONTAINER, "source": PackagePurpose.SOURCE, "sdist": PackagePurpose.SOURCE,
                "build": PackagePurpose.LIBRARY}
    for item in inventory(lock):
        spdx_id = _spdx_id(item.kind, item.name, seen)
        download = item.download if item.download and not validate_download_location(item.download) else None
        source_info = None
        if item.kind == "source":
            source_info = f"git commit {item.commit} tree {item.tree} from {item.url}"
        elif download is None and item.url:
            source_info = f"from {item.url}"
        packages.append(Package(
            spdx_id=spdx_id, name=item.name, version=item.version, file_name=item.filename,
            download_location=download or no(), files_analyzed=False,
            checksums=_spdx_checksums(item, Checksum, ChecksumAlgorithm),
            external_references=[purl_ref(item.purl)], source_info=source_info, comment=f"{PROJECT} lock: {item.kind}",
            license_concluded=no(), license_declared=no(), copyright_text=no(), supplier=no(),
            primary_package_purpose=purposes.get(item.kind, PackagePurpose.LIBRARY)))
        relationships.append(Relationship(image_id, RelationshipType.CONTAINS, spdx_id))
    document = Document(creation_info=info, packages=packages, relationships=relationships)
    stream = io.StringIO()
    try:
        write_document_to_stream(document, stream, validate=True)
    except ValueError as ex:
        raise UserError(f"lock {lock['name']}: its SPDX SBOM does not validate ({' '.join(str(ex).split())[:400]})") from None
    return (stream.getvalue() + "\n").encode()


def cyclonedx_json(lock: Dict[str, Any], manifest_digest: str) -> bytes:
    """The CycloneDX 1.6 JSON SBOM of the image ``manifest_digest`` built from ``lock`` (written by
    cyclonedx-python-lib)."""
    from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, XsUri
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.tool import ToolRepository
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    def hashes(hex_: Optional[str], tree: Optional[str] = None) -> List[HashType]:
        out = [HashType(alg=HashAlgorithm.SHA_256, content=hex_)] if hex_ else []
        return out + ([HashType(alg=HashAlgorithm.SHA_1, content=tree)] if tree else [])  # a git tree id

    image = Component(name=lock["name"], version=manifest_digest, type=ComponentType.CONTAINER, bom_ref="image",
                      purl=PackageURL.from_string(image_purl(lock, manifest_digest)),
                      hashes=hashes(manifest_digest.split(":", 1)[1]))
    kinds = {"base": ComponentType.CONTAINER, "build": ComponentType.LIBRARY}
    components = []
    for item in inventory(lock):
        refs = []
        if item.kind == "source" and item.url:
            refs.append(ExternalReference(type=ExternalReferenceType.VCS, url=XsUri(item.url),
                                          comment=f"commit {item.commit} tree {item.tree}"))
        elif item.url and re.match(r"^[a-z]+://", item.url) and not item.url.startswith("docker://"):
            refs.append(ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(item.url)))
        components.append(Component(name=item.name, version=item.version, type=kinds.get(item.kind, ComponentType.LIBRARY),
                                    bom_ref=item.ref, purl=PackageURL.from_string(item.purl), hashes=hashes(item.sha256, item.tree),
                                    external_references=refs))
    tools = ToolRepository(components=[Component(name=PROJECT, version=__version__, type=ComponentType.APPLICATION)])
    bom = Bom(components=components, serial_number=_serial(manifest_digest, "cyclonedx"),
              metadata=BomMetaData(component=image, timestamp=_epoch(lock), tools=tools))
    bom.register_dependency(image, components)
    text = JsonV1Dot6(bom).output_as_string(indent=2)
    return (json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n").encode()


def validate_spdx(data: bytes, where: str) -> None:
    """Parse ``data`` with spdx-tools' JSON parser and run its full SPDX 2.3 validation.

    Raises :class:`UserError` naming ``where`` and the first problem."""
    from spdx_tools.spdx.parser.error import SPDXParsingError
    from spdx_tools.spdx.parser.jsonlikedict.json_like_dict_parser import JsonLikeDictParser
    from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

    try:
        document = JsonLikeDictParser().parse(json.loads(data))
    except (SPDXParsingError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
            AttributeError) as ex:
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


def packages_of_spdx(data: bytes) -> Dict[str, Dict[str, Optional[str]]]:
    """The packages of an SPDX JSON SBOM keyed by purl without version and qualifiers (``pkg:pypi/six``):
    ``{"version", "sha256", "purl"}``; for comparing two images' SBOMs."""
    from packageurl import PackageURL

    doc = json.loads(data)
    out: Dict[str, Dict[str, Optional[str]]] = {}
    for pkg in doc.get("packages") or []:
        purls = [r["referenceLocator"] for r in pkg.get("externalRefs") or [] if r.get("referenceType") == "purl"]
        if not purls or pkg.get("SPDXID") == "SPDXRef-image":
            continue
        p = PackageURL.from_string(purls[0])
        key = PackageURL(p.type, p.namespace, p.name).to_string()
        sha = next((c["checksumValue"] for c in pkg.get("checksums") or [] if c.get("algorithm") == "SHA256"), None)
        out[key] = {"version": pkg.get("versionInfo"), "sha256": sha, "purl": purls[0]}
    return out
