"""The signed binary cache (``trainer cache push|pull``, ``image build --substituter``) and ``trainer image push``,
against a real registry: Debian's ``docker-registry`` (distribution 2.8) started here on 127.0.0.1 with a fresh
storage directory, stopped at the end. The hostile cases tamper with the registry's own storage (a different
blob served for a digest, a truncated blob), forge or misplace entries, and point at a registry that is down or
never answers; each is refused in one line and the layer is built locally, to the same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

import helpers
from image_fixtures import free_port, local_registry, make_demo_inputs, push_then_pull

trainer = helpers.run_trainer
# what a failed download says when there is no network (getaddrinfo, connect)
OFFLINE = ("Name or service not known", "Temporary failure in name resolution", "Network is unreachable",
           "Connection refused", "timed out")  # fmt: skip
pytestmark = pytest.mark.skipif(
    shutil.which("docker-registry") is None or shutil.which("skopeo") is None,
    reason="needs docker-registry and skopeo (bin/setup installs them)",
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A distribution 2.8 registry on 127.0.0.1 (plain HTTP), its storage in a fresh directory; stopped after."""
    with local_registry(tmp_path_factory.mktemp("registry"), delete=True) as served:
        yield served


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The demo lock built once into cache ``a``; a team key pair and an attacker's."""
    root = tmp_path_factory.mktemp("world")
    lock, files, bundle = make_demo_inputs(root)
    cache = root / "a"
    for f in files:
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    for name in ("team", "attacker"):
        assert trainer("keygen", "--out", root / name).returncode == 0
    first = build(lock, bundle, cache, root / "a.oci")
    assert {layer["status"] for layer in first["layers"]} == {"built"}
    digest = first["manifest_digest"]
    return {"root": root, "lock": lock, "bundle": bundle, "cache": cache, "files": files, "digest": digest}


