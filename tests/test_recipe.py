"""Recipe YAML: the schema, the seed validating against it, and a run emitted as a recipe."""

import copy
import json
import shutil

import pytest
import yaml

import helpers
from helpers import GOLDEN, recipe_rows, write_rows
from trainer import cli
from trainer.report.recipe import load_schema, validation_errors

SEED = GOLDEN / "attune-tp2-pp4-ep8.yaml"


def seed():
    return yaml.safe_load(SEED.read_text())


def test_schema_is_valid_and_documents_every_field():
    schema = load_schema()

    def walk(node, path):
        for name, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{path}.{name} has no description"
            walk(sub, f"{path}.{name}")

    walk(schema, "")


def test_seed_recipe_validates():
    assert validation_errors(seed()) == []


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda r: r.pop("layout"), "(top): 'layout' is a required property"),
        (lambda r: r.update(status="great"), "status: 'great' is not one of"),
        (lambda r: r["result"].update(window=[5]), "result.window"),
        (lambda r: r["layout"].update(tp=0), "layout.tp: 0 is less than the minimum of 1"),
        (
            lambda r: r["stack"].update(torch="2.11"),
            "stack: Additional properties are not allowed ('torch' was unexpected)",
        ),
        (lambda r: r["workload"]["dataset"].update(rows_sha256="abc"), "workload.dataset.rows_sha256"),
    ],
)
def test_schema_rejects(edit, needle):
    recipe = copy.deepcopy(seed())
    edit(recipe)
    errors = validation_errors(recipe)
    assert any(needle in e for e in errors), errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, layout in (("cand", "tp2pp4ep8"), ("ref", "tp8pp8ep8")):
        proc = helpers.run_train([f"hydra.run.dir={root / name}", f"layout={layout}"], cwd=root)
        assert proc.returncode == 0, proc.stderr
        rows = recipe_rows()
        if name == "ref":
            for r in rows:
                r["lm_loss"] *= 1.002
        write_rows(root / name / "metrics.jsonl", rows)
    record = json.loads((root / "cand" / "record.json").read_text())
    record.update(
        admitted_utc="2026-10-13T10:00:00Z",
        finished_utc="2026-10-13T10:11:24Z",
        observed={"nccl": "2.28.9 (printed by the run)"},
        image_digest="sha256:" + "ab" * 32,
    )
    (root / "cand" / "record.json").write_text(json.dumps(record))
    return root


def test_emitted_recipe_reproduces_the_seed_result(runs, capsys):
    out = runs / "recipe.yaml"
    code = cli.main(
        ["recipe", str(runs / "cand"), "--reference", str(runs / "ref"), "--author", "ATTUNE", "-o", str(out)]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert out.read_text().startswith(
        "# recipe.yaml\n# A recipe; the fields are documented in schema/recipe.schema.yaml.\n"
    )
    recipe = yaml.safe_load(out.read_text())
    assert validation_errors(recipe) == []
    want = seed()
    for key in (
        "tokens_per_s_per_gpu",
        "usd_per_million_tokens",
        "step_time_cv_percent",
        "mfu",
        "window",
        "window_tokens",
        "gpu_hours",
        "steps_per_run",
    ):
        assert recipe["result"][key] == want["result"][key], key
    assert recipe["result"]["active_params"]["count"] == want["result"]["active_params"]["count"]
    assert recipe["result"]["measured"] == "2026-10-13"
    for key in (
        "tp",
        "pp",
        "cp",
        "ep",
        "etp",
        "dp",
        "sequence_parallel",
        "layer_split",
        "recompute",
        "dispatcher",
        "summary",
    ):
        assert recipe["layout"][key] == want["layout"][key], key
    assert recipe["gpu"] == want["gpu"] and recipe["env"] == want["env"] and recipe["model"] == want["model"]
    assert (
        recipe["workload"]["dataset"]["build"]["parquet_sha256"]
        == want["workload"]["dataset"]["build"]["parquet_sha256"]
    )
    assert (
        recipe["stack"]["nccl"] == "2.28.9 (printed by the run)"
        and recipe["stack"]["image_digest"] == "sha256:" + "ab" * 32
    )
    assert recipe["stack"]["lock_sha256"]["lockfiles/stack.json"]
    assert recipe["status"] == "verified" and recipe["correctness"]["result"] == "pass"
    conv = recipe["correctness"]["convergence"]
    assert (
        conv["steps"] == 20
        and conv["pointwise_failures"] == 0
        and conv["final_loss_difference"] == pytest.approx(0.002, abs=1e-4)
    )
    assert recipe["correctness"]["configuration"] == "pass"
    assert recipe["run"] == (runs / "cand" / "command.sh").read_text()


def test_recipe_without_reference_is_measured(runs, capsys):
    code = cli.main(["recipe", str(runs / "ref"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    recipe = json.loads(out)
    assert recipe["status"] == "measured" and recipe["correctness"]["result"] == "not-checked"
    assert validation_errors(yaml.safe_load((runs / "ref" / "recipe.yaml").read_text())) == []


def test_recipe_of_a_run_with_a_nan_step_fails_its_check(runs, tmp_path, capsys):
    cand = tmp_path / "cand"
    shutil.copytree(runs / "cand", cand)
    rows = recipe_rows()
    rows[9].update(lm_loss="NaN", skipped_iterations=1, nan_iterations=1)  # as `trainer logs` writes a lossless step
    write_rows(cand / "metrics.jsonl", rows)
    code = cli.main(["recipe", str(cand), "--reference", str(runs / "ref"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    recipe = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert recipe["status"] == "failed" and recipe["correctness"]["result"] == "fail"
    assert "finite_loss" in recipe["correctness"]["summary"]
    assert validation_errors(yaml.safe_load((cand / "recipe.yaml").read_text())) == []


def test_validate_command(tmp_path, capsys):
    assert cli.main(["recipe", "--validate", str(SEED)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = copy.deepcopy(seed())
    bad["status"] = "great"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert cli.main(["recipe", "--validate", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["valid"] and "status: 'great' is not one of" in report["errors"][str(path)][0]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
