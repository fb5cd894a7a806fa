"""A composition read back from the composition cache's JSON (trainer/compose/cache.py) is indistinguishable from
the one Hydra made, for every option of every config group of conf/ and a few overrides: the same nodes with
the same classes, metadata (reference, object, key and element types, optional, flags), keys and values, so the
same YAML, structured types per node, struct and read-only flags, unresolved interpolations, ``???`` and
``hydra`` node, and the same prepared plan."""

import dataclasses

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

import helpers
from helpers import REPO_ROOT
from trainer import launch
from trainer.compose import cache as cache_module
from trainer.compose import compose as compose_module
from trainer.compose.compose import session
from trainer.compose.prepare import prepare
from trainer.errors import UserError

CONF = REPO_ROOT / "conf"
# The groups of conf/train.yaml's defaults list.
GROUPS = sorted(str(g) for d in OmegaConf.load(CONF / "train.yaml").defaults if isinstance(d, DictConfig) for g in d)
OPTIONS = [[f"{group}={option.stem}"] for group in GROUPS for option in sorted((CONF / group).glob("*.yaml"))]
OVERRIDES = [
    [],
    ["layout=tp8pp8ep8", "optim.lr=2e-5"],
    ["+env.FROM_ENV=${oc.env:HOME}", "launcher.job=[a,'b c']"],
    ["hydra.run.dir=outputs/${now:%Y-%m-%d}/${layout.name}", "hydra.mode=RUN"],
    ["model.num_layers=???"],
    ["launcher=local-megatron", "model=dsv4-tiny", "layout=gpu1-tp1pp1ep1", "cluster=local"],
]
JOBS = OPTIONS + OVERRIDES


def nodes(cfg, path="", parent=None):
    """Every node of ``cfg`` as (path, class, metadata but the resolver cache, value or child keys, get_type,
    struct and read-only flags as the node sees them), children checked to point at their parent."""
    state = cfg.__dict__
    meta = cfg._metadata
    fields = tuple(
        (f.name, repr(getattr(meta, f.name))) for f in dataclasses.fields(meta) if f.name != "resolver_cache"
    )
    assert cfg._get_parent() is parent
    try:
        of_type = OmegaConf.get_type(parent, meta.key) if parent is not None else OmegaConf.get_type(cfg)
    except Exception as ex:  # noqa: BLE001 - an interpolation get_type would resolve: the same error both ways
        of_type = type(ex).__name__
    row = (
        path,
        type(cfg).__name__,
        fields,
        sorted(k for k in state if k != "_flags_cache"),
        cfg._get_flag("struct"),
        cfg._get_flag("readonly"),
        of_type,
    )
    if not isinstance(cfg, (DictConfig, ListConfig)):
        return [
            row
            + (
                repr(state["_val"]),
                type(state["_val"]).__name__,
                repr(state.get("enum_type")),
                repr(state.get("fields")),
            )
        ]
    content = state["_content"]
    if not isinstance(content, (dict, list)):
        return [row + (repr(content),)]
    items = list(content.items() if isinstance(content, dict) else enumerate(content))
    out = [row + ([key for key, _ in items],)]
    for key, child in items:
        out += nodes(child, f"{path}.{key}", cfg)
    return out


def test_the_jobs_cover_every_option_of_every_group():
    groups = {job[0].split("=")[0] for job in OPTIONS}
    assert groups == {
        "cluster",
        "data",
        "experiment",
        "launcher",
        "layout",
        "model",
        "optim",
        "throughput",
        "stack",
        "env",
    }
    assert len(OPTIONS) >= 30


@pytest.fixture
def hydra_made(monkeypatch):
    """(overrides, composition) of every call of Hydra's own ``compose``: the object the composer returns on a
    miss, and stores (a cache hit makes no call)."""
    made = []
    real = compose_module.compose

    def compose(*args, **kwargs):
        cfg = real(*args, **kwargs)
        made.append((list(kwargs.get("overrides")), cfg))
        return cfg

    monkeypatch.setattr(compose_module, "compose", compose)
    return made


