"""SBOMs and provenance of images: deterministic, valid by the formats' own validators, attached as OCI 1.1
referrers that skopeo and umoci leave alone, signed offline, and refused when altered or misattached.

The image is built offline from fixtures (two .debs for a debian-rootfs base, wheels on PyPI and on another
index, a github.com git source); the README's smoke lock is built too when PyPI can be reached. (An image's
sdists are built by build steps, which need a real build root: the sdist and build-step SBOM entries are
checked on the repository locks below, a built sdist's image in tests/test_image_native.py, and an image
whose two build steps' outputs are in the cache, as a previous build leaves them, is built here.)

Both SBOMs are also validated against the formats' official JSON schemas with ``jsonschema``: SPDX 2.3's
from spdx/spdx-spec tag v2.3 (``tests/golden/schemas/``, see its README), CycloneDX 1.6's as shipped in
cyclonedx-python-lib.
"""

import base64
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from helpers import run_trainer as trainer
from image_fixtures import debian_base, make_deb, make_git_source, make_wheel, small_lock
from trainer.image import sbom

EPOCH = 1767225600


def make_world(root: Path, beta: str = "2.0"):
    """A lock of every kind of input the builder takes, its files, and a bundle root."""
    root.mkdir(parents=True, exist_ok=True)
    passwd = make_deb(
        root,
        "base-passwd",
        "3.6.1",
        {
            "/usr/share/base-passwd/passwd.master": (b"root:*:0:0:root:/root:/bin/sh\n", 0o644),
            "/usr/share/base-passwd/group.master": (b"root:*:0:\n", 0o644),
        },
    )
    tiny = make_deb(root, "tinybin", "1.0-1", {"/usr/bin/hello": (b"#!/bin/sh\necho hello\n", 0o755)})
    alpha = make_wheel(root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    beta_w = make_wheel(root, "beta", beta, {"beta/__init__.py": f"V = {beta!r}\n".encode()})
    archive, commit, tree = make_git_source(root / "git", "demo", {"README.md": b"demo\n"}, EPOCH)
    source = {
        "name": "demo",
        "url": "https://github.com/example/demo.git",
        "commit": commit,
        "tree": tree,
        "dest": "/opt/src/demo",
        "archive": {"filename": archive.name, "sha256": sha(archive)},
    }
    lock = small_lock("sbom-test", EPOCH, [(alpha, "alpha", "1.0", "rest"), (beta_w, "beta", beta, "torch")], [source])
    lock["wheels"][1]["url"] = f"https://download.pytorch.org/whl/cpu/{beta_w.name}"
    lock["base"] = debian_base([(passwd, "base-passwd", "3.6.1"), (tiny, "tinybin", "1.0-1")])
    lock["python"].update(
        version="3.11", site_packages="/usr/local/lib/python3.11/dist-packages", interpreter="/usr/bin/python3.11"
    )
    lock_path = root / f"sbom-test-{beta}.lock.json"
    lock_path.write_text(json.dumps(lock, indent=1))
    bundle = root / "bundle"
    (bundle / "conf").mkdir(parents=True, exist_ok=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    return lock_path, [passwd, tiny, alpha, beta_w, archive], bundle


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


SPDX_SCHEMA = REPO_ROOT / "tests" / "golden" / "schemas" / "spdx-schema-2.3.json"
SPDX_SCHEMA_SHA256 = "239208b7ac287b3cf5d9a9af23f9d69863971102a5e1587a27a398b43490b89b"  # spdx-spec v2.3


def schema_errors(kind: str, data) -> list:
    """Every error of the SBOM ``data`` (bytes or str) against the official JSON schema of ``kind`` ("spdx":
    SPDX 2.3, the stored copy, its sha256 checked; "cyclonedx": CycloneDX 1.6 as cyclonedx-python-lib ships it,
    with the SPDX-license and JSF schemas it references), as "path: message" strings (draft-07, jsonschema;
    ``format`` is an annotation there, as jsonschema treats it by default)."""
    import cyclonedx
    import jsonschema
    import referencing
    from referencing.jsonschema import DRAFT7

    if kind == "spdx":
        assert sha(SPDX_SCHEMA) == SPDX_SCHEMA_SHA256
        validator = jsonschema.Draft7Validator(json.loads(SPDX_SCHEMA.read_text()))
    else:
        res = Path(cyclonedx.__file__).parent / "schema" / "_res"
        schema = json.loads((res / "bom-1.6.SNAPSHOT.schema.json").read_text())
        assert schema["$id"] == "http://cyclonedx.org/schema/bom-1.6.schema.json"
        registry = referencing.Registry()
        for name in ("spdx.SNAPSHOT.schema.json", "jsf-0.82.SNAPSHOT.schema.json"):  # as the bom schema names them
            registry = registry.with_resource(
                f"http://cyclonedx.org/schema/{name}", DRAFT7.create_resource(json.loads((res / name).read_text()))
            )
        validator = jsonschema.Draft7Validator(schema, registry=registry)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(json.loads(data))
    ]


def build(lock, out, cache, bundle, *extra):
    r = trainer(
        "image",
        "build",
        "--lock",
        lock,
        "--out",
        out,
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        bundle,
        "--revision",
        "test",
        "--json",
        "-q",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("sbom")
    lock, files, bundle = make_world(root / "in")
    lock2, files2, _ = make_world(root / "in2", beta="2.1")
    cache = root / "cas"
    for f in files + files2:
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    r = trainer("keygen", "--out", root / "key")
    assert r.returncode == 0, r.stderr
    assert trainer("keygen", "--out", root / "other", "--type", "ecdsa").returncode == 0
    a = build(lock, root / "a.oci", cache, bundle, "--sign-key", root / "key")
    b = build(lock, root / "b.oci", cache, bundle, "--sign-key", root / "key", "--archive", root / "b.tar")
    plain = build(lock, root / "plain.oci", cache, bundle)
    v2 = build(lock2, root / "v2.oci", cache, bundle)
    return {
        "root": root,
        "lock": lock,
        "cache": cache,
        "bundle": bundle,
        "a": a,
        "b": b,
        "plain": plain,
        "v2": v2,
        "key": root / "key",
        "pub": root / "key.pub",
        "other_pub": root / "other.pub",
    }


def index(layout: Path):
    return json.loads((layout / "index.json").read_text())


def referrer_blob(layout: Path, artifact_type: str) -> bytes:
    for d in index(layout)["manifests"]:
        if d.get("artifactType") == artifact_type:
            manifest = json.loads((layout / "blobs/sha256" / d["digest"][7:]).read_bytes())
            return (layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]).read_bytes()
    raise AssertionError(f"no {artifact_type} referrer")


def statement_of(envelope: bytes):
    return json.loads(base64.b64decode(json.loads(envelope)["payload"]))


def test_built_twice_the_documents_are_byte_identical_and_the_image_digest_is_the_image(world):
    root = world["root"]
    assert world["a"]["manifest_digest"] == world["b"]["manifest_digest"] == world["plain"]["manifest_digest"]
    for kind in ("application/spdx+json", "application/vnd.cyclonedx+json", "application/vnd.dsse.envelope.v1+json"):
        assert referrer_blob(root / "a.oci", kind) == referrer_blob(root / "b.oci", kind)
    assert index(root / "a.oci") == index(root / "b.oci")
    # the image comes first, named "latest"; three referrers follow, none named
    listed = index(root / "a.oci")["manifests"]
    assert listed[0]["digest"] == world["a"]["manifest_digest"] and listed[0]["annotations"] == {
        "org.opencontainers.image.ref.name": "latest"
    }
    assert [d["artifactType"] for d in listed[1:]] == [
        "application/spdx+json",
        "application/vnd.cyclonedx+json",
        "application/vnd.dsse.envelope.v1+json",
    ]
    assert [r["artifactType"] for r in world["a"]["referrers"]] == [d["artifactType"] for d in listed[1:]]
    for d in listed[1:]:
        manifest = json.loads((root / "a.oci/blobs/sha256" / d["digest"][7:]).read_bytes())
        assert manifest["subject"]["digest"] == world["a"]["manifest_digest"]
        assert manifest["config"] == {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "size": 2,
            "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
        }
    r = trainer("image", "digest", root / "a.oci")
    assert r.stdout.strip() == world["a"]["manifest_digest"]
    assert trainer("image", "digest", root / "b.tar").stdout.strip() == world["a"]["manifest_digest"]


def test_validators_accept_the_sboms_and_they_list_every_input(world):
    layout = world["root"] / "a.oci"
    spdx = trainer("image", "sbom", layout, "--validate")
    assert spdx.returncode == 0, spdx.stderr
    sbom.validate_spdx(spdx.stdout.encode(), "spdx")
    cdx = trainer("image", "sbom", world["root"] / "b.tar", "--format", "cyclonedx", "--validate")
    assert cdx.returncode == 0, cdx.stderr
    sbom.validate_cyclonedx(cdx.stdout.encode(), "cyclonedx")
    assert schema_errors("spdx", spdx.stdout) == [] and schema_errors("cyclonedx", cdx.stdout) == []
    lock = json.loads(world["lock"].read_text())
    packages = {p["SPDXID"]: p for p in json.loads(spdx.stdout)["packages"]}
    purls = {p["externalRefs"][0]["referenceLocator"]: p for p in packages.values()}
    image = packages["SPDXRef-image"]
    assert image["checksums"] == [{"algorithm": "SHA256", "checksumValue": world["a"]["manifest_digest"][7:]}]
    assert (
        image["externalRefs"][0]["referenceLocator"] == f"pkg:oci/sbom-test@{world['a']['manifest_digest']}?arch=amd64"
    )
    deb = purls["pkg:deb/debian/tinybin@1.0-1?arch=amd64&distro=bookworm"]
    assert deb["checksums"][0]["checksumValue"] == lock["base"]["debs"][1]["sha256"]
    alpha = purls["pkg:pypi/alpha@1.0?file_name=alpha-1.0-py3-none-any.whl"]
    assert alpha["checksums"][0]["checksumValue"] == lock["wheels"][0]["sha256"]
    beta = [p for u, p in purls.items() if u.startswith("pkg:pypi/beta@2.0?")][0]
    assert "repository_url=https://download.pytorch.org/whl/cpu" in beta["externalRefs"][0]["referenceLocator"]
    commit = lock["sources"][0]["commit"]
    demo = purls[f"pkg:github/example/demo@{commit}"]
    assert demo["checksums"][0]["checksumValue"] == lock["sources"][0]["archive"]["sha256"]
    assert demo["downloadLocation"] == f"git+https://github.com/example/demo.git@{commit}"
    assert len(packages) == 1 + 2 + 2 + 1
    contains = {
        r["relatedSpdxElement"] for r in json.loads(spdx.stdout)["relationships"] if r["relationshipType"] == "CONTAINS"
    }
    assert contains == set(packages) - {"SPDXRef-image"}
    doc = json.loads(cdx.stdout)
    assert doc["specVersion"] == "1.6" and doc["metadata"]["timestamp"] == "2026-01-01T00:00:00+00:00"
    assert doc["metadata"]["component"]["purl"] == image["externalRefs"][0]["referenceLocator"]
    assert sorted(c["purl"] for c in doc["components"]) == sorted(
        set(purls) - {image["externalRefs"][0]["referenceLocator"]}
    )


def test_sboms_of_the_repository_locks_validate_with_every_kind_of_input():
    """debian-full (debs) and full (an oci base) as locked, cut to a few inputs per section, plus a native build."""
    from trainer.lock.imagelock import load_lock

    for name in ("debian-full", "full"):
        lock = load_lock(REPO_ROOT / "lockfiles" / f"{name}.lock.json")
        if lock["base"]["type"] == "debian-rootfs":
            lock["base"]["debs"] = lock["base"]["debs"][:4]
        lock["wheels"], lock["sdists"] = lock["wheels"][:4], lock["sdists"][:2]
        lock["sources"] = [
            {
                "name": "miles",
                "url": "https://github.com/radixark/miles.git",
                "commit": "78527b9102b3a5f15891128cbec3ac6c2dc4089e",
                "tree": "6d202c7215156941afe3e53e2d72babe49fb2875",
                "dest": "/root/miles",
            }
        ]  # no archive
        lock["builds"] = [{"name": "deepep", "version": "1.2.1", "sha256": "ab" * 32}]
        digest = "sha256:" + "cd" * 32
        spdx, cdx = sbom.spdx_json(lock, digest), sbom.cyclonedx_json(lock, digest)
        assert spdx == sbom.spdx_json(lock, digest) and cdx == sbom.cyclonedx_json(lock, digest)
        sbom.validate_spdx(spdx, name)
        sbom.validate_cyclonedx(cdx, name)
        assert schema_errors("spdx", spdx) == [] and schema_errors("cyclonedx", cdx) == []
        purls = {c["purl"] for c in json.loads(cdx)["components"]}
        assert "pkg:github/radixark/miles@78527b9102b3a5f15891128cbec3ac6c2dc4089e" in purls
        miles = [c for c in json.loads(cdx)["components"] if c["name"] == "miles"][0]
        assert miles["hashes"] == [{"alg": "SHA-1", "content": "6d202c7215156941afe3e53e2d72babe49fb2875"}]  # its tree
        assert "pkg:generic/deepep@1.2.1" in purls
        if name == "full":
            assert (
                "pkg:oci/sglang@sha256:7b6a35df9839fd593a94a1eaee82d7777f472225d9f3ad1f8a2e0cb2bd1785d0"
                "?repository_url=docker.io/lmsysorg/sglang&tag=v0.5.16"
            ) in purls
        else:
            assert (
                f"pkg:deb/debian/{lock['base']['debs'][0]['name']}@{lock['base']['debs'][0]['version']}"
                f"?arch={lock['base']['debs'][0]['architecture']}&distro=bookworm"
                in {p.replace("%2B", "+") for p in purls}
            )


def step_layers(lock) -> list:
    """(name, diff_id) of an image of ``lock`` as the build passes them on, with made-up digests: its build
    steps' layers ``build-<name>`` (``sha256:<one byte per step, 32 times>``) between ``sources`` and ``bundle``."""
    steps = [(f"build-{b['name']}", "sha256:" + f"{0xA1 + i:02x}" * 32) for i, b in enumerate(lock["builds"])]
    return [
        ("base", "sha256:" + "01" * 32),
        ("sources", "sha256:" + "02" * 32),
        *steps,
        ("bundle", "sha256:" + "03" * 32),
    ]


def test_debian_full_build_steps_their_outputs_build_roots_and_inputs_in_both_sboms_and_the_provenance():
    """debian-full as locked (5 build steps, a build root of 179 .debs and 6 wheels), with its layers' digests:
    each step's output has its layer's sha256, every build-root package is a build dependency of each step that
    used it, each output is generated from its input, and both documents pass their official schemas."""
    from trainer.image import provenance
    from trainer.lock.imagelock import canonical_name, load_lock, wheel_items

    lock = load_lock(REPO_ROOT / "lockfiles" / "debian-full.lock.json")
    layers, digest = step_layers(lock), "sha256:" + "cd" * 32
    outputs = {name[6:]: d[7:] for name, d in layers if name.startswith("build-")}
    assert sorted(outputs) == [
        "antlr4-python3-runtime",
        "aws-ofi-nccl",
        "deepep",
        "fast-hadamard-transform",
        "transformer-engine-torch",
    ]
    root_debs, root_wheels = lock["build_root"]["debs"], lock["build_root"]["wheels"]
    assert (len(root_debs), len(root_wheels)) == (179, 6)
    spdx_bytes, cdx_bytes = sbom.spdx_json(lock, digest, layers), sbom.cyclonedx_json(lock, digest, layers)
    assert spdx_bytes == sbom.spdx_json(lock, digest, layers) and cdx_bytes == sbom.cyclonedx_json(lock, digest, layers)
    assert schema_errors("spdx", spdx_bytes) == [] and schema_errors("cyclonedx", cdx_bytes) == []
    sbom.validate_spdx(spdx_bytes, "spdx")  # spdx-tools still reads the 2.3 spelling back
    sbom.validate_cyclonedx(cdx_bytes, "cyclonedx")  # cyclonedx-python-lib's strict validator, every component

    spdx = json.loads(spdx_bytes)
    packages = {p["SPDXID"]: p for p in spdx["packages"]}
    purl_of = {i: p["externalRefs"][0]["referenceLocator"] for i, p in packages.items()}
    by_purl = {u: i for i, u in purl_of.items()}
    assert len(by_purl) == len(packages)  # one package per purl: a build-root .deb identical to a base .deb is that one
    assert {r["referenceCategory"] for p in spdx["packages"] for r in p["externalRefs"]} == {"PACKAGE-MANAGER"}

    def sha256_of(spdx_id):
        return [c["checksumValue"] for c in packages[spdx_id]["checksums"] if c["algorithm"] == "SHA256"]

    for step, hex_ in outputs.items():
        assert sha256_of(f"SPDXRef-build-{step}") == [hex_]
        assert f"diff_id of the image layer build-{step}" in packages[f"SPDXRef-build-{step}"]["comment"]
    # every file-producing package has its sha256; only the git sources pinned by commit and tree alone do not
    assert sorted(packages[i]["name"] for i in packages if not sha256_of(i)) == [
        "fast_hadamard_transform",
        "megatron_lm",
        "miles",
    ]
    n_wheels = len(lock["wheels"])
    assert (len(lock["base"]["debs"]), n_wheels, len(lock["sdists"]), len(lock["sources"])) == (110, 191, 2, 5)
    assert sum(d["sha256"] in {b["sha256"] for b in lock["base"]["debs"]} for d in root_debs) == 110  # all of the base
    # image, base .debs, wheels, sdists, sources, builds, the build-root .debs that are not the base's,
    # build-root wheels
    assert len(packages) == 1 + 110 + n_wheels + 2 + 5 + 5 + (179 - 110) + 6 == 389

    relations = {}
    for r in spdx["relationships"]:
        relations.setdefault(r["relationshipType"], set()).add((r["spdxElementId"], r["relatedSpdxElement"]))

    def deb_purl(d):
        return f"pkg:deb/debian/{d['name']}@{d['version']}?arch={d['architecture']}&distro=bookworm"

    for step in lock["builds"]:
        out = f"SPDXRef-build-{step['name']}"
        used = {purl_of[a] for a, b in relations["BUILD_DEPENDENCY_OF"] if b == out}
        wheels = wheel_items(lock, step["wheels"], step["name"])
        assert used == {deb_purl(d).replace("+", "%2B") for d in root_debs} | {
            f"pkg:pypi/{canonical_name(w['name'])}@{w['version'].replace('+', '%2B')}?file_name={w['filename']}"
            for w in wheels
        }, step["name"]
        assert len(used) == 179 + len(wheels)
        source = step["input"].get("source") or step["input"]["sdist"]
        (generated,) = [b for a, b in relations["GENERATED_FROM"] if a == out]
        assert packages[generated]["name"] == canonical_name(source) if "sdist" in step["input"] else source
        assert (
            packages[generated]["comment"]
            == f"recipe-bundle lock: {'source' if 'source' in step['input'] else 'sdist'}"
        )
    assert by_purl["pkg:github/deepseek-ai/deepep@9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee"] in {
        b for a, b in relations["GENERATED_FROM"] if a == "SPDXRef-build-deepep"
    }
    # every step uses the 179 .debs; its wheels: antlr4 3, aws-ofi-nccl 3, DeepEP, fast-hadamard-transform and TE 36
    assert len(relations["BUILD_DEPENDENCY_OF"]) == 5 * 179 + 3 + 3 + 36 + 36 + 36
    contained = {b for a, b in relations["CONTAINS"] if a == "SPDXRef-image"}
    assert {f"SPDXRef-build-{s}" for s in outputs} <= contained
    assert not {i for i in contained if i.startswith(("SPDXRef-build-root-", "SPDXRef-sdist-"))}  # not in the image
    assert len(contained) == 110 + n_wheels + 5 + 5

    cdx = json.loads(cdx_bytes)
    components = {c["bom-ref"]: c for c in cdx["components"]}
    for step, hex_ in outputs.items():
        assert components[f"build:{step}"]["hashes"] == [{"alg": "SHA-256", "content": hex_}]
    (formula,) = cdx["formulation"]
    transient = {c["bom-ref"]: c for c in formula["components"]}
    assert len(transient) == 69 + 6 + 2 and not set(transient) & set(components)
    assert {r for r in transient if r.startswith("sdist:")} == {
        "sdist:antlr4-python3-runtime",
        "sdist:transformer-engine-torch",
    }
    assert all(c["hashes"][0]["alg"] == "SHA-256" for c in transient.values())
    every_ref = set(components) | set(transient)
    workflows = {w["bom-ref"]: w for w in formula["workflows"]}
    assert sorted(workflows) == [f"build-step:{s}" for s in sorted(outputs)]
    deepep = workflows["build-step:deepep"]
    assert deepep["taskTypes"] == ["build"] and deepep["outputs"] == [
        {"resource": {"ref": "build:deepep"}, "type": "artifact"}
    ]
    refs = [i["resource"]["ref"] for i in deepep["inputs"] if "resource" in i]
    assert refs[0] == "source:deepep" and len(refs) == 1 + 179 + 36 and set(refs) <= every_ref
    assert {"name": "TORCH_CUDA_ARCH_LIST", "value": "9.0"} in deepep["inputs"][-1]["environmentVars"]
    assert (
        "TORCH_CUDA_ARCH_LIST" not in json.dumps(deepep["steps"])
        and "pip wheel" in deepep["steps"][0]["commands"][0]["executed"]
    )
    (image_deps,) = [d for d in cdx["dependencies"] if d["ref"] == "image"]
    assert set(image_deps["dependsOn"]) == set(components)  # the image holds what is in its layers, not its build roots

    statement = provenance.statement(lock, digest, "test", layers, [], REPO_ROOT)
    resolved = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert all(d.get("digest") for d in resolved)  # no empty digest: a build step's output is no resolved input
    assert not [d for d in resolved if d["name"].startswith("pkg:generic/")]
    shas = {d["digest"].get("sha256") for d in resolved}
    assert {d["sha256"] for d in root_debs + root_wheels} <= shas
    assert sum(1 for d in resolved if (d.get("annotations") or {}).get("buildRoot") == "build_root.debs") == 69
    byproducts = {b["name"]: b for b in statement["predicate"]["runDetails"]["byproducts"]}
    assert byproducts["layer build-deepep"] == {
        "name": "layer build-deepep",
        "digest": {"sha256": outputs["deepep"]},
        "mediaType": "application/vnd.oci.image.layer.v1.tar",
        "annotations": {
            "buildStep": "deepep",
            "purl": "pkg:generic/deepep@9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee",
            "builtFrom": "pkg:github/deepseek-ai/deepep@9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee",
        },
    }
    assert byproducts["layer build-transformer-engine-torch"]["annotations"]["builtFrom"] == (
        "pkg:pypi/transformer-engine-torch@2.17.0?file_name=transformer_engine_torch-2.17.0.tar.gz"
    )


def test_the_stored_spdx_schema_refuses_the_spelling_spdx_tools_writes():
    """The check is not vacuous: spdx-tools' own spelling PACKAGE_MANAGER (what these SBOMs had) fails SPDX 2.3's
    schema once per package; a CycloneDX document without its specVersion fails CycloneDX 1.6's."""
    from trainer.lock.imagelock import load_lock

    lock = load_lock(REPO_ROOT / "lockfiles" / "debian-smoke.lock.json")
    spdx = sbom.spdx_json(lock, "sha256:" + "cd" * 32, step_layers(lock))
    old = spdx.replace(b'"PACKAGE-MANAGER"', b'"PACKAGE_MANAGER"')
    errors = schema_errors("spdx", old)
    assert len(errors) == len(json.loads(spdx)["packages"]) > 1
    assert all(e.startswith("packages/") and "'PACKAGE_MANAGER' is not one of" in e for e in errors)
    cdx = json.loads(sbom.cyclonedx_json(lock, "sha256:" + "cd" * 32, step_layers(lock)))
    del cdx["specVersion"]
    assert schema_errors("cyclonedx", json.dumps(cdx)) == [": 'specVersion' is a required property"]


def make_step_world(root: Path):
    """:func:`make_world`'s lock plus a build root and two build steps: ``demo-ext`` builds the git source ``demo``
    into a wheel (distribution demo-ext 0.3, a name the lock has nowhere else, as DeepEP's deep-ep), ``gamma``
    the sdist ``gamma`` 0.5. The build root: base-passwd (the very .deb of the base), cc-fake (only in the
    build root), the image's wheel alpha and the build root's own wheel pip. Returns (lock path, files to add to
    the cache, bundle root, {step: the wheel it builds})."""
    import io
    import tarfile

    lock_path, files, bundle = make_world(root)
    lock = json.loads(lock_path.read_text())
    cc = make_deb(root, "cc-fake", "1.0", {"/usr/bin/cc-fake": (b"#!/bin/sh\nexit 0\n", 0o755)})
    pip = make_wheel(root, "pip", "25.3", {"pip/__init__.py": b""})
    sdist = root / "gamma-0.5.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("gamma-0.5/setup.py")
        info.size, info.mtime = 5, EPOCH
        tar.addfile(info, io.BytesIO(b"pass\n"))
    import gzip

    sdist.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    python = {
        "version": "3.11",
        "platform": "x86_64-manylinux_2_36",
        "prefix": "/usr/local",
        "site_packages": "/usr/local/lib/python3.11/dist-packages",
        "interpreter": "/usr/bin/python3.11",
    }
    lock["build_root"] = {
        "suite": "bookworm",
        "variant": "essential",
        "include": ["cc-fake"],
        "links": {},
        "python": python,
        "debs": [dict(lock["base"]["debs"][0]), debian_base([(cc, "cc-fake", "1.0")])["debs"][0]],
        "wheels": [
            {
                "name": "pip",
                "version": "25.3",
                "filename": pip.name,
                "sha256": sha(pip),
                "url": f"https://files.pythonhosted.org/packages/test/{pip.name}",
            }
        ],
        "requirements": ["pip==25.3"],
    }
    lock["sdists"] = [
        {
            "name": "gamma",
            "version": "0.5",
            "filename": sdist.name,
            "group": "rest",
            "sha256": sha(sdist),
            "url": f"https://files.pythonhosted.org/packages/test/{sdist.name}",
        }
    ]
    wheel_step = ["/bin/sh", "-euc", 'python3 -m pip wheel --no-index --no-deps --wheel-dir "$BUILD_OUT" .']
    lock["builds"] = [
        {
            "name": "demo-ext",
            "input": {"source": "demo"},
            "wheels": ["alpha", "pip"],
            "command": wheel_step,
            "env": {"CC": "cc-fake"},
            "install": {"type": "wheel"},
        },
        {
            "name": "gamma",
            "input": {"sdist": "gamma"},
            "wheels": ["pip"],
            "command": wheel_step,
            "env": {},
            "install": {"type": "wheel"},
        },
    ]
    lock_path.write_text(json.dumps(lock, indent=1))
    (root / "built").mkdir()
    wheels = {
        "demo-ext": make_wheel(root / "built", "demo-ext", "0.3", {"demo_ext/__init__.py": b"V = 3\n"}),
        "gamma": make_wheel(root / "built", "gamma", "0.5", {"gamma/__init__.py": b"V = 5\n"}),
    }
    return lock_path, files + [cc, pip, sdist], bundle, wheels


def seed_step_outputs(lock_path: Path, cache_dir: Path, wheels, work: Path):
    """Put each build step's output layer into the cache under its key, as a previous build of the step leaves
    it (its wheel installed by :func:`trainer.image.native.output_entries`, the layer written and recorded): the
    build then takes the layer from the cache and runs no sandbox. Returns {step: diff_id}."""
    from trainer.image import native
    from trainer.image.cas import Cache
    from trainer.image.layer import write_layer
    from trainer.lock.imagelock import load_lock

    lock, cache = load_lock(lock_path), Cache(cache_dir)
    keys, made = native.step_keys(lock), {}
    for step in lock["builds"]:
        out, spool = work / f"out-{step['name']}", work / f"spool-{step['name']}"
        out.mkdir(parents=True)
        spool.mkdir()
        shutil.copy(wheels[step["name"]], out)
        handles: list = []
        entries = native.output_entries(lock, step, out, cache, spool, handles)
        tmp = cache.new_temp()
        with open(tmp, "wb") as handle:
            info = write_layer(entries, handle, lock["epoch"])
        for h in handles:
            h.close()
        cache.commit(tmp, info.diff_id[7:])
        cache.put_layer_record(
            keys[step["name"]], {"diff_id": info.diff_id, "size": info.size, "layer": f"build-{step['name']}"}
        )
        made[step["name"]] = info.diff_id
    return made


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """An image of :func:`make_step_world`'s lock built with its steps' outputs in the cache."""
    root = tmp_path_factory.mktemp("steps")
    lock, files, bundle, wheels = make_step_world(root / "in")
    cache = root / "cas"
    for f in files:
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    outputs = seed_step_outputs(lock, cache, wheels, root / "work")
    built = build(lock, root / "s.oci", cache, bundle)
    return {"root": root, "lock": lock, "layout": root / "s.oci", "outputs": outputs, "built": built}


def test_an_image_with_build_steps_names_their_outputs_build_roots_and_built_distributions(stepped):
    layout, outputs = stepped["layout"], stepped["outputs"]
    layers = {layer["name"]: layer for layer in stepped["built"]["layers"]}
    assert [layer["name"] for layer in stepped["built"]["layers"]] == [
        "base",
        "torch",
        "rest",
        "sources",
        "build-demo-ext",
        "build-gamma",
        "bundle",
    ]
    for step, diff_id in outputs.items():
        assert (layers[f"build-{step}"]["diff_id"], layers[f"build-{step}"]["status"]) == (diff_id, "cached")
    spdx = trainer("image", "sbom", layout, "--validate")
    cdx = trainer("image", "sbom", layout, "--format", "cyclonedx", "--validate")
    assert (spdx.returncode, cdx.returncode) == (0, 0), (spdx.stderr, cdx.stderr)
    assert schema_errors("spdx", spdx.stdout) == [] and schema_errors("cyclonedx", cdx.stdout) == []
    doc = json.loads(spdx.stdout)
    packages = {p["SPDXID"]: p for p in doc["packages"]}
    assert packages["SPDXRef-build-demo-ext"]["checksums"] == [
        {"algorithm": "SHA256", "checksumValue": outputs["demo-ext"][7:]}
    ]
    assert packages["SPDXRef-build-gamma"]["checksums"] == [
        {"algorithm": "SHA256", "checksumValue": outputs["gamma"][7:]}
    ]
    commit = json.loads(stepped["lock"].read_text())["sources"][0]["commit"]
    assert packages["SPDXRef-build-demo-ext"]["externalRefs"][0]["referenceLocator"] == f"pkg:generic/demo-ext@{commit}"
    assert packages["SPDXRef-build-root-deb-cc-fake"]["comment"].startswith("recipe-bundle lock: build_root.debs")
    relations = {(r["spdxElementId"], r["relationshipType"], r["relatedSpdxElement"]) for r in doc["relationships"]}
    built_from = {(a, b) for a, t, b in relations if t == "GENERATED_FROM"}
    assert built_from == {
        ("SPDXRef-build-demo-ext", "SPDXRef-source-demo"),
        ("SPDXRef-build-gamma", "SPDXRef-sdist-gamma"),
    }
    assert {(a, b) for a, t, b in relations if t == "BUILD_DEPENDENCY_OF"} == {
        ("SPDXRef-deb-base-passwd", "SPDXRef-build-demo-ext"),
        ("SPDXRef-build-root-deb-cc-fake", "SPDXRef-build-demo-ext"),
        ("SPDXRef-wheel-alpha", "SPDXRef-build-demo-ext"),
        ("SPDXRef-build-root-wheel-pip", "SPDXRef-build-demo-ext"),
        ("SPDXRef-deb-base-passwd", "SPDXRef-build-gamma"),
        ("SPDXRef-build-root-deb-cc-fake", "SPDXRef-build-gamma"),
        ("SPDXRef-build-root-wheel-pip", "SPDXRef-build-gamma"),
    }
    assert {b for a, t, b in relations if t == "CONTAINS"} == set(packages) - {
        "SPDXRef-image",
        "SPDXRef-sdist-gamma",
        "SPDXRef-build-root-deb-cc-fake",
        "SPDXRef-build-root-wheel-pip",
    }
    bom = json.loads(cdx.stdout)
    assert sorted(c["bom-ref"] for c in bom["formulation"][0]["components"]) == [
        "build-root-deb:cc-fake",
        "build-root-wheel:pip",
        "sdist:gamma",
    ]
    (workflow,) = [w for w in bom["formulation"][0]["workflows"] if w["bom-ref"] == "build-step:demo-ext"]
    assert workflow["inputs"] == [
        {"resource": {"ref": r}}
        for r in ("source:demo", "deb:base-passwd", "build-root-deb:cc-fake", "wheel:alpha", "build-root-wheel:pip")
    ] + [{"environmentVars": [{"name": "CC", "value": "cc-fake"}]}]
    statement = json.loads(trainer("image", "provenance", layout).stdout)
    resolved = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert all(d.get("digest") for d in resolved)
    lock = json.loads(stepped["lock"].read_text())
    assert {d["sha256"] for d in lock["build_root"]["debs"] + lock["build_root"]["wheels"]} <= {
        d["digest"].get("sha256") for d in resolved
    }
    byproduct = [b for b in statement["predicate"]["runDetails"]["byproducts"] if b["name"] == "layer build-gamma"]
    assert byproduct == [
        {
            "name": "layer build-gamma",
            "digest": {"sha256": outputs["gamma"][7:]},
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "annotations": {
                "buildStep": "gamma",
                "purl": "pkg:generic/gamma@0.5",
                "builtFrom": "pkg:pypi/gamma@0.5?file_name=gamma-0.5.tar.gz",
            },
        }
    ]


def test_image_diff_against_its_lock_counts_the_distributions_its_build_steps_installed(stepped, tmp_path):
    layout = stepped["layout"]
    same = trainer("image", "diff", layout, stepped["lock"])
    assert (same.returncode, same.stdout.strip()) == (0, "identical"), (
        same.stdout
    )  # demo-ext 0.3 and gamma 0.5 are the lock's
    lock = json.loads(stepped["lock"].read_text())
    lock["builds"] = [b for b in lock["builds"] if b["name"] != "demo-ext"]  # a lock without the step
    other = tmp_path / "other.lock.json"
    other.write_text(json.dumps(lock))
    r = trainer("image", "diff", layout, other)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert "python demo-ext: 0.3 -> (absent)" in lines
    assert f"build demo-ext: layer {stepped['outputs']['demo-ext']} -> (absent)" in lines
    data = json.loads(trainer("image", "diff", "--json", layout, other).stdout)
    assert data["distributions"] == [{"name": "demo-ext", "old": "0.3", "new": None}]
    assert data["builds"] == [{"name": "demo-ext", "old": f"layer {stepped['outputs']['demo-ext']}", "new": None}]


def test_provenance_names_the_image_the_lock_and_every_input(world):
    r = trainer("image", "provenance", world["root"] / "a.oci", "--statement")
    assert r.returncode == 0, r.stderr
    statement = json.loads(r.stdout)
    unsigned = trainer("image", "provenance", world["root"] / "plain.oci")
    assert json.loads(unsigned.stdout) == statement  # the signed one carries the same statement
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    assert statement["subject"] == [{"name": "sbom-test", "digest": {"sha256": world["a"]["manifest_digest"][7:]}}]
    definition = statement["predicate"]["buildDefinition"]
    assert definition["externalParameters"] == {
        "lock": {"path": world["lock"].name, "sha256": sha(world["lock"])},
        "revision": "test",
    }
    lock = json.loads(world["lock"].read_text())
    digests = [d["digest"].get("sha256") for d in definition["resolvedDependencies"]]
    for item in lock["base"]["debs"] + lock["wheels"] + lock["sdists"]:
        assert item["sha256"] in digests
    assert {"gitCommit": lock["sources"][0]["commit"], "sha256": lock["sources"][0]["archive"]["sha256"]} in [
        d["digest"] for d in definition["resolvedDependencies"]
    ]
    bundle = [layer for layer in world["a"]["layers"] if layer["name"] == "bundle"][0]
    assert {"sha256": bundle["diff_id"][7:]} in [d["digest"] for d in definition["resolvedDependencies"]]
    details = statement["predicate"]["runDetails"]
    assert details["builder"]["id"].endswith("/image-build@0.1.0") and details["metadata"] == {}
    byproducts = {b["mediaType"]: b["digest"]["sha256"] for b in details["byproducts"] if "name" in b}
    assert byproducts["application/spdx+json"] == sha_bytes(
        referrer_blob(world["root"] / "a.oci", "application/spdx+json")
    )


def sha_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_skopeo_and_umoci_still_read_the_image(world, tmp_path):
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (bin/setup installs it)")
    layout = world["root"] / "a.oci"
    inspect = json.loads(
        subprocess.run(["skopeo", "inspect", f"oci:{layout}:latest"], capture_output=True, text=True, check=True).stdout
    )
    assert inspect["Digest"] == world["a"]["manifest_digest"]
    assert inspect["Layers"] == [layer["diff_id"] for layer in world["a"]["layers"]]
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{layout}:latest", f"oci:{tmp_path / 'copy'}:latest"],
        check=True,
        capture_output=True,
    )
    # skopeo re-serializes the manifest (another digest) but copies the same config and layers
    same = trainer("image", "diff", layout, tmp_path / "copy")
    assert (same.returncode, same.stdout.strip()) == (0, "identical")
    subprocess.run(
        ["umoci", "unpack", "--rootless", "--image", f"{layout}:latest", str(tmp_path / "u")],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "u/rootfs/usr/bin/hello").read_bytes() == b"#!/bin/sh\necho hello\n"


