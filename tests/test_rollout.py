"""The serving rollout (workflows/rollout.py) against a fake Kubernetes API that answers as KServe in Knative mode
does (stale status right after an apply, revisions, canary traffic and its rollback bookkeeping), the real vLLM
engine serving a tiny model for the good answers, a fake vLLM OpenAI server for the bad ones (empty, echoed, slow),
and a real MLflow registry on SQLite.

The fake's status follows KServe's own code: ksvc_reconciler.go (the traffic targets it gives Knative for a
canaryTrafficPercent) and inference_service_status.go PropagateStatus (latestRolledoutRevision and the rollback
bookkeeping); Knative's `latestRevision: true` target follows the latest READY revision."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from conftest import fresh_spec, require_real_vllm
from fake_vllm_server import JsonHandler
from kubernetes import client
from schema_validation import validate_custom_resource

from run.run_dir import RunDir
from run.serving import LOCAL_HOST, RUNTIME_ENV, inference_service, model_storage_uri, server_argv, to_yaml
from run.vllm_server import Server, free_port, server_env
from spec.pipeline import PipelineSpec
from stages.contract import StageContext
from workflows import rollout

NAMESPACE = "llm-training"
NAME = "korean-llm"
PATH = f"/apis/serving.kserve.io/v1beta1/namespaces/{NAMESPACE}/inferenceservices/{NAME}"
CREATED_AGE, READY_AGE = 2, 4
"""Reconciles (GETs) after its apply at which a revision shows as created, then ready: the first GET after an apply
still shows the previous revision, ready with all the traffic."""


# --------------------------------------------------------------------------- fake vLLM (OpenAI chat completions)


class VllmHandler(JsonHandler):
    """`/<behaviour>/v1/chat/completions`: empty, echo or slow answers, as a broken model's server would give, or
    a fresh one (a good answer from one revision's server, to tell which revision answered)."""

    requests_seen: list[tuple[str, dict[str, Any]]]
    slow_seconds = 6.0

    def do_POST(self) -> None:
        behaviour, _, route = self.path.lstrip("/").partition("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests_seen.append((behaviour, body))  # type: ignore[attr-defined]
        valid = (
            route == "v1/chat/completions"
            and body.get("model") == NAME
            and isinstance(body.get("max_tokens"), int)
            and [m["role"] for m in body.get("messages", [])] == ["user"]
        )
        if not valid:
            return self._send(400, {"error": {"message": f"bad request {route} {body}"}})
        prompt = body["messages"][0]["content"]
        answers = {"empty": "  ", "echo": prompt, "fresh": "서울은 대한민국의 수도입니다."}
        text = answers.get(behaviour, "늦은 답입니다.")
        if behaviour == "slow":
            time.sleep(self.slow_seconds)
        self._send(
            200,
            {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]},
        )


class VllmServer(ThreadingHTTPServer):
    """The model servers. A client that gave up waiting (the smoke check's latency limit) has closed its connection
    when the slow answer is written: no error of the server's, and no traceback on the stderr a later test reads."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def vllm() -> Iterator[ThreadingHTTPServer]:
    server = VllmServer(("127.0.0.1", 0), VllmHandler)
    server.requests_seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def vllm_url(server: ThreadingHTTPServer, behaviour: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/{behaviour}"


# --------------------------------------------------------------------------- fake KServe behind the API server


class FakeKServe:
    """One InferenceService as the API server and KServe's controller report it. Every GET is one reconcile:
    a changed predictor template makes a revision that appears CREATED_AGE reconciles after the apply (until then
    the status still shows the previous revision, ready), is ready at READY_AGE or fails, and traffic follows the
    canaryTrafficPercent in the spec. `models` maps a storageUri to the behaviour of its vLLM server."""

    def __init__(self, vllm: ThreadingHTTPServer, models: dict[str, str], good: str) -> None:
        self.vllm, self.models, self.good = vllm, models, good
        self.obj: dict[str, Any] | None = None
        self.revisions: list[dict[str, Any]] = []  # name, storage, age, fails
        self.template: str = ""
        self.status: dict[str, Any] = {}
        self.applied: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def url(self, behaviour: str) -> str:
        """Where a revision's model answers: the real engine for good answers, the fake for the others."""
        return self.good if behaviour == "good" else vllm_url(self.vllm, behaviour)

    # Knative: the revision side.
    def _latest_ready(self) -> str:
        ready = [r for r in self.revisions if r["age"] >= READY_AGE and not r["fails"]]
        return ready[-1]["name"] if ready else ""

    def _reconcile(self) -> None:
        assert self.obj is not None
        for revision in self.revisions:
            revision["age"] += 1
        created = [r for r in self.revisions if r["age"] >= CREATED_AGE]
        component = self.status.setdefault("components", {}).setdefault("predictor", {})
        if not created:
            return
        latest_created, latest_ready = created[-1], self._latest_ready()
        # ksvc_reconciler.go: the traffic KServe gives Knative.
        percent = self.obj["spec"]["predictor"].get("canaryTrafficPercent")
        rolled_out = component.get("latestRolledoutRevision", "")
        if percent is not None and rolled_out:
            traffic = [{"latestRevision": True, "percent": percent, "tag": "latest"}]
            if percent < 100:
                traffic.append(
                    {"revisionName": rolled_out, "latestRevision": False, "percent": 100 - percent, "tag": "prev"}
                )
        else:
            traffic = [{"latestRevision": True, "percent": 100}]
        for target in traffic:  # Knative resolves the latest target to the latest ready revision
            if target["latestRevision"]:
                target["revisionName"] = latest_ready
        traffic = [t for t in traffic if t["revisionName"]]
        for target in traffic:
            if "tag" in target:  # a tagged target's own address
                storage = next(r["storage"] for r in self.revisions if r["name"] == target["revisionName"])
                target["url"] = self.url(self.models[storage])
        # inference_service_status.go PropagateStatus: rolled-out bookkeeping, rollback included.
        shares: dict[str, int] = {}
        for target in traffic:
            shares[target["revisionName"]] = shares.get(target["revisionName"], 0) + target["percent"]
        for target in traffic:
            if target["revisionName"] == latest_ready and target["latestRevision"]:
                if rolled_out != latest_ready:
                    if target["percent"] == 100:
                        component["previousRolledoutRevision"] = rolled_out
                        component["latestRolledoutRevision"] = latest_ready
                elif (
                    latest_ready == latest_created["name"]
                    and target["percent"] < 100
                    and shares.get(latest_ready) == 100
                    and component.get("previousRolledoutRevision")
                ):
                    component["latestRolledoutRevision"] = component["previousRolledoutRevision"]
        component.update(
            latestCreatedRevision=latest_created["name"], latestReadyRevision=latest_ready, traffic=traffic
        )
        main = max(traffic, key=lambda t: t["percent"])["revisionName"] if traffic else ""
        main_storage = next((r["storage"] for r in self.revisions if r["name"] == main), "")
        component["address"] = {"url": self.url(self.models.get(main_storage, "none"))}
        failed = latest_created["fails"] and latest_created["age"] >= READY_AGE
        ready = bool(latest_ready) and latest_created["name"] == latest_ready
        self.status["conditions"] = [
            {"type": "PredictorConfigurationReady", "status": "False" if failed else "True" if ready else "Unknown",
             **({"message": "Revision failed: container exited: model load failed"} if failed else {})},
            {"type": "PredictorReady", "status": "True" if latest_ready else "Unknown"},
            {"type": "Ready", "status": "True" if latest_ready else "Unknown"},
        ]  # fmt: skip
        transition = "BlockedByFailedLoad" if failed else "UpToDate" if ready else "InProgress"
        self.status["modelStatus"] = {"transitionStatus": transition}

    def get(self) -> dict[str, Any] | None:
        with self.lock:
            if self.obj is None:
                return None
            self._reconcile()
            return {**self.obj, "status": json.loads(json.dumps(self.status))}

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        validate_custom_resource(body)
        with self.lock:
            self.applied.append(body)
            generation = (self.obj or {}).get("metadata", {}).get("generation", 0) + 1
            self.obj = {**body, "metadata": {**body["metadata"], "generation": generation}}
            predictor = {k: v for k, v in body["spec"]["predictor"].items() if k != "canaryTrafficPercent"}
            template = json.dumps([predictor, body["metadata"].get("annotations"), body["metadata"]["labels"]])
            if template != self.template:
                self.template = template
                storage = predictor["model"]["storageUri"]
                number = len(self.revisions) + 1
                self.revisions.append(
                    {"name": f"{NAME}-predictor-{number:05d}", "storage": storage, "age": 0,
                     "fails": self.models[storage] == "fails"}
                )  # fmt: skip
            return self.obj


class KubeHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if urlparse(self.path).path != PATH:
            return self._send(404, {"kind": "Status", "message": "not found"})
        obj = self.server.kserve.get()  # type: ignore[attr-defined]
        self._send(200, obj) if obj else self._send(404, {"kind": "Status", "message": f'"{NAME}" not found'})

    def do_PATCH(self) -> None:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        if self.headers["Content-Type"] != "application/apply-patch+yaml":
            return self._send(415, {"kind": "Status", "message": "expected a server-side apply"})
        if url.path != PATH or query.get("fieldManager") != ["posttrain-rollout"] or query.get("force") != ["true"]:
            return self._send(422, {"kind": "Status", "message": f"bad apply {self.path}"})
        body = yaml.safe_load(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, self.server.kserve.apply(body))  # type: ignore[attr-defined]

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def kube() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), KubeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def api_client(server: ThreadingHTTPServer) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    return client.ApiClient(configuration)


