"""Pre-launch checks: good layouts derive the right sizes; bad compositions fail with one line naming the field."""

import pytest

import helpers
from helpers import compose
from trainer.compose import checks
from trainer.compose.compose import validate
from trainer.errors import UserError
from trainer.train import prepare_command_line as preflight


def derived(*overrides):
    return checks.check(validate(compose(*overrides)))


def test_seed_layout_sizes():
    par = derived()
    assert par.world_size == 64
    assert par.data_parallel_size == 8
    assert par.expert_data_parallel_size == 2  # 64 / (ETP 1 x EP 8 x PP 4)
    assert par.stage_layers == [11, 11, 11, 10]
    assert par.microbatches == 16  # 128 rows / (micro-batch 1 x DP 8)


def test_reference_layout_sizes():
    par = derived("layout=tp8pp8ep8")
    assert par.world_size == 64
    assert par.data_parallel_size == 1
    assert par.expert_data_parallel_size == 1
    assert par.stage_layers == [4, 6, 6, 6, 6, 6, 6, 3]
    assert sum(par.stage_layers) == 43


@pytest.mark.parametrize(
    "overrides,world,dp,stages",
    [
        (["layout=gpu1-tp1pp1ep1", "model=deepseek-v4-tiny"], 1, 1, [2]),
        (["layout=gpu2-tp1pp1ep2", "model=deepseek-v4-tiny"], 2, 2, [2]),
        (["layout=gpu2-tp1pp2ep1", "model=deepseek-v4-flash-4layer"], 2, 1, [2, 2]),
        (["layout=gpu8-tp1pp1ep8", "model=deepseek-v4-flash-4layer"], 8, 8, [4]),
        (["layout=gpu8-tp2pp2ep4", "model=deepseek-v4-flash-4layer"], 8, 2, [2, 2]),
    ],
)
def test_small_layouts(overrides, world, dp, stages):
    par = derived(*overrides)
    assert (par.world_size, par.data_parallel_size, par.stage_layers) == (world, dp, stages)


def test_stage_split_even_and_pinned():
    assert checks.stage_split(43, 4, 11, 10) == [11, 11, 11, 10]
    assert checks.stage_split(43, 8, 4, 3) == [4, 6, 6, 6, 6, 6, 6, 3]
    assert checks.stage_split(8, 4, None, None) == [2, 2, 2, 2]
    assert checks.stage_split(7, 3, 1, None) == [1, 3, 3]
    assert checks.stage_split(5, 2, 3, 2) == [3, 2]


