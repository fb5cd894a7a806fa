"""One rank of a ``launcher=local-cpu`` run: the training loop of the tiny DeepSeek-V4 on CPU.

The story of a step (the recipe's optimizer semantics, Megatron's definitions):

1. every DP rank takes its share of the global batch (``optim.global_batch_size`` rows, ``layout.micro_batch_size``
   rows per microbatch) from the fixed rows, in the loader's deterministic order;
2. loss = sum over supervised tokens of cross-entropy / supervised tokens of the whole global batch, over all
   ranks (``--calculate-per-token-loss``); gradients are summed over ranks (gloo all-reduce), so the update is
   the same for any DP size;
3. gradient clipping at ``optim.clip_grad`` (Megatron's default 1.0; ``grad_norm`` is the norm before clipping);
4. Adam with decoupled weight decay on 2-D weights (Megatron leaves biases and norms undecayed), betas from
   the config; the learning rate follows Megatron's ``OptimizerParamScheduler``: linear warm-up from 0 over
   ``lr_warmup_fraction x steps`` steps (a float, as Megatron), then cosine from ``lr`` to ``min_lr``, evaluated at the number
   of completed steps;
5. router gates frozen (``--moe-router-freeze-gate``); the expert bias is never updated
   (``--freeze-e-score-correction-bias``).

Rank 0 appends one line per step to ``metrics.jsonl`` (keys of :mod:`trainer.report.metrics`). Every rank writes its
probe to ``probe-rank-N.json``. Run as ``python -m trainer.launch.cpu_worker RUN_DIR RANK WORLD ROWS_DIR``.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from pathlib import Path

from trainer.publish import atomic_write
from trainer.record.record import canonical_json


def megatron_lr(
    step_done: int, steps: int, lr: float, min_lr: float, warmup_fraction: float, style: str = "cosine"
) -> float:
    """Learning rate after ``step_done`` completed steps (Megatron-LM 37f91617
    ``megatron/core/optimizer_param_scheduler.py`` ``OptimizerParamScheduler.get_lr``, for the decay ``style`` of
    ``--lr-decay-style``: ``constant``, ``linear`` or ``cosine``).

    Warm-up: ``lr x step_done / warmup`` for ``step_done <= warmup`` with ``warmup = fraction x steps`` (a
    float, as Megatron's ``lr_warmup_steps = lr_warmup_fraction x lr_decay_steps``; the first step runs at 0
    when there is warm-up); then ``lr`` (constant), or ``min_lr + (lr - min_lr) x c`` with
    ``r = (step_done - warmup) / (steps - warmup)`` and ``c = 1 - r`` (linear) or ``0.5 x (1 + cos(pi x r))``
    (cosine). Raises ``ValueError`` for another style (Megatron's inverse-square-root and WSD are not followed).
    """
    from trainer.compose.checks import LR_DECAY_STYLES

    if style not in LR_DECAY_STYLES:
        raise ValueError(f"lr_decay_style {style!r}: expected one of {', '.join(LR_DECAY_STYLES)}")
    warmup = warmup_fraction * steps
    if warmup > 0 and step_done <= warmup:
        return lr * step_done / warmup
    if style == "constant":
        return lr
    if steps <= warmup:
        return min_lr
    ratio = min(1.0, (step_done - warmup) / (steps - warmup))
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + (lr - min_lr) * coeff


def main(argv=None) -> int:
    """Train one rank; ``argv`` (default ``sys.argv[1:]``) is ``RUN_DIR RANK WORLD ROWS_DIR``. Returns 0.

    Reads ``RUN_DIR/config.yaml`` and the fixed rows in ``ROWS_DIR``; with ``WORLD > 1`` joins a gloo group
    through the file ``RUN_DIR/.rendezvous``. Writes ``RUN_DIR/probe-rank-RANK.json`` (every rank); rank 0
    appends one line per step to ``RUN_DIR/metrics.jsonl`` (``tokens``/``supervised_tokens`` summed over
    ranks, ``step_time_s`` wall seconds, ``max_memory_bytes`` peak RSS in bytes, max over ranks) and prints it.
    Raises ``IndexError``/``ValueError`` on a short or non-integer ``argv``, :class:`UserError` on a bad
    config or rows.
    """
    argv = sys.argv[1:] if argv is None else argv
    run_dir, rank, world, rows_dir = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])

    import torch
    import torch.distributed as dist

    from trainer.compose.compose import validate
    from trainer.compose.plan import run_steps
    from trainer.data import Rows
    from trainer.models.deepseek_v4_hf import build_model, freeze_router
    from trainer.probe import probe
    from trainer.record.rundir import CONFIG, METRICS, load_config, probe_rank
    from trainer.report.metrics import dumps_row

    cfg = validate(load_config(run_dir / CONFIG))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{run_dir / '.rendezvous'}", rank=rank, world_size=world)
    atomic_write(run_dir / probe_rank(rank), canonical_json(probe()))

    model = build_model(cfg.model, cfg.launcher.seed)
    freeze_router(model, cfg.optim.moe_router_freeze_gate, cfg.optim.freeze_e_score_correction_bias)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0,
        betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
        eps=1e-8,
    )
    steps = run_steps(cfg)
    rows = Rows(rows_dir)  # verified against its manifest
    mbs = cfg.layout.micro_batch_size
    per_step = cfg.optim.global_batch_size // (mbs * world)  # microbatches per rank per step
    per_epoch = rows.num_batches(mbs, world)

    def step_batches(step_index: int):
        """This rank's microbatches of step ``step_index`` (0-based); epochs wrap around the rows."""
        out = []
        for k in range(per_step):
            epoch, index = divmod(step_index * per_step + k, per_epoch)
            out.append(next(rows.batches(mbs, dp_rank=rank, dp_size=world, epoch=epoch, start=index)))
        return out

    params = [p for p in model.parameters() if p.requires_grad]
    metrics = (run_dir / METRICS).open("a") if rank == 0 else None
    for step in range(1, steps + 1):
        start = time.perf_counter()
        lr = megatron_lr(
            step - 1, steps, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_fraction, cfg.optim.lr_decay_style
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        microbatches = step_batches(step - 1)
        counts = torch.tensor(
            [
                float(sum(int(mb.loss_mask.sum()) for mb in microbatches)),
                float(sum(mb.tokens.size for mb in microbatches)),
            ]
        )
        if world > 1:
            dist.all_reduce(counts)
        supervised, tokens = counts.tolist()
        loss_sum = torch.zeros(())
        optimizer.zero_grad(set_to_none=True)
        for mb in microbatches:
            input_ids = torch.from_numpy(mb.tokens).long()
            labels = torch.from_numpy(mb.labels).long()
            mask = torch.from_numpy(mb.loss_mask).float()
            labels = labels.clamp(min=0)  # IGNORE_INDEX positions carry mask 0
            logits = model(input_ids=input_ids, position_ids=torch.from_numpy(mb.position_ids).long()).logits
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none"
            )
            mb_loss = (ce * mask.reshape(-1)).sum()
            (mb_loss / max(supervised, 1.0)).backward()
            loss_sum += mb_loss.detach()
        if world > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            dist.all_reduce(loss_sum)
        # Megatron: clip_grad 0 means no clipping (the norm is still reported)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, cfg.optim.clip_grad if cfg.optim.clip_grad > 0 else float("inf")
        )
        optimizer.step()
        rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)])
        if world > 1:
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        elapsed = time.perf_counter() - start
        if metrics is not None:
            row = {
                "step": step,
                "lm_loss": float(loss_sum) / max(supervised, 1.0),
                "grad_norm": float(grad_norm),
                "lr": lr,
                "tokens": tokens,
                "supervised_tokens": supervised,
                "step_time_s": elapsed,
                "max_memory_bytes": float(rss),
            }
            metrics.write(dumps_row(row) + "\n")
            metrics.flush()
            print(
                f"step {step}/{steps} loss {row['lm_loss']:.4f} grad_norm {row['grad_norm']:.3f} lr {lr:.3g} "
                f"{elapsed:.2f} s",
                flush=True,
            )
    if metrics is not None:
        metrics.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
