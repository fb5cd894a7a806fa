"""Parameter counts of a DeepSeek-V4 model from its config shapes (no torch needed).

The layout of weights is that of transformers' ``DeepseekV4ForCausalLM`` (transformers 5.24.0,
``models/deepseek_v4/modeling_deepseek_v4.py``), checked against that model instantiated on the meta
device. With H = hidden_size, nh = num_attention_heads, hd = qk_head_dim (V4 uses one shared K=V head of
width hd, so kv_lora_rank = v_head_dim = hd), qr = q_lora_rank, g = dsv4_o_groups, ro = dsv4_o_lora_rank,
k = dsv4_hc_mult, E = num_experts, K = moe_router_topk, F = moe_ffn_hidden_size, Fs =
moe_shared_expert_intermediate_size, ih/id = dsa_indexer_n_heads/head_dim, V = vocab_size, the 2-D
weight matrices are:

=========================================  =====================================  ==========================
matrix                                     shape                                  layers
=========================================  =====================================  ==========================
attention q_a, q_b, kv, o_a, o_b           [qr,H] [nh*hd,qr] [hd,H]               every layer
                                           [g*ro, nh*hd/g] [H, g*ro]
hyper-connection fn (attention, MLP)       2 x [(2+k)*k, k*H]                     every layer
router                                     [E, H]                                 every layer (hash layers too)
shared expert gate, up, down               3 x Fs*H                               every layer
routed expert gate, up, down               3 x F*H each, E of them                every layer
compressor kv, gate (CSA, ratio 4)         2 x [2*hd, H]                          CSA layers
compressor kv, gate (HCA, other ratios)    2 x [hd, H]                            HCA layers
indexer kv, gate, q_b, scorer              2 x [2*id, H], [ih*id, qr], [ih, H]    CSA layers
output head, hc head                       [V, H], [k, k*H]                       once
=========================================  =====================================  ==========================

A model whose ``experimental_attention_variant`` is not ``dsv4`` (the megatron-core proxy) has plain multi-head
attention instead: Q, K, V, O of [nh*hd, H] each, no hyper-connections, no compressors.

Ratio 0 layers are sliding-window only (no compressor). 1-D vectors (norms, attention sinks,
hyper-connection base/scale), the compressors' position biases ([ratio, width]) and the input embedding
[V, H] are counted apart.

Active parameters per token N (the recipe's MFU basis, shared docs STACK.md): the 2-D matrices of the
main layers' active path (K routed + the shared expert) plus the output and hc heads, excluding the
input embedding, the MTP layer, 1-D vectors and position biases: 13,268,221,952 for DeepSeek-V4-Flash;
with all E experts, 283,800,829,952.

The MTP layer (``mtp_num_layers``) is not built by transformers; it is estimated here as one
sliding-window layer plus its [H, 2H] input projection and is used only in the memory estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.compose.schema import ModelConfig

CSA_RATIO = 4  # compress ratio of the compressed-sparse-attention layers (with indexer); others are HCA


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer (counts of scalars).

    ``matrices``: non-expert 2-D weights (attention, compressor, indexer, hyper-connections, router, shared
    expert); ``other``: 1-D vectors and position biases; ``expert_each``: one routed expert;
    ``n_experts``: routed experts in the layer; ``topk``: routed experts per token.
    """

    index: int
    compress_ratio: int
    matrices: int
    other: int
    expert_each: int
    n_experts: int
    topk: int

    @property
    def dense(self) -> int:
        """Every non-routed-expert parameter (replicated over EP, split over TP)."""
        return self.matrices + self.other

    @property
    def expert_total(self) -> int:
        """All routed-expert parameters of the layer (split over EP x ETP)."""
        return self.expert_each * self.n_experts

    @property
    def active_matrices(self) -> int:
        """2-D weights one token passes through: non-expert matrices + top-k routed experts."""
        return self.matrices + self.expert_each * self.topk


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts of a whole model (scalars). See the module docstring for the basis of N."""

    layers: list[LayerParams] = field(default_factory=list)
    embedding: int = 0
    output: int = 0
    hc_head: int = 0
    final_norm: int = 0
    mtp_dense: int = 0
    mtp_expert: int = 0

    @property
    def active_per_token(self) -> int:
        """N: active 2-D weights per token (main layers + output and hc heads)."""
        return sum(layer.active_matrices for layer in self.layers) + self.output + self.hc_head

    @property
    def total_matrices(self) -> int:
        """All 2-D weights on the same basis as N, with every routed expert."""
        return sum(layer.matrices + layer.expert_total for layer in self.layers) + self.output + self.hc_head

    @property
    def total(self) -> int:
        """Every parameter, MTP estimate included."""
        return (
            sum(layer.dense + layer.expert_total for layer in self.layers)
            + self.embedding
            + self.output
            + self.hc_head
            + self.final_norm
            + self.mtp_dense
            + self.mtp_expert
        )

    def stage_counts(self, stage_layers: list[int]) -> list[tuple[int, int]]:
        """``(dense, expert)`` parameters of each pipeline stage holding ``stage_layers[i]`` consecutive decoder
        layers: the embedding on the first stage; the output head, final norm and MTP on the last."""
        counts, first = [], 0
        for stage, n_layers in enumerate(stage_layers):
            layers = self.layers[first : first + n_layers]
            first += n_layers
            dense = sum(layer.dense for layer in layers)
            expert = sum(layer.expert_total for layer in layers)
            if stage == 0:
                dense += self.embedding
            if stage == len(stage_layers) - 1:
                dense += self.output + self.final_norm + self.mtp_dense
                expert += self.mtp_expert
            counts.append((dense, expert))
        return counts

    def summary(self) -> dict[str, int]:
        """JSON-ready counts: ``active_per_token``, ``total_matrices``, ``embedding``, ``total``."""
        return {
            "active_per_token": self.active_per_token,
            "total_matrices": self.total_matrices,
            "embedding": self.embedding,
            "total": self.total,
        }


def _layer(m: ModelConfig, index: int, ratio: int, moe: bool) -> LayerParams:
    H, nh, hd, qr = m.hidden_size, m.num_attention_heads, m.qk_head_dim, m.q_lora_rank
    g, ro, k = m.dsv4_o_groups, m.dsv4_o_lora_rank, m.dsv4_hc_mult
    ih, idim = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
    if m.experimental_attention_variant != "dsv4":
        # plain multi-head attention (the megatron-core proxy): Q, K, V, O of nh heads of width hd
        attention, hyper = 4 * H * nh * hd, 0
    else:
        attention = qr * H + nh * hd * qr + hd * H + (g * ro) * (nh * hd // g) + H * g * ro
        hyper = 2 * (2 + k) * k * k * H
    if moe:
        mlp = m.num_experts * H + 3 * m.moe_shared_expert_intermediate_size * H
    else:
        mlp = 3 * m.ffn_hidden_size * H
    matrices = attention + hyper + mlp
    other = qr + hd + nh + 2 * H + 2 * ((2 + k) * k + 3) if hyper else 2 * H
    if ratio == CSA_RATIO:
        matrices += 2 * (2 * hd * H) + 2 * (2 * idim * H) + ih * idim * qr + ih * H
        other += hd + idim + ratio * 2 * hd + ratio * 2 * idim
    elif ratio > 0:
        matrices += 2 * (hd * H)
        other += hd + ratio * hd
    return LayerParams(
        index=index,
        compress_ratio=ratio,
        matrices=matrices,
        other=other,
        expert_each=3 * m.moe_ffn_hidden_size * H if moe else 0,
        n_experts=m.num_experts if moe else 0,
        topk=m.moe_router_topk if moe else 0,
    )


def count_params(m: ModelConfig) -> ModelParams:
    """Count the parameters of a DeepSeek-V4 ``model`` config, layer by layer.

    Raises ``ValueError`` if ``moe_layer_freq`` or ``dsv4_compress_ratios`` are shorter than ``num_layers``.
    """
    if len(m.moe_layer_freq) < m.num_layers or len(m.dsv4_compress_ratios) < m.num_layers:
        raise ValueError("model.moe_layer_freq and model.dsv4_compress_ratios need one entry per layer")
    layers = [_layer(m, i, m.dsv4_compress_ratios[i], bool(m.moe_layer_freq[i])) for i in range(m.num_layers)]
    H, V, k = m.hidden_size, m.vocab_size, m.dsv4_hc_mult
    mtp_dense = mtp_expert = 0
    if m.mtp_num_layers:
        mtp = _layer(m, m.num_layers, 0, True)
        mtp_dense = m.mtp_num_layers * (mtp.dense + 2 * H * H + 2 * H)
        mtp_expert = m.mtp_num_layers * mtp.expert_total
    return ModelParams(
        layers=layers,
        embedding=V * H,
        output=V * H if m.untie_embeddings_and_output_weights else 0,
        hc_head=k * k * H if m.experimental_attention_variant == "dsv4" else 0,
        final_norm=H + k + 1,
        mtp_dense=mtp_dense,
        mtp_expert=mtp_expert,
    )
