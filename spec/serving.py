"""How deploy serves a model: the InferenceService, its autoscaling and its smoke checks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spec.fields import FieldError, Int32, Int64, KubernetesName, Seconds, StrictModel

ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]
"""vLLM tool-call parsers for the families this project trains (vllm/tool_parsers/)."""


class ToolFunction(StrictModel):
    """A function the model may call, as OpenAI's `tools[].function` has it."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The function's name (letters, digits, _ and -; OpenAI's rule)."
    )
    description: str = Field("", description="What it does, as the model's chat template shows it.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of its arguments (an object).",
    )


class ToolCallCheckSpec(StrictModel):
    """Chat requests that offer the model functions: the agent a tool-call dataset trained must still call them."""

    prompts: list[str] = Field(
        min_length=1,
        description="User messages, each sent with `tools` and tool_choice auto; every answer must call one of the "
        "tools (OpenAI `tool_calls`, which vLLM's tool_call_parser makes of the model's own syntax) with "
        "arguments that are a JSON object.",
    )
    tools: list[ToolFunction] = Field(min_length=1, description="The functions offered, as in the training data.")


class SmokeCheckSpec(StrictModel):
    """Real chat requests to the new model's vLLM server before it keeps traffic or becomes champion."""

    prompts: Int64 = Field(
        3,
        ge=1,
        le=20,
        description="How many of stages.evaluate.prompts are sent, first ones first (a built-in Korean greeting "
        "when evaluate has none), each as one user message to the OpenAI-compatible /v1/chat/completions.",
    )
    max_tokens: Int64 = Field(64, gt=0, le=4096, description="Tokens the server may generate per answer.")
    max_latency_seconds: float = Field(
        60.0, gt=0, description="Longest wait for one complete answer; a slower answer fails the check."
    )
    expected_substrings: list[str] = Field(
        default_factory=list,
        description="When set, every answer must contain at least one of these (case-insensitive), e.g. a few "
        "Hangul particles for a Korean model. Answers are always checked to be non-empty and not the prompt echoed.",
    )
    tool_calls: ToolCallCheckSpec | None = Field(
        None,
        description="Tool-call requests checked after the prompts (needs serving.tool_call_parser); None: none.",
    )
    ready_timeout_seconds: Seconds = Field(
        1800,
        gt=0,
        description="Longest wait for the new revision to be ready (model download and load included), and for "
        "each traffic change to take effect.",
    )

    @field_validator("expected_substrings")
    @classmethod
    def _non_blank(cls, values: list[str]) -> list[str]:
        if any(not v.strip() for v in values):
            raise ValueError("expected_substrings must not hold empty strings: every answer would contain one")
        return values


class AutoscalingSpec(StrictModel):
    """Knative's request-based autoscaler for the predictor (KServe scaleMetric/scaleTarget), instead of scaling on
    CPU, which says nothing about a GPU server's load."""

    metric: Literal["concurrency", "rps"] = Field(
        "concurrency",
        description="concurrency: requests in flight per replica; rps: requests per second per replica.",
    )
    target: Int32 = Field(
        gt=0,
        description="The value per replica the autoscaler aims at (e.g. 8 concurrent requests per vLLM replica); "
        "replicas stay within min_replicas..max_replicas.",
    )


class ServingSpec(StrictModel):
    """The KServe InferenceService rendered for the model, and how a new model rolls out in the cluster."""

    enabled: bool = Field(True, description="Render (and in-cluster apply) an InferenceService.")
    runtime: KubernetesName = Field("kserve-vllm", description="ServingRuntime name.")
    gpus: Int32 = Field(1, ge=0, description="GPUs for the predictor.")
    max_model_len: Int32 | None = Field(None, gt=0, description="vLLM --max-model-len.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="vLLM --dtype; auto: the model's own (vLLM serves float32 weights as half precision)."
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="vLLM's parser for the model's tool-call syntax (--enable-auto-tool-choice --tool-call-parser), "
        "so that answers carry OpenAI tool_calls: hermes for Qwen2.5 and Qwen3, llama3_json for Llama 3, mistral "
        "for Mistral. None: tool calls come back as text.",
    )
    min_replicas: Int32 = Field(1, ge=0, description="Predictor minReplicas.")
    max_replicas: Int32 = Field(1, ge=1, description="Predictor maxReplicas.")
    service_account: KubernetesName | None = Field(
        None,
        description="ServiceAccount of the predictor, e.g. one bound through Workload Identity or IRSA to read "
        "gs:// or s3:// storage. None uses the namespace's default account, never the workflow's (which may "
        "create jobs).",
    )
    rollout: Literal["replace", "canary"] = Field(
        "replace",
        description="How the cluster's serve step moves traffic to a new model (KServe's Knative mode, revisions). "
        "replace: the new revision takes all traffic once ready, then the smoke check decides whether it stays. "
        "canary: it gets canary_traffic_percent[0] of the traffic beside the previous model and is smoke-checked "
        "on its own address, then each further step, then all of it. Any failed check rolls traffic back to the "
        "previous revision and leaves the champion alias where it was.",
    )
    canary_traffic_percent: list[Int32] = Field(
        default_factory=lambda: [10, 50],
        min_length=1,
        description="Canary traffic steps in percent (each 1-99, increasing); 100 follows the last one.",
    )
    canary_interval_seconds: Seconds = Field(
        60, ge=0, description="How long each canary step serves its share before it is checked again."
    )
    smoke_check: SmokeCheckSpec = Field(
        default_factory=SmokeCheckSpec, description="The requests that decide whether a new model keeps its traffic."
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Request-based autoscaling (Knative); None keeps KServe's default for the mode (concurrency "
        "100 per replica).",
    )

    @field_validator("canary_traffic_percent")
    @classmethod
    def _steps(cls, steps: list[int]) -> list[int]:
        if any(not 0 < s < 100 for s in steps):
            raise ValueError(f"canary_traffic_percent steps must each lie between 1 and 99, got {steps}")
        if steps != sorted(set(steps)):
            raise ValueError(f"canary_traffic_percent steps must increase, got {steps}")
        return steps

    @model_validator(mode="after")
    def _replicas(self) -> ServingSpec:
        if self.min_replicas > self.max_replicas:
            raise FieldError(
                ("min_replicas",),
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas}): KServe refuses it",
            )
        return self

    @model_validator(mode="after")
    def _tool_calls_need_a_parser(self) -> ServingSpec:
        if self.smoke_check.tool_calls is not None and self.tool_call_parser is None:
            raise FieldError(
                ("smoke_check", "tool_calls"),
                "checks answers for OpenAI tool_calls, which vLLM gives only with a tool_call_parser: set "
                "stages.deploy.serving.tool_call_parser (hermes for Qwen2.5 and Qwen3, llama3_json for Llama 3, "
                "mistral for Mistral)",
            )
        return self
