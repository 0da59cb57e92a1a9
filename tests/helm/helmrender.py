"""Running helm and reading what it renders, for the chart tests (see conftest.py)."""

from __future__ import annotations

import copy
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sluice"
EXAMPLES = ROOT / "helm" / "examples"
GET_HELM = ROOT / "deploy" / "get-helm.sh"
NO_HELM_HERE = 3  # deploy/get-helm.sh: neither npm nor go on this machine


@dataclass
class Release:
    """The manifests of one ``helm template`` run."""

    manifests: list[dict[str, Any]]

    def of_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        return {m["metadata"]["name"]: m for m in self.manifests if m["kind"] == kind}

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert name in found, f"no {kind} {name!r}; there are: {sorted(found)}"
        return found[name]

    def workloads(self) -> dict[str, dict[str, Any]]:
        """Deployments and StatefulSets by name."""
        return {**self.of_kind("Deployment"), **self.of_kind("StatefulSet")}

    def site_file(self, config_name: str) -> str:
        """The site file text held by the ConfigMap or Secret ``config_name``."""
        for m in self.manifests:
            if m["kind"] in ("ConfigMap", "Secret") and m["metadata"]["name"] == config_name:
                return (m.get("data") or m.get("stringData"))["site.yaml"]
        raise AssertionError(f"no ConfigMap or Secret {config_name!r}")


class HelmFailed(Exception):
    """``helm`` exited non-zero; the message is what it printed."""


@dataclass
class Helm:
    path: str

    def run(self, *args: str) -> str:
        proc = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            # `helm lint` puts its findings on stdout and only the tally on stderr.
            raise HelmFailed("\n".join(filter(None, (proc.stdout.strip(), proc.stderr.strip()))))
        return proc.stdout

    def template(self, *args: str, release: str = "sluice", namespace: str = "sluice") -> Release:
        out = self.run("template", release, str(CHART), "--namespace", namespace, *args)
        return Release([d for d in yaml.safe_load_all(out) if d])


def load_values(name: str) -> dict[str, Any]:
    """Chart defaults (``"default"``) or an example's values file, as data."""
    path = CHART / "values.yaml" if name == "default" else EXAMPLES / f"{name}.yaml"
    return yaml.safe_load(path.read_text())


def merged(base: Any, over: Any) -> Any:
    """Helm's coalescing of values: maps merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = merged(base.get(key), value)
        return out
    return copy.deepcopy(over)


def values_of(name: str) -> dict[str, Any]:
    """The values a release of ``name`` (``"default"`` or an example) is rendered with."""
    defaults = load_values("default")
    return defaults if name == "default" else merged(defaults, load_values(name))
