"""The plan of a checked run: where every layer and expert lives, memory per GPU, numerics, how to submit.

Rank placement follows Megatron's default rank order ``tp-cp-ep-dp-pp`` (``megatron/core/parallel_state.py``,
``RankGenerator``): within one pipeline stage of W/PP consecutive ranks, the dense grid is
``rank = tp + TP x (cp + CP x dp)`` and the expert grid ``rank = etp + ETP x (ep + EP x edp)``; global
rank = stage x W/PP + that index; node = rank // GPUs per node. EP rank ``e`` holds routed experts
``[e x E/EP, (e+1) x E/EP)`` of every MoE layer on its stage.

Memory per GPU (bytes; estimate, stated so it can be checked):

    weights     = 2 x P_w                                  (bf16)
    grads       = g x P_w                                  (g = 4 with accumulate_allreduce_grads_in_fp32, else 2)
    optimizer   = 12 x (P_dense / DP + P_expert / EDP)     (Adam: fp32 master, exp_avg, exp_avg_sq; sharded by
                                                            the distributed optimizer over DP for dense and over the
                                                            expert data-parallel group EDP for expert weights;
                                                            without it, 12 x P_w)
    activations = m x (L_s / r) x C + R x L_s x C + r x A + logits
        P_w        = P_dense / TP + P_expert / (EP x ETP) on the GPU's stage (embedding on the first stage,
                     output head and MTP on the last)
        C          = s x b x h x k x 2 / (TP if sequence parallel else 1) / CP   (one checkpointed layer input:
                     the hyper-connection residual is k = dsv4_hc_mult streams of width h, bf16)
        R          = 2 for miles' V4 layers (k > 1), else 0: measured, not derived. On one H200 (2026-12-05,
                     bench/results/h200-2026-12-05, the stage slices of 2 to 5 layers) every V4 layer holds
                     0.80 GB beyond its 18 B per parameter = 3 x C at s 8,192, h 4,096, k 4, and holds it after
                     the step too (memory_after_step_1_bytes in megatron.json): the peak grows by the same
                     0.80 GB per layer while the peak minus the memory after the step stays 7.49 GB for 2 to 5
                     layers. One C of the three is the checkpoint m counts; R counts the other two
        A          = 34 x s x b x h / TP / CP   (one layer's activations while it is recomputed; Korthikanti
                     et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2,
                     sequence parallel with flash attention: the 5as/h term vanishes)
        m          = microbatches in flight on stage i under 1F1B: min(PP - i, microbatches)
        r          = recompute_num_layers (full recompute); without recompute, L_s x A per microbatch
        logits     = s x b x V / TP x 6 on the last stage (the vocab-parallel cross entropy keeps an fp32 copy
                     of the bf16 logits, exponentiates it in place and reuses it as the gradient: 4 B, with the
                     2 B bf16 logits alive beside it; megatron/core/tensor_parallel/cross_entropy.py)
        MTP        = per MTP layer on the last stage: its checkpoint and retained inputs, (1 + R) x C (with full
                     recompute; else A), and the logits of its own output head, as above (its loss is computed in
                     the forward, megatron/core/transformer/multi_token_prediction.py, and both cross entropies'
                     buffers wait for the backward). Derived, not measured: the H200 slices ran no MTP layer
Not counted: CUDA context, NCCL and DeepEP buffers, allocator fragmentation (typically a few GB).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, NotRequired, TypedDict

from trainer.compose.checks import Parallelism
from trainer.compose.numerics import NumericsVerdict
from trainer.compose.params import ModelParams, count_params
from trainer.compose.predict import Prediction, predict
from trainer.compose.schema import TrainConfig

GB = 1e9  # bytes


class RankPlacement(TypedDict):
    """Where one global rank sits: its node and local GPU, its pipeline stage, its dense (TP, CP, DP) and expert
    (ETP, EP, EDP) grid ranks, and the half-open ``[start, end)`` ranges of the layers and experts it holds."""

    rank: int
    node: int
    local_rank: int
    pipeline_stage: int
    tensor_rank: int
    context_rank: int
    data_rank: int
    expert_tensor_rank: int
    expert_rank: int
    expert_data_rank: int
    layers: list[int]
    experts: list[int]


class StageMemory(TypedDict):
    """One pipeline stage's estimate per GPU: parameters held (count) and GB (1e9 bytes) of each part."""

    stage: int
    params_per_gpu: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    total_gb: float


