"""Render a composed run as the exact miles launch: argv and environment.

The argv is built from ordered tables of ``(flag, config key, kind)``; nothing in a table holds a value,
so every value comes from the composed config (one source of truth). The order is the recipe's own
(shared seed ``attune-tp2-pp4-ep8.command.sh``): launcher sizes, then the model arguments in the order
miles' ``model_args_utils.py`` prints them, then checkpoints, data and loss, the layout, the optimizer,
and the arguments the recipe restates at the end (Megatron's argparse keeps the last occurrence, and
both occurrences come from the same field, so they cannot disagree).

These tables are the one map from config fields to launch arguments: miles gets every row of :data:`SECTIONS`;
megatron-core (``launcher=local-megatron``, :func:`render_megatron`, called by
:func:`trainer.launch.megatron_args.megatron_argv`) gets the model, layout and optimizer rows under the row
conditions of :data:`MEGATRON_WHEN` (no ``--max-tokens-per-gpu``, which only miles reads; no V4-only rows for a
model without the V4 attention; no ``--moe-grouped-gemm`` for the local transformer implementation, whose grouped
GEMM would be TransformerEngine's), then :data:`MEGATRON_ARGS`, the arguments Megatron-LM needs that the recipe's
argv leaves to miles (sequence length, steps, seed, gradient clipping, precision, implementation choices), which
reuse the rows above for flags both have. The megatron-core worker reads its parallel sizes, seed and optimizer
settings from the namespace Megatron-LM's parser makes of that argv
(:data:`trainer.launch.megatron_worker.WORKER_ARGS`, each checked equal to its row's field), so it maps no
field itself, except the three that miles and Megatron-LM overwrite there (``CONFIG_NOT_ARGS`` beside it).
The numerics verdict (:mod:`trainer.compose.numerics`) classes every row.

A new field is a field of :mod:`trainer.compose.schema`, its default in ``conf/`` and one row here: in the table
of its section when miles reads it (megatron-core then gets it too, unless a :data:`MEGATRON_WHEN` condition
says otherwise), in :data:`MEGATRON_ARGS` when only the megatron-core launch needs it.

Kinds of flag:
``value``  ``--flag VALUE``; omitted when the value is null.
``int``    ``--flag VALUE`` with a float of integral value written as an integer (``16``, not ``16.0``):
           the form miles' ``model_args_utils.py`` prints for these flags (its snapshot in
           ``tests/golden/miles-78527b91.model-args.*.txt``); a non-integral value keeps its float form.
``true``   ``--flag`` when the field is true, nothing when false (a Megatron ``store_true``).
``false``  ``--flag`` when the field is false, nothing when true (a Megatron ``store_false`` such as
           ``--disable-bias-linear`` for ``add_bias_linear``).
``nargs``  ``--flag V1 V2 ...`` (argparse ``nargs='+'``).
``pylist`` ``--flag [1,1,...]``: a Python list literal that Megatron evaluates (``--moe-layer-freq``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.compose.schema import as_dict
from trainer.redact import is_secret_name

Row = tuple[str, str, str]  # (flag, dotted config key, kind)

LAUNCHER_ARGS: tuple[Row, ...] = (
    ("--actor-num-nodes", "cluster.nodes", "value"),
    ("--actor-num-gpus-per-node", "cluster.gpus_per_node", "value"),
    ("--num-gpus-per-node", "cluster.gpus_per_node", "value"),
)

# miles 78527b91 `model_args_utils.py deepseek-v4-flash`, in its order.
MODEL_ARGS: tuple[Row, ...] = (
    ("--disable-bias-linear", "model.add_bias_linear", "false"),
    ("--num-layers", "model.num_layers", "value"),
    ("--hidden-size", "model.hidden_size", "value"),
    ("--ffn-hidden-size", "model.ffn_hidden_size", "value"),
    ("--num-attention-heads", "model.num_attention_heads", "value"),
    ("--normalization", "model.normalization", "value"),
    ("--position-embedding-type", "model.position_embedding_type", "value"),
    ("--norm-epsilon", "model.norm_epsilon", "value"),
    ("--swiglu", "model.swiglu", "true"),
    ("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights", "true"),
    ("--vocab-size", "model.vocab_size", "value"),
    ("--hidden-dropout", "model.hidden_dropout", "value"),
    ("--attention-dropout", "model.attention_dropout", "value"),
    ("--multi-latent-attention", "model.multi_latent_attention", "true"),
    ("--q-lora-rank", "model.q_lora_rank", "value"),
    ("--kv-lora-rank", "model.kv_lora_rank", "value"),
    ("--qk-head-dim", "model.qk_head_dim", "value"),
    ("--qk-pos-emb-head-dim", "model.qk_pos_emb_head_dim", "value"),
    ("--v-head-dim", "model.v_head_dim", "value"),
    ("--qk-layernorm", "model.qk_layernorm", "true"),
    ("--rotary-scaling-factor", "model.rotary_scaling_factor", "int"),
    ("--rotary-base", "model.rotary_base", "value"),
    ("--original-max-position-embeddings", "model.original_max_position_embeddings", "value"),
    ("--beta-fast", "model.beta_fast", "int"),
    ("--beta-slow", "model.beta_slow", "int"),
    ("--attention-softmax-in-fp32", "model.attention_softmax_in_fp32", "true"),
    ("--no-rope-fusion", "model.apply_rope_fusion", "false"),
    ("--num-experts", "model.num_experts", "value"),
    ("--moe-layer-freq", "model.moe_layer_freq", "pylist"),
    ("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size", "value"),
    ("--moe-router-topk", "model.moe_router_topk", "value"),
    ("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_intermediate_size", "value"),
    ("--moe-router-pre-softmax", "model.moe_router_pre_softmax", "true"),
    ("--moe-router-score-function", "model.moe_router_score_function", "value"),
    ("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias", "true"),
    ("--moe-router-load-balancing-type", "model.moe_router_load_balancing_type", "value"),
    ("--moe-token-dispatcher-type", "layout.moe_token_dispatcher_type", "value"),
    ("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", "int"),
    ("--moe-grouped-gemm", "model.moe_grouped_gemm", "true"),
    ("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor", "value"),
    ("--experimental-attention-variant", "model.experimental_attention_variant", "value"),
    ("--dsv4-hc-mult", "model.dsv4_hc_mult", "value"),
    ("--dsv4-hc-sinkhorn-iters", "model.dsv4_hc_sinkhorn_iters", "value"),
    ("--dsv4-compress-ratios", "model.dsv4_compress_ratios", "nargs"),
    ("--dsv4-compress-rope-theta", "model.dsv4_compress_rope_theta", "int"),
    ("--dsv4-o-groups", "model.dsv4_o_groups", "value"),
    ("--dsv4-o-lora-rank", "model.dsv4_o_lora_rank", "value"),
    ("--dsv4-n-hash-layers", "model.dsv4_n_hash_layers", "value"),
    ("--dsv4-window-size", "model.dsv4_window_size", "value"),
    ("--dsa-indexer-n-heads", "model.dsa_indexer_n_heads", "value"),
    ("--dsa-indexer-head-dim", "model.dsa_indexer_head_dim", "value"),
    ("--dsa-indexer-topk", "model.dsa_indexer_topk", "value"),
    ("--spec", "model.spec", "nargs"),
    ("--activation-func-clamp-value", "model.activation_func_clamp_value", "int"),
    ("--no-bias-swiglu-fusion", "model.bias_swiglu_fusion", "false"),
    ("--no-activation-func-clamp-shared-expert", "model.activation_func_clamp_shared_expert", "false"),
)

RUN_ARGS: tuple[Row, ...] = (
    ("--hf-checkpoint", "paths.hf_checkpoint", "value"),
    ("--ref-load", "paths.ref_load", "value"),
    ("--model-name", "model.model_name", "value"),
    ("--qkv-format", "layout.qkv_format", "value"),
    ("--moe-router-freeze-gate", "optim.moe_router_freeze_gate", "true"),
    ("--freeze-e-score-correction-bias", "optim.freeze_e_score_correction_bias", "true"),
    ("--rollout-function-path", "data.rollout_function_path", "value"),
    ("--prompt-data", "paths.prompt_data", "value"),
    ("--input-key", "data.input_key", "value"),
    ("--metadata-key", "data.metadata_key", "value"),
    ("--num-rollout", "optim.num_rollout", "value"),
    ("--rollout-batch-size", "optim.rollout_batch_size", "value"),
    ("--global-batch-size", "optim.global_batch_size", "value"),
    ("--loss-type", "optim.loss_type", "value"),
    ("--calculate-per-token-loss", "optim.calculate_per_token_loss", "true"),
    ("--disable-compute-advantages-and-returns", "launcher.disable_compute_advantages_and_returns", "true"),
    ("--debug-train-only", "launcher.debug_train_only", "true"),
)

LAYOUT_ARGS: tuple[Row, ...] = (
    ("--tensor-model-parallel-size", "layout.tensor_model_parallel_size", "value"),
    ("--sequence-parallel", "layout.sequence_parallel", "true"),
    ("--pipeline-model-parallel-size", "layout.pipeline_model_parallel_size", "value"),
    ("--num-virtual-stages-per-pipeline-rank", "layout.num_virtual_stages_per_pipeline_rank", "value"),
    ("--decoder-first-pipeline-num-layers", "layout.decoder_first_pipeline_num_layers", "value"),
    ("--decoder-last-pipeline-num-layers", "layout.decoder_last_pipeline_num_layers", "value"),
    ("--context-parallel-size", "layout.context_parallel_size", "value"),
    ("--expert-model-parallel-size", "layout.expert_model_parallel_size", "value"),
    ("--expert-tensor-parallel-size", "layout.expert_tensor_parallel_size", "value"),
    ("--recompute-granularity", "layout.recompute_granularity", "value"),
    ("--recompute-method", "layout.recompute_method", "value"),
    ("--recompute-num-layers", "layout.recompute_num_layers", "value"),
    ("--micro-batch-size", "layout.micro_batch_size", "value"),
    ("--max-tokens-per-gpu", "layout.max_tokens_per_gpu", "value"),
)

OPTIM_ARGS: tuple[Row, ...] = (
    ("--optimizer", "optim.optimizer", "value"),
    ("--lr", "optim.lr", "value"),
    ("--lr-decay-style", "optim.lr_decay_style", "value"),
    ("--min-lr", "optim.min_lr", "value"),
    ("--lr-warmup-fraction", "optim.lr_warmup_fraction", "value"),
    ("--weight-decay", "optim.weight_decay", "value"),
    ("--adam-beta1", "optim.adam_beta1", "value"),
    ("--adam-beta2", "optim.adam_beta2", "value"),
    ("--use-distributed-optimizer", "layout.use_distributed_optimizer", "true"),
)

# Restated by the recipe after the model arguments; the same fields as above.
TAIL_ARGS: tuple[Row, ...] = (
    ("--attention-dropout", "model.attention_dropout", "value"),
    ("--hidden-dropout", "model.hidden_dropout", "value"),
    ("--accumulate-allreduce-grads-in-fp32", "optim.accumulate_allreduce_grads_in_fp32", "true"),
    ("--attention-softmax-in-fp32", "model.attention_softmax_in_fp32", "true"),
    ("--distributed-timeout-minutes", "launcher.distributed_timeout_minutes", "value"),
)

SECTIONS: tuple[tuple[str, tuple[Row, ...]], ...] = (
    ("launcher", LAUNCHER_ARGS),
    ("model", MODEL_ARGS),
    ("run", RUN_ARGS),
    ("layout", LAYOUT_ARGS),
    ("optim", OPTIM_ARGS),
    ("tail", TAIL_ARGS),
)

_ROWS = {row[0]: row for _, rows in SECTIONS for row in rows}

# Megatron-LM arguments of ``launcher=local-megatron`` beyond the model, layout and optimizer rows, in the order
# they follow them; a flag the recipe's argv has is its row above, not a second one. ``megatron.*`` keys are the
# launch's own choices, set by :func:`trainer.launch.megatron_args.megatron_argv` (``megatron.train_iters`` the
# run's steps, ``megatron.transformer_impl`` / ``attention_backend`` Megatron's ``--transformer-impl`` /
# ``--attention-backend``; ``megatron.mtp_num_layers`` null for none). The fusions are Megatron-LM's field names
# (``gradient_accumulation_fusion``, ``persist_layer_norm``, ``masked_softmax_fusion``): Megatron-LM defaults
# them on, they need APEX's CUDA extensions or Megatron's own compiled kernels, which the bundle does not build
# (the recipe's image has APEX); the persistent layer norm and fused softmax only matter for the local spec.
MEGATRON_ARGS: tuple[Row, ...] = (
    ("--seq-length", "data.seq_length", "value"),
    ("--max-position-embeddings", "data.seq_length", "value"),
    _ROWS["--global-batch-size"],
    ("--train-iters", "megatron.train_iters", "value"),
    ("--seed", "launcher.seed", "value"),
    ("--clip-grad", "optim.clip_grad", "value"),
    _ROWS["--distributed-timeout-minutes"],
    ("--transformer-impl", "megatron.transformer_impl", "value"),
    ("--attention-backend", "megatron.attention_backend", "value"),
    # the rows are already token ids: no tokenizer is loaded (vocab size from --vocab-size)
    ("--tokenizer-type", "megatron.tokenizer_type", "value"),
    ("--no-gradient-accumulation-fusion", "megatron.gradient_accumulation_fusion", "false"),
    ("--no-persist-layer-norm", "megatron.persist_layer_norm", "false"),
    ("--no-masked-softmax-fusion", "megatron.masked_softmax_fusion", "false"),
    ("--mtp-num-layers", "megatron.mtp_num_layers", "value"),
    ("--bf16", "optim.bf16", "true"),
    _ROWS["--calculate-per-token-loss"],
    _ROWS["--accumulate-allreduce-grads-in-fp32"],
    # TransformerConfig fields, which Megatron-LM's parser makes flags of (ArgumentGroupFactory)
    _ROWS["--moe-router-freeze-gate"],
    _ROWS["--freeze-e-score-correction-bias"],
)

# Row conditions of the megatron-core argv: a row of MODEL_ARGS, LAYOUT_ARGS or OPTIM_ARGS whose flag starts with
# one of these renders there only when the boolean key is true (miles always gets it). ``--max-tokens-per-gpu``
# is miles' own flag (Megatron-LM's parser has none); the V4 rows need the V4 attention variant; the local
# transformer implementation gets no ``--moe-grouped-gemm`` (its grouped GEMM for experts is TransformerEngine's).
MEGATRON_WHEN: tuple[tuple[str, str], ...] = (
    ("--max-tokens-per-gpu", "megatron.miles"),
    ("--moe-grouped-gemm", "megatron.transformer_engine"),
    ("--dsv4-", "megatron.v4"),
    ("--dsa-indexer-", "megatron.v4"),
    ("--spec", "megatron.v4"),
    ("--experimental-attention-variant", "megatron.v4"),
)


def format_value(value: Any, integral: bool = False) -> str:
    """One argv token for a config value: floats as Python's shortest repr with a short exponent.

    ``1e-06`` becomes ``1e-6``; ``16.0`` stays ``16.0`` unless ``integral`` (the ``int`` kind), which
    writes a float with an integral value as the integer ``16``; booleans are lower-case; everything
    else ``str()``. The token is the recipe's string, compared byte for byte by the golden test.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if integral and isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exponent = text.split("e")
            sign = "-" if exponent.startswith("-") else ""
            text = f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"
        return text
    return str(value)


