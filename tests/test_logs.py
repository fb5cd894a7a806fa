"""Training-log parsing: Megatron-LM training_log lines and miles step/perf lines into metrics.jsonl."""

import math

import pytest

import helpers
from trainer import cli
from trainer.errors import UserError
from trainer.logs import parse_log
from trainer.metrics import read_metrics

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


def test_cli_writes_metrics_jsonl(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(MEGATRON)
    code = cli.main(["logs", str(log), "-o", str(tmp_path), "--seq-length", "8192"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 steps (1..3), 3 with a step time, 3 with tokens" in out
    steps = read_metrics(tmp_path / "metrics.jsonl")
    assert [s.lm_loss for s in steps] == [2.45123, 2.398, 2.35] and math.isnan(steps[1].grad_norm)
    code = cli.main(["logs", str(tmp_path / "missing.log"), "-o", str(tmp_path)])
    assert code == 2 and "no such log file" in capsys.readouterr().err


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
