"""This user's stamp key: the secret under which the input cache's stamps, layer records and the composition
cache's entries are MACed (HMAC-SHA256, RFC 2104), kept outside every cache so that whoever can write a cache
cannot also vouch for it. A module of its own so that reading the key (``train``'s composition cache) does not load
the input cache's fetching code."""

from __future__ import annotations

import os
from pathlib import Path

from trainer import inputs
from trainer.errors import UserError

_PROCESS_KEY: bytes | None = None


def stamp_key_path() -> Path:
    """This user's stamp key: ``$XDG_CONFIG_HOME/recipe-bundle/cache-stamp.key`` (``~/.config`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "recipe-bundle" / "cache-stamp.key"


def stamp_key() -> bytes:
    """The secret key of stamps and layer records (32 random bytes, created once, mode 0600, outside the cache so
    that whoever can write the cache cannot also vouch for it). Where it cannot be kept, a key of this process only:
    stamps are then never trusted across runs and every blob is re-hashed."""
    global _PROCESS_KEY  # one key per process, read or made once (not run state)
    if _PROCESS_KEY is not None:
        return _PROCESS_KEY
    path = stamp_key_path()
    try:
        key = inputs.read_bytes(path, "cache stamp key", 4096)  # a FIFO or device refused without blocking
    except (OSError, UserError):
        key = b""
    if len(key) != 32:
        key = os.urandom(32)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(key)
        except FileExistsError:
            key = existing if len(existing := inputs.read_bytes(path, "cache stamp key", 4096)) == 32 else key
        except OSError:
            pass
    _PROCESS_KEY = key
    return key
