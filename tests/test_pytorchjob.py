"""The PyTorchJob each training stage creates: valid for the CRD, and shaped as the operator and torchrun need."""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import PIPELINE_VARIANTS, fresh_spec, variant_id
from schema_validation import SchemaViolation, pod_template_object, validate_core, validate_pytorchjob

from run.names import STAGE_LABEL
from spec.cluster import SecretRef
from spec.document import SpecError
from spec.fields import TRAINING_STAGES
from spec.loading import known_pipelines, load_pipeline
from spec.pipeline import MAX_PIPELINE_NAME_LENGTH, PipelineSpec
from spec.stage import MAX_NODES, RdmaSpec, RunPolicy, Toleration
from workflows.pytorchjob import CONTAINER_NAME, SCRATCH_VOLUME, job_manifest, run_dir

STAGE_CASES = [
    (variant, stage)
    for variant in PIPELINE_VARIANTS
    for stage in TRAINING_STAGES
    if fresh_spec(*variant).stage(stage).enabled
]
STAGE_IDS = [f"{variant_id(v)}:{stage}" for v, stage in STAGE_CASES]


@pytest.fixture(params=STAGE_CASES, ids=STAGE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[PipelineSpec, str]:
    """(spec, stage) for every enabled training stage of every shipped pipeline and profile."""
    variant, stage = request.param
    return fresh_spec(*variant), stage


def _replicas(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return manifest["spec"]["pytorchReplicaSpecs"]


def _containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for r in _replicas(manifest).values() for c in r["template"]["spec"]["containers"]]


def test_every_shipped_pipeline_has_a_training_stage() -> None:
    assert STAGE_CASES, "no enabled training stage in any shipped pipeline"


def test_manifest_validates_strictly_against_the_crd(case: tuple[PipelineSpec, str], schemas_dir: Any) -> None:
    validate_pytorchjob(job_manifest(*case))


def test_pod_templates_validate_as_core_objects(case: tuple[PipelineSpec, str]) -> None:
    for rtype, replica in _replicas(job_manifest(*case)).items():
        validate_core(pod_template_object(replica["template"], name=rtype.lower()))


def test_the_validators_reject_an_unknown_field(case: tuple[PipelineSpec, str], schemas_dir: Any) -> None:
    """Strictness guard: a misspelt container field must not pass as 'unknown, pruned'."""
    manifest = job_manifest(*case)
    _replicas(manifest)["Master"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(SchemaViolation, match=r"containers\[0\].*'volumeMount' was unexpected"):
        validate_pytorchjob(manifest)
    manifest = job_manifest(*case)
    manifest["spec"]["runPolicy"]["activeDeadline"] = 5
    with pytest.raises(SchemaViolation, match=r"spec\.runPolicy: .*'activeDeadline'"):
        validate_pytorchjob(manifest)


@pytest.mark.parametrize("nodes", [1, 2, 5])
def test_master_and_workers(case: tuple[PipelineSpec, str], nodes: int) -> None:
    spec, stage = case
    spec.stage(stage).resources.nodes = nodes
    replicas = _replicas(job_manifest(spec, stage))
    assert replicas["Master"]["replicas"] == 1
    if nodes == 1:
        assert set(replicas) == {"Master"}
    else:
        assert set(replicas) == {"Master", "Worker"}
        assert replicas["Worker"]["replicas"] == nodes - 1
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"  # Argo retries with a fresh job; pods never restart


def test_container_and_command(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    manifest = job_manifest(spec, stage, run_name="run-abc12")
    for replica in _replicas(manifest).values():
        [container] = replica["template"]["spec"]["containers"]
        assert container["name"] == CONTAINER_NAME == "pytorch"
        command = container["command"]
        assert isinstance(command, list) and all(isinstance(a, str) for a in command)
        assert command[0] == "torchrun"
        expected = ["--module", "stages", stage, "--run-dir", run_dir(spec, "run-abc12")]
        assert any(command[i : i + len(expected)] == expected for i in range(len(command))), command
        assert run_dir(spec, "run-abc12").startswith(spec.cluster.checkpoints.mount_path + "/")
        assert "args" not in container
        assert container["image"] == (spec.stage(stage).resources.image or spec.cluster.image)


def test_default_run_dir_is_the_workflow_name(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    manifest = job_manifest(spec, stage)
    assert manifest["metadata"]["generateName"] == f"{{{{workflow.name}}}}-{stage}-"
    assert "name" not in manifest["metadata"]  # retries must not collide with the previous job
    for container in _containers(manifest):
        assert container["command"][-1] == run_dir(spec, "{{workflow.name}}")


def test_nproc_and_gpus(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    res = spec.stage(stage).resources
    manifest = job_manifest(spec, stage)
    assert manifest["spec"]["nprocPerNode"] == str(res.gpus_per_node or 1)
    for container in _containers(manifest):
        limits = container.get("resources", {}).get("limits", {})
        if res.gpus_per_node:
            assert str(limits["nvidia.com/gpu"]) == str(res.gpus_per_node)  # a quantity: "8" or 8
        else:
            assert "nvidia.com/gpu" not in limits


def test_shared_memory_volume(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    for shm in ("32Gi", None):
        spec.stage(stage).resources.shm_size = shm
        manifest = job_manifest(spec, stage)
        for replica in _replicas(manifest).values():
            pod = replica["template"]["spec"]
            shm_mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            shm_volumes = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            if shm is None:
                assert not shm_mounts and not shm_volumes
                continue
            [mount], [volume] = shm_mounts, shm_volumes
            assert mount["name"] == volume["name"]
            assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_volume_claims_are_mounted(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    manifest = job_manifest(spec, stage)
    for replica in _replicas(manifest).values():
        pod = replica["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        for volume in (spec.cluster.datasets, spec.cluster.checkpoints):
            [name] = [n for n, c in claims.items() if c["claimName"] == volume.claim_name]
            assert mounts[name]["mountPath"] == volume.mount_path
            assert bool(mounts[name].get("readOnly", False)) == volume.read_only
        assert set(mounts) <= {v["name"] for v in pod["volumes"]}


def test_secrets_only_by_reference(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    spec.cluster.secrets.hf_token = SecretRef(name="hf-token-x", key="token")
    spec.cluster.secrets.aws_secret_access_key = SecretRef(name="s3-creds", key="secret")
    manifest = job_manifest(spec, stage)
    wanted = {env: (ref.name, ref.key) for env, ref in spec.cluster.secrets.env().items()}
    for container in _containers(manifest):
        by_ref = {}
        for var in container["env"]:
            assert set(var) in ({"name", "value"}, {"name", "valueFrom"}), var
            if "valueFrom" in var:
                assert set(var["valueFrom"]) == {"secretKeyRef"}, var
                ref = var["valueFrom"]["secretKeyRef"]
                by_ref[var["name"]] = (ref["name"], ref["key"])
            else:
                assert var["name"] not in wanted, f"{var['name']} given as a plain value"
                assert isinstance(var["value"], str)
        assert by_ref == wanted
    assert "HF_TOKEN" in wanted and "AWS_SECRET_ACCESS_KEY" in wanted


def test_run_policy(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    rp = spec.stage(stage).run_policy
    policy = job_manifest(spec, stage)["spec"]["runPolicy"]
    assert policy["cleanPodPolicy"] == rp.clean_pod_policy
    assert policy.get("ttlSecondsAfterFinished") == rp.ttl_seconds_after_finished
    assert policy.get("activeDeadlineSeconds") == rp.active_deadline_seconds
    assert policy.get("backoffLimit") == rp.backoff_limit
    assert "suspend" not in policy


def test_run_policy_overrides_and_gang_scheduling(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    st = spec.stage(stage)
    st.run_policy.active_deadline_seconds = 600
    st.run_policy.backoff_limit = 3
    st.run_policy.ttl_seconds_after_finished = None
    st.run_policy.clean_pod_policy = "Running"
    st.resources.queue = "team-a"
    st.resources.priority_class = "high"
    st.resources.nodes = 3
    manifest = job_manifest(spec, stage)
    policy = manifest["spec"]["runPolicy"]
    assert policy["activeDeadlineSeconds"] == 600
    assert policy["backoffLimit"] == 3
    assert "ttlSecondsAfterFinished" not in policy
    assert policy["cleanPodPolicy"] == "Running"
    assert policy["schedulingPolicy"] == {"queue": "team-a", "priorityClass": "high", "minAvailable": 3}
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    for replica in _replicas(manifest).values():
        assert replica["template"]["spec"]["priorityClassName"] == "high"


def test_scheduling_policy_only_when_asked(case: tuple[PipelineSpec, str]) -> None:
    spec, stage = case
    spec.stage(stage).resources.queue = None
    spec.stage(stage).resources.priority_class = None
    manifest = job_manifest(spec, stage)
    assert "schedulingPolicy" not in manifest["spec"]["runPolicy"]
    assert "kueue.x-k8s.io/queue-name" not in manifest["metadata"]["labels"]


def test_placement_and_labels(case: tuple[PipelineSpec, str], schemas_dir: Any) -> None:
    spec, stage = case
    res = spec.stage(stage).resources
    res.node_selector = {"pool": "gpu"}
    res.tolerations = [Toleration(key="gpu", operator="Exists", effect="NoSchedule")]
    res.affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }
        }
    }
    manifest = job_manifest(spec, stage)
    validate_pytorchjob(manifest)
    assert manifest["metadata"]["namespace"] == spec.cluster.namespace
    assert manifest["metadata"]["labels"][STAGE_LABEL] == stage
    for replica in _replicas(manifest).values():
        pod = replica["template"]
        assert pod["metadata"]["labels"][STAGE_LABEL] == stage
        assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_training_pods_hold_no_api_token(case: tuple[PipelineSpec, str]) -> None:
    """Training code needs no Kubernetes API: the pods run as the account without a Role, and no token is mounted
    (the account that may create jobs is the resource step's, never the job's)."""
    spec, stage = case
    spec.cluster.pod_service_account = "runner-x"
    for replica in _replicas(job_manifest(spec, stage)).values():
        pod = replica["template"]["spec"]
        assert pod["serviceAccountName"] == "runner-x" != spec.cluster.service_account
        assert pod["automountServiceAccountToken"] is False


def test_a_read_only_root_with_writable_scratch_and_caches(case: tuple[PipelineSpec, str]) -> None:
    """The root filesystem is read-only; /tmp is an emptyDir and every cache the stages' libraries write points
    into it (or at the checkpoints volume: HF_HOME). A stage's env may move one elsewhere."""
    spec, stage = case
    spec.stage(stage).env = {"TRITON_CACHE_DIR": "/mnt/checkpoints/.cache/triton"}
    for replica in _replicas(job_manifest(spec, stage)).values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        (scratch,) = [v for v in pod["volumes"] if v["name"] == SCRATCH_VOLUME]
        assert scratch == {"name": SCRATCH_VOLUME, "emptyDir": {}}
        assert {"name": SCRATCH_VOLUME, "mountPath": "/tmp"} in container["volumeMounts"]
        names = [var["name"] for var in container["env"]]
        assert len(names) == len(set(names)), "an environment variable is set twice"
        env = _env(container)
        writable = ("/tmp", spec.cluster.checkpoints.mount_path)
        for name in ("HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
            assert env[name].startswith(writable), (name, env[name])
        assert env["HF_HOME"].startswith(spec.cluster.checkpoints.mount_path + "/")
        assert env["TRITON_CACHE_DIR"] == "/mnt/checkpoints/.cache/triton"


def test_a_bad_affinity_is_caught_by_the_spec_and_by_the_crd(case: tuple[PipelineSpec, str], schemas_dir: Any) -> None:
    """A typo in `affinity` is refused by the spec; were one to get past it, the strict CRD check catches it."""
    spec, stage = case
    resources = spec.stage(stage).resources
    with pytest.raises(ValueError, match="nodeAfinity"):
        resources.affinity = {"nodeAfinity": {}}
    resources.__dict__["affinity"] = {"nodeAfinity": {}}  # past the spec's validation
    with pytest.raises(SchemaViolation, match="nodeAfinity"):
        validate_pytorchjob(job_manifest(spec, stage))


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var["value"] for var in container["env"] if "value" in var}


def test_rdma_devices_the_capability_they_need_and_nccl_settings_only_when_asked(
    case: tuple[PipelineSpec, str], schemas_dir: Any
) -> None:
    spec, stage = case
    section = spec.stage(stage)
    asked = {k: v for k, v in {**spec.cluster.env, **section.env}.items() if k.startswith("NCCL_")}
    for container in _containers(job_manifest(spec, stage)):  # by default: no device, no capability
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {k: v for k, v in _env(container).items() if k.startswith("NCCL_")} == asked
        assert set(container["resources"].get("limits", {})) <= {"cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"}

    spec.cluster.env = {k: v for k, v in spec.cluster.env.items() if k != "NCCL_IB_HCA"}
    section.resources.rdma = RdmaSpec(resource="rdma/rdma_shared_device_a", count=2, nccl_ib_hca="=mlx5_0,mlx5_1")
    section.env = {"NCCL_SOCKET_IFNAME": "eth1"}  # set in the env, not in rdma: as the env says
    manifest = job_manifest(spec, stage)
    validate_pytorchjob(manifest)
    for rtype, replica in _replicas(manifest).items():
        validate_core(pod_template_object(replica["template"], name=rtype.lower()))
    for container in _containers(manifest):
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "2"
        assert "rdma/rdma_shared_device_a" not in container["resources"].get("requests", {})
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        env = _env(container)
        assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
        assert env["NCCL_SOCKET_IFNAME"] == "eth1"
        names = [var["name"] for var in container["env"]]
        assert len(names) == len(set(names)), "an environment variable is set twice"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stages.evaluate.resources.rdma={resource: rdma/hca}", "stages.evaluate.resources.rdma: RDMA devices are"),
        ("stages.cpt.resources.rdma={resource: nvidia.com/gpu}", "(GPUs are gpus_per_node)"),
        ("stages.cpt.resources.rdma={resource: memory}", "is not a device plugin's resource"),
        ("stages.cpt.resources.rdma={resource: rdma/hca, count: 0}", "stages.cpt.resources.rdma.count"),
        (
            "stages.cpt.resources.rdma={resource: rdma/hca, nccl_ib_hca: mlx4}",  # the pipeline's cluster.env: mlx5
            "stages.cpt.resources.rdma.nccl_ib_hca: cluster.env sets NCCL_IB_HCA=mlx5 and resources.rdma.nccl_ib_hca",
        ),
    ],
)
def test_rdma_refuses_what_is_not_a_training_stage_device(override: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        load_pipeline("korean-llm", None, [override])


def test_pods_know_their_image(case: tuple[PipelineSpec, str]) -> None:
    """The MLflow runs are tagged with the image (stages/tracking_mlflow_server.py reads POSTTRAIN_IMAGE)."""
    spec, stage = case
    spec.stage(stage).resources.image = "registry.example/trainer:pinned"
    for container in _containers(job_manifest(spec, stage)):
        assert _env(container)["POSTTRAIN_IMAGE"] == container["image"] == "registry.example/trainer:pinned"


@pytest.mark.parametrize(("grace", "timeout"), [(300, 285), (600, 585), (40, 30), (30, 30)])
def test_torchrun_gives_workers_the_grace_period_to_checkpoint(
    case: tuple[PipelineSpec, str], grace: int, timeout: int
) -> None:
    """On SIGTERM torchrun SIGKILLs its workers after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default): it must
    cover most of the pod's grace period, which is sized for one step plus a checkpoint."""
    spec, stage = case
    spec.stage(stage).run_policy.termination_grace_period_seconds = grace
    for replica in _replicas(job_manifest(spec, stage)).values():
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        shutdown = int(_env(pod["containers"][0])["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        assert shutdown == timeout and shutdown <= grace


def test_a_failed_job_frees_the_gpus_of_its_running_pods() -> None:
    """By default the operator deletes the pods still running when the job ends (e.g. Workers waiting on a failed
    Master), and the job always has a deadline."""
    policy = RunPolicy()
    assert policy.clean_pod_policy == "Running"
    assert policy.active_deadline_seconds == 7 * 24 * 3600
    spec = fresh_spec("korean-llm")
    spec.stages.sft.run_policy = RunPolicy()
    run_policy = job_manifest(spec, "sft")["spec"]["runPolicy"]
    assert run_policy["cleanPodPolicy"] == "Running"
    assert run_policy["activeDeadlineSeconds"] == 7 * 24 * 3600


# --------------------------------------------------------------------------- name lengths

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _worst_service_name(spec: PipelineSpec) -> str:
    """The longest replica Service name a run of `spec` can get: a resubmitted scheduled run's workflow
    ('<name>-<unix time>-<5 random>'), the job's generateName suffix, and the last Worker's index."""
    workflow = f"{spec.name}-{2**32}-abcde"  # a 10-digit unix time (2106); resubmission appends '-<5 random>'
    names = []
    for stage in TRAINING_STAGES:
        job = job_manifest(spec, stage, run_name=workflow)["metadata"]["generateName"] + "fghij"
        names.append(f"{job}-worker-{MAX_NODES - 2}")
    return max(names, key=len)


@pytest.mark.parametrize("pipeline", known_pipelines())
def test_shipped_pipelines_have_valid_service_names(pipeline: str) -> None:
    service = _worst_service_name(load_pipeline(pipeline).spec)
    assert len(service) <= 63 and _DNS_1035.match(service), service


def test_the_longest_allowed_name_still_gives_valid_service_names() -> None:
    longest = "a" * MAX_PIPELINE_NAME_LENGTH
    spec = load_pipeline("korean-llm", overrides=[f"name={longest}"]).spec
    service = _worst_service_name(spec)
    assert len(service) == 63 and _DNS_1035.match(service), service
    with pytest.raises(SpecError, match=f"at most {MAX_PIPELINE_NAME_LENGTH} characters"):
        load_pipeline("korean-llm", overrides=[f"name={longest}b"])