def test_signed_provenance_verifies_with_the_public_key_and_with_in_toto(world, tmp_path):
    from in_toto.exceptions import SignatureVerificationError
    from in_toto.models._signer import load_public_key_from_file
    from in_toto.models.metadata import Metadata

    layout = world["root"] / "a.oci"
    r = trainer("verify", layout, "--key", world["pub"])
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith(f"provenance ok: {layout} signed by ")
    wrong = trainer("verify", layout, "--key", world["other_pub"])
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1 and "not by the given key" in wrong.stderr
    unsigned = trainer("verify", world["root"] / "plain.oci", "--key", world["pub"])
    assert unsigned.returncode == 1 and "unsigned statement" in unsigned.stderr
    # in-toto's own DSSE verification accepts the envelope with the same public key file, refuses another key
    envelope = tmp_path / "provenance.dsse.json"
    envelope.write_bytes(trainer("image", "provenance", layout).stdout.encode())
    metadata = Metadata.load(str(envelope))
    metadata.verify_signature(load_public_key_from_file(str(world["pub"])))
    with pytest.raises(SignatureVerificationError):
        metadata.verify_signature(load_public_key_from_file(str(world["other_pub"])))


def test_ecdsa_p256_keys_sign_and_verify_and_in_toto_agrees(tmp_path):
    from in_toto.models._signer import load_public_key_from_file
    from in_toto.models.metadata import Envelope

    from trainer import signing

    _, pub, keyid = signing.keygen(tmp_path / "ec", "ecdsa")
    statement = {
        "_type": signing.STATEMENT_TYPE,
        "subject": [{"name": "x", "digest": {"sha256": "ab" * 32}}],
        "predicateType": "https://example.invalid/p",
        "predicate": {},
    }
    data = signing.sign(json.dumps(statement).encode(), signing.load_signer(tmp_path / "ec"))
    assert signing.open_envelope(data, signing.load_public_key(pub), "e") == statement
    assert json.loads(data)["signatures"][0]["keyid"] == keyid
    Envelope.from_dict(json.loads(data)).verify_signature(load_public_key_from_file(str(pub)))


