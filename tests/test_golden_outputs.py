"""Golden outputs: what the front doors print and write for a fixed set of command lines, byte for byte.

Each case runs `train` or `trainer` as a user types it, in a fresh directory, and compares its exit code, standard
output, standard error and every file it writes into the run directory with ``tests/golden/outputs/CASE/``. Only
what differs between two honest runs of the same commit is normalised, each by a named rule below: the run
directory's path, the checkout's path, times, the bundle's git revision and the launcher environment's lock digest
and interpreter path (the lock changes when a requirement is added, not when the code does). Refactors must leave
every byte of the rest as it was.

Regenerate after an intended change of output with ``GOLDEN_UPDATE=1`` (then read the diff before committing).
"""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train, run_trainer

OUTPUTS = Path(__file__).absolute().parent / "golden" / "outputs"
RUN = "RUN_DIR"

# name -> (front door, arguments); RUN_DIR stands for the case's run directory.
CASES = {
    "train-plan-tp2pp4ep8": ("train", ["layout=tp2pp4ep8", f"hydra.run.dir={RUN}"]),
    "train-plan-tp8pp8ep8": ("train", ["layout=tp8pp8ep8", f"hydra.run.dir={RUN}"]),
    "train-slurm-tp2pp4ep8": (
        "train",
        [
            "launcher=slurm",
            "layout=tp2pp4ep8",
            "launcher.image=registry.example/recipe-bundle@sha256:" + "ab" * 32,
            f"hydra.run.dir={RUN}",
        ],
    ),
    "train-ray-no-address": ("train", ["launcher=ray", "layout=tp2pp4ep8", f"hydra.run.dir={RUN}"]),
    "train-smoke-plan": ("train", ["experiment=smoke", "launcher=plan", f"hydra.run.dir={RUN}"]),
    "train-smoke-cfg": ("train", ["experiment=smoke", "--cfg", "job"]),
    "train-help": ("train", ["--help"]),
    "train-cfg-job": ("train", ["layout=tp2pp4ep8", "--cfg", "job"]),
    "train-bad-group": ("train", ["layout=nope", f"hydra.run.dir={RUN}"]),
    "train-bad-value": ("train", ["layout.micro_batch_size=0", f"hydra.run.dir={RUN}"]),
    "train-bad-key": ("train", ["model.no_such_field=1", f"hydra.run.dir={RUN}"]),
    "trainer-help": ("trainer", ["--help"]),
    "trainer-converge-predict": (
        "trainer",
        ["converge", "--predict", "--candidate", "layout=tp2pp4ep8", "--reference", "layout=tp8pp8ep8", "--json"],
    ),
    "trainer-converge-predict-lr": (
        "trainer",
        ["converge", "--predict", "--candidate", "optim.lr=2e-5", "--reference", "layout=tp8pp8ep8"],
    ),
    "trainer-lock-verify-smoke": ("trainer", ["lock", "verify", str(REPO_ROOT / "lockfiles/smoke.lock.json")]),
    "trainer-image-predict": (
        "trainer",
        ["image", "check", "--lock", str(REPO_ROOT / "lockfiles/debian-full.lock.json"), "--predict"],
    ),
    "trainer-report-bad-run": ("trainer", ["report", "no-such-run"]),
}

TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?")
DATED_DIR = re.compile(r"outputs/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}\.\d+")


def normalise_text(text: str, run_dir: Path) -> str:
    """The rules: run directory → RUN_DIR, the case's working directory → CWD, checkout → REPO, times → TIME."""
    text = text.replace(str(run_dir), RUN).replace(str(run_dir.parent), "CWD").replace(str(REPO_ROOT), "REPO")
    text = DATED_DIR.sub("outputs/DATE/TIME", text)
    return TIME.sub("TIME", text)


