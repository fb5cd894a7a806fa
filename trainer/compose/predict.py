"""Throughput prediction of a plan: measured compute per layer, scaled to the layout, plus a communication model.

Inputs: ``throughput`` (conf/throughput/: seconds per microbatch of each decoder layer by compress ratio, of the
output head, of the optimizer per 1e9 parameters, measured on one GPU that does a whole TP group's work of one
microbatch: bench/throughput_fit.py), ``cluster.nvlink_gb_s`` and ``cluster.network_gb_s`` (GB/s per GPU and
direction) and the layout. Every figure is per GPU; s tokens per row, b rows per microbatch, h hidden size, k
routed experts per token, c hyper-connection streams, m microbatches per DP rank, bf16 = 2 bytes.

Per microbatch on pipeline stage i (seconds):

    compute  = sum over its layers of layer_s[ratio] / TP   (+ head and, per MTP layer, layer_s[its ratio] / TP
               + head on the last stage; head = head_s / TP + the all-gather of the output layer's input under
               sequence parallelism and the reduce-scatter of its gradient, 2 x (TP-1)/TP x s x b x h x 2 B /
               bandwidth, counted here, not under TP). A TP rank does 1/TP of the dense work; with ETP 1 an EP
               rank's experts receive s x b x k / TP token-expert pairs, 1/TP of the timed GPU's (uniform
               routing).
    TP       = per layer 4 collectives (all-gather and reduce-scatter around attention and around the MLP, sequence
               parallel) x 3 (forward, recomputed forward, backward) x (TP-1)/TP x s x b x h x 2 B / bandwidth
    EP       = per MoE layer 2 all-to-alls (dispatch, combine) x 3 x (EP-1)/EP x (s x b / TP) x k x h x 2 B
    PP       = 2 x s x b x c x h x 2 B / TP (the hyper-connection stream sent forward, its gradient backward; / TP
               with sequence parallelism, else whole), at the network's bandwidth for every stage once the
               pipeline spans two nodes (the slowest link paces it)

    step     = sum_i t_i + (m - 1) x max_i t_i         (1F1B with p stages: each microbatch crosses every stage
               once and the slowest stage paces the rest; = (m + p - 1) x t for equal stages, Narayanan et al. 2021,
               "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2)
             + DP: reduce-scatter of the grads (4 B in fp32, else 2 B) and all-gather of the bf16 params,
               (DP-1)/DP x P_dense_gpu x (g + 2) B over the DP group and (EDP-1)/EDP x P_expert_gpu x (g + 2) B over
               the expert DP group, after the last backward (the recipe sets no --overlap-grad-reduce)
             + optimizer_s_per_gparam x the GPU's optimizer shard (P_dense / TP / DP + P_expert / EP / EDP) / 1e9

Refused (``predicted`` false, ``why``): another GPU, hidden size, sequence or microbatch, a model that differs
from the timed layers in any of ``throughput.shapes`` (model fields), another number of experts a GPU
(``num_experts`` / EP against ``throughput.experts``), a compress ratio without a time or a decoder or MTP layer
without a ratio, dense layers, no full recompute, CP or ETP above 1.

A group whose ranks span more than one node uses ``network_gb_s``, else ``nvlink_gb_s`` (Megatron's rank order
tp-cp-ep-dp-pp, trainer/compose/plan.py). tokens/s/GPU = global batch x s / (step x world); MFU = 6 x N x tokens/s/GPU
/ peak (trainer/report/metrics.py). Not modelled: load imbalance between EP ranks, kernels' lower efficiency at
1/TP of the shapes, NCCL latency, overlap of communication with compute, data loading and logging.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from trainer.compose.checks import Parallelism
from trainer.compose.params import ModelParams
from trainer.compose.schema import RecomputeGranularity, TrainConfig

BF16 = 2  # bytes


class StageTime(TypedDict):
    """Seconds per microbatch on one pipeline stage, by part, and their sum."""

    stage: int
    compute_s: float
    tp_s: float
    ep_s: float
    pp_s: float
    total_s: float


class Prediction(TypedDict):
    """``plan.json`` ``throughput``: ``predicted`` false with ``why`` when the calibration does not apply, else the
    per-stage times (seconds per microbatch), the step's parts (seconds), tokens/s/GPU, MFU, and the comparison with
    the recipe's measured run."""

    predicted: bool
    calibration: str
    why: NotRequired[str]
    source: NotRequired[str]
    per_stage: NotRequired[list[StageTime]]
    pipeline_s: NotRequired[float]
    bubble_fraction: NotRequired[float]
    dp_s: NotRequired[float]
    optimizer_s: NotRequired[float]
    step_s: NotRequired[float]
    tokens_per_s_per_gpu: NotRequired[float]
    mfu: NotRequired[float]
    reference: NotRequired[dict[str, object]]


