"""The import contract between the phases, from the source (an ast walk: every ``import`` and ``from`` at any
depth, module level, under ``if TYPE_CHECKING:`` and inside functions, relative imports resolved).

The graph's nodes are the phase packages (``trainer.compose``, ``trainer.launch`` with ``launch.host`` inside it,
...), the root modules (``trainer.errors``, ``trainer.redact``, ...) and the commands that sit on top of their
package (:data:`COMMAND_MODULES`). Asserted: no cycle between nodes; no function-local import of a project
module, and a function-local import of a third-party module only for the packages of :data:`LAZY_IMPORTS`;
every import goes down :data:`LAYERS` (pyproject.toml's ``[tool.importlinter]`` states the same contract for
``lint-imports``, which tests/test_lint.py runs).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "trainer"

# The layers, highest first: a module may import its own node and any node of a lower layer; the nodes of one
# layer import none of each other. The entry points on top; the commands of :data:`COMMAND_MODULES` with them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("trainer.__main__",),
    ("trainer.cli",),
    ("trainer.train", "commands"),
    ("trainer.launch",),  # the launchers (launch.host) and what runs inside the job
    ("trainer.probe",),  # the version probe the job runs on every node (`python -m trainer.probe` in sbatch.sh)
    ("trainer.report",),  # figures of a run directory; its metrics row is what the workers write
    ("trainer.record",),  # the run directory, its record, attestations, verification
    ("trainer.data", "trainer.models"),  # the training rows; the model built by the local launchers
    ("trainer.compose",),  # compose, check, render, plan
    ("trainer.image",),  # the OCI image built from a lock
    ("trainer.lock",),  # the image locks and the launcher lock
    ("trainer.runlog", "trainer.console", "trainer.publish", "trainer.signing"),  # shared utilities: import no phase
    ("trainer.redact",),
    ("trainer.inputs",),
    ("trainer.errors",),
    ("trainer",),  # REPO_ROOT, the version, the project's name
)
# Commands that sit on top of their own package (``trainer COMMAND`` runs them; nothing but the entry points
# imports them): they may import any phase below the entry points.
COMMAND_MODULES = frozenset(
    {
        "trainer.data.cli",
        "trainer.lock.cli",
        "trainer.image.cli",
        "trainer.image.cachecli",
        "trainer.report.convergence_cli",
    }
)
PHASES = ("compose", "data", "lock", "image", "launch", "record", "report", "models")
# Third-party packages imported inside the functions that need them, each with why (anything else imported in a
# function body is a finding). The standard library is not listed: it is always there and cheap.
LAZY_IMPORTS: Mapping[str, str] = {
    "torch": "the job's image only (the launcher environment has no torch)",
    "megatron": "the job's image only (the local-megatron worker)",
    "miles": "the job's image only",
    "transformers": "the job's image only (the HF model of the local-cpu worker)",
    "tokenizers": "the data build's tokenizer: heavy, and absent where only `train` runs",
    "pyarrow": "the data rows' Parquet: heavy, needed only by the data build and the workers",
    "ray": "the Ray launcher's job side and its tests' head: optional",
    "psutil": "Ray's dependency, on the cluster side of launcher.payload=cpu (trainer.launch.ray_workers)",
    "spdx_tools": "SBOMs only (`trainer image build`): heavy",
    "cyclonedx": "SBOMs only (`trainer image build`): heavy",
    "packageurl": "SBOMs only",
    "securesystemslib": "signing only (`--key`, `trainer keygen`): heavy",
    "cryptography": "signing only (`--key`, `trainer keygen`)",
    "jsonschema": "recipe validation only (`trainer recipe --validate`)",
    "hydra": "startup: a warm plan (the composition cache) and the other commands never compose (bench/RESULTS.md)",
    "omegaconf": "startup: the commands that read no composition do not load it",
    "rich": "startup: piped output is plain text; rich draws only on a terminal (bench/RESULTS.md: tty)",
    "yaml": "startup: only the readers of YAML files load it",
    "packaging": "startup: only the lock resolver and the stack pins compare versions",
}
# Imports under ``if __name__ == "__main__":`` (the module run as a script) allowed to reach up, with why: none
# (a command runs as `trainer COMMAND`, not as `python -m` of its module).
MAIN_BLOCK_IMPORTS: Mapping[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One imported module: ``importer`` (dotted name) imports ``imported`` (a project module, resolved to the
    longest known module name, or a third-party/standard top-level name) at ``path:line``; ``local`` when inside a
    function body, ``main`` when under ``if __name__ == "__main__":``."""

    importer: str
    imported: str
    path: str
    line: int
    local: bool
    main: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}{' (in a function)' if self.local else ''}"


