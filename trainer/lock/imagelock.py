"""Image locks: every input of an image, pinned by URL (or registry reference) and sha256.

A lock is one JSON file (``lockfiles/*.lock.json``); builds read only the lock, ``trainer lock resolve``
writes it, ``trainer lock verify`` checks it offline. Format (``schema_version`` 1)::

    {
      "schema_version": 1,
      "kind": "recipe-bundle.image-lock",
      "name": "smoke",                        # image name; also the file name stem
      "epoch": 1767225600,                    # mtime of every file and the config's "created" (seconds, UTC)
      "platform": {"os": "linux", "architecture": "amd64"},
      "python": {"version": "3.12", "platform": "x86_64-manylinux_2_28",
                 "prefix": "/usr/local",                          # scripts go to PREFIX/bin, data to PREFIX
                 "site_packages": "/usr/local/lib/python3.12/site-packages",
                 "interpreter": "/usr/local/bin/python3.12"},      # the shebang of console scripts
      "base": {"type": "scratch"}                                 # nothing below our layers (smoke)
            | {"type": "oci", "reference": "NAME:TAG@sha256:...", "digest": "sha256:...",  # the real recipe
               "config_digest"?: "sha256:...", "platform_manifest"?: "sha256:...",       # once resolved by
               "layers"?: [{"digest", "mediaType", "size", "diff_id"}, ...]}              # `cache add-image`
            | {"type": "debian-rootfs", "suite": "bookworm", "variant": "essential",
               "debs": [{"name", "version", "architecture", "url", "sha256"}, ...]},        # buildable variant
      "wheels": [{"name", "version", "filename", "url", "sha256", "group"}, ...],
      "sdists": [{"name", "version", "filename", "url", "sha256", "group"}, ...],   # each built by a builds[] step
      "sources": [{"name", "url", "commit", "tree", "dest",            # git sources by commit + git tree id
                   "python_path"?: true,                              # dest goes on the image Python's path
                   "archive"?: {"filename", "sha256", "url"?}}, ...],  # optional: pin one archive's bytes too
      "build_root"?: {...}, "builds"?: [...],  # build steps: trainer.image.buildroot, trainer.image.native
      "bundle": {"dest": "/opt/recipe-bundle", "include": ["conf"], "stamp": "/etc/recipe-bundle/lock.json"},
      "image": {"env": {...}, "entrypoint": [...], "cmd"?: [...], "working_dir": "...",
                "labels": {"org.opencontainers.image.source": "...", ...}},
      "stack": "lockfiles/stack.json",         # optional: the stack pins this lock must agree with
      "resolved_from": {"requirements": "smoke.in", "sha256": "...",   # what `trainer lock resolve` read: the
                        "python_version": "3.12", "python_platform": "x86_64-manylinux_2_28",   # requirements
                        "index_url": "https://pypi.org/simple"}   # (path from the lock's folder) and its options
    }

``resolved_from`` makes a lock know its inputs (as uv's ``--locked`` does): :func:`stale_inputs` says when the
requirements file changed since the lock was resolved, and ``trainer lock verify``, ``trainer image build`` and
``train`` refuse such a lock (``--frozen`` uses it as it is, on purpose).

``group`` puts a wheel or sdist into one of the Python layers, in this order: ``cuda-runtime``, ``torch``,
``te``, ``rest``. Layers, bottom to top: base, the Python groups (only those with entries), ``sources``
(git sources and sdists), ``bundle`` (``conf/``, the lock itself and the stamped lock summary).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.inputs import decode, open_regular, parse_json, read_bytes, read_text, reading

SCHEMA_VERSION = 1
KIND = "recipe-bundle.image-lock"
GROUPS = ("cuda-runtime", "torch", "te", "rest")
BASE_TYPES = ("scratch", "oci", "debian-rootfs")
HEX40 = re.compile(r"^[0-9a-f]{40}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


def canonical_name(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def load_lock(path: Path) -> dict[str, Any]:
    """Read and validate the lock at ``path``; return it with ``_sha256`` (of its bytes) and ``_path`` added.

    Raises :class:`UserError` with the file and field for every defect (see :func:`validate_lock`).
    """
    path = Path(path)
    with reading(path, missing=f"{path}: lock not found"):  # a directory: open_regular names it
        raw = read_bytes(path, "lock")  # a FIFO refused without blocking, 64 MiB at most
    lock = parse_json(decode(raw, str(path), "lock"), str(path))
    validate_lock(lock, str(path))
    lock["_sha256"] = hashlib.sha256(raw).hexdigest()
    lock["_path"] = path
    lock["_bytes"] = raw
    return lock


def _need(obj: dict[str, Any], key: str, kind, where: str) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        expected = getattr(kind, "__name__", str(kind))
        raise UserError(f"{where}.{key}: expected {expected}, got {json.dumps(value)}")
    return value


def _sha(obj: dict[str, Any], key: str, where: str) -> str:
    value = _need(obj, key, str, where)
    if not HEX64.match(value):
        raise UserError(f"{where}.{key}: expected a sha256 (64 lowercase hex digits), got {value!r}")
    return value


def validate_lock(lock: Any, where: str = "lock") -> None:
    """Check a parsed lock: fields and types, every artifact hashed, no duplicate names, files or hashes.

    Raises :class:`UserError` naming ``where`` and the field (``wheels[3].sha256``) and what was expected.
    """
    if not isinstance(lock, dict):
        raise UserError(f"{where}: expected a JSON object")
    if lock.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{where}: schema_version {lock.get('schema_version')!r} (expected {SCHEMA_VERSION})")
    if lock.get("kind") != KIND:
        raise UserError(f"{where}: kind {lock.get('kind')!r} (expected {KIND!r})")
    name = _need(lock, "name", str, where)
    if not NAME.match(name):
        raise UserError(f"{where}.name: {name!r} is not a simple name")
    epoch = _need(lock, "epoch", int, where)
    if epoch < 0:
        raise UserError(f"{where}.epoch: expected seconds since 1970 (>= 0), got {epoch}")
    python = _need(lock, "python", dict, where)
    for key in ("version", "platform", "prefix", "site_packages", "interpreter"):
        value = _need(python, key, str, f"{where}.python")
        if key in ("prefix", "site_packages", "interpreter") and not value.startswith("/"):
            raise UserError(f"{where}.python.{key}: expected an absolute path in the image, got {value!r}")
    base = _need(lock, "base", dict, where)
    if base.get("type") not in BASE_TYPES:
        raise UserError(f"{where}.base.type: {base.get('type')!r} (expected one of {', '.join(BASE_TYPES)})")
    if base["type"] == "oci":
        ref = _need(base, "reference", str, f"{where}.base")
        digest = _need(base, "digest", str, f"{where}.base")
        if not digest.startswith("sha256:") or not HEX64.match(digest[7:]) or not ref.endswith("@" + digest):
            raise UserError(f"{where}.base: reference {ref!r} must end with @<digest> and digest be sha256:<hex>")
        for key in ("config_digest", "platform_manifest"):
            if key in base and not (
                isinstance(base[key], str) and base[key].startswith("sha256:") and HEX64.match(base[key][7:])
            ):
                raise UserError(f"{where}.base.{key}: expected sha256:<64 hex>, got {json.dumps(base[key])}")
        for i, layer in enumerate(_need(base, "layers", list, f"{where}.base") if "layers" in base else []):
            w = f"{where}.base.layers[{i}]"
            _need(layer, "mediaType", str, w)
            _need(layer, "size", int, w)
            for key in ("digest", "diff_id"):
                value = _need(layer, key, str, w)
                if not value.startswith("sha256:") or not HEX64.match(value[7:]):
                    raise UserError(f"{w}.{key}: expected sha256:<64 hex>, got {value!r}")
    if base["type"] == "debian-rootfs":
        debs = _need(base, "debs", list, f"{where}.base")
        seen: dict[str, int] = {}
        for i, deb in enumerate(debs):
            w = f"{where}.base.debs[{i}]"
            for key in ("name", "version", "architecture", "url"):
                _need(deb, key, str, w)
            _sha(deb, "sha256", w)
            if deb["name"] in seen:
                raise UserError(f"{w}.name: {deb['name']!r} duplicates debs[{seen[deb['name']]}]")
            seen[deb["name"]] = i
    names: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for section in ("wheels", "sdists"):
        items = lock.get(section, [])
        if not isinstance(items, list):
            raise UserError(f"{where}.{section}: expected a list")
        for i, item in enumerate(items):
            w = f"{where}.{section}[{i}]"
            for key in ("name", "version", "filename", "url"):
                _need(item, key, str, w)
            sha = _sha(item, "sha256", w)
            if item.get("group") not in GROUPS:
                raise UserError(f"{w}.group: {item.get('group')!r} (expected one of {', '.join(GROUPS)})")
            suffix = ".whl" if section == "wheels" else (".tar.gz", ".zip")
            if not item["filename"].endswith(suffix) or "/" in item["filename"]:
                raise UserError(f"{w}.filename: {item['filename']!r} is not a {section[:-1]} file name")
            key = f"{section}:{canonical_name(item['name'])}"
            if key in names:
                raise UserError(f"{w}.name: {item['name']!r} is locked twice (also {names[key]})")
            names[key] = w
            if sha in hashes:
                raise UserError(f"{w}.sha256: same hash as {hashes[sha]}")
            hashes[sha] = w
    sources = lock.get("sources", [])
    if not isinstance(sources, list):
        raise UserError(f"{where}.sources: expected a list")
    dests: dict[str, str] = {}
    trees: dict[str, str] = {}
    for i, src in enumerate(sources):
        w = f"{where}.sources[{i}]"
        for key in ("name", "url", "dest"):
            _need(src, key, str, w)
        for key in ("commit", "tree"):
            if not HEX40.match(str(src.get(key, ""))):
                raise UserError(f"{w}.{key}: expected a full 40-hex git id, got {src.get(key)!r}")
        if "archive" in src:  # optional: the tree is what is verified; an archive pins its own bytes too
            archive = _need(src, "archive", dict, w)
            _need(archive, "filename", str, f"{w}.archive")
            sha = _sha(archive, "sha256", f"{w}.archive")
            if sha in hashes:
                raise UserError(f"{w}.archive.sha256: same hash as {hashes[sha]}")
            hashes[sha] = w
            if "url" in archive and not isinstance(archive["url"], str):
                raise UserError(f"{w}.archive.url: expected a string")
        submodules = src.get("submodules", {})  # the tree's gitlinks: path -> the submodule's commit
        if not isinstance(submodules, dict) or not all(
            isinstance(k, str)
            and k
            and not k.startswith("/")
            and ".." not in k.split("/")
            and isinstance(v, str)
            and HEX40.match(v)
            for k, v in submodules.items()
        ):
            raise UserError(
                f"{w}.submodules: expected {{relative path: the submodule's 40-hex commit}}, got "
                f"{json.dumps(submodules)}"
            )
        if not isinstance(src.get("python_path", False), bool):
            raise UserError(f"{w}.python_path: expected true or false, got {json.dumps(src.get('python_path'))}")
        if src["tree"] in trees:
            raise UserError(f"{w}.tree: same tree as {trees[src['tree']]}")
        trees[src["tree"]] = w
        if (
            not src["dest"].startswith("/")
            or ".." in src["dest"].split("/")
            or any(c.isspace() or ord(c) < 32 for c in src["dest"])
        ):
            raise UserError(
                f"{w}.dest: expected an absolute path without '..', whitespace or control characters, "
                f"got {src['dest']!r}"
            )
        if src["name"] in dests or src["dest"] in dests.values():
            raise UserError(f"{w}: name or dest duplicates another source")
        dests[src["name"]] = src["dest"]
    bundle = _need(lock, "bundle", dict, where)
    for key in ("dest", "stamp"):
        if not _need(bundle, key, str, f"{where}.bundle").startswith("/"):
            raise UserError(f"{where}.bundle.{key}: expected an absolute path in the image")
    include = _need(bundle, "include", list, f"{where}.bundle")
    for item in include:
        if not isinstance(item, str) or item.startswith("/") or ".." in item.split("/"):
            raise UserError(f"{where}.bundle.include: {item!r} is not a relative path inside the bundle")
    image = _need(lock, "image", dict, where)
    env = _need(image, "env", dict, f"{where}.image")
    for key, value in env.items():
        if not isinstance(value, str) or "=" in key:
            raise UserError(f"{where}.image.env.{key}: expected a string value and a name without '='")
    for key in ("entrypoint", "cmd"):
        value = image.get(key, [])
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise UserError(f"{where}.image.{key}: expected a list of strings")
    labels = _need(image, "labels", dict, f"{where}.image")
    if not all(isinstance(v, str) for v in labels.values()):
        raise UserError(f"{where}.image.labels: expected string values")
    validate_builds(lock, where)  # build_root and builds (built by trainer.image.buildroot, trainer.image.native)
    if RESOLVED_FROM in lock:
        _validate_resolved_from(lock, where)


def public(lock: dict[str, Any]) -> dict[str, Any]:
    """The lock without the fields :func:`load_lock` adds (``_sha256``, ``_path``, ``_bytes``)."""
    return {k: v for k, v in lock.items() if not k.startswith("_")}


def wheels_in(lock: dict[str, Any], group: str) -> list[dict[str, Any]]:
    """The wheels of ``group``, sorted by canonical name (the install order inside a layer)."""
    return sorted((w for w in lock.get("wheels", []) if w["group"] == group), key=lambda w: canonical_name(w["name"]))


def find_stack_consistency(lock: dict[str, Any], stack: dict[str, Any]) -> list[str]:
    """Differences between the lock and the stack pins (``lockfiles/stack.json`` data): a list of one-line
    messages (empty when consistent). A pinned package (``components.*.packages``, "name==version") locked
    in ``wheels`` or ``sdists`` must have that version; a git component in ``sources`` must have that commit
    and tree; an oci base must be the stack's ``base_image`` reference."""
    problems: list[str] = []
    locked = {canonical_name(w["name"]): w["version"] for w in lock.get("wheels", []) + lock.get("sdists", [])}
    for comp_name, comp in stack.get("components", {}).items():
        for spec in comp.get("packages", []):
            pkg, _, version = spec.partition("==")
            have = locked.get(canonical_name(pkg))
            if have is not None and have.split("+")[0] != version.split("+")[0]:
                problems.append(f"{pkg}: lock has {have}, stack.json components.{comp_name} pins {version}")
        if "commit" in comp:
            for src in lock.get("sources", []):
                if src["name"] == comp_name and (
                    src["commit"] != comp["commit"] or src["tree"] != comp.get("tree", src["tree"])
                ):
                    problems.append(f"sources {comp_name}: lock has {src['commit']}, stack.json pins {comp['commit']}")
    base = lock.get("base", {})
    ref = stack.get("components", {}).get("base_image", {}).get("reference")
    if base.get("type") == "oci" and ref and base.get("reference") != ref:
        problems.append(f"base: lock has {base.get('reference')}, stack.json pins {ref}")
    return problems


