"""Locks know their inputs, and digests are predicted without building.

- An image lock's ``resolved_from`` names its requirements file by sha256 with the resolver's options, and the
  launcher's lock says the same on its first line: `trainer lock verify`, `trainer image build` refuse a lock
  whose requirements changed since (naming the command that re-resolves it), and `--frozen` uses it as it is.
- `trainer image check --predict [--record]` gives the digests a build would give after a conf/ change, and a real
  build of the smoke lock agrees with its prediction byte for byte; a change below the bundle layer cannot be
  predicted and is refused.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import helpers
from helpers import REPO_ROOT

trainer = helpers.run_trainer
LOCKS = ("smoke", "debian-smoke", "full", "debian-full")


def one_line_refusal(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("name", LOCKS)
def test_every_lock_records_the_requirements_it_was_resolved_from(name):
    lock = json.loads((REPO_ROOT / "lockfiles" / f"{name}.lock.json").read_text())
    inputs = lock["resolved_from"]
    requirements = REPO_ROOT / "lockfiles" / inputs["requirements"]
    assert inputs["requirements"] == f"{name}.in"
    assert inputs["sha256"] == hashlib.sha256(requirements.read_bytes()).hexdigest()
    assert (inputs["python_version"], inputs["python_platform"]) == (
        lock["python"]["version"],
        lock["python"]["platform"],
    )
    assert inputs["index_url"] == "https://pypi.org/simple"


def copied(tmp_path, name="smoke"):
    """The lock and its requirements file copied into ``tmp_path`` (the lock's folder there)."""
    lock = tmp_path / f"{name}.lock.json"
    shutil.copy(REPO_ROOT / "lockfiles" / f"{name}.lock.json", lock)
    shutil.copy(REPO_ROOT / "lockfiles" / f"{name}.in", tmp_path / f"{name}.in")
    return lock


def test_a_changed_requirements_file_is_refused_with_the_command_that_re_resolves(tmp_path):
    lock = copied(tmp_path)
    ok = trainer("lock", "verify", lock)
    assert ok.returncode == 0 and "inputs: smoke.in as resolved" in ok.stdout, ok.stderr
    with open(tmp_path / "smoke.in", "a") as handle:
        handle.write("packaging==26.0\n")  # a pin appended, the lock not re-resolved
    stale = trainer("lock", "verify", lock)
    one_line_refusal(
        stale,
        "smoke.in changed since the lock was resolved",
        f"trainer lock resolve --requirements {tmp_path}/smoke.in --template {lock} --out {lock} "
        "--python-version 3.12 --python-platform x86_64-manylinux_2_28",
        "--frozen",
    )
    frozen = trainer("lock", "verify", "--frozen", lock)
    assert frozen.returncode == 0 and "(not compared: --frozen)" in frozen.stdout
    out = tmp_path / "out.oci"
    built = trainer("image", "build", "--lock", lock, "--out", out, "--cache", tmp_path / "cas", "--offline")
    one_line_refusal(built, "smoke.in changed since the lock was resolved")
    assert not out.exists() and not (tmp_path / "cas").exists()  # refused before anything is written
    (tmp_path / "smoke.in").unlink()
    one_line_refusal(trainer("lock", "verify", lock), "smoke.in, which is missing")


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("sha256", "not-a-sha", "resolved_from.sha256: expected a sha256"),
        ("requirements", "/etc/passwd", "resolved_from.requirements: expected a path relative to the lock's folder"),
        ("python_platform", 3, "resolved_from.python_platform: expected str"),
    ],
)
def test_a_malformed_inputs_record_is_one_line(tmp_path, field, value, needle):
    lock = copied(tmp_path)
    data = json.loads(lock.read_text())
    data["resolved_from"][field] = value
    lock.write_text(json.dumps(data))
    one_line_refusal(trainer("lock", "verify", lock), needle)


