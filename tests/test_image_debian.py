"""The debian-rootfs base from pinned .debs, streaming wheel installs, cached-layer stamps, `image check`.

The .debs are made here with `dpkg-deb --build`; nothing is downloaded.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from image_fixtures import debian_base, make_deb, make_wheel, small_lock

EPOCH = 1767225600


trainer = helpers.run_trainer


def make_debs(root: Path):
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
    tiny = make_deb(
        root,
        "tinybin",
        "1.0-1",
        {
            "/bin/hello": (b"#!/bin/sh\necho hello\n", 0o755),
            "/usr/bin/passwdish": (b"setuid tool\n", 0o4755),
            "/lib64/ld-tiny.so.2": (b"\x7fELF tiny loader\n", 0o755),
        },
        symlinks={"/usr/bin/hi": "/bin/hello"},
        dirs={"/tmp": 0o1777, "/var/local": 0o2775},
    )
    lib = make_deb(
        root,
        "libtiny1",
        "2:0.5",
        {"/usr/lib/x86_64-linux-gnu/libtiny.so.1": (b"lib\n" * 100, 0o644)},
        control="Multi-Arch: same\n",
    )
    return [(passwd, "base-passwd", "3.6.1"), (tiny, "tinybin", "1.0-1"), (lib, "libtiny1", "2:0.5")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("debian")
    debs = make_debs(root / "debs")
    wheel = make_wheel(
        root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"}, entry_points="[console_scripts]\nalpha = alpha:main\n"
    )
    lock = small_lock("debian-test", EPOCH, [(wheel, "alpha", "1.0", "rest")], [])
    lock["base"] = debian_base(debs)
    lock["python"].update(
        version="3.11", site_packages="/usr/local/lib/python3.11/dist-packages", interpreter="/usr/bin/python3.11"
    )
    lock_path = root / "debian-test.lock.json"
    lock_path.write_text(json.dumps(lock, indent=1))
    bundle = root / "bundle"
    (bundle / "conf").mkdir(parents=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    cache = root / "cas"
    for f in [d[0] for d in debs] + [wheel]:
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    r = trainer(
        "image",
        "build",
        "--lock",
        lock_path,
        "--out",
        root / "a.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        bundle,
        "--revision",
        "test",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    return {
        "root": root,
        "debs": debs,
        "wheel": wheel,
        "lock": lock_path,
        "bundle": bundle,
        "cache": cache,
        "result": json.loads(r.stdout),
        "layout": root / "a.oci",
    }


def layer_tar(world, name):
    diff_id = next(layer["diff_id"] for layer in world["result"]["layers"] if layer["name"] == name)
    return tarfile.open(world["layout"] / "blobs" / "sha256" / diff_id[7:])


def test_debian_base_is_a_merged_usr_rootfs_with_a_dpkg_database(world):
    assert [layer["name"] for layer in world["result"]["layers"]] == ["base", "rest", "bundle"]
    tar = layer_tar(world, "base")
    members = {m.name: m for m in tar.getmembers()}
    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
    assert members["lib64"].linkname == "usr/lib64" and "lib32" not in members
    assert tar.extractfile("usr/bin/hello").read() == b"#!/bin/sh\necho hello\n"
    assert members["usr/bin/hello"].mode == 0o755 and members["usr/bin/passwdish"].mode == 0o4755
    assert members["tmp"].mode == 0o1777 and members["var/local"].mode == 0o2775
    assert members["usr/bin/hi"].linkname == "/bin/hello"  # absolute links are allowed in the base only
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members.values()} == {(0, 0, "", "", EPOCH)}
    status = tar.extractfile("var/lib/dpkg/status").read().decode()
    assert "Package: libtiny1\nStatus: install ok installed\nVersion: 2:0.5\n" in status
    assert status.index("Package: base-passwd") < status.index("Package: libtiny1") < status.index("Package: tinybin")
    listing = tar.extractfile("var/lib/dpkg/info/tinybin.list").read().decode().splitlines()
    assert listing[0] == "/." and "/bin/hello" in listing and "/lib64/ld-tiny.so.2" in listing
    assert "var/lib/dpkg/info/libtiny1:amd64.list" in members  # Multi-Arch: same
    assert tar.extractfile("var/lib/dpkg/info/tinybin.md5sums").read().decode().count("\n") == 3
    assert tar.extractfile("etc/passwd").read() == b"root:*:0:0:root:/root:/bin/sh\n"
    names = [m.name for m in tar.getmembers()]
    assert names == sorted(names, key=lambda n: n.split("/"))
    rest = layer_tar(world, "rest")
    assert rest.extractfile("usr/local/bin/alpha").read().startswith(b"#!/usr/bin/python3.11\n")
    assert "usr/local/lib/python3.11/dist-packages/alpha/__init__.py" in rest.getnames()


def test_debian_base_is_reproducible_and_unpacks_with_umoci(world, tmp_path):
    cache = tmp_path / "cas"
    for f in reversed([d[0] for d in world["debs"]] + [world["wheel"]]):
        assert trainer("cache", "--cache", cache, "add", f).returncode == 0
    wd = tmp_path / "wd"
    wd.mkdir()
    r = subprocess.run(
        [
            "sh",
            "-c",
            f'umask 077 && exec "$0" -m trainer image build --lock {world["lock"]} --out '
            f"{tmp_path / 'b.oci'} --cache {cache} --offline --bundle-root {world['bundle']} "
            f"--revision test -q",
            sys.executable,
        ],
        cwd=wd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TZ": "Asia/Kathmandu"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == world["result"]["manifest_digest"]
    subprocess.run(
        ["umoci", "unpack", "--rootless", "--image", f"{tmp_path / 'b.oci'}:latest", str(tmp_path / "u")],
        check=True,
        capture_output=True,
    )
    rootfs = tmp_path / "u" / "rootfs"
    assert (rootfs / "bin" / "hello").read_bytes() == b"#!/bin/sh\necho hello\n"  # through the merged-/usr link
    assert os.readlink(rootfs / "bin") == "usr/bin"
    assert (rootfs / "usr/local/lib/python3.11/dist-packages/alpha/__init__.py").read_bytes() == b"X = 1\n"


def test_tampered_or_mislabelled_deb_is_refused(world, tmp_path):
    lock = json.loads(world["lock"].read_text())
    deb, name, version = world["debs"][1]
    cache = tmp_path / "cas"
    other = make_deb(tmp_path, "tinybin", "1.0-2", {"/bin/hello": (b"other\n", 0o755)})
    assert trainer("cache", "--cache", cache, "add", other).returncode == 0
    for d in lock["base"]["debs"]:
        if d["name"] == "tinybin":
            d["sha256"] = hashlib.sha256(other.read_bytes()).hexdigest()  # right hash, but the control says 1.0-2
    bad = tmp_path / "bad.lock.json"
    bad.write_text(json.dumps(lock))
    for f, _, _ in world["debs"]:
        trainer("cache", "--cache", cache, "add", f)
    r = trainer(
        "image",
        "build",
        "--lock",
        bad,
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
    assert "deb tinybin_1.0-1_amd64: control says tinybin 1.0-2 amd64 (refused)" in r.stderr
    assert not (tmp_path / "o.oci").exists()
    blob = cache / "sha256" / hashlib.sha256(deb.read_bytes()).hexdigest()
    os.chmod(blob, 0o644)
    blob.write_bytes(blob.read_bytes() + b"x")
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
    assert r.returncode == 2 and "deb tinybin_1.0-1_amd64 is corrupt" in r.stderr and not (tmp_path / "o.oci").exists()


def test_big_wheel_member_is_streamed_not_held_in_memory(tmp_path):
    """A wheel with a 384 MiB member (zeros: tiny zipped) installs with a peak RSS far below the member's size."""
    big = 384 << 20
    path = tmp_path / "big-1.0-py3-none-any.whl"
    dist = "big-1.0.dist-info"
    digest = hashlib.sha256()
    zero = bytes(1 << 20)
    for _ in range(big >> 20):
        digest.update(zero)
    import base64

    def b64(d):
        return base64.urlsafe_b64encode(d).rstrip(b"=").decode()

    small = {
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: big\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"big/blob.bin,sha256={b64(digest.digest())},{big}"]
    record += [f"{k},sha256={b64(hashlib.sha256(v).digest())},{len(v)}" for k, v in small.items()] + [
        f"{dist}/RECORD,,"
    ]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open(zipfile.ZipInfo("big/blob.bin", (2020, 1, 1, 0, 0, 0)), "w", force_zip64=True) as member:
            for _ in range(big >> 20):
                member.write(zero)
        for k, v in small.items():
            zf.writestr(zipfile.ZipInfo(k, (2020, 1, 1, 0, 0, 0)), v)
        zf.writestr(zipfile.ZipInfo(f"{dist}/RECORD", (2020, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    lock = small_lock("big", EPOCH, [(path, "big", "1.0", "torch")], [])
    lock["bundle"]["include"] = []
    lock_path = tmp_path / "big.lock.json"
    lock_path.write_text(json.dumps(lock))
    cache = tmp_path / "cas"
    assert trainer("cache", "--cache", cache, "add", path).returncode == 0
    code = (
        f"import sys; from trainer.cli import main; rc = main(['image', 'build', '--lock', {str(lock_path)!r}, "
        f"'--out', {str(tmp_path / 'o.oci')!r}, '--cache', {str(cache)!r}, '--offline', '--json', '-q']); "
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0], file=sys.stderr); "
        "sys.exit(rc)"
    )  # VmHWM: this process's peak RSS (ru_maxrss would include the pre-exec fork of pytest)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert r.returncode == 0, r.stderr
    peak_kib = int(r.stderr.strip().splitlines()[-1])
    assert peak_kib * 1024 < big // 3, f"peak RSS {peak_kib} KiB for a {big >> 20} MiB member"
    layer = json.loads(r.stdout)["layers"][0]
    assert layer["name"] == "torch" and layer["size"] > big
    with tarfile.open(tmp_path / "o.oci" / "blobs" / "sha256" / layer["diff_id"][7:]) as tar:
        member = tar.getmember("usr/local/lib/python3.12/site-packages/big/blob.bin")
        assert member.size == big


def test_wheel_member_not_matching_record_is_refused_while_streaming(tmp_path):
    wheel = make_wheel(tmp_path, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    # rewrite one member's bytes (same size) after RECORD was written: zip CRC is recomputed, RECORD is not
    tampered = tmp_path / "t" / wheel.name
    tampered.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"X = 2\n" if info.filename == "alpha/__init__.py" else data)
    lock = small_lock("t", EPOCH, [(tampered, "alpha", "1.0", "rest")], [])
    lock_path = tmp_path / "t.lock.json"
    lock_path.write_text(json.dumps(lock))
    cache = tmp_path / "cas"
    assert trainer("cache", "--cache", cache, "add", tampered).returncode == 0
    r = trainer(
        "image",
        "build",
        "--lock",
        lock_path,
        "--out",
        tmp_path / "o.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        tmp_path,
        "-q",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert (
        "wheel alpha-1.0-py3-none-any.whl: usr/local/lib/python3.12/site-packages/alpha/__init__.py has sha256"
        in r.stderr
    )
    assert not (tmp_path / "o.oci").exists() and not list((cache / "layers").glob("*.json"))


def test_noop_rebuild_trusts_stamps_and_a_modified_layer_is_rebuilt(world, tmp_path):
    from trainer.image import build as build_mod
    from trainer.image import cas

    cache = cas.Cache(world["cache"])
    hashed = []
    real = cas.hash_file
    cas.hash_file = lambda path, description="": hashed.append(Path(path).name) or real(path, description)
    try:
        out = tmp_path / "n.oci"
        result = build_mod.build_image(world["lock"], out, cache, world["bundle"], revision="test", offline=True)
        assert [layer[3] for layer in result.layers] == ["cached", "cached", "built"]
        assert hashed == []  # the no-op rebuild re-hashed nothing: every cached layer's stamp matched
        assert result.manifest_digest == world["result"]["manifest_digest"]
        # modify a cached layer's bytes keeping size and mtime: ctime moved, so it is re-hashed, found corrupt
        # and rebuilt from the (re-hashed) inputs
        base = cache.blob_path(result.layers[0][1][7:])
        # the blob is hard-linked into the module's layout, which later tests read (and `image check` re-hashes):
        # give the cache its own copy first, so only the cache's bytes are modified
        copy = base.with_name(base.name + ".copy")
        shutil.copy2(base, copy)
        os.replace(copy, base)
        st = base.stat()
        os.chmod(base, 0o644)
        data = bytearray(base.read_bytes())
        data[1000] ^= 1
        base.write_bytes(bytes(data))
        os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns))
        again = build_mod.build_image(
            world["lock"], tmp_path / "m.oci", cache, world["bundle"], revision="test", offline=True
        )
        assert [layer[3] for layer in again.layers] == ["built", "cached", "built"]
        assert again.manifest_digest == world["result"]["manifest_digest"]
        assert base.name in hashed and hashlib.sha256(base.read_bytes()).hexdigest() == base.name
    finally:
        cas.hash_file = real


