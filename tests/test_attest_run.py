"""Run attestations: a smoke CPU run signs attestation.json, which names every file of its run directory;
`trainer verify --key` accepts it with the public key, takes its verdict from what was signed, and refuses
(exit 1, one line) every mutation of a file it vouches for: a flipped byte, a file deleted, added, swapped, made a
link, record.json redirected to another lock, a forged metrics file under a failed run, another lock, a tampered
statement, another key and a truncated file."""

import base64
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

import helpers
from helpers import run_train
from helpers import run_trainer as trainer
from trainer import signing
from trainer.record import attest


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("attest")
    assert trainer("keygen", "--out", root / "key").returncode == 0
    assert trainer("keygen", "--out", root / "other").returncode == 0
    run_dir = root / "run"
    proc = run_train(
        ["experiment=smoke", "launcher.steps=2", f"hydra.run.dir={run_dir}", "--sign-key", root / "key"],
        root,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"root": root, "dir": run_dir, "pub": root / "key.pub", "other": root / "other.pub"}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def statement(run_dir: Path):
    return json.loads(base64.b64decode(json.loads((run_dir / "attestation.json").read_text())["payload"]))


def one_line(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    for word in words:
        assert word in r.stderr, r.stderr


def test_the_attestation_names_the_run_files_the_probe_and_the_verdict(run):
    s = statement(run["dir"])
    assert s["_type"] == "https://in-toto.io/Statement/v1"
    assert s["predicateType"] == "https://github.com/recipe-bundle/recipe-bundle/attestation/run/v2"
    names = {x["name"]: x["digest"]["sha256"] for x in s["subject"]}
    on_disk = {p.relative_to(run["dir"]).as_posix() for p in run["dir"].rglob("*") if p.is_file()}
    assert set(names) == on_disk - {"attestation.json"}
    assert {
        "record.json",
        "metrics.jsonl",
        "config.yaml",
        "argv.json",
        "env.json",
        "job.json",
        "plan.json",
        "command.sh",
        "probe-rank-0.json",
        "logs/rank-0.log",
        "data/rows/rows.parquet",
        "data/rows/manifest.json",
        ".hydra/overrides.yaml",
        "train.log",
    } <= set(names)
    for name, digest in names.items():
        assert digest == sha(run["dir"] / name)
    record = json.loads((run["dir"] / "record.json").read_text())
    assert record["attestation"] == {"path": "attestation.json", "signed_by": signing.load_public_key(run["pub"]).keyid}
    # the record's own hashes cover every other file, as they stay
    assert set(record["files_sha256"]) == on_disk - {"attestation.json", "record.json"}
    for name, digest in record["files_sha256"].items():
        assert digest == sha(run["dir"] / name), name
    pred = s["predicate"]
    assert pred["run"]["status"] == "complete" and pred["run"]["launcher"] == "local-cpu"
    assert pred["probes"]["ranks"] == record["probe"]["ranks"]
    # every rank's distributions as they are (google-auth is not a secret's name to redact)
    assert "<redacted>" not in json.dumps(record["probe"])
    assert dict(record["probe"]["ranks"][0]["distributions"])["torch"].startswith("2.")
    assert pred["probes"]["ranks"][0]["torch"]["version"].startswith("2.")
    table = json.loads(trainer("verify", run["dir"], "--json").stdout)
    assert pred["verify"]["ok"] == table["ok"] and pred["verify"]["rows"] == table["rows"]
    assert pred["verify"]["lock"] == {
        "path": "lockfiles/launcher.lock",
        "base": "bundle",
        "sha256": sha(helpers.REPO_ROOT / "lockfiles" / "launcher.lock"),
    }
    assert pred["run"]["steps"] == 2 == len((run["dir"] / "metrics.jsonl").read_text().splitlines())
    assert pred["unsigned"] == ["attestation.json"]


def test_verify_with_the_public_key_and_in_toto_agree(run):
    from in_toto.exceptions import SignatureVerificationError
    from in_toto.models._signer import load_public_key_from_file
    from in_toto.models.metadata import Metadata

    r = trainer("verify", run["dir"], "--key", run["pub"])
    assert r.returncode == 0, r.stderr
    files = len([p for p in run["dir"].rglob("*") if p.is_file()]) - 1
    assert r.stdout.splitlines()[0] == (
        f"attestation ok: {run['dir'] / 'attestation.json'} signed by "
        f"{signing.load_public_key(run['pub']).keyid}; {files} files of the run "
        "directory match, none added or removed"
    )
    assert "run complete, 2 steps in metrics.jsonl (as signed)" in r.stdout and "unsigned:" not in r.stdout
    signed = json.loads(trainer("verify", run["dir"], "--key", run["pub"], "--json").stdout)
    assert signed["signature"] == r.stdout.splitlines()[0]
    assert (signed["signed"], signed["status"], signed["steps"], signed["ok"]) == (True, "complete", 2, True)
    plain = trainer("verify", run["dir"])
    assert plain.returncode == 0 and plain.stdout.splitlines()[-1].startswith("unsigned: nothing above was checked")
    assert json.loads(trainer("verify", run["dir"], "--json").stdout)["signed"] is False
    metadata = Metadata.load(str(run["dir"] / "attestation.json"))
    metadata.verify_signature(load_public_key_from_file(str(run["pub"])))
    with pytest.raises(SignatureVerificationError):
        metadata.verify_signature(load_public_key_from_file(str(run["other"])))


def test_any_changed_byte_of_metrics_fails(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work)
    key = signing.load_public_key(run["pub"])
    metrics = work / "metrics.jsonl"
    original = metrics.read_bytes()
    assert len(original) > 100
    for i in range(len(original)):
        changed = bytearray(original)
        changed[i] ^= 0x01
        metrics.write_bytes(bytes(changed))
        with pytest.raises(signing.VerificationFailed, match="subject metrics.jsonl has sha256"):
            attest.check_run(work, key)
    metrics.write_bytes(original + b"\n")
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "metrics.jsonl", "changed after the run")
    metrics.write_bytes(original)
    assert attest.check_run(work, key).statement["subject"]


