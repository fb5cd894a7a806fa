"""trainer.record.joblog: a failure's line reads a job's log at the end it needs, never the whole of a long log."""

import os

import helpers
from trainer.record import joblog

PLACED = "rank 0: node n1 (127.0.0.2), slot 0, pid 11\nrank 1: node n1 (127.0.0.2), slot 1, pid 12\n"
PLACED += "rank 2: node n2 (127.0.0.3), slot 0, pid 13\n"


def test_tail_reads_the_last_bytes_from_a_line_start(tmp_path):
    """A 64 MiB log (sparse: zero bytes, no line breaks) ending in two lines gives back at most ``max_bytes``, from
    the first line break inside them on; a short log whole; a missing log, a link, a folder and a FIFO without a
    writer "" (at once). A line starting exactly where the window starts is kept whole, and so is a last line
    without a line break."""
    log = tmp_path / "job.log"
    with log.open("wb") as handle:
        handle.truncate(64 * 1024 * 1024)
        handle.seek(0, os.SEEK_END)
        handle.write(b"\nstep 9\nray_workers: error: rank 3 on node n2 failed\n")
    text = joblog.tail(log, 4096)
    assert text.endswith("ray_workers: error: rank 3 on node n2 failed\n")
    assert len(text.encode()) <= 4096 and "\0" not in text  # the partial first line is dropped
    assert joblog.tail(log, 16) == ""  # no line starts in the last 16 bytes
    short = tmp_path / "short.log"
    short.write_text("one\ntwo\n")
    assert joblog.tail(short) == "one\ntwo\n"
    (tmp_path / "link.log").symlink_to(short)
    assert joblog.tail(tmp_path / "link.log") == ""
    assert joblog.tail(tmp_path / "missing.log") == ""
    assert joblog.tail(tmp_path) == ""
    os.mkfifo(tmp_path / "fifo.log")  # no writer: opening it must not wait for one
    assert joblog.tail(tmp_path / "fifo.log") == "" and joblog.placement(tmp_path / "fifo.log") == {}
    # a window starting exactly at a line's start keeps that line; a last line without a line break is kept
    short.write_bytes(b"AAAA\nBBBB\nCC")
    assert joblog.tail(short, 7) == "BBBB\nCC" and joblog.tail(short, 8) == "BBBB\nCC"
    assert joblog.tail(short, 6) == "CC" and joblog.tail(short, 2) == "CC" and joblog.tail(short, 1) == ""


def test_placement_stops_at_the_rendezvous_line(tmp_path):
    """The ranks' nodes come from the placement lines before ``rendezvous:``; lines after it (a worker echoing a
    placement-like line, or a log of gigabytes of steps) are not read: the later "rank 0: node n9" is ignored. A
    log with no rendezvous line (the job died while placing) still gives the ranks it named. A line of 2 MiB (a
    sparse file) is read in pieces, and a piece that is not a line's start is no placement line. Placement lines
    past ``PLACEMENT_BYTES`` are not looked for: a log without any (another payload's) is not read to its end."""
    log = tmp_path / "job.log"
    log.write_text("preflight: ok\n" + PLACED + "rendezvous: tcp://127.0.0.2:40001\nrank 0: node n9 (x), slot 0\n")
    assert joblog.placement(log) == {0: "n1", 1: "n1", 2: "n2"}
    log.write_text("preflight: ok\n" + PLACED)
    assert joblog.placement(log) == {0: "n1", 1: "n1", 2: "n2"}
    log.write_text("rendezvous: before any rank\n" + PLACED)  # not a placement's end: nothing placed yet
    assert joblog.placement(log) == {0: "n1", 1: "n1", 2: "n2"}
    (tmp_path / "link.log").symlink_to(log)
    assert joblog.placement(tmp_path / "link.log") == {}
    assert joblog.placement(tmp_path / "missing.log") == {}
    log.write_bytes(b"\xff\xfe garbage\n" + PLACED.encode())
    assert joblog.placement(log)[2] == "n2"
    # a line of 2 MiB is read LINE_BYTES at a time, and a piece of it that looks like a placement line is not one
    with log.open("wb") as handle:
        handle.write(b"x" * joblog.LINE_BYTES + b"rank 5: node n7 (127.0.0.8)\n")
        handle.truncate(2 * 1024 * 1024)
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n" + PLACED.encode())
    assert joblog.placement(log) == {0: "n1", 1: "n1", 2: "n2"}
    # placement lines further in than PLACEMENT_BYTES are not looked for (a log with none is not read to its end)
    with log.open("wb") as handle:
        handle.write(b"step 1\n" * (joblog.PLACEMENT_BYTES // 7 + 1) + PLACED.encode())
    assert joblog.placement(log) == {}


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
