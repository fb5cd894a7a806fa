"""The composition cache (trainer/compose/cache.py): an entry is the composition Hydra would make, keyed by
every input it reads, verified on reading, and never a reason for a different run."""

import hashlib
import json
import shutil
import time

import pytest
from omegaconf import OmegaConf

import helpers
from helpers import REPO_ROOT, run_train
from trainer.compose import cache as cache_module
from trainer.compose.compose import session
from trainer.errors import UserError

JOBS = [
    [],
    ["layout=tp8pp8ep8", "optim.lr=2e-5"],
    ["experiment=smoke"],
    ["model=dsv4-tiny", "layout=gpu1-tp1pp1ep1", "cluster=local", "launcher=local-megatron"],
]


def fingerprint(cfg):
    """What a composition is, for comparing two: its YAML (unresolved), its flags and its node types."""
    return (
        OmegaConf.to_yaml(cfg),
        OmegaConf.is_struct(cfg),
        OmegaConf.is_readonly(cfg),
        OmegaConf.get_type(cfg),
        OmegaConf.get_type(cfg, "layout"),
        OmegaConf.get_type(cfg, "model"),
    )


def entries(root):
    return sorted(root.glob("*" + cache_module.SUFFIX))


@pytest.mark.parametrize("hydra_node", [False, True], ids=["job", "with-hydra-node"])
@pytest.mark.parametrize("job", JOBS, ids=lambda j: " ".join(j) or "(recipe)")
def test_a_cached_composition_is_the_composition_hydra_makes(tmp_path, monkeypatch, hydra_calls, job, hydra_node):
    """Promise: the second composition of a job comes from the cache (no Hydra call) and is the one Hydra made:
    the same YAML, flags and structured types as a composition with the cache off."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    wanted = [*job, "hydra.mode=RUN"] if hydra_node else job
    with session() as composer:
        first = composer.compose(wanted, hydra_node=hydra_node)
    with session() as composer:
        second = composer.compose(wanted, hydra_node=hydra_node)
    assert hydra_calls == [wanted]  # the first only
    assert len(entries(tmp_path / "cache")) == 1
    with session(cached=False) as composer:
        fresh = composer.compose(wanted, hydra_node=hydra_node)
    assert hydra_calls == [wanted, wanted]
    for cfg in (first, second):
        assert fingerprint(cfg) == fingerprint(fresh)
    if hydra_node:
        assert second.hydra.runtime.choices == fresh.hydra.runtime.choices
        assert list(second.hydra.overrides.task) == job


def test_a_damaged_entry_is_a_miss_and_is_written_again(tmp_path, monkeypatch, hydra_calls):
    """Promise: an entry whose bytes do not match its MAC, or whose payload (under a right MAC) is not the JSON of
    a composition, is not used: Hydra composes again and the entry is replaced by a good one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(root))
    with session() as composer:
        good = OmegaConf.to_yaml(composer.compose(["layout=tp8pp8ep8"]))
    (entry,) = entries(root)
    blob = entry.read_bytes()
    key, payload = entry.name[: -len(cache_module.SUFFIX)], blob[len(cache_module.FORMAT) :].partition(b"\n")[2]
    secret = cache_module.mac_key()
    assert blob == cache_module.FORMAT + cache_module.entry_mac(secret, key, payload) + b"\n" + payload
    damaged = {
        "payload flipped": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:],
        "MAC of other bytes": cache_module.FORMAT + cache_module.entry_mac(secret, key, b"x") + b"\n" + payload,
        "not JSON, MAC right": cache_module.FORMAT + cache_module.entry_mac(secret, key, b"junk") + b"\njunk",
        "JSON, no composition, MAC right": cache_module.FORMAT + cache_module.entry_mac(secret, key, b"{}") + b"\n{}",
        "sha256 header of format 3": hashlib.sha256(b"x").hexdigest().encode() + b"\n" + payload,
        "empty": b"",
    }
    for name, data in damaged.items():
        entry.write_bytes(data)
        calls_before = len(hydra_calls)
        with session() as composer:
            assert OmegaConf.to_yaml(composer.compose(["layout=tp8pp8ep8"])) == good, name
        assert len(hydra_calls) == calls_before + 1, name
        assert entry.read_bytes() == blob, name  # written again, the same bytes


