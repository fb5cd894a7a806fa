"""The docs say what runs: README.md, docs/*.md, CHANGELOG.md, lockfiles/README.md and bench/RESULTS.md checked
against the code and files.

Three kinds of check, each a function from the docs' text to a list of failures (``FILE:LINE: what``), so that
every one is run on the real docs (no failure) and on a tampered copy (the failure named):

* (a) every command line the docs show (fenced code blocks, and inline spans that start with ``trainer``,
  ``bin/...``, ``python -m trainer``, ``nix run .#...``, ``python bench/...``, ``bash bench/...``, ``bazel test``)
  parses: ``trainer`` subcommands with the real argparse parsers of :mod:`trainer.cli`'s modules (stopped right
  after ``parse_args``, nothing run; exit 2 is a failure), ``train`` overrides against ``conf/`` (a group's option
  is a file ``conf/GROUP/OPTION.yaml``, a ``group.field=`` a key of the composition that the command line's
  group choices give, composed once per choice set with :func:`trainer.compose.compose.compose_run`),
  ``bench/*.py`` with their own parsers, ``bench/*.sh`` by their subcommands, ``bazel test`` by its targets;
* (b) stated figures against the files they come from: the .deb/wheel/sdist counts of the locks, every
  ``sha256:`` digest (current in ``lockfiles/expected-digests.json`` or a lock, or in a paragraph that says it is
  historical), the H200 tables of bench/RESULTS.md against ``bench/results/*/summary.json``, the native-build
  table against ``bench/results/native_builds.json`` and ``expected-digests.json``, the ratios stated beside
  their figures, the configuration table against ``conf/``, the repository map against the files;
* (c) cheap commands run in-process: ``trainer lock verify`` of every lock, ``trainer image check --predict``,
  ``--help`` of every subcommand, the plan and the refused overrides README shows, the offline build of the
  full lock, with the exit codes and output the docs show;
* (d) the docs hold together: every page of ``docs/`` is linked from README.md, every relative link resolves, and
  no paragraph of README.md, ``docs/`` or CHANGELOG.md runs over :data:`PARAGRAPH_WORDS` words.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import helpers
from trainer import cli

if TYPE_CHECKING:
    from omegaconf import DictConfig

ROOT = helpers.REPO_ROOT
# the reference, one page per phase (README.md is the guide that links them)
DOCS_PAGES = tuple(sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
DOCS = ("README.md", "CHANGELOG.md", "lockfiles/README.md", "bench/RESULTS.md", *DOCS_PAGES)
CONFIG_DOC = "docs/compose.md"  # the configuration table
HISTORICAL = re.compile(r"\bhistorical\b", re.I)

Docs = dict[str, list[str]]


def load_docs() -> Docs:
    return {name: (ROOT / name).read_text(encoding="utf-8").splitlines() for name in DOCS}


def search(pattern: str, text: str) -> re.Match[str]:
    """``re.search`` that must find ``pattern``: an AssertionError naming it and ``text`` when it does not."""
    m = re.search(pattern, text)
    assert m, f"no {pattern!r} in {text!r}"
    return m


def tampered(docs: Docs, name: str, old: str, new: str) -> Docs:
    """A copy of ``docs`` with the first line of ``name`` that holds ``old`` changed to hold ``new``."""
    lines = list(docs[name])
    for i, line in enumerate(lines):
        if old in line:
            lines[i] = line.replace(old, new, 1)
            return {**docs, name: lines}
    raise AssertionError(f"{name}: no line holds {old!r}")


# ---------------------------------------------------------------------------------------------------------------
# reading the docs: fenced blocks, paragraphs, command lines


def fenced(lines: list[str]) -> Iterator[tuple[int, str, list[tuple[int, str]]]]:
    """(line number of the fence, language, [(line number, text)]) of every fenced code block."""
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            start, lang, body = i + 1, m.group(1), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append((i + 1, lines[i]))
                i += 1
            yield start, lang, body
        i += 1


def paragraphs(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, last line, text) of each prose paragraph or table outside fenced blocks (1-based lines); a
    table's paragraph includes the paragraph right above it (its caption)."""
    out: list[tuple[int, int, str]] = []
    inside, start, buf = False, 0, list[str]()  # start: the first line of buf (0 while buf is empty)
    for i, line in enumerate(lines + [""], 1):
        if line.startswith("```"):
            inside = not inside
            if buf:
                out.append((start, i - 1, "\n".join(buf)))
            start, buf = 0, []
            continue
        if inside:
            continue
        if not line.strip() or line.startswith("#"):
            if buf:
                out.append((start, i - 1, "\n".join(buf)))
            start, buf = 0, []
            continue
        if not buf:
            start = i
        buf.append(line)
    merged: list[tuple[int, int, str]] = []
    for p in out:
        if p[2].startswith("|") and merged and not merged[-1][2].startswith("|") and merged[-1][1] >= p[0] - 2:
            q = merged.pop()
            p = (q[0], p[1], q[2] + "\n" * (p[0] - q[1]) + p[2])
        merged.append(p)
    return merged


def paragraph_at(lines: list[str], number: int) -> str:
    for first, last, text in paragraphs(lines):
        if first <= number <= last:
            return text
    return lines[number - 1]


COMMAND_START = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*(?:bin/\S+|trainer\s|train\s|python3? -m trainer|python3? bench/|bash bench/|"
    r"nix run \.#|bazel test\s|\$\(bin/python-env\))"
)


def normalise(text: str) -> str:
    """A documented command line as a command: optional groups taken (``[--json]`` -> ``--json``, the first of
    ``[A | B]``), ``A / B`` alternatives and ``...`` left out."""
    text = re.sub(r"(?<=\s)\[(-[^\[\]]*)\]", lambda m: m.group(1).split(" | ")[0], text)
    text = re.sub(r"\s/\s\S+", "", text)
    return text


def command_lines(docs: Docs) -> list[tuple[str, int, str, bool]]:
    """(doc, line, command, inline) of every command line shown: fenced blocks (``$ `` prompts stripped, comments
    cut, continuations joined, ``&&``/``;``/``|`` split) and inline spans that start like a command (inline: True;
    prose names a command with some of its options, so those are checked as fragments)."""
    out: list[tuple[str, int, str, bool]] = []
    for name, lines in docs.items():
        for _, lang, body in fenced(lines):
            if lang in ("json", "yaml"):
                continue
            pending, first = "", 0
            for number, text in body:
                text = text[2:] if text.startswith("$ ") else text
                text = re.sub(r"(^|\s)#(?!\S*\.#).*$", "", text).rstrip()  # a comment (not `.#train`)
                if not pending:
                    first = number
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                full, pending = (pending + text).strip(), ""
                out += [(name, first, part, False) for part in split_commands(full)]
        for first, _, text in paragraphs(lines):
            flat = text.replace("\n", " ")
            for m in re.finditer(r"`([^`]+)`", flat):
                span = m.group(1).strip()
                line = first + text[: m.start()].count("\n")  # the line the span starts on
                out += [(name, line, part, True) for part in split_commands(span)]
    return out


def split_commands(text: str) -> list[str]:
    """The commands of one shell line (split at ``&&``, ``;`` and pipes), normalised, that start like a command."""
    parts = re.split(r"\s*(?:&&|;)\s+|\s\|\s", normalise(text))
    return [p.strip() for p in parts if p.strip() and COMMAND_START.match(p.strip())]


# ---------------------------------------------------------------------------------------------------------------
# (a) parsing command lines without running them


class Parsed(BaseException):
    """Raised right after a real parser's ``parse_args`` succeeded: the command line parses; nothing runs."""


@contextlib.contextmanager
def stop_after_parse():
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        argparse.ArgumentParser.parse_args = original


def parse_with(main: Callable[[], object]) -> tuple[int, str]:
    """(exit code, stderr) of ``main`` stopped after its parse: 0 parsed (or ``--help``), argparse's code else."""
    return parse_capturing(main)[:2]


def parse_capturing(main: Callable[[], object]) -> tuple[int, str, str]:
    """:func:`parse_with` and what ``main`` printed on stdout (its ``--help``)."""
    with stop_after_parse() as (out, err):
        code, said = _parse(main, err)
    return code, said, out.getvalue()


def _parse(main: Callable[[], object], err: io.StringIO) -> tuple[int, str]:
    try:
        code = main()
    except Parsed:
        return 0, ""
    except SystemExit as ex:
        said = err.getvalue().strip().splitlines()
        return (ex.code if isinstance(ex.code, int) else 2), (said[-1] if said else "")
    # a main that catches argparse's SystemExit itself (trainer data) returns its code
    said = err.getvalue().strip().splitlines()
    return (code if isinstance(code, int) else 1), (said[-1] if said else "returned without parsing its arguments")


