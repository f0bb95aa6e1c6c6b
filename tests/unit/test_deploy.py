"""The shipped Prometheus rules and Grafana dashboard are valid and name real metrics.

Pins: promtool accepts deploy/prometheus-rules.yml; every agent_* metric the rules and
the dashboard query is one the registry exports (a renamed metric breaks this test, not
a production alert silently).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def _exported() -> set[str]:
    names = set()
    for family in metrics.REGISTRY.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
    return names


def _referenced(text: str) -> set[str]:
    return {m for m in re.findall(r"\bagent_[a-z_]+", text)}


def test_promtool_accepts_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: `make test` installs Debian's prometheus package")
    out = subprocess.run(
        [promtool, "check", "rules", str(DEPLOY / "prometheus-rules.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rules_and_dashboard_query_exported_metrics() -> None:
    # Labelled metrics export samples only once a label is used: touch each family with a
    # probe label, and take the probes out again so that no later scrape sees them.
    probes = [
        (metrics.STAGE, ("probe",)),
        (metrics.INGEST_BUFFER, ("probe",)),
        (metrics.INGEST_DROPPED, ("probe", "probe")),
        (metrics.OFFERS_REJECTED, ("probe",)),
    ]
    for family, labels in probes:
        family.labels(*labels)
    try:
        exported = _exported()
    finally:
        for family, labels in probes:
            family.remove(*labels)
    assert 'reason="probe"' not in metrics.render().decode()
    rules = (DEPLOY / "prometheus-rules.yml").read_text()
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = json.dumps([t["expr"] for p in dashboard["panels"] for t in p["targets"]])
    referenced = _referenced(rules) | _referenced(exprs)
    assert referenced, "no agent_* metric referenced at all"
    missing = {m for m in referenced if m not in exported}
    assert not missing, f"queried but not exported: {sorted(missing)}"
