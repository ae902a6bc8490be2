"""The import contract: dependencies point one way (docs/architecture.md).

import-linter checks the contracts in pyproject.toml ([tool.importlinter]) over the
packages as Python imports them. The second test proves the check can fail: it copies
the packages, adds one forbidden import to a copy, and expects that contract broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", str(cwd / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def package_dirs() -> dict[str, str]:
    """Import name -> folder, as pyproject.toml maps them (folder names differ)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def module_file(packages: Path, module: str) -> Path:
    path = packages.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_packages_keep_the_import_contract():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "arrow"),
    [
        ("kvservice.server", "import torch", "kvservice imports only kvcraft", "kvservice.server -> torch"),
        ("kvservice.store", "import kvclient", "kvservice imports only kvcraft", "kvservice.store -> kvclient"),
        ("kvcraft.keys", "import kvservice", "kvcraft (the contract)", "kvcraft.keys -> kvservice"),
        ("kvclient.client", "import kvservice", "kvclient imports kvcraft", "kvclient.client -> kvservice"),
        ("engine_adapter.source", "import kvbench", "engine_adapter talks", "engine_adapter.source -> kvbench"),
        ("engine_adapter.source", "import engine_adapter.blend", "No cycles are allowed in engine_adapter",
         ".source -> .blend"),
        ("kvservice.cluster.view", "import kvservice.store", "No cycles are allowed in kvservice",
         ".cluster -> .store"),
        ("kvservice.tiers.slab", "import kvservice.server", "No cycles are allowed in kvservice",
         ".tiers -> .server"),
        ("kvservice.store.session", "from kvservice.wire import variant_message", "the store core takes no protobuf",
         "kvservice.store.session -> kvservice.wire"),
        ("kvservice.metadata", "from google.protobuf.message import DecodeError", "the store core takes no protobuf",
         "kvservice.metadata -> google"),
    ],
)
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, line, contract, arrow):
    packages = tmp_path / "packages"
    for name, folder in package_dirs().items():
        shutil.copytree(ROOT / folder, packages / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = module_file(packages, module)
    target.write_text(target.read_text() + f"\n{line}\n")

    # The copy comes first on the path, ahead of the packages the suite itself imports.
    env = {**os.environ, "PYTHONPATH": str(packages)}
    out = lint_imports(tmp_path, env)

    assert out.returncode != 0, out.stdout + out.stderr
    broken = out.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, out.stdout
    assert arrow in broken, out.stdout


def test_engine_adapter_modules_stay_readable():
    # docs/adapter.md "One layer step": the loop one file under 200 lines, no module of the
    # engine side over 400 (one that grows past it splits by what its parts are for)
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for p in (ROOT / "engine_adapter").rglob("*.py")}
    assert len(lines) > 20  # the folder was read
    assert {p: n for p, n in lines.items() if n > 400} == {}
    assert lines["engine_adapter/loop.py"] < 200
