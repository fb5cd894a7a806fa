"""Four Slurm nodes on this machine (munged, slurmctld and four slurmd ``n1``..``n4``, all on 127.0.0.1, started
and stopped here): ``srun -N4 --ntasks-per-node=2`` places two tasks on each node, and the CPU worker trains
across them, eight ranks under DistributedDataParallel, to the per-step losses of one process on the same
global batch (``trainer converge`` passes). ``train launcher=slurm`` submits the same training through Ray on the
four nodes; a node killed whole mid-run fails it naming the node and its ranks, and once the node is back
``--resume`` continues it from the last checkpoint; that job then loses its first node (its script, the Ray head,
rank 0), ``trainer status`` records the end Slurm saw, and a second ``--resume`` completes the run."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train
from launch_fixtures import LocalSlurm, NetNamespace, free_port, missing_slurm

pytestmark = [
    pytest.mark.skipif(
        bool(missing_slurm()),
        reason=f"Slurm is not installed (missing: {' '.join(missing_slurm())}; Debian slurm-wlm munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the private Slurm cluster runs its daemons as root"),
]
NODES, TASKS_PER_NODE, STEPS = 4, 2, 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm4")
    with (
        NetNamespace() as netns,
        LocalSlurm(root, gpus=0, cpus=TASKS_PER_NODE, nodes=NODES, netns=netns, lifetime_s=1800) as slurm,
    ):
        yield slurm


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same training as one local process (DP1, the global batch of 8 rows in 8 microbatches)."""
    return helpers.one_process_run(tmp_path_factory.mktemp("dp1"), STEPS)


def srun(slurm, *argv, timeout=300):
    return slurm.client(
        ["srun", f"-N{NODES}", f"--ntasks-per-node={TASKS_PER_NODE}", "--time=00:08:00", *map(str, argv)], timeout
    )


