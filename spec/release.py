"""The release half of the DAG: the gate that compares candidate and champion, evaluate, and deploy."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from spec.data import StageData, check_mixture
from spec.fields import _DNS_SUBDOMAIN, FieldError, Int64, OneLine, StrictModel
from spec.serving import ServingSpec
from spec.stage import StageBase


class GateRule(StrictModel):
    """One rule of the champion/challenger gate."""

    # The rule carries its meaning: how far behind a candidate may fall (`allowance`, `within_allowance`;
    # stages/gate.py applies it to measured values) and which rules are at least as strict
    # (`at_least_as_strict_as`: all the Argo form may do to it, spec/form.py).

    metric: str = Field(
        min_length=1, description="Metric name from the evaluation (e.g. 'perplexity', 'kobest_boolq/acc')."
    )
    higher_is_better: bool = Field(True, description="Direction of the metric.")
    max_regression: float = Field(
        0.0, ge=0, description="How far the candidate may fall behind the champion (absolute) and still pass."
    )
    max_regression_relative: float | None = Field(
        None,
        ge=0,
        le=1,
        description="How far the candidate may fall behind, as a fraction of the reference's value (0.05: 5% worse, "
        "e.g. a perplexity of 10.5 against 10.0). The allowance is the larger of this and max_regression. None: "
        "max_regression alone.",
    )
    min_significance: float | None = Field(
        None,
        gt=0,
        description="Require a significant improvement: the candidate must beat the reference by more than this "
        "many standard errors, candidate - reference > k * sqrt(se_candidate^2 + se_reference^2), with the "
        "standard errors lm-eval reports (`<task>/<metric>_stderr`); a side whose standard error is unknown fails "
        "the rule, saying so. Only for lm-eval metrics (`<task>/<metric>`). None: no significance required.",
    )

    def allowance(self, reference: float) -> float:
        """How far the candidate may fall behind `reference` and still pass: the larger of max_regression and
        max_regression_relative x |reference|."""
        if self.max_regression_relative is None:
            return self.max_regression
        return max(self.max_regression, self.max_regression_relative * abs(reference))

    def within_allowance(self, value: float, reference: float) -> bool:
        """Whether `value` is no further behind `reference` than the allowance, in the rule's direction (compared
        with the threshold itself, not as a difference, so a value on the line rounds the same way)."""
        allowed = self.allowance(reference)
        return value >= reference - allowed if self.higher_is_better else value <= reference + allowed

    def at_least_as_strict_as(self, other: GateRule) -> bool:
        """Whether this rule stops every candidate `other` stops: the same metric and direction, max_regression
        and max_regression_relative no larger (none is the strictest), min_significance no smaller. What the
        Argo form may do to the template's rules (spec/form.py)."""
        relative_kept = self.max_regression_relative is None or (
            other.max_regression_relative is not None and self.max_regression_relative <= other.max_regression_relative
        )
        return (
            self.metric == other.metric
            and self.higher_is_better == other.higher_is_better
            and self.max_regression <= other.max_regression
            and relative_kept
            and (self.min_significance or 0.0) >= (other.min_significance or 0.0)
        )

    @model_validator(mode="after")
    def _significance_needs_a_stderr(self) -> GateRule:
        if self.min_significance is not None and "/" not in self.metric:
            raise FieldError(
                ("min_significance",),
                f"metric {self.metric!r} has no standard error: min_significance applies to lm-eval metrics "
                "('<task>/<metric>', e.g. 'arc_easy/acc'), whose standard errors lm-eval reports; remove "
                "min_significance or use max_regression_relative",
            )
        return self