def inputs_of(lock: dict[str, Any], sources: bool = True) -> list[dict[str, Any]]:
    """Every artifact a build of ``lock`` reads, as [{"label", "sha256", "url", "size"}] (url None for
    artifacts no build downloads, e.g. git archives; size None when the lock does not record it): the base's
    .debs, wheels, sdists and (with ``sources``) the git source archives the lock pins by sha256,
    then the build root's .debs and wheels, in that order."""
    out: list[dict[str, Any]] = []
    for deb in lock.get("base", {}).get("debs", []) if lock.get("base", {}).get("type") == "debian-rootfs" else []:
        out.append(
            {
                "label": f"deb {deb['name']}_{deb['version']}_{deb['architecture']}",
                "sha256": deb["sha256"],
                "url": deb["url"],
                "size": deb.get("size"),
            }
        )
    for w in lock.get("wheels", []):
        out.append({"label": f"wheel {w['filename']}", "sha256": w["sha256"], "url": w["url"], "size": None})
    for sd in lock.get("sdists", []):
        out.append({"label": f"sdist {sd['filename']}", "sha256": sd["sha256"], "url": sd["url"], "size": None})
    for src in lock.get("sources", []) if sources else []:
        if "archive" in src:  # a source pinned by its tree only is seeded by tree id (trainer.image.sources)
            out.append(
                {
                    "label": f"source {src['name']} ({src['archive']['filename']})",
                    "sha256": src["archive"]["sha256"],
                    "url": src["archive"].get("url"),
                    "size": None,
                }
            )
    root = lock.get("build_root", {})
    for deb in root.get("debs", []):
        out.append(
            {
                "label": f"deb {deb['name']}_{deb['version']}_{deb['architecture']} (build root)",
                "sha256": deb["sha256"],
                "url": deb["url"],
                "size": deb.get("size"),
            }
        )
    for w in root.get("wheels", []):
        out.append(
            {"label": f"wheel {w['filename']} (build root)", "sha256": w["sha256"], "url": w["url"], "size": None}
        )
    return out


