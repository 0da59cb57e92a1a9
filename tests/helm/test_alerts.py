"""The chart's alert rules under Prometheus's own rule engine: `promtool check rules` accepts what the
PrometheusRule renders, and `promtool test rules` (alerts/sluice-alerts.test.yaml) shows each alert firing on
the series that should fire it, after its `for`, for its own site only, with its labels and annotations, and
not firing otherwise.

promtool comes from `deploy/get-promtool.sh --no-build`: the binary `make promtool` built once (with `go
install` from the Go module proxy, many minutes on 2 cores, so `make test` does not build it).  Where it is
not there yet, or SLUICE_PROMTOOL names none, the tests skip with the script's reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helmrender import Helm

ROOT = Path(__file__).resolve().parents[2]
GET_PROMTOOL = ROOT / "deploy" / "get-promtool.sh"
RULE_TESTS = Path(__file__).resolve().parent / "alerts" / "sluice-alerts.test.yaml"
NO_PROMTOOL_HERE = 3


@pytest.fixture(scope="module")
def promtool() -> str:
    proc = subprocess.run(["bash", str(GET_PROMTOOL), "--no-build"], capture_output=True, text=True, timeout=60)
    if proc.returncode == NO_PROMTOOL_HERE:
        pytest.skip(f"no promtool: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"deploy/get-promtool.sh failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def rules_dir(helm: Helm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's groups (default values) as a Prometheus rule file, with the rule tests beside it."""
    release = helm.template("--set", "monitoring.prometheusRule.enabled=true")
    spec = release.get("PrometheusRule", "sluice")["spec"]
    folder = tmp_path_factory.mktemp("rules")
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": spec["groups"]}, sort_keys=False))
    shutil.copy(RULE_TESTS, folder / RULE_TESTS.name)
    return folder


def test_promtool_accepts_the_rules(promtool: str, rules_dir: Path) -> None:
    done = subprocess.run([promtool, "check", "rules", str(rules_dir / "rules.yaml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout, done.stdout


def test_each_alert_fires_when_it_should_and_only_then(promtool: str, rules_dir: Path) -> None:
    done = subprocess.run([promtool, "test", "rules", str(rules_dir / RULE_TESTS.name)], capture_output=True,
                          text=True, timeout=120, cwd=rules_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_rule_tests_can_fail(promtool: str, rules_dir: Path, tmp_path: Path) -> None:
    """Not vacuous: the same tests against rules whose site selector names another site fail."""
    (tmp_path / "rules.yaml").write_text((rules_dir / "rules.yaml").read_text().replace(
        'sluice_site="sluice"', 'sluice_site="other"'))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / RULE_TESTS.name)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr
