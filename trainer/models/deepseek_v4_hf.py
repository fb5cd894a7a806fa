"""The composed DeepSeek-V4 ``model`` config as transformers' ``DeepseekV4ForCausalLM`` (CPU smoke runs).

Field mapping (ours, Megatron's names -> ``DeepseekV4Config``, transformers 5.24):
num_layers -> num_hidden_layers, qk_head_dim -> head_dim (V4's single shared K=V head), qk_pos_emb_head_dim ->
qk_rope_head_dim, num_experts -> n_routed_experts, moe_router_topk -> num_experts_per_tok, moe_ffn_hidden_size ->
moe_intermediate_size (transformers sizes the shared expert with the same width, so
moe_shared_expert_intermediate_size must equal it), moe_router_score_function -> scoring_func,
moe_router_topk_scaling_factor -> routed_scaling_factor, rotary_base -> rope_theta, dsv4_* -> hc_mult,
hc_sinkhorn_iters, compress_ratios (per layer 0 / 4 / 128), compress_rope_theta, o_groups, o_lora_rank,
num_hash_layers, sliding_window; dsa_indexer_* -> index_n_heads / index_head_dim / index_topk;
activation_func_clamp_value -> swiglu_limit; norm_epsilon -> rms_norm_eps; YaRN (rotary_scaling_factor,
original_max_position_embeddings, beta_fast, beta_slow) -> the compressed branches' rope parameters.

Random init only (no checkpoint is reachable here). The hash-routed layers' ``tid2eid`` table, a fixed lookup
in a real checkpoint, is filled from the seed with ``topk`` distinct experts per token id.
"""

from __future__ import annotations

from typing import Any

from trainer.compose.schema import ModelConfig
from trainer.errors import UserError


def hf_config_kwargs(m: ModelConfig) -> dict[str, Any]:
    """Keyword arguments of ``DeepseekV4Config`` for ``m`` (see the module docstring for the mapping).

    Raises :class:`UserError` for shapes transformers cannot express (a shared expert of another width,
    dense layers, compress ratios other than 0, 4, 128).
    """
    if m.moe_shared_expert_intermediate_size != m.moe_ffn_hidden_size:
        raise UserError(
            f"model.moe_shared_expert_intermediate_size {m.moe_shared_expert_intermediate_size} != "
            f"model.moe_ffn_hidden_size {m.moe_ffn_hidden_size}: transformers' DeepseekV4 sizes both alike"
        )
    if any(f != 1 for f in m.moe_layer_freq):
        raise UserError("model.moe_layer_freq: transformers' DeepseekV4 has MoE in every layer (all entries must be 1)")
    ratios = list(m.dsv4_compress_ratios[: m.num_layers])
    if any(r not in (0, 4, 128) for r in ratios):
        raise UserError(f"model.dsv4_compress_ratios {ratios}: transformers' DeepseekV4 knows ratios 0, 4 and 128")
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=1,
        head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim,
        q_lora_rank=m.q_lora_rank,
        n_routed_experts=m.num_experts,
        n_shared_experts=1,
        num_experts_per_tok=m.moe_router_topk,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        scoring_func=m.moe_router_score_function,
        routed_scaling_factor=m.moe_router_topk_scaling_factor,
        rope_theta=float(m.rotary_base),
        compress_rope_theta=float(m.dsv4_compress_rope_theta),
        rope_parameters={
            "rope_type": "yarn",
            "factor": float(m.rotary_scaling_factor),
            "original_max_position_embeddings": m.original_max_position_embeddings,
            "beta_fast": float(m.beta_fast),
            "beta_slow": float(m.beta_slow),
        },
        compress_ratios=ratios,
        num_hash_layers=m.dsv4_n_hash_layers,
        hc_mult=m.dsv4_hc_mult,
        hc_sinkhorn_iters=m.dsv4_hc_sinkhorn_iters,
        sliding_window=m.dsv4_window_size,
        o_groups=m.dsv4_o_groups,
        o_lora_rank=m.dsv4_o_lora_rank,
        index_n_heads=m.dsa_indexer_n_heads,
        index_head_dim=m.dsa_indexer_head_dim,
        index_topk=m.dsa_indexer_topk,
        swiglu_limit=float(m.activation_func_clamp_value),
        rms_norm_eps=float(m.norm_epsilon),
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        attention_dropout=float(m.attention_dropout),
        num_nextn_predict_layers=m.mtp_num_layers,
        bos_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )


def build_model(m: ModelConfig, seed: int):
    """A randomly initialised ``DeepseekV4ForCausalLM`` for ``m`` in float32, seeded by ``seed``.

    Returns the module in train mode. The hash routers' ``tid2eid`` ([vocab, topk] expert ids) are drawn
    from ``seed``: ``topk`` distinct experts per token id.
    """
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**hf_config_kwargs(m))
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            fill_tid2eid(table, m.num_experts, generator)
    return model.train()


def fill_tid2eid(table, num_experts: int, generator) -> None:
    """Fill a hash router's ``tid2eid`` table ``[vocab, topk]`` in place with ``topk`` distinct expert ids per
    token id, drawn from ``generator`` (a ``torch.Generator``): the argsort of uniform scores per row. A real
    checkpoint carries its own table; this is the random-init stand-in."""
    import torch

    scores = torch.rand(table.shape[0], num_experts, generator=generator)
    table.copy_(scores.argsort(dim=1)[:, : table.shape[1]].to(table.dtype))


def freeze_router(model, freeze_gate: bool, freeze_bias: bool) -> int:
    """Freeze router gate weights (``--moe-router-freeze-gate``); the expert score-correction bias is a buffer
    in transformers and never trained here, matching ``--freeze-e-score-correction-bias``.

    Returns the number of parameters (scalars) frozen.
    """
    frozen = 0
    for name, param in model.named_parameters():
        if freeze_gate and name.endswith("mlp.gate.weight"):
            param.requires_grad_(False)
            frozen += param.numel()
    del freeze_bias  # a buffer: no gradient, no update
    return frozen