class MemoryEstimate(TypedDict):
    """:func:`memory_estimate`: per stage, the largest total and the GPU's memory (GB), and whether it fits."""

    formula: str
    per_stage: list[StageMemory]
    max_gb: float
    gpu_memory_gb: float
    fits: bool


class PipelineStage(TypedDict):
    """One pipeline stage: its ``[start, end)`` decoder layers and their count, its ranks, what else it holds."""

    stage: int
    layers: list[int]
    num_layers: int
    ranks: list[int]
    extra: list[str]


class Submission(TypedDict):
    """How the plan is submitted: the launcher, in words, and the script (a file of the run directory)."""

    launcher: str
    how: str
    command: str


class Plan(TypedDict):
    """``plan.json`` (:func:`build_plan`): counts of GPUs, layers, experts, tokens and steps; memory in GB.
    ``parallelism`` is :class:`~trainer.compose.checks.Parallelism` as a dict; ``params`` the counts of
    :meth:`~trainer.compose.params.ModelParams.summary`; ``throughput`` the prediction of
    :mod:`trainer.compose.predict`; ``numerics`` the verdict against the reference layout;
    ``megatron`` only for ``launcher=local-megatron`` (what its worker builds)."""

    schema_version: int
    model: str
    layout: str
    cluster: str
    parallelism: dict[str, Any]
    params: dict[str, int]
    pipeline: list[PipelineStage]
    experts_per_ep_rank: int
    ranks: list[RankPlacement]
    memory: MemoryEstimate
    throughput: Prediction
    numerics: NumericsVerdict
    tokens_per_step: int
    steps: int
    warnings: list[str]
    submit: Submission
    megatron: NotRequired[dict[str, Any]]


