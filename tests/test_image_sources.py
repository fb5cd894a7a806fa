"""Git sources pinned by commit and tree: seeding from a clone, fetching, any archive format, refusals.

Every repository here is made by the test (two commits, an executable, a symlink, nested directories);
``git`` itself gives the expected commit and tree ids. A refused input must leave the cache as it was.
"""

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from image_fixtures import git_env, make_wheel, small_lock
from trainer.errors import UserError
from trainer.image.gittree import check_links_stay_inside, directory_tree_id, git_tree_id

EPOCH = 1767225600


trainer = helpers.run_trainer


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], env=git_env(EPOCH), check=True, capture_output=True, text=True
    ).stdout.strip()


def write(repo: Path, files):
    for rel, data in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, tuple):  # ("link", target)
            os.symlink(data[1], path)
        else:
            path.write_bytes(data)


def commit(repo: Path, message: str):
    git(repo, "add", "-A")
    git(repo, "-c", "commit.gpgsign=false", "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD"), git(repo, "rev-parse", "HEAD^{tree}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A work tree with two commits: v1 (files, an executable, a symlink) and v2 (one file changed)."""
    root = tmp_path_factory.mktemp("repo") / "demo"
    root.mkdir()
    git(root, "init", "-q")
    write(
        root,
        {
            "README.md": b"demo\n",
            "demo/__init__.py": b"VERSION = 1\n",
            "demo/deep/x.txt": b"x\n",
            "bin/run": b"#!/bin/sh\necho run\n",
            "docs/latest": ("link", "../README.md"),
        },
    )
    os.chmod(root / "bin" / "run", 0o755)
    v1 = commit(root, "v1")
    write(root, {"demo/__init__.py": b"VERSION = 2\n"})
    v2 = commit(root, "v2")
    return {"path": root, "v1": v1, "v2": v2}


def source(repo, version="v1", **extra):
    c, t = repo[version]
    return {
        "name": "demo",
        "url": "https://example.invalid/demo",
        "commit": c,
        "tree": t,
        "dest": "/opt/src/demo",
        "python_path": True,
        **extra,
    }


def lock_file(tmp: Path, repo, version="v1", **extra) -> Path:
    wheels = tmp / "wheels"
    wheels.mkdir(exist_ok=True)
    wheel = make_wheel(wheels, "alpha", "1.0", {"alpha/__init__.py": b""})
    lock = small_lock("src-test", EPOCH, [(wheel, "alpha", "1.0", "rest")], [source(repo, version, **extra)])
    path = tmp / f"lock-{version}.json"
    path.write_text(json.dumps(lock, indent=1))
    return path


def snapshot(root: Path):
    """Every file under ``root`` with its sha256: what a refused input must leave unchanged."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "tmp" not in p.relative_to(root).parts
    }


def build(tmp: Path, lock: Path, cache: Path, name: str):
    """Build ``lock`` offline from ``cache`` (its wheel added first) into ``tmp/name``."""
    for wheel in (tmp / "wheels").glob("*.whl"):
        assert trainer("cache", "--cache", cache, "add", wheel).returncode == 0
    bundle = tmp / "bundle"
    (bundle / "conf").mkdir(parents=True, exist_ok=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    r = trainer(
        "image",
        "build",
        "--lock",
        lock,
        "--out",
        tmp / name,
        "--cache",
        cache,
        "--offline",
        "--bundle-root",
        bundle,
        "--revision",
        "test",
        "--json",
    )
    return r


def test_tree_id_matches_git_for_modes_links_and_nesting(repo, tmp_path):
    # v1 unpacked from git's own archive: executable bit and symlink included
    out = tmp_path / "export"
    out.mkdir()
    subprocess.run(f"git -C {repo['path']} archive {repo['v1'][0]} | tar x -C {out}", shell=True, check=True)
    assert directory_tree_id(out) == repo["v1"][1]
    # git orders entries by bytes with a directory compared as "name/": "a-b" < "a.b/" < "a/" here
    files = {"a/x": ("100644", b"1"), "a.b/c": ("100644", b"2"), "a-b": ("100755", b"3"), "l": ("120000", b"a-b")}
    work = tmp_path / "w"
    work.mkdir()
    git(work, "init", "-q")
    write(work, {"a/x": b"1", "a.b/c": b"2", "a-b": b"3", "l": ("link", "a-b")})
    os.chmod(work / "a-b", 0o755)
    assert git_tree_id(files) == commit(work, "order")[1]


def test_add_git_seeds_builds_and_the_image_holds_the_tree(repo, tmp_path):
    cache = tmp_path / "cas"
    lock = lock_file(tmp_path, repo)
    r = trainer(
        "cache", "--cache", cache, "add-git", repo["path"], "--commit", repo["v1"][0][:10], "--lock", lock, "--json"
    )
    assert r.returncode == 0, r.stderr
    added = json.loads(r.stdout)
    assert (added["commit"], added["tree"], added["files"]) == (repo["v1"][0], repo["v1"][1], 5)
    # a bare clone serves the same way and stores the same blob
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo["path"]), str(bare)], check=True)
    r2 = trainer(
        "cache", "--cache", tmp_path / "cas-bare", "add-git", bare, "--commit", repo["v1"][0], "--lock", lock, "--json"
    )
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["sha256"] == added["sha256"]
    r = build(tmp_path, lock, cache, "img")
    assert r.returncode == 0, r.stderr
    layers = {layer["name"]: layer["diff_id"] for layer in json.loads(r.stdout)["layers"]}
    blob = tmp_path / "img" / "blobs" / "sha256" / layers["sources"][7:]
    with tarfile.open(blob) as tar:
        names = {m.name: m for m in tar.getmembers()}
        assert tar.extractfile("opt/src/demo/demo/__init__.py").read() == b"VERSION = 1\n"
        assert names["opt/src/demo/bin/run"].mode == 0o755
        assert (
            names["opt/src/demo/docs/latest"].issym() and names["opt/src/demo/docs/latest"].linkname == "../README.md"
        )
        pth = tar.extractfile("usr/local/lib/python3.12/site-packages/recipe-bundle-sources.pth").read()
        assert pth == b"/opt/src/demo\n"
    stamp = json.loads(
        subprocess.run(
            [
                "tar",
                "-xOf",
                str(tmp_path / "img" / "blobs" / "sha256" / layers["bundle"][7:]),
                "etc/recipe-bundle/lock.json",
            ],
            capture_output=True,
            check=True,
        ).stdout
    )
    assert stamp["sources"]["demo"] == {
        "commit": repo["v1"][0],
        "tree": repo["v1"][1],
        "url": "https://example.invalid/demo",
        "dest": "/opt/src/demo",
    }


def _tar_of_tree(repo, version, compress=""):
    return subprocess.run(
        ["git", "-C", str(repo["path"]), "archive", f"--format=tar{compress}", "--prefix=demo-x/", repo[version][0]],
        capture_output=True,
        check=True,
    ).stdout


def test_archive_formats_of_one_tree_give_one_layer(repo, tmp_path):
    """git archive tar, tar.gz and zip, and a zip made by Python's zipfile: the same sources layer digest."""
    archives = {
        "tar": _tar_of_tree(repo, "v1"),
        "zip": subprocess.run(
            ["git", "-C", str(repo["path"]), "archive", "--format=zip", "--prefix=demo-x/", repo["v1"][0]],
            capture_output=True,
            check=True,
        ).stdout,
    }
    archives["tar.gz"] = subprocess.run(["gzip", "-n"], input=archives["tar"], capture_output=True, check=True).stdout
    own = io.BytesIO()
    with zipfile.ZipFile(own, "w") as z:  # directories left out, Unix modes set by hand
        with tarfile.open(fileobj=io.BytesIO(archives["tar"])) as tar:
            for m in tar.getmembers():
                if m.isdir():
                    continue
                info = zipfile.ZipInfo(m.name)
                info.external_attr = (0o120777 if m.issym() else 0o100000 | m.mode) << 16
                z.writestr(info, m.linkname.encode() if m.issym() else tar.extractfile(m).read())
    archives["python-zip"] = own.getvalue()
    digests = set()
    for name, data in archives.items():
        path = tmp_path / f"demo.{name}"
        path.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        with_archive = lock_file(tmp_path, repo, archive={"filename": path.name, "sha256": sha})
        cache = tmp_path / f"cas-{name}"
        assert trainer("cache", "--cache", cache, "add", path, "--sha256", sha).returncode == 0
        r = build(tmp_path, with_archive, cache, f"img-{name}")
        assert r.returncode == 0, (name, r.stderr)
        digests.add({layer["name"]: layer["diff_id"] for layer in json.loads(r.stdout)["layers"]}["sources"])
    assert len(digests) == 1, digests


def test_fetch_downloads_an_archive_and_checks_its_tree(repo, tmp_path):
    data = subprocess.run(["gzip", "-n"], input=_tar_of_tree(repo, "v2"), capture_output=True, check=True).stdout

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        lock = lock_file(
            tmp_path,
            repo,
            "v2",
            archive={
                "filename": "demo.tar.gz",
                "sha256": hashlib.sha256(data).hexdigest(),
                "url": base + "demo.tar.gz",
            },
        )
        cache = tmp_path / "cas"
        wheel = next((tmp_path / "wheels").glob("*.whl"))
        assert trainer("cache", "--cache", cache, "add", wheel).returncode == 0
        refused = trainer("cache", "--cache", cache, "fetch", "--lock", lock)
        assert refused.returncode == 1 and "will not download http://127.0.0.1" in refused.stdout
        r = trainer("cache", "--cache", cache, "fetch", "--lock", lock, "--allow-host", base, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stderr == ""  # off a terminal: no progress bars, no blank lines
        assert json.loads(r.stdout)["fetched"] == 1
        assert build(tmp_path, lock, cache, "img").returncode == 0
    finally:
        server.shutdown()
        server.server_close()


def refused(args, cache: Path):
    before = snapshot(cache)
    r = trainer(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert snapshot(cache) == before
    return lines[0]


def test_add_git_refusals_store_nothing(repo, tmp_path):
    cache = tmp_path / "cas"
    cache.mkdir()
    lock = lock_file(tmp_path, repo)
    absent = "0123456789abcdef0123456789abcdef01234567"
    line = refused(["cache", "--cache", cache, "add-git", repo["path"], "--commit", absent, "--lock", lock], cache)
    assert f"commit {absent} is not in this repository" in line
    # v2 is not what the lock pins
    line = refused(
        ["cache", "--cache", cache, "add-git", repo["path"], "--commit", repo["v2"][0], "--lock", lock], cache
    )
    assert "is not pinned by any lock given" in line
    # the lock pins v1's commit with another tree
    bad = json.loads(lock.read_text())
    bad["sources"][0]["tree"] = repo["v2"][1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    line = refused(
        [
            "cache",
            "--cache",
            cache,
            "add-git",
            repo["path"],
            "--commit",
            repo["v1"][0],
            "--lock",
            tmp_path / "bad.json",
        ],
        cache,
    )
    assert f"has tree {repo['v1'][1]} for this commit" in line and f"pins {repo['v2'][1]}" in line
    line = refused(["cache", "--cache", cache, "add-git", tmp_path, "--commit", repo["v1"][0], "--lock", lock], cache)
    assert "not a git repository" in line


@pytest.mark.parametrize(
    "links, why",
    [
        ({"esc": "../../etc/passwd"}, "resolves outside the source tree"),
        ({"abs": "/etc/shadow"}, "absolute target"),
        # each link alone stays inside lexically; through the chain, esc leaves the tree
        ({"top/up": "..", "top/esc": "up/../../etc/shadow"}, "resolves outside the source tree"),
        ({"a": "b", "b": "a"}, "a loop"),
    ],
)
def test_symlink_escapes_are_refused(links, why, tmp_path):
    with pytest.raises(UserError, match=why):
        check_links_stay_inside(links, "source t")
    # the same through add-git: a commit with that link is never stored
    work = tmp_path / "w"
    work.mkdir()
    git(work, "init", "-q")
    write(work, {"ok.txt": b"ok\n", "top/inner.txt": b"i\n", **{k: ("link", v) for k, v in links.items()}})
    c, t = commit(work, "escape")
    cache = tmp_path / "cas"
    cache.mkdir()
    line = refused(["cache", "--cache", cache, "add-git", work, "--commit", c, "--tree", t], cache)
    assert why in line


def test_links_inside_the_tree_pass():
    check_links_stay_inside({"docs/latest": "../README.md", "a/b": "../docs/latest", "c": "a/./b"}, "source t")


def test_tampered_cached_tree_is_refused_at_build(repo, tmp_path):
    cache = tmp_path / "cas"
    lock = lock_file(tmp_path, repo)
    assert (
        trainer(
            "cache", "--cache", cache, "add-git", repo["path"], "--commit", repo["v1"][0], "--lock", lock
        ).returncode
        == 0
    )
    wheel = next((tmp_path / "wheels").glob("*.whl"))
    assert trainer("cache", "--cache", cache, "add", wheel).returncode == 0
    # point the tree index at another blob that holds other files (v2): its tree id gives it away
    other = tmp_path / "cas-v2"
    assert (
        trainer(
            "cache",
            "--cache",
            other,
            "add-git",
            repo["path"],
            "--commit",
            repo["v2"][0],
            "--tree",
            repo["v2"][1],
            "--json",
        ).returncode
        == 0
    )
    v2_record = json.loads((other / "trees" / f"{repo['v2'][1]}.json").read_text())
    blob = other / "sha256" / v2_record["sha256"]
    assert trainer("cache", "--cache", cache, "add", blob).returncode == 0
    index = cache / "trees" / f"{repo['v1'][1]}.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "sha256": v2_record["sha256"]}))
    r = build(tmp_path, lock, cache, "img")
    assert r.returncode == 2 and not (tmp_path / "img").exists()
    assert f"archive files hash to git tree {repo['v2'][1]}, lock says {repo['v1'][1]} (refused)" in r.stderr
    # and with nothing seeded, the build names the command that seeds it
    empty = tmp_path / "empty"
    assert trainer("cache", "--cache", empty, "add", wheel).returncode == 0
    r = build(tmp_path, lock, empty, "img")
    assert r.returncode == 2 and "trainer cache add-git CLONE --commit " + repo["v1"][0] in r.stderr


def test_probe_reads_the_commit_from_the_installed_files(repo, tmp_path):
    from trainer.probe import source_of

    out = tmp_path / "site" / "demo-checkout"
    out.mkdir(parents=True)
    subprocess.run(f"git -C {repo['path']} archive {repo['v1'][0]} | tar x -C {out}", shell=True, check=True)
    (out / "demo" / "__pycache__").mkdir()
    (out / "demo" / "__pycache__" / "x.pyc").write_bytes(b"\0")  # byte-code caches do not count
    sys.path.insert(0, str(out))
    try:
        pins = {repo["v1"][1]: {"name": "demo", "commit": repo["v1"][0]}}
        assert source_of("demo", pins) == {"commit": repo["v1"][0], "tree": repo["v1"][1], "path": str(out)}
        (out / "demo" / "deep" / "x.txt").write_bytes(b"changed\n")
        seen = source_of("demo", pins)
        assert seen["commit"] is None and seen["tree"] not in (None, repo["v1"][1])
    finally:
        sys.path.remove(str(out))


def test_verify_compares_the_image_stamps_sources(tmp_path):
    from trainer.record.verify import read_lock, verify

    stack = json.loads((REPO_ROOT / "lockfiles" / "stack.json").read_text())["components"]
    stamp = {
        "lock": {"name": "x"},
        "distributions": {},
        "python": {"version": "3.11"},
        "sources": {"megatron_lm": stack["megatron_lm"], "miles": stack["miles"]},
    }
    path = tmp_path / "stamp-lock.json"
    path.write_text(json.dumps(stamp))
    pins = read_lock(path)
    assert pins["megatron_lm_tree"] == "a37cb22fbe3089d8c8ec617a42e8c623ea1679e3"
    probe = {
        "python": "3.11.2",
        "megatron_lm_commit": stack["megatron_lm"]["commit"],
        "megatron_lm_tree": stack["megatron_lm"]["tree"],
        "miles_commit": stack["miles"]["commit"],
        "miles_tree": "f" * 40,
    }
    rows = {r["component"]: r["verdict"] for r in verify({"probe": probe}, pins, {})}
    assert rows["megatron_lm_commit"] == rows["megatron_lm_tree"] == rows["miles_commit"] == rows["python"] == "ok"
    assert rows["miles_tree"] == "drift"


def test_recipe_locks_pin_the_recipes_sources():
    stack = json.loads((REPO_ROOT / "lockfiles" / "stack.json").read_text())["components"]
    recipe = {"miles", "megatron_lm", "deepep", "aws_ofi_nccl"}
    # full.lock.json (on the sglang base, which is not seeded here) locks no build steps, so no fast-hadamard-transform
    for name, wanted in (("debian-full", recipe | {"fast_hadamard_transform"}), ("full", recipe)):
        lock = json.loads((REPO_ROOT / "lockfiles" / f"{name}.lock.json").read_text())
        sources = {s["name"]: s for s in lock["sources"]}
        assert set(sources) == wanted
        for comp in sources:
            assert (sources[comp]["commit"], sources[comp]["tree"]) == (stack[comp]["commit"], stack[comp]["tree"])
        assert sources["miles"]["dest"] == "/root/miles" and sources["miles"]["python_path"] is True
        assert sources["megatron_lm"]["python_path"] is True and "python_path" not in sources["deepep"]


def _crafted_tar(members):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, payload
                tar.addfile(info)
            else:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return out.getvalue()


@pytest.mark.parametrize(
    "members, why",
    [
        ([("top/ok", "file", b"1"), ("top/../../escape", "file", b"x")], "'..' in path"),
        (
            [("top/ok", "file", b"1"), ("top/d", "link", "ok"), ("top/d/x", "file", b"x")],
            "d/x lies under the symlink d",
        ),
        ([("top/ok", "file", b"1"), ("other/x", "file", b"x")], "expected one top-level directory"),
        ([("top/up", "link", ".."), ("top/esc", "link", "up/../../etc/shadow")], "resolves outside the source tree"),
        # a path both a file and a directory, in both orders: no git tree holds it
        (
            [("top/README.md/evil.py", "file", b"x"), ("top/README.md", "file", b"demo\n")],
            "both a file and a directory",
        ),
        (
            [("top/README.md", "file", b"demo\n"), ("top/README.md/evil.py", "file", b"x")],
            "both a file and a directory",
        ),
    ],
)
def test_crafted_archives_are_refused_at_build(members, why, repo, tmp_path):
    data = _crafted_tar(members)
    path = tmp_path / "crafted.tar"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    lock = lock_file(tmp_path, repo, archive={"filename": path.name, "sha256": sha})
    cache = tmp_path / "cas"
    assert trainer("cache", "--cache", cache, "add", path, "--sha256", sha).returncode == 0
    r = build(tmp_path, lock, cache, "img")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and why in r.stderr.strip().splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "img").exists()


def test_archive_urls_and_allowed_hosts(tmp_path):
    from trainer.image.sources import archive_url

    src = {"name": "m", "url": "https://github.com/radixark/Megatron-LM.git", "commit": "37f91617" + "0" * 32}
    assert archive_url(src) == "https://codeload.github.com/radixark/Megatron-LM/tar.gz/37f91617" + "0" * 32
    assert archive_url({**src, "url": "https://gitlab.example/x/y"}) is None
    assert archive_url({**src, "archive": {"url": "https://mirror.example/m.zip"}}) == "https://mirror.example/m.zip"
    lock = tmp_path / "l.json"
    lock.write_text("{}")
    r = trainer("cache", "--cache", tmp_path / "cas", "fetch", "--lock", lock, "--allow-host", "http://127.0.0.1")
    assert r.returncode == 2 and "--allow-host 'http://127.0.0.1': expected a URL prefix ending" in r.stderr


def test_a_dest_that_could_inject_a_pth_line_is_refused(repo, tmp_path):
    lock = json.loads(lock_file(tmp_path, repo).read_text())
    lock["sources"][0]["dest"] = "/opt/src/demo\nimport os; os.system('id')"
    path = tmp_path / "inject.json"
    path.write_text(json.dumps(lock))
    r = trainer("lock", "verify", path)
    assert r.returncode == 2 and "sources[0].dest: expected an absolute path without '..', whitespace" in r.stderr


def test_non_utf8_names_hash_the_same_from_git_zip_and_tar(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    git(work, "init", "-q")
    (work / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"latin-1 name\n")
    c, t = commit(work, "latin-1")
    src = {"name": "n", "url": "x", "commit": c, "tree": t, "dest": "/opt/n"}
    from trainer.image.sources import verified_files

    for fmt in ("tar", "zip"):
        data = subprocess.run(
            ["git", "-C", str(work), "archive", f"--format={fmt}", "--prefix=n/", c], capture_output=True, check=True
        ).stdout
        path = tmp_path / f"n.{fmt}"
        path.write_bytes(data)
        assert set(verified_files(path, src)) == {os.fsdecode(b"caf\xe9.txt")}, fmt


def test_the_probe_never_hashes_a_site_directory(tmp_path):
    from trainer.probe import source_of

    site = tmp_path / "site-packages"
    (site / "wheelpkg").mkdir(parents=True)
    (site / "wheelpkg" / "__init__.py").write_text("")
    (site / "wheelpkg-1.0.dist-info").mkdir()
    sys.path.insert(0, str(site))
    try:
        assert source_of("wheelpkg", {}) == {"commit": None, "tree": None, "path": str(site)}
    finally:
        sys.path.remove(str(site))


def test_add_archive_takes_an_archive_of_a_pinned_tree_and_refuses_any_other(tmp_path):
    """Promise: `trainer cache add-archive` stores a source from an archive of its tree only when the files hash to a
    tree a lock pins (or --tree names); a changed file, another tree, or no pin is refused in one line, nothing
    stored."""
    from image_fixtures import make_git_source
    from trainer.errors import UserError
    from trainer.image.cas import Cache
    from trainer.image.sources import add_archive, cached_archive

    archive, commit, tree = make_git_source(tmp_path / "git", "demo", {"demo/a.py": b"A = 1\n"}, 1767225600)
    pins = [
        {"name": "demo", "url": "https://example.invalid/demo", "commit": commit, "tree": tree, "where": "x.lock.json"}
    ]
    cache = Cache(tmp_path / "cache")
    with pytest.raises(UserError, match=f"hash to git tree {tree}, which no lock given pins"):
        add_archive(cache, archive, [])
    with pytest.raises(UserError, match="--tree says " + "0" * 40):
        add_archive(cache, archive, [], tree="0" * 40)
    assert cache.tree_record(tree) is None
    stored = add_archive(cache, archive, pins)
    assert (stored["name"], stored["commit"], stored["tree"], stored["files"]) == ("demo", commit, tree, 1)
    assert cached_archive(cache, {"name": "demo", "commit": commit, "tree": tree, "url": pins[0]["url"]}).is_file()
    # one changed byte inside the archive: another tree, refused
    other, _, other_tree = make_git_source(tmp_path / "git2", "demo", {"demo/a.py": b"A = 2\n"}, 1767225600)
    r = helpers.run_trainer("cache", "--cache", tmp_path / "cache2", "add-archive", other, "--tree", tree)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"hash to git tree {other_tree}" in r.stderr, r.stderr
    assert not (tmp_path / "cache2" / "trees").exists() or not list((tmp_path / "cache2" / "trees").iterdir())


@pytest.fixture(scope="module")
def with_submodule(tmp_path_factory):
    """A commit whose tree holds files and one submodule (a gitlink at deps/sub to another repository's commit),
    the way enroot's tree pins makeself, musl and the Linux headers."""
    sub = tmp_path_factory.mktemp("sub") / "sub"
    sub.mkdir()
    git(sub, "init", "-q")
    write(sub, {"inside.txt": b"a file of the submodule\n"})
    sub_commit = commit(sub, "sub")[0]
    root = tmp_path_factory.mktemp("super") / "super"
    root.mkdir()
    git(root, "init", "-q")
    write(root, {"Makefile": b"all:\n", "deps/readme": b"deps\n"})
    git(root, "add", "-A")
    git(root, "update-index", "--add", "--cacheinfo", f"160000,{sub_commit},deps/sub")
    git(root, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "with a submodule")  # no add -A: it drops the link
    c, t = git(root, "rev-parse", "HEAD"), git(root, "rev-parse", "HEAD^{tree}")
    assert git(root, "ls-tree", "HEAD", "deps/sub").startswith("160000 commit ")
    return {"path": root, "v1": (c, t), "sub": sub_commit}


def test_submodules_are_part_of_the_tree_and_each_is_checked(with_submodule, tmp_path):
    """Promise: a source whose commit pins submodules hashes to git's own tree only with the gitlinks its lock
    states (``submodules``: path -> commit); add-git, add-archive and the build refuse a lock that leaves one out
    or changes one, and a file where a submodule is stated; the image gets the tree's files and nothing at the
    submodule's path."""
    from trainer.image.cas import Cache
    from trainer.image.sources import add_archive, export_commit

    repo = with_submodule
    sub = repo["sub"]
    c, t = repo["v1"]
    full, git_tree, files, gitlinks = export_commit(repo["path"], c)
    assert (full, git_tree, gitlinks) == (c, t, {"deps/sub": sub})
    assert sorted(files) == ["Makefile", "deps/readme"]
    assert git_tree_id(files, gitlinks) == t
    assert git_tree_id(files) != t  # without the gitlink: another tree
    other = "f" * 40
    assert git_tree_id(files, {"deps/sub": other}) != t
    assert git_tree_id(files, {"deps/other": sub}) != t
    for bad in ({"Makefile": sub}, {"deps": sub}):  # a submodule where the tree has a file / a directory
        with pytest.raises(UserError):
            git_tree_id(files, bad)
    with pytest.raises(UserError):
        git_tree_id({**files, "deps/sub/inside.txt": ("100644", b"x")}, gitlinks)

    def lock_with(submodules, name):
        path = lock_file(tmp_path, repo)
        data = json.loads(path.read_text())
        if submodules is not None:
            data["sources"][0]["submodules"] = submodules
        out = tmp_path / name
        out.write_text(json.dumps(data))
        return out

    good = lock_with({"deps/sub": sub}, "good.json")
    cache = tmp_path / "cas"
    cache.mkdir()
    add = ["cache", "--cache", cache, "add-git", repo["path"], "--commit", c, "--lock"]
    line = refused([*add, lock_with(None, "none.json")], cache)
    assert f'the commit\'s submodules are {{"deps/sub": "{sub}"}}' in line and "states {}" in line
    line = refused([*add, lock_with({"deps/sub": other}, "changed.json")], cache)
    assert "submodules are" in line and other in line
    for bad in ({"/abs": sub}, {"../up": sub}, {"deps/sub": "xyz"}, ["deps/sub"]):
        line = refused(["lock", "verify", lock_with(bad, "bad.json")], cache)
        assert "sources[0].submodules: expected {relative path: the submodule's 40-hex commit}" in line, line
    r = trainer(*add, good, "--json")
    assert r.returncode == 0, r.stderr
    assert (json.loads(r.stdout)["tree"], json.loads(r.stdout)["files"]) == (t, 2)
    r = build(tmp_path, good, cache, "img")
    assert r.returncode == 0, r.stderr
    layers = {layer["name"]: layer["diff_id"] for layer in json.loads(r.stdout)["layers"]}
    with tarfile.open(tmp_path / "img" / "blobs" / "sha256" / layers["sources"][7:]) as tar:
        names = {m.name.rstrip("/") for m in tar.getmembers()}
    assert {"opt/src/demo/Makefile", "opt/src/demo/deps/readme"} <= names
    assert not any(n.startswith("opt/src/demo/deps/sub") for n in names), names
    # the same cache, a lock that changes the gitlink but keeps the tree: the build recomputes and refuses
    r = build(tmp_path, lock_with({"deps/sub": other}, "changed.json"), cache, "img2")
    assert r.returncode == 2 and f"lock says {t} (refused)" in r.stderr, r.stderr
    assert not (tmp_path / "img2").exists()
    # git's own archive of the commit has no submodule entries: matched with the pin's gitlinks, or refused
    archive = tmp_path / "super.tar"
    subprocess.run(["git", "-C", str(repo["path"]), "archive", "--prefix=super/", "-o", str(archive), c], check=True)
    pin = {"name": "demo", "url": "u", "commit": c, "tree": t, "where": "good.json"}
    assert add_archive(Cache(tmp_path / "c2"), archive, [{**pin, "submodules": {"deps/sub": sub}}])["tree"] == t
    with pytest.raises(UserError, match="which no lock given pins"):
        add_archive(Cache(tmp_path / "c3"), archive, [pin])
    with pytest.raises(UserError, match="which no lock given pins"):
        add_archive(Cache(tmp_path / "c4"), archive, [{**pin, "submodules": {"deps/sub": other}}])


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