def build(lock, bundle, cache, out, *extra):
    r = trainer(
        "image", "build", "--lock", lock, "--out", out, "--cache", cache, "--offline", "--bundle-root", bundle,
        "--revision", "test", "--json", "-q", *extra,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def push(world, remote, key="team", *extra):
    return trainer(
        "cache", "--cache", world["cache"], "push", remote, "--lock", world["lock"],
        "--sign-key", world["root"] / key, "--no-tls-verify", "--json", "--remote-timeout", "120", *extra,
    )  # fmt: skip


def substituted_build(world, tmp_path, remote, *extra):
    """Build the demo lock with ``remote`` as substituter (the team key trusted) in a cache that holds the inputs
    but no layer (so a refused layer is built here); returns (build JSON, stderr)."""
    fresh = tmp_path / "empty"
    if fresh.exists():
        shutil.rmtree(fresh)
    for f in world["files"]:
        assert trainer("cache", "--cache", fresh, "add", f).returncode == 0
    r = trainer(
        "image", "build", "--lock", world["lock"], "--out", tmp_path / "s.oci", "--cache", tmp_path / "empty",
        "--offline", "--bundle-root", world["bundle"], "--revision", "test", "--json",
        "--substituter", remote, "--trusted-key", world["root"] / "team.pub", "--no-tls-verify",
        "--remote-timeout", "120", *extra,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def statuses(result) -> dict[str, str]:
    return {layer["name"]: layer["status"] for layer in result["layers"]}


def registry_blob(registry, digest: str) -> Path:
    """Where distribution 2.8 keeps the bytes of blob ``digest`` in its storage (filesystem driver)."""
    hexdigest = digest[7:]
    return registry["storage"] / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def test_push_pull_into_an_empty_cache_rebuilds_nothing_to_the_same_digest(registry, world, tmp_path):
    remote = f"docker://{registry['host']}/cache-roundtrip"
    pushed = push(world, remote)
    assert pushed.returncode == 0, pushed.stderr
    rows = json.loads(pushed.stdout)["layers"]
    assert sorted(r["layer"] for r in rows) == ["rest", "sources", "torch"]
    assert {r["status"] for r in rows} == {"pushed"}
    # the entry is an OCI artifact: artifactType, the empty config, the layer tar and its signed statement
    key = rows[0]["key"]
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"{remote}:{key}"], capture_output=True, text=True
    )
    manifest = json.loads(raw.stdout)
    assert manifest["artifactType"] == "application/vnd.recipe-bundle.layer-cache-entry.v1"
    assert [d["mediaType"] for d in manifest["layers"]] == [
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.dsse.envelope.v1+json",
    ]
    assert manifest["annotations"]["dev.recipe-bundle.cache.key"] == key

    empty = tmp_path / "b"
    pulled = trainer(
        "cache", "--cache", empty, "pull", remote, "--lock", world["lock"],
        "--trusted-key", world["root"] / "team.pub", "--no-tls-verify", "--json",
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert {r["status"] for r in json.loads(pulled.stdout)["layers"]} == {"pulled"}
    again = build(world["lock"], world["bundle"], empty, tmp_path / "b.oci")
    assert again["manifest_digest"] == world["digest"]
    assert statuses(again) == {"torch": "cached", "rest": "cached", "sources": "cached", "bundle": "built"}
    # a second pull finds everything present and transfers nothing
    second = trainer(
        "cache", "--cache", empty, "pull", remote, "--lock", world["lock"],
        "--trusted-key", world["root"] / "team.pub", "--no-tls-verify", "--json",
    )  # fmt: skip
    assert {r["status"] for r in json.loads(second.stdout)["layers"]} == {"present"}

    # the substituter path: image build takes every missing layer from the remote
    result, _ = substituted_build(world, tmp_path, remote)
    assert result["manifest_digest"] == world["digest"]
    want = {"torch": "substituted", "rest": "substituted", "sources": "substituted", "bundle": "built"}
    assert statuses(result) == want


def test_a_directory_remote_round_trips_and_a_tampered_entry_is_refused(world, tmp_path):
    remote = tmp_path / "shared"
    assert push(world, remote).returncode == 0
    assert sorted(p.name for p in remote.iterdir() if not p.name.startswith(".")) == sorted(
        r["key"] for r in json.loads(push(world, remote).stdout)["layers"]
    )
    result, _ = substituted_build(world, tmp_path, remote)
    assert (result["manifest_digest"], set(statuses(result).values())) == (world["digest"], {"substituted", "built"})

    # flip one byte of every layer blob in the shared directory: no tampered layer is used, all are built here
    for entry in remote.iterdir():
        index = json.loads((entry / "index.json").read_text())
        manifest = json.loads((entry / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
        blob = entry / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 1
        blob.chmod(0o644)
        blob.write_bytes(bytes(data))
    result, err = substituted_build(world, tmp_path, remote)
    assert result["manifest_digest"] == world["digest"]
    assert statuses(result) == {"torch": "built", "rest": "built", "sources": "built", "bundle": "built"}
    assert err.count("Digest did not match") == 3, err  # skopeo checks each blob as it copies; so do we after


@pytest.mark.parametrize("case", ["different-blob", "truncated-blob", "forged-signature", "another-key", "unsigned"])
def test_hostile_registry_entries_are_refused_and_the_layer_built_locally(registry, world, tmp_path, case, request):
    remote = f"docker://{registry['host']}/hostile-{case}"
    rows = json.loads(push(world, remote, "attacker" if case == "forged-signature" else "team").stdout)["layers"]
    rest = next(r for r in rows if r["layer"] == "rest")
    torch = next(r for r in rows if r["layer"] == "torch")
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"{remote}:{rest['key']}"], capture_output=True, text=True
    )
    layer_digest = json.loads(raw.stdout)["layers"][0]["digest"]
    if case in ("different-blob", "truncated-blob"):  # blobs are shared by all repositories: restored after
        data = registry_blob(registry, layer_digest)
        original = data.read_bytes()
        request.addfinalizer(lambda: data.write_bytes(original))
        data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]) if case == "different-blob" else original[:1000])
    elif case == "another-key":  # the torch layer's signed entry served under the rest layer's key
        copy = subprocess.run(
            ["skopeo", "copy", "-q", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false",
             f"{remote}:{torch['key']}", f"{remote}:{rest['key']}"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert copy.returncode == 0, copy.stderr
    extra = [] if case != "unsigned" else ["--trusted-key", world["root"] / "attacker.pub"]
    if case == "unsigned":  # no key trusted at all: nothing from the remote is used
        r = trainer(
            "cache", "--cache", tmp_path / "p", "pull", remote, "--lock", world["lock"], "--no-tls-verify",
        )  # fmt: skip
        assert r.returncode == 1
        assert r.stdout.count("no trusted key configured") == 3, r.stdout
        return
    result, err = substituted_build(world, tmp_path, remote, *extra)
    assert result["manifest_digest"] == world["digest"]
    if case == "forged-signature":
        assert set(statuses(result).values()) == {"built"}
        assert err.count("not signed by a trusted key") == 3, err
        return
    assert statuses(result)["rest"] == "built" and statuses(result)["torch"] == "substituted"
    line = next(line for line in err.splitlines() if "layer rest" in line)
    want = {
        "different-blob": "Digest did not match",
        "truncated-blob": "from docker://",
        "another-key": "the signed entry is for key",
    }[case]
    assert want in line and line.endswith("not used"), err


def _rewrite_manifest(entry: Path, change) -> None:
    """Apply ``change`` to the manifest of the directory-remote entry ``entry`` and re-point its index at it."""
    index = json.loads((entry / "index.json").read_text())
    old = entry / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    data = change(json.loads(old.read_bytes()))
    digest = hashlib.sha256(data).hexdigest()
    (entry / "blobs/sha256" / digest).write_bytes(data)
    index["manifests"][0].update(digest=f"sha256:{digest}", size=len(data))
    (entry / "index.json").write_text(json.dumps(index))


def test_a_hostile_shared_directory_never_aborts_a_build_nor_fills_the_disk(world, tmp_path):
    remote = tmp_path / "shared"
    old = os.umask(0o022)
    try:
        rows = json.loads(push(world, remote).stdout)["layers"]
    finally:
        os.umask(old)
    entries = {r["layer"]: remote / r["key"] for r in rows}
    # readable by every user of the shared file system
    assert {stat.S_IMODE(e.stat().st_mode) for e in entries.values()} == {0o755}
    # torch: a manifest nested 5,000 deep; rest: its layer blob a link to an endless device; sources: an envelope
    # declared 400 MB large
    _rewrite_manifest(
        entries["torch"],
        lambda m: json.dumps({**m, "x": 0}).encode()[:-1] + b',"y":' + b"[" * 5000 + b"]" * 5000 + b"}",
    )
    index = json.loads((entries["rest"] / "index.json").read_text())
    manifest = json.loads((entries["rest"] / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    blob = entries["rest"] / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    blob.unlink()
    blob.symlink_to("/dev/zero")
    _rewrite_manifest(
        entries["sources"],
        lambda m: json.dumps({**m, "layers": [m["layers"][0], {**m["layers"][1], "size": 400 << 20}]}).encode(),
    )
    started = time.monotonic()
    result, err = substituted_build(world, tmp_path, remote)
    assert time.monotonic() - started < 60
    assert result["manifest_digest"] == world["digest"]
    assert set(statuses(result).values()) == {"built"}, err
    assert "nested too deeply" in err and "not a regular file" in err and "a signature envelope of 419,430,400" in err
    assert not list((tmp_path / "empty" / "tmp").glob("spool-pull-*"))


def test_an_entry_whose_manifest_names_another_layer_than_the_one_signed_is_refused(world, tmp_path):
    """The rest layer's entry, its manifest re-pointed at the torch layer's blob (copied in) while keeping the rest
    layer's signed envelope: every digest matches its descriptor, only the signature binds the layer."""
    remote = tmp_path / "shared"
    rows = {r["layer"]: r for r in json.loads(push(world, remote).stdout)["layers"]}
    rest, torch = remote / rows["rest"]["key"], remote / rows["torch"]["key"]
    index = json.loads((torch / "index.json").read_text())
    torch_layer = json.loads((torch / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())["layers"][0]
    shutil.copy(torch / "blobs/sha256" / torch_layer["digest"][7:], rest / "blobs/sha256")
    _rewrite_manifest(rest, lambda m: json.dumps({**m, "layers": [torch_layer, m["layers"][1]]}).encode())
    result, err = substituted_build(world, tmp_path, remote)
    assert result["manifest_digest"] == world["digest"]
    assert statuses(result)["rest"] == "built" and statuses(result)["torch"] == "substituted"
    assert "is not the one signed" in next(line for line in err.splitlines() if "layer rest" in line), err


def test_pull_repairs_a_corrupt_local_layer(registry, world, tmp_path):
    remote = f"docker://{registry['host']}/cache-repair"
    assert push(world, remote).returncode == 0
    cache = tmp_path / "c"
    args = ["--lock", world["lock"], "--trusted-key", world["root"] / "team.pub", "--no-tls-verify", "--json"]
    assert trainer("cache", "--cache", cache, "pull", remote, *args).returncode == 0
    blob = next((cache / "sha256").iterdir())
    data = bytearray(blob.read_bytes())
    data[0] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    again = json.loads(trainer("cache", "--cache", cache, "pull", remote, *args).stdout)["layers"]
    assert sorted(r["status"] for r in again) == ["present", "present", "pulled"]


def test_a_registry_that_is_down_or_hangs_is_refused_in_bounded_time(world, tmp_path):
    down = f"docker://127.0.0.1:{free_port()}/nothing"
    started = time.monotonic()
    result, err = substituted_build(world, tmp_path, down)
    assert result["manifest_digest"] == world["digest"]
    assert set(statuses(result).values()) == {"built"}
    assert "connection refused" in err and "was unreachable earlier in this command" in err, err

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    try:
        hang = f"docker://127.0.0.1:{listener.getsockname()[1]}/silent"
        started = time.monotonic()
        r = trainer(
            "cache", "--cache", tmp_path / "h", "pull", hang, "--lock", world["lock"], "--no-tls-verify",
            "--trusted-key", world["root"] / "team.pub", "--remote-timeout", "3",
        )  # fmt: skip
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()
    assert r.returncode == 1, r.stdout
    lines = r.stdout.splitlines()
    assert "no answer from the remote within 3 s" in lines[0], r.stdout
    assert sum("did not answer earlier in this command" in line for line in lines) == 2, r.stdout
    assert elapsed < 40, elapsed  # one timeout, not one per layer


def test_image_push_by_digest_with_referrers_pulls_back_identical(registry, world, tmp_path):
    layout = world["root"] / "signed.oci"
    build(world["lock"], world["bundle"], world["cache"], layout, "--sign-key", world["root"] / "team")
    target = f"{registry['host']}/recipe-bundle"
    r = trainer("image", "push", layout, target, "--no-tls-verify", "--json")
    assert r.returncode == 0, r.stderr
    pushed = json.loads(r.stdout)
    assert pushed["reference"] == f"{target}@{world['digest']}"
    back = tmp_path / "back"
    copy = subprocess.run(
        ["skopeo", "copy", "-q", "--preserve-digests", "--src-tls-verify=false", f"docker://{pushed['reference']}",
         f"oci:{back}:x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    digest = trainer("image", "digest", back)
    assert digest.stdout.strip().splitlines()[-1] == world["digest"]
    # the referrers tag (distribution-spec 1.1 tag schema) lists the layout's referrers with their artifactType
    tag = f"docker://{target}:sha256-{world['digest'][7:]}"
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", tag], capture_output=True, text=True)
    listed = json.loads(raw.stdout)["manifests"]
    local = [m for m in json.loads((layout / "index.json").read_text())["manifests"] if m.get("artifactType")]
    assert [(m["digest"], m["artifactType"]) for m in listed] == [(m["digest"], m["artifactType"]) for m in local]
    assert {m["artifactType"] for m in listed} == {
        "application/spdx+json",
        "application/vnd.cyclonedx+json",
        "application/vnd.dsse.envelope.v1+json",
    }
    for m in listed:  # each referrer manifest is served byte for byte
        got = subprocess.run(
            ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{target}@{m['digest']}"],
            capture_output=True,
        )
        assert got.stdout == (layout / "blobs/sha256" / m["digest"][7:]).read_bytes()


def test_bad_targets_and_options_are_one_line(world, tmp_path):
    r = trainer("image", "push", world["root"] / "a.oci", "127.0.0.1:1/name:tag")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no tag or digest" in r.stderr, r.stderr
    r = trainer("image", "push", world["root"] / "a.oci", f"127.0.0.1:{free_port()}/name", "--no-tls-verify")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "connection refused" in r.stderr, r.stderr
    r = trainer("cache", "pull", "docker://hostonly", "--lock", world["lock"], "--trusted-key", tmp_path / "none.pub")
    assert r.returncode == 2 and "docker://HOST[:PORT]/REPOSITORY" in r.stderr, r.stderr
    r = trainer("cache", "pull", str(tmp_path), "--lock", world["lock"], "--trusted-key", tmp_path / "none.pub")
    assert r.returncode == 2 and "--trusted-key" in r.stderr and "no such file" in r.stderr, r.stderr
    r = trainer("cache", "--cache", tmp_path / "c", "push", str(tmp_path / "d"), "--lock", world["lock"],
                "--sign-key", world["root"] / "team")  # fmt: skip
    assert r.returncode == 1 and r.stdout.count("not in the local cache") == 3, r.stdout


def test_the_readme_smoke_lock_round_trips_through_the_registry(registry, tmp_path):
    """lockfiles/smoke.lock.json as the README builds it (two wheels from PyPI, its generated git source): built
    in one cache, pushed, pulled into an empty cache, rebuilt offline from the pulled layers alone (no wheel, no
    source there) to the same manifest digest."""
    lock = helpers.REPO_ROOT / "lockfiles" / "smoke.lock.json"
    one = tmp_path / "one"
    made = trainer("image", "smoke-source", tmp_path / "src")
    assert made.returncode == 0, made.stderr
    src = json.loads(made.stdout.splitlines()[0])
    assert trainer("cache", "--cache", one, "add", src["archive"], "--sha256", src["sha256"]).returncode == 0
    fetched = trainer("cache", "--cache", one, "fetch", "--lock", lock)
    if fetched.returncode != 0 and any(word in fetched.stderr for word in OFFLINE):
        pytest.skip(f"PyPI not reachable for the smoke lock's wheels: {fetched.stderr.strip()[-200:]}")
    assert fetched.returncode == 0, fetched.stderr  # anything but no network (a hash mismatch) is a failure

    def smoke_build(cache: Path, out: str) -> dict:
        r = trainer(
            "image", "build", "--lock", lock, "--out", tmp_path / out, "--cache", cache, "--offline",
            "--revision", "0.1.0", "--json", "-q",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first = smoke_build(one, "one.oci")
    two = tmp_path / "two"
    pushed, pulled = push_then_pull(one, f"docker://{registry['host']}/smoke-cache", lock, tmp_path / "team", two)
    layers = sorted(r["layer"] for r in pushed)
    assert layers == sorted(name for name in statuses(first) if name != "bundle") and layers
    assert {r["status"] for r in pulled} == {"pulled"}
    again = smoke_build(two, "two.oci")
    assert again["manifest_digest"] == first["manifest_digest"]
    assert statuses(again) == {name: "built" if name == "bundle" else "cached" for name in statuses(first)}


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
