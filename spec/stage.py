"""What every stage section has: its switch, its pods' resources, placement, run policy and environment."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spec import validation
from spec.credentials import looks_secret_name
from spec.fields import (
    _ENV_NAME,
    Annotations,
    ImageReference,
    Int32,
    Int64,
    KubernetesName,
    Labels,
    Quantity,
    Seconds,
    StrictModel,
    _check,
)


class Toleration(StrictModel):
    """A Kubernetes toleration."""

    key: str | None = Field(None, description="Taint key; None with operator Exists matches every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal or Exists.")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; None tolerates all effects."
    )
    toleration_seconds: Int64 | None = Field(
        None, alias="tolerationSeconds", description="For NoExecute: how long the pod stays bound."
    )

    @model_validator(mode="after")
    def _coherent(self) -> Toleration:
        # The API server's rules for a Toleration (k8s.io/kubernetes validation).
        if self.key is not None:
            _check(validation.qualified_name(self.key), "toleration ")
        elif self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists (it then tolerates every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"a toleration with operator Exists takes no value, got {self.value!r}")
        if self.value:
            _check(validation.label_value(self.value), "toleration ")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds only applies to effect NoExecute")
        return self

    def to_k8s(self) -> dict[str, Any]:
        """This toleration as a core/v1 Toleration object."""
        return self.model_dump(by_alias=True, exclude_none=True)


MAX_NODES = 512


"""The most pods one training stage may have."""


class RdmaSpec(StrictModel):
    """RDMA network devices (InfiniBand or RoCE) for NCCL between a training stage's nodes; without them NCCL
    runs over TCP sockets. Needs the cluster's RDMA device plugin, and a namespace whose Pod Security admits the
    IPC_LOCK capability that RDMA needs to pin memory (`privileged`: neither `restricted` nor `baseline` allows
    it; README, "Fast networking")."""

    resource: str = Field(
        description="The device plugin's extended resource, e.g. 'rdma/rdma_shared_device_a' (the RDMA shared "
        "device plugin) or 'nvidia.com/hostdev' (the NVIDIA Network Operator's SR-IOV devices)."
    )
    count: Int64 = Field(1, ge=1, le=16, description="Devices per pod (a limit of that resource).")
    nccl_ib_hca: str | None = Field(
        None,
        description="NCCL_IB_HCA: the adapters NCCL uses, e.g. 'mlx5' or '=mlx5_0,mlx5_1'; None lets NCCL choose.",
    )
    nccl_socket_ifname: str | None = Field(
        None,
        description="NCCL_SOCKET_IFNAME: the interface of NCCL's bootstrap, e.g. 'eth0'; None lets NCCL choose.",
    )

    @field_validator("resource")
    @classmethod
    def _extended_resource(cls, name: str) -> str:
        _check(validation.qualified_name(name), "rdma.resource: ")
        prefix = name.rpartition("/")[0]
        if not prefix or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io") or name == "nvidia.com/gpu":
            raise ValueError(
                f"rdma.resource {name!r} is not a device plugin's resource: it is 'domain/name', e.g. "
                "'rdma/rdma_shared_device_a' or 'nvidia.com/hostdev' (GPUs are gpus_per_node)"
            )
        return name


class Resources(StrictModel):
    """What one stage's pods ask the cluster for."""

    nodes: Int64 = Field(1, ge=1, le=MAX_NODES, description="Nodes (pods) in the job: one Master plus nodes-1 Workers.")
    gpus_per_node: Int64 = Field(0, ge=0, le=16, description="GPUs per pod (nvidia.com/gpu); also torchrun's nproc.")
    rdma: RdmaSpec | None = Field(
        None,
        description="Training stages: RDMA devices per pod for NCCL between nodes (InfiniBand or RoCE), the "
        "IPC_LOCK capability they need, and NCCL's IB settings. None: NCCL over TCP.",
    )
    cpu: Quantity | None = Field(
        None,
        description="CPU request and limit per pod. None: derived from the stage (training: 8 per GPU, evaluate "
        "and deploy: 4 per GPU, at least 4; prepare: 4).",
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit per pod, /dev/shm included. None: derived from the model's size "
        "(its weights in model.dtype: once per GPU plus 16Gi for training, under FSDP over several processes twice "
        "for full training and once for LoRA, since rank 0 alone loads them; plus offloaded optimizer state with "
        "distributed.cpu_offload; 1.5 times plus 8Gi for evaluate; 2.5 times plus 8Gi for deploy, which merges an "
        "adapter and loads the result again; 16Gi for prepare) and shm_size.",
    )
    shm_size: Quantity | None = Field(
        "16Gi",
        description="Size of the memory-backed /dev/shm (NCCL and dataloader workers need it); None: none.",
    )
    ephemeral_storage: Quantity | None = Field(
        None,
        description="Ephemeral storage (the pod's /tmp and caches) request and limit per pod. None: none, except "
        "deploy, whose model MLflow stages in /tmp: the weights plus 10Gi.",
    )
    node_selector: Labels = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: dict[str, Any] | None = Field(
        None, description="A core/v1 Affinity object, as in a pod spec (nodeAffinity, podAntiAffinity...)."
    )
    image: ImageReference | None = Field(None, description="Image for this stage; None uses cluster.image.")
    priority_class: KubernetesName | None = Field(None, description="PriorityClass name for the pods.")
    queue: str | None = Field(
        None,
        description="Kueue LocalQueue name (label kueue.x-k8s.io/queue-name) and the job's scheduling queue.",
    )
    annotations: Annotations = Field(default_factory=dict, description="Extra pod annotations.")
    labels: Labels = Field(default_factory=dict, description="Extra pod labels.")

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
        if affinity is not None:
            _check(validation.kubernetes_object(affinity, "V1Affinity"))
        return affinity

    @field_validator("queue")
    @classmethod
    def _queue(cls, name: str | None) -> str | None:
        if name is not None:  # a LocalQueue name, also written as a label value
            _check(validation.dns_subdomain(name) or validation.label_value(name), "queue: ")
        return name


