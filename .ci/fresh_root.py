"""The README's two commands, verbatim, in a fresh Debian 12 root built now: the check that set-up works on a new machine.

1. ``mmdebstrap --variant=minbase bookworm`` builds the root from the host's apt sources and settings (nothing else).
2. The root gets only the host's package access: its apt sources and settings, its CA certificates, its pip
   configuration (the files ``pip config debug`` names, the ``PIP_*`` variables) and, read-only at the same paths,
   the local wheel folders and indexes that configuration names; and a clone of this repository (HEAD) in
   ``/root/recipe-bundle``.
3. Each command of the README's "Two commands" block runs there in its own ``bwrap --bind ROOT / --proc /proc
   --dev /dev --ro-bind /sys /sys`` (private PID, IPC and UTS namespaces, the host's network; sysfs as on any
   machine: slurmd wants the cgroup file system), as a user would type them one after
   the other: first ``bin/setup && nix run .#train -- layout=tp2pp4ep8``, then ``bin/setup && bazel test
   //tests/...`` (the second finds the first's set-up done: its ``bin/setup`` is the warm one).
4. The JUnit XML of the tests is copied to ``--testlogs DIR`` (for .ci/summary.py), the root removed.

Nothing is left out: every test module runs in the root as well. What such a root lacks that a whole machine has,
and how the bundle does without it: no ``/etc/hosts`` (the test Slurm cluster uses addresses, and its daemons run
with host name 127.0.0.1 in a UTS namespace of their own); no init system (the tests start their own daemons);
Bazel's linux-sandbox does not start inside bubblewrap, so Bazel uses its processwrapper sandbox (a writable
HOME: test_run_cpu's read-only-HOME run checks that case by itself); bubblewrap sandboxes nest (local-image
asks for no user namespace as root). Exit code: 0 when both commands exit 0, else the failing command's code.
Needs root (mmdebstrap and bind mounts), mmdebstrap and bubblewrap (bin/setup installs both).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).absolute().parent.parent
INSIDE = "/root/recipe-bundle"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def readme_commands() -> list[str]:
    """The commands of the README's "Two commands" block, as written there (comments after `#` dropped)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## Two commands.*?^```bash\n(.*?)^```", text, re.S | re.M)
    if not block:
        raise SystemExit("fresh-root: README.md has no '## Two commands' section with a bash block")
    commands = [re.sub(r"\s+#.*", "", line).strip() for line in block.group(1).splitlines()]
    commands = [c for c in commands if c]
    if len(commands) != 2:
        raise SystemExit(f"fresh-root: README.md's Two commands block has {len(commands)} commands, expected 2")
    return commands


def pip_access(python: str) -> tuple[list[str], list[str], dict[str, str]]:
    """(configuration files, folders and files they name, PIP_* variables) of the host's pip configuration."""
    out = subprocess.run([python, "-m", "pip", "config", "debug"], capture_output=True, text=True, check=True).stdout
    files = [m.group(1) for m in re.finditer(r"^\s+(/\S+), exists: True$", out, re.M)]
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    values = re.findall(r"^\s+\S+?[:=]\s*'?(.*?)'?$", out, re.M) + list(env.values())
    named = []
    for value in values:
        for word in value.split():
            path = word[len("file://") :] if word.startswith("file://") else word
            if os.path.basename(path.rstrip("/")) == "simple":  # a local index: its pages link to ../files etc.
                path = os.path.dirname(path.rstrip("/"))
            if path.startswith("/") and os.path.exists(path) and path not in named:
                named.append(path)
    return files, named, env