def test_image_check_against_expected_digests(world, tmp_path):
    expected = tmp_path / "expected.json"
    r = trainer("image", "check", "--lock", world["lock"], "--expected", expected, "--record", world["layout"])
    assert r.returncode == 0, r.stderr
    r = trainer("image", "check", "--lock", world["lock"], "--expected", expected, world["layout"])
    assert (
        r.returncode == 0
        and r.stdout.splitlines()[-1] == f"ok: {world['result']['manifest_digest']} is the expected digest"
    )
    data = json.loads(expected.read_text())
    entry = data["debian-test"]
    entry["layers"][1]["diff_id"] = "sha256:" + "0" * 64
    entry["manifest_digest"] = "sha256:" + "1" * 64
    expected.write_text(json.dumps(data))
    r = trainer("image", "check", "--lock", world["lock"], "--expected", expected, world["layout"])
    assert r.returncode == 1
    assert f"layer rest: {world['result']['layers'][1]['diff_id']}, expected sha256:{'0' * 64}" in r.stdout
    assert "layer base: same" in r.stdout


def test_diff_against_a_run_record(world, tmp_path):
    digest = world["result"]["manifest_digest"]
    lock_sha = hashlib.sha256(world["lock"].read_bytes()).hexdigest()
    cases = [
        ({"image": {"digest": digest, "lock": lock_sha}}, 0),
        ({"probe": {"ranks": [{"image": {"lock": lock_sha}}]}}, 0),
        ({"image": {"digest": "sha256:" + "2" * 64}}, 1),
        ({"image": {"lock": "3" * 64}}, 1),
    ]
    for record, code in cases:
        path = tmp_path / "record.json"
        path.write_text(json.dumps(record))
        r = trainer("image", "diff", world["layout"], path)
        assert r.returncode == code, (record, r.stdout, r.stderr)
    path.write_text(json.dumps({"image": {"digest": "sha256:" + "2" * 64}}))
    r = trainer("image", "diff", world["layout"], path)
    assert f"image digest: {digest}, the run record says sha256:{'2' * 64}" in r.stdout
    path.write_text(json.dumps({"run": "x"}))
    r = trainer("image", "diff", world["layout"], path)
    assert r.returncode == 2 and "names no image" in r.stderr