def module_names(root: Path = PACKAGE) -> dict[str, bool]:
    """Every module of the package under ``root``: dotted name -> whether it is a package (``__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        names[".".join(parts[:-1] if package else parts)] = package
    return names


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def imports_of(module: str, source: str, is_package: bool, known: Iterable[str], path: str = "") -> list[Import]:
    """Every import of ``source`` (the text of ``module``), at any depth, relative ones resolved against the
    module's package; ``from X import name`` is an import of ``X.name`` when that is one of the ``known`` modules.
    """
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def resolve(name: str) -> str:
        if name.split(".")[0] != "trainer":
            return name.split(".")[0]
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        return name

    def visit(node: ast.AST, local: bool, main: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, resolve(alias.name), path, child.lineno, local, main))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                for alias in child.names:
                    full = f"{name}.{alias.name}"
                    target = resolve(full if full in known else name)
                    found.append(Import(module, target, path, child.lineno, local, main))
            inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, inner, main or _is_main_guard(child))

    visit(ast.parse(source), False, False)
    return found


def node_of(module: str) -> str:
    """The graph node of a project module: its command (:data:`COMMAND_MODULES`), its phase package, or itself
    (a root module)."""
    if module in COMMAND_MODULES:
        return module
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in PHASES:
        return ".".join(parts[:2])
    return module


def layer_of(node: str) -> int:
    """Index of ``node``'s layer in :data:`LAYERS` (0 is the top)."""
    for i, layer in enumerate(LAYERS):
        if node in layer or (node in COMMAND_MODULES and "commands" in layer):
            return i
    raise AssertionError(f"{node}: in no layer of LAYERS (add it)")


def project_imports(extra: Mapping[str, str] | None = None) -> list[Import]:
    """Every import of the tree under trainer/ (plus ``extra``: module name -> source text, a module added for a
    test), in file order."""
    names = module_names()
    extra = dict(extra or {})
    known = set(names) | set(extra)
    found = []
    for module, is_package in names.items():
        path = PACKAGE.parent / (module.replace(".", "/") + ("/__init__.py" if is_package else ".py"))
        source = extra.pop(module, None) or path.read_text()
        found += imports_of(module, source, is_package, known, str(path.relative_to(REPO_ROOT)))
    for module, source in extra.items():
        found += imports_of(module, source, False, known, module.replace(".", "/") + ".py")
    return found


