"""The ``debian-rootfs`` base: a Debian root filesystem from pinned .debs, as one deterministic layer.

Resolution (network, ``trainer lock resolve``; :func:`resolve_debs`): apt, run on a private state
directory (empty dpkg status, the lock's ``sources`` lines, Debian's archive keyring), lists the suite's
``Essential: yes`` packages (what ``mmdebstrap --variant=essential`` installs), adds the lock's ``include``
packages (e.g. ``python3``) and prints the URI, size and SHA256 of every package of the closure
(``apt-get install --print-uris``); each becomes a ``base.debs`` item: name, version, architecture, url, sha256.

Build (no resolution; :func:`rootfs_entries`): every .deb is taken from the content-addressed cache (or
downloaded from the Debian mirror named in the lock) and hash-checked; ``dpkg-deb --fsys-tarfile`` and
``--ctrl-tarfile`` stream its data and control archives, which become layer entries. Packages are unpacked in
name order and no maintainer script is run. The steps of a fresh install that a Python image relies on are
done here instead, from the packages' own files:

- merged ``/usr`` (Debian 12's default layout): ``bin``, ``sbin``, ``lib``, ``lib32``, ``lib64``, ``libx32``
  are symlinks into ``usr/``, and a package's ``/bin/x`` lands at ``usr/bin/x`` (as dpkg does on such a system);
- the dpkg database: ``var/lib/dpkg/status`` (each package's control paragraph with
  ``Status: install ok installed``), ``var/lib/dpkg/info/PKG.list`` (its paths) and the control files
  (``md5sums``, ``conffiles``, maintainer scripts) as ``info/PKG.*``, so ``dpkg -l`` and ``dpkg -S`` work;
- ``/etc/passwd`` and ``/etc/group`` from base-passwd's ``passwd.master`` and ``group.master`` (what its
  postinst does on a first install).

Not done (documented differences from ``mmdebstrap``): ``update-alternatives`` links (e.g. ``awk``),
``/etc/shadow``, ``ldconfig`` (glibc finds Debian's multiarch library directories without a cache), byte
compilation of Debian's own Python modules (no ``.pyc``). File modes come from the .deb (setuid bits and
``/tmp``'s 1777 are kept); owners are 0:0, times the lock's epoch (:mod:`trainer.image.layer`). The layer
therefore depends only on the .deb bytes and the epoch: the same pins give the same layer on any machine.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image.layer import DIR, FILE, SYMLINK, Entry
from trainer.image.tarread import member_name, member_stream, tar_entries

MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
SPOOL_BYTES = 1 << 20  # files from a .deb larger than this are spooled to disk while the layer is planned
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
FORMAT = 1  # bump when the rootfs bytes for the same .debs would change


def default_sources(suite: str) -> list[str]:
    """Debian's three archives for ``suite`` (main, updates, security), as apt ``deb`` lines."""
    return [
        f"deb http://deb.debian.org/debian {suite} main",
        f"deb http://deb.debian.org/debian {suite}-updates main",
        f"deb http://deb.debian.org/debian-security {suite}-security main",
    ]


