"""The Argo client against the fake server: configuration, create-or-update, submit, and every error message."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import requests
from fake_argo import SUBMITTER_RBAC, FakeArgo, node, running, workflow_status
from hera.workflows import models as m

from spec.loading import load_pipeline
from workflows.argo import ArgoClient, ArgoConfig, ArgoError, StaleObject, comparable
from workflows.compile import CompiledPipeline, compile_pipeline

NS = "llm-training"  # korean-llm's cluster.namespace


def _compiled(*overrides: str) -> CompiledPipeline:
    return compile_pipeline(load_pipeline("korean-llm", overrides=list(overrides)).spec)


def _client(fake: FakeArgo, **env: str) -> ArgoClient:
    return ArgoClient(ArgoConfig.from_env(NS, fake.env(**env)), timeout=10)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake() -> Iterator[FakeArgo]:
    with running() as server:
        yield server


# --------------------------------------------------------------------------- configuration


def test_config_defaults_to_https_and_the_spec_namespace() -> None:
    config = ArgoConfig.from_env("posttrain", {"ARGO_SERVER": "argo.example.com:2746"})
    assert config.server == "https://argo.example.com:2746"
    assert config.namespace == "posttrain"
    assert config.base_href == "/"
    assert config.verify_tls is True
    assert config.token is None


def test_config_reads_every_variable() -> None:
    config = ArgoConfig.from_env(
        "posttrain",
        {
            "ARGO_SERVER": "http://localhost:2746",
            "ARGO_NAMESPACE": "team-a",
            "ARGO_INSECURE_SKIP_VERIFY": "true",
            "ARGO_BASE_HREF": "argo",
            "ARGO_TOKEN": "abc",
        },
    )
    assert (config.server, config.namespace, config.base_href, config.verify_tls) == (
        "http://localhost:2746",
        "team-a",
        "/argo/",
        False,
    )
    assert config.api_root == "http://localhost:2746/argo/"


def test_argo_secure_false_picks_http_for_a_bare_host() -> None:
    config = ArgoConfig.from_env("ns", {"ARGO_SERVER": "localhost:2746", "ARGO_SECURE": "false"})
    assert config.server == "http://localhost:2746"


def test_a_path_in_argo_server_is_the_base_href_unless_set() -> None:
    assert ArgoConfig.from_env("ns", {"ARGO_SERVER": "https://h/argo"}).base_href == "/argo/"
    assert ArgoConfig.from_env("ns", {"ARGO_SERVER": "https://h/argo", "ARGO_BASE_HREF": "/"}).base_href == "/"


@pytest.mark.parametrize("token", ["abc.def", "Bearer abc.def", "  bearer abc.def  "])
def test_token_is_accepted_with_or_without_bearer(token: str) -> None:
    config = ArgoConfig.from_env("ns", {"ARGO_SERVER": "h:1", "ARGO_TOKEN": token})
    assert config.token == "abc.def"
    assert "abc.def" not in repr(config)


def test_ui_url_has_server_base_href_namespace_and_name() -> None:
    config = ArgoConfig.from_env("ns", {"ARGO_SERVER": "argo.example.com", "ARGO_BASE_HREF": "/argo/"})
    assert config.ui_url("korean-llm-x7k2p") == "https://argo.example.com/argo/workflows/ns/korean-llm-x7k2p"


def test_missing_server_says_what_to_set() -> None:
    with pytest.raises(ArgoError, match="ARGO_SERVER is not set"):
        ArgoConfig.from_env("ns", {})


def test_bad_boolean_names_the_variable() -> None:
    with pytest.raises(ArgoError, match="ARGO_INSECURE_SKIP_VERIFY='maybe'"):
        ArgoConfig.from_env("ns", {"ARGO_SERVER": "h:1", "ARGO_INSECURE_SKIP_VERIFY": "maybe"})


# --------------------------------------------------------------------------- operations


def test_ensure_workflow_template_creates_then_updates(fake: FakeArgo) -> None:
    client = _client(fake)
    first = client.ensure_workflow_template(_compiled().template)
    assert str(first) == f"created WorkflowTemplate {NS}/korean-llm"
    version = fake.objects("workflowtemplates")[(NS, "korean-llm")]["metadata"]["resourceVersion"]

    changed = _compiled("description=changed")
    second = client.ensure_workflow_template(changed.template)
    assert second.action == "updated"
    stored = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    assert stored["metadata"]["annotations"]["workflows.argoproj.io/description"] == "changed"
    assert int(stored["metadata"]["resourceVersion"]) > int(version)
    put = [r for r in fake.requests if r.method == "PUT"]
    assert put[0].body["template"]["metadata"]["resourceVersion"] == version


def test_an_unchanged_template_is_left_alone(fake: FakeArgo) -> None:
    """The server's copy carries its own labels and empty structs; the template is still the same."""
    client = _client(fake)
    client.ensure_workflow_template(_compiled().template)
    stored = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    assert "workflows.argoproj.io/creator" in stored["metadata"]["labels"]
    assert all("inputs" in t and "metadata" in t for t in stored["spec"]["templates"])
    version = stored["metadata"]["resourceVersion"]
    fake.requests.clear()

    applied = client.ensure_workflow_template(_compiled().template)
    assert applied.action == "unchanged"
    assert str(applied) == f"WorkflowTemplate {NS}/korean-llm is up to date"
    assert [r.method for r in fake.requests] == ["GET"]
    assert fake.objects("workflowtemplates")[(NS, "korean-llm")]["metadata"]["resourceVersion"] == version


