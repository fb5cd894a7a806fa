"""Hostile entries in the composition cache (trainer/compose/cache.py): an entry is this user's authenticated data.

Whatever another process of the user (which knows the format but not the key) plants under an entry's name, a
pickle that would run code included, or whatever the config tree holds (FIFOs, link loops), the composition is
the one Hydra makes, in bounded time, and no entry holds a secret."""

import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

import helpers
from trainer import launch
from trainer.compose import cache as cache_module
from trainer.compose.compose import session
from trainer.compose.prepare import prepare

LR = ["optim.lr=1e-5"]


@pytest.fixture
def root(compose_cache):
    return compose_cache


def entries(root):
    return sorted(root.glob("*" + cache_module.SUFFIX))


def the_entry(root):
    (entry,) = entries(root)
    return entry


def lr_of(overrides=LR):
    """optim.lr of the job through the cache, and the --lr the prepared launch passes to miles."""
    with session() as composer:
        lr = composer.compose(overrides).optim.lr
        prepared = prepare(overrides, composer, check_launcher=launch.check)
    argv = prepared.launch.argv
    return lr, argv[argv.index("--lr") + 1], prepared.config.optim.lr


def forge(entry, payload, mac=b"0" * 64):
    """Write what an attacker without the key can: the format, a MAC of its choice and ``payload``."""
    entry.write_bytes(cache_module.FORMAT + mac + b"\n" + payload)
    entry.chmod(0o600)


def test_a_forged_entry_that_changes_the_lr_is_a_miss(root, hydra_calls):
    """Promise: an entry forged by another process of the user, which knows the format but not the key (the
    composition's JSON with optim.lr 7e-6, under a MAC of another key, of the true entry, or none), is not read:
    the plan has the true lr (1e-5) and the entry is written again, the same bytes as before."""
    assert lr_of() == (1e-5, "1e-5", 1e-5)
    good = {entry: entry.read_bytes() for entry in entries(root)}
    holding = [entry for entry, blob in good.items() if b"1e-05" in blob]
    assert len(holding) == 3  # the job, the job with its hydra node (the plan's) and its reference layout
    other_key = os.urandom(32)
    for name in ("MAC of another key", "the true entry's MAC", "no MAC", "payload only"):
        for entry in holding:
            mac, _, payload = good[entry][len(cache_module.FORMAT) :].partition(b"\n")
            forged = payload.replace(b"1e-05", b"7e-06")
            assert forged != payload
            if name == "MAC of another key":
                forge(entry, forged, cache_module.entry_mac(other_key, entry.name[: -len(cache_module.SUFFIX)], forged))
            elif name == "the true entry's MAC":
                forge(entry, forged, mac)
            elif name == "no MAC":
                forge(entry, forged, b"")
            else:
                entry.write_bytes(forged)
        before = len(hydra_calls)
        assert lr_of() == (1e-5, "1e-5", 1e-5), name
        assert len(hydra_calls) == before + 3, name  # all three composed by Hydra again
        assert {entry: entry.read_bytes() for entry in entries(root)} == good, name  # and written again
    assert lr_of() == (1e-5, "1e-5", 1e-5)


class Plant:
    """A pickle that creates ``marker`` when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_planted_under_an_entry_name_never_runs(root, hydra_calls, tmp_path):
    """Promise: entries are JSON read as data, never unpickled: a pickle planted under the entry's name (bare,
    behind the format line and a MAC, or as an entry of the pickle format 3) or under the old format's name is a
    miss, creates nothing, and the old format's files are removed when the cache next writes."""
    marker = tmp_path / "pwned"
    bomb = pickle.dumps(Plant(marker))
    pickle.loads(bomb).close()
    assert marker.exists()  # the payload works: unpickling it runs code
    marker.unlink()
    with session() as composer:
        composer.compose(LR)
        key = composer.cache.key_of(LR, False)
    entry = root / (key + cache_module.SUFFIX)
    import hashlib

    legacy = root / (key + ".composition")
    old_header = hashlib.sha256(b"recipe-bundle compose cache 3\n" + key.encode() + b"\n" + bomb).hexdigest().encode()
    for data in (bomb, cache_module.FORMAT + b"0" * 64 + b"\n" + bomb, old_header + b"\n" + bomb):
        entry.write_bytes(data)
        entry.chmod(0o600)
        legacy.write_bytes(old_header + b"\n" + bomb)
        legacy.chmod(0o600)
        with session() as composer:
            assert composer.compose(LR).optim.lr == 1e-5
        assert not marker.exists()
        assert not legacy.exists()  # removed when the entry was written again
        assert entry.read_bytes().startswith(cache_module.FORMAT) and b"\x80" not in entry.read_bytes()
    assert len(hydra_calls) == 4


