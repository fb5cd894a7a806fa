"""``trainer image diff A B``: are two images the same, and if not, what differs — down to the package and file.

Two images (OCI layout, oci-archive or docker-archive) are identical when their config digests and layer
diff_ids are equal (an OCI layout and the docker-archive skopeo made from it are identical). Otherwise the
report lists: config differences (architecture, created, Env by name, Entrypoint, Cmd, WorkingDir, Labels),
layers aligned by diff_id (unmatched layers paired by their history's ``created_by``, else by position) with
per-layer file changes (added/removed/changed, with size and sha256), Python distributions that differ
(from ``*.dist-info/METADATA`` under any ``site-packages/`` or ``dist-packages/`` directory, where CPython
and Debian's Python find them, in the merged filesystem), Debian packages that differ (from the dpkg
database, ``var/lib/dpkg/status``) and git sources whose commit or tree differs (from the stamped
``/etc/recipe-bundle/lock.json``) and, when both images carry SPDX SBOMs (OCI 1.1 referrers),
every package whose version or sha256 differs between them (by purl; .debs, wheels, sdists, sources, builds).

Image vs run record: the record's ``image`` field (``{"digest", "lock"}``, written when a run happens inside
a bundle image; or ``probe.ranks[0].image``) against the image's manifest digest and stamped lock sha256.

Image vs lock: the image's distributions, Debian packages and stamped sources against the lock's wheels,
base .debs and sources, and the lock's sha256 against the image's ``dev.recipe-bundle.lock.sha256`` label;
identical when all agree. A distribution a build step installed counts as the lock's: a step that builds an
sdist pins that sdist's version; a step that builds a git source into a wheel (DeepEP) pins what its layer
``build-<name>`` holds (the lock pins the step's input, command and build root, not the version its build
writes), whichever version that is. Which layer is whose comes from the stamp's layer list (name, diff_id),
else from the layer's history (``recipe-bundle layer NAME``). The lock's build steps and the image's
``build-<name>`` layers must match one to one (``builds``: a step without its layer, or a layer of a step the
lock does not have).
"""

from __future__ import annotations

import json
import re
from email.parser import BytesHeaderParser
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image import referrers, sbom
from trainer.image.oci import ImageRef, LayerRef, open_image
from trainer.image.recorded import record_image
from trainer.image.tarread import member_name, member_stream, open_layer
from trainer.inputs import parse_json, read_text
from trainer.lock.imagelock import load_lock

STAMP = "etc/recipe-bundle/lock.json"
LOCK_LABEL = "dev.recipe-bundle.lock.sha256"
METADATA = re.compile(r"(^|/)(site|dist)-packages/[^/]+\.dist-info/METADATA$")
DPKG_STATUS = "var/lib/dpkg/status"


