"""Building an OCI image from a lock, reading nothing else but the cache and the bundle's ``conf/``.

Flow: load and validate the lock → for each layer (base, Python groups cuda-runtime/torch/te/rest, sources,
bundle) compute its key, the sha256 of everything that goes into it (the layer format version, the epoch,
the python block and each input's name, version and sha256) → reuse the cached layer with that key (its
blob re-hashed) or build it: fetch each input into the content-addressed cache (:mod:`trainer.image.cas`,
re-hashed on every use), install wheels (:mod:`trainer.image.wheels`), unpack and tree-check git sources
(:mod:`trainer.image.sources`), write the tar (:mod:`trainer.image.layer`) into the cache → write config,
manifest and layout (:mod:`trainer.image.oci`), with the image's SBOMs and provenance as OCI 1.1
referrers (:mod:`trainer.image.referrers`). A one-pin change therefore rebuilds only its layer (and the
small bundle layer, which holds the lock).

Bases: ``scratch`` (nothing below the Python layers), ``debian-rootfs`` (one layer unpacked from the
lock's pinned .debs, :mod:`trainer.image.debian`) and ``oci`` (a registry image by manifest digest, seeded
into the cache by ``trainer cache add-image``; its manifest, config and layer blobs are re-hashed from the
cache and its layer blobs reused unchanged below ours, :mod:`trainer.image.base`).

Memory: wheel contents stream from their zip members into the layer file (:mod:`trainer.image.wheels`);
big layers are hashed and written by a second thread while the first inflates. What is hash-checked when
is described in :mod:`trainer.image.cas`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from trainer import PROJECT, __version__
from trainer.errors import UserError
from trainer.image import native, referrers
from trainer.image.base import load_base
from trainer.image.cas import Cache
from trainer.image.debian import deb_inputs, rootfs_entries
from trainer.image.layer import FILE, Entry, entries_from_tree, write_layer
from trainer.image.layerplan import LayerPlan, layer_key
from trainer.image.oci import Layer, based_config, compact_json, digest_of, image_manifest, write_archive, write_layout
from trainer.image.remote import Remote
from trainer.image.sources import cached_archive, pth_entry, source_entries
from trainer.image.wheels import install_wheels
from trainer.lock import imagelock
from trainer.signing import load_signer

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOCK_LABEL = "dev.recipe-bundle.lock.sha256"


@dataclass
class BuildResult:
    """``manifest_digest`` and ``config_digest`` ("sha256:<hex>"), ``layers`` as (name, diff_id, size bytes,
    "cached"/"built") and ``archive_digest`` when an archive was written."""

    manifest_digest: str
    config_digest: str
    layers: list[tuple[str, str, int, str]] = field(default_factory=list)
    archive_digest: str | None = None
    referrers: list[tuple[str, str]] = field(default_factory=list)  # (artifactType, manifest digest) attached


def _wheel_label(w: dict[str, Any]) -> str:
    return f"wheel {w['filename']}"


def plan_layers(
    lock: dict[str, Any], cache: Cache, bundle_root: Path, offline: bool, jobs: int = 1, console=None
) -> list[LayerPlan]:
    """The layers of ``lock`` in order (empty groups left out; build steps after ``sources``, see
    :mod:`trainer.image.native`, run with ``jobs`` parallel jobs). Raises :class:`UserError` for a base type this
    builder cannot produce or an sdist without a build step."""
    base = lock["base"]
    plans: list[LayerPlan] = []
    if base["type"] == "debian-rootfs":

        def make_base(spool: Path, handles: list[Any]) -> list[Entry]:
            debs = [
                (cache.ensure(d["sha256"], f"deb {d['name']}_{d['version']}_{d['architecture']}", d["url"], offline), d)
                for d in base["debs"]
            ]
            return rootfs_entries(debs, spool)

        if not base["debs"]:
            raise UserError(f"{lock['_path']}: base.debs is empty (run `trainer lock resolve` to pin the .debs)")
        packages = ", ".join(f"{d['name']}={d['version']}" for d in base["debs"])
        comment = f"debian {base.get('suite', '')} rootfs: {len(base['debs'])} packages ({packages})"[:1000]
        plans.append(LayerPlan("base", deb_inputs(base), comment, make_base, allow_absolute_symlinks=True))
    elif base["type"] not in ("scratch", "oci"):
        raise UserError(
            f"{lock['_path']}: base.type {base['type']!r} is not built by this version "
            "(scratch and debian-rootfs are); see lockfiles/README.md"
        )
    for group in imagelock.GROUPS:
        wheels = imagelock.wheels_in(lock, group)
        if not wheels:
            continue

        def make(spool: Path, handles: list[Any], wheels=wheels) -> list[Entry]:
            items = [
                (cache.ensure(w["sha256"], _wheel_label(w), w["url"], offline), w["filename"], _wheel_label(w))
                for w in wheels
            ]
            return install_wheels(items, lock["python"], spool, handles)

        inputs = [[w["name"], w["version"], w["filename"], w["sha256"]] for w in wheels]
        names = ", ".join(f"{w['name']}=={w['version']}" for w in wheels)
        plans.append(LayerPlan(group, inputs, f"{len(wheels)} wheels: {names}"[:1000], make))
    sources = sorted(lock.get("sources", []), key=lambda s: s["name"])
    # sdists are built by build steps (layers build-<name>, below), never shipped unbuilt
    unbuilt = native.unbuilt_sdists(lock)
    if unbuilt:
        raise UserError(
            f"{lock['_path']}: sdists {', '.join(unbuilt)} have no builds[] step "
            "(an sdist is built in the build root into a wheel, then installed; see lockfiles/README.md)"
        )
    if sources:

        def make_sources(spool: Path, handles: list[Any]) -> list[Entry]:
            entries: list[Entry] = []
            for src in sources:
                entries += source_entries(cached_archive(cache, src), src)
            pth = pth_entry(sources, lock["python"]["site_packages"])
            if pth is not None:
                entries.append(pth)
            return entries

        # a source's layer bytes follow from its tree (verified on unpacking), not from the archive it came in;
        # stated submodules join the key (only where there are some: other keys stay as recorded), so a lock
        # that changes one misses the cache and meets the tree check
        source_inputs: dict[str, Any] = {
            "sources": [
                [s["name"], s["commit"], s["tree"], s["dest"], bool(s.get("python_path"))]
                + ([s["submodules"]] if s.get("submodules") else [])
                for s in sources
            ],
            "sdists": [],
        }
        if any(s.get("python_path") for s in sources):
            source_inputs["pth"] = lock["python"]["site_packages"]
        comment = "git sources: " + ", ".join(f"{s['name']}@{s['commit'][:12]}" for s in sources)
        plans.append(LayerPlan("sources", source_inputs, comment, make_sources))
    plans += native.build_plans(lock, cache, offline, jobs, console)
    plans.append(
        LayerPlan(
            "bundle",
            None,
            f"conf/, the lock {lock['_path'].name} and {lock['bundle']['stamp']}",
            lambda spool, handles: [],
            cacheable=False,
        )
    )
    return plans


def stamp(lock: dict[str, Any], layers: list[tuple[str, str]]) -> bytes:
    """The stamped ``/etc/<project>/lock.json``: which lock built the image and what it pinned (canonical JSON)."""
    return (
        compact_json(
            {
                "project": PROJECT,
                "lock": {"name": lock["name"], "file": lock["_path"].name, "sha256": lock["_sha256"]},
                "epoch": lock["epoch"],
                "layers": [{"name": n, "diff_id": d} for n, d in layers],
                "python": {"version": lock["python"]["version"], "site_packages": lock["python"]["site_packages"]},
                "distributions": {w["name"]: w["version"] for w in lock.get("wheels", [])},
                "sdists": {s["name"]: s["version"] for s in lock.get("sdists", [])},
                "sources": {
                    s["name"]: {"commit": s["commit"], "tree": s["tree"], "url": s["url"], "dest": s["dest"]}
                    for s in lock.get("sources", [])
                },
                "base": lock["base"],
            }
        )
        + b"\n"
    )


def bundle_entries(lock: dict[str, Any], bundle_root: Path, built: list[tuple[str, str]]) -> list[Entry]:
    """The bundle layer: ``bundle.include`` paths of ``bundle_root``, the lock's bytes and the stamp."""
    dest = lock["bundle"]["dest"].strip("/")
    entries: list[Entry] = []
    for rel in lock["bundle"]["include"]:
        src = bundle_root / rel
        if src.is_dir():
            entries += [e for e in entries_from_tree(src, f"{dest}/{rel}") if "__pycache__" not in e.path.split("/")]
        elif src.is_file():
            entries.append(Entry(f"{dest}/{rel}", FILE, source=src))
        else:
            raise UserError(f"bundle.include {rel!r}: not found under {bundle_root}")
    entries.append(Entry(f"{dest}/lockfiles/{lock['_path'].name}", FILE, data=lock["_bytes"]))
    entries.append(Entry(lock["bundle"]["stamp"], FILE, data=stamp(lock, built)))
    return entries


