"""``train --resume`` of a local-cpu run (DP2) that a killed rank ended: the run continues from its latest
checkpoint (Megatron's layout, ``launcher.save_interval``), the record links both attempts, the per-step losses
are those of an uninterrupted run (``trainer converge`` passes) and ``trainer verify`` passes. A checkpoint whose
bytes changed since the failed attempt recorded them is refused before anything is written."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train

STEPS, SAVE = 6, 2
ARGS = ["experiment=smoke", "layout=gpu2-tp1pp1ep1", f"launcher.steps={STEPS}", f"launcher.save_interval={SAVE}"]
CKPT = "checkpoints/iter_{:07d}/mp_rank_00/model_optim_rng.pt"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(uninterrupted, killed) run directories: both started together; rank 1 of the second is killed (SIGKILL)
    once its step 3 is written (a checkpoint of step 2 is then the latest). Its gloo rendezvous file as it was
    then is kept beside it (``rendezvous.stale``): what a SIGKILL of the launcher, which removes it, leaves."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "160"}
    dirs = {name: tmp_path_factory.mktemp(name) / "run" for name in ("whole", "killed")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "trainer.train", *ARGS, f"hydra.run.dir={run_dir}"],
            cwd=run_dir.parent,
            env=env,
            stdout=(run_dir.parent / "train-output.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for name, run_dir in dirs.items()
    }
    try:
        killed = dirs["killed"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert procs["killed"].poll() is None, (killed.parent / "train-output.log").read_text()[-3000:]
            if (killed / "metrics.jsonl").is_file() and len(rows(killed)) >= 3:
                break
            time.sleep(0.2)
        victim = helpers.pids_running("trainer.launch.cpu_worker", str(killed), "1")
        assert len(victim) == 1
        (killed.parent / "rendezvous.stale").write_bytes((killed / ".rendezvous").read_bytes())
        os.kill(victim[0], signal.SIGKILL)
        for proc in procs.values():
            proc.wait(timeout=300)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs["whole"].returncode == 0, (dirs["whole"].parent / "train-output.log").read_text()[-3000:]
    assert procs["killed"].returncode == 1, (killed.parent / "train-output.log").read_text()[-3000:]
    return dirs["whole"], killed


def test_the_killed_run_failed_naming_the_rank_and_kept_its_checkpoints(runs):
    whole, killed = runs
    record = json.loads((killed / "record.json").read_text())
    assert record["status"] == "failed" and "rank 1" in record["reason"], record["reason"]
    done = int((killed / "checkpoints/latest_checkpointed_iteration.txt").read_text())
    assert done in (2, 4) and len(rows(killed)) >= 3
    # the failed attempt's record vouches for every checkpoint it left (the sweep leaves their bytes alone)
    for step in range(SAVE, done + 1, SAVE):
        data = (killed / CKPT.format(step)).read_bytes()
        assert record["files_sha256"][CKPT.format(step)] == hashlib.sha256(data).hexdigest()
    assert sorted(json.loads((whole / "record.json").read_text())["files_sha256"]).count(CKPT.format(STEPS)) == 1


def test_a_checkpoint_changed_by_one_byte_is_refused_and_nothing_is_written(runs, tmp_path):
    _, killed = runs
    done = int((killed / "checkpoints/latest_checkpointed_iteration.txt").read_text())
    path = killed / CKPT.format(done)
    before = {p: p.read_bytes() for p in (killed / "record.json", killed / "metrics.jsonl")}
    original = path.read_bytes()
    for offset in (0, len(original) // 2, len(original) - 1):
        changed = bytearray(original)
        changed[offset] ^= 0x01
        path.write_bytes(bytes(changed))
        try:
            refused = run_train([*ARGS, f"hydra.run.dir={killed}", "--resume"], cwd=tmp_path)
        finally:
            path.write_bytes(original)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and CKPT.format(done) in lines[0] and "changed since" in lines[0], refused.stderr
        assert not (killed / "attempts").exists()
        assert {p: p.read_bytes() for p in before} == before


def test_resume_continues_from_the_checkpoint_and_trains_like_the_uninterrupted_run(runs, tmp_path):
    whole, killed = runs
    failed = (killed / "record.json").read_bytes()
    done = int((killed / "checkpoints/latest_checkpointed_iteration.txt").read_text())
    # the gloo file of a killed launcher's group: the launch removes it before the ranks rendezvous again
    (killed / ".rendezvous").write_bytes((killed.parent / "rendezvous.stale").read_bytes())
    resumed = run_train([*ARGS, f"hydra.run.dir={killed}", "--resume"], cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert f"resumed from {CKPT.format(done)}: steps 1-{done} done" in resumed.stdout
    record = json.loads((killed / "record.json").read_text())
    assert record["status"] == "complete"
    # the record links both attempts: the first one's record kept byte for byte, by its sha256
    [first] = record["attempts"]
    assert first["attempt"] == 1 and first["status"] == "failed" and "rank 1" in first["reason"]
    assert (killed / first["record"]).read_bytes() == failed
    assert first["record_sha256"] == hashlib.sha256(failed).hexdigest()
    assert record["files_sha256"][first["record"]] == first["record_sha256"]
    assert first["resumed_from_iteration"] == done and first["steps_written"] >= 3
    assert record["resumed_from"] == {
        "attempt": 1,
        "iteration": done,
        "checkpoint": CKPT.format(done),
        "sha256": json.loads(failed)["files_sha256"][CKPT.format(done)],
    }
    # one row per step, the checkpoint's steps from the first attempt and the rest from the second, as the
    # uninterrupted run's: the same function (CPU arithmetic, the same order of operations)
    helpers.same_training(whole, killed, STEPS, loss_rel=1e-6, grad_rel=1e-5)
    assert [r["lr"] for r in rows(killed)] == [r["lr"] for r in rows(whole)]
    verified = helpers.run_trainer("verify", killed)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-1000:]
    assert f"run complete, {STEPS} steps in metrics.jsonl" in verified.stdout
    assert f"attempt 1: failed, resumed from step {done}; attempts/1/record.json linked by sha256" in verified.stdout


def test_verify_fails_when_an_earlier_attempts_record_is_changed_or_gone(runs):
    """Tamper test of verify's attempt rows: each byte region of attempts/1/record.json changed, the file
    removed, and its entry pointed at a checkpoint its record does not vouch for."""
    _, killed = runs
    path = killed / "attempts/1/record.json"
    original, record_bytes = path.read_bytes(), (killed / "record.json").read_bytes()

    def verify_line():
        out = helpers.run_trainer("verify", killed, "--json")
        return out.returncode, json.loads(out.stdout)["attempts"][0]

    try:
        for offset in (0, len(original) // 2, len(original) - 2):
            changed = bytearray(original)
            changed[offset] ^= 0x20
            path.write_bytes(bytes(changed))
            code, row = verify_line()
            assert code == 1 and row["ok"] is False and "sha256 is not the one" in row["line"], row
        path.unlink()
        code, row = verify_line()
        assert code == 1 and row == {
            "attempt": 1,
            "record": "attempts/1/record.json",
            "ok": False,
            "line": "attempt 1: attempts/1/record.json: missing",
        }
        path.write_bytes(original)
        record = json.loads(record_bytes)
        record["attempts"][0]["checkpoint_sha256"] = "0" * 64
        (killed / "record.json").write_text(json.dumps(record))
        code, row = verify_line()
        assert code == 1 and "does not vouch for the checkpoint" in row["line"], row
    finally:
        path.write_bytes(original)
        (killed / "record.json").write_bytes(record_bytes)
    code, row = verify_line()
    assert code == 0 and row["ok"] is True


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
