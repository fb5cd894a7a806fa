"""A prepared run (compose.prepare.PreparedRun) is read-only all the way down and holds each fact once: the typed
config and the composition are two views of one source, which no assignment can set apart; and the schema's
choice fields (trainer.compose.schema's Enums) refuse a value outside their set on one line."""

import dataclasses
import json
import pickle

import pytest
from omegaconf import OmegaConf, read_write
from omegaconf.errors import ReadonlyConfigError

import helpers
from trainer import launch
from trainer.compose import schema
from trainer.compose.frozen import FrozenDict, FrozenList, freeze
from trainer.compose.prepare import PreparedRun, prepare
from trainer.errors import UserError
from trainer.train import prepare_command_line


@pytest.fixture(scope="module")
def prepared() -> PreparedRun:
    return prepare(["+env.FOO=bar"], check_launcher=launch.check)


# (what is changed, the change): every nested level of the typed config, the composition, the other fields
TYPED = [
    ("config.layout", lambda p: setattr(p.config.layout, "micro_batch_size", 7)),
    ("config.model", lambda p: setattr(p.config.model, "num_layers", 1)),
    ("config.data.build", lambda p: setattr(p.config.data.build, "rows", 1)),
    ("config", lambda p: setattr(p.config, "layout", schema.LayoutConfig())),
    ("config.layout (del)", lambda p: delattr(p.config.layout, "label")),
]
ITEMS = [
    ("config.model.moe_layer_freq", lambda p: p.config.model.moe_layer_freq.append(1)),
    ("config.model.moe_layer_freq[0]", lambda p: p.config.model.moe_layer_freq.__setitem__(0, 0)),
    ("config.launcher.entrypoint", lambda p: p.config.launcher.entrypoint.extend(["x"])),
    ("config.env", lambda p: p.config.env.__setitem__("FOO", "baz")),
    ("config.env (update)", lambda p: p.config.env.update(FOO="baz")),
    ("plan", lambda p: p.plan.__setitem__("steps", 1)),
    ("plan.ranks[0]", lambda p: p.plan["ranks"][0].__setitem__("node", 9)),
    ("plan.memory.per_stage", lambda p: p.plan["memory"]["per_stage"].pop()),
    ("numerics", lambda p: p.numerics.__setitem__("equivalent", False)),
    ("choices", lambda p: p.choices.__setitem__("layout", "tp8pp8ep8")),
    ("launch.argv", lambda p: p.launch.argv.append("--lr")),
    ("launch.env", lambda p: p.launch.env.pop("FOO")),
    ("par.stage_layers", lambda p: p.par.stage_layers.sort()),
]
FIELDS = [
    ("plan (field)", lambda p: setattr(p, "plan", {})),
    ("config (field)", lambda p: setattr(p, "config", None)),
    ("launch.argv (field)", lambda p: setattr(p.launch, "argv", [])),
    ("par.world_size", lambda p: setattr(p.par, "world_size", 1)),
]


