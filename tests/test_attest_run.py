"""Run attestations: a smoke CPU run signs attestation.json; `trainer verify --key` accepts it with the public
key and refuses a changed byte of metrics.jsonl, a tampered statement, another key and a truncated file."""

import helpers

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import run_train, run_trainer as trainer
from trainer.record import attest


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("attest")
    assert trainer("keygen", "--out", root / "key").returncode == 0
    assert trainer("keygen", "--out", root / "other").returncode == 0
    run_dir = root / "run"
    proc = run_train(["experiment=smoke", "launcher.steps=2", f"hydra.run.dir={run_dir}", "--sign-key", root / "key"],
                     root, timeout=600)
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
    assert s["predicateType"] == "https://github.com/recipe-bundle/recipe-bundle/attestation/run/v1"
    names = {x["name"]: x["digest"]["sha256"] for x in s["subject"]}
    assert set(names) == {"metrics.jsonl", "config.yaml", "data/rows/manifest.json"}
    for name, digest in names.items():
        assert digest == sha(run["dir"] / name)
    record = json.loads((run["dir"] / "record.json").read_text())
    assert record["attestation"]["path"] == "attestation.json"
    assert record["attestation"]["sha256"] == sha(run["dir"] / "attestation.json")
    assert record["attestation"]["signed_by"] == attest.load_public_key(run["pub"]).keyid
    pred = s["predicate"]
    assert pred["run"]["status"] == "complete" and pred["run"]["launcher"] == "local-cpu"
    assert pred["probes"]["ranks"] == record["probe"]["ranks"]
    assert pred["probes"]["ranks"][0]["torch"]["version"].startswith("2.")
    table = json.loads(trainer("verify", run["dir"], "--json").stdout)
    assert pred["verify"]["ok"] == table["ok"] and pred["verify"]["rows"] == table["rows"]
    assert pred["verify"]["lock"] == "lockfiles/launcher.lock"


def test_verify_with_the_public_key_and_in_toto_agree(run):
    from in_toto.exceptions import SignatureVerificationError
    from in_toto.models._signer import load_public_key_from_file
    from in_toto.models.metadata import Metadata

    r = trainer("verify", run["dir"], "--key", run["pub"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"attestation ok: {run['dir'] / 'attestation.json'} signed by ")
    assert json.loads(trainer("verify", run["dir"], "--key", run["pub"], "--json").stdout)["signature"] == \
        r.stdout.splitlines()[0]
    metadata = Metadata.load(str(run["dir"] / "attestation.json"))
    metadata.verify_signature(load_public_key_from_file(str(run["pub"])))
    with pytest.raises(SignatureVerificationError):
        metadata.verify_signature(load_public_key_from_file(str(run["other"])))


def test_any_changed_byte_of_metrics_fails(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run["dir"], work)
    key = attest.load_public_key(run["pub"])
    metrics = work / "metrics.jsonl"
    original = metrics.read_bytes()
    assert len(original) > 100
    for i in range(len(original)):
        changed = bytearray(original)
        changed[i] ^= 0x01
        metrics.write_bytes(bytes(changed))
        with pytest.raises(attest.VerificationFailed, match="subject metrics.jsonl has sha256"):
            attest.check_run(work, key)
    metrics.write_bytes(original + b"\n")
    one_line(trainer("verify", work, "--key", run["pub"]), 1, "metrics.jsonl", "changed after the run")
    metrics.write_bytes(original)
    assert attest.check_run(work, key)["subject"]


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
    assert json.loads((work / "record.json").read_text())["attestation"]["sha256"] == sha(work / "attestation.json")
    before = (work / "attestation.json").read_bytes()
    one_line(trainer("attest", work, "--sign-key", key), 2, "exists")
    assert (work / "attestation.json").read_bytes() == before
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

if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