# --------------------------------------------------------------------------- runs and the registry


def registry(spec: PipelineSpec) -> Any:
    from mlflow import MlflowClient

    uri = spec.tracking.mlflow_tracking_uri
    return MlflowClient(uri, registry_uri=uri)


def make_spec(tmp_path: Path, **serving: Any) -> PipelineSpec:
    spec = fresh_spec("korean-llm")
    spec.tracking.mlflow_tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec.stages.evaluate.prompts = ["한국의 수도는 어디인가요?", "김치는 무엇인가요?"]
    settings = spec.stages.deploy.serving
    for key, value in serving.items():
        setattr(settings, key, value)
    settings.canary_interval_seconds = 0
    return spec


def deploy_run(tmp_path: Path, spec: PipelineSpec, run: str, version: str) -> Path:
    """A run directory as deploy leaves it in the cluster: its record (version registered as challenger, gate
    passed) and the InferenceService it rendered; the registry holds the version."""
    mlflow_client = registry(spec)
    if not mlflow_client.search_registered_models(f"name='{NAME}'"):
        mlflow_client.create_registered_model(NAME)
    while len(mlflow_client.search_model_versions(f"name='{NAME}'")) < int(version):
        mlflow_client.create_model_version(NAME, source=str(tmp_path / "model"))
    mlflow_client.set_registered_model_alias(NAME, "challenger", version)
    run_dir = RunDir(tmp_path / run)
    run_dir.root.mkdir(parents=True)
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "deploy", spec)
    assert ctx.begin()
    manifest = inference_service(spec, model_storage_uri(spec, run), run, model_version=version)
    (ctx.dir / "inferenceservice.yaml").write_text(to_yaml(manifest), encoding="utf-8")
    ctx.finish(extra={"registered_model": NAME, "model_version": version, "gate": "pass", "champion_before": "1"})
    return run_dir.root


