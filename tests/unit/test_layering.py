"""Services never import each other: what two of them need lives in ``sluice.core`` (STYLE.md, issue 21).

Every module under ``services/`` is parsed with ``ast`` (nothing is imported) and each of its
imports is resolved to a module of the ``sluice`` distribution: relative imports by their level,
absolute ones spelled ``sluice.…`` or ``services.…``, ``from X import name`` as ``X.name`` when
``name`` is a module of its own, imports under ``if TYPE_CHECKING:`` and inside functions alike.
An import is allowed when it stays inside the importer's own package or goes to ``core``; besides
that, only these, each a use of a public face as a user or an operator would use it:

* ``core`` imports nothing but ``core``: it is what every service stands on.
* ``verify`` (the fault harness, ``sluice soak``) drives the sites as an application would: it may
  import the client library's public API, the package ``sluice.client`` itself (``RegionClient``,
  ``RegionError``, ``ClientCache``) but none of its modules, and it starts embedded brokers through
  the package ``sluice.broker`` (``start_broker``, ``resolve_engine``), as ``sluice broker`` does.
  What it reads of a site's status (queue sizes, receiver reports) is ``core.statusread``, the
  readers ``sluice admin`` shows.
* ``demo.py`` (``sluice demo``) is a short run of the fault harness's two sites: it may import
  ``verify`` and, as ``verify``, the package ``sluice.client``.
* ``cli.py`` (the ``sluice`` command) builds one sub-command per service: it may import each
  package's ``cli`` module, ``demo``, the harness's command (``verify.soak``), the data pipeline
  (``sluice.pipelines``, whose command lives outside ``services/``, so the parse sees only the
  package) and the distribution's root package (its ``__version__``).

``sluice.client`` keeps showing ``RegionClient``, ``RegionError``, ``ALL_KEYS`` and ``ResultPolicy``,
which live in the core, as the README documents them; no service imports them from there.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"

#: Beyond its own package and ``core``: (importer, module it may import, whether its submodules too).
ALLOWED: dict[str, list[tuple[str, bool]]] = {
    "verify": [("client", False), ("broker", False)],
    "demo": [("verify", True), ("client", False)],
    "cli": [("", False), ("demo", False), ("verify.soak", False), ("pipelines", False),
            *((f"{package}.cli", False) for package in
              ("admin", "broker", "dispatcher", "receiver", "region", "sender", "subscriptions"))],
}


@dataclass(frozen=True)
class Import:
    """One import of one module of the tree: where it is and the module it reaches (dotted, no ``sluice.``)."""

    path: str
    line: int
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted; "" is the distribution's root package

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {'.'.join(filter(None, ('sluice', self.target)))}"


def _module_of(root: Path, file: Path) -> tuple[str, ...]:
    parts = file.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(root: Path, dotted: tuple[str, ...]) -> bool:
    base = root.joinpath(*dotted) if dotted else root
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(root: Path) -> list[Import]:
    """Every import of a module of the distribution by a module under ``root`` (the folder ``sluice`` maps to)."""
    found: list[Import] = []
    for file in sorted(root.rglob("*.py")):
        module = _module_of(root, file)
        package = module if file.name == "__init__.py" else module[:-1]
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for node in ast.walk(tree):
            targets: list[tuple[str, ...]] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    head, *rest = alias.name.split(".")
                    if head in ("sluice", "services"):
                        targets.append(tuple(rest))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if node.level - 1 > len(package):
                        raise AssertionError(f"{file}:{node.lineno}: a relative import above the distribution")
                    base = package[:len(package) - (node.level - 1)] + tuple(node.module.split(".") if node.module else ())
                else:
                    head, *rest = (node.module or "").split(".")
                    if head not in ("sluice", "services"):
                        continue
                    base = tuple(rest)
                for alias in node.names:
                    # ``from X import name``: the module X.name when there is one, else X itself.
                    sub = base + (alias.name,)
                    targets.append(sub if alias.name != "*" and _is_module(root, sub) else base)
            for target in dict.fromkeys(targets):  # one report per module an import statement reaches
                found.append(Import(str(file.relative_to(root.parent)), node.lineno, ".".join(module), ".".join(target)))
    return found


def _unit(dotted: str) -> str:
    """The package (or top-level module) a dotted module belongs to."""
    return dotted.split(".", 1)[0]


def allowed(imp: Import) -> bool:
    source, target = _unit(imp.source), imp.target
    if _unit(target) == source:
        return True
    if source == "core":
        return False
    if _unit(target) == "core":
        return True
    for permitted, submodules in ALLOWED.get(source, ()):
        if target == permitted or (submodules and target.startswith(permitted + ".")):
            return True
    return False


def violations(root: Path) -> list[Import]:
    return [imp for imp in imports(root) if not allowed(imp)]


def test_no_service_imports_another_service() -> None:
    """Every import between packages under services/ goes to core, or is one of the public faces allowed above."""
    found = violations(SERVICES)
    assert not found, "imports across services (move what they share into sluice.core):\n" + "\n".join(map(str, found))


def test_the_check_sees_the_imports_it_judges() -> None:
    """The parse finds the imports the tree is known to make, so the check above cannot pass on an empty list."""
    found = {(imp.source, imp.target) for imp in imports(SERVICES)}
    assert ("receiver.service", "core.regionclient") in found  # ``from ..core.regionclient import``
    assert ("subscriptions.service", "core.interest") in found
    assert ("client", "core.regionclient") in found  # the public API shows core's RegionClient
    assert ("verify.checks", "core.statusread") in found  # imported inside a function
    assert ("broker.kafka", "core.processes") in found  # spelled ``from sluice.core.processes import``
    assert ("receiver.cli", "receiver.service") in found  # ``from .service import``: a module of its package
    assert ("cli", "") in found  # ``from . import __version__``: the root package


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "services"
    for name, text in {"__init__.py": "", "core/__init__.py": "", "core/errors.py": "",
                       "client/__init__.py": "", "client/region.py": "", "subscriptions/__init__.py": "",
                       "subscriptions/registry.py": "", "verify/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("name, text, why", [
    ("client/subscriber.py", "from ..subscriptions.registry import bearer\n", "a relative import of another service"),
    ("subscriptions/service.py", "from sluice.client.region import RegionError\n", "an absolute one"),
    ("subscriptions/index.py", "from ..client import region\n", "a module imported by name from its package"),
    ("subscriptions/other.py", "def f():\n    from ..client import RegionClient\n", "the client API, by a service"),
    ("core/things.py", "from ..client import RegionClient\n", "core importing a service"),
    ("verify/checks.py", "from ..client.region import RegionError\n", "the harness past the client's public API"),
    ("client/cache.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from sluice.subscriptions.registry import bearer\n", "an import for type checking only"),
])
def test_each_kind_of_crossing_is_caught(tmp_path: Path, name: str, text: str, why: str) -> None:
    """A service reaching into another is reported, whichever way the import is spelled."""
    found = violations(_tree(tmp_path, {name: text}))
    assert [Path(imp.path).as_posix() for imp in found] == [f"services/{name}"], why


def test_what_is_allowed_stays_allowed(tmp_path: Path) -> None:
    """Core, one's own package, and the harness's public client API pass."""
    root = _tree(tmp_path, {
        "client/subscriber.py": "from ..core.errors import SluiceError\nfrom .region import x\nfrom . import region\n",
        "verify/checks.py": "def f():\n    from ..client import RegionClient\n    from sluice.core import errors\n",
    })
    assert violations(root) == []
