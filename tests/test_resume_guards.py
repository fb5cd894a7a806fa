"""The guards of ``train --resume`` that need no training: which record may be continued (an ended one; a
``running`` one only once its process is gone, and then only from a checkpoint its hashes vouch for), the tracker
read as Megatron writes it and vouched for by the record, an ``attempts/N`` left by a killed resume, a half-written
metrics row, the worker's load of the checkpoint the record names (by its sha256), and ``trainer verify``'s
attempt links behind a symbolic link. Real checkpoints of a tiny torch model (:func:`trainer.launch.checkpoint.save`),
real run directories of ``train`` (a plan, its record edited to the state under test)."""

import hashlib
import json
import os
import shutil
import socket
import subprocess

import pytest
import torch

import helpers
from helpers import run_train
from trainer.errors import UserError
from trainer.launch import checkpoint
from trainer.record import attempts
from trainer.record.record import boot_id, pid_namespace, process_started
from trainer.record.verify_cli import check_attempts

TRACKER = "checkpoints/latest_checkpointed_iteration.txt"
CKPT = "checkpoints/iter_{:07d}/mp_rank_00/model_optim_rng.pt"


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny(seed=0):
    """A model and its AdamW, one step taken (so that the optimizer has state to save and load)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def record_of(run_dir):
    return json.loads((run_dir / "record.json").read_text())


def write_record(run_dir, record):
    (run_dir / "record.json").write_text(json.dumps(record, indent=1))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A plan run of ``train`` (its record, of the composition ``train`` then composes again), 20 metrics rows."""
    return helpers.planned_run(tmp_path_factory.mktemp("plan"))


@pytest.fixture
def ended(plan, tmp_path):
    """``plan`` copied, with the checkpoints of steps 2 and 4 (the tracker naming 4) and a record that ended
    ``failed`` vouching for them, the tracker included (as a sealed run's record does): the run directory."""
    run_dir = tmp_path / "run"
    shutil.copytree(plan, run_dir)
    model, optimizer = tiny()
    for step in (2, 4):
        checkpoint.save(run_dir, step, model, optimizer)
    record = record_of(run_dir)
    vouched = {rel: sha256(run_dir / rel) for rel in (TRACKER, CKPT.format(2), CKPT.format(4), "metrics.jsonl")}
    record.update(status="failed", reason="rank 1 exited with -9", files_sha256={**record["files_sha256"], **vouched})
    write_record(run_dir, record)
    return run_dir


def resume(run_dir, cwd):
    return run_train([f"hydra.run.dir={run_dir}", "--resume"], cwd=cwd)


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def running(record, pid):
    """``record`` as the launcher saved it while its run ran: ``running``, the identity of process ``pid``, the
    checkpoints and ``metrics.jsonl`` not hashed (a record is hashed when its run ends)."""
    files = {
        k: v for k, v in record["files_sha256"].items() if not k.startswith("checkpoints/") and k != "metrics.jsonl"
    }
    record = {k: v for k, v in record.items() if k not in ("reason", "finished_utc")}
    return {
        **record,
        "status": "running",
        "files_sha256": files,
        "host": socket.gethostname(),
        "pid": pid,
        "pid_started": process_started(pid),
        "boot_id": boot_id(),
        "pid_ns": pid_namespace(),
    }


# ------------------------------------------------------------------ 1, 2: a record that says running


def test_a_killed_run_whose_record_says_running_resumes_from_the_checkpoint_its_save_vouched_for(ended):
    """Finding 1 (host side): the launcher was killed (SIGKILL) and its record still says running; its process is
    gone, so the run is an ended attempt whose record never hashed its checkpoints. The save wrote the state's
    sha256 beside it (``sha256sum``'s line): that vouches for it, the attempt says so, and `trainer verify`'s
    attempt check passes while that file holds the sha256 the new record resumed from, and fails once it does
    not or is gone."""
    write_record(ended, running(record_of(ended), dead_pid()))
    state = sha256(ended / CKPT.format(4))
    sums = ended / f"{CKPT.format(4)}.sha256"
    assert sums.read_text() == f"{state}  model_optim_rng.pt\n"
    previous = attempts.ended_attempt(ended)
    assert previous["status"] == "interrupted"
    linked = attempts.continue_attempt(ended, previous)
    assert linked["resumed_from"] == {"attempt": 1, "iteration": 4, "checkpoint": CKPT.format(4), "sha256": state}
    assert linked["attempts"][0]["checkpoint_vouched_by"] == "writer"
    record = {**record_of(ended), **linked}
    [row] = check_attempts(ended, record)
    assert row["ok"] and row["line"].endswith("(its checkpoint vouched for by the sha256 file its save wrote)")
    sums.write_text(f"{'0' * 64}  model_optim_rng.pt\n")
    [row] = check_attempts(ended, record)
    assert not row["ok"] and "does not hold the sha256 of the checkpoint of step 4" in row["line"]
    sums.unlink()
    [row] = check_attempts(ended, record)
    assert not row["ok"] and "nothing vouches for the checkpoint of step 4" in row["line"]
    (ended / "attempts" / "1" / "record.json").write_text(json.dumps(record_of(ended) | {"status": "failed"}))
    record["attempts"][0]["record_sha256"] = sha256(ended / "attempts" / "1" / "record.json")
    [row] = check_attempts(ended, record)  # a sealed record that holds no checkpoint's hash vouches for none
    assert not row["ok"] and "does not vouch for the checkpoint of step 4" in row["line"]