def rollout_main(run_dir: Path, kube: ThreadingHTTPServer) -> int:
    return rollout.main(["--run-dir", str(run_dir)], api_client=api_client(kube), sleep=lambda _: None)


def champion(spec: PipelineSpec) -> str:
    return str(registry(spec).get_registered_model(NAME).aliases.get("champion", ""))


@pytest.fixture(scope="module")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real vLLM engine serving a tiny korean-llm model under the service's name, with the predictor pod's
    command line: the model built from the local profile's config with a run's tokenizer (the qwen3 template), saved
    as deploy saves it. The good answers come from it; the fake above gives only what the real engine cannot be
    made to give on cue (empty, echoed and slow answers, a server that routes by revision)."""
    from training_fixtures import write_tiny_model

    python = require_real_vllm()
    root = tmp_path_factory.mktemp("served")
    model = write_tiny_model(root)
    spec = fresh_spec("korean-llm", "local")
    port = free_port()
    argv = [*server_argv(spec, str(python), str(model), NAME, port), f"--host={LOCAL_HOST}"]
    server = Server(argv, server_env(RUNTIME_ENV, spec.stages.deploy.serving.gpus), root / "vllm.log")
    url = f"http://{LOCAL_HOST}:{port}"
    try:
        server.wait_ready(url, 600)
        yield url
    finally:
        server.stop()


@pytest.fixture
def serving(
    tmp_path: Path, kube: ThreadingHTTPServer, vllm: ThreadingHTTPServer, real_model: str
) -> Iterator[tuple[ThreadingHTTPServer, FakeKServe]]:
    """The service as a first run left it: revision 1 serving model `run-1` (champion v1)."""
    kserve = FakeKServe(vllm, {}, good=real_model)
    kube.kserve = kserve  # type: ignore[attr-defined]
    yield vllm, kserve


def first_run(
    tmp_path: Path, kube: ThreadingHTTPServer, kserve: FakeKServe, spec: PipelineSpec, behaviour: str = "good"
) -> None:
    kserve.models[model_storage_uri(spec, "run-1")] = behaviour
    assert rollout_main(deploy_run(tmp_path, spec, "run-1", "1"), kube) == 0
    assert champion(spec) == "1"


# --------------------------------------------------------------------------- the tests


def test_replace_waits_for_the_new_revision_not_the_ready_previous_one(
    tmp_path: Path, kube: ThreadingHTTPServer, serving: tuple[ThreadingHTTPServer, FakeKServe]
) -> None:
    vllm, kserve = serving
    spec = make_spec(tmp_path)
    first_run(tmp_path, kube, kserve, spec)
    assert kserve.revisions[0]["name"] == f"{NAME}-predictor-00001"

    kserve.models[model_storage_uri(spec, "run-2")] = "fresh"  # answers well, from run-2's server only
    vllm.requests_seen.clear()  # type: ignore[attr-defined]
    run = deploy_run(tmp_path, spec, "run-2", "2")
    assert rollout_main(run, kube) == 0
    status = kserve.get()["status"]["components"]["predictor"]  # type: ignore[index]
    assert status["latestReadyRevision"] == status["latestRolledoutRevision"] == f"{NAME}-predictor-00002"
    assert champion(spec) == "2"
    # The smoke check ran against the new revision's server (the stale status still named revision 1, ready, at
    # first), with the evaluate prompts.
    seen = vllm.requests_seen  # type: ignore[attr-defined]
    assert [behaviour for behaviour, _ in seen] == ["fresh", "fresh"]
    assert [body["messages"][0]["content"] for _, body in seen] == spec.stages.evaluate.prompts[:3]
    applied = kserve.applied[-1]
    assert "canaryTrafficPercent" not in applied["spec"]["predictor"]
    assert applied["metadata"]["annotations"][rollout.PREVIOUS_REVISION_ANNOTATION] == f"{NAME}-predictor-00001"


def test_a_stale_ready_status_is_not_taken_for_the_new_revision(tmp_path: Path) -> None:
    """The status KServe shows right after an apply: the previous revision ready with all traffic."""
    spec = make_spec(tmp_path)
    stale = {
        "status": {
            "conditions": [{"type": "PredictorReady", "status": "True"}],
            "modelStatus": {"transitionStatus": "UpToDate"},
            "components": {
                "predictor": {
                    "latestCreatedRevision": f"{NAME}-predictor-00001",
                    "latestReadyRevision": f"{NAME}-predictor-00001",
                    "traffic": [{"revisionName": f"{NAME}-predictor-00001", "percent": 100, "latestRevision": True}],
                }
            },
        }
    }
    plan = rollout.Rollout(services=None, spec=spec, manifest={}, previous=f"{NAME}-predictor-00001")  # type: ignore[arg-type]
    assert not plan.new_revision_serving(100)(rollout.predictor_status(stale))
    fresh = json.loads(json.dumps(stale).replace("00001", "00002"))
    assert plan.new_revision_serving(100)(rollout.predictor_status(fresh))


def test_canary_steps_up_and_promotes_on_good_answers(
    tmp_path: Path, kube: ThreadingHTTPServer, serving: tuple[ThreadingHTTPServer, FakeKServe]
) -> None:
    vllm, kserve = serving
    spec = make_spec(tmp_path, rollout="canary", canary_traffic_percent=[10, 50])
    first_run(tmp_path, kube, kserve, spec)
    kserve.models[model_storage_uri(spec, "run-2")] = "good"
    assert rollout_main(deploy_run(tmp_path, spec, "run-2", "2"), kube) == 0
    assert vllm.requests_seen == []  # type: ignore[attr-defined]  # every answer came from the real engine
    percents = [a["spec"]["predictor"].get("canaryTrafficPercent") for a in kserve.applied[1:]]
    assert percents == [10, 50, None]
    assert kserve.applied[-1]["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"
    component = kserve.get()["status"]["components"]["predictor"]  # type: ignore[index]
    assert component["latestRolledoutRevision"] == f"{NAME}-predictor-00002"
    assert component["traffic"] == [{"latestRevision": True, "percent": 100, "revisionName": f"{NAME}-predictor-00002"}]
    assert champion(spec) == "2"


@pytest.mark.parametrize("behaviour", ["empty", "echo", "slow", "fails"])
def test_canary_rolls_back_on_bad_answers_and_keeps_champion(
    tmp_path: Path,
    kube: ThreadingHTTPServer,
    serving: tuple[ThreadingHTTPServer, FakeKServe],
    behaviour: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, kserve = serving
    spec = make_spec(tmp_path, rollout="canary", canary_traffic_percent=[10, 50])
    # the real engine's good answer within it on a loaded 2-core machine (0.5 s was missed in CI), the slow one not
    spec.stages.deploy.serving.smoke_check.max_latency_seconds = 3.0
    first_run(tmp_path, kube, kserve, spec)
    capsys.readouterr()
    kserve.models[model_storage_uri(spec, "run-2")] = behaviour
    assert rollout_main(deploy_run(tmp_path, spec, "run-2", "2"), kube) == rollout.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[serve] error: korean-llm v2 was not promoted: ")
    expected = {
        "empty": "is empty",
        "echo": "only echoes the prompt",
        "slow": "within max_latency_seconds=3",
        "fails": "revision korean-llm-predictor-00002 failed: Revision failed",
    }[behaviour]
    assert expected in err[0] and "rolled back" in err[0], err[0]
    assert kserve.applied[-1]["spec"]["predictor"]["canaryTrafficPercent"] == 0
    component = kserve.get()["status"]["components"]["predictor"]  # type: ignore[index]
    shares = {t["revisionName"]: t["percent"] for t in component["traffic"] if t["percent"]}
    assert shares == {f"{NAME}-predictor-00001": 100}
    assert champion(spec) == "1"


def test_replace_rolls_back_a_revision_that_took_all_traffic(
    tmp_path: Path, kube: ThreadingHTTPServer, serving: tuple[ThreadingHTTPServer, FakeKServe]
) -> None:
    """After a full switch KServe's rollback takes two reconciles (latestRolledoutRevision goes back first)."""
    _, kserve = serving
    spec = make_spec(tmp_path, smoke_check={"expected_substrings": ["수도"]})
    first_run(tmp_path, kube, kserve, spec, "fresh")  # the real tiny model cannot be made to say it on cue
    kserve.models[model_storage_uri(spec, "run-2")] = "echo"  # answers without the expected word
    assert rollout_main(deploy_run(tmp_path, spec, "run-2", "2"), kube) == rollout.EXIT_FAILED
    component = kserve.get()["status"]["components"]["predictor"]  # type: ignore[index]
    assert component["latestRolledoutRevision"] == f"{NAME}-predictor-00001"
    shares = {t["revisionName"]: t["percent"] for t in component["traffic"] if t["percent"]}
    assert shares == {f"{NAME}-predictor-00001": 100}
    assert champion(spec) == "1"


