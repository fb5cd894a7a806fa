"""One rank of a ``launcher=local-megatron`` run: the composed config trained with Megatron-LM on local GPUs.

Started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment) as
``python -m trainer.launch.megatron_worker RUN_DIR ROWS_DIR``, with the verified Megatron-LM and miles
checkouts on ``PYTHONPATH`` (:mod:`trainer.launch.host.checkout`). The story of the run:

1. NCCL process group; the probe (after one collective, so it sees NCCL's net plugin);
2. Megatron-LM's arguments from the composed config (:func:`trainer.launch.megatron_args.megatron_argv`: the
   recipe's model, layout and optimizer flags, ``--transformer-impl`` from ``launcher.transformer_impl``,
   ``--attention-backend`` from ``launcher.attention_backend``), parsed and validated as miles does
   (:func:`megatron_args`); ``parallel_state.initialize_model_parallel`` with the parsed TP/PP/CP/EP/ETP (the
   worker reads the fields of :data:`WORKER_ARGS` from that namespace, and only the three of
   :data:`CONFIG_NOT_ARGS`, which miles and Megatron-LM overwrite there, from the config);
3. the model as miles' model provider builds it (:func:`build_model`): TransformerEngine's layers or the local
   spec, miles' DeepSeek-V4 spec (``--spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec``) when
   the model names it, an MTP block when ``model.mtp_num_layers`` > 0; the parameters the V4 code leaves for a
   checkpoint given initial values (:func:`init_checkpoint_only`: the recipe loads a checkpoint, this runs
   from random init);
4. router gates frozen; bf16 weights as Megatron's ``get_model`` makes them (``Float16Module``, miles'
   ``enforce_marked_param_dtypes``); megatron-core's DDP and optimizer with every field of their configs from the
   namespace, as Megatron-LM's own training makes them (:func:`ddp_config`, :func:`optimizer_config`); the
   learning rate of :func:`trainer.launch.steps.megatron_lr` set before every step;
5. per step: this DP rank's microbatches from the fixed rows (:class:`trainer.launch.steps.Schedule` over
   :class:`trainer.data.Rows`), ``get_forward_backward_func()`` (1F1B when PP > 1), ``optimizer.step()``; one
   ``metrics.jsonl`` line written by the first rank of the last pipeline stage
   (:class:`trainer.launch.steps.MetricsWriter`).

:func:`main` tells that story; each numbered part is a function after it (:func:`join_group`,
:func:`configure`, :func:`prepare_model`, :func:`wrap_ddp`, :func:`build_optimizer`, :func:`train`,
:func:`train_step`, :func:`write_metrics`, :func:`finish`).

Rank 0 writes ``RUN_DIR/megatron.json``: the implementation, attention backend, spec, argv and stand-ins
(:func:`hadamard_stand_in`) that ran (and,
after step 1, the cuDNN libraries mapped into the process); with ``launcher.profile_step`` N, step N runs
under ``torch.profiler`` and rank 0 writes ``RUN_DIR/profile-top-kernels.md`` (:func:`top_kernels_table`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.compose.compose import validate
from trainer.compose.plan import run_steps
from trainer.compose.schema import TrainConfig
from trainer.data import Batch, Rows
from trainer.launch.megatron_args import megatron_argv, resolve_transformer_impl
from trainer.launch.steps import MetricsWriter, Schedule, megatron_lr, per_token_loss, step_line
from trainer.models import hadamard
from trainer.models.deepseek_v4_hf import fill_tid2eid
from trainer.probe import mapped_libraries, probe
from trainer.publish import atomic_write, canonical_json
from trainer.record.rundir import CONFIG, MEGATRON, METRICS, PROFILE, load_config, probe_rank
from trainer.report.metrics import Step

if TYPE_CHECKING:
    import torch


def main(argv: list[str] | None = None) -> int:
    """Train one torchrun rank with megatron-core; ``argv`` (default ``sys.argv[1:]``) is ``RUN_DIR ROWS_DIR``,
    and ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` come from the environment (``KeyError`` if unset). Returns 0.

    Reads ``RUN_DIR/config.yaml`` and the fixed rows in ``ROWS_DIR``. Writes ``RUN_DIR/probe-rank-RANK.json``
    (every rank) and ``RUN_DIR/megatron.json`` (rank 0); the first rank of the last pipeline stage (DP rank 0,
    TP rank 0) appends one line per step to ``RUN_DIR/metrics.jsonl`` (``tokens`` = global batch x seq length,
    ``step_time_s`` wall seconds, ``max_memory_bytes`` = ``torch.cuda.max_memory_allocated`` in bytes, max over
    ranks) and prints it. Raises ``SystemExit`` for a flag no part of the worker reads (:func:`configure`).
    """
    argv = sys.argv[1:] if argv is None else argv
    run_dir, rows_dir = Path(argv[0]), Path(argv[1])
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cfg = validate(load_config(run_dir / CONFIG))
    join_group(run_dir, rank, world, local_rank)
    import_megatron_core()
    setup = configure(cfg, world)
    chosen = record_choices(run_dir / MEGATRON, setup, cfg) if rank == 0 else None
    init_parallel(setup.args)
    model, config, frozen, initialized = prepare_model(setup.args, setup.impl, cfg)
    model = wrap_ddp(model, config, setup.args, cfg)
    optimizer = build_optimizer(model, config, setup.args, cfg)
    if chosen is not None:  # weights, gradient buffers and what the optimizer allocates before its first step
        chosen["memory_after_setup_bytes"] = allocated_memory()
    schedule = data_schedule(Rows(rows_dir), setup.args)
    with MetricsWriter(run_dir / METRICS if writes_metrics() else None) as metrics:
        if metrics.writes:
            print(
                f"megatron-core: {sum(p.numel() for p in model.parameters()):,} parameters on this rank, "
                f"{frozen:,} frozen router weights, {initialized} checkpoint-only tensors initialised; "
                f"{schedule.per_step} microbatches per step",
                flush=True,
            )
        train(model, optimizer, schedule, setup.args, cfg.launcher.profile_step, Run(run_dir, rank, chosen), metrics)
    finish()
    return 0


def join_group(run_dir: Path, rank: int, world: int, local_rank: int) -> None:
    """This rank on GPU ``local_rank`` in an NCCL group of ``world``; the probe in ``probe-rank-RANK.json`` after
    one collective (NCCL loads its net plugin with the first communicator, and the probe should see it)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local_rank))
    dist.all_reduce(torch.zeros(1, device="cuda"))
    atomic_write(run_dir / probe_rank(rank), canonical_json(probe()))


# megatron-core's modules the worker drives, imported together as soon as the process group is up: before the V4
# stand-ins are bound (:func:`configure`), so that megatron-core's own optional imports see what they always saw.
MEGATRON_CORE = (
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel.random",
)


def import_megatron_core() -> None:
    """Import :data:`MEGATRON_CORE` in that order (``ModuleNotFoundError`` without the pinned Megatron-LM)."""
    for name in MEGATRON_CORE:
        importlib.import_module(name)


@dataclass(frozen=True)
class Setup:
    """What the run's Megatron-LM arguments are: ``impl`` (``--transformer-impl``), the ``stand_ins`` in use
    (:func:`hadamard_stand_in`), the rendered argv ``flags``, Megatron-LM's parsed namespace ``args`` and where
    each flag lands (:func:`flag_landing`)."""

    impl: str
    stand_ins: list[str]
    flags: list[str]
    args: Any  # Megatron-LM's argparse.Namespace
    landing: dict[str, str]


def configure(cfg: TrainConfig, world: int) -> Setup:
    """Megatron-LM's arguments for ``cfg`` on ``world`` ranks: the transformer implementation resolved, the V4
    stand-ins bound for a ``dsv4`` model (:func:`tilelang_compat`, :func:`hadamard_stand_in`), the argv rendered
    (:func:`trainer.launch.megatron_args.megatron_argv`, ``--train-iters`` the run's steps) and parsed as miles does
    (:func:`megatron_args`). Raises ``SystemExit`` naming the flags no part of the worker reads."""
    impl = resolve_transformer_impl(cfg.launcher.transformer_impl)
    stand_ins = []
    if cfg.model.experimental_attention_variant == "dsv4":
        tilelang_compat()
        stand_ins = hadamard_stand_in()
    flags = megatron_argv(cfg, impl, cfg.launcher.attention_backend, run_steps(cfg))
    args = megatron_args(flags, world)
    landing = flag_landing(flags, args)
    ignored = [flag for flag, where in landing.items() if where == REFUSED]
    if ignored:  # a flag the argv shows and nothing reads: refuse rather than train as if it applied
        raise SystemExit(
            f"megatron worker: {', '.join(ignored)}: no part of the worker reads "
            f"{'this flag' if len(ignored) == 1 else 'these flags'} (see flag_landing); refused"
        )
    return Setup(impl, stand_ins, flags, args, landing)


def record_choices(path: Path, setup: Setup, cfg: TrainConfig) -> dict[str, Any]:
    """Write ``megatron.json`` at ``path``: the implementation, attention backend, spec, argv, landing and
    stand-ins; returns it as read back (step 1 adds the cuDNN libraries loaded, :func:`write_metrics`)."""
    choices = {
        "transformer_impl": setup.impl,
        "attention_backend": cfg.launcher.attention_backend,
        "spec": setup.args.spec,
        "argv": setup.flags,
        "landing": setup.landing,
        "stand_ins": setup.stand_ins,
        "hadamard_transform": hadamard_module() if cfg.model.experimental_attention_variant == "dsv4" else None,
    }
    atomic_write(path, canonical_json(choices))
    chosen: dict[str, Any] = json.loads(path.read_text())
    return chosen


def init_parallel(args: Any) -> None:
    """megatron-core's parallel state with the namespace's TP/PP/CP/EP/ETP sizes and timeout (:data:`WORKER_ARGS`),
    and the seeds (torch's and the model-parallel CUDA RNG's) from ``args.seed``."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def prepare_model(args: Any, impl: str, cfg: TrainConfig) -> tuple[Any, Any, int, int]:
    """This rank's pipeline stage of the model (:func:`build_model`), checkpoint-only parameters initialised
    (:func:`init_checkpoint_only`), router gates frozen (``--moe-router-freeze-gate``: the fork's router does it
    too), on the GPU, and with ``optim.bf16`` in bf16 as Megatron-LM's ``get_model`` makes it (``Float16Module``,
    weights marked ``_keep_fp32`` kept, then miles' ``enforce_marked_param_dtypes``). Returns ``(model,
    TransformerConfig, frozen router scalars, tensors initialised)``."""
    import torch
    from megatron.core import parallel_state as ps

    model, config = build_model(args, impl, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    initialized = init_checkpoint_only(model, config.init_method_std, args.num_experts, args.seed)
    frozen = 0
    for name, param in model.named_parameters():
        if args.moe_router_freeze_gate and name.endswith("router.weight"):
            param.requires_grad_(False)
            frozen += param.numel()
    model.cuda(torch.cuda.current_device())
    if cfg.optim.bf16:
        from megatron.core.transformer.module import Float16Module
        from miles.backends.megatron_utils.fp32_param_utils import enforce_marked_param_dtypes

        model = Float16Module(config, model)
        enforce_marked_param_dtypes([model])
    return model, config, frozen, initialized


def wrap_ddp(model: Any, config: Any, args: Any, cfg: TrainConfig) -> Any:
    """megatron-core's ``DistributedDataParallel`` around ``model`` with :func:`ddp_config` of the namespace (the
    data-parallel size counting context parallelism, the rank's parameters counted before wrapping)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel

    dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
    return DistributedDataParallel(
        config=config,
        ddp_config=ddp_config(args, sum(p.numel() for p in model.parameters()), dp_size, cfg),
        module=model,
    )


def build_optimizer(model: Any, config: Any, args: Any, cfg: TrainConfig) -> Any:
    """megatron-core's optimizer of ``model`` from :func:`optimizer_config`; ``config`` (the TransformerConfig)
    gets megatron-core's gradient finalisation and the optimizer's loss scaling, as Megatron-LM's training sets."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    opt_config, overrides = optimizer_config(args, cfg)
    optimizer = get_megatron_optimizer(opt_config, [model], config_overrides=overrides)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def data_schedule(rows: Rows, args: Any) -> Schedule:
    """This data-parallel rank's microbatches (:class:`trainer.launch.steps.Schedule`): ``args.global_batch_size``
    rows per step, ``args.micro_batch_size`` per microbatch, over megatron-core's data-parallel group."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return Schedule.of(rows, args.global_batch_size, args.micro_batch_size, dp_rank, dp_size)


def writes_metrics() -> bool:
    """Whether this rank writes ``metrics.jsonl``: the last pipeline stage's DP rank 0, TP rank 0 (the loss lives
    on the last stage)."""
    from megatron.core import parallel_state as ps

    return bool(
        ps.is_pipeline_last_stage() and ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    )


@dataclass(frozen=True)
class Run:
    """Where a step's files go: the run directory, this process's global ``rank`` (rank 0 writes the profile) and
    rank 0's ``megatron.json`` as written (None elsewhere)."""

    run_dir: Path
    rank: int
    chosen: dict[str, Any] | None


def train(
    model: Any,
    optimizer: Any,
    schedule: Schedule,
    args: Any,
    profile_step: int | None,
    run: Run,
    metrics: MetricsWriter,
) -> None:
    """Run ``args.train_iters`` optimizer steps (1-based) over ``schedule``'s microbatches, the learning rate of
    :func:`megatron_lr` set before each; step ``profile_step`` runs under ``torch.profiler``. Each step's wall time
    runs from a CUDA synchronize to one; its row goes to :func:`write_metrics`."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    steps = args.train_iters
    for step in range(1, steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        lr = megatron_lr(step - 1, steps, args.lr, args.min_lr, args.lr_warmup_fraction, args.lr_decay_style)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = schedule.microbatches(step - 1)
        profile_to = run.run_dir / PROFILE if run.rank == 0 else None
        totals, grad_norm = train_step(
            model, optimizer, forward_backward, batches, args, step == profile_step, profile_to
        )
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        memory = peak_memory()
        if metrics.writes:
            loss, supervised = totals.tolist()
            row = Step(
                step=step,
                lm_loss=per_token_loss(loss, supervised),
                grad_norm=float(grad_norm) if grad_norm is not None else None,
                lr=lr,
                tokens=float(args.global_batch_size * args.seq_length),
                supervised_tokens=supervised,
                step_time_s=elapsed,
                max_memory_bytes=float(memory.item()),
            )
            write_metrics(metrics, row, steps, run)


def train_step(
    model: Any,
    optimizer: Any,
    forward_backward: Any,
    batches: list[Batch],
    args: Any,
    profile: bool,
    profile_to: Path | None,
) -> tuple[torch.Tensor, Any]:
    """One optimizer step: gradients zeroed, megatron-core's forward-backward schedule (1F1B when PP > 1) over this
    rank's ``batches`` (each ``(micro_batch_size, seq_length)``), ``optimizer.step()``; under the profiler when
    ``profile`` (:func:`profiled`). Returns (:func:`loss_totals`, the gradient norm ``optimizer.step`` reports or
    None)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with profiled(profile, profile_to):
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
    return loss_totals(reduced), grad_norm


def forward_step(data_iterator: Iterator[Batch], model: Any) -> tuple[Any, Any]:
    """megatron-core's ``forward_step_func``: the next microbatch through ``model`` (per-token losses of
    ``labels``), and the function that reduces them to the microbatch's summed loss over its supervised tokens,
    their count, and ``{"lm loss": [loss sum, supervised tokens]}`` for the step's totals."""
    import torch

    batch = next(data_iterator)
    tokens = torch.from_numpy(batch.tokens).cuda(non_blocking=True)
    labels = torch.from_numpy(batch.labels).clamp(min=0).cuda(non_blocking=True)
    mask = torch.from_numpy(batch.loss_mask).float().cuda(non_blocking=True)
    positions = torch.from_numpy(batch.position_ids).cuda(non_blocking=True)
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        losses = output_tensor.float().reshape(-1)
        flat = mask.reshape(-1)
        loss = (losses * flat).sum()
        count = flat.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), flat.sum().detach()])}

    return output, loss_func


@contextlib.contextmanager
def profiled(profile: bool, out: Path | None) -> Iterator[None]:
    """Run the block under ``torch.profiler`` (CPU and CUDA activity) when ``profile``; after it (and a CUDA
    synchronize) write :func:`top_kernels_table` to ``out`` unless it is None. Without ``profile``: nothing."""
    if not profile:
        yield
        return
    import torch

    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    profiler.__enter__()
    yield
    torch.cuda.synchronize()
    profiler.__exit__(None, None, None)
    if out is not None:
        atomic_write(out, top_kernels_table(profiler).encode())


def loss_totals(reduced: list[dict[str, Any]]) -> torch.Tensor:
    """``[summed loss, supervised tokens]`` of the step (a CUDA float tensor of 2): on the last pipeline stage the
    microbatches' ``lm loss`` pairs summed and all-reduced over the data-parallel group; zeros on other stages."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    totals = torch.zeros(2, device="cuda")
    if ps.is_pipeline_last_stage():
        for item in reduced:
            totals += item["lm loss"].float()
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
    return totals


def peak_memory() -> torch.Tensor:
    """``torch.cuda.max_memory_allocated`` (bytes) as a CUDA tensor of 1, the maximum over all ranks."""
    import torch
    import torch.distributed as dist

    memory = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    return memory


def allocated_memory() -> int:
    """``torch.cuda.memory_allocated`` on this rank now (bytes): the tensors alive, not the peak."""
    import torch

    return int(torch.cuda.memory_allocated())


def write_metrics(metrics: MetricsWriter, row: Step, steps: int, run: Run) -> None:
    """Append ``row`` to ``metrics.jsonl``; after step 1 on rank 0 add the cuDNN libraries that TransformerEngine
    and torch loaded (``cudnn_loaded``, once both ran a step) and the bytes then allocated
    (``memory_after_step_1_bytes``, with the optimizer's state) to ``megatron.json``; print the row's line
    (``grad_norm`` as ``str`` has it, the step time to 3 decimals)."""
    metrics.write(row)
    if row.step == 1 and run.chosen is not None:
        run.chosen["cudnn_loaded"] = [lib for lib in mapped_libraries() if "libcudnn" in lib]
        run.chosen["memory_after_step_1_bytes"] = allocated_memory()  # + the optimizer's state, made at step 1
        atomic_write(run.run_dir / MEGATRON, canonical_json(run.chosen))
    print(step_line(row, steps, grad_norm_spec="", time_spec=".3f"), flush=True)


def finish() -> None:
    """Leave after a barrier (no rank exits while another still communicates): megatron-core's parallel state and
    the process group destroyed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def top_kernels_table(profiler, limit: int = 25) -> str:
    """The ``limit`` GPU kernels of a finished ``torch.profiler.profile`` with the most device time, as a
    Markdown table: kernel name (cut to 90 characters), calls, total device ms, share of all kernels' time
    in percent. Raises nothing for a profile without GPU events (the table is then empty)."""
    events = [e for e in profiler.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1.0
    lines = [
        f"total device time of all kernels: {total / 1e3:.1f} ms",
        "",
        "| kernel | calls | device ms | share |",
        "|---|---|---|---|",
    ]
    for e in events[:limit]:
        name = e.key.replace("|", "/")[:90]
        lines.append(
            f"| `{name}` | {e.count} | {e.self_device_time_total / 1e3:.2f} | "
            f"{100.0 * e.self_device_time_total / total:.1f}% |"
        )
    return "\n".join(lines) + "\n"


# DeepSeek-V4 parameters that miles 78527b91 and its Megatron-LM fork allocate with torch.empty (or, for tid2eid,
# fill with -1) and only ever load from a checkpoint: (name suffix, initial value). Values as transformers'
# DeepseekV4PreTrainedModel._init_weights (modeling_deepseek_v4.py): hyper-connection fn ~ N(0, std), base 0,
# scale 1; attention sinks 0; compressor position bias (miles' `ape`) 0.
CHECKPOINT_ONLY = (
    ("hc_attn_fn", "normal"),
    ("hc_ffn_fn", "normal"),
    ("hc_head_fn", "normal"),
    ("hc_attn_base", "zeros"),
    ("hc_ffn_base", "zeros"),
    ("hc_head_base", "zeros"),
    ("hc_attn_scale", "ones"),
    ("hc_ffn_scale", "ones"),
    ("hc_head_scale", "ones"),
    ("attn_sink", "zeros"),
    ("compressor.ape", "zeros"),
)


def init_checkpoint_only(model, std: float, num_experts: int, seed: int) -> int:
    """Give a randomly initialised model the values of the parameters that the V4 code leaves for a checkpoint
    (:data:`CHECKPOINT_ONLY`, ``std`` = ``init_method_std``), and the hash routers' ``tid2eid`` tables
    ``topk`` distinct experts per token id from ``seed``
    (:func:`trainer.models.deepseek_v4_hf.fill_tid2eid`; the fork asserts every entry >= 0). Returns the
    number of tensors set; a model without such parameters is left as it is (0)."""
    import torch

    done = 0
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = next((k for suffix, k in CHECKPOINT_ONLY if name.endswith(suffix)), None)
            if name.endswith("tid2eid"):
                table = torch.empty(param.shape, dtype=param.dtype)
                fill_tid2eid(table, num_experts, generator)
                param.copy_(table)
            elif kind == "normal":
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif kind in ("zeros", "ones"):
                param.fill_(0.0 if kind == "zeros" else 1.0)
            else:
                continue
            done += 1
    return done


def tilelang_compat() -> None:
    """Let TileKernels 1.0.0 import under tilelang 0.1.15.

    miles 78527b91's V4 hyper-connections and FP8 cast-back come from TileKernels (``tile_kernels``), which its
    ``docker/Dockerfile`` installs at 1.0.0 next to tilelang 0.1.8; the bundle's lock pins tilelang 0.1.15,
    where ``determine_target`` moved from ``tilelang.utils.target`` to ``tilelang.backend.target``. When the
    old module is missing and the new one exists, the old name is made an alias of the new module (the only
    import of TileKernels 1.0.0 that 0.1.15 lacks); otherwise nothing changes."""
    import importlib.util

    if importlib.util.find_spec("tilelang") is None:
        return
    try:
        importlib.import_module("tilelang.utils.target")
    except ModuleNotFoundError:
        sys.modules["tilelang.utils.target"] = importlib.import_module("tilelang.backend.target")


def hadamard_stand_in() -> list:
    """Let miles' DeepSeek-V4 indexer and compressor run without the ``fast_hadamard_transform`` CUDA package.

    miles 78527b91's ``rotate_activation`` (``miles_plugins/models/deepseek_v4/ops/utils.py``) asserts that
    package, which miles' ``docker/Dockerfile`` builds from source and the bundle's lock does not carry; every
    layer with compress ratio 4 calls it. When the package is not importable, its name is bound to
    :mod:`trainer.models.hadamard` (the same transform in torch operations) before miles' modules are imported.
    Returns the stand-ins in use, one line each for the run's record (empty when the package is installed)."""
    import importlib.util

    if sys.modules.get("fast_hadamard_transform") is not hadamard:
        if importlib.util.find_spec("fast_hadamard_transform") is not None:
            return []
        sys.modules["fast_hadamard_transform"] = hadamard
    return [
        "fast_hadamard_transform.hadamard_transform: trainer.models.hadamard (torch operations, float32 sums; "
        "the package is not in the lock)"
    ]


def hadamard_module() -> dict[str, str | None]:
    """Which ``fast_hadamard_transform`` miles' V4 code calls: ``{"module", "version", "file"}`` of the CUDA
    package (its distribution's version) or of the stand-in :mod:`trainer.models.hadamard` bound in its place."""
    from importlib.metadata import PackageNotFoundError, version

    module = sys.modules.get("fast_hadamard_transform") or importlib.import_module("fast_hadamard_transform")
    if module is hadamard:
        return {"module": hadamard.__name__, "version": None, "file": None}
    try:
        dist_version: str | None = version("fast_hadamard_transform")
    except PackageNotFoundError:
        dist_version = getattr(module, "__version__", None)
    return {"module": "fast_hadamard_transform", "version": dist_version, "file": getattr(module, "__file__", None)}


# What the worker reads from Megatron-LM's namespace (:func:`megatron_args`), by Megatron argument name; each is
# rendered from the config field of its flag's row in trainer.compose.render (``--tensor-model-parallel-size``
# for ``tensor_model_parallel_size``; ``--train-iters`` from the run's steps), and tests/test_local_megatron.py
# shows each equal to that field after parsing. The run's own choices that are no Megatron argument
# (``launcher.profile_step``, ``launcher.transformer_impl``'s resolution) are read from the config.
WORKER_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "distributed_timeout_minutes",
    "seed",
    "optimizer",
    "lr",
    "min_lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "clip_grad",
    "micro_batch_size",
    "global_batch_size",
    "seq_length",
    "lr_warmup_fraction",
    "lr_decay_style",
    "train_iters",
    "num_experts",
    "moe_router_freeze_gate",
    "freeze_e_score_correction_bias",
)
# Read from the config instead (``layout.use_distributed_optimizer``, ``optim.bf16``,
# ``optim.accumulate_allreduce_grads_in_fp32``): the namespace does not keep them. miles 78527b91's
# ``set_default_megatron_args`` sets ``use_distributed_optimizer`` for every Adam run and ``bf16 = not fp16``;
# Megatron-LM 37f91617's ``validate_args`` sets ``accumulate_allreduce_grads_in_fp32`` under bf16. The worker
# honours the config (the one-GPU convergence pair turns the distributed optimizer off).
CONFIG_NOT_ARGS = ("use_distributed_optimizer", "bf16", "accumulate_allreduce_grads_in_fp32")


def ddp_config(args, num_parameters: int, dp_size: int, cfg):
    """megatron-core's ``DistributedDataParallelConfig`` as Megatron-LM 37f91617's ``get_model``
    (``megatron/training/training.py``) makes it from the namespace ``args``: every field the dataclass declares
    that the namespace has, then the fields it names otherwise there (``grad_reduce_in_fp32`` from
    ``accumulate_allreduce_grads_in_fp32``, ``check_for_nan_in_grad`` from ``check_for_nan_in_loss_and_grad``,
    ``check_for_large_grads``, ``bucket_size`` from ``ddp_num_buckets`` (``num_parameters`` // it) or
    ``ddp_bucket_size``, and the ``ddp_``-prefixed ``pad_buckets_for_high_nccl_busbw``,
    ``reduce_scatter_with_fp32_accumulation``, ``average_in_collective``), the default bucket of
    max(40,000,000, 1,000,000 x ``dp_size``) parameters, none without ``overlap_grad_reduce``. The two of
    :data:`CONFIG_NOT_ARGS` it holds come from the composed ``cfg``. ``num_parameters``: this rank's parameters."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(DistributedDataParallelConfig)
        if hasattr(args, f.name)
    }
    kwargs.update(
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        check_for_large_grads=args.check_for_large_grads,
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
        average_in_collective=args.ddp_average_in_collective,
    )
    if args.ddp_num_buckets is not None:
        if args.ddp_bucket_size is not None or args.ddp_num_buckets <= 0:
            raise ValueError("--ddp-num-buckets: expected a positive count and no --ddp-bucket-size")
        kwargs["bucket_size"] = num_parameters // args.ddp_num_buckets
    else:
        kwargs["bucket_size"] = args.ddp_bucket_size
    kwargs["grad_reduce_in_fp32"] = bool(cfg.optim.accumulate_allreduce_grads_in_fp32)
    kwargs["use_distributed_optimizer"] = bool(cfg.layout.use_distributed_optimizer)
    config = DistributedDataParallelConfig(**kwargs)
    if config.bucket_size is None:
        config.bucket_size = max(40_000_000, 1_000_000 * dp_size)
    if not config.overlap_grad_reduce:
        config.bucket_size = None
    return config


def optimizer_config(args, cfg):
    """(megatron-core's optimizer config, its per-parameter overrides) as Megatron-LM 37f91617's
    ``get_megatron_optimizer_config`` (``megatron/training/training.py``) makes them from the namespace ``args``:
    ``AdamOptimizerConfig`` (Adam; muon too, as there) or ``SGDOptimizerConfig``, every field the dataclass declares
    that the namespace has; the overrides from ``megatron.core.optimizer.get_standard_config_overrides``. The two of
    :data:`CONFIG_NOT_ARGS` it holds (``bf16``, ``use_distributed_optimizer``) come from the composed ``cfg``.
    Raises ``ValueError`` for another optimizer."""
    import dataclasses

    from megatron.core.optimizer import AdamOptimizerConfig, SGDOptimizerConfig, get_standard_config_overrides

    if args.optimizer == "adam" or "muon" in args.optimizer:
        cls = AdamOptimizerConfig
    elif args.optimizer == "sgd":
        cls = SGDOptimizerConfig
    else:
        raise ValueError(f"--optimizer {args.optimizer!r}: expected adam or sgd")
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kwargs.update(bf16=bool(cfg.optim.bf16), use_distributed_optimizer=bool(cfg.layout.use_distributed_optimizer))
    config = cls(**kwargs)
    return config, get_standard_config_overrides(config=config)


# Megatron arguments core_transformer_config_from_args (megatron/training/arguments.py at 37f91617) reads by name
# into TransformerConfig fields of other names (num_experts -> num_moe_experts, no_persist_layer_norm ->
# persist_layer_norm, ...), besides the fields the config declares.
CORE_TRANSLATED = (
    "bias_gelu_fusion",
    "bias_swiglu_fusion",
    "cp_comm_type",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "fp8_param_gather",
    "group_query_attention",
    "init_method_xavier_uniform",
    "multi_latent_attention",
    "no_persist_layer_norm",
    "num_experts",
    "num_query_groups",
    "overlap_p2p_comm",
    "params_dtype",
    "post_mlp_layernorm",
    "post_self_attn_layernorm",
    "quick_geglu",
    "rope_type",
    "rotary_interleaved",
    "squared_relu",
    "swiglu",
    "moe_latent_size",
)
# Megatron arguments :func:`build_model` passes to GPTModel or the layer spec (as miles' model provider does).
MODEL_ARGS = (
    "spec",
    "padded_vocab_size",
    "max_position_embeddings",
    "fp16_lm_cross_entropy",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "use_rope_scaling",
    "mtp_num_layers",
    "transformer_impl",
)
# Megatron arguments whose whole effect is inside the parse (:func:`megatron_args`: Megatron's validate_args and
# miles' set_default_megatron_args derive what the worker then reads), each with what it derives.
PARSE_ONLY = {
    "vocab_size": "padded_vocab_size (with make_vocab_size_divisible_by and TP)",
    "make_vocab_size_divisible_by": "padded_vocab_size",
    "tokenizer_type": "padded_vocab_size: miles' set_default_megatron_args pads the given vocabulary",
    "bf16": "params_dtype (validate_args), the bf16 the worker takes from the config (CONFIG_NOT_ARGS)",
    "use_distributed_optimizer": "kept from the config (CONFIG_NOT_ARGS)",
    "accumulate_allreduce_grads_in_fp32": "kept from the config (CONFIG_NOT_ARGS)",
    "check_for_nan_in_loss_and_grad": "DistributedDataParallelConfig.check_for_nan_in_grad (ddp_config)",
    "ddp_bucket_size": "DistributedDataParallelConfig.bucket_size (ddp_config)",
    "ddp_num_buckets": "DistributedDataParallelConfig.bucket_size (ddp_config)",
    "ddp_pad_buckets_for_high_nccl_busbw": "DistributedDataParallelConfig (ddp_config)",
    "ddp_reduce_scatter_with_fp32_accumulation": "DistributedDataParallelConfig (ddp_config)",
    "ddp_average_in_collective": "DistributedDataParallelConfig (ddp_config)",
    "attention_backend": "TransformerConfig.attention_backend (an enum validate_args converts)",
}
REFUSED = "refused"


def flag_landing(flags, args) -> dict:
    """Where each ``--flag`` of the rendered Megatron argv ``flags`` lands once parsed into ``args``
    (:func:`megatron_args`): ``transformer_config``, ``ddp_config``, ``optimizer_config`` (a field the worker's
    configs take from the namespace: :func:`build_model`'s ``core_transformer_config_from_args`` with
    :data:`CORE_TRANSLATED`, :func:`ddp_config`, :func:`optimizer_config`), ``worker`` (read by name:
    :data:`WORKER_ARGS`, :data:`MODEL_ARGS`), ``parse`` (:data:`PARSE_ONLY`), or :data:`REFUSED`: a flag no part of
    the worker reads, which would show in the argv and change nothing (``main`` refuses to train with one). A flag
    Megatron-LM's parser does not know is refused too: the worker runs Megatron-LM, not miles. Returns
    ``{flag: landing}`` in argv order. Needs the pinned Megatron-LM importable."""
    import argparse
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import AdamOptimizerConfig, SGDOptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dest = {option: action.dest for action in parser._actions for option in action.option_strings}
    fields = {
        "transformer_config": {f.name for c in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(c)}
        | set(CORE_TRANSLATED),
        "ddp_config": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
        "optimizer_config": {f.name for c in (AdamOptimizerConfig, SGDOptimizerConfig) for f in dataclasses.fields(c)},
    }
    out = {}
    for flag in (word.split("=", 1)[0] for word in flags if word.startswith("--")):
        name = dest.get(flag)
        if name is None:
            out[flag] = REFUSED
        elif name in WORKER_ARGS or name in MODEL_ARGS:
            out[flag] = "worker"
        elif name in PARSE_ONLY or name in CONFIG_NOT_ARGS:
            out[flag] = "parse"
        else:
            out[flag] = next(
                (where for where, names in fields.items() if name in names and hasattr(args, name)), REFUSED
            )
    return out


def megatron_args(argv, world: int):
    """Megatron-LM's argument namespace for ``argv`` (:func:`trainer.launch.megatron_args.megatron_argv`), made
    as miles 78527b91 makes it for its Megatron backend (``miles/utils/arguments.py`` ``parse_args``):
    Megatron-LM's ``parse_args`` (flags only miles defines are skipped), miles' ``set_default_megatron_args``
    (padded vocabulary, rope type, DSA top-k backend), Megatron's ``validate_args``. Raises whatever those raise
    (an ``AssertionError`` names the bad argument)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args
    from miles.backends.megatron_utils.arguments import set_default_megatron_args

    saved = sys.argv
    sys.argv = ["megatron"] + list(argv)
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = saved
    args.rank, args.world_size = int(os.environ["RANK"]), world
    args = set_default_megatron_args(args)
    validate_args(args)
    set_args(args)
    return args


def build_model(args, impl: str, pre_process: bool, post_process: bool):
    """The ``GPTModel`` and its ``TransformerConfig``, built as miles 78527b91's
    ``miles/backends/megatron_utils/model_provider.py`` ``model_provider`` builds the actor: config from
    ``core_transformer_config_from_args``; the layer spec from ``--spec`` (called as ``spec(args, config,
    vp_stage)``: DeepSeek-V4's ``get_dsv4_spec``) or, without one, ``get_gpt_decoder_block_spec`` with
    TransformerEngine or the local modules; an MTP block from ``get_gpt_mtp_block_spec``; the same
    ``GPTModel`` arguments. (That module itself is not imported: it pulls in ``miles.utils.misc``, which
    imports ray at module level, and ray is not part of a training process's needs.)"""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.arguments import core_transformer_config_from_args

    use_te = impl == "transformer_engine"
    config = core_transformer_config_from_args(args)
    if args.spec:
        spec = import_module(args.spec)
        if callable(spec):
            spec = spec(args, config, None)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    kwargs = {
        "config": config,
        "transformer_layer_spec": spec,
        "vocab_size": args.padded_vocab_size,
        "max_sequence_length": args.max_position_embeddings,
        "pre_process": pre_process,
        "post_process": post_process,
        "fp16_lm_cross_entropy": args.fp16_lm_cross_entropy,
        "parallel_output": True,
        "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
        "position_embedding_type": args.position_embedding_type,
        "rotary_percent": args.rotary_percent,
        "rotary_base": args.rotary_base,
        "rope_scaling": args.use_rope_scaling,
    }
    if args.mtp_num_layers:
        kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te)
    return GPTModel(**kwargs), config


if __name__ == "__main__":
    raise SystemExit(main())
