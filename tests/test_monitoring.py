"""manifests/components/monitoring: the alert rules pass `promtool check rules` and the promtool unit tests in
tests/prometheus/, the dashboard and the rules read only metrics that exist, and the monitors find what the
compiled PyTorchJob and the stages serve. (tests/test_manifests.py builds and validates the component's objects
against prometheus-operator's schemas, and compares the build with `kubectl kustomize`.)

promtool is Debian's `prometheus` package's, unpacked by .ci/run into build/prometheus (no daemon is started):
the promtool tests skip without it, or fail when POSTTRAIN_REQUIRE_SCHEMAS is set, as in CI.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import fresh_spec
from kustomize import MANIFESTS, _kubectl_kustomize, build
from schema_validation import SchemaViolation, validate_custom_resource
from test_progress import tiny_model

from run.names import STAGE_LABEL
from stages.metrics import StageMetrics
from stages.progress import ProgressLog
from workflows.notify import GRAFANA_DASHBOARD
from workflows.pytorchjob import METRICS_PORT_NAME, job_manifest

COMPONENT = MANIFESTS / "components" / "monitoring"
UNIT_TESTS = Path(__file__).resolve().parent / "prometheus" / "posttrain_test.yaml"
RULES_FILE = "posttrain-rules.yaml"  # the name the unit tests' rule_files gives
REPO = Path(__file__).resolve().parent.parent

Doc = dict[str, Any]

DCGM_METRICS = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}
"""The DCGM exporter's fields the kit reads (in its default counters, dcp-metrics-included.csv)."""
TRAINING_OPERATOR_METRICS = {"training_operator_jobs_failed_total"}
METRIC_NAME = re.compile(r"\b(posttrain_[a-z_]+|posttrain:[a-z_:]+|DCGM_FI_[A-Z_]+|training_operator_[a-z_]+)\b")


def _docs(name: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((COMPONENT / name).read_text(encoding="utf-8")) if d]


def _rule() -> Doc:
    (rule,) = _docs("prometheusrule.yaml")
    return rule


def stage_metric_names() -> set[str]:
    """Every series name stages/metrics.py serves."""
    metrics = StageMetrics(ProgressLog("sft", tiny_model()), "p", "r", "sft", deadline_seconds=60)
    return {family.name for family in metrics.registry.collect()}


def known_metrics() -> set[str]:
    recorded = {r["record"] for g in _rule()["spec"]["groups"] for r in g["rules"] if "record" in r}
    return stage_metric_names() | DCGM_METRICS | TRAINING_OPERATOR_METRICS | recorded


# --------------------------------------------------------------------------- promtool


def promtool() -> str:
    """promtool from the PATH or from .ci/run's build/prometheus; skips (fails in CI) without one."""
    found = shutil.which("promtool") or REPO / "build" / "prometheus" / "usr" / "bin" / "promtool"
    if Path(found).is_file():
        return str(found)
    reason = "promtool not found (Debian's prometheus package; .ci/run unpacks it into build/prometheus)"
    if os.environ.get("POSTTRAIN_REQUIRE_SCHEMAS", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; POSTTRAIN_REQUIRE_SCHEMAS is set, so this is an error", pytrace=False)
    pytest.skip(reason)


def write_rules(directory: Path, rule: Doc) -> Path:
    """The PrometheusRule's spec as a Prometheus rules file, with the unit tests beside it."""
    path = directory / RULES_FILE
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False), encoding="utf-8")
    shutil.copy(UNIT_TESTS, directory / UNIT_TESTS.name)
    return path


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    path = write_rules(tmp_path, _rule())
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def test_each_alert_fires_when_it_should_and_only_then(tmp_path: Path) -> None:
    write_rules(tmp_path, _rule())
    done = subprocess.run([promtool(), "test", "rules", UNIT_TESTS.name], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in _rule()["spec"]["groups"] for r in g["rules"] if "alert" in r}
    tested = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))["tests"]
    fired = {t["alertname"] for group in tested for t in group["alert_rule_test"] if t["exp_alerts"]}
    spared = {t["alertname"] for group in tested for t in group["alert_rule_test"] if not t["exp_alerts"]}
    assert fired == spared == alerts


