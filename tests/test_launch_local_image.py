"""launcher=local-image: a real image built from a lock, unpacked by digest with umoci and probed inside with
bubblewrap; `trainer verify` checks the image's stamped lock against what the probe saw inside."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

import helpers
from helpers import run_train
from image_fixtures import make_git_source, make_wheel, small_lock
from trainer.launch.host.local_image import HOST_MOUNT, elf_interpreter

pytestmark = pytest.mark.skipif(
    shutil.which("umoci") is None or shutil.which("bwrap") is None,
    reason="umoci and bubblewrap (Debian umoci, bubblewrap) are not installed",
)


trainer = helpers.run_trainer
SECRET = "hf_planted_secret_0123456789"
WORDS = "the container runs in a terminal; username and password are asked for; sortedcontainers"
PLANTED = f"SMB_PASSWORD=password\nUSERNAME: username\n{WORDS}\ntoken {SECRET}\n"


@pytest.fixture(autouse=True)
def rootfs_cache(tmp_path_factory, monkeypatch):
    """Every test's unpacked images in one cache of this module's own (TRAINER_ROOTFS_CACHE), not the user's."""
    monkeypatch.setenv("TRAINER_ROOTFS_CACHE", str(tmp_path_factory.getbasetemp() / "rootfs-cache"))


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    # ordinary words a secret sweep that learnt from files once took for secrets (fsspec's smb.py says
    # password=password), and a planted secret the run knows from its overrides (+env.HF_TOKEN)
    wheel = make_wheel(root, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n", "alpha/smb.conf": PLANTED.encode()})
    # stand-ins for the recipe's git sources, installed as the recipe's locks install miles and Megatron-LM
    sources, archives = [], []
    for name, files in (
        ("miles", {"miles/__init__.py": b"NAME = 'miles'\n"}),
        ("megatron_lm", {"megatron/core/package_info.py": b"MAJOR = 0\nMINOR = 16\nPATCH = 0\nPRE_RELEASE = 'rc0'\n"}),
    ):
        archive, commit, tree = make_git_source(root / "git", name, files, 1767225600)
        archives.append(archive)
        sources.append(
            {
                "name": name,
                "url": f"https://example.invalid/{name}",
                "commit": commit,
                "tree": tree,
                "dest": f"/root/{name}",
                "python_path": True,
                "archive": {"filename": archive.name, "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()},
            }
        )
    lock = small_lock("local-image-test", 1767225600, [(wheel, "alpha", "1.0", "rest")], sources)
    (root / "lock.json").write_text(json.dumps(lock))
    (root / "bundle" / "conf").mkdir(parents=True)
    (root / "bundle" / "conf" / "x.yaml").write_text("a: 1\n")
    for path in [wheel, *archives]:
        assert trainer("cache", "--cache", root / "cas", "add", path).returncode == 0
    out = trainer(
        "image",
        "build",
        "--lock",
        root / "lock.json",
        "--out",
        root / "oci",
        "--cache",
        root / "cas",
        "--offline",
        "--bundle-root",
        root / "bundle",
        "--revision",
        "test",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    return {"layout": root / "oci", "digest": json.loads(out.stdout)["manifest_digest"], "sources": sources}


def launch(tmp_path, image, digest=None, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_dir = tmp_path / "run"
    result = run_train(
        [
            "experiment=smoke",
            "launcher=local-image",
            f"launcher.image={digest or image['digest']}",
            f"launcher.image_layout={image['layout']}",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=tmp_path,
    )
    return result, run_dir


def test_git_sources_in_the_image_are_probed_from_their_files(tmp_path, image):
    """miles and Megatron-LM stand-ins installed with python_path: the probe inside the image imports them,
    hashes their trees, and `trainer verify` says ok for both commits and trees against the image's stamp."""
    result, run_dir = launch(tmp_path, image)
    assert result.returncode == 0, result.stdout + result.stderr
    probe = json.loads((run_dir / "record.json").read_text())["probe"]["ranks"][0]
    pins = {s["name"]: s for s in image["sources"]}
    assert probe["sources"]["miles"] == {
        "commit": pins["miles"]["commit"],
        "tree": pins["miles"]["tree"],
        "path": "/root/miles",
    }
    assert probe["megatron_lm_tree"] == pins["megatron_lm"]["tree"]
    assert probe["components"]["megatron_core"] == "0.16.0rc0"
    rows = {r["component"]: r["verdict"] for r in json.loads(trainer("verify", run_dir, "--json").stdout)["rows"]}
    assert [rows[k] for k in ("megatron_lm_commit", "megatron_lm_tree", "miles_commit", "miles_tree")] == ["ok"] * 4


def test_probe_inside_the_image_and_verify_against_its_stamp(tmp_path, image):
    result, run_dir = launch(tmp_path, image)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "has no Python interpreter; running this machine's" in result.stdout
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "complete"
    assert record["image"]["digest"] == image["digest"] and record["image"]["tag"] == "latest"
    assert record["image"]["interpreter"]["from"] == "host"
    # bound under its own mount point, whatever its prefix (Debian's /usr/bin/python3 too), run by its own loader
    host_python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    inside = record["image"]["interpreter"]["inside"]
    assert inside[-1] == f"{HOST_MOUNT}{host_python}" and record["image"]["interpreter"]["path"] == str(host_python)
    assert inside[0] == f"{HOST_MOUNT}{Path(elf_interpreter(host_python)).resolve()}"
    probe = record["probe"]["ranks"][0]
    stamp = (run_dir / "image" / "lock.json").read_bytes()
    assert probe["image"]["digest"] == image["digest"]
    import hashlib

    assert probe["image"]["lock.json"]["sha256"] == hashlib.sha256(stamp).hexdigest() == record["image"]["stamp_sha256"]
    # only the image's site-packages are visible inside: none of the launcher environment's packages
    assert probe["distributions"] == [["alpha", "1.0"]]
    assert probe["components"]["torch"] is None and probe["host"] == "recipe-image"
    verify = trainer("verify", run_dir, "--json")
    assert verify.returncode == 1, verify.stderr
    rows = {r["component"]: r for r in json.loads(verify.stdout)["rows"]}
    assert rows["alpha"]["verdict"] == "ok" and rows["alpha"]["locked"] == "1.0"
    # the host's interpreter ran inside (the image has none): verify says so against the image's locked 3.12
    assert rows["python"]["locked"] == "3.12" and rows["python"]["observed"] == sys.version.split()[0]
    assert rows["python"]["verdict"] == "drift"


def test_a_job_inside_the_image_that_fails_is_recorded(tmp_path, image):
    result, run_dir = launch(
        tmp_path, image, None, "launcher.job=[python3,-c,'import alpha, sys; sys.exit(alpha.X + 6)']"
    )
    assert result.returncode == 1
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "failed"
    assert record["reason"] == "the job inside the image exited with code 7"
    assert record["probe"]["ranks"][0]["distributions"] == [["alpha", "1.0"]]


def test_every_file_the_launcher_writes_is_hashed_in_the_record(tmp_path, image):
    result, run_dir = launch(tmp_path, image, None, "launcher.job=[python3,-c,pass]")
    assert result.returncode == 0, result.stderr
    hashes = json.loads((run_dir / "record.json").read_text())["files_sha256"]
    assert {"sandbox.json", "argv.json", "job.json", "probes/image.json", "logs/unpack.log", "logs/probe.log"} <= set(
        hashes
    )
    for name, digest in hashes.items():
        assert hashlib.sha256((run_dir / name).read_bytes()).hexdigest() == digest, name


def test_the_run_directory_holds_records_and_the_image_stays_read_only(tmp_path, image, monkeypatch):
    """Promise: the root file system is unpacked once per digest into the cache, outside the run directory, and
    shown read-only; a second run re-hashes it and reuses it; a job cannot write into it."""
    import os

    from trainer.launch.host.rootfs import FILES, tree

    monkeypatch.setenv("TRAINER_ROOTFS_CACHE", str(tmp_path / "own-cache"))

    job = 'launcher.job=[python3,-c,\'open("/usr/written","w")\']'
    result, run_dir = launch(tmp_path / "a", image, None, job)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Read-only file system" in (run_dir / "logs" / "job.log").read_text()
    record = json.loads((run_dir / "record.json").read_text())
    cached = record["image"]["rootfs"]
    entry = Path(cached["cache"])
    assert entry.parent == Path(os.environ["TRAINER_ROOTFS_CACHE"]) and entry.name == image["digest"][7:]
    assert cached["unpacked"] is True and cached["files"] > 10
    assert not (entry / "bundle" / "rootfs" / "usr" / "written").exists()
    assert tree(entry / "bundle") == json.loads((entry / FILES).read_text())["files"]  # unchanged by the run
    assert not (run_dir / "image" / "bundle").exists()
    assert sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file()) < 1 << 20
    again, second = launch(tmp_path / "b", image)
    assert again.returncode == 0, again.stderr
    reused = json.loads((second / "record.json").read_text())["image"]["rootfs"]
    assert reused["unpacked"] is False and reused["files_sha256"] == cached["files_sha256"]
    assert "re-hashed and unchanged" in (second / "logs" / "unpack.log").read_text()
    # a damaged entry is never used: it is unpacked anew
    victim = next(p for p in (entry / "bundle" / "rootfs").rglob("*.py") if p.is_file())
    victim.write_text("# changed in the cache\n")
    third, run3 = launch(tmp_path / "c", image)
    assert third.returncode == 0, third.stderr
    assert json.loads((run3 / "record.json").read_text())["image"]["rootfs"]["unpacked"] is True
    assert "was damaged" in (run3 / "logs" / "unpack.log").read_text()
    assert victim.read_text() != "# changed in the cache\n"


def test_secrets_in_the_image_are_redacted_its_words_are_not_and_every_hash_holds(tmp_path, image):
    """Promise: the sweep learns secrets only from the run's overrides and environment, never from files: the planted
    secret is redacted in the job's log, ordinary words (password, username, container, terminal) stay wherever a
    pattern did not match, the copied stamp stays byte-exact, and the record's hashes and the signed attestation
    hold for every file."""
    assert trainer("keygen", "--out", tmp_path / "key").returncode == 0
    job = (
        "launcher.job=[python3,-c,'import alpha, pathlib; "
        'print(pathlib.Path(alpha.__file__).with_name("smb.conf").read_text())\']'
    )
    result, run_dir = launch(tmp_path, image, None, job, f"+env.HF_TOKEN={SECRET}", "--sign-key", str(tmp_path / "key"))
    assert result.returncode == 0, result.stdout + result.stderr
    log = (run_dir / "logs" / "job.log").read_text()
    assert SECRET not in log and "token <redacted>" in log
    assert WORDS in log and "SMB_PASSWORD=<redacted>" in log and "USERNAME: username" in log  # not a secret name
    texts = {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert not [name for name, data in texts.items() if SECRET.encode() in data]
    # <redacted> only where a secret was: the job's log, and the overrides and environment naming HF_TOKEN
    redacted = {name for name, data in texts.items() if b"<redacted>" in data}
    assert "logs/job.log" in redacted and "image/lock.json" not in redacted and "probes/image.json" not in redacted
    for name in redacted - {"logs/job.log"}:
        assert all(b"HF_TOKEN" in line for line in texts[name].splitlines() if b"<redacted>" in line), name
    record = json.loads(texts["record.json"])
    assert hashlib.sha256(texts["image/lock.json"]).hexdigest() == record["image"]["stamp_sha256"]
    stamp = Path(record["image"]["rootfs"]["cache"]) / "bundle" / "rootfs" / "etc" / "recipe-bundle" / "lock.json"
    assert texts["image/lock.json"] == stamp.read_bytes()  # verbatim, whatever words it holds
    assert set(record["files_sha256"]) == set(texts) - {"record.json", "attestation.json"}
    for name, digest in record["files_sha256"].items():
        assert hashlib.sha256(texts[name]).hexdigest() == digest, name
    signed = trainer("verify", run_dir, "--key", tmp_path / "key.pub", "--json")
    assert json.loads(signed.stdout)["signed"] is True, signed.stderr


def test_a_link_in_the_image_never_reads_a_file_of_this_machine(tmp_path):
    """Promise: the image's stamped lock is read as the image sees it: a link to an absolute path resolves inside
    the image's root, never to this machine's file of that name (which would become the run's lock, unredacted)."""
    import subprocess

    host_file = tmp_path / "host-secret.json"
    host_file.write_text('{"lock": "forged", "python": {"version": "3.11.7"}, "distributions": {}, "sources": {}}')
    layout, bundle = tmp_path / "layout", tmp_path / "bundle"
    for command in (
        ["umoci", "init", "--layout", layout],
        ["umoci", "new", "--image", f"{layout}:t"],
        ["umoci", "unpack", "--image", f"{layout}:t", bundle],
    ):
        subprocess.run([str(c) for c in command], check=True, capture_output=True)
    stamp = bundle / "rootfs" / "etc" / "recipe-bundle" / "lock.json"
    stamp.parent.mkdir(parents=True)
    stamp.symlink_to(host_file)
    subprocess.run(["umoci", "repack", "--image", f"{layout}:t", str(bundle)], check=True, capture_output=True)
    index = json.loads((layout / "index.json").read_text())
    digest = next(
        m["digest"]
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == "t"
    )
    result, run_dir = launch(tmp_path / "run", {"layout": layout}, digest)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((run_dir / "record.json").read_text())
    assert "stamp_sha256" not in record["image"] and not (run_dir / "image" / "lock.json").exists()
    assert record["lock"] == {"path": "lockfiles/launcher.lock"}
    assert not [p for p in run_dir.rglob("*") if p.is_file() and b"forged" in p.read_bytes()]


def test_a_digest_not_in_the_layout_is_refused(tmp_path, image):
    other = "sha256:" + "0" * 64
    result, run_dir = launch(tmp_path, image, other)
    assert result.returncode == 2
    assert result.stderr.strip() == f"train: error: launcher.image {other}: no such manifest blob in {image['layout']}"
    assert json.loads((run_dir / "record.json").read_text())["status"] == "failed"


def test_the_dynamic_loader_is_read_from_the_elf_header(tmp_path):
    loader = elf_interpreter(Path(sys.executable).resolve())
    assert loader.startswith("/") and Path(loader).name.startswith("ld-") and Path(loader).is_file()
    (tmp_path / "script").write_text("#!/bin/sh\n")
    assert elf_interpreter(tmp_path / "script") is None


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
