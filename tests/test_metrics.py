"""Reports: throughput, MFU, model FLOPs, cost, step-time CV, GPU-hours, and refused metrics files."""

import json
import math
import shutil

import pytest

import helpers
from helpers import RECIPE_TPS, compose, recipe_rows, write_rows
from trainer import cli
from trainer.compose.compose import validate
from trainer.compose.params import count_params
from trainer.errors import UserError
from trainer.report.metrics import (
    Step,
    _mean_keys,
    cv_percent,
    mfu,
    model_flops_per_token,
    read_metrics,
    select_window,
    usd_per_million_tokens,
    write_metrics,
)

N_FLASH = 13_268_221_952  # the recipe's active parameters per token


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """A plan run directory of the recipe (layout=tp2pp4ep8) with the recipe's figures as metrics."""
    root = tmp_path_factory.mktemp("runs")
    proc = helpers.run_train([f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr
    run = root / "run"
    write_rows(run / "metrics.jsonl", recipe_rows())
    return run


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")


def trainer(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_recipe_figures_from_its_own_numbers():
    # shared docs METRICS.md: 6 x 13,268,221,952 x 808.22 / 989e12 = 0.0651; 63.296 / (808.22 x 8 x 3600) x 1e6 = 2.719
    assert round(mfu(N_FLASH, RECIPE_TPS, 989e12), 4) == 0.0651
    assert round(usd_per_million_tokens(63.296, RECIPE_TPS, 8), 3) == 2.719
    assert round(usd_per_million_tokens(63.296, RECIPE_TPS, 8), 2) == 2.72


def test_active_parameters_basis_is_the_model_config():
    assert count_params(validate(compose()).model).active_per_token == N_FLASH


def test_cv_is_population():
    assert cv_percent([1.0, 3.0]) == pytest.approx(50.0)  # pstdev 1, mean 2 (the sample stdev would give 70.7%)


def test_report_reproduces_the_recipe_result(recipe_run, capsys):
    record = json.loads((recipe_run / "record.json").read_text())
    # 12.16 GPU-hours = 64 GPUs x 684 s from scheduler admission to finish
    record.update(admitted_utc="2026-10-13T10:00:00Z", finished_utc="2026-10-13T10:11:24Z")
    (recipe_run / "record.json").write_text(json.dumps(record))
    code, out, err = trainer(["report", str(recipe_run), "--json"], capsys)
    assert code == 0, err
    summary = json.loads((recipe_run / "summary.json").read_text())
    assert json.loads(out) == summary
    assert summary["window"] == [5, 19] and summary["window_tokens"] == 15_728_640
    assert round(summary["tokens_per_s_per_gpu"], 2) == 808.22
    assert round(summary["mfu"], 4) == 0.0651
    assert round(summary["usd_per_million_tokens"], 2) == 2.72
    assert round(summary["step_time_cv_percent"], 2) == 3.25
    assert round(summary["gpu_hours"], 2) == 12.16 and "admitted_utc" in summary["gpu_hours_note"]
    assert summary["active_params"]["count"] == N_FLASH
    assert summary["peak_flops"]["value"] == 989e12
    flops = summary["model_flops_per_token"]
    assert summary["model_tflops_per_gpu"] == pytest.approx(flops["total"] * summary["tokens_per_s_per_gpu"] / 1e12)
    assert (recipe_run / "step_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_table(recipe_run, capsys):
    code, out, _ = trainer(["report", str(recipe_run), "--no-plot", "--out", str(recipe_run / "again")], capsys)
    assert code == 0 and "808.22" in out and "0.0651" in out and "population" in out
    assert (recipe_run / "again" / "summary.json").exists()


def test_gpu_hours_without_admission_times_say_so(tmp_path):
    from trainer.report.metrics import ReportInputs, summarize

    rows = [Step(**r) for r in recipe_rows()]
    inputs = ReportInputs(
        gpus=64,
        gpus_per_node=8,
        active_params=N_FLASH,
        active_params_source="test",
        peak_flops=989e12,
        usd_per_node_hour=63.296,
    )
    summary = summarize(rows, inputs)
    assert summary["gpu_hours"] == pytest.approx(64 * sum(r.step_time_s for r in rows) / 3600)
    assert "startup is not included" in summary["gpu_hours_note"]
    assert summary["model_tflops_per_gpu"] is None  # no model given


def test_model_flops_per_token_structure():
    model = validate(compose()).model
    p = count_params(model)
    f = model_flops_per_token(model, 8192)
    assert f.matmul == 2 * (N_FLASH - p.output)
    assert f.logits == 2 * 129_280 * 4096
    assert f.per_token == pytest.approx(3 * (f.matmul + f.attention + f.logits))
    # the 6N basis leaves attention out; the per-layer count is above it by 3 x attention
    assert f.per_token - 6 * N_FLASH == pytest.approx(3 * f.attention)
    assert 0 < f.attention < 0.2 * f.matmul


def test_mean_attended_keys_by_hand():
    # positions 1..8, window 4: 1,2,3,4,4,4,4,4; ratio 4 compressed: 0,0,0,1,1,1,1,2 (top-1: 0,0,0,1,1,1,1,1)
    keys, scored = _mean_keys(8, 4, 4, 1)
    assert keys == (26 + 5) / 8 and scored == 6 / 8
    keys, scored = _mean_keys(8192, 128, 0, 512)  # sliding window only
    assert keys == (128 * 129 / 2 + (8192 - 128) * 128) / 8192 and scored == 0
    keys, _ = _mean_keys(256, 128, 128, 512)  # HCA: window + every compressed entry
    assert keys == (128 * 129 / 2 + 128 * 128 + 128 * 1 + 2) / 256  # p = 128..255 see 1 entry, p = 256 sees 2


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty (no steps)"),
        ('{"step": 1, "lm_loss": 2.0}\n{"step": 2, "lm_lo', "truncated last line"),
        ('{"step": 2, "lm_loss": 2.0}\n{"step": 1, "lm_loss": 2.0}\n', "line 2: step 1 after step 2"),
        ('{"step": 1, "lm_loss": 2.0}\n{"step": 1, "lm_loss": 2.0}\n', "must strictly increase"),
        ('{"step": 0, "lm_loss": 2.0}\n', "1-based"),
        ('{"step": 1}\n', "missing key 'lm_loss'"),
        ('{"step": 1, "lm_loss": "x"}\n', "lm_loss is 'x', expected a number"),
        ('{"step": 1, "lm_loss": 1, "loss": 2}\n', "unknown key 'loss'"),
        (
            '{"step": 1, "lm_loss": "nan"}\n',
            "lm_loss is 'nan', expected a number",
        ),  # only "NaN", "Infinity", "-Infinity"
        (
            '{"step": 1, "lm_loss": 1.0, "skipped_iterations": 1.5}\n',
            "skipped_iterations is 1.5, expected an integer >= 0 or null",
        ),
        ('{"step": 1, "lm_loss": 1.0, "nan_iterations": -1}\n', "nan_iterations is -1"),
    ],
)
def test_bad_metrics_files(tmp_path, text, needle):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        read_metrics(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_raw_log_is_refused_with_the_command_to_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("[2026-10-13 10:00:01] startup\n iteration 1/ 20 | lm loss: 2.0 |\n")
    with pytest.raises(UserError) as err:
        read_metrics(path)
    assert str(err.value) == (
        f"{path}: a training log, not metrics.jsonl (line 2 is a Megatron iteration line); run "
        f"`trainer logs {path} -o DIR` first (add --run RUN_DIR for tokens per step) and pass DIR"
    )
    path.write_text("hello\nworld\n")  # not JSON and no step line: the JSON error, as before
    with pytest.raises(
        UserError, match=r"metrics.jsonl line 1: not valid JSON \(Expecting value at line 1 column 1\)$"
    ):
        read_metrics(path)


def test_window_without_tokens_says_how_to_get_them():
    rows = recipe_rows()
    rows[4]["tokens"] = None
    with pytest.raises(UserError) as err:
        select_window([Step(**r) for r in rows], (5, 19))
    assert str(err.value).startswith(
        "metrics.jsonl step 5: tokens is None, expected a positive number; a log without a "
        "global batch size (miles prints none) gives no tokens: make metrics.jsonl with "
        "`trainer logs LOG --run RUN_DIR`"
    )


def test_nan_loss_is_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "lm_loss": NaN, "grad_norm": Infinity}\n')  # bare tokens of older files
    (row,) = read_metrics(path)
    assert math.isnan(row.lm_loss) and math.isinf(row.grad_norm)
    path.write_text(
        '{"step": 1, "lm_loss": "NaN", "grad_norm": "-Infinity", "skipped_iterations": 1, "nan_iterations": 0}\n'
    )
    (row,) = read_metrics(path)
    assert (
        math.isnan(row.lm_loss)
        and row.grad_norm == -math.inf
        and (row.skipped_iterations, row.nan_iterations) == (1, 0)
    )
    assert row.no_loss_reason == "1 skipped iteration"


def test_write_metrics_is_strict_json(tmp_path):
    steps = [
        Step(step=1, lm_loss=math.nan, grad_norm=math.inf, skipped_iterations=1, nan_iterations=1),
        Step(step=2, lm_loss=2.0),
    ]
    write_metrics(tmp_path / "metrics.jsonl", steps)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0], parse_constant=lambda c: pytest.fail(c)) == {
        "step": 1,
        "lm_loss": "NaN",
        "grad_norm": "Infinity",
        "lr": None,
        "tokens": None,
        "supervised_tokens": None,
        "step_time_s": None,
        "max_memory_bytes": None,
        "skipped_iterations": 1,
        "nan_iterations": 1,
    }
    assert "iterations" not in lines[1]  # counts only where known
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back[0].lm_loss) and back[0].skipped_iterations == 1 and back[1] == steps[1]


