"""launcher=local-megatron on CPU: checkouts verified by git tree hash, the Megatron-LM argv and what
Megatron-LM's parser makes of it (the values the worker reads), the plan's choice, the initial values of
checkpoint-only V4 parameters."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import helpers
from helpers import compose
from trainer.compose import checks
from trainer.compose.compose import validate
from trainer.compose.plan import build_plan, megatron_choice
from trainer.errors import CheckError
from trainer.launch.host.checkout import verify_checkouts
from trainer.launch.megatron_args import megatron_argv, resolve_transformer_impl


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def _checkout(root: Path, package: str) -> tuple[str, str]:
    """A git repository with a package dir, an executable, a symlink and a nested file; (commit, tree)."""
    (root / package / "sub").mkdir(parents=True)
    (root / package / "__init__.py").write_text("__version__ = '0.0.1'\n")
    (root / package / "sub" / "data.txt").write_bytes(b"\x00\x01binary\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("run.sh")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "x")
    return _git(root, "rev-parse", "HEAD"), _git(root, "rev-parse", "HEAD^{tree}")


@pytest.fixture()
def checkouts(tmp_path):
    megatron, miles = tmp_path / "Megatron-LM", tmp_path / "miles"
    megatron.mkdir(), miles.mkdir()
    pins = {}
    for root, package, name in ((megatron, "megatron", "megatron_lm"), (miles, "miles", "miles")):
        commit, tree = _checkout(root, package)
        pins[name] = {"version": "0", "commit": commit, "tree": tree}
    lock = tmp_path / "stack.json"
    lock.write_text(json.dumps({"components": pins}))

    class Launcher:
        megatron_lm_path, miles_path = str(megatron), str(miles)

    return Launcher, lock, pins


def test_verify_checkouts_returns_the_locked_commits(checkouts):
    launcher, lock, pins = checkouts
    out = verify_checkouts(launcher, lock)
    assert out["megatron_lm"]["commit"] == pins["megatron_lm"]["commit"]
    assert out["miles"]["tree"] == pins["miles"]["tree"]
    assert out["miles"]["path"] == launcher.miles_path


def test_verify_checkouts_refuses_another_tree_with_one_line(checkouts):
    launcher, lock, pins = checkouts
    (Path(launcher.miles_path) / "miles" / "extra.py").write_text("x = 1\n")
    with pytest.raises(CheckError) as info:
        verify_checkouts(launcher, lock)
    text = str(info.value)
    assert text.startswith(f"launcher.miles_path {launcher.miles_path}: files hash to git tree ")
    assert f"stack.json pins {pins['miles']['tree']}" in text and text.endswith("refused") and "\n" not in text


def test_checkouts_come_from_the_cache_when_no_path_is_given(checkouts, tmp_path, monkeypatch):
    from trainer.errors import UserError
    from trainer.image.cas import Cache
    from trainer.image.sources import add_git, pins_for

    launcher, lock, pins = checkouts
    for var in ("MEGATRON_LM_PATH", "MILES_PATH"):
        monkeypatch.delenv(var, raising=False)
    cache = Cache(tmp_path / "cache")
    megatron_root, miles_root = launcher.megatron_lm_path, launcher.miles_path
    launcher.megatron_lm_path = launcher.miles_path = None
    with pytest.raises(
        UserError, match=r"missing input source megatron_lm@[0-9a-f]{12} .*trainer cache add-git CLONE --commit"
    ):
        verify_checkouts(launcher, lock, cache)
    for repo, name in ((megatron_root, "megatron_lm"), (miles_root, "miles")):
        add_git(cache, Path(repo), pins[name]["commit"], pins_for([lock]))
    out = verify_checkouts(launcher, lock, cache)
    for name in ("megatron_lm", "miles"):
        assert out[name]["path"] == str(cache.root / "checkouts" / pins[name]["tree"])
        assert out[name]["commit"] == pins[name]["commit"]
    assert (Path(out["megatron_lm"]["path"]) / "run.sh").stat().st_mode & 0o111
    assert (Path(out["miles"]["path"]) / "link").is_symlink()
    # a cached checkout someone edited is refused like a given one
    (Path(out["miles"]["path"]) / "miles" / "__init__.py").write_text("changed = True\n")
    with pytest.raises(CheckError, match=r"cached miles checkout .*: files hash to git tree .* refused"):
        verify_checkouts(launcher, lock, cache)


def test_megatron_argv_of_the_proxy_on_the_local_spec():
    argv = megatron_argv(compose("experiment=proxy-h200"), "local", "unfused", 12)
    assert not any(t.startswith(("--dsv4-", "--dsa-", "--spec", "--experimental-attention-variant")) for t in argv)
    assert "--moe-grouped-gemm" not in argv and "--multi-latent-attention" not in argv
    for flag, value in (
        ("--num-layers", "8"),
        ("--hidden-size", "2048"),
        ("--seq-length", "4096"),
        ("--global-batch-size", "16"),
        ("--train-iters", "12"),
        ("--transformer-impl", "local"),
        ("--attention-backend", "unfused"),
        ("--moe-router-score-function", "sigmoid"),
    ):
        assert argv[argv.index(flag) + 1] == value
    for flag in (
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
        "--no-masked-softmax-fusion",
        "--bf16",
        "--use-distributed-optimizer",
        "--calculate-per-token-loss",
    ):
        assert flag in argv


def test_megatron_argv_of_dsv4_tiny_names_miles_v4_spec():
    argv = megatron_argv(compose("experiment=dsv4-tiny-h200"), "transformer_engine", "unfused", 20)
    assert argv[argv.index("--spec") + 1 : argv.index("--spec") + 3] == [
        "miles_plugins.models.deepseek_v4.deepseek_v4",
        "get_dsv4_spec",
    ]
    ratios = argv.index("--dsv4-compress-ratios")
    assert argv[ratios + 1 : ratios + 5] == ["0", "4", "128", "4"]
    for flag, value in (
        ("--experimental-attention-variant", "dsv4"),
        ("--dsv4-hc-mult", "4"),
        ("--dsv4-n-hash-layers", "1"),
        ("--moe-router-score-function", "sqrtsoftplus"),
        ("--seq-length", "8192"),
        ("--micro-batch-size", "1"),
        ("--kv-lora-rank", "512"),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert "--moe-grouped-gemm" in argv and "--no-persist-layer-norm" not in argv and "--mtp-num-layers" not in argv


def test_transformer_impl_auto_follows_transformer_engine(monkeypatch):
    import importlib.util

    installed = importlib.util.find_spec("transformer_engine") is not None
    assert resolve_transformer_impl("auto") == ("transformer_engine" if installed else "local")
    assert resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="expected auto, transformer_engine or local"):
        resolve_transformer_impl("apex")


def test_the_plan_says_which_implementation_and_attention_backend_and_why():
    cfg = validate(compose("experiment=dsv4-tiny-h200"))
    plan = build_plan(cfg, checks.check(cfg), {})
    assert plan["megatron"] == megatron_choice(cfg)
    assert plan["megatron"]["attention_backend"] == "unfused"
    why = " ".join(plan["megatron"]["why"])
    assert "CUDNN_STATUS_BAD_PARAM" in why and "cuDNN 9.19.0" in why and "tilelang sparse-attention" in why
    proxy = validate(compose("experiment=proxy-h200", "launcher.attention_backend=fused"))
    assert megatron_choice(proxy)["why"][1] == "attention_backend fused: asked for"


@pytest.fixture()
def megatron_parser(monkeypatch):
    """Megatron-LM and miles at the locked commits on ``sys.path`` (``$MEGATRON_LM_PATH`` / ``$MILES_PATH`` or the
    cache, verified by tree hash as the launcher does), importable on CPU: ``megatron.training``'s package
    ``__init__`` is not run (it imports ``initialize``, which needs triton, absent from a CPU torch); its
    modules are the checkout's own. ``validate_args`` asks the GPU's compute capability for a grouped GEMM: the
    H200's (9, 0) is given. Skips when neither checkout is given nor cached nor in ``$RECIPE_BUNDLE_SOURCES``."""
    import sys
    import types

    import torch

    from trainer.errors import UserError

    helpers.seed_sources()  # $RECIPE_BUNDLE_SOURCES: the locked commits' archives (CI sets it)
    try:
        lock = helpers.REPO_ROOT / "lockfiles" / "stack.json"
        paths = verify_checkouts(compose("experiment=proxy-h200").launcher, lock)
    except UserError as ex:
        pytest.skip(f"no Megatron-LM/miles checkout: {ex}")
    for name in ("miles", "megatron_lm"):
        monkeypatch.syspath_prepend(paths[name]["path"])
    training = types.ModuleType("megatron.training")
    training.__path__ = [str(Path(paths["megatron_lm"]["path"]) / "megatron" / "training")]
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    import megatron.training.global_vars as global_vars

    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(training, name, getattr(global_vars, name))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("RANK", "0")
    from trainer.launch.megatron_worker import megatron_args

    def parse(*overrides, impl="transformer_engine"):
        cfg = validate(compose(*overrides))
        argv = megatron_argv(cfg, impl, cfg.launcher.attention_backend, STEPS)
        return cfg, megatron_args(argv, cfg.cluster.nodes * cfg.cluster.gpus_per_node)

    return parse