class StepPolicy(StrictModel):
    """The Argo step around a single-pod stage (prepare, evaluate, deploy): its timeout, retries and grace period."""

    active_deadline_seconds: Seconds = Field(
        24 * 3600,
        gt=0,
        description="The step's timeout: the pod is stopped after running this long (SIGTERM, then SIGKILL after "
        "the grace period; time spent waiting to be scheduled does not count), and the attempt is retried like an "
        "interrupted one. Default 24 hours.",
    )
    retries: Int64 = Field(
        2,
        ge=0,
        le=20,
        description="Argo retries of the step, only after a failure a retry can fix: the pod was deleted, evicted "
        "or lost with its node (Argo status Error), or the stage was interrupted (exit 75: SIGTERM, or another "
        "process still held the stage) or killed (exit 137 or 143, not OOMKilled). A failed stage (exit 1) or bad "
        "input (exit 2) is never retried.",
    )
    retry_backoff: str = Field(
        "30s",
        description="Wait before the first retry, in seconds or as a Go duration ('90s', '2m', '1h30m'); it doubles "
        "with each retry, each wait at most 1h.",
    )
    termination_grace_period_seconds: Seconds = Field(
        120,
        ge=30,
        description="Time a stopped pod (preempted, or past its timeout) gets between SIGTERM and SIGKILL to "
        "record itself as interrupted.",
    )

    @field_validator("retry_backoff", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `retry_backoff: 120` in YAML means seconds, as Argo reads it
        # What Argo accepts for a retry backoff: whole seconds, or a Go duration such as '90s', '2m', '1h30m'.
        if isinstance(value, str) and not (value.isdigit() or validation.go_duration_seconds(value) is not None):
            raise ValueError(
                f"retry_backoff must be whole seconds or a Go duration such as '90s', '2m' or '1h30m', got {value!r}"
            )
        return value


class RunPolicy(StepPolicy):
    """The PyTorchJob's runPolicy, and the Argo retry around it."""

    active_deadline_seconds: Seconds = Field(
        7 * 24 * 3600,
        gt=0,
        description="Fail the job after this long (the operator marks it Failed). The step's timeout is this plus "
        "an hour, so even a job that never starts (stuck at Created) ends; default 7 days.",
    )
    ttl_seconds_after_finished: Int32 | None = Field(
        7 * 24 * 3600, ge=0, description="Delete the finished PyTorchJob after this long."
    )
    backoff_limit: Int32 | None = Field(0, ge=0, description="Pod restarts the operator allows before failing the job.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "Running",
        description="Which pods the operator deletes when the job ends. Running (default) deletes the pods still "
        "running, e.g. Workers left waiting on a failed Master, which would otherwise hold their GPUs until the job "
        "is deleted; finished pods stay for their logs. None keeps every pod, All deletes every pod.",
    )
    retries: Int64 = Field(
        2, ge=0, le=20, description="Argo retries of the stage; each creates a fresh PyTorchJob that resumes."
    )
    retry_backoff: str = Field(
        "2m",
        description="Wait before the first retry, in seconds or as a Go duration ('90s', '2m', '1h30m'); it doubles "
        "with each retry, each wait at most 1h. Retries are limited in number, and by the workflow's deadline, not "
        "by the time since the first attempt: a stage that fails after days is still retried.",
    )
    termination_grace_period_seconds: Seconds = Field(
        300,
        ge=30,
        description="Time a preempted pod gets between SIGTERM and SIGKILL: it must cover one training step "
        "plus writing a checkpoint.",
    )


class StageBase(StrictModel):
    """Fields every stage has."""

    enabled: bool = Field(True, description="Run this stage; a disabled stage drops out and the DAG closes up.")
    resources: Resources = Field(default_factory=Resources, description="Pods, GPUs and scheduling.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables (never secrets: use cluster.secrets)."
    )
    run_policy: StepPolicy = Field(
        default_factory=StepPolicy, description="The step's timeout, retries and grace period in the cluster."
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
            # Any casing, word by word (AWS_ACCESS_KEY_ID, wandb_key); a path names a mounted file, not a secret.
            if looks_secret_name(name) and not value.startswith("/"):
                raise ValueError(
                    f"{name} looks like a secret: its value would be in the template, readable by anyone who may "
                    "submit; reference a Kubernetes Secret through cluster.secrets instead"
                )
        return env


class PrepareStage(StageBase):
    """Resolve the spec, validate data, tokenize: a plain container step."""

    enabled: Literal[True] = Field(True, description="prepare always runs.")
    skip_if_unchanged: bool = Field(
        False,
        description="End the run early, as skipped, when nothing that decides its result changed since the last "
        "completed run: each stage's data (by content), the model, each stage's configuration (not resources, "
        "run_policy, env or data URIs) and the project version. Otherwise prepare says what changed.",
    )
    num_proc: Int64 | None = Field(
        None,
        gt=0,
        le=256,
        description="Worker processes that parse, clean and tokenize the data. Default: the prepare pod's CPU "
        "request (resources.cpu, rounded down) in the cluster, the machine's usable CPUs locally.",
    )
