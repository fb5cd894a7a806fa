"""What a lock is resolved from on PyPI: the files of a project (its simple JSON API) and which wheels fit the
image's Python and platform (``trainer lock resolve``, :func:`trainer.image.buildroot.resolve_build_root`)."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

from packaging.utils import parse_wheel_filename

from trainer.errors import UserError
from trainer.lock.imagelock import canonical_name

LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def _glibc_of(platform_tag: str) -> tuple[int, int]:
    """(major, minor) glibc a manylinux platform tag needs ((0, 0) for linux_x86_64 and unknown tags)."""
    match = re.match(r"^manylinux_(\d+)_(\d+)_", platform_tag)
    if match:
        return int(match.group(1)), int(match.group(2))
    return LEGACY_MANYLINUX.get(platform_tag.split("_x86_64")[0], (0, 0))


def wheel_fits(
    filename: str,
    python: str = "cp312",
    platform_tags: tuple[str, ...] = ("manylinux", "linux_x86_64"),
    glibc: tuple[int, int] = (9, 99),
) -> bool:
    """Whether a wheel file name fits CPython ``python`` ("cp312", "cp311") on x86_64 manylinux with at most
    ``glibc`` (e.g. (2, 36) for Debian bookworm): py3-none-any, abi3 wheels of an older or equal minor, and
    ``python`` wheels (PEP 425 tags; manylinux glibc versions from PEP 600)."""
    minor = int(python[3:])
    try:
        _, _, _, tags = parse_wheel_filename(filename)
    except Exception:
        return False
    for tag in tags:
        interp_ok = tag.interpreter in ("py3", f"py3{minor}", python) or (
            tag.abi == "abi3" and tag.interpreter.startswith("cp3") and int(tag.interpreter[3:] or 0) <= minor
        )
        plat_ok = tag.platform == "any" or (
            tag.platform.endswith("x86_64")
            and tag.platform.startswith(platform_tags)
            and _glibc_of(tag.platform) <= glibc
        )
        if interp_ok and plat_ok:
            return True
    return False


def pypi_files(name: str, version: str) -> list[dict[str, Any]]:
    """The files of project ``name`` from PyPI's simple JSON API (PEP 691, ``https://pypi.org/simple/NAME/``),
    as [{"filename", "url", "sha256", "packagetype"}]; callers keep those whose sha256 uv locked for ``version``.
    (The per-version JSON API ``/pypi/NAME/VERSION/json`` is not served by every PyPI mirror.)"""
    url = f"https://pypi.org/simple/{canonical_name(name)}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
    except Exception as ex:
        raise UserError(f"{name}=={version}: PyPI simple API {url} failed ({ex})") from None
    return [
        {
            "filename": f["filename"],
            "url": f["url"].split("#")[0],
            "sha256": f.get("hashes", {}).get("sha256", ""),
            "packagetype": "bdist_wheel" if f["filename"].endswith(".whl") else "sdist",
        }
        for f in files
    ]