def rewrite_referrer(src: Path, dst: Path, artifact_type: str, document=None, subject=None):
    """A copy of layout ``src`` whose ``artifact_type`` referrer has ``document`` bytes and/or ``subject`` digest,
    with every digest made consistent again (so only the change itself can be caught)."""
    shutil.copytree(src, dst)
    blobs = dst / "blobs" / "sha256"
    idx = index(dst)
    for d in idx["manifests"]:
        if d.get("artifactType") != artifact_type:
            continue
        manifest = json.loads((blobs / d["digest"][7:]).read_bytes())
        if document is not None:
            (blobs / sha_bytes(document)).write_bytes(document)
            manifest["layers"][0].update(digest="sha256:" + sha_bytes(document), size=len(document))
        if subject is not None:
            manifest["subject"]["digest"] = subject
        data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        (blobs / sha_bytes(data)).write_bytes(data)
        d.update(digest="sha256:" + sha_bytes(data), size=len(data))
    (dst / "index.json").write_text(json.dumps(idx))
    return dst


def one_line(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    for word in words:
        assert word in r.stderr, r.stderr


def test_bad_referrers_are_refused_with_one_line(world, tmp_path):
    layout = world["root"] / "a.oci"
    spdx = referrer_blob(layout, "application/spdx+json")
    # a truncated SBOM blob: its digest no longer matches
    cut = tmp_path / "cut.oci"
    shutil.copytree(layout, cut)
    (cut / "blobs/sha256" / sha_bytes(spdx)).write_bytes(spdx[:-20])
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line(trainer("image", "sbom", cut), 2, "corrupt")
    # an SBOM altered and re-hashed consistently: the signed provenance names the original
    altered = rewrite_referrer(
        layout, tmp_path / "altered.oci", "application/spdx+json", document=spdx.replace(b'"1.0"', b'"1.1"')
    )
    assert trainer("image", "sbom", altered).returncode == 0  # digests consistent, so only the signature can tell
    one_line(trainer("verify", altered, "--key", world["pub"]), 1, "application/spdx+json", "signed provenance names")
    # ... and a truncated one fails its validation
    truncated = rewrite_referrer(layout, tmp_path / "truncated.oci", "application/spdx+json", document=spdx[:200])
    one_line(trainer("image", "sbom", truncated, "--validate"), 2, "SPDX")
    cdx = referrer_blob(layout, "application/vnd.cyclonedx+json")
    bad_cdx = rewrite_referrer(
        layout,
        tmp_path / "badcdx.oci",
        "application/vnd.cyclonedx+json",
        document=cdx.replace(b'"specVersion": "1.6"', b'"specVersion": 1.6'),
    )
    one_line(trainer("image", "sbom", bad_cdx, "--format", "cyclonedx", "--validate"), 2, "CycloneDX")
    # a referrer whose subject is another image
    other = rewrite_referrer(
        layout, tmp_path / "other.oci", "application/spdx+json", subject=world["v2"]["manifest_digest"]
    )
    one_line(
        trainer("image", "sbom", other), 2, "has subject", world["v2"]["manifest_digest"], "not this image's manifest"
    )
    # an altered provenance: payload changed, signature kept
    envelope = json.loads(referrer_blob(layout, "application/vnd.dsse.envelope.v1+json"))
    statement = statement_of(json.dumps(envelope).encode())
    statement["predicate"]["buildDefinition"]["externalParameters"]["revision"] = "forged"
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    forged = rewrite_referrer(
        layout, tmp_path / "forged.oci", "application/vnd.dsse.envelope.v1+json", document=json.dumps(envelope).encode()
    )
    one_line(trainer("verify", forged, "--key", world["pub"]), 1, "does not verify")
    # a truncated envelope
    short = rewrite_referrer(
        layout,
        tmp_path / "short.oci",
        "application/vnd.dsse.envelope.v1+json",
        document=json.dumps(envelope).encode()[:100],
    )
    one_line(trainer("verify", short, "--key", world["pub"]), 1, "not valid JSON")
    # a provenance signed for another image, attached to this one
    v2_statement = {**statement, "subject": [{"name": "x", "digest": {"sha256": world["v2"]["manifest_digest"][7:]}}]}
    from trainer import signing

    resigned = signing.sign(json.dumps(v2_statement).encode(), signing.load_signer(world["key"]))
    moved = rewrite_referrer(layout, tmp_path / "moved.oci", "application/vnd.dsse.envelope.v1+json", document=resigned)
    one_line(trainer("verify", moved, "--key", world["pub"]), 1, "is not this image's manifest")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        before + ["altered.oci", "truncated.oci", "badcdx.oci", "other.oci", "forged.oci", "short.oci", "moved.oci"]
    )


