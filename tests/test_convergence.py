"""The convergence check (Megatron-Bridge validate_convergence + alignment by step, missing and NaN fail) and
--predict."""

import json
import math

import pytest

import helpers
from trainer import cli
from trainer.errors import UserError
from trainer.report.convergence import Thresholds, check, load_thresholds
from trainer.report.metrics import Step


def curve(steps=range(1, 21), scale=1.0, decay=30.0, start=2.5):
    return [
        Step(step=s, lm_loss=start * math.exp(-s / decay) * scale + 0.01 * math.sin(s), grad_norm=1.0) for s in steps
    ]


def check_named(result, name):
    return next(c for c in result["checks"] if c["name"] == name)


def test_identical_runs_pass_every_check():
    r = check(curve(), curve())
    assert r["passed"] and r["failed_checks"] == []
    assert [c["name"] for c in r["checks"]] == [
        "aligned",
        "finite_loss",
        "finite_grad_norm",
        "correlation",
        "pointwise",
        "final_loss",
        "outliers",
    ]
    assert r["metrics"]["correlation"] == pytest.approx(1.0)
    assert r["metrics"]["points_checked"] == 16 and r["metrics"]["skipped"] == 4  # int(20 x 0.2)
    assert r["metrics"]["pointwise_failures"] == 0 and r["metrics"]["final_loss_difference"] == 0


def test_aligned_by_step_number_never_by_position():
    cand = curve(range(2, 22))  # the same function of the step number, shifted by one position
    r = check(cand, curve())
    assert not r["passed"] and "aligned" in r["failed_checks"]
    assert check_named(r, "aligned")["value"] == 2  # step 1 only in the reference, 21 only in the candidate
    # compared where both have the step, at the same step: identical values, no pointwise failure
    assert r["metrics"]["pointwise_failures"] == 0
    assert all(p["relative_difference"] in (None, 0.0) for p in r["points"])


def test_half_the_steps_missing_fails():
    # the known defect of the reference implementation: missing steps become NaN and pass
    r = check([s for s in curve() if s.step % 2], curve())
    assert not r["passed"] and check_named(r, "aligned")["value"] == 10