def relink(run_dir, rel):
    """Move ``run_dir/rel`` out of the run directory and leave a symbolic link to it in its place."""
    moved = run_dir.parent / f"moved-{rel.replace('/', '-')}"
    (run_dir / rel).rename(moved)
    (run_dir / rel).symlink_to(moved)
    assert (run_dir / rel).is_symlink()


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at if at >= 0 else len(data) + at] ^= 0x01
    path.write_bytes(bytes(data))


WRITER_TAMPER = {  # name -> (change to the run directory, what the one line names)
    "state, first byte": (lambda d: flip(d / CKPT.format(4), 0), f"{CKPT.format(4)} changed since its save wrote"),
    "state, middle byte": (
        lambda d: flip(d / CKPT.format(4), (d / CKPT.format(4)).stat().st_size // 2),
        f"{CKPT.format(4)} changed since its save wrote",
    ),
    "state, last byte": (lambda d: flip(d / CKPT.format(4), -1), f"{CKPT.format(4)} changed since its save wrote"),
    "sha256 file, a digit": (
        lambda d: (d / f"{CKPT.format(4)}.sha256").write_text(
            "{}{}".format(
                *(lambda t: ("1" if t[0] != "1" else "2", t[1:]))((d / f"{CKPT.format(4)}.sha256").read_text())
            )
        ),
        "changed since its save wrote",
    ),
    "sha256 file, its name": (lambda d: flip(d / f"{CKPT.format(4)}.sha256", -3), "nor a sha256 file its save wrote"),
    "sha256 file gone": (lambda d: (d / f"{CKPT.format(4)}.sha256").unlink(), "nor a sha256 file its save wrote"),
    "sha256 file a link": (lambda d: relink(d, f"{CKPT.format(4)}.sha256"), "nor a sha256 file its save wrote"),
    "state a link": (lambda d: relink(d, CKPT.format(4)), f"{CKPT.format(4)}: missing, unreadable or a link"),
    "its folder a link": (lambda d: relink(d, "checkpoints/iter_0000004/mp_rank_00"), "nor a sha256 file its save"),
    "tracker without its newline": (lambda d: (d / TRACKER).write_bytes(b"4"), f"{TRACKER} holds b'4'"),
    "tracker with a zero": (lambda d: (d / TRACKER).write_bytes(b"04\n"), f"{TRACKER} holds b'04\\n'"),
}


@pytest.mark.parametrize("change", WRITER_TAMPER)
def test_a_checkpoint_its_save_vouched_for_is_refused_when_anything_it_vouches_for_changed(ended, change):
    """Tamper test of the save's voucher (a killed launcher's record, as above): a byte of the state (first,
    middle, last) or of its sha256 file changed, that file gone or a link, the state a link, the tracker not as a
    save writes it: each is refused in one line naming the file, before anything is written."""
    write_record(ended, running(record_of(ended), dead_pid()))
    tamper, says = WRITER_TAMPER[change]
    tamper(ended)
    before = helpers.tree_hash(ended)
    with pytest.raises(UserError) as refused:
        attempts.ended_attempt(ended)
    assert str(refused.value).startswith(f"{ended} (--resume): ") and says in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)
    assert helpers.tree_hash(ended) == before and not (ended / "attempts").exists()


def test_resume_of_a_slurm_job_slurm_cannot_say_has_ended_is_refused(ended, tmp_path):
    """A Slurm job's record that says running (its job wrote it) is reconciled with Slurm before a resume; where
    Slurm cannot say the job ended (here no controller answers for ``SLURM_CONF``), the resume is refused in one
    line naming the job, and nothing of the run is written."""
    record = {k: v for k, v in running(record_of(ended), dead_pid()).items() if k not in ("pid", "pid_started")}
    write_record(ended, {**record, "launcher": "slurm", "slurm": {"job_id": "4242", "nodes": ["n1"]}})
    before = helpers.tree_hash(ended)
    conf = tmp_path / "slurm.conf"
    conf.write_text(  # nothing listens on port 9; the client gives up at once (no retries of 10 s)
        "ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\nMessageTimeout=1\nTCPTimeout=1\n"
    )
    os.environ["SLURM_CONF"] = str(conf)
    try:
        with pytest.raises(UserError) as refused:
            attempts.ended_attempt(ended)
    finally:
        del os.environ["SLURM_CONF"]
    assert str(refused.value).startswith(f"{ended} (--resume): its record.json says running and its Slurm job 4242 is ")
    assert str(refused.value).endswith(": wait for it to end, or scancel it, before resuming")
    assert helpers.tree_hash(ended) == before and not (ended / "attempts").exists()


VERIFY_TAMPER = {  # name -> change to the run directory or to the new record's attempt entry
    "sha256 file, first byte": lambda d, e: flip(d / f"{CKPT.format(4)}.sha256", 0),
    "sha256 file, middle byte": lambda d, e: flip(d / f"{CKPT.format(4)}.sha256", 40),
    "sha256 file, last byte": lambda d, e: flip(d / f"{CKPT.format(4)}.sha256", -1),
    "sha256 file gone": lambda d, e: (d / f"{CKPT.format(4)}.sha256").unlink(),
    "sha256 file a link": lambda d, e: relink(d, f"{CKPT.format(4)}.sha256"),
    "its folder a link": lambda d, e: relink(d, "checkpoints/iter_0000004"),
    "the entry's checkpoint_sha256": lambda d, e: e.update(checkpoint_sha256="0" * 64),
    "the entry's voucher": lambda d, e: e.update(checkpoint_vouched_by="record"),
}