def test_bad_keys_are_refused_and_nothing_is_written(world, tmp_path):
    pub_before = world["pub"].read_bytes()
    one_line(trainer("keygen", "--out", world["key"]), 2, "exists")
    assert world["pub"].read_bytes() == pub_before
    (tmp_path / "notakey").write_text("hello\n")
    r = trainer(
        "image",
        "build",
        "--lock",
        world["lock"],
        "--out",
        tmp_path / "o.oci",
        "--cache",
        world["cache"],
        "--offline",
        "--bundle-root",
        world["bundle"],
        "-q",
        "--sign-key",
        tmp_path / "notakey",
    )
    one_line(r, 2, "--sign-key", "PKCS#8")
    assert not (tmp_path / "o.oci").exists()
    one_line(trainer("verify", world["root"] / "a.oci", "--key", tmp_path / "notakey"), 2, "not a PEM public key")


def test_image_diff_reads_the_sboms(world):
    r = trainer("image", "diff", world["root"] / "a.oci", world["root"] / "v2.oci")
    assert r.returncode == 1
    assert "sbom pkg:pypi/beta: 2.0 -> 2.1" in r.stdout.splitlines()
    data = json.loads(trainer("image", "diff", "--json", world["root"] / "a.oci", world["root"] / "v2.oci").stdout)
    assert [p["package"] for p in data["sbom"]] == ["pkg:pypi/beta"]
    same = trainer("image", "diff", world["root"] / "a.oci", world["root"] / "b.tar")
    assert (same.returncode, same.stdout.strip()) == (0, "identical")


