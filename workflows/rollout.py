"""The serving rollout: a run's model goes live only after real requests to it succeed, else traffic goes back.

    python -m workflows.rollout --run-dir DIR

The cluster DAG's serve step, after deploy (which registered the model as `challenger` and wrote
`<run>/deploy/inferenceservice.yaml`):

1. Apply the InferenceService (server-side apply): `rollout: replace` as rendered, `canary` with
   canaryTrafficPercent at the first step.
2. Wait for the NEW revision to be ready with its share of the traffic. Right after an apply KServe still reports
   the previous revision as ready (and its status.observedGeneration is copied from the Knative Service, not the
   InferenceService's own generation, so no generation comparison can tell the two apart). The revision that
   holds this run's model is the first one created after the revision that was newest before the apply; that
   revision's name is stamped on the object in the same apply (PREVIOUS_REVISION_ANNOTATION), so a retry of the
   step waits for the same one. Argo's mutex on the step keeps two runs from rolling out one service at once.
3. Smoke-check it: real chat requests (stages.evaluate.prompts) to vLLM's OpenAI-compatible server, each answer
   non-empty, not the prompt echoed, holding an expected substring when asked, and within the latency limit. A
   canary is reached alone through its `latest` tag's address.
4. canary: each further step, then all traffic, each checked again.
5. Move the registry alias `champion` to the deployed version.

Any failure after the apply rolls back (canaryTrafficPercent 0: KServe pins all traffic to the previous rolled-out
revision), leaves `champion` where it was, and ends with one `error:` line (exit 1). Bad input, such as a run
directory without deploy's record, exits 2.

This module is control plane: no torch; mlflow is imported only to move the alias.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from run.serving import (
    API_VERSION,
    RUN_LABEL,
    with_canary_traffic,
)
from spec.pipeline import PipelineSpec
from spec.serving import ServingSpec, SmokeCheckSpec

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "inferenceservices"
FIELD_MANAGER = "posttrain-rollout"
PREVIOUS_REVISION_ANNOTATION = "posttrain.dev/previous-revision"
"""The predictor revision that was newest before this run's apply: the run's own revision is the next one."""
CHAT_PATH = "/v1/chat/completions"
"""The kit's kserve-vllm runtime runs vLLM's OpenAI server itself (vllm.entrypoints.openai.api_server), serving the
model under the InferenceService's name (--served-model-name={{.Name}})."""
DEFAULT_PROMPT = "안녕하세요. 자기소개를 한 문장으로 해 주세요."
"""Sent when stages.evaluate.prompts is empty."""
CANARY_TAG = "latest"
FAILED_TRANSITIONS = ("BlockedByFailedLoad", "InvalidSpec")
POLL_SECONDS = 5.0
API_TIMEOUT_SECONDS = 30
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class RolloutFailed(RuntimeError):
    """The new model did not become ready, or failed its smoke check: traffic goes back."""


class BadInput(RuntimeError):
    """The run directory does not hold what the rollout needs."""


# --------------------------------------------------------------------------- the API server


class InferenceServices:
    """GET and server-side apply of InferenceServices in one namespace, through the kubernetes client's ApiClient."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.api = api_client
        self.namespace = namespace

    def _path(self, name: str) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{name}"

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = self.api.call_api(
                path,
                method,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=API_TIMEOUT_SECONDS,
                **kwargs,
            )
        except ApiException as exc:
            if exc.status == 404 and method == "GET":
                return None
            message = _api_message(exc.body) or exc.reason
            raise RolloutFailed(f"{method} {path}: the API server answered {exc.status}: {message}") from None
        except (HTTPError, OSError) as exc:
            reason = type(exc).__name__
            raise RolloutFailed(f"{method} {path}: the API server could not be reached ({reason})") from None
        return json.loads(response.data)

    def get(self, name: str) -> dict[str, Any] | None:
        """The InferenceService, or None when there is none."""
        return self._call("GET", self._path(name), header_params={"Accept": "application/json"})

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or makes the fields this manager set exactly these (a field it set
        before and left out now, such as canaryTrafficPercent, is removed)."""
        applied = self._call(
            "PATCH",
            self._path(manifest["metadata"]["name"]),
            header_params={"Accept": "application/json", "Content-Type": "application/apply-patch+yaml"},
            query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=manifest,
        )
        assert applied is not None
        return applied


def _api_message(body: Any) -> str:
    try:
        return str(json.loads(body).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        return ""


def default_api_client() -> Any:
    """The in-cluster ServiceAccount's client, else the kubeconfig's."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        return config.new_client_from_config()
    return client.ApiClient(configuration)


# --------------------------------------------------------------------------- the predictor's status


@dataclass
class PredictorStatus:
    """What KServe reports of the predictor's revisions (status.components.predictor) and their readiness."""

    latest_created: str = ""
    latest_ready: str = ""
    rolled_out: str = ""
    traffic: list[dict[str, Any]] = field(default_factory=list)
    ready: bool = False
    transition: str = ""
    failure: str = ""
    address: str = ""

    def percent_of(self, revision: str) -> int:
        """The share of traffic `revision` gets, over every target naming it."""
        return sum(int(t.get("percent") or 0) for t in self.traffic if t.get("revisionName") == revision)

    def tag_url(self, tag: str) -> str:
        return next((str(t.get("url") or "") for t in self.traffic if t.get("tag") == tag), "")


def predictor_status(isvc: dict[str, Any]) -> PredictorStatus:
    status = isvc.get("status") or {}
    component = (status.get("components") or {}).get("predictor") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    model = status.get("modelStatus") or {}
    failure = ""
    for kind in ("PredictorConfigurationReady", "PredictorReady"):
        condition = conditions.get(kind) or {}
        if condition.get("status") == "False":
            failure = condition.get("message") or condition.get("reason") or kind
            break
    info = model.get("lastFailureInfo") or {}
    if model.get("transitionStatus") in FAILED_TRANSITIONS:
        failure = info.get("message") or info.get("reason") or failure or model["transitionStatus"]
    address = ((component.get("address") or {}).get("url")) or ((status.get("address") or {}).get("url")) or ""
    return PredictorStatus(
        latest_created=component.get("latestCreatedRevision") or "",
        latest_ready=component.get("latestReadyRevision") or "",
        rolled_out=component.get("latestRolledoutRevision") or "",
        traffic=list(component.get("traffic") or []),
        ready=(conditions.get("PredictorReady") or {}).get("status") == "True",
        transition=model.get("transitionStatus") or "",
        failure=failure,
        address=address or status.get("url") or "",
    )


# --------------------------------------------------------------------------- the smoke check


@dataclass
class Answer:
    prompt: str
    text: str
    seconds: float


def smoke_check(base_url: str, model: str, prompts: list[str], spec: ServingSpec) -> list[Answer]:
    """Send each prompt as a chat request to `base_url`, then each tool-call prompt with its tools (when
    `smoke_check.tool_calls` is set); RolloutFailed at the first bad answer."""
    check = spec.smoke_check
    answers = []
    for prompt in prompts:
        message, seconds = chat(base_url, model, prompt, check)
        text = message.get("content") or ""
        problem = answer_problem(prompt, text, check.expected_substrings)
        answers.append(checked(prompt, text, seconds, problem, check))
    if check.tool_calls is not None:
        tools = [{"type": "function", "function": f.model_dump()} for f in check.tool_calls.tools]
        for prompt in check.tool_calls.prompts:
            message, seconds = chat(base_url, model, prompt, check, tools)
            calls, problem = tool_call_problem(message, {f.name for f in check.tool_calls.tools})
            answers.append(checked(prompt, calls, seconds, problem, check))
    return answers


def chat(
    base_url: str, model: str, prompt: str, check: SmokeCheckSpec, tools: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], float]:
    """One greedy chat request (offering `tools`, tool_choice auto, when given): the answer's message and the
    seconds it took; RolloutFailed when the server cannot be reached, answers late or with an error."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": check.max_tokens,
        "temperature": 0,
    }
    if tools:
        body.update(tools=tools, tool_choice="auto")
    url = base_url.rstrip("/") + CHAT_PATH
    started = time.monotonic()
    try:
        response = requests.post(url, json=body, timeout=check.max_latency_seconds)
    except requests.Timeout:
        raise RolloutFailed(
            f"smoke check: no answer from {url} within max_latency_seconds={check.max_latency_seconds:g}"
        ) from None
    except requests.RequestException as exc:
        raise RolloutFailed(f"smoke check: {url} could not be reached ({type(exc).__name__})") from None
    seconds = time.monotonic() - started
    if response.status_code != 200:
        said = " ".join(response.text.split())[:200]
        raise RolloutFailed(f"smoke check: {url} answered {response.status_code}: {said}")
    try:
        message = response.json()["choices"][0]["message"]
        if not isinstance(message, dict):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError):
        raise RolloutFailed(f"smoke check: {url} answered without choices[0].message") from None
    return message, seconds


def checked(prompt: str, text: str, seconds: float, problem: str | None, check: SmokeCheckSpec) -> Answer:
    """The answer, or RolloutFailed with its problem (a late answer is one)."""
    if problem is None and seconds > check.max_latency_seconds:
        problem = f"took {seconds:.1f}s, over max_latency_seconds={check.max_latency_seconds:g}"
    if problem:
        raise RolloutFailed(f"smoke check: the answer to {prompt[:60]!r} {problem}")
    print(f"[serve] smoke check: {prompt[:40]!r} -> {text[:80]!r} ({seconds:.1f}s)", flush=True)
    return Answer(prompt, text, seconds)


def tool_call_problem(message: dict[str, Any], names: set[str]) -> tuple[str, str | None]:
    """The calls of a tool-call answer as text (`name({"arg": ...})`, one per line), and what is wrong with them:
    none made, a function that was not offered, arguments that are not a JSON object."""
    calls = message.get("tool_calls") or []
    if not calls:
        said = " ".join(str(message.get("content") or "").split())[:80]
        return said, f"calls none of the tools {sorted(names)} (it says {said!r})"
    shown = []
    for call in calls:
        function = call.get("function") or {}
        name, raw = str(function.get("name", "")), function.get("arguments")
        shown.append(f"{name}({raw})")
        if name not in names:
            return "\n".join(shown), f"calls {name!r}, which is none of the tools {sorted(names)}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return "\n".join(shown), f"calls {name} with arguments that are not a JSON object: {str(raw)[:80]!r}"
    return "\n".join(shown), None


def answer_problem(prompt: str, text: str, expected: list[str]) -> str | None:
    """What is wrong with an answer, or None."""
    answer = " ".join(text.split())
    if not answer:
        return "is empty"
    if answer == " ".join(prompt.split()):
        return "only echoes the prompt"
    if expected and not any(s.lower() in answer.lower() for s in expected):
        return f"holds none of expected_substrings {expected}: {answer[:80]!r}"
    return None


def smoke_prompts(spec: PipelineSpec) -> list[str]:
    prompts = [p for p in spec.stages.evaluate.prompts if p.strip()] or [DEFAULT_PROMPT]
    return prompts[: spec.stages.deploy.serving.smoke_check.prompts]


# --------------------------------------------------------------------------- the rollout


@dataclass
class Rollout:
    """One run's rollout of its InferenceService."""

    services: InferenceServices
    spec: PipelineSpec
    manifest: dict[str, Any]
    sleep: Callable[[float], None] = time.sleep
    poll_seconds: float = POLL_SECONDS
    previous: str = ""
    revision: str = ""

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def serving(self) -> ServingSpec:
        return self.spec.stages.deploy.serving

    def apply(self, percent: int | None) -> None:
        manifest = with_canary_traffic(self.manifest, percent)
        manifest["metadata"]["annotations"][PREVIOUS_REVISION_ANNOTATION] = self.previous
        self.services.apply(manifest)
        share = "all traffic once ready" if percent is None else f"canaryTrafficPercent {percent}"
        print(f"[serve] applied InferenceService {self.name} ({share})", flush=True)

    def previous_revision(self) -> str:
        """The newest predictor revision before this run's apply; an earlier attempt of this run stamped it."""
        live = self.services.get(self.name)
        if live is None:
            return ""
        meta = live.get("metadata") or {}
        ours = (meta.get("labels") or {}).get(RUN_LABEL) == self.manifest["metadata"]["labels"][RUN_LABEL]
        annotations = meta.get("annotations") or {}
        if ours and PREVIOUS_REVISION_ANNOTATION in annotations:
            return str(annotations[PREVIOUS_REVISION_ANNOTATION])
        return predictor_status(live).latest_created

    def wait(self, what: str, done: Callable[[PredictorStatus], bool], fail_on_error: bool = True) -> PredictorStatus:
        """Poll the InferenceService until `done`; RolloutFailed when the new revision fails or time runs out."""
        timeout = self.serving.smoke_check.ready_timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            live = self.services.get(self.name)
            if live is None:
                raise RolloutFailed(f"InferenceService {self.name} disappeared while waiting for {what}")
            status = predictor_status(live)
            if done(status):
                return status
            new = status.latest_created not in ("", self.previous)
            if fail_on_error and new and status.failure:
                raise RolloutFailed(f"revision {status.latest_created} failed: {' '.join(status.failure.split())}")
            if time.monotonic() >= deadline:
                raise RolloutFailed(f"{what}: not reached within ready_timeout_seconds={timeout}")
            self.sleep(self.poll_seconds)

    def new_revision_serving(self, percent: int) -> Callable[[PredictorStatus], bool]:
        """Done when the revision created after `previous` is ready and has `percent` of the traffic."""

        def done(status: PredictorStatus) -> bool:
            created = status.latest_created
            return (
                created not in ("", self.previous)
                and status.latest_ready == created
                and status.ready
                and status.percent_of(created) == percent
            )

        return done

    def wait_for_new_revision(self, percent: int) -> PredictorStatus:
        status = self.wait(f"the new revision with {percent}% of the traffic", self.new_revision_serving(percent))
        self.revision = status.latest_created
        print(f"[serve] revision {self.revision} is ready with {percent}% of the traffic", flush=True)
        return status

    def check(self, url: str) -> None:
        if not url:
            raise RolloutFailed(f"InferenceService {self.name} reports no address to send the smoke check to")
        smoke_check(url, self.name, smoke_prompts(self.spec), self.serving)

    def run(self) -> str:
        """Roll out; returns the revision that serves. RolloutFailed after a rollback when a check fails."""
        self.previous = self.previous_revision()
        first_rollout = not self.previous
        steps = list(self.serving.canary_traffic_percent) if self.serving.rollout == "canary" else []
        if steps and first_rollout:
            print("[serve] no previous revision to share traffic with: the first model takes all of it", flush=True)
            steps = []
        self.apply(steps[0] if steps else None)
        try:
            status = self.wait_for_new_revision(steps[0] if steps else 100)
            for index, percent in enumerate(steps):
                if index:
                    self.apply(percent)
                    status = self.wait(f"{percent}% of the traffic on {self.revision}", self._share(percent))
                    print(f"[serve] canary {self.revision} has {percent}% of the traffic", flush=True)
                    self.sleep(self.serving.canary_interval_seconds)
                url = status.tag_url(CANARY_TAG)
                if not url:
                    raise RolloutFailed(f"the canary's traffic target has no `{CANARY_TAG}` tag address")
                self.check(url)
            if steps:
                self.apply(None)
                status = self.wait(f"all traffic on {self.revision}", self._share(100))
                print(f"[serve] revision {self.revision} has all the traffic", flush=True)
            self.check(status.address)
        except RolloutFailed as exc:
            raise RolloutFailed(f"{exc}; {self.rollback()}") from None
        return self.revision

    def _share(self, percent: int) -> Callable[[PredictorStatus], bool]:
        return lambda s: s.ready and s.percent_of(self.revision) == percent

    def rollback(self) -> str:
        """Pin all traffic to the previous rolled-out revision; says what became of the traffic."""
        if not self.previous:
            return "no earlier revision to roll back to: the service keeps the new model"
        try:
            self.apply(0)
            self.wait(
                "the rollback",
                lambda s: bool(s.traffic) and (not self.revision or s.percent_of(self.revision) == 0),
                fail_on_error=False,
            )
        except RolloutFailed as exc:
            return f"rolling back (canaryTrafficPercent 0) did not complete: {exc}"
        return "rolled back: all traffic is on the previous revision (canaryTrafficPercent 0)"


