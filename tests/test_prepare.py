"""A run prepared once (compose.prepare), the run directory's owner (record.rundir.RunDir), and the commands the
tree reorganisation added (trainer image smoke-source)."""

import dataclasses
import json

import pytest
from omegaconf.errors import ReadonlyConfigError

import helpers
from helpers import REPO_ROOT, compose
from trainer import launch
from trainer.compose import compose as compose_module
from trainer.compose.prepare import prepare, reference_overrides
from trainer.compose.render import render
from trainer.errors import UserError
from trainer.record.rundir import COMPLETE, FAILED, RECORD, RUNNING, RunDir


def pairs(argv):
    """``--flag value`` pairs of an argv (a flag without a value maps to None)."""
    out = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[token] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_a_layout_override_reaches_the_miles_argv_through_compose_and_render_only(monkeypatch):
    """Promise: `layout=tp8pp8ep8` is composed twice in one Hydra session (the job and the reference layout) and
    rendered once; the prepared launch is the render of the composition, with the reference's sizes. (The
    composition cache is off here: with it, a composition made before costs no Hydra call at all.)"""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "off")
    calls = []
    real = compose_module.compose
    monkeypatch.setattr(compose_module, "compose", lambda *a, **k: calls.append(k.get("overrides")) or real(*a, **k))
    prepared = prepare(["layout=tp8pp8ep8"], check_launcher=launch.check)
    assert calls == [["layout=tp8pp8ep8"], ["layout=tp8pp8ep8"]]  # the job, then the reference (the same layout)
    assert prepared.launch.argv == render(compose("layout=tp8pp8ep8")).argv
    flags = pairs(prepared.launch.argv)
    assert (
        flags["--tensor-model-parallel-size"],
        flags["--pipeline-model-parallel-size"],
        flags["--expert-model-parallel-size"],
    ) == ("8", "8", "8")
    assert prepared.choices["layout"] == "tp8pp8ep8" and prepared.par.data_parallel_size == 1
    assert prepared.numerics["reference_layout"] == "tp8pp8ep8" and prepared.numerics["differences"] == []


def test_the_recipe_is_prepared_with_its_verdict_and_plan():
    prepared = prepare(["hydra.run.dir=/tmp/unused"], check_launcher=launch.check)
    assert prepared.overrides == ()  # Hydra's task overrides: hydra.* ones are Hydra's own
    assert len(prepared.launch.argv) == 229
    assert prepared.plan["numerics"]["reference_layout"] == "tp8pp8ep8"
    assert prepared.plan["parallelism"]["world_size"] == 64
    assert prepared.numerics["equivalent"] is True


def test_a_prepared_run_is_frozen():
    prepared = prepare([], check_launcher=launch.check)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.plan = {}
    with pytest.raises(ReadonlyConfigError):
        prepared.cfg.layout.micro_batch_size = 2


def test_the_reference_keeps_every_override_but_layout_and_cluster():
    assert reference_overrides(
        ["layout=gpu8-tp2pp2ep4", "layout.micro_batch_size=2", "cluster=local", "optim.lr=2e-5", "+env.X=1"],
        "tp8pp8ep8",
    ) == ["optim.lr=2e-5", "+env.X=1", "layout=tp8pp8ep8"]


def test_a_bad_job_is_refused_on_one_line():
    with pytest.raises(UserError) as info:
        prepare(["cluster.nodes=4"], check_launcher=launch.check)
    assert str(info.value).startswith("layout.data_parallel_size 8 != world 32")


def test_run_dir_hashes_what_it_writes_and_what_others_wrote(tmp_path):
    rundir = RunDir(tmp_path)
    digest = rundir.write("config.yaml", b"a: 1\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    found = rundir.hash_written()
    assert set(found) == {"metrics.jsonl"} and set(rundir.hashes) == {"config.yaml", "metrics.jsonl"}
    import hashlib

    assert found["metrics.jsonl"] == hashlib.sha256(b'{"step": 1}\n').hexdigest()
    assert digest == hashlib.sha256(b"a: 1\n").hexdigest()


def test_run_dir_states(tmp_path):
    rundir = RunDir(tmp_path)
    record = {"status": RUNNING, "pid": 1, "files_sha256": {}}
    rundir.save_record(record)
    ended = rundir.hand_back(rundir.end(dict(record), FAILED, "x"))
    assert (ended["status"], ended["reason"], "finished_utc" in ended, "handed_off_utc" in ended) == (
        FAILED,
        "x",
        True,
        False,
    )
    with pytest.raises(AssertionError):
        rundir.end(dict(record), "rendered")  # handed off is not an end
    # a submitted job that already wrote its own state (no pid) keeps it; our Slurm fields are merged in
    rundir.save_record({"status": RUNNING, "slurm": {"nodes": ["n1"]}})
    handed = rundir.hand_back({"status": "submitted", "pid": 1, "slurm": {"job_id": "7", "state": None}})
    assert handed["status"] == RUNNING and handed["slurm"] == {"nodes": ["n1"], "job_id": "7"}
    assert "pid" not in handed and "handed_off_utc" in handed
    updated = rundir.update(lambda r: r.update(status=COMPLETE))
    assert json.loads((tmp_path / RECORD).read_text())["status"] == COMPLETE == updated["status"]


def test_mark_takes_every_ranks_probe_in_rank_order_and_ignores_a_stray_file(tmp_path):
    """launcher.payload=cpu on Slurm: the record's probe ranks are the ranks' own files, by rank number."""
    from trainer.launch.jobsteps import mark

    RunDir(tmp_path).save_record({"status": RUNNING, "slurm": {"nodes": ["n1"]}})
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "n1.json").write_text(json.dumps({"host": "n1"}))
    for rank in (10, 2, 0, 1):
        (tmp_path / f"probe-rank-{rank}.json").write_text(json.dumps({"rank": rank}))
    (tmp_path / "probe-rank-x.json").write_text("not a rank's")
    record = mark(tmp_path, COMPLETE, stage="job", exit_code=0)
    assert [p["rank"] for p in record["probe"]["ranks"]] == [0, 1, 2, 10]
    assert record["probe"]["nodes"] == ["n1"]


