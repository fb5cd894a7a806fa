"""One rank of a ``launcher=local-megatron`` run: the composed config trained with megatron-core on local GPUs.

Started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment) as
``python -m trainer.launch.megatron_worker RUN_DIR ROWS_DIR``. The story of the run:

1. NCCL process group; ``parallel_state.initialize_model_parallel`` with the layout's TP/PP/CP/EP/ETP
   (Megatron's default rank order ``tp-cp-ep-dp-pp``, the one ``trainer.plan`` places ranks by);
2. ``TransformerConfig`` from the ``model`` and ``layout`` configs (bf16, RMSNorm, SwiGLU, no linear biases,
   RoPE, MoE with ``num_experts`` routed experts + a shared expert, top-k, expert bias with its update rate
   set to 0 = frozen, the layout's dispatcher, full uniform recompute, uneven first/last pipeline stages,
   per-token loss); a ``GPTModel`` with megatron-core's local (non-TransformerEngine) layer spec;
3. router gates frozen (``--moe-router-freeze-gate``); megatron-core's DDP (fp32 grad reduction with
   ``accumulate_allreduce_grads_in_fp32``) and its optimizer (Adam, distributed optimizer from the layout,
   clip 1.0); the learning rate of :func:`trainer.launch.cpu_worker.megatron_lr` set before every step;
4. per step: this DP rank's microbatches from the fixed rows (:class:`trainer.data.Rows`),
   ``get_forward_backward_func()`` (1F1B when PP > 1), ``optimizer.step()``; one ``metrics.jsonl`` line
   written by the first rank of the last pipeline stage.

What the proxy lacks against DeepSeek-V4 (they need TransformerEngine or live in miles): multi-latent
attention, the V4 compressed-sparse / heavily-compressed attention with its indexer, hyper-connections,
hash routing, the ``sqrtsoftplus`` router score (megatron-core 0.16 has softmax and sigmoid), MTP. TP > 1
needs sequence parallel for MoE, which the local spec's torch norms do not support.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    """Train one torchrun rank with megatron-core; ``argv`` (default ``sys.argv[1:]``) is ``RUN_DIR ROWS_DIR``,
    and ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` come from the environment (``KeyError`` if unset). Returns 0.

    Reads ``RUN_DIR/config.yaml`` and the fixed rows in ``ROWS_DIR``. Writes ``RUN_DIR/probe-rank-RANK.json``
    (every rank); the first rank of the last pipeline stage (DP rank 0, TP rank 0) appends one line per step
    to ``RUN_DIR/metrics.jsonl`` (``tokens`` = global batch x seq length, ``step_time_s`` wall seconds,
    ``max_memory_bytes`` = ``torch.cuda.max_memory_allocated`` in bytes, max over ranks) and prints it.
    """
    argv = sys.argv[1:] if argv is None else argv
    run_dir, rows_dir = Path(argv[0]), Path(argv[1])
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer.compose import validate
    from trainer.data import Rows
    from trainer.metrics import dumps_row
    from trainer.launch.cpu_worker import megatron_lr
    from trainer.probe import probe
    from trainer.record import atomic_write, canonical_json
    from trainer.rundir import load_config

    cfg = validate(load_config(run_dir / "config.yaml"))
    lay, m, optim = cfg.layout, cfg.model, cfg.optim
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local_rank))
    # NCCL loads its net plugin with the first communicator: probe after one collective, so the probe sees it
    dist.all_reduce(torch.zeros(1, device="cuda"))
    atomic_write(run_dir / f"probe-rank-{rank}.json", canonical_json(probe()))

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16.0/0.16.1 NameError without TransformerEngine

    ps.initialize_model_parallel(
        tensor_model_parallel_size=lay.tensor_model_parallel_size,
        pipeline_model_parallel_size=lay.pipeline_model_parallel_size,
        context_parallel_size=lay.context_parallel_size,
        expert_model_parallel_size=lay.expert_model_parallel_size,
        expert_tensor_parallel_size=lay.expert_tensor_parallel_size,
        distributed_timeout_minutes=cfg.launcher.distributed_timeout_minutes,
    )
    torch.manual_seed(cfg.launcher.seed)
    model_parallel_cuda_manual_seed(cfg.launcher.seed)
    seq = cfg.data.seq_length
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=0.0 if optim.freeze_e_score_correction_bias else 1e-3,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type=lay.moe_token_dispatcher_type,
        moe_grouped_gemm=False,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu,
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bf16=optim.bf16,
        params_dtype=torch.bfloat16 if optim.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if optim.bf16 else torch.float32,
        tensor_model_parallel_size=lay.tensor_model_parallel_size,
        pipeline_model_parallel_size=lay.pipeline_model_parallel_size,
        context_parallel_size=lay.context_parallel_size,
        expert_model_parallel_size=lay.expert_model_parallel_size,
        expert_tensor_parallel_size=lay.expert_tensor_parallel_size,
        sequence_parallel=lay.sequence_parallel,
        num_layers_in_first_pipeline_stage=lay.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=lay.decoder_last_pipeline_num_layers,
        recompute_granularity=lay.recompute_granularity,
        recompute_method=lay.recompute_method,
        recompute_num_layers=lay.recompute_num_layers,
        calculate_per_token_loss=optim.calculate_per_token_loss,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=m.num_experts, moe_grouped_gemm=False, qk_layernorm=m.qk_layernorm, normalization=m.normalization
        ),
        vocab_size=m.vocab_size,
        max_sequence_length=seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
    )
    frozen = 0
    for name, param in model.named_parameters():
        if optim.moe_router_freeze_gate and name.endswith("router.weight"):
            param.requires_grad_(False)
            frozen += param.numel()
    model.cuda(torch.cuda.current_device())
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=optim.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=lay.use_distributed_optimizer,
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optim.optimizer,
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            bf16=optim.bf16,
            use_distributed_optimizer=lay.use_distributed_optimizer,
            clip_grad=optim.clip_grad,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    rows = Rows(rows_dir)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs = lay.micro_batch_size
    num_micro = optim.global_batch_size // (mbs * dp_size)
    per_epoch = rows.num_batches(mbs, dp_size)
    steps = cfg.launcher.steps or optim.num_rollout * (optim.rollout_batch_size // optim.global_batch_size)
    writer = ps.is_pipeline_last_stage() and dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
    metrics = (run_dir / "metrics.jsonl").open("a") if writer else None
    if writer:
        print(f"megatron-core: {sum(p.numel() for p in model.parameters()):,} parameters on this rank, "
              f"{frozen:,} frozen router weights; {num_micro} microbatches per step", flush=True)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = torch.from_numpy(batch.tokens).cuda(non_blocking=True)
        labels = torch.from_numpy(batch.labels).clamp(min=0).cuda(non_blocking=True)
        mask = torch.from_numpy(batch.loss_mask).float().cuda(non_blocking=True)
        positions = torch.from_numpy(batch.position_ids).cuda(non_blocking=True)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(output_tensor):
            losses = output_tensor.float().reshape(-1)
            flat = mask.reshape(-1)
            loss = (losses * flat).sum()
            count = flat.sum().to(torch.int)
            return loss, count, {"lm loss": torch.stack([loss.detach(), flat.sum().detach()])}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    for step in range(1, steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        lr = megatron_lr(step - 1, steps, optim.lr, optim.min_lr, optim.lr_warmup_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = []
        for k in range(num_micro):
            epoch, index = divmod((step - 1) * num_micro + k, per_epoch)
            batches.append(next(rows.batches(mbs, dp_rank=dp_rank, dp_size=dp_size, epoch=epoch, start=index)))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=num_micro,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        totals = torch.zeros(2, device="cuda")
        if ps.is_pipeline_last_stage():
            for item in reduced:
                totals += item["lm loss"].float()
            dist.all_reduce(totals, group=ps.get_data_parallel_group())
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        memory = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        if metrics is not None:
            loss, supervised = totals.tolist()
            row = {
                "step": step,
                "lm_loss": loss / max(supervised, 1.0),
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "lr": lr,
                "tokens": float(optim.global_batch_size * seq),
                "supervised_tokens": supervised,
                "step_time_s": elapsed,
                "max_memory_bytes": float(memory.item()),
            }
            metrics.write(dumps_row(row) + "\n")
            metrics.flush()
            print(f"step {step}/{steps} loss {row['lm_loss']:.4f} grad_norm {row['grad_norm']} lr {lr:.3g} "
                  f"{elapsed:.3f} s", flush=True)
    if metrics is not None:
        metrics.close()
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