def test_the_readme_smoke_image_built_twice_carries_identical_documents(tmp_path):
    """lockfiles/smoke.lock.json as the README builds it (its two wheels from PyPI, its generated git source)."""
    cache = tmp_path / "cas"
    made = trainer("image", "smoke-source", tmp_path / "src")
    assert made.returncode == 0, made.stderr
    src = json.loads(made.stdout.splitlines()[0])
    assert trainer("cache", "--cache", cache, "add", src["archive"], "--sha256", src["sha256"]).returncode == 0
    fetched = trainer("cache", "--cache", cache, "fetch", "--lock", REPO_ROOT / "lockfiles/smoke.lock.json")
    if fetched.returncode != 0:
        pytest.skip(f"PyPI not reachable for the smoke lock's wheels: {fetched.stderr.strip()[-200:]}")
    key = tmp_path / "key"
    assert trainer("keygen", "--out", key).returncode == 0
    out = []
    for name in ("one", "two"):
        r = trainer(
            "image",
            "build",
            "--lock",
            REPO_ROOT / "lockfiles/smoke.lock.json",
            "--out",
            tmp_path / f"{name}.oci",
            "--cache",
            cache,
            "--offline",
            "--revision",
            "0.1.0",
            "--sign-key",
            key,
            "--json",
            "-q",
        )
        assert r.returncode == 0, r.stderr
        out.append(json.loads(r.stdout))
    assert out[0]["manifest_digest"] == out[1]["manifest_digest"]
    for kind in ("application/spdx+json", "application/vnd.cyclonedx+json", "application/vnd.dsse.envelope.v1+json"):
        assert referrer_blob(tmp_path / "one.oci", kind) == referrer_blob(tmp_path / "two.oci", kind)
    assert trainer("image", "sbom", tmp_path / "one.oci", "--validate").returncode == 0
    assert trainer("image", "sbom", tmp_path / "one.oci", "--format", "cyclonedx", "--validate").returncode == 0
    assert trainer("verify", tmp_path / "two.oci", "--key", f"{key}.pub").returncode == 0


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