def test_four_nodes_come_up_and_take_two_tasks_each(cluster):
    nodes = cluster.client(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
    assert sorted(nodes.stdout.split("\n")[:-1]) == [f"n{i} idle" for i in range(1, NODES + 1)]
    placed = srun(cluster, "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS"')
    assert placed.returncode == 0, placed.stderr
    rows = [line.split() for line in placed.stdout.splitlines()]
    assert Counter(r[0] for r in rows) == {f"n{i}": TASKS_PER_NODE for i in range(1, NODES + 1)}
    assert sorted(int(r[1]) for r in rows) == list(range(NODES * TASKS_PER_NODE))
    assert {r[3] for r in rows} == {str(NODES * TASKS_PER_NODE)}
    assert {r[2] for r in rows} == {"0", "1"}


def test_the_cpu_worker_trains_across_four_nodes_like_one_process(
    cluster, one_process, eight_ranks_at_a_time, tmp_path
):
    one = one_process
    nodes = tmp_path / "slurm"  # the same composition, its eight ranks placed by Slurm on the four nodes
    nodes.mkdir()
    shutil.copy(one / "config.yaml", nodes / "config.yaml")
    worker = f"exec {sys.executable} -m trainer.launch.cpu_worker {nodes} $SLURM_PROCID $SLURM_NTASKS {one}/data/rows"
    # rank 0's address and a port, as a launcher across hosts gives them (TCP rendezvous, no shared file)
    export = f"--export=ALL,PYTHONPATH={REPO_ROOT},MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}"
    ran = srun(cluster, export, "bash", "-c", worker, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not (nodes / ".rendezvous").exists()
    helpers.same_training(one, nodes, STEPS)
    probes = [json.loads((nodes / f"probe-rank-{r}.json").read_text()) for r in range(NODES * TASKS_PER_NODE)]
    assert len(probes) == NODES * TASKS_PER_NODE


def submit(cluster, run_dir: Path, cwd: Path, *extra: str):
    """`train experiment=smoke-cluster launcher=slurm launcher.submit=true` on ``cluster`` (this module's settings
    for four nodes on few cores), ``extra`` overrides appended; returns the completed `train`."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "SLURM_CONF": str(cluster.conf)}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + cluster.env()["PATH"]
    return run_train(
        [
            "experiment=smoke-cluster",
            "launcher=slurm",
            "launcher.container=none",
            "launcher.node_address=hostname",
            "launcher.gpus_flag=none",
            "launcher.submit=true",
            f"launcher.python={sys.executable}",
            "launcher.time_limit=00:10:00",
            'launcher.ray_start_args=["--object-store-memory=200000000"]',
            "launcher.ray_join_wave=1",  # four nodes on this machine's few cores: one joins at a time
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=cwd,
        env=env,
        preexec_fn=cluster._preexec(),
    )


def test_train_launcher_slurm_on_four_nodes_survives_a_node_then_its_first_node_lost_by_resume(
    cluster, one_process, eight_ranks_at_a_time, tmp_path
):
    """`train launcher=slurm launcher.submit=true` writes sbatch.sh and submits it: the probe on every node, the
    preflight, a Ray head on n1 and a Ray worker on n2..n4 (each at its node's address, `hostname -i`), and the job:
    eight CPU workers, two per node, checkpointing every step. Node n3 dies whole after step 2 of STEPS (its slurmd,
    slurmstepd, Ray worker node and both ranks, SIGKILL at once, as a power cut): the job ends failed within 120 s,
    its record naming the node and the ranks it held, every step already written kept. n3 comes back (a fresh
    slurmd), and ``--resume`` of the same command line submits again. That job loses its first node n1 once it has
    saved a step (the batch script, the Ray head, ranks 0 and 1: nothing in the job is left to record the end):
    ``trainer status --wait`` finds the job ended by Slurm, records it failed naming n1 and its ranks, and the
    next ``--resume`` continues from the checkpoint the save's own sha256 file vouches for. The last job completes
    on the four nodes, the record links all three attempts, every rank's probe names its node, and the run
    trains like one process (``trainer converge`` passes) and verifies. (One run for all: a clean four-node run
    costs as much again on two cores; the pyxis module runs one uninterrupted.)"""
    run_dir = tmp_path / "run"
    args = (f"launcher.steps={STEPS}", "launcher.save_interval=1")
    submitted = submit(cluster, run_dir, tmp_path, *args)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        record = json.loads((run_dir / "record.json").read_text())
        assert record["status"] in ("submitted", "running"), record.get("reason")
        time.sleep(0.5)
    assert metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "no step 2 in 420 s"
    killed = cluster.kill_node("n3")
    assert len(killed) >= 4, killed  # slurmd, slurmstepd and the Ray worker node's processes at least
    at = time.monotonic()
    record = json.loads((run_dir / "record.json").read_text())
    while record["status"] not in ("complete", "failed") and time.monotonic() < at + 120:
        time.sleep(1)
        record = json.loads((run_dir / "record.json").read_text())
    ended_after = time.monotonic() - at
    print(f"the run ended {ended_after:.1f} s after node n3 was killed: {record.get('reason')}")
    logs = "".join(p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert record["status"] == "failed", f"{record['status']} {ended_after:.0f} s after the kill\n{logs}"
    lost = r"node n3 lost after \d+ s \(Ray marks it dead\), with rank\(s\) 4, 5; rank \d on node n\d saw "
    assert re.search(lost, record["reason"]), record["reason"]
    kept = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(kept) >= 2 and [r["step"] for r in kept] == list(range(1, len(kept) + 1)) and len(kept) < STEPS
    done = int((run_dir / "checkpoints/latest_checkpointed_iteration.txt").read_text())
    assert 1 <= done <= len(kept)

    cluster.restart_node("n3")
    resumed = submit(cluster, run_dir, tmp_path, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and int(tracker.read_text()) <= done:
        record = json.loads((run_dir / "record.json").read_text())
        assert record["status"] in ("submitted", "running"), record.get("reason")
        time.sleep(0.5)
    second = int(tracker.read_text())
    assert done < second < STEPS, f"the resumed job saved no step after {done} in 420 s, or finished: {second}"
    cluster.kill_node("n1")
    # Slurm learns of it as from a node health check (after SlurmdTimeout, 300 s, it would by itself) and ends
    # the job: NODE_FAIL
    marked = cluster.client(["scontrol", "update", "nodename=n1", "state=down", "reason=power cut"], timeout=30)
    assert marked.returncode == 0, marked.stderr
    followed = subprocess.run(  # as the user would, on the cluster (its namespace, its slurm.conf)
        [sys.executable, "-m", "trainer", "status", str(run_dir), "--wait", "--timeout", "120"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "SLURM_CONF": str(cluster.conf)},
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=cluster._preexec(),
    )
    assert followed.returncode == 1, followed.stdout[-2000:] + followed.stderr[-2000:]
    record = json.loads((run_dir / "record.json").read_text())
    print(f"the second attempt: {record.get('reason')}")
    first_lost = r"Slurm job \d+ ended NODE_FAIL before its script recorded a result; node\(s\) n1 lost \(down"
    assert record["status"] == "failed" and re.match(first_lost, record["reason"]), record.get("reason")
    assert record["reason"].split("), ", 1)[1].startswith("with rank(s) 0, 1"), record["reason"]
    assert record["ended_by"] == "trainer status" and int(tracker.read_text()) >= second

    cluster.restart_node("n1")
    second = int(tracker.read_text())
    resumed = submit(cluster, run_dir, tmp_path, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    again = wait_for_end(run_dir, 420)
    logs = "".join(p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert again["status"] == "complete", f"{again['status']}: {again.get('reason')}\n{logs}"
    assert again["resumed_from"]["iteration"] == second and again["slurm"]["nodes"] == ["n1", "n2", "n3", "n4"]
    assert again["preflight"]["ok"] is True
    job = (run_dir / "logs" / "job.log").read_text()
    placed = re.findall(r"rank (\d+): node (n\d) \(([\d.]+)\)", job)[-NODES * TASKS_PER_NODE :]  # the resumed job's
    addresses = {f"n{i}": f"127.0.0.{i + 1}" for i in range(1, NODES + 1)}
    assert [(int(r), n, a) for r, n, a in placed] == [
        (r, f"n{r // 2 + 1}", addresses[f"n{r // 2 + 1}"]) for r in range(NODES * TASKS_PER_NODE)
    ]
    assert Counter(p["node"] for p in again["probe"]["ranks"]) == {f"n{i}": TASKS_PER_NODE for i in range(1, 5)}
    assert [(a["attempt"], a["status"]) for a in again["attempts"]] == [(1, "failed"), (2, "failed")]
    assert re.search(lost, again["attempts"][0]["reason"]), again["attempts"][0]["reason"]
    assert re.match(first_lost, again["attempts"][1]["reason"]), again["attempts"][1]["reason"]
    assert [a["checkpoint_vouched_by"] for a in again["attempts"]] == ["record", "writer"]
    assert f"resumed from checkpoints/iter_{second:07d}/mp_rank_00/model_optim_rng.pt" in job
    helpers.same_training(one_process, run_dir, STEPS)
    verified = helpers.run_trainer("verify", run_dir)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-1000:]
    assert "attempt 1: failed" in verified.stdout
    assert "attempt 2: failed" in verified.stdout and "vouched for by the sha256 file its save wrote" in verified.stdout


def wait_for_end(run_dir: Path, timeout_s: float) -> dict:
    """The run's record once its status is ``complete`` or ``failed`` (polled every 2 s), or as it stands after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    record = json.loads((run_dir / "record.json").read_text())
    while record["status"] not in ("complete", "failed") and time.monotonic() < deadline:
        time.sleep(2)
        record = json.loads((run_dir / "record.json").read_text())
    return record


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