def check_trainer(args: list[str], fragment: bool = False) -> str | None:
    """A ``trainer`` command line parsed by its subcommand's parser; a ``fragment`` (prose naming a command and
    some options): its subcommand exists and has each ``--option`` named."""
    if not args:
        return None
    name, rest = args[0], args[1:]
    if name not in cli.COMMANDS:
        return f"unknown trainer command {name!r}"
    if name == "train":
        return check_train(rest)
    module = importlib.import_module(cli.COMMANDS[name][0])
    if fragment:
        path = subcommand_path(rest)
        code, err, help_text = parse_capturing(lambda: module.main([*path, "--help"]))
        if code != 0:
            return f"`trainer {' '.join([name, *path])}` is not a command (exit {code}): {err}"
        unknown = [o for o in (w.split("=")[0] for w in rest if w.startswith("--")) if o not in help_text]
        return f"`trainer {' '.join([name, *path])}` has no option {', '.join(unknown)}" if unknown else None
    code, err = parse_with(lambda: module.main(rest))
    return None if code == 0 else f"`trainer {' '.join(args)}` does not parse (exit {code}): {err}"


def subcommand_path(args: list[str]) -> list[str]:
    """``args`` up to the first argument (the program's subcommands); ``sbom/provenance`` -> ``sbom``."""
    path: list[str] = []
    for a in args:
        if a.startswith("-") or not re.fullmatch(r"[a-z][a-z0-9/-]*", a) or len(path) >= 2:
            break
        path.append(a.split("/")[0])
    return path


TRAIN_FLAGS = {
    "--resume",
    "--overwrite",
    "--frozen",
    "-m",
    "--multirun",
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "--resolve",
}
TRAIN_VALUE_FLAGS = {"--sign-key", "--cfg", "-c"}
HYDRA_KEYS = {"hydra.run.dir", "hydra.sweep.dir", "hydra.job.chdir", "hydra.verbose"}
_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def groups() -> dict[str, set]:
    return {d.name: {f.stem for f in d.glob("*.yaml")} for d in (ROOT / "conf").iterdir() if d.is_dir()}


def check_train(args: list[str]) -> str | None:
    """A ``train`` command line: its flags, each group's option a file in conf/, each field a key of the
    composition its group choices give."""
    from omegaconf import OmegaConf

    from trainer.compose.compose import compose_run

    conf = groups()
    choices, fields = [], []
    it = iter(args)
    for a in it:
        if a in TRAIN_FLAGS or a == "ARGS":  # `bin/train ARGS`: the form
            continue
        if a in TRAIN_VALUE_FLAGS:
            next(it, None)
            continue
        m = re.fullmatch(r"(\+{0,2}|~)([A-Za-z_][\w.\-]*)=(.*)", a)
        if not m:
            return f"train: {a!r} is neither a flag of train nor an override KEY=VALUE"
        plus, key, value = m.groups()
        if key.startswith("hydra."):
            if key not in HYDRA_KEYS:
                return f"train: {key} is not a Hydra key the bundle uses ({', '.join(sorted(HYDRA_KEYS))})"
        elif key in conf:
            for option in value.split(","):
                if option != "null" and option not in conf[key]:
                    return f"train: {key}={option}: no conf/{key}/{option}.yaml"
            choices.append(f"{key}={value.split(',')[0]}")
        else:
            fields.append((plus, key))
    if not fields:
        return None
    combo = tuple(sorted(choices))
    if combo not in _COMPOSED:
        _COMPOSED[combo] = compose_run(list(combo))
    cfg = _COMPOSED[combo]
    for plus, key in fields:
        where = key.rsplit(".", 1)[0] if plus else key
        if "." not in key and plus:
            continue
        if OmegaConf.select(cfg, where, default=KeyError) is KeyError:
            return f"train: {key}: not a key of the composition of {' '.join(combo) or 'conf/train.yaml'}" + (
                f" (no {where})" if plus else ""
            )
    return None


def script_labels(path: Path) -> set:
    """The subcommands / run names a bench shell script takes: its ``case`` labels and ``= NAME ]`` tests."""
    text = path.read_text()
    labels = set()
    for m in re.finditer(r"^\s+([a-z0-9][\w|.-]*)\)", text, re.M):
        labels |= set(m.group(1).split("|"))
    labels |= set(re.findall(r'= "?([a-z][\w-]*)"? \]', text))
    return labels


NO_ARGPARSE = {"h200_report.py": 2, "megatron_h200_report.py": 2}  # RUNS OUT, checked by their own argv count


def check_bench_python(script: str, args: list[str]) -> str | None:
    path = ROOT / script
    if not path.is_file():
        return f"{script}: no such file"
    if path.name in NO_ARGPARSE:
        want = NO_ARGPARSE[path.name]
        return (
            None
            if len(args) == want or args[:1] in (["-h"], ["--help"])
            else f"{script} takes {want} arguments, {len(args)} shown"
        )
    spec = importlib.util.spec_from_file_location(f"_docs_bench_{path.stem}", path)
    assert spec and spec.loader, f"{script}: not a Python module"
    module = importlib.util.module_from_spec(spec)
    saved, saved_bytecode = list(sys.argv), sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # tests write only under their temporary directory: no bench/__pycache__
    try:
        spec.loader.exec_module(module)
        sys.argv = [str(path), *args]
        takes_argv = module.main.__code__.co_argcount > 0
        code, err = parse_with(lambda: module.main(args) if takes_argv else module.main())
    finally:
        sys.argv, sys.dont_write_bytecode = saved, saved_bytecode
    return None if code == 0 else f"`{script} {' '.join(args)}` does not parse (exit {code}): {err}"


@functools.cache  # the tampered copies of the docs share all their other command lines
def check_command(command: str, inline: bool = False) -> str | None:
    """None when ``command`` (one documented command line; ``inline``: named in prose) parses, else what is
    wrong."""
    try:
        words = shlex.split(command)
    except ValueError as ex:
        return f"not a shell command line: {ex}"
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    words = [w.split("|")[0] if "|" in w and not w.startswith(("'", '"')) else w for w in words]
    words = ["X" if w == "..." else w for w in words]  # `add-image ... --json`: some argument
    if not words:
        return None
    head, rest = words[0], words[1:]
    if head in ("trainer", "bin/trainer") or (head.startswith("python") and rest[:2] == ["-m", "trainer"]):
        args = rest[2:] if head.startswith("python") else rest
        if not args or args[0] in ("ARGS", "COMMAND", "-h", "--help"):  # the program itself (its help: (c))
            return None
        return check_trainer(args, fragment=inline)
    if head.startswith("python") and rest[:2] == ["-m", "trainer.train"]:
        return check_train(rest[2:])
    if head in ("bin/train", "train"):
        return check_train(rest)
    if head == "nix":
        if rest[:1] != ["run"] or len(rest) < 2:
            return f"nix: expected `nix run .#APP -- ARGS`, got {command!r}"
        app, args = rest[1], rest[3:] if rest[2:3] == ["--"] else rest[2:]
        if app == ".#train":
            return check_train(args)
        if app == ".#trainer":
            return check_command("trainer " + shlex.join(args)) if args != ["ARGS"] else None
        if app == ".#image":
            return check_trainer(["image", *args], fragment=inline)
        return f"nix: the flake has no app {app!r} (train, trainer, image)"
    if head.startswith("python") and rest and rest[0].startswith("bench/"):
        return check_bench_python(rest[0], rest[1:])
    if head == "bash" and rest and rest[0].startswith("bench/"):
        path = ROOT / rest[0]
        if not path.is_file():
            return f"{rest[0]}: no such file"
        if path.name in ("h200_setup.sh", "h200_bench.sh") and rest[1:]:
            labels = script_labels(path)
            wanted = rest[1:2] if path.name == "h200_setup.sh" else [r for r in rest[1:] if r != "RUN..."]
            bad = [w for w in wanted if w not in labels]
            if bad:
                return f"{rest[0]} has no subcommand or run {', '.join(bad)} (it has {', '.join(sorted(labels))})"
        if path.name == "h200_carry.sh" and len(rest) not in (3, 4) and not (inline and len(rest) == 1):
            return (
                f"{rest[0]} takes MEGATRON_LM MILES [FAST_HADAMARD_TRANSFORM_GIT_DIR], {len(rest) - 1} arguments shown"
            )
        return None
    if head == "bazel":
        for target in rest[1:]:
            m = re.fullmatch(r"//tests(?:/\.\.\.|:(test_\w+))", target)
            if not m:
                return f"bazel: unknown target {target}"
            if m.group(1) and not (ROOT / "tests" / f"{m.group(1)}.py").is_file():
                return f"bazel: {target}: no tests/{m.group(1)}.py"
        return None
    if head == "bin/test-cluster":
        words = rest[: rest.index("--")] if "--" in rest else rest
        shown = subprocess.run([str(ROOT / head), *words[:1], "--help"], capture_output=True, text=True, timeout=60)
        if shown.returncode != 0:
            return f"{head} has no subcommand {words[:1]} ({shown.stderr.strip()[-200:]})"
        for flag in (w for w in words if w.startswith("--")):
            if flag not in shown.stdout:
                return f"{head} {words[0]} knows no {flag}"
        return None
    if head.startswith("bin/"):
        if head == "bin/trainer" or head == "bin/train":
            return None
        path = ROOT / head
        if not path.is_file():
            return f"{head}: no such program in bin/"
        for flag in (w for w in rest if w.startswith("--")):
            if flag not in path.read_text():
                return f"{head} knows no {flag}"
        return None
    return None


