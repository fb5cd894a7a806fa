"""The composed run as Megatron-LM arguments, for ``launcher=local-megatron``.

The worker hands these to Megatron-LM's own parser (``megatron.training.arguments.parse_args``), then
``core_transformer_config_from_args`` turns them into the ``TransformerConfig`` — the path miles 78527b91
takes (``miles/utils/arguments.py`` -> ``miles/backends/megatron_utils/arguments.py`` ->
``model_provider.py``). The model, layout and optimizer flags come from :mod:`trainer.compose.render`'s tables (the
recipe's own argv), less the flags only miles reads; the rest are the run's sizes and the launcher's choices.
"""

from __future__ import annotations

from typing import List

from omegaconf import DictConfig, OmegaConf

from trainer.compose.render import LAYOUT_ARGS, MODEL_ARGS, OPTIM_ARGS, format_value, render_rows

# Flags of the rendered tables that Megatron-LM's parser does not define (miles reads them) or that a model
# without the V4 attention variant must not pass.
MILES_ONLY = {"--max-tokens-per-gpu"}
V4_ONLY_PREFIXES = ("--dsv4-", "--dsa-indexer-", "--spec", "--experimental-attention-variant")


def megatron_argv(cfg, transformer_impl: str, attention_backend: str, steps: int) -> List[str]:
    """Megatron-LM argv (without the program name) for the composed ``cfg`` (a DictConfig or a
    :class:`~trainer.compose.schema.TrainConfig`).

    ``transformer_impl``: ``transformer_engine`` | ``local`` (Megatron ``--transformer-impl``);
    ``attention_backend``: Megatron ``--attention-backend`` (``flash``, ``fused``, ``unfused``, ``local``,
    ``auto``); ``steps``: ``--train-iters``. A model whose ``experimental_attention_variant`` is ``none``
    gets none of the V4 flags (``--dsv4-*``, ``--dsa-indexer-*``, ``--spec``); the local implementation
    gets no ``--moe-grouped-gemm`` (its grouped GEMM is TransformerEngine's). Fusions that need APEX are
    turned off (``--no-gradient-accumulation-fusion``; local: ``--no-persist-layer-norm``,
    ``--no-masked-softmax-fusion``).
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    m = cfg.model
    v4 = m.experimental_attention_variant not in ("none", "", None)
    argv: List[str] = []
    for rows in (MODEL_ARGS, LAYOUT_ARGS, OPTIM_ARGS):
        keep = tuple(r for r in rows if r[0] not in MILES_ONLY and (v4 or not r[0].startswith(V4_ONLY_PREFIXES)))
        argv += render_rows(cfg, keep)
    if transformer_impl == "local" and "--moe-grouped-gemm" in argv:
        argv.remove("--moe-grouped-gemm")  # grouped GEMM for experts needs TransformerEngine
    seq = str(cfg.data.seq_length)
    argv += [
        "--seq-length", seq, "--max-position-embeddings", seq,
        "--global-batch-size", str(cfg.optim.global_batch_size),
        "--train-iters", str(steps),
        "--seed", str(cfg.launcher.seed),
        "--clip-grad", format_value(cfg.optim.clip_grad),
        "--distributed-timeout-minutes", str(cfg.launcher.distributed_timeout_minutes),
        "--transformer-impl", transformer_impl,
        "--attention-backend", attention_backend,
        # the rows are already token ids: no tokenizer is loaded (vocab size from --vocab-size)
        "--tokenizer-type", "NullTokenizer",
        # Megatron-LM defaults these fusions on, and they need APEX's CUDA extensions or Megatron's own compiled
        # kernels, which the bundle does not build (the recipe's image has APEX): weight-gradient accumulation
        # fusion in every linear layer; for the local spec also the persistent layer norm and fused softmax
        "--no-gradient-accumulation-fusion",
    ]
    if transformer_impl == "local":
        # torch norms support neither a persistent (APEX) layer norm nor Megatron's compiled softmax
        argv += ["--no-persist-layer-norm", "--no-masked-softmax-fusion"]
    if m.mtp_num_layers:
        argv += ["--mtp-num-layers", str(m.mtp_num_layers)]
    if cfg.optim.bf16:
        argv.append("--bf16")
    for flag, on in (("--calculate-per-token-loss", cfg.optim.calculate_per_token_loss),
                     ("--accumulate-allreduce-grads-in-fp32", cfg.optim.accumulate_allreduce_grads_in_fp32)):
        if on:
            argv.append(flag)
    return argv


def resolve_transformer_impl(choice: str) -> str:
    """``launcher.transformer_impl`` as Megatron's ``--transformer-impl``: ``auto`` is ``transformer_engine``
    when ``transformer_engine`` is importable here (the recipe's path), else ``local``; the other values pass
    through. Raises ``ValueError`` for another value."""
    if choice == "auto":
        import importlib.util

        return "transformer_engine" if importlib.util.find_spec("transformer_engine") is not None else "local"
    if choice not in ("transformer_engine", "local"):
        raise ValueError(f"launcher.transformer_impl {choice!r}: expected auto, transformer_engine or local")
    return choice