def test_a_layer_record_mac_is_not_an_entry_mac(root, hydra_calls):
    """Promise: the entry's MAC has its own kind: the MAC the image cache would give a layer record or a stamp over
    the same fields, under the same key, does not verify as an entry; the entry's own MAC is the image cache's
    construction (Cache.mac) with that kind, under the key of trainer.image.cas.stamp_key."""
    import hashlib

    from trainer.image import cas, stampkey

    with session() as composer:
        composer.compose(LR)
        key = composer.cache.key_of(LR, False)
    entry = the_entry(root)
    mac, _, payload = entry.read_bytes()[len(cache_module.FORMAT) :].partition(b"\n")
    assert cache_module.mac_key() == cas.stamp_key() and len(cas.stamp_key()) == 32
    assert cache_module.key_path() == stampkey.stamp_key_path()
    fields = (cache_module.FORMAT.decode().strip(), key, hashlib.sha256(payload).hexdigest())
    image = cas.Cache(root / "cas")
    assert mac.decode() == image.mac(cache_module.MAC_KIND, *fields)
    for kind in ("layer", "stamp"):
        forge(entry, payload, image.mac(kind, *fields).encode())
        with session() as composer:
            assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 3


def test_another_keys_entry_copied_over_is_a_miss(root, hydra_calls):
    """Promise: a good entry of another command line (lr 3e-5) copied over this one's is a miss: this command
    line gets its own lr."""
    with session() as composer:
        composer.compose(["optim.lr=3e-5"])
        composer.compose(LR)
        mine = root / (composer.cache.key_of(LR, False) + cache_module.SUFFIX)
        other = root / (composer.cache.key_of(["optim.lr=3e-5"], False) + cache_module.SUFFIX)
    good = mine.read_bytes()
    shutil.copy2(other, mine)
    with session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 3 and mine.read_bytes() == good