def test_the_launcher_lock_knows_its_requirements(tmp_path):
    from trainer.errors import UserError
    from trainer.lock.imagelock import stale_requirements_lock

    assert stale_requirements_lock(REPO_ROOT / "lockfiles" / "launcher.lock") is None
    lock = tmp_path / "launcher.lock"
    shutil.copy(REPO_ROOT / "lockfiles" / "launcher.lock", lock)
    shutil.copy(REPO_ROOT / "lockfiles" / "launcher.in", tmp_path / "launcher.in")
    assert stale_requirements_lock(lock) is None
    with open(tmp_path / "launcher.in", "a") as handle:
        handle.write("packaging==26.0\n")
    stale = stale_requirements_lock(lock)
    assert stale.startswith(f"{lock}: {tmp_path}/launcher.in changed since the lock was resolved")
    assert "re-resolve with `bin/lock-launcher" in stale
    verify = trainer("lock", "verify", lock)
    one_line_refusal(verify, "launcher.in changed since the lock was resolved")
    assert trainer("lock", "verify", "--frozen", lock).returncode == 0
    lock.write_text("".join(lock.read_text().splitlines(keepends=True)[1:]))  # its first line removed
    with pytest.raises(UserError, match="line 1 does not say what the lock was resolved from"):
        stale_requirements_lock(lock)