def normalise_record(record: dict, run_dir: Path) -> dict:
    """The rules for record.json: the host's name, the bundle's revision and dirtiness, the creation time, the launcher
    environment (interpreter path and package versions follow the lock) and the launcher lock's digest. The
    digests of the run's files follow the paths and times inside them: each is checked against the file as written,
    then stands as CHECKED (the file itself is compared, normalised)."""
    record = dict(record)
    for name, digest in record.get("files_sha256", {}).items():
        assert hashlib.sha256((run_dir / name).read_bytes()).hexdigest() == digest, name
        record["files_sha256"][name] = "CHECKED"
    record.get("bundle", {}).update(revision="REVISION", dirty="DIRTY")
    for key in ("host", "created_utc", "launcher_env", "ended_utc", "started_utc"):
        if key in record:
            record[key] = key.upper()
    if "lockfiles/launcher.lock" in record.get("locks", {}):
        record["locks"]["lockfiles/launcher.lock"] = "LAUNCHER_LOCK"
    return record


def observe(case: str, tmp_path: Path) -> dict:
    """Run one case; return {"exit": ..., "stdout": ..., "stderr": ..., "files": {name: text}}."""
    door, args = CASES[case]
    run_dir = tmp_path / "run"
    args = [a.replace(RUN, str(run_dir)) for a in args]
    env = {"COLUMNS": "160", "TRAINER_FROZEN": "", "NO_COLOR": "1"}
    if door == "train":
        result = run_train(args, cwd=tmp_path, env=env)
    else:
        result = run_trainer(*args, cwd=tmp_path, env=env)
    files = {}
    if run_dir.is_dir():
        for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
            name = str(path.relative_to(run_dir))
            text = path.read_text()
            if name == "record.json":
                text = json.dumps(normalise_record(json.loads(text), run_dir), indent=2, sort_keys=True) + "\n"
            files[name] = normalise_text(text, run_dir)
    return {
        "exit": result.returncode,
        "stdout": normalise_text(result.stdout, run_dir),
        "stderr": normalise_text(result.stderr, run_dir),
        "files": files,
    }


def write_golden(case: str, seen: dict) -> None:
    """Store one case's observation as files: exit, stdout, stderr and files/NAME."""
    root = OUTPUTS / case
    if root.exists():
        import shutil

        shutil.rmtree(root)
    (root / "files").mkdir(parents=True)
    (root / "exit").write_text(f"{seen['exit']}\n")
    (root / "stdout").write_text(seen["stdout"])
    (root / "stderr").write_text(seen["stderr"])
    for name, text in seen["files"].items():
        (root / "files" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "files" / name).write_text(text)


def read_golden(case: str) -> dict:
    """The stored observation of one case (as `observe` returns it)."""
    root = OUTPUTS / case
    files = {
        str(p.relative_to(root / "files")): p.read_text() for p in sorted((root / "files").rglob("*")) if p.is_file()
    }
    return {
        "exit": int((root / "exit").read_text()),
        "stdout": (root / "stdout").read_text(),
        "stderr": (root / "stderr").read_text(),
        "files": files,
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_is_byte_identical_to_the_golden(case, tmp_path):
    seen = observe(case, tmp_path)
    if os.environ.get("GOLDEN_UPDATE"):
        write_golden(case, seen)
    golden = read_golden(case)
    assert seen["exit"] == golden["exit"]
    assert seen["stdout"] == golden["stdout"]
    assert seen["stderr"] == golden["stderr"]
    assert sorted(seen["files"]) == sorted(golden["files"])
    for name in golden["files"]:
        assert seen["files"][name] == golden["files"][name], name


def test_every_case_has_a_golden_and_every_golden_a_case():
    assert sorted(p.name for p in OUTPUTS.iterdir()) == sorted(CASES)


def test_the_golden_notices_one_changed_byte(tmp_path):
    """The comparison is not vacuous: a golden changed in one byte of the plan fails it."""
    seen = observe("train-plan-tp2pp4ep8", tmp_path)
    golden = read_golden("train-plan-tp2pp4ep8")
    assert seen == golden
    plan = golden["files"]["plan.json"]
    i = plan.index("64")
    golden["files"]["plan.json"] = plan[:i] + "65" + plan[i + 2 :]
    assert seen != golden


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