RESOLVED_FROM = "resolved_from"
RESOLVER_OPTIONS = ("python_version", "python_platform", "index_url")


def resolved_from(
    requirements: Path, lock_path: Path, python_version: str, python_platform: str, index_url: str
) -> dict[str, str]:
    """The ``resolved_from`` block of a lock written to ``lock_path`` by resolving ``requirements``: the
    requirements file's path relative to the lock's folder (so a clone anywhere checks it), its sha256 and the
    resolver's options. Raises ``OSError`` when the requirements file cannot be read."""
    requirements, lock_dir = Path(requirements).absolute(), Path(lock_path).absolute().parent
    return {
        "requirements": os.path.relpath(requirements, lock_dir),
        "sha256": hashlib.sha256(requirements.read_bytes()).hexdigest(),
        "python_version": python_version,
        "python_platform": python_platform,
        "index_url": index_url,
    }


def resolve_command(lock_path: Path, inputs: dict[str, str]) -> str:
    """The command that re-resolves the lock at ``lock_path`` from its ``resolved_from`` ``inputs``."""
    requirements = Path(lock_path).parent / inputs["requirements"]
    return (
        f"trainer lock resolve --requirements {os.path.normpath(requirements)} --template {lock_path} "
        f"--out {lock_path} --python-version {inputs['python_version']} "
        f"--python-platform {inputs['python_platform']}"
    )