def check_commands(docs: Docs) -> list[str]:
    failures = []
    for name, line, command, inline in command_lines(docs):
        problem = check_command(command, inline)
        if problem:
            failures.append(f"{name}:{line}: {problem}")
    return failures


# ---------------------------------------------------------------------------------------------------------------
# (b) stated figures against the files they come from


def locks() -> dict[str, dict]:
    return {p.name[: -len(".lock.json")]: json.loads(p.read_text()) for p in (ROOT / "lockfiles").glob("*.lock.json")}


def expected() -> dict:
    return json.loads((ROOT / "lockfiles" / "expected-digests.json").read_text())


def lines_matching(docs: Docs, pattern: str) -> Iterator[tuple[str, int, re.Match]]:
    for name, lines in docs.items():
        for number, line in enumerate(lines, 1):
            for m in re.finditer(pattern, line):
                yield name, number, m


def check_counts(docs: Docs) -> list[str]:
    """Every count of .debs, wheels and sdists stated for ``debian-full`` (or beside a lock's name) is that
    lock's, unless its paragraph says it is historical; "N .debs + M wheels + K sdists = T inputs" adds up."""
    failures = []
    all_locks = locks()
    counts = {
        name: {
            "debs": {len(lk["base"].get("debs", [])), len(lk.get("build_root", {}).get("debs", []))} - {0},
            "wheels": {len(lk.get("wheels", []))},
            "sdists": {len(lk.get("sdists", []))},
        }
        for name, lk in all_locks.items()
    }
    for name, number, m in lines_matching(docs, r"\b(\d[\d,]*) (?:pinned )?(\.debs|wheels|sdists|packages)\b"):
        para = paragraph_at(docs[name], number)
        lock = next(
            (
                candidate
                for candidate in ("debian-full", "debian-smoke", "full", "smoke")
                if re.search(rf"(?<![\w-]){re.escape(candidate)}(?:\.lock\.json)?(?![\w-])", para)
            ),
            None,
        )
        kind = {"packages": "debs"}.get(m.group(2), m.group(2).lstrip("."))
        if lock is None or (m.group(2) == "packages" and "dpkg" not in para) or HISTORICAL.search(para):
            continue
        value = int(m.group(1).replace(",", ""))
        if value not in counts[lock][kind]:
            failures.append(
                f"{name}:{number}: {m.group(0)} for {lock}, but lockfiles/{lock}.lock.json has "
                f"{' or '.join(map(str, sorted(counts[lock][kind])))}"
            )
    for name, lines in docs.items():
        for first, _, text in paragraphs(lines):
            for m in re.finditer(r"(\d+) \.debs \+ (\d+)\s+wheels \+ (\d+) sdists = (\d+) inputs", text):
                a, b, c, total = map(int, m.groups())
                if a + b + c != total:
                    failures.append(
                        f"{name}:{first + text[: m.start()].count(chr(10))}: {a} + {b} + {c} is "
                        f"{a + b + c}, not {total}"
                    )
    return failures


def current_digests() -> set:
    """Every sha256 (hex) that is current: expected-digests.json's, and every lock's pins."""
    out = set()

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str):
            for h in re.findall(r"(?:sha256:)?([0-9a-f]{64})", value):
                out.add(h)

    walk(expected())
    for lock in locks().values():
        walk(lock)
    return out


def check_digests(docs: Docs) -> list[str]:
    """Every ``sha256:HEX`` (8 or more hex digits) the docs state is a current digest (a prefix of one in
    expected-digests.json or a lock), or its paragraph says it is historical."""
    failures, current = [], current_digests()
    for name, number, m in lines_matching(docs, r"sha256:([0-9a-f]{8,64})"):
        if any(h.startswith(m.group(1)) for h in current):
            continue
        if not HISTORICAL.search(paragraph_at(docs[name], number)):
            failures.append(
                f"{name}:{number}: sha256:{m.group(1)} is not in lockfiles/expected-digests.json nor a "
                "lock, and its paragraph does not say it is historical"
            )
    return failures


Section = tuple[int, str, list[tuple[int, str]]]


def sections(lines: list[str]) -> list[Section]:
    out: list[Section] = []
    current: Section | None = None
    for number, line in enumerate(lines, 1):
        if line.startswith("## "):
            current = (number, line[3:], [])
            out.append(current)
        elif current:
            current[2].append((number, line))
    return out


def table_rows(body: list[tuple[int, str]], header_has: str) -> list[tuple[int, dict[str, str]]]:
    """The rows of the first table in ``body`` whose header line holds ``header_has``, as (line, {column: cell})."""
    rows: list[tuple[int, dict[str, str]]] = []
    header = None
    for number_, line in body:
        if header is None:
            if line.startswith("|") and header_has in line:
                header = [c.strip() for c in line.strip().strip("|").split("|")]
            continue
        if not line.startswith("|"):
            break
        if set(line.strip()) <= set("|-: "):
            continue
        cells = [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]
        rows.append((number_, dict(zip(header, cells, strict=False))))  # a short row: its missing cells are absent
    return rows


def number(cell: str) -> float:
    return float(search(r"-?[\d,]*\.?\d+", cell).group(0).replace(",", ""))


# section title (start) -> (results dir, the run's directory from a row, {column: (summary key, scale, digits)})
H200_TABLES = {
    "megatron-core proxy on H200": (
        "h200-2026-11-30",
        lambda row: {
            "TP1 PP1 EP1 DP1": "gpu1-tp1pp1ep1",
            "TP1 PP1 EP1 DP2": "gpu2-tp1pp1ep1",
            "TP1 PP1 EP2 DP2": "gpu2-tp1pp1ep2",
            "TP1 PP2 EP1 DP1": "gpu2-tp1pp2ep1",
        }[row["layout"]],
        "layout",
    ),
    "DeepSeek-V4 tiny again, after the worker builds its DDP": ("h200-2026-12-01-r6", lambda row: row["run"], "run"),
    "DeepSeek-V4 tiny again, after the worker reads": ("h200-2026-12-01-r5", lambda row: row["run"], "run"),
    "DeepSeek-V4 tiny and the proxies on one H200": ("h200-2026-12-01-r4", lambda row: row["run"], "run"),
    "The recipe's own code on one H200": ("h200-2026-12-01", lambda row: row["run"], "run"),
}