def test_a_changed_config_file_is_another_key(tmp_path, monkeypatch, hydra_calls):
    """Promise: editing any file of the config tree changes the key: the next composition reads the edit."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    conf = tmp_path / "conf"
    shutil.copytree(REPO_ROOT / "conf", conf)
    with session(conf) as composer:
        assert composer.compose(["layout=tp8pp8ep8"]).layout.micro_batch_size == 1
    path = conf / "layout" / "tp8pp8ep8.yaml"
    path.write_text(path.read_text().replace("micro_batch_size: 1", "micro_batch_size: 2"))
    with session(conf) as composer:
        assert composer.compose(["layout=tp8pp8ep8"]).layout.micro_batch_size == 2
    assert len(hydra_calls) == 2 and len(entries(tmp_path / "cache")) == 2


def test_bad_overrides_are_refused_by_hydra_and_never_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        with session() as composer, pytest.raises(UserError, match="Could not find 'layout/nope'"):
            composer.compose(["layout=nope"])
    assert entries(tmp_path / "cache") == []


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, hydra_calls):
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for _ in range(2):
        with session() as composer:
            composer.compose([])
    assert len(hydra_calls) == 2 and not (tmp_path / "xdg").exists()


def test_the_oldest_entries_go_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache_module, "MAX_ENTRIES", 2)
    with session() as composer:
        for layout in ("tp2pp4ep8", "tp8pp8ep8", "gpu8-tp2pp2ep4"):
            composer.compose([f"layout={layout}"])
            time.sleep(0.01)
    kept = {p.name for p in entries(tmp_path / "cache")}
    assert kept == {
        composer.cache.key_of([f"layout={layout}"], False) + cache_module.SUFFIX
        for layout in ("tp8pp8ep8", "gpu8-tp2pp2ep4")
    }  # the oldest, tp2pp4ep8, went


def test_the_key_covers_the_working_directory_the_schema_and_the_python_path(tmp_path, monkeypatch):
    """Promise: an entry made in another working directory, with another schema module or another import path is
    another key (Hydra records the working directory; the schema types every node; the path picks the libraries)."""
    conf, schema_file = REPO_ROOT / "conf", tmp_path / "schema.py"
    schema_file.write_bytes((REPO_ROOT / "trainer" / "compose" / "schema.py").read_bytes())

    def key():
        return cache_module.CompositionCache(tmp_path, conf, "train", schema_file).key_of(["layout=tp8pp8ep8"], False)

    base = key()
    assert key() == base
    monkeypatch.chdir(tmp_path)
    moved = key()
    schema_file.write_bytes(schema_file.read_bytes() + b"\n# another schema\n")
    reschema = key()
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    repath = key()
    assert len({base, moved, reschema, repath}) == 4


def test_a_config_directory_reached_through_a_link_is_in_the_key(tmp_path, monkeypatch, hydra_calls):
    """Promise: Hydra follows a linked directory of the tree; so does the key, and an edit there is read."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    conf, layouts = tmp_path / "conf", tmp_path / "layouts"
    shutil.copytree(REPO_ROOT / "conf", conf, ignore=shutil.ignore_patterns("layout"))
    shutil.copytree(REPO_ROOT / "conf" / "layout", layouts)
    (conf / "layout").symlink_to(layouts)
    path = layouts / "tp8pp8ep8.yaml"
    for mbs in (1, 2):
        path.write_text(path.read_text().replace(f"micro_batch_size: {3 - mbs}", f"micro_batch_size: {mbs}"))
        with session(conf) as composer:
            assert composer.compose(["layout=tp8pp8ep8"]).layout.micro_batch_size == mbs
    assert len(hydra_calls) == 2


def test_what_the_key_cannot_cover_is_composed_by_hydra_every_time(tmp_path, monkeypatch, hydra_calls):
    """Promise: a composition that read another config directory (``hydra.searchpath``), copies environment
    variables into the job (``hydra.job.env_copy``) or holds a secret value is never stored: the next run composes
    it again and sees the change."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(root))
    extra = tmp_path / "extra" / "layout"
    extra.mkdir(parents=True)
    mine = extra / "mine.yaml"
    mine.write_text((REPO_ROOT / "conf" / "layout" / "tp8pp8ep8.yaml").read_text())
    searched = [f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "layout=mine", "hydra.mode=RUN"]
    for mbs in (1, 2):
        mine.write_text(mine.read_text().replace(f"micro_batch_size: {3 - mbs}", f"micro_batch_size: {mbs}"))
        with session() as composer:
            assert composer.compose(searched, hydra_node=True).layout.micro_batch_size == mbs
    copied = ["hydra.job.env_copy=[FOO]", "hydra.mode=RUN"]
    for value in ("a", "b"):
        monkeypatch.setenv("FOO", value)
        with session() as composer:
            assert composer.compose(copied, hydra_node=True).hydra.job.env_set.FOO == value
    secret = ["+env.HF_TOKEN=hf_0123456789abcdefghij"]
    short = ["+env.hf_token=abc1234"]  # too short for the redactor to learn: refused by its key's name
    with session() as composer:
        composer.compose(secret)
        composer.compose(secret, hydra_node=True)
        composer.compose(short)
    assert entries(root) == [] and len(hydra_calls) == 7
    assert not any(b"hf_0123456789" in p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_the_cache_directory_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for off in ("off", "OFF", "0", "no", "False"):
        monkeypatch.setenv("TRAINER_COMPOSE_CACHE", off)
        assert cache_module.default_root() is None, off
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "rel/cache")
    assert cache_module.default_root() == tmp_path / "rel" / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "~/c")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_module.default_root() == tmp_path / "home" / "c"
    monkeypatch.delenv("TRAINER_COMPOSE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_module.default_root() == tmp_path / "xdg" / "recipe-bundle" / "compose"


def test_an_entry_renamed_to_another_key_is_not_read(tmp_path, monkeypatch, hydra_calls):
    """Promise: an entry verifies only under its own key: the file of one command line copied to the name of
    another is a miss, and that command line gets its own composition."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(root))
    with session() as composer:
        composer.compose(["optim.lr=1e-5"])
        other = root / (composer.cache.key_of(["optim.lr=3e-5"], False) + cache_module.SUFFIX)
    (entry,) = entries(root)
    shutil.copy2(entry, other)
    with session() as composer:
        assert composer.compose(["optim.lr=3e-5"]).optim.lr == 3e-5
    assert len(hydra_calls) == 2