def render_rows(cfg: DictConfig, rows: tuple[Row, ...]) -> list[str]:
    """Render one table of ``(flag, key, kind)`` rows against a composed config into argv tokens.

    Raises ``KeyError`` for a key the config lacks and ``ValueError`` for an unknown kind or a
    non-boolean value under a boolean kind (programming errors, not user errors).
    """
    out: list[str] = []
    for flag, key, kind in rows:
        value = OmegaConf.select(cfg, key, throw_on_missing=True, default=KeyError)
        if value is KeyError:
            raise KeyError(f"render: config has no key {key!r} for {flag}")
        if isinstance(value, DictConfig):
            raise ValueError(f"render: {key} is a mapping, {flag} needs a value")
        if kind in ("value", "int"):
            if value is not None:
                out += [flag, format_value(value, integral=kind == "int")]
        elif kind in ("true", "false"):
            if not isinstance(value, bool):
                raise ValueError(f"render: {key} must be a boolean for {flag}, got {value!r}")
            if value == (kind == "true"):
                out.append(flag)
        elif kind == "nargs":
            out += [flag, *(format_value(v) for v in value)]
        elif kind == "pylist":
            out += [flag, "[" + ",".join(format_value(v) for v in value) + "]"]
        else:
            raise ValueError(f"render: unknown kind {kind!r} for {flag}")
    return out