def _config_view(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("config") or {}
    env = dict(item.split("=", 1) if "=" in item else (item, "") for item in inner.get("Env") or [])
    return {
        "architecture": config.get("architecture"),
        "os": config.get("os"),
        "created": config.get("created"),
        "Entrypoint": inner.get("Entrypoint"),
        "Cmd": inner.get("Cmd"),
        "WorkingDir": inner.get("WorkingDir"),
        "Env": env,
        "Labels": inner.get("Labels") or {},
    }


def _dict_changes(kind: str, a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append({"field": f"{kind}.{key}", "old": a.get(key), "new": b.get(key)})
    return out


def config_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Differences between two image configs: [{"field", "old", "new"}], Env and Labels compared by name."""
    va, vb = _config_view(a), _config_view(b)
    out: list[dict[str, Any]] = []
    for key in ("architecture", "os", "created", "Entrypoint", "Cmd", "WorkingDir"):
        if va[key] != vb[key]:
            out.append({"field": key, "old": va[key], "new": vb[key]})
    return out + _dict_changes("Env", va["Env"], vb["Env"]) + _dict_changes("Labels", va["Labels"], vb["Labels"])


def file_changes(fa: dict[str, dict[str, Any]], fb: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-file changes between two layers' listings (see :meth:`ImageRef.files`)."""
    out = []
    for path in sorted(set(fa) | set(fb)):
        old, new = fa.get(path), fb.get(path)
        if old == new:
            continue
        change = "added" if old is None else "removed" if new is None else "changed"
        out.append({"path": path, "change": change, "old": old, "new": new})
    return out


def align_layers(a: list[LayerRef], b: list[LayerRef]) -> list[tuple[LayerRef | None, LayerRef | None]]:
    """Pairs of layers: equal diff_ids first, then unmatched ones by history name, then by position."""
    b_ids = {layer.diff_id for layer in b}
    a_ids = {layer.diff_id for layer in a}
    only_a = [layer for layer in a if layer.diff_id not in b_ids]
    only_b = [layer for layer in b if layer.diff_id not in a_ids]
    pairs: list[tuple[LayerRef | None, LayerRef | None]] = [(layer, layer) for layer in a if layer.diff_id in b_ids]
    rest_b = list(only_b)
    for la in only_a:
        match = next((lb for lb in rest_b if la.history and lb.history == la.history), None)
        if match is None and rest_b and not any(lb.history == la.history for lb in only_b):
            match = next((lb for lb in rest_b if not lb.history or lb.history not in {x.history for x in only_a}), None)
        if match is not None:
            rest_b.remove(match)
        pairs.append((la, match))
    pairs += [(None, lb) for lb in rest_b]
    return pairs


def _describe_file(x: dict[str, Any] | None) -> str:
    """One file of :meth:`ImageRef.files` as the text report shows it ("-" for none)."""
    if x is None:
        return "-"
    if x.get("type") == "file":
        return f"{x['size']} bytes sha256:{x['sha256'][:12]}"
    return f"{x['type']} {x.get('target', '')}".strip()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def contents(image: ImageRef) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """What is installed in ``image``, read in one pass over its layers (top-most layer wins): Python
    distributions (canonical name -> version, from dist-info METADATA), Debian packages (name -> version,
    the ``install ok installed`` entries of the dpkg status file) and each distribution's directory (canonical
    name -> the site directory holding its dist-info, relative, e.g. ``usr/local/lib/python3.11/dist-packages``)."""
    dists, debs, where, _ = _scan(image)
    return dists, debs, where


def _scan(image: ImageRef) -> tuple[dict[str, str], dict[str, str], dict[str, str], dict[str, str]]:
    """:func:`contents` and, fourth, canonical name -> the diff_id of the layer its (top-most) dist-info is in."""
    dists: dict[str, str] = {}
    where: dict[str, str] = {}
    layer_of: dict[str, str] = {}
    status: bytes | None = None
    for layer in image.layers:
        if layer.media_type.endswith("+zstd"):
            continue  # not decompressed here (no zstd in the standard library); only base images use it
        with layer.open() as raw:
            with open_layer(raw) as tar:
                for member in tar:
                    name = member_name(member.name)
                    if member.isreg() and METADATA.search(name):
                        headers = BytesHeaderParser().parsebytes(member_stream(tar, member).read())
                        if headers.get("Name"):
                            dists[_canonical(headers["Name"])] = headers.get("Version", "")
                            where[_canonical(headers["Name"])] = name.rsplit("/", 2)[0]
                            layer_of[_canonical(headers["Name"])] = layer.diff_id
                    elif member.isreg() and name == DPKG_STATUS:
                        status = member_stream(tar, member).read()
    return dists, _dpkg_installed(status or b""), where, layer_of


def layer_names(image: ImageRef, stamp: dict[str, Any] | None = None) -> dict[str, str]:
    """diff_id -> layer name (``base``, ``torch``, ``build-deepep``, ...) of ``image``'s layers: from the stamped
    lock's ``layers`` list (``stamp``, else read from the image), else from a layer's history
    (``recipe-bundle layer NAME``); layers named by neither are left out."""
    stamp = stamped(image) if stamp is None else stamp
    names: dict[str, str] = {}
    for layer in image.layers:
        match = re.fullmatch(r"recipe-bundle layer (\S+)", layer.history or "")
        if match:
            names[layer.diff_id] = match.group(1)
    for entry in stamp.get("layers") or []:
        if isinstance(entry, dict) and isinstance(entry.get("diff_id"), str) and isinstance(entry.get("name"), str):
            names[entry["diff_id"]] = entry["name"]
    return names


def _dpkg_installed(status: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for paragraph in status.decode("utf-8", "replace").split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in paragraph.splitlines() if ": " in line and not line.startswith(" ")
        )
        state = fields.get("Status", "").split()
        if fields.get("Package") and len(state) == 3 and state[2] == "installed":  # not half-installed etc.
            out[fields["Package"]] = fields.get("Version", "")
    return out


def distributions(image: ImageRef) -> dict[str, str]:
    """canonical name -> version of every installed Python distribution (see :func:`contents`)."""
    return contents(image)[0]


def _source_pins(sources: Any) -> dict[str, str]:
    items = sources.items() if isinstance(sources, dict) else ((s.get("name"), s) for s in sources or [])
    return {n: f"{s.get('commit')} tree {s.get('tree')}" for n, s in items if isinstance(s, dict)}


def stamped(image: ImageRef) -> dict[str, Any]:
    """The lock stamped into ``image`` at ``/etc/recipe-bundle/lock.json`` (:data:`STAMP`), decoded; ``{}``
    when the image has no such file or it is not valid JSON.
    """
    data = image.read_file(STAMP)
    if data is None:
        return {}
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return {}


def _versions(a: dict[str, str], b: dict[str, str]) -> list[dict[str, str | None]]:
    return [{"name": n, "old": a.get(n), "new": b.get(n)} for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]


def sbom_changes(a: ImageRef, b: ImageRef) -> list[dict[str, Any]] | None:
    """Packages whose version or sha256 differs between the SPDX SBOMs attached to ``a`` and ``b``:
    [{"package": purl without version, "old", "new", "old_sha256", "new_sha256"}]; None when either image
    has no SBOM (a docker-archive, or an image built before SBOMs). Raises :class:`UserError` for a layout
    whose referrers do not bind (:func:`trainer.image.referrers.bound`: a digest or subject check fails, an
    extra or duplicated referrer)."""
    if not (referrers.listed(a) and referrers.listed(b)):
        return None
    try:
        docs = [referrers.find(image, (sbom.SPDX_MEDIA_TYPE,))[1] for image in (a, b)]
    except UserError as err:
        if "no referrer" in str(err):
            return None
        raise
    pa, pb = (sbom.packages_of_spdx(d) for d in docs)
    none: dict[str, Any] = {}
    return [
        {
            "package": key,
            "old": pa.get(key, none).get("version"),
            "new": pb.get(key, none).get("version"),
            "old_sha256": pa.get(key, none).get("sha256"),
            "new_sha256": pb.get(key, none).get("sha256"),
        }
        for key in sorted(set(pa) | set(pb))
        if pa.get(key) != pb.get(key)
    ]


def diff_images(a: ImageRef, b: ImageRef) -> dict[str, Any]:
    """The differences between images ``a`` and ``b`` as a JSON-able dict with ``identical`` (bool)."""
    same_layers = [layer.diff_id for layer in a.layers] == [layer.diff_id for layer in b.layers]
    if a.config_digest == b.config_digest and same_layers:
        return {"identical": True, "a": a.manifest_digest or a.config_digest, "b": b.manifest_digest or b.config_digest}
    layers: list[dict[str, Any]] = []
    for la, lb in align_layers(a.layers, b.layers):
        if la is not None and lb is not None and la.diff_id == lb.diff_id:
            layers.append({"name": la.history, "diff_id": la.diff_id, "status": "same"})
            continue
        fa = a.files(la) if la is not None else {}
        fb = b.files(lb) if lb is not None else {}
        layers.append(
            {
                "name": la.history if la is not None else lb.history if lb is not None else "",
                "old": la.diff_id if la else None,
                "new": lb.diff_id if lb else None,
                "status": "changed" if la and lb else "removed" if la else "added",
                "files": file_changes(fa, fb),
            }
        )
    sa, sb = stamped(a), stamped(b)
    (dists_a, debs_a, _), (dists_b, debs_b, _) = contents(a), contents(b)
    return {
        "identical": False,
        "a": a.manifest_digest or a.config_digest,
        "b": b.manifest_digest or b.config_digest,
        "config": config_changes(a.config, b.config),
        "layers": layers,
        "distributions": _versions(dists_a, dists_b),
        "debs": _versions(debs_a, debs_b),
        "sources": _versions(_source_pins(sa.get("sources")), _source_pins(sb.get("sources"))),
        "sbom": sbom_changes(a, b),
    }


def diff_image_lock(a: ImageRef, lock: dict[str, Any]) -> dict[str, Any]:
    """Image ``a`` against a loaded lock: distributions (the built ones included, see the module docstring),
    Debian packages, sources, build steps and the lock hash label."""
    label = (_config_view(a.config)["Labels"]).get(LOCK_LABEL)
    wheels = {_canonical(w["name"]): w["version"] for w in lock.get("wheels", [])}
    installed, installed_debs, where, layer_of = _scan(a)
    stamp = stamped(a)
    names = layer_names(a, stamp)
    # every distribution in the lock's site directory is the lock's to pin (one added there is named); those
    # elsewhere (a base image's, Debian's python3-* packages) are not
    for sd in lock.get("sdists", []):  # an sdist is pinned as installed once a build step has made it a wheel
        if _canonical(sd["name"]) in installed:
            wheels[_canonical(sd["name"])] = sd["version"]
    steps = {s["name"]: s for s in lock.get("builds", []) if isinstance(s, dict) and s.get("name")}
    for dist, diff_id in layer_of.items():  # a wheel a build step built from a git source: what its layer holds
        step = (
            steps.get(names.get(diff_id, "")[len("build-") :]) if names.get(diff_id, "").startswith("build-") else None
        )
        if step is not None and "source" in (step.get("input") or {}) and dist not in wheels:
            wheels[dist] = installed[dist]
    site = lock["python"]["site_packages"].strip("/")
    dists = _versions({n: v for n, v in installed.items() if where.get(n) == site or n in wheels}, wheels)
    base = lock.get("base", {})
    debs = (
        _versions(installed_debs, {d["name"]: d["version"] for d in base.get("debs", [])})
        if base.get("type") == "debian-rootfs"
        else []
    )
    sources = _versions(_source_pins(stamp.get("sources")), _source_pins(lock.get("sources", [])))
    layers = {n[len("build-") :]: d for d, n in names.items() if n.startswith("build-")}
    builds = _versions(
        {n: f"layer {d}" for n, d in layers.items()},
        {n: f"layer {layers[n]}" if n in layers else "a build step" for n in steps},
    )
    result: dict[str, Any] = {
        "a": a.manifest_digest or a.config_digest,
        "b": str(lock["_path"]),
        "lock_sha256": {"image": label, "lock": lock["_sha256"]},
        "distributions": dists,
        "debs": debs,
        "sources": sources,
        "builds": builds,
    }
    result["identical"] = not dists and not debs and not sources and not builds and label == lock["_sha256"]
    return result


def diff_image_record(a: ImageRef, record: dict[str, Any], where: Path) -> dict[str, Any]:
    """Image ``a`` against a run record: identical when the record's image digest is ``a``'s manifest digest
    (or, when it names only a lock, when that lock's sha256 is the one ``a`` was stamped with)."""
    seen = record_image(record)
    if not seen["digest"] and not seen["lock"]:
        raise UserError(
            f"{where}: the run record names no image (expected image.digest, image.lock or "
            "probe.ranks[0].image): the run did not happen inside a bundle image"
        )
    label = (_config_view(a.config)["Labels"]).get(LOCK_LABEL)
    lock = seen["lock"]
    if lock and not re.match(r"^[0-9a-f]{64}$", str(lock)):
        lock = load_lock(Path(lock))["_sha256"]
    mine = a.manifest_digest or a.config_digest
    result: dict[str, Any] = {
        "a": mine,
        "b": str(where),
        "record_image": seen,
        "lock_sha256": {"image": label, "lock": lock or label},
    }
    result["identical"] = (not seen["digest"] or seen["digest"] == mine) and (not lock or lock == label)
    if seen["digest"] and seen["digest"] != mine:
        result["image_digest"] = {"image": mine, "record": seen["digest"]}
    return result


def render(result: dict[str, Any]) -> str:
    """The human-readable report of a :func:`diff_images` / :func:`diff_image_lock` result."""
    if result["identical"]:
        return "identical"
    lines = [f"different: {result['a']} vs {result['b']}"]
    if "image_digest" in result:
        lines.append(
            f"image digest: {result['image_digest']['image']}, the run record says {result['image_digest']['record']}"
        )
    if "lock_sha256" in result and result["lock_sha256"]["image"] != result["lock_sha256"]["lock"]:
        lines.append(
            f"lock sha256: image built from {result['lock_sha256']['image']}, lock is {result['lock_sha256']['lock']}"
        )
    for c in result.get("config", []):
        lines.append(f"config {c['field']}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}")
    for layer in result.get("layers", []):
        if layer["status"] == "same":
            lines.append(f"layer {layer['name'] or '?'}: same {layer['diff_id']}")
            continue
        lines.append(f"layer {layer['name'] or '?'}: {layer['status']} {layer['old']} -> {layer['new']}")
        for f in layer["files"]:
            lines.append(f"  {f['change']:<7} {f['path']}  {_describe_file(f['old'])} -> {_describe_file(f['new'])}")
    for d in result.get("distributions", []):
        lines.append(f"python {d['name']}: {d['old'] or '(absent)'} -> {d['new'] or '(absent)'}")
    for d in result.get("debs", []):
        lines.append(f"deb {d['name']}: {d['old'] or '(absent)'} -> {d['new'] or '(absent)'}")
    for s in result.get("sources", []):
        lines.append(f"source {s['name']}: {s['old'] or '(absent)'} -> {s['new'] or '(absent)'}")
    for b in result.get("builds", []):
        lines.append(f"build {b['name']}: {b['old'] or '(absent)'} -> {b['new'] or '(absent)'}")
    for p in result.get("sbom") or []:
        same = p["old"] == p["new"]
        lines.append(
            f"sbom {p['package']}: {p['old'] or '(absent)'} -> {p['new'] or '(absent)'}"
            + (f" (sha256 {str(p['old_sha256'])[:12]} -> {str(p['new_sha256'])[:12]})" if same else "")
        )
    return "\n".join(lines)


def diff_main(a: Path, b: Path, as_json: bool) -> int:
    """Compare ``a`` (an image) with ``b`` (an image or an image lock); print; 0 identical, 1 different."""
    image_a = open_image(a)
    if b.is_file() and b.suffix == ".json":
        data = (
            parse_json(read_text(b, "lock or run record") or "null", str(b)) if b.stat().st_size < (64 << 20) else None
        )
        if isinstance(data, dict) and data.get("kind") == "recipe-bundle.image-lock":
            result = diff_image_lock(image_a, load_lock(b))
        elif isinstance(data, dict):
            result = diff_image_record(image_a, data, b)
        else:
            raise UserError(
                f"{b}: neither an image lock (kind recipe-bundle.image-lock) nor a run record (a JSON object)"
            )
    else:
        result = diff_images(image_a, open_image(b))
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0 if result["identical"] else 1
