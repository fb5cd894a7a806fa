"""The rendered sbatch.sh for the recipe (layout=tp2pp4ep8 cluster=p5en-8x8) reviewed against the recipe: 8 nodes,
8 GPUs each, the image by digest, and exactly the seed's environment and argv (via the plan's argv.json)."""

import json
import os
import re
import subprocess

import helpers
from helpers import run_train, seed_command

IMAGE = "registry.example.invalid/recipe-bundle/full@sha256:" + "0123456789abcdef" * 4


def render(tmp_path, *extra):
    run_dir = tmp_path / "run"
    result = run_train(
        [
            "layout=tp2pp4ep8",
            "cluster=p5en-8x8",
            "launcher=slurm",
            f"launcher.image={IMAGE}",
            "cluster.partition=h200",
            "cluster.account=llm",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        cwd=tmp_path,
    )
    return result, run_dir


def bash_array(script: str, name: str, env_names):
    """Expand the bash array ``name`` of ``script`` as bash would, with each $VAR standing for itself."""
    found = re.search(rf"^{name}=\(\n.*?^\)$", script, re.M | re.S)
    assert found, f"no bash array {name} in the script"
    block = found.group(0)
    env = {**os.environ, **{n: f"${n}" for n in env_names}}
    out = subprocess.run(["bash", "-c", block + f'\nprintf "%s\\0" "${{{name}[@]}}"'], capture_output=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.decode().split("\0")[:-1]


def test_recipe_sbatch_matches_the_recipe(tmp_path):
    result, run_dir = render(tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"wrote {run_dir}/sbatch.sh" in result.stdout
    script = (run_dir / "sbatch.sh").read_text()
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "rendered" and record["image"]["digest"] == IMAGE.split("@")[1]
    directives = [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert directives[:7] == [
        "--job-name=recipe-tp2pp4ep8",
        "--nodes=8",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--time=04:00:00",
        "--partition=h200",
        "--account=llm",
    ]
    # every srun step runs in the image pinned by digest (pyxis)
    assert f"IMAGE={IMAGE}" in script
    assert '--container-image="$IMAGE"' in script
    sruns = [line for line in script.splitlines() if line.lstrip().startswith("srun ")]
    assert sruns and all('"${CONTAINER[@]}"' in line or "hostname" in line for line in sruns)
    assert "ray start --head --block" in script
    # each Ray node takes free ports of its own (jobsteps ray-ports); the workers start once the head answers
    worker = (
        """exec ray start --block --address="$1" $("$0" -m trainer.launch.jobsteps ray-ports) """
        """--node-name="$SLURMD_NODENAME" --temp-dir="$RAY_TMP-$SLURMD_NODENAME" "${@:2}"' \\\n"""
        """      "$PY" "$HEAD_IP:6379" --num-gpus=8"""
    )
    assert worker in script
    assert "jobsteps ray-ports --head" in script
    assert script.index("wait-dashboard") < script.index("exec ray start --block --address")
    assert script.index("trainer.probe") < script.index("trainer.launch.preflight") < script.index("ray start --head")
    assert "--expect-gpus 8 --expect-digest " + IMAGE.split("@")[1] in script
    # the environment: the seed's export lines, in its order and quoting
    seed_argv, seed_env = seed_command()
    exports = dict(
        line[len("export ") :].split("=", 1)
        for line in script.splitlines()
        if line.startswith("export ") and line.split("=")[0][7:] in seed_env
    )
    assert list(exports) == list(seed_env)
    for name, value in seed_env.items():
        assert exports[name].strip('"') == value, name
    # the argv: what bash makes of the ARGV array == the plan's argv.json == the seed's command
    argv = bash_array(script, "ARGV", ["HF_CKPT", "TORCH_DIST", "SFT_DATA", "KERNEL_CACHE"])
    plan_argv = json.loads((run_dir / "argv.json").read_text())
    assert argv == plan_argv
    assert argv[:8] == [
        "python3",
        "train.py",
        "--actor-num-nodes",
        "8",
        "--actor-num-gpus-per-node",
        "8",
        "--num-gpus-per-node",
        "8",
    ]
    assert len(argv) == len(seed_argv) and [(a, b) for a, b in zip(argv, seed_argv, strict=True) if a != b] == []
    # and the same command as command.sh
    command = (run_dir / "command.sh").read_text()
    assert (
        " \\\n  ".join(
            line.strip() for line in re.search(r"^ARGV=\(\n(.*?)^\)$", script, re.M | re.S).group(1).splitlines()
        )
        in command
    )


def test_refusals_are_one_line(tmp_path):
    result, run_dir = render(tmp_path, "launcher.image=registry.example.invalid/full:latest")
    assert result.returncode == 2 and not run_dir.exists()
    assert result.stderr.strip() == (
        "train: error: launcher.image 'registry.example.invalid/full:latest': expected an "
        "image pinned by digest, NAME@sha256:<64 hex>"
    )
    result, _ = render(tmp_path, "launcher.time_limit=soon")
    assert result.returncode == 2 and "launcher.time_limit 'soon'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result, _ = render(tmp_path, "launcher.ray_join_wave=-1")
    assert result.returncode == 2 and result.stderr.strip() == (
        "train: error: launcher.ray_join_wave must be >= 0 (got -1)"
    )


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
