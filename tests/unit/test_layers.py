"""Imports run one way: domain <- translate <- providers <- pipeline <- services. A module may import from its own
layer and those below it, never from one above; observability learns about errors from the errors themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"

# Every top-level module and package of server/, as a module name's second part.
_SERVER_PARTS = sorted({path.stem if path.is_file() else path.name for path in SERVER.iterdir()
                        if path.suffix == ".py" or (path / "__init__.py").exists()} - {"__init__"})
# module prefix -> server modules it must never import (prefix match)
FORBIDDEN = {
    "server.domain": ("server.",),
    # The domain's other modules (answers, images, keys, the catalog) build on server.domain alone.
    **{f"server.domain_{part}": tuple(f"server.{name}" for name in _SERVER_PARTS if name != "domain")
       for part in ("answers", "images", "keys", "models")},
    # Errors sit just above the domain: one may carry a domain value (a stream's usage reported before it broke off).
    "server.errors": tuple(f"server.{name}" for name in _SERVER_PARTS if name not in ("domain", "domain_answers")),
    "server.wire_json": ("server.",),
    "server.translate": ("server.providers", "server.pipeline", "server.services", "server.config", "server.keys",
                         "server.limits", "server.observability", "server.catalog", "server.app"),
    "server.render": ("server.providers", "server.pipeline", "server.services", "server.translate"),
    "server.providers": ("server.pipeline", "server.services", "server.app", "server.catalog", "server.keys"),
    "server.limits": ("server.pipeline", "server.services", "server.config", "server.providers", "server.app",
                      "server.observability"),
    "server.observability": ("server.limits", "server.pipeline", "server.services", "server.providers"),
    "server.catalog": ("server.config", "server.pipeline", "server.services"),
    "server.keys": ("server.pipeline", "server.services", "server.config"),
    "server.pipeline": ("server.services", "server.app", "server.config"),
    "server.calls": ("server.pipeline", "server.services", "server.app", "server.config"),
    # What the pipeline is built from: below it, like the providers.
    "server.metering": ("server.pipeline", "server.services", "server.app", "server.config", "server.providers"),
    "server.cache": ("server.pipeline", "server.services", "server.app", "server.config", "server.providers"),
    "server.health": ("server.config", "server.limits.redis"),
    # Settings are read below the parts they configure: providers/build.py reads them, so they import no part.
    "server.config": ("server.keys", "server.providers", "server.pipeline", "server.services", "server.app",
                      "server.catalog", "server.observability"),
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def modules():
    for path in sorted(SERVER.rglob("*.py")):
        parts = path.relative_to(SERVER.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda value: str(value).rsplit("/", 1)[-1])
def test_no_import_runs_upward(module, path):
    for layer, forbidden in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            wrong = sorted(name for name in imports_of(path) if name != module and name.startswith(forbidden)
                           and not name.startswith(layer + ".") and name != layer)
            assert not wrong, f"{module} imports {wrong}, above its layer {layer}"


def test_a_gateway_without_redis_or_tracing_loads_neither():
    """redis-py (with the OpenTelemetry SDK it loads) costs every server process ~8 MB: 5,000 open streams went over
    the bench's 600 MB when the configuration's check of a Redis URL imported it for every gateway. (The
    OpenTelemetry API, which the request path uses, is small and always loaded.)"""
    import subprocess
    import sys

    probe = ("import sys, server.serving, server.app; from server.config import load_config; load_config(); "
             "print(sorted(m for m in sys.modules if m == 'redis' or m.startswith('opentelemetry.sdk')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def _layout_table() -> str:
    text = (SERVER.parent / "docs" / "architecture.md").read_text()
    return text.split("## Layout", 1)[1].split("\n## ", 1)[0]


def _unnamed_modules() -> list[str]:
    """Modules of server/ and gateway/ the Layout table names neither by path (`server/heap.py`) nor, in their
    package's row (`server/providers/`), by name (`proxies`)."""
    table = _layout_table()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| `")}
    missing = []
    for root in (SERVER, SERVER.parent / "gateway"):
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(SERVER.parent).as_posix()
            if path.name == "__init__.py" or "/web/" in relative or f"`{relative}`" in table:
                continue
            package = path.parent.relative_to(SERVER.parent).as_posix() + "/"
            row = next((line for first, line in rows.items() if f"`{package}`" in first), "")
            if f"`{path.stem}`" not in row:
                missing.append(relative)
    return missing


def test_every_module_is_in_the_layout_table():
    # docs/architecture.md's Layout is where a reader looks up what a module is for: one left out is a module
    # nobody can place without reading it.
    assert _unnamed_modules() == []