def stale_inputs(lock: dict[str, Any]) -> Any:
    """Why the lock (as :func:`load_lock` returns it) no longer follows its inputs, as one line naming the
    requirements file, both sha256s and the command that re-resolves it; None when it does, and None for a
    lock that records no ``resolved_from`` (one written by hand: nothing to compare)."""
    inputs = lock.get(RESOLVED_FROM)
    if inputs is None:
        return None
    lock_path = Path(lock["_path"])
    requirements = lock_path.parent / inputs["requirements"]
    try:
        have = hashlib.sha256(read_text(requirements, "requirements file").encode()).hexdigest()
    except FileNotFoundError:
        return (
            f"{lock_path}: resolved from {os.path.normpath(requirements)}, which is missing "
            f"(restore it, or pass --frozen to use the lock as it is)"
        )
    if have == inputs["sha256"]:
        return None
    return (
        f"{lock_path}: {os.path.normpath(requirements)} changed since the lock was resolved (sha256 "
        f"{have[:12]}, the lock's {inputs['sha256'][:12]}): re-resolve with `{resolve_command(lock_path, inputs)}`"
        f", or pass --frozen to use the lock as it is"
    )


def _validate_resolved_from(lock: dict[str, Any], where: str) -> None:
    inputs = _need(lock, RESOLVED_FROM, dict, where)
    w = f"{where}.{RESOLVED_FROM}"
    rel = _need(inputs, "requirements", str, w)
    if rel.startswith("/") or "\0" in rel:
        raise UserError(f"{w}.requirements: expected a path relative to the lock's folder, got {rel!r}")
    _sha(inputs, "sha256", w)
    for key in RESOLVER_OPTIONS:
        _need(inputs, key, str, w)