# --------------------------------------------------------------------------- the registry


def promote(spec: PipelineSpec, run_dir: Path, deployed: dict[str, Any]) -> str:
    """Move `champion` to the deployed version (only for a model whose gate passed); returns what was done."""
    from mlflow import MlflowClient

    from run.release import CHAMPION, GATE_PASS
    from run.tracking import resolve_tracking_uri

    name, version = deployed["registered_model"], deployed["model_version"]
    if deployed.get("gate") != GATE_PASS:
        return f"{name} v{version} serves, and stays challenger only: its gate did not pass"
    uri = resolve_tracking_uri(spec, run_dir)
    MlflowClient(tracking_uri=uri, registry_uri=uri).set_registered_model_alias(name, CHAMPION, version)
    return f"{name} v{version} is {CHAMPION}"


# --------------------------------------------------------------------------- the step


def not_promoted(deployed: dict[str, Any], failure: Exception) -> str:
    """The serve step's error line when the model did not answer as it must: champion stays where it was."""
    before = deployed.get("champion_before") or "unchanged"
    version = f"{deployed['registered_model']} v{deployed['model_version']}"
    return f"[serve] error: {version} was not promoted: {failure}; champion {before}"


def read_run(run_dir: Path) -> tuple[PipelineSpec, dict[str, Any], dict[str, Any]]:
    """The resolved spec, deploy's record (its extra) and the InferenceService deploy rendered."""
    from run.run_dir import RunDir, StageRefused

    run = RunDir(run_dir)
    try:
        spec = run.load_spec()
    except StageRefused as exc:
        raise BadInput(str(exc)) from None
    result = run.read_result("deploy")
    if result is None or result.status != "succeeded":
        state = "has no record" if result is None else f"is {result.status}"
        raise BadInput(f"{run.result_path('deploy')}: deploy {state}; the rollout needs the model it registered")
    manifest_path = run.stage_dir("deploy") / "inferenceservice.yaml"
    if not manifest_path.is_file():
        raise BadInput(f"{manifest_path} is missing: deploy renders it when stages.deploy.serving.enabled is true")
    manifest = yaml.safe_load(manifest_path.read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or manifest.get("kind") != "InferenceService":
        raise BadInput(f"{manifest_path} does not hold an InferenceService")
    for key in ("registered_model", "model_version"):
        if not result.extra.get(key):
            raise BadInput(f"{run.result_path('deploy')}: extra.{key} is missing")
    return spec, result.extra, manifest


def main(argv: list[str] | None = None, api_client: Any = None, sleep: Callable[[float], None] = time.sleep) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="The run directory (deploy has run in it).")
    args = parser.parse_args(argv)
    try:
        spec, deployed, manifest = read_run(args.run_dir)
    except BadInput as exc:
        print(f"[serve] error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    services = InferenceServices(api_client or default_api_client(), manifest["metadata"]["namespace"])
    rollout = Rollout(services, spec, manifest, sleep=sleep)
    try:
        revision = rollout.run()
    except RolloutFailed as exc:
        print(not_promoted(deployed, exc), file=sys.stderr, flush=True)
        return EXIT_FAILED
    promoted = promote(spec, args.run_dir, deployed)
    print(f"[serve] revision {revision} serves; {promoted}", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
