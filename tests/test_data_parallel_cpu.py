"""Layout equivalence on CPU under PyTorch's DistributedDataParallel: the tiny DeepSeek-V4 trained with the global
batch fixed (8 rows, one row per microbatch) by 1, 2, 4 and 8 processes (``layout=gpu{1,2,4,8}-tp1pp1ep1``,
gloo on loopback). Every pair passes ``trainer converge``, the per-step losses agree to float32 reduction order,
and one process with a 10x learning rate fails against DP1 and DP8."""

import contextlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT

STEPS = 5
BATCH = ("optim.global_batch_size=8", "optim.rollout_batch_size=8", "layout.micro_batch_size=1")
# name -> overrides; started in waves so that at most 8 ranks (about 1.4 GB each) are alive at once; the waves of
# more than two ranks hold the eight-rank lock (helpers.one_heavy_at_a_time)
WAVES: list[dict[str, tuple[str, ...]]] = [
    {"dp1": ("layout=gpu1-tp1pp1ep1",), "dp1-lr10": ("layout=gpu1-tp1pp1ep1", "optim.lr=3e-2")},
    {"dp2": ("layout=gpu2-tp1pp1ep1",), "dp4": ("layout=gpu4-tp1pp1ep1",)},
    {"dp8": ("layout=gpu8-tp1pp1ep1",)},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each run of :data:`WAVES` (``experiment=smoke``, :data:`STEPS` steps, :data:`BATCH`), a wave at a time;
    returns name -> run directory. Fails with the run's log tail when one does not finish (10 min each)."""
    done: dict[str, Path] = {}
    for wave in WAVES:
        ranks = sum(int(overrides[0].split("-")[0].removeprefix("layout=gpu")) for overrides in wave.values())
        with helpers.one_heavy_at_a_time() if ranks > 2 else contextlib.nullcontext():
            done |= run_wave(wave, tmp_path_factory)
    return done


def run_wave(wave: dict[str, tuple[str, ...]], tmp_path_factory) -> dict[str, Path]:
    """Start every run of ``wave`` at once and wait for each; returns name -> run directory. A failed or stuck
    run does not leave the others of its wave running."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    started: dict[str, tuple[subprocess.Popen, Path]] = {}
    done: dict[str, Path] = {}
    try:
        for name, overrides in wave.items():
            cwd = tmp_path_factory.mktemp(name)
            argv = [sys.executable, "-m", "trainer.train", "experiment=smoke", f"launcher.steps={STEPS}", *BATCH]
            argv += [*overrides, f"hydra.run.dir={cwd / 'run'}"]
            with (cwd / "train.log").open("w") as log:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
            started[name] = (proc, cwd)
        for name, (proc, cwd) in started.items():
            proc.wait(timeout=600)
            assert proc.returncode == 0, (cwd / "train.log").read_text()[-3000:]
            done[name] = cwd / "run"
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_each_data_parallel_size_matches_one_process_step_by_step(runs, size):
    one, many = metrics(runs["dp1"]), metrics(runs[f"dp{size}"])
    assert len(one) == len(many) == STEPS
    for a, b in zip(one, many, strict=True):
        assert (b["tokens"], b["supervised_tokens"]) == (a["tokens"], a["supervised_tokens"])
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    record = json.loads((runs[f"dp{size}"] / "record.json").read_text())
    assert record["returncodes"] == [0] * size and len(record["probe"]["ranks"]) == size
    assert record["choices"]["layout"] == f"gpu{size}-tp1pp1ep1"


@pytest.mark.parametrize("pair", list(itertools.combinations(["dp1", "dp2", "dp4", "dp8"], 2)))
def test_every_pair_of_sizes_converges(runs, pair):
    verdict = helpers.run_trainer("converge", runs[pair[1]], runs[pair[0]], "--json")
    assert verdict.returncode == 0 and json.loads(verdict.stdout)["passed"] is True, verdict.stdout[-2000:]


@pytest.mark.parametrize("reference", ["dp1", "dp8"])
def test_a_changed_learning_rate_fails(runs, reference):
    other = helpers.run_trainer("converge", runs["dp1-lr10"], runs[reference], "--json")
    assert other.returncode == 1, other.stdout[-2000:]
    assert "final_loss" in {c["name"] for c in json.loads(other.stdout)["checks"] if not c["passed"]}


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
