"""The baseline for the bundle's Megatron worker: the same model trained by a plain Megatron-LM script.

Nothing of the bundle is imported: Megatron-LM's own argument parser and validation, ``TransformerConfig``
from ``core_transformer_config_from_args``, ``get_gpt_decoder_block_spec`` (TransformerEngine when
``--transformer-impl transformer_engine``), ``GPTModel``, megatron-core's DDP, optimizer and
``forward_backward_func``; rows read with pyarrow from a fixed-rows parquet in file order (what the bundle's
worker reads on one GPU), labels = next token, loss mask shifted the same way. Per step it appends
``{"step", "lm_loss", "step_time_s", "tokens", "max_memory_bytes"}`` to ``--out`` (JSON lines); the learning
rate is Megatron's constant ``--lr`` (schedule differences do not change step time).

Usage (one GPU, torchrun): python -m torch.distributed.run --nproc-per-node 1 bench/megatron_bare.py
    --rows ROWS.parquet --out METRICS.jsonl MEGATRON_ARGS...  (the run's megatron.json argv)
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or "--rows" not in sys.argv or "--out" not in sys.argv:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    own: dict[str, str] = {}
    argv = sys.argv[1:]
    for flag in ("--rows", "--out"):
        i = argv.index(flag)
        own[flag] = argv[i + 1]
        del argv[i : i + 2]
    sys.argv = [sys.argv[0]] + argv

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

    args = parse_args()
    args.padded_vocab_size = _vocab_size_with_padding(args.vocab_size, args)
    validate_args(args)
    set_args(args)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ps.initialize_model_parallel()
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)

    config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=use_te),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    ).cuda()
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            bf16=args.bf16,
            use_distributed_optimizer=args.use_distributed_optimizer,
            clip_grad=args.clip_grad,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    table = pq.read_table(own["--rows"], columns=["tokens", "loss_mask"])
    tokens_all = np.stack(table.column("tokens").to_numpy(zero_copy_only=False))
    mask_all = np.stack(table.column("loss_mask").to_numpy(zero_copy_only=False))
    seq, mbs = args.seq_length, args.micro_batch_size
    num_micro = args.global_batch_size // mbs
    positions = torch.arange(seq, device="cuda").expand(mbs, seq)

    def microbatch(index):
        rows = slice(index * mbs, (index + 1) * mbs)
        tokens = torch.from_numpy(tokens_all[rows].astype(np.int64)).cuda()
        labels = torch.zeros_like(tokens)
        labels[:, :-1] = tokens[:, 1:]
        mask = torch.zeros_like(tokens, dtype=torch.float32)
        mask[:, :-1] = torch.from_numpy(mask_all[rows, 1:].astype(np.float32)).cuda()
        return tokens, labels, mask

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)
        output = model(tokens, positions, None, labels=labels, loss_mask=mask)

        def loss_func(output_tensor):
            loss = (output_tensor.float().reshape(-1) * mask.reshape(-1)).sum()
            count = mask.sum().to(torch.int)
            return loss, count, {"lm loss": torch.stack([loss.detach(), mask.sum().detach()])}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    with open(own["--out"], "w") as out:
        for step in range(1, args.train_iters + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            batches = [microbatch((step - 1) * num_micro + k) for k in range(num_micro)]
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
            optimizer.step()
            totals = sum(item["lm loss"].float() for item in reduced)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            row = {
                "step": step,
                "lm_loss": float(totals[0] / totals[1]),
                "step_time_s": elapsed,
                "tokens": float(args.global_batch_size * seq),
                "max_memory_bytes": float(torch.cuda.max_memory_allocated()),
            }
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"step {step} loss {row['lm_loss']:.4f} {elapsed:.3f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