def test_run_dir_moves(tmp_path):
    """The record's states move planned -> running -> handed off -> final only; an ended run does not start again."""
    from trainer.launch.jobsteps import mark

    rundir = RunDir(tmp_path)
    record = rundir.move({"status": "planned"}, RUNNING)
    assert rundir.move(record, RUNNING)["status"] == RUNNING  # a job's next stage
    handed = rundir.hand_off(dict(record), "rendered", "wrote sbatch.sh")
    assert (handed["status"], handed["message"]) == ("rendered", "wrote sbatch.sh")
    assert rundir.move(handed, "submitted")["status"] == "submitted"
    with pytest.raises(UserError, match=r"record\.json: a run submitted cannot become rendered"):
        rundir.move(dict(handed), "rendered")
    ended = rundir.end(handed, COMPLETE)
    assert (ended["status"], ended["reason"]) == (COMPLETE, None)
    for status in (RUNNING, FAILED, "submitted"):
        with pytest.raises(UserError, match="cannot become .*it has ended"):
            rundir.move(dict(ended), status)
    with pytest.raises(AssertionError):
        rundir.hand_off(dict(record), COMPLETE, "")  # an end is not a hand-off
    # the job's own steps go through the same moves: a finished record is left as it was
    rundir.save_record(ended)
    before = (tmp_path / RECORD).read_bytes()
    with pytest.raises(UserError, match="a run complete cannot become running"):
        mark(tmp_path, RUNNING, job_id="7")
    assert (tmp_path / RECORD).read_bytes() == before
    rundir.save_record({"status": "submitted", "slurm": {"job_id": "7"}})
    assert mark(tmp_path, RUNNING, stage="job")["status"] == RUNNING
    assert mark(tmp_path, FAILED, stage="job", exit_code=3, reason="x")["reason"] == "x"


def test_run_dir_update_needs_a_record(tmp_path):
    with pytest.raises(UserError, match="no readable run record"):
        RunDir(tmp_path).update(lambda r: None)


def test_the_smoke_source_command_makes_the_pinned_source(tmp_path):
    """Promise: `trainer image smoke-source DIR` writes the git source lockfiles/smoke.lock.json pins (commit, tree
    and archive sha256), on any machine."""
    made = helpers.run_trainer("image", "smoke-source", tmp_path)
    assert made.returncode == 0, made.stderr
    out = json.loads(made.stdout)
    pinned = json.loads((REPO_ROOT / "lockfiles" / "smoke.lock.json").read_text())["sources"][0]
    assert (out["commit"], out["tree"], out["sha256"]) == (
        pinned["commit"],
        pinned["tree"],
        pinned["archive"]["sha256"],
    )
    assert out["archive"].endswith(pinned["archive"]["filename"])


def test_run_dir_begins_with_the_launch_and_hashes_what_is_on_disk(tmp_path):
    """Promise: every run starts with the miles launch written (argv.json, env.json = command.sh) and a record
    whose hashes are those of the files on disk; a job.json an earlier run left is removed; job.json is what a
    launcher runs, written through RunDir.write_job with secret values redacted."""
    import hashlib

    from trainer.record.rundir import JOB, PLANNED

    prepared = prepare(["layout=tp8pp8ep8"], check_launcher=launch.check)
    (tmp_path / JOB).write_text("{}")
    rundir = RunDir(tmp_path)
    rundir.write_plan(prepared)
    assert not (tmp_path / JOB).exists()
    record = rundir.begin(PLANNED, prepared.record_fields())
    assert json.loads((tmp_path / "argv.json").read_text()) == prepared.launch.argv
    assert set(record["files_sha256"]) == {"config.yaml", "command.sh", "plan.json", "argv.json", "env.json"}
    for name, digest in record["files_sha256"].items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest, name
    assert (record["status"], record["kind"], record["launcher"], record["choices"]["layout"]) == (
        PLANNED,
        "plan",
        "plan",
        "tp8pp8ep8",
    )
    rundir.write_job(["python3", "-c", "pass"], {"HF_TOKEN": "hf_secret_value", "A": "1"})
    assert json.loads((tmp_path / JOB).read_text()) == {
        "argv": ["python3", "-c", "pass"],
        "env": {"A": "1", "HF_TOKEN": "<redacted>"},
    }


def test_run_dir_finish_attests_an_ended_run_and_not_a_handed_off_one(tmp_path):
    from trainer.record.rundir import RENDERED, RUNNING

    prepared = prepare(["launcher=local-cpu", "experiment=smoke"], check_launcher=launch.check)
    for name, status in (("ended", COMPLETE), ("handed-off", RENDERED)):
        rundir = RunDir(tmp_path / name)
        rundir.path.mkdir()
        rundir.write_plan(prepared)
        record = rundir.begin(RUNNING, prepared.record_fields())
        record = rundir.end(record, status) if status == COMPLETE else rundir.hand_off(record, status, "rendered")
        record = rundir.finish(record)
        on_disk = json.loads((rundir.path / RECORD).read_text())
        assert on_disk["status"] == status and ("attestation" in on_disk) == (status == COMPLETE), name
        assert (rundir.path / "attestation.json").exists() == (status == COMPLETE)
        assert ("finished_utc" in on_disk, "pid" in on_disk) == ((True, True) if status == COMPLETE else (False, False))


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