def _condition(cfg: DictConfig, key: str) -> bool:
    """The boolean at ``key`` of a row condition; ``KeyError``/``ValueError`` as :func:`render_rows`."""
    value = OmegaConf.select(cfg, key, throw_on_missing=True, default=KeyError)
    if not isinstance(value, bool):
        raise (KeyError if value is KeyError else ValueError)(
            f"render: row condition {key} must be a boolean, got {value!r}"
        )
    return value


def render_megatron(cfg: DictConfig) -> list[str]:
    """The megatron-core argv (without the program name) of a composed config that also holds the ``megatron``
    node of :data:`MEGATRON_ARGS` (:func:`trainer.launch.megatron_args.megatron_argv` adds it): the model, layout
    and optimizer rows that :data:`MEGATRON_WHEN` keeps, then :data:`MEGATRON_ARGS`. Raises as :func:`render_rows`.
    """
    argv: list[str] = []
    for rows in (MODEL_ARGS, LAYOUT_ARGS, OPTIM_ARGS):
        keep = tuple(
            r for r in rows if all(_condition(cfg, when) for prefix, when in MEGATRON_WHEN if r[0].startswith(prefix))
        )
        argv += render_rows(cfg, keep)
    return argv + render_rows(cfg, MEGATRON_ARGS)


