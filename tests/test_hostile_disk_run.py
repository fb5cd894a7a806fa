"""A disk that fills while a run executes: the record ends failed with the reason, or, where not even that can be
written, `trainer status` reports the run not running.

Real full disks, as in test_hostile_disk.py: a tmpfs in a user and mount namespace. The run is the tiny CPU
smoke run (``experiment=smoke``, launcher local-cpu); the disk is filled by a filler file as soon as the launcher
has written the job it runs (``job.json``), so the workers and the launcher's end meet ``ENOSPC``.
"""

import json
import subprocess
import sys

import helpers
from helpers import REPO_ROOT

NOTES = b"my notes: keep me\n"


NAMESPACE = helpers.tmpfs_namespace()
needs_tmpfs = helpers.needs_tmpfs

RUN_DRIVER = r"""
import json, os, subprocess, sys, time
base, repo, notes = sys.argv[1], sys.argv[2], sys.argv[3].encode()
env = {**os.environ, "PYTHONPATH": repo, "COLUMNS": "160"}
fs = f"{base}/fs"
os.makedirs(fs)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", fs], check=True)
open(f"{fs}/NOTES.md", "wb").write(notes)
run = f"{fs}/run"
proc = subprocess.Popen([sys.executable, "-m", "trainer.train", "experiment=smoke", "launcher.steps=4",
                         f"hydra.run.dir={run}"], cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
deadline = time.time() + 300
while not os.path.exists(f"{run}/job.json") and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
filled = 0
with open(f"{fs}/filler", "wb", buffering=0) as f:
    for chunk in (1 << 16, 1 << 12):
        try:
            while True:
                filled += f.write(b"\0" * chunk)
        except OSError:
            pass
stdout, stderr = proc.communicate(timeout=300)
status = subprocess.run([sys.executable, "-m", "trainer", "status", run], cwd=base, env=env, capture_output=True,
                        text=True, timeout=60)
print(json.dumps({"rc": proc.returncode, "stderr": stderr, "filled": filled,
                  "record": json.load(open(f"{run}/record.json")), "status": [status.returncode, status.stdout,
                  status.stderr], "notes": open(f"{fs}/NOTES.md", "rb").read().decode(),
                  "debris": [n for n in os.listdir(run) if n.startswith(".") and n != ".hydra"]}))
"""

# No room at all: the record on disk is smaller than the record that says how the run ended, on a full tmpfs
# (nothing can be written beside it, and it cannot be written over in place). The launcher's pid is dead.
NO_ROOM_DRIVER = r"""
import errno, json, os, socket, subprocess, sys
base, repo = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo)
from trainer.record.record import process_identity
from trainer.record.rundir import RunDir
env = {**os.environ, "PYTHONPATH": repo}
fs = f"{base}/fs"
os.makedirs(fs)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", fs], check=True)
run = f"{fs}/run"
os.makedirs(run)
dead = subprocess.Popen(["true"])
dead.wait()
record = {"status": "running", "host": socket.gethostname(), "files_sha256": {}, **process_identity(dead.pid)}
open(f"{run}/record.json", "w").write(json.dumps(record))
with open(f"{fs}/filler", "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\0" * 4096)
    except OSError:
        pass
ended = {**record, "files_sha256": {f"file-{i}": "0" * 64 for i in range(20)}}
saved = RunDir(run).record_out_of_room(ended, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{run}/metrics.jsonl"))
on_disk = json.load(open(f"{run}/record.json"))
def status():
    r = subprocess.run([sys.executable, "-m", "trainer", "status", run], env=env, capture_output=True, text=True,
                       timeout=60)
    return [r.returncode, r.stdout, r.stderr, json.load(open(f"{run}/record.json"))["status"]]
full = status()
os.unlink(f"{fs}/filler")
print(json.dumps({"saved": saved, "on_disk": on_disk, "full": full, "room": status()}))
"""