def test_a_retry_waits_for_the_revision_of_its_own_run(
    tmp_path: Path, kube: ThreadingHTTPServer, serving: tuple[ThreadingHTTPServer, FakeKServe]
) -> None:
    """A second attempt of the same run finds its apply done: it waits for the revision made after the one that
    served before the run (stamped on the object), not for yet another one."""
    _, kserve = serving
    spec = make_spec(tmp_path)
    first_run(tmp_path, kube, kserve, spec)
    kserve.models[model_storage_uri(spec, "run-2")] = "good"
    run = deploy_run(tmp_path, spec, "run-2", "2")
    assert rollout_main(run, kube) == 0
    assert rollout_main(run, kube) == 0
    assert len(kserve.revisions) == 2 and champion(spec) == "2"


def test_a_run_directory_without_deploy_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = make_spec(tmp_path)
    run_dir = RunDir(tmp_path / "run-x")
    run_dir.root.mkdir()
    run_dir.write_spec(spec)
    assert rollout.main(["--run-dir", str(run_dir.root)], api_client=object()) == rollout.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deploy has no record" in err[0]


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "is empty"), ("  \n", "is empty"), ("  프롬프트  ", "only echoes the prompt"), ("답", None)],
)
def test_answer_checks(text: str, problem: str | None) -> None:
    assert rollout.answer_problem("프롬프트", text, []) == problem


