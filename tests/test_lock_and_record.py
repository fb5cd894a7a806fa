"""Lockfiles (launcher lock hashed, stack pins agree with conf/stack) and atomic run-record writes."""

import os
import re
import stat

import pytest

import helpers
from helpers import REPO_ROOT, compose
from trainer.compose.compose import validate
from trainer.compose.stackpins import load_stack_lock, verify_stack
from trainer.errors import UserError
from trainer.publish import atomic_write
from trainer.record.record import git_revision, write_json


def locked_requirements():
    """(name, version, hashes) of every requirement in lockfiles/launcher.lock."""
    text = (REPO_ROOT / "lockfiles" / "launcher.lock").read_text()
    entries = []
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = block.split()[0]
        if "==" not in head:
            continue
        name, version = head.split("==")
        entries.append((name.lower(), version, re.findall(r"--hash=sha256:([0-9a-f]{64})", block)))
    return entries


def test_launcher_lock_pins_every_package_with_hashes():
    entries = locked_requirements()
    names = [n for n, _, _ in entries]
    assert {"hydra-core", "omegaconf", "rich", "pyyaml", "pytest", "antlr4-python3-runtime", "setuptools"} <= set(names)
    assert len(names) == len(set(names))
    assert all(hashes for _, _, hashes in entries)


def test_launcher_environment_matches_the_lock():
    from importlib import metadata

    for name, version, _ in locked_requirements():
        if name == "colorama":  # Windows-only marker
            continue
        assert metadata.version(name) == version, name


def test_stack_config_agrees_with_the_lockfile():
    data = verify_stack(validate(compose()).stack)
    assert data["components"]["miles"]["commit"] == "78527b9102b3a5f15891128cbec3ac6c2dc4089e"


@pytest.mark.parametrize(
    "content,message", [("{", "not valid JSON"), ("[]", "expected an object with a 'components' object")]
)
def test_bad_stack_lockfile(tmp_path, content, message):
    path = tmp_path / "stack.json"
    path.write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        load_stack_lock(path)


def test_atomic_write_applies_umask_and_replaces(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "a.txt", b"one")
        atomic_write(tmp_path / "a.txt", b"two")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").read_bytes() == b"two"
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    class Boom:
        def __len__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        atomic_write(tmp_path / "b.json", Boom())
    assert list(tmp_path.iterdir()) == []


def test_write_json_is_canonical(tmp_path):
    a = write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    b = write_json(tmp_path / "b.json", {"a": [1, 2], "b": 1})
    assert a == b
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'


def test_redaction_of_argv_and_url_credentials():
    from trainer.redact import redact_argv, redact_env

    assert redact_argv(
        ["train", "+env.HF_TOKEN=hf_abc", "optim.lr=1e-5", "paths.prompt_data=s3://u:pw@bucket/rows"]
    ) == ["train", "+env.HF_TOKEN=<redacted>", "optim.lr=1e-5", "paths.prompt_data=s3://<redacted>@bucket/rows"]
    assert redact_env({"PIP_INDEX_URL": "https://user:pw@pypi.example/simple", "DB_PASSWD": "x", "PATH": "/bin"}) == {
        "DB_PASSWD": "<redacted>",
        "PATH": "/bin",
        "PIP_INDEX_URL": "https://<redacted>@pypi.example/simple",
    }


def test_verify_versions_and_commits():
    from trainer.record.verify import _same

    assert _same("2.11.0+cu130", "2.11.0")  # the lock pins no build label
    assert not _same("2.11.0", "2.11.0+cu130") and not _same("2.11.0+cpu", "2.11.0+cu130")
    assert _same("37f91617b95c1ef4f01fc66210e502572ad97fda", "37f91617")  # a commit and its prefix
    assert not _same("2.6.0.post10", "2.6.0.post1")  # prefixes count for commits only


def test_verify_checks_every_ranks_distributions_and_digest():
    """Tamper test of the image-stamp rows: every rank's distributions (pairs, as the probe writes them) against
    the stamped lock's ``dist:`` pins, and every rank's image digest against the record's. One rank's changed
    version, a rank without its list, a list cut to garbage, one rank's other digest: each turns a row from ok."""
    from trainer.record.verify import verify

    digest = "sha256:" + "ab" * 32
    lock = {"python": "3.11", "dist:ray": "2.60.0", "dist:google-auth": "2.63.0"}

    def rank(**change):
        probe = {
            "python": {"version": "3.11.2"},
            "image": {"digest": digest},
            "distributions": [["google-auth", "2.63.0"], ["ray", "2.60.0"]],
        }
        return {**probe, **change}

    def verdicts(ranks):
        rows = verify({"probe": {"ranks": ranks}, "image": {"digest": digest}}, lock, {})
        return {r["component"]: r["verdict"] for r in rows if r["component"] in ("ray", "google-auth", "image digest")}

    ok = {"ray": "ok", "google-auth": "ok", "image digest": "ok"}
    assert verdicts([rank(), rank()]) == ok
    assert verdicts([rank(), rank(distributions={"ray": "2.60.0", "google-auth": "2.63.0"})]) == ok  # older form
    assert verdicts([rank(), rank(distributions=[["google-auth", "2.63.0"], ["ray", "2.61.0"]])])["ray"] == "drift"
    assert verdicts([rank(), rank(distributions=None)]) == {**ok, "ray": "drift", "google-auth": "drift"}
    assert verdicts([rank(distributions=None)]) == {**ok, "ray": "absent", "google-auth": "absent"}
    assert verdicts([rank(distributions="ray==2.60.0")])["ray"] == "absent"  # garbage: no traceback, not ok
    assert verdicts([rank(distributions=[["ray"]])])["ray"] == "absent"
    assert verdicts([rank(), rank(image={"digest": "sha256:" + "cd" * 32})])["image digest"] == "drift"
    assert verdicts([rank(), rank(image={})])["image digest"] == "drift"


def test_git_revision_from_nix(monkeypatch):
    monkeypatch.setenv("TRAINER_SOURCE_REVISION", "dirty")
    assert git_revision() == {"revision": None, "dirty": True, "from": "nix flake"}
    monkeypatch.setenv("TRAINER_SOURCE_REVISION", "a" * 40)
    assert git_revision()["revision"] == "a" * 40


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