def test_a_truncated_entry_is_a_miss(root, hydra_calls):
    """Promise: an entry cut anywhere (in the format line, in the MAC, in the payload, by its last byte, to
    nothing) is a miss and is written again."""
    with session() as composer:
        fresh = OmegaConf.to_yaml(composer.compose(LR))
        entry = the_entry(root)
        good = entry.read_bytes()
        cuts = (10, len(cache_module.FORMAT) + 30, len(good) // 2, len(good) - 1, 0)
        for n, size in enumerate(cuts, start=2):
            os.truncate(entry, size)
            assert OmegaConf.to_yaml(composer.compose(LR)) == fresh, size
            assert len(hydra_calls) == n and entry.read_bytes() == good, size


def test_an_8_gib_sparse_entry_is_refused_without_reading_it(root, hydra_calls):
    """Promise: an entry larger than MAX_ENTRY_BYTES (an 8 GiB sparse file) is a miss decided from its size, in
    well under a second, and is replaced by a good entry."""
    with session() as composer:
        composer.compose(LR)
    entry = the_entry(root)
    good = entry.read_bytes()
    os.truncate(entry, 8 << 30)
    start = time.perf_counter()
    with helpers.bounded(20), session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert time.perf_counter() - start < 10  # a read of 8 GiB would take far longer, and the memory
    assert len(hydra_calls) == 2 and entry.read_bytes() == good


def test_a_fifo_or_a_link_where_an_entry_should_be_is_a_miss(root, hydra_calls, tmp_path):
    """Promise: a FIFO under an entry's name is a miss without blocking (and is replaced by an entry); so is a
    symbolic link, even to a good entry of the same key."""
    with session() as composer:
        composer.compose(LR)
    entry = the_entry(root)
    good = entry.read_bytes()
    entry.unlink()
    os.mkfifo(entry, 0o600)
    with helpers.bounded(20), session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert entry.is_file() and entry.read_bytes() == good
    elsewhere = tmp_path / "elsewhere.json"
    shutil.move(entry, elsewhere)
    entry.symlink_to(elsewhere)
    with session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert not entry.is_symlink() and entry.read_bytes() == good
    assert len(hydra_calls) == 3


def test_another_accounts_entry_is_a_miss(root, hydra_calls):
    with session() as composer:
        composer.compose(LR)
    entry = the_entry(root)
    try:
        os.chown(entry, 65534, 65534)
    except OSError as ex:
        pytest.skip(f"cannot give a file to another account here: {ex.strerror}")
    with session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 2 and entry.stat().st_uid == os.getuid()


def test_a_key_others_may_read_or_a_fifo_key_turns_the_cache_off(root, hydra_calls, monkeypatch):
    """Promise: the key must be a regular file of 32 bytes only this user may read and write: a key others may
    read (they could forge entries), or a FIFO in its place, means no entry is read or stored, without blocking."""
    with session() as composer:
        composer.compose(LR)
    key = cache_module.key_path()
    assert key.stat().st_mode & 0o777 == 0o600
    key.chmod(0o644)
    monkeypatch.setattr(cache_module, "_KEY", None)
    with session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 2
    key.unlink()
    os.mkfifo(key, 0o600)
    monkeypatch.setattr(cache_module, "_KEY", None)
    shutil.rmtree(root)
    with helpers.bounded(20), session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 3 and entries(root) == []


def test_the_type_names_of_an_entry_are_looked_up_in_the_schema_and_hydra_only() -> None:
    """Promise: even an authenticated entry names types only from trainer.compose.schema and Hydra's modules
    (dataclasses and enums): a description naming os.system, builtins.eval or a class of another module is
    refused, and a composition holding a type of another module is not stored."""
    from trainer.compose import schema

    cfg = OmegaConf.structured(schema.OptimConfig)
    data = cache_module.to_data(cfg)
    assert OmegaConf.to_yaml(cache_module.from_data(json.loads(json.dumps(data)))) == OmegaConf.to_yaml(cfg)
    for bad in (
        "os:system",
        "builtins:eval",
        "subprocess:Popen",
        "trainer.compose.schema:register",
        "test_hostile_compose_cache:Local",
    ):
        hostile = json.loads(json.dumps(data))
        index = next(i for i, t in enumerate(hostile["types"]) if isinstance(t, str) and ":" in t)
        hostile["types"][index] = bad
        with pytest.raises(cache_module.Unstorable):
            cache_module.from_data(hostile)

    @dataclass
    class Local:
        x: int = 1

    with pytest.raises(cache_module.Unstorable):
        cache_module.to_data(OmegaConf.structured(Local))


def test_a_secret_of_the_environment_is_never_stored(root, hydra_calls, monkeypatch):
    """Promise: a value the run directory treats as secret because the caller's environment names it
    (HF_TOKEN=V, as train learns it: learn_env(os.environ)) makes a composition holding it uncacheable, even where
    no override names it secret (launcher.job=[-p,V]): no cache file holds V and Hydra composes it every time. Its
    control: without HF_TOKEN the same command line is stored and read back."""
    canary = "CANARYzq81xyz"
    job = [f"launcher.job=[-p,{canary}]"]
    monkeypatch.setenv("HF_TOKEN", canary)
    for _ in range(2):
        with session() as composer:
            assert canary in composer.compose(job).launcher.job
            composer.compose([*job, "hydra.mode=RUN"], hydra_node=True)
    assert len(hydra_calls) == 4
    assert not any(canary.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())
    monkeypatch.delenv("HF_TOKEN")
    for _ in range(2):
        with session() as composer:
            assert canary in composer.compose(job).launcher.job
    assert len(hydra_calls) == 5 and len(entries(root)) == 1


USER_FILES = {
    "symphony.composition": b"song\n",
    "notes.composition.json": b"{}\n",
    ".x.composition.old": b"x\n",
    ".draft.composition.bak": b"draft\n",
    ("a" * 64) + ".composition.json.bak": b"mine\n",
}


def _user_files(directory, age_s=7200):
    for name, data in USER_FILES.items():
        (directory / name).write_bytes(data)
        os.utime(directory / name, (time.time() - age_s, time.time() - age_s))


def test_a_shared_cache_directory_is_neither_chmodded_nor_pruned(root, hydra_calls):
    """Promise: TRAINER_COMPOSE_CACHE naming a directory others may write (a 1777 one, as /tmp) turns the cache
    off: the directory keeps its mode, no entry is written, and the user's files in it (named like entries or
    temporary files, two hours old) are all kept, byte for byte."""
    root.mkdir()
    root.chmod(0o1777)
    _user_files(root)
    for _ in range(2):
        with session() as composer:
            assert composer.compose(LR).optim.lr == 1e-5
    assert root.stat().st_mode & 0o7777 == 0o1777 and len(hydra_calls) == 2
    assert {p.name: p.read_bytes() for p in root.iterdir()} == USER_FILES


def test_pruning_removes_only_the_names_the_cache_writes(root, hydra_calls):
    """Promise: in this user's own cache directory a write removes an older format's pickle (KEY.composition),
    a killed writer's temporary file (.KEY.composition.json.XXXXXXXX, two hours old) and a link under an entry's
    name, and nothing else: the user's symphony.composition, notes.composition.json, .x.composition.old (two hours
    old) stay byte for byte."""
    root.mkdir(mode=0o700)
    _user_files(root)
    legacy, debris, link = (
        ("b" * 64) + ".composition",
        f".{'c' * 64}.composition.json.ab1_cd2e",
        ("d" * 64) + ".composition.json",
    )
    (root / legacy).write_bytes(b"pickle")
    (root / debris).write_bytes(b"half")
    os.utime(root / debris, (time.time() - 7200, time.time() - 7200))
    (root / link).symlink_to(root / "symphony.composition")
    with session() as composer:
        composer.compose(LR)
    left = {
        p.name: p.read_bytes()
        for p in root.iterdir()
        if not p.name.endswith(cache_module.SUFFIX) or p.name in USER_FILES
    }
    assert left == USER_FILES, sorted(left)
    assert not os.path.lexists(root / link), sorted(os.listdir(root))
    assert len([e for e in entries(root) if cache_module.ENTRY_NAME.match(e.name)]) == 1


def test_entries_are_0600_whatever_the_umask(root, hydra_calls):
    """Promise: under umask 0277 the cache still works: its directory is made 0700 and entries 0600 (before, the
    umask made them 0400 and every write pruned what it had just written), and the second composition is a hit."""
    old = os.umask(0o277)
    try:
        for _ in range(2):
            with session() as composer:
                assert composer.compose(LR).optim.lr == 1e-5
    finally:
        os.umask(old)
    (entry,) = entries(root)
    assert entry.stat().st_mode & 0o777 == 0o600 and root.stat().st_mode & 0o777 == 0o700
    assert len(hydra_calls) == 1


def test_an_entry_in_a_directory_others_may_write_is_a_miss(root, hydra_calls):
    """Promise: a true entry in a cache directory that has since become writable by others (0777) is a miss, and
    the directory is not chmodded back: whoever may write it may have swapped the entry."""
    with session() as composer:
        composer.compose(LR)
    root.chmod(0o777)
    with session() as composer:
        assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 2 and root.stat().st_mode & 0o777 == 0o777 and len(entries(root)) == 1


def test_a_key_of_one_process_stores_nothing(root, hydra_calls, monkeypatch, tmp_path):
    """Promise: where the key cannot be kept in its file (XDG_CONFIG_HOME a missing directory no one may make, under
    /proc: the image cache falls back to a key of this process), no entry is stored: none could be verified by a
    later process."""
    monkeypatch.setenv("XDG_CONFIG_HOME", f"/proc/no-such-config-{os.getpid()}")
    for _ in range(2):
        with session() as composer:
            assert composer.compose(LR).optim.lr == 1e-5
    assert len(hydra_calls) == 2 and not root.exists()


def test_a_type_reaching_another_module_is_refused():
    """Promise: a type name is looked up only as what its module defines under it: an attribute path reaching
    another module (hydra._internal.config_loader_impl:re.enum.IntFlag is enum.IntFlag), a private or dunder part,
    or a module not yet imported and not one the compositions use, is refused without importing anything; a true
    name (hydra.conf:JobConf.JobConfig) is found."""
    import sys

    from hydra.conf import JobConf

    assert cache_module._named_class("hydra.conf", "JobConf.JobConfig") is JobConf.JobConfig
    for module, qualname in (
        ("hydra._internal.config_loader_impl", "re.enum.IntFlag"),
        ("hydra.conf", "JobConf.__class__"),
        ("hydra.conf", "_JobConf"),
        ("trainer.compose.schema", "OptimConfig.__mro__"),
        ("hydra.test_utils.example_app", "Anything"),
    ):
        with pytest.raises(cache_module.Unstorable):
            cache_module._named_class(module, qualname)
    assert "hydra.test_utils.example_app" not in sys.modules


def test_a_type_description_referring_to_itself_is_refused():
    """Promise: a type table entry that names itself (["List", i] at index i) is refused as unstorable, not read
    as List[NoneType]."""
    from trainer.compose import schema

    data = json.loads(json.dumps(cache_module.to_data(OmegaConf.structured(schema.TrainConfig))))
    index = len(data["types"])
    data["types"].append(["List", index])
    container = next(m for m in data["metas"] if len(m) == 7)
    container[6] = index
    with pytest.raises(cache_module.Unstorable, match="refers to itself"):
        cache_module.from_data(data)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
