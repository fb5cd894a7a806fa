"""Hostile content in the build cache and image layouts: nothing in the cache is trusted unchecked.

A small scratch image (one wheel, one git source) is built once; each case then tampers with a copy of its
cache or layout the way a hostile or broken tool could, and the promise is checked: the next build ships the
right bytes (same digest as the clean build) or refuses with one line, never blocks, and leaves no debris.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, tree_hash
from helpers import run_trainer as trainer
from image_fixtures import demo_source, make_wheel, small_lock
from trainer import cli

EPOCH = 1767225600


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A lock, its seeded cache and the clean build's JSON result."""
    root = tmp_path_factory.mktemp("hostile-cache")
    wheel = make_wheel(root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    source, archive = demo_source(root / "git", {"README.md": b"demo\n", "demo/a.py": b"A = 1\n"}, EPOCH)
    lock = root / "lock.json"
    lock.write_text(json.dumps(small_lock("hostile", EPOCH, [(wheel, "alpha", "1.0", "rest")], [source])))
    bundle = root / "bundle"
    (bundle / "conf").mkdir(parents=True)
    (bundle / "conf" / "x.yaml").write_text("x: 1\n")
    cache = root / "cas"
    for f in (wheel, archive):
        assert cli.main(["cache", "--cache", str(cache), "add", str(f)]) == 0
    state = {"root": root, "lock": lock, "bundle": bundle, "cache": cache, "wheel": wheel}
    state["result"] = build(state, cache, root / "clean.oci")
    return state


def build(state, cache, out, capsys=None):
    """``trainer image build`` in this process; returns the --json result (asserting exit 0)."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(
            [
                "image",
                "build",
                "--lock",
                str(state["lock"]),
                "--out",
                str(out),
                "--cache",
                str(cache),
                "--offline",
                "--bundle-root",
                str(state["bundle"]),
                "--revision",
                "test",
                "--json",
                "-q",
            ]
        )
    assert code == 0, stderr.getvalue()
    return json.loads(stdout.getvalue())


def copy_cache(clean, tmp_path) -> Path:
    cache = tmp_path / "cas"
    # not tmp/: it holds this process's live-build marker, which a copy would turn into a dead one
    shutil.copytree(clean["cache"], cache, symlinks=True, ignore=shutil.ignore_patterns("tmp"))
    return cache


def layer_entry(cache: Path, name: str) -> Path:
    for path in (cache / "layers").glob("*.json"):
        if json.loads(path.read_text()).get("layer") == name:
            return path
    raise AssertionError(f"no layer record for {name}")


def flip_byte(path: Path) -> None:
    """Change one byte in place (same size), as a disk error or a hostile edit would."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def forge_stamp(cache: Path, hexdigest: str) -> None:
    """Rewrite a blob's stamp with its new stat, keeping the old MAC: what a tool unaware of the key would do."""
    stamp_path = cache / "stamps" / f"{hexdigest}.json"
    stamp = json.loads(stamp_path.read_text())
    st = (cache / "sha256" / hexdigest).stat()
    stamp.update(size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, ino=st.st_ino, dev=st.st_dev)
    stamp_path.write_text(json.dumps(stamp))


def _point_at_other_blob(cache: Path, clean) -> None:
    entry = layer_entry(cache, "rest")
    record = json.loads(entry.read_text())
    other = hashlib.sha256(clean["wheel"].read_bytes()).hexdigest()  # another blob of the same cache
    record.update(diff_id=f"sha256:{other}", size=(cache / "sha256" / other).stat().st_size)
    entry.write_text(json.dumps(record))


def _edit_entry(**fields):
    def edit(cache: Path, clean) -> None:
        entry = layer_entry(cache, "rest")
        record = json.loads(entry.read_text())
        for key, value in fields.items():
            if value is KeyError:
                record.pop(key)
            else:
                record[key] = value
        entry.write_text(json.dumps(record))

    return edit


def _flip_and_forge(cache: Path, clean) -> None:
    hexdigest = json.loads(layer_entry(cache, "rest").read_text())["diff_id"][7:]
    flip_byte(cache / "sha256" / hexdigest)
    forge_stamp(cache, hexdigest)


TAMPERED = {
    "entry pointed at another cached blob": _point_at_other_blob,
    "entry with a non-numeric size": _edit_entry(size="12 bytes"),
    "entry without a size": _edit_entry(size=KeyError),
    "entry with a wrong size": _edit_entry(size=1),
    "entry copied from another key": _edit_entry(mac="0" * 64),
    "blob flipped and its stamp rewritten": _flip_and_forge,
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_cache_entry_is_rebuilt_not_shipped(clean, tmp_path, case):
    """Promise: a layer entry is used only when its MAC binds it to these inputs and its blob (numeric, right size,
    and re-hashed when its stamp is in doubt); otherwise the layer is rebuilt and the image is the clean one."""
    cache = copy_cache(clean, tmp_path)
    TAMPERED[case](cache, clean)
    result = build(clean, cache, tmp_path / "out.oci")
    assert result["manifest_digest"] == clean["result"]["manifest_digest"]
    status = {layer["name"]: layer["status"] for layer in result["layers"]}
    assert status["rest"] == "built", status
    assert trainer("image", "digest", tmp_path / "out.oci").stdout.strip() == clean["result"]["manifest_digest"]


def test_an_intact_cache_is_used(clean, tmp_path):
    """Promise (the other side): untouched entries are cache hits."""
    cache = copy_cache(clean, tmp_path)
    status = {layer["name"]: layer["status"] for layer in build(clean, cache, tmp_path / "out.oci")["layers"]}
    assert status["rest"] == "cached" and status["sources"] == "cached"


def assert_one_line(result, code, expected):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_a_fifo_in_the_cache_does_not_block_a_build(clean, tmp_path):
    """Promise: a FIFO where a blob should be is refused at once (one line), never read (which blocks forever)."""
    cache = copy_cache(clean, tmp_path)
    hexdigest = hashlib.sha256(clean["wheel"].read_bytes()).hexdigest()
    for entry in (cache / "layers").glob("*.json"):
        entry.unlink()  # no layer hits: the build must read the wheel
    blob = cache / "sha256" / hexdigest
    blob.unlink()
    os.mkfifo(blob)
    before = tree_hash(cache / "sha256")
    result = trainer(
        "image",
        "build",
        "--lock",
        clean["lock"],
        "--out",
        tmp_path / "out.oci",
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        clean["bundle"],
        "-q",
        timeout=60,
    )  # a blocked read would hang
    assert_one_line(result, 2, "not a regular file (a FIFO, device or socket is refused)")
    assert not (tmp_path / "out.oci").exists() and tree_hash(cache / "sha256") == before


def test_cache_add_refuses_an_empty_sha256(clean, tmp_path):
    """Promise: `cache add F --sha256 ''` is a refused check, not a skipped one; nothing is added."""
    cache = copy_cache(clean, tmp_path)
    (tmp_path / "f").write_bytes(b"content")
    before = tree_hash(cache)
    result = trainer("cache", "--cache", cache, "add", tmp_path / "f", "--sha256", "")
    assert_one_line(result, 2, "--sha256: expected a sha256 (64 lowercase hex digits), got ''")
    assert tree_hash(cache) == before


def test_debris_of_killed_builds_is_reported_and_collected_but_a_live_builds_is_kept(clean, tmp_path):
    """Promise: `cache verify` lists what killed builds left (exit 1), `cache gc` removes it, and debris newer than
    a live build (which holds its marker) is kept until that build is gone."""
    cache = copy_cache(clean, tmp_path)
    tmp = cache / "tmp"
    tmp.mkdir(exist_ok=True)
    (tmp / "part-dead1").write_bytes(b"x" * 1000)
    (tmp / "spool-dead2").mkdir()
    (tmp / "spool-dead2" / "member").write_bytes(b"y")
    (cache / "layers" / ".abc.json.tmp").write_text("{")
    old = time.time() - 3600
    for path in (tmp / "part-dead1", tmp / "spool-dead2", cache / "layers" / ".abc.json.tmp"):
        os.utime(path, (old, old))
    verify = trainer("cache", "--cache", cache, "verify")
    assert verify.returncode == 1 and verify.stdout.strip().splitlines()[-1].endswith("0 corrupt, 3 debris"), (
        verify.stdout
    )
    assert "debris tmp/part-dead1" in verify.stdout
    live = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from trainer.image.cas import Cache; "
            f"Cache({str(cache)!r}).tmp_dir(); print('live', flush=True); time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout.readline().strip() == "live"  # its start removed the old debris already
        assert not (tmp / "part-dead1").exists() and not (tmp / "spool-dead2").exists()
        time.sleep(0.05)
        (tmp / "part-of-the-live-build").write_bytes(b"z")
        gc = trainer("cache", "--cache", cache, "gc")
        assert gc.returncode == 0 and (tmp / "part-of-the-live-build").exists(), gc.stdout
    finally:
        live.kill()
        live.wait()
    gc = trainer("cache", "--cache", cache, "gc", "--json")
    removed = sorted(json.loads(gc.stdout)["removed"])
    # the killed build's debris and its marker (kill -9 ran no clean-up)
    assert removed[1] == "tmp/part-of-the-live-build" and removed[0].startswith(f"tmp/live-{live.pid}-"), removed
    assert [p.name for p in tmp.iterdir()] == []
    assert trainer("cache", "--cache", cache, "verify").returncode == 0


def test_sigterm_removes_what_a_cache_add_was_writing(tmp_path):
    """Promise: SIGTERM during `cache add` of a large file exits 143 with one line and leaves no partial blob."""
    big = tmp_path / "big"
    with open(big, "wb") as handle:
        handle.truncate(3 << 30)  # sparse: 3 GB to copy and hash
    cache = tmp_path / "cas"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "cache", "--cache", str(cache), "add", str(big)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 30
    while not list((cache / "tmp").glob("part-*")) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["trainer cache: terminated (temporary files removed)"]
    assert list((cache / "tmp").glob("part-*")) == [] and not (cache / "sha256").exists()


def test_image_digest_and_diff_rehash_the_layers(clean, tmp_path):
    """Promise: `image digest` and `image diff` re-hash every layer they vouch for: a flipped byte in a layout's
    layer blob is one line, exit 2, not the clean digest or "identical"."""
    layout = tmp_path / "a.oci"
    shutil.copytree(clean["root"] / "clean.oci", layout)
    manifest_digest = clean["result"]["manifest_digest"]
    manifest = json.loads((layout / "blobs" / "sha256" / manifest_digest[7:]).read_text())
    flip_byte(layout / "blobs" / "sha256" / manifest["layers"][1]["digest"][7:])
    digest = trainer("image", "digest", layout)
    assert_one_line(digest, 2, "layer 1 blob has sha256:")
    diff = trainer("image", "diff", clean["root"] / "clean.oci", layout)
    assert_one_line(diff, 2, "(corrupt)")


def test_a_killed_builds_output_siblings_are_removed(clean, tmp_path):
    """Promise: the temporary `.OUT.tmp-PID-*` directory a killed build left next to its output is removed by the
    next build (its process is gone); one of a live process is kept."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.oci.tmp-{dead.pid}-abc"
    (stale / "blobs").mkdir(parents=True)
    live = tmp_path / f".out.oci.tmp-{os.getpid()}-def"
    live.mkdir()
    build(clean, copy_cache(clean, tmp_path), tmp_path / "out.oci")
    assert not stale.exists() and live.exists()


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
