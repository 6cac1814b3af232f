"""Preflight against a fake cluster: a local HTTP server serving the Kubernetes API routes preflight reads and the
Argo server's version route. A ready cluster passes; each missing piece fails with its fix; Secrets are only ever
asked for as metadata (the fake API fails the test on a request for a whole Secret), so their values never show."""

from __future__ import annotations

import base64
import copy
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client

from spec.loading import load_pipeline
from spec.pipeline import PipelineSpec
from workflows import preflight
from workflows.preflight import PreflightReport, run_preflight

SECRET_VALUE = "hf_s3cr3t-VALUE-never-shown"
H100 = "NVIDIA-H100-80GB-HBM3"

Routes = dict[str, tuple[int, Any]]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        accept = self.headers.get("Accept", "")
        self.server.seen.append((path, dict(self.headers)))
        status, body = self.server.routes.get(path, (404, {"kind": "Status", "reason": "NotFound", "code": 404}))
        if "/secrets/" in path and status == 200:
            body = self._secret_metadata(path, accept, body)
            status = 200 if body is not None else 500
        if isinstance(body, str):  # e.g. a proxy's HTML page
            payload, content_type = body.encode(), "text/html"
        else:
            payload, content_type = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _secret_metadata(self, path: str, accept: str, secret: dict) -> dict | None:
        """What the API server answers to a metadata-only GET of a Secret; a request for the whole Secret (its
        values) is recorded, and fails the test."""
        if accept != preflight.METADATA_ONLY:
            self.server.full_secret_reads.append(f"GET {path} with Accept {accept!r}")
            return None
        return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": secret["metadata"]}

    def log_message(self, *_: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    routes: Routes
    seen: list[tuple[str, dict[str, str]]]
    full_secret_reads: list[str]


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.routes, srv.seen, srv.full_secret_reads = {}, [], []
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    assert not srv.full_secret_reads, f"preflight asked for Secret values: {srv.full_secret_reads}"


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def _api(srv: _Server) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = _url(srv)
    configuration.retries = 0
    return client.ApiClient(configuration)


def _node(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]] | None = None) -> dict:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints or []},
        "status": {"allocatable": {"cpu": "192", "nvidia.com/gpu": str(gpus)}},
    }


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TRAINER_RUNTIME = Path(__file__).resolve().parent.parent / "manifests/components/trainer-v2/clustertrainingruntime.yaml"
"""The kit's ClusterTrainingRuntime, served as the API server would return it."""


