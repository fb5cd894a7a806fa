"""A content-addressed cache of Hydra compositions, so that composing a run again costs a file read.

An entry is keyed (sha256) by every input the composition read that the bundle can name: the files of the
config tree (symbolic links followed, as Hydra follows them), the structured schema registered beside it
(:mod:`trainer.compose.schema`), the overrides, the Hydra and OmegaConf versions, the Python environment they are
imported from (``sys.executable``, ``sys.path``), the working directory (Hydra records it as
``hydra.runtime.cwd``) and whether Hydra's own ``hydra`` node is kept. A composition that read anything else is
not stored (:func:`cacheable`): config sources beyond the tree and Hydra's own package (``hydra.searchpath``),
environment variables copied into the job (``hydra.job.env_copy``), secrets (an override of a secret-named key,
a value :class:`trainer.redact.Redactor` learns or its patterns find); nor one whose tree changed while Hydra
composed it.
Only compositions that succeeded are stored; a bad override always meets Hydra itself, so its error line is
Hydra's.

An entry is the pickled, unresolved ``DictConfig`` Hydra returned, with the sha256 of its key and payload in
front, written atomically (mode 0600, in a directory of this user's that only they may write: one that others
may write is not used, and this user's own is made 0700). Reading verifies the hash against the entry's own
name, and reads only entries the current user owns that no one else may write: anything else (absent, damaged,
renamed, foreign, not unpickling) is a miss and is composed and written again; entries an older format or mode
left are removed when the cache next writes. Interpolations stay unresolved (``${now:...}``, ``${oc.env:...}``,
``${layout.name}``), and what a caching resolver remembered while Hydra composed (the time of ``${now:...}``) is
left out of the entry: both are resolved when the run reads them, as for a fresh composition.

Location: ``$TRAINER_COMPOSE_CACHE`` if set (``~`` expanded, a relative path taken from the working directory;
``off``, ``0``, ``no`` or ``false``, in any case, turn the cache off), else
``$XDG_CACHE_HOME/recipe-bundle/compose`` (``~/.cache`` without XDG_CACHE_HOME). At most :data:`MAX_ENTRIES`
entries are kept; the least recently written go first.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

# Changing how entries are keyed or laid out changes this, so that old entries are never read as new ones.
FORMAT = b"recipe-bundle compose cache 3\n"
MAX_ENTRIES = 512
SUFFIX = ".composition"
OFF = ("off", "0", "no", "false")  # values of TRAINER_COMPOSE_CACHE that turn the cache off (any case)


def default_root() -> Optional[Path]:
    """The cache directory (see the module docstring), or None when ``TRAINER_COMPOSE_CACHE=off``."""
    chosen = os.environ.get("TRAINER_COMPOSE_CACHE", "")
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recipe-bundle" / "compose"


def tree_digest(conf_dir: Path, schema_file: Path) -> bytes:
    """sha256 over every file of ``conf_dir`` (relative path and bytes, in sorted order; directories reached
    through symbolic links included) and the schema module's source ``schema_file``: what a composition reads
    from disk. Raises ``OSError`` for a file that cannot be read."""
    digest = hashlib.sha256()
    files = []
    for top, dirs, names in os.walk(conf_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(top, name) for name in names]
    for path in sorted(files):
        data = Path(path).read_bytes()
        digest.update(f"{os.path.relpath(path, conf_dir)}\0{len(data)}\0".encode())
        digest.update(data)
    data = Path(schema_file).read_bytes()
    digest.update(f"<schema>\0{len(data)}\0".encode() + data)
    return digest.digest()


def cacheable(composed: DictConfig, conf_dir: Path, overrides: Sequence[str]) -> bool:
    """Whether a composition made with its ``hydra`` node read nothing the key leaves out: its config sources
    are the tree ``conf_dir``, Hydra's own package and the structured configs; it copies no environment variable
    into the job (``hydra.job.env_copy``); no override sets a secret-named key (``+env.HF_TOKEN=...``, whatever
    the value's length) and neither the overrides nor the composition carry a secret value."""
    from trainer.redact import Redactor, sets_secret

    hydra_node = composed.hydra
    if list(hydra_node.job.env_copy):
        return False
    for source in hydra_node.runtime.config_sources:
        kind = (source.schema, source.provider)
        if kind == ("file", "main") and os.path.abspath(source.path) == os.path.abspath(conf_dir):
            continue
        if kind in (("pkg", "hydra"), ("structured", "schema")):
            continue
        return False
    if any(sets_secret(o) for o in overrides):
        return False
    redactor = Redactor().learn_overrides(overrides)
    text = OmegaConf.to_yaml(composed)
    return not redactor.known and redactor.scrub(text) == text


def entry_hash(key: str, payload: bytes) -> bytes:
    """The header of an entry: sha256 (hex, ASCII) of :data:`FORMAT`, its key and its payload, so that an entry
    renamed to another key, or written by another format, does not verify."""
    return hashlib.sha256(FORMAT + key.encode() + b"\n" + payload).hexdigest().encode()


class CompositionCache:
    """Compositions of one config tree (``conf_dir``, ``config_name``) stored under ``root``.

    ``get`` and ``put`` take the overrides exactly as given to Hydra's ``compose`` and the ``hydra_node`` flag
    (``return_hydra_config``); neither raises on a damaged, foreign or unwritable cache: it is then a miss, or
    not stored. Raises ``OSError`` when the tree cannot be read (:func:`tree_digest`).
    """

    def __init__(self, root: Path, conf_dir: Path, config_name: str, schema_file: Path) -> None:
        import hydra
        import omegaconf

        self.root = Path(root)
        self.conf_dir, self.schema_file = Path(conf_dir), Path(schema_file)
        self.tree = tree_digest(conf_dir, schema_file)
        head = hashlib.sha256(FORMAT)
        for part in (hydra.__version__, omegaconf.__version__, sys.version, sys.executable, *sys.path,
                     os.path.abspath(conf_dir), config_name, os.getcwd()):
            head.update(part.encode() + b"\0")
        head.update(self.tree)
        self._head = head

    def key_of(self, overrides: Sequence[str], hydra_node: bool) -> str:
        """The entry's name: sha256 (hex) of the tree's inputs, ``overrides`` (in order) and ``hydra_node``."""
        digest = self._head.copy()
        for override in overrides:
            digest.update(override.encode() + b"\0")
        digest.update(b"hydra-node\0" if hydra_node else b"job\0")
        return digest.hexdigest()

    def usable_root(self) -> bool:
        """Whether the cache directory may hold entries: absent (it is made 0700), or a directory this user owns;
        one that group or others may write is made 0700 when it is this user's, and not used when it is not."""
        try:
            info = self.root.stat()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        if info.st_mode & 0o077:
            try:
                self.root.chmod(0o700)
            except OSError:
                return False
        return True

    def get(self, overrides: Sequence[str], hydra_node: bool) -> Optional[DictConfig]:
        """The stored composition, verified against its hash and its key; None on a miss (absent, damaged,
        renamed from another key, unreadable, a file another user owns or may write, a directory others may
        write)."""
        key = self.key_of(overrides, hydra_node)
        path = self.root / (key + SUFFIX)
        try:
            with open(path, "rb") as handle:
                info = os.fstat(handle.fileno())
                if info.st_uid != os.getuid() or info.st_mode & 0o077 or not self.usable_root():
                    return None
                blob = handle.read()
        except OSError:
            return None
        expected, _, payload = blob.partition(b"\n")
        if entry_hash(key, payload) != expected:
            return None
        try:
            cfg = pickle.loads(payload)  # noqa: S301 - this user's own entry under its key, verified above
        except Exception:  # noqa: BLE001 - an entry written by other library versions is a miss
            return None
        if not isinstance(cfg, DictConfig):
            return None
        OmegaConf.clear_cache(cfg)
        return cfg

    def put(self, overrides: Sequence[str], hydra_node: bool, cfg: DictConfig) -> None:
        """Store ``cfg`` atomically (a reader sees the whole entry or none), without what resolvers remembered
        while Hydra composed it; nothing is stored when the tree changed since this cache read it. A cache that
        cannot be written is left as it is."""
        from trainer.publish import atomic_file

        remembered = OmegaConf.get_cache(cfg)
        OmegaConf.clear_cache(cfg)
        try:
            payload = pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a value that does not pickle: not stored
            return
        finally:
            OmegaConf.set_cache(cfg, remembered)
        path = self.root / (self.key_of(overrides, hydra_node) + SUFFIX)
        try:
            if tree_digest(self.conf_dir, self.schema_file) != self.tree:  # edited while Hydra read it
                return
            if not self.usable_root():
                return
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            with atomic_file(path, 0o600) as handle:
                handle.write(entry_hash(path.name[:-len(SUFFIX)], payload) + b"\n" + payload)
            self._prune()
        except OSError:
            return

    def _prune(self) -> None:
        """Remove entries an older format's mode left (any mode but 0600: the first format's were readable by
        all), then the least recently written beyond :data:`MAX_ENTRIES` (entries of other formats are never
        read: their keys differ)."""
        entries = []
        for entry in self.root.glob("*" + SUFFIX):
            info = entry.stat()
            if info.st_mode & 0o777 != 0o600:
                entry.unlink(missing_ok=True)
            else:
                entries.append((info.st_mtime_ns, entry))
        for _, stale in sorted(entries)[:-MAX_ENTRIES]:
            stale.unlink(missing_ok=True)
