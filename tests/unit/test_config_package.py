"""The configuration package keeps one front door: every name the rest of Sluice imports from
``sluice.core.config`` is there, each of its modules says what it holds, and `pip install .`
ships all of it."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import tomllib
from pathlib import Path

import sluice.core.config as config

ROOT = Path(__file__).resolve().parents[2]
#: Folders whose Python files import from the package; their import lines must not need to change.
IMPORTERS = ("services", "pipelines", "tests", "bench", "deploy")
#: Where each distribution package's folder is (pyproject's package-dir).
PACKAGE_DIRS = {"sluice": ROOT / "services", "sluice.pipelines": ROOT / "pipelines"}


def module_name(path: Path) -> str | None:
    """The dotted name ``path`` is imported as, for files inside the distribution's folders."""
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join((package, *parts))
    return None


def names_imported_from_config() -> dict[str, list[str]]:
    """Each name the project imports from ``sluice.core.config`` (absolute or relative), with the files."""
    inside = ROOT / "services" / "core" / "config"
    found: dict[str, list[str]] = {}
    for folder in IMPORTERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(inside):
                continue
            name = module_name(path)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    if name is None:
                        continue
                    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                else:
                    target = node.module or ""
                if target == "sluice.core.config":
                    for alias in node.names:
                        found.setdefault(alias.name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_name_imported_from_the_package_is_there() -> None:
    """The split kept every import working: each name any module, test, bench or pipeline imports
    from sluice.core.config (SiteConfig, load_config, the patterns, _shown …) is an attribute of it."""
    imported = names_imported_from_config()
    assert {"SiteConfig", "load_config", "KafkaConnection", "_problems_from_validation"} <= set(imported)
    missing = {name: files for name, files in imported.items() if not hasattr(config, name)}
    assert not missing, f"names imported from sluice.core.config that it no longer has: {missing}"
    assert [name for name in config.__all__ if not hasattr(config, name)] == []


def test_every_module_of_the_package_says_what_it_holds() -> None:
    """Each module of sluice.core.config opens with a docstring of more than a title line."""
    modules = [config.__name__] + [info.name for info in pkgutil.walk_packages(config.__path__, config.__name__ + ".")]
    assert {"sluice.core.config.loading", "sluice.core.config.models.site"} <= set(modules)
    for name in modules:
        doc = importlib.import_module(name).__doc__ or ""
        assert len(doc.split()) >= 12, f"{name} has no docstring telling what it holds"


def test_pip_install_ships_every_package_folder() -> None:
    """pyproject's explicit package list names every folder with an __init__.py under services/ and
    pipelines/ (sluice.core.config and its models included), so the image's `pip install .` has them."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    folders = {module_name(init) for folder in PACKAGE_DIRS.values() for init in folder.rglob("__init__.py")}
    assert {"sluice.core.config", "sluice.core.config.models"} <= folders
    assert folders - listed == set(), "package folders missing from [tool.setuptools] packages in pyproject.toml"
