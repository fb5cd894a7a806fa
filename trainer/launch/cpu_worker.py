"""One rank of a ``launcher=local-cpu`` run: the training loop of the tiny DeepSeek-V4 on CPU.

The story of a step (the recipe's optimizer semantics, Megatron's definitions):

1. every DP rank takes its share of the global batch (``optim.global_batch_size`` rows, ``layout.micro_batch_size``
   rows per microbatch) from the fixed rows, in the loader's deterministic order
   (:class:`trainer.launch.steps.Schedule`);
2. loss = sum over supervised tokens of cross-entropy / supervised tokens of the whole global batch, over all
   ranks (``--calculate-per-token-loss``); with DP > 1 the model is wrapped in PyTorch's
   ``DistributedDataParallel`` (gloo), which all-reduces the gradients in one pass per step (the microbatches
   before the last accumulate under ``no_sync``) and averages them, so each rank backpropagates ``world`` times its
   loss: the update is the sum over ranks, the same for any DP size;
3. gradient clipping at ``optim.clip_grad`` (Megatron's default 1.0; ``grad_norm`` is the norm before clipping);
4. Adam with decoupled weight decay on 2-D weights (Megatron leaves biases and norms undecayed), betas from
   the config; the learning rate follows Megatron's ``OptimizerParamScheduler``: linear warm-up from 0 over
   ``lr_warmup_fraction x steps`` steps (a float, as Megatron), then cosine from ``lr`` to ``min_lr``, evaluated at
   the number of completed steps (:func:`trainer.launch.steps.megatron_lr`);
5. router gates frozen (``--moe-router-freeze-gate``); the expert bias is never updated
   (``--freeze-e-score-correction-bias``).

Rank 0 appends one line per step to ``metrics.jsonl`` (keys of :mod:`trainer.report.metrics`, through
:class:`trainer.launch.steps.MetricsWriter`). Every rank writes its probe to ``probe-rank-N.json``. Run as
``python -m trainer.launch.cpu_worker RUN_DIR RANK WORLD ROWS_DIR``; :func:`main` tells the run's story (parse,
join the group, build, train, finish) and the functions after it are its steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.compose.compose import validate
from trainer.compose.plan import run_steps
from trainer.compose.schema import OptimConfig, TrainConfig
from trainer.data import Batch, Rows
from trainer.errors import UserError
from trainer.launch import checkpoint
from trainer.launch.steps import MetricsWriter, Schedule, megatron_lr, per_token_loss, step_line
from trainer.models import deepseek_v4_hf
from trainer.probe import distribution_pairs, probe
from trainer.publish import atomic_write, canonical_json
from trainer.record.rundir import CONFIG, METRICS, load_config, probe_rank, read_record
from trainer.report.metrics import Step

NODE_ENV = "RECIPE_BUNDLE_NODE"  # set by trainer.launch.ray_workers: the Ray node of this rank
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt(3) parameter numbers, glibc's malloc.h

if TYPE_CHECKING:
    import torch

__all__ = ["main", "megatron_lr"]  # megatron_lr: the schedule's home is trainer.launch.steps


def main(argv: list[str] | None = None) -> int:
    """Train one rank; ``argv`` (default ``sys.argv[1:]``) is ``RUN_DIR RANK WORLD ROWS_DIR``. Returns 0.

    Reads ``RUN_DIR/config.yaml`` and the fixed rows in ``ROWS_DIR``; with ``WORLD > 1`` joins a gloo group
    (:func:`rendezvous`: TCP at ``MASTER_ADDR:MASTER_PORT`` when set, else the file ``RUN_DIR/.rendezvous``).
    A ``--resume`` continues from the checkpoint ``RUN_DIR/record.json`` names in ``resumed_from``, its bytes
    checked against the sha256 there (:func:`trainer.launch.checkpoint.load`).
    Writes ``RUN_DIR/probe-rank-RANK.json`` (every rank); rank 0 appends one line per step to
    ``RUN_DIR/metrics.jsonl`` (``tokens``/``supervised_tokens`` summed over ranks, ``step_time_s`` wall seconds,
    ``max_memory_bytes`` peak RSS in bytes, max over ranks) and prints it.
    Raises ``IndexError``/``ValueError`` on a short or non-integer ``argv``, :class:`UserError` on a bad
    config, record, rows or checkpoint.
    """
    run_dir, rank, world, rows_dir = parse_argv(sys.argv[1:] if argv is None else argv)
    keep_freed_memory()
    with collector_paused():  # torch's and transformers' imports, the model: long-lived objects only
        cfg = validate(load_config(run_dir / CONFIG))
        join_group(run_dir, rank, world)
        model = data_parallel(build_model(cfg), world)
        optimizer = build_optimizer(model, cfg.optim)
    schedule = Schedule.of(Rows(rows_dir), cfg.optim.global_batch_size, cfg.layout.micro_batch_size, rank, world)
    # a --resume: the steps of the checkpoint the record names (its sha256 checked), never the tracker's
    done = checkpoint.load(run_dir, model, optimizer, (read_record(run_dir) or {}).get("resumed_from"))
    if done and rank == 0:
        print(f"resumed from {checkpoint.state_path(done)}: steps 1-{done} done", flush=True)
    with MetricsWriter(run_dir / METRICS if rank == 0 else None) as metrics:
        train(
            model,
            optimizer,
            schedule,
            cfg.optim,
            run_steps(cfg),
            metrics,
            first=done + 1,
            after_step=saver(run_dir, rank, world, cfg.launcher.save_interval, model, optimizer),
        )
    finish(world)
    return 0


def parse_argv(argv: list[str]) -> tuple[Path, int, int, Path]:
    """``RUN_DIR RANK WORLD ROWS_DIR`` as (run directory, rank, world size, rows directory). Raises
    ``IndexError`` for fewer than four words, ``ValueError`` for a rank or world that is not an integer."""
    return Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])


def keep_freed_memory() -> bool:
    """Have the C library's malloc keep freed memory for the next step instead of returning it to the kernel
    (mallopt(3), glibc; for the life of the process): no ``mmap`` of its own for large blocks on the main thread's
    heap (``M_MMAP_MAX`` 0) and no trimming of the heap below 2 GiB free (``M_TRIM_THRESHOLD``). Each microbatch
    allocates and frees tensors of 10 to 130 MB (the logits over the 129,280-token vocabulary, their gradient);
    glibc maps every block above 32 MB afresh, and the kernel zero-fills it page by page: 45% of a row's time on
    this machine, 3% kept (bench/RESULTS.md). The heap settles after a step or two (glibc before 2.38 asks
    ``posix_memalign`` for size plus alignment, so a freed block is not always reused the first time). Peak RSS
    is about 10% higher. Returns whether both settings took; False (nothing changed) where the C library has
    no ``mallopt``."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with Python's cyclic garbage collector off, then move every object alive at its end to the
    permanent generation (``gc.freeze``) and turn the collector back on. A rank's start-up (importing torch and
    transformers, building the model) makes hundreds of thousands of long-lived objects, and each full collection
    walked them all again: 4.00 s of CPU with the collector on, 3.12 s paused (bench/RESULTS.md). Frozen, they are
    never walked again; cycles made later are collected. Garbage cycles made in the block (about 25,000 small
    objects, no tensors) are frozen with the rest and stay until the process ends."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def tcp_url(host: str, port: int) -> str:
    """``tcp://HOST:PORT``, an IPv6 address in brackets (RFC 3986 section 3.2.2: ``tcp://[::1]:29500``)."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def rendezvous(run_dir: Path, environ: dict[str, str] | None = None) -> str:
    """torch.distributed's ``init_method``: ``tcp://MASTER_ADDR:MASTER_PORT`` when both are set (torchrun's and
    Megatron's names; a launcher across nodes sets them to rank 0's host), else the file ``run_dir/.rendezvous``
    (one machine, or a file system every node shares). Raises ``ValueError`` for a MASTER_PORT that is not a
    port number."""
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"MASTER_PORT {port!r}: expected a TCP port number (1-65535)")
        return tcp_url(addr, int(port))
    return f"file://{run_dir / '.rendezvous'}"


def join_group(run_dir: Path, rank: int, world: int) -> None:
    """Start this rank: torch gets the machine's CPUs divided by ``world`` as threads (at least 1); with
    ``world`` > 1 a gloo group through :func:`rendezvous`; the probe in ``probe-rank-RANK.json`` (with ``node``
    when the launcher names the rank's node in ``RECIPE_BUNDLE_NODE``, and every installed distribution, which
    ``trainer verify`` compares with an image's stamped lock on every rank)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=rendezvous(run_dir), rank=rank, world_size=world)
    info = probe()
    info["distributions"] = distribution_pairs()
    if os.environ.get(NODE_ENV):  # the cluster node this rank runs on, as its launcher names it
        info["node"] = os.environ[NODE_ENV]
    atomic_write(run_dir / probe_rank(rank), canonical_json(info))


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """transformers' DeepSeek-V4 of ``cfg.model`` in float32, seeded by ``launcher.seed``
    (:func:`trainer.models.deepseek_v4_hf.build_model`), router gates frozen as ``optim`` says."""
    model: torch.nn.Module = deepseek_v4_hf.build_model(cfg.model, cfg.launcher.seed)
    deepseek_v4_hf.freeze_router(model, cfg.optim.moe_router_freeze_gate, cfg.optim.freeze_e_score_correction_bias)
    return model


def data_parallel(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """``model`` itself for ``world`` 1, else ``torch.nn.parallel.DistributedDataParallel`` over the default (gloo)
    group, one reduction pass per step (its buckets, about 33 MB each for the tiny model). ``find_unused_parameters``:
    some parameters take no part in a forward (the sparse-attention indexer's, idle at short sequences);
    :func:`train_step` gives them zero gradients as Megatron's contiguous gradient buffer does.
    ``broadcast_buffers`` off: the buffers (e.g. the hash router's token-to-expert table) are made from the same
    seed on every rank and never change."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters: ``optim.weight_decay`` on the 2-D weights, none on biases and
    norms (as Megatron), betas from ``optim``, eps 1e-8; the learning rate starts at 0 (each step sets it)."""
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=1e-8,
    )


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    optim: OptimConfig,
    steps: int,
    metrics: MetricsWriter,
    first: int = 1,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """Run optimizer steps ``first`` .. ``steps`` (1-based; ``first`` > 1 after a checkpoint of steps before it)
    over ``schedule``'s microbatches, the learning rate of :func:`megatron_lr` set before each, hand each step's
    row to :func:`write_metrics`, then call ``after_step(step)`` (:func:`saver`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    world = schedule.dp_size
    for step in range(first, steps + 1):
        start = time.perf_counter()
        lr = megatron_lr(step - 1, steps, optim.lr, optim.min_lr, optim.lr_warmup_fraction, optim.lr_decay_style)
        for group in optimizer.param_groups:
            group["lr"] = lr
        microbatches = schedule.microbatches(step - 1)
        lm_loss, grad_norm, tokens, supervised = train_step(
            model, optimizer, params, microbatches, optim.clip_grad, world
        )
        rss = peak_rss_bytes(world)
        elapsed = time.perf_counter() - start
        write_metrics(metrics, Step(step, lm_loss, grad_norm, lr, tokens, supervised, elapsed, rss), steps)
        if after_step is not None:
            after_step(step)


def saver(
    run_dir: Path, rank: int, world: int, interval: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[int], None] | None:
    """What runs after each step: every ``interval`` steps (``launcher.save_interval``, Megatron's
    ``--save-interval``; 0: never, None returned) rank 0 saves a checkpoint (:func:`trainer.launch.checkpoint.save`;
    the ranks are replicas) and, with ``world`` > 1, every rank waits for it at a barrier, so that no rank is a
    step past the latest checkpoint when it is written."""
    if interval <= 0:
        return None

    def after(step: int) -> None:
        if step % interval:
            return
        if rank == 0:
            checkpoint.save(run_dir, step, model, optimizer)
            print(f"saved checkpoint {checkpoint.state_path(step)}", flush=True)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()

    return after


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    microbatches: list[Batch],
    clip_grad: float,
    world: int,
) -> tuple[float, float, float, float]:
    """One optimizer step over this rank's ``microbatches`` (each ``(B, S)``): the per-token loss of the whole
    global batch backward, gradients summed over the ``world`` ranks (by :func:`data_parallel`'s DDP during the
    last microbatch's backward), clipped at ``clip_grad`` (0: not clipped, the norm still reported),
    ``optimizer.step()``. Returns ``(lm_loss, grad_norm, tokens, supervised_tokens)``:
    the loss per supervised token, the gradient norm before clipping, and the step's tokens and supervised tokens
    summed over ranks."""
    import torch
    import torch.distributed as dist

    supervised, tokens = token_counts(microbatches, world)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = backward(model, microbatches, supervised, world)
    for p in params:  # Megatron's gradient buffer is zeroed, not absent: an unused parameter still steps (decay)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if world > 1:
        dist.all_reduce(loss_sum)
    # Megatron: clip_grad 0 means no clipping (the norm is still reported)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
    optimizer.step()
    return per_token_loss(float(loss_sum), supervised), float(grad_norm), tokens, supervised


def token_counts(microbatches: list[Batch], world: int) -> tuple[float, float]:
    """``(supervised tokens, tokens)`` of the step's ``microbatches``, summed over the ``world`` ranks (floats)."""
    import torch
    import torch.distributed as dist

    counts = torch.tensor(
        [
            float(sum(int(mb.loss_mask.sum()) for mb in microbatches)),
            float(sum(mb.tokens.size for mb in microbatches)),
        ]
    )
    if world > 1:
        dist.all_reduce(counts)
    supervised, tokens = counts.tolist()
    return supervised, tokens


def backward(model: torch.nn.Module, microbatches: list[Batch], supervised: float, world: int = 1) -> torch.Tensor:
    """Forward and backward of each microbatch: the summed cross-entropy of its supervised positions (``loss_mask``
    1) divided by the global batch's ``supervised`` tokens (at least 1) and multiplied by ``world`` (DDP averages
    over the ranks) is backpropagated, so the gradients add up to the per-token loss's. Under DDP the gradients are
    synchronised in the last microbatch's backward only (the others run under ``model.no_sync()``). Returns this
    rank's summed cross-entropy (a 0-d tensor, nats)."""
    import torch

    loss_sum = torch.zeros(())
    no_sync = getattr(model, "no_sync", None)  # DistributedDataParallel's
    for index, mb in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            loss_sum += _microbatch_backward(model, mb, world / max(supervised, 1.0))
    return loss_sum


def _microbatch_backward(model: torch.nn.Module, mb: Batch, scale: float) -> torch.Tensor:
    """Forward of one microbatch, backward of its summed supervised cross-entropy times ``scale``; returns the
    summed cross-entropy (0-d, detached, nats). Only the supervised positions (``loss_mask`` 1) are projected onto
    the vocabulary (transformers' ``logits_to_keep`` as a boolean ``(B, S)`` mask: ``(supervised, vocab)``
    logits); the others add nothing to the loss, and the 129,280-column projection is most of a row's cost here.
    The loss and gradients equal those of all positions' logits with the masked sum, up to float rounding."""
    import torch

    keep = torch.from_numpy(mb.loss_mask) > 0
    labels = torch.from_numpy(mb.labels).long()[keep]
    logits = model(
        input_ids=torch.from_numpy(mb.tokens).long(),
        position_ids=torch.from_numpy(mb.position_ids).long(),
        logits_to_keep=keep,
    ).logits
    mb_loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
    (mb_loss * scale).backward()
    return mb_loss.detach()


def peak_rss_bytes(world: int) -> float:
    """Peak resident memory of this process (``ru_maxrss``, KiB on Linux) in bytes, the maximum over the
    ``world`` ranks."""
    import torch
    import torch.distributed as dist

    rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)])
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return float(rss)


def write_metrics(metrics: MetricsWriter, row: Step, steps: int) -> None:
    """On the writing rank (rank 0): append ``row`` to ``metrics.jsonl`` and print its line (``grad_norm`` to 3
    decimals, the step time to 2)."""
    if metrics.writes:
        metrics.write(row)
        print(step_line(row, steps, grad_norm_spec=".3f", time_spec=".2f"), flush=True)


def finish(world: int) -> None:
    """Leave the gloo group (after a barrier: no rank exits while another still reduces) when ``world`` > 1."""
    import torch.distributed as dist

    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def entry(argv: list[str] | None = None) -> int:
    """:func:`main` as the process ``python -m trainer.launch.cpu_worker`` runs it: a :class:`UserError` (a
    checkpoint refused, a bad config or rows) is one line on stderr, ``cpu_worker: error: ...``, and its exit code
    (2), not a traceback; the host's reason for the run's end is that line (the last of the rank's log)."""
    try:
        return main(argv)
    except UserError as err:
        print(f"cpu_worker: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code


if __name__ == "__main__":
    raise SystemExit(entry())
