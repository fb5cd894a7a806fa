"""``oci`` bases: seeding a base image into the cache (`trainer cache add-image`) and building on top of it.

The base images are written here (one gzip layer made with gzip mtime 0); nothing is downloaded.
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from image_fixtures import make_base_image, make_wheel, small_lock
from trainer.errors import UserError
from trainer.image.oci import write_archive
from trainer.lock.imagelock import load_lock, validate_lock

EPOCH = 1767225600
BASE_FILES = {
    "etc/os-release": (b"ID=tinybase\n", 0o644),
    "usr/local/bin/python3.12": (b"#!/bin/sh\necho fake python\n", 0o755),
    "usr/local/lib/python3.12/site-packages/base_pkg/__init__.py": (b"FROM_BASE = True\n", 0o644),
}
BASE_CONFIG = {
    "Entrypoint": ["/usr/local/bin/python3.12"],
    "WorkingDir": "/workspace",
    "User": "0",
    "Labels": {"org.opencontainers.image.source": "https://example.invalid/base", "base.only": "yes"},
}


trainer = helpers.run_trainer


def write_lock(root: Path, name: str, base_digest: str, wheel: Path, version: str, image=None, base_extra=None) -> Path:
    lock = small_lock(
        name,
        EPOCH,
        [(wheel, "alpha", version, "rest")],
        [],
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "BASE_ONLY": "overridden"},
    )
    lock["base"] = {
        "type": "oci",
        "reference": f"example.invalid/tinybase:1@{base_digest}",
        "digest": base_digest,
        **(base_extra or {}),
    }
    lock["image"].pop("entrypoint")
    lock["image"].update(image or {})
    path = root / f"{name}.lock.json"
    path.write_text(json.dumps(lock, indent=1))
    return path


def build(world, lock, out, cache, *extra):
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
        world["bundle"],
        "--revision",
        "test",
        "--json",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def read_image(layout: Path):
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    config = json.loads((layout / "blobs/sha256" / manifest["config"]["digest"][7:]).read_bytes())
    return manifest, config


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("oci-base")
    base, digest = make_base_image(root / "base", BASE_FILES, EPOCH, BASE_CONFIG)
    wheel = make_wheel(root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    (root / "v2").mkdir()
    wheel2 = make_wheel(root / "v2", "alpha", "1.1", {"alpha/__init__.py": b"X = 2\n"})
    lock = write_lock(root, "based", digest, wheel, "1.0")
    bundle = root / "bundle"
    (bundle / "conf").mkdir(parents=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    cache = root / "cas"
    r = trainer("cache", "--cache", cache, "add-image", base, "--lock", lock, "--json")
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    for f in (wheel, wheel2):
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    world = {
        "root": root,
        "base": base,
        "digest": digest,
        "wheel": wheel,
        "wheel2": wheel2,
        "lock": lock,
        "bundle": bundle,
        "cache": cache,
        "resolved": resolved,
    }
    world["result"] = build(world, lock, root / "a.oci", cache)
    world["layout"] = root / "a.oci"
    return world


def base_layer(world):
    manifest = json.loads((world["base"] / "blobs/sha256" / world["digest"][7:]).read_bytes())
    return manifest["layers"][0]


def test_add_image_resolves_the_base_block(world):
    layer = base_layer(world)
    blob = (world["base"] / "blobs/sha256" / layer["digest"][7:]).read_bytes()
    diff_id = "sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest()
    manifest = json.loads((world["base"] / "blobs/sha256" / world["digest"][7:]).read_bytes())
    assert world["resolved"] == {
        "type": "oci",
        "reference": f"example.invalid/tinybase:1@{world['digest']}",
        "digest": world["digest"],
        "config_digest": manifest["config"]["digest"],
        "layers": [
            {
                "digest": layer["digest"],
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "size": len(blob),
                "diff_id": diff_id,
            }
        ],
    }
    for d in (world["digest"], manifest["config"]["digest"], layer["digest"]):
        assert (world["cache"] / "sha256" / d[7:]).is_file()


def test_build_reuses_base_blobs_and_continues_its_config(world):
    manifest, config = read_image(world["layout"])
    layer = base_layer(world)
    # the base layer is the very same compressed blob, ours follow uncompressed
    assert manifest["layers"][0] == {
        "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
        "digest": layer["digest"],
        "size": layer["size"],
    }
    ours = [layer for layer in world["result"]["layers"]]
    assert [layer["name"] for layer in ours] == ["rest", "bundle"]
    assert [layer["digest"] for layer in manifest["layers"][1:]] == [layer["diff_id"] for layer in ours]
    assert config["rootfs"]["diff_ids"] == [world["resolved"]["layers"][0]["diff_id"]] + [
        layer["diff_id"] for layer in ours
    ]
    assert [h["created_by"] for h in config["history"]] == [
        "base: add files",
        "base: ENV BASE_ONLY=1",
        "recipe-bundle layer rest",
        "recipe-bundle layer bundle",
    ]
    inner = config["config"]
    assert inner["Env"] == [
        "BASE_ONLY=overridden",
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "PATH=/opt/base/bin:/usr/local/bin:/usr/bin:/bin",
    ]
    # the lock sets no entrypoint here: the base's Entrypoint and Cmd stay; the lock's WorkingDir wins
    assert inner["Entrypoint"] == ["/usr/local/bin/python3.12"] and inner["Cmd"] == ["/bin/sh"]
    assert inner["WorkingDir"] == "/opt/recipe-bundle" and inner["User"] == "0"
    assert inner["Labels"]["base.only"] == "yes"
    assert inner["Labels"]["org.opencontainers.image.source"] == "https://example.invalid/recipe-bundle"
    assert (config["architecture"], config["os"], config["created"]) == ("amd64", "linux", "2026-01-01T00:00:00Z")


def test_same_lock_and_base_from_an_oci_archive_give_the_same_digest(world, tmp_path):
    archive = tmp_path / "base.tar"
    write_archive(world["base"], archive, EPOCH)
    cache = tmp_path / "cas"
    r = trainer("cache", "--cache", cache, "add-image", archive, "--digest", world["digest"], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"] == world["resolved"]["layers"]
    assert trainer("cache", "--cache", cache, "add", world["wheel"]).returncode == 0
    result = build(world, world["lock"], tmp_path / "b.oci", cache)
    assert result["manifest_digest"] == world["result"]["manifest_digest"]
    again = build(world, world["lock"], tmp_path / "b.oci", cache)
    assert again["manifest_digest"] == world["result"]["manifest_digest"]
    assert {layer["status"] for layer in again["layers"]} == {"cached", "built"}  # rest cached, bundle always written


def test_entrypoint_and_cmd_from_the_lock(world, tmp_path):
    lock = write_lock(
        tmp_path,
        "ep",
        world["digest"],
        world["wheel"],
        "1.0",
        image={"entrypoint": ["python3"], "env": {"PATH": "/opt/venv/bin:/usr/bin"}},
    )
    _, config = read_image(Path(build(world, lock, tmp_path / "ep.oci", world["cache"])["out"]))
    assert config["config"]["Entrypoint"] == ["python3"] and "Cmd" not in config["config"]  # as a Dockerfile ENTRYPOINT
    assert "PATH=/opt/venv/bin:/usr/bin" in config["config"]["Env"]
    lock = write_lock(tmp_path, "cmd", world["digest"], world["wheel"], "1.0", image={"cmd": ["-m", "alpha"]})
    _, config = read_image(Path(build(world, lock, tmp_path / "cmd.oci", world["cache"])["out"]))
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/python3.12"] and config["config"]["Cmd"] == [
        "-m",
        "alpha",
    ]


def test_skopeo_and_umoci_see_the_base_files_and_ours(world, tmp_path):
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (bin/setup installs it)")
    inspect = json.loads(
        subprocess.run(
            ["skopeo", "inspect", f"oci:{world['layout']}:latest"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert inspect["Digest"] == world["result"]["manifest_digest"]
    assert inspect["Layers"] == [base_layer(world)["digest"]] + [
        layer["diff_id"] for layer in world["result"]["layers"]
    ]
    subprocess.run(
        ["umoci", "unpack", "--rootless", "--image", f"{world['layout']}:latest", str(tmp_path / "u")],
        check=True,
        capture_output=True,
    )
    rootfs = tmp_path / "u" / "rootfs"
    assert (rootfs / "etc/os-release").read_bytes() == b"ID=tinybase\n"
    site = rootfs / "usr/local/lib/python3.12/site-packages"
    assert (site / "base_pkg/__init__.py").read_bytes() == b"FROM_BASE = True\n"
    assert (site / "alpha/__init__.py").read_bytes() == b"X = 1\n"
    stamp = json.loads((rootfs / "etc/recipe-bundle/lock.json").read_text())
    assert stamp["base"]["digest"] == world["digest"]
    # a real `skopeo copy ... dir:` is a seed with the same manifest digest and blobs
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{world['base']}", f"dir:{tmp_path / 'sk'}"], check=True, capture_output=True
    )
    r = trainer("cache", "--cache", tmp_path / "cas", "add-image", tmp_path / "sk", "--lock", world["lock"], "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == world["resolved"], r.stderr


def test_skopeo_dir_copy_with_docker_media_types_is_a_seed(world, tmp_path):
    """Docker Hub serves Docker schema 2 manifests; a `skopeo copy ... dir:` keeps them byte for byte."""
    base, digest = make_base_image(tmp_path / "dbase", BASE_FILES, EPOCH, BASE_CONFIG, docker_types=True)
    seed = tmp_path / "dir-seed"
    seed.mkdir()
    for blob in (base / "blobs/sha256").iterdir():
        name = "manifest.json" if blob.name == digest[7:] else blob.name
        shutil.copyfile(blob, seed / name)
    (seed / "version").write_text("Directory Transport Version: 1.1\n")
    cache = tmp_path / "cas"
    lock = write_lock(tmp_path, "docker-based", digest, world["wheel"], "1.0")
    r = trainer("cache", "--cache", cache, "add-image", seed, "--lock", lock, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"][0]["mediaType"] == "application/vnd.docker.image.rootfs.diff.tar.gzip"
    assert trainer("cache", "--cache", cache, "add", world["wheel"]).returncode == 0
    result = build(world, lock, tmp_path / "d.oci", cache)
    manifest, _ = read_image(tmp_path / "d.oci")
    # the same bytes under the OCI media type
    assert manifest["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert manifest["layers"][0]["digest"] == base_layer(world)["digest"]
    assert result["manifest_digest"] != world["result"]["manifest_digest"]  # another base, another lock


def test_tampered_base_blob_in_the_cache_is_refused_and_nothing_written(world, tmp_path):
    cache = tmp_path / "cas"
    shutil.copytree(world["cache"], cache)
    blob = cache / "sha256" / base_layer(world)["digest"][7:]
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[20] ^= 0xFF
    blob.write_bytes(bytes(data))
    r = trainer(
        "image",
        "build",
        "--lock",
        world["lock"],
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        world["bundle"],
        "-q",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"base image layer 1/1 {base_layer(world)['digest']} of example.invalid/tinybase:1@" in r.stderr
    assert "is corrupt" in r.stderr
    assert not (tmp_path / "o.oci").exists() and not blob.exists()
    # then it is missing: one line naming it and how to seed it
    r = trainer(
        "image",
        "build",
        "--lock",
        world["lock"],
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        world["bundle"],
        "-q",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"missing base image layer 1/1 {base_layer(world)['digest']}" in r.stderr
    assert "trainer cache add-image base-image --lock" in r.stderr
    assert not (tmp_path / "o.oci").exists()


def test_tampered_seed_or_wrong_digest_is_refused_and_nothing_added(world, tmp_path):
    seed = tmp_path / "seed"
    shutil.copytree(world["base"], seed)
    layer = seed / "blobs/sha256" / base_layer(world)["digest"][7:]
    layer.write_bytes(layer.read_bytes()[:-4])
    cache = tmp_path / "cas"
    r = trainer("cache", "--cache", cache, "add-image", seed, "--lock", world["lock"])
    error = r.stderr.splitlines()[-1]  # after the progress line "adding base layer 1/1 ..."
    assert (
        r.returncode == 2
        and error.startswith("trainer cache: error: ")
        and error.endswith("named by the manifest (not added)")
    )
    assert not list((cache / "sha256").glob("*"))
    r = trainer("cache", "--cache", cache, "add-image", world["base"], "--digest", "sha256:" + "ab" * 32)
    assert r.returncode == 2 and "does not list manifest sha256:abab" in r.stderr
    # a layer whose bytes match the manifest but not the config's diff_id
    bad_diff = tmp_path / "bad-diff"
    base, digest = make_base_image(bad_diff, BASE_FILES, EPOCH, BASE_CONFIG)
    config_path = next(p for p in (base / "blobs/sha256").iterdir() if b'"rootfs"' in p.read_bytes())
    config = json.loads(config_path.read_bytes())
    config["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64]
    new_config = json.dumps(config).encode()
    (base / "blobs/sha256" / hashlib.sha256(new_config).hexdigest()).write_bytes(new_config)
    manifest = json.loads((base / "blobs/sha256" / digest[7:]).read_bytes())
    manifest["config"].update(digest="sha256:" + hashlib.sha256(new_config).hexdigest(), size=len(new_config))
    manifest_bytes = json.dumps(manifest).encode()
    new_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    (base / "blobs/sha256" / new_digest[7:]).write_bytes(manifest_bytes)
    (base / "index.json").write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [{"mediaType": manifest["mediaType"], "digest": new_digest, "size": len(manifest_bytes)}],
            }
        )
    )
    r = trainer("cache", "--cache", cache, "add-image", base)
    assert r.returncode == 2 and "!= the config's diff_id sha256:0000" in r.stderr
    assert not list((cache / "sha256").glob("*"))


def test_docker_archive_is_refused_with_the_reason(world, tmp_path):
    archive = tmp_path / "d.tar"
    with tarfile.open(archive, "w") as tar:
        data = b'[{"Config": "c.json", "Layers": []}]'
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = trainer("cache", "--cache", tmp_path / "cas", "add-image", archive)
    assert (
        r.returncode == 2 and "a docker-archive has no registry manifest" in r.stderr and "dir:base-image" in r.stderr
    )


def test_resolved_base_block_must_match_the_cache(world, tmp_path):
    good = write_lock(
        tmp_path,
        "resolved",
        world["digest"],
        world["wheel"],
        "1.0",
        base_extra={k: world["resolved"][k] for k in ("config_digest", "layers")},
    )
    assert load_lock(good)["base"]["layers"] == world["resolved"]["layers"]  # well-formed (stack.json pins sglang)
    malformed = json.loads(good.read_text())
    malformed["base"]["layers"][0]["diff_id"] = "c93b90c2"
    with pytest.raises(UserError, match=r"base\.layers\[0\]\.diff_id: expected sha256:<64 hex>"):
        validate_lock(malformed, "m")
    build(world, good, tmp_path / "r.oci", world["cache"])
    layers = [dict(world["resolved"]["layers"][0], diff_id="sha256:" + "1" * 64)]
    bad = write_lock(tmp_path, "bad", world["digest"], world["wheel"], "1.0", base_extra={"layers": layers})
    r = trainer(
        "image",
        "build",
        "--lock",
        bad,
        "--out",
        tmp_path / "x.oci",
        "--cache",
        world["cache"],
        "--offline",
        "--bundle-root",
        world["bundle"],
        "-q",
    )
    assert r.returncode == 2 and "base.layers[0]: the lock does not match the cached manifest" in r.stderr
    assert not (tmp_path / "x.oci").exists()


def test_diff_aligns_base_layers_by_diff_id(world, tmp_path):
    lock = write_lock(tmp_path, "based", world["digest"], world["wheel2"], "1.1")
    build(world, lock, tmp_path / "v2.oci", world["cache"])
    r = trainer("image", "diff", "--json", world["layout"], tmp_path / "v2.oci")
    assert r.returncode == 1, r.stderr
    data = json.loads(r.stdout)
    assert data["layers"][0] == {
        "name": "base: add files",
        "diff_id": world["resolved"]["layers"][0]["diff_id"],
        "status": "same",
    }
    assert [(layer["name"], layer["status"]) for layer in data["layers"][1:]] == [
        ("recipe-bundle layer rest", "changed"),
        ("recipe-bundle layer bundle", "changed"),
    ]
    assert data["distributions"] == [{"name": "alpha", "old": "1.0", "new": "1.1"}]


def test_full_lock_verifies_but_needs_the_seeded_base(tmp_path):
    full = REPO_ROOT / "lockfiles" / "full.lock.json"
    r = trainer("lock", "verify", full)
    assert r.returncode == 0 and "base oci" in r.stdout, r.stderr
    digest = json.loads(full.read_text())["base"]["digest"]
    r = trainer(
        "image",
        "build",
        "--lock",
        full,
        "--out",
        tmp_path / "full.oci",
        "--cache",
        tmp_path / "empty-cas",
        "--offline",
        "-q",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert (
        f"missing base image manifest {digest} of lmsysorg/sglang:v0.5.16@{digest} (builds do not contact a "
        "registry; this base has not been seeded into the cache)"
    ) in r.stderr
    assert f"skopeo copy docker://lmsysorg/sglang:v0.5.16@{digest} dir:base-image" in r.stderr
    assert not (tmp_path / "full.oci").exists()


def test_an_index_manifest_without_a_digest_is_refused_on_one_line(tmp_path):
    # it used to end in a KeyError traceback: the manifest was looked up by the digest it does not have
    seed = tmp_path / "seed"
    (seed / "blobs/sha256").mkdir(parents=True)
    (seed / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (seed / "index.json").write_text(
        json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json"}]})
    )
    r = trainer("cache", "--cache", tmp_path / "cas", "add-image", seed)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == f"trainer cache: error: {seed}: index.json lists a manifest without a digest"
    assert not (tmp_path / "cas" / "sha256").exists() or not list((tmp_path / "cas" / "sha256").glob("*"))


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