def test_comparison_looks_past_what_the_server_changes() -> None:
    ours = m.WorkflowTemplate.model_validate(
        {
            "metadata": {"name": "p", "labels": {"app": "x"}},
            "spec": {
                "templates": [
                    {
                        "name": "t",
                        "container": {
                            "image": "i",
                            "resources": {"requests": {"memory": "2048Mi", "cpu": "0.5"}},
                            "volumeMounts": [{"name": "v", "mountPath": "/v", "readOnly": False}],
                        },
                    }
                ],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1024Mi"}}],
            },
        }
    )
    theirs = m.WorkflowTemplate.model_validate(
        {
            "metadata": {
                "name": "p",
                "uid": "u",
                "resourceVersion": "7",
                "generation": 3,
                "labels": {"app": "x", "workflows.argoproj.io/creator": "someone"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
            },
            "spec": {
                "templates": [
                    {
                        "name": "t",
                        "metadata": {},
                        "inputs": {},
                        "outputs": {},
                        "container": {
                            "name": "",
                            "image": "i",
                            "resources": {"requests": {"memory": "2Gi", "cpu": "500m"}},
                            "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                        },
                    }
                ],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
            },
        }
    )
    assert comparable(ours) == comparable(theirs)
    changed = theirs.model_copy(deep=True)
    changed.spec.templates[0].container.image = "other"
    assert comparable(ours) != comparable(changed)
    relabelled = theirs.model_copy(deep=True)
    relabelled.metadata.labels = {"workflows.argoproj.io/creator": "someone"}
    assert comparable(ours) != comparable(relabelled)


def test_a_submitter_may_use_an_unchanged_template(fake: FakeArgo) -> None:
    compiled = _compiled()
    _client(fake).ensure_workflow_template(compiled.template)
    fake.allowed = SUBMITTER_RBAC
    client = _client(fake)
    assert client.ensure_workflow_template(_compiled().template).action == "unchanged"
    assert client.submit_workflow(compiled.workflow).startswith("korean-llm-")


def test_a_submitter_is_told_when_the_template_is_out_of_date(fake: FakeArgo) -> None:
    _client(fake).ensure_workflow_template(_compiled().template)
    fake.allowed = SUBMITTER_RBAC
    with pytest.raises(StaleObject) as err:
        _client(fake).ensure_workflow_template(_compiled("description=changed").template)
    assert err.value.summary == (
        f"WorkflowTemplate {NS}/korean-llm on the Argo server is out of date (it differs from the compiled "
        "pipeline), and the identity behind ARGO_TOKEN may not update it (403 Forbidden)"
    )
    assert err.value.status == 403
    assert "RBAC verb 'update' on resource 'workflowtemplates'" in str(err.value)


def test_a_submitter_is_told_when_the_template_is_missing(fake: FakeArgo) -> None:
    fake.allowed = SUBMITTER_RBAC
    with pytest.raises(StaleObject, match="RBAC verb 'create'") as err:
        _client(fake).ensure_workflow_template(_compiled().template)
    assert err.value.summary.startswith(f"WorkflowTemplate {NS}/korean-llm does not exist on the Argo server")


def test_ensure_updates_a_template_someone_else_created(fake: FakeArgo) -> None:
    fake.put_object("workflowtemplates", {"metadata": {"name": "korean-llm", "namespace": NS}, "spec": {}})
    applied = _client(fake).ensure_workflow_template(_compiled().template)
    assert applied.action == "updated"
    assert fake.objects("workflowtemplates")[(NS, "korean-llm")]["spec"]["entrypoint"]


def test_ensure_cron_workflow_creates_then_updates(fake: FakeArgo) -> None:
    client = _client(fake)
    cron = _compiled().cron
    assert cron is not None
    assert client.ensure_cron_workflow(cron).action == "created"
    suspended = _compiled("schedule.suspend=true").cron
    assert suspended is not None
    assert client.ensure_cron_workflow(suspended).action == "updated"
    assert fake.objects("cronworkflows")[(NS, "korean-llm")]["spec"]["suspend"] is True


def test_submit_returns_the_generated_name_and_get_reads_status(fake: FakeArgo) -> None:
    fake.statuses = [workflow_status("Running", [node("prepare", "Running")])]
    client = _client(fake)
    compiled = _compiled()
    client.ensure_workflow_template(compiled.template)
    name = client.submit_workflow(compiled.workflow)
    assert name.startswith("korean-llm-") and len(name) == len("korean-llm-") + 5
    stored = fake.objects("workflows")[(NS, name)]
    assert stored["spec"]["workflowTemplateRef"] == {"name": "korean-llm"}
    workflow = client.get_workflow(name)
    assert workflow.status is not None and workflow.status.phase == "Running"


def test_argo_namespace_must_be_the_spec_namespace(fake: FakeArgo) -> None:
    """The PyTorchJobs and InferenceService inside the template are created in cluster.namespace, and the
    workflow that owns them cannot be in another one."""
    client = _client(fake, ARGO_NAMESPACE="posttrain")
    with pytest.raises(
        ArgoError,
        match=r"cluster\.namespace is 'llm-training': unset ARGO_NAMESPACE, or set cluster\.namespace to "
        r"'posttrain' in the pipeline file or a profile",
    ):
        client.ensure_workflow_template(_compiled().template)
    with pytest.raises(ArgoError, match=r"set cluster\.namespace to 'posttrain'"):
        client.submit_workflow(_compiled().workflow)
    assert fake.requests == []
    moved = _compiled("cluster.namespace=posttrain")
    client.ensure_workflow_template(moved.template)
    client.submit_workflow(moved.workflow)
    assert set(fake.objects("workflowtemplates")) == {("posttrain", "korean-llm")}
    assert {ns for ns, _ in fake.objects("workflows")} == {"posttrain"}


def test_a_profile_template_is_another_object(fake: FakeArgo) -> None:
    client = _client(fake)
    client.ensure_workflow_template(_compiled().template)
    plain = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    loaded = load_pipeline("korean-llm", "local")
    profiled = compile_pipeline(loaded.spec, profile=loaded.profile)
    assert str(client.ensure_workflow_template(profiled.template)) == f"created WorkflowTemplate {NS}/korean-llm-local"
    assert profiled.cron is not None
    assert str(client.ensure_cron_workflow(profiled.cron)) == f"created CronWorkflow {NS}/korean-llm-local"
    assert fake.objects("workflowtemplates")[(NS, "korean-llm")] == plain
    assert client.submit_workflow(profiled.workflow).startswith("korean-llm-")


def test_base_href_prefixes_the_api_paths() -> None:
    with running(base_href="/argo/") as fake:
        client = _client(fake)
        client.ensure_workflow_template(_compiled().template)
        assert [(r.method, r.path) for r in fake.requests] == [
            ("GET", "/argo/api/v1/workflow-templates/llm-training/korean-llm"),
            ("POST", "/argo/api/v1/workflow-templates/llm-training"),
        ]
        assert client.ui_url("w").startswith(f"{fake.url}/argo/workflows/")


# --------------------------------------------------------------------------- errors


def test_submit_before_the_template_exists_is_rejected(fake: FakeArgo) -> None:
    with pytest.raises(ArgoError, match=r"korean-llm.* not found") as err:
        _client(fake).submit_workflow(_compiled().workflow)
    assert err.value.status == 400


def test_connection_refused_says_to_set_argo_server() -> None:
    config = ArgoConfig.from_env(NS, {"ARGO_SERVER": f"http://127.0.0.1:{_closed_port()}"})
    with pytest.raises(ArgoError) as err:
        ArgoClient(config, timeout=5).get_workflow("w")
    assert "cannot reach the Argo server at http://127.0.0.1:" in str(err.value)
    assert "set ARGO_SERVER" in str(err.value) and "ARGO_INSECURE_SKIP_VERIFY=true" in str(err.value)
    assert err.value.retriable


def test_tls_to_a_plain_http_server_suggests_the_tls_settings(fake: FakeArgo) -> None:
    config = ArgoConfig.from_env(NS, {"ARGO_SERVER": fake.address, "ARGO_TOKEN": fake.token})
    with pytest.raises(ArgoError, match=r"TLS handshake failed.*ARGO_INSECURE_SKIP_VERIFY=true"):
        ArgoClient(config, timeout=5).get_workflow("w")


def test_401_without_token_says_to_set_argo_token(fake: FakeArgo) -> None:
    env = {"ARGO_SERVER": fake.url}
    with pytest.raises(ArgoError, match=r"401 Unauthorized\): ARGO_TOKEN is not set.*argo auth token") as err:
        ArgoClient(ArgoConfig.from_env(NS, env)).ensure_workflow_template(_compiled().template)
    assert err.value.status == 401


def test_401_with_a_wrong_token_never_shows_it(fake: FakeArgo) -> None:
    with pytest.raises(ArgoError, match="the token in ARGO_TOKEN was rejected") as err:
        _client(fake, ARGO_TOKEN="wrong-s3cr3t-value").get_workflow("w")
    assert "wrong-s3cr3t-value" not in str(err.value)


def test_bearer_prefixed_token_is_accepted_by_the_server(fake: FakeArgo) -> None:
    client = _client(fake, ARGO_TOKEN=f"Bearer {fake.token}")
    assert client.ensure_workflow_template(_compiled().template).action == "created"


def test_403_names_the_missing_verb_resource_and_namespace(fake: FakeArgo) -> None:
    fake.forbidden = {("create", "workflows")}
    client = _client(fake)
    compiled = _compiled()
    client.ensure_workflow_template(compiled.template)
    with pytest.raises(ArgoError) as err:
        client.submit_workflow(compiled.workflow)
    message = str(err.value)
    assert "403 Forbidden" in message
    assert "RBAC verb 'create' on resource 'workflows'" in message
    assert f"in namespace '{NS}'" in message
    assert err.value.status == 403


def test_403_on_update_names_update(fake: FakeArgo) -> None:
    client = _client(fake)
    client.ensure_workflow_template(_compiled().template)
    fake.forbidden = {("update", "workflowtemplates")}
    with pytest.raises(ArgoError, match="RBAC verb 'update' on resource 'workflowtemplates'"):
        client.ensure_workflow_template(_compiled("description=changed").template)


def test_unknown_namespace_says_to_set_argo_namespace(fake: FakeArgo) -> None:
    with pytest.raises(ArgoError, match=r"namespace 'nope' was not found.*set ARGO_NAMESPACE") as err:
        _client(fake, ARGO_NAMESPACE="nope").ensure_workflow_template(_compiled("cluster.namespace=nope").template)
    assert err.value.status == 404


def test_unknown_workflow_is_404(fake: FakeArgo) -> None:
    with pytest.raises(ArgoError, match="not found: cannot get Workflow llm-training/ghost") as err:
        _client(fake).get_workflow("ghost")
    assert err.value.status == 404


def test_wrong_base_href_is_pointed_out() -> None:
    with running(base_href="/argo/") as fake:
        client = _client(fake, ARGO_BASE_HREF="/")
        with pytest.raises(ArgoError, match=r"no Argo API there.*ARGO_BASE_HREF"):
            client.get_workflow("w")


def test_a_html_page_instead_of_json_is_pointed_out() -> None:
    with running(base_href="/argo/", ui_fallback=True) as fake:
        client = _client(fake, ARGO_BASE_HREF="/")
        with pytest.raises(ArgoError, match=r"not an Argo API response.*ARGO_BASE_HREF"):
            client.get_workflow("w")


# --------------------------------------------------------------------------- the fake itself


def test_fake_rejects_a_body_with_an_unknown_field(fake: FakeArgo) -> None:
    """The fake's schema is strict, so a typo in a compiled manifest would fail the tests above."""
    doc = _compiled().documents()["workflowtemplate.yaml"]
    doc["spec"]["entrypoint_typo"] = "x"
    resp = requests.post(
        f"{fake.url}/api/v1/workflow-templates/{NS}",
        json={"namespace": NS, "template": doc},
        headers={"Authorization": f"Bearer {fake.token}"},
        timeout=10,
    )
    assert resp.status_code == 400
    assert "entrypoint_typo" in resp.json()["message"]
