"""Hostile places: a full disk, a partial run, a name too long, a record whose pid is no process of the run.

A real full disk: each case runs inside a user and mount namespace (``unshare --user --map-root-user --mount``;
as root, ``unshare --mount``) on a tmpfs a few KiB large, so that ``write`` really fails with ``ENOSPC``. Every
refusal is checked the same way: its exit code, one line on stderr naming the file and the error, no traceback,
and a user's file beside the run directory byte for byte as before.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train, run_trainer
from trainer import cli
from trainer.record.record import process_started

NOTES = b"my notes: keep me\n"
LONG = "n" * 300  # a path component longer than any Linux file system takes (NAME_MAX is 255)


# ------------------------------------------------------------------------------------------ a namespace with a tmpfs


NAMESPACE = helpers.tmpfs_namespace()
needs_tmpfs = helpers.needs_tmpfs

# What runs inside the namespace: for each size (KiB), a tmpfs with the user's NOTES.md and `train` planning into
# fsKB/run; then each tmpfs is given 4 MiB and `train` runs again into the same directory (plain, then --overwrite
# when the plain one refuses). Everything is reported as JSON.
PLAN_DRIVER = r"""
import json, os, shutil, subprocess, sys
base, sizes, repo, notes = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
env = {**os.environ, "PYTHONPATH": repo, "COLUMNS": "160"}
def train(kb, *extra):
    return subprocess.Popen([sys.executable, "-m", "trainer.train", f"hydra.run.dir={base}/fs{kb}/run", *extra],
                            cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
def wait(procs):
    return {kb: (p.wait(timeout=120), p.stderr.read()) for kb, p in procs.items()}
for kb in sizes:
    os.makedirs(f"{base}/fs{kb}")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", f"{base}/fs{kb}"], check=True)
    with open(f"{base}/fs{kb}/NOTES.md", "wb") as f:
        f.write(notes)
out = {kb: {"full": r} for kb, r in wait({kb: train(kb) for kb in sizes}).items()}
for kb in sizes:
    run = f"{base}/fs{kb}/run"
    out[kb]["left"] = sorted(os.listdir(run)) if os.path.isdir(run) else None
    if os.path.isdir(run):  # the real partial run, kept outside the namespace for the partial-run tests
        shutil.copytree(run, f"{base}/partial{kb}", symlinks=True)
    subprocess.run(["mount", "-o", "remount,size=4m", f"{base}/fs{kb}"], check=True)
for kb, r in wait({kb: train(kb) for kb in sizes}).items():
    out[kb]["again"] = r
for kb, r in wait({kb: train(kb, "--overwrite") for kb in sizes if out[kb]["again"][0] != 0}).items():
    out[kb]["overwrite"] = r
for kb in sizes:
    record = f"{base}/fs{kb}/run/record.json"
    out[kb]["status"] = json.load(open(record))["status"] if os.path.exists(record) else None
    out[kb]["notes"] = open(f"{base}/fs{kb}/NOTES.md", "rb").read().decode()
    out[kb]["tmp_debris"] = [n for n in os.listdir(f"{base}/fs{kb}/run") if n.startswith(".") and n != ".hydra"]
print(json.dumps(out))
"""

# the tmpfs sizes (KiB, one page of them the user's NOTES.md): full before .hydra/ is written, at config.yaml (after
# .hydra/ and the run's marker .recipe-bundle-run), at plan.json (after config.yaml and command.sh), at env.json
# (after plan.json and argv.json); each in the middle of its range (measured 2026-12-02: config.yaml 32-36, plan.json
# 44-68, env.json 76; 2026-12-06, plan.json with its throughput section: env.json 80, 84 and larger fit it all)
PLAN_SIZES = [8, 36, 56, 80]


@pytest.fixture(scope="module")
def full_plans(tmp_path_factory):
    base = tmp_path_factory.mktemp("full")
    result = subprocess.run(
        [
            *NAMESPACE,
            sys.executable,
            "-c",
            PLAN_DRIVER,
            str(base),
            json.dumps(PLAN_SIZES),
            str(REPO_ROOT),
            NOTES.decode(),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return base, {int(kb): case for kb, case in json.loads(result.stdout).items()}


@needs_tmpfs
@pytest.mark.parametrize("kb", PLAN_SIZES)
def test_a_plan_on_a_full_disk_is_one_line_naming_the_file(full_plans, kb):
    """Promise: a plan on a full file system exits 2 with one line naming the file that could not be written and
    "no space left on device" (Hydra's .hydra/ included), no traceback, no temporary file left; the user's file
    beside the run directory is untouched."""
    base, cases = full_plans
    rc, stderr = cases[kb]["full"]
    assert rc == 2, stderr[-3000:]
    line = helpers.assert_one_line(stderr, f"{base}/fs{kb}/run/", ": no space left on device")
    assert "record.json" not in cases[kb]["left"] or "no space" in line
    assert cases[kb]["notes"] == NOTES.decode()


@needs_tmpfs
def test_the_disk_fills_at_different_points(full_plans):
    """The sizes fill the disk before .hydra/, at config.yaml, at plan.json and at env.json: the cases above cover
    each."""
    base, cases = full_plans
    named = {kb: cases[kb]["full"][1].strip().split(": ")[-2].rsplit("/", 1)[-1] for kb in PLAN_SIZES}
    assert {".hydra", "config.yaml", "plan.json", "env.json"} <= set(named.values()), named
    assert "config.yaml" in cases[56]["left"] and "plan.json" not in cases[56]["left"], cases[56]["left"]


@needs_tmpfs
@pytest.mark.parametrize("kb", PLAN_SIZES)
def test_after_a_full_disk_train_works_or_names_the_way_out(full_plans, kb):
    """Promise: once there is room again, `train` into the directory a full disk stopped either works (only
    Hydra's files were left) or refuses in one line, "holds a partial run (no record.json); pass --overwrite",
    and --overwrite then plans the run; the user's file survives."""
    base, cases = full_plans
    case = cases[kb]
    rc, stderr = case["again"]
    if rc != 0:
        assert rc == 2
        helpers.assert_one_line(stderr, "holds a partial run (no record.json", "pass --overwrite")
        assert case["overwrite"][0] == 0, case["overwrite"][1][-3000:]
        assert set(case["left"]) - {".hydra", "train.log"}, "refused although only Hydra's files were left"
    else:
        assert set(case["left"]) <= {".hydra", "train.log"}, case["left"]
    assert case["status"] == "planned" and case["notes"] == NOTES.decode() and case["tmp_debris"] == []


# ------------------------------------------------------------------------------------------ partial runs


def _partial(full_plans, tmp: Path, kb: int = 80) -> Path:
    """A copy of the real partial run a full disk of ``kb`` KiB left (:data:`PLAN_DRIVER`), in ``tmp/run``."""
    import shutil

    base, cases = full_plans
    assert ".recipe-bundle-run" in cases[kb]["left"], cases[kb]["left"]
    shutil.copytree(base / f"partial{kb}", tmp / "run", symlinks=True)
    return tmp / "run"


@pytest.fixture
def train_here(refused_train):
    """``train ARGS`` in this process (conftest's ``refused_train``) as (exit code, stderr)."""

    def call(args, cwd):
        result = refused_train(args, cwd)
        return result.returncode, result.stderr

    return call


@needs_tmpfs
@pytest.mark.parametrize("kb", [56, 80])
def test_a_partial_run_is_named_and_overwrite_removes_it(full_plans, tmp_path, train_here, kb):
    """Promise: a directory a full disk stopped before its record (a real one: the run's marker
    .recipe-bundle-run, the plan files written so far, Hydra's .hydra/ and train.log, plus the temporary sibling of
    an atomic write) is a partial run: a plain `train` refuses it by name, nothing removed; --overwrite removes
    it and plans the run. Then a file of the user's in that run's .hydra/ stops --overwrite of it, naming .hydra/,
    and nothing is removed."""
    run = _partial(full_plans, tmp_path, kb)
    assert (run / ".recipe-bundle-run").is_file() and not (run / "record.json").exists()
    (run / ".record.json.ab12cd34").write_bytes(b'{"status": "runn')
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    rc, err = train_here([f"hydra.run.dir={run}"], tmp_path)
    assert rc == 2
    helpers.assert_one_line(err, f"hydra.run.dir={run}: holds a partial run (no record.json", "pass --overwrite")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    result = run_train([f"hydra.run.dir={run}", "--overwrite"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "record.json").read_text())["status"] == "planned"
    assert not (run / ".record.json.ab12cd34").exists() and not (run / ".recipe-bundle-run").exists()
    assert json.loads((run / "plan.json").read_text())
    (run / ".hydra" / "thesis.tex").write_bytes(NOTES)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    rc, err = train_here([f"hydra.run.dir={run}", "--overwrite"], tmp_path)
    assert rc == 2
    helpers.assert_one_line(err, "holds files its run's record.json does not list (.hydra/)")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert (run / ".hydra" / "thesis.tex").read_bytes() == NOTES


FOREIGN = ["NOTES.md", "metrics.jsonl", "data", ".config.yaml.short", ".hydra/thesis.tex", ".hydra/sub/x.yaml"]


@needs_tmpfs
@pytest.mark.parametrize("foreign", FOREIGN)
def test_a_partial_run_with_anything_else_is_never_removed(full_plans, tmp_path, train_here, foreign):
    """Promise: a real partial run (its marker, no record.json) beside anything a run does not write before its
    record (a user's file, metrics or rows no record accounts for, a name that only looks like a temporary file, a
    file in .hydra/ that is not one of Hydra's three) is not a partial run: refused in every mode, --overwrite
    included, and nothing is removed."""
    run = _partial(full_plans, tmp_path)
    (run / foreign).parent.mkdir(parents=True, exist_ok=True)
    (run / foreign).mkdir() if foreign == "data" else (run / foreign).write_bytes(NOTES)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for flag in ([], ["--overwrite"], ["--resume"]):
        rc, err = train_here([f"hydra.run.dir={run}", *flag], tmp_path)
        assert rc == 2
        helpers.assert_one_line(err, "holds files that no run wrote")
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def _users(tmp: Path, files: dict) -> Path:
    run = tmp / "run"
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    return run


HYDRA_YAML = b"hydra:\n  run:\n    dir: RUN\n"
USERS = {  # directories a user wrote, with the names a run writes but no marker: no run of the bundle wrote them
    "a lone config.yaml": {"config.yaml": b"my own config\n"},
    "a lone command.sh": {"command.sh": b"#!/bin/bash\necho mine\n"},
    "config.yaml and train.log": {"config.yaml": b"mine\n", "train.log": b"my log\n"},
    "a .plan.json.backup01": {"plan.json": b"{}\n", ".plan.json.backup01": b"backup\n"},
    "a thesis in .hydra": {"config.yaml": b"mine\n", ".hydra/thesis.tex": b"thesis\n", ".hydra/hydra.yaml": HYDRA_YAML},
    "every plan file, Hydra's three": {
        **{n: b"{}\n" for n in ("config.yaml", "command.sh", "plan.json", "argv.json", "env.json")},
        **{f".hydra/{n}": HYDRA_YAML for n in ("config.yaml", "hydra.yaml", "overrides.yaml")},
    },
}


@pytest.mark.parametrize("case", sorted(USERS))
def test_a_users_files_are_no_partial_run(tmp_path, train_here, case):
    """Promise: a directory holding a user's files under the names a run writes (config.yaml, command.sh,
    train.log, .plan.json.backup01, a file in .hydra/) but not the marker a run writes first
    (.recipe-bundle-run) is not a partial run: refused in every mode, --overwrite included, byte for byte kept."""
    run = _users(tmp_path, USERS[case])
    before = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for flag in ([], ["--overwrite"], ["--resume"]):
        rc, err = train_here([f"hydra.run.dir={run}", *flag], tmp_path)
        assert rc == 2, err
        helpers.assert_one_line(err, f"hydra.run.dir={run}: holds files that no run wrote")
        assert {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------------------------ atomic_file's errors


def test_atomic_file_names_its_target_only_for_its_own_errors(tmp_path):
    """Promise: atomic_file names its target in an OSError of its own writes (here a write past RLIMIT_FSIZE,
    EFBIG, through its handle), and raises an error of the caller's own code in its body unchanged (a flush to
    /dev/full: ENOSPC, no filename), never blaming the target for it; either way no file and no temporary file is
    left."""
    import errno
    import resource
    import signal

    from trainer.errors import os_error_line
    from trainer.publish import atomic_file

    target = tmp_path / "out.bin"
    with pytest.raises(OSError) as info:
        with atomic_file(target) as handle, open("/dev/full", "wb") as other:
            handle.write(b"mine")
            other.write(b"x")
            other.flush()
    assert info.value.errno == errno.ENOSPC and info.value.filename is None, info.value
    assert str(target) not in os_error_line(info.value)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with pytest.raises(OSError) as info:
            with atomic_file(target) as handle:
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
                handle.write(b"x" * 65536)
                handle.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert info.value.errno == errno.EFBIG and info.value.filename == str(target), info.value
    assert os_error_line(info.value).startswith(str(target))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ a name too long


def test_a_run_directory_name_too_long_is_one_line(tmp_path, train_here):
    """Promise: a path component longer than the file system takes is one line "file name too long" naming the
    field and the path, exit 2, nothing written."""
    rc, err = train_here([f"hydra.run.dir={tmp_path}/{LONG}/run"], tmp_path)
    assert rc == 2
    helpers.assert_one_line(err, f"hydra.run.dir={tmp_path}/{LONG}/run", "file name too long")
    assert list(tmp_path.iterdir()) == []


def test_a_sign_key_name_too_long_is_one_line(tmp_path, train_here):
    rc, err = train_here([f"hydra.run.dir={tmp_path}/run", "--sign-key", f"{tmp_path}/{LONG}"], tmp_path)
    assert rc == 2
    helpers.assert_one_line(err, f"{tmp_path}/{LONG}", "file name too long")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["status", "TMP/LONG"],
        ["logs", "TMP/LONG/train.log", "-o", "TMP/metrics.jsonl"],
        ["report", "TMP/LONG"],
        ["cache", "--cache", "TMP/LONG", "add", "TMP/file", "--sha256", "0" * 64],
        ["cache", "--cache", "TMP/cas", "add", "TMP/LONG", "--sha256", "0" * 64],
        ["cache", "--cache", "TMP/LONG", "verify"],
        ["keygen", "--out", "TMP/LONG"],
        ["verify", "TMP/LONG"],
        ["converge", "TMP/LONG", "TMP/LONG"],
    ],
)
def test_a_name_too_long_is_one_line_in_every_command(tmp_path, capsys, args):
    """Promise: every command answers a path component that is too long with one line naming it, exit 2."""
    (tmp_path / "file").write_bytes(b"x")
    argv = [a.replace("TMP", str(tmp_path)).replace("LONG", LONG) for a in args]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    line = helpers.assert_one_line(err, LONG, prefix=f"trainer {args[0]}: error: ")
    assert "too long" in line.lower(), line


# ------------------------------------------------------------------------------------------ a record's pid


def _running_record(tmp: Path, **fields) -> Path:
    run = tmp / "run"
    run.mkdir()
    record = {
        "schema_version": 1,
        "status": "running",
        "host": socket.gethostname(),
        "files_sha256": {},
        "created_utc": "2026-01-01T00:00:00Z",
        "started_utc": "2026-01-01T00:00:00Z",
        **fields,
    }
    (run / "record.json").write_text(json.dumps(record))
    return run


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _own_start() -> int:
    """This process's start time (``/proc/self/stat``), which the tests' machines always have."""
    started = process_started(os.getpid())
    assert started is not None, "no start time for this process (/proc)"
    return started


PIDS = {
    "2**31": lambda: {"pid": 2147483648},
    "negative": lambda: {"pid": -1},
    "zero": lambda: {"pid": 0},
    "beyond pid_max": lambda: {"pid": (1 << 22) + 1},
    "dead": lambda: {"pid": _dead_pid()},
    "reused, start time recorded": lambda: {"pid": os.getpid(), "pid_started": _own_start() - 1},
    "pid 1, start time recorded": lambda: {"pid": 1, "pid_started": (process_started(1) or 0) + 7},
    "reused, no start time (an older record)": lambda: {"pid": os.getpid()},
    "another boot": lambda: {
        "pid": os.getpid(),
        "pid_started": process_started(os.getpid()),
        "boot_id": "00000000-0000-0000-0000-000000000000",
    },
}


@pytest.mark.parametrize("case", sorted(PIDS))
def test_a_running_record_whose_process_is_gone_is_not_running(tmp_path, capsys, case):
    """Promise: `trainer status` never reports running for a record whose pid names no process of the run (a pid
    that overflows kill, a negative one or 0, which name process groups, one past pid_max, a dead one, a live one
    reused by another process: its start time differs from the record's pid_started, or it started after the
    run; another boot): one line "interrupted" with the reason, exit 1, and --wait returns at once; the record
    then says so."""
    run = _running_record(tmp_path, **PIDS[case]())
    started = time.monotonic()
    rc = cli.main(["status", str(run), "--wait", "--timeout", "20"])
    out = capsys.readouterr()
    assert time.monotonic() - started < 5
    assert rc == 1, out
    assert "Traceback" not in out.err + out.out and out.err == ""
    lines = out.out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{run}: interrupted: its "), lines
    assert "is gone" in lines[0] or "is not a process id" in lines[0]
    assert json.loads((run / "record.json").read_text())["status"] == "interrupted"


def test_a_string_pid_is_one_line(tmp_path, capsys):
    run = _running_record(tmp_path, pid="12")
    assert cli.main(["status", str(run)]) == 2
    helpers.assert_one_line(
        capsys.readouterr().err, "record.json: pid is str", "expected integer", prefix="trainer status: error: "
    )


def test_the_runs_own_live_process_is_running(tmp_path, capsys):
    """The tamper cases' control: the record of a live process with its own start time is running (exit 3)."""
    run = _running_record(
        tmp_path,
        pid=os.getpid(),
        pid_started=process_started(os.getpid()),
        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    assert cli.main(["status", str(run)]) == 3
    assert capsys.readouterr().out == f"{run}: running\n"


def test_status_wait_of_a_reused_pid_returns(tmp_path):
    """Promise: `status --wait` of a record naming a live unrelated process (pid 1, another start time) returns,
    in a process of its own (bounded here by a timeout)."""
    run = _running_record(tmp_path, pid=1, pid_started=(process_started(1) or 0) + 7)
    result = run_trainer("status", run, "--wait", cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and result.stdout.startswith(f"{run}: interrupted: its process 1 is gone")


def test_a_zombie_launcher_is_not_running(tmp_path, capsys):
    """Promise: a record naming a process that has ended but is not yet reaped (a zombie: kill(pid, 0) still
    succeeds, its start time still matches) is reported and recorded interrupted, not running."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        for _ in range(200):  # until the child has exited (state Z); it is reaped only in the finally below
            if (Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]) == b"Z":
                break
            time.sleep(0.01)
        run = _running_record(
            tmp_path,
            pid=pid,
            pid_started=process_started(pid),
            started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        os.kill(pid, 0)  # the zombie answers kill(pid, 0)
        assert cli.main(["status", str(run)]) == 1
        out = capsys.readouterr().out
        assert out.startswith(f"{run}: interrupted: its process {pid} is gone: it ended (a zombie"), out
        assert json.loads((run / "record.json").read_text())["status"] == "interrupted"
    finally:
        os.waitpid(pid, 0)


PIDNS_WRITER = r"""
import json, socket, sys, time
from trainer.record.record import process_identity
run = sys.argv[1]
record = {"schema_version": 1, "status": "running", "host": socket.gethostname(), "files_sha256": {},
          "created_utc": "2026-01-01T00:00:00Z", "started_utc": "2026-01-01T00:00:00Z", **process_identity()}
open(f"{run}/record.json", "w").write(json.dumps(record))
open(f"{run}/ready", "w").write("")
for _ in range(600):
    time.sleep(0.05)
    try:
        open(f"{run}/done")
        break
    except OSError:
        pass
"""


def _pidns_prefix() -> list:
    for prefix in (
        ["unshare", "--pid", "--fork", "--mount-proc"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"],
    ):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            continue
    return []


def test_a_live_run_in_another_pid_namespace_stays_running(tmp_path, capsys):
    """Promise: a live run whose launcher runs in another pid namespace (a container) is reported "running (its
    process cannot be checked from here...)", exit 3, and its record is never rewritten (before, its pid, 1 or 2
    in its namespace, named pid 1 here and the run was recorded interrupted for good)."""
    prefix = _pidns_prefix()
    if not prefix:
        pytest.skip("unshare --pid --fork --mount-proc is refused here")
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", PIDNS_WRITER, str(run)], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    try:
        for _ in range(400):
            if (run / "ready").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (run / "ready").exists(), proc.poll()
        before = (run / "record.json").read_bytes()
        record = json.loads(before)
        assert record["pid"] < 10 and record["pid_ns"] != os.readlink("/proc/self/ns/pid"), record
        assert cli.main(["status", str(run)]) == 3
        assert (
            capsys.readouterr().out
            == f"{run}: running (its process cannot be checked from here: another pid namespace)\n"
        )
        assert (run / "record.json").read_bytes() == before
    finally:
        (run / "done").write_text("")
        proc.wait(timeout=60)


def test_a_record_of_this_pid_namespace_is_still_checked(tmp_path, capsys):
    """The namespace case's tamper control: a record naming this reader's own pid namespace and a dead pid is
    interrupted (the namespace check skips only a namespace other than the reader's)."""
    run = _running_record(tmp_path, pid=_dead_pid(), pid_ns=os.readlink("/proc/self/ns/pid"))
    assert cli.main(["status", str(run)]) == 1
    assert "interrupted: its process" in capsys.readouterr().out
    assert json.loads((run / "record.json").read_text())["status"] == "interrupted"


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