BAD = [
    # world size, DP, expert grid
    (
        ["cluster.nodes=4"],
        "layout.data_parallel_size 8 != world 32 / (TP 2 x PP 4 x CP 1) = 4 "
        "(world size 32 = cluster.nodes 4 x cluster.gpus_per_node 8)",
    ),
    (["layout.data_parallel_size=16"], "layout.data_parallel_size 16 != world 64 / (TP 2 x PP 4 x CP 1) = 8"),
    (
        ["layout.tensor_model_parallel_size=3"],
        "layout: TP 3 x PP 4 x CP 1 = 12 does not divide the world size 64 = cluster.nodes 8 x cluster.gpus_per_node 8",
    ),
    (["layout.context_parallel_size=3"], "layout: TP 2 x PP 4 x CP 3 = 24 does not divide the world size 64"),
    (["layout.expert_model_parallel_size=32"], "layout: ETP 1 x EP 32 x PP 4 = 128 does not divide the world size 64"),
    (["layout.expert_tensor_parallel_size=4"], "layout: ETP 4 x EP 8 x PP 4 = 128 does not divide the world size 64"),
    (["cluster.nodes=0"], "cluster.nodes must be >= 1 (got 0)"),
    (["layout.tensor_model_parallel_size=0"], "layout.tensor_model_parallel_size must be >= 1 (got 0)"),
    # pipeline split
    (
        ["layout.decoder_first_pipeline_num_layers=12"],
        "layout.pipeline_model_parallel_size 4: model.num_layers 43 - first 12 - last 10 = 21 layers "
        "do not split evenly over 2 middle stages",
    ),
    (
        ["layout=tp8pp8ep8", "layout.decoder_last_pipeline_num_layers=4"],
        "model.num_layers 43 - first 4 - last 4 = 35 layers do not split evenly over 6 middle stages",
    ),
    (
        ["layout.pipeline_model_parallel_size=2", "layout.data_parallel_size=16"],
        "layout: PP 2 stages hold first 11 + last 10 = 21 layers, but model.num_layers is 43",
    ),
    (
        ["model=deepseek-v4-flash-4layer"],
        "model.num_layers 4 - first 11 - last 10 = -17 layers do not split evenly over 2 middle stages",
    ),
    (
        ["layout=gpu8-tp2pp2ep4"],
        "layout.pipeline_model_parallel_size 2: model.num_layers 43 layers do not split evenly over 2 stages",
    ),
    (
        ["layout.num_virtual_stages_per_pipeline_rank=2"],
        "layout.num_virtual_stages_per_pipeline_rank 2 does not divide the stage layers [11, 11, 11, 10]",
    ),
    # divisibility of experts and heads
    (["model.num_experts=100"], "model.num_experts 100 is not divisible by layout.expert_model_parallel_size 8"),
    (
        ["model.num_attention_heads=65"],
        "model.num_attention_heads 65 is not divisible by layout.tensor_model_parallel_size 2",
    ),
    (["model.moe_router_topk=0"], "model.moe_router_topk 0 must be in 1..model.num_experts 256"),
    # sequence parallel
    (
        ["layout=gpu1-tp1pp1ep1", "model=deepseek-v4-tiny", "layout.sequence_parallel=true"],
        "layout.sequence_parallel true needs layout.tensor_model_parallel_size > 1 (got 1)",
    ),
    (
        ["layout.sequence_parallel=false"],
        "layout.sequence_parallel must be true: MoE (model.num_experts 256) with "
        "layout.tensor_model_parallel_size 2 > 1 needs sequence parallel",
    ),
    # batch and rows
    (
        ["optim.global_batch_size=100"],
        "optim.global_batch_size 100 is not divisible by layout.micro_batch_size 1 x DP 8 = 8",
    ),
    (
        ["layout.micro_batch_size=3"],
        "optim.global_batch_size 128 is not divisible by layout.micro_batch_size 3 x DP 8 = 24",
    ),
    (["optim.rollout_batch_size=192"], "optim.rollout_batch_size 192 is not a multiple of optim.global_batch_size 128"),
    (["data.seq_length=4096"], "data.seq_length 4096 != data.build.row_tokens 8192"),
    (["optim.min_lr=1e-4"], "optim.min_lr 0.0001 > optim.lr 1e-05"),
    # model lists, recompute, dispatcher
    (["model.moe_layer_freq=[1,1]"], "model.moe_layer_freq has 2 entries, model.num_layers is 43"),
    (
        ["model.dsv4_compress_ratios=[0]"],
        "model.dsv4_compress_ratios has 1 entries, expected model.num_layers 43 (+ model.mtp_num_layers 1)",
    ),
    (
        ["layout.recompute_method=null"],
        "layout.recompute_method must be uniform or block with full recompute (got None)",
    ),
    (
        ["layout.moe_token_dispatcher_type=ring"],
        "layout.moe_token_dispatcher_type must be allgather, alltoall or flex (got ring)",
    ),
    # schema: unknown keys, wrong types, unknown options
    (["layout.foo=1"], "Key 'foo' not in 'LayoutConfig' (key: layout.foo)"),
    (["+model.x=1"], "model.x: unknown key"),
    (
        ["layout.tensor_model_parallel_size=abc"],
        "Value 'abc' of type 'str' could not be converted to Integer (key: layout.tensor_model_parallel_size)",
    ),
    (["model.norm_epsilon=tiny"], "could not be converted to Float (key: model.norm_epsilon)"),
    (
        ["layout.use_distributed_optimizer=maybe"],
        "Value 'maybe' is not a valid bool (type str) (key: layout.use_distributed_optimizer)",
    ),
    (["model.num_layers=null"], "field 'model.num_layers' is not Optional"),
    (["layout=nope"], "Could not find 'layout/nope' (available: gpu1-tp1pp1ep1, gpu2-tp1pp1ep1, gpu2-tp1pp1ep2"),
    # stack pins against the lockfile
    (["stack.nccl=2.28.8"], "stack.nccl 2.28.8 != lockfiles/stack.json components.nccl.version 2.28.9"),
    (["stack.lockfile=lockfiles/missing.json"], "lockfiles/missing.json: stack lockfile not found"),
    # launcher-specific: megatron-core's local spec and this machine
    (["launcher=local-megatron"], "cluster.nodes 8: launcher local-megatron runs on one node (use slurm or ray)"),
    (
        [
            "launcher=local-megatron",
            "layout=gpu1-tp1pp1ep1",
            "model=deepseek-v4-tiny",
            "launcher.transformer_impl=local",
        ],
        "launcher local-megatron: model.multi_latent_attention true: MLA needs TransformerEngine's attention",
    ),
    (
        ["experiment=dsv4-tiny-h200", "launcher.transformer_impl=local"],
        "launcher local-megatron: model.multi_latent_attention true: MLA needs TransformerEngine's attention",
    ),
    (
        [
            "experiment=dsv4-tiny-h200",
            "launcher.transformer_impl=transformer_engine",
            "model.mtp_num_layers=1",
            "model.dsv4_compress_ratios=[0,4,128,4,0]",
        ],
        "launcher local-megatron: model.mtp_num_layers 1 with the V4 attention: "
        "Megatron-LM 37f91617's MTP layer asserts",
    ),
    (
        ["experiment=dsv4-tiny-h200", "launcher.transformer_impl=transformer_engine", "layout.micro_batch_size=2"],
        "launcher local-megatron: layout.micro_batch_size 2 with the V4 model: "
        "TileKernels 1.0.0's hyper-connection backward",
    ),
    (
        ["experiment=proxy-h200", "launcher.transformer_impl=apex"],
        "launcher.transformer_impl must be auto, transformer_engine or local (got apex)",  # the schema's Enum
    ),
    (
        ["experiment=proxy-h200", "launcher.attention_backend=cudnn"],
        "launcher.attention_backend must be unfused, fused, flash, local or auto (got cudnn)",  # the schema's Enum
    ),
    (
        ["experiment=proxy-h200", "launcher.megatron_lm_path=/nonexistent/Megatron-LM"],
        "launcher.megatron_lm_path /nonexistent/Megatron-LM: not a megatron_lm checkout (no megatron/ in it)",
    ),
    (["experiment=proxy-h200", "layout=gpu8-tp2pp2ep4"], "launcher local-megatron: layout.sequence_parallel true"),
    (
        ["experiment=smoke", "layout=gpu2-tp1pp1ep2"],
        "layout.expert_model_parallel_size 2: launcher local-cpu runs data parallel only",
    ),
    # sweeps
    (["layout=tp2pp4ep8,tp8pp8ep8"], "layout=tp2pp4ep8,tp8pp8ep8: a sweep needs multirun (-m, or hydra.mode=MULTIRUN)"),
    (["-m", "layout=tp2pp4ep8,gpu8-tp2pp2ep4"], "layout=gpu8-tp2pp2ep4: layout.pipeline_model_parallel_size 2"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_composition_fails_with_one_line(overrides, message):
    with pytest.raises(UserError) as info:
        preflight(overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_at_least_twenty_bad_compositions():
    assert len(BAD) >= 20


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