@pytest.mark.parametrize("change", VERIFY_TAMPER)
def test_verify_fails_an_attempt_vouched_by_its_save_when_anything_it_vouches_for_changed(ended, change):
    """Tamper test of `trainer verify`'s check of an attempt whose checkpoint the save's sha256 file vouched for
    (a killed launcher's record, resumed): a byte of that file (first, middle, last), the file gone or a link, a
    folder on its way a link, the attempt entry's checkpoint sha256 or voucher changed: each fails the row; the
    untouched run passes, and so does none where an earlier attempt holds another hash for that checkpoint."""
    write_record(ended, running(record_of(ended), dead_pid()))
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    record = {**record_of(ended), **linked}
    [row] = check_attempts(ended, record)
    assert row["ok"], row["line"]
    VERIFY_TAMPER[change](ended, record["attempts"][0])
    [row] = check_attempts(ended, record)
    assert not row["ok"] and row["line"].startswith("attempt 1: "), row["line"]


@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_verify_hashes_the_checkpoint_an_attempt_vouched_by_its_save_resumed_from(ended, tmp_path, at):
    """A byte of the state the attempt resumed from flipped afterwards, its sha256 file left as it was: the row
    fails (the state itself is hashed, not only the file that vouched for it); the state gone is no claim and
    passes; the state a link to an outside copy of the same bytes fails."""
    write_record(ended, running(record_of(ended), dead_pid()))
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    record = {**record_of(ended), **linked}
    state = ended / CKPT.format(4)
    original = state.read_bytes()
    flip(state, {"first": 0, "middle": len(original) // 2, "last": len(original) - 1}[at])
    [row] = check_attempts(ended, record)
    assert not row["ok"] and f"{CKPT.format(4)}: changed since the attempt resumed from it" in row["line"]
    state.unlink()
    [row] = check_attempts(ended, record)
    assert row["ok"], row["line"]
    outside = tmp_path / "outside.pt"
    outside.write_bytes(original)
    state.symlink_to(outside)
    [row] = check_attempts(ended, record)
    assert not row["ok"] and "a symbolic link on its way" in row["line"]


def test_verify_hashes_the_checkpoint_a_sealed_attempt_resumed_from_and_reads_entries_before_the_voucher(ended):
    """The checkpoint a record-vouched attempt resumed from, a byte flipped afterwards: the row fails, as for a
    writer-vouched one. An entry written before ``checkpoint_vouched_by`` existed (no such key) passes."""
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    entry = linked["attempts"][0]
    old = {k: v for k, v in entry.items() if k != "checkpoint_vouched_by"}
    [row] = check_attempts(ended, {**record_of(ended), "attempts": [old]})
    assert row["ok"], row["line"]
    flip(ended / CKPT.format(4), 0)
    [row] = check_attempts(ended, {**record_of(ended), "attempts": [entry]})
    assert not row["ok"] and f"{CKPT.format(4)}: changed since the attempt resumed from it" in row["line"]


def test_verify_fails_an_attempt_vouched_by_its_save_that_an_earlier_attempt_contradicts(ended):
    """An attempt vouched for by the save's sha256 file, listed after one that resumed from the same step with
    another sha256: its row fails, naming the earlier record."""
    write_record(ended, running(record_of(ended), dead_pid()))
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    entry = linked["attempts"][0]
    other = {**entry, "checkpoint_sha256": "0" * 64, "checkpoint_vouched_by": "record"}
    record = {**record_of(ended), "attempts": [other, {**entry, "attempt": 2}]}
    rows = check_attempts(ended, record)
    assert not rows[1]["ok"] and "other than the one an earlier attempt recorded" in rows[1]["line"]


def test_an_unsealed_resumed_attempt_accepts_no_other_or_older_checkpoint_than_its_earlier_attempts(ended):
    """Attempt 1 ended sealed (its record vouches for step 4); attempt 2 resumed from it and was killed before
    its next save, its record unsealed. The save's sha256 file still vouches for step 4, but a state of step 4
    swapped together with its sha256 file (another hash than attempt 1 recorded), or the tracker set back to step
    2 (older than attempt 2 started from), is refused; `trainer verify` reports an attempt whose step is no
    integer as a failed row, not a traceback."""
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    write_record(ended, running({**record_of(ended), **linked}, dead_pid()))
    assert attempts.vouched_by(record_of(ended)) == "writer"
    assert attempts.ended_attempt(ended)["status"] == "interrupted"  # the same checkpoint: accepted
    state, sums = ended / CKPT.format(4), ended / f"{CKPT.format(4)}.sha256"
    original, line = state.read_bytes(), sums.read_text()
    flip(state, len(original) // 2)
    sums.write_text(f"{sha256(state)}  model_optim_rng.pt\n")  # swapped, its sha256 file rewritten to match
    with pytest.raises(UserError, match=f"{CKPT.format(4)} is not the one an earlier attempt recorded"):
        attempts.ended_attempt(ended)
    state.write_bytes(original)
    sums.write_text(line)
    (ended / TRACKER).write_bytes(b"2\n")
    with pytest.raises(UserError, match="names iteration 2, older than the 4 the previous attempt resumed from"):
        attempts.ended_attempt(ended)
    record = {**record_of(ended), "attempts": [{**linked["attempts"][0], "resumed_from_iteration": "4"}]}
    [row] = check_attempts(ended, record)
    assert not row["ok"] and "does not vouch for the checkpoint of step 4" in row["line"]


def test_an_unsealed_resumed_attempt_whose_tracker_is_gone_does_not_start_again_from_step_0(ended, tmp_path):
    """Attempt 2 resumed from step 4 and was killed, its record unsealed: removing the tracker must not send the
    next resume back to step 0 (past the guard against an older checkpoint, with the rows after it cut): refused
    by ``train --resume`` in one line, exit 2, nothing written."""
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    write_record(ended, running({**record_of(ended), **linked}, dead_pid()))
    (ended / TRACKER).unlink()
    with pytest.raises(UserError, match=f"{TRACKER} is gone, but the previous attempt resumed from step 4"):
        attempts.ended_attempt(ended)
    before = helpers.tree_hash(ended)
    refused = resume(ended, tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    helpers.assert_one_line(refused.stderr, f"{ended} (--resume): {TRACKER} is gone, but the previous attempt")
    assert helpers.tree_hash(ended) == before


@pytest.mark.parametrize("change", ["binding removed", "one byte", "deleted", "a link"])
def test_an_earlier_attempts_record_changed_since_it_was_linked_binds_still(ended, tmp_path, change):
    """Attempt 1 ended sealed, holding step 4's hash; attempt 2 resumed from it and was killed unsealed. With step
    4's state swapped together with its sha256 file, the kept ``attempts/1/record.json`` changed so that it no
    longer binds step 4 (the hash removed, a byte changed, the file deleted or replaced by a link to such a copy)
    does not lift the binding: the resume is refused, naming the kept record, and a Slurm job's final mark
    vouches for no state then."""
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    write_record(ended, running({**record_of(ended), **linked}, dead_pid()))
    state, sums = ended / CKPT.format(4), ended / f"{CKPT.format(4)}.sha256"
    flip(state, state.stat().st_size // 2)
    sums.write_text(f"{sha256(state)}  model_optim_rng.pt\n")
    kept = ended / "attempts" / "1" / "record.json"
    edited = json.loads(kept.read_text())
    del edited["files_sha256"][CKPT.format(4)]
    if change == "binding removed":
        kept.write_text(json.dumps(edited))
    elif change == "one byte":
        flip(kept, kept.stat().st_size // 2)
    elif change == "deleted":
        kept.unlink()
    else:
        other = tmp_path / "record.json"
        other.write_text(json.dumps(edited))
        kept.unlink()
        kept.symlink_to(other)
    with pytest.raises(UserError, match="attempts/1/record.json: missing, a link, unreadable or not of the sha256"):
        attempts.ended_attempt(ended)
    record = record_of(ended)
    assert attempts.vouch_for_resume(ended, record) == [CKPT.format(2), CKPT.format(4)]
    assert CKPT.format(4) not in record["files_sha256"]


def test_verify_fails_a_sealed_attempt_that_claims_its_save_vouched_for_its_checkpoint(ended):
    """An attempt resumed from a sealed record (``checkpoint_vouched_by`` ``"record"``) relabelled ``"writer"``
    (or anything else): its row fails; left as it was, it passes."""
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    entry = linked["attempts"][0]
    assert entry["checkpoint_vouched_by"] == "record"
    [row] = check_attempts(ended, {**record_of(ended), "attempts": [entry]})
    assert row["ok"], row["line"]
    for label in ("writer", None, "slurm"):
        [row] = check_attempts(ended, {**record_of(ended), "attempts": [{**entry, "checkpoint_vouched_by": label}]})
        assert not row["ok"] and f"yet the attempt says it was vouched for by {label!r}" in row["line"], label


def test_a_killed_run_that_trainer_status_found_gone_resumes_from_the_checkpoint_its_save_vouched_for(ended):
    """`trainer status` records a killed local run ``interrupted`` (its process gone) and says it wrote that end
    (``ended_by``): the record is still unsealed, so the save's sha256 file vouches for the checkpoint."""
    from trainer.record.status import refresh

    write_record(ended, running(record_of(ended), dead_pid()))
    after = refresh(ended)
    assert after["status"] == "interrupted" and after["ended_by"] == "trainer status"
    assert record_of(ended)["ended_by"] == "trainer status"
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert linked["resumed_from"]["iteration"] == 4 and linked["attempts"][0]["checkpoint_vouched_by"] == "writer"


def test_a_sealed_record_without_checkpoint_hashes_refuses_a_checkpoint_its_save_vouched_for(ended, tmp_path):
    """The save's voucher serves only a record that ended unsealed: a record its run sealed (``failed``) that
    holds no checkpoint's hash (none existed when it ended) refuses a checkpoint that appeared since, sha256 file
    and all, through ``train --resume``: one line, exit 2, nothing written."""
    files = {k: v for k, v in record_of(ended)["files_sha256"].items() if not k.startswith("checkpoints/")}
    write_record(ended, {**record_of(ended), "files_sha256": files})
    before = helpers.tree_hash(ended)
    refused = resume(ended, tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = helpers.assert_one_line(refused.stderr, f"{ended} (--resume): {TRACKER} is not in the previous attempt")
    assert "nothing vouches for it" in line
    assert helpers.tree_hash(ended) == before and not (ended / "attempts").exists()


def test_a_killed_run_without_checkpoints_resumes_as_interrupted_from_the_start(ended):
    """Finding 1: a running record whose process is gone and that left no checkpoint is continued from step 1,
    as an interrupted attempt naming why (the process is gone)."""
    shutil.rmtree(ended / "checkpoints")
    pid = dead_pid()
    write_record(ended, running(record_of(ended), pid))
    previous = attempts.ended_attempt(ended)
    assert previous["status"] == "interrupted"
    assert previous["reason"] == (
        f"its process {pid} is gone: it ended without recording how the run ended (its record.json still said running)"
    )
    linked = attempts.continue_attempt(ended, previous)
    assert linked["resumed_from"] == {"attempt": 1, "iteration": 0, "checkpoint": None, "sha256": None}
    assert linked["attempts"][0]["status"] == "interrupted" and linked["attempts"][0]["steps_written"] == 20


def test_resume_of_a_live_run_is_refused(ended, tmp_path):
    """Finding 2: a running record whose process lives (this test's own: the same pid, start time, boot and pid
    namespace) is refused, even with every checkpoint vouched for; nothing is written."""
    record = {**running(record_of(ended), os.getpid()), "files_sha256": record_of(ended)["files_sha256"]}
    write_record(ended, record)
    before = helpers.tree_hash(ended)
    refused = resume(ended, tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    helpers.assert_one_line(
        refused.stderr,
        f"{ended} (--resume): its record.json says running (pid {os.getpid()} on {socket.gethostname()}) and "
        "that process may still run",
    )
    assert helpers.tree_hash(ended) == before


def test_a_running_record_of_another_host_is_refused(ended):
    """Finding 2: a run on another host cannot be checked from here: it may run, so it is refused."""
    write_record(ended, {**running(record_of(ended), dead_pid()), "host": "another-host"})
    with pytest.raises(UserError, match=r"says running \(pid \d+ on another-host\) and that process may still run"):
        attempts.ended_attempt(ended)


# ------------------------------------------------------------------ 1: the worker loads what the record names


def resumed_from(run_dir, step):
    return {
        "attempt": 1,
        "iteration": step,
        "checkpoint": CKPT.format(step),
        "sha256": sha256(run_dir / CKPT.format(step)),
    }


def test_the_worker_loads_only_the_checkpoint_the_record_names_by_its_sha256(ended):
    """Finding 1 (worker side): checkpoint.load loads the checkpoint resumed_from names, never the tracker's
    (here step 4); a resumed_from of none loads nothing; its bytes changed, or a sha256 not theirs, are refused
    before torch.load, naming the file; a resumed_from naming another file than its iteration's is refused."""
    saved = tiny()[0].state_dict()
    model, optimizer = tiny(seed=1)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    assert checkpoint.load(ended, model, optimizer, None) == 0
    assert (
        checkpoint.load(ended, model, optimizer, {"attempt": 1, "iteration": 0, "checkpoint": None, "sha256": None})
        == 0
    )
    assert all(torch.equal(model.state_dict()[k], fresh[k]) for k in fresh)  # the tracker's step 4 was not loaded
    assert checkpoint.load(ended, model, optimizer, resumed_from(ended, 2)) == 2
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    assert optimizer.state_dict()["state"][0]["step"] == 1

    wrong = {**resumed_from(ended, 2), "sha256": "0" * 64}
    with pytest.raises(UserError, match=r"model_optim_rng.pt: sha256 [0-9a-f]{16}\.\.\., the record resumes from 0000"):
        checkpoint.load(ended, *tiny(), wrong)
    vouched = resumed_from(ended, 2)
    path = ended / CKPT.format(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="refusing to load it"):
        checkpoint.load(ended, *tiny(), vouched)
    for bad in (
        {**resumed_from(ended, 4), "checkpoint": CKPT.format(2)},
        {**resumed_from(ended, 4), "iteration": True},
        {**resumed_from(ended, 4), "iteration": 10**9},
        {**resumed_from(ended, 4), "sha256": None},
    ):
        with pytest.raises(UserError, match=r"record.json: resumed_from .* names no checkpoint"):
            checkpoint.load(ended, *tiny(), bad)


# ------------------------------------------------------------------ 3: a leftover attempts/N


def test_an_attempt_left_by_a_killed_resume_is_taken_again(ended):
    """Finding 3: a --resume killed after it kept attempts/1 but before its new record was saved leaves the old
    record in place; the next --resume takes that attempts/1 (its record.json the same bytes) and links the same
    attempt, the rows the first attempt wrote counted from its copy."""
    first = attempts.continue_attempt(ended, attempts.ended_attempt(ended))  # the kill: no new record follows
    assert sorted(p.name for p in (ended / "attempts").iterdir()) == ["1"]
    again = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert again == first
    assert again["attempts"][0]["steps_written"] == 20 and again["resumed_from"]["iteration"] == 4
    assert [json.loads(line)["step"] for line in (ended / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_killed_resume_of_an_unsealed_run_is_taken_again_and_a_forged_copy_is_not(ended):
    """The record ended unsealed (``running``, its process gone: no hash of metrics.jsonl), and the --resume
    that kept attempts/1 was killed before its new record left. The next --resume takes that copy: the run's
    metrics.jsonl is the copy's rows up to the checkpoint, as the cut left it. A copy with a row changed is
    refused in one line."""
    write_record(ended, running(record_of(ended), dead_pid()))
    first = attempts.continue_attempt(ended, attempts.ended_attempt(ended))  # the kill: no new record follows
    again = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert again == first and again["attempts"][0]["steps_written"] == 20
    assert [json.loads(line)["step"] for line in (ended / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    copy = ended / "attempts/1/metrics.jsonl"
    rows = copy.read_text().splitlines(keepends=True)
    rows[1] = json.dumps({**json.loads(rows[1]), "lm_loss": 0.001}) + "\n"
    copy.write_text("".join(rows))
    with pytest.raises(UserError, match=r"attempts/1/metrics.jsonl: not the run's metrics.jsonl") as err:
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert "\n" not in str(err.value)


def test_a_leftover_attempt_of_an_unsealed_run_without_its_metrics_copy_is_refused(ended):
    """An unsealed record holds no hash of metrics.jsonl, yet the run had one to copy: a leftover attempts/1
    without that copy is not one a killed resume made; refused, and the run's rows stay (taking it would have
    counted no rows and removed the run's metrics.jsonl)."""
    write_record(ended, running(record_of(ended), dead_pid()))
    before = (ended / "metrics.jsonl").read_bytes()
    (ended / "attempts" / "1").mkdir(parents=True)
    shutil.copy(ended / "record.json", ended / "attempts" / "1" / "record.json")
    with pytest.raises(UserError, match="attempts/1/metrics.jsonl: missing, but the run's metrics.jsonl was there"):
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert (ended / "metrics.jsonl").read_bytes() == before


def test_a_killed_resume_whose_new_plan_removed_the_attestation_is_taken_again(ended):
    """A --resume killed after the new attempt's plan removed the run's attestation.json (``write_plan``) but
    before its record left: attempts/1 holds the attestation, the run none. That leftover is the copy and is
    taken; the copy a link is not."""
    (ended / "attestation.json").write_text('{"payload": "signed"}')
    first = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    (ended / "attestation.json").unlink()
    again = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert again == first
    copy = ended / "attempts" / "1" / "attestation.json"
    outside = ended.parent / "attestation.json"
    outside.write_bytes(copy.read_bytes())
    copy.unlink()
    copy.symlink_to(outside)
    with pytest.raises(UserError, match="attempts/1/attestation.json: not the run's attestation.json"):
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))


def test_a_first_unsealed_attempt_whose_tracker_is_gone_after_two_saves_does_not_start_again(ended):
    """A first attempt, ended unsealed, that saved steps 2 and 4: a save writes its state, then the tracker, so
    a second save means a tracker existed; with it removed, the resume is refused rather than starting again from
    step 0. A single save (killed before its tracker) resumes from the start."""
    write_record(ended, running(record_of(ended), dead_pid()))
    (ended / TRACKER).unlink()
    with pytest.raises(UserError, match=f"{TRACKER} is gone, but 2 checkpoints were saved"):
        attempts.ended_attempt(ended)
    shutil.rmtree(ended / "checkpoints" / "iter_0000004")
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert linked["resumed_from"]["iteration"] == 0


def test_an_attempt_folder_of_another_record_is_refused(ended):
    """Finding 3: an attempts/1 whose record.json is not the run's is not this attempt's copy: refused, one line."""
    (ended / "attempts/1").mkdir(parents=True)
    (ended / "attempts/1/record.json").write_text("{}")
    with pytest.raises(UserError, match=r"attempts/1: exists, but the record lists 0 earlier attempts"):
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))


@pytest.mark.parametrize("change", ["forged row", "one byte", "a link", "no hash in the record"])
def test_a_leftover_attempt_whose_metrics_the_record_does_not_vouch_for_is_refused(ended, tmp_path, change):
    """A leftover attempts/1 is taken only with the metrics.jsonl its record hashed: a forged copy (one row of a
    lower loss, one byte changed, a link to another file, a record that holds no hash for it) is refused in one
    line and the run's metrics.jsonl is left as it was."""
    attempts.continue_attempt(ended, attempts.ended_attempt(ended))  # the kill: attempts/1 left, the record kept
    copy = ended / "attempts/1/metrics.jsonl"
    before = (ended / "metrics.jsonl").read_bytes()
    if change == "forged row":
        copy.write_text(json.dumps({"step": 1, "lm_loss": 0.001}) + "\n")
    elif change == "one byte":
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 1
        copy.write_bytes(bytes(data))
    elif change == "a link":
        other = tmp_path / "other.jsonl"
        other.write_bytes(copy.read_bytes())
        copy.unlink()
        copy.symlink_to(other)
    else:
        record = record_of(ended)
        del record["files_sha256"]["metrics.jsonl"]
        write_record(ended, record)
        (ended / "attempts/1/record.json").write_bytes((ended / "record.json").read_bytes())
    with pytest.raises(UserError, match=r"attempts/1/metrics.jsonl: not the run's metrics.jsonl") as err:
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert "\n" not in str(err.value)
    assert (ended / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "attestation.json"])
def test_a_leftover_attempt_without_a_copy_the_run_had_is_refused(ended, name):
    """A leftover attempts/1 holding the run's record but not its metrics.jsonl (which the record hashes) or not
    its attestation.json (which the run holds): not a copy a killed resume made (it copies all, then renames),
    refused in one line, the run's metrics left whole."""
    (ended / "attestation.json").write_text("{}")
    attempts.continue_attempt(ended, attempts.ended_attempt(ended))  # the kill: attempts/1 left, the record kept
    before = (ended / "metrics.jsonl").read_bytes()
    (ended / "attempts" / "1" / name).unlink()
    with pytest.raises(UserError, match=f"attempts/1/{name}: missing, but the run's {name} was there") as err:
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert "\n" not in str(err.value)
    assert (ended / "metrics.jsonl").read_bytes() == before


def test_a_slurm_job_past_ten_million_iterations_vouches_for_its_state(ended):
    """The tracker takes up to 9 digits, and so do the states a Slurm job's final mark hashes: iteration
    10,000,000 (``iter_10000000``, 8 digits) is vouched for; a name no save writes (``iter_00000004``) is not."""
    model, optimizer = tiny()
    checkpoint.save(ended, 10_000_000, model, optimizer)
    odd = ended / "checkpoints" / "iter_00000004" / "mp_rank_00" / "model_optim_rng.pt"
    odd.parent.mkdir(parents=True)
    odd.write_bytes(b"x")
    inputs = attempts.resume_inputs(ended)
    assert CKPT.format(10_000_000) == "checkpoints/iter_10000000/mp_rank_00/model_optim_rng.pt"
    assert CKPT.format(10_000_000) in inputs and odd.relative_to(ended).as_posix() not in inputs
    assert (ended / TRACKER).read_text() == "10000000\n"


def test_a_leftover_attempt_with_another_attestation_is_refused(ended):
    (ended / "attestation.json").write_text('{"a": 1}')
    attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert (ended / "attempts/1/attestation.json").read_text() == '{"a": 1}'
    (ended / "attempts/1/attestation.json").write_text('{"a": 2}')
    with pytest.raises(UserError, match=r"attempts/1/attestation.json: not the run's attestation.json"):
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))


# ------------------------------------------------------------------ 4, 5: the tracker


@pytest.mark.parametrize(
    "text", ["²", "٣", "9" * 4200, "9" * 5000, "1e3", "0", "-1", "", "4 4", "0x4", "1000000000", "+4", "４"]
)
def test_a_tracker_that_is_no_iteration_is_one_line(ended, text):
    """Finding 4: the tracker holds anything but 1 to 9 ASCII digits (a superscript, Arabic-Indic or full-width
    digit that str.isdigit takes, 5,000 digits that int() refuses, 4,200 that it takes): one UserError naming the
    tracker and what it holds, or its size past 4 KiB."""
    (ended / TRACKER).write_text(f"{text}\n")
    with pytest.raises(UserError) as err:
        attempts.latest_iteration(ended)
    message = str(err.value)
    assert message.startswith(f"{ended / TRACKER}: ") and "\n" not in message
    if len(text) < 4096:
        expected = "expected the iteration of the latest checkpoint (a positive integer of at most 9 digits)"
        assert f"{expected}, got {text[:40]!r}" in message
    else:
        assert "bytes, more than the 4,096 a checkpoint tracker may have" in message


def test_a_tracker_of_a_superscript_digit_is_refused_by_train_in_one_line(ended, tmp_path):
    """Finding 4, through train: exit 2 and one line (it was an internal error, exit 70)."""
    (ended / TRACKER).write_text("²\n")
    refused = resume(ended, tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    helpers.assert_one_line(refused.stderr, f"{ended / TRACKER}: expected the iteration of the latest checkpoint")
    assert "Traceback" not in refused.stderr


def test_a_tracker_changed_since_the_record_is_refused(ended):
    """Finding 5 (tamper): the tracker rewritten to name step 2 (a checkpoint the record vouches for too), or
    removed, or never hashed: each refused before anything is written, naming the tracker."""
    original = (ended / TRACKER).read_bytes()
    assert attempts.vouched_checkpoint(ended, record_of(ended)["files_sha256"], "here") == (
        4,
        sha256(ended / CKPT.format(4)),
    )
    for changed in (b"2\n", b"4", b"04\n"):
        (ended / TRACKER).write_bytes(changed)
        with pytest.raises(UserError, match=f"{ended} \\(--resume\\): {TRACKER} changed since the previous attempt"):
            attempts.ended_attempt(ended)
    (ended / TRACKER).unlink()
    with pytest.raises(UserError, match=f"{TRACKER} is gone, but the previous attempt's record holds it"):
        attempts.ended_attempt(ended)
    (ended / TRACKER).write_bytes(original)
    files = {k: v for k, v in record_of(ended)["files_sha256"].items() if k != TRACKER}
    with pytest.raises(UserError, match=f"here: {TRACKER} is not in the previous attempt's record"):
        attempts.vouched_checkpoint(ended, files, "here")
    assert not (ended / "attempts").exists()


def test_a_slurm_job_that_ends_vouches_for_its_checkpoints_and_a_changed_byte_is_refused(plan, tmp_path):
    """A Slurm job's record ends in the job (``jobsteps mark``, no ``train`` to seal it): the final mark hashes the
    metrics and every checkpoint file as the job leaves them, so that ``--resume`` after a lost node has something
    that vouches for them; a checkpoint linked in from elsewhere is not vouched for, and a byte changed in any
    vouched file afterwards is refused."""
    from trainer.launch.jobsteps import mark

    run_dir = tmp_path / "run"
    shutil.copytree(plan, run_dir)
    model, optimizer = tiny()
    for step in (2, 4):
        checkpoint.save(run_dir, step, model, optimizer)
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"not this run's")
    (run_dir / "checkpoints" / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
    (run_dir / CKPT.format(6)).symlink_to(outside)  # a linked state: nothing vouches for what it points to
    half = run_dir / "checkpoints" / ".iter_0000008.abc123" / "mp_rank_00"  # a save a kill interrupted
    half.mkdir(parents=True)
    (half / "model_optim_rng.pt").write_bytes(b"half a save")
    record = record_of(run_dir)
    before = {k: v for k, v in record["files_sha256"].items() if not k.startswith("checkpoints/")}
    write_record(run_dir, {**record, "status": "running", "files_sha256": before, "slurm": {"job_id": "7"}})
    ended = mark(run_dir, "failed", stage="job", exit_code=1, reason="node n3 lost")
    hashed = ended["files_sha256"]
    assert {k for k in hashed if k.startswith("checkpoints/")} == {TRACKER, CKPT.format(2), CKPT.format(4)}
    assert hashed[CKPT.format(4)] == sha256(run_dir / CKPT.format(4)) and hashed["metrics.jsonl"]
    assert attempts.ended_attempt(run_dir)["status"] == "failed"
    assert attempts.vouched_checkpoint(run_dir, hashed, "here") == (4, sha256(run_dir / CKPT.format(4)))
    for rel in (TRACKER, CKPT.format(4)):
        original = (run_dir / rel).read_bytes()
        for at in (0, len(original) // 2, len(original) - 1):
            changed = bytearray(original)
            changed[at] ^= 0x01
            (run_dir / rel).write_bytes(bytes(changed))
            with pytest.raises(UserError, match=f"{rel}"):
                attempts.vouched_checkpoint(run_dir, hashed, "here")
        (run_dir / rel).write_bytes(original)
    assert attempts.vouched_checkpoint(run_dir, hashed, "here")[0] == 4


def test_a_resumed_slurm_job_does_not_vouch_for_a_state_changed_since_an_earlier_attempt(plan, tmp_path):
    """A resumed Slurm job whose worker refused the checkpoint (changed while the job waited) ends failed without
    saving: its final mark must not make the changed state acceptable. An iteration's state that an earlier
    attempt's record holds with other bytes is left out of the record (named in ``slurm.unvouched``), so the next
    ``--resume`` still refuses it; the tracker and metrics, which move on with each attempt, are hashed anew."""
    from trainer.launch.jobsteps import mark

    run_dir = tmp_path / "run"
    shutil.copytree(plan, run_dir)
    model, optimizer = tiny()
    checkpoint.save(run_dir, 2, model, optimizer)
    first = {
        **record_of(run_dir),
        "status": "failed",
        "files_sha256": {CKPT.format(2): sha256(run_dir / CKPT.format(2))},
    }
    (run_dir / "attempts" / "1").mkdir(parents=True)
    (run_dir / "attempts" / "1" / "record.json").write_text(json.dumps(first))
    state = bytearray((run_dir / CKPT.format(2)).read_bytes())
    state[len(state) // 2] ^= 0x01
    (run_dir / CKPT.format(2)).write_bytes(bytes(state))  # swapped while the resumed job waited in the queue
    files = {k: v for k, v in record_of(run_dir)["files_sha256"].items() if not k.startswith("checkpoints/")}
    files.pop("metrics.jsonl", None)
    rows = tmp_path / "rows-elsewhere.jsonl"
    (run_dir / "metrics.jsonl").rename(rows)
    (run_dir / "metrics.jsonl").symlink_to(rows)  # metrics that are a link: nothing vouches for their target
    attempt = {"attempt": 1, "status": "failed", "record": "attempts/1/record.json"}
    write_record(run_dir, {**record_of(run_dir), "status": "running", "files_sha256": files, "attempts": [attempt]})
    ended = mark(run_dir, "failed", stage="job", exit_code=1, reason="the checkpoint's sha256 differs")
    assert CKPT.format(2) not in ended["files_sha256"] and ended["slurm"]["unvouched"] == [CKPT.format(2)]
    assert ended["files_sha256"][TRACKER] == sha256(run_dir / TRACKER) and "metrics.jsonl" not in ended["files_sha256"]
    with pytest.raises(UserError, match=f"{CKPT.format(2)} is not in the previous attempt's record"):
        attempts.vouched_checkpoint(run_dir, ended["files_sha256"], "here")


# ------------------------------------------------------------------ 6: metrics rows


def test_an_unterminated_last_metrics_row_is_dropped(ended):
    """Finding 6: a kill mid-write leaves half a row, unterminated, last: dropped; the rows up to the checkpoint
    kept, each ending in a newline."""
    metrics = ended / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 21, "lm_lo')
    linked = attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert linked["attempts"][0]["steps_written"] == 20
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert metrics.read_bytes().endswith(b"}\n")


@pytest.mark.parametrize("row", ['{"step": "3"}', '{"step": 3.0}', '{"step": true}', '{"lm_loss": 1}', "[3]", "x"])
def test_a_row_without_an_integer_step_is_refused_naming_its_line(ended, row):
    """Finding 6: a complete row whose step is not an integer (it was silently dropped) or that is no row: one
    line naming the file and the line; nothing is changed."""
    metrics = ended / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([*lines[:2], row + "\n", *lines[2:]]))
    before = helpers.tree_hash(ended)
    with pytest.raises(UserError, match=r"metrics.jsonl:3: not a step's row \(a JSON object with an integer step\)"):
        attempts.continue_attempt(ended, attempts.ended_attempt(ended))
    assert helpers.tree_hash(ended) == before


# ------------------------------------------------------------------ 7: verify's attempts behind a link


def test_verify_does_not_follow_a_linked_attempts_folder(ended, tmp_path):
    """Finding 7 (tamper): attempts/ moved out of the run directory and linked back: the record's bytes and
    sha256 are the same, but they are not the run directory's: the attempt fails; so does a linked record.json."""
    record = {**record_of(ended), **attempts.continue_attempt(ended, attempts.ended_attempt(ended))}
    write_record(ended, record)
    [row] = check_attempts(ended, record)
    assert row["ok"] is True, row
    elsewhere = tmp_path / "elsewhere"
    shutil.move(ended / "attempts", elsewhere)
    (ended / "attempts").symlink_to(elsewhere)
    [row] = check_attempts(ended, record)
    assert row["ok"] is False and row["line"] == (
        f"attempt 1: attempts/1/record.json: a symbolic link on its way (to {elsewhere.resolve()}/1/record.json): "
        "not a file of the run directory"
    )
    (ended / "attempts").unlink()
    (ended / "attempts/1").mkdir(parents=True)
    (ended / "attempts/1/record.json").symlink_to(elsewhere / "1/record.json")
    [row] = check_attempts(ended, record)
    assert row["ok"] is False and "a symbolic link on its way" in row["line"]
    shutil.rmtree(ended / "attempts")
    (ended / "attempts").symlink_to("attempts")  # a loop of links: a failed row, no traceback
    [row] = check_attempts(ended, record)
    assert row["ok"] is False and row["line"].startswith("attempt 1: attempts/1/record.json: not readable"), row


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
