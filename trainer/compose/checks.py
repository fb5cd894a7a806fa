"""Pre-launch checks of a composed run: layout arithmetic and model/data consistency.

Each check that fails gives one line naming the field(s) and the arithmetic, e.g.
``layout.data_parallel_size 8 != world 32 / (TP 2 x PP 4 x CP 1) = 4``. The rules are Megatron-LM's
(``megatron/training/arguments.py``, ``megatron/core/parallel_state.py``,
``megatron/core/transformer/transformer_block.py`` for the uneven pipeline split):

- world size W = nodes x GPUs per node;
- model-parallel size TP x PP x CP divides W and DP = W / (TP x PP x CP);
- the expert grid ETP x EP x PP divides W; the expert data-parallel size is W / (ETP x EP x PP);
- the pipeline stages cover exactly ``num_layers``: first + (PP-2) x middle + last, the middle stages
  even (Megatron's ``decoder_first/last_pipeline_num_layers``), or an even split when neither is set;
- routed experts divide by EP; attention heads divide by TP;
- sequence parallel needs TP > 1, and MoE with TP > 1 needs sequence parallel;
- the global batch divides by micro-batch x DP;
- one row is one sequence: ``data.seq_length`` equals ``data.build.row_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer.compose.schema import RecomputeGranularity, TrainConfig
from trainer.errors import CheckError
from trainer.redact import redact_field


@dataclass(frozen=True)
class Parallelism:
    """Sizes derived from a checked config (all counts of GPUs, layers or rows).

    ``stage_layers[i]`` is the number of decoder layers on pipeline stage ``i`` (sums to num_layers);
    ``expert_data_parallel_size`` is the data-parallel size of expert weights, W / (ETP x EP x PP);
    ``microbatches`` is the number of microbatches per optimizer step per DP rank.
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    data_parallel_size: int
    expert_data_parallel_size: int
    stage_layers: list[int] = field(default_factory=list)
    microbatches: int = 1


