"""A whole pipeline: its stages, tracking, schedule, notifications, variants and the PipelineSpec itself."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spec import validation
from spec.cluster import ClusterSpec
from spec.data import DataSpec, datasets
from spec.fields import (
    STAGE_ORDER,
    TRAINING_STAGES,
    CronExpression,
    FieldError,
    Int32,
    Int64,
    Labels,
    OneLine,
    Seconds,
    StrictModel,
    _check,
    _dns_label,
    out_of_int64,
)
from spec.model import ModelSpec
from spec.model_shapes import AttentionShape, known_mixture, known_shape, tensor_parallel_problem
from spec.release import DeployStage, EvaluateStage
from spec.search import recorded_metrics, search_field_problem
from spec.stage import MAX_NODES, PrepareStage, StageBase
from spec.training import CptStage, RlhfStage, SftStage


class Stages(StrictModel):
    """The stages of the DAG, in order."""

    prepare: PrepareStage = Field(default_factory=PrepareStage, description="Resolve spec, validate data.")
    cpt: CptStage = Field(default_factory=lambda: CptStage(enabled=False), description="Continued pre-training.")
    sft: SftStage = Field(default_factory=lambda: SftStage(enabled=False), description="Supervised fine-tuning.")
    rlhf: RlhfStage = Field(default_factory=lambda: RlhfStage(enabled=False), description="Preference optimisation.")
    evaluate: EvaluateStage = Field(default_factory=EvaluateStage, description="Evaluation and gate.")
    deploy: DeployStage = Field(default_factory=DeployStage, description="Registry and serving.")

    def enabled(self) -> list[str]:
        """Names of the stages that run, in DAG order."""
        return [name for name in STAGE_ORDER if getattr(self, name).enabled]


class TrackingSpec(StrictModel):
    """Experiment tracking. Credentials come from cluster.secrets (or the environment locally)."""

    mlflow_tracking_uri: OneLine | None = Field(
        None,
        description="MLflow server URI; None: MLFLOW_TRACKING_URI, else a SQLite store beside the run directories "
        "(runs/mlflow.db), shared by the runs there.",
    )
    mlflow_experiment: str | None = Field(None, description="MLflow experiment; None uses the pipeline name.")
    wandb_project: str | None = Field(
        None, description="W&B project ($WANDB_PROJECT overrides it); None, and no $WANDB_PROJECT, turns W&B off."
    )
    wandb_entity: str | None = Field(None, description="W&B entity, team or user ($WANDB_ENTITY overrides it).")
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files into the run directory (tags train/..., eval/...)."
    )
    langfuse_host: str | None = Field(
        None,
        description="Langfuse server (e.g. https://langfuse.example.com): every stage's start, checkpoints, end and "
        "error become events of one trace per run, sent with the Langfuse SDK. Its keys come from "
        "cluster.secrets.langfuse_public_key and langfuse_secret_key (locally from LANGFUSE_PUBLIC_KEY and "
        "LANGFUSE_SECRET_KEY). None: $LANGFUSE_HOST when set, else no Langfuse.",
    )

    @field_validator("langfuse_host")
    @classmethod
    def _langfuse_host(cls, host: str | None) -> str | None:
        if host is None:
            return None
        if not re.match(r"^https?://[^/@\s]+(/\S*)?$", host):
            raise ValueError(
                f"langfuse_host {host!r} must be an http(s) URL without credentials, e.g. https://langfuse.example.com"
            )
        return host.rstrip("/")


class ScheduleSpec(StrictModel):
    """When the CronWorkflow starts the pipeline."""

    cron: list[CronExpression] = Field(
        default_factory=list, description="Cron expressions; empty means no CronWorkflow."
    )
    timezone: str = Field("UTC", description="IANA timezone the cron expressions are read in (e.g. Asia/Seoul).")
    concurrency_policy: Literal["Forbid", "Allow", "Replace"] = Field(
        "Forbid", description="What to do when a run is still going at the next tick."
    )
    starting_deadline_seconds: Seconds = Field(
        3600, ge=0, description="A tick missed by more than this (controller down) is not started late."
    )
    successful_history: Int32 = Field(5, ge=0, description="Succeeded workflows kept by the CronWorkflow.")
    failed_history: Int32 = Field(5, ge=0, description="Failed workflows kept by the CronWorkflow.")
    suspend: bool = Field(False, description="Register the CronWorkflow suspended.")

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, tz: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {tz!r} (use an IANA name such as 'Asia/Seoul')") from None
        return tz


class NotificationSpec(StrictModel):
    """Where the outcome of each run is posted."""

    slack: bool = Field(False, description="Post to the Slack webhook in cluster.secrets.slack_webhook.")
    on: list[Literal["Succeeded", "Failed", "Error"]] = Field(
        default_factory=lambda: ["Succeeded", "Failed", "Error"], description="Workflow outcomes that notify."
    )
    channel_note: str | None = Field(None, description="A line added to every message (e.g. who to ping).")


class WorkflowSpec(StrictModel):
    """How Argo keeps and bounds each run."""

    ttl_seconds_after_success: Int32 = Field(7 * 24 * 3600, ge=0, description="Keep a succeeded workflow this long.")
    ttl_seconds_after_failure: Int32 = Field(14 * 24 * 3600, ge=0, description="Keep a failed workflow this long.")
    pod_gc: Literal["OnPodCompletion", "OnPodSuccess", "OnWorkflowCompletion", "OnWorkflowSuccess"] = Field(
        "OnPodSuccess", description="When pods are deleted; failed pods stay for their logs by default."
    )
    active_deadline_seconds: Seconds | None = Field(
        None,
        gt=0,
        description="Backstop for the whole workflow (Argo stops it, and retries no step, past this); the steps' "
        "timeouts are the detectors. None: the enabled steps' worst case, each step (retries + 1) times its timeout "
        "plus the waits between its retries (training steps: run_policy.active_deadline_seconds plus an hour, plus "
        "the cleanup before a retry, the create step and the waits between the wait step's retries; serve: an hour), "
        "summed in DAG order, plus the exit handler's steps and an hour for scheduling.",
    )
    parallelism: Int64 | None = Field(
        None,
        ge=1,
        description="With variants: how many variants' stage chains run at once (Argo's `parallelism` of the entry "
        "DAG, which counts the pods it runs at a time; a chain runs one pod at a time, each training stage one job). "
        "None: all at once. The deadline then allows for the chains running in ceil(variants / parallelism) waves.",
    )
    labels: Labels = Field(default_factory=dict, description="Labels on every workflow of the pipeline.")


class RetentionSpec(StrictModel):
    """Which run directories (`<checkpoints>/runs/<run>`) a run deletes when it ends: a last step runs
    `python -m workflows.runs prune` for the pipeline. It never deletes a run without a final state, the run whose
    model is the registered champion or challenger, or one a serving revision uses."""

    keep_last: Int64 | None = Field(
        None, ge=1, description="Keep the newest this many runs of the pipeline; None (and no keep_days): never prune."
    )
    keep_days: float | None = Field(
        None, gt=0, description="Also keep every run younger than this many days; None: age keeps nothing."
    )

    @property
    def enabled(self) -> bool:
        """Whether the pipeline prunes at all."""
        return self.keep_last is not None or self.keep_days is not None


VARIANT_FIXED_SECTIONS = (
    "name",
    "cluster",
    "schedule",
    "workflow",
    "notifications",
    "retention",
    "profiles",
    "variants",
    "variant",
)


"""Top-level fields a variant may not override: one WorkflowTemplate holds every variant, so its pods' cluster,
schedule, workflow settings, notifications and retention are the pipeline's."""


