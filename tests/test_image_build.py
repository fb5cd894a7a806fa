"""Images from locks: reproducible digests, layer caching, refused inputs, diff, and skopeo/umoci validation.

Everything is built offline from fixtures the tests make (tiny wheels, a git source archive, a lock).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from image_fixtures import make_demo_inputs as make_inputs
from image_fixtures import make_wheel

trainer = helpers.run_trainer


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    lock, files, bundle = make_inputs(root)
    lock2, files2, _ = make_inputs(root, beta="2.1")
    return {"root": root, "lock": lock, "files": files, "bundle": bundle, "lock2": lock2, "files2": files2}


def seeded_cache(path: Path, files, reverse=False):
    for f in reversed(files) if reverse else files:
        r = trainer("cache", "--cache", path, "add", f)
        assert r.returncode == 0, r.stderr
    return path


def build(inputs, out, cache, lock=None, extra=(), **kw):
    r = trainer(
        "image",
        "build",
        "--lock",
        lock or inputs["lock"],
        "--out",
        out,
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "--revision",
        "test",
        "--json",
        *extra,
        **kw,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def built(inputs, tmp_path_factory):
    work = tmp_path_factory.mktemp("built")
    cache = seeded_cache(work / "cas", inputs["files"])
    result = build(inputs, work / "a.oci", cache, extra=["--archive", work / "a.oci.tar"])
    return {"work": work, "cache": cache, "result": result, "layout": work / "a.oci", "archive": work / "a.oci.tar"}


def test_build_writes_an_oci_layout_with_grouped_layers(built):
    result = built["result"]
    assert [layer["name"] for layer in result["layers"]] == ["torch", "rest", "sources", "bundle"]
    layout = built["layout"]
    index = json.loads((layout / "index.json").read_text())
    digest = index["manifests"][0]["digest"]
    assert digest == result["manifest_digest"]
    manifest_bytes = (layout / "blobs" / "sha256" / digest[7:]).read_bytes()
    assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == digest
    manifest = json.loads(manifest_bytes)
    config = json.loads((layout / "blobs" / "sha256" / manifest["config"]["digest"][7:]).read_bytes())
    assert config["created"] == "2026-01-01T00:00:00Z"
    assert (
        config["rootfs"]["diff_ids"]
        == [layer["digest"] for layer in manifest["layers"]]
        == [layer["diff_id"] for layer in result["layers"]]
    )
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in config["config"]["Env"]
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.revision"] == "test"
    assert set(labels) >= {"org.opencontainers.image.source", "org.opencontainers.image.version"}
    assert [h["created_by"] for h in config["history"]] == [
        f"recipe-bundle layer {n}" for n in ("torch", "rest", "sources", "bundle")
    ]
    for layer in manifest["layers"]:
        blob = layout / "blobs" / "sha256" / layer["digest"][7:]
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == layer["digest"][7:]
        assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    # the rest layer holds alpha installed by installer, its script pointing at the lock's interpreter
    rest = tarfile.open(layout / "blobs" / "sha256" / manifest["layers"][1]["digest"][7:])
    script = rest.extractfile("usr/local/bin/alpha").read()
    assert script.startswith(b"#!/usr/local/bin/python3.12\n") and rest.getmember("usr/local/bin/alpha").mode == 0o755
    assert (
        rest.extractfile("usr/local/lib/python3.12/site-packages/alpha-1.0.dist-info/INSTALLER").read()
        == b"recipe-bundle\n"
    )
    assert not any(n.endswith(".pyc") for n in rest.getnames())


def test_digest_command_reads_layout_and_archive(built):
    for target in (built["layout"], built["archive"]):
        r = trainer("image", "digest", target)
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == built["result"]["manifest_digest"]
    r = trainer("image", "digest", "--json", built["archive"])
    data = json.loads(r.stdout)
    assert [layer["diff_id"] for layer in data["layers"]] == [layer["diff_id"] for layer in built["result"]["layers"]]
    assert [layer["size"] for layer in data["layers"]] == [layer["size"] for layer in built["result"]["layers"]]


def test_same_lock_same_digest_under_different_conditions(inputs, built, tmp_path):
    """Other cwd, TZ, umask, cache fill order, input mtimes and wall time: the same bytes."""
    for f in inputs["files"] + [inputs["bundle"] / "conf" / "env" / "recipe.yaml"]:
        os.utime(f, (time.time() - 86400 * 30, time.time() - 86400 * 30))
    cache = seeded_cache(tmp_path / "other-cache", inputs["files"], reverse=True)
    time.sleep(1.1)
    wd = tmp_path / "elsewhere"
    wd.mkdir()
    r = trainer(
        "image",
        "build",
        "--lock",
        inputs["lock"],
        "--out",
        tmp_path / "b.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "--revision",
        "test",
        "--archive",
        tmp_path / "b.tar",
        "-q",
        cwd=wd,
        env={"TZ": "Pacific/Kiritimati", "LC_ALL": "C"},
    )
    assert r.returncode == 0, r.stderr
    # umask is inherited by the child: run the same build once more under umask 077 through a shell
    r2 = subprocess.run(
        [
            "sh",
            "-c",
            f'umask 077 && exec "$0" -m trainer image build --lock {inputs["lock"]} '
            f"--out {tmp_path / 'c.oci'} --cache {cache} --offline --bundle-root {inputs['bundle']} "
            f"--revision test -q",
            sys.executable,
        ],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        cwd=wd,
    )
    assert r2.returncode == 0, r2.stderr
    digest = built["result"]["manifest_digest"]
    assert r.stdout.splitlines()[-1] == r2.stdout.splitlines()[-1] == digest
    assert (tmp_path / "b.tar").read_bytes() == built["archive"].read_bytes()


def test_changed_pin_rebuilds_only_its_layer_and_diff_names_it(inputs, built, tmp_path):
    cache = built["cache"]
    seeded_cache(cache, inputs["files2"])
    result = build(inputs, tmp_path / "v2.oci", cache, lock=inputs["lock2"])
    status = {layer["name"]: layer["status"] for layer in result["layers"]}
    assert status == {"torch": "built", "rest": "cached", "sources": "cached", "bundle": "built"}
    assert result["manifest_digest"] != built["result"]["manifest_digest"]
    r = trainer("image", "diff", built["layout"], tmp_path / "v2.oci")
    assert r.returncode == 1, r.stderr
    assert "python beta: 2.0 -> 2.1" in r.stdout
    assert "layer recipe-bundle layer rest: same" in r.stdout
    assert "changed usr/local/lib/python3.12/site-packages/beta/__init__.py" in r.stdout
    assert "added   usr/local/lib/python3.12/site-packages/beta-2.1.dist-info/METADATA" in r.stdout
    data = json.loads(trainer("image", "diff", "--json", built["layout"], tmp_path / "v2.oci").stdout)
    assert data["distributions"] == [{"name": "beta", "old": "2.0", "new": "2.1"}]
    assert [c["field"] for c in data["config"]] == ["Labels.dev.recipe-bundle.lock.sha256"]
    # an image against its own lock, and against the other lock
    assert trainer("image", "diff", built["layout"], inputs["lock"]).stdout.strip() == "identical"
    other = trainer("image", "diff", built["layout"], inputs["lock2"])
    assert other.returncode == 1 and "python beta: 2.0 -> 2.1" in other.stdout


def test_skopeo_and_umoci_accept_the_layout(built, tmp_path):
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (bin/setup installs it)")
    inspect = json.loads(
        subprocess.run(
            ["skopeo", "inspect", f"oci:{built['layout']}:latest"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert inspect["Digest"] == built["result"]["manifest_digest"]
    assert inspect["Layers"] == [layer["diff_id"] for layer in built["result"]["layers"]]
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{built['layout']}:latest", f"docker-archive:{tmp_path / 'd.tar'}:smoke:latest"],
        check=True,
        capture_output=True,
    )
    # the docker-archive skopeo wrote is the same image
    r = trainer("image", "diff", built["layout"], tmp_path / "d.tar")
    assert (r.returncode, r.stdout.strip()) == (0, "identical")
    subprocess.run(
        ["umoci", "unpack", "--rootless", "--image", f"{built['layout']}:latest", str(tmp_path / "b")],
        check=True,
        capture_output=True,
    )
    rootfs = tmp_path / "b" / "rootfs"
    assert (rootfs / "opt/src/demo/demo/run.py").read_bytes() == b"print(1)\n"
    stamp = json.loads((rootfs / "etc/recipe-bundle/lock.json").read_text())
    assert stamp["distributions"] == {"alpha": "1.0", "beta": "2.0"}
    assert (rootfs / "opt/recipe-bundle/conf/env/recipe.yaml").is_file()


def test_tampered_cache_entry_is_refused_and_nothing_written(inputs, tmp_path):
    cache = seeded_cache(tmp_path / "cas", inputs["files"])
    blob = cache / "sha256" / hashlib.sha256(inputs["files"][0].read_bytes()).hexdigest()
    os.chmod(blob, 0o644)
    blob.write_bytes(blob.read_bytes()[:-10])  # truncated
    r = trainer(
        "image",
        "build",
        "--lock",
        inputs["lock"],
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "-q",
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "wheel alpha-1.0-py3-none-any.whl is corrupt" in r.stderr
    assert not (tmp_path / "o.oci").exists() and not blob.exists()
    # now it is simply missing: one line with the artifact and its hash
    r = trainer(
        "image",
        "build",
        "--lock",
        inputs["lock"],
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "-q",
    )
    assert (
        r.returncode == 2 and f"missing input wheel alpha-1.0-py3-none-any.whl sha256:{blob.name} (offline)" in r.stderr
    )


def test_cache_trust_survives_removed_outputs_but_not_a_write(inputs, tmp_path, monkeypatch):
    """Removing an old --out (hard links to the cache's layer blobs) moves their ctime: the next build still
    trusts them without re-hashing; a write to a blob (same size) is caught and the layer rebuilt."""
    import trainer.image.cas as cas
    from trainer.image.build import build_image

    cache = cas.Cache(seeded_cache(tmp_path / "cas", inputs["files"]))
    hashed = []
    real = cas.hash_file
    monkeypatch.setattr(
        cas, "hash_file", lambda path, description="": hashed.append(Path(path).name) or real(path, description)
    )
    first = build_image(inputs["lock"], tmp_path / "a.oci", cache, inputs["bundle"], offline=True)
    hashed.clear()
    shutil.rmtree(tmp_path / "a.oci")
    again = build_image(inputs["lock"], tmp_path / "b.oci", cache, inputs["bundle"], offline=True)
    assert again.manifest_digest == first.manifest_digest and hashed == []
    layer = next(d for n, d, _, _ in again.layers if n == "rest")[7:]
    blob = cache.blob_path(layer)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes(data))
    third = build_image(inputs["lock"], tmp_path / "c.oci", cache, inputs["bundle"], offline=True)
    assert layer in hashed and third.manifest_digest == first.manifest_digest
    assert hashlib.sha256(cache.blob_path(layer).read_bytes()).hexdigest() == layer


def test_cache_add_checks_the_hash(inputs, tmp_path):
    wheel = inputs["files"][0]
    r = trainer("cache", "--cache", tmp_path / "cas", "add", wheel, "--sha256", "0" * 64)
    assert r.returncode == 2 and "!= expected 000" in r.stderr
    assert not list((tmp_path / "cas").glob("sha256/*"))
    r = trainer(
        "cache", "--cache", tmp_path / "cas", "add", wheel, "--sha256", hashlib.sha256(wheel.read_bytes()).hexdigest()
    )
    assert r.returncode == 0 and r.stdout.strip() == "sha256:" + hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert trainer("cache", "--cache", tmp_path / "cas", "verify").returncode == 0


def _lock_with(inputs, tmp_path, wheel_path, name="alpha", version="1.0"):
    lock = json.loads(inputs["lock"].read_text())
    lock["wheels"] = [
        {
            "name": name,
            "version": version,
            "filename": wheel_path.name,
            "group": "rest",
            "url": "https://files.pythonhosted.org/x/" + wheel_path.name,
            "sha256": hashlib.sha256(wheel_path.read_bytes()).hexdigest(),
        }
    ]
    lock["sources"] = []
    path = tmp_path / "bad.lock.json"
    path.write_text(json.dumps(lock))
    return path


@pytest.mark.parametrize(
    "member,target,message",
    [
        ("../evil.py", None, "absolute or '..' path"),
        ("/etc/evil", None, "absolute or '..' path"),
        ("alpha/link", "/etc/passwd", "is a symlink"),
    ],
)
def test_bad_wheels_are_refused(inputs, tmp_path, member, target, message):
    info = zipfile.ZipInfo(member, (2020, 1, 1, 0, 0, 0))
    if target:
        info.external_attr = (0o120777) << 16
    bad = make_wheel(
        tmp_path, "alpha", "1.0", {"alpha/__init__.py": b""}, extra_members=[(info, (target or "x").encode())]
    )
    lock = _lock_with(inputs, tmp_path, bad)
    cache = seeded_cache(tmp_path / "cas", [bad])
    r = trainer(
        "image",
        "build",
        "--lock",
        lock,
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "-q",
    )
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "o.oci").exists()


def test_git_archive_must_match_the_locked_tree(inputs, tmp_path):
    lock = json.loads(inputs["lock"].read_text())
    lock["sources"][0]["tree"] = "1" * 40
    path = tmp_path / "tree.lock.json"
    path.write_text(json.dumps(lock))
    cache = seeded_cache(tmp_path / "cas", inputs["files"])
    r = trainer(
        "image",
        "build",
        "--lock",
        path,
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        inputs["bundle"],
        "-q",
    )
    assert r.returncode == 2 and "lock says 1111111111111111111111111111111111111111" in r.stderr


def test_git_tree_id_matches_git(inputs):
    from trainer.image.sources import git_tree_id

    lock = json.loads(inputs["lock"].read_text())
    files = {"README.md": ("100644", b"demo\n"), "demo/run.py": ("100644", b"print(1)\n")}
    assert git_tree_id(files) == lock["sources"][0]["tree"]  # the tree git itself computed in make_git_source


def test_kill_9_and_concurrent_builds_leave_a_consistent_cache(inputs, built, tmp_path):
    cache = seeded_cache(tmp_path / "cas", inputs["files"])
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "image",
        "build",
        "--lock",
        str(inputs["lock"]),
        "--out",
        str(tmp_path / "k.oci"),
        "--cache",
        str(cache),
        "--offline",
        "--bundle-root",
        str(inputs["bundle"]),
        "--revision",
        "test",
        "-q",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for delay in (0.3, 0.6, 0.9):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    procs = [
        subprocess.Popen(
            cmd[:8] + [str(tmp_path / f"p{i}.oci")] + cmd[9:],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o[0].splitlines()[-1] for o in outs} == {built["result"]["manifest_digest"]}
    r = trainer("image", "build", *cmd[5:])
    assert r.stdout.splitlines()[-1] == built["result"]["manifest_digest"]
    verify = trainer("cache", "--cache", cache, "verify")
    # the builds after the kills removed the partial blobs and spools the killed ones left
    assert verify.returncode == 0 and verify.stdout.strip().endswith(", 0 corrupt, 0 debris")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
