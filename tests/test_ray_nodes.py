"""Four Ray nodes on this machine (a head and three workers, ``n1``..``n4`` at 127.0.0.2-5, each its own temp dir
and two declared slots, in a network namespace of their own; started and stopped here): ``train
experiment=smoke-cluster`` (``launcher=ray``, ``launcher.payload=cpu``) places one CPU worker per slot as miles
places its actors, two per node, and the eight ranks train under DDP to one process's per-step losses on the same
global batch; every rank's probe names its node and ``trainer verify`` passes. A rank killed mid-run ends the run
``failed`` within a bounded time, naming the rank and its node, with the steps already written kept; ``--resume``
continues it from its latest checkpoint to the same losses. (The resumed run is the one whose placement, probes,
losses and verify are checked: a clean four-node run costs as much again on two cores.)"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train
from launch_fixtures import LocalRayCluster, NetNamespace, missing_ray

pytestmark = [
    pytest.mark.skipif(missing_ray() is not None, reason=str(missing_ray())),
    pytest.mark.skipif(os.geteuid() != 0, reason="the cluster's network namespace needs root"),
]
NODES, SLOTS, STEPS = 4, 2, 4


def host_listening_inodes() -> set[str]:
    """Socket inodes listening in this (the host's) network namespace: ``/proc/net/tcp`` and ``tcp6``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                out.add(fields[9])
    return out


def socket_inodes(pids: list[int]) -> set[str]:
    """The socket inodes the processes ``pids`` hold open (``/proc/PID/fd`` links ``socket:[INODE]``)."""
    out = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out.add(target[len("socket:[") : -1])
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # the nodes' lifetime (`timeout`) bounds the whole module: about 11 minutes here, two runs more on a slower day
    with NetNamespace() as netns, LocalRayCluster(tmp_path_factory.mktemp("ray4"), netns, lifetime_s=1800) as ray:
        yield ray


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same training as one local process (DP1, the global batch of 8 rows in 8 microbatches)."""
    return helpers.one_process_run(tmp_path_factory.mktemp("dp1"), STEPS)


def cluster_env(ray) -> dict[str, str]:
    return {k: v for k, v in ray.env().items() if k.startswith("RAY_") or k == "PATH"}


def train_on(cluster, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``train ARGS`` in ``cwd`` as a client of ``cluster``: in its namespace, with its Ray settings."""
    return run_train(args, cwd=cwd, timeout=timeout, env=cluster_env(cluster), preexec_fn=cluster.netns.enter)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_four_nodes_on_their_own_addresses_and_nothing_listens_outside(cluster):
    assert cluster.alive_nodes() == NODES
    ask = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json,sys,urllib.request;print(urllib.request.urlopen(sys.argv[1]).read().decode())",
            cluster.address + "/nodes?view=summary",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=cluster.netns.enter,
    )
    summary = json.loads(ask.stdout)["data"]["summary"]
    assert sorted(n["raylet"]["nodeName"] for n in summary) == ["n1", "n2", "n3", "n4"]
    assert sorted(n["ip"] for n in summary) == ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    assert {n["raylet"]["resourcesTotal"]["GPU"] for n in summary} == {float(SLOTS)}
    # every socket the cluster's processes hold is in its namespace: none listens in the host's
    held = socket_inodes(cluster.netns.members())
    assert len(held) > 20  # the nodes' raylets, GCS, dashboard, agents
    assert held & host_listening_inodes() == set()