RESERVED_VARIANT_NAMES = ("pipeline", "switches", "cleanup", "notify", "retention", "exit-handler")


"""Steps of the workflow that a variant's chain (a template named after the variant) would clash with."""


VARIANT_FIXED_FIELDS = (
    ("tracking", "mlflow_tracking_uri"),
    ("tracking", "mlflow_experiment"),
    ("tracking", "wandb_project"),
    ("tracking", "wandb_entity"),
    ("tracking", "langfuse_host"),
)


"""Tracking settings shared by the variants, so their runs sit side by side in one experiment (tagged with the
variant); a variant may turn its own TensorBoard files on or off (`tracking.tensorboard`)."""


class Variant(StrictModel):
    """One model of a pipeline that trains several: the pipeline's spec with its own overrides."""

    name: str = Field(
        description="A DNS label: the variant's runs, training jobs and InferenceService are named "
        "'<pipeline>-<variant>', which must fit the pipeline name's limit."
    )
    description: str = Field("", description="What this variant is, shown in the form's run-<variant> switch.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="A partial spec merged onto the pipeline's (after its profile): base model, resources, stage "
        "settings. Not the sections one template shares (name, cluster, schedule, workflow, notifications, "
        "retention) nor the tracking server and experiment.",
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The variant's own overlay per profile, merged last when that profile is applied (e.g. its "
        "tiny stand-in model under 'local').",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        _dns_label(name, "variant name")
        return name


def variant_fixed_problem(keys: tuple[str, ...]) -> str | None:
    """Why a variant may not override the field at `keys`, or None when it may."""
    if keys[:1] and keys[0] in VARIANT_FIXED_SECTIONS:
        return f"{keys[0]} is the pipeline's, shared by all its variants (one template holds them): set it at the top"
    for fixed in VARIANT_FIXED_FIELDS:
        if keys[: len(fixed)] == fixed or fixed[: len(keys)] == keys:
            return (
                f"{'.'.join(fixed)} is shared by all variants (their runs go to one experiment, tagged with the "
                "variant): set it at the top"
            )
    return None


# The PyTorchJob operator names each replica's Service '<job>-worker-<index>', a DNS-1035 label of at most 63
# characters. The longest job name comes from resubmitting a scheduled run: the CronWorkflow names its runs
# '<name>-<10-digit unix time>', a resubmission appends '-<5 random>', and the job '-<stage>-<5 random>'.
LONGEST_SERVICE_NAME = (
    f"<name>-<10 digits>-<5 random>-{max(TRAINING_STAGES, key=len)}-<5 random>-worker-<{MAX_NODES - 2}>"
)


MAX_PIPELINE_NAME_LENGTH = 63 - len(
    f"-{'9' * 10}-{'x' * 5}-{max(TRAINING_STAGES, key=len)}-{'x' * 5}-worker-{MAX_NODES - 2}"
)


"""The longest pipeline name whose worst-case Service name still fits."""


DESCRIPTION_ANNOTATION = "workflows.argoproj.io/description"


"""The annotation that carries the pipeline's description into the Argo UI."""


class PipelineSpec(StrictModel):
    """A post-training pipeline: base model + data → evaluated, registered, served model."""

    @model_validator(mode="before")
    @classmethod
    def _integers_fit_64_bits(cls, data: Any) -> Any:
        found = out_of_int64(data) if isinstance(data, dict) else None
        if found is not None:
            raise FieldError(
                found[0], f"{found[1]} does not fit in a 64-bit integer, the most the cluster and its tools read"
            )
        return data

    name: str = Field(
        description="Pipeline name: the WorkflowTemplate and CronWorkflow are named after it ('<name>-<profile>' "
        "with --profile), and so are the runs. A DNS label that "
        f"starts with a letter, at most {MAX_PIPELINE_NAME_LENGTH} characters (the training jobs' Service names "
        "are built from it)."
    )
    description: str = Field("", description="What this pipeline is for, shown in the Argo UI.")
    model: ModelSpec = Field(description="Base model.")
    data_version: OneLine = Field(
        "latest",
        description="Version label of the input data, recorded as lineage and substituted in data URIs.",
    )
    stages: Stages = Field(default_factory=Stages, description="Stages of the DAG.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Namespace, volumes, image, secrets.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow and W&B.")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Cron schedule.")
    notifications: NotificationSpec = Field(default_factory=NotificationSpec, description="Slack notifications.")
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec, description="Workflow retention and deadline.")
    retention: RetentionSpec = Field(
        default_factory=RetentionSpec, description="Which old run directories each run deletes at its end."
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Named overlays merged onto this spec by --profile (the 'local' profile is used by --local). "
        "A profile's WorkflowTemplate and CronWorkflow are named '<name>-<profile>', so a profile name that is "
        "registered or submitted holds lowercase letters, digits and '-'. A profile never replaces a data URI that "
        "the pipeline file (outside profiles) sets: its stages.<stage>.data section is left out for that stage, "
        "unless the profile says `replaces_data: true` (the shipped 'local' profiles do, to run offline on "
        "builtin: data); a --set URI always wins. A profile's max_steps, like any max_steps, overrides epochs "
        "(the local runner warns).",
    )
    variants: list[Variant] = Field(
        default_factory=list,
        description="Several models from one submission: each variant is this spec with its own overrides, run as "
        "its own stage chain (run directory, MLflow parent run, gate against its own champion, registered model "
        "'<registered_model>-<variant>' unless it sets one, InferenceService), in parallel in the cluster "
        "(workflow.parallelism) and one after the other with --local. Empty: one model.",
    )
    variant: str | None = Field(
        None,
        description="Set by the compiler in a variant's resolved spec: the variant it is (tagged on its MLflow "
        "runs). Not written in pipeline files.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if len(name) > MAX_PIPELINE_NAME_LENGTH:
            raise ValueError(
                f"pipeline name must be at most {MAX_PIPELINE_NAME_LENGTH} characters, got {len(name)}: a training "
                f"stage's Services are named {LONGEST_SERVICE_NAME!r} and must fit a 63-character DNS label"
            )
        _dns_label(name, "pipeline name")
        if not name[0].isalpha():
            raise ValueError(f"pipeline name must start with a letter, as the Service names it begins do: {name!r}")
        return name

    @field_validator("description")
    @classmethod
    def _description(cls, description: str) -> str:
        problem = validation.annotations({DESCRIPTION_ANNOTATION: description})
        _check(problem, "too long for the workflow's annotation: ")
        return description

    @field_validator("data_version")
    @classmethod
    def _data_version(cls, version: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", version):
            raise ValueError("data_version may hold letters, digits, '.', '_' and '-' (at most 63)")
        return version

    @model_validator(mode="after")
    def _coherent(self) -> PipelineSpec:
        if self.notifications.slack and self.cluster.secrets.slack_webhook is None:
            raise ValueError("notifications.slack needs cluster.secrets.slack_webhook")
        self._langfuse_keys()
        if self.stages.deploy.enabled and not self.stages.evaluate.enabled:
            raise ValueError("stages.deploy needs stages.evaluate: only a model that passed the gate is deployed")
        trained = [s for s in TRAINING_STAGES if getattr(self.stages, s).enabled]
        if self.stages.evaluate.enabled and not trained:
            raise ValueError("stages.evaluate needs at least one training stage (cpt, sft or rlhf) to evaluate")
        for stage in ("prepare", "evaluate", "deploy"):
            if self.stage(stage).resources.rdma is not None:
                raise FieldError(
                    ("stages", stage, "resources", "rdma"),
                    f"RDMA devices are for the training stages' NCCL between nodes; {stage} runs in one pod",
                )
        for stage in TRAINING_STAGES:
            self._rdma_env_agrees(stage)
            self._trainjob_can_say(stage)
            self._search_space(stage)
            self._adapter_trl_can_train(stage)
        self._serving_fits_model()
        self._tensor_parallel_fits_model()
        self._pipeline_parallel_fits_model()
        self._serving_context_fits_model()
        self._variants_fit()
        return self

    def _variants_fit(self) -> None:
        """Variant names are distinct and short enough, and their overrides leave the shared sections alone."""
        if self.variants and self.variant is not None:
            raise FieldError(("variant",), "a variant's resolved spec has no variants of its own")
        searched = [s for s in TRAINING_STAGES if self.variants and getattr(self.stage(s), "hpo", None) is not None]
        if searched:  # a search's Experiment and trials are one run's: not yet one per variant
            raise FieldError(("stages", searched[0], "hpo"), "a hyperparameter search cannot be combined with variants")
        seen: set[str] = set()
        for index, variant in enumerate(self.variants):
            at = ("variants", index)
            if variant.name in seen:
                raise FieldError((*at, "name"), f"variant {variant.name!r} is named twice; each name is unique")
            if variant.name in STAGE_ORDER:  # the form's run-<variant> would be the stages' run-<stage>
                raise FieldError((*at, "name"), f"a variant cannot be named after the stage {variant.name!r}")
            if variant.name in RESERVED_VARIANT_NAMES:
                raise FieldError((*at, "name"), f"{variant.name!r} names a step of the workflow; pick another name")
            seen.add(variant.name)
            combined = f"{self.name}-{variant.name}"
            if len(combined) > MAX_PIPELINE_NAME_LENGTH:
                raise FieldError(
                    (*at, "name"),
                    f"the variant's runs, jobs and InferenceService are named {combined!r} ({len(combined)} "
                    f"characters), over the {MAX_PIPELINE_NAME_LENGTH} a pipeline name may have: shorten the "
                    "variant or pipeline name",
                )
            for stage, section in (variant.overrides.get("stages") or {}).items():
                if isinstance(section, dict) and "hpo" in section:
                    raise FieldError(
                        (*at, "overrides", "stages", stage, "hpo"),
                        "a hyperparameter search cannot be combined with variants",
                    )
            overlays = [((*at, "overrides"), variant.overrides)]
            overlays += [((*at, "profiles", name), overlay) for name, overlay in variant.profiles.items()]
            for where, overlay in overlays:
                for key, value in overlay.items():
                    # A mapping merges key by key (its keys are what it sets); anything else replaces the field.
                    paths = [(key, sub) for sub in value] if isinstance(value, dict) else [(key,)]
                    if key in VARIANT_FIXED_SECTIONS:
                        paths = [(key,)]
                    for path in paths:
                        if (problem := variant_fixed_problem(path)) is not None:
                            raise FieldError((*where, *path), problem)

    def _langfuse_keys(self) -> None:
        """Langfuse needs both keys in the cluster, and keys are only given to a named server."""
        secrets = self.cluster.secrets
        keys = {"langfuse_public_key": secrets.langfuse_public_key, "langfuse_secret_key": secrets.langfuse_secret_key}
        missing = [name for name, ref in keys.items() if ref is None]
        if self.tracking.langfuse_host is not None and missing:
            raise FieldError(
                ("cluster", "secrets", missing[0]),
                f"tracking.langfuse_host needs cluster.secrets.{missing[0]} (a Secret key): the pods get the Langfuse "
                "keys only from a Secret",
            )
        if self.tracking.langfuse_host is None and len(missing) < len(keys):
            given = next(name for name, ref in keys.items() if ref is not None)
            raise FieldError(
                ("tracking", "langfuse_host"),
                f"cluster.secrets.{given} is set but tracking.langfuse_host is not: name the Langfuse server the keys "
                "are for",
            )

    def _adapter_trl_can_train(self, stage: str) -> None:
        """No adapter on the LM head where TRL trains it: SFT and DPO compute log-probabilities from
        `lm_head.weight` directly and refuse such an adapter when they start; cpt's adapter counts when a later
        sft or rlhf continues it (cpt without merge_after)."""
        section = self.stage(stage)
        modules = section.lora.target_modules if section.enabled and section.method != "full" else "all-linear"
        if isinstance(modules, str) or not any(m == "lm_head" or m.endswith(".lm_head") for m in modules):
            return
        later = [s for s in ("sft", "rlhf") if s != stage and getattr(self.stages, s).enabled]
        if stage == "cpt" and (section.lora.merge_after or not later):
            return
        why = (
            f"{stage} trains with TRL" if stage != "cpt" else f"{later[0]} continues cpt's adapter with TRL"
        ) + ", which computes log-probabilities from lm_head.weight directly and refuses an adapter on lm_head"
        fix = "remove 'lm_head'" + (" or set stages.cpt.lora.merge_after: true" if stage == "cpt" else "")
        raise FieldError(("stages", stage, "lora", "target_modules"), f"{why}: {fix}")

    def _search_space(self, stage: str) -> None:
        """A search varies fields the stage has, with values the stage accepts, towards a metric it records."""
        section = self.stage(stage)
        hpo = getattr(section, "hpo", None)
        if hpo is None or not section.enabled:
            return
        at = ("stages", stage, "hpo")
        for index, parameter in enumerate(hpo.parameters):
            where = (*at, "parameters", index)
            problem = search_field_problem(type(section), parameter)
            if problem is not None:
                raise FieldError((*where, "path"), problem)
            document = section.model_dump(mode="json")
            for value in parameter.candidates():
                target = document
                for key in parameter.keys[:-1]:
                    target = target[key]
                target[parameter.keys[-1]] = value
                try:
                    type(section).model_validate(document)
                except ValueError as exc:
                    first = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
                    raise FieldError(
                        (*where, "values" if parameter.type == "categorical" else "min"),
                        f"stages.{stage}.{parameter.path} cannot be {value!r}: {first}",
                    ) from None
        recorded = recorded_metrics(stage, getattr(section, "algorithm", None))
        metric = hpo.objective.metric
        if metric not in recorded:
            raise FieldError(
                (*at, "objective", "metric"),
                f"stage {stage} does not record {metric!r}; it records {', '.join(recorded)}",
            )
        held_out = metric.startswith("eval_") or metric == "perplexity"
        if held_out and section.data is not None and not any(d.eval_fraction > 0 for d in datasets(section.data)):
            raise FieldError(
                (*at, "objective", "metric"),
                f"{metric} is measured on held-out rows and stages.{stage}.data.eval_fraction is 0: hold rows out "
                "(data.eval_fraction: 0.05) or optimise a training metric",
            )
        if self.cluster.job_kind == "trainjob":
            raise FieldError(at, "Katib runs the trials as PyTorchJobs: a search needs cluster.job_kind pytorchjob")

    def _trainjob_can_say(self, stage: str) -> None:
        """What a Trainer v2.1 TrainJob cannot set per job is refused, not dropped: it belongs in the runtime."""
        section = self.stage(stage)
        if self.cluster.job_kind != "trainjob" or not section.enabled:
            return
        runtime = f"the ClusterTrainingRuntime {self.cluster.training_runtime}"
        if section.resources.rdma is not None:
            raise FieldError(
                ("stages", stage, "resources", "rdma"),
                f"a TrainJob cannot add the IPC_LOCK capability RDMA needs: give {runtime} the RDMA devices and "
                "IPC_LOCK, or use cluster.job_kind pytorchjob",
            )
        if section.resources.priority_class is not None:
            raise FieldError(
                ("stages", stage, "resources", "priority_class"),
                f"a TrainJob cannot set a PriorityClass: set priorityClassName in {runtime}, or use cluster.job_kind "
                "pytorchjob",
            )

    def _rdma_env_agrees(self, stage: str) -> None:
        """An NCCL setting named both in resources.rdma and in an env section must say the same in both."""
        section = self.stage(stage)
        rdma = section.resources.rdma
        if rdma is None:
            return
        for field, var in (("nccl_ib_hca", "NCCL_IB_HCA"), ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME")):
            value = getattr(rdma, field)
            for where, env in ((f"stages.{stage}.env", section.env), ("cluster.env", self.cluster.env)):
                if value is not None and var in env and env[var] != value:
                    raise FieldError(
                        ("stages", stage, "resources", "rdma", field),
                        f"{where} sets {var}={env[var]} and resources.rdma.{field} says {value}: set it in one place",
                    )

    def _attention_shape(self) -> AttentionShape | None:
        """The model's heads and key/value heads where the spec knows them (model.from_config, or a well-known hub
        model), for the checks that must hold before any weights are downloaded."""
        config = self.model.from_config
        return config.attention() if config is not None else known_shape(self.model.name_or_path)

    def _serving_fits_model(self) -> None:
        """vLLM splits the model over serving.gpus GPUs (tensor parallelism): they must divide its heads."""
        serving = self.stages.deploy.serving
        if not (self.stages.deploy.enabled and serving.enabled and serving.gpus > 1):
            return
        shape = self._attention_shape()
        if shape is None or (problem := tensor_parallel_problem(shape, serving.gpus)) is None:
            return
        fits = [n for n in range(1, 17) if tensor_parallel_problem(shape, n) is None]
        raise FieldError(
            ("stages", "deploy", "serving", "gpus"),
            f"vLLM cannot split {self.model.name_or_path} over {serving.gpus} GPUs: {problem}; use one of "
            f"{', '.join(map(str, fits))}",
        )

    def _tensor_parallel_fits_model(self) -> None:
        """A training stage's tensor_parallel splits attention by heads: it must divide both the model's query heads
        and its key/value heads (transformers' plan splits the key/value projections too, without replicating)."""
        shape = self._attention_shape()
        for name in TRAINING_STAGES:
            section = self.stage(name)
            tp = section.distributed.tensor_parallel
            if not section.enabled or tp == 1:
                continue
            lora = getattr(section, "lora", None)
            if section.method == "lora" and lora is not None and lora.target_experts and self._mixture():
                raise FieldError(
                    ("stages", name, "lora", "target_experts"),
                    f"puts adapters on {self.model.name_or_path}'s experts, which distributed.tensor_parallel {tp} "
                    "cannot split with them: set it to false (adapters on attention), or tensor_parallel to 1 "
                    "(expert_parallel alone splits the experts and trains their adapters)",
                )
            if self._mixture() and section.distributed.expert_parallel == 1:
                raise FieldError(
                    ("stages", name, "distributed", "tensor_parallel"),
                    f"is {tp}, which would split {self.model.name_or_path}'s experts too, and a checkpoint of them "
                    f"fails (their split halves overlap in torch's checkpoint): set distributed.expert_parallel to "
                    f"{tp} or a multiple of it (the experts then spread whole), or tensor_parallel to 1",
                )
            if shape is not None and (shape.heads % tp or shape.kv_heads % tp):
                fits = [n for n in range(1, 17) if shape.heads % n == 0 and shape.kv_heads % n == 0]
                raise FieldError(
                    ("stages", name, "distributed", "tensor_parallel"),
                    f"{tp} does not divide {self.model.name_or_path}'s {shape.heads} attention heads and "
                    f"{shape.kv_heads} key/value heads; use one of {', '.join(map(str, fits))}",
                )

    def _mixture(self) -> bool:
        """Whether the model is a mixture of experts, where the spec knows (model.from_config, or a well-known hub
        model)."""
        config = self.model.from_config
        return config.num_experts is not None if config is not None else known_mixture(self.model.name_or_path)

    def _pipeline_parallel_fits_model(self) -> None:
        """A mixture of experts the spec knows (model.from_config, or a well-known hub model) is cut into pipeline
        stages only with its router balance loss off: the loss is taken over every layer's routers at once."""
        mixture = self._mixture()
        for name in TRAINING_STAGES:
            section = self.stage(name)
            pp = section.distributed.pipeline_parallel
            if not mixture or not section.enabled or pp == 1 or section.training.router_aux_loss_coef == 0:
                continue
            coef = section.training.router_aux_loss_coef
            current = "unset (the model config's)" if coef is None else str(coef)
            raise FieldError(
                ("stages", name, "training", "router_aux_loss_coef"),
                f"is {current}; with distributed.pipeline_parallel {pp}, {self.model.name_or_path} (a mixture of "
                "experts) trains with its router balance loss off, as that loss is taken over every layer's routers "
                "at once and no stage holds them all: set it to 0, or pipeline_parallel to 1",
            )

    def _serving_context_fits_model(self) -> None:
        """vLLM refuses a --max-model-len above the model's max_position_embeddings (its positions end there)."""
        serving, config = self.stages.deploy.serving, self.model.from_config
        if not (self.stages.deploy.enabled and serving.enabled) or config is None or serving.max_model_len is None:
            return
        if serving.max_model_len > config.max_position_embeddings:
            raise FieldError(
                ("stages", "deploy", "serving", "max_model_len"),
                f"{serving.max_model_len} is above model.from_config.max_position_embeddings "
                f"({config.max_position_embeddings}): vLLM refuses to serve a context longer than the model's "
                "positions; set it to at most that, or null for the model's own",
            )

    def data_uri(self, data: DataSpec) -> str:
        """The data URI with '{data_version}' replaced."""
        return data.uri.replace("{data_version}", self.data_version)

    def stage(self, name: str) -> StageBase:
        """The stage called `name`."""
        return getattr(self.stages, name)
