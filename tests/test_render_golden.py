"""Golden: the default composition renders the seed's miles launch argument for argument."""

import shlex

import pytest

import helpers
from helpers import compose, reference_model_args, seed_command
from trainer.compose.render import MODEL_ARGS, format_value, render


def test_default_composition_renders_the_seed_command_argument_for_argument():
    launch = render(compose("layout=tp2pp4ep8"))
    golden_argv, _ = seed_command()
    assert len(golden_argv) == 229  # python3 train.py, 6 launcher tokens, 144 model tokens, 77 more
    assert golden_argv[8 : 8 + len(reference_model_args())] == reference_model_args()
    assert len(launch.argv) == len(golden_argv)
    # Raw strings, byte for byte: no numeric normalisation (the recipe's `16` is not our `16.0`).
    mismatches = [
        (i, ours, theirs)
        for i, (ours, theirs) in enumerate(zip(launch.argv, golden_argv, strict=True))
        if ours != theirs
    ]
    assert mismatches == []
    assert launch.argv == golden_argv
    # Flags (every token starting with --) are identical strings, in the same order.
    assert [t for t in launch.argv if t.startswith("--")] == [t for t in golden_argv if t.startswith("--")]


def test_default_composition_renders_the_seed_environment():
    launch = render(compose())
    _, golden_env = seed_command()
    assert launch.env == golden_env
    assert launch.env["TILELANG_CACHE_DIR"] == "$KERNEL_CACHE/tilelang"


def test_paths_stay_symbolic_or_come_from_config():
    argv = render(compose()).argv
    assert argv[argv.index("--hf-checkpoint") + 1] == "$HF_CKPT"
    argv = render(compose("paths.hf_checkpoint=/ckpt/dsv4", "paths.kernel_cache=/cache")).argv
    assert argv[argv.index("--hf-checkpoint") + 1] == "/ckpt/dsv4"
    assert render(compose("paths.kernel_cache=/cache")).env["TRITON_CACHE_DIR"] == "/cache/triton"


@pytest.mark.parametrize("variant", ["deepseek-v4-flash", "deepseek-v4-flash-4layer"])
def test_model_args_match_miles_snapshot(variant):
    launch = render(compose(f"model={variant}"))
    golden = reference_model_args(variant)
    assert len(launch.model_args) == len(golden)
    assert [(a, b) for a, b in zip(launch.model_args, golden, strict=True) if a != b] == []


def test_every_model_field_with_a_flag_is_rendered_from_config():
    # Change one value: exactly that token changes.
    base = render(compose()).model_args
    changed = render(compose("model.dsv4_window_size=256")).model_args
    diff = [(a, b) for a, b in zip(base, changed, strict=False) if a != b]
    assert diff == [("128", "256")]
    assert len({key for _, key, _ in MODEL_ARGS}) == len(MODEL_ARGS)


def test_store_false_flags_follow_their_field():
    on = render(compose("model.apply_rope_fusion=true", "model.add_bias_linear=true")).argv
    assert "--no-rope-fusion" not in on and "--disable-bias-linear" not in on
    off = render(compose()).argv
    assert "--no-rope-fusion" in off and "--disable-bias-linear" in off


def test_tp8pp8ep8_renders_its_layout_and_token_budget():
    argv = render(compose("layout=tp8pp8ep8")).argv
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--tensor-model-parallel-size"] == "8"
    assert pairs["--pipeline-model-parallel-size"] == "8"
    assert pairs["--decoder-first-pipeline-num-layers"] == "4"
    assert pairs["--decoder-last-pipeline-num-layers"] == "3"
    assert pairs["--max-tokens-per-gpu"] == "2048"


def test_shell_script_parses_back_to_the_argv():
    launch = render(compose())
    script = launch.shell_script()
    body = script.split("\n\n", 1)[1].replace("\\\n", " ")
    assert shlex.split(body) == launch.argv
    assert 'export TILELANG_CACHE_DIR="$KERNEL_CACHE/tilelang"' in script


@pytest.mark.parametrize(
    "token,quoted",
    [
        ("$HF_CKPT", '"$HF_CKPT"'),
        ("${KERNEL_CACHE}/triton", '"${KERNEL_CACHE}/triton"'),
        ("$(rm -rf /)", "'$(rm -rf /)'"),
        ("${X:=y}", "'${X:=y}'"),
        ("`id`", "'`id`'"),
        ("plain", "plain"),
    ],
)
def test_shell_words_expand_plain_variables_only(token, quoted):
    from trainer.compose.render import shell_word

    assert shell_word(token) == quoted
    # bash agrees: a command substitution is never run
    import subprocess

    out = subprocess.run(
        ["bash", "-c", f"HF_CKPT=/ckpt KERNEL_CACHE=/kc; printf %s {quoted}"], capture_output=True, text=True
    )
    expected = {"$HF_CKPT": "/ckpt", "${KERNEL_CACHE}/triton": "/kc/triton"}.get(token, token)
    assert out.stdout == expected


@pytest.mark.parametrize(
    "value,text",
    [(1e-6, "1e-6"), (1e-5, "1e-5"), (0.0, "0.0"), (0.98, "0.98"), (160000.0, "160000.0"), (True, "true"), (7, "7")],
)
def test_format_value(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize(
    "value,text", [(16.0, "16"), (0.0, "0"), (160000.0, "160000"), (16.5, "16.5"), (1e-6, "1e-6"), (7, "7")]
)
def test_format_value_integral_form(value, text):
    assert format_value(value, integral=True) == text


def test_integral_flags_keep_an_override_that_is_not_integral():
    argv = render(compose("model.rotary_scaling_factor=16.5", "model.beta_fast=33")).argv
    assert argv[argv.index("--rotary-scaling-factor") + 1] == "16.5"
    assert argv[argv.index("--beta-fast") + 1] == "33"


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