PIPELINE_BYTES = 64 << 20  # layers at least this large are hashed and written by a second thread


def _write_cached_layer(
    cache: Cache, entries: list[Entry], epoch: int, label: str, console, allow_absolute_symlinks: bool = False
) -> tuple[str, int]:
    total = sum(e.size() for e in entries)
    tmp = cache.new_temp()
    big = total >= PIPELINE_BYTES
    try:
        with open(tmp, "wb", buffering=0) as handle:
            if console is not None and big and console.is_terminal:  # off a terminal a bar leaves blank lines
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                with Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    DownloadColumn(),
                    TransferSpeedColumn(),
                    console=console,
                    transient=True,
                ) as progress:
                    task = progress.add_task(f"writing layer {label}", total=total)
                    info = write_layer(
                        entries,
                        handle,
                        epoch,
                        allow_absolute_symlinks,
                        on_write=lambda n: progress.advance(task, n),
                        pipelined=True,
                    )
            else:
                info = write_layer(entries, handle, epoch, allow_absolute_symlinks, pipelined=big)
            handle.flush()
            os.fsync(handle.fileno())
        cache.commit(tmp, info.hex)
        return info.diff_id, info.size
    finally:
        tmp.unlink(missing_ok=True)


def _cached_layer_ok(cache: Cache, record: dict[str, Any], name: str, verify_cache: bool, console) -> bool:
    """Whether the cached layer of ``record`` is intact (stamp or full hash); a corrupt one is removed by the
    cache and rebuilt from its inputs (a layer is derived data, so this is not an error)."""
    try:
        return cache.get(record["diff_id"][7:], f"layer {name}", trust_stamp=not verify_cache) is not None
    except UserError as err:
        if console is not None:
            console.print(f"[yellow]{err}; rebuilding it[/yellow]", soft_wrap=True)
        return False


