"""Four Slurm nodes on this machine (munged, slurmctld and four slurmd ``n1``..``n4``, all on 127.0.0.1, started
and stopped here): ``srun -N4 --ntasks-per-node=2`` places two tasks on each node, and the CPU worker trains
across them, eight ranks under DistributedDataParallel, to the per-step losses of one process on the same
global batch (``trainer converge`` passes)."""

import json
import os
import shutil
import sys
from collections import Counter

import pytest

import helpers
from helpers import REPO_ROOT, run_train
from launch_fixtures import LocalSlurm, free_port, missing_slurm

pytestmark = [
    pytest.mark.skipif(
        bool(missing_slurm()),
        reason=f"Slurm is not installed (missing: {' '.join(missing_slurm())}; Debian slurm-wlm munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the private Slurm cluster runs its daemons as root"),
    pytest.mark.usefixtures("eight_ranks_one_module_at_a_time"),
]
NODES, TASKS_PER_NODE, STEPS = 4, 2, 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalSlurm(tmp_path_factory.mktemp("slurm4"), gpus=0, cpus=TASKS_PER_NODE, nodes=NODES) as slurm:
        yield slurm


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


def test_the_cpu_worker_trains_across_four_nodes_like_one_process(cluster, tmp_path):
    one = tmp_path / "dp1"
    batch = ["optim.global_batch_size=8", "optim.rollout_batch_size=8", "layout.micro_batch_size=1"]
    result = run_train(["experiment=smoke", f"launcher.steps={STEPS}", *batch, f"hydra.run.dir={one}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    nodes = tmp_path / "slurm"  # the same composition, its eight ranks placed by Slurm on the four nodes
    nodes.mkdir()
    shutil.copy(one / "config.yaml", nodes / "config.yaml")
    worker = f"exec {sys.executable} -m trainer.launch.cpu_worker {nodes} $SLURM_PROCID $SLURM_NTASKS {one}/data/rows"
    # rank 0's address and a port, as a launcher across hosts gives them (TCP rendezvous, no shared file)
    export = f"--export=ALL,PYTHONPATH={REPO_ROOT},MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}"
    ran = srun(cluster, export, "bash", "-c", worker, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not (nodes / ".rendezvous").exists()
    a = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (nodes / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b, strict=True):
        assert (y["tokens"], y["supervised_tokens"]) == (x["tokens"], x["supervised_tokens"])
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-4)
    probes = [json.loads((nodes / f"probe-rank-{r}.json").read_text()) for r in range(NODES * TASKS_PER_NODE)]
    assert len(probes) == NODES * TASKS_PER_NODE
    verdict = helpers.run_trainer("converge", nodes / "metrics.jsonl", one / "metrics.jsonl", "--json")
    assert verdict.returncode == 0 and json.loads(verdict.stdout)["passed"] is True, verdict.stdout[-2000:]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
