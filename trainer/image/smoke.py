"""The smoke image's git source, made here from nothing but fixed bytes: ``trainer image smoke-source DIR``.

``lockfiles/smoke.lock.json`` pins a git source (commit, tree, archive sha256) that this module makes
deterministically (fixed git identity and dates, the archive written by the layer writer), so that the smoke
image can be built on a machine that reaches no git host: write the archive, then seed the cache with it
(``trainer cache add PATH --sha256 HEX``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from trainer.image.cas import hash_file
from trainer.image.layer import FILE, Entry, write_layer


def git_env(epoch: int) -> dict[str, str]:
    """An environment that makes ``git commit`` deterministic (fixed identity and dates, no user config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    date = f"{epoch} +0000"
    env.update(
        GIT_AUTHOR_NAME="recipe-bundle",
        GIT_AUTHOR_EMAIL="tests@recipe-bundle.invalid",
        GIT_COMMITTER_NAME="recipe-bundle",
        GIT_COMMITTER_EMAIL="tests@recipe-bundle.invalid",
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        HOME=os.devnull,
    )
    return env


def make_git_source(directory: Path, name: str, files: dict[str, bytes], epoch: int) -> tuple[Path, str, str]:
    """Commit ``files`` in a fresh git repository under ``directory``/``name``.git and write the commit's
    archive (a tar with top-level directory ``{name}-{commit[:12]}``, made by the deterministic layer writer).

    Returns (archive path, commit id, tree id); the same arguments give the same three on any machine.
    """
    repo = Path(directory) / f"{name}.git-work"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    for rel, data in files.items():
        target = repo / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    env = git_env(epoch)

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("-c", "commit.gpgsign=false", "commit", "-q", "-m", f"{name} fixture")
    commit, tree = git("rev-parse", "HEAD"), git("rev-parse", "HEAD^{tree}")
    top = f"{name}-{commit[:12]}"
    entries = [Entry(f"{top}/{rel}", FILE, data=data) for rel, data in files.items()]
    archive = Path(directory) / f"{top}.tar"
    with open(archive, "wb") as handle:
        write_layer(entries, handle, epoch)
    return archive, commit, tree


# The files of the smoke source; their bytes are pinned by lockfiles/smoke.lock.json (the README's text names the
# module that first made them, and stays as it is).
SMOKE_SOURCE_FILES = {
    "README.md": b"smoke-src: the git source of lockfiles/smoke.lock.json (made by trainer.image.testing)\n",
    "smoke_src/__init__.py": b"GREETING = 'hello from a pinned git source'\n",
}
SMOKE_EPOCH = 1767225600


def smoke_source(directory: Path) -> dict[str, str]:
    """Write the smoke lock's git source archive into ``directory``; return {"archive" (its path), "commit",
    "tree", "sha256"} (hex ids)."""
    archive, commit, tree = make_git_source(Path(directory), "smoke-src", SMOKE_SOURCE_FILES, SMOKE_EPOCH)
    return {"archive": str(archive), "commit": commit, "tree": tree, "sha256": hash_file(archive)}