# The first line of a requirements-format lock (lockfiles/launcher.lock, written by bin/lock-launcher): what it was
# resolved from, so that it knows its inputs as an image lock's resolved_from does.
REQUIREMENTS_HEADER = re.compile(
    r"^# resolved from (?P<requirements>\S+) sha256:(?P<sha256>[0-9a-f]{64})"
    r" with: (?P<command>.+)$"
)


def stale_requirements_lock(path: Path, requirements_name: str = "") -> Any:
    """Why the requirements-format lock at ``path`` (pip's ``--require-hashes`` format, first line
    :data:`REQUIREMENTS_HEADER`) no longer follows the requirements file it was resolved from, as one line with
    the command that re-resolves it; None when it does. ``requirements_name``: the file it must be resolved from
    (``launcher.in``; always one beside it). Raises :class:`UserError` for a lock without that first line (it
    cannot be checked) or naming another file, and ``OSError`` when it cannot be read."""
    path = Path(path)
    with open_regular(path, "lock", None) as handle:  # a FIFO refused without blocking
        first = handle.readline(4096).decode("utf-8", "replace").rstrip("\n")
    header = REQUIREMENTS_HEADER.match(first)
    if header is None:
        raise UserError(
            f"{path}: line 1 does not say what the lock was resolved from (expected '# resolved from "
            f"FILE.in sha256:<hex> with: COMMAND'; re-resolve it with bin/lock-launcher)"
        )
    named = header["requirements"]
    if "/" in named or named in (".", "..") or (requirements_name and named != requirements_name):
        raise UserError(
            f"{path}: line 1 names {named!r}; a lock is resolved from its own requirements file "
            f"beside it ({requirements_name or 'FILE.in'}): re-resolve it with bin/lock-launcher"
        )
    requirements = path.parent / header["requirements"]
    try:
        have = hashlib.sha256(read_text(requirements, "requirements file").encode()).hexdigest()
    except FileNotFoundError:
        return f"{path}: resolved from {os.path.normpath(requirements)}, which is missing"
    if have == header["sha256"]:
        return None
    return (
        f"{path}: {os.path.normpath(requirements)} changed since the lock was resolved (sha256 {have[:12]}, "
        f"the lock's {header['sha256'][:12]}): re-resolve with `{header['command']}`, or pass --frozen to use "
        "the lock as it is"
    )