def make_config(
    lock: dict[str, Any], layers: list[Layer], revision: str, base_image: Any = None, base_count: int = 0
) -> dict[str, Any]:
    """The image config (OCI image-spec config.md) for ``layers`` (base layers first, ``base_count`` of them
    from ``base_image`` for an ``oci`` base): Env, Entrypoint, Cmd, WorkingDir and Labels from the lock's
    ``image`` block, the labels naming the bundle version, ``revision`` and the lock's sha256."""
    image = lock["image"]
    labels = {
        "org.opencontainers.image.version": __version__,
        **image["labels"],
        "org.opencontainers.image.revision": revision,
        LOCK_LABEL: lock["_sha256"],
    }
    # a scratch or Debian base has no config of its own: ours goes on an empty one of the lock's platform
    base = (
        base_image.config
        if base_image is not None
        else {"architecture": lock.get("platform", {}).get("architecture", "amd64"), "os": "linux"}
    )
    return based_config(
        base,
        base_count,
        layers[base_count:],
        lock["epoch"],
        image["env"],
        image.get("entrypoint", []),
        image.get("cmd", []),
        labels,
        image.get("working_dir", ""),
        DEFAULT_PATH,
    )


class PredictedDigests(TypedDict):
    """What :func:`predict_digests` returns: ``bundle`` (the bundle layer's diff_id), ``bundle_size`` (bytes),
    ``config_digest`` and ``manifest_digest`` ("sha256:<hex>" each)."""

    bundle: str
    bundle_size: int
    config_digest: str
    manifest_digest: str