def run(argv: list[str], **kw) -> int:
    print("+ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    return subprocess.run(argv, **kw).returncode


def build_root(root: Path) -> None:
    """mmdebstrap minbase bookworm from the host's apt sources and settings."""
    sources = [
        f
        for f in [
            "/etc/apt/sources.list",
            *sorted(glob.glob("/etc/apt/sources.list.d/*.list")),
            *sorted(glob.glob("/etc/apt/sources.list.d/*.sources")),
        ]
        if os.path.isfile(f) and os.path.getsize(f)
    ]
    options = [f for f in ["/etc/apt/apt.conf", *sorted(glob.glob("/etc/apt/apt.conf.d/*"))] if os.path.isfile(f)]
    argv = [
        "mmdebstrap",
        "--quiet",
        "--variant=minbase",
        *[f"--aptopt={f}" for f in options],
        "bookworm",
        str(root),
        *sources,
    ]
    if run(argv) != 0:
        raise SystemExit("fresh-root: mmdebstrap failed")


def provision(root: Path, python: str) -> tuple[list[str], dict[str, str]]:
    """Copy the host's package access and a clone into ``root``; return (read-only binds, pip variables). The
    directory ``$RECIPE_BUNDLE_SOURCES`` names (archives of the locked Megatron-LM and miles commits, test data
    the Megatron-LM parse tests seed their cache from) is bound read-only and named there too."""
    files, named, env = pip_access(python)
    copies = ["/etc/ssl/certs/ca-certificates.crt", *glob.glob("/usr/local/share/ca-certificates/*"), *files]
    binds = []
    for path in named:
        if os.path.isdir(path):
            binds.append(path)
        else:
            copies.append(path)
    for path in copies:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    if run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(root / INSIDE.lstrip("/"))]) != 0:
        raise SystemExit("fresh-root: git clone failed")
    sources = os.environ.get("RECIPE_BUNDLE_SOURCES")
    if sources and os.path.isdir(sources):  # test data: archives of the locked commits, checked by tree id there
        binds.append(os.path.abspath(sources))
        env["RECIPE_BUNDLE_SOURCES"] = os.path.abspath(sources)
    return binds, env


def enter(root: Path, binds: list[str], env: dict[str, str], command: str) -> int:
    """Run ``command`` with bash in ``root`` under bubblewrap, as root, in the clone."""
    argv = [
        "bwrap",
        "--bind",
        str(root),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--ro-bind",
        "/sys",
        "/sys",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "fresh-debian12",
        "--die-with-parent",
        "--cap-add",
        "ALL",
    ]
    for path in binds:
        argv += ["--ro-bind", path, path]
    argv += [
        "--clearenv",
        "--setenv",
        "HOME",
        "/root",
        "--setenv",
        "PATH",
        PATH,
        "--setenv",
        "TERM",
        "dumb",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    # xtrace marks when each command of the line starts (PS4 with the time; bash run as root ignores an inherited
    # PS4), for the timings printed after it
    argv += ["--chdir", INSIDE, "bash", "-c", "PS4='+ [$EPOCHREALTIME] '; set -x; " + command]
    print("+ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    start = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    marks = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        mark = re.match(r"\+ \[(\d+\.\d+)\] (.*)", line)
        if mark:
            marks.append((float(mark.group(1)), mark.group(2).strip()))
    rc = proc.wait()
    end = time.time()
    steps = ", ".join(
        f"{what.split(' -- ')[0]} {(marks[i + 1][0] if i + 1 < len(marks) else end) - at:.1f} s"
        for i, (at, what) in enumerate(marks)
    )
    print(f"fresh-root: `{command}` exited {rc} after {end - start:.1f} s ({steps})", flush=True)
    return rc


def main() -> int:
    def stop(*_):  # so that the root is removed when CI stops this; a second SIGTERM must not stop the removal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testlogs", help="copy the tests' JUnit XML (test.xml files) here")
    parser.add_argument("--keep", action="store_true", help="keep the root (its path is printed)")
    args = parser.parse_args()
    commands = readme_commands()
    python = subprocess.run(
        [str(REPO / "bin" / "python-env")], capture_output=True, text=True, check=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="fresh-root-", dir=os.environ.get("TMPDIR", "/tmp")))
    root = work / "root"
    rc = 0
    try:
        start = time.monotonic()
        build_root(root)
        print(f"fresh-root: Debian 12 minbase root built in {time.monotonic() - start:.0f} s ({root})", flush=True)
        binds, env = provision(root, python)
        for command in commands:
            rc = enter(root, binds, env, command)
            if rc != 0:
                break
        if args.testlogs:
            logs = root / "root" / ".cache" / "bazel"
            # os.walk never follows links (a test's tree may hold link loops; a recursive glob would walk them)
            for top, dirs, files in os.walk(logs):
                if "test.xml" in files and "/testlogs/tests" in top:
                    rel = os.path.join(top, "test.xml").split("/testlogs/", 1)[1]
                    target = Path(args.testlogs) / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(os.path.join(top, "test.xml"), target)
    finally:
        if args.keep:
            print(f"fresh-root: kept {root}")
        else:
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)])
    return rc


if __name__ == "__main__":
    sys.exit(main())
