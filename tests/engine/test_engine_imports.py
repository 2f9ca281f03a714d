"""The engine package imports without kopf and without the operator package (docs/architecture.md,
"Packages and layers"): the engine image carries neither."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megafleet_engine

ENGINE_ROOT = Path(megafleet_engine.__file__).parent
FORBIDDEN = {"kopf", "megafleet"}

IMPORT_EVERYTHING = """
import importlib, pkgutil, sys
sys.modules["kopf"] = None        # any 'import kopf' now raises ImportError
sys.modules["megafleet"] = None   # likewise for the operator package
import megafleet_engine

imported, optional = [], []
for module in pkgutil.walk_packages(megafleet_engine.__path__, "megafleet_engine."):
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as error:
        if error.name in {"kopf", "megafleet"}:
            raise
        optional.append(f"{module.name} (needs {error.name})")  # GPU-only extras such as megatron-core
        continue
    imported.append(module.name)
print("\\n".join(imported))
"""


@pytest.mark.slow  # a subprocess imports every engine module
def test_engine_modules_import_with_kopf_and_the_operator_unimportable() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    imported = set(result.stdout.split())
    for module in (
        "cli",
        "server",
        "agent_server",
        "metrics",
        "http_server",
        "openai.router",
        "openai.serving",
        "engine",
    ):
        assert f"megafleet_engine.{module}" in imported


def test_no_engine_source_imports_kopf_or_the_operator() -> None:
    offenders = []
    for path in sorted(ENGINE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ENGINE_ROOT)}: {name}" for name in names if name.split(".")[0] in FORBIDDEN
            ]
    assert offenders == []