def predict_digests(lock_path: Path, recorded: dict[str, Any], bundle_root: Path) -> PredictedDigests:
    """The digests a build of ``lock_path`` would give now, without its inputs: the layers below the bundle
    are taken from ``recorded`` (an ``expected-digests.json`` entry: their diff_ids and sizes follow from the
    lock alone), the bundle layer is rebuilt in memory from ``bundle_root``'s ``conf/``, then the config and
    manifest are made as :func:`build_image` makes them (with ``recorded["revision"]``).

    Returns {"bundle", "config_digest", "manifest_digest"} ("sha256:<hex>" each) and "bundle_size" (bytes).
    Raises :class:`UserError` for an ``oci`` base (its config comes from the base image's blobs) or a record whose
    layers do not match the lock's layer plan.
    """

    lock = imagelock.load_lock(lock_path)
    if lock["base"]["type"] == "oci":
        raise UserError(f"{lock_path}: an oci base's config comes from its blobs; build the image to check it")
    plans = plan_layers(lock, Cache(Path(tempfile.gettempdir()) / "unused-cache"), bundle_root, offline=True)
    names = [p.name for p in plans]
    rec = recorded.get("layers", [])
    if [r["name"] for r in rec] != names:
        raise UserError(f"{lock_path}: recorded layers {[r['name'] for r in rec]} do not match the lock's {names}")
    built = [(r["name"], r["diff_id"]) for r in rec[:-1]]
    info = write_layer(bundle_entries(lock, bundle_root, built), None, lock["epoch"])
    layers = [
        Layer(r["diff_id"], int(r["size"]), Path("/nonexistent"), p.name, p.comment, diff_id=r["diff_id"])
        for r, p in zip(rec[:-1], plans, strict=False)  # all but the bundle layer, the plans' last
    ]
    layers.append(
        Layer(info.diff_id, info.size, Path("/nonexistent"), "bundle", plans[-1].comment, diff_id=info.diff_id)
    )
    config_bytes = compact_json(make_config(lock, layers, recorded.get("revision", "unknown")))
    manifest = compact_json(image_manifest(config_bytes, layers, {}))
    return {
        "bundle": info.diff_id,
        "bundle_size": info.size,
        "config_digest": digest_of(config_bytes),
        "manifest_digest": digest_of(manifest),
    }


def layer_keys(lock: dict[str, Any], bundle_root: Path) -> dict[str, str]:
    """Layer name -> its cache key (:func:`layer_key`: the hash of everything that determines its bytes) for
    every layer of ``lock``, computed from the lock alone (nothing is read from a cache or downloaded)."""
    plans = plan_layers(lock, Cache(Path(tempfile.gettempdir()) / "unused-cache"), bundle_root, offline=True)
    return {plan.name: layer_key(lock, plan) for plan in plans}