def _key(name):
    """The config key of Megatron argument ``name``: the field of its flag's row in the render tables."""
    from trainer.compose.render import MEGATRON_ARGS, SECTIONS

    flag = "--" + name.replace("_", "-")
    rows = [row for _, table in SECTIONS for row in table] + list(MEGATRON_ARGS)
    keys = {key for f, key, _ in rows if f == flag}
    assert len(keys) == 1, (flag, keys)
    return keys.pop()


STEPS = 3  # the megatron_parser fixture's --train-iters (megatron.train_iters: the run's steps, no config field)


def _field(cfg, name):
    import operator

    key = _key(name)
    return STEPS if key == "megatron.train_iters" else operator.attrgetter(key)(cfg)


# the config fields the worker read by hand before it read Megatron-LM's namespace
WORKER_READ_BEFORE = {
    **{
        n: f"layout.{n}"
        for n in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        )
    },
    "distributed_timeout_minutes": "launcher.distributed_timeout_minutes",
    "seed": "launcher.seed",
    **{
        n: f"optim.{n}"
        for n in (
            "optimizer",
            "lr",
            "min_lr",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "clip_grad",
            "global_batch_size",
            "lr_warmup_fraction",
            "lr_decay_style",
            "moe_router_freeze_gate",
            "freeze_e_score_correction_bias",
        )
    },
    "micro_batch_size": "layout.micro_batch_size",
    "seq_length": "data.seq_length",
    "num_experts": "model.num_experts",
    "train_iters": "megatron.train_iters",
}


