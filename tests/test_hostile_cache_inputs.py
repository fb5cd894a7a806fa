"""What enters the cache, and what counts as in it: `cache add-git` refuses a file over the build's per-file limit
before reading it, and `cache fetch` counts a cached blob only when its bytes are intact.

Every refusal: exit code, one line naming the file and the limit, no traceback, nothing stored.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

import helpers
from image_fixtures import demo_source, make_git_source, make_wheel, small_lock
from trainer import cli
from trainer.image import sources, tarread

EPOCH = 1767225600
BIG = 4096  # bytes of the source's large file: over the limit the tests set, far under the real one


def cache_files(cache: Path):
    return (
        sorted(
            p.relative_to(cache).as_posix()
            for p in cache.rglob("*")
            if p.is_file() and p.parts[len(cache.parts)] not in ("tmp",)
        )
        if cache.exists()
        else []
    )


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-source")
    files = {"README.md": b"demo\n", "data/big.bin": bytes(range(256)) * (BIG // 256)}
    _, commit, tree = make_git_source(root, "demo", files, EPOCH)
    return root / "demo.git-work", commit, tree


def test_the_per_file_limit_of_add_git_is_the_builds(big_source):
    """The limit add-git applies is the one a build reads a cached source archive with (tarread, 1 GiB): add-git
    reads the module's constant when it runs, so the tests below that lower it exercise that very check."""
    assert tarread.MAX_MEMBER_BYTES == 1 << 30
    assert "tarread.MAX_MEMBER_BYTES" in Path(sources.__file__).read_text()


def test_add_git_refuses_a_file_over_the_limit_before_reading_it(big_source, tmp_path, monkeypatch, capsys):
    """Promise: `trainer cache add-git` refuses a commit holding a file over the build's per-file limit (here
    lowered to 1 KiB) from the sizes git lists, before any blob is read (no `git cat-file` is started): exit 2, one
    line naming the file, its size and the limit; nothing is stored."""
    repo, commit, tree = big_source
    monkeypatch.setattr(tarread, "MAX_MEMBER_BYTES", 1024)
    started = []
    real_popen = sources.subprocess.Popen

    def popen(argv, *args, **kwargs):  # a spy that records what runs (the real git runs)
        started.append(argv)
        return real_popen(argv, *args, **kwargs)

    monkeypatch.setattr(sources.subprocess, "Popen", popen)
    cache = tmp_path / "cas"
    rc = cli.main(["cache", "--cache", str(cache), "add-git", str(repo), "--commit", commit, "--tree", tree])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer cache: error: "), err
    assert f"file data/big.bin is {BIG:,} bytes, more than the build's 1,024 per file" in lines[0], lines[0]
    assert not any("cat-file" in argv for argv in started), started
    assert not (cache / "blobs").exists() or not any((cache / "blobs").rglob("*"))
    assert not (cache / "trees").exists() or not any((cache / "trees").iterdir())


def test_add_git_at_the_limit_stores_the_tree(big_source, tmp_path, monkeypatch, capsys):
    """The control: with the limit at the file's size the same commit is stored, its blobs streamed from one
    `git cat-file --batch`, and the tree id is git's."""
    repo, commit, tree = big_source
    monkeypatch.setattr(tarread, "MAX_MEMBER_BYTES", BIG)
    cache = tmp_path / "cas"
    assert cli.main(["cache", "--cache", str(cache), "add-git", str(repo), "--commit", commit, "--tree", tree]) == 0
    capsys.readouterr()
    assert json.loads((cache / "trees" / f"{tree}.json").read_text())["commit"] == commit