def recipe_steps(cfg: TrainConfig) -> int:
    """Optimizer steps of the recipe's schedule: ``optim.num_rollout`` rollouts of ``optim.rollout_batch_size``
    rows, ``optim.global_batch_size`` rows a step (miles' SFT loop, ``--num-rollout`` x steps per rollout)."""
    return cfg.optim.num_rollout * (cfg.optim.rollout_batch_size // cfg.optim.global_batch_size)


def run_steps(cfg: TrainConfig) -> int:
    """Optimizer steps an executed run takes: ``launcher.steps`` when set (a short run), else
    :func:`recipe_steps`."""
    return cfg.launcher.steps or recipe_steps(cfg)


def rank_table(cfg: TrainConfig, par: Parallelism) -> list[RankPlacement]:
    """One entry per global rank: node, local GPU, stage, TP/CP/DP and ETP/EP/EDP ranks, layers and experts.

    ``layers`` and ``experts`` are half-open ``[start, end)`` index ranges.
    """
    per_stage = par.world_size // par.pipeline_model_parallel_size
    tp, cp, ep, etp = (
        par.tensor_model_parallel_size,
        par.context_parallel_size,
        par.expert_model_parallel_size,
        par.expert_tensor_parallel_size,
    )
    experts_per_rank = cfg.model.num_experts // ep
    starts = [sum(par.stage_layers[:i]) for i in range(len(par.stage_layers))]
    ranks: list[RankPlacement] = []
    for rank in range(par.world_size):
        stage, idx = divmod(rank, per_stage)
        ep_rank = (idx // etp) % ep
        ranks.append(
            {
                "rank": rank,
                "node": rank // cfg.cluster.gpus_per_node,
                "local_rank": rank % cfg.cluster.gpus_per_node,
                "pipeline_stage": stage,
                "tensor_rank": idx % tp,
                "context_rank": (idx // tp) % cp,
                "data_rank": idx // (tp * cp),
                "expert_tensor_rank": idx % etp,
                "expert_rank": ep_rank,
                "expert_data_rank": idx // (etp * ep),
                "layers": [starts[stage], starts[stage] + par.stage_layers[stage]],
                "experts": [ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank],
            }
        )
    return ranks


def memory_estimate(cfg: TrainConfig, par: Parallelism, params: ModelParams) -> MemoryEstimate:
    """Per-stage memory estimate per GPU in GB (1e9 bytes), by the formula in the module docstring.

    Returns ``{"formula", "per_stage": [{stage, params, weights_gb, grads_gb, optimizer_gb, activations_gb,
    total_gb}], "max_gb", "gpu_memory_gb", "fits"}``.
    """
    lay, model, data = cfg.layout, cfg.model, cfg.data
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    s, b, h = data.seq_length, lay.micro_batch_size, model.hidden_size
    grad_bytes = 4 if cfg.optim.accumulate_allreduce_grads_in_fp32 else 2
    checkpoint = s * b * h * model.dsv4_hc_mult * 2 / (tp if lay.sequence_parallel else 1) / cp
    layer_acts = 34 * s * b * h / tp / cp
    retained = 2 if model.dsv4_hc_mult > 1 else 0  # R of the module docstring (measured on miles' V4 layers)
    stages: list[StageMemory] = []
    for stage, (n_layers, (dense, expert)) in enumerate(
        zip(par.stage_layers, params.stage_counts(par.stage_layers), strict=True)
    ):
        on_gpu = dense / tp + expert / (par.expert_model_parallel_size * par.expert_tensor_parallel_size)
        if lay.use_distributed_optimizer:
            optimizer = 12 * (
                dense / tp / par.data_parallel_size
                + expert
                / (par.expert_model_parallel_size * par.expert_tensor_parallel_size)
                / par.expert_data_parallel_size
            )
        else:
            optimizer = 12 * on_gpu
        in_flight = min(pp - stage, par.microbatches)
        if lay.recompute_granularity == "full":
            r = lay.recompute_num_layers or 1
            acts = in_flight * math.ceil(n_layers / r) * checkpoint + r * layer_acts + retained * n_layers * checkpoint
        else:
            acts = in_flight * n_layers * layer_acts
        if stage == pp - 1:  # the output head's logits, and per MTP layer its layer and its own head's logits
            mtp = model.mtp_num_layers
            if lay.recompute_granularity == "full":
                acts += mtp * (checkpoint + retained * checkpoint)
            else:
                acts += mtp * layer_acts
            acts += (1 + mtp) * s * b * model.vocab_size / tp * 6
        total = (2 + grad_bytes) * on_gpu + optimizer + acts
        stages.append(
            {
                "stage": stage,
                "params_per_gpu": int(on_gpu),
                "weights_gb": round(2 * on_gpu / GB, 2),
                "grads_gb": round(grad_bytes * on_gpu / GB, 2),
                "optimizer_gb": round(optimizer / GB, 2),
                "activations_gb": round(acts / GB, 2),
                "total_gb": round(total / GB, 2),
            }
        )
    peak = max(st["total_gb"] for st in stages)
    return {
        "formula": "see trainer/compose/plan.py module docstring (weights 2 B, grads 4 B, Adam 12 B sharded by the "
        "distributed optimizer, full-recompute checkpoints + the V4 layers' retained 2 x C + one recomputed layer + "
        "last-stage logits, those of each MTP layer too)",
        "per_stage": stages,
        "max_gb": peak,
        "gpu_memory_gb": cfg.cluster.gpu_memory_gb,
        "fits": peak <= cfg.cluster.gpu_memory_gb,
    }


def build_plan(cfg: TrainConfig, par: Parallelism, numerics: NumericsVerdict) -> Plan:
    """The plan as JSON-ready data: parallelism, stages, ranks, memory, numerics verdict, throughput inputs, submission.

    Depends only on the composition (no paths, times or hosts), so the same config gives the same bytes.
    """
    params = count_params(cfg.model)
    ranks = rank_table(cfg, par)
    starts = [sum(par.stage_layers[:i]) for i in range(len(par.stage_layers))]
    pipeline: list[PipelineStage] = [
        {
            "stage": i,
            "layers": [starts[i], starts[i] + n],
            "num_layers": n,
            "ranks": [r["rank"] for r in ranks if r["pipeline_stage"] == i],
            "extra": (["embedding"] if i == 0 else [])
            + (
                ["output head", "final norm"] + (["MTP"] * bool(cfg.model.mtp_num_layers))
                if i == len(starts) - 1
                else []
            ),
        }
        for i, n in enumerate(par.stage_layers)
    ]
    memory = memory_estimate(cfg, par, params)
    warnings: list[str] = []
    if not memory["fits"]:
        warnings.append(
            f"estimated {memory['max_gb']} GB per GPU exceeds cluster.gpu_memory_gb {cfg.cluster.gpu_memory_gb}"
        )
    rows_needed = cfg.optim.num_rollout * cfg.optim.rollout_batch_size
    if rows_needed > cfg.data.build.rows:
        warnings.append(
            f"optim.num_rollout {cfg.optim.num_rollout} x optim.rollout_batch_size {cfg.optim.rollout_batch_size} = "
            f"{rows_needed} rows > data.build.rows {cfg.data.build.rows}: rows repeat"
        )
    plan: Plan = {
        "schema_version": 1,
        "model": cfg.model.display_name,
        "layout": cfg.layout.label,
        "cluster": cfg.cluster.name,
        "parallelism": asdict(par),
        "params": params.summary(),
        "pipeline": pipeline,
        "experts_per_ep_rank": cfg.model.num_experts // par.expert_model_parallel_size,
        "ranks": ranks,
        "memory": memory,
        "throughput": predict(cfg, par, params),
        "numerics": numerics,
        "tokens_per_step": cfg.optim.global_batch_size * cfg.data.seq_length,
        "steps": recipe_steps(cfg),
        "warnings": warnings,
        "submit": {
            "launcher": cfg.launcher.name,
            "how": (
                f"inside the recipe image on {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s), in the "
                "miles checkout, with HF_CKPT, TORCH_DIST, SFT_DATA and KERNEL_CACHE set: bash command.sh from this "
                "run directory (miles starts its Ray actors from the head node)"
            ),
            "command": "command.sh",
        },
    }
    if cfg.launcher.name == "local-megatron":
        plan["megatron"] = megatron_choice(cfg)
    return plan


def megatron_choice(cfg: TrainConfig) -> dict[str, Any]:
    """What the plan says the worker builds: ``{"transformer_impl", "attention_backend", "why"}``."""
    impl = cfg.launcher.transformer_impl
    why = [
        "transformer_impl auto: TransformerEngine's layer spec when transformer_engine is importable in the "
        "training process (the recipe's path), else megatron-core's local spec"
        if impl == "auto"
        else f"transformer_impl {impl}: asked for",
    ]
    if cfg.launcher.attention_backend == "unfused":
        why.append(
            "attention_backend unfused: TE 2.17.0's cuDNN fused attention failed on the lent H200 (torch "
            "2.11.0+cu130, the lock's cuDNN 9.19.0): backward CUDNN_STATUS_BAD_PARAM (2026-12-01, first "
            "try), forward CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED with the machine's apt cuDNN 9.14 mapped "
            "next to 9.19 (fused_attn_f16_arbitrary_seqlen.cu:419); unfused ran"
        )
    else:
        why.append(f"attention_backend {cfg.launcher.attention_backend}: asked for")
    if cfg.model.experimental_attention_variant == "dsv4":
        why.append(
            "model: miles' DeepSeekV4Attention (--spec miles_plugins.models.deepseek_v4.deepseek_v4 "
            "get_dsv4_spec) uses its own tilelang sparse-attention kernel; attention_backend applies to "
            "no V4 layer"
        )
    return {"transformer_impl": impl, "attention_backend": cfg.launcher.attention_backend, "why": why}