def test_report_reads_a_run_with_a_nan_step(recipe_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(recipe_run, run)
    rows = recipe_rows()
    rows[-1].update(
        lm_loss="NaN", grad_norm="NaN", skipped_iterations=0, nan_iterations=1
    )  # step 20: outside the window
    write_rows(run / "metrics.jsonl", rows)
    code, out, err = trainer(["report", str(run), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out, parse_constant=lambda c: pytest.fail(c))
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(RECIPE_TPS, rel=1e-9)


@pytest.mark.parametrize(
    "window,needle",
    [
        ((6, 5), "window [6, 5] is empty"),
        ((5, 25), "window [5, 25] does not match"),
        ((0, 3), "does not match"),
    ],
)
def test_bad_windows(window, needle):
    steps = [Step(**r) for r in recipe_rows()]
    with pytest.raises(UserError, match=r".*") as err:
        select_window(steps, window)
    assert needle in str(err.value)


def test_window_with_a_missing_step_or_time():
    rows = recipe_rows()
    steps = [Step(**r) for r in rows if r["step"] != 9]
    with pytest.raises(UserError, match="lacks step 9"):
        select_window(steps, (5, 19))
    rows[6]["step_time_s"] = None
    with pytest.raises(UserError, match="step 7: step_time_s is None"):
        select_window([Step(**r) for r in rows], (5, 19))


def test_cli_refusals_are_one_line(recipe_run, tmp_path, capsys):
    code, _, err = trainer(["report", str(recipe_run), "--window", "9:3"], capsys)
    assert code == 2 and err.count("\n") == 1 and "trainer report: error: window [9, 3] is empty" in err
    code, _, err = trainer(["report", str(recipe_run), "--window", "five"], capsys)
    assert code == 2 and "expected FIRST:LAST" in err
    code, _, err = trainer(["report", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "no such run directory" in err


def test_cluster_without_price(tmp_path, capsys):
    proc = helpers.run_train(
        [f"hydra.run.dir={tmp_path / 'run'}", "layout=gpu1-tp1pp1ep1", "model=deepseek-v4-tiny"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    rows = recipe_rows()
    write_rows(tmp_path / "run" / "metrics.jsonl", rows)
    code, _, err = trainer(["report", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1 and "cluster.usd_per_node_hour is null" in err
    assert not (tmp_path / "run" / "summary.json").exists()
    code, _, err = trainer(["report", str(tmp_path / "run"), "--no-cost", "--json", "--no-plot"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["usd_per_million_tokens"] is None and summary["gpus"] == 1
    code, _, _ = trainer(["report", str(tmp_path / "run"), "--usd-per-node-hour", "10", "--json", "--no-plot"], capsys)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["usd_per_million_tokens"] == pytest.approx(10 / (summary["tokens_per_s_per_gpu"] * 1 * 3600) * 1e6)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
