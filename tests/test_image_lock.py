"""Image locks: `trainer lock verify` (offline) and the pieces of `resolve` that need no network."""

import copy
import hashlib
import json

import pytest

import helpers
from helpers import REPO_ROOT
from trainer.errors import UserError
from trainer.lock.cli import group_of, parse_uv_output, verify
from trainer.lock.imagelock import find_stack_consistency, validate_lock
from trainer.lock.pypi import wheel_fits

SMOKE = REPO_ROOT / "lockfiles" / "smoke.lock.json"
STACK = REPO_ROOT / "lockfiles" / "stack.json"


def smoke():
    return json.loads(SMOKE.read_text())


def test_smoke_lock_verifies_offline():
    lock = verify(SMOKE, STACK)
    assert lock["base"] == {"type": "scratch"}
    assert all(
        len(w["sha256"]) == 64 and w["url"].startswith("https://files.pythonhosted.org/") for w in lock["wheels"]
    )
    assert lock["sources"][0]["commit"] == "7875b87a00de0eba599024fba624b636e483ae2f"


def test_smoke_source_is_reproducible_from_its_generator(tmp_path):
    from image_fixtures import SMOKE_EPOCH, SMOKE_SOURCE_FILES, make_git_source, sha256

    archive, commit, tree = make_git_source(tmp_path, "smoke-src", SMOKE_SOURCE_FILES, SMOKE_EPOCH)
    source = smoke()["sources"][0]
    assert (commit, tree, sha256(archive), archive.name) == (
        source["commit"],
        source["tree"],
        source["archive"]["sha256"],
        source["archive"]["filename"],
    )


def mutate(fn):
    lock = smoke()
    fn(lock)
    return lock


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda raw: raw["wheels"][0].pop("sha256"), r"wheels\[0\]\.sha256: expected str"),
        (lambda raw: raw["wheels"][0].update(sha256="ABC"), r"wheels\[0\]\.sha256: expected a sha256"),
        (
            lambda raw: raw["wheels"].append(copy.deepcopy(raw["wheels"][0])),
            r"wheels\[2\]\.name: 'idna' is locked twice",
        ),
        (lambda raw: raw["wheels"][1].update(sha256=raw["wheels"][0]["sha256"]), r"wheels\[1\]\.sha256: same hash as"),
        (lambda raw: raw["wheels"][0].update(group="gpu"), r"wheels\[0\]\.group: 'gpu'"),
        (
            lambda raw: raw["sources"][0].update(commit="7875b87"),
            r"sources\[0\]\.commit: expected a full 40-hex git id",
        ),
        (lambda raw: raw["base"].update(type="docker"), r"base\.type: 'docker'"),
        (lambda raw: raw.update(epoch="2026"), r"\.epoch: expected int"),
        (
            lambda raw: raw["python"].update(site_packages="lib/python3.12"),
            r"python\.site_packages: expected an absolute path",
        ),
        (lambda raw: raw["bundle"]["include"].append("../secrets"), r"bundle\.include: '\.\./secrets'"),
    ],
)
def test_malformed_locks_are_refused_naming_the_field(change, message):
    with pytest.raises(UserError, match=message):
        validate_lock(mutate(change), "smoke")


def test_stack_consistency_names_the_package_and_both_versions():
    stack = json.loads(STACK.read_text())
    lock = mutate(
        lambda raw: raw["wheels"].append(
            {
                "name": "torch",
                "version": "2.10.0",
                "filename": "torch-2.10.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                "url": "https://files.pythonhosted.org/t.whl",
                "sha256": "a" * 64,
                "group": "torch",
            }
        )
    )
    assert find_stack_consistency(lock, stack) == ["torch: lock has 2.10.0, stack.json components.torch pins 2.11.0"]
    ok = mutate(
        lambda raw: raw["wheels"].append(
            {
                "name": "torch",
                "version": "2.11.0",
                "filename": "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                "url": "https://files.pythonhosted.org/t.whl",
                "sha256": "a" * 64,
                "group": "torch",
            }
        )
    )
    assert find_stack_consistency(ok, stack) == []
    base = mutate(
        lambda raw: raw.update(
            base={
                "type": "oci",
                "reference": "lmsysorg/sglang:v0.5.15@sha256:" + "b" * 64,
                "digest": "sha256:" + "b" * 64,
            }
        )
    )
    assert find_stack_consistency(base, stack)[0].startswith("base: lock has lmsysorg/sglang:v0.5.15@")