def ready_cluster(spec: PipelineSpec, nodes: list[dict] | None = None, argo: str = "v3.6.5") -> Routes:
    """Routes of a cluster that has everything `spec` needs."""
    ns = spec.cluster.namespace
    routes: Routes = {}
    for crd, (version, _) in preflight.CRDS.items():
        body = {"metadata": {"name": crd}, "spec": {"versions": [{"name": version, "served": True}]}}
        routes[f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"] = (200, body)
    routes[f"/api/v1/namespaces/{ns}"] = (200, {"metadata": {"name": ns}, "status": {"phase": "Active"}})
    cluster = spec.cluster
    for account in (cluster.service_account, cluster.pod_service_account, cluster.executor_service_account):
        routes[f"/api/v1/namespaces/{ns}/serviceaccounts/{account}"] = (200, {"metadata": {"name": account}})
    token = {"metadata": {"name": f"{cluster.executor_service_account}.service-account-token"}, "data": {}}
    routes[f"/api/v1/namespaces/{ns}/secrets/{token['metadata']['name']}"] = (200, token)
    for volume in (spec.cluster.datasets, spec.cluster.checkpoints):
        pvc = {
            "spec": {"accessModes": ["ReadWriteMany"]},
            "status": {"phase": "Bound", "accessModes": ["ReadWriteMany"]},
        }
        routes[f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{volume.claim_name}"] = (200, pvc)
    encoded = base64.b64encode(SECRET_VALUE.encode()).decode()
    for name, keys in preflight._secret_refs(spec).items():
        data = {k: encoded for k in keys} or {".dockerconfigjson": encoded}
        routes[f"/api/v1/namespaces/{ns}/secrets/{name}"] = (200, {"metadata": {"name": name}, "data": data})
    for stage in spec.stages.enabled():
        res = spec.stage(stage).resources
        if res.priority_class:
            routes[f"/apis/scheduling.k8s.io/v1/priorityclasses/{res.priority_class}"] = (200, {"value": 100000})
        if res.queue:
            routes[f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{ns}/localqueues/{res.queue}"] = (200, {"spec": {}})
    runtime = spec.stages.deploy.serving.runtime
    routes[f"/apis/serving.kserve.io/v1alpha1/namespaces/{ns}/servingruntimes/{runtime}"] = (200, {"spec": {}})
    if spec.cluster.job_kind == "trainjob":
        routes[f"/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/{spec.cluster.training_runtime}"] = (
            200,
            yaml.safe_load(TRAINER_RUNTIME.read_text(encoding="utf-8")),
        )
    if nodes is None:
        gpu_labels = {"nvidia.com/gpu.product": H100}
        nodes = [_node(f"h100-{i}", gpu_labels, 8, [GPU_TAINT]) for i in range(2)]
        nodes.append(_node("cpu-0", {"kubernetes.io/os": "linux"}, 0))
    routes["/api/v1/nodes"] = (200, {"items": nodes})
    routes["/api/v1/version"] = (200, {"version": argo, "gitCommit": "abc"})
    return routes


@pytest.fixture(scope="module")
def korean() -> PipelineSpec:
    return load_pipeline("korean-llm").spec


def _run(srv: _Server, spec: PipelineSpec, routes: Routes) -> PreflightReport:
    srv.routes = routes
    return run_preflight(spec, kube_api_client=_api(srv), argo_server=_url(srv))


def _check(report: PreflightReport, name: str) -> preflight.Check:
    found = [c for c in report.checks if c.name == name]
    assert len(found) == 1, f"no single check {name!r} in {[c.name for c in report.checks]}"
    return found[0]


def test_a_ready_cluster_passes(server: _Server, korean: PipelineSpec) -> None:
    report = _run(server, korean, ready_cluster(korean))
    assert report.ok, report.render_text()
    assert {c.status for c in report.checks} == {"ok"}
    names = {c.name for c in report.checks}
    assert {
        "CRD pytorchjobs.kubeflow.org",
        "CRD cronworkflows.argoproj.io",
        "CRD inferenceservices.serving.kserve.io",
        "namespace llm-training",
        "serviceaccount posttrain-workflow",
        "serviceaccount posttrain-runner",
        "serviceaccount posttrain-executor",
        "secret posttrain-executor.service-account-token",
        "pvc datasets-rwx (datasets)",
        "pvc checkpoints-rwx (checkpoints)",
        "secret hf-token",
        "secret mlflow-auth",
        "secret slack-webhook",
        "gpu nodes: cpt",
        "gpu nodes: evaluate",
        "priorityclass posttrain-training",
        "servingruntime kserve-vllm",
        "argo server",
    } <= names
    assert "ready" in report.render_text()


def test_fix_commands_print_whole_on_a_narrow_console_without_a_terminal(
    server: _Server, korean: PipelineSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 80 columns, and with no terminal (stdout captured), a fix is one line, never broken mid-word by a table
    cell: `kubectl apply --server-side -k '...'` can be copied as printed."""
    from rich.console import Console

    routes = copy.deepcopy(ready_cluster(korean))
    routes.pop("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pytorchjobs.kubeflow.org")
    routes.pop(NS)
    report = _run(server, korean, routes)
    monkeypatch.setenv("COLUMNS", "80")
    console = Console()
    assert (console.width, console.is_terminal) == (80, False)
    report.show(console)
    lines = capsys.readouterr().out.splitlines()
    fixes = [c for c in report.checks if c.status != "ok" and c.fix]
    assert {c.name for c in fixes} >= {"CRD pytorchjobs.kubeflow.org", "namespace llm-training"}
    for check in fixes:
        assert f"fix for {check.name}: {check.fix}" in lines
    operator = _check(report, "CRD pytorchjobs.kubeflow.org").fix
    assert "kubectl apply --server-side -k 'github.com/kubeflow/training-operator.git/" in operator
    assert len(f"fix for CRD pytorchjobs.kubeflow.org: {operator}") > 80  # longer than the console is wide
    assert all(len(line) <= 80 for line in lines if not line.startswith("fix for "))  # the table still fits


def _drop(path: str) -> Callable[[Routes], None]:
    return lambda routes: routes.pop(path)


def _set(path: str, update: Callable[[Any], None]) -> Callable[[Routes], None]:
    return lambda routes: update(routes[path][1])


def _nodes(update: Callable[[list[dict]], None]) -> Callable[[Routes], None]:
    return lambda routes: update(routes["/api/v1/nodes"][1]["items"])


def _relabel(items: list[dict]) -> None:
    for node in items:
        node["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4-80GB"


NS = "/api/v1/namespaces/llm-training"
MISSING = {
    "crd": (
        _drop("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pytorchjobs.kubeflow.org"),
        "CRD pytorchjobs.kubeflow.org",
        "install the Kubeflow Training Operator",
    ),
    "crd-version": (
        _set(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.serving.kserve.io",
            lambda crd: crd["spec"].update(versions=[{"name": "v1alpha2", "served": True}]),
        ),
        "CRD inferenceservices.serving.kserve.io",
        "install KServe",
    ),
    "namespace": (_drop(NS), "namespace llm-training", "kubectl apply -k manifests/overlays/"),
    "serviceaccount": (
        _drop(f"{NS}/serviceaccounts/posttrain-workflow"),
        "serviceaccount posttrain-workflow",
        "kubectl apply -k",
    ),
    "runner-serviceaccount": (
        _drop(f"{NS}/serviceaccounts/posttrain-runner"),
        "serviceaccount posttrain-runner",
        "or set cluster.pod_service_account",
    ),
    "executor-serviceaccount": (
        _drop(f"{NS}/serviceaccounts/posttrain-executor"),
        "serviceaccount posttrain-executor",
        "or set cluster.executor_service_account",
    ),
    "executor-token": (
        _drop(f"{NS}/secrets/posttrain-executor.service-account-token"),
        "secret posttrain-executor.service-account-token",
        "kubernetes.io/service-account-token annotated kubernetes.io/service-account.name: posttrain-executor",
    ),
    "workflow-token-off": (
        _set(f"{NS}/serviceaccounts/posttrain-workflow", lambda sa: sa.update(automountServiceAccountToken=False)),
        "serviceaccount posttrain-workflow",
        "kubectl -n llm-training patch serviceaccount posttrain-workflow --type json",
    ),
    "pvc-missing": (
        _drop(f"{NS}/persistentvolumeclaims/datasets-rwx"),
        "pvc datasets-rwx (datasets)",
        "cluster.datasets.claim_name",
    ),
    "pvc-unbound": (
        _set(f"{NS}/persistentvolumeclaims/checkpoints-rwx", lambda pvc: pvc["status"].update(phase="Pending")),
        "pvc checkpoints-rwx (checkpoints)",
        "kubectl -n llm-training describe pvc checkpoints-rwx",
    ),
    "pvc-rwo": (
        _set(
            f"{NS}/persistentvolumeclaims/checkpoints-rwx",
            lambda pvc: pvc["status"].update(accessModes=["ReadWriteOnce"]),
        ),
        "pvc checkpoints-rwx (checkpoints)",
        "ReadWriteMany storage class",
    ),
    "secret": (
        _drop(f"{NS}/secrets/hf-token"),
        "secret hf-token",
        "kubectl -n llm-training create secret generic hf-token --from-literal=token=...",
    ),
    "too-few-gpus": (
        _nodes(lambda items: [n["status"]["allocatable"].update({"nvidia.com/gpu": "4"}) for n in items]),
        "gpu nodes: cpt",
        "lower stages.cpt.resources.gpus_per_node to 4",
    ),
    "too-little-memory": (
        _nodes(lambda items: [n["status"]["allocatable"].update({"memory": "512Gi"}) for n in items]),
        "gpu nodes: cpt",
        "set stages.cpt.resources.cpu/memory to what the nodes allocate",
    ),
    "too-few-nodes": (
        _nodes(lambda items: items.pop(0)),
        "gpu nodes: cpt",
        "lower stages.cpt.resources.nodes to 1",
    ),
    "wrong-labels": (_nodes(_relabel), "gpu nodes: sft", "node_selector/affinity to labels the GPU nodes have"),
    "untolerated-taint": (
        _nodes(
            lambda items: [
                n["spec"]["taints"].append({"key": "dedicated", "value": "llm-training", "effect": "NoSchedule"})
                for n in items
            ]
        ),
        "gpu nodes: evaluate",
        "add tolerations for dedicated=llm-training:NoSchedule",
    ),
    "cordoned": (
        _nodes(lambda items: items[1]["spec"].update(unschedulable=True)),
        "gpu nodes: cpt",
        "kubectl uncordon",
    ),
    "old-argo": (
        _set("/api/v1/version", lambda body: body.update(version="v3.5.8")),
        "argo server",
        "upgrade Argo Workflows to v3.6+",
    ),
    "argo-unauthorized": (
        lambda routes: routes.update({"/api/v1/version": (401, {"message": "token not valid"})}),
        "argo server",
        "ARGO_TOKEN",
    ),
    "priority-class": (
        _drop("/apis/scheduling.k8s.io/v1/priorityclasses/posttrain-training"),
        "priorityclass posttrain-training",
        "manifests/components/priority-class",
    ),
    "serving-runtime": (
        _drop("/apis/serving.kserve.io/v1alpha1/namespaces/llm-training/servingruntimes/kserve-vllm"),
        "servingruntime kserve-vllm",
        "components/kserve-vllm",
    ),
}


@pytest.mark.parametrize("case", sorted(MISSING))
def test_each_missing_piece_fails_with_its_fix(server: _Server, korean: PipelineSpec, case: str) -> None:
    mutate, name, fix = MISSING[case]
    routes = copy.deepcopy(ready_cluster(korean))
    mutate(routes)
    report = _run(server, korean, routes)
    assert not report.ok
    check = _check(report, name)
    assert check.status == "fail"
    assert fix in check.fix
    assert fix in report.render_text(width=2000)  # wide enough that no cell wraps
    # Only what was broken fails (a missing namespace hides the namespaced checks; nodes affect several stages).
    failed = {c.name for c in report.failed()}
    assert all(n.startswith("gpu nodes") for n in failed) if name.startswith("gpu nodes") else failed == {name}


def test_too_few_gpus_suggests_a_count_the_parallel_groups_divide(server: _Server) -> None:
    """Nodes of 6 GPUs and a cpt split over groups of 4 (tensor_parallel): 4 GPUs a node, not 6; nodes of 2: smaller
    groups or bigger nodes."""
    split = ["stages.cpt.distributed.tensor_parallel=4"]
    spec = load_pipeline("korean-llm", overrides=split).spec
    routes = copy.deepcopy(ready_cluster(spec))
    _nodes(lambda items: [n["status"]["allocatable"].update({"nvidia.com/gpu": "6"}) for n in items])(routes)
    fix = _check(_run(server, spec, routes), "gpu nodes: cpt").fix
    assert "lower stages.cpt.resources.gpus_per_node to 4 or less (a multiple of 4" in fix
    _nodes(lambda items: [n["status"]["allocatable"].update({"nvidia.com/gpu": "2"}) for n in items])(routes)
    fix = _check(_run(server, spec, routes), "gpu nodes: cpt").fix
    assert "add nodes of 4 GPUs or more, or lower stages.cpt.distributed.tensor_parallel/expert_parallel" in fix


def test_too_few_gpus_suggests_a_count_whose_total_the_pipeline_stages_divide(server: _Server) -> None:
    """Two nodes of 6 GPUs and a cpt cut into 8 pipeline stages: 12 GPUs are not whole pipelines, 2 x 4 are."""
    cut = ["stages.cpt.distributed.pipeline_parallel=8", "stages.cpt.training.gradient_accumulation_steps=8"]
    spec = load_pipeline("korean-llm", overrides=cut).spec
    routes = copy.deepcopy(ready_cluster(spec))
    _nodes(lambda items: [n["status"]["allocatable"].update({"nvidia.com/gpu": "6"}) for n in items])(routes)
    fix = _check(_run(server, spec, routes), "gpu nodes: cpt").fix
    assert "lower stages.cpt.resources.gpus_per_node to 4 or less (with 2 nodes, a total the 8 pipeline" in fix


def test_missing_namespace_skips_the_namespaced_checks(server: _Server, korean: PipelineSpec) -> None:
    routes = ready_cluster(korean)
    del routes[f"{NS}"]
    report = _run(server, korean, routes)
    assert not any(c.name.startswith(("secret ", "pvc ", "serviceaccount ")) for c in report.checks)


def test_secret_values_never_appear(server: _Server, korean: PipelineSpec, capsys, monkeypatch) -> None:
    routes = ready_cluster(korean)
    del routes[f"{NS}/secrets/slack-webhook"]  # a failing secret check, too
    encoded = base64.b64encode(SECRET_VALUE.encode()).decode()
    server.routes = routes
    monkeypatch.setattr(preflight, "_default_api_client", lambda: _api(server))
    monkeypatch.setenv("ARGO_SERVER", _url(server))
    code = preflight.main(["korean-llm"])
    out = capsys.readouterr()
    assert code == 1
    report = run_preflight(korean, kube_api_client=_api(server), argo_server=_url(server))
    for text in (out.out, out.err, report.render_text(), repr(report), json.dumps([c.__dict__ for c in report.checks])):
        assert SECRET_VALUE not in text
        assert encoded not in text
    secret_reads = [headers["Accept"] for path, headers in server.seen if "/secrets/" in path]
    assert secret_reads and set(secret_reads) == {preflight.METADATA_ONLY}


def test_secrets_are_checked_from_their_metadata_alone(server: _Server, korean: PipelineSpec) -> None:
    """A Secret that exists passes whatever keys it holds: only its metadata is requested, so they are unknown."""
    routes = ready_cluster(korean)
    routes[f"{NS}/secrets/mlflow-auth"][1]["data"].pop("password")
    report = _run(server, korean, routes)
    check = _check(report, "secret mlflow-auth")
    assert check.status == "ok" and "keys are not read" in check.detail


def test_the_fake_api_fails_a_request_for_a_whole_secret(server: _Server, korean: PipelineSpec) -> None:
    """The guard above can fail: a plain GET of a Secret is refused and recorded."""
    server.routes = ready_cluster(korean)
    with pytest.raises(preflight._Unreachable):
        preflight._Kube(_api(server)).get(f"{NS}/secrets/hf-token")
    assert server.full_secret_reads == [f"GET {NS}/secrets/hf-token with Accept 'application/json'"]
    server.full_secret_reads.clear()


def test_no_argo_server_is_a_failure_with_the_fix(server: _Server, korean: PipelineSpec, monkeypatch) -> None:
    monkeypatch.delenv("ARGO_SERVER", raising=False)
    server.routes = ready_cluster(korean)
    report = run_preflight(korean, kube_api_client=_api(server))
    check = _check(report, "argo server")
    assert check.status == "fail" and "ARGO_SERVER is unset" in check.detail
    assert "set ARGO_SERVER and ARGO_TOKEN" in check.fix
    assert [c.name for c in report.failed()] == ["argo server"]
    assert not report.ok


def test_an_html_answer_is_a_clear_failure(server: _Server, korean: PipelineSpec) -> None:
    """A proxy in front of the API server answering 200 with its HTML login page."""
    routes = ready_cluster(korean)
    for path in list(routes):
        if path.startswith("/api/v1/namespaces/") or path.startswith("/apis/apiextensions"):
            routes[path] = (200, "<html><body>Sign in</body></html>")
    report = _run(server, korean, routes)
    (failed,) = report.failed()
    assert failed.name == "cluster access"
    assert "not a JSON object" in failed.detail and "proxy" in failed.fix
    assert "Traceback" not in report.render_text()


def test_unscheduled_pipeline_accepts_an_older_argo(server: _Server) -> None:
    spec = load_pipeline("korean-llm", overrides=["schedule.cron=[]"]).spec
    report = _run(server, spec, ready_cluster(spec, argo="v3.5.8"))
    assert _check(report, "argo server").status == "ok"
    assert "CRD cronworkflows.argoproj.io" not in {c.name for c in report.checks}


def test_forbidden_reads_are_warnings(server: _Server, korean: PipelineSpec) -> None:
    routes = ready_cluster(korean)
    routes[f"{NS}/secrets/hf-token"] = (403, {"kind": "Status", "reason": "Forbidden", "code": 403})
    report = _run(server, korean, routes)
    check = _check(report, "secret hf-token")
    assert check.status == "warn" and "preflight-access" in check.fix
    assert report.ok


def test_unreachable_cluster_is_one_clear_failure(korean: PipelineSpec, monkeypatch) -> None:
    monkeypatch.setenv("ARGO_SERVER", "127.0.0.1:1")  # what fails besides the cluster: the Argo server, reported apart
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = probe.server_address[1]
    probe.server_close()  # nothing listens there now
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0
    report = run_preflight(korean, kube_api_client=client.ApiClient(configuration))
    assert [c.name for c in report.failed()] == ["cluster access", "argo server"]
    assert "kubeconfig" in report.failed()[0].fix


def test_required_node_affinity_and_queue(server: _Server) -> None:
    """qwen3-30b-a3b also needs RDMA nodes (required node affinity), its taint tolerated and its Kueue queue."""
    spec = load_pipeline("qwen3-30b-a3b").spec
    labels = {
        "nvidia.com/gpu.product": H100,
        "node-role.example.com/training": "true",
        "nvidia.com/gpu.count": "8",
        "feature.node.kubernetes.io/rdma.available": "true",
    }
    dedicated = {"key": "dedicated", "value": "llm-training", "effect": "NoSchedule"}
    nodes = [_node(f"h100-{i}", dict(labels), 8, [GPU_TAINT, dedicated]) for i in range(2)]
    routes = ready_cluster(spec, nodes=nodes)
    assert _run(server, spec, routes).ok
    assert _check(_run(server, spec, routes), "localqueue h100-training").status == "ok"

    no_rdma = copy.deepcopy(routes)
    for node in no_rdma["/api/v1/nodes"][1]["items"]:
        del node["metadata"]["labels"]["feature.node.kubernetes.io/rdma.available"]
    check = _check(_run(server, spec, no_rdma), "gpu nodes: sft")
    assert check.status == "fail" and "required nodeAffinity" in check.detail

    no_queue = copy.deepcopy(routes)
    del no_queue["/apis/kueue.x-k8s.io/v1beta1/namespaces/llm-training/localqueues/h100-training"]
    check = _check(_run(server, spec, no_queue), "localqueue h100-training")
    assert check.status == "fail" and "components/kueue" in check.fix


def test_spec_errors_exit_2_without_a_traceback(capsys) -> None:
    assert preflight.main(["korean-llm", "--set", "stages.sft.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "Traceback" not in err


def test_the_executor_token_is_found_as_argo_finds_it(server: _Server, korean: PipelineSpec) -> None:
    """Argo takes the executor account's first listed secret, else the one its annotation names, else
    `<account>.service-account-token`; preflight checks the same Secret, by its metadata only."""
    routes = ready_cluster(korean)
    routes[f"{NS}/serviceaccounts/posttrain-executor"][1]["metadata"]["annotations"] = {
        preflight.ARGO_TOKEN_ANNOTATION: "executor-token"
    }
    check = _check(_run(server, korean, routes), "secret executor-token")
    assert check.status == "fail"
    routes[f"{NS}/secrets/executor-token"] = (200, {"metadata": {"name": "executor-token"}, "data": {}})
    assert _check(_run(server, korean, routes), "secret executor-token").status == "ok"
    listed = {"metadata": {"name": "posttrain-executor"}, "secrets": [{"name": "listed-token"}]}
    assert preflight.executor_token_secret(listed, "posttrain-executor") == "listed-token"


def test_one_account_for_several_roles_is_checked_once(server: _Server) -> None:
    spec = load_pipeline("korean-llm", overrides=["cluster.executor_service_account=posttrain-workflow"]).spec
    report = _run(server, spec, ready_cluster(spec))
    assert report.ok, report.render_text()
    check = _check(report, "serviceaccount posttrain-workflow")
    assert "the steps that create the jobs" in check.detail and "Argo's init and wait" in check.detail
    _check(report, "secret posttrain-workflow.service-account-token")


def test_the_executor_token_is_not_readable_through_preflight_access(server: _Server, korean: PipelineSpec) -> None:
    """preflight-access does not grant reading the executor's token Secret (its token may write any step's outputs):
    a refused read is a warning that says who can check it, not a hint to ask for that access."""
    routes = ready_cluster(korean)
    routes[f"{NS}/secrets/posttrain-executor.service-account-token"] = (403, {"kind": "Status", "code": 403})
    report = _run(server, korean, routes)
    check = _check(report, "secret posttrain-executor.service-account-token")
    assert check.status == "warn" and "kubectl -n llm-training get secret" in check.fix
    assert "preflight-access" not in check.fix
    assert report.ok


# --------------------------------------------------------------------------- cluster.job_kind trainjob

RUNTIME_PATH = "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/posttrain-torch"


@pytest.fixture(scope="module")
def korean_trainjob() -> PipelineSpec:
    return load_pipeline("korean-llm", "trainjob").spec


def test_a_trainer_v2_cluster_passes(server: _Server, korean_trainjob: PipelineSpec) -> None:
    """job_kind trainjob needs the TrainJob CRD and the runtime (the kit's, as served), not the PyTorchJob CRD."""
    routes = ready_cluster(korean_trainjob)
    routes.pop("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pytorchjobs.kubeflow.org")
    report = _run(server, korean_trainjob, routes)
    assert report.ok, report.render_text()
    names = {c.name for c in report.checks}
    assert {"CRD trainjobs.trainer.kubeflow.org", "clustertrainingruntime posttrain-torch"} <= names
    assert "CRD pytorchjobs.kubeflow.org" not in names
    assert _check(report, "clustertrainingruntime posttrain-torch").detail == "torch runtime, replicated jobs: node"


def _initializer_first(runtime: dict) -> None:
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    jobs.insert(0, {"name": "dataset-initializer", "template": {}})


TRAINJOB_CASES: dict[str, tuple[Callable[[Routes], None], str, str, str]] = {
    "crd": (
        _drop("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/trainjobs.trainer.kubeflow.org"),
        "CRD trainjobs.trainer.kubeflow.org",
        "not installed",
        "install Kubeflow Trainer (v2.1+)",
    ),
    "runtime": (
        _drop(RUNTIME_PATH),
        "clustertrainingruntime posttrain-torch",
        "no ClusterTrainingRuntime",
        "trainer-v2",
    ),
    "runtime-order": (
        _set(RUNTIME_PATH, _initializer_first),
        "clustertrainingruntime posttrain-torch",
        "first replicated job must be `node` (found: dataset-initializer, node)",
        "cluster.training_runtime",
    ),
    "runtime-policy": (
        _set(RUNTIME_PATH, lambda runtime: runtime["spec"]["mlPolicy"].pop("torch")),
        "clustertrainingruntime posttrain-torch",
        "no torch ML policy",
        "trainer-v2",
    ),
}


@pytest.mark.parametrize("case", sorted(TRAINJOB_CASES))
def test_each_missing_trainer_piece_fails_with_its_fix(
    server: _Server, korean_trainjob: PipelineSpec, case: str
) -> None:
    breaks, name, detail, fix = TRAINJOB_CASES[case]
    routes = copy.deepcopy(ready_cluster(korean_trainjob))
    breaks(routes)
    report = _run(server, korean_trainjob, routes)
    check = _check(report, name)
    assert (check.status, not report.ok) == ("fail", True)
    assert detail in check.detail and fix in check.fix, check