def check_results_tables(docs: Docs) -> list[str]:
    """bench/RESULTS.md's H200 tables against the summaries in bench/results/, its native-build table against
    bench/results/native_builds.json and expected-digests.json."""
    failures, name = [], "bench/RESULTS.md"
    checked = 0
    for _start, title, body in sections(docs[name]):
        spec = next((v for k, v in H200_TABLES.items() if title.startswith(k)), None)
        if spec:
            folder, run_of, key = spec
            for number_, row in table_rows(body, "tokens/s/GPU"):
                summary_path = ROOT / "bench" / "results" / folder / run_of(row) / "summary.json"
                if (summary_path.parent.parent / f"{run_of(row)}.jsonl").is_file():
                    continue  # the bare Megatron script's own per-step file, no summary
                if not summary_path.is_file():
                    if row.get("tokens/s/GPU"):
                        failures.append(f"{name}:{number_}: {row[key]}: no {summary_path.relative_to(ROOT)}")
                    continue
                s = json.loads(summary_path.read_text())
                pairs = [
                    ("tokens/s/GPU", s["tokens_per_s_per_gpu"], 0),
                    ("model TFLOP/s/GPU", s["model_tflops_per_gpu"], 1),
                ]
                if "MFU" in row and row["MFU"]:
                    mfu = s["mfu"] * (100 if row["MFU"].endswith("%") else 1)
                    pairs.append(("MFU", mfu, 1 if row["MFU"].endswith("%") else 4))
                if row.get("step-time CV"):
                    digits = len(row["step-time CV"].rstrip("%").split(".")[1]) if "." in row["step-time CV"] else 0
                    pairs.append(("step-time CV", s["step_time_cv_percent"], digits))
                for column, value, digits in pairs:
                    if not row.get(column):
                        continue
                    stated = number(row[column])
                    if abs(stated - round(value, digits)) > 1.01 * 10**-digits:
                        failures.append(
                            f"{name}:{number_}: {row[key]} {column} {row[column]}, but "
                            f"{summary_path.relative_to(ROOT)} gives {round(value, digits)}"
                        )
                checked += 1
        if title.startswith("Native build steps, reproduced"):
            runs = json.loads((ROOT / "bench" / "results" / "native_builds.json").read_text())["runs"]
            measured: dict[str, list[float]] = {}  # a step's times over every recorded bench run
            for run in runs:
                for step, r in run["steps"].items():
                    measured.setdefault(step, []).extend(x["seconds"] for x in r["runs"])
            builds = expected()["debian-full"]["builds"]
            for number_, row in table_rows(body, "run A"):
                step = search(r"`([\w-]+)`", row["step"]).group(1)
                b = builds[step]
                if f"{b['size']:,} B" not in row["output (layer)"]:
                    failures.append(
                        f"{name}:{number_}: {step} output {row['output (layer)']!r}, but "
                        f"expected-digests.json has {b['size']:,} B"
                    )
                prefix = search(r"sha256:([0-9a-f]+)", row["output (layer)"]).group(1)
                if not b["diff_id"][7:].startswith(prefix):
                    failures.append(
                        f"{name}:{number_}: {step} sha256:{prefix}, but expected-digests.json has {b['diff_id']}"
                    )
                times = [number(row["run A"]), number(row["run B"])]
                if times != b["seconds"]:
                    failures.append(
                        f"{name}:{number_}: {step} took {times} s, but expected-digests.json has {b['seconds']}"
                    )
                if not set(times) & set(measured.get(step, [])):  # run A of deepep and TE: main-cache builds
                    failures.append(
                        f"{name}:{number_}: {step} took {times} s, but bench/results/native_builds.json has "
                        f"{measured.get(step, [])}"
                    )
                checked += 1
    if checked < 20:
        failures.append(f"{name}: only {checked} table rows compared with bench/results/: a table was not found")
    return failures


def check_ratios(docs: Docs) -> list[str]:
    """Ratios stated beside their figures: plan latency (figure / baseline), data build (raw time / build time),
    image build (cold / floor, baseline / cold), the one-GPU baseline ratios of the megatron-core proxy."""
    failures, name = [], "bench/RESULTS.md"
    lines = docs[name]
    for _start, title, body in sections(lines):
        if title.startswith("Plan latency"):
            for header_has in ("plan median", "plan (warm)"):
                for n, row in table_rows(body, header_has):
                    base = number(row.get("baseline median") or row["baseline"])
                    for column, cell in row.items():
                        for m in re.finditer(r"([\d.]+) s, ([\d.]+)x", cell):
                            ratio = float(m.group(1)) / base
                            if abs(ratio - float(m.group(2))) > 0.011 * max(1, float(m.group(2))):
                                failures.append(
                                    f"{name}:{n}: {column} {m.group(0)}: {m.group(1)} / {base} = {ratio:.2f}"
                                )
                    if row.get("ratio"):
                        ratio = number(row["plan median"]) / base
                        if abs(ratio - number(row["ratio"])) > 0.06:
                            failures.append(
                                f"{name}:{n}: ratio {row['ratio']}, but {row['plan median']} / {base} = {ratio:.2f}"
                            )
        if title.startswith("Data build throughput"):
            for n, row in table_rows(body, "wall ratio"):
                raw = float(search(r"\(([\d.]+) s\)", row["raw encoding"]).group(1))
                build = float(search(r"\(([\d.]+) s\)", row["builder"]).group(1))
                if abs(raw / build - number(row["wall ratio"])) > 0.006:
                    failures.append(
                        f"{name}:{n}: wall ratio {row['wall ratio']}, but {raw} / {build} = {raw / build:.3f}"
                    )
        if title.startswith("Image build, Debian-based"):
            for n, row in table_rows(body, "cold/floor"):
                floor, cold, base = (
                    number(row["floor (read+hash inputs)"]),
                    number(row["cold build"]),
                    number(row["baseline"]),
                )
                if abs(cold / floor - number(row["cold/floor"])) > 0.051:
                    failures.append(
                        f"{name}:{n}: cold/floor {row['cold/floor']}, but {cold} / {floor} = {cold / floor:.2f}"
                    )
                if abs(base / cold - number(row["baseline/cold"])) > 0.006:
                    failures.append(
                        f"{name}:{n}: baseline/cold {row['baseline/cold']}, but {base} / {cold} = {base / cold:.3f}"
                    )
        if title.startswith("megatron-core proxy on H200"):
            rows = {row["layout"]: row for _, row in table_rows(body, "tokens/s/GPU")}
            base = number(rows["TP1 PP1 EP1 DP1"]["tokens/s/GPU"])
            for n, line in body:
                stated_ratios = re.search(r"DP2 (\d+\.\d+), EP2 (\d+\.\d+), PP2 (\d+\.\d+)", line)
                if stated_ratios:
                    layouts = ("TP1 PP1 EP1 DP2", "TP1 PP1 EP2 DP2", "TP1 PP2 EP1 DP1")
                    for layout, stated in zip(layouts, stated_ratios.groups(), strict=True):
                        ratio = number(rows[layout]["tokens/s/GPU"]) / base
                        if abs(ratio - float(stated)) > 0.006:
                            failures.append(f"{name}:{n}: {layout} ratio {stated}, but the table gives {ratio:.3f}")
    return failures


def check_config_table(docs: Docs) -> list[str]:
    """The configuration table (:data:`CONFIG_DOC`) lists exactly the options of each group in conf/."""
    failures, conf, seen = [], groups(), set()
    for n, line in enumerate(docs[CONFIG_DOC], 1):
        m = re.match(r"^\| `(\w+)` \| (.*?) \| .* \|$", line)
        if not m or m.group(1) not in conf:
            continue
        group = m.group(1)
        seen.add(group)
        listed = set()
        for option in re.findall(r"`([\w.*-]+)`", m.group(2)):
            matches = {o for o in conf[group] if re.fullmatch(option.replace("*", ".*"), o)}
            if not matches:
                failures.append(f"{CONFIG_DOC}:{n}: {group} option `{option}`: no conf/{group}/{option}.yaml")
            listed |= matches
        if conf[group] - listed:
            also = ", ".join(sorted(conf[group] - listed))
            failures.append(f"{CONFIG_DOC}:{n}: {group}: conf/{group}/ also has {also}")
    if seen != set(conf):
        lacks = ", ".join(sorted(set(conf) - seen))
        failures.append(f"{CONFIG_DOC}: the configuration table lacks the groups {lacks}")
    return failures


OUTSIDE_DATA = (".ci/", "tools/bazel/")  # named by the map, checked where the checkout is the working tree


def check_repository_map(docs: Docs) -> list[str]:
    """README's repository map names files, packages and modules that exist (``trainer/<package>/<module>.py``,
    or under its ``host/``)."""
    failures = []
    lines = docs["README.md"]
    start = next(i for i, line in enumerate(lines) if line.startswith("## Repository"))
    block = next(body for fence, _, body in fenced(lines) if fence > start)
    in_trainer, package = False, None
    for n, text in block:
        if not text.startswith(" "):
            top = text.split()[0]
            in_trainer = top == "trainer/"
            if top in OUTSIDE_DATA and os.environ.get("TEST_SRCDIR"):
                continue  # not data of the tests: Bazel's runfiles do not hold it
            if not (ROOT / top.rstrip("/")).exists():
                failures.append(f"README.md:{n}: {top}: no such file or directory")
            continue
        if not in_trainer:
            continue
        words = text[:55].split()
        if text.startswith("  ") and not text.startswith("   "):  # a new entry of trainer/
            package = words[0].rstrip("/") if words and words[0].endswith("/") else None
            words = words[1:] if package else words
        base = ROOT / "trainer" / (package or "")
        if package and not base.is_dir():
            failures.append(f"README.md:{n}: trainer/{package}/: no such package")
        for word in (w.strip("()") for w in words):
            if not word or word == "...":
                continue
            name = word[:-3] if word.endswith(".py") else word.rstrip("/")
            if not any(p.exists() for p in (base / f"{name}.py", base / name, base / "host" / f"{name}.py")):
                failures.append(f"README.md:{n}: trainer/{package + '/' if package else ''}{word}: no such module")
    return failures


