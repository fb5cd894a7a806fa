"""`bin/test-cluster up|status|run|down DIR`: the tests' four-node Slurm cluster by hand (tests/cluster.py) comes
up in a network namespace of its own, runs a command on every node, refuses a second cluster in the same
directory in one line, and `down` leaves no process of it behind."""

import json
import os
import subprocess
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from launch_fixtures import missing_slurm

pytestmark = [
    pytest.mark.skipif(bool(missing_slurm()), reason=f"Slurm is not installed (missing: {' '.join(missing_slurm())})"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the cluster's daemons and namespaces need root"),
]
CLI = REPO_ROOT / "bin" / "test-cluster"


def cli(*args, timeout=240):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that contain ``text`` (from /proc: a fresh root has no pgrep)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and text in line and alive(int(entry.name)):
            found.append(line)
    return found


def test_up_run_status_down(tmp_path):
    root = tmp_path / "c"
    up = cli("up", root, "--nodes", 4, "--lifetime", 300, "--json")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads(up.stdout)
        assert state["nodes"] == ["n1", "n2", "n3", "n4"]
        assert state["addresses"] == {f"n{i}": f"127.0.0.{i + 1}" for i in range(1, 5)}
        assert json.loads((root / "cluster.json").read_text()) == state
        status = cli("status", root, "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["states"] == {f"n{i}": "idle" for i in range(1, 5)}
        ran = cli("run", root, "--", "srun", "-N4", "bash", "-c", 'echo "$SLURMD_NODENAME $(hostname)"')
        assert ran.returncode == 0, ran.stderr
        assert sorted(ran.stdout.split("\n")[:-1]) == [f"n{i} 127.0.0.{i + 1}" for i in range(1, 5)]
        again = cli("up", root)
        assert again.returncode == 2
        assert (
            again.stderr
            == f"test-cluster: error: {root}: a test cluster is already running there (down {root} first)\n"
        )
        assert processes_naming(str(root / "slurm" / "slurm.conf"))  # slurmctld and the four slurmd
    finally:
        down = cli("down", root)
    assert down.returncode == 0, down.stderr
    assert not alive(state["pid"]) and not (root / "cluster.json").exists()
    assert processes_naming(str(root / "slurm" / "slurm.conf")) == []
    gone = cli("run", root, "--", "true")
    assert gone.returncode == 1
    assert (
        gone.stderr
        == f"test-cluster: error: {root}: no test cluster running (no readable cluster.json); start one: up {root}\n"
    )


def test_bad_node_count_is_refused(tmp_path):
    refused = cli("up", tmp_path / "c", "--nodes", 9)
    assert refused.returncode == 2 and refused.stderr == "test-cluster: error: --nodes: expected 1 to 8\n"
    assert not (tmp_path / "c").exists()
    no_tools = cli("up", tmp_path / "c", "--tools", tmp_path / "nothing")
    assert no_tools.returncode == 2 and no_tools.stderr == (
        f"test-cluster: error: --tools {tmp_path / 'nothing'}: expected a root file system with "
        "opt/enroot/bin/enroot (lockfiles/slurm-node.lock.json built and unpacked)\n"
    )
    assert not (tmp_path / "c").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cluster.json").write_text('{"pid": "one"}')  # hand-edited: one line, no traceback
    edited = cli("status", tmp_path / "c")
    assert edited.returncode == 1 and edited.stderr == (
        f"test-cluster: error: {tmp_path / 'c' / 'cluster.json'}: expected the supervisor's record "
        "(pid, netns, slurm_conf, nodes)\n"
    )


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