@pytest.mark.parametrize("where", ["candidate", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_fails(where, bad):
    broken = [Step(step=s.step, lm_loss=bad if s.step == 12 else s.lm_loss, grad_norm=1.0) for s in curve()]
    cand, ref = (broken, curve()) if where == "candidate" else (curve(), broken)
    r = check(cand, ref)
    assert not r["passed"] and r["failed_checks"] == ["finite_loss"]
    assert f"{where} step 12" in check_named(r, "finite_loss")["text"]


def test_non_finite_grad_norm_fails_and_null_is_allowed():
    cand = [Step(step=s.step, lm_loss=s.lm_loss, grad_norm=float("nan") if s.step == 3 else 1.0) for s in curve()]
    r = check(cand, curve())
    assert not r["passed"] and r["failed_checks"] == ["finite_grad_norm"]
    no_norm = [Step(step=s.step, lm_loss=s.lm_loss) for s in curve()]
    assert check(no_norm, curve())["passed"]
    assert check(cand, curve(), Thresholds(require_finite_grad_norm=False))["passed"]


def flat(values, start=1):
    return [Step(step=start + i, lm_loss=v) for i, v in enumerate(values)]


def test_pointwise_tolerance_by_golden_value():
    th = Thresholds(
        skip_first_percent_loss=0.0, correlation_threshold=-1.0, max_outlier_ratio=1.0, final_loss_tolerance=1.0
    )
    golden = [3.0, 3.0, 1.0, 1.0, 0.4, 0.4]
    cand = [3.29, 3.31, 1.049, 1.051, 0.4079, 0.4081]  # 9.7% / 10.3%, 4.9% / 5.1%, 1.98% / 2.03%
    r = check(flat(cand), flat(golden), th)
    assert [p["tolerance"] for p in r["points"]] == [0.10, 0.10, 0.05, 0.05, 0.02, 0.02]
    assert [p["failed"] for p in r["points"]] == [False, True, False, True, False, True]
    assert r["metrics"]["pointwise_failures"] == 3


def test_pointwise_failures_up_to_ten_percent_are_allowed():
    golden = [2.0 - 0.05 * i for i in range(20)]
    one = list(golden)
    one[10] *= 1.2  # 1 of 16 checked points off: 6.25% <= 10%
    r = check(flat(one), flat(golden), Thresholds(outlier_threshold=100.0))
    assert r["metrics"]["pointwise_failures"] == 1 and check_named(r, "pointwise")["passed"]
    two = list(one)
    two[12] *= 1.2  # 2 of 16: 12.5% > 10%
    r = check(flat(two), flat(golden), Thresholds(outlier_threshold=100.0))
    assert r["metrics"]["pointwise_failures"] == 2 and not check_named(r, "pointwise")["passed"]
    assert "12.5% > 10%" in check_named(r, "pointwise")["text"]


def test_skipped_points_are_not_checked():
    golden = [2.0 - 0.05 * i for i in range(20)]
    early = list(golden)
    early[0] = early[1] = early[2] = 9.0  # inside the first 20%
    r = check(flat(early), flat(golden))
    assert r["metrics"]["pointwise_failures"] == 0 and check_named(r, "pointwise")["passed"]
    assert [p["skipped"] for p in r["points"]][:5] == [True, True, True, True, False]


def test_final_loss_threshold_and_override():
    golden = [2.0 - 0.05 * i for i in range(20)]
    cand = list(golden)
    cand[-1] = golden[-1] * 1.04  # 4%: within the pipeline's 0.05, outside the function default 0.03
    assert check_named(check(flat(cand), flat(golden)), "final_loss")["passed"]
    strict = load_thresholds("megatron-bridge-pipeline", ["final_loss_tolerance=0.03"])
    r = check(flat(cand), flat(golden), strict)
    assert not r["passed"] and "final_loss" in r["failed_checks"]
    assert check_named(r, "final_loss")["value"] == pytest.approx(0.04)


def test_correlation_threshold():
    golden = [2.0 - 0.01 * i for i in range(20)]
    noisy = [g + (0.03 if i % 2 else -0.03) for i, g in enumerate(golden)]
    r = check(flat(noisy), flat(golden))
    c = check_named(r, "correlation")
    assert c["value"] < 0.95 and not c["passed"] and r["metrics"]["pointwise_failures"] == 0


def test_three_sigma_outliers():
    golden = [2.0 - 0.05 * i for i in range(40)]
    cand = [g + 0.001 * (i % 3) for i, g in enumerate(golden)]
    cand[20] += 0.08  # one spike among 32 checked points
    cand[30] += 0.08
    th = Thresholds(max_outlier_ratio=0.05)
    r = check(flat(cand), flat(golden), th)
    assert r["metrics"]["outliers"] == 2 and not check_named(r, "outliers")["passed"]  # 2/32 = 6.25% > 5%


def test_thresholds_files_and_overrides():
    assert load_thresholds() == Thresholds()
    default = load_thresholds("megatron-bridge-default")
    assert default.skip_first_percent_loss == 0.0 and default.final_loss_tolerance == 0.03
    with pytest.raises(UserError, match="unknown_key"):
        load_thresholds("megatron-bridge-pipeline", ["unknown_key=1"])
    with pytest.raises(UserError, match="correlation_threshold"):
        load_thresholds("megatron-bridge-pipeline", ["correlation_threshold=high"])
    with pytest.raises(UserError, match="options: megatron-bridge-default, megatron-bridge-pipeline"):
        load_thresholds("nope")
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_thresholds("megatron-bridge-pipeline", ["final_loss_tolerance"])


def write(path, steps):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s.as_dict()) + "\n" for s in steps))
    return path


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_codes_and_json(tmp_path, capsys):
    ref = write(tmp_path / "ref" / "metrics.jsonl", curve())
    good = write(tmp_path / "good" / "metrics.jsonl", curve(scale=1.001))
    bad = write(tmp_path / "bad" / "metrics.jsonl", curve(decay=12.0))
    code, out, err = run_cli(["converge", str(good.parent), str(ref), "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["passed"] and result["metrics"]["pointwise_failures"] == 0
    assert json.loads((good.parent / "convergence.json").read_text())["passed"]
    assert (good.parent / "convergence_loss.png").read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run_cli(["converge", str(bad), str(ref), "--no-plot"], capsys)
    assert code == 1 and "FAIL" in out and "pointwise failures: 16 of 16" in out
    code, out, _ = run_cli(
        [
            "converge",
            str(bad),
            str(ref),
            "--json",
            "--no-plot",
            "--set",
            "high_loss_tolerance=10",
            "--set",
            "medium_loss_tolerance=10",
            "--set",
            "final_loss_tolerance=10",
        ],
        capsys,
    )
    assert code == 0 and json.loads(out)["thresholds"]["final_loss_tolerance"] == 10


def test_cli_nan_is_standard_json(tmp_path, capsys):
    ref = write(tmp_path / "ref" / "metrics.jsonl", curve())
    nan = write(tmp_path / "nan" / "metrics.jsonl", [Step(step=s.step, lm_loss=float("nan")) for s in curve()])
    code, out, _ = run_cli(["converge", str(nan), str(ref), "--json"], capsys)
    result = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert code == 1 and result["metrics"]["correlation"] == "NaN"


def test_cli_refusals(tmp_path, capsys):
    code, _, err = run_cli(["converge", str(tmp_path)], capsys)
    assert code == 2 and "expected two runs" in err
    empty = tmp_path / "e" / "metrics.jsonl"
    empty.parent.mkdir()
    empty.write_text("")
    ref = write(tmp_path / "ref" / "metrics.jsonl", curve())
    code, _, err = run_cli(["converge", str(empty), str(ref)], capsys)
    assert code == 2 and err.count("\n") == 1 and "empty (no steps)" in err


def test_predict_from_overrides(capsys):
    code, out, _ = run_cli(
        ["converge", "--predict", "--candidate", "layout=tp2pp4ep8", "--reference", "layout=tp8pp8ep8"], capsys
    )
    assert code == 0 and "numerics-equivalent" in out and "--tensor-model-parallel-size" in out and "performance" in out
    code, out, _ = run_cli(
        [
            "converge",
            "--predict",
            "--json",
            "--candidate",
            "layout=tp2pp4ep8 optim.lr=2e-5",
            "--reference",
            "layout=tp8pp8ep8",
        ],
        capsys,
    )
    result = json.loads(out)
    assert code == 1 and not result["equivalent"]
    assert [d["flag"] for d in result["differences"] if d["class"] == "numerics"] == ["--lr"]
    code, _, err = run_cli(["converge", "--predict", "--candidate", "layout=nope", "--reference", ""], capsys)
    assert code == 2 and "nope" in err


def smoke_run(tmp_path, name, *overrides):
    proc = helpers.run_train([f"hydra.run.dir={tmp_path / name}", "model=deepseek-v4-tiny", *overrides], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / name


def test_done_when_layout_change_passes_and_lr_change_fails(tmp_path, capsys):
    """Planned smoke runs; their metrics are synthetic until training runs execute (a separate feature)."""
    smoke = smoke_run(tmp_path, "smoke", "layout=gpu1-tp1pp1ep1")
    layout = smoke_run(tmp_path, "layout", "layout=gpu2-tp1pp1ep2")
    lr = smoke_run(tmp_path, "lr", "layout=gpu1-tp1pp1ep1", "optim.lr=1e-3")
    write(smoke / "metrics.jsonl", curve())
    write(layout / "metrics.jsonl", curve(scale=1.0005))  # bf16 reduction-order noise
    write(lr / "metrics.jsonl", curve(decay=8.0))
    code, out, _ = run_cli(["converge", "--predict", "--candidate", str(layout), "--reference", str(smoke)], capsys)
    assert code == 0 and "expert-model-parallel-size" in out
    code, out, _ = run_cli(["converge", "--predict", "--candidate", str(lr), "--reference", str(smoke)], capsys)
    assert code == 1 and "--lr" in out
    code, out, _ = run_cli(["converge", str(layout), str(smoke), "--no-plot"], capsys)
    assert code == 0 and "PASS" in out and "numerics-equivalent" in out
    code, out, _ = run_cli(["converge", str(lr), str(smoke), "--no-plot"], capsys)
    assert code == 1 and "FAIL" in out and "numerics differ: --lr" in out


def test_piped_tables_keep_whole_values(tmp_path):
    """Promise: piped, `trainer converge --predict` prints whole argument names and keys (no cell cut to "…" at
    rich's default 80 columns), one row per line."""
    proc = helpers.run_trainer(
        "converge",
        "--predict",
        "--candidate",
        "layout=tp8pp8ep8",
        "--reference",
        "layout=tp2pp4ep8",
        cwd=tmp_path,
        env={"COLUMNS": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if "--decoder-first-pipeline-num-layers" in line)
    assert "layout.decoder_first_pipeline_num_layers" in row and "│ 4 " in row and "│ 11 " in row


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