def prepared(composer, job):
    """What `prepare` gives for ``job`` (plan, launch, numerics, choices, overrides, record fields, the job's
    composition), or its one-line refusal."""
    try:
        run = prepare(job, composer, check_launcher=launch.check)
    except UserError as err:
        return str(err)
    return (
        run.plan,
        run.launch.argv,
        run.launch.env,
        run.numerics,
        run.choices,
        run.overrides,
        run.record_fields(),
        OmegaConf.to_yaml(run.cfg),
        OmegaConf.is_readonly(run.cfg),
        nodes(run.cfg),
    )


def test_every_option_read_back_from_the_cache_is_what_hydra_made(tmp_path, monkeypatch, hydra_made):
    """Promise: for every option of every group and the overrides above (interpolations of ``oc.env``, ``now``
    and other keys, ``???``, a list with a space), `prepare` (what `train` does before writing anything) from the
    cache (no Hydra call) gives the same plan, launch (argv, env), numerics verdict, choices, overrides,
    composition_sha256 and job composition as from Hydra's compositions, or the same one-line refusal; and every
    composition Hydra made for it (the job with its ``hydra`` node, the reference layout's without) is read back
    from the cache with the same nodes: classes, metadata (types, optional, flags), keys, values,
    ``OmegaConf.get_type`` and struct/read-only flags per node, and the same YAML."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    compared, planned = set(), 0
    with session() as composer:
        for job in JOBS:
            fresh = prepared(composer, job)
            made = len(hydra_made)
            assert prepared(composer, job) == fresh, job
            assert len(hydra_made) == made, job  # all from the cache
            planned += not isinstance(fresh, str)
        for job in OVERRIDES:  # without the hydra node, as `compose_run` composes
            try:
                composer.compose(job)
            except UserError:
                pass
        for overrides, cfg in hydra_made:
            hydra_node = "hydra" in cfg
            cached = composer.cache.get(overrides, hydra_node)
            assert cached is not None, overrides
            assert nodes(cached) == nodes(cfg), (overrides, hydra_node)
            assert OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(cfg), (overrides, hydra_node)
            compared.add((tuple(overrides), hydra_node))
    assert planned >= len(JOBS) // 2  # most jobs plan (the others are refused the same way from the cache)
    assert {job for job, hydra_node in compared if hydra_node} >= {tuple(job) for job in JOBS}
    assert sum(not hydra_node for _, hydra_node in compared) >= len(OPTIONS) // 2


def test_the_comparison_sees_a_changed_type_flag_key_or_value(monkeypatch):
    """Tamper check of the comparison above: a composition read back with one object type, one flag, one key or
    one value changed (or a float become an int) is told apart from Hydra's by ``nodes``."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "off")
    import json

    with session() as composer:
        cfg = composer.compose(["hydra.mode=RUN"], hydra_node=True)
    data = cache_module.to_data(cfg)
    assert nodes(cache_module.from_data(json.loads(json.dumps(data)))) == nodes(cfg)

    def optim(d):
        return next(child for key, child in d["root"][3] if key == "optim")

    def lr(d):
        return next(child for key, child in optim(d)[3] if key == "lr")

    def meta_of(d, node):
        d["metas"].append(json.loads(json.dumps(d["metas"][node[1]])))
        node[1] = len(d["metas"]) - 1
        return d["metas"][-1]

    def other_type(d):
        meta_of(d, optim(d))[1] = next(i for i, t in enumerate(d["types"]) if t == "dict")

    def struct_off(d):
        d["metas"][d["root"][1]][3] = {**d["metas"][d["root"][1]][3], "struct": False}

    def readonly(d):
        meta_of(d, lr(d))[3] = {"readonly": True}

    def renamed(d):
        next(pair for pair in optim(d)[3] if pair[0] == "lr")[0] = "lr2"

    def value(d):
        lr(d)[3] = lr(d)[3] * 1.5

    def as_int(d):
        lr(d)[3] = 1

    for tamper in (other_type, struct_off, readonly, renamed, value, as_int):
        hostile = json.loads(json.dumps(data))
        tamper(hostile)
        assert nodes(cache_module.from_data(hostile)) != nodes(cfg), tamper.__name__


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