@pytest.mark.parametrize("where,change", TYPED + FIELDS, ids=[w for w, _ in TYPED + FIELDS])
def test_a_field_of_a_prepared_run_cannot_be_assigned(prepared, where, change):
    before = (prepared.config.layout.micro_batch_size, prepared.record_fields()["composition_sha256"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        change(prepared)
    assert (prepared.config.layout.micro_batch_size, prepared.record_fields()["composition_sha256"]) == before


@pytest.mark.parametrize("where,change", ITEMS, ids=[w for w, _ in ITEMS])
def test_a_list_or_dict_of_a_prepared_run_cannot_be_changed(prepared, where, change):
    plan = json.dumps(prepared.plan, sort_keys=True)
    with pytest.raises(TypeError, match="read-only"):
        change(prepared)
    assert json.dumps(prepared.plan, sort_keys=True) == plan
    assert prepared.config.env["FOO"] == "bar" and prepared.choices["layout"] == "tp2pp4ep8"


@pytest.mark.parametrize("key", ["layout.micro_batch_size", "data.build.rows", "model.moe_layer_freq", "env.FOO"])
def test_the_composition_is_read_only_at_every_level(prepared, key):
    parent, _, leaf = key.rpartition(".")
    with pytest.raises(ReadonlyConfigError):
        OmegaConf.select(prepared.cfg, parent)[leaf] = 7


def test_the_two_views_cannot_disagree(prepared):
    """`p.config.layout.micro_batch_size = 7` raises while `p.cfg` keeps 1 (the issue's case); a change forced into
    `p.cfg` with `read_write` stays in that copy: both views still read the one composition."""
    assert prepared.config.layout.micro_batch_size == prepared.cfg.layout.micro_batch_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.config.layout.micro_batch_size = 7
    copy = prepared.cfg
    with read_write(copy):
        copy.layout.micro_batch_size = 7
    assert copy.layout.micro_batch_size == 7
    assert prepared.cfg.layout.micro_batch_size == 1 and prepared.config.layout.micro_batch_size == 1
    assert prepared.config == schema.to_object(prepared.cfg)  # the typed view is the composition's, field by field
    assert prepared.config is prepared.config  # made once
    assert "cfg" not in {f.name for f in dataclasses.fields(prepared)}  # not stored twice
    assert "config" not in {f.name for f in dataclasses.fields(prepared)}


def test_frozen_values_are_still_plain_json_lists_and_dicts(prepared):
    assert isinstance(prepared.plan, dict) and isinstance(prepared.plan["ranks"], list)
    assert type(prepared.plan) is FrozenDict and type(prepared.config.model.moe_layer_freq) is FrozenList
    assert json.loads(json.dumps(prepared.plan))["parallelism"]["world_size"] == 64
    assert prepared.config.model.moe_layer_freq + [1] == [*prepared.config.model.moe_layer_freq, 1]
    again = pickle.loads(pickle.dumps(prepared.config))
    assert again == prepared.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.layout.micro_batch_size = 7


def test_freeze_refuses_what_it_cannot_make_read_only() -> None:
    @dataclasses.dataclass
    class Mutable:
        x: int = 0

    with pytest.raises(TypeError, match="mutable dataclass"):
        freeze(Mutable())
    with pytest.raises(TypeError, match="set"):
        freeze({1, 2})
    assert freeze((1, [2])) == (1, [2]) and type(freeze((1, [2]))[1]) is FrozenList


def test_a_config_made_by_omegaconf_is_mutable_until_frozen():
    """The schema's records are plain dataclasses to OmegaConf: a report's config (rundir.load_run) stays writable."""
    layout = schema.LayoutConfig(name="x", label="y")
    layout.micro_batch_size = 2
    assert freeze(layout).micro_batch_size == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.micro_batch_size = 3


CHOICES = [
    ("layout.moe_token_dispatcher_type=ring", "layout.moe_token_dispatcher_type must be allgather, alltoall or flex"),
    ("layout.recompute_granularity=some", "layout.recompute_granularity must be full, selective or null (got some)"),
    ("layout.recompute_method=all", "layout.recompute_method must be uniform, block or null (got all)"),
    ("layout.qkv_format=sbhd", "layout.qkv_format must be bshd or thd (got sbhd)"),
    ("model.normalization=rmsnorm", "model.normalization must be LayerNorm or RMSNorm (got rmsnorm)"),
    ("model.position_embedding_type=alibi", "model.position_embedding_type must be learned_absolute, rope, mrope,"),
    ("launcher.attention_backend=cudnn", "launcher.attention_backend must be unfused, fused, flash, local or auto"),
    ("launcher.transformer_impl=apex", "launcher.transformer_impl must be auto, transformer_engine or local"),
]


@pytest.mark.parametrize("override,line", CHOICES, ids=[o for o, _ in CHOICES])
def test_a_choice_outside_its_set_is_refused_on_one_line(override, line):
    with pytest.raises(UserError) as info:
        prepare_command_line([override])
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    "text,line",
    [
        ("layout:\n  qkv_format: THD\n", "layout.qkv_format must be bshd or thd (got THD)"),
        ("model:\n  normalization: rmsnorm\n", "model.normalization must be LayerNorm or RMSNorm (got rmsnorm)"),
        ("layout: [\n", "a config file is not YAML: while parsing a flow node"),
    ],
    ids=["choice", "choice-model", "not-yaml"],
)
def test_a_bad_experiment_file_is_refused_on_one_line(tmp_path, text, line):
    """The same line as on the command line for a choice outside its set written in a config file (Hydra wraps
    OmegaConf's error without `from`), and one line, exit 2, for a file that is not YAML (was an internal error)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "bad.yaml").write_text("# @package _global_\n" + text)
    result = helpers.run_train(
        ["launcher=plan", "experiment=bad", f"hydra.searchpath=[file://{tmp_path}]", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"train: error: {line}") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_choice_is_typed_and_written_as_before(prepared):
    lay = prepared.config.layout
    assert lay.moe_token_dispatcher_type is schema.MoeTokenDispatcherType.alltoall
    assert lay.moe_token_dispatcher_type == "alltoall" and f"{lay.recompute_granularity}" == "full"
    assert "moe_token_dispatcher_type: alltoall\n" in OmegaConf.to_yaml(prepared.cfg, resolve=True)
    argv = prepared.launch.argv
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert type(argv[argv.index("--moe-token-dispatcher-type") + 1]) is str


def test_prepared_jobs_are_returned_not_kept_in_a_module():
    """Two command lines prepared in one process: each gets its own jobs (no module-level registry)."""
    from trainer.compose import commandline

    assert not hasattr(commandline, "PREPARED")
    _, first = prepare_command_line(["layout=tp8pp8ep8"])
    _, second = prepare_command_line(["-m", "optim.lr=1e-5,2e-5"])
    assert list(first) == [("layout=tp8pp8ep8",)]
    assert list(second) == [("optim.lr=1e-05",), ("optim.lr=2e-05",)]  # as Hydra writes each job's override
    assert first[("layout=tp8pp8ep8",)].config.layout.name == "tp8pp8ep8"


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
