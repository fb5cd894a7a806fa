"""``launcher=local-image``: run inside the bundle's image without a container engine, as pyxis/enroot would.

1. The image is ``launcher.image`` (``sha256:<64 hex>``, or ``NAME@sha256:...``) in the OCI image layout
   ``launcher.image_layout``: its manifest blob must hash to that digest and be named in the layout's
   ``index.json`` (``org.opencontainers.image.ref.name``); its root file system comes from the cache of unpacked
   images outside the run directory (:mod:`trainer.launch.host.rootfs`: ``umoci unpack`` the first time, which
   checks every layer blob against its digest; every file re-hashed against the entry's record each time after).
   The run directory holds records only.
2. The probe (``python -m trainer.probe --distributions``) runs inside that root file system, read-only, with
   bubblewrap: each entry of the root bound read-only (:func:`trainer.launch.host.rootfs.readonly_view`),
   ``--proc /proc --dev /dev --tmpfs /tmp``, with new PID, IPC, network, UTS
   and cgroup namespaces (and a user namespace when not root), ``--cap-drop ALL --clearenv``, no network,
   ``RECIPE_BUNDLE_IMAGE_DIGEST`` set to the digest. Then ``launcher.job``, if given, runs the same way (its log
   is ``logs/job.log``).
3. The record carries the image (digest, layout, tag, the stamped ``/etc/recipe-bundle/lock.json`` copied to
   ``image/lock.json``) and the probe; its ``lock`` is that stamp, so ``trainer verify RUN_DIR`` compares what
   the probe saw inside the image with the lock the image was built from.

The interpreter: an image whose entrypoint interpreter exists in its root file system runs its own. An image
without one (the smoke image is ``scratch``: site-packages, sources and the bundle layer, no Python) runs
**this machine's Python, bound read-only** into the sandbox under ``/opt/recipe-bundle-host`` (its prefix and
library directories at their host paths below that, started through its own dynamic loader: see
:func:`host_interpreter`; so a system Python in ``/usr`` does not hide the image's ``/usr``), with ``-S`` so that
only the image's site-packages (from the stamp), the directories its ``.pth`` files name (git sources such
as miles) and this bundle's ``trainer`` package (bound read-only at ``/opt/recipe-bundle-launcher``) are on
``sys.path``. The record says so (``image.interpreter.from = "host"``), and ``trainer verify`` then shows the
host's Python version against the image's locked one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import REPO_ROOT
from trainer.compose.checks import Parallelism
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError, UserError
from trainer.image.oci import find_tag
from trainer.launch.host import cluster
from trainer.launch.host import rootfs as rootfs_cache
from trainer.launch.host.rootfs import readonly_view
from trainer.record.rundir import COMPLETE, FAILED, LOGS, PROBES, SANDBOX, RunDir

IMAGE_DIR = "image"  # the run directory's copy of the image's stamped lock: image/lock.json

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun

LAUNCHER_MOUNT = "/opt/recipe-bundle-launcher"
HOST_MOUNT = "/opt/recipe-bundle-host"
STAMP = "etc/recipe-bundle/lock.json"


def _digest(cfg: TrainConfig) -> str:
    image = cfg.launcher.image or ""
    if cluster.DIGEST_RE.match(image):
        return image
    return cluster.parse_image(image)[1]


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """``launcher.image`` pinned by digest; ``launcher.image_layout`` an OCI layout; umoci and bwrap present."""
    _digest(cfg)
    layout = Path(cfg.launcher.image_layout or "")
    if not cfg.launcher.image_layout or not (layout / "index.json").is_file():
        raise CheckError(
            f"launcher.image_layout {cfg.launcher.image_layout!r}: expected an OCI image layout directory "
            "(oci-layout, index.json, blobs/)"
        )
    for tool, package in (("umoci", "umoci"), ("bwrap", "bubblewrap")):
        if shutil.which(tool) is None:
            raise CheckError(f"launcher=local-image needs `{tool}` (Debian package {package}); bin/setup installs it")


def _image_interpreter(bundle: Path) -> str | None:
    """The image's interpreter (its config's first entrypoint word) when it exists in the root file system."""
    try:
        args = json.loads((bundle / "config.json").read_text())["process"]["args"]
    except (OSError, KeyError, json.JSONDecodeError):
        return None
    if not args:
        return None
    candidate = rootfs_cache.image_path(bundle / "rootfs", args[0])
    return args[0] if candidate.is_file() else None


def elf_interpreter(path: Path) -> str | None:
    """The program interpreter (``PT_INTERP``: the dynamic loader's path) of the 64-bit little-endian ELF file
    ``path``, or None for a static executable or another format. Layout from the System V gABI: ``e_phoff`` at
    byte 32 (8 bytes), ``e_phentsize`` at 54 and ``e_phnum`` at 56 (2 bytes each); in each program header
    ``p_type`` at 0 (``PT_INTERP`` = 3), ``p_offset`` at 8, ``p_filesz`` at 32."""
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            (p_type,) = struct.unpack_from("<I", table, i * phentsize)
            if p_type == 3:
                (offset,) = struct.unpack_from("<Q", table, i * phentsize + 8)
                (size,) = struct.unpack_from("<Q", table, i * phentsize + 32)
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode()
    return None


def host_interpreter() -> tuple[list[str], list[str]]:
    """(directories to bind read-only under ``HOST_MOUNT``, the command that starts this machine's Python there).

    The interpreter runs through its own dynamic loader with ``--library-path`` set to its library directories
    (all under ``HOST_MOUNT``), so neither the loader nor the libraries nor the standard library need to be at
    their host paths inside the image: a Python in ``/usr`` (Debian's ``/usr/bin/python3``) works as well as
    one installed elsewhere, and the image's own ``/usr`` stays visible. Python finds its standard library
    relative to the executable's path (``HOST_MOUNT/usr/lib/python3.11`` for ``HOST_MOUNT/usr/bin/python3.11``).
    """
    executable = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    prefix = Path(sys.base_prefix).resolve()
    loader = elf_interpreter(executable)
    multiarch = getattr(sys.implementation, "_multiarch", "")
    libdirs = [prefix / "lib"]
    if loader:
        libdirs.append(Path(loader).resolve().parent)
    for base in ("/lib", "/usr/lib", "/lib64", "/usr/lib64"):
        libdirs += [Path(base) / multiarch, Path(base)] if multiarch else [Path(base)]
    libdirs = list(dict.fromkeys(d.resolve() for d in libdirs if d.is_dir()))
    binds: list[str] = []
    for path in sorted({prefix, executable.parent, *libdirs}, key=lambda p: len(p.parts)):
        if not any(path == Path(b) or Path(b) in path.parents for b in binds):
            binds.append(str(path))
    command = [f"{HOST_MOUNT}{executable}"]
    if loader:
        command = [
            f"{HOST_MOUNT}{Path(loader).resolve()}",
            "--library-path",
            ":".join(f"{HOST_MOUNT}{d}" for d in libdirs),
        ] + command
    return binds, command


def pth_directories(rootfs: Path, site_packages: str | None) -> list[str]:
    """The directories the image's ``.pth`` files in ``site_packages`` add to ``sys.path`` (what site.py would
    do; a host Python started with ``-S`` does not read them): plain absolute path lines that exist in
    ``rootfs``, in file-name order. Lines that site.py would execute (``import ...``) are not followed."""
    if not site_packages:
        return []
    out: list[str] = []
    for pth in sorted(rootfs_cache.image_path(rootfs, site_packages).glob("*.pth")):
        try:
            lines = rootfs_cache.image_path(rootfs, f"{site_packages}/{pth.name}").read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            line = line.strip()
            if line.startswith("/") and rootfs_cache.image_path(rootfs, line).is_dir() and line not in out:
                out.append(line)
    return out


def sandbox(rootfs: Path, digest: str, site_packages: str | None, host_python: bool) -> tuple[list[str], list[str]]:
    """(bwrap argv prefix, the interpreter's command inside) for running in ``rootfs``, which stays read-only and
    unchanged; see the module docstring.

    Raises :class:`UserError` when the image itself uses ``HOST_MOUNT`` (binding there would hide it)."""
    # every namespace but, for root, the user namespace (--unshare-all tries one): a new procfs may not be mounted
    # in a user namespace where /proc has parts covered (inside another sandbox: bwrap, a container); root's
    # process keeps no capability anyway (--cap-drop ALL)
    unshare = ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        unshare.append("--unshare-user-try")
    binds: list[tuple[str, str]] = [(str(REPO_ROOT / "trainer"), f"{LAUNCHER_MOUNT}/trainer")]
    python_path = [LAUNCHER_MOUNT] + ([site_packages] if site_packages else [])
    interpreter: list[str] = []
    if host_python:
        if os.path.lexists(rootfs / HOST_MOUNT.lstrip("/")):
            raise UserError(
                f"the image has {HOST_MOUNT}, where this machine's Python would be bound; "
                "use an image with its own Python"
            )
        host_dirs, interpreter = host_interpreter()
        binds += [(path, f"{HOST_MOUNT}{path}") for path in host_dirs]
        python_path += pth_directories(rootfs, site_packages)
    view = readonly_view(rootfs, ["/proc", "/dev", "/tmp", *(inside for _, inside in binds)])
    args = [
        "bwrap",
        *view,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        *unshare,
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--hostname",
        "recipe-image",
        "--clearenv",
    ]
    for source, inside in binds:
        args += ["--ro-bind", source, inside]
    args += [
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "PYTHONPATH",
        ":".join(python_path),
        "--setenv",
        cluster.DIGEST_ENV,
        digest,
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
    ]
    return args, interpreter


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Unpack, probe inside, run ``launcher.job`` inside if given; returns the record (see the module docstring)."""
    cfg = prepared.config
    run_dir = rundir.path.absolute()
    digest = _digest(cfg)
    layout = Path(cfg.launcher.image_layout or "").absolute()  # check() refused a missing one
    tag = find_tag(layout, digest)
    logs = run_dir / LOGS
    logs.mkdir(exist_ok=True)
    record["image"] = {"digest": digest, "layout": str(layout), "tag": tag}
    record["probe"] = None
    cached = rootfs_cache.unpacked(layout, tag, digest)
    record["image"]["rootfs"] = cached.as_record()
    rundir.write(
        f"{LOGS}/unpack.log",
        (
            cached.log
            or f"{digest}: the cached root file system, {cached.files:,} "
            f"entries re-hashed and unchanged ({cached.bundle})\n"
        ).encode(),
    )
    bundle = cached.bundle
    rootfs = bundle / "rootfs"
    stamp_path = rootfs_cache.image_path(rootfs, STAMP)  # the image's own file: never one of this machine
    stamp: dict[str, Any] = {}
    if stamp_path.is_file():
        stamp_bytes = stamp_path.read_bytes()
        rundir.write(f"{IMAGE_DIR}/lock.json", stamp_bytes, verbatim=True)  # rundir.VERBATIM: no sweep either
        stamp = json.loads(stamp_bytes)
        record["image"]["stamp_sha256"] = hashlib.sha256(stamp_bytes).hexdigest()
        record["lock"] = {"path": str(run_dir / IMAGE_DIR / "lock.json"), "kind": "image stamp"}
    site_packages = (stamp.get("python") or {}).get("site_packages")
    own = _image_interpreter(bundle)
    prefix, interpreter = sandbox(rootfs, digest, site_packages, host_python=own is None)
    python = [own] if own else interpreter
    host_executable = str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())
    record["image"]["interpreter"] = (
        {"from": "image", "path": own}
        if own
        else {
            "from": "host",
            "path": host_executable,
            "inside": interpreter,
            "version": sys.version.split()[0],
            "note": f"the image has no Python interpreter; this machine's is bound read-only under {HOST_MOUNT}",
        }
    )
    if own is None:
        print(
            f"local-image: {digest} has no Python interpreter; running this machine's ({host_executable}, "
            f"Python {sys.version.split()[0]}) read-only inside it under {HOST_MOUNT}, with the image's site-packages"
        )
    # the image's own Python starts as in the container (its site.py reads the .pth files that put git
    # sources on the path); a host Python starts with -S so that none of the host's site-packages leak in
    flags = [] if own else ["-S"]
    command = prefix + python + [*flags, "-m", "trainer.probe", "--distributions", "--node", "image"]
    rundir.write(SANDBOX, (json.dumps(command, indent=2) + "\n").encode())
    probe = subprocess.run(command, capture_output=True, text=True, timeout=300)
    rundir.write(f"{LOGS}/probe.log", probe.stderr.encode())
    if probe.returncode != 0:
        return rundir.end(
            record,
            FAILED,
            f"the probe inside the image exited with code {probe.returncode}: {cluster.last_line(probe.stderr)}",
        )
    info = json.loads(probe.stdout)
    rundir.write_json(f"{PROBES}/image.json", info)
    record["probe"] = {"ranks": [info], "nodes": ["image"]}
    if cfg.launcher.job:
        argv: list[str] = []
        for token in cfg.launcher.job:
            argv += python if token in ("python", "python3") else [str(token)]
        rundir.write_job(prefix + argv, {})  # bubblewrap clears the environment: its --setenv words are the env
        with (logs / "job.log").open("wb") as log:
            job = subprocess.run(prefix + argv, stdout=log, stderr=subprocess.STDOUT)
        if job.returncode != 0:
            text = (logs / "job.log").read_text(errors="replace")
            tail = cluster.last_line(text)
            return rundir.end(
                record,
                FAILED,
                f"the job inside the image exited with code {job.returncode}" + (f": {tail}" if tail else ""),
            )
    return rundir.end(record, COMPLETE)
