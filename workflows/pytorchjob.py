"""The Kubeflow PyTorchJob (kubeflow.org/v1) a training stage creates, and the Argo conditions that watch it.

The default of workflows/job_kinds.py's kinds (`cluster.job_kind: pytorchjob`): API_VERSION, KIND, PLURAL,
SUCCESS_CONDITION, FAILURE_CONDITION and `job_manifest` are what the control plane uses of it. The pod settings
below (volumes, environment, security contexts, resources) are shared by every step that runs stage code.

How the Training Operator (v1.7–v1.9) writes `status`, which the conditions below rely on:
- `status.conditions` only grows at the end. `Created` is always first. `Running` and `Restarting`
  replace each other; `Suspended` comes and goes; `Succeeded` or `Failed` is appended last, and once
  `Failed` is there nothing changes any more. So `Failed` sits at some index 1..4, never at a fixed one.
- `status.replicaStatuses.Master.succeeded` becomes 1 in the same status write that appends
  `Succeeded` (the job succeeds when its Master succeeds, with or without Workers).
- Deadline (`activeDeadlineSeconds`) and backoff-limit failures append `Failed` without bumping any
  replica's `failed` counter, and with restart policies other than Never a replica's `failed` counter
  is non-zero while the job is merely `Restarting`. Counters therefore never decide failure.

How Argo evaluates them (workflow/executor/resource.go): each condition string is parsed as a
Kubernetes label selector whose keys are gjson paths into the resource JSON. Failure requirements are
OR-ed (any match fails the step), success requirements are AND-ed. Keys must be label-key shaped, so no
array queries (`#(...)`) are possible; numeric indices are.
"""

from __future__ import annotations

import copy
from typing import Any

from run.names import METRICS_PORT_ENV, PART_OF, PIPELINE_LABEL, RUN_ROOT, STAGE_LABEL
from spec.pipeline import PipelineSpec
from spec.sizing import PodSize, pod_size
from spec.stage import StageBase
from spec.training import TrainingStage
from workflows.launch import SCRATCH_DIR, WRITABLE_ENV, rdma_env, shutdown_timeout, training_command

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
PLURAL = "pytorchjobs"
CONTAINER_NAME = "pytorch"  # the operator injects PET_* variables into the container of this name

# `Created` is always at index 0; `Failed` can be appended after Suspended, Running/Restarting and Succeeded.
_MAX_CONDITIONS = 5

SUCCESS_CONDITION = "status.replicaStatuses.Master.succeeded > 0"
FAILURE_CONDITION = ",".join(f"status.conditions.{i}.type == Failed" for i in range(1, _MAX_CONDITIONS + 1))

WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
"""Argo's label for the workflow a resource step created an object in: cleanup finds a run's jobs by it."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
METRICS_PORT_NAME = "metrics"  # the container port manifests/components/monitoring's PodMonitor scrapes


SCRATCH_VOLUME = "tmp"


def run_dir(spec: PipelineSpec, run_name: str) -> str:
    """The run directory on the checkpoints volume for a run (a workflow name, or an Argo expression)."""
    return f"{spec.cluster.checkpoints.mount_path}/{RUN_ROOT}/{run_name}"


def volumes(spec: PipelineSpec, shm_size: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pod volumes and the matching container mounts: the datasets and checkpoints PVCs, the scratch emptyDir at
    /tmp, and /dev/shm."""
    cluster = spec.cluster
    vols: list[dict[str, Any]] = [
        {
            "name": "datasets",
            "persistentVolumeClaim": {
                "claimName": cluster.datasets.claim_name,
                "readOnly": cluster.datasets.read_only,
            },
        },
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": cluster.checkpoints.claim_name}},
    ]
    mounts: list[dict[str, Any]] = [
        {
            "name": "datasets",
            "mountPath": cluster.datasets.mount_path,
            "readOnly": cluster.datasets.read_only,
        },
        {"name": "checkpoints", "mountPath": cluster.checkpoints.mount_path},
    ]
    vols.append({"name": SCRATCH_VOLUME, "emptyDir": {}})
    mounts.append({"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR})
    if shm_size:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return vols, mounts


def stage_image(spec: PipelineSpec, stage: StageBase) -> str:
    """The image a stage's pods run."""
    return stage.resources.image or spec.cluster.image


def pod_env(spec: PipelineSpec, stage: StageBase) -> list[dict[str, Any]]:
    """Environment of a stage's container: plain settings, Argo identity, the image (an MLflow tag), the caches on
    writable mounts, and secrets by reference only."""
    cluster = spec.cluster
    env: list[dict[str, Any]] = [
        {"name": "ARGO_WORKFLOW_NAME", "value": "{{workflow.name}}"},
        {"name": "ARGO_WORKFLOW_UID", "value": "{{workflow.uid}}"},
        {"name": "POSTTRAIN_IMAGE", "value": stage_image(spec, stage)},
        {"name": "HF_HOME", "value": f"{cluster.checkpoints.mount_path}/.cache/huggingface"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    plain = {**cluster.env, **stage.env}
    env += [{"name": name, "value": value} for name, value in WRITABLE_ENV.items() if name not in plain]
    for name, value in plain.items():
        env.append({"name": name, "value": value})
    for name, ref in cluster.secrets.env().items():
        env.append(
            {
                "name": name,
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": True}},
            }
        )
    return env


def training_env(spec: PipelineSpec, stage: TrainingStage) -> list[dict[str, Any]]:
    """Environment of a training stage's container: `pod_env`, torchrun's shutdown timeout, and RDMA's NCCL settings
    (the spec's env wins). The plain values among them are workflows.launch.container_env's."""
    env = pod_env(spec, stage)
    env.append({"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(shutdown_timeout(stage))})
    named = {e["name"] for e in env}
    env += [{"name": k, "value": v} for k, v in rdma_env(stage.resources.rdma).items() if k not in named]
    return env


def resource_requirements(size: PodSize, gpus: int = 0, devices: dict[str, int] | None = None) -> dict[str, Any]:
    """Requests equal to limits (Guaranteed QoS: a pod that keeps to its size is the last one the kubelet evicts);
    GPUs and other devices as limits."""
    amounts: dict[str, Any] = {"cpu": size.cpu, "memory": size.memory}
    if size.ephemeral_storage:
        amounts["ephemeral-storage"] = size.ephemeral_storage
    limits = dict(amounts)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    limits.update({name: str(count) for name, count in (devices or {}).items()})
    return {"requests": amounts, "limits": limits}


def pod_template(spec: PipelineSpec, stage_name: str, stage: TrainingStage, command: list[str]) -> dict[str, Any]:
    """The pod template shared by Master and Workers."""
    res = stage.resources
    cluster = spec.cluster
    vols, mounts = volumes(spec, res.shm_size)
    env = training_env(spec, stage)
    devices = {res.rdma.resource: res.rdma.count} if res.rdma is not None else None
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": stage_image(spec, stage),
        "imagePullPolicy": cluster.image_pull_policy,
        "command": command,
        "env": env,
        "resources": resource_requirements(pod_size(spec, stage_name, res), res.gpus_per_node, devices),
        "volumeMounts": mounts,
        "securityContext": container_security_context(ipc_lock=res.rdma is not None),
    }
    pod: dict[str, Any] = {
        # Training code needs no Kubernetes API: the pods run as an account without a Role, and without its token.
        "serviceAccountName": cluster.pod_service_account,
        "automountServiceAccountToken": False,
        # SIGTERM makes the stage save a checkpoint after the current step; give it the time to.
        "terminationGracePeriodSeconds": stage.run_policy.termination_grace_period_seconds,
        "containers": [container],
        "volumes": vols,
        "securityContext": pod_security_context(spec),
    }
    if cluster.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in cluster.image_pull_secrets]
    if res.node_selector:
        pod["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        pod["tolerations"] = [t.to_k8s() for t in res.tolerations]
    if res.affinity:
        pod["affinity"] = res.affinity
    if res.priority_class:
        pod["priorityClassName"] = res.priority_class
    labels = {PIPELINE_LABEL: spec.name, STAGE_LABEL: stage_name, **res.labels}
    metadata: dict[str, Any] = {"labels": labels}
    if res.annotations:
        metadata["annotations"] = dict(res.annotations)
    return {"metadata": metadata, "spec": pod}


def serve_metrics(template: dict[str, Any], port: int) -> None:
    """Give the Master's container the metrics port (named, for the PodMonitor) and tell the stage to serve on it.
    Rank 0, the Master's first process, serves; the Workers declare no port, so the PodMonitor finds no target in
    them that would be down."""
    (container,) = template["spec"]["containers"]
    container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}]
    env = [e for e in container["env"] if e["name"] != METRICS_PORT_ENV]  # the port served is the one declared
    container["env"] = [*env, {"name": METRICS_PORT_ENV, "value": str(port)}]


def container_security_context(ipc_lock: bool = False) -> dict[str, Any]:
    """Every container that runs stage code: no privilege escalation, no capabilities, a read-only root filesystem
    (the volumes of `volumes` are its writable places). With `ipc_lock` (a training stage with `resources.rdma`)
    the one capability RDMA needs to pin its buffers, IPC_LOCK, is added back: Pod Security `privileged` only."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if ipc_lock:
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities, "readOnlyRootFilesystem": True}


def pod_security_context(spec: PipelineSpec) -> dict[str, Any]:
    """Non-root with the RuntimeDefault seccomp profile; fsGroup so the PVCs are writable. Without
    cluster.run_as_user the image's user is used, and the kubelet still refuses to start it as root."""
    ctx: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True}
    if spec.cluster.run_as_user is not None:
        ctx.update(
            runAsUser=spec.cluster.run_as_user,
            runAsGroup=spec.cluster.run_as_user,
            fsGroup=spec.cluster.run_as_user,
        )
    return ctx


def run_policy(spec: PipelineSpec, stage: TrainingStage) -> dict[str, Any]:
    """The job's runPolicy; schedulingPolicy only when a queue or priority class is set."""
    rp = stage.run_policy
    policy: dict[str, Any] = {
        "cleanPodPolicy": rp.clean_pod_policy,
        "activeDeadlineSeconds": rp.active_deadline_seconds,
    }
    if rp.ttl_seconds_after_finished is not None:
        policy["ttlSecondsAfterFinished"] = rp.ttl_seconds_after_finished
    if rp.backoff_limit is not None:
        policy["backoffLimit"] = rp.backoff_limit
    scheduling: dict[str, Any] = {}
    if stage.resources.queue:
        scheduling["queue"] = stage.resources.queue
    if stage.resources.priority_class:
        scheduling["priorityClass"] = stage.resources.priority_class
    if scheduling:
        scheduling["minAvailable"] = stage.resources.nodes  # gang: all pods or none
        policy["schedulingPolicy"] = scheduling
    return policy


def job_metadata(spec: PipelineSpec, stage_name: str, run_name: str) -> dict[str, Any]:
    """A training job's metadata, whatever its kind: a fresh name per attempt, and the labels that cleanup
    (the workflow's), dashboards (pipeline, stage) and Kueue (the stage's queue) select it by."""
    labels = {
        "app.kubernetes.io/part-of": PART_OF,
        PIPELINE_LABEL: spec.name,
        STAGE_LABEL: stage_name,
        WORKFLOW_LABEL: run_name,
    }
    queue = spec.stage(stage_name).resources.queue
    if queue:
        labels[KUEUE_QUEUE_LABEL] = queue  # Kueue admits the whole job from this LocalQueue
    return {"generateName": f"{run_name}-{stage_name}-", "namespace": spec.cluster.namespace, "labels": labels}


def job_manifest(spec: PipelineSpec, stage_name: str, run_name: str = "{{workflow.name}}") -> dict[str, Any]:
    """The PyTorchJob for one training stage of a run: Master (1) + Workers (nodes-1)."""
    stage: TrainingStage = getattr(spec.stages, stage_name)
    res = stage.resources
    command = training_command(stage_name, run_dir(spec, run_name))
    template = pod_template(spec, stage_name, stage, command)
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if res.nodes > 1:
        # A copy, so the YAML manifest spells the Worker template out instead of aliasing the Master's.
        replicas["Worker"] = {"replicas": res.nodes - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
    if spec.cluster.metrics_port is not None:
        serve_metrics(template, spec.cluster.metrics_port)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": job_metadata(spec, stage_name, run_name),
        "spec": {
            "nprocPerNode": str(res.gpus_per_node or 1),
            "runPolicy": run_policy(spec, stage),
            "pytorchReplicaSpecs": replicas,
        },
    }
