"""Hostile run directories handed to the readers (report, recipe, status, converge, verify, logs): one line each.

A finished plan run with the recipe's metrics is corrupted one way per case; every reader must answer exit 2 with
one line naming the file (no traceback, no hang, bounded memory) and leave the directory as it was.
"""

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest

import helpers
from helpers import planned_run, tree_hash
from trainer import cli

READERS = {
    "report": lambda d, out: ["report", d, "--no-plot", "--out", out],
    "recipe": lambda d, out: ["recipe", d, "-o", out / "recipe.yaml"],
    "converge": lambda d, out: ["converge", d, d, "--no-plot", "--out", out],
    "status": lambda d, out: ["status", d],
    "verify": lambda d, out: ["verify", d],
}

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
)


def _record(edit):
    def mutate(run: Path) -> None:
        record = json.loads((run / "record.json").read_text())
        edit(record)
        (run / "record.json").write_text(json.dumps(record))

    return mutate


def _metrics_line(line: str):
    def mutate(run: Path) -> None:
        (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + line + "\n")

    return mutate


# case: (mutation, readers that must refuse, text of the one line)
CASES = {
    "latin-1 config.yaml": (
        lambda r: (r / "config.yaml").write_bytes("a: caf\xe9\n".encode("latin-1")),
        ("report", "recipe", "converge"),
        "config.yaml: not UTF-8 text (byte 0xe9 at offset 6",
    ),
    "binary record.json": (
        lambda r: (r / "record.json").write_bytes(b"\x7fELF\x02\x01\x01\0\xd0\xff" * 30),
        tuple(READERS),
        "record.json: not UTF-8 text",
    ),
    "YAML alias bomb": (
        lambda r: (r / "config.yaml").write_text(BOMB),
        ("report", "recipe", "converge"),
        "config.yaml: more than 1,000,000 values",
    ),
    "deep JSON in a record": (
        lambda r: (r / "record.json").write_text("[" * 100000 + "]" * 100000),
        tuple(READERS),
        "record.json: not JSON this bundle reads",
    ),
    "record status a list": (
        _record(lambda x: x.update(status=[1])),
        tuple(READERS),
        "record.json: status is list [1], expected string",
    ),
    "record probe ranks not objects": (
        _record(lambda x: x.update(probe={"ranks": [5]})),
        tuple(READERS),
        "record.json: probe.ranks[0] is int 5, expected object",
    ),
    "record probe rank null": (
        _record(lambda x: x.update(probe={"ranks": [None]})),
        tuple(READERS),
        "record.json: probe.ranks[0] is null, expected object",
    ),
    "record lock path a number": (
        _record(lambda x: x.update(lock={"path": 7})),
        tuple(READERS),
        "record.json: lock.path is int 7, expected string",
    ),
    "record pid a string": (
        _record(lambda x: x.update(pid="abc")),
        tuple(READERS),
        'record.json: pid is str "abc", expected integer',
    ),
    "deep JSON in metrics": (
        lambda r: (r / "metrics.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n"),
        ("report", "recipe", "converge"),
        "metrics.jsonl line 1: not JSON this bundle reads",
    ),
    "number of 5,000 digits": (
        _metrics_line('{"step": 99, "lm_loss": ' + "9" * 5000 + "}"),
        ("report", "recipe", "converge"),
        "metrics.jsonl line 21: not JSON this bundle reads",
    ),
    "number of 4,000 digits": (
        _metrics_line('{"step": 99, "lm_loss": ' + "9" * 4000 + "}"),
        ("report", "recipe", "converge"),
        "lm_loss is an integer of 4,000 digits",
    ),
    "step beyond int64": (
        _metrics_line('{"step": ' + "9" * 30 + ', "lm_loss": 1.0}'),
        ("report", "recipe", "converge"),
        "step is '999999999999999999999999999999', expected an integer",
    ),
    "NaN peak FLOP/s in config.yaml": (
        lambda r: (r / "config.yaml").write_text(
            (r / "config.yaml")
            .read_text()
            .replace("gpu_peak_bf16_flops: 989000000000000.0", "gpu_peak_bf16_flops: .nan")
        ),
        ("report", "recipe", "converge"),
        "config.yaml: cluster.gpu_peak_bf16_flops must be a finite number (got nan)",
    ),
    "negative price in config.yaml": (
        lambda r: (r / "config.yaml").write_text(
            (r / "config.yaml").read_text().replace("usd_per_node_hour: ", "usd_per_node_hour: -")
        ),
        ("report", "recipe", "converge"),
        "config.yaml: cluster.usd_per_node_hour must be >= 0",
    ),
    "non-UTF-8 metrics": (
        lambda r: (r / "metrics.jsonl").write_bytes(b'{"step": 1, "lm_loss": 1.0, "x\xff": 1}\n'),
        ("report", "recipe", "converge"),
        "metrics.jsonl line 1: not UTF-8 text",
    ),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    return planned_run(tmp_path_factory.mktemp("readers"))


def call(capsys, args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("case,reader", [(c, r) for c in sorted(CASES) for r in CASES[c][1]])
def test_a_corrupt_run_directory_is_one_line_for_every_reader(finished, tmp_path, capsys, case, reader):
    """Promise: a run directory with a corrupt file gives every reader one line naming the file and what is wrong,
    exit 2, no traceback, and nothing in the directory changes (no half-written summary or recipe)."""
    mutate, _, expected = CASES[case]
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    mutate(run)
    before = tree_hash(run)
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = call(capsys, READERS[reader](run, out))
    assert code == 2, (code, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainer {reader}: error: "), stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in stdout + stderr
    assert tree_hash(run) == before
    assert list(out.iterdir()) == []


def test_a_huge_step_costs_no_memory(finished, tmp_path, capsys):
    """Promise: a metrics line whose step is 10^15 is refused (its window lacks steps) without allocating the
    range: memory stays that of the file's 21 steps."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _metrics_line('{"step": 1000000000000000, "lm_loss": 1.0, "tokens": 1048576, "step_time_s": 10.0}')(run)
    assert call(capsys, ["report", finished, "--no-plot", "--out", tmp_path])[0] == 0  # imports done
    peaks = []
    for directory, want in ((finished, 0), (run, 2)):
        tracemalloc.start()
        code, _, stderr = call(capsys, ["report", directory, "--no-plot", "--out", tmp_path])
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert code == want, stderr
    assert "lacks step 21 (999,999,999,999,979 missing)" in stderr, stderr
    assert peaks[1] < peaks[0] + (4 << 20), peaks


def test_converge_on_a_long_run_keeps_its_result_bounded(tmp_path, capsys):
    """Promise: converge on 30,000 steps keeps the per-step points it reports bounded (MAX_POINTS, failures
    first), so its result and memory do not grow with the run beyond the steps read."""
    from trainer.report.convergence import MAX_POINTS

    rows = [{"step": i, "lm_loss": 2.0 + (i % 7) * 1e-4} for i in range(1, 30_001)]
    helpers.write_rows(tmp_path / "a.jsonl", rows)
    helpers.write_rows(tmp_path / "b.jsonl", rows)
    code, _, stderr = call(
        capsys, ["converge", tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--no-plot", "--out", tmp_path]
    )
    assert code == 0, stderr
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert result["passed"] and result["metrics"]["steps"] == 30_000
    assert len(result["points"]) <= MAX_POINTS and result["points_omitted"] == 30_000 - len(result["points"])
    assert (tmp_path / "convergence.json").stat().st_size < 8 << 20


def test_logs_does_not_replace_a_runs_metrics(finished, tmp_path, capsys):
    """Promise: `trainer logs -o RUN_DIR` refuses to replace the run's own metrics.jsonl (one line) unless --force."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    log = tmp_path / "train.log"
    log.write_text(
        " iteration        1/      20 | consumed samples:          128 | elapsed time per iteration (ms): "
        "1000.0 | learning rate: 1.000000E-05 | global batch size:   128 | lm loss: 2.000000E+00 |\n"
    )
    before = tree_hash(run)
    code, _, stderr = call(capsys, ["logs", log, "-o", run])
    assert code == 2 and stderr.strip().splitlines() == [
        f"trainer logs: error: {run}/metrics.jsonl: exists (a run's own metrics); pass --force to replace it, "
        "or write to another file"
    ]
    assert tree_hash(run) == before
    assert call(capsys, ["logs", log, "-o", run, "--force"])[0] == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