# Room for the plan, not for the rows the run builds (data/): the launcher's write fails, its temporary files go,
# and the end of the run has room again: a signed attestation.
SIGNED_DRIVER = r"""
import json, os, subprocess, sys
base, repo = sys.argv[1], sys.argv[2]
env = {**os.environ, "PYTHONPATH": repo, "COLUMNS": "160"}
subprocess.run([sys.executable, "-m", "trainer", "keygen", "--out", f"{base}/key"], env=env, check=True,
               capture_output=True)
fs = f"{base}/fs"
os.makedirs(fs)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", fs], check=True)
run = f"{fs}/run"
proc = subprocess.run([sys.executable, "-m", "trainer.train", "experiment=smoke", "launcher.steps=2",
                       f"hydra.run.dir={run}", "--sign-key", f"{base}/key"], cwd=base, env=env, capture_output=True,
                      text=True, timeout=300)
print(json.dumps({"rc": proc.returncode, "stderr": proc.stderr, "record": json.load(open(f"{run}/record.json")),
                  "attested": os.path.isfile(f"{run}/attestation.json"),
                  "debris": [n for n in os.listdir(run) if n.startswith(".") and n != ".hydra"]
                  + [n for n in os.listdir(f"{run}/data") if n.startswith(".")]}))
"""


def _in_namespace(driver, tmp_path, *args):
    result = subprocess.run(
        [*NAMESPACE, sys.executable, "-c", driver, str(tmp_path), str(REPO_ROOT), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@needs_tmpfs
def test_a_disk_that_fills_during_the_run_ends_its_record_failed(tmp_path):
    """Promise: a run whose disk fills while it executes exits 1 with one line naming the file and "no space left
    on device"; its record ends failed with that reason and not attested (there was no room for it), never
    "running"; `trainer status` says failed; the user's file beside the run directory survives; no temporary
    file is left."""
    out = _in_namespace(RUN_DRIVER, tmp_path, NOTES.decode())
    assert out["filled"] > 0
    assert out["rc"] == 1, out["stderr"][-3000:]
    helpers.assert_one_line(out["stderr"], "run failed", "no space left on device", "its record says so, not attested")
    record = out["record"]
    assert record["status"] == "failed" and "no space left on device" in record["reason"], record
    assert "not attested" in record["attestation"]["error"], record.get("attestation")
    rc, stdout, stderr = out["status"]
    assert rc == 1 and stdout.startswith(f"{tmp_path}/fs/run: failed: ") and "no space left" in stdout, out["status"]
    assert out["notes"] == NOTES.decode() and out["debris"] == []


@needs_tmpfs
def test_with_no_room_even_for_the_record_status_says_the_run_is_gone(tmp_path):
    """Promise: when not even the record can be written (a full disk, the record larger than the one on disk), it
    is left as it was (valid, "running"), and `trainer status` reports the run interrupted, its process gone, not
    running (exit 1); once there is room, status records that."""
    out = _in_namespace(NO_ROOM_DRIVER, tmp_path)
    assert out["saved"] is False and out["on_disk"]["status"] == "running"
    for when in ("full", "room"):
        rc, stdout, stderr, on_disk = out[when]
        assert rc == 1 and stderr == "", out[when]
        assert stdout.startswith(f"{tmp_path}/fs/run: interrupted: its process ") and "is gone" in stdout
    assert out["full"][3] == "running" and out["room"][3] == "interrupted"


@needs_tmpfs
def test_a_disk_too_small_for_the_runs_rows_ends_failed_and_signed(tmp_path):
    """Promise: when the disk fills during the run and the failed write's temporary files leave room again, the
    record ends failed with the reason (the file, "no space left on device") and the run is attested, signed with
    --sign-key; exit 1, one line, no temporary file left."""
    out = _in_namespace(SIGNED_DRIVER, tmp_path)
    assert out["rc"] == 1, out["stderr"][-3000:]
    helpers.assert_one_line(out["stderr"], f"{tmp_path}/fs/run/data/", ": no space left on device")
    record = out["record"]
    assert record["status"] == "failed" and f"{tmp_path}/fs/run/data/" in record["reason"], record
    assert "no space left on device" in record["reason"] and "Errno" not in record["reason"]
    assert out["attested"] and record["attestation"]["signed_by"], record["attestation"]
    assert out["debris"] == []


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