def test_train_refuses_a_launcher_lock_whose_requirements_changed(tmp_path):
    """`train` (a plan) refuses a checkout whose lockfiles/launcher.in changed since launcher.lock was resolved,
    naming the command that re-resolves it; `--frozen` plans with the lock as it is."""
    root = tmp_path / "checkout"
    for part in ("trainer", "conf", "lockfiles", "schema"):
        shutil.copytree(REPO_ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    with open(root / "lockfiles" / "launcher.in", "a") as handle:
        handle.write("packaging==26.0\n")
    env = {**os.environ, "PYTHONPATH": str(root), "TRAINER_COMPOSE_CACHE": "off"}

    def train(*args):
        return subprocess.run(
            [sys.executable, "-m", "trainer.train", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = train(f"hydra.run.dir={tmp_path / 'run'}")
    one_line_refusal(
        r, "launcher.in changed since the lock was resolved", "bin/lock-launcher", "pass --frozen to train"
    )
    assert not (tmp_path / "run").exists()
    frozen = train("--frozen", f"hydra.run.dir={tmp_path / 'run'}")
    assert frozen.returncode == 0, frozen.stderr


def test_a_change_below_the_bundle_layer_is_not_predicted(tmp_path):
    lock = copied(tmp_path, "debian-full")
    data = json.loads(lock.read_text())
    wheel = next(w for w in data["wheels"] if w["group"] == "rest")
    wheel["sha256"] = "0" * 64  # another file for one wheel: its layer's bytes are not known without a build
    lock.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    expected = tmp_path / "expected.json"
    shutil.copy(REPO_ROOT / "lockfiles" / "expected-digests.json", expected)
    before = expected.read_bytes()
    r = trainer("image", "check", "--lock", lock, "--expected", expected, "--predict", "--record")
    one_line_refusal(r, "layer rest's inputs changed since its build was recorded", "build the image and record it")
    assert expected.read_bytes() == before


def test_a_conf_change_is_predicted_without_building(tmp_path):
    expected = tmp_path / "expected.json"
    shutil.copy(REPO_ROOT / "lockfiles" / "expected-digests.json", expected)
    lock = REPO_ROOT / "lockfiles" / "debian-full.lock.json"
    same = trainer("image", "check", "--lock", lock, "--expected", expected, "--predict")
    assert same.returncode == 0 and same.stdout.startswith("ok: a build now gives"), same.stderr
    bundle = tmp_path / "bundle"
    shutil.copytree(REPO_ROOT / "conf", bundle / "conf")
    (bundle / "conf" / "optim" / "recipe-sft.yaml").write_text(
        (bundle / "conf" / "optim" / "recipe-sft.yaml").read_text() + "# edited\n"
    )
    changed = trainer("image", "check", "--lock", lock, "--expected", expected, "--predict", "--bundle-root", bundle)
    assert changed.returncode == 1 and changed.stdout.startswith("different: a build now gives")
    recorded = trainer(
        "image", "check", "--lock", lock, "--expected", expected, "--predict", "--record", "--bundle-root", bundle
    )
    assert recorded.returncode == 0, recorded.stderr
    old = json.loads((REPO_ROOT / "lockfiles" / "expected-digests.json").read_text())["debian-full"]
    new = json.loads(expected.read_text())["debian-full"]
    assert new["manifest_digest"] != old["manifest_digest"] and new["recorded_by"] == "prediction"
    assert [layer["diff_id"] for layer in new["layers"][:-1]] == [layer["diff_id"] for layer in old["layers"][:-1]]
    assert new["layers"][-1]["diff_id"] != old["layers"][-1]["diff_id"]
    assert new["builds"] == old["builds"]
    assert (
        trainer(
            "image", "check", "--lock", lock, "--expected", expected, "--predict", "--bundle-root", bundle
        ).returncode
        == 0
    )


def test_a_real_build_of_the_smoke_lock_matches_its_prediction_byte_for_byte(tmp_path):
    """Build lockfiles/smoke.lock.json (its wheels from PyPI), record it, change conf/, predict and record that,
    build again from the changed conf/: `image check` finds the build to be the prediction (manifest, config and
    every layer)."""
    cache = tmp_path / "cas"
    made = trainer("image", "smoke-source", tmp_path / "src")
    assert made.returncode == 0, made.stderr
    src = json.loads(made.stdout.splitlines()[0])
    assert trainer("cache", "--cache", cache, "add", src["archive"], "--sha256", src["sha256"]).returncode == 0
    lock = REPO_ROOT / "lockfiles" / "smoke.lock.json"
    fetched = trainer("cache", "--cache", cache, "fetch", "--lock", lock)
    if fetched.returncode != 0:
        pytest.skip(f"PyPI not reachable for the smoke lock's wheels: {fetched.stderr.strip()[-200:]}")
    bundle = tmp_path / "bundle"
    shutil.copytree(REPO_ROOT / "conf", bundle / "conf")
    expected = tmp_path / "expected.json"

    def build(name):
        r = trainer(
            "image",
            "build",
            "--lock",
            lock,
            "--out",
            tmp_path / name,
            "--cache",
            cache,
            "--offline",
            "--revision",
            "0.1.0",
            "--bundle-root",
            bundle,
            "--json",
            "-q",
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first = build("first.oci")
    assert (
        trainer(
            "image",
            "check",
            tmp_path / "first.oci",
            "--lock",
            lock,
            "--expected",
            expected,
            "--record",
            "--bundle-root",
            bundle,
        ).returncode
        == 0
    )
    (bundle / "conf" / "layout" / "tp2pp4ep8.yaml").write_text(
        (bundle / "conf" / "layout" / "tp2pp4ep8.yaml").read_text() + "# a comment changes the bundle layer\n"
    )
    predicted = trainer(
        "image", "check", "--lock", lock, "--expected", expected, "--predict", "--record", "--bundle-root", bundle
    )
    assert predicted.returncode == 0, predicted.stderr
    entry = json.loads(expected.read_text())["smoke"]
    assert entry["manifest_digest"] != first["manifest_digest"]
    second = build("second.oci")
    assert second["manifest_digest"] == entry["manifest_digest"]
    assert second["config_digest"] == entry["config_digest"]
    assert [(layer["name"], layer["diff_id"], layer["size"]) for layer in second["layers"]] == [
        (layer["name"], layer["diff_id"], layer["size"]) for layer in entry["layers"]
    ]
    check = trainer("image", "check", tmp_path / "second.oci", "--lock", lock, "--expected", expected)
    assert check.returncode == 0 and "is the expected digest" in check.stdout


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