def test_a_blob_git_answers_with_another_size_is_refused(big_source):
    """Promise: a blob whose size in git's answer is not the size listed is refused, not read."""
    repo, commit, _ = big_source
    from trainer.image.sources import _git, _read_blobs, git_dir_of

    gitdir = git_dir_of(repo)
    oid = _git(gitdir, "rev-parse", f"{commit}:data/big.bin").strip()
    with pytest.raises(sources.UserError, match=r"data/big.bin is 4,096 bytes \(listed 10, at most"):
        _read_blobs(gitdir, repo, [("data/big.bin", "100644", oid, 10)], 1 << 30)
    assert _read_blobs(gitdir, repo, [("data/big.bin", "100644", oid, BIG)], 1 << 30)["data/big.bin"][1] == bytes(
        range(256)
    ) * (BIG // 256)


def test_git_cat_file_is_killed_on_a_refusal(big_source, monkeypatch):
    """Promise: when _read_blobs refuses git's answer, the git process is killed (SIGKILL) before it is waited
    for, never left to finish writing; its control: a read that succeeds lets git exit on its own (code 0)."""
    import signal

    repo, commit, _ = big_source
    from trainer.image.sources import _git, _read_blobs, git_dir_of

    gitdir = git_dir_of(repo)
    oid = _git(gitdir, "rev-parse", f"{commit}:data/big.bin").strip()
    procs = []
    real_popen = sources.subprocess.Popen

    def popen(argv, *args, **kwargs):  # a spy that keeps the real git process
        procs.append(real_popen(argv, *args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(sources.subprocess, "Popen", popen)
    with pytest.raises(sources.UserError, match="listed 10"):
        _read_blobs(gitdir, repo, [("data/big.bin", "100644", oid, 10)], 1 << 30)
    assert procs[-1].returncode == -signal.SIGKILL
    _read_blobs(gitdir, repo, [("data/big.bin", "100644", oid, BIG)], 1 << 30)
    assert procs[-1].returncode == 0


# ------------------------------------------------------------------------------------------ fetch


@pytest.fixture
def seeded(tmp_path):
    """A lock of one wheel and one git source (by archive), both in a fresh cache."""
    wheel = make_wheel(tmp_path, "alpha", "1.0", {"alpha/__init__.py": b"X = 1\n"})
    source, archive = demo_source(tmp_path / "git", {"README.md": b"demo\n"}, EPOCH)
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps(small_lock("fetch", EPOCH, [(wheel, "alpha", "1.0", "rest")], [source])))
    cache = tmp_path / "cas"
    for f in (wheel, archive):
        assert cli.main(["cache", "--cache", str(cache), "add", str(f)]) == 0
    return {
        "lock": lock,
        "cache": cache,
        "wheel": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "archive": source["archive"]["sha256"],
    }


def _fetch(seeded, capsys):
    rc = cli.main(["cache", "--cache", str(seeded["cache"]), "fetch", "--lock", str(seeded["lock"])])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return rc, out.out


def _corrupt(cache: Path, sha: str) -> Path:
    blob = next(p for p in cache.rglob(sha) if p.is_file())
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    st = blob.stat()
    blob.write_bytes(bytes(data))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back: only the bytes (and ctime) differ
    return blob


def test_fetch_counts_an_intact_cache_as_cached(seeded, capsys):
    rc, out = _fetch(seeded, capsys)
    assert rc == 0 and out.strip().splitlines()[-1] == "0 fetched, 2 already cached, 0 missing", out


@pytest.mark.parametrize("which", ["wheel", "archive"])
def test_fetch_never_counts_a_corrupt_blob_as_cached(seeded, capsys, which):
    """Promise: `trainer cache fetch` re-hashes a cached blob unless its stamp vouches for it: one corrupted byte
    (its mtime restored) is reported corrupt and removed, and, since it cannot be fetched again here (no network
    to its URL), named missing with exit 1; the intact input is still counted cached."""
    blob = _corrupt(seeded["cache"], seeded[which])
    rc, out = _fetch(seeded, capsys)
    assert rc == 1, out
    lines = out.strip().splitlines()
    assert lines[-1] == "0 fetched, 1 already cached, 1 missing", out
    assert len(lines) == 2 and "is corrupt: sha256 " in lines[0] and seeded[which] in lines[0], out
    assert not blob.exists()


@pytest.mark.parametrize("kind", ["directory", "fifo", "link"])
def test_fetch_removes_a_non_file_at_a_blob_path_and_says_so_once(seeded, capsys, kind):
    """Promise: a directory, FIFO or symbolic link where a cached blob should be is reported once (not "X; X"),
    without blocking, and removed (a link never followed: its target stays), so that the input can be fetched
    again; here it cannot (no network), so it is named missing with exit 1 and the intact input is still cached."""
    blob = next(p for p in seeded["cache"].rglob(seeded["wheel"]) if p.is_file())
    target = seeded["cache"].parent / "elsewhere"
    target.write_bytes(b"not a wheel")
    blob.unlink()
    {"directory": blob.mkdir, "fifo": lambda: os.mkfifo(blob), "link": lambda: blob.symlink_to(target)}[kind]()
    rc, out = _fetch(seeded, capsys)
    assert rc == 1, out
    lines = out.strip().splitlines()
    assert lines[-1] == "0 fetched, 1 already cached, 1 missing", out
    assert len(lines) == 2 and seeded["wheel"] in lines[0], out
    parts = lines[0].split("; ")
    assert len(parts) == len(set(parts)), lines[0]
    assert not os.path.lexists(blob), kind
    assert target.read_bytes() == b"not a wheel"


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
