"""A signed image whose layout was tampered with does not verify, and ``trainer image sbom`` / ``provenance``
refuse it rather than pick one of several documents.

One small signed image (a scratch base, one wheel, the bundle layer) is built per module; each case copies its
layout, changes ``index.json`` or a blob, and checks that ``trainer verify LAYOUT --key PUB`` answers no with
one line naming the problem (exit 1) and what ``trainer image sbom`` does with the same layout.
"""

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest

import helpers
from helpers import run_trainer as trainer
from image_fixtures import make_wheel, small_lock
from trainer.image.referrers import Document, referrer

EPOCH = 1767225600
SPDX = "application/spdx+json"
CDX = "application/vnd.cyclonedx+json"
DSSE = "application/vnd.dsse.envelope.v1+json"
INTOTO = "application/vnd.in-toto+json"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """The signed layout, its key pair and what the build reported."""
    root = tmp_path_factory.mktemp("tamper")
    wheel = make_wheel(root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    lock = root / "tamper.lock.json"
    lock.write_text(json.dumps(small_lock("tamper-test", EPOCH, [(wheel, "alpha", "1.0", "rest")], [])))
    bundle = root / "bundle"
    (bundle / "conf").mkdir(parents=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    cache = root / "cas"
    assert trainer("cache", "--cache", cache, "add", wheel).returncode == 0
    made = trainer("keygen", "--out", root / "key")
    assert made.returncode == 0, made.stderr
    r = trainer(
        "image",
        "build",
        "--lock",
        lock,
        "--out",
        root / "image.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        bundle,
        "--revision",
        "test",
        "--json",
        "-q",
        "--sign-key",
        root / "key",
    )
    assert r.returncode == 0, r.stderr
    return {"layout": root / "image.oci", "key": root / "key", "pub": root / "key.pub", "build": json.loads(r.stdout)}


def index(layout: Path):
    return json.loads((layout / "index.json").read_bytes())


def write_index(layout: Path, idx) -> None:
    (layout / "index.json").write_text(json.dumps(idx))


def descriptor_of(layout: Path, artifact_type: str):
    found = [d for d in index(layout)["manifests"] if d.get("artifactType") == artifact_type]
    assert len(found) == 1, found
    return found[0]


def blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs/sha256" / digest[7:]).read_bytes()


def document_of(layout: Path, artifact_type: str) -> bytes:
    manifest = json.loads(blob(layout, descriptor_of(layout, artifact_type)["digest"]))
    return blob(layout, manifest["layers"][0]["digest"])


def statement_of(layout: Path):
    return json.loads(base64.b64decode(json.loads(document_of(layout, DSSE))["payload"]))


def copy(signed, tmp_path: Path, name: str = "copy.oci") -> Path:
    dst = tmp_path / name
    shutil.copytree(signed["layout"], dst)
    return dst


def attach(
    layout: Path, artifact_type: str, data: bytes, subject_digest: str | None = None, first: bool = False
) -> str:
    """Add a well-formed referrer of ``data`` (made by the builder's own :func:`referrer`) to ``layout``'s index,
    as the first referrer (right after the image) or the last; returns its manifest digest."""
    idx = index(layout)
    image = idx["manifests"][0]
    subject = {"mediaType": image["mediaType"], "digest": subject_digest or image["digest"], "size": image["size"]}
    descriptor, manifest, blobs = referrer(Document(artifact_type, data, "forged.json"), subject, EPOCH)
    for item in (manifest, *blobs):
        (layout / "blobs/sha256" / sha(item)).write_bytes(item)
    idx["manifests"].insert(1 if first else len(idx["manifests"]), descriptor)
    write_index(layout, idx)
    return descriptor["digest"]


def drop(layout: Path, *artifact_types: str) -> None:
    idx = index(layout)
    idx["manifests"] = [d for d in idx["manifests"] if d.get("artifactType") not in artifact_types]
    write_index(layout, idx)


def replace_provenance(layout: Path, key: Path, statement) -> None:
    """Re-sign ``statement`` with the genuine key and attach it in place of the provenance."""
    from trainer import signing

    drop(layout, DSSE)
    envelope = signing.sign(json.dumps(statement, sort_keys=True).encode(), signing.load_signer(key))
    attach(layout, DSSE, envelope)


def one_line(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    for word in words:
        assert str(word) in r.stderr, (word, r.stderr)


def verify(signed, layout: Path):
    return trainer("verify", layout, "--key", signed["pub"])


def test_the_untouched_copy_verifies_and_its_sboms_are_the_byproducts(signed, tmp_path):
    layout = copy(signed, tmp_path)
    r = verify(signed, layout)
    assert (r.returncode, r.stderr) == (0, "")
    manifest_digest = signed["build"]["manifest_digest"]
    assert r.stdout.startswith(f"provenance ok: {layout} signed by ")
    assert f"subject {manifest_digest}" in r.stdout
    byproducts = statement_of(layout)["predicate"]["runDetails"]["byproducts"]
    named = {b["mediaType"]: b["digest"]["sha256"] for b in byproducts if b["mediaType"] in (SPDX, CDX)}
    spdx = trainer("image", "sbom", layout)
    cdx = trainer("image", "sbom", layout, "--format", "cyclonedx")
    assert spdx.returncode == 0 and cdx.returncode == 0, (spdx.stderr, cdx.stderr)
    assert sha(spdx.stdout.encode()) == named[SPDX] == sha(document_of(layout, SPDX))
    assert sha(cdx.stdout.encode()) == named[CDX] == sha(document_of(layout, CDX))
    image = [p for p in json.loads(spdx.stdout)["packages"] if p["SPDXID"] == "SPDXRef-image"]
    assert image[0]["checksums"] == [{"algorithm": "SHA256", "checksumValue": manifest_digest[7:]}]
    # the layers the provenance names are the image's layers, by diff_id
    layers = [b["digest"]["sha256"] for b in byproducts if b["mediaType"] == "application/vnd.oci.image.layer.v1.tar"]
    assert layers and layers == [layer["diff_id"][7:] for layer in signed["build"]["layers"]]
    prov = trainer("image", "provenance", layout)
    assert prov.returncode == 0 and prov.stdout.encode() == document_of(layout, DSSE)


@pytest.mark.parametrize("first", [True, False], ids=["before", "after"])
def test_a_forged_spdx_referrer_beside_the_genuine_one_is_refused(signed, tmp_path, first):
    layout = copy(signed, tmp_path)
    genuine = descriptor_of(layout, SPDX)["digest"]
    forged_doc = document_of(layout, SPDX).replace(b'"1.0"', b'"6.6"')
    assert forged_doc != document_of(layout, SPDX)
    forged = attach(layout, SPDX, forged_doc, first=first)
    assert [d.get("artifactType") for d in index(layout)["manifests"]][1 if first else 4] == SPDX
    for r, code in ((verify(signed, layout), 1), (trainer("image", "sbom", layout), 2)):
        one_line(r, code, layout, "2 referrers of artifactType application/spdx+json", genuine, forged)
    # the other documents are refused too: the layout binds nothing
    one_line(trainer("image", "sbom", layout, "--format", "cyclonedx"), 2, "application/spdx+json", forged)


@pytest.mark.parametrize("removed", [[SPDX], [CDX], [SPDX, CDX]], ids=["spdx", "cyclonedx", "both"])
def test_an_sbom_referrer_the_provenance_names_but_the_index_lacks_fails(signed, tmp_path, removed):
    layout = copy(signed, tmp_path)
    named = {
        b["mediaType"]: b["digest"]["sha256"] for b in statement_of(layout)["predicate"]["runDetails"]["byproducts"]
    }
    drop(layout, *removed)
    first = removed[0]  # the provenance names SPDX before CycloneDX
    one_line(
        verify(signed, layout),
        1,
        layout,
        f"the signed provenance names {first} sha256 {named[first]}; none is attached",
    )
    for media in removed:
        fmt = "spdx" if media == SPDX else "cyclonedx"
        one_line(trainer("image", "sbom", layout, "--format", fmt), 2, f"no referrer of type {media}")


def test_a_referrer_whose_subject_is_another_manifest_is_refused(signed, tmp_path):
    other = "sha256:" + "ab" * 32
    # the genuine SPDX referrer's manifest rewritten (and re-hashed) to point at another image
    layout = copy(signed, tmp_path)
    idx = index(layout)
    for d in idx["manifests"]:
        if d.get("artifactType") == SPDX:
            manifest = json.loads(blob(layout, d["digest"]))
            manifest["subject"]["digest"] = other
            data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
            (layout / "blobs/sha256" / sha(data)).write_bytes(data)
            d.update(digest="sha256:" + sha(data), size=len(data))
            moved = d["digest"]
    write_index(layout, idx)
    for r, code in ((verify(signed, layout), 1), (trainer("image", "sbom", layout), 2)):
        one_line(r, code, layout, moved, f"has subject {other}", "not this image's manifest")
    # a foreign SBOM added beside the genuine ones
    extra = copy(signed, tmp_path, "extra.oci")
    foreign = attach(extra, SPDX, b'{"spdxVersion": "SPDX-2.3"}', subject_digest=other)
    one_line(verify(signed, extra), 1, extra, foreign, f"has subject {other}")
    one_line(trainer("image", "sbom", extra), 2, foreign, f"has subject {other}")


@pytest.mark.parametrize("artifact_type", [SPDX, CDX, DSSE])
def test_a_duplicated_index_entry_is_refused(signed, tmp_path, artifact_type):
    layout = copy(signed, tmp_path)
    idx = index(layout)
    entry = descriptor_of(layout, artifact_type)
    idx["manifests"].append(dict(entry))
    write_index(layout, idx)
    words = (layout, f"2 referrers of artifactType {artifact_type} ({entry['digest']}, {entry['digest']})")
    one_line(verify(signed, layout), 1, *words)
    one_line(trainer("image", "sbom", layout), 2, *words)
    one_line(trainer("image", "provenance", layout), 2, *words)


@pytest.mark.parametrize("part", ["document", "manifest"])
@pytest.mark.parametrize("artifact_type", [SPDX, CDX, DSSE])
def test_a_flipped_byte_in_a_referrer_blob_is_refused(signed, tmp_path, artifact_type, part):
    layout = copy(signed, tmp_path)
    descriptor = descriptor_of(layout, artifact_type)
    digest = (
        descriptor["digest"]
        if part == "manifest"
        else json.loads(blob(layout, descriptor["digest"]))["layers"][0]["digest"]
    )
    path = layout / "blobs/sha256" / digest[7:]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    words = (layout, f"blob {digest} has sha256 sha256:{sha(bytes(data))} (corrupt)")
    one_line(verify(signed, layout), 1, *words)
    one_line(trainer("image", "sbom", layout, "--format", "cyclonedx"), 2, *words)


def test_without_its_provenance_referrer_the_image_does_not_verify(signed, tmp_path):
    layout = copy(signed, tmp_path)
    drop(layout, DSSE)
    one_line(verify(signed, layout), 1, layout, "no provenance referrer", signed["build"]["manifest_digest"])
    one_line(trainer("image", "provenance", layout), 2, "no referrer of type")
    # the SBOMs alone still bind (but nothing vouches for them)
    spdx = trainer("image", "sbom", layout)
    assert spdx.returncode == 0 and spdx.stdout.encode() == document_of(signed["layout"], SPDX)


def test_a_second_unsigned_provenance_is_refused(signed, tmp_path):
    layout = copy(signed, tmp_path)
    statement = statement_of(layout)
    envelope = descriptor_of(layout, DSSE)["digest"]
    unsigned = attach(layout, INTOTO, json.dumps(statement).encode())
    words = (layout, "two provenance referrers", f"{DSSE} {envelope}", f"{INTOTO} {unsigned}")
    one_line(verify(signed, layout), 1, *words)
    one_line(trainer("image", "provenance", layout, "--statement"), 2, *words)
    one_line(trainer("image", "sbom", layout), 2, *words)


def test_a_signed_provenance_that_names_another_sbom_set_or_layer_fails(signed, tmp_path):
    # signed by the genuine key without the CycloneDX byproduct: the attached CycloneDX is named by nothing
    layout = copy(signed, tmp_path, "no-cdx.oci")
    statement = statement_of(layout)
    details = statement["predicate"]["runDetails"]
    details["byproducts"] = [b for b in details["byproducts"] if b["mediaType"] != CDX]
    replace_provenance(layout, signed["key"], statement)
    cdx = descriptor_of(layout, CDX)["digest"]
    one_line(verify(signed, layout), 1, layout, f"a {CDX} referrer {cdx}", "the signed provenance names none")
    # ... and naming a layer the image does not have
    layout = copy(signed, tmp_path, "layer.oci")
    statement = statement_of(layout)
    layers = [b for b in statement["predicate"]["runDetails"]["byproducts"] if b["mediaType"].endswith(".tar")]
    layers[-1]["digest"]["sha256"] = "cd" * 32
    replace_provenance(layout, signed["key"], statement)
    one_line(verify(signed, layout), 1, layout, f"names {layers[-1]['name']} sha256 {'cd' * 32}", "has no such layer")
    # the same statement re-signed unchanged still verifies (the re-signing itself is not what fails)
    layout = copy(signed, tmp_path, "resigned.oci")
    replace_provenance(layout, signed["key"], statement_of(layout))
    r = verify(signed, layout)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