PYTHON_KEYS = ("version", "prefix", "site_packages", "interpreter")

INSTALL_TYPES = ("tree", "wheel")


def validate_build_root(block: Any, where: str) -> None:
    """Check a ``build_root`` block (see the module docstring). Raises :class:`UserError` naming the field."""
    if not isinstance(block, dict):
        raise UserError(f"{where}: expected an object")
    _need(block, "suite", str, where)
    debs = _need(block, "debs", list, where)
    for i, deb in enumerate(debs):
        for key in ("name", "version", "architecture", "url"):
            _need(deb, key, str, f"{where}.debs[{i}]")
        _sha(deb, "sha256", f"{where}.debs[{i}]")
    links = block.get("links", {})
    if not isinstance(links, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and not k.startswith("/") and ".." not in k.split("/")
        for k, v in links.items()
    ):
        raise UserError(
            f"{where}.links: expected {{relative path: symlink target}} (what update-alternatives would make)"
        )
    python = _need(block, "python", dict, where)
    for key in PYTHON_KEYS:
        if not _need(python, key, str, f"{where}.python").strip():
            raise UserError(f"{where}.python.{key}: expected a non-empty string")
    if not python["site_packages"].startswith(python["prefix"].rstrip("/") + "/"):
        raise UserError(f"{where}.python.site_packages: expected a directory under python.prefix {python['prefix']!r}")
    seen = set()
    for i, wheel in enumerate(block.get("wheels", [])):
        w = f"{where}.wheels[{i}]"
        for key in ("name", "version", "filename", "url"):
            _need(wheel, key, str, w)
        _sha(wheel, "sha256", w)
        if not wheel["filename"].endswith(".whl"):
            raise UserError(f"{w}.filename: {wheel['filename']!r} is not a wheel file name")
        if wheel["name"] in seen:
            raise UserError(f"{w}.name: {wheel['name']!r} is listed twice")
        seen.add(wheel["name"])