def stage_split(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Decoder layers per pipeline stage, as Megatron splits them.

    ``first``/``last`` pin the first/last stage (``--decoder-first/last-pipeline-num-layers``); the
    remaining layers are spread evenly over the other stages. Raises :class:`CheckError` when the
    split does not cover exactly ``num_layers`` or is uneven.
    """
    if pp == 1:
        if first is not None or last is not None:
            raise CheckError(
                "layout.decoder_first/last_pipeline_num_layers need layout.pipeline_model_parallel_size > 1 (got 1)"
            )
        return [num_layers]
    head = [first] if first is not None else []
    tail = [last] if last is not None else []
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise CheckError(f"layout.decoder_{name}_pipeline_num_layers must be >= 1 (got {value})")
    middle_stages = pp - len(head) - len(tail)
    rest = num_layers - sum(head) - sum(tail)
    pinned = [f"first {first}"] * bool(head) + [f"last {last}"] * bool(tail)
    if middle_stages == 0:
        if rest != 0:
            raise CheckError(
                f"layout: PP {pp} stages hold {' + '.join(pinned)} = {num_layers - rest} layers, "
                f"but model.num_layers is {num_layers}"
            )
        return head + tail
    if rest < middle_stages or rest % middle_stages:
        where = " - ".join([f"model.num_layers {num_layers}"] + pinned) + (f" = {rest} layers" if pinned else " layers")
        raise CheckError(
            f"layout.pipeline_model_parallel_size {pp}: {where} do not split evenly over "
            f"{middle_stages} {'middle ' if pinned else ''}stages"
        )
    return head + [rest // middle_stages] * middle_stages + tail


# Fields that must be > 0 (a size, a rate, a capacity); every other number must be finite and >= 0.
POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.ffn_hidden_size",
    "model.num_attention_heads",
    "model.vocab_size",
    "model.q_lora_rank",
    "model.kv_lora_rank",
    "model.qk_head_dim",
    "model.v_head_dim",
    "model.moe_ffn_hidden_size",
    "model.norm_epsilon",
    "cluster.gpu_memory_gb",
    "cluster.gpu_peak_bf16_flops",
    "optim.lr",
    "optim.global_batch_size",
    "optim.num_rollout",
    "optim.rollout_batch_size",
    "data.seq_length",
)
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The --lr-decay-style values the workers' schedule follows (trainer.launch.cpu_worker.megatron_lr, after
# Megatron-LM's OptimizerParamScheduler.get_lr); its inverse-square-root and WSD styles are not followed.
LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _numbers(node: Any, prefix: str) -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every int/float leaf of a typed config (lists included, bools not)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _numbers(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{prefix}{key}.")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix[:-1], node


def check_values(cfg: TrainConfig) -> None:
    """Every number of the config finite and >= 0, those of :data:`POSITIVE` > 0; every ``env`` name a shell name.

    Raises :class:`CheckError` naming the first bad field (NaN or infinite learning rate, a negative model size,
    NaN GPU memory, a negative price, zero peak FLOP/s, ``env.1BAD``).
    """
    for key, value in _numbers(cfg, ""):
        if not math.isfinite(value):
            raise CheckError(f"{key} must be a finite number (got {value})")
        if value < 0 or (value == 0 and key in POSITIVE):
            raise CheckError(f"{key} must be {'> 0' if key in POSITIVE else '>= 0'} (got {value})")
    for name in cfg.env or {}:
        if not SHELL_NAME.fullmatch(str(name)):
            raise CheckError(
                f"env.{name}: not a shell variable name (letters, digits and _, not starting with a digit)"
            )


def check(cfg: TrainConfig) -> Parallelism:
    """Run every pre-launch check on a typed config; return the derived :class:`Parallelism`.

    Raises :class:`CheckError` (one line: the field and the arithmetic) at the first failure.
    """
    check_values(cfg)
    lay, model, cluster, optim, data = cfg.layout, cfg.model, cfg.cluster, cfg.optim, cfg.data
    for key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "micro_batch_size",
    ):
        if getattr(lay, key) < 1:
            raise CheckError(f"layout.{key} must be >= 1 (got {getattr(lay, key)})")
    for key in ("nodes", "gpus_per_node"):
        if getattr(cluster, key) < 1:
            raise CheckError(f"cluster.{key} must be >= 1 (got {getattr(cluster, key)})")

    tp, pp, cp = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size, lay.context_parallel_size
    ep, etp = lay.expert_model_parallel_size, lay.expert_tensor_parallel_size
    world = cluster.nodes * cluster.gpus_per_node
    world_text = f"world size {world} = cluster.nodes {cluster.nodes} x cluster.gpus_per_node {cluster.gpus_per_node}"
    if world % (tp * pp * cp):
        raise CheckError(f"layout: TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp} does not divide the {world_text}")
    dp = world // (tp * pp * cp)
    if lay.data_parallel_size is not None and lay.data_parallel_size != dp:
        raise CheckError(
            f"layout.data_parallel_size {lay.data_parallel_size} != "
            f"world {world} / (TP {tp} x PP {pp} x CP {cp}) = {dp} "
            f"({world_text})"
        )
    if world % (etp * ep * pp):
        raise CheckError(f"layout: ETP {etp} x EP {ep} x PP {pp} = {etp * ep * pp} does not divide the {world_text}")
    expert_dp = world // (etp * ep * pp)

    if len(model.moe_layer_freq) != model.num_layers:
        raise CheckError(
            f"model.moe_layer_freq has {len(model.moe_layer_freq)} entries, model.num_layers is {model.num_layers}"
        )
    ratios = len(model.dsv4_compress_ratios)
    if ratios not in (model.num_layers, model.num_layers + model.mtp_num_layers):
        raise CheckError(
            f"model.dsv4_compress_ratios has {ratios} entries, expected model.num_layers {model.num_layers}"
            f" (+ model.mtp_num_layers {model.mtp_num_layers})"
        )
    stages = stage_split(
        model.num_layers, pp, lay.decoder_first_pipeline_num_layers, lay.decoder_last_pipeline_num_layers
    )
    vpp = lay.num_virtual_stages_per_pipeline_rank
    if vpp is not None and vpp > 1 and any(n % vpp for n in stages):
        raise CheckError(f"layout.num_virtual_stages_per_pipeline_rank {vpp} does not divide the stage layers {stages}")

    if model.num_experts % ep:
        raise CheckError(
            f"model.num_experts {model.num_experts} is not divisible by layout.expert_model_parallel_size {ep}"
        )
    if not 1 <= model.moe_router_topk <= model.num_experts:
        raise CheckError(
            f"model.moe_router_topk {model.moe_router_topk} must be in 1..model.num_experts {model.num_experts}"
        )
    if model.num_attention_heads % tp:
        raise CheckError(
            f"model.num_attention_heads {model.num_attention_heads} is not divisible by "
            f"layout.tensor_model_parallel_size {tp}"
        )
    if lay.sequence_parallel and tp == 1:
        raise CheckError("layout.sequence_parallel true needs layout.tensor_model_parallel_size > 1 (got 1)")
    if model.num_experts > 0 and tp > 1 and not lay.sequence_parallel:
        raise CheckError(
            f"layout.sequence_parallel must be true: MoE (model.num_experts {model.num_experts}) with "
            f"layout.tensor_model_parallel_size {tp} > 1 needs sequence parallel in Megatron"
        )
    # the sets of the choice fields (recompute granularity and method, dispatcher, qkv format) are the schema's
    # (trainer.compose.schema: an Enum each, refused at composition); what is left here relates fields
    if lay.recompute_granularity == RecomputeGranularity.full:
        if lay.recompute_method is None:
            raise CheckError("layout.recompute_method must be uniform or block with full recompute (got None)")
        if lay.recompute_num_layers is None or lay.recompute_num_layers < 1:
            raise CheckError(
                f"layout.recompute_num_layers must be >= 1 with full recompute (got {lay.recompute_num_layers})"
            )

    per_step = lay.micro_batch_size * dp
    if optim.global_batch_size < 1 or optim.global_batch_size % per_step:
        raise CheckError(
            f"optim.global_batch_size {optim.global_batch_size} is not divisible by layout.micro_batch_size "
            f"{lay.micro_batch_size} x DP {dp} = {per_step}"
        )
    if optim.rollout_batch_size % optim.global_batch_size:
        raise CheckError(
            f"optim.rollout_batch_size {optim.rollout_batch_size} is not a multiple of "
            f"optim.global_batch_size {optim.global_batch_size}"
        )
    if data.seq_length != data.build.row_tokens:
        raise CheckError(
            f"data.seq_length {data.seq_length} != data.build.row_tokens {data.build.row_tokens}: "
            "each fixed row is one training sequence"
        )
    if data.seq_length % (tp if lay.sequence_parallel else 1) or data.seq_length % (2 * cp if cp > 1 else 1):
        raise CheckError(
            f"data.seq_length {data.seq_length} must divide by TP {tp} (sequence parallel)"
            f" and by 2 x CP {cp} (context parallel)"
        )
    if not 0.0 <= optim.lr_warmup_fraction <= 1.0:
        raise CheckError(f"optim.lr_warmup_fraction must be in [0, 1] (got {optim.lr_warmup_fraction})")
    if optim.lr_decay_style not in LR_DECAY_STYLES:
        raise CheckError(
            f"optim.lr_decay_style {redact_field('lr_decay_style', optim.lr_decay_style)!r}: "
            f"expected one of {', '.join(LR_DECAY_STYLES)} "
            "(the styles the workers' learning-rate schedule follows)"
        )
    if optim.min_lr > optim.lr:
        raise CheckError(f"optim.min_lr {optim.min_lr} > optim.lr {optim.lr}")
    return Parallelism(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        data_parallel_size=dp,
        expert_data_parallel_size=expert_dp,
        stage_layers=stages,
        microbatches=optim.global_batch_size // per_step,
    )