def test_the_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    rule = copy.deepcopy(_rule())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            if r.get("alert") == "PosttrainGpuUnderutilized":
                r["expr"] = "posttrain:gpu_utilization:pod < 30"  # misses the idle Master at 35%
    write_rules(tmp_path, rule)
    done = subprocess.run([promtool(), "test", "rules", UNIT_TESTS.name], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert "alertname: PosttrainGpuUnderutilized, time: 16m" in done.stdout + done.stderr


# --------------------------------------------------------------------------- rules


def test_every_alert_says_how_bad_what_and_what_to_do() -> None:
    for group in _rule()["spec"]["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"].startswith("Posttrain"), rule["alert"]  # the Slack route matches Posttrain.+
                assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
                assert set(rule["annotations"]) == {"summary", "description", "runbook"}, rule["alert"]


def test_rules_read_only_metrics_that_exist() -> None:
    known = known_metrics()
    for group in _rule()["spec"]["groups"]:
        for rule in group["rules"]:
            names = set(METRIC_NAME.findall(rule["expr"]))
            assert names, rule
            assert names <= known, f"{rule.get('alert') or rule.get('record')}: {sorted(names - known)} do not exist"


def test_stage_metrics_are_the_ones_documented() -> None:
    assert stage_metric_names() == {
        "posttrain_step",
        "posttrain_max_steps",
        "posttrain_loss",
        "posttrain_tokens_per_second",
        "posttrain_mfu",
        "posttrain_eta_seconds",
        "posttrain_gpu_memory_bytes",
        "posttrain_last_step_timestamp_seconds",
        "posttrain_stage_start_timestamp_seconds",
        "posttrain_deadline_timestamp_seconds",
    }


# --------------------------------------------------------------------------- the dashboard


def _dashboard() -> Doc:
    return json.loads((COMPONENT / "dashboards" / "posttrain-run.json").read_text(encoding="utf-8"))


def dashboard_problems(dashboard: Doc, known: set[str]) -> list[str]:
    """What is wrong with the run dashboard, one line each: its uid, its `run` variable, a panel without a query,
    a query of a metric that does not exist, or one that ignores the run."""
    problems = []
    if dashboard.get("uid") != GRAFANA_DASHBOARD:
        problems.append(f"uid {dashboard.get('uid')!r}, the notifications link to {GRAFANA_DASHBOARD!r}")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    if "run" not in variables:
        problems.append("no template variable `run` (the notifications' links set var-run)")
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if not exprs:
            problems.append(f"panel {panel['title']!r} has no query")
        for expr in exprs:
            names = set(METRIC_NAME.findall(expr))
            if not names or not names <= known:
                problems.append(f"panel {panel['title']!r}: {sorted(names - known) or 'no metric'} in {expr!r}")
            if "$run" not in expr:
                problems.append(f"panel {panel['title']!r}: {expr!r} is not limited to the run")
    return problems


def test_the_dashboard_shows_one_run_from_metrics_that_exist() -> None:
    dashboard = _dashboard()
    assert dashboard_problems(dashboard, known_metrics()) == []
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"GPU utilisation", "GPU memory used", "Training loss", "Tokens per second", "MFU", "ETA"} <= titles
    assert "Stage timeline" in titles
    (run,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert "posttrain_" in run["definition"]


def test_the_dashboard_check_can_fail() -> None:
    dashboard = copy.deepcopy(_dashboard())
    dashboard["uid"] = "posttrain"
    dashboard["templating"]["list"] = [v for v in dashboard["templating"]["list"] if v["name"] != "run"]
    dashboard["panels"][3]["targets"][0]["expr"] = "posttrain_losss"
    assert dashboard_problems(dashboard, known_metrics()) == [
        "uid 'posttrain', the notifications link to 'posttrain-run'",
        "no template variable `run` (the notifications' links set var-run)",
        "panel 'Training loss': ['posttrain_losss'] in 'posttrain_losss'",
        "panel 'Training loss': 'posttrain_losss' is not limited to the run",
    ]


def test_grafana_loads_the_dashboard_from_the_built_config_map() -> None:
    docs = build(MANIFESTS / "overlays" / "onprem")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "posttrain-run-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert json.loads(config_map["data"]["posttrain-run.json"]) == _dashboard()


# --------------------------------------------------------------------------- monitors


def _matches(selector: Doc, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In/NotIn/Exists/DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def test_the_pod_monitor_scrapes_each_training_masters_metrics_port() -> None:
    (monitor,) = _docs("podmonitor.yaml")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == METRICS_PORT_NAME
    spec = fresh_spec("qwen3-30b-a3b")
    for stage in ("cpt", "sft", "rlhf"):
        for rtype, replica in job_manifest(spec, stage)["spec"]["pytorchReplicaSpecs"].items():
            template = replica["template"]
            assert _matches(monitor["spec"]["selector"], template["metadata"]["labels"]), (stage, rtype)
            ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
            assert ports == ([METRICS_PORT_NAME] if rtype == "Master" else []), (stage, rtype)
    assert not _matches(monitor["spec"]["selector"], {STAGE_LABEL: "evaluate"})


def test_the_slack_route_takes_its_webhook_from_a_secret() -> None:
    (config,) = _docs("alertmanagerconfig.yaml")
    (receiver,) = config["spec"]["receivers"]
    (slack,) = receiver["slackConfigs"]
    assert slack["apiURL"] == {"name": "slack-webhook", "key": "url"}
    secrets = yaml.safe_load_all((MANIFESTS / "secrets.example.yaml").read_text(encoding="utf-8"))
    assert any(s["metadata"]["name"] == "slack-webhook" and "url" in s["stringData"] for s in secrets)
    assert "hooks.slack.com" not in (COMPONENT / "alertmanagerconfig.yaml").read_text(encoding="utf-8")
    (matcher,) = config["spec"]["route"]["matchers"]
    assert re.fullmatch(matcher["value"], "PosttrainJobFailed") and not re.fullmatch(matcher["value"], "Watchdog")


def test_the_dcgm_monitor_can_be_pointed_elsewhere_from_an_overlay(tmp_path: Path) -> None:
    """The patch manifests/README.md shows for a DCGM exporter in another namespace, under another label."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    patch = [
        {"op": "replace", "path": "/spec/namespaceSelector/matchNames", "value": ["nvidia-gpu-operator"]},
        {"op": "replace", "path": "/spec/selector/matchLabels", "value": {"app.kubernetes.io/name": "dcgm-exporter"}},
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(MANIFESTS / "overlays" / "onprem", overlay)],
        "patches": [
            {"target": {"kind": "ServiceMonitor", "name": "posttrain-dcgm-exporter"}, "patch": yaml.dump(patch)}
        ],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    builds = [build(overlay)]
    if (kubectl := _kubectl_kustomize()) is not None:  # the real kustomize agrees
        done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
        builds.append([d for d in yaml.safe_load_all(done.stdout) if d])
    for docs in builds:
        (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor" and "dcgm" in d["metadata"]["name"]]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["nvidia-gpu-operator"]}
        assert monitor["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "dcgm-exporter"}}
        assert monitor["metadata"]["namespace"] == "llm-training"


def test_the_monitoring_schemas_are_strict() -> None:
    """Guard: a misspelt field, a literal webhook URL where a Secret reference belongs, or a rule without an
    expression fails prometheus-operator's schema."""
    (monitor,) = _docs("podmonitor.yaml")
    validate_custom_resource(monitor)
    typo = copy.deepcopy(monitor)
    typo["spec"]["podMetricsEndpoint"] = typo["spec"].pop("podMetricsEndpoints")
    with pytest.raises(SchemaViolation, match=r"spec: .*'podMetricsEndpoint' was unexpected"):
        validate_custom_resource(typo)
    (config,) = _docs("alertmanagerconfig.yaml")
    validate_custom_resource(config)
    literal = copy.deepcopy(config)
    literal["spec"]["receivers"][0]["slackConfigs"][0]["apiURL"] = "https://hooks.slack.com/services/T0/B0/x"
    with pytest.raises(SchemaViolation, match=r"slackConfigs\[0\]\.apiURL: .* is not of type 'object'"):
        validate_custom_resource(literal)
    rule = copy.deepcopy(_rule())
    del rule["spec"]["groups"][1]["rules"][0]["expr"]
    with pytest.raises(SchemaViolation, match=r"rules\[0\]: 'expr' is a required property"):
        validate_custom_resource(rule)
