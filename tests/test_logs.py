"""Training-log parsing: Megatron-LM training_log lines and miles step/perf lines into metrics.jsonl."""

import json
import math
import shutil

import pytest

import helpers
from helpers import GOLDEN
from trainer import cli
from trainer.errors import UserError
from trainer.report.convergence import check
from trainer.report.logs import parse_log, read_log
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
"""  # noqa: E501 - Megatron's log lines as it prints them, one line each

MILES = """\
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:00] model.py:612 - step 0: {'train/loss': 2.45123, 'train/grad_norm': 3.21, 'train/lr-pg_0': 1e-06, 'train/global_batch_size': 128, 'train/step': 0}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:01] actor.py:300 - perf 0: {'perf/actor_train_time': 30.5124, 'perf/step_time': 31.0}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:20] model.py:612 - step 1: {'train/loss': 2.398, 'train/grad_norm': inf, 'train/lr-pg_0': 2e-06, 'train/global_batch_size': 128, 'train/step': 1}
(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:21] actor.py:300 - perf 1: {'perf/actor_train_time': 20.27, 'perf/step_time': 21.0}
"""  # noqa: E501 - miles' log lines as it prints them, one line each


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
        (3383, 0.7334521, 0.752, 0, 0),
        (3384, 0.7072597, 0.741, 0, 0),
    ]
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
    assert (step.step, math.isnan(step.lm_loss), step.skipped_iterations, step.no_loss_reason) == (
        10,
        True,
        10,
        "10 skipped iterations",
    )
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
    rows = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
        for line in text.splitlines()
    ]
    assert [r["lm_loss"] for r in rows] == ["NaN", "NaN"]
    assert [(r["skipped_iterations"], r.get("nan_iterations")) for r in rows] == [(0, 0), (1, None)]
    steps = read_metrics(tmp_path / "metrics.jsonl")
    assert [s.step for s in steps] == [3633, 3634] and all(math.isnan(s.lm_loss) for s in steps)
    # against a reference with finite losses at the same steps, the check fails for the NaN steps
    reference = [Step(step=3633, lm_loss=0.70), Step(step=3634, lm_loss=0.69)]
    result = check(steps, reference)
    assert (
        not result["passed"] and "finite_loss" in result["failed_checks"] and "aligned" not in result["failed_checks"]
    )
    finite = next(c for c in result["checks"] if c["name"] == "finite_loss")
    assert finite["value"] == 2
    assert finite["text"] == "NaN/Inf loss at candidate step 3633, candidate step 3634 (1 skipped iteration)"
    # the same through the command
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "metrics.jsonl").write_text("".join(json.dumps(s.as_dict()) + "\n" for s in reference))
    code = cli.main(
        [
            "converge",
            str(tmp_path / "metrics.jsonl"),
            str(ref / "metrics.jsonl"),
            "--json",
            "--no-plot",
            "--out",
            str(tmp_path / "conv"),
        ]
    )
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


# ------------------------------------------------------------------------------------ issue 26 point 3

MILES_RAY = LOGS / "miles-78527b91-ray-driver.log"  # miles 78527b91's formats through a Ray driver; see its header


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A plan run of the recipe (`train`): config.yaml with optim.global_batch_size 128, data.seq_length 8192,
    64 GPUs."""
    root = tmp_path_factory.mktemp("runs")
    proc = helpers.run_train([f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def miles_log(steps, step_time=2.0):
    """A miles 78527b91 log of ``steps`` steps (0-based step K and perf R lines, one step per rollout)."""
    prefix = "(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:00.123 actor_cell0_rank0]"
    return "".join(
        f"{prefix} log_utils.py:542 - step {k}: {{'train/loss': {2.5 - 0.01 * k}, 'train/grad_norm': 1.5, "
        f"'train/lr-pg_0': 1e-05, 'train/step': {k}}}\n"
        f"{prefix} train_metric_utils.py:56 - perf {k}: {{'perf/train_wait_time': 0.05, "
        f"'perf/actor_train_time': {step_time + 0.01 * k}, 'perf/step_time': {step_time + 0.5}}}\n"
        for k in range(steps)
    )


def test_miles_log_has_no_global_batch_size_tokens_come_from_the_composition():
    text = MILES_RAY.read_text(encoding="utf-8")
    read = read_log(text, "miles.log")  # miles 78527b91 prints no global batch size: no tokens from the log alone
    assert [s.tokens for s in read.steps] == [None, None] and read.tokens_from == ""
    read = read_log(text, "miles.log", seq_length=8192, global_batch_size=128)
    assert [s.step for s in read.steps] == [1, 2]
    assert [s.tokens for s in read.steps] == [128 * 8192, 128 * 8192] and read.tokens_from == "composition"
    assert [s.step_time_s for s in read.steps] == [2.0512, 2.0333] and [s.lm_loss for s in read.steps] == [
        2.45123,
        2.398,
    ]
    # a log that prints its global batch size keeps it; one that differs from the composition is refused
    read = read_log(MEGATRON, "train.log", seq_length=8192, global_batch_size=128)
    assert read.tokens_from == "log" and read.steps[0].tokens == 128 * 8192
    with pytest.raises(
        UserError, match=r"train.log line 2: global batch size 128 in the log, 64 in the run's composition"
    ):
        read_log(MEGATRON, "train.log", seq_length=8192, global_batch_size=64)


def test_logs_run_dir_gives_tokens_and_report_reads_a_miles_log(run_dir, tmp_path, capsys):
    log = tmp_path / "miles.log"
    log.write_text(miles_log(20))
    run_dir = shutil.copytree(run_dir, tmp_path / "run")
    assert cli.main(["logs", str(log), "--run", str(run_dir)]) == 0  # writes RUN_DIR/metrics.jsonl
    out = capsys.readouterr().out
    assert (
        f"{run_dir / 'metrics.jsonl'}: 20 steps (1..20), 20 with a step time, 20 with tokens "
        f"(from {run_dir / 'config.yaml'} "
        "optim.global_batch_size x data.seq_length)" in out
    )
    steps = read_metrics(run_dir / "metrics.jsonl")
    assert {s.tokens for s in steps} == {128 * 8192}
    code = cli.main(["report", str(run_dir), "--json", "--no-plot", "--no-cost", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    times = [2.0 + 0.01 * k for k in range(4, 19)]  # steps 5..19 are perf 4..18
    assert summary["window"] == [5, 19] and summary["window_tokens"] == 15 * 128 * 8192
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(15 * 128 * 8192 / sum(times) / 64, rel=1e-12)
    # the same through the flags, into a file of its own
    assert (
        cli.main(
            [
                "logs",
                str(log),
                "-o",
                str(tmp_path / "m.jsonl"),
                "--global-batch-size",
                "128",
                "--seq-length",
                "8192",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == {
        "steps": 20,
        "from": "--global-batch-size x --seq-length",
        "global_batch_size": 128,
        "seq_length": 8192,
    }
    assert [s.tokens for s in read_metrics(tmp_path / "m.jsonl")] == [128 * 8192] * 20


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--global-batch-size", "128"], "--global-batch-size needs --seq-length"),
        (
            ["--run", "RUN", "--seq-length", "8192"],
            "--run takes the global batch size and sequence length from RUN_DIR/config.yaml",
        ),
        (["--seq-length", "0", "-o", "OUT"], "--seq-length 0: expected a positive number"),
        ([], "where to write? pass -o metrics.jsonl"),
        (["--run", "NOWHERE"], "NOWHERE: no such run directory (--run RUN_DIR)"),
        (["--run", "OUT"], "OUT: no config.yaml"),
    ],
)
def test_logs_composition_refusals_are_one_line(run_dir, tmp_path, capsys, args, needle):
    log = tmp_path / "miles.log"
    log.write_text(miles_log(2))
    (tmp_path / "out").mkdir()
    subst = {"RUN": str(run_dir), "OUT": str(tmp_path / "out"), "NOWHERE": str(tmp_path / "nowhere")}
    args = [subst.get(a, a) for a in args]
    code = cli.main(["logs", str(log), *args])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and needle.replace("NOWHERE", subst["NOWHERE"]).replace("OUT", subst["OUT"]) in err
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_truncated_last_line_is_counted_not_a_nan_step():
    # the epfLLM thread's two real lines, then the next one cut where a killed job would leave it
    cut = (LOGS / "epfllm-megatron-llm-issue-33.log").read_text(
        encoding="utf-8"
    ) + "iteration     3385/    8000 | consumed samples:       216640 | elapsed time per iteration (ms): 76"
    read = read_log(cut, "train.log")
    assert [s.step for s in read.steps] == [3383, 3384]  # before: step 3385 with lm_loss NaN
    assert [(t.line, t.kind, t.step) for t in read.truncated] == [(5, "megatron step", 3385)]
    # so the run passes the check against a reference of its steps (a NaN step 3385 failed it as finite_loss)
    reference = [Step(step=s.step, lm_loss=s.lm_loss, grad_norm=s.grad_norm) for s in read.steps]
    assert check(read.steps, reference)["passed"] is True
    # a miles step line cut inside its dict
    read = read_log(MILES_RAY.read_text(encoding="utf-8"), "miles.log")
    assert [(t.line, t.kind, t.step) for t in read.truncated] == [(20, "miles step", 5)]
    assert 5 not in [s.step for s in read.steps]
    with pytest.raises(
        UserError,
        match=r"x.log: no training step lines found .*; 1 truncated line not read \(line 1; 1 of them step lines\)",
    ):
        read_log(" iteration 1/ 2 | lm loss: 2.0", "x.log")
    # a fork whose runner ends the line otherwise (`log_string += f' ETA Time: {eta_string}'`): complete lines are
    # steps, and only a last line the text ends without a newline is cut
    eta = " iteration 1/ 20 | lm loss: 2.0 | ETA Time: 1:00:00\n iteration 2/ 20 | lm loss: 1.9 | ETA Time: 0:59:00\n"
    assert [s.lm_loss for s in read_log(eta, "eta.log").steps] == [2.0, 1.9]
    read = read_log(eta + " iteration 3/ 20 | lm loss: 1.", "eta.log")
    assert [s.step for s in read.steps] == [1, 2] and [(t.line, t.step) for t in read.truncated] == [(3, 3)]


def test_ray_deduplicated_lines_are_counted_with_their_repeats(tmp_path, capsys):
    read = read_log(MILES_RAY.read_text(encoding="utf-8"), "miles.log")
    assert [(d.line, d.kind, d.step, d.repeats) for d in read.deduplicated] == [
        (17, "other", None, 4),
        (18, "miles step", 4, 3),
    ]
    assert [s.step for s in read.steps] == [1, 2]  # the line showing step 4 (for 3 held-back lines) is no step
    assert read.summary()["ray_deduplicated"] == {
        "count": 2,
        "stands_for_lines": 7,
        "step_lines": 1,
        "step_lines_stand_for": 3,
        "lines": [
            {"line": 18, "kind": "miles step", "step": 4, "repeats": 3},
            {"line": 17, "kind": "other", "step": None, "repeats": 4},
        ],
    }
    # a Megatron iteration line Ray held back is not a step either (before: it became step 2 again, or a new step)
    held = (
        MEGATRON.splitlines()[3].replace("iteration        2/", "iteration        9/")
        + " [repeated 2x across cluster]\n"
    )
    read = read_log(MEGATRON + held, "train.log")
    assert [s.step for s in read.steps] == [1, 2, 3]
    assert [(d.line, d.kind, d.step, d.repeats) for d in read.deduplicated] == [(6, "megatron step", 9, 2)]
    # the command says so, in its summary and in --json
    assert cli.main(["logs", str(MILES_RAY), "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        f"{MILES_RAY}: 1 truncated line not read (line 20; 1 of them step lines); 2 Ray-deduplicated lines not read "
        "(standing for 7 lines; 1 of them step lines standing for 3 step lines, line 18: steps may be missing, "
        "rerun with RAY_DEDUP_LOGS=0)" in out
    )
    assert cli.main(["logs", str(MILES_RAY), "-o", str(tmp_path), "--force", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["steps"], printed["truncated_lines"]["count"], printed["ray_deduplicated"]["stands_for_lines"]) == (
        2,
        1,
        7,
    )


def test_numpy_and_torch_number_reprs_are_numbers():
    prefix = "(MegatronTrainRayActor pid=4711) [2026-10-13 10:01:00.123 actor_cell0_rank0] log_utils.py:542 - "
    text = (
        prefix + "step 0: {'train/loss': np.float64(0.5), 'train/grad_norm': tensor(1.25, device='cuda:0'), "
        "'train/lr-pg_0': np.float32(1e-05), 'train/step': np.int64(0), 'train/ok': np.True_, "
        "'train/where': device(type='cuda', index=0)}\n"
        + prefix
        + "step 1: {'train/loss': tensor(0.25), 'train/grad_norm': np.float64(nan), 'train/step': np.int64(1)}\n"
        + prefix
        + "perf 0: {'perf/actor_train_time': np.float64(2.5)}\n"
        + prefix
        + "perf 1: {'perf/actor_train_time': np.float64(3.5)}\n"
    )
    steps = parse_log(text, "np.log")
    assert [s.lm_loss for s in steps] == [0.5, 0.25]
    assert steps[0].grad_norm == 1.25 and math.isnan(steps[1].grad_norm)
    assert steps[0].lr == pytest.approx(1e-05) and steps[0].step_time_s == 2.5 and steps[1].step_time_s == 3.5
    # a time report would refuse (-inf s) is refused here, naming the line (before: written, then report refused it)
    with pytest.raises(UserError, match=r"^np.log line 4: step time -inf s, expected a positive finite number"):
        parse_log(text.replace("np.float64(3.5)", "np.float64(-inf)"), "np.log")
    # an unreadable value is an error only where it is read, naming the line and key
    with pytest.raises(UserError, match=r"np.log line 1: train/loss is device\(type='cuda'\), not a number"):
        parse_log(prefix + "step 0: {'train/loss': device(type='cuda')}", "np.log")


def test_converge_and_report_on_a_raw_log_name_trainer_logs(run_dir, tmp_path, capsys):
    ref = tmp_path / "ref.jsonl"
    ref.write_text('{"step": 1, "lm_loss": 2.45}\n{"step": 2, "lm_loss": 2.4}\n')
    code = cli.main(["converge", str(MILES_RAY), str(ref), "--no-plot", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err == (
        f"trainer converge: error: {MILES_RAY}: a training log, not metrics.jsonl (line 12 is a miles step line); "
        f"run `trainer logs {MILES_RAY} -o DIR` first (add --run RUN_DIR for tokens per step) and pass DIR\n"
    )
    megatron = tmp_path / "train.log"
    megatron.write_text(MEGATRON)
    code = cli.main(["converge", str(ref), str(megatron), "--no-plot", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "line 2 is a Megatron iteration line); run `trainer logs" in err
    code = cli.main(["report", str(megatron)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"trainer report: error: {megatron}: a training log (line 2 is a Megatron iteration line), "
        f"and `trainer report` reads a run directory: run `trainer logs {megatron} --run RUN_DIR` "
        "first, then `trainer report RUN_DIR`\n"
    )
    # a run directory whose metrics.jsonl is a raw log: the same hint
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(MEGATRON)
    code = cli.main(["converge", str(tmp_path / "run"), str(ref), "--no-plot", "--out", str(tmp_path)])
    assert code == 2 and "a training log, not metrics.jsonl" in capsys.readouterr().err
    # a miles log that gives no tokens: report says how to get them
    log = tmp_path / "miles.log"
    log.write_text(miles_log(20))
    run = shutil.copytree(run_dir, tmp_path / "copy")
    assert cli.main(["logs", str(log), "-o", str(run)]) == 0
    assert "0 with tokens (pass --run RUN_DIR" in capsys.readouterr().out
    code = cli.main(["report", str(run), "--no-plot", "--no-cost"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and "step 5: tokens is None" in err
        and "`trainer logs LOG --run RUN_DIR`" in err
    )


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