def test_tampered_truncated_and_foreign_attestations_are_refused(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work)
    path = work / "attestation.json"
    original = path.read_bytes()
    envelope = json.loads(original)
    s = statement(work)
    s["predicate"]["run"]["status"] = "complete (edited)"
    envelope["payload"] = base64.b64encode(json.dumps(s).encode()).decode()
    path.write_text(json.dumps(envelope))
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "does not verify")
    path.write_bytes(original[: len(original) // 2])
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "not valid JSON")
    path.write_bytes(original)
    one_line(trainer("verify", work, "--key", run["other"]), 1, "not by the given key")
    (work / "config.yaml").write_text((work / "config.yaml").read_text() + "# edited\n")
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "subject config.yaml")
    assert path.read_bytes() == original  # verify never writes


def test_an_unsigned_attestation_and_an_image_subject(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work)
    record = json.loads((work / "record.json").read_text())
    record["image"] = {"digest": "sha256:" + "ab" * 32, "lock": None}
    (work / "record.json").write_text(json.dumps(record))
    info = attest.write_run_attestation(work, record, None)
    assert info["signed_by"] is None
    bare = json.loads((work / "attestation.json").read_text())
    assert {"name": "oci-image", "digest": {"sha256": "ab" * 32}} in bare["subject"]
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "unsigned statement")


def test_trainer_attest_writes_the_attestation_of_an_ended_run_once(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work)
    (work / "attestation.json").unlink()
    key = run["root"] / "key"
    r = trainer("attest", work, "--sign-key", key)
    assert r.returncode == 0, r.stderr
    assert trainer("verify", work, "--key", run["pub"]).returncode == 0
    assert (
        json.loads((work / "record.json").read_text())["attestation"]["signed_by"]
        == signing.load_public_key(run["pub"]).keyid
    )
    before = (work / "attestation.json").read_bytes()
    one_line(trainer("attest", work, "--sign-key", key), 2, "exists")
    assert (work / "attestation.json").read_bytes() == before
    # a late log line (Slurm's output after the job marked its end): refused until attested again
    with (work / "logs" / "rank-0.log").open("a") as log:
        log.write("late line\n")
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "subject logs/rank-0.log", "--again")
    assert trainer("attest", work, "--sign-key", key, "--again").returncode == 0
    assert trainer("verify", work, "--key", run["pub"]).returncode == 0
    assert b"late line" in (work / "logs" / "rank-0.log").read_bytes()
    record = json.loads((work / "record.json").read_text())
    (work / "attestation.json").unlink()
    (work / "record.json").write_text(json.dumps({**record, "status": "submitted"}))
    one_line(trainer("attest", work), 2, "status 'submitted'")
    assert not (work / "attestation.json").exists()


def test_a_run_with_a_bad_signing_key_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "notakey").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    for key in (tmp_path / "missing", tmp_path / "notakey"):
        proc = run_train(["experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}", "--sign-key", str(key)], tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--sign-key" in proc.stderr, proc.stderr
        assert not (tmp_path / "run").exists()
    proc = run_train(["experiment=smoke", "--sign-key"], tmp_path)
    assert proc.returncode == 2 and "expected the path of a private key" in proc.stderr


# ------------------------------------------------------------------------------------------ the tamper suite


def copy(run, tmp_path) -> Path:
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work, symlinks=True)
    return work


