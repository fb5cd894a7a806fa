"""The deterministic layer writer: fixed headers, sorted entries, refused paths, digest = sha256 of the tar."""

import hashlib
import io
import os
import random
import subprocess
import tarfile

import pytest

import helpers
from trainer.errors import UserError
from trainer.image.layer import DIR, FILE, SYMLINK, Entry, entries_from_tree, write_layer
from trainer.image.tarread import entries_from_tar

EPOCH = 1767225600  # 2026-01-01T00:00:00Z


def sample_entries():
    return [
        Entry("usr/local/bin/tool", FILE, data=b"#!/bin/sh\necho hi\n", executable=True),
        Entry("/usr/local/lib/python3.12/site-packages/pkg/__init__.py", FILE, data=b"x = 1\n"),
        Entry("./usr/local/lib/python3.12/site-packages/pkg/data.bin", FILE, data=bytes(range(256)) * 9),
        Entry("usr/local/lib/python3.12/site-packages/pkg/link.py", SYMLINK, target="__init__.py"),
        Entry("opt/empty", DIR),
        Entry("etc/a-b", FILE, data=b""),
    ]


def layer_bytes(entries, epoch=EPOCH, **kw):
    out = io.BytesIO()
    info = write_layer(entries, out, epoch, **kw)
    return out.getvalue(), info


def test_digest_is_sha256_of_bytes_and_independent_of_input_order():
    data, info = layer_bytes(sample_entries())
    assert info.diff_id == "sha256:" + hashlib.sha256(data).hexdigest()
    assert info.size == len(data) and len(data) % 512 == 0
    shuffled = sample_entries()
    random.Random(7).shuffle(shuffled)
    assert layer_bytes(shuffled)[0] == data
    assert write_layer(sample_entries(), None, EPOCH).diff_id == info.diff_id  # hashing only, no sink


def test_headers_are_fixed_and_entries_sorted_with_parents():
    data, info = layer_bytes(sample_entries())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names[:3] == ["etc", "etc/a-b", "opt"]
    assert "usr/local/lib/python3.12/site-packages" in names
    assert names.index("usr/local/lib") < names.index("usr/local/lib/python3.12/site-packages/pkg/__init__.py")
    assert info.entries == len(members) == 15
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.pax_headers) == (EPOCH, 0, 0, "", "", {})
        assert m.type in (tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE)
        expected = {tarfile.DIRTYPE: 0o755, tarfile.SYMTYPE: 0o777}.get(
            m.type, 0o755 if m.name.endswith("tool") else 0o644
        )
        assert m.mode == expected, m.name
    link = next(m for m in members if m.issym())
    assert link.linkname == "__init__.py"


def test_gnu_tar_reads_the_same_metadata(tmp_path):
    data, _ = layer_bytes(sample_entries())
    (tmp_path / "l.tar").write_bytes(data)
    listing = subprocess.run(
        ["tar", "--list", "--verbose", "--numeric-owner", "--full-time", "-f", str(tmp_path / "l.tar")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TZ": "UTC"},
    ).stdout.splitlines()
    tool = next(line for line in listing if line.endswith("usr/local/bin/tool"))
    assert tool.split()[:5] == ["-rwxr-xr-x", "0/0", "18", "2026-01-01", "00:00:00"]
    assert all(" 0/0 " in line for line in listing)


def test_epoch_changes_bytes_and_is_the_only_time():
    a, _ = layer_bytes(sample_entries(), epoch=EPOCH)
    b, _ = layer_bytes(sample_entries(), epoch=EPOCH + 1)
    assert a != b and len(a) == len(b)
    with pytest.raises(UserError, match="epoch"):
        layer_bytes(sample_entries(), epoch=-1)


def test_source_files_equal_inline_data_whatever_their_metadata(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"payload")
    os.chmod(src, 0o600)
    os.utime(src, (1, 1))
    a, _ = layer_bytes([Entry("x/f", FILE, source=src)])
    b, _ = layer_bytes([Entry("x/f", FILE, data=b"payload")])
    assert a == b


def test_long_paths_use_gnu_longlink_and_round_trip():
    long = "usr/" + "/".join(["d" * 60] * 4) + "/file.txt"
    data, _ = layer_bytes([Entry(long, FILE, data=b"z")])
    assert b"././@LongLink" in data
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames()[-1] == long
        assert tar.extractfile(long).read() == b"z"


@pytest.mark.parametrize(
    "entry,message",
    [
        (Entry("a/../b", FILE, data=b""), r"'\.\.' in path"),
        (Entry("..", DIR), r"'\.\.' in path"),
        (Entry("a/link", SYMLINK, target="/etc/passwd"), "absolute symlink target"),
        (Entry("a/link", SYMLINK, target="../../etc"), "escapes the image root"),
        (Entry("link", SYMLINK, target=".."), "escapes the image root"),
        (Entry("dev/null", "char"), "type 'char' refused"),
        (Entry("/", DIR), "empty path"),
        (Entry("a", FILE), "exactly one of data, source or opener"),
    ],
)
def test_refused_entries(entry, message):
    out = io.BytesIO()
    with pytest.raises(UserError, match=message):
        write_layer([Entry("ok", FILE, data=b"1"), entry], out, EPOCH)
    assert out.getvalue() == b""  # refused before any byte is written


def test_duplicates_and_file_parents_are_refused_but_repeated_dirs_merge():
    with pytest.raises(UserError, match="path appears twice"):
        layer_bytes([Entry("a", FILE, data=b"1"), Entry("/a", FILE, data=b"2")])
    with pytest.raises(UserError, match="parent 'a' is a file"):
        layer_bytes([Entry("a", FILE, data=b"1"), Entry("a/b", FILE, data=b"2")])
    data, info = layer_bytes([Entry("d", DIR), Entry("d/", DIR), Entry("d/x", FILE, data=b"")])
    assert info.entries == 2


def test_relative_symlink_inside_root_and_absolute_when_allowed():
    _, info = layer_bytes([Entry("a/b/link", SYMLINK, target="../../c")])
    assert info.entries == 3
    _, info = layer_bytes([Entry("bin", SYMLINK, target="/usr/bin")], allow_absolute_symlinks=True)
    assert info.entries == 1


def test_entries_from_tree_and_tar_agree(tmp_path):
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "pkg" / "run.sh", 0o700)
    (root / "pkg" / "mod.py").write_text("y = 2\n")
    os.symlink("mod.py", root / "pkg" / "alias.py")
    from_tree, _ = layer_bytes(entries_from_tree(root, "opt/src/demo"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname="demo-1234")
    buf.seek(0)
    from_tar, _ = layer_bytes(entries_from_tar(buf, "opt/src/demo", strip_components=1))
    assert from_tree == from_tar
    with tarfile.open(fileobj=io.BytesIO(from_tree)) as tar:
        assert tar.getmember("opt/src/demo/pkg/run.sh").mode == 0o755


def test_entries_from_tar_refuses_dotdot_and_devices():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("top/../../evil")
        tar.addfile(info, io.BytesIO(b""))
    buf.seek(0)
    with pytest.raises(UserError, match="'..' in path"):
        entries_from_tar(buf, "opt")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("top/null")
        info.type = tarfile.CHRTYPE
        tar.addfile(info)
    buf.seek(0)
    with pytest.raises(UserError, match="special file refused"):
        entries_from_tar(buf, "opt")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
