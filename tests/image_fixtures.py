"""Deterministic fixtures for the tests: tiny wheels, .debs, base images and a small lock (the git source
archive and the smoke source come from :mod:`trainer.image.smoke`).

Everything here is derived from its arguments only (fixed zip times, fixed git author/committer dates),
so the same call gives the same bytes and hashes on any machine.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.image.cas import hash_file
from trainer.image.layer import FILE, Entry, write_layer
from trainer.image.smoke import SMOKE_EPOCH, SMOKE_SOURCE_FILES, git_env, make_git_source  # noqa: F401 (the tests' too)

ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    files: dict[str, bytes],
    entry_points: str = "",
    extra_members: list[tuple[zipfile.ZipInfo, bytes]] | None = None,
) -> Path:
    """Write ``{name}-{version}-py3-none-any.whl`` with ``files`` (path -> bytes), METADATA, WHEEL and a
    RECORD of sha256 hashes; ``extra_members`` are appended as given (to make bad wheels). Returns its path."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: recipe-bundle-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if entry_points:
        members[f"{info}/entry_points.txt"] = entry_points.encode()
    record = []
    for path, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = Path(directory) / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            info_ = zipfile.ZipInfo(member, ZIP_TIME)
            info_.external_attr = 0o644 << 16
            zf.writestr(info_, data)
        for zinfo, data in extra_members or []:
            zf.writestr(zinfo, data)
    return wheel


def sha256(path: Path) -> str:
    """sha256 hex (64 digits) of the file at ``path`` (str or Path): :func:`trainer.image.cas.hash_file`
    (streamed in 1 MiB chunks; a progress bar on stderr only for files of 32 MiB or more). Raises
    ``FileNotFoundError`` when the file does not exist.
    """
    return hash_file(Path(path))


def small_lock(
    name: str,
    epoch: int,
    wheels: list[tuple[Path, str, str, str]],
    sources: list[dict[str, Any]],
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A scratch-based lock for ``wheels`` ((path, name, version, group) each) and git ``sources``
    (lock ``sources[]`` items). URLs point at files.pythonhosted.org-style names that are never fetched
    (tests seed the cache)."""
    return {
        "schema_version": 1,
        "kind": "recipe-bundle.image-lock",
        "name": name,
        "epoch": epoch,
        "platform": {"os": "linux", "architecture": "amd64"},
        "python": {
            "version": "3.12",
            "platform": "x86_64-manylinux_2_28",
            "prefix": "/usr/local",
            "site_packages": "/usr/local/lib/python3.12/site-packages",
            "interpreter": "/usr/local/bin/python3.12",
        },
        "base": {"type": "scratch"},
        "wheels": [
            {
                "name": n,
                "version": v,
                "filename": Path(p).name,
                "group": g,
                "sha256": sha256(p),
                "url": f"https://files.pythonhosted.org/packages/test/{Path(p).name}",
            }
            for p, n, v, g in wheels
        ],
        "sdists": [],
        "sources": sources,
        "bundle": {"dest": "/opt/recipe-bundle", "include": ["conf"], "stamp": "/etc/recipe-bundle/lock.json"},
        "image": {
            "env": env or {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
            "entrypoint": ["/usr/local/bin/python3.12"],
            "working_dir": "/opt/recipe-bundle",
            "labels": {"org.opencontainers.image.source": "https://example.invalid/recipe-bundle"},
        },
    }


def make_deb(
    directory: Path,
    name: str,
    version: str,
    files: dict[str, tuple[bytes, int]],
    symlinks: dict[str, str] | None = None,
    dirs: dict[str, int] | None = None,
    control: str = "",
    epoch: int = SMOKE_EPOCH,
) -> Path:
    """Build ``{name}_{version}_amd64.deb`` with ``dpkg-deb --build --root-owner-group``: ``files`` maps an
    absolute path to (content, mode), ``symlinks`` a path to its target, ``dirs`` a path to its mode;
    ``control`` adds fields to the control file; DEBIAN/md5sums lists the files. SOURCE_DATE_EPOCH = ``epoch``
    (dpkg-deb uses it for the member times). Returns the .deb's path."""
    root = Path(directory) / f"{name}-{version}.root"
    if root.exists():
        shutil.rmtree(root)
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: amd64\nMaintainer: tests <tests@recipe-bundle.invalid>\n"
        f"Description: recipe-bundle test package {name}\n{control}"
    )
    for path, mode in (dirs or {}).items():
        target = root / path.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, mode)
    for path, (data, mode) in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, mode)
    for path, link in (symlinks or {}).items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link, target)
    (root / "DEBIAN" / "md5sums").write_text(
        "".join(  # as dh_md5sums writes it
            f"{hashlib.md5(data).hexdigest()}  {path.lstrip('/')}\n" for path, (data, _) in sorted(files.items())
        )
    )
    out = Path(directory) / f"{name}_{version}_amd64.deb"
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(out)],
        check=True,
        capture_output=True,
        env=env,
    )
    shutil.rmtree(root)
    return out