def test_each_argument_the_worker_reads_renders_the_field_it_read_before():
    from trainer.launch.megatron_worker import WORKER_ARGS

    assert {n: _key(n) for n in WORKER_ARGS} == WORKER_READ_BEFORE


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("experiment", ["proxy-h200", "dsv4-tiny-h200", "dsv4-flash-slice-h200"])
def test_what_the_worker_reads_from_megatron_args_equals_the_config_field(megatron_parser, experiment, impl):
    from trainer.launch.megatron_worker import CONFIG_NOT_ARGS, WORKER_ARGS

    cfg, args = megatron_parser(f"experiment={experiment}", impl=impl)
    got = {name: (type(getattr(args, name)).__name__, getattr(args, name)) for name in WORKER_ARGS}
    want = {name: (type(_field(cfg, name)).__name__, _field(cfg, name)) for name in WORKER_ARGS}
    assert got == want
    assert got["lr"] == ("float", 3e-4) and got["tensor_model_parallel_size"] == ("int", 1)
    # with these experiments' values the fields the worker keeps from the config agree too
    assert {n: getattr(args, n) for n in CONFIG_NOT_ARGS} == {n: _field(cfg, n) for n in CONFIG_NOT_ARGS}


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("experiment", ["proxy-h200", "dsv4-tiny-h200", "dsv4-flash-slice-h200"])
def test_every_flag_of_the_argv_lands_where_the_worker_reads_it(megatron_parser, experiment, impl):
    """Promise: each flag the worker's argv shows lands in a config the worker builds from the namespace, is read by
    name, or is documented as consumed by the parse; none is ignored (an ignored flag would be refused)."""
    from trainer.launch.megatron_worker import REFUSED, flag_landing

    cfg, args = megatron_parser(f"experiment={experiment}", impl=impl)
    flags = megatron_argv(cfg, impl, cfg.launcher.attention_backend, STEPS)
    landing = flag_landing(flags, args)
    assert {f for f, where in landing.items() if where == REFUSED} == set()
    assert set(landing) == {w for w in flags if w.startswith("--")}
    assert landing["--lr"] == "worker" and landing["--hidden-size"] == "transformer_config"
    assert landing["--adam-beta2"] == "worker" and landing["--num-attention-heads"] == "transformer_config"