def test_a_rank_killed_mid_run_fails_the_run_naming_rank_and_node_and_resume_completes_it(
    cluster, one_process, eight_ranks_at_a_time, tmp_path
):
    """Rank 5 (node n3) killed after step 2 of STEPS, checkpoints every step: the run fails within a minute
    naming the rank and node, its steps kept; ``--resume`` of the same command line continues from the latest
    checkpoint on the same cluster, links both attempts and trains like one process."""
    run_dir = tmp_path / "run"
    env = {**os.environ, **cluster_env(cluster), "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "160"}
    args = ["experiment=smoke-cluster", f"launcher.steps={STEPS}", "launcher.save_interval=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.train", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=cluster.netns.enter,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
            line.lstrip().startswith("step 2/") or "step 2/" in line for line in lines
        ):
            assert proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        victim = next(re.search(r"rank 5: node (n\d) .*pid (\d+)", line) for line in lines if "rank 5: node" in line)
        node, pid = victim.group(1), int(victim.group(2))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=120)
        ended_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert proc.returncode != 0, "".join(lines)[-3000:]
    print(f"the run ended {ended_after:.1f} s after the kill")
    assert ended_after < 60, f"the run took {ended_after:.0f} s to end after the kill"
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "failed"
    assert f"rank 5 on node {node} failed" in record["reason"], record["reason"]
    assert node == "n3"
    kept = rows(run_dir / "metrics.jsonl")
    assert len(kept) >= 2 and [r["step"] for r in kept] == list(range(1, len(kept) + 1)) and len(kept) < STEPS
    done = int((run_dir / "checkpoints/latest_checkpointed_iteration.txt").read_text())
    assert 1 <= done <= len(kept)

    resumed = train_on(cluster, [*args, f"hydra.run.dir={run_dir}", "--resume"], tmp_path, 480)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    again = json.loads((run_dir / "record.json").read_text())
    assert again["status"] == "complete" and again["resumed_from"]["iteration"] == done
    assert again["ray"]["status"] == "SUCCEEDED"
    assert again["preflight"]["ok"] is True and again["preflight"]["nodes"] == ["n1", "n2", "n3", "n4"]
    # placement: ranks in node order, two slots per node (the resumed job's own account of it)
    log = (run_dir / "logs" / "job.log").read_text()
    placed = re.findall(r"^rank (\d+): node (n\d) \(([\d.]+)\), slot (\d)", log, re.M)[-NODES * SLOTS :]
    assert [(int(r), n, int(s)) for r, n, _, s in placed] == [(r, f"n{r // 2 + 1}", r % 2) for r in range(8)]
    assert "rendezvous: tcp://127.0.0.2:" in log
    # every rank's probe, written by the rank itself, names the node it ran on
    probes = [json.loads((run_dir / f"probe-rank-{r}.json").read_text()) for r in range(NODES * SLOTS)]
    assert Counter(p["node"] for p in probes) == {f"n{i}": SLOTS for i in range(1, NODES + 1)}
    assert again["probe"]["ranks"] == probes and again["probe"]["nodes"] == ["n1", "n2", "n3", "n4"]
    assert [(a["attempt"], a["status"]) for a in again["attempts"]] == [(1, "failed")]
    assert f"rank 5 on node {node} failed" in again["attempts"][0]["reason"]
    assert (
        f"resumed from checkpoints/iter_{done:07d}/mp_rank_00/model_optim_rng.pt"
        in (run_dir / "logs" / "job.log").read_text()
    )
    helpers.same_training(one_process, run_dir, STEPS)
    verified = helpers.run_trainer("verify", run_dir)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-1000:]
    assert "attempt 1: failed" in verified.stdout and "ok: nothing the lock pins drifted" in verified.stdout


def test_a_node_that_never_joins_or_runs_another_image_fails_the_run_before_training(cluster, tmp_path):
    """The last case (it stops n4): with three of the four nodes, the job waits ``launcher.node_wait_s`` for the
    fourth and fails before any rank starts, its reason one line naming the nodes that came. Then n4 comes back
    in another image (its processes see another ``RECIPE_BUNDLE_IMAGE_DIGEST``, as in an image of another
    digest): the preflight stops the run before training with the table of what differs."""
    cluster.stop_node("n4")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = train_on(
        cluster, ["experiment=smoke-cluster", "launcher.node_wait_s=10", f"hydra.run.dir={run_dir}"], tmp_path, 300
    )
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    record = json.loads((run_dir / "record.json").read_text())
    reason = "preflight: 3 of 4 node(s) alive after 10 s (n1, n2, n3); cluster.nodes is 4"
    assert record["status"] == "failed" and record["reason"] == reason, record["reason"]
    assert record["preflight"]["ok"] is False and not (run_dir / "metrics.jsonl").exists()
    assert reason in result.stdout + result.stderr
    print(f"the run failed {took:.0f} s after train started")
    assert took < 180

    other = "sha256:" + "be" * 32
    cluster.restart_node("n4", {"RECIPE_BUNDLE_IMAGE_DIGEST": other})
    run_dir = tmp_path / "other-image"
    result = train_on(cluster, ["experiment=smoke-cluster", f"hydra.run.dir={run_dir}"], tmp_path, 300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    record = json.loads((run_dir / "record.json").read_text())
    assert (
        record["status"] == "failed"
        and record["reason"] == f"preflight: 1 of 4 node(s) differ: n4: image digest {other} != -"
    )
    assert [(d["node"], d["field"]) for d in record["preflight"]["differences"]] == [("n4", "image digest")]
    assert not (run_dir / "metrics.jsonl").exists()
    table = (run_dir / "logs" / "job.log").read_text()
    n4 = next(line for line in table.splitlines() if line.startswith("n4 "))
    assert f"{other} *" in n4 and n4.count("*") == 1


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
