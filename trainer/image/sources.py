"""Git sources: one commit's files, pinned by the lock's git tree id, from any archive or a local clone.

A lock's ``sources[]`` item names a repository ``url``, a full ``commit`` and its git ``tree`` (what ``git
rev-parse COMMIT^{tree}`` prints), where it goes in the image (``dest``) and, optionally, an ``archive``
(``filename``, ``sha256``, ``url``) whose own bytes are pinned too. Archive bytes are not what is trusted:
GitHub's tarballs changed checksum when its git was upgraded (2023), so, as Nix does with the hash of an
unpacked tree, the builder recomputes the git tree id of what it unpacked (:mod:`trainer.image.gittree`)
and refuses any difference. Any format that unpacks to that tree serves: ``git archive`` tar (with or
without compression), GitHub's tar.gz and zip, a zip from any tool.

Ways into the cache (:mod:`trainer.image.cas`):

- ``trainer cache add-git GITDIR --commit C`` reads the commit's tree straight from a local clone or bare
  repository (``git ls-tree`` + ``git cat-file --batch``, so ``.gitattributes`` export rules cannot leave a
  file out), recomputes its tree id, checks it against the lock and stores it as a canonical tar
  (:func:`canonical_entries`: sorted, fixed times, one top-level directory) indexed by tree id;
- ``trainer cache fetch`` downloads the archive from the source's URL where the network allows and stores it
  the same way after the same check;
- ``trainer cache add FILE --sha256 HEX`` for a source whose lock pins ``archive.sha256``.

Submodules: a tree whose commit pins submodules (enroot pins makeself, musl and Linux headers) holds a gitlink
for each, the submodule's commit, and no files there. An archive of such a tree has none of them either, so
the lock states them (``submodules``: path -> commit) and the tree id is recomputed with those entries: a
changed or missing one gives another tree and is refused. The submodules' files are not part of the source;
a build step takes what they provide elsewhere (a Debian package of the build root, another source).

What the layer gets: every file and symlink of the tree under ``dest`` (empty directories are not part of a
tree), and, for a source with ``python_path: true``, its ``dest`` in ``<site_packages>/recipe-bundle-sources.pth``
so the image's Python imports it (the way ``pip install -e`` makes a checkout importable).
"""

from __future__ import annotations

import json
import stat
import subprocess
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from trainer.errors import UserError
from trainer.image import tarread
from trainer.image.gittree import EXEC_MODE, FILE_MODE, LINK_MODE, check_links_stay_inside, git_tree_id
from trainer.image.layer import DIR, FILE, SYMLINK, Entry
from trainer.image.tarread import entries_from_tar
from trainer.lock.imagelock import KIND, load_lock

PTH_NAME = "recipe-bundle-sources.pth"
MAX_SOURCE_BYTES = 2 << 30  # a source tree larger than this (uncompressed) is refused: 2 GiB


def source_label(source: dict[str, Any]) -> str:
    """``source NAME@COMMIT12`` for messages."""
    return f"source {source['name']}@{source['commit'][:12]}"


def _zip_entries(stream: BinaryIO) -> list[Entry]:
    """Entries of a zip archive: files (executable from the Unix mode in ``external_attr``), symlinks (Unix
    mode S_IFLNK, target = the member's content) and directories. Raises :class:`UserError` for ``..`` paths,
    special files, or an archive larger than :data:`MAX_SOURCE_BYTES`."""
    out: list[Entry] = []
    try:
        archive = zipfile.ZipFile(stream)
    except zipfile.BadZipFile as ex:
        raise UserError(f"not a readable zip archive ({ex})") from None
    with archive:
        if sum(info.file_size for info in archive.infolist()) > MAX_SOURCE_BYTES:
            raise UserError(f"zip archive unpacks to more than {MAX_SOURCE_BYTES:,} bytes (refused)")
        for info in archive.infolist():
            name = info.filename
            if not info.flag_bits & 0x800:  # no UTF-8 flag: zipfile decoded the raw bytes as cp437; git wrote bytes
                name = name.encode("cp437").decode("utf-8", "surrogateescape")
            parts = [p for p in name.split("/") if p not in ("", ".")]
            if ".." in parts or name.startswith("/"):
                raise UserError(f"archive member {name!r}: path outside the archive's root")
            if not parts:
                continue
            mode = info.external_attr >> 16
            path = "/".join(parts)
            if info.is_dir() or stat.S_ISDIR(mode):
                out.append(Entry(path, DIR))
            elif stat.S_ISLNK(mode):
                out.append(Entry(path, SYMLINK, target=archive.read(info).decode("utf-8", "surrogateescape")))
            elif mode == 0 or stat.S_ISREG(mode):
                out.append(Entry(path, FILE, data=archive.read(info), executable=bool(mode & 0o111)))
            else:
                raise UserError(f"archive member {info.filename!r}: device, FIFO or other special file refused")
    return out


