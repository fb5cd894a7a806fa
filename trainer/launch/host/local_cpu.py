"""``launcher=local-cpu``: train the composed model on this machine's CPUs, data parallel over processes.

The parent (inside ``train``) refuses layouts that need model parallelism, prepares the rows, starts one
process per DP rank (``python -m trainer.launch.cpu_worker RUN_DIR RANK WORLD``; gloo over loopback, file
rendezvous in the run directory), streams rank 0's output, and finishes the run record:

``record.json`` is written with status ``running`` (and the parent's pid) before the first process starts and
rewritten at the end as ``complete``, ``failed`` (with the reason: which rank exited how, and the last line of
its log) or ``interrupted`` (SIGINT/SIGTERM). A record still saying ``running`` whose pid is gone was killed
(``trainer.record.record.effective_status``). ``job.json`` holds rank 0's command and the workers' environment,
secrets redacted (``argv.json``/``env.json`` are the miles launch, as for a plan).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.compose.checks import Parallelism
from trainer.compose.schema import TrainConfig
from trainer.data import Rows, synthetic
from trainer.data.build import BuildConfig, build
from trainer.errors import CheckError, UserError
from trainer.launch.host.processes import collect_probes, supervise, worker_env
from trainer.record.rundir import LOGS, RENDEZVOUS, RunDir
from trainer.redact import redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse what a CPU run cannot do: TP/PP/CP/EP/ETP > 1 or more than one node (one line, the field)."""
    data_parallel_only(cfg, "launcher local-cpu")
    if cfg.cluster.nodes != 1:
        raise CheckError(f"cluster.nodes {cfg.cluster.nodes}: launcher local-cpu runs on this machine only (1 node)")


def data_parallel_only(cfg: TrainConfig, who: str) -> None:
    """Refuse a layout with TP, PP, CP, EP or ETP > 1 (the CPU worker is data parallel only): :class:`CheckError`
    naming the field and ``who`` (e.g. ``launcher local-cpu``)."""
    lay = cfg.layout
    needs = {
        "tensor_model_parallel_size": lay.tensor_model_parallel_size,
        "pipeline_model_parallel_size": lay.pipeline_model_parallel_size,
        "context_parallel_size": lay.context_parallel_size,
        "expert_model_parallel_size": lay.expert_model_parallel_size,
        "expert_tensor_parallel_size": lay.expert_tensor_parallel_size,
    }
    for key, value in needs.items():
        if value > 1:
            raise CheckError(
                f"layout.{key} {value}: {who} runs data parallel only (TP, PP, CP, EP, ETP must be 1); "
                "use a GPU launcher for this layout"
            )


def prepare_rows(cfg: TrainConfig, run_dir: Path) -> Path:
    """The rows directory the workers read: built here from generated conversations when
    ``data.synthetic_conversations`` is set (checked against ``data.rows_sha256`` when that is given), else
    ``paths.prompt_data`` (a ``trainer data build`` output). Raises :class:`UserError` with one line."""

    data = cfg.data
    if data.synthetic_conversations:
        source = run_dir / "data" / "conversations.jsonl"
        source.parent.mkdir(parents=True, exist_ok=True)
        synthetic.write(source, data.synthetic_conversations, data.synthetic_seed)
        out = run_dir / "data" / "rows"
        manifest = build(
            [str(source)],
            out,
            BuildConfig(
                row_tokens=data.build.row_tokens,
                seed=data.build.seed,
                tokenizer_sha256=data.build.tokenizer_sha256,
                loss_mask=data.build.loss_mask,
                name=data.build.name,
            ),
        )
        if data.rows_sha256 and manifest["rows_sha256"] != data.rows_sha256:
            raise UserError(
                f"data.rows_sha256 {data.rows_sha256} != built {manifest['rows_sha256']} ({out}): "
                "the same inputs and config must give the same rows"
            )
        return out
    path = Path(os.path.expandvars(cfg.paths.prompt_data))
    if "$" in str(path) or not (path / "manifest.json").is_file():
        raise UserError(
            f"paths.prompt_data {redact_field('prompt_data', cfg.paths.prompt_data)}: expected a rows directory from "
            "`trainer data build` (rows.parquet + manifest.json)"
        )
    rows = Rows(path)  # verified against its own manifest before any process starts
    if data.rows_sha256 and rows.manifest.get("rows_sha256") != data.rows_sha256:
        raise UserError(
            f"paths.prompt_data {redact_field('prompt_data', path)}: rows_sha256 {rows.manifest.get('rows_sha256')} "
            f"!= data.rows_sha256 {data.rows_sha256} (data={data.name})"
        )
    return path


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Run the job; return ``record`` updated with ``status``, ``reason``, ``returncodes`` and ``probe``.

    ``record`` is the run record so far (written by the caller as ``running``); this function writes
    ``job.json`` (rank 0's command and the environment of its processes, redacted) first, and removes the gloo
    rendezvous file ``.rendezvous`` before the workers start and after they end.
    """
    cfg, par = prepared.config, prepared.par
    run_dir = rundir.path
    world = par.world_size
    env = worker_env(
        cfg.env,
        {
            "GLOO_SOCKET_IFNAME": "lo",  # gloo's connections stay on loopback
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
            "PYTHONUNBUFFERED": "1",
        },
        run_dir,
    )
    rows_dir = prepare_rows(cfg, run_dir)
    record["data"] = {"rows": str(rows_dir), "manifest": json.loads((rows_dir / "manifest.json").read_text())}
    commands: list[list[str]] = [
        [sys.executable, "-m", "trainer.launch.cpu_worker", str(run_dir), str(rank), str(world), str(rows_dir)]
        for rank in range(world)
    ]
    rundir.write_job(commands[0], env)
    # gloo's file store: one that a launcher killed before it could remove it (SIGKILL) left holds the keys of that
    # group, which a new group of the same size would read as its own
    (run_dir / RENDEZVOUS).unlink(missing_ok=True)
    outcome = supervise(commands, env, run_dir / LOGS)
    (run_dir / RENDEZVOUS).unlink(missing_ok=True)
    rundir.end(record, outcome.pop("status"), outcome.pop("reason"))
    record.update(outcome)
    record["probe"] = collect_probes(run_dir, world)
    return record
