"""Lint is a test: pyflakes over every Python file of the project, so an unused import, an
undefined name or a shadowed variable cannot land. pyflakes itself ignores ``# noqa``; an import
that is there on purpose (an availability check, say) carries ``# noqa: F401`` and is skipped
here, as flake8 and ruff would skip it."""

from __future__ import annotations

import ast
import io

import pytest

from conftest import REPO

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pip install pyflakes "
                                   "(requirements-test.txt has it)")
from pyflakes.reporter import Reporter  # noqa: E402

SKIP_DIRS = {".git", ".venv", ".venv-oldest", "__pycache__", "runs"}


def project_files() -> list:
    return sorted(p for p in REPO.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(REPO).parts))


def findings(path, root=REPO) -> list:
    """pyflakes' warnings for one file (named relative to ``root``), less those on a line
    marked ``noqa``."""
    out, err = io.StringIO(), io.StringIO()
    pyflakes_api.checkPath(str(path), Reporter(out, err))
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for message in out.getvalue().splitlines() + err.getvalue().splitlines():
        # "path:line:col: message"
        parts = message[len(str(path)):].split(":")
        line = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0
        if 0 < line <= len(lines) and "noqa" in lines[line - 1]:
            continue
        kept.append(str(path.relative_to(root)) + message[len(str(path)):])
    return kept


def test_project_files_are_found():
    names = {p.relative_to(REPO).as_posix() for p in project_files()}
    assert {"ddp_train.py", "fsdp_train.py", "dp_train.py", "training/common.py",
            "tests/test_lint.py"} <= names


def test_pyflakes_is_clean():
    problems = [f for p in project_files() for f in findings(p)]
    assert not problems, "pyflakes:\n" + "\n".join(problems)


def test_a_real_unused_import_is_caught(tmp_path):
    """The noqa filter keeps what it should: an unused import without noqa is reported, the
    one with it is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport sys  # noqa: F401\n")
    assert findings(bad, tmp_path) == ["bad.py:1:1: 'os' imported but unused"]


def training_imports() -> dict:
    """{module: the training modules it imports} for every module of training/, imports inside
    functions included: a late import hides a circle, it does not remove it."""
    graph = {}
    for path in sorted((REPO / "training").glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "training":
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("training."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[1] for alias in node.names
                             if alias.name.startswith("training."))
        graph[path.stem] = found - {path.stem}
    return graph


def test_training_modules_import_no_circle():
    """No module of training/ imports one that imports it back, however far round: each can be
    read, and imported, on its own terms."""
    graph = training_imports()
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):]
                                                                 + [module]))
        if module in done:
            return
        path.append(module)
        for other in sorted(graph.get(module, ())):
            visit(other)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_printing_imports_nothing_above_it():
    """print0 and the reductions over ranks live with the rank accessor (distributed.py): no
    module of training/ imports common, the top of the tree that only the scripts use."""
    importers = sorted(m for m, imports in training_imports().items() if "common" in imports)
    assert not importers, f"these modules import training.common: {importers}"