def archive_entries(path: Path, label: str) -> list[Entry]:
    """The raw entries of an archive file (zip, or tar with any compression :mod:`tarfile` reads).
    Raises :class:`UserError` naming ``label`` for an unreadable archive or a refused member."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            handle.seek(0)
            if magic.startswith(b"PK"):
                return _zip_entries(handle)
            with tarfile.open(fileobj=handle, mode="r:*") as tar:  # headers only: refuse a bomb before reading
                total = 0
                for member in tar:
                    total += member.size
                    if total > MAX_SOURCE_BYTES:
                        raise UserError(f"archive unpacks to more than {MAX_SOURCE_BYTES:,} bytes (refused)")
            handle.seek(0)
            return entries_from_tar(handle, "", strip_components=0)
    except UserError as err:
        raise UserError(f"{label}: {err}") from None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as ex:
        raise UserError(f"{label}: not a readable tar or zip archive ({ex})") from None


def tree_files(raw: list[Entry], label: str) -> dict[str, tuple[str, bytes]]:
    """The files of an archive with one top-level directory (stripped), as git tree input: relative path ->
    (mode, content or symlink target bytes). Symlinks are checked to stay inside the tree, chains included.
    Raises :class:`UserError` naming ``label``."""
    tops = {e.path.split("/")[0] for e in raw}
    if len(tops) != 1 or any(e.path == next(iter(tops)) and e.type != DIR for e in raw):
        raise UserError(f"{label}: expected one top-level directory in the archive, found {len(tops)} entries")
    top = next(iter(tops))
    files: dict[str, tuple[str, bytes]] = {}
    for entry in raw:
        rel = entry.path[len(top) + 1 :]
        if not rel:
            continue
        if entry.type == FILE:
            if entry.data is None:  # an archive's members are read into memory (entries_from_tar, from zip)
                raise ValueError(f"{label}: {entry.path} was not read into memory")
            files[rel] = (EXEC_MODE if entry.executable else FILE_MODE, entry.data)
        elif entry.type == SYMLINK:
            files[rel] = (LINK_MODE, entry.target.encode("utf-8", "surrogateescape"))
    _check_tree(files, label)
    return files


def _check_tree(files: dict[str, tuple[str, bytes]], label: str) -> None:
    if not files:
        raise UserError(f"{label}: the archive holds no files")
    links = {path: data.decode("utf-8", "surrogateescape") for path, (mode, data) in files.items() if mode == LINK_MODE}
    check_links_stay_inside(links, label)
    for path in files:  # nothing may live under a symlink: unpacking would write through it
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        while parent:
            if parent in links:
                raise UserError(f"{label}: {path} lies under the symlink {parent} (refused)")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else ""


def verified_files(archive: Path, source: dict[str, Any]) -> dict[str, tuple[str, bytes]]:
    """The files of ``archive`` after checking that they hash to ``source['tree']``.
    Raises :class:`UserError` on a mismatch, naming both tree ids."""
    label = source_label(source)
    files = tree_files(archive_entries(archive, label), label)
    _check_paths(files, label)
    tree = labelled_tree_id(files, label, source.get("submodules"))
    if tree != source["tree"]:
        raise UserError(f"{label}: archive files hash to git tree {tree}, lock says {source['tree']} (refused)")
    return files


def labelled_tree_id(files: dict[str, tuple[str, bytes]], label: str, gitlinks: dict[str, str] | None = None) -> str:
    """:func:`git_tree_id` (``gitlinks``: a source's ``submodules``) with ``label`` in front of its error (a path
    both a file and a directory, or a file where the lock states a submodule)."""
    try:
        return git_tree_id(files, gitlinks)
    except UserError as err:
        raise UserError(f"{label}: {err}") from None


def source_entries(archive: Path, source: dict[str, Any]) -> list[Entry]:
    """Layer entries of the git ``source`` (a lock ``sources[]`` item) from its ``archive``, under its ``dest``.

    Raises :class:`UserError` when the archive's files do not hash to the locked tree, when it does not have
    a single top-level directory, or for refused members (``..``, special files, symlinks leaving the tree).
    """
    dest = source["dest"].strip("/")
    out = []
    for rel, (mode, data) in verified_files(archive, source).items():
        if mode == LINK_MODE:
            out.append(Entry(f"{dest}/{rel}", SYMLINK, target=data.decode("utf-8", "surrogateescape")))
        else:
            out.append(Entry(f"{dest}/{rel}", FILE, data=data, executable=mode == EXEC_MODE))
    return out


def cached_archive(cache: Any, source: dict[str, Any]) -> Path:
    """The cached archive of ``source`` (re-hashed by the cache; its tree is checked when it is unpacked):
    by ``archive.sha256`` when the lock pins one and the cache has it, else the blob the cache's tree index
    names (seeded by ``add-git`` or ``fetch``).

    Raises :class:`UserError` with one line naming the source, its commit and tree and the commands that seed
    it, when the cache does not hold it.
    """
    label = source_label(source)
    archive = source.get("archive")
    path = cache.get(archive["sha256"], f"{label} ({archive['filename']})") if archive else None
    if path is None:
        record = cache.tree_record(source["tree"])
        path = cache.get(record["sha256"], f"{label} (git tree {source['tree']})") if record else None
    if path is None:
        also = (
            f", or add its archive with `trainer cache add {archive['filename']} --sha256 {archive['sha256']}`"
            if archive
            else ""
        )
        raise UserError(
            f"missing input {label} (git tree {source['tree']}); seed it from a clone with `trainer cache add-git "
            f"CLONE --commit {source['commit']}`{also}, or, with network to {source['url']}, "
            "`trainer cache fetch --lock LOCK`"
        )
    return path


def pth_entry(sources: list[dict[str, Any]], site_packages: str) -> Entry | None:
    """The ``.pth`` file that puts every ``python_path`` source's ``dest`` on the image Python's path
    (site.py reads one directory per line), or None when no source asks for it."""
    lines = [s["dest"] for s in sorted(sources, key=lambda s: s["name"]) if s.get("python_path")]
    if not lines:
        return None
    for line in lines:  # site.py executes a .pth line that starts with "import": only plain paths here
        if not line.startswith("/") or any(c.isspace() or ord(c) < 32 for c in line):
            raise UserError(
                f"sources dest {line!r}: expected an absolute path without whitespace or control characters"
            )
    return Entry(f"{site_packages.rstrip('/')}/{PTH_NAME}", FILE, data="".join(f"{line}\n" for line in lines).encode())


def canonical_entries(files: dict[str, tuple[str, bytes]], tree: str) -> list[Entry]:
    """The cache's own archive of a tree: every file under one top-level directory ``tree-<12 hex>``, for
    :func:`trainer.image.layer.write_layer` (sorted, fixed time: the same tree always gives the same bytes)."""
    top = f"tree-{tree[:12]}"
    out = [Entry(top, DIR)]
    for rel, (mode, data) in files.items():
        if mode == LINK_MODE:
            out.append(Entry(f"{top}/{rel}", SYMLINK, target=data.decode("utf-8", "surrogateescape")))
        else:
            out.append(Entry(f"{top}/{rel}", FILE, data=data, executable=mode == EXEC_MODE))
    return out


def _git(gitdir: Path, *args: str, stdin: bytes | None = None) -> bytes:
    try:
        out = subprocess.run(["git", "--git-dir", str(gitdir), *args], input=stdin, capture_output=True, timeout=600)
    except FileNotFoundError:
        raise UserError("git is not installed (apt-get install git)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{gitdir}: git {args[0]} took more than 600 s") from None
    if out.returncode != 0:
        message = out.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(f"{gitdir}: git {' '.join(args[:2])}: {message[-1] if message else 'failed'}")
    return out.stdout


def git_dir_of(path: Path) -> Path:
    """The git directory of ``path``: a bare repository itself, or a work tree's ``.git``.
    Raises :class:`UserError` when ``path`` is neither."""
    if not path.is_dir():
        raise UserError(f"{path}: not a directory (expected a git clone or bare repository)")
    for candidate in (path / ".git", path):
        if (candidate / "objects").is_dir() and (candidate / "HEAD").is_file():
            return candidate
        if candidate.name == ".git" and candidate.is_file():  # a worktree or submodule: .git names the gitdir
            try:
                text = candidate.read_text().strip()
            except (OSError, UnicodeDecodeError):
                raise UserError(f"{candidate}: not a readable 'gitdir: PATH' file") from None
            if text.startswith("gitdir:"):
                gitdir = (path / text[len("gitdir:") :].strip()).resolve()
                if not (gitdir / "HEAD").is_file():
                    raise UserError(f"{candidate}: names {gitdir}, which is not a git directory")
                return gitdir
    raise UserError(f"{path}: not a git repository (no objects/ and HEAD in it or in its .git)")


def export_commit(path: Path, commit: str) -> tuple[str, str, dict[str, tuple[str, bytes]], dict[str, str]]:
    """Read ``commit``'s tree from the git repository at ``path`` without a checkout.

    Returns (full commit id, tree id as git states it, files as for :func:`git_tree_id`, gitlinks: submodule
    path -> commit, the entries of the tree's submodules, whose files are not read). Raises
    :class:`UserError` for a commit the repository does not have, a tree over :data:`MAX_SOURCE_BYTES`, or a file
    over the build's per-file limit (:data:`trainer.image.tarread.MAX_MEMBER_BYTES`, 1 GiB, the limit a build reads the
    cached archive with), both checked from the sizes ``git ls-tree -l`` lists before any blob is read. Blobs are
    read one at a time from one ``git cat-file --batch`` (:func:`_read_blobs`), so memory holds the tree's
    files once, never git's whole output besides them.
    """
    gitdir = git_dir_of(path)
    try:
        full = _git(gitdir, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    except UserError:
        raise UserError(f"{path}: commit {commit} is not in this repository (fetch it first)") from None
    tree = _git(gitdir, "rev-parse", f"{full}^{{tree}}").decode().strip()
    listing = _git(gitdir, "ls-tree", "-r", "-z", "--full-tree", "-l", full)
    items = []
    gitlinks: dict[str, str] = {}
    total = 0
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, name = record.partition(b"\t")
        mode, kind, oid, size = meta.split()
        rel = name.decode("utf-8", "surrogateescape")
        if kind == b"commit" and mode == b"160000":  # a submodule: its commit is the entry; its files are not here
            gitlinks[rel] = oid.decode()
            continue
        if kind != b"blob":
            raise UserError(f"{path}: {commit[:12]} has a {kind.decode()} at {rel} (expected files and submodules)")
        if int(size) > tarread.MAX_MEMBER_BYTES:  # read at call time: the build's limit, whatever it is now
            raise UserError(
                f"{path}: {commit[:12]}'s file {rel} is {int(size):,} bytes, more than the build's "
                f"{tarread.MAX_MEMBER_BYTES:,} per file (refused before reading it)"
            )
        total += int(size)
        if total > MAX_SOURCE_BYTES:
            raise UserError(f"{path}: {commit[:12]}'s tree is larger than {MAX_SOURCE_BYTES:,} bytes (refused)")
        items.append((rel, mode.decode(), oid, int(size)))
    files = _read_blobs(gitdir, path, items, tarread.MAX_MEMBER_BYTES)
    if not files:
        raise UserError(f"{path}: commit {full[:12]} has no files (an empty tree is not a source)")
    return full, tree, files, gitlinks


def _read_blobs(
    gitdir: Path, path: Path, items: list[tuple[str, str, bytes, int]], limit: int
) -> dict[str, tuple[str, bytes]]:
    """The blobs ``items`` ((path, mode, object id, size listed)) read from one ``git cat-file --batch`` process,
    one object at a time: its id written, its header read and checked (the id asked, a size equal to the one
    listed and at most ``limit`` bytes), then exactly that many bytes. Returns path -> (mode, content) as git
    stores it (a legacy 100664 stays 100664, so the tree id is git's). Raises :class:`UserError` naming ``path``
    for git missing, a failed or short answer, or a size over ``limit``; the process is ended on any error: killed
    (SIGKILL) before it is waited for, so that a git still writing an object of 1 GiB costs no wait; after all
    objects were read, its stdin closed and waited for at most 60 s, then killed."""
    try:
        proc = subprocess.Popen(
            ["git", "--git-dir", str(gitdir), "cat-file", "--batch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise UserError("git is not installed (apt-get install git)") from None
    assert proc.stdin is not None and proc.stdout is not None  # both are pipes (PIPE above)
    files: dict[str, tuple[str, bytes]] = {}
    done = False
    try:
        for rel, mode, oid, listed in items:
            proc.stdin.write(oid + b"\n")
            proc.stdin.flush()  # without --buffer, git answers each object as it is asked
            header = proc.stdout.readline(200).split()
            if len(header) != 3 or header[0] != oid or not header[2].isdigit():
                raise UserError(f"{path}: git cat-file returned {header!r} for {rel}")
            size = int(header[2])
            if size != listed or size > limit:
                raise UserError(
                    f"{path}: git cat-file says {rel} is {size:,} bytes (listed {listed:,}, at most {limit:,}; refused)"
                )
            data = proc.stdout.read(size)
            if len(data) != size or proc.stdout.read(1) != b"\n":  # each object ends with a newline
                raise UserError(f"{path}: git cat-file cut {rel} short")
            files[rel] = (mode, data)
        done = True
    except (BrokenPipeError, OSError) as ex:
        raise UserError(f"{path}: git cat-file failed ({ex})") from None
    finally:
        if not done:  # an error (or a signal): git is ended now, not waited for
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
    return files


def _check_paths(files: dict[str, tuple[str, bytes]], label: str) -> None:
    for rel in files:
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..", ".git") or "\0" in p for p in parts):
            raise UserError(f"{label}: path {rel!r} leaves the tree or is not a plain relative path (refused)")


def pins_for(locks: list[Path]) -> list[dict[str, Any]]:
    """Every git source pinned by the image locks and stack files in ``locks``: [{"name", "url", "commit",
    "tree", "where"}]. Image locks give ``sources[]``; a ``stack.json`` gives its components with a commit and
    tree. Raises :class:`UserError` for an unreadable file."""
    out: list[dict[str, Any]] = []
    for path in locks:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as ex:
            raise UserError(f"{path}: cannot read the pins ({ex})") from None
        if isinstance(data, dict) and data.get("kind") == KIND:
            for src in load_lock(path).get("sources", []):
                out.append(
                    {
                        **{k: src[k] for k in ("name", "url", "commit", "tree")},
                        "submodules": src.get("submodules", {}),
                        "where": path.name,
                    }
                )
            continue
        components = data.get("components", {}) if isinstance(data, dict) else {}
        for name, comp in components.items() if isinstance(components, dict) else []:
            if isinstance(comp, dict) and comp.get("commit") and comp.get("tree"):
                out.append(
                    {
                        "name": name,
                        "url": comp.get("source", ""),
                        "commit": comp["commit"],
                        "tree": comp["tree"],
                        "where": path.name,
                    }
                )
    return out


def add_git(cache: Any, repo: Path, commit: str, pins: list[dict[str, Any]], tree: str | None = None) -> dict[str, Any]:
    """Seed the cache with ``commit``'s tree from the local git repository ``repo`` (clone or bare).

    The commit must be one that ``pins`` (see :func:`pins_for`) name, or ``tree`` must be given; its files
    are read from git's objects, their tree id recomputed here (:func:`git_tree_id`, with the commit's
    submodule entries, which must be the ones the pin states) and compared with both git's own and the pinned
    tree. Returns {"name", "commit", "tree", "sha256", "files", "bytes"}. Raises
    :class:`UserError` (nothing stored) for an unknown commit, a mismatch, a path outside the tree or a
    symlink leaving it.
    """
    full, git_tree, files, gitlinks = export_commit(repo, commit)
    pinned = [p for p in pins if p["commit"] == full]
    if tree is not None:
        pinned = [{"name": "(--tree)", "url": str(repo), "commit": full, "tree": tree, "where": "--tree"}]
    if not pinned:
        raise UserError(f"{repo}: commit {full} is not pinned by any lock given (pass --lock LOCK or --tree TREE)")
    pin = pinned[0]
    label = f"source {pin['name']}@{full[:12]}"
    _check_paths(files, label)
    _check_tree(files, label)
    computed = labelled_tree_id(files, label, gitlinks)
    if computed != git_tree:
        raise UserError(
            f"{label}: files of {repo} hash to git tree {computed}, but git says {git_tree} "
            "(a corrupt repository; run `git fsck`)"
        )
    if computed != pin["tree"]:
        raise UserError(
            f"{label}: {repo} has tree {computed} for this commit, {pin['where']} pins {pin['tree']} (refused)"
        )
    if gitlinks != pin.get("submodules", {}) and pin["where"] != "--tree":
        raise UserError(
            f"{label}: the commit's submodules are {json.dumps(gitlinks, sort_keys=True)}, {pin['where']} states "
            f"{json.dumps(pin.get('submodules', {}), sort_keys=True)} (refused)"
        )
    sha = cache.put_tree(computed, canonical_entries(files, computed), {"commit": full, "source": pin["url"]})
    return {
        "name": pin["name"],
        "commit": full,
        "tree": computed,
        "sha256": sha,
        "files": len(files),
        "bytes": sum(len(data) for _, data in files.values()),
    }


def add_archive(cache: Any, archive: Path, pins: list[dict[str, Any]], tree: str | None = None) -> dict[str, Any]:
    """Seed the cache with a source tree from ``archive`` (a tar of any compression :mod:`tarfile` reads, or a
    zip, holding one top-level directory: ``git archive --prefix=NAME/ COMMIT``, GitHub's tarball of a commit).

    The archive's files are hashed as git hashes a tree (:func:`git_tree_id`) and the result must be a tree that
    ``pins`` (:func:`pins_for`) name, or ``tree`` when given: the tree id is what a lock pins, so any archive of
    that tree serves. Returns {"name", "commit", "tree", "sha256", "files", "bytes"}. Raises :class:`UserError`
    (nothing stored) for an unreadable archive, refused members, or a tree no pin names."""
    label = f"archive {archive}"
    files = tree_files(archive_entries(Path(archive), label), label)
    _check_paths(files, label)
    computed = labelled_tree_id(files, label)
    if tree is not None:
        pinned = [{"name": "(--tree)", "url": str(archive), "commit": None, "tree": tree, "where": "--tree"}]
    else:
        # an archive has no submodule entries: a pin that states some is matched with them added
        pinned = [p for p in pins if p["tree"] == labelled_tree_id(files, label, p.get("submodules"))]
        if pinned:
            computed = str(pinned[0]["tree"])
    if not pinned:
        raise UserError(
            f"{label}: its files hash to git tree {computed}, which no lock given pins "
            "(pass --lock LOCK, or --tree TREE for a tree no lock names)"
        )
    pin = pinned[0]
    if pin["tree"] != computed:
        raise UserError(f"{label}: its files hash to git tree {computed}, --tree says {pin['tree']} (refused)")
    sha = cache.put_tree(computed, canonical_entries(files, computed), {"commit": pin["commit"], "source": pin["url"]})
    return {
        "name": pin["name"],
        "commit": pin["commit"],
        "tree": computed,
        "sha256": sha,
        "files": len(files),
        "bytes": sum(len(data) for _, data in files.values()),
    }


GITHUB = "https://github.com/"
FETCH_HOSTS = ("https://github.com/", "https://codeload.github.com/")


def archive_url(source: dict[str, Any]) -> str | None:
    """Where ``source``'s archive can be downloaded: ``archive.url`` when the lock gives one, else GitHub's
    tarball of the commit for a ``https://github.com/OWNER/REPO`` url, else None."""
    archive = source.get("archive") or {}
    if archive.get("url"):
        return archive["url"]
    url = source["url"].rstrip("/")
    if url.endswith(".git"):
        url = url[:-4]
    if url.startswith(GITHUB) and url[len(GITHUB) :].count("/") == 1:
        return f"https://codeload.github.com/{url[len(GITHUB) :]}/tar.gz/{source['commit']}"
    return None


def fetch_source(cache: Any, source: dict[str, Any], hosts: tuple[str, ...] = FETCH_HOSTS, timeout: float = 60) -> str:
    """Download ``source``'s archive (:func:`archive_url`, from URLs starting with one of ``hosts``, after
    redirects too; at most :data:`MAX_SOURCE_BYTES`; ``timeout`` in seconds per network operation), check it
    (its sha256 when the lock pins the file at ``archive.url``, always its git tree) and store the tree in
    the cache; returns the
    stored blob's sha256. Raises :class:`UserError` for no URL, a refused host, a failed or oversized download
    or a mismatch (nothing stored)."""
    import hashlib
    import urllib.error
    import urllib.request

    label = source_label(source)
    url = archive_url(source)
    if url is None:
        raise UserError(
            f"{label}: no download URL known for {source['url']}; seed it with `trainer cache add-git "
            f"CLONE --commit {source['commit']}`"
        )
    if not url.startswith(hosts):
        raise UserError(f"{label}: will not download {url} (hosts allowed: {', '.join(hosts)})")
    tmp = cache.new_temp()
    try:
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
                if not response.geturl().startswith(hosts):
                    raise UserError(f"{label}: {url} redirected to {response.geturl()}, not an allowed host (refused)")
                size = 0
                while chunk := response.read(1 << 20):
                    size += len(chunk)
                    if size > MAX_SOURCE_BYTES:
                        raise UserError(f"{label}: {url} is larger than {MAX_SOURCE_BYTES:,} bytes (refused)")
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError, TimeoutError) as ex:
            raise UserError(f"{label}: download of {url} failed ({getattr(ex, 'reason', ex)})") from None
        # the archive's sha256 pins the file archive.url names; GitHub's own archive of the commit is another file
        archive = source.get("archive") or {}
        pinned = archive.get("sha256") if archive.get("url") == url else None
        if pinned and digest.hexdigest() != pinned:
            raise UserError(f"{label}: {url} has sha256 {digest.hexdigest()}, the lock pins {pinned} (refused)")
        try:
            files = verified_files(tmp, source)
        except UserError as err:
            raise UserError(
                f"{err}; an archive made by `git archive` leaves out files that .gitattributes marks "
                f"export-ignore: seed it with `trainer cache add-git CLONE --commit {source['commit']}`"
            ) from None
        if pinned:
            cache.add_file(tmp, pinned, label)
        return cache.put_tree(
            source["tree"], canonical_entries(files, source["tree"]), {"commit": source["commit"], "source": url}
        )
    finally:
        tmp.unlink(missing_ok=True)
