"""The Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) a training stage creates with
`cluster.job_kind: trainjob`, and the Argo conditions that watch it (a kind of workflows/job_kinds.py).

A TrainJob names a ClusterTrainingRuntime (`cluster.training_runtime`, manifests/components/trainer-v2) whose
JobSet template holds the pod's fixed parts: security contexts, the grace period, automountServiceAccountToken,
the JobSet's restart policy. The TrainJob sets what varies per stage through what Trainer v2.1 lets it override:
`spec.trainer` (image, command, env, numNodes, numProcPerNode, resourcesPerNode) and `spec.podTemplateOverrides`
(service account, node selector, affinity, tolerations, volumes, the `node` container's volume mounts, image pull
secrets, pod labels and annotations). A v2.1 TrainJob cannot say the rest. A stage's
priority_class and resources.rdma (its IPC_LOCK) are refused with job_kind trainjob (spec/); these act
on PyTorchJobs only: run_policy's active deadline (Argo's wait timeout still bounds the stage), backoff limit, TTL
and clean-pod policy, and cluster.run_as_user (the runtime's UID). The torch plugin sets
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in the container named `node`,
which torchrun reads, so the argv is the PyTorchJob's (workflows/launch.py `training_command`).

How the Trainer (v2.1) writes `status`, which the conditions below rely on (pkg/controller/trainjob_controller.go,
pkg/runtime/framework/plugins/jobset): `status.conditions` holds at most `Suspended`, `Complete` and `Failed`,
each set with `meta.SetStatusCondition`, which updates a condition in place and appends a new one.
- `Suspended` is True while `spec.suspend` is (Kueue creates the job suspended and resumes it on admission),
  then False (reason Resumed); Kueue suspends a preempted job again. Without Kueue there is none.
- `Complete` and `Failed` are copied from the JobSet's own, only when True, and exclude each other. Every
  reconcile removes `Failed` first and appends it again, so it sits at index 0 or 1 (after `Suspended`, or
  before it when the runtime is refused while the job is suspended).
- `status.jobsStatus` lists the JobSet's replicated jobs in the runtime's order, with counters of child Jobs;
  `succeeded` of `node` (one Job of numNodes pods) is 1 once every node has exited 0.

How Argo evaluates them: workflows/pytorchjob.py. "`Complete` at index 0 (no Kueue) or 1 (after Kueue's
`Suspended`)" is an OR, which the AND-ed success condition cannot say; `node`'s `succeeded` counter can, at the
index the runtime gives it. The success condition pins that index to the job's name, and preflight checks that
the runtime's first replicated job is `node`.
"""

from __future__ import annotations

from typing import Any

from run.names import METRICS_PORT_ENV, PIPELINE_LABEL, STAGE_LABEL
from spec.pipeline import PipelineSpec
from spec.sizing import pod_size
from spec.training import TrainingStage
from workflows.launch import training_command
from workflows.pytorchjob import (
    job_metadata,
    resource_requirements,
    run_dir,
    stage_image,
    training_env,
    volumes,
)

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
RUNTIME_KIND = "ClusterTrainingRuntime"
RUNTIME_PLURAL = "clustertrainingruntimes"
NODE = "node"
"""The runtime's replicated job and container the torch plugin configures (the Trainer's constants.Node)."""

# Suspended, Complete and Failed: Failed sits at 0 or 1; index 2 is watched too, should a condition be added.
_MAX_CONDITIONS = 3

SUCCESS_CONDITION = f"status.jobsStatus.0.name == {NODE},status.jobsStatus.0.succeeded > 0"
FAILURE_CONDITION = ",".join(f"status.conditions.{i}.type == Failed" for i in range(_MAX_CONDITIONS))


def runtime_ref(spec: PipelineSpec) -> dict[str, str]:
    """The TrainJob's reference to the cluster's training runtime."""
    return {"name": spec.cluster.training_runtime, "apiGroup": API_GROUP, "kind": RUNTIME_KIND}


def trainer_env(spec: PipelineSpec, stage: TrainingStage) -> list[dict[str, Any]]:
    """The `node` container's environment: the PyTorchJob's (settings, identity, caches, secrets by reference),
    torchrun's shutdown timeout, RDMA's NCCL settings, and the metrics port (rank 0 serves)."""
    env = training_env(spec, stage)
    if spec.cluster.metrics_port is not None:
        env = [e for e in env if e["name"] != METRICS_PORT_ENV]
        env.append({"name": METRICS_PORT_ENV, "value": str(spec.cluster.metrics_port)})
    return env


def pod_override(spec: PipelineSpec, stage_name: str, stage: TrainingStage) -> dict[str, Any]:
    """The podTemplateOverride of the `node` pods: what varies per cluster and stage and the runtime cannot know."""
    res = stage.resources
    cluster = spec.cluster
    vols, mounts = volumes(spec, res.shm_size)
    pod: dict[str, Any] = {
        "serviceAccountName": cluster.pod_service_account,
        "volumes": vols,
        "containers": [{"name": NODE, "volumeMounts": mounts}],
    }
    if res.node_selector:
        pod["nodeSelector"] = dict(res.node_selector)
    if res.affinity:
        pod["affinity"] = res.affinity
    if res.tolerations:
        pod["tolerations"] = [t.to_k8s() for t in res.tolerations]
    if cluster.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in cluster.image_pull_secrets]
    metadata: dict[str, Any] = {"labels": {PIPELINE_LABEL: spec.name, STAGE_LABEL: stage_name, **res.labels}}
    if res.annotations:
        metadata["annotations"] = dict(res.annotations)
    return {"targetJobs": [{"name": NODE}], "metadata": metadata, "spec": pod}


def job_manifest(spec: PipelineSpec, stage_name: str, run_name: str = "{{workflow.name}}") -> dict[str, Any]:
    """The TrainJob for one training stage of a run: `nodes` pods of the runtime's `node` job, each running
    torchrun with `gpus_per_node` processes."""
    stage: TrainingStage = getattr(spec.stages, stage_name)
    res = stage.resources
    devices = {res.rdma.resource: res.rdma.count} if res.rdma is not None else None
    trainer: dict[str, Any] = {
        "image": stage_image(spec, stage),
        "command": training_command(stage_name, run_dir(spec, run_name)),
        "env": trainer_env(spec, stage),
        "numNodes": res.nodes,
        "numProcPerNode": res.gpus_per_node or 1,
        "resourcesPerNode": resource_requirements(pod_size(spec, stage_name, res), res.gpus_per_node, devices),
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": job_metadata(spec, stage_name, run_name),
        "spec": {
            "runtimeRef": runtime_ref(spec),
            "trainer": trainer,
            # The JobSet and its Jobs carry the pipeline and stage too (`kubectl get jobs -l ...`).
            "labels": {PIPELINE_LABEL: spec.name, STAGE_LABEL: stage_name},
            "podTemplateOverrides": [pod_override(spec, stage_name, stage)],
        },
    }
