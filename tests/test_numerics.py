"""Numerics equivalence: layout-only differences are performance, everything else numerics."""

import pytest

import helpers
from helpers import compose
from trainer.compose.numerics import NUMERICS, PERFORMANCE, classify, compare


def test_seed_vs_reference_layout_is_equivalent():
    verdict = compare(compose("layout=tp2pp4ep8"), compose("layout=tp8pp8ep8"))
    assert verdict.equivalent
    keys = {d.key for d in verdict.differences}
    assert {
        "layout.tensor_model_parallel_size",
        "layout.pipeline_model_parallel_size",
        "layout.decoder_first_pipeline_num_layers",
        "layout.decoder_last_pipeline_num_layers",
        "layout.max_tokens_per_gpu",
        "layout.data_parallel_size",  # not an argument: compared as a config key
    } == keys
    assert all(d.cls == PERFORMANCE for d in verdict.differences)


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.lr=2e-5", "optim.lr"),
        ("optim.adam_beta2=0.95", "optim.adam_beta2"),
        ("optim.moe_router_freeze_gate=false", "optim.moe_router_freeze_gate"),
        ("optim.loss_type=policy_loss", "optim.loss_type"),
        ("paths.prompt_data=/other/rows", "paths.prompt_data"),
        ("model.hidden_dropout=0.1", "model.hidden_dropout"),
    ],
)
def test_numerics_changes_are_flagged(override, key):
    verdict = compare(compose(override), compose())
    assert not verdict.equivalent
    assert [d.key for d in verdict.numerics_differences] == [key]
    text = verdict.as_dict()["verdict"]
    assert text.startswith("numerics differ: ") and verdict.numerics_differences[0].flag in text


@pytest.mark.parametrize(
    "override",
    ["layout.recompute_num_layers=2", "layout.moe_token_dispatcher_type=allgather", "model.moe_grouped_gemm=false"],
)
def test_performance_changes_keep_equivalence(override):
    verdict = compare(compose(override), compose())
    assert verdict.equivalent and len(verdict.differences) == 1


def test_fields_without_a_launch_argument_are_compared_too():
    verdict = compare(compose("optim.clip_grad=0.5", "launcher.distributed_timeout_minutes=60"), compose())
    assert {(d.key, d.cls) for d in verdict.differences} == {
        ("optim.clip_grad", NUMERICS),
        ("launcher.distributed_timeout_minutes", PERFORMANCE),
    }
    assert compare(compose("launcher.seed=7"), compose()).numerics_differences[0].key == "launcher.seed"


def test_env_difference_counts_as_numerics():
    verdict = compare(compose("+env.NCCL_ALGO=Ring"), compose())
    assert [d.key for d in verdict.differences] == ["env.NCCL_ALGO"] and not verdict.equivalent


def test_classify():
    assert classify("layout.sequence_parallel") == PERFORMANCE
    assert classify("cluster.nodes") == PERFORMANCE
    assert classify("model.num_layers") == NUMERICS
    assert classify("data.seq_length") == NUMERICS


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