def test_a_flag_no_part_of_the_worker_reads_is_refused_and_ddp_and_optimizer_flags_take_effect(megatron_parser):
    """Promise: a DDP or optimizer flag added to the argv reaches the config the worker builds (the configs take
    every declared field from the namespace, as Megatron-LM's training does); a flag nothing reads is refused."""
    from trainer.launch.megatron_worker import REFUSED, ddp_config, flag_landing, megatron_args, optimizer_config

    cfg, args = megatron_parser("experiment=proxy-h200", impl="local")
    flags = megatron_argv(cfg, "local", cfg.launcher.attention_backend, STEPS)
    extra = flags + [
        "--overlap-grad-reduce",
        "--adam-eps",
        "1e-6",
        "--ddp-bucket-size",
        "1000",
        "--log-interval",
        "7",
        "--no-such-flag-anywhere",
    ]
    parsed = megatron_args(extra, cfg.cluster.nodes * cfg.cluster.gpus_per_node)
    landing = flag_landing(extra, parsed)
    assert landing["--overlap-grad-reduce"] == "ddp_config" and landing["--adam-eps"] == "optimizer_config"
    assert landing["--ddp-bucket-size"] == "parse"
    assert landing["--log-interval"] == REFUSED and landing["--no-such-flag-anywhere"] == REFUSED
    ddp = ddp_config(parsed, 10_000, 1, cfg)
    assert (ddp.overlap_grad_reduce, ddp.bucket_size) == (True, 1000)
    assert ddp.use_distributed_optimizer is bool(cfg.layout.use_distributed_optimizer)
    assert ddp.grad_reduce_in_fp32 is bool(cfg.optim.accumulate_allreduce_grads_in_fp32)
    plain = ddp_config(args, 10_000, 1, cfg)
    assert (plain.overlap_grad_reduce, plain.bucket_size) == (False, None)
    opt, _ = optimizer_config(parsed, cfg)
    assert opt.adam_eps == 1e-6 and opt.lr == args.lr and opt.clip_grad == args.clip_grad
    assert (opt.adam_beta1, opt.adam_beta2, opt.weight_decay) == (args.adam_beta1, args.adam_beta2, args.weight_decay)
    assert opt.bf16 is bool(cfg.optim.bf16)


def test_the_router_freeze_flags_parse_off_when_the_config_turns_them_off(megatron_parser):
    cfg, args = megatron_parser(
        "experiment=proxy-h200", "optim.moe_router_freeze_gate=false", "optim.freeze_e_score_correction_bias=false"
    )
    assert (args.moe_router_freeze_gate, args.freeze_e_score_correction_bias) == (False, False)


def test_miles_and_megatron_overwrite_the_fields_the_worker_keeps_from_the_config(megatron_parser):
    from trainer.launch.megatron_worker import CONFIG_NOT_ARGS

    off = [
        "layout.use_distributed_optimizer=false",
        "optim.bf16=false",
        "optim.accumulate_allreduce_grads_in_fp32=false",
    ]
    cfg, args = megatron_parser("experiment=proxy-h200", *off, impl="local")
    assert {n: _field(cfg, n) for n in CONFIG_NOT_ARGS} == dict.fromkeys(CONFIG_NOT_ARGS, False)
    assert {n: getattr(args, n) for n in CONFIG_NOT_ARGS} == dict.fromkeys(CONFIG_NOT_ARGS, True)


