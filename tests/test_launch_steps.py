"""What both workers share (trainer.launch.steps): which rows each DP rank trains on in each step, the metrics.jsonl
row and console line a step ends with; and the sbatch template's placeholders against the values rendered into it."""

import json
import math
import string
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import helpers
from trainer.compose.compose import compose_run, validate
from trainer.data import Rows
from trainer.launch.host import slurm
from trainer.launch.steps import MetricsWriter, Schedule, microbatch_positions, per_token_loss, step_line
from trainer.report.metrics import Step

ROWS, ROW_TOKENS = 10, 4


@pytest.fixture
def rows(tmp_path):
    """10 rows of 4 tokens; row r holds tokens 100r .. 100r+3, its loss mask 1 from position 2 on."""
    tokens = [[100 * r + i for i in range(ROW_TOKENS)] for r in range(ROWS)]
    masks = [[0, 0, 1, 1] for _ in range(ROWS)]
    table = pa.table(
        {"tokens": pa.array(tokens, pa.list_(pa.int32())), "loss_mask": pa.array(masks, pa.list_(pa.uint8()))}
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    (tmp_path / "manifest.json").write_text(json.dumps({"row_tokens": ROW_TOKENS, "rows": ROWS, "seed": 7}))
    return Rows(tmp_path, verify=False)


def test_positions_number_the_microbatches_on_across_steps_and_epochs():
    # 2 microbatches per step, 5 per epoch: step 2 takes the last of epoch 0 and the first of epoch 1
    assert [microbatch_positions(s, 2, 5) for s in range(4)] == [
        [(0, 0), (0, 1)],
        [(0, 2), (0, 3)],
        [(0, 4), (1, 0)],
        [(1, 1), (1, 2)],
    ]
    assert microbatch_positions(0, 0, 5) == []


def test_schedule_gives_each_rank_its_rows_of_every_step(rows):
    # global batch 4 rows, micro-batch 1, DP 2: 2 microbatches per rank per step, 10 // 2 = 5 per epoch
    ranks = [Schedule.of(rows, 4, 1, rank, 2) for rank in range(2)]
    assert [(s.per_step, s.per_epoch) for s in ranks] == [(2, 5), (2, 5)]

    def rows_of(schedule, step):
        return [mb.row_index.tolist() for mb in schedule.microbatches(step)]

    assert rows_of(ranks[0], 0) == [[0], [2]] and rows_of(ranks[1], 0) == [[1], [3]]
    assert rows_of(ranks[0], 1) == [[4], [6]] and rows_of(ranks[1], 1) == [[5], [7]]
    # epoch 1 reads the rows by sha256("7:epoch1:ROW") (the manifest's seed 7): 8, 1, 4, 0, 9, 3, 7, 5, 6, 2
    assert rows.order(1).tolist() == [8, 1, 4, 0, 9, 3, 7, 5, 6, 2]
    assert rows_of(ranks[0], 2) == [[8], [8]] and rows_of(ranks[1], 2) == [[9], [1]]  # epoch 0's last, epoch 1's first
    assert rows_of(ranks[0], 3) == [[4], [9]] and rows_of(ranks[1], 3) == [[0], [3]]
    (first, _) = ranks[1].microbatches(0)
    assert first.tokens.tolist() == [[100, 101, 102, 103]]
    assert first.labels.tolist() == [[101, 102, 103, -100]] and first.loss_mask.tolist() == [[0, 1, 1, 0]]
    # micro-batch 2 on one rank: the global batch of 4 is 2 microbatches of 2 rows
    whole = Schedule.of(rows, 4, 2, 0, 1)
    assert (whole.per_step, whole.per_epoch) == (2, 5)
    assert [mb.row_index.tolist() for mb in whole.microbatches(0)] == [[0, 1], [2, 3]]
    assert all(mb.tokens.shape == (2, ROW_TOKENS) and mb.tokens.dtype == np.int64 for mb in whole.microbatches(4))


def test_the_metrics_row_is_written_and_flushed_with_the_report_keys(tmp_path):
    path = tmp_path / "metrics.jsonl"
    row = Step(1, per_token_loss(1306.5, 871.0), 0.4672776460647583, 0.0, 1024.0, 871.0, 6.96, 1126875136.0)
    with MetricsWriter(path) as metrics:
        assert metrics.writes
        metrics.write(row)
        assert path.read_text() == (  # flushed at once: a reader follows the run
            '{"step": 1, "lm_loss": 1.5, "grad_norm": 0.4672776460647583, "lr": 0.0, "tokens": '
            '1024.0, "supervised_tokens": 871.0, "step_time_s": 6.96, "max_memory_bytes": 1126875136.0}\n'
        )
        metrics.write(Step(2, math.nan, None, 1e-3, 1024.0, 0.0, 7.5, None))
    assert path.read_text().splitlines()[1] == (
        '{"step": 2, "lm_loss": "NaN", "grad_norm": null, "lr": 0.001, "tokens": 1024.0, "supervised_tokens": 0.0, '
        '"step_time_s": 7.5, "max_memory_bytes": null}'
    )
    with MetricsWriter(path) as again:  # appends
        again.write(row)
    assert len(path.read_text().splitlines()) == 3
    quiet = MetricsWriter(None)  # a rank that writes no metrics
    quiet.write(row)
    quiet.close()
    assert not quiet.writes and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_per_token_loss_divides_by_at_least_one_token():
    assert per_token_loss(10.0, 4.0) == 2.5
    assert per_token_loss(3.0, 0.0) == 3.0


def test_step_line_as_each_worker_prints_it():
    row = Step(2, 11.779190017097264, 0.5317515134811401, 0.0025764262111227904, 1024.0, 658.0, 6.509302805, 1.3e9)
    assert step_line(row, 6, ".3f", ".2f") == "step 2/6 loss 11.7792 grad_norm 0.532 lr 0.00258 6.51 s"
    assert step_line(row, 6, "", ".3f") == "step 2/6 loss 11.7792 grad_norm 0.5317515134811401 lr 0.00258 6.509 s"
    no_norm = Step(1, 11.0, None, 0.0, None, None, 1.0, None)
    assert step_line(no_norm, 1, "", ".3f") == "step 1/1 loss 11.0000 grad_norm None lr 0 1.000 s"


def test_the_sbatch_template_has_a_value_for_every_placeholder():
    cfg = validate(compose_run(["layout=tp2pp4ep8", "cluster=p5en-8x8", "launcher=slurm"]))
    template = string.Template(slurm.SBATCH_TEMPLATE.read_text())
    assert template.is_valid()  # every $ of bash's own is written $$
    values = slurm.sbatch_values(cfg, Path("/shared/run"), ["python3", "train.py"], {"A": "1"})
    assert set(template.get_identifiers()) == set(values)
    script = template.substitute(values)
    assert script.startswith("#!/bin/bash\n# recipe-bundle: TP2 PP4 EP8 DP8 on 8 x 8 H200 (p5en-8x8)")
    assert "HEAD=${NODES[0]}\n" in script and "\nexport A=1\n\n# the job" in script
    assert "\nARGV=(\n  python3 train.py\n)\n\nmkdir -p" in script


def test_the_rendezvous_is_tcp_when_the_launcher_names_rank_zero_else_the_run_directory_file(tmp_path):
    from trainer.launch.cpu_worker import rendezvous

    assert rendezvous(tmp_path, {}) == f"file://{tmp_path}/.rendezvous"
    assert rendezvous(tmp_path, {"MASTER_ADDR": "127.0.0.1"}) == f"file://{tmp_path}/.rendezvous"
    assert rendezvous(tmp_path, {"MASTER_ADDR": "n1", "MASTER_PORT": "29500"}) == "tcp://n1:29500"
    # an IPv6 address in brackets, as a URL must hold it (else torch reads "::1:29500" as a host and no port)
    assert rendezvous(tmp_path, {"MASTER_ADDR": "fd00::2", "MASTER_PORT": "29500"}) == "tcp://[fd00::2]:29500"
    assert rendezvous(tmp_path, {"MASTER_ADDR": "[::1]", "MASTER_PORT": "29500"}) == "tcp://[::1]:29500"
    for bad in ("0", "65536", "29500x", "-1"):
        with pytest.raises(ValueError, match="MASTER_PORT"):
            rendezvous(tmp_path, {"MASTER_ADDR": "n1", "MASTER_PORT": bad})


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