@dataclass(frozen=True)
class Launch:
    """The launch a composed run becomes.

    ``argv``: the full command (entrypoint + arguments), list of strings.
    ``env``: environment variables set for every training process (values may hold ``$VARS`` that the
    cluster's shell expands). ``model_args``: the slice of ``argv`` that miles' ``model_args_utils.py``
    would print for the model.
    """

    argv: list[str]
    env: dict[str, str]
    model_args: list[str]

    def shell_script(self) -> str:
        """The launch as a bash script in the recipe's style: ``export`` lines, then the command.

        ``$VAR`` references stay expandable (double quotes); everything else is quoted with ``shlex``.
        """
        lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
        # a secret-named variable is taken from the caller's environment: its value is never written out
        lines += [
            f'export {k}="${{{k}:?{k} is a secret: set it in the environment}}"'
            if is_secret_name(k)
            else f"export {k}={shell_word(v)}"
            for k, v in self.env.items()
        ]
        lines.append("")
        lines.append(" \\\n  ".join(argv_words(self.argv)))
        return "\n".join(lines) + "\n"


_SIMPLE_REFS = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")


def argv_words(argv: list[str]) -> list[str]:
    """``argv`` quoted for bash (:func:`shell_word`), one flag and its values per item (the recipe's style:
    ``--tensor-model-parallel-size 2``); a first item without ``--`` is the program."""
    words: list[list[str]] = []
    for token in argv:
        if not words or token.startswith("--"):
            words.append([])
        words[-1].append(shell_word(token))
    return [" ".join(w) for w in words]


def shell_word(token: str) -> str:
    """Quote ``token`` for bash. A token whose only specials are plain variable references (``$HF_CKPT``,
    ``${KERNEL_CACHE}/triton``) is double-quoted so the shell expands them; anything else (``$(cmd)``,
    ``${X:=y}``, backticks, quotes) is single-quoted by ``shlex.quote`` and stays literal."""
    rest = _SIMPLE_REFS.sub("", token)
    if rest != token and not any(c in rest for c in '$"`\\!'):
        return f'"{token}"'
    return shlex.quote(token)


def render(cfg: DictConfig) -> Launch:
    """Render a composed (and checked) config as the miles launch.

    ``cfg`` is the Hydra composition (``conf/train.yaml``); interpolations are resolved here.
    Returns a :class:`Launch`; raises ``KeyError``/``ValueError`` only on a programming error.
    """
    argv: list[str] = [str(t) for t in cfg.launcher.entrypoint]
    model_args: list[str] = []
    for name, rows in SECTIONS:
        tokens = render_rows(cfg, rows)
        if name == "model":
            model_args = tokens
        argv += tokens
    env = {k: str(v) for k, v in as_dict(cfg.env).items()}
    return Launch(argv=argv, env=env, model_args=model_args)