def wheel_items(lock: dict[str, Any], names: Sequence[str], where: str) -> list[dict[str, Any]]:
    """The wheel lock items of ``names``, each looked up in ``build_root.wheels`` first, then in the image's
    ``wheels``; sorted by canonical name. Raises :class:`UserError` for a name in neither."""
    pool: dict[str, dict[str, Any]] = {}
    for w in lock.get("wheels", []) + lock.get("build_root", {}).get("wheels", []):
        pool[canonical_name(w["name"])] = w
    items = []
    for name in names:
        item = pool.get(canonical_name(name))
        if item is None:
            raise UserError(f"{where}: wheel {name!r} is neither in build_root.wheels nor in wheels")
        items.append(item)
    return sorted(items, key=lambda w: canonical_name(w["name"]))


def validate_builds(lock: dict[str, Any], where: str) -> None:
    """Check ``lock['builds']`` and ``lock['build_root']`` (see the module docstring). Raises :class:`UserError`
    naming the field: an unknown input, a step without a build root, a bad command, env or install."""
    builds = lock.get("builds", [])
    if not isinstance(builds, list):
        raise UserError(f"{where}.builds: expected a list")
    if "build_root" in lock:
        validate_build_root(lock["build_root"], f"{where}.build_root")
    elif builds:
        raise UserError(f"{where}.build_root: missing (builds need a build root of pinned .debs)")
    sources = {s.get("name") for s in lock.get("sources", [])}
    sdists = {canonical_name(s.get("name", "")) for s in lock.get("sdists", [])}
    names = set()
    for i, step in enumerate(builds):
        w = f"{where}.builds[{i}]"
        name = _need(step, "name", str, w)
        if not NAME.match(name) or name in names:
            raise UserError(f"{w}.name: {name!r} is not a simple name or is used twice")
        names.add(name)
        spec = _need(step, "input", dict, w)
        if set(spec) == {"source"}:
            if spec["source"] not in sources:
                raise UserError(f"{w}.input.source: {spec['source']!r} is not a sources[] name")
        elif set(spec) == {"sdist"}:
            if canonical_name(str(spec["sdist"])) not in sdists:
                raise UserError(f"{w}.input.sdist: {spec['sdist']!r} is not an sdists[] name")
        else:
            raise UserError(f'{w}.input: expected {{"source": NAME}} or {{"sdist": NAME}}, got {spec!r}')
        command = _need(step, "command", list, w)
        if not command or not all(isinstance(x, str) for x in command) or not command[0].startswith("/"):
            raise UserError(f"{w}.command: expected a list of strings starting with an absolute program path")
        env = step.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "=" not in k for k, v in env.items()
        ):
            raise UserError(f"{w}.env: expected string values and names without '='")
        wheels = step.get("wheels", [])
        if not isinstance(wheels, list) or not all(isinstance(x, str) for x in wheels):
            raise UserError(f"{w}.wheels: expected a list of wheel names")
        wheel_items(lock, wheels, f"{w}.wheels")
        install = _need(step, "install", dict, w)
        if install.get("type") not in INSTALL_TYPES:
            raise UserError(f"{w}.install.type: {install.get('type')!r} (expected one of {', '.join(INSTALL_TYPES)})")
        if install["type"] == "tree":
            dest = _need(install, "dest", str, f"{w}.install")
            if not dest.startswith("/") or ".." in dest.split("/"):
                raise UserError(f"{w}.install.dest: expected an absolute path without '..', got {dest!r}")
