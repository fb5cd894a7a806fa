"""Training-log parsing: Megatron-LM training_log lines and miles step/perf lines into metrics.jsonl."""

import json
import math

import pytest

import helpers
from helpers import GOLDEN
from trainer import cli
from trainer.report.convergence import check
from trainer.errors import UserError
from trainer.report.logs import parse_log
from trainer.report.metrics import Step, read_metrics

LOGS = GOLDEN / "megatron-logs"  # real Megatron lines quoted in public threads; each file names its source


def real_log(name):
    return parse_log((LOGS / name).read_text(encoding="utf-8"), name)

MEGATRON = """\
[2026-10-13 10:00:01] some startup line
 [2026-10-13 10:01:00] iteration        1/      20 | consumed samples:          128 | elapsed time per iteration (ms): 30512.4 | throughput per GPU (TFLOP/s/GPU): 40.1 | learning rate: 1.000000E-06 | global batch size:   128 | lm loss: 2.451230E+00 | loss scale: 1.0 | grad norm: 3.210 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 1000.0 | max allocated: 2000.0
 [2026-10-13 10:01:20] iteration        2/      20 | consumed samples:          256 | elapsed time per iteration (ms): 20270.0 | learning rate: 2.000000E-06 | global batch size:   128 | lm loss: 2.398000E+00 | loss scale: 1.0 | grad norm: nan | number of skipped iterations:   0 | number of nan iterations:   1 |
 [2026-10-13 10:01:40] iteration        3/      20 | consumed samples:          384 | elapsed time per iteration (ms): 20100.5 | learning rate: 3.000000E-06 | global batch size:   128 | lm loss: 2.350000E+00 | loss scale: 1.0 | grad norm: 2.500 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""

MILES = """\
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:00] model.py:612 - step 0: {'train/loss': 2.45123, 'train/grad_norm': 3.21, 'train/lr-pg_0': 1e-06, 'train/global_batch_size': 128, 'train/step': 0}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:01] actor.py:300 - perf 0: {'perf/actor_train_time': 30.5124, 'perf/step_time': 31.0}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:20] model.py:612 - step 1: {'train/loss': 2.398, 'train/grad_norm': inf, 'train/lr-pg_0': 2e-06, 'train/global_batch_size': 128, 'train/step': 1}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:21] actor.py:300 - perf 1: {'perf/actor_train_time': 20.27, 'perf/step_time': 21.0}
"""


def test_megatron_lines():
    steps = parse_log(MEGATRON, "train.log", seq_length=8192)
    assert [s.step for s in steps] == [1, 2, 3]
    assert [s.lm_loss for s in steps] == [2.45123, 2.398, 2.35]
    assert steps[0].grad_norm == 3.21 and math.isnan(steps[1].grad_norm)
    assert [s.step_time_s for s in steps] == pytest.approx([30.5124, 20.27, 20.1005], rel=1e-12)  # ms / 1000
    assert steps[2].lr == 3e-6 and steps[0].tokens == 128 * 8192
    assert steps[0].supervised_tokens is None and steps[0].max_memory_bytes is None


def test_miles_lines_are_zero_based():
    steps = parse_log(MILES, "miles.log")
    assert [s.step for s in steps] == [1, 2]
    assert [s.lm_loss for s in steps] == [2.45123, 2.398]
    assert math.isinf(steps[1].grad_norm) and steps[1].lr == 2e-6
    assert [s.step_time_s for s in steps] == [30.5124, 20.27]
    assert steps[0].tokens is None  # no --seq-length


def test_refusals():
    with pytest.raises(UserError, match="no training step lines found"):
        parse_log("hello\nworld\n", "x.log")
    clash = MEGATRON + MEGATRON.splitlines()[3].replace("2.398000E+00", "2.5") + "\n"
    with pytest.raises(UserError, match=r"x.log line 6: step 2 again \(first at line 4\)"):
        parse_log(clash, "x.log")
    assert len(parse_log(MEGATRON + MEGATRON, "x.log")) == 3  # the same lines twice (two handlers) are fine
    with pytest.raises(UserError, match="lm loss 'abc' is not a number"):
        parse_log(" iteration 1/ 2 | lm loss: abc |", "x.log")
    with pytest.raises(UserError, match="x.log line 1: number of nan iterations 'x' is not an integer"):
        parse_log(" iteration 1/ 2 | number of nan iterations: x |", "x.log")


def test_real_lines_every_iteration_is_a_step():
    # epfLLM thread: ordinary lines
    steps = real_log("epfllm-megatron-llm-issue-33.log")
    assert [(s.step, s.lm_loss, s.grad_norm, s.skipped_iterations, s.nan_iterations) for s in steps] == [
        (3383, 0.7334521, 0.752, 0, 0), (3384, 0.7072597, 0.741, 0, 0)]
    assert steps[0].step_time_s == pytest.approx(7.6131) and steps[0].lr == 6.68e-6
    # epfLLM PR: a NaN loss (no lm loss, no counter) and a skipped iteration: both are steps without a loss
    steps = real_log("epfllm-megatron-llm-pull-34.log")
    assert [s.step for s in steps] == [3633, 3634]
    assert all(math.isnan(s.lm_loss) for s in steps)
    assert [(s.skipped_iterations, s.nan_iterations) for s in steps] == [(0, 0), (1, None)]
    assert steps[0].grad_norm == 0.794 and steps[1].grad_norm is None
    assert [s.no_loss_reason for s in steps] == [None, "1 skipped iteration"]
    # NCCL thread: a whole interval skipped by the fp16 loss scaler; the timer line is not a step
    (step,) = real_log("nvidia-nccl-issue-743.log")
    assert (step.step, math.isnan(step.lm_loss), step.skipped_iterations, step.no_loss_reason) == (10, True, 10, "10 skipped iterations")
    # Megatron-DeepSpeed thread: extra fields, grad norm nan, no loss
    steps = real_log("bigscience-megatron-deepspeed-issue-396.log")
    assert [s.step for s in steps] == [5426, 5427, 5428]
    assert all(math.isnan(s.lm_loss) and math.isnan(s.grad_norm) for s in steps)


def test_nan_step_survives_logs_and_fails_converge(tmp_path, capsys):
    log = LOGS / "epfllm-megatron-llm-pull-34.log"
    assert cli.main(["logs", str(log), "-o", str(tmp_path)]) == 0
    assert "2 without a finite loss (steps 3633, 3634)" in capsys.readouterr().out
    text = (tmp_path / "metrics.jsonl").read_text()
    # strict JSON: no bare NaN; the non-finite loss is the string "NaN"
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in text.splitlines()]
    assert [r["lm_loss"] for r in rows] == ["NaN", "NaN"]
    assert [(r["skipped_iterations"], r.get("nan_iterations")) for r in rows] == [(0, 0), (1, None)]
    steps = read_metrics(tmp_path / "metrics.jsonl")
    assert [s.step for s in steps] == [3633, 3634] and all(math.isnan(s.lm_loss) for s in steps)
    # against a reference with finite losses at the same steps, the check fails for the NaN steps
    reference = [Step(step=3633, lm_loss=0.70), Step(step=3634, lm_loss=0.69)]
    result = check(steps, reference)
    assert not result["passed"] and "finite_loss" in result["failed_checks"] and "aligned" not in result["failed_checks"]
    finite = next(c for c in result["checks"] if c["name"] == "finite_loss")
    assert finite["value"] == 2
    assert finite["text"] == "NaN/Inf loss at candidate step 3633, candidate step 3634 (1 skipped iteration)"
    # the same through the command
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "metrics.jsonl").write_text("".join(json.dumps(s.as_dict()) + "\n" for s in reference))
    code = cli.main(["converge", str(tmp_path / "metrics.jsonl"), str(ref / "metrics.jsonl"), "--json", "--no-plot", "--out", str(tmp_path / "conv")])
    out = capsys.readouterr().out
    assert code == 1
    verdict = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in converge --json"))
    assert verdict["passed"] is False and "finite_loss" in verdict["failed_checks"]


def test_cli_writes_metrics_jsonl(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(MEGATRON)
    code = cli.main(["logs", str(log), "-o", str(tmp_path), "--seq-length", "8192"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 steps (1..3), 3 with a step time, 3 with tokens" in out
    steps = read_metrics(tmp_path / "metrics.jsonl")
    assert [s.lm_loss for s in steps] == [2.45123, 2.398, 2.35] and math.isnan(steps[1].grad_norm)
    assert '"grad_norm": "NaN"' in (tmp_path / "metrics.jsonl").read_text()
    code = cli.main(["logs", str(tmp_path / "missing.log"), "-o", str(tmp_path)])
    assert code == 2 and "no such log file" in capsys.readouterr().err


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