def debian_base(debs: list[tuple[Path, str, str]]) -> dict[str, Any]:
    """A ``debian-rootfs`` base block for ``debs`` ((path, name, version) each; amd64); URLs name the Debian
    mirror but tests seed the cache instead."""
    return {
        "type": "debian-rootfs",
        "suite": "bookworm",
        "variant": "essential",
        "include": [],
        "debs": [
            {
                "name": n,
                "version": v,
                "architecture": "amd64",
                "sha256": sha256(p),
                "size": Path(p).stat().st_size,
                "url": f"http://deb.debian.org/debian/pool/main/t/{n}/{Path(p).name}",
            }
            for p, n, v in debs
        ],
    }


def make_base_image(
    directory: Path,
    files: dict[str, tuple[bytes, int]],
    epoch: int = SMOKE_EPOCH,
    config: dict[str, Any] | None = None,
    docker_types: bool = False,
) -> tuple[Path, str]:
    """Write an OCI image layout at ``directory`` standing in for a registry base image: one gzip-compressed
    layer (made by the deterministic layer writer, gzip mtime 0) of ``files`` (path -> (content, mode)),
    ``config`` merged into the image config's ``config`` field, a history with one empty-layer entry.
    ``docker_types``: Docker schema 2 media types for the manifest, config and layer (as Docker Hub serves).
    Returns (layout path, manifest digest "sha256:<hex>"); the same arguments give the same bytes."""
    import gzip

    from trainer.image.oci import compact_json, rfc3339

    buf = io.BytesIO()
    info = write_layer([Entry(p, FILE, data=data, mode_bits=mode) for p, (data, mode) in files.items()], buf, epoch)
    layer = gzip.compress(buf.getvalue(), compresslevel=6, mtime=0)
    created = rfc3339(epoch)
    config_doc = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "Env": ["PATH=/opt/base/bin:/usr/local/bin:/usr/bin:/bin", "BASE_ONLY=1"],
            "Cmd": ["/bin/sh"],
            **(config or {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [info.diff_id]},
        "history": [
            {"created": created, "created_by": "base: add files"},
            {"created": created, "created_by": "base: ENV BASE_ONLY=1", "empty_layer": True},
        ],
    }
    config_bytes = compact_json(config_doc)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json"
        if docker_types
        else "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json"
            if docker_types
            else "application/vnd.oci.image.config.v1+json",
            "digest": "sha256:" + hashlib.sha256(config_bytes).hexdigest(),
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip"
                if docker_types
                else "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": "sha256:" + hashlib.sha256(layer).hexdigest(),
                "size": len(layer),
            }
        ],
    }
    manifest_bytes = compact_json(manifest)
    digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    directory = Path(directory)
    blobs = directory / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for data in (config_bytes, manifest_bytes, layer):
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
    (directory / "oci-layout").write_bytes(compact_json({"imageLayoutVersion": "1.0.0"}))
    (directory / "index.json").write_bytes(
        compact_json(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [
                    {
                        "mediaType": manifest["mediaType"],
                        "digest": digest,
                        "size": len(manifest_bytes),
                        "annotations": {"org.opencontainers.image.ref.name": "latest"},
                    }
                ],
            }
        )
    )
    return directory, digest


DEMO_EPOCH = 1767225600