def test_verify_cli_one_line_and_exit_codes(tmp_path):
    ok = helpers.run_trainer("lock", "verify", SMOKE)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ") and "2 wheels, 0 sdists, 1 sources" in ok.stdout
    bad = tmp_path / "bad.lock.json"
    bad.write_text(json.dumps(mutate(lambda raw: raw["wheels"][0].update(sha256="0"))))
    r = helpers.run_trainer("lock", "verify", bad)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "wheels[0].sha256" in r.stderr


UV_OUTPUT = """\
hydra-core==1.3.8 \\
    --hash=sha256:1111111111111111111111111111111111111111111111111111111111111111
    # via -r full.in
nvidia-nccl-cu13==2.28.9 ; platform_machine == 'x86_64' \\
    --hash=sha256:2222222222222222222222222222222222222222222222222222222222222222 \\
    --hash=sha256:3333333333333333333333333333333333333333333333333333333333333333
    # via torch
"""


def test_parse_uv_output_and_groups():
    assert parse_uv_output(UV_OUTPUT) == [
        ("hydra-core", "1.3.8", ["1" * 64]),
        ("nvidia-nccl-cu13", "2.28.9", ["2" * 64, "3" * 64]),
    ]
    assert [
        group_of(n)
        for n in ("torch", "triton", "transformer_engine_cu13", "nvidia-nccl-cu13", "cuda-toolkit", "hydra-core")
    ] == ["torch", "torch", "te", "cuda-runtime", "cuda-runtime", "rest"]


@pytest.mark.parametrize(
    "filename,fits",
    [
        ("six-1.17.0-py2.py3-none-any.whl", True),
        ("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", True),
        ("torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),
        ("torch-2.11.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
        ("tilelang-0.1.15-cp39-abi3-manylinux2014_x86_64.whl", True),
        ("x-1.0-cp312-cp312-win_amd64.whl", False),
    ],
)
def test_wheel_fits_cpython312_x86_64(filename, fits):
    assert wheel_fits(filename) is fits


def test_expected_digests_follow_the_current_conf():
    """expected-digests.json is not stale: the digest a build would give now, with the bundle layer made from
    this checkout's conf/ and the lower layers as recorded (they follow from the lock alone), is the recorded
    one. A change to conf/ or a lock without a new recorded build fails here, not on a user's machine."""
    from trainer.image.build import predict_digests

    table = json.loads((REPO_ROOT / "lockfiles" / "expected-digests.json").read_text())
    assert table, "no expected digests recorded"
    for name, entry in table.items():
        lock = REPO_ROOT / "lockfiles" / entry["lock"]
        assert hashlib.sha256(lock.read_bytes()).hexdigest() == entry["lock_sha256"], (
            f"{lock.name} changed since its digest was recorded: rebuild it and re-record with "
            f"`trainer image check --lock lockfiles/{lock.name} IMAGE --record`"
        )
        predicted = predict_digests(lock, entry, REPO_ROOT)
        assert predicted["manifest_digest"] == entry["manifest_digest"], (
            f"{name}: a build now gives {predicted['manifest_digest']} (bundle layer {predicted['bundle']}), "
            f"expected-digests.json says {entry['manifest_digest']}: conf/ changed since it was recorded; rebuild "
            f"and re-record with `trainer image check --lock lockfiles/{lock.name} IMAGE --record`"
        )
        assert predicted["config_digest"] == entry["config_digest"]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