def check_setup_packages(docs: Docs) -> list[str]:
    """The docs' list of what `bin/setup` installs is bin/setup's package list."""
    text = (ROOT / "bin" / "setup").read_text()
    match = re.search(r"^packages=\(([^)]*)\)", text, re.M)
    assert match, "bin/setup has no packages=(...) list"
    want = match.group(1).split()
    for name, lines in docs.items():
        for n, line in enumerate(lines, 1):
            if "installs the Debian packages the bundle uses" in line:
                para = paragraph_at(lines, n)
                listed = re.findall(r"`([\w-]+)`", para.split("(`--no-install-recommends`)")[0])
                if listed != want:
                    return [f"{name}:{n}: bin/setup installs {' '.join(want)}, the docs list {' '.join(listed)}"]
                return []
    return ["README.md: the list of what bin/setup installs is gone (from it and docs/)"]


def check_first_build(docs: Docs) -> list[str]:
    """README's time of a first debian-full build (and TE's share) is the one bench/RESULTS.md records."""
    section = next(
        (
            (start, body)
            for start, title, body in sections(docs["bench/RESULTS.md"])
            if title.startswith("A first debian-full build")
        ),
        None,
    )
    if section is None:
        return ['bench/RESULTS.md: no section "A first debian-full build"']
    recorded = search(r"([\d,]+) s, ([\d,]+) s of it", " ".join(line for _, line in section[1]))
    for name, lines in docs.items():
        for first, _, text in paragraphs(lines):
            flat = text.replace("\n", " ")
            m = re.search(
                r"first build (?:compiles the four build steps and )?took ([\d,]+) s.+?([\d,]+) s of it", flat
            )
            if m and m.groups() != recorded.groups():
                return [
                    f"{name}:{first}: a first debian-full build {m.group(1)} s ({m.group(2)} s TE), but "
                    f"bench/RESULTS.md:{section[0]} records {recorded.group(1)} s ({recorded.group(2)} s)"
                ]
            if m:
                return []
    return ["README.md: says nothing of how long a first debian-full build takes"]


def check_claims(docs: Docs) -> list[str]:
    """Sentences the code contradicts: DeepEP, aws-ofi-nccl or TE's extension "shipped, not compiled" (debian-full
    compiles them: a claim may stand for full.lock.json alone), `image diff IMAGE LOCK` "identical" outside a
    historical paragraph (the morning's image against today's lock exits 1)."""
    failures = []
    steps = [s["name"] for s in locks()["debian-full"]["builds"]]
    for name, lines in docs.items():
        for first, _, text in paragraphs(lines):
            for m in re.finditer(r"[^.]*(?:\.(?!\s)[^.]*)*", text):
                sentence = m.group(0)
                line = first + text[: m.start()].count("\n")
                flat = " ".join(sentence.split())
                if (
                    re.search(r"not compiled|uncompiled|ships? unbuilt|shipped, not", flat)
                    and re.search(r"DeepEP|aws-ofi-nccl|transformer-engine-torch|TE", flat)
                    and "full.lock.json" not in flat
                ):
                    failures.append(f"{name}:{line}: says a build step's output ({', '.join(steps)}) ships uncompiled")
                if "image diff IMAGE" in flat and "identical" in flat and not HISTORICAL.search(text):
                    failures.append(
                        f"{name}:{line}: `image diff IMAGE LOCK` said identical, outside a historical paragraph"
                    )
    return failures


def source_text() -> str:
    """Everything a flag or variable the docs name may be defined in: the package (its templates included), bin/,
    bench/, the locks (build steps' commands), conf/, the golden launch files (miles' and Megatron's flags) and
    bin/test-cluster's module."""
    files = [
        *(ROOT / "trainer").rglob("*.py"),
        *(ROOT / "trainer").rglob("*.tmpl"),
        *(ROOT / "bin").iterdir(),
        *(ROOT / "bench").glob("*.*"),
        *(ROOT / "lockfiles").glob("*.lock.json"),
        *(ROOT / "conf").rglob("*.yaml"),
        *(ROOT / "tests" / "golden").glob("*.txt"),
        *(ROOT / "tests" / "golden").glob("*.sh"),
        ROOT / "tests" / "conftest.py",
        ROOT / "tests" / "helpers.py",
        ROOT / "tests" / "cluster.py",  # bin/test-cluster's options
    ]
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def check_names(docs: Docs) -> list[str]:
    """Every option (a backticked ``--flag``) and every bundle environment variable (``TRAINER_*``,
    ``RECIPE_BUNDLE_*``, ``KERNEL_CACHE``, ``MEGATRON_LM_PATH``, ``MILES_PATH``) the docs name is defined somewhere
    in the sources."""
    failures, text = [], source_text()
    for name, number, m in lines_matching(docs, r"`(--[a-z][a-z0-9-]*)"):
        if not re.search(rf"{re.escape(m.group(1))}(?![a-z0-9-])", text):
            failures.append(f"{name}:{number}: {m.group(1)}: no such option in trainer/, bin/, bench/ or the locks")
    for name, number, m in lines_matching(
        docs, r"\b(TRAINER_[A-Z_]+|RECIPE_BUNDLE_[A-Z_]+|KERNEL_CACHE|MEGATRON_LM_PATH|MILES_PATH)\b"
    ):
        if not re.search(rf"\b{m.group(1)}\b", text):
            failures.append(f"{name}:{number}: ${m.group(1)}: no such environment variable in the sources")
    return failures


def check_lock_example(docs: Docs) -> list[str]:
    """lockfiles/README.md's example lock is JSON with the top-level keys of lockfiles/smoke.lock.json, and its
    values where they are not elided (``...``)."""
    lines = docs["lockfiles/README.md"]
    start, _, body = next(b for b in fenced(lines) if b[1] == "json")
    try:
        example = json.loads("\n".join(text for _, text in body))
    except ValueError as ex:
        return [f"lockfiles/README.md:{start}: the example lock is not JSON: {ex}"]
    smoke = locks()["smoke"]
    failures = []
    if set(example) != set(smoke):
        failures.append(
            f"lockfiles/README.md:{start}: the example lock's keys differ from lockfiles/smoke.lock.json's: "
            f"missing {sorted(set(smoke) - set(example))}, extra {sorted(set(example) - set(smoke))}"
        )
    for key in ("schema_version", "kind", "name", "epoch", "platform", "python", "base", "bundle", "image", "stack"):
        if key in example and key in smoke and "..." not in json.dumps(example[key]) and example[key] != smoke[key]:
            failures.append(
                f"lockfiles/README.md:{start}: example {key} {example[key]!r}, smoke.lock.json has {smoke[key]!r}"
            )
    return failures


# ---------------------------------------------------------------------------------------------------------------
# (d) the docs hold together: links and paragraphs

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
PARAGRAPH_WORDS = 120  # the most words of one paragraph of the guide, the reference pages and the changelog
SHORT_PARAGRAPHS = ("README.md", "CHANGELOG.md", *DOCS_PAGES)


def prose_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks."""
    inside = False
    for number_, line in enumerate(lines, 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            yield number_, line


def links(docs: Docs) -> Iterator[tuple[str, int, str, Path]]:
    """(doc, line, target as written, the file it names) of every relative link ``[text](target)`` outside code;
    a ``#fragment`` is cut, web addresses and in-page anchors are left out."""
    for name, lines in docs.items():
        for number_, line in prose_lines(lines):
            for m in LINK.finditer(line):
                target = m.group(2)
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                yield name, number_, target, (ROOT / name).parent / target.split("#")[0]


def check_links(docs: Docs) -> list[str]:
    """Every relative link of the docs names a file or directory of the repository, and README.md links every
    page of ``docs/`` (the guide is the way in to the reference)."""
    failures, linked = [], set()
    for name, number_, target, path in links(docs):
        resolved = os.path.normpath(path)
        inside = resolved == str(ROOT) or resolved.startswith(str(ROOT) + os.sep)
        rel = os.path.relpath(resolved, ROOT) if inside else None
        if rel is None or not os.path.exists(resolved):
            if rel is not None and rel.startswith(OUTSIDE_DATA) and os.environ.get("TEST_SRCDIR"):
                continue  # not data of the tests: Bazel's runfiles do not hold it
            failures.append(f"{name}:{number_}: link {target}: no such file in the repository")
        elif name == "README.md":
            linked.add(rel)
    for page in DOCS_PAGES:
        if page in docs and page not in linked:
            failures.append(f"README.md: {page} is not linked from the README")
    return failures