def test_a_cache_directory_others_may_write_is_not_used_nor_changed(tmp_path, monkeypatch, hydra_calls):
    """Promise: a cache directory the cache makes is 0700; one that others may write (this user's own 0777) is not
    used and never chmodded (and one owned by another account is not used either: below)."""
    made = tmp_path / "made" / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(made))
    with session() as composer:
        composer.compose([])
    assert made.stat().st_mode & 0o777 == 0o700 and len(entries(made)) == 1
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(root))
    for _ in range(2):
        with session() as composer:
            composer.compose([])
    assert root.stat().st_mode & 0o777 == 0o777 and entries(root) == [] and len(hydra_calls) == 3


def test_a_cache_directory_another_account_owns_is_not_used(tmp_path, monkeypatch, hydra_calls):
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    try:
        os.chown(shared, 65534, 65534)  # nobody
    except OSError as ex:  # not root, or a sandbox without that account mapped (Bazel's linux-sandbox)
        pytest.skip(f"cannot make a directory another account owns here: {ex.strerror}")
    shared.chmod(0o777)
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(shared))
    for _ in range(2):
        with session() as composer:
            composer.compose([])
    assert entries(shared) == [] and len(hydra_calls) == 2


def test_entries_are_this_users_alone(tmp_path, monkeypatch, hydra_calls):
    """Promise: the directory is 0700 and entries 0600; an entry others may write is not read (composed again)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(root))
    with session() as composer:
        composer.compose([])
    (entry,) = entries(root)
    assert (root.stat().st_mode & 0o777, entry.stat().st_mode & 0o777) == (0o700, 0o600)
    entry.chmod(0o620)
    with session() as composer:
        composer.compose([])
    assert len(hydra_calls) == 2 and entry.stat().st_mode & 0o777 == 0o600  # written again


def test_an_unwritable_cache_is_no_cache(tmp_path, monkeypatch, hydra_calls):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(blocker / "cache"))
    for _ in range(2):
        with session() as composer:
            assert composer.compose(["layout=tp8pp8ep8"]).layout.tensor_model_parallel_size == 8
    assert len(hydra_calls) == 2


def test_a_hit_sets_up_hydra_as_its_initialisation_would(tmp_path, monkeypatch, hydra_calls):
    """Promise: with every composition from the cache, Hydra's version base is 1.3 and its ``now`` resolver is
    there, as after ``initialize_config_dir(version_base="1.3")``."""
    from hydra import version

    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    with session() as composer:
        composer.compose(["hydra.mode=RUN"], hydra_node=True)
    version.setbase(None)  # as in a fresh process
    with session() as composer:
        cfg = composer.compose(["hydra.mode=RUN"], hydra_node=True)
        assert len(hydra_calls) == 1 and composer.config_loader is None
        assert version.base_at_least("1.3")
        assert OmegaConf.select(cfg, "hydra.run.dir").startswith("outputs/20")


def test_train_from_the_cache_writes_the_same_run(tmp_path):
    """Promise: `train layout=tp2pp4ep8` twice in one directory (Hydra's default run directories, a second apart)
    composes once with Hydra; the second run, from the cache, has its own time in its directory's name and writes
    the same plan, argv and config bytes as a run with the cache off."""
    env = {"TRAINER_COMPOSE_CACHE": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        proc = run_train(["layout=tp2pp4ep8"], tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(sorted((tmp_path / "outputs").glob("*/*")))
        time.sleep(1.05)
    assert len(entries(tmp_path / "cache")) == 2  # the job (with its hydra node) and the reference layout
    first, second = runs[0][0], (set(runs[1]) - set(runs[0])).pop()
    assert first.name != second.name and second.name.endswith("-tp2pp4ep8")
    off = tmp_path / "off"
    proc = run_train(["layout=tp2pp4ep8", f"hydra.run.dir={off}"], tmp_path, env={"TRAINER_COMPOSE_CACHE": "off"})
    assert proc.returncode == 0, proc.stderr
    for name in ("plan.json", "argv.json", "config.yaml", "env.json", "command.sh"):
        assert (second / name).read_bytes() == (off / name).read_bytes() == (first / name).read_bytes(), name
    plan = json.loads((second / "plan.json").read_text())
    assert plan["numerics"]["reference_layout"] == "tp8pp8ep8" and plan["parallelism"]["world_size"] == 64


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
