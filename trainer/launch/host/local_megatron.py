"""``launcher=local-megatron``: the composed config on this machine's GPUs with megatron-core, via torchrun.

One ``torchrun`` starts ``cluster.gpus_per_node`` ranks of :mod:`trainer.launch.megatron_worker` on one node
(rendezvous on 127.0.0.1). The run directory gets what every executed run gets (see
:mod:`trainer.launch.host.local_cpu`): ``metrics.jsonl``, per-rank probes gathered into ``record.json``, argv, the
redacted env, logs, and a final status.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from trainer import REPO_ROOT
from trainer.compose.checks import Parallelism
from trainer.compose.plan import megatron_choice
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError
from trainer.launch.host.checkout import verify_checkouts
from trainer.launch.host.local_cpu import prepare_rows
from trainer.launch.host.processes import collect_probes, supervise, worker_env
from trainer.launch.megatron_args import resolve_transformer_impl
from trainer.launch.ports import free_ports
from trainer.record.rundir import LOGS, MEGATRON, RunDir

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse, with one line, what the worker would otherwise drop silently or fail on late: more than one
    node, an unknown ``launcher.transformer_impl``, what the local (non-TransformerEngine) spec cannot build
    (MLA, V4 attention, sequence parallel with torch norms), MTP or more than one row per microbatch with the V4
    model, context parallel (the worker does not split rows
    over CP ranks), Megatron-LM / miles checkouts that are missing or do not hash to the locked trees, and
    fewer GPUs than the layout needs."""
    m, lay = cfg.model, cfg.layout
    if cfg.cluster.nodes != 1:
        raise CheckError(
            f"cluster.nodes {cfg.cluster.nodes}: launcher local-megatron runs on one node (use slurm or ray)"
        )
    try:
        impl = resolve_transformer_impl(cfg.launcher.transformer_impl)
    except ValueError as ex:
        raise CheckError(str(ex)) from None
    local = impl == "local"
    refusals = [
        (
            local and m.multi_latent_attention,
            "model.multi_latent_attention true: MLA needs TransformerEngine's attention "
            "(launcher.transformer_impl local)",
        ),
        (
            local and m.experimental_attention_variant not in ("none", ""),
            f"model.experimental_attention_variant {m.experimental_attention_variant}: miles' V4 attention is built "
            "from TransformerEngine layers (launcher.transformer_impl local)",
        ),
        (
            local and lay.sequence_parallel,
            "layout.sequence_parallel true: the local spec's torch norms do not support it "
            "(and MoE with TP > 1 needs it)",
        ),
        (
            m.experimental_attention_variant == "dsv4" and m.mtp_num_layers > 0,
            f"model.mtp_num_layers {m.mtp_num_layers} with the V4 attention: Megatron-LM 37f91617's MTP layer "
            "asserts an attn_mask_type on its attention spec (multi_token_prediction.py:724), which miles' V4 spec "
            "does not set (deepseek_v4.py _dsv4_attention_module_spec): use model.mtp_num_layers=0",
        ),
        (
            m.experimental_attention_variant == "dsv4" and lay.micro_batch_size > 1,
            f"layout.micro_batch_size {lay.micro_batch_size} with the V4 model: TileKernels 1.0.0's hyper-connection "
            "backward views a non-contiguous gradient with more than one row per microbatch "
            "(tile_kernels/modeling/mhc/ops/pre_apply_mix.py:42; seen on an H200, 2026-12-01) and Megatron-LM "
            "37f91617's hash routing pairs token ids with router logits only for one row: "
            "use layout.micro_batch_size=1",
        ),
        (
            lay.context_parallel_size > 1,
            f"layout.context_parallel_size {lay.context_parallel_size}: the worker does not split rows over CP ranks",
        ),
        (
            cfg.launcher.attention_backend not in ("unfused", "fused", "flash", "local", "auto"),
            f"launcher.attention_backend {cfg.launcher.attention_backend!r}: "
            "expected unfused, fused, flash, local or auto",
        ),
    ]
    for refused, line in refusals:
        if refused:
            raise CheckError(f"launcher local-megatron: {line}")
    verify_checkouts(cfg.launcher, REPO_ROOT / cfg.stack.lockfile)
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


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Run the job with torchrun; return ``record`` with status, reason, return codes, probes and data."""
    cfg, par = prepared.config, prepared.par
    run_dir = rundir.path
    checkouts = verify_checkouts(cfg.launcher, REPO_ROOT / cfg.stack.lockfile)
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
            # the verified sources first on the path; no bytecode written into them
            "PYTHONPATH": os.pathsep.join(
                [c["path"] for c in checkouts.values()]
                + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            ),
            "PYTHONDONTWRITEBYTECODE": "1",
        },
        run_dir,
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(par.world_size),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(cfg.launcher.master_port or free_ports(1, "127.0.0.1")[0]),
        "-m",
        "trainer.launch.megatron_worker",
        str(run_dir),
        str(rows_dir),
    ]
    rundir.write_job(command, env)
    outcome = supervise([command], env, run_dir / LOGS)
    rundir.end(record, outcome.pop("status"), outcome.pop("reason"))
    record.update(outcome)
    record["probe"] = collect_probes(run_dir, par.world_size)
    record["sources"] = {name: {"commit": c["commit"], "tree": c["tree"]} for name, c in checkouts.items()}
    chosen = run_dir / MEGATRON
    if chosen.is_file():
        record["megatron"] = {**json.loads(chosen.read_text()), "why": megatron_choice(cfg)["why"]}
    return record