def demo_source(directory: Path, files: dict[str, bytes], epoch: int) -> tuple[dict[str, Any], Path]:
    """A git source "demo" of ``files`` (path -> bytes) committed at ``epoch`` (:func:`make_git_source` under
    ``directory``): its lock ``sources[]`` item (commit, tree, archive sha256; dest /opt/src/demo; a URL that is never
    fetched) and the archive's path."""
    archive, commit, tree = make_git_source(directory, "demo", files, epoch)
    source = {
        "name": "demo",
        "url": "https://example.invalid/demo.git",
        "commit": commit,
        "tree": tree,
        "dest": "/opt/src/demo",
        "archive": {"filename": archive.name, "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()},
    }
    return source, archive


def make_demo_inputs(root: Path, beta: str = "2.0") -> tuple[Path, list[Path], Path]:
    """A small scratch-based lock and its inputs, made offline: wheels alpha 1.0 (rest, with a console script),
    beta (torch group), a git source, a bundle conf/.
    Returns (lock path, [the input files], the bundle root)."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    alpha = make_wheel(
        wheels,
        "alpha",
        "1.0",
        {"alpha/__init__.py": b"def main():\n    return 0\n"},
        entry_points="[console_scripts]\nalpha = alpha:main\n",
    )
    beta_w = make_wheel(wheels, "beta", beta, {"beta/__init__.py": f"VERSION = {beta!r}\n".encode()})
    source, archive = demo_source(root / "git", {"README.md": b"demo\n", "demo/run.py": b"print(1)\n"}, DEMO_EPOCH)
    lock = small_lock(
        "smoke-test", DEMO_EPOCH, [(alpha, "alpha", "1.0", "rest"), (beta_w, "beta", beta, "torch")], [source]
    )
    lock_path = root / f"lock-{beta}.json"
    lock_path.write_text(json.dumps(lock, indent=2))
    bundle = root / "bundle"
    (bundle / "conf" / "env").mkdir(parents=True, exist_ok=True)
    (bundle / "conf" / "env" / "recipe.yaml").write_text("CUDA_DEVICE_MAX_CONNECTIONS: '1'\n")
    return lock_path, [alpha, beta_w, archive], bundle


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_registry(root: Path, delete: bool = False) -> Iterator[dict[str, Any]]:
    """Debian's ``docker-registry`` (distribution 2.8) serving plain HTTP on 127.0.0.1 at a free port, its
    storage under ``root/data`` (``root`` made if missing); yields {"host": "127.0.0.1:PORT", "storage": Path}.
    Stopped on exit. Raises RuntimeError when it does not listen within 20 s (its log's tail in the message)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\n"
        + ("  delete:\n    enabled: true\n" if delete else "")
        + f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(root / "registry.log", "wb")  # a pipe nobody reads would stall the registry once full
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    tail = (root / "registry.log").read_text(errors="replace")[-300:]
                    raise RuntimeError(f"docker-registry did not listen on 127.0.0.1:{port}: {tail}") from None
                time.sleep(0.1)
        yield {"host": f"127.0.0.1:{port}", "storage": root / "data"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def push_then_pull(cache: Path, remote: str, lock: Path, key: Path, empty: Path) -> tuple[list[dict], list[dict]]:
    """``trainer cache push`` of ``lock``'s layers from ``cache`` to ``remote`` signed with a new key pair made at
    ``key``, then ``trainer cache pull`` into the cache ``empty`` trusting ``key.pub`` (plain HTTP); asserts both
    succeed and returns their JSON rows (push's, pull's)."""
    from helpers import run_trainer

    assert run_trainer("keygen", "--out", key).returncode == 0
    pushed = run_trainer(
        "cache", "--cache", cache, "push", remote, "--lock", lock, "--sign-key", key, "--no-tls-verify", "--json"
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stdout[-2000:] + pushed.stderr[-2000:]
    pulled = run_trainer(
        "cache", "--cache", empty, "pull", remote, "--lock", lock, "--trusted-key", f"{key}.pub",
        "--no-tls-verify", "--json",
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stdout[-2000:] + pulled.stderr[-2000:]
    return json.loads(pushed.stdout)["layers"], json.loads(pulled.stdout)["layers"]