def not_applicable(cfg: TrainConfig, par: Parallelism) -> str | None:
    """Why ``cfg.throughput`` cannot predict this composition (one line), or None when it can."""
    cal, model, lay = cfg.throughput, cfg.model, cfg.layout
    if cal.name == "none":
        return "throughput=none: no measured compute times"
    if cfg.cluster.nvlink_gb_s is None or cfg.cluster.network_gb_s is None:
        return f"cluster {cfg.cluster.name} states no nvlink_gb_s / network_gb_s"
    if cfg.cluster.gpu_type != cal.gpu_type:
        return f"times measured on {cal.gpu_type}, cluster has {cfg.cluster.gpu_type}"
    for field, want, have in (
        ("model.hidden_size", cal.hidden_size, model.hidden_size),
        ("data.seq_length", cal.seq_length, cfg.data.seq_length),
        ("layout.micro_batch_size", cal.micro_batch_size, lay.micro_batch_size),
    ):
        if want != have:
            return f"{field} {have}: the times are for {want}"
    for name, want in cal.shapes.items():
        if getattr(model, name, None) != want:
            return f"model.{name} {getattr(model, name, None)}: the times are of layers with {want}"
    if cal.experts and model.num_experts != cal.experts * par.expert_model_parallel_size:
        return (
            f"model.num_experts {model.num_experts} over EP {par.expert_model_parallel_size}: the times are of "
            f"{cal.experts} experts a GPU"
        )
    ratios = [str(r) for r in model.dsv4_compress_ratios[: model.num_layers + model.mtp_num_layers]]
    if len(ratios) < model.num_layers + model.mtp_num_layers:
        return (
            f"model.dsv4_compress_ratios has {len(ratios)} entries, the decoder and MTP layers are "
            f"{model.num_layers + model.mtp_num_layers}: no ratio, no measured time, for the last"
        )
    missing = sorted(set(ratios) - set(cal.layer_s))
    if missing:
        return f"no measured layer time for compress ratio {', '.join(missing)}"
    if any(f != 1 for f in model.moe_layer_freq):
        return "the times are of MoE layers; this model has dense layers"
    if lay.recompute_granularity != RecomputeGranularity.full:
        return "the times include full recompute; this layout does not recompute fully"
    if par.context_parallel_size != 1 or par.expert_tensor_parallel_size != 1:
        return "the scaling assumes CP 1 and ETP 1"
    return None


