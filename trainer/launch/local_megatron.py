"""``launcher=local-megatron``: the composed config on this machine's GPUs with megatron-core, via torchrun.

One ``torchrun`` starts ``cluster.gpus_per_node`` ranks of :mod:`trainer.launch.megatron_worker` on one node
(rendezvous on 127.0.0.1). The run directory gets what every executed run gets (see
:mod:`trainer.launch.local_cpu`): ``metrics.jsonl``, per-rank probes gathered into ``record.json``, argv, the
redacted env, logs, and a final status.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

from trainer.checks import Parallelism
from trainer.errors import CheckError, UserError
from trainer.launch.local_cpu import prepare_rows
from trainer.launch.processes import collect_probes, supervise, worker_env
from trainer.record import redact_env, write_json
from trainer.schema import TrainConfig


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse what megatron-core's local (non-TransformerEngine) spec cannot run, with one line."""
    if cfg.cluster.nodes != 1:
        raise CheckError(f"cluster.nodes {cfg.cluster.nodes}: launcher local-megatron runs on one node (use slurm or ray)")
    if not _has_transformer_engine():
        if cfg.model.multi_latent_attention:
            raise CheckError(
                "model.multi_latent_attention true needs TransformerEngine, which is not installed: "
                "use a proxy model without MLA (model=dsv4-proxy)"
            )
        if cfg.layout.sequence_parallel:
            raise CheckError(
                "layout.sequence_parallel true needs TransformerEngine norms, which are not installed "
                "(and MoE with TP > 1 needs sequence parallel): use TP 1"
            )
    if cfg.model.moe_router_score_function not in ("softmax", "sigmoid"):
        raise CheckError(
            f"model.moe_router_score_function {cfg.model.moe_router_score_function}: megatron-core has softmax "
            "and sigmoid (sqrtsoftplus lives in miles' Megatron-LM fork)"
        )


def execute(cfg: TrainConfig, par: Parallelism, run_dir: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """Run the job with torchrun; return ``record`` with status, reason, return codes, probes and data."""
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus < par.world_size:
        raise UserError(f"cluster.gpus_per_node {par.world_size}: this machine has {gpus} GPU(s)")
    rows_dir = prepare_rows(cfg, run_dir)
    record["data"] = {"rows": str(rows_dir), "manifest": json.loads((rows_dir / "manifest.json").read_text())}
    env = worker_env(cfg.env, {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")})
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(par.world_size),
        "--master-addr", "127.0.0.1", "--master-port", str(cfg.launcher.master_port),
        "-m", "trainer.launch.megatron_worker", str(run_dir), str(rows_dir),
    ]
    write_json(run_dir / "argv.json", command)
    write_json(run_dir / "env.json", redact_env(env))
    record.update(supervise([command], env, run_dir / "logs"))
    record["probe"] = collect_probes(run_dir, par.world_size)
    return record