def test_checkpoint_only_parameters_get_initial_values():
    import torch

    from trainer.launch.megatron_worker import init_checkpoint_only

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hc_attn_fn = torch.nn.Parameter(torch.full((24, 64), float("nan")))
            self.hc_attn_base = torch.nn.Parameter(torch.full((24,), float("nan")))
            self.hc_ffn_scale = torch.nn.Parameter(torch.full((3,), float("nan")))
            self.attn_sink = torch.nn.Parameter(torch.full((4,), float("nan")))
            self.compressor = torch.nn.Module()
            self.compressor.ape = torch.nn.Parameter(torch.full((4, 8), float("nan")))
            self.router = torch.nn.Module()
            self.router.tid2eid = torch.nn.Parameter(torch.full((50, 6), -1, dtype=torch.int32), requires_grad=False)
            self.other = torch.nn.Parameter(torch.full((2,), 7.0))

    layer = Layer()
    assert init_checkpoint_only(layer, 0.02, 16, seed=3) == 6
    assert 0.01 < layer.hc_attn_fn.std().item() < 0.03 and abs(layer.hc_attn_fn.mean().item()) < 0.005
    assert torch.equal(layer.hc_attn_base, torch.zeros(24)) and torch.equal(layer.hc_ffn_scale, torch.ones(3))
    assert torch.equal(layer.attn_sink, torch.zeros(4)) and torch.equal(layer.compressor.ape, torch.zeros(4, 8))
    table = layer.router.tid2eid
    assert table.dtype == torch.int32 and int(table.min()) >= 0 and int(table.max()) < 16
    assert all(len(set(row.tolist())) == 6 for row in table)
    assert torch.equal(layer.other, torch.full((2,), 7.0))
    again = Layer()
    init_checkpoint_only(again, 0.02, 16, seed=3)
    assert torch.equal(again.router.tid2eid, table) and torch.equal(again.hc_attn_fn, layer.hc_attn_fn)


def _sylvester(n):
    import torch

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_stand_in_is_x_times_the_sylvester_matrix():
    import torch

    from trainer.models.hadamard import hadamard_transform

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=generator, dtype=torch.float64)
    want = (x @ _sylvester(128)) * 128**-0.5
    got = hadamard_transform(x.to(torch.bfloat16), scale=128**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, 128)
    assert torch.equal(got, hadamard_transform(x.bfloat16().float(), scale=128**-0.5).bfloat16())
    assert (got.double() - want).abs().max().item() < 0.02 * want.abs().max().item()
    # exact in float32 for float32 input; orthogonal up to the scale: applying it twice gives x back
    x32 = x.float()
    assert torch.allclose(hadamard_transform(x32, 2.0), (x32.double() @ _sylvester(128) * 2.0).float(), atol=1e-4)
    assert torch.allclose(hadamard_transform(hadamard_transform(x32, 128**-0.5), 128**-0.5), x32, atol=1e-5)
    # a width that is not a power of two is zero-padded to the next one and cut back
    short = x32[..., :100]
    padded = torch.nn.functional.pad(short, (0, 28))
    assert torch.allclose(hadamard_transform(short), hadamard_transform(padded)[..., :100], atol=1e-5)


def test_hadamard_stand_in_gradient_is_the_same_transform():
    import torch

    from trainer.models.hadamard import hadamard_transform

    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(4, 64)
    hadamard_transform(x, 0.125).backward(grad)
    assert torch.allclose(x.grad, (grad.double() @ _sylvester(64) * 0.125).float(), atol=1e-5)


def test_hadamard_stand_in_binds_the_package_name_only_when_it_is_missing(monkeypatch):
    import importlib.util
    import sys

    from trainer.launch import megatron_worker
    from trainer.models import hadamard

    monkeypatch.delitem(sys.modules, "fast_hadamard_transform", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    lines = megatron_worker.hadamard_stand_in()
    assert sys.modules["fast_hadamard_transform"] is hadamard
    assert len(lines) == 1 and lines[0].startswith(
        "fast_hadamard_transform.hadamard_transform: trainer.models.hadamard"
    )
    from fast_hadamard_transform import hadamard_transform  # the import miles' rotate_activation does

    assert hadamard_transform is hadamard.hadamard_transform
    assert megatron_worker.hadamard_stand_in() == lines  # called again in the same process: still the stand-in
    monkeypatch.delitem(sys.modules, "fast_hadamard_transform")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # the real package is installed
    assert megatron_worker.hadamard_stand_in() == []
    assert "fast_hadamard_transform" not in sys.modules


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