NOT_AN_OBJECT = "calls get_weather with arguments that are not a JSON object"


def call(name: str, arguments: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(
    ("message", "shown", "problem"),
    [
        (
            {"content": "", "tool_calls": [call("get_weather", '{"city": "부산"}')]},
            'get_weather({"city": "부산"})',
            None,
        ),
        ({"content": "부산은 맑습니다."}, "부산은 맑습니다.", "calls none of the tools ['get_weather'] (it says"),
        ({"tool_calls": []}, "", "calls none of the tools"),
        ({"tool_calls": [call("rm_rf", "{}")]}, "rm_rf({})", "calls 'rm_rf', which is none of the tools"),
        (
            {"tool_calls": [call("get_weather", '{"city": ')]},
            "get_weather(",
            "calls get_weather with arguments that are not",
        ),
        (
            {"tool_calls": [call("get_weather", '"부산"')]},
            "get_weather(",
            "calls get_weather with arguments that are not",
        ),
    ],
)
def test_tool_call_answers(message: dict[str, object], shown: str, problem: str | None) -> None:
    """What a tool-call smoke check accepts: a call to an offered function whose arguments are a JSON object."""
    text, found = rollout.tool_call_problem(message, {"get_weather"})
    assert text.startswith(shown)
    assert found == problem if problem is None else found is not None and found.startswith(problem)


def test_a_tool_call_check_without_a_parser_is_refused() -> None:
    from spec.loading import SpecError, load_pipeline

    check = "stages.deploy.serving.smoke_check.tool_calls={prompts: [부산 날씨 알려줘], tools: [{name: get_weather}]}"
    with pytest.raises(SpecError, match=r"stages\.deploy\.serving\.smoke_check\.tool_calls: .*tool_call_parser"):
        load_pipeline("llama3-dolly", overrides=[check])
    parsed = load_pipeline("llama3-dolly", overrides=[check, "stages.deploy.serving.tool_call_parser=llama3_json"])
    assert parsed.spec.stages.deploy.serving.smoke_check.tool_calls.tools[0].name == "get_weather"


def test_rendered_rollout_settings_validate_against_kserve(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, rollout="canary", autoscaling={"metric": "concurrency", "target": 8})
    manifest = inference_service(spec, "s3://b/m/run-1", "run-1", model_version="3")
    for percent in (None, 0, 10):
        validate_custom_resource(rollout.with_canary_traffic(manifest, percent))
    predictor = manifest["spec"]["predictor"]
    assert (predictor["scaleMetric"], predictor["scaleTarget"]) == ("concurrency", 8)
    assert manifest["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Knative"


@pytest.mark.parametrize(("steps", "problem"), [([50, 10], "must increase"), ([10, 100], "between 1 and 99")])
def test_canary_steps_are_checked(steps: list[int], problem: str) -> None:
    from pydantic import ValidationError

    from spec.serving import ServingSpec

    with pytest.raises(ValidationError, match=problem):
        ServingSpec(rollout="canary", canary_traffic_percent=steps)