def test_diff_against_the_lock_reads_dist_packages_and_dpkg(world, tmp_path):
    """The wheels Debian's Python finds under dist-packages and the .debs in the dpkg database are what the
    lock pins: identical; a lock pinning another wheel version or another .deb version is named."""
    layout = tmp_path / "d.oci"  # its own build: other tests here modify cached blobs the module's layout links to
    assert (
        trainer(
            "image",
            "build",
            "--lock",
            world["lock"],
            "--out",
            layout,
            "--cache",
            world["cache"],
            "--offline",
            "--bundle-root",
            world["bundle"],
            "--revision",
            "test",
        ).returncode
        == 0
    )
    r = trainer("image", "diff", layout, world["lock"])
    assert (r.returncode, r.stdout.strip()) == (0, "identical"), r.stdout + r.stderr
    other = json.loads(world["lock"].read_text())
    other["wheels"][0]["version"] = "1.1"
    other["base"]["debs"][1]["version"] = "1.0-2"
    path = tmp_path / "other.lock.json"
    path.write_text(json.dumps(other))
    r = trainer("image", "diff", layout, path, "--json")
    result = json.loads(r.stdout)
    assert r.returncode == 1 and result["distributions"] == [{"name": "alpha", "old": "1.0", "new": "1.1"}]
    assert result["debs"] == [{"name": "tinybin", "old": "1.0-1", "new": "1.0-2"}]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