def check_paragraph_length(docs: Docs) -> list[str]:
    """No paragraph (a list item counts as its own paragraph; tables and code are left out) of README.md,
    CHANGELOG.md or a ``docs/`` page is longer than :data:`PARAGRAPH_WORDS` words."""
    failures = []
    for name in SHORT_PARAGRAPHS:
        if name not in docs:
            continue
        for first, _, text in paragraphs(docs[name]):
            chunk: list[str] = []
            start = first
            for offset, line in enumerate([*text.split("\n"), "| end"]):
                if line.startswith("|") or re.match(r"\s*(?:[-*]|\d+\.) ", line):
                    words = len(" ".join(chunk).split())
                    if words > PARAGRAPH_WORDS:
                        failures.append(f"{name}:{start}: a paragraph of {words} words (at most {PARAGRAPH_WORDS})")
                    chunk, start = [], first + offset
                    if line.startswith("|"):
                        continue
                chunk.append(line)
    return failures


CHECKS = [
    check_counts,
    check_digests,
    check_results_tables,
    check_ratios,
    check_config_table,
    check_repository_map,
    check_setup_packages,
    check_first_build,
    check_claims,
    check_names,
    check_lock_example,
    check_links,
    check_paragraph_length,
]


# ---------------------------------------------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def docs() -> Docs:
    return load_docs()


@pytest.fixture(autouse=True)
def at_the_repository_root(monkeypatch):
    # the docs' commands name paths from the repository root (lockfiles/..., bench/...), as a user runs them
    monkeypatch.chdir(ROOT)


def test_the_docs_are_where_the_tests_run():
    # under Bazel the repository root is the runfiles tree: the docs and bench/ are data of //tests:helpers
    for name in (
        *DOCS,
        "bench/h200_carry.sh",
        "bench/h200_setup.sh",
        "bench/h200_bench.sh",
        "bench/results/native_builds.json",
        "bin/setup",
    ):
        assert (ROOT / name).is_file(), f"{name} is not visible at {ROOT}"


def test_command_lines_are_found(docs):
    found = command_lines(docs)
    commands = [c for _, _, c, _ in found]
    assert len(found) > 120
    assert "nix run .#train -- layout=tp2pp4ep8" in commands
    assert any(c.startswith("bin/trainer cache add-git ../miles") for c in commands)
    assert any(c.startswith("bash bench/h200_setup.sh install") for c in commands)
    assert any(c.startswith("bazel test //tests/...") for c in commands)
    assert any(c.startswith("python bench/native_builds.py") for c in commands)


def test_every_command_line_shown_parses(docs):
    assert check_commands(docs) == []


@pytest.mark.parametrize(
    "doc,old,new,said",
    [
        # the drift: add-git without --commit is refused (exit 2)
        (
            "docs/locks-and-images.md",
            "bin/trainer cache add-git ../miles       --commit 78527b9102b3a5f15891128cbec3ac6c2dc4089e",
            "bin/trainer cache add-git ../miles --lock lockfiles/debian-full.lock.json",
            "docs/locks-and-images.md:",
        ),
        (
            "bench/RESULTS.md",
            "bash bench/h200_setup.sh te",
            "bash bench/h200_setup.sh native",
            "no subcommand or run native",
        ),
        (
            "README.md",
            "nix run .#train -- layout=tp8pp8ep8",
            "nix run .#train -- layout=tp8pp9ep8",
            "no conf/layout/tp8pp9ep8.yaml",
        ),
        (
            "docs/runs.md",
            "cluster.partition=<partition>",
            "cluster.partitio=<partition>",
            "cluster.partitio: not a key",
        ),
        (
            "docs/reports.md",
            "bin/trainer report RUN_DIR [--window 5:19]",
            "bin/trainer report RUN_DIR [--windw 5:19]",
            "does not parse",
        ),
        (
            "README.md",
            "bin/trainer data verify rows --rederive 20",
            "bin/trainer data verify rows --rederive twenty",
            "exit 2",
        ),
        (
            "lockfiles/README.md",
            "python bench/native_builds.py --step aws-ofi-nccl --record",
            "python bench/native_builds.py --stpe aws-ofi-nccl --record",
            "bench/native_builds.py --stpe",
        ),
        (
            "README.md",
            "bazel test //tests/...                  # the tests",
            "bazel test //tests:test_nothing",
            "no tests/test_nothing.py",
        ),
        (
            "docs/nix-and-bazel.md",
            "`bin/python-env --torch-source`",
            "`bin/python-env --torch-sources`",
            "knows no --torch-sources",
        ),
        (
            "README.md",
            "`trainer verify`, `trainer report`",
            "`trainer verfy`, `trainer report`",
            "unknown trainer command 'verfy'",
        ),
        (
            "docs/runs.md",
            "bin/train launcher=ray launcher.address=http://HEAD:8265",
            "bin/train launcher=rey launcher.address=x",
            "no conf/launcher/rey.yaml",
        ),
        ("docs/runs.md", "hydra.run.dir=/shared/runs/dsv4-tp2pp4ep8", "hydra.rundir=/shared", "not a Hydra key"),
    ],
)
def test_a_command_line_that_does_not_parse_is_named(docs, doc, old, new, said):
    failures = check_commands(tampered(docs, doc, old, new))
    assert failures and all(f.startswith(doc + ":") for f in failures), failures
    assert any(said in f for f in failures), failures
    line = next(i for i, text in enumerate(tampered(docs, doc, old, new)[doc], 1) if new in text)
    # the line named is the command's first: the tampered line or up to two above it (continued lines)
    assert any(f.startswith(tuple(f"{doc}:{n}:" for n in range(line - 2, line + 1))) for f in failures), (
        line,
        failures,
    )


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_stated_figures_match_their_files(docs, check):
    assert check(docs) == []


