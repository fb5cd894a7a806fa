"""launcher=ray against a real Ray head on 127.0.0.1 (started and stopped here): a probe-only job with the
preflight on every node, a job that exits non-zero, and a cluster that cannot be reached."""

import json

import pytest

import helpers
from helpers import run_train
from launch_fixtures import LocalRay, free_port, missing_ray

pytestmark = pytest.mark.skipif(missing_ray() is not None, reason=str(missing_ray()))
DIGEST = "sha256:" + "5e" * 32


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    with LocalRay(tmp_path_factory.mktemp("ray")) as head:
        yield head


def submit(tmp_path, address, *extra):
    run_dir = tmp_path / "run"
    result = run_train(
        [
            "experiment=smoke",
            "launcher=ray",
            f"launcher.address={address}",
            f"launcher.image=registry.example.invalid/smoke@{DIGEST}",
            "launcher.expect_gpus=false",
            "launcher.workdir=null",
            f"paths.kernel_cache={tmp_path}/kernels",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=tmp_path,
        timeout=180,
    )
    record = json.loads((run_dir / "record.json").read_text())
    return result, run_dir, record


def test_probe_job_on_every_node(tmp_path, ray_head):
    result, run_dir, record = submit(tmp_path, ray_head.address, "launcher.job=[python3,-m,trainer.probe,--node,job]")
    assert result.returncode == 0, result.stdout + result.stderr + ray_head.logs()
    assert record["status"] == "complete" and record["ray"]["status"] == "SUCCEEDED"
    assert record["preflight"]["ok"] is True and record["preflight"]["nodes"] == ["127.0.0.1"]
    node = json.loads((run_dir / "probes" / "127.0.0.1.json").read_text())
    assert node["image"]["digest"] == DIGEST  # from the runtime env
    assert record["probe"]["ranks"] == [node]
    runtime_env = json.loads((run_dir / "runtime_env.json").read_text())
    env = json.loads((run_dir / "env.json").read_text())
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["FI_PROVIDER"] == "efa"
    assert {k: runtime_env["env_vars"][k] for k in env} == env
    assert runtime_env["env_vars"]["RECIPE_BUNDLE_IMAGE_DIGEST"] == DIGEST
    # the job's own output (a probe run as the job, with the recipe's env expanded on the cluster) is in its log
    log = (run_dir / "logs" / "job.log").read_text()
    job_probe = json.loads(log[log.index('{\n  "components"') : log.rindex("}") + 1])
    assert job_probe["node"] == "job" and job_probe["image"]["digest"] == DIGEST
    assert (
        (run_dir / "submit.sh")
        .read_text()
        .startswith("#!/usr/bin/env bash\nray job submit --address " + ray_head.address)
    )


def test_job_that_exits_non_zero(tmp_path, ray_head):
    result, run_dir, record = submit(
        tmp_path, ray_head.address, "launcher.job=[python3,-c,'import sys; print(\"boom\"); sys.exit(7)']"
    )
    assert result.returncode == 1
    assert record["status"] == "failed"
    assert record["reason"].endswith("failed: Job entrypoint command failed with exit code 7; last log line: boom"), (
        record["reason"] + ray_head.logs()
    )
    assert record["preflight"]["ok"] is True  # the nodes were fine; the job failed
    assert "boom" in (run_dir / "logs" / "job.log").read_text()


def test_wait_dashboard_counts_the_alive_nodes(ray_head, capsys):
    """`jobsteps wait-dashboard --nodes N` (what sbatch.sh waits on between waves of Ray worker nodes) reads the
    head's state API: one node alive here, so 1 passes at once and 2 times out naming the count."""
    from trainer.launch.jobsteps import alive_nodes, wait_dashboard

    assert alive_nodes(ray_head.address) == 1
    assert wait_dashboard(ray_head.address, 30, nodes=1) == 0
    assert wait_dashboard(ray_head.address, 2, nodes=2) == 1
    assert "(1 of 2 nodes alive)" in capsys.readouterr().err
    assert alive_nodes(f"http://127.0.0.1:{free_port()}") == "Connection refused"


def test_unreachable_cluster(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    result, run_dir, record = submit(tmp_path, address, "launcher.job=[python3,-c,pass]")
    assert result.returncode == 1
    assert record["status"] == "failed"
    assert record["reason"] == f"launcher.address {address}: Ray cluster unreachable (Connection refused)"
    assert json.loads((run_dir / "job.json").read_text())["argv"] == ["python3", "-c", "pass"]  # launcher.job
    assert json.loads((run_dir / "argv.json").read_text())[:2] == ["python3", "train.py"]  # the miles launch


def test_ranks_follow_node_address_then_gpu_id_whatever_the_bundle_order():
    """``ray_workers.rank_order``: the actors as Ray placed them (by bundle) ranked by node address as a number
    (127.0.0.9 before 127.0.0.10, which a string sort would swap), then by GPU id; a node that names no IP address
    is refused."""
    from trainer.launch.ray_workers import rank_order

    nodes = [
        {"address": "127.0.0.10", "gpu": 0},
        {"address": "127.0.0.9", "gpu": 1},
        {"address": "127.0.0.10", "gpu": 1},
        {"address": "127.0.0.9", "gpu": 0},
        {"address": "::1", "gpu": 0},
    ]
    assert rank_order(nodes) == [3, 1, 0, 2, 4]
    assert rank_order([]) == []
    with pytest.raises(ValueError):
        rank_order([{"address": "n1", "gpu": 0}])


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