def refused(run, work, *words, code=1):
    r = trainer("verify", work, "--key", run["pub"])
    one_line(r, code, *words)
    return r


def test_every_file_flipped_deleted_or_made_a_link_fails(run, tmp_path):
    """Promise: each file the attestation vouches for, of every kind in a run directory (the record, the launch,
    the plan, the probes, the logs, Hydra's files, the rows and their manifest, the metrics), fails verification
    when one byte changes (first, middle, last), when it is deleted, or when it becomes a link to a copy of itself."""
    work = copy(run, tmp_path)
    key = signing.load_public_key(run["pub"])
    names = [x["name"] for x in statement(work)["subject"]]
    assert len(names) >= 16
    for name in names:
        path = work / name
        original = path.read_bytes()
        variants = [
            original[:i] + bytes([original[i] ^ 0x20]) + original[i + 1 :]
            for i in sorted({0, len(original) // 2, len(original) - 1})
            if original
        ] or [b"x"]  # train.log: empty
        for changed in variants:
            path.write_bytes(changed)
            with pytest.raises(signing.VerificationFailed, match=f"subject {name} has sha256"):
                attest.check_run(work, key)
        path.unlink()
        with pytest.raises(signing.VerificationFailed, match=f"subject {name} is missing"):
            attest.check_run(work, key)
        (tmp_path / "elsewhere").write_bytes(original)
        path.symlink_to(tmp_path / "elsewhere")
        with pytest.raises(signing.VerificationFailed, match="symbolic link"):
            attest.check_run(work, key)
        path.unlink()
        path.write_bytes(original)
    assert attest.check_run(work, key).statement["subject"]
    # the same refusals through the command line: one line, exit 1
    (work / "data" / "rows" / "rows.parquet").write_bytes(
        b"PAR1" + (work / "data" / "rows" / "rows.parquet").read_bytes()[4:-1] + b"!"
    )
    refused(run, work, "subject data/rows/rows.parquet has sha256")


def test_an_added_or_swapped_file_fails(run, tmp_path):
    """Promise: a file added anywhere in the run directory, or two files whose contents were swapped, fails."""
    for extra in ("NOTES.md", "logs/late.log", "probes/node9.json", ".hydra/extra.yaml"):
        work = copy(run, tmp_path / extra.replace("/", "_"))
        (work / extra).parent.mkdir(parents=True, exist_ok=True)
        (work / extra).write_text("{}\n")
        refused(run, work, f"{extra} is not named by the attestation")
    work = copy(run, tmp_path / "swap")
    a, b = (work / "config.yaml").read_bytes(), (work / ".hydra" / "config.yaml").read_bytes()
    assert a != b
    (work / "config.yaml").write_bytes(b)
    (work / ".hydra" / "config.yaml").write_bytes(a)
    refused(run, work, "has sha256")
    work = copy(run, tmp_path / "dirlink")
    shutil.move(str(work / "logs"), str(tmp_path / "logs-elsewhere"))
    (work / "logs").symlink_to(tmp_path / "logs-elsewhere")
    refused(run, work, "logs is a symbolic link")


def test_an_edited_record_cannot_turn_drift_or_a_failure_into_ok(run, tmp_path):
    """Promise (the three ways the unsigned record once lied): restoring a probe's version in record.json,
    pointing record.json's lock at an empty file, and adding a forged metrics.jsonl to a failed run whose status is
    then set to complete all fail, whatever the record says."""
    from trainer.record.rundir import RunDir, utc_now

    work = copy(run, tmp_path / "probe")
    record = json.loads((work / "record.json").read_text())
    record["probe"]["ranks"][0]["torch"]["version"] = "9.9.9"
    (work / "record.json").write_text(json.dumps(record))
    refused(run, work, "subject record.json has sha256")
    work = copy(run, tmp_path / "lock")
    (tmp_path / "empty.lock").write_text("")
    record = json.loads((work / "record.json").read_text())
    record["lock"]["path"] = str(tmp_path / "empty.lock")
    (work / "record.json").write_text(json.dumps(record))
    refused(run, work, "subject record.json has sha256")
    # unsigned, the empty lock is refused too: a lock that pins nothing verifies nothing
    one_line(trainer("verify", work), 2, "pins none of the components")
    # a failed run, sealed without metrics; then forged metrics and the status set to complete
    work = copy(run, tmp_path / "forged")
    metrics = (work / "metrics.jsonl").read_bytes()
    (work / "metrics.jsonl").unlink()
    record = json.loads((work / "record.json").read_text())
    record.update(status="failed", reason="worker died", finished_utc=utc_now())
    RunDir(work).seal(record, signing.load_signer(run["root"] / "key"))
    failed = trainer("verify", work, "--key", run["pub"])
    assert failed.returncode == 0 and "run failed, 0 steps in metrics.jsonl (as signed)" in failed.stdout, failed.stdout
    (work / "metrics.jsonl").write_bytes(metrics)
    refused(run, work, "metrics.jsonl is not named by the attestation")
    record = json.loads((work / "record.json").read_text())
    (work / "record.json").write_text(json.dumps({**record, "status": "complete"}))
    refused(run, work, "metrics.jsonl is not named by the attestation")
    (work / "metrics.jsonl").unlink()
    refused(run, work, "subject record.json has sha256")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_a_directory_the_verifier_cannot_read_fails(run, tmp_path):
    """Promise: files hidden in a directory the verifier cannot list are not 'none added': verification fails.
    As root, the read override is dropped from the verifying process's capabilities (setpriv), as a user or root
    on a root-squashed NFS mount would be."""
    import os
    import subprocess

    work = copy(run, tmp_path / "run")
    (work / "hidden").mkdir()
    (work / "hidden" / "evil.txt").write_text("planted\n")
    (work / "hidden").chmod(0)
    try:
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
        probe = subprocess.run([*prefix, "ls", str(work / "hidden")], capture_output=True, text=True)
        if probe.returncode == 0:
            pytest.skip(f"this process can list a mode-000 directory even without its read override ({probe.stderr})")
        if "Permission denied" not in probe.stderr:
            pytest.skip(f"cannot drop the read override here: {probe.stderr.strip()}")
        command = [*prefix, sys.executable, "-m", "trainer", "verify", str(work), "--key", str(run["pub"])]
        env = {**os.environ, "PYTHONPATH": str(helpers.REPO_ROOT)}
        r = subprocess.run(command, capture_output=True, text=True, env=env, cwd=helpers.REPO_ROOT, timeout=120)
        one_line(r, 1, "hidden cannot be read")
    finally:
        (work / "hidden").chmod(0o755)


def test_the_lock_is_the_one_whose_digest_was_signed(run, tmp_path):
    """Promise: --key verifies against the lock the attestation signed by sha256; another --lock is refused, a
    byte-identical copy is accepted."""
    work = copy(run, tmp_path / "run")
    lock = helpers.REPO_ROOT / "lockfiles" / "launcher.lock"
    (tmp_path / "same.lock").write_bytes(lock.read_bytes())
    assert trainer("verify", work, "--key", run["pub"], "--lock", tmp_path / "same.lock").returncode == 0
    (tmp_path / "other.lock").write_bytes(lock.read_bytes() + b"extra==1.0\n")
    r = trainer("verify", work, "--key", run["pub"], "--lock", tmp_path / "other.lock")
    one_line(
        r, 1, f"--lock {tmp_path / 'other.lock'} has sha256", "the attestation signed the lock lockfiles/launcher.lock"
    )


def test_outside_rows_are_named_and_checked(run, tmp_path):
    """Promise: rows a run read from outside its directory (paths.prompt_data) are subjects by absolute path; a
    changed byte of their parquet fails."""
    import yaml

    from trainer.record.rundir import RunDir

    work = copy(run, tmp_path / "run")
    rows = tmp_path / "shared-rows"
    shutil.move(str(work / "data" / "rows"), str(rows))
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    cfg["paths"]["prompt_data"] = str(rows)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    record = json.loads((work / "record.json").read_text())
    RunDir(work).seal(record, signing.load_signer(run["root"] / "key"))
    names = {x["name"] for x in statement(work)["subject"]}
    assert {str(rows / "manifest.json"), str(rows / "rows.parquet")} <= names
    assert trainer("verify", work, "--key", run["pub"]).returncode == 0
    (rows / "extra.parquet").write_bytes(b"PAR1")
    refused(run, work, f"{rows / 'extra.parquet'} is not named by the attestation (added to the rows")
    (rows / "extra.parquet").unlink()
    data = bytearray((rows / "rows.parquet").read_bytes())
    data[len(data) // 2] ^= 1
    (rows / "rows.parquet").write_bytes(bytes(data))
    refused(run, work, f"subject {rows / 'rows.parquet'} has sha256", "the rows changed")


def test_a_redirected_subject_path_is_refused(run, tmp_path):
    """Promise: a statement naming a path outside the run directory by '..' is not a file of the run: refused."""
    from trainer.signing import sign

    work = copy(run, tmp_path / "run")
    s = statement(work)
    s["subject"].append({"name": "../escape.txt", "digest": {"sha256": "0" * 64}})
    (work / "attestation.json").write_bytes(sign(json.dumps(s).encode(), signing.load_signer(run["root"] / "key")))
    refused(run, work, "'../escape.txt' is not a file path inside the run directory")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
