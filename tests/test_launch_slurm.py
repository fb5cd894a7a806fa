"""launcher=slurm against a real single-node Slurm on localhost (munged, slurmctld, slurmd started and stopped
here): a probe-only job through sbatch -> preflight -> Ray head -> ray job submit, followed with `trainer status`;
a node that fails its probe (it sees 0 GPUs where the job asked for 1); a submission Slurm refuses."""

import json
import os

import pytest

import helpers
from helpers import run_train
from launch_fixtures import LocalSlurm, free_port, missing_ray, missing_slurm, ray_port_args

pytestmark = [
    pytest.mark.skipif(
        bool(missing_slurm()),
        reason=f"Slurm is not installed (missing: {' '.join(missing_slurm())}; Debian slurm-wlm munge)",
    ),
    pytest.mark.skipif(missing_ray() is not None, reason=str(missing_ray())),
    pytest.mark.skipif(os.geteuid() != 0, reason="the private Slurm cluster runs its daemons as root"),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with LocalSlurm(tmp_path_factory.mktemp("slurm"), gpus=2) as cluster:
        yield cluster


def submit(tmp_path, slurm, *extra):
    run_dir = tmp_path / "run"
    os.environ.update(SLURM_CONF=str(slurm.conf), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    ray_args = ",".join(repr(a) for a in ray_port_args())
    result = run_train(
        [
            "experiment=smoke",
            "launcher=slurm",
            "launcher.container=none",
            "launcher.submit=true",
            "launcher.head_ip=127.0.0.1",
            f"launcher.ray_port={free_port()}",
            f"launcher.dashboard_port={free_port()}",
            f"launcher.ray_start_args=[{ray_args}]",
            "launcher.time_limit=00:05:00",
            f"paths.kernel_cache={tmp_path}/kernels",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=tmp_path,
    )
    return result, run_dir


def status(run_dir, *args):
    return helpers.run_trainer("status", run_dir, *args, timeout=150)


def test_probe_job_end_to_end(tmp_path, slurm):
    result, run_dir = submit(
        tmp_path, slurm, "launcher.expect_gpus=false", "launcher.job=[python3,-m,trainer.probe,--node,job]"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.split("submitted Slurm job ")[1].split()[0]
    assert json.loads((run_dir / "record.json").read_text())["slurm"]["job_id"] == job_id
    followed = status(run_dir, "--wait", "--timeout", "120")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert followed.stdout.strip().splitlines()[-1] == f"{run_dir}: complete (Slurm job {job_id})"
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "complete" and record["slurm"]["nodes"] == ["localhost"]
    assert record["slurm"]["exit_codes"] == {"job": 0}
    assert record["preflight"]["ok"] is True and record["probe"]["nodes"] == ["localhost"]
    assert record["probe"]["ranks"][0]["node"] == "localhost"
    # the node saw the GPU Slurm gave it (a simulated device: scheduling only)
    assert "CUDA_VISIBLE_DEVICES" not in record["probe"]["ranks"][0]  # the probe reads devices, not env
    log = (run_dir / "logs" / "job.log").read_text()
    assert "preflight: 1 node(s) agree" in log and f"Job 'recipe-{job_id}' succeeded" in log
    assert '"node": "job"' in log  # the job's own output
    assert (run_dir / "logs" / "ray" / "localhost" / "raylet.out").is_file()
    assert f"logs/slurm-{job_id}.out" in record["logs"]


def test_node_failing_its_probe_stops_the_job_before_training(tmp_path, slurm):
    # the job asks for 1 GPU per node; the node's probe sees none (no CUDA here): preflight must stop it
    result, run_dir = submit(tmp_path, slurm, "launcher.job=[python3,-c,'raise SystemExit(9)']")
    assert result.returncode == 0, result.stderr
    followed = status(run_dir, "--wait", "--timeout", "60")
    assert followed.returncode == 1
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "failed" and record["slurm"]["stage"] == "preflight"
    assert record["reason"] == "preflight: 1 of 1 node(s) differ: localhost: GPUs 0 != 1"
    assert record["probe"]["nodes"] == ["localhost"]  # the probe is kept
    assert "localhost    -" in (run_dir / "logs" / "preflight.log").read_text()
    assert not (run_dir / "logs" / "job.log").exists() and not (run_dir / "logs" / "ray-head.log").exists()


def test_submission_refused_by_slurm(tmp_path, slurm):
    result, run_dir = submit(tmp_path, slurm, "cluster.partition=nosuch")
    assert result.returncode == 1
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "failed"
    assert record["reason"] == "sbatch refused the job: Batch job submission failed: Invalid partition name specified"
    assert (run_dir / "sbatch.sh").is_file() and "#SBATCH --partition=nosuch" in (run_dir / "sbatch.sh").read_text()


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
