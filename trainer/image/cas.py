"""A content-addressed cache of build inputs and layers, checked by sha256 on every use.

Layout (default root ``$XDG_CACHE_HOME/recipe-bundle/cas``, ``~/.cache/recipe-bundle/cas`` without it;
``--cache DIR`` overrides)::

    DIR/sha256/<hex>          a blob whose sha256 is <hex>: a wheel, an sdist, a source archive, a layer tar
    DIR/layers/<key>.json     a built layer: {"diff_id", "size"}; <key> is the sha256 of the layer's inputs
    DIR/trees/<tree>.json     a git tree (40 hex): {"sha256": the blob holding its files, "commit": ...}
    DIR/stamps/<hex>.json     the blob's stat (size, mtime_ns, ctime_ns, inode) when its hash was last checked
    DIR/tmp/                  downloads and layers being written (renamed into place when complete)

Every write goes to a temporary file in ``DIR/tmp`` and is renamed into place only after its hash has been
checked, so ``kill -9`` never leaves a corrupt entry, and two builds sharing a cache at once only race to
rename identical bytes.

What is verified when:

- an input (wheel, sdist, .deb, git archive) is hashed in full when it enters the cache (download,
  ``trainer cache add``) and again, in full, every time a build reads it to make a layer;
- a built layer is hashed while it is written; when a later build reuses it (a layer-cache hit) its blob is
  re-hashed in full unless its stamp still matches: same size, mtime, ctime and inode as recorded right after
  its hash was last checked. ctime cannot be set back by a user (any write, chmod, truncation or rename
  moves it), so a blob modified in place fails the stamp and is re-hashed before it can enter an image. Linking a
  blob into an output layout, or removing such a layout, also moves ctime: a ctime that moved together with
  the link count, with size, mtime and inode unchanged, is accepted (a write would have moved mtime), so a
  cache entry does not depend on what happens to the outputs that link to it. What a stamp does not catch:
  a deliberate same-size write whose mtime is then set back by hand (``touch -d``, ``os.utime``) and whose
  link count changes too; stamps guard against accidents, not against someone with write access to the
  cache (who could rewrite the stamp as well): ``--verify-cache`` re-hashes everything.
  ``trainer image build --verify-cache`` and ``trainer cache verify`` re-hash everything regardless.

A blob whose bytes no longer match its name is removed and reported. Downloads are allowed from PyPI's and
Debian's hosts only (each checked against the locked sha256 before it is renamed in).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from trainer import inputs
from trainer.errors import UserError
from trainer.image.layer import write_layer
from trainer.image.stampkey import stamp_key
from trainer.publish import atomic_write

HEX = re.compile(r"^[0-9a-f]{64}$")
DOWNLOAD_HOSTS = (
    "https://files.pythonhosted.org/",
    "https://pypi.org/",
    "http://deb.debian.org/",
    "https://deb.debian.org/",
    "http://security.debian.org/",
    "https://security.debian.org/",
    "http://snapshot.debian.org/",
    "https://snapshot.debian.org/",
)
CHUNK = 1 << 20
PROGRESS_MIN_BYTES = 32 << 20  # show a bar when hashing or downloading at least this much


def default_root() -> Path:
    """``$XDG_CACHE_HOME/recipe-bundle/cas`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recipe-bundle" / "cas"


def parse_sha256(value: str, what: str) -> str:
    """``value`` ("<hex>" or "sha256:<hex>") as 64 lowercase hex digits; :class:`UserError` naming ``what``."""
    hexdigest = value[len("sha256:") :] if value.startswith("sha256:") else value
    if not HEX.match(hexdigest):
        raise UserError(f"{what}: expected a sha256 (64 lowercase hex digits), got {value!r}")
    return hexdigest


def _progress(total: int, description: str):
    """A rich progress bar for ``total`` bytes on stderr, or None for small or non-interactive work."""
    if total < PROGRESS_MIN_BYTES:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a transient bar off a terminal leaves only blank lines behind
        return None
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,
    )
    return progress, progress.add_task(description, total=total)


def open_regular(path: Path):
    """``open(path, "rb")`` refusing anything but a regular file (a FIFO, device or socket would block or never
    end): opened without blocking and checked with ``fstat``. Raises :class:`UserError`."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as ex:
        if ex.errno == 40:  # ELOOP: a symlink
            raise UserError(f"{path}: a symlink where a regular file is expected (refused)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: not a regular file (a FIFO, device or socket is refused)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def hash_file(path: Path, description: str = "") -> str:
    """sha256 hex of the regular file at ``path`` (streamed; a progress bar for large files).
    Raises :class:`UserError` for a FIFO, device or socket (:func:`open_regular`)."""
    digest = hashlib.sha256()
    handle = open_regular(path)
    size = os.fstat(handle.fileno()).st_size
    bar = _progress(size, description or f"hashing {path.name}")
    with handle:
        if bar:
            bar[0].start()
        try:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                if bar:
                    bar[0].advance(bar[1], len(chunk))
        finally:
            if bar:
                bar[0].stop()
    return digest.hexdigest()


# A live process holds an exclusive flock on its marker ROOT/tmp/live-<pid>-*; debris older than the oldest live
# marker belongs to no live build and is removed by `trainer cache gc` (and when a build starts).
LIVE_PREFIX = "live-"
DEBRIS_PREFIXES = ("part-", "spool-", LIVE_PREFIX)
_LIVE: dict = {}


class Cache:
    """The cache at ``root`` (created on first write). All methods raise :class:`UserError` for bad input."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def blob_path(self, hexdigest: str) -> Path:
        """Where blob ``hexdigest`` (64 hex digits) lives: ``ROOT/sha256/<hex>``; it need not exist."""
        return self.root / "sha256" / hexdigest

    def tmp_dir(self) -> Path:
        """``ROOT/tmp`` (created if missing), the directory for partial downloads and layers being written.

        The first call of a process marks the process live (:data:`LIVE_PREFIX`) and removes the debris of dead
        ones (:meth:`gc`)."""
        path = self.root / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        if str(path) not in _LIVE:
            self._mark_live(path)
            self.gc()
        return path

    def _mark_live(self, tmp: Path) -> None:
        import atexit
        import fcntl

        fd, marker = tempfile.mkstemp(prefix=f"{LIVE_PREFIX}{os.getpid()}-", dir=tmp)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _LIVE[str(tmp)] = (fd, marker)

        def release() -> None:
            Path(marker).unlink(missing_ok=True)
            os.close(fd)

        atexit.register(release)

    def _oldest_live(self, tmp: Path) -> float | None:
        """The start time (marker mtime) of the oldest live process using this cache, or None."""
        import fcntl

        own = _LIVE.get(str(tmp), (None, None))[1]
        oldest = None
        for marker in tmp.glob(f"{LIVE_PREFIX}*"):
            if str(marker) == own:
                continue
            try:
                fd = os.open(marker, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a FIFO marker never blocks
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: a dead process's marker (debris)
            except OSError:
                started = os.fstat(fd).st_mtime
                oldest = started if oldest is None else min(oldest, started)
            finally:
                os.close(fd)
        return oldest

    def debris(self) -> list:
        """What killed builds left (partial blobs ``tmp/part-*``, spools ``tmp/spool-*``, dead markers, half-written
        stamps and layer records ``.*``) and no live build can still be using: older than the oldest live process
        of this cache (all of it when none is live). Sorted paths."""
        tmp = self.root / "tmp"
        oldest = self._oldest_live(tmp) if tmp.is_dir() else None
        own = _LIVE.get(str(tmp), (None, None))[1]
        found = []
        candidates = [p for p in tmp.iterdir() if p.name.startswith(DEBRIS_PREFIXES)] if tmp.is_dir() else []
        for sub in ("stamps", "layers"):
            if (self.root / sub).is_dir():
                candidates += [p for p in (self.root / sub).iterdir() if p.name.startswith(".")]
        for path in candidates:
            if str(path) == own:
                continue
            try:
                mtime = path.lstat().st_mtime
            except OSError:
                continue
            if oldest is None or mtime < oldest:
                found.append(path)
        return sorted(found)

    def gc(self) -> list:
        """Remove :meth:`debris`; return what was removed (paths)."""
        removed = []
        for path in self.debris():
            try:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    def has(self, hexdigest: str) -> bool:
        """Whether blob ``hexdigest`` is present as a file (its content is not re-hashed; use :meth:`get`)."""
        return self.blob_path(hexdigest).is_file()

    def get(self, hexdigest: str, name: str, trust_stamp: bool = False) -> Path | None:
        """The blob ``hexdigest`` after re-hashing it, or None when absent. With ``trust_stamp`` a blob whose
        stat still matches its stamp (see the module docstring) is not re-hashed. A blob whose bytes do not
        match is removed and :class:`UserError` names ``name`` and both hashes."""
        path = self.blob_path(hexdigest)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        if trust_stamp and self._stamp_matches(hexdigest, st, self._read_stamp(hexdigest)):
            return path
        actual = hash_file(path, f"verifying {name}")
        if actual != hexdigest:
            path.unlink(missing_ok=True)
            self._stamp_path(hexdigest).unlink(missing_ok=True)
            raise UserError(
                f"cache entry for {name} is corrupt: sha256 {actual} != expected {hexdigest} "
                "(removed; run again to re-fetch)"
            )
        self.stamp(hexdigest, st)
        return path

    # stamps: the stat of a blob right after its hash was checked
    def _stamp_path(self, hexdigest: str) -> Path:
        return self.root / "stamps" / f"{hexdigest}.json"

    @staticmethod
    def _stamp_of(st: os.stat_result) -> dict:
        return {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino,
            "nlink": st.st_nlink,
            "dev": st.st_dev,
        }

    def _signed_stamp(self, hexdigest: str, st: os.stat_result) -> dict:
        """The stamp of blob ``hexdigest`` with stat ``st``: the stat and a MAC binding it to the digest."""
        stamp = self._stamp_of(st)
        return {**stamp, "mac": self.mac("stamp", hexdigest, stamp)}

    def _stamp_matches(self, hexdigest: str, st: os.stat_result, stamp: dict | None) -> bool:
        """Whether ``st`` is the stat blob ``hexdigest`` had when its hash was checked, as its stamp says.

        The stamp must carry a MAC under this user's key (:meth:`mac`) over the stat it records and the digest:
        a stamp rewritten after the blob changed, or copied from another blob, is refused. A moved ctime is
        explained, and accepted, only by a changed link count with size, mtime, inode and device unchanged: an
        output layout that hard-links the blob was made or removed (``rm -rf`` of an old ``--out``); any write
        moves mtime."""
        import hmac

        if not isinstance(stamp, dict):
            return False
        recorded = {k: v for k, v in stamp.items() if k != "mac"}
        if not hmac.compare_digest(str(stamp.get("mac", "")), self.mac("stamp", hexdigest, recorded)):
            return False
        now = self._stamp_of(st)
        if now == recorded:
            return True
        same_bytes = all(now[k] == recorded.get(k) for k in ("size", "mtime_ns", "ino", "dev"))
        return same_bytes and "nlink" in recorded and now["nlink"] != recorded["nlink"]

    def _read_stamp(self, hexdigest: str) -> dict | None:
        try:
            stamp = json.loads(inputs.read_bytes(self._stamp_path(hexdigest), "cache stamp"))  # a FIFO refused
        except (OSError, ValueError):
            return None
        return stamp if isinstance(stamp, dict) else None

    def mac(self, kind: str, *fields: object) -> str:
        """HMAC-SHA256 (hex) of ``kind`` and ``fields`` (canonical JSON) under :func:`stamp_key`: what makes a stamp
        or a layer record this user's own statement rather than a file anyone could write into the cache."""
        import hmac

        message = json.dumps([kind, *fields], sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(stamp_key(), message, hashlib.sha256).hexdigest()

    def stamp(self, hexdigest: str, st: os.stat_result | None = None) -> None:
        """Record the blob's current stat (``st``: taken before its hash was checked) as trusted."""
        path = self.blob_path(hexdigest)
        now = path.stat()
        if st is not None and self._stamp_of(st) != self._stamp_of(now):
            return  # changed while it was hashed: leave it untrusted
        atomic_write(
            self._stamp_path(hexdigest), json.dumps(self._signed_stamp(hexdigest, now), sort_keys=True).encode()
        )

    def new_temp(self) -> Path:
        """A fresh, empty temporary file in the cache (same filesystem as the blobs, for atomic renames)."""
        fd, tmp = tempfile.mkstemp(prefix="part-", dir=self.tmp_dir())
        os.close(fd)
        return Path(tmp)

    def commit(self, tmp: Path, hexdigest: str) -> Path:
        """Move the complete temporary file ``tmp`` (already hashed to ``hexdigest``) into place, read-only."""
        dest = self.blob_path(hexdigest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        self.stamp(hexdigest)
        return dest

    def add_file(self, source: Path, expected: str | None = None, name: str | None = None) -> str:
        """Copy ``source`` into the cache; return its sha256 hex. With ``expected`` a mismatch is refused
        (nothing is added)."""
        name = name or str(source)
        if not source.is_file():
            raise UserError(f"{source}: not a file")
        want = parse_sha256(expected, "--sha256") if expected is not None else None
        tmp = self.new_temp()
        try:
            digest = hashlib.sha256()
            with open_regular(source) as src, open(tmp, "wb") as dst:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            actual = digest.hexdigest()
            if want and actual != want:
                raise UserError(f"{name}: sha256 {actual} != expected {want} (not added)")
            self.commit(tmp, actual)
            return actual
        finally:
            tmp.unlink(missing_ok=True)

    def add_bytes(self, data: bytes) -> str:
        """Add ``data``; return its sha256 hex."""
        actual = hashlib.sha256(data).hexdigest()
        if not self.has(actual):
            tmp = self.new_temp()
            try:
                tmp.write_bytes(data)
                self.commit(tmp, actual)
            finally:
                tmp.unlink(missing_ok=True)
        return actual

    def download(self, url: str, hexdigest: str, name: str) -> Path:
        """Download ``url`` (PyPI hosts only) into the cache, checking its sha256 before it is renamed in."""
        if not url.startswith(DOWNLOAD_HOSTS):
            raise UserError(
                f"{name}: will not download {url} (only PyPI URLs are fetched; seed the cache with `trainer cache add`)"
            )
        tmp = self.new_temp()
        try:
            digest = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
                total = int(response.headers.get("Content-Length") or 0)
                bar = _progress(total, f"downloading {name}")
                if bar:
                    bar[0].start()
                try:
                    while chunk := response.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        if bar:
                            bar[0].advance(bar[1], len(chunk))
                finally:
                    if bar:
                        bar[0].stop()
            actual = digest.hexdigest()
            if actual != hexdigest:
                raise UserError(f"{name}: download from {url} has sha256 {actual} != locked {hexdigest}")
            return self.commit(tmp, actual)
        finally:
            tmp.unlink(missing_ok=True)

    def ensure(self, hexdigest: str, name: str, url: str | None = None, offline: bool = False) -> Path:
        """The verified blob for artifact ``name``: from the cache, else downloaded from ``url``.

        Raises :class:`UserError` with one line naming the artifact and its hash when it is neither cached nor
        downloadable.
        """
        path = self.get(hexdigest, name)
        if path is not None:
            return path
        reason = "offline" if offline else "no download URL"
        if url and not offline and url.startswith(DOWNLOAD_HOSTS):
            try:
                return self.download(url, hexdigest, name)
            except (urllib.error.URLError, OSError, TimeoutError) as ex:
                reason = f"download failed: {getattr(ex, 'reason', ex)}"
        elif url and not offline:
            reason = f"{url} is not fetched by builds"
        raise UserError(
            f"missing input {name} sha256:{hexdigest} ({reason}); "
            f"add it with `trainer cache add FILE --sha256 {hexdigest}`"
        )

    # built layers, keyed by the hash of their inputs
    def layer_record(self, key: str) -> dict | None:
        """The built-layer record ``ROOT/layers/<key>.json`` (``{"diff_id": "sha256:<hex>", "size": bytes, ...}``), or
        None when it is absent, not valid JSON, not an object, or has no valid ``diff_id``. ``key``: the sha256 of the
        layer's inputs. The blob itself is not checked here.
        """
        import hmac

        path = self.root / "layers" / f"{key}.json"
        try:
            record = json.loads(inputs.read_bytes(path, "layer record"))  # a FIFO refused without blocking
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or not HEX.match(str(record.get("diff_id", ""))[7:]):
            return None
        size = record.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return None
        # the record must be this user's statement about these inputs: a record pointed at another blob, or
        # copied from another key, fails its MAC and the layer is rebuilt
        want = self.mac("layer", key, record["diff_id"], size)
        if not hmac.compare_digest(str(record.get("mac", "")), want):
            return None
        try:
            if self.blob_path(record["diff_id"][7:]).stat().st_size != size:
                return None
        except OSError:
            return None
        return record

    def put_layer_record(self, key: str, record: dict) -> None:
        """Write ``record`` (JSON, sorted keys) as ``ROOT/layers/<key>.json`` atomically
        (:func:`trainer.publish.atomic_write`).
        """
        record = {**record, "key": key, "mac": self.mac("layer", key, record["diff_id"], int(record["size"]))}
        atomic_write(self.root / "layers" / f"{key}.json", (json.dumps(record, sort_keys=True) + "\n").encode())

    # git trees: which blob holds a tree's files (the blob is re-hashed and its files' tree id recomputed
    # on every use, so this index is a hint, never trusted; see trainer.image.sources)
    def tree_record(self, tree: str) -> dict | None:
        """``ROOT/trees/<tree>.json`` (``{"sha256": hex, "commit": hex, "source": ...}``), or None when absent or
        malformed. ``tree``: a git tree id, 40 hex."""
        if not re.match(r"^[0-9a-f]{40}$", tree):
            return None
        try:
            record = json.loads(
                inputs.read_bytes(self.root / "trees" / f"{tree}.json", "cas tree record")
            )  # FIFO refused
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict) or not HEX.match(str(record.get("sha256", ""))):
            return None
        return record

    def put_tree(self, tree: str, entries: list, record: dict) -> str:
        """Store the canonical archive of git ``tree`` (layer ``entries``, see
        :func:`trainer.image.sources.canonical_entries`) as a blob and index it under the tree id; returns the
        blob's sha256 hex. The blob is written to a temporary file and renamed in, then the index entry."""

        tmp = self.new_temp()
        try:
            with open(tmp, "wb") as handle:
                info = write_layer(entries, handle, 0)
                handle.flush()
                os.fsync(handle.fileno())
            self.commit(tmp, info.hex)
        finally:
            tmp.unlink(missing_ok=True)
        atomic_write(
            self.root / "trees" / f"{tree}.json",
            (json.dumps({**record, "sha256": info.hex}, sort_keys=True) + "\n").encode(),
        )
        return info.hex

    def link_or_copy(self, hexdigest: str, dest: Path) -> None:
        """Place blob ``hexdigest`` at ``dest`` (a hard link when possible, else a copy)."""
        src = self.blob_path(hexdigest)
        try:
            os.link(src, dest)
        except OSError:
            shutil.copyfile(src, dest)


ProgressFn = Callable[[int], None]
