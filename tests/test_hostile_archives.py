"""Hostile archives read into layers (source tars, layer entries): no escape, no traceback, bounded memory.

Each case is a small tar built here; the promise is one :class:`UserError` line naming the member, before any
layer byte is written.
"""

import io
import tarfile

import pytest

import helpers
from trainer.errors import UserError
from trainer.image.gittree import resolve_in_tree
from trainer.image.layer import DIR, FILE, SYMLINK, Entry, plan_entries, write_layer
from trainer.image.sources import source_entries
from trainer.image.tarread import entries_from_tar


def tar_of(members, encoding="utf-8"):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding=encoding) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sym(name, target):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def reg(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def sparse_header(name, size):
    """A tar whose one member claims ``size`` bytes (a sparse 30 GB file archives to a few blocks)."""
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


# case: (archive bytes, the source reader's line, the layer reader's line)
CASES = {
    "symlink chain escaping": (
        tar_of([sym("top/a/b/up", "../../.."), sym("top/a/b/esc", "up/../../../../etc/shadow")]),
        "symlink a/b/esc -> up/../../../../etc/shadow resolves outside the source tree",
        "'top/a/b/esc': symlink target 'up/../../../../etc/shadow' escapes the image root",
    ),
    "symlink chain through two links": (
        tar_of([sym("top/x", "y/.."), sym("top/y", ".."), sym("top/z", "x/../etc")]),
        "resolves outside the source tree",
        "escapes the image root",
    ),
    "symlink loop": (
        tar_of([sym("top/a", "b"), sym("top/b", "a")]),
        "more than 40 links (a loop)",
        "more than 40 symlinks in a chain",
    ),
    "file under a symlink": (
        tar_of([sym("top/link", "real"), reg("top/link/file")]),
        "link/file lies under the symlink link",
        "'top/link/file': parent 'top/link' is a symlink, not a directory",
    ),
    "sparse 30 GB member": (
        sparse_header("top/huge", 30 << 30),
        "archive unpacks to more than 2,147,483,648 bytes",
        "'top/huge': 32,212,254,720 bytes",
    ),
    "truncated archive": (tar_of([reg("top/a", b"y" * 5000)])[:1500], "", "archive: corrupt or truncated"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_source_archive_is_one_line(tmp_path, case):
    """Promise: a source tar is accepted only when it is bounded in size, readable, and every symlink resolves
    inside the tree through all the others; else one UserError line, before a layer byte is written."""
    data, expected, _ = CASES[case]
    archive = tmp_path / "src.tar"
    archive.write_bytes(data)
    source = {
        "name": "demo",
        "commit": "1" * 40,
        "archive": {"filename": "src.tar"},
        "dest": "/opt/src/demo",
        "tree": "0" * 40,
    }
    with pytest.raises(UserError) as err:
        source_entries(archive, source)
    assert str(err.value).startswith("source demo@111111111111: ") and expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_archive_is_refused_by_the_layer_reader(case):
    """Promise: the same archives read into any layer (:func:`entries_from_tar`, then the writer's whole-tree
    check) give one UserError line naming the member."""
    data, _, expected = CASES[case]
    with pytest.raises(UserError) as err:
        plan_entries(entries_from_tar(io.BytesIO(data), ""))
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_non_utf8_member_name_is_kept_as_bytes_not_a_traceback(tmp_path):
    """Promise: a member name with a byte that is not UTF-8 (git allows any bytes) travels as those bytes: the
    layer holds the same name, and a source archive is judged by its git tree like any other (one line)."""
    data = tar_of([reg("top/caf\xe9", b"x")], encoding="latin-1")
    buf = io.BytesIO()
    write_layer(entries_from_tar(io.BytesIO(data), ""), buf, 0)
    names = [
        m.name for m in tarfile.open(fileobj=io.BytesIO(buf.getvalue()), encoding="utf-8", errors="surrogateescape")
    ]
    assert [n.encode("utf-8", "surrogateescape") for n in names] == [b"top", b"top/caf\xe9"]
    archive = tmp_path / "src.tar"
    archive.write_bytes(data)
    source = {
        "name": "demo",
        "commit": "1" * 40,
        "archive": {"filename": "src.tar"},
        "dest": "/opt/src/demo",
        "tree": "0" * 40,
    }
    with pytest.raises(
        UserError,
        match=r"^source demo@111111111111: archive files hash to git tree [0-9a-f]{40}, "
        r"lock says 0{40} \(refused\)$",
    ):
        source_entries(archive, source)


def test_a_chain_is_refused_by_the_layer_writer_whatever_read_it(tmp_path):
    """Promise: the layer writer itself resolves every symlink through the tree (wheels, sources, debs and trees all
    pass through it): the escaping chain writes nothing."""
    entries = [Entry("top/up", SYMLINK, target="../.."), Entry("top/esc", SYMLINK, target="up/../etc/shadow")]
    out = tmp_path / "layer.tar"
    with open(out, "wb") as handle, pytest.raises(UserError, match="escapes the image root"):
        write_layer(entries, handle, 0)
    assert out.stat().st_size == 0


@pytest.mark.parametrize(
    "links,path,resolved",
    [
        ({"a/b": "../c"}, "a/b", "c"),
        ({"usr/lib64": "lib", "usr/lib/x": "../lib64/y"}, "usr/lib/x", "usr/lib/y"),
        ({"bin": "usr/bin", "sbin/tool": "../bin/tool"}, "sbin/tool", "usr/bin/tool"),
        ({"etc/alt/python": "/usr/bin/python3.12"}, "etc/alt/python", "usr/bin/python3.12"),
    ],
)
def test_links_inside_the_tree_are_accepted(links, path, resolved):
    """Promise (the other side): links that stay inside the root resolve to where the kernel would take them."""
    assert resolve_in_tree(path, links, allow_absolute=True) == resolved


def test_plain_archives_still_read(tmp_path):
    """Promise (the other side): a well-formed source tree passes the whole-tree check unchanged."""
    data = tar_of([reg("top/a.py", b"A = 1\n"), sym("top/lib", "pkg"), reg("top/pkg/b.py", b"B = 2\n")])
    entries = plan_entries(entries_from_tar(io.BytesIO(data), ""))
    assert [(e.path, e.type) for e in entries] == [
        ("top", DIR),
        ("top/a.py", FILE),
        ("top/lib", SYMLINK),
        ("top/pkg", DIR),
        ("top/pkg/b.py", FILE),
    ]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