def predict(cfg: TrainConfig, par: Parallelism, params: ModelParams) -> Prediction:
    """The prediction of the module docstring for ``cfg`` laid out as ``par`` (``params``: its counts).

    Returns ``{"predicted": False, "why"}`` when :func:`not_applicable` says so; raises nothing else."""
    cal = cfg.throughput
    why = not_applicable(cfg, par)
    if why is not None:
        return {"predicted": False, "calibration": cal.name, "why": why}
    model, lay, cl = cfg.model, cfg.layout, cfg.cluster
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    dp, edp = par.data_parallel_size, par.expert_data_parallel_size
    stage_ranks = par.world_size // pp
    gpn, nvlink, network = cl.gpus_per_node, cl.nvlink_gb_s, cl.network_gb_s
    assert nvlink is not None and network is not None  # not_applicable checked them

    def seconds(nbytes: float, span: int) -> float:  # a group of `span` consecutive ranks
        return nbytes / ((network if span > gpn else nvlink) * 1e9)

    tokens = cfg.data.seq_length * lay.micro_batch_size
    h = model.hidden_size
    tp_layer = seconds(4 * 3 * (tp - 1) / tp * tokens * h * BF16, tp) if tp > 1 else 0.0
    ep_layer = seconds(2 * 3 * (ep - 1) / ep * tokens / tp * model.moe_router_topk * h * BF16, ep) if ep > 1 else 0.0
    sp = tp if lay.sequence_parallel else 1
    # every stage is charged the slowest link of the pipeline: a network one as soon as it spans two nodes
    pp_mb = seconds(2 * tokens * model.dsv4_hc_mult * h * BF16 / sp, par.world_size) if pp > 1 else 0.0
    ratios = [str(r) for r in model.dsv4_compress_ratios]
    head = cal.head_s / tp + (seconds(2 * (tp - 1) / tp * tokens * h * BF16, tp) if tp > 1 else 0.0)
    per_stage: list[StageTime] = []
    first = 0
    for stage, n_layers in enumerate(par.stage_layers):
        layers = ratios[first : first + n_layers]
        first += n_layers
        compute = sum(cal.layer_s[r] for r in layers) / tp
        n_tp = n_ep = n_layers
        if stage == pp - 1:
            mtp = ratios[model.num_layers : model.num_layers + model.mtp_num_layers]
            compute += head + sum(cal.layer_s[r] / tp + head for r in mtp)
            n_tp += len(mtp)
            n_ep += len(mtp)
        parts = {"compute_s": compute, "tp_s": n_tp * tp_layer, "ep_s": n_ep * ep_layer, "pp_s": pp_mb}
        per_stage.append(
            {"stage": stage, **{k: round(v, 5) for k, v in parts.items()}, "total_s": round(sum(parts.values()), 5)}  # type: ignore[typeddict-item]
        )
    m = par.microbatches
    times = [st["total_s"] for st in per_stage]
    pipeline = sum(times) + (m - 1) * max(times)
    grad_bytes = 4 if cfg.optim.accumulate_allreduce_grads_in_fp32 else 2
    dp_s = opt_s = 0.0
    for dense, expert in params.stage_counts(par.stage_layers):
        dense_gpu, expert_gpu = dense / tp, expert / ep
        if lay.use_distributed_optimizer:
            moved = (grad_bytes + BF16) * ((dp - 1) / dp * dense_gpu + (edp - 1) / edp * expert_gpu)
            shard = dense_gpu / dp + expert_gpu / edp
        else:  # an all-reduce of the grads, every rank updates all its parameters
            moved = 2 * grad_bytes * ((dp - 1) / dp * dense_gpu + (edp - 1) / edp * expert_gpu)
            shard = dense_gpu + expert_gpu
        dp_s = max(dp_s, seconds(moved, stage_ranks))
        opt_s = max(opt_s, cal.optimizer_s_per_gparam * shard / 1e9)
    step = pipeline + dp_s + opt_s
    tps = cfg.optim.global_batch_size * cfg.data.seq_length / (step * par.world_size)
    reference: dict[str, object] = {
        "layout": cal.reference_layout,
        "tokens_per_s_per_gpu": cal.reference_tokens_per_s_per_gpu,
        "validated_error": cal.validated_error,
    }
    if lay.name == cal.reference_layout and cal.reference_tokens_per_s_per_gpu:
        reference["error"] = round(tps / cal.reference_tokens_per_s_per_gpu - 1, 4)
    return {
        "predicted": True,
        "calibration": cal.name,
        "source": cal.source,
        "per_stage": per_stage,
        "pipeline_s": round(pipeline, 4),
        "bubble_fraction": round(1 - m * max(times) / pipeline, 4),
        "dp_s": round(dp_s, 4),
        "optimizer_s": round(opt_s, 4),
        "step_s": round(step, 4),
        "tokens_per_s_per_gpu": round(tps, 2),
        "mfu": round(6 * params.active_per_token * tps / cl.gpu_peak_bf16_flops, 4),
        "reference": reference,
    }
