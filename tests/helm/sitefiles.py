"""A rendered site file as a pod sees it, so the real `sluice config check` can judge it.

In a pod the site file finds the files it names in the volumes the chart
mounts (kafka.secrets and the service's kafkaSecrets under
kafka.secretMountPath, extraVolumes elsewhere), and its ``*_env`` secrets in
the variables secretEnv sets from Secrets.  ``as_pod_sees_it`` puts
stand-ins for both in place: the files under a temporary folder (the site
file's paths rewritten to it), the variables in the process environment,
each with a value of the right kind (an Ed25519 private key for
gateway_private_key_env, a distinct random token for the others).
"""

from __future__ import annotations

import base64
import contextlib
import io
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helmrender import Release
from sluice.cli import main as sluice_main

#: Volumes every Sluice pod has that hold no file a site file names.
OWN_VOLUMES = {"site", "kafka-secrets", "work", "tmp"}


@dataclass
class Checked:
    returncode: int
    stdout: str
    stderr: str


def config_check(site_text: str, tmp_path: Path) -> Checked:
    """`sluice config check FILE`, the command's own entry point run in this process (a
    subprocess would spend a second importing what this one has already imported)."""
    path = tmp_path / "site.yaml"
    path.write_text(site_text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        returncode = sluice_main(["config", "check", str(path)])
    return Checked(returncode, out.getvalue(), err.getvalue())


def key_pair() -> tuple[str, str]:
    """An Ed25519 pair as `sluice keys generate` writes it: base64 of the 32-byte seed and public key."""
    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw()
    public = private.public_key().public_bytes_raw()
    return base64.b64encode(seed).decode(), base64.b64encode(public).decode()


def pod_specs(release: Release) -> list[dict[str, Any]]:
    """The pod spec of every workload and of the topics Job."""
    specs = [w["spec"]["template"]["spec"] for w in release.workloads().values()]
    specs += [j["spec"]["template"]["spec"] for j in release.of_kind("Job").values()]
    return specs


def projected_files(spec: dict[str, Any], mount: str) -> set[str]:
    """The files the pod's kafka-secrets volume puts under ``mount`` (only Secrets given with items)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    if "kafka-secrets" not in volumes:
        return set()
    return {f"{mount}/{item['path']}" for source in volumes["kafka-secrets"]["projected"]["sources"]
            for item in source["secret"].get("items", [])}


def named_files(node: Any) -> list[str]:
    """Every Kafka TLS/SASL file a site file (or part of it) names."""
    if isinstance(node, dict):
        def is_file(key: Any) -> bool:
            return str(key).endswith(("_location", "password_file"))
        return [v for k, v in node.items() if is_file(k)] + [
            x for k, v in node.items() if not is_file(k) for x in named_files(v)]
    if isinstance(node, list):
        return [x for v in node for x in named_files(v)]
    return []


def as_pod_sees_it(release: Release, site_text: str, into: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The site file with its files in place under ``into`` and its variables set.

    Every Kafka file the site file names must be projected into every pod
    (a pod lacking one would fail its config-check step), which is asserted
    here; files under an extraVolumes mount are written as the site file
    says (a real public key where gateway_public_keys_file points).
    """
    site = yaml.safe_load(site_text)
    mount = "/etc/sluice/kafka"
    specs = pod_specs(release)
    wanted = {f for f in named_files(site) if f.startswith(f"{mount}/")}
    provided: set[str] = set()
    for spec in specs:
        files = projected_files(spec, mount)
        assert wanted <= files, f"a pod lacks files its site file names: {sorted(wanted - files)}"
        provided |= files
    text = site_text
    for path in provided:
        target = into / "kafka" / path[len(mount):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("placeholder\n")
    text = text.replace(f"{mount}/", f"{into / 'kafka'}/")

    public_key_files = set((site.get("gateway_public_keys_file") or {}).values())
    extra_mounts = {m["mountPath"] for spec in specs for c in spec["containers"] for m in c["volumeMounts"]
                    if m["name"] not in OWN_VOLUMES}
    for i, extra in enumerate(sorted(extra_mounts)):
        folder = into / f"extra-{i}"
        for path in public_key_files:
            if path.startswith(f"{extra}/"):
                target = folder / path[len(extra):].lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(key_pair()[1] + "\n")
        text = text.replace(f"{extra}/", f"{folder}/")

    private_key_env = site.get("gateway_private_key_env")
    for spec in specs:
        for container in spec.get("initContainers", []) + spec["containers"]:
            for env in container.get("env", []):
                if "secretKeyRef" not in env.get("valueFrom", {}):
                    continue
                name = env["name"]
                value = key_pair()[0] if name == private_key_env else f"{name.lower()}-{secrets.token_hex(12)}"
                monkeypatch.setenv(name, value)
    return text