def _apt(root: Path, *args: str) -> str:
    opts = [
        "-o",
        f"Dir={root}",
        "-o",
        f"Dir::State::status={root}/var/lib/dpkg/status",
        "-o",
        "Dir::Etc::TrustedParts=/usr/share/keyrings",
        "-o",
        "APT::Architecture=amd64",
        "-o",
        "APT::Architectures=amd64",
        "-o",
        "Debug::NoLocking=true",
        "-o",
        "APT::Install-Recommends=false",
        "-o",
        "APT::Get::AllowUnauthenticated=false",
    ]
    proc = subprocess.run(["apt-get", *opts, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["apt-get failed"])[-1]
        raise UserError(f"apt-get {' '.join(args[:2])}: {last}")
    return proc.stdout


def _paragraphs(text: str) -> list[dict[str, str]]:
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            out.append(fields)
    return out


def resolve_debs(base: dict[str, Any]) -> list[dict[str, Any]]:
    """The pinned .debs of a ``debian-rootfs`` base block (``suite``, ``variant`` "essential", ``include``,
    optional ``sources``): [{name, version, architecture, url, sha256, size}] sorted by name; the sha256 is
    the Packages index's (signed through the suite's InRelease, which apt verified). Network (the Debian
    mirror); raises :class:`UserError` with apt's last line when apt fails."""
    if base.get("variant", "essential") != "essential":
        raise UserError(
            f"base.variant {base.get('variant')!r}: only 'essential' (Essential: yes + include) is resolved"
        )
    if shutil.which("apt-get") is None:
        raise UserError("base.debs: resolving a Debian base needs apt-get (Debian's apt)")
    suite = base["suite"]
    with tempfile.TemporaryDirectory(prefix="debian-resolve-") as tmp:
        root = Path(tmp)
        for d in (
            "etc/apt/apt.conf.d",
            "etc/apt/preferences.d",
            "etc/apt/sources.list.d",
            "var/lib/apt/lists/partial",
            "var/cache/apt/archives/partial",
            "var/lib/dpkg",
        ):
            (root / d).mkdir(parents=True)
        (root / "var/lib/dpkg/status").write_text("")
        lines = base.get("sources") or default_sources(suite)
        (root / "etc/apt/sources.list").write_text(
            "".join(re.sub(r"^deb\s+", f"deb [arch=amd64 signed-by={KEYRING}] ", line) + "\n" for line in lines)
        )
        _apt(root, "update", "-q")
        essential = set()
        index: dict[str, dict[str, str]] = {}  # pool file name -> its paragraph (apt checked the signed Release)
        for lists in sorted((root / "var/lib/apt/lists").glob("*_Packages*")):
            # apt may keep the index compressed (host config: Acquire::GzipIndexes); apt-helper reads any
            text = subprocess.run(
                ["/usr/lib/apt/apt-helper", "cat-file", str(lists)], capture_output=True, check=True
            ).stdout.decode("utf-8", "replace")
            for para in _paragraphs(text):
                if para.get("Essential") == "yes" and para.get("Architecture") in ("amd64", "all"):
                    essential.add(para["Package"])
                if "Filename" in para:
                    index[para["Filename"].rsplit("/", 1)[-1]] = para
        wanted = sorted(essential | set(base.get("include", [])))
        out = _apt(root, "install", "--print-uris", "-qq", "-y", *wanted)
    debs = []
    for line in out.splitlines():
        match = re.match(r"^'([^']+)' (\S+) (\d+)", line)  # the hash field is empty for some archives
        if not match:
            continue
        url, filename, size = match.groups()
        listed = index.get(urllib.parse.unquote(url.rsplit("/", 1)[-1]))
        if listed is None or not re.match(r"^[0-9a-f]{64}$", listed.get("SHA256", "")):
            raise UserError(f"{filename}: no SHA256 for it in the suite's Packages index (refused)")
        debs.append(
            {
                "name": listed["Package"],
                "version": listed["Version"],
                "architecture": listed["Architecture"],
                "url": url,
                "sha256": listed["SHA256"],
                "size": int(listed.get("Size", size)),
            }
        )
    if not debs:
        raise UserError(f"base: apt resolved no packages for {suite}")
    return sorted(debs, key=lambda d: d["name"])


def _merged(parts: list[str]) -> list[str]:
    return ["usr", *parts] if parts and parts[0] in MERGED else parts


@contextlib.contextmanager
def _dpkg_tar(path: Path, option: str, label: str, what: str) -> Iterator[tarfile.TarFile]:
    """The tar stream ``dpkg-deb OPTION PATH`` writes (``--ctrl-tarfile``, ``--fsys-tarfile``), read once. Raises
    :class:`UserError` naming ``label`` when dpkg-deb is missing or fails, or the ``what`` archive is unreadable."""
    if shutil.which("dpkg-deb") is None:
        raise UserError(f"{label}: unpacking .debs needs dpkg-deb (Debian's dpkg)")
    proc = subprocess.Popen(["dpkg-deb", option, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None  # both are pipes (PIPE above)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            yield tar
    except tarfile.TarError as ex:
        raise UserError(f"{label}: {what} archive unreadable ({ex})") from None
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        if proc.wait() != 0:
            raise UserError(f"{label}: dpkg-deb {option} failed: {(err.splitlines() or ['?'])[-1]}")


MAX_CONTROL_BYTES = 16 << 20  # one file of a .deb's control archive (control, md5sums, scripts)
MAX_MEMBER_BYTES = 8 << 30  # one file of a .deb's data archive (the largest CUDA library is ~1 GB)


def _read_control(path: Path, label: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    with _dpkg_tar(path, "--ctrl-tarfile", label, "control") as tar:
        for member in tar:
            name = member_name(member.name)
            if member.isreg() and name and "/" not in name:
                if member.size > MAX_CONTROL_BYTES:
                    raise UserError(
                        f"{label}: control member {name!r} is {member.size:,} bytes (at most "
                        f"{MAX_CONTROL_BYTES:,}; refused)"
                    )
                files[name] = member_stream(tar, member).read()
    if "control" not in files:
        raise UserError(f"{label}: no control file")
    return files


def _data_entries(path: Path, label: str, spool: Path, counter: list[int]) -> tuple[list[Entry], list[str]]:
    """Entries of the package's data archive (merged /usr applied) and its paths as dpkg lists them."""
    listed: list[str] = []
    with _dpkg_tar(path, "--fsys-tarfile", label, "data") as tar:

        def path_of(parts: list[str]) -> str | None:
            if not parts:
                return None
            listed.append("/" + "/".join(parts))
            if len(parts) == 1 and parts[0] in MERGED:
                return None  # the merged-/usr symlink stands for this directory
            return "/".join(_merged(parts))

        def file_entry(member: tarfile.TarInfo, image_path: str, mode: dict) -> Entry:
            if member.size > MAX_MEMBER_BYTES:  # checked from the header: a sparse 30 GB member is refused
                raise UserError(
                    f"{label}: member {member.name!r} is {member.size:,} bytes (at most "
                    f"{MAX_MEMBER_BYTES:,} per file; refused)"
                )
            handle = member_stream(tar, member)
            if member.size > SPOOL_BYTES:
                counter[0] += 1
                spooled = spool / f"deb-{counter[0]:08d}"
                with open(spooled, "wb") as out:
                    shutil.copyfileobj(handle, out, 1 << 20)
                return Entry(image_path, FILE, source=spooled, **mode)
            return Entry(image_path, FILE, data=handle.read(), **mode)

        entries = tar_entries(
            tar,
            f"{label}: archive",
            path_of,
            file_entry,
            keep_modes=True,
            key_of=lambda parts: "/".join(_merged(parts)),
        )
    return entries, listed


def _status_paragraph(control: bytes) -> bytes:
    lines = control.decode("utf-8", "surrogateescape").rstrip("\n").split("\n")
    out = [lines[0], "Status: install ok installed", *lines[1:]]
    return ("\n".join(out) + "\n").encode("utf-8", "surrogateescape")


def rootfs_entries(debs: list[tuple[Path, dict[str, Any]]], spool: Path) -> list[Entry]:
    """Layer entries of the Debian root filesystem unpacked from ``debs`` ((verified .deb file, lock item)
    each). Raises :class:`UserError` naming the package for an unreadable .deb, a refused member, a
    package whose name or version differs from the lock, or two packages shipping one path differently."""
    entries: dict[str, tuple[Entry, str]] = {}
    status: list[bytes] = []
    info: list[Entry] = []
    counter = [0]
    for path, deb in sorted(debs, key=lambda x: x[1]["name"]):
        label = f"deb {deb['name']}_{deb['version']}_{deb['architecture']}"
        control = _read_control(path, label)
        fields = _paragraphs(control["control"].decode("utf-8", "replace"))[0]
        if (fields.get("Package"), fields.get("Version"), fields.get("Architecture")) != (
            deb["name"],
            deb["version"],
            deb["architecture"],
        ):
            raise UserError(
                f"{label}: control says {fields.get('Package')} {fields.get('Version')} "
                f"{fields.get('Architecture')} (refused)"
            )
        data, listed = _data_entries(path, label, spool, counter)
        for entry in data:
            previous = entries.get(entry.path)
            if previous is not None:
                if entry.type == DIR and previous[0].type == DIR:
                    continue
                if (
                    previous[0].type == entry.type
                    and previous[0].content_id() == entry.content_id()
                    and previous[0].target == entry.target
                ):
                    continue
                if (
                    entry.type == FILE
                    and previous[0].type == FILE
                    and entry.data is not None
                    and previous[0].data is not None
                    and entry.data == previous[0].data
                ):
                    continue
                raise UserError(f"{label}: /{entry.path} is also shipped, differently, by {previous[1]} (refused)")
            entries[entry.path] = (entry, deb["name"])
        pkg = deb["name"] + (f":{deb['architecture']}" if fields.get("Multi-Arch") == "same" else "")
        status.append(_status_paragraph(control["control"]))
        listing = ["/."] + [p for p in listed if p != "/."]
        info.append(Entry(f"var/lib/dpkg/info/{pkg}.list", FILE, data=("\n".join(listing) + "\n").encode()))
        for name, content in sorted(control.items()):
            if name != "control":
                info.append(
                    Entry(
                        f"var/lib/dpkg/info/{pkg}.{name}",
                        FILE,
                        data=content,
                        executable=name in ("preinst", "postinst", "prerm", "postrm", "config"),
                    )
                )
    out = [e for e, _ in entries.values()]
    shipped_tops = {e.path.split("/")[1] for e in out if e.path.startswith("usr/") and e.path.count("/") >= 1}
    for top in MERGED:
        if top in ("bin", "sbin", "lib") or top in shipped_tops:
            out.append(Entry(top, SYMLINK, target=f"usr/{top}"))
    out.append(Entry("var/lib/dpkg/status", FILE, data=b"\n".join(status)))
    out += info
    for name, master in (
        ("passwd", "usr/share/base-passwd/passwd.master"),
        ("group", "usr/share/base-passwd/group.master"),
    ):
        found = entries.get(master)
        if found is not None and f"etc/{name}" not in entries:
            master_data, source = found[0].data, found[0].source
            if master_data is None:
                if source is None:  # a .deb's files are read into memory or spooled: never neither
                    raise ValueError(f"{master}: an entry without data or source")
                master_data = source.read_bytes()
            out.append(Entry(f"etc/{name}", FILE, data=master_data))
    return out


def deb_inputs(base: dict[str, Any]) -> dict[str, Any]:
    """What the base layer's cache key hashes: the rootfs format and every .deb's name, version, arch, sha256."""
    return {
        "format": FORMAT,
        "suite": base.get("suite"),
        "debs": [
            [d["name"], d["version"], d["architecture"], d["sha256"]]
            for d in sorted(base["debs"], key=lambda d: d["name"])
        ],
    }