def predicted_record(lock_path: Path, recorded: dict[str, Any], bundle_root: Path) -> dict[str, Any]:
    """An ``expected-digests.json`` entry for the lock at ``lock_path`` as a build would record it now, made
    without building (:func:`predict_digests`): ``recorded`` (the entry of an earlier build, or of an earlier
    prediction) with the lock's sha256, the new bundle layer, config and manifest digests and every layer's key.

    Only the bundle layer may have changed: every other layer's key (:func:`layer_keys`) must equal the one
    ``recorded`` holds, so that its recorded diff_id is still the one a build gives. An entry that records no
    keys yet is taken for the lock it records (its ``lock_sha256`` must be this lock's), and its keys are
    added. Raises :class:`UserError` naming the first layer whose inputs changed (build it instead) or a
    record made for another lock without keys.
    """
    lock = imagelock.load_lock(lock_path)
    keys = layer_keys(lock, bundle_root)
    layers = recorded.get("layers", [])
    if any("key" not in layer for layer in layers[:-1]):
        if recorded.get("lock_sha256") != lock["_sha256"]:
            raise UserError(
                f"{lock_path}: the recorded build of {lock['name']!r} names no layer keys and was made "
                f"from lock sha256 {str(recorded.get('lock_sha256'))[:12]}, not this lock's "
                f"{lock['_sha256'][:12]}: build the image and record it"
            )
    else:
        for layer in layers[:-1]:
            if keys.get(layer["name"]) != layer["key"]:
                raise UserError(
                    f"{lock_path}: layer {layer['name']}'s inputs changed since its build was recorded "
                    f"(key {str(keys.get(layer['name']))[:12]}, recorded {layer['key'][:12]}): only the "
                    f"bundle layer can be predicted; build the image and record it"
                )
    predicted = predict_digests(lock_path, recorded, bundle_root)
    new_layers = [{**layer, "key": keys[layer["name"]]} for layer in layers[:-1]]
    new_layers.append(
        {
            "name": layers[-1]["name"],
            "diff_id": predicted["bundle"],
            "size": predicted["bundle_size"],
            "key": keys[layers[-1]["name"]],
        }
    )
    return {
        **recorded,
        "lock": Path(lock_path).name,
        "lock_sha256": lock["_sha256"],
        "manifest_digest": predicted["manifest_digest"],
        "config_digest": predicted["config_digest"],
        "layers": new_layers,
        "recorded_by": "prediction",
    }


def realize_layer(
    lock: dict[str, Any],
    plan: LayerPlan,
    cache: Cache,
    spool: Path,
    console=None,
    verify_cache: bool = False,
    substituters: tuple[Remote, ...] = (),
) -> tuple[str, int, str]:
    """The layer of ``plan``: the cached one under its key (:func:`layer_key`) when intact, else the first
    ``substituters`` entry for that key that verifies (:meth:`trainer.image.remote.Remote.fetch`; a refused one is
    said in one line and skipped), else made, written into the cache and recorded. Returns (diff_id, size in
    bytes, "cached", "substituted" or "built"); ``spool`` is emptied after a build. Raises :class:`UserError`
    from ``plan.make`` (nothing is recorded then)."""
    key = layer_key(lock, plan)
    record = cache.layer_record(key) if plan.cacheable else None
    if record is not None and _cached_layer_ok(cache, record, plan.name, verify_cache, console):
        return record["diff_id"], int(record["size"]), "cached"
    from rich.markup import escape

    for remote in substituters if plan.cacheable else ():
        try:
            got = remote.fetch(cache, key, plan.name)
            return got["diff_id"], int(got["size"]), "substituted"
        except UserError as err:
            if console is not None:
                console.print(f"[yellow]{escape(str(err))}; not used[/yellow]", soft_wrap=True, highlight=False)
    if plan.make is None:
        raise ValueError(f"layer {plan.name}: a plan made only for its key cannot be built")
    handles: list[Any] = []
    try:
        entries = plan.make(spool, handles)
        diff_id, size = _write_cached_layer(
            cache, entries, lock["epoch"], plan.name, console, plan.allow_absolute_symlinks
        )
    finally:
        for handle in handles:
            handle.close()
    cache.put_layer_record(key, {"diff_id": diff_id, "size": size, "layer": plan.name})
    for child in spool.iterdir():
        child.unlink()
    return diff_id, size, "built"


