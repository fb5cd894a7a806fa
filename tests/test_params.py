"""Parameter counts from config shapes (transformers' DeepseekV4ForCausalLM layout)."""

import helpers
from helpers import compose
from trainer.compose.compose import validate
from trainer.compose.params import count_params


def params(*overrides):
    return count_params(validate(compose(*overrides)).model)


def test_deepseek_v4_flash_active_parameters_per_token():
    # the recipe's MFU basis: https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash revision 60d8d707
    assert params().active_per_token == 13_268_221_952


def test_deepseek_v4_flash_total_on_the_same_basis():
    assert params().total_matrices == 283_800_829_952


def test_flash_layer_kinds():
    p = params()
    ratios = [layer.compress_ratio for layer in p.layers]
    assert ratios[:4] == [0, 0, 4, 128] and len(ratios) == 43
    window, csa, hca = p.layers[0], p.layers[2], p.layers[3]
    # every layer: attention 106,954,752 + hyper-connections 786,432 + router 1,048,576 + shared expert 25,165,824
    assert window.matrices == 133_955_584
    assert csa.matrices - window.matrices == 19_136_512  # compressor (2 x [1024, 4096]) + indexer
    assert hca.matrices - window.matrices == 4_194_304  # compressor 2 x [512, 4096]
    assert window.expert_each == 3 * 2048 * 4096
    assert p.embedding == 129_280 * 4096


def test_tiny_model_by_hand():
    p = params("model=deepseek-v4-tiny")
    H, nh, hd, qr, g, ro, k = 64, 4, 16, 32, 2, 16, 2
    attention = qr * H + nh * hd * qr + hd * H + g * ro * (nh * hd // g) + H * g * ro
    common = attention + 2 * (2 + k) * k * k * H + 4 * H + 3 * 32 * H
    csa_extra = 2 * (2 * hd * H) + 2 * (2 * 8 * H) + 2 * 8 * qr + 2 * H
    assert [layer.matrices for layer in p.layers] == [common, common + csa_extra]
    assert p.active_per_token == 2 * common + csa_extra + 2 * 2 * (3 * 32 * H) + 129_280 * H + k * k * H


def test_more_layers_more_parameters():
    assert params("model=deepseek-v4-flash-4layer").total < params().total


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