@pytest.mark.parametrize(
    "check,doc,old,new,said",
    [
        (
            check_counts,
            "docs/locks-and-images.md",
            "110 pinned .debs",
            "94 pinned .debs",
            "lockfiles/debian-full.lock.json has 110",
        ),
        (
            check_counts,
            "lockfiles/README.md",
            "base of 110 pinned .debs",
            "base of 94 pinned .debs",
            "lockfiles/debian-full.lock.json has 110",
        ),
        (
            check_counts,
            "bench/RESULTS.md",
            "(110 .debs + 191 wheels + 2",
            "(110 .debs + 195 wheels + 2",
            "195 wheels for debian-full",
        ),
        (check_counts, "bench/RESULTS.md", "2 sdists = 287 inputs", "2 sdists = 288 inputs", "is 287, not 288"),
        (check_digests, "bench/RESULTS.md", "historical) was recorded", "was recorded", "sha256:afeaff9152fda55c"),
        (
            check_digests,
            "docs/locks-and-images.md",
            "sha256:7b6a35df9839fd593a94",
            "sha256:7b6a35df9839fd593a95",
            "not in lockfiles/expected",
        ),
        (check_results_tables, "bench/RESULTS.md", "| tiny | 32,388 |", "| tiny | 33,388 |", "gives 32388"),
        (check_results_tables, "bench/RESULTS.md", "| 62.3 | 5.5% |", "| 62.3 | 5.9% |", "MFU 5.9%"),
        (
            check_results_tables,
            "bench/RESULTS.md",
            "| 14,156 | 69.5 | 0.0645 | 4.81% |",
            "| 14,156 | 69.5 | 0.0645 | 4.18% |",
            "step-time CV 4.18%",
        ),
        (
            check_results_tables,
            "bench/RESULTS.md",
            "| 9.6 s | 9.8 s |",
            "| 9.6 s | 9.9 s |",
            "antlr4-python3-runtime took",
        ),
        (
            check_results_tables,
            "bench/RESULTS.md",
            "1,136,640 B, sha256:5bed0a4a105d",
            "1,136,640 B, sha256:5bed0a4a105e",
            "aws-ofi-nccl sha256",
        ),
        (check_ratios, "bench/RESULTS.md", "0.227 s, 1.97x", "0.227 s, 1.79x", "0.227 / 0.115"),
        (check_ratios, "bench/RESULTS.md", "| 0.649 |", "| 0.694 |", "wall ratio 0.694"),
        (check_ratios, "bench/RESULTS.md", "| 7.9x |", "| 1.5x |", "cold/floor 1.5x"),
        (check_ratios, "bench/RESULTS.md", "DP2 0.98, EP2 1.11", "DP2 0.98, EP2 1.21", "TP1 PP1 EP2 DP2 ratio 1.21"),
        (
            check_config_table,
            "docs/compose.md",
            "`plan`, `local-cpu`, ",
            "`plan`, `local-gpu`, ",
            "no conf/launcher/local-gpu.yaml",
        ),
        (check_config_table, "docs/compose.md", ", `synthetic-8192` |", " |", "also has synthetic-8192"),
        (
            check_repository_map,
            "README.md",
            "referrers recorded smoke remote",
            "referers recorded smoke remote",
            "trainer/image/referers",
        ),
        (check_setup_packages, "docs/setup.md", "`munge`, `bubblewrap`", "`munge`", "bin/setup installs"),
        (
            check_names,
            "docs/data.md",
            "unless `--keep-reasoning`",
            "unless `--keep-reasonings`",
            "--keep-reasonings: no such option",
        ),
        (
            check_names,
            "docs/compose.md",
            "`TRAINER_COMPOSE_CACHE=DIR`",
            "`TRAINER_COMPOSE_CACHES=DIR`",
            "$TRAINER_COMPOSE_CACHES",
        ),
        (
            check_lock_example,
            "lockfiles/README.md",
            '"epoch": 1767225600,',
            '"epoch": 1767225601,',
            "example epoch 1767225601",
        ),
        (
            check_lock_example,
            "lockfiles/README.md",
            '"resolved_from": {"requirements"',
            '"resolved": {"requirements"',
            "missing ['resolved_from']",
        ),
        # the drift: a first build is 1,186 s, not 95 s; the build steps are compiled; image diff exits 1 now
        (check_first_build, "docs/locks-and-images.md", "took 1,186 s", "took 95 s", "records 1,186 s"),
        # the docs hold together: a page's link that names nothing, a page the README no longer links, a wall
        (check_links, "docs/runs.md", "(supply-chain.md)", "(supply-chains.md)", "link supply-chains.md: no such"),
        (check_links, "docs/compose.md", "(../SECURITY.md)", "(../SECURITY.txt)", "link ../SECURITY.txt"),
        (
            check_paragraph_length,
            "docs/data.md",
            "A conversation's tokens and mask depend on that conversation alone",
            "A conversation's tokens and mask depend on that conversation alone" + " and on nothing else" * 20,
            "a paragraph of",
        ),
        (
            check_claims,
            "lockfiles/README.md",
            "DeepEP, aws-ofi-nccl and TE's torch extension are compiled there, not shipped as sources.",
            "The sources of DeepEP and aws-ofi-nccl are shipped, not compiled.",
            "ships uncompiled",
        ),
        (
            check_claims,
            "bench/RESULTS.md",
            "Historical, of the morning's image (c3ca95de): its",
            "Of the image: its",
            "said identical, outside a historical paragraph",
        ),
    ],
)
def test_a_figure_that_drifted_is_named(docs, check, doc, old, new, said):
    failures = check(tampered(docs, doc, old, new))
    assert failures and any(said in f for f in failures), failures
    assert all(f.startswith(doc + ":") for f in failures), failures


def test_a_docs_page_the_readme_does_not_link_is_named(docs):
    readme = [re.sub(r"\]\(docs/data\.md\)", "]", line) for line in docs["README.md"]]
    assert readme != docs["README.md"]
    assert check_links({**docs, "README.md": readme}) == ["README.md: docs/data.md is not linked from the README"]


def test_the_docs_hold_their_pages(docs):
    # the reference moved from the README into docs/: each page is there, checked, and says where its code lives
    assert len(DOCS_PAGES) >= 8 and "docs/compose.md" in DOCS_PAGES and "CHANGELOG.md" in docs
    for page in DOCS_PAGES:
        intro = " ".join(docs[page][:8])
        assert docs[page][0].startswith("# ") and "Where it lives:" in intro, f"{page}: no 'Where it lives:' opening"
    assert sum(1 for _ in links(docs)) >= 30
    assert len(docs["README.md"]) <= 250, f"README.md is {len(docs['README.md'])} lines, a guide is at most 250"


def test_the_checks_see_the_statements(docs):
    # not vacuous: the statements each check compares are found
    assert len(list(lines_matching(docs, r"sha256:[0-9a-f]{8,64}"))) >= 15
    assert len(list(lines_matching(docs, r"\b\d[\d,]* (?:pinned )?(?:\.debs|wheels|sdists)\b"))) >= 8
    assert sum(1 for _, _, c, _ in command_lines(docs) if c.startswith(("bin/train ", "nix run .#train -- "))) >= 10


