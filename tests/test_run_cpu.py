"""launcher=local-cpu end to end: the tiny DeepSeek-V4 trains on CPU processes, and the run record proves what ran."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from conftest import TEST_ROOT
from helpers import REPO_ROOT, run_train
from trainer.launch.cpu_worker import megatron_lr
from trainer.launch.host.processes import default_kernel_cache
from trainer.record.record import effective_status
from trainer.redact import redact_env

STEPS = 6
SECRETS = {"HF_TOKEN": "hf-secret-value-123", "MY_API_KEY": "key-value-456"}
# The smoke runs the cases share: name -> (overrides, HOME read-only). dp1 sees HOME on a read-only directory and
# no XDG_CACHE_HOME (bubblewrap binds it read-only: root could write into a mode-0555 one), as in a build sandbox.
SMOKE_RUNS = {"dp1": ((), True), "dp2": (("layout=gpu2-tp1pp1ep1",), False), "lr10": (("optim.lr=3e-2",), False)}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The shared smoke runs of STEPS steps, started together so that their serial start-ups overlap."""
    runs = {}
    for name, (extra, read_only_home) in SMOKE_RUNS.items():
        cwd = tmp_path_factory.mktemp(name)
        run_dir = cwd / "run"
        env = {**os.environ, **SECRETS, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "160"}
        argv = [
            sys.executable,
            "-m",
            "trainer.train",
            "experiment=smoke",
            f"launcher.steps={STEPS}",
            f"hydra.run.dir={run_dir}",
            *extra,
        ]
        if read_only_home:
            (cwd / "home").mkdir()
            env["HOME"] = str(cwd / "home")
            env.pop("XDG_CACHE_HOME")
            argv = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", env["HOME"], env["HOME"], *argv]
        output = (cwd / "train-output.log").open("w")
        runs[name] = (subprocess.Popen(argv, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT), run_dir)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def finished(runs, name):
    proc, run_dir = runs[name]
    proc.wait(timeout=600)
    assert proc.returncode == 0, (run_dir.parent / "train-output.log").read_text()[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def dp1(smoke_runs):
    return finished(smoke_runs, "dp1")


@pytest.fixture(scope="module")
def dp2(smoke_runs):
    return finished(smoke_runs, "dp2")


@pytest.fixture(scope="module")
def lr10(smoke_runs):
    return finished(smoke_runs, "lr10")


trainer = helpers.run_trainer


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_metrics_have_the_schema(dp1):
    rows = metrics(dp1)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert set(rows[0]) == {
        "step",
        "lm_loss",
        "grad_norm",
        "lr",
        "tokens",
        "supervised_tokens",
        "step_time_s",
        "max_memory_bytes",
    }
    assert rows[0]["lm_loss"] == pytest.approx(math.log(129_280), abs=0.3)  # random init: ~uniform over the vocabulary
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.1
    assert all(r["tokens"] == 4 * 256 for r in rows)  # global batch 4 rows x 256 tokens
    assert all(0 < r["supervised_tokens"] < r["tokens"] for r in rows)
    # warm-up 0.1 x 6 = 0.6 steps: step 1 at lr 0, then cosine from 3e-3 towards 3e-4
    assert rows[0]["lr"] == 0.0
    assert [r["lr"] for r in rows] == [pytest.approx(megatron_lr(i, STEPS, 3e-3, 3e-4, 0.1)) for i in range(STEPS)]
    assert 3e-4 < rows[-1]["lr"] < rows[1]["lr"] < 3e-3
    assert all(r["max_memory_bytes"] > 1e8 and r["step_time_s"] > 0 for r in rows)


def test_a_run_with_a_read_only_home_completes(dp1):
    # dp1 ran with HOME read-only and no XDG_CACHE_HOME: the default kernel cache could not be made there, so the
    # run used one in its own directory, said so, and wrote nothing into HOME
    home = dp1.parent / "home"
    assert json.loads((dp1 / "record.json").read_text())["status"] == "complete"
    env = json.loads((dp1 / "job.json").read_text())["env"]  # the environment the workers got
    assert env["HOME"] == str(home) and "XDG_CACHE_HOME" not in env
    assert env["KERNEL_CACHE"] == str(dp1 / "kernels") and env["TORCHINDUCTOR_CACHE_DIR"] == str(
        dp1 / "kernels/inductor"
    )
    expected = (
        f"kernel cache {home}/.cache/recipe-bundle/kernels not writable (Read-only file system); using {dp1}/kernels"
    )
    assert expected in (dp1.parent / "train-output.log").read_text()
    assert (dp1 / "kernels").is_dir() and list(home.iterdir()) == []


def test_the_kernel_cache_is_the_users_outside_tests(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_kernel_cache(tmp_path / "run") == str(tmp_path / "home/.cache/recipe-bundle/kernels")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_kernel_cache(tmp_path / "run") == str(tmp_path / "xdg/recipe-bundle/kernels")
    assert (tmp_path / "xdg/recipe-bundle/kernels").is_dir() and not (tmp_path / "run").exists()


def test_tests_write_under_their_own_temporary_directory(tmp_path):
    # conftest.py points HOME and the XDG directories at this test's temporary directory (Bazel's TEST_TMPDIR)
    base = Path(os.environ.get("TEST_TMPDIR") or TEST_ROOT).absolute()
    for name in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        assert Path(os.environ[name]).is_relative_to(base), name
    assert "KERNEL_CACHE" not in os.environ
    if os.environ.get("TEST_TMPDIR"):
        assert tmp_path.is_relative_to(base)


def test_record_says_what_ran(dp1):
    record = json.loads((dp1 / "record.json").read_text())
    assert record["status"] == "complete" and record["kind"] == "run" and record["launcher"] == "local-cpu"
    assert record["returncodes"] == [0]
    probe = record["probe"]["ranks"][0]
    import torch
    import transformers

    assert probe["torch"]["version"] == torch.__version__
    assert probe["components"]["transformers"] == transformers.__version__
    assert probe["components"]["megatron_core"] is None  # absent, not guessed
    assert (
        record["data"]["manifest"]["rows_sha256"] == "6ceb4f6e949f5e183b4e5cc48187c1ad247edb3770d7d060de7d58d6fd5711f3"
    )
    for name in ("config.yaml", "argv.json", "job.json", "env.json", "plan.json", "metrics.jsonl", "logs/rank-0.log"):
        assert (dp1 / name).is_file(), name
    job = json.loads((dp1 / "job.json").read_text())  # what the launcher started: rank 0's worker
    assert job["argv"][1:3] == ["-m", "trainer.launch.cpu_worker"]
    argv = json.loads((dp1 / "argv.json").read_text())  # the run's miles launch, as for a plan
    assert argv[:2] == ["python3", "train.py"] and "--micro-batch-size" in argv


def test_secrets_are_redacted_everywhere(dp1):
    env = json.loads((dp1 / "job.json").read_text())["env"]  # the workers' (env.json: the miles launch's, no secret)
    assert env["HF_TOKEN"] == "<redacted>" and env["MY_API_KEY"] == "<redacted>"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # the recipe's env reached the workers
    assert env["TRITON_CACHE_DIR"] == env["KERNEL_CACHE"] + "/triton"  # expanded as the recipe's shell would
    for path in dp1.parent.rglob("*"):  # the run directory and the launcher's output
        if path.is_file() and path.suffix in (".json", ".yaml", ".log", ".jsonl"):
            text = path.read_text(errors="replace")
            assert "hf-secret-value-123" not in text and "key-value-456" not in text, path


def test_data_parallel_matches_one_process(dp1, dp2):
    one, two = metrics(dp1), metrics(dp2)
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert (b["tokens"], b["supervised_tokens"]) == (a["tokens"], a["supervised_tokens"])
    record = json.loads((dp2 / "record.json").read_text())
    assert len(record["probe"]["ranks"]) == 2 and record["returncodes"] == [0, 0]


def test_convergence_passes_for_another_layout_and_fails_for_another_learning_rate(dp1, dp2, lr10):
    same = trainer("converge", dp2, dp1, "--json")
    assert same.returncode == 0, same.stdout[-2000:]
    assert json.loads(same.stdout)["passed"] is True
    other = trainer("converge", lr10, dp1, "--json")
    assert other.returncode == 1
    failed = {c["name"] for c in json.loads(other.stdout)["checks"] if not c["passed"]}
    assert "final_loss" in failed
    predicted = trainer(
        "converge", "--predict", "--candidate", "experiment=smoke optim.lr=3e-2", "--reference", "experiment=smoke"
    )
    assert predicted.returncode == 1 and "--lr" in predicted.stdout


def test_the_run_as_a_recipe(dp1, dp2, tmp_path):
    out = tmp_path / "recipe.yaml"
    proc = trainer("recipe", dp2, "--reference", dp1, "--no-cost", "-o", out)
    assert proc.returncode == 0, proc.stderr
    import yaml

    recipe = yaml.safe_load(out.read_text())
    assert recipe["correctness"]["convergence"]["result"] == "pass"
    assert recipe["result"]["mfu"] is None and "no GPU" in recipe["result"]["mfu_note"]
    assert trainer("recipe", "--validate", out).returncode == 0


def test_verify_passes_and_catches_planted_drift(dp1, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "trainer", "verify", str(dp1), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert ok.returncode == 0, ok.stderr
    rows = {r["component"]: r for r in json.loads(ok.stdout)["rows"]}
    assert rows["torch"]["verdict"] == "ok" and rows["megatron_core"]["verdict"] == "-"
    drifted = tmp_path / "drifted"
    shutil.copytree(dp1, drifted)
    record = json.loads((drifted / "record.json").read_text())
    record["probe"]["ranks"][0]["torch"]["version"] = "2.12.0+cpu"
    record["probe"]["ranks"][0]["components"]["transformers"] = None
    (drifted / "record.json").write_text(json.dumps(record))
    bad = subprocess.run(
        [sys.executable, "-m", "trainer", "verify", str(drifted), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert bad.returncode == 1
    rows = {r["component"]: r for r in json.loads(bad.stdout)["rows"]}
    assert (rows["torch"]["verdict"], rows["torch"]["observed"]) == ("drift", "2.12.0+cpu")
    assert rows["transformers"]["verdict"] == "absent"


def test_model_parallel_layouts_are_refused_on_cpu(tmp_path):
    proc = run_train(["experiment=smoke", "layout=gpu8-tp2pp2ep4", "model.num_layers=2"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "train: error: layout.tensor_model_parallel_size 2: launcher local-cpu runs data parallel only "
        "(TP, PP, CP, EP, ETP must be 1); use a GPU launcher for this layout"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_run_stopped_midway_leaves_a_record_that_says_so(tmp_path):
    # two runs at once (each needs only its record): one stopped by SIGTERM, one killed by SIGKILL after step 1
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    runs = {}
    for sig, expected in ((signal.SIGTERM, "interrupted"), (signal.SIGKILL, "running")):
        run_dir = tmp_path / sig.name / "run"
        run_dir.parent.mkdir()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.train",
                "experiment=smoke",
                "launcher.steps=50",
                f"hydra.run.dir={run_dir}",
            ],
            cwd=run_dir.parent,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        runs[sig] = (proc, run_dir, expected)
    try:
        for sig, (proc, run_dir, expected) in runs.items():
            deadline = time.time() + 300
            while time.time() < deadline and not (run_dir / "metrics.jsonl").is_file():
                time.sleep(0.5)
            assert (run_dir / "metrics.jsonl").is_file(), sig.name
            assert helpers.pids_running("trainer.launch.cpu_worker", str(run_dir))  # the worker is seen while it runs
            proc.send_signal(sig)
            proc.wait(timeout=120)
            record = json.loads((run_dir / "record.json").read_text())
            assert record["status"] == expected, sig.name
            assert effective_status(record) == "interrupted", sig.name
            deadline = time.time() + 60
            workers = ["?"]
            while workers and time.time() < deadline:  # workers die with their launcher (SIGTERM from the kernel)
                workers = helpers.pids_running("trainer.launch.cpu_worker", str(run_dir))
                time.sleep(0.2)
            assert workers == [], sig.name
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_redact_env():
    env = {
        "HF_TOKEN": "a",
        "aws_secret_access_key": "b",
        "DB_PASSWORD": "c",
        "GCP_CREDENTIALS": "d",
        "PATH": "/bin",
        "KEYBOARD": "x",
        "GITHUB_PAT": "e",
    }
    out = redact_env(env)
    assert out == {
        "DB_PASSWORD": "<redacted>",
        "GCP_CREDENTIALS": "<redacted>",
        "HF_TOKEN": "<redacted>",
        "GITHUB_PAT": "<redacted>",
        "KEYBOARD": "x",
        "PATH": "/bin",
        "aws_secret_access_key": "<redacted>",
    }


def test_megatron_learning_rate_schedule():
    lr, low = 1e-5, 1e-6
    assert megatron_lr(0, 20, lr, low, 0.1) == 0.0
    assert megatron_lr(1, 20, lr, low, 0.1) == pytest.approx(lr / 2)
    assert megatron_lr(2, 20, lr, low, 0.1) == pytest.approx(lr)
    assert megatron_lr(11, 20, lr, low, 0.1) == pytest.approx(low + (lr - low) * 0.5)
    assert megatron_lr(20, 20, lr, low, 0.1) == pytest.approx(low)
    # a fractional warm-up (0.1 x 25 = 2.5 steps) is not rounded: step 2 is still warming up
    assert megatron_lr(2, 25, lr, low, 0.1) == pytest.approx(lr * 2 / 2.5)
    # the other --lr-decay-style values the workers follow; Megatron's others are refused
    assert megatron_lr(11, 20, lr, low, 0.1, "linear") == pytest.approx(low + (lr - low) * 0.5)
    assert (
        megatron_lr(15, 20, lr, low, 0.1, "constant") == lr and megatron_lr(1, 20, lr, low, 0.1, "constant") == lr / 2
    )
    with pytest.raises(ValueError, match="lr_decay_style 'WSD'"):
        megatron_lr(3, 20, lr, low, 0.1, "WSD")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