def build_image(
    lock_path: Path,
    out: Path,
    cache: Cache,
    bundle_root: Path,
    archive: Path | None = None,
    revision: str = "unknown",
    offline: bool = False,
    console=None,
    verify_cache: bool = False,
    sign_key: Path | None = None,
    jobs: int = 1,
    substituters: tuple[Remote, ...] = (),
) -> BuildResult:
    """Build the image of the lock at ``lock_path`` into the OCI layout ``out`` (and ``archive``).

    ``bundle_root``: the directory whose ``conf/`` (``bundle.include``) goes into the bundle layer;
    ``revision``: the ``org.opencontainers.image.revision`` label; ``offline``: never download;
    ``verify_cache``: re-hash cached layers in full even when their stamp matches (see :mod:`trainer.image.cas`);
    ``sign_key``: a private key (``trainer keygen``) that signs the provenance (a DSSE envelope). The SBOMs and
    the provenance are attached as OCI 1.1 referrers (:mod:`trainer.image.referrers`).
    ``jobs``: parallel jobs of build steps (``BUILD_JOBS``; not part of any key); ``substituters``: binary caches
    a layer missing from ``cache`` is taken from when a trusted, intact entry is there (:mod:`trainer.image.remote`).
    Raises :class:`UserError` for a bad lock, a missing or tampered input, a refused wheel or archive, or a
    failing build step; nothing is written to ``out`` then.
    """
    lock = imagelock.load_lock(lock_path)
    signer = None
    if sign_key is not None:
        signer = load_signer(sign_key)  # a bad key is refused before anything is built
    base_image = None
    layers: list[Layer] = []
    if lock["base"]["type"] == "oci":
        base_image = load_base(cache, lock["base"], lock.get("platform", {}), str(lock_path))
        layers = [
            Layer(b["digest"], b["size"], b["path"], "base", media_type=b["mediaType"], diff_id=b["diff_id"])
            for b in base_image.layers
        ]
        if console is not None:
            console.print(
                f"base  {lock['base']['reference']}  manifest {base_image.manifest_digest}: "
                f"{len(layers)} layers, {sum(layer.size for layer in layers):,} bytes, verified",
                soft_wrap=True,
            )
    base_count = len(layers)
    plans = plan_layers(lock, cache, bundle_root, offline, jobs, console)
    result_layers: list[tuple[str, str, int, str]] = []
    built: list[tuple[str, str]] = []
    spool = Path(tempfile.mkdtemp(prefix="spool-", dir=cache.tmp_dir()))
    try:
        for plan in plans:
            if plan.name == "bundle":
                entries = bundle_entries(lock, bundle_root, built)
                diff_id, size = _write_cached_layer(cache, entries, lock["epoch"], plan.name, console)
                status = "built"
            else:
                diff_id, size, status = realize_layer(lock, plan, cache, spool, console, verify_cache, substituters)
                built.append((plan.name, diff_id))
            if console is not None:
                console.print(f"layer {plan.name:<12} {diff_id}  {size:>12,} bytes  {status}", soft_wrap=True)
            layers.append(Layer(diff_id, size, cache.blob_path(diff_id[7:]), plan.name, plan.comment, diff_id=diff_id))
            result_layers.append((plan.name, diff_id, size, status))
    finally:
        shutil.rmtree(spool, ignore_errors=True)

    config = make_config(lock, layers, revision, base_image, base_count)
    checked = {layer.digest[7:]: cache.blob_path(layer.digest[7:]).stat() for layer in layers}
    attached: list[tuple[str, str]] = []

    def attach(subject: dict[str, Any]):
        ours = [(name, diff_id) for name, diff_id, _, _ in result_layers]
        documents = referrers.documents(lock, subject["digest"], revision, ours, bundle_root, signer)
        made = [referrers.referrer(doc, subject, lock["epoch"]) for doc in documents]
        attached.extend((descriptor["artifactType"], descriptor["digest"]) for descriptor, _, _ in made)
        return made

    digest = write_layout(
        out, config, layers, {}, lambda layer, dest: cache.link_or_copy(layer.digest[7:], dest), attach
    )
    for hexdigest, before in checked.items():
        # linking into (and removing the old) layout moved ctime; re-stamp only if the bytes' size and mtime are
        # those just checked (a write in between would change mtime; ctime alone moves on link/unlink)
        now = cache.blob_path(hexdigest).stat()
        if (now.st_size, now.st_mtime_ns, now.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino):
            cache.stamp(hexdigest)
    result = BuildResult(
        digest, "sha256:" + hashlib.sha256(compact_json(config)).hexdigest(), result_layers, referrers=attached
    )
    if archive is not None:
        result.archive_digest = write_archive(out, archive, lock["epoch"])
    return result
