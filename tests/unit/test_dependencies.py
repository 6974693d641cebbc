"""pyproject.toml against the code: every dependency pinned exactly, and every third-party module the code imports
named there itself (one that only some other dependency pulls in goes when that one stops needing it)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

PROJECT = tomllib.loads(Path("pyproject.toml").read_text())["project"]
OWN = {"server", "client", "gateway", "bench", "portico", "tests"}


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _declared(*extras: str) -> set[str]:
    lists = [PROJECT["dependencies"], *(PROJECT["optional-dependencies"][extra] for extra in extras)]
    return {_name(requirement) for requirements in lists for requirement in requirements}


def _imports(root: str) -> set[str]:
    """Dotted names of the third-party modules imported under root (for `from a.b import c`: a.b.c when c is a
    module, else a.b), inside functions too."""
    found = set()
    for path in Path(root).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            found.update(name for name in names if name.split(".")[0] not in sys.stdlib_module_names | OWN)
    return found


@functools.cache
def _distributions_by_file() -> dict[Path, str]:
    files = {}
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            files[Path(dist.locate_file(file))] = _name(dist.metadata["Name"])
    return files


def _distribution(module: str, files: dict[Path, str]) -> str | None:
    """The installed distribution whose files hold the module (a namespace package such as `google` or
    `opentelemetry` is split over several, so the top-level name alone does not tell)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None  # `from a.b import name`: the candidate a.b.name when name is not a module
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    return files.get(Path(spec.origin))


def test_every_dependency_is_pinned_exactly():
    extras = PROJECT["optional-dependencies"].values()
    requirements = [*PROJECT["dependencies"], *(requirement for extra in extras for requirement in extra)]
    loose = [requirement for requirement in requirements if not re.search(r"==[^,]+$", requirement)]
    assert not loose


@pytest.mark.parametrize(("root", "extras"), [("server", ()), ("client", ()), ("gateway", ("dev",)),
                                              ("bench", ("dev",)), ("tests", ("dev",))])
def test_every_imported_module_is_a_declared_dependency(root, extras):
    """gateway/descriptors.py (grpcio-tools, at install), bench/ and tests/ run from a checkout with the dev
    extras."""
    files = _distributions_by_file()
    declared = _declared(*extras)
    modules = {module: _distribution(module, files) for module in _imports(root)}
    undeclared = {module: dist for module, dist in modules.items() if dist and dist not in declared}
    assert not undeclared
    assert any(modules.values())  # the lookup found distributions at all
