"""The cluster a pipeline runs on: namespace, images, volumes, secrets and the settings every pod shares."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from spec.fields import ImageReference, Int64, KubernetesName, OneLine, StrictModel, _dns_label
from spec.stage import StageBase


class SecretRef(StrictModel):
    """A key of a Kubernetes Secret; the value is only ever read by the pod, through secretKeyRef."""

    name: str = Field(description="Secret name.")
    key: str = Field(description="Key inside the Secret.")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name) or len(name) > 253:
            raise ValueError(f"secret name {name!r} is not a valid Kubernetes name")
        return name


class Secrets(StrictModel):
    """Secrets the pods read. Names only: values never appear in the spec, parameters or logs."""

    hf_token: SecretRef | None = Field(None, description="Hugging Face token (HF_TOKEN), for gated models.")
    wandb_api_key: SecretRef | None = Field(None, description="W&B API key (WANDB_API_KEY).")
    mlflow_username: SecretRef | None = Field(None, description="MLflow basic-auth user (MLFLOW_TRACKING_USERNAME).")
    mlflow_password: SecretRef | None = Field(None, description="MLflow basic-auth password.")
    mlflow_token: SecretRef | None = Field(None, description="MLflow bearer token (MLFLOW_TRACKING_TOKEN).")
    slack_webhook: SecretRef | None = Field(None, description="Slack incoming-webhook URL for notifications.")
    langfuse_public_key: SecretRef | None = Field(None, description="Langfuse public key (LANGFUSE_PUBLIC_KEY).")
    langfuse_secret_key: SecretRef | None = Field(None, description="Langfuse secret key (LANGFUSE_SECRET_KEY).")
    aws_access_key_id: SecretRef | None = Field(None, description="S3 access key id (AWS_ACCESS_KEY_ID).")
    aws_secret_access_key: SecretRef | None = Field(None, description="S3 secret key (AWS_SECRET_ACCESS_KEY).")
    aws_endpoint_url: SecretRef | None = Field(
        None,
        description="Endpoint of an S3-compatible store such as MinIO or Ceph RGW (AWS_ENDPOINT_URL), kept in the "
        "Secret beside its keys; boto3 addresses it path-style. Unset: AWS S3 (or cluster.env AWS_ENDPOINT_URL).",
    )

    def env(self) -> dict[str, SecretRef]:
        """Environment variable name → secret reference, for the secrets that are set."""
        names = {
            "hf_token": "HF_TOKEN",
            "wandb_api_key": "WANDB_API_KEY",
            "mlflow_username": "MLFLOW_TRACKING_USERNAME",
            "mlflow_password": "MLFLOW_TRACKING_PASSWORD",
            "mlflow_token": "MLFLOW_TRACKING_TOKEN",
            "langfuse_public_key": "LANGFUSE_PUBLIC_KEY",
            "langfuse_secret_key": "LANGFUSE_SECRET_KEY",
            "aws_access_key_id": "AWS_ACCESS_KEY_ID",
            "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
            "aws_endpoint_url": "AWS_ENDPOINT_URL",
        }
        return {env: ref for field, env in names.items() if (ref := getattr(self, field)) is not None}


class VolumeSpec(StrictModel):
    """A ReadWriteMany PersistentVolumeClaim every pod mounts."""

    claim_name: str = Field(description="PVC name.")
    mount_path: OneLine = Field(description="Where it is mounted in every pod.")
    read_only: bool = Field(False, description="Mount read-only.")

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"mount_path must be an absolute path without '..', got {path!r}")
        return path.rstrip("/") or "/"


class ClusterSpec(StrictModel):
    """Where and as whom the pipeline runs."""

    namespace: str = Field("posttrain", description="Namespace of the workflows and jobs.")
    service_account: str = Field(
        "posttrain-workflow",
        description="ServiceAccount of the steps that create the training jobs and apply the InferenceService (Argo "
        "resource templates), the only pods that hold a Kubernetes API token (the kit's posttrain-workflow Role).",
    )
    pod_service_account: str = Field(
        "posttrain-runner",
        description="ServiceAccount of every pod that runs stage code (prepare, the training jobs' pods, evaluate, "
        "deploy, the notification): no Kubernetes API token is mounted in them (automountServiceAccountToken: "
        "false) and the account has no Role. Bind cloud identity for buckets (GKE Workload Identity, EKS IRSA) to it.",
    )
    executor_service_account: str = Field(
        "posttrain-executor",
        description="ServiceAccount whose token Argo mounts into its own init and wait containers of those pods, "
        "never into the stage's container, to report the step's outputs (workflowtaskresults create/patch only). "
        "Argo reads the token from the Secret '<name>.service-account-token', which the kit creates.",
    )
    executor_security_context: bool = Field(
        True,
        description="Give Argo's init and wait containers of those pods the restricted securityContext (no "
        "privilege escalation, all capabilities dropped, read-only root filesystem) through the templates' "
        "podSpecPatch, so the pods pass Pod Security `restricted` whatever the controller's executor settings. Turn "
        "off only with the controller's init-less pod layout (initlessPod, beta), which has no containers by those "
        "names; then set the controller's executor.securityContext instead (manifests/README.md).",
    )
    image: ImageReference = Field(
        "ghcr.io/posttrain/trainer:0.1.0", description="Trainer image (stages and control steps run in it)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    image_pull_secrets: list[KubernetesName] = Field(default_factory=list, description="Secrets for pulling the image.")
    datasets: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(claim_name="posttrain-datasets", mount_path="/mnt/datasets", read_only=True),
        description="Volume with the input data.",
    )
    checkpoints: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(claim_name="posttrain-checkpoints", mount_path="/mnt/checkpoints"),
        description="Volume with run directories (resolved spec, checkpoints, models).",
    )
    secrets: Secrets = Field(default_factory=Secrets, description="Secret references.")
    env: dict[str, str] = Field(
        default_factory=lambda: {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        description="Environment for every training pod (NCCL settings and the like; never secrets).",
    )
    argo_ui_url: str | None = Field(
        None,
        description="Base URL of the Argo UI, for links in notifications (e.g. https://argo.example.com).",
    )
    grafana_url: str | None = Field(
        None,
        description="Base URL of Grafana, for a link in notifications to the run's dashboard "
        "(`<grafana_url>/d/posttrain-run?var-run=<workflow>`, the dashboard of manifests/components/monitoring), "
        "e.g. https://grafana.example.com. None: no link.",
    )
    run_as_user: Int64 | None = Field(1000, ge=0, description="UID the pods run as (None: the image's user).")
    metrics_port: Int64 | None = Field(
        9200,
        ge=1024,
        le=65535,
        description="Port on which a training stage serves its Prometheus metrics (step, loss, tokens/s, MFU, ETA, "
        "GPU memory, deadline) from rank 0: the Master pod's container port named `metrics`, which "
        "manifests/components/monitoring's PodMonitor scrapes. None: no metrics server. Not 9400 (the DCGM "
        "exporter's) nor 9090 (Prometheus'); a port already taken only costs the metrics, never the stage.",
    )
    job_kind: Literal["pytorchjob", "trainjob"] = Field(
        "pytorchjob",
        description="What a training stage creates: `pytorchjob`, a Kubeflow Training Operator v1 PyTorchJob "
        "(kubeflow.org/v1); or `trainjob`, a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, on "
        "JobSet) that runs on the ClusterTrainingRuntime `training_runtime` (manifests/components/trainer-v2).",
    )
    training_runtime: str = Field(
        "posttrain-torch",
        description="With job_kind `trainjob`: the ClusterTrainingRuntime the TrainJobs run on. It holds what a "
        "TrainJob cannot set (security contexts, /dev/shm, the grace period, the JobSet's restart policy); its "
        "first replicated job must be `node` with a torch ML policy (preflight checks).",
    )

    @field_validator(
        "namespace", "service_account", "pod_service_account", "executor_service_account", "training_runtime"
    )
    @classmethod
    def _names(cls, value: str) -> str:
        return _dns_label(value, "name")

    @field_validator("run_as_user")
    @classmethod
    def _non_root(cls, uid: int | None) -> int | None:
        if uid == 0:
            raise ValueError("pods run as non-root (runAsNonRoot): use a non-zero UID, or null for the image's user")
        return uid

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return StageBase._env_names(env)

    @field_validator("grafana_url")
    @classmethod
    def _grafana_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not re.match(r"^https?://[^/@\s]+(/\S*)?$", url):
            raise ValueError(
                f"grafana_url {url!r} must be an http(s) URL without credentials, e.g. https://grafana.example.com"
            )
        return url.rstrip("/")