def edges(imports: Iterable[Import]) -> dict[tuple[str, str], list[Import]]:
    """Imports between two different nodes (script blocks of :data:`MAIN_BLOCK_IMPORTS` left out), by edge."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if not imp.imported.startswith("trainer"):
            continue
        a, b = node_of(imp.importer), node_of(imp.imported)
        if a != b and not (imp.main and (imp.importer, imp.imported) in MAIN_BLOCK_IMPORTS):
            out.setdefault((a, b), []).append(imp)
    return out


def cycles(graph: Mapping[tuple[str, str], list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {}
    for a, b in graph:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(succ[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            connect(v)
    return found


def cycle_findings(imports: Iterable[Import]) -> list[str]:
    graph = edges(imports)
    lines = []
    for component in cycles(graph):
        lines.append(f"cycle between {', '.join(component)}:")
        for (a, b), where in sorted(graph.items()):
            if a in component and b in component:
                lines.append(f"  {a} -> {b}: {', '.join(i.where() for i in where)}")
    return lines


def local_findings(imports: Iterable[Import]) -> list[str]:
    """Function-local imports of project modules, and of third-party packages not in :data:`LAZY_IMPORTS`."""
    out = []
    for imp in imports:
        if not imp.local:
            continue
        if imp.imported.startswith("trainer"):
            out.append(f"{imp.where()}: {imp.importer} imports {imp.imported} in a function")
        elif imp.imported not in sys.stdlib_module_names and imp.imported not in LAZY_IMPORTS:
            out.append(f"{imp.where()}: {imp.imported} imported in a function but not in LAZY_IMPORTS")
    return out


def layer_findings(imports: Iterable[Import]) -> list[str]:
    out = []
    for (a, b), where in sorted(edges(imports).items()):
        if layer_of(a) >= layer_of(b):
            how = "up" if layer_of(a) > layer_of(b) else "across"
            out.append(f"{a} -> {b} imports {how} the layers: {', '.join(i.where() for i in where)}")
    return out


@pytest.fixture(scope="module")
def tree() -> list[Import]:
    return project_imports()


def test_every_module_is_in_the_graph(tree):
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(module_names()) == len(files) > 85
    assert {node_of(m) for m in module_names()} >= {f"trainer.{p}" for p in PHASES}
    for module in module_names():
        layer_of(node_of(module))
    # the walk sees the imports at every depth: module level, TYPE_CHECKING blocks and function bodies
    project = [i for i in tree if i.imported.startswith("trainer")]
    assert len(project) > 300
    assert any(i.local for i in tree) and any(not i.local for i in project)
    assert ("trainer.launch", "trainer.record") in edges(tree)
    assert ("trainer.report", "trainer.record") in edges(tree)


def test_no_cycle_between_packages(tree):
    findings = cycle_findings(tree)
    assert not findings, "\n".join(findings)


def test_no_function_local_project_imports(tree):
    findings = local_findings(tree)
    assert not findings, "\n".join(findings)


def test_imports_go_down_the_layers(tree):
    findings = layer_findings(tree)
    assert not findings, "\n".join(findings)


def test_every_lazy_import_is_used(tree):
    used = {i.imported for i in tree if i.local}
    assert set(LAZY_IMPORTS) - used == set()


BACK_EDGE = """
def megatron_choice(cfg):
    from trainer.launch.host.local_megatron import check
    return check
"""


def test_a_back_edge_is_caught():
    """compose importing the launchers again (inside a function, as ``plan.py`` once did) is found by all three
    checks, with its file and line."""
    tampered = project_imports({"trainer.compose.evil": BACK_EDGE})
    cycle = cycle_findings(tampered)
    assert any("trainer.compose -> trainer.launch" in f and "trainer/compose/evil.py:3" in f for f in cycle)
    assert [f for f in local_findings(tampered) if "evil" in f] == [
        "trainer/compose/evil.py:3 (in a function): trainer.compose.evil imports trainer.launch.host.local_megatron "
        "in a function"
    ]
    assert [f for f in layer_findings(tampered) if "evil" in f] == [
        "trainer.compose -> trainer.launch imports up the layers: trainer/compose/evil.py:3 (in a function)"
    ]


def test_relative_and_nested_imports_are_resolved():
    known = {"trainer", "trainer.image", "trainer.image.oci", "trainer.image.cas", "trainer.record.attest"}
    source = (
        "from . import oci\nfrom .cas import Cache\nimport trainer.record.attest as a\n"
        "if TYPE_CHECKING:\n    from ..record.attest import sign\n"
        "def f():\n    import torch\n    from trainer import REPO_ROOT\n"
    )
    found = imports_of("trainer.image.build", source, False, known, "build.py")
    assert [(i.imported, i.line, i.local) for i in found] == [
        ("trainer.image.oci", 1, False),
        ("trainer.image.cas", 2, False),
        ("trainer.record.attest", 3, False),
        ("trainer.record.attest", 5, False),
        ("torch", 7, True),
        ("trainer", 8, True),
    ]
    assert local_findings(found) == ["build.py:8 (in a function): trainer.image.build imports trainer in a function"]
    assert layer_findings(found) == [
        "trainer.image -> trainer.record imports up the layers: build.py:3, build.py:5",
    ]


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
