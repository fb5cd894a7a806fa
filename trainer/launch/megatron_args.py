"""The composed run as Megatron-LM arguments, for ``launcher=local-megatron``.

The worker hands these to Megatron-LM's own parser (``megatron.training.arguments.parse_args``), then
``core_transformer_config_from_args`` turns them into the ``TransformerConfig`` — the path miles 78527b91
takes (``miles/utils/arguments.py`` -> ``miles/backends/megatron_utils/arguments.py`` ->
``model_provider.py``). Every flag is a row of :mod:`trainer.compose.render`'s tables: the model, layout and
optimizer rows of the recipe's own argv under the row conditions of ``MEGATRON_WHEN``, then ``MEGATRON_ARGS``
(the run's sizes and the launcher's choices); this module only supplies those choices.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from trainer.compose.render import render_megatron


def megatron_argv(cfg, transformer_impl: str, attention_backend: str, steps: int) -> list[str]:
    """Megatron-LM argv (without the program name) for the composed ``cfg`` (a DictConfig or a
    :class:`~trainer.compose.schema.TrainConfig`): :func:`trainer.compose.render.render_megatron` of ``cfg`` with
    the launch's own choices added as its ``megatron`` node (the keys of ``MEGATRON_ARGS`` and ``MEGATRON_WHEN``).

    ``transformer_impl``: ``transformer_engine`` | ``local`` (Megatron ``--transformer-impl``);
    ``attention_backend``: Megatron ``--attention-backend`` (``flash``, ``fused``, ``unfused``, ``local``,
    ``auto``); ``steps``: ``--train-iters``. A model whose ``experimental_attention_variant`` is ``none``
    gets none of the V4 flags (``--dsv4-*``, ``--dsa-indexer-*``, ``--spec``); the local implementation
    gets no ``--moe-grouped-gemm`` (its grouped GEMM is TransformerEngine's). Fusions that need APEX are
    turned off (``--no-gradient-accumulation-fusion``; local: ``--no-persist-layer-norm``,
    ``--no-masked-softmax-fusion``); ``model.mtp_num_layers`` 0 gives no ``--mtp-num-layers``.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    data = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(data, dict):  # a DictConfig's container is a dict
        raise TypeError(f"megatron_argv: expected a mapping config, got {type(data).__name__}")
    data["megatron"] = {
        "train_iters": steps,
        "transformer_impl": transformer_impl,
        "attention_backend": attention_backend,
        "tokenizer_type": "NullTokenizer",
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": transformer_impl != "local",
        "masked_softmax_fusion": transformer_impl != "local",
        "mtp_num_layers": cfg.model.mtp_num_layers or None,
        "miles": False,
        "transformer_engine": transformer_impl != "local",
        "v4": cfg.model.experimental_attention_variant not in ("none", "", None),
    }
    return render_megatron(DictConfig(data))


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
