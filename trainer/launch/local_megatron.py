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
from trainer.errors import CheckError
from trainer.launch.local_cpu import prepare_rows
from trainer.launch.processes import collect_probes, supervise, worker_env
from trainer.record import redact_env, write_json
from trainer.schema import TrainConfig


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse, with one line, what the worker's megatron-core local (non-TransformerEngine) layer spec does not
    build: it would otherwise be dropped silently (MLA, V4 attention, MTP, dense layers) or fail at run time
    (sequence parallel with torch norms, context parallel without per-rank sequence splitting)."""
    m, lay = cfg.model, cfg.layout
    if cfg.cluster.nodes != 1:
        raise CheckError(f"cluster.nodes {cfg.cluster.nodes}: launcher local-megatron runs on one node (use slurm or ray)")
    refusals = [
        (m.multi_latent_attention, "model.multi_latent_attention true: the local spec has no MLA (use model=dsv4-proxy)"),
        (m.experimental_attention_variant not in ("none", ""),
         f"model.experimental_attention_variant {m.experimental_attention_variant}: V4 attention lives in miles "
         "(use model=dsv4-proxy)"),
        (m.mtp_num_layers > 0, f"model.mtp_num_layers {m.mtp_num_layers}: the worker builds no MTP layer"),
        (any(f != 1 for f in m.moe_layer_freq), "model.moe_layer_freq: the worker builds MoE in every layer (all 1)"),
        (lay.sequence_parallel,
         "layout.sequence_parallel true: the local spec's torch norms do not support it (and MoE with TP > 1 needs it): "
         "use TP 1"),
        (lay.context_parallel_size > 1,
         f"layout.context_parallel_size {lay.context_parallel_size}: the worker does not split rows over CP ranks"),
        (m.moe_router_score_function not in ("softmax", "sigmoid"),
         f"model.moe_router_score_function {m.moe_router_score_function}: megatron-core has softmax and sigmoid "
         "(sqrtsoftplus lives in miles' Megatron-LM fork)"),
    ]
    for refused, line in refusals:
        if refused:
            raise CheckError(f"launcher local-megatron: {line}")
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus < par.world_size:
        raise CheckError(
            f"launcher local-megatron: cluster.gpus_per_node {cfg.cluster.gpus_per_node} x cluster.nodes "
            f"{cfg.cluster.nodes} = {par.world_size} GPUs, this machine has {gpus}"
        )


def _free_port() -> int:
    """A free TCP port on 127.0.0.1 (for torchrun's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def execute(cfg: TrainConfig, par: Parallelism, run_dir: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """Run the job with torchrun; return ``record`` with status, reason, return codes, probes and data."""
    rows_dir = prepare_rows(cfg, run_dir)
    record["data"] = {"rows": str(rows_dir), "manifest": json.loads((rows_dir / "manifest.json").read_text())}
    env = worker_env(
        cfg.env,
        {
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"),
            # one node: NCCL's bootstrap and gloo stay on loopback
            "NCCL_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
        },
    )
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(par.world_size),
        "--master-addr", "127.0.0.1", "--master-port", str(cfg.launcher.master_port or _free_port()),
        "-m", "trainer.launch.megatron_worker", str(run_dir), str(rows_dir),
    ]
    write_json(run_dir / "argv.json", command)
    write_json(run_dir / "env.json", redact_env(env))
    record.update(supervise([command], env, run_dir / "logs"))
    record["probe"] = collect_probes(run_dir, par.world_size)
    return record