def script_header_commands() -> list[tuple[str, int, str, bool]]:
    """The commands that the header comments of bench/*.sh name in backticks (``bash bench/...``, ``python3
    bench/...``), as (script, line, command, inline)."""
    out = []
    for path in sorted((ROOT / "bench").glob("*.sh")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("#"):
                break
            for m in re.finditer(r"`([^`]+)`", line):
                out += [(f"bench/{path.name}", n, part, True) for part in split_commands(m.group(1))]
    return out


def test_bench_script_headers_name_commands_that_exist():
    found = script_header_commands()
    assert any(c == "bash bench/native_h200.sh" for _, _, c, _ in found)  # what h200_carry.sh's header names now
    failures = [f"{d}:{n}: {p}" for d, n, c, i in found for p in [check_command(c, i)] if p]
    assert failures == []


def test_a_bench_header_naming_a_missing_subcommand_is_named():
    # the drift: h200_carry.sh's header named `bash bench/h200_setup.sh native`, which does not exist
    assert check_command("bash bench/h200_setup.sh native", True) == (
        "bench/h200_setup.sh has no subcommand or run native (it has cudnn-dir, deepep, fht, install, run, stash, te)"
    )
    assert check_command("bash bench/h200_bench.sh tiny tiny-nodistop", True).startswith(
        "bench/h200_bench.sh has no subcommand or run tiny-nodistop"
    )


def test_historical_marks_only_their_own_paragraph(docs):
    # the mark excuses the digests of its paragraph (or table with its caption), never another's
    lines = list(docs["bench/RESULTS.md"])
    row = next(i for i, line in enumerate(lines) if "sha256:c3ca95de" in line)
    blank = next(i for i in range(row, len(lines)) if not lines[i].strip())  # the end of that table
    lines[blank + 1 : blank + 1] = ["The image is `sha256:c3ca95debd075d82`.", ""]
    failures = check_digests({**docs, "bench/RESULTS.md": lines})
    assert failures == [
        f"bench/RESULTS.md:{blank + 2}: sha256:c3ca95debd075d82 is not in lockfiles/expected-digests.json "
        "nor a lock, and its paragraph does not say it is historical"
    ]


# (c) cheap commands, run in-process, against what the docs show


def trainer(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def doc_line(docs: Docs, name: str, holding: str) -> tuple[int, str]:
    for n, line in enumerate(docs[name], 1):
        if holding in line:
            return n, line
    raise AssertionError(f"{name}: no line holds {holding!r}")


@pytest.mark.parametrize("lock", ["smoke", "full", "debian-full"])
def test_lock_verify_of_each_lock(lock, capsys, docs):
    code, out, err = trainer(["lock", "verify", f"lockfiles/{lock}.lock.json"], capsys)
    assert code == 0, err
    data = json.loads((ROOT / "lockfiles" / f"{lock}.lock.json").read_text())
    assert out.startswith(
        f"ok: lockfiles/{lock}.lock.json ({len(data['wheels'])} wheels, {len(data['sdists'])} sdists, "
        f"{len(data['sources'])} sources, base {data['base']['type']}; inputs: {lock}.in as resolved)"
    )


def test_lock_verify_refuses_the_debian_smoke_torch_as_lockfiles_readme_says(capsys, docs):
    n, _ = doc_line(docs, "lockfiles/README.md", "`trainer lock verify` says")
    code, _, err = trainer(["lock", "verify", "lockfiles/debian-smoke.lock.json"], capsys)
    assert code == 2 and "torch: lock has 2.13.0+cpu, stack.json components.torch pins 2.11.0" in err, (
        f"lockfiles/README.md:{n}: {err}"
    )


def test_image_check_predict_prints_what_the_docs_show(docs):
    n, line = doc_line(docs, "docs/locks-and-images.md", "--predict              # ")
    shown = line.split("# ", 1)[1]
    # a subprocess, as a user runs it: in-process, Bazel's runfiles tree (symlinks) would be the bundle root
    proc = helpers.run_trainer("image", "check", "--lock", ROOT / "lockfiles/debian-full.lock.json", "--predict")
    code, out, err = proc.returncode, proc.stdout, proc.stderr
    digest = expected()["debian-full"]["manifest_digest"]
    assert code == 0, err
    assert out.strip() == shown.replace("sha256:...", digest), (
        f"docs/locks-and-images.md:{n}: shows {shown!r}, the command prints {out!r}"
    )


def test_image_check_predict_fails_on_a_stale_record(tmp_path):
    table = expected()
    table["debian-full"]["manifest_digest"] = "sha256:" + "0" * 64
    stale = tmp_path / "expected.json"
    stale.write_text(json.dumps(table))
    proc = helpers.run_trainer(
        "image", "check", "--lock", ROOT / "lockfiles/debian-full.lock.json", "--predict", "--expected", stale
    )
    assert proc.returncode == 1 and "ok:" not in proc.stdout and "different:" in proc.stdout, proc.stderr


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_of_each_subcommand(command, capsys):
    if command == "train":
        proc = helpers.run_train(["--help"], cwd=ROOT)
        assert proc.returncode == 0 and "launcher" in proc.stdout, proc.stderr
        return
    try:
        code = cli.main([command, "--help"])
    except SystemExit as ex:  # argparse's --help
        code = ex.code
    assert code == 0
    assert f"usage: trainer {command}" in capsys.readouterr().out


def test_trainer_help_lists_every_command(capsys):
    code, out, _ = trainer(["--help"], capsys)
    assert code == 0 and all(f"  {name}" in out for name in cli.COMMANDS)


def test_the_plan_prints_what_readme_shows(docs, tmp_path):
    lines = docs["README.md"]
    start = next(i for i, line in enumerate(lines) if line == "$ nix run .#train -- layout=tp2pp4ep8")
    shown = []
    for n in range(start + 1, len(lines)):
        if lines[n].startswith("```"):
            break
        shown.append((n + 1, lines[n]))
    proc = helpers.run_train(["layout=tp2pp4ep8", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout + proc.stderr
    assert sum(1 for _, line in shown if line.startswith(("│", "peak estimate"))) == 5
    rows = [" ".join(c.split()) for line in printed.splitlines() for c in [line.replace("│", " ").strip()] if c]
    for n, line in shown:
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            want = " ".join(cells[1].replace("...", "").split())
            assert any(r.startswith(cells[0]) and want in r for r in rows), f"README.md:{n}: {line!r} not printed"
        elif line.startswith("peak estimate"):
            assert line in printed, f"README.md:{n}: {line!r} not printed"


def test_refused_overrides_print_the_lines_the_docs_show(docs, tmp_path):
    checked = 0
    for name, lines in docs.items():
        for n, line in enumerate(lines, 1):
            if line.startswith("$ nix run .#train -- ") and lines[n].startswith("train: error:"):
                args = shlex.split(line[len("$ nix run .#train -- ") :])
                run = tmp_path / f"{name.replace('/', '-')}-{n}"
                proc = helpers.run_train([*args, f"hydra.run.dir={run}"], cwd=tmp_path)
                assert proc.returncode == 2, f"{name}:{n}: exit {proc.returncode}"
                assert proc.stderr.strip() == lines[n], (
                    f"{name}:{n + 1}: shows {lines[n]!r}, train says {proc.stderr!r}"
                )
                assert not run.exists()
                checked += 1
    assert checked == 2


def test_an_unseeded_registry_base_is_refused_as_lockfiles_readme_says(docs, capsys, tmp_path):
    n, _ = doc_line(docs, "lockfiles/README.md", "be seeded on these machines, and the build says exactly that")
    shown = re.search(
        r"\(`(missing base image.*?)`\)", paragraph_at(docs["lockfiles/README.md"], n).replace("\n  ", " "), re.S
    ).group(1)
    code, _, err = trainer(
        [
            "image",
            "build",
            "--lock",
            "lockfiles/full.lock.json",
            "--out",
            str(tmp_path / "o"),
            "--offline",
            "--cache",
            str(tmp_path / "cas"),
            "-q",
        ],
        capsys,
    )
    assert code == 2
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    assert re.search(pattern, err), f"lockfiles/README.md:{n}: shows {shown!r}, the build says {err!r}"


# the CPU run's report speaks of CPU processes, not GPUs (issue #27, the smoke report)


def cpu_run(tmp_path: Path) -> Path:
    """A run directory of experiment=smoke as a CPU run leaves it: its plan's files, the recipe's metrics rows,
    a probe whose ranks saw no GPU."""
    run = tmp_path / "run"
    proc = helpers.run_train(["experiment=smoke", "launcher=plan", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    helpers.write_rows(run / "metrics.jsonl", helpers.recipe_rows())
    record = json.loads((run / "record.json").read_text())
    record["probe"] = {"ranks": [{"rank": 0, "torch": {"version": "2.13.0+cpu", "gpus": 0}}]}
    (run / "record.json").write_text(json.dumps(record))
    return run


def test_a_cpu_runs_report_speaks_of_cpu_process_hours(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    run = cpu_run(tmp_path)
    code, out, err = trainer(["report", str(run), "--no-plot", "--no-cost"], capsys)
    assert code == 0, err
    assert "CPU-process-hours" in out and "GPU-hours" not in out and "GPU-hour" not in out
    assert "tokens/s per process" in out and "MFU" in out and "n/a" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run"]["gpu_type"] == "CPU processes" and summary["mfu"] is None
    assert summary["gpu_hours_note"].startswith("CPU-process-hours, no GPU in the run: processes x sum of step times")
    # the run as a recipe says so too, and stays valid against schema/recipe.schema.yaml
    out = tmp_path / "recipe.yaml"
    code, _, err = trainer(["recipe", str(run), "--no-cost", "-o", str(out)], capsys)
    assert code == 0, err
    import yaml

    assert yaml.safe_load(out.read_text())["result"]["gpu_hours_note"].startswith("CPU-process-hours")
    assert trainer(["recipe", "--validate", str(out)], capsys)[0] == 0
    # a run whose probe saw a GPU keeps GPU-hours
    record = json.loads((run / "record.json").read_text())
    record["probe"]["ranks"][0]["torch"]["gpus"] = 1
    (run / "record.json").write_text(json.dumps(record))
    code, out, err = trainer(["report", str(run), "--no-plot", "--no-cost"], capsys)
    assert code == 0, err
    assert "GPU-hours" in out and "CPU-process-hours" not in out and "tokens/s per GPU" in out


# bench/h200_carry.sh stops when the image's build steps are not built (issue #27)


def carry(tmp_path: Path):
    import subprocess

    return subprocess.run(
        ["bash", str(ROOT / "bench" / "h200_carry.sh"), str(tmp_path / "megatron.git"), str(tmp_path / "miles.git")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_carry_stops_without_the_image_build_steps(tmp_path):
    # the tests' cache ($XDG_CACHE_HOME, conftest) holds no built layer
    proc = carry(tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "not built: transformer-engine-torch, deepep, aws-ofi-nccl" in lines[0]
    assert lines[0].endswith(
        "build them with bin/trainer image build --lock lockfiles/debian-full.lock.json "
        "--out build/debian-full.oci --jobs 2"
    )


def test_the_carry_names_only_the_steps_that_are_missing(tmp_path):
    from trainer.image.cas import Cache
    from trainer.image.native import step_keys
    from trainer.lock.imagelock import load_lock

    cache = Cache()
    keys = step_keys(load_lock(ROOT / "lockfiles" / "debian-full.lock.json"))
    blob = cache.add_bytes(b"a built layer")
    for step in ("deepep", "aws-ofi-nccl"):
        cache.put_layer_record(keys[step], {"diff_id": f"sha256:{blob}", "size": len(b"a built layer")})
    # a record forged for the TE step (its MAC made for another key) counts as not built
    forged = json.loads((cache.root / "layers" / f"{keys['deepep']}.json").read_text())
    (cache.root / "layers" / f"{keys['transformer-engine-torch']}.json").write_text(json.dumps(forged))
    try:
        proc = carry(tmp_path)
    finally:
        for step in ("deepep", "aws-ofi-nccl", "transformer-engine-torch"):
            (cache.root / "layers" / f"{keys[step]}.json").unlink()
    assert proc.returncode == 1
    assert "not built: transformer-engine-torch (cache " in proc.stderr and "deepep" not in proc.stderr.split(";")[0]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