class EvaluateStage(StageBase):
    """Evaluate the candidate against the base model and the registered champion."""

    data: StageData | None = Field(
        None,
        description="Held-out text or chat data for perplexity: one dataset, or a list of datasets (every row of "
        "each is evaluated; no weights).",
    )
    lm_eval_tasks: list[str] = Field(
        default_factory=list, description="lm-eval-harness tasks (e.g. kobest_boolq, kmmlu, haerae)."
    )
    lm_eval_include_path: OneLine | None = Field(
        None,
        description="Directory of extra lm-eval task YAMLs (tasks over local data files, for offline clusters), or "
        "'builtin:korean-lm-eval' for the tasks prepare generates offline from the builtin corpus "
        "(ko_constitution_mc). Pipeline file only (task YAMLs can run Python); in the cluster it must lie on the "
        "datasets or checkpoints volume.",
    )
    limit: Int64 | None = Field(None, gt=0, description="Examples per lm-eval task (None: all).")
    prompts: list[str] = Field(default_factory=list, description="Prompts for the sampled-generation table.")
    max_new_tokens: Int64 = Field(128, gt=0, description="Tokens generated per prompt.")
    backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="What measures each model: 'transformers' loads it in the evaluate process (held-out loss from "
        "its logits, lm-eval through lm-eval's HFLM, generate()); 'vllm' starts vLLM's OpenAI-compatible server on "
        "it (the engine KServe serves with) and measures through the API: held-out loss from the prompt logprobs, "
        "lm-eval through its local-completions model, greedy completions. Same rows, prompts and tokenizer; "
        "within bf16 noise of each other (docs/stages.md). Needs vLLM's environment: the trainer image's, or "
        "`.venv-vllm` under --local (`make local`). Pipeline file only.",
    )
    cache_scores: bool = Field(
        True,
        description="Reuse the base model's and the champion's numbers that an earlier run of the pipeline measured "
        "on the same model (by content: files, config or hub commit) with the same held-out rows, tokenizer, "
        "lm-eval tasks, prompts, lengths, dtype and library versions; they are kept beside the run directories, "
        "in .scores/. A scheduled run then measures only the candidate. Off: every model is measured every run.",
    )
    gate: list[GateRule] = Field(
        default_factory=lambda: [GateRule(metric="perplexity", higher_is_better=False, max_regression=0.0)],
        description="Rules the candidate must pass to become champion; all must hold. Set in the pipeline file: "
        "the form may add rules, lower a rule's max_regression or max_regression_relative, or raise its "
        "min_significance (tighten the gate), never remove, relax or reverse one.",
    )

    @model_validator(mode="after")
    def _datasets(self) -> EvaluateStage:
        check_mixture(self.data, weighted=False)
        return self


class DeployStage(StageBase):
    """Register the model, move aliases, serve it."""

    registered_model: str | None = Field(
        None,
        min_length=1,
        description="MLflow registered model name, whose challenger and champion aliases deploy moves; None uses the "
        "pipeline name. Pipeline file only: the form cannot point a run at another model's aliases.",
    )
    storage_uri: OneLine | None = Field(
        None,
        description="Where the served model is published: 'gs://...', 's3://...' or 'pvc://claim/path' (a folder "
        "inside the claim, without '..'). None serves it from the checkpoints volume.",
    )
    serving: ServingSpec = Field(default_factory=ServingSpec, description="The InferenceService.")

    @field_validator("storage_uri")
    @classmethod
    def _storage_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if not re.match(r"^(gs|s3|pvc)://[^/]+", uri):
            raise ValueError("storage_uri must start with gs://, s3:// or pvc://")
        if uri.startswith("pvc://"):
            claim, _, path = uri[len("pvc://") :].partition("/")
            if len(claim) > 253 or not _DNS_SUBDOMAIN.match(claim):
                raise ValueError(f"storage_uri {uri!r} must name a PersistentVolumeClaim: pvc://CLAIM/PATH")
            segments = [s for s in path.split("/") if s]
            if not segments:
                raise ValueError(
                    f"storage_uri {uri!r} is the root of the claim: name a folder inside it, e.g. pvc://{claim}/models"
                )
            if ".." in segments:
                raise ValueError(f"storage_uri {uri!r} must stay inside its claim: no '..' in the path")
        return uri
