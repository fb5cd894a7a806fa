"""A content-addressed cache of Hydra compositions, so that composing a run again costs a file read.

A composition of ``conf/train.yaml`` is a pure function of its inputs: the files of the config tree, the
structured schema registered beside it (:mod:`trainer.compose.schema`), the overrides, the Hydra and
OmegaConf versions, the Python environment they are imported from (``sys.path``), the working directory
(Hydra records it as ``hydra.runtime.cwd``) and whether Hydra's own ``hydra`` node is kept. :func:`key_of`
hashes all of them (sha256); an entry is the pickled, unresolved ``DictConfig`` Hydra returned, written
atomically under that key with the sha256 of its payload in front, and verified on every read: an entry
that does not match its hash, or that does not unpickle, is a miss and is written again. Only compositions
that succeeded are stored; a bad override always meets Hydra itself, so its error line is Hydra's.

Interpolations stay unresolved in an entry (``${now:...}``, ``${oc.env:...}``, ``${layout.name}``), and what a
caching resolver remembered when Hydra composed it (the time of ``${now:...}``) is dropped on reading: they
are resolved when the run reads them, as for a fresh composition.

Location: ``$TRAINER_COMPOSE_CACHE`` if set (``off`` disables the cache), else
``$XDG_CACHE_HOME/recipe-bundle/compose`` (``~/.cache`` without XDG_CACHE_HOME). At most
:data:`MAX_ENTRIES` entries are kept; the least recently written go first.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

# Changing how entries are keyed or laid out changes this, so that old entries are never read as new ones.
FORMAT = b"recipe-bundle compose cache 1\n"
MAX_ENTRIES = 512
SUFFIX = ".composition"


def default_root() -> Optional[Path]:
    """The cache directory (see the module docstring), or None when ``TRAINER_COMPOSE_CACHE=off``."""
    chosen = os.environ.get("TRAINER_COMPOSE_CACHE")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recipe-bundle" / "compose"


def tree_digest(conf_dir: Path, schema_file: Path) -> bytes:
    """sha256 over every file of ``conf_dir`` (relative path and bytes, in sorted order) and the schema
    module's source ``schema_file``: what a composition reads from disk."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(conf_dir).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [*files, Path(schema_file)]:
        data = path.read_bytes()
        name = str(path.relative_to(conf_dir)) if path in files else f"<schema>/{path.name}"
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.digest()


class CompositionCache:
    """Compositions of one config tree (``conf_dir``, ``config_name``) stored under ``root``.

    ``get`` and ``put`` take the overrides exactly as given to Hydra's ``compose`` and the ``hydra_node`` flag
    (``return_hydra_config``); neither raises on a damaged or unwritable cache: it is then a miss, or not
    stored.
    """

    def __init__(self, root: Path, conf_dir: Path, config_name: str, schema_file: Path) -> None:
        import hydra
        import omegaconf

        self.root = Path(root)
        head = hashlib.sha256(FORMAT)
        for part in (hydra.__version__, omegaconf.__version__, sys.version, sys.executable, *sys.path,
                     os.path.abspath(conf_dir), config_name, os.getcwd()):
            head.update(part.encode() + b"\0")
        head.update(tree_digest(conf_dir, schema_file))
        self._head = head

    def key_of(self, overrides: Sequence[str], hydra_node: bool) -> str:
        """The entry's name: sha256 (hex) of the tree's inputs, ``overrides`` (in order) and ``hydra_node``."""
        digest = self._head.copy()
        for override in overrides:
            digest.update(override.encode() + b"\0")
        digest.update(b"hydra-node\0" if hydra_node else b"job\0")
        return digest.hexdigest()

    def get(self, overrides: Sequence[str], hydra_node: bool) -> Optional[DictConfig]:
        """The stored composition, verified against its hash; None on a miss (absent, damaged, unreadable)."""
        path = self.root / (self.key_of(overrides, hydra_node) + SUFFIX)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        expected, _, payload = blob.partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != expected:
            return None
        try:
            cfg = pickle.loads(payload)  # noqa: S301 - our own entry, verified against its hash above
        except Exception:  # noqa: BLE001 - an entry written by other library versions is a miss
            return None
        if not isinstance(cfg, DictConfig):
            return None
        OmegaConf.clear_cache(cfg)  # values resolvers cached when Hydra composed it (``${now:...}``) are not kept
        return cfg

    def put(self, overrides: Sequence[str], hydra_node: bool, cfg: DictConfig) -> None:
        """Store ``cfg`` (atomically: a reader sees the whole entry or none); a cache that cannot be written is
        left as it is."""
        from trainer.publish import atomic_file

        payload = pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
        path = self.root / (self.key_of(overrides, hydra_node) + SUFFIX)
        try:
            with atomic_file(path, 0o644) as handle:
                handle.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            self._prune()
        except OSError:
            return

    def _prune(self) -> None:
        entries = sorted(self.root.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        for stale in entries[:-MAX_ENTRIES]:
            stale.unlink(missing_ok=True)
