"""The kit's RBAC: every verb of every role has a reason, and each identity holds only what its steps need."""

from __future__ import annotations

import copy
from typing import Any

from kustomize import (
    OVERLAY_PIPELINES,
    Doc,
    _all_objects,
    _find,
    _matches,
)

from spec.loading import load_pipeline

ALL: tuple[str, ...] = ()


"""resourceNames of a rule that names none: every object of the resource."""


PREFLIGHT_CRDS = (
    "cronworkflows.argoproj.io",
    "experiments.kubeflow.org",
    "inferenceservices.serving.kserve.io",
    "localqueues.kueue.x-k8s.io",
    "pytorchjobs.kubeflow.org",
    "trainjobs.trainer.kubeflow.org",
    "workflows.argoproj.io",
    "workflowtemplates.argoproj.io",
)


PREFLIGHT_SECRETS = ("aws-credentials", "hf-token", "mlflow-auth", "registry-credentials", "slack-webhook", "wandb")


"""The names preflight's rules are limited to, sorted (as `_grants` sorts them)."""


Grant = tuple[str, str, str, tuple[str, ...]]


"""(apiGroup, resource, verb, resourceNames): one permission a role grants."""


VERB_REASONS: dict[tuple[str, str], dict[Grant, str]] = {
    ("Role", "posttrain-workflow"): {
        ("argoproj.io", "workflowtaskresults", "create", ALL): "a resource step's executor reports its outputs",
        ("argoproj.io", "workflowtaskresults", "patch", ALL): "a resource step's executor updates the step's result",
        ("kubeflow.org", "pytorchjobs", "create", ALL): "training steps are resource templates with action create",
        (
            "kubeflow.org",
            "pytorchjobs",
            "get",
            ALL,
        ): "the resource step polls the job for its success/failure condition",
        (
            "kubeflow.org",
            "pytorchjobs",
            "list",
            ALL,
        ): "cleanup (exit handler, a training stage's retry) finds the run's jobs by their workflow label",
        (
            "kubeflow.org",
            "pytorchjobs",
            "delete",
            ALL,
        ): "cleanup deletes a stopped or failed run's unfinished jobs, freeing their GPUs at once",
        ("kubeflow.org", "experiments", "create", ALL): "a stage's hpo step creates its Katib Experiment",
        ("kubeflow.org", "experiments", "get", ALL): "the hpo wait step polls the Experiment for Katib's verdict",
        (
            "kubeflow.org",
            "experiments",
            "list",
            ALL,
        ): "the exit handler's cleanup finds the run's Experiments by their workflow label",
        (
            "kubeflow.org",
            "experiments",
            "delete",
            ALL,
        ): "cleanup deletes a stopped run's unfinished search (Katib deletes its trials and their jobs)",
        ("trainer.kubeflow.org", "trainjobs", "create", ALL): "with job_kind trainjob, training steps create TrainJobs",
        ("trainer.kubeflow.org", "trainjobs", "get", ALL): "the resource step polls the TrainJob for its conditions",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "list",
            ALL,
        ): "cleanup --kind trainjob finds the run's TrainJobs by their workflow label",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "delete",
            ALL,
        ): "cleanup deletes a stopped or failed run's unfinished TrainJobs (their JobSet and pods go with them)",
        (
            "serving.kserve.io",
            "inferenceservices",
            "create",
            ALL,
        ): "serve (workflows.rollout) server-side applies the InferenceService; the first apply creates it",
        (
            "serving.kserve.io",
            "inferenceservices",
            "get",
            ALL,
        ): "serve reads the revision serving before its apply, then polls the new revision, traffic and rollback",
        (
            "serving.kserve.io",
            "inferenceservices",
            "patch",
            ALL,
        ): "serve's apply moves the InferenceService to the run's model, its canary steps and rollback set traffic",
        (
            "serving.knative.dev",
            "revisions",
            "get",
            ALL,
        ): "retention reads the storageUri of each revision the service still names, never pruning a served model",
    },
    ("Role", "posttrain-reaper"): {
        (
            "argoproj.io",
            "workflows",
            "get",
            ALL,
        ): "the reaper reads a job's workflow: ended (phase, finishedAt), or gone",
        (
            "kubeflow.org",
            "pytorchjobs",
            "list",
            ALL,
        ): "the reaper finds the namespace's unfinished PyTorchJobs by their workflow label",
        (
            "kubeflow.org",
            "pytorchjobs",
            "delete",
            ALL,
        ): "the reaper deletes an ended (e.g. terminated) workflow's unfinished PyTorchJobs, freeing their GPUs",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "list",
            ALL,
        ): "the reaper finds the namespace's unfinished TrainJobs by their workflow label",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "delete",
            ALL,
        ): "the reaper deletes an ended workflow's unfinished TrainJobs (their JobSet and pods go with them)",
        (
            "kubeflow.org",
            "experiments",
            "list",
            ALL,
        ): "the reaper finds the namespace's unfinished Katib Experiments by their workflow label",
        (
            "kubeflow.org",
            "experiments",
            "delete",
            ALL,
        ): "the reaper deletes an ended workflow's unfinished search (Katib deletes its trials and their jobs)",
    },
    ("Role", "posttrain-executor"): {
        (
            "argoproj.io",
            "workflowtaskresults",
            "create",
            ALL,
        ): "Argo's wait container of a stage pod reports the step's outputs (its token is mounted there only)",
        ("argoproj.io", "workflowtaskresults", "patch", ALL): "Argo's wait container updates the step's result",
    },
    ("Role", "posttrain-submitter"): {
        ("argoproj.io", "workflows", "create", ALL): "submit a run (CLI, or the UI's submit dialog)",
        ("argoproj.io", "workflows", "get", ALL): "`submit --watch` follows the run it submitted",
        ("argoproj.io", "workflowtemplates", "get", ALL): "a run references its pipeline's registered template",
    },
    ("Role", "posttrain-registrar"): {
        ("argoproj.io", "workflowtemplates", "create", ALL): "register a new pipeline",
        ("argoproj.io", "workflowtemplates", "get", ALL): "register reads the resourceVersion to update",
        ("argoproj.io", "workflowtemplates", "update", ALL): "register an existing pipeline again",
        ("argoproj.io", "cronworkflows", "create", ALL): "register a scheduled pipeline",
        ("argoproj.io", "cronworkflows", "get", ALL): "register reads the resourceVersion, and finds stale schedules",
        ("argoproj.io", "cronworkflows", "update", ALL): "register a changed schedule",
    },
    ("ClusterRole", "posttrain-preflight"): {
        (
            "apiextensions.k8s.io",
            "customresourcedefinitions",
            "get",
            PREFLIGHT_CRDS,
        ): "preflight: the CRDs are installed",
        ("", "namespaces", "get", ALL): "preflight: the namespace exists",
        ("", "nodes", "list", ALL): "preflight: GPU nodes with the stages' labels, taints and GPUs",
        ("scheduling.k8s.io", "priorityclasses", "get", ALL): "preflight: the stages' PriorityClasses exist",
        ("serving.kserve.io", "clusterservingruntimes", "get", ALL): "preflight: the serving runtime, cluster-wide",
        (
            "trainer.kubeflow.org",
            "clustertrainingruntimes",
            "get",
            ALL,
        ): "preflight: with job_kind trainjob, the TrainJobs' runtime exists and fits",
    },
    ("Role", "posttrain-preflight"): {
        ("", "serviceaccounts", "get", ALL): "preflight: the pipeline's three ServiceAccounts exist",
        ("", "persistentvolumeclaims", "get", ALL): "preflight: the volumes exist, are Bound and ReadWriteMany",
        ("", "secrets", "get", PREFLIGHT_SECRETS): (
            "preflight: the spec's Secrets exist; it requests their metadata only (PartialObjectMetadata), and "
            "RBAC has no narrower verb than get"
        ),
        ("kueue.x-k8s.io", "localqueues", "get", ALL): "preflight: the stages' Kueue LocalQueues exist",
        ("serving.kserve.io", "servingruntimes", "get", ALL): "preflight: the deploy stage's ServingRuntime exists",
    },
}


"""Every permission any Role of the kit grants, with the reason it is needed. A verb, resource or widened
resourceNames without a row here fails."""


def _grants(role: Doc) -> set[Grant]:
    out = set()
    for rule in role.get("rules", []):
        assert "nonResourceURLs" not in rule
        names = tuple(sorted(rule.get("resourceNames") or ()))
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"{role['metadata']['name']}: wildcard in {rule}"
                    out.add((group, resource, verb, names))
    return out


def rbac_differences(roles: list[Doc]) -> list[str]:
    """What differs between the roles' grants and VERB_REASONS: each unexplained or unused grant, one line each."""
    problems = []
    seen = set()
    for role in roles:
        key = (role["kind"], role["metadata"]["name"])
        seen.add(key)
        reasons = VERB_REASONS.get(key)
        if reasons is None:
            problems.append(f"{key}: a role with no entry in VERB_REASONS")
            continue
        granted = _grants(role)
        problems += [f"{key}: {g} is granted without a reason" for g in sorted(granted - set(reasons))]
        problems += [f"{key}: {g} has a reason but is not granted" for g in sorted(set(reasons) - granted)]
    problems += [f"{key}: in VERB_REASONS but in no manifest" for key in sorted(set(VERB_REASONS) - seen)]
    return problems


def _all_roles(builds: dict[str, list[Doc]]) -> list[Doc]:
    roles: dict[tuple[str, str], Doc] = {}
    for _, doc in _all_objects(builds):
        if doc["kind"] in ("Role", "ClusterRole"):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in roles or roles[key]["rules"] == doc["rules"], f"{key} differs between builds"
            roles[key] = doc
    return list(roles.values())


def test_roles_grant_exactly_the_verbs_with_a_reason(builds: dict[str, list[Doc]]) -> None:
    assert rbac_differences(_all_roles(builds)) == []


def _role(roles: list[Doc], kind: str, name: str) -> Doc:
    return next(r for r in roles if (r["kind"], r["metadata"]["name"]) == (kind, name))


def test_an_extra_verb_fails_the_rbac_check(builds: dict[str, list[Doc]]) -> None:
    roles = copy.deepcopy(_all_roles(builds))
    _role(roles, "Role", "posttrain-workflow")["rules"][1]["verbs"].append("update")
    _role(roles, "Role", "posttrain-submitter")["rules"][1]["verbs"].append("update")
    assert rbac_differences(roles) == [
        "('Role', 'posttrain-workflow'): ('kubeflow.org', 'pytorchjobs', 'update', ()) is granted without a reason",
        "('Role', 'posttrain-submitter'): ('argoproj.io', 'workflowtemplates', 'update', ()) is granted without a "
        "reason",
    ]


def test_the_reaper_role_grants_exactly_the_calls_the_reaper_makes(builds: dict[str, list[Doc]]) -> None:
    """workflows/reaper.py gets workflows and lists and deletes what it reaps: the Role holds that and nothing else,
    so a kind added to the reaper without its verbs (or a verb left behind) fails here."""
    from workflows import reaper

    group, _, plural = reaper.WORKFLOW_RESOURCE
    calls = {(group, plural, "get", ALL)}
    calls |= {(g, p, verb, ALL) for g, _, p in reaper.RESOURCES for verb in ("list", "delete")}
    assert _grants(_role(_all_roles(builds), "Role", "posttrain-reaper")) == calls
    for docs in builds.values():
        assert _roles_bound_to(docs, "posttrain-reaper") == ["Role/posttrain-reaper"]


def test_widening_a_named_resource_rule_fails_the_rbac_check(builds: dict[str, list[Doc]]) -> None:
    roles = copy.deepcopy(_all_roles(builds))
    secrets = next(r for r in _role(roles, "Role", "posttrain-preflight")["rules"] if r["resources"] == ["secrets"])
    del secrets["resourceNames"]  # every Secret of the namespace
    problems = rbac_differences(roles)
    assert problems == [
        "('Role', 'posttrain-preflight'): ('', 'secrets', 'get', ()) is granted without a reason",
        f"('Role', 'posttrain-preflight'): ('', 'secrets', 'get', {PREFLIGHT_SECRETS}) has a reason but is not granted",
    ]


def test_submitters_cannot_write_templates(builds: dict[str, list[Doc]]) -> None:
    """What a run executes is decided by whoever registers templates, not by whoever submits runs."""
    submitter = _grants(_role(_all_roles(builds), "Role", "posttrain-submitter"))
    writes = {"create", "update", "patch", "delete"}
    assert not {g for g in submitter if g[1] in ("workflowtemplates", "cronworkflows") and g[2] in writes}
    for name in ("posttrain-submitters", "posttrain-registrars"):
        for docs in builds.values():
            _find(docs, "RoleBinding", name)


def test_nothing_cluster_wide_outside_the_optional_components(builds: dict[str, list[Doc]]) -> None:
    for name, docs in builds.items():
        kinds = {d["kind"] for d in docs}
        assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, name


def _roles_bound_to(docs: list[Doc], account: str) -> list[str]:
    """The roles the kit binds to ServiceAccount `account` (by RoleBinding or ClusterRoleBinding)."""
    return sorted(
        f"{doc['roleRef']['kind']}/{doc['roleRef']['name']}"
        for doc in docs
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for subject in doc.get("subjects", [])
        if subject["kind"] == "ServiceAccount" and subject["name"] == account
    )


def identity_problems(docs: list[Doc], cluster: Any) -> list[str]:
    """What the kit gets wrong about a pipeline's three ServiceAccounts (cluster.*), one line each:
    - service_account (the resource steps): bound to the posttrain-workflow Role only, its token not switched off
      on the account (Argo writes only `false` into a pod, so the account's setting would win);
    - pod_service_account (every pod that runs stage code): no role at all, no token;
    - executor_service_account (Argo's init/wait): the posttrain-executor Role only, and the token Secret Argo
      mounts, `<name>.service-account-token`."""
    problems = []
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    wanted = {
        cluster.service_account: ["Role/posttrain-workflow"],
        cluster.pod_service_account: [],
        cluster.executor_service_account: ["Role/posttrain-executor"],
    }
    for account, roles in wanted.items():
        if account not in accounts:
            problems.append(f"ServiceAccount {account} is missing")
        elif (bound := _roles_bound_to(docs, account)) != roles:
            problems.append(f"ServiceAccount {account} is bound to {bound}, expected {roles}")
    if accounts.get(cluster.service_account, {}).get("automountServiceAccountToken") is False:
        problems.append(f"{cluster.service_account} switches its token off: the resource steps would have none")
    for account in (cluster.pod_service_account, cluster.executor_service_account):
        if account in accounts and accounts[account].get("automountServiceAccountToken") is not False:
            problems.append(f"{account} does not set automountServiceAccountToken: false")
    token = f"{cluster.executor_service_account}.service-account-token"
    secrets = [d for d in docs if _matches(d, "Secret", token)]
    if not secrets:
        problems.append(f"Secret {token} (the executor's token, which Argo mounts) is missing")
    elif (
        secrets[0].get("type") != "kubernetes.io/service-account-token"
        or secrets[0]["metadata"].get("annotations", {}).get("kubernetes.io/service-account.name")
        != cluster.executor_service_account
    ):
        problems.append(f"Secret {token} is not a token of {cluster.executor_service_account}")
    return problems


def test_the_identities_hold_only_what_their_steps_need(builds: dict[str, list[Doc]]) -> None:
    from spec.cluster import ClusterSpec

    for name, docs in builds.items():
        pipelines = [load_pipeline(p).spec.cluster for p in OVERLAY_PIPELINES.get(name, [])] or [ClusterSpec()]
        for cluster in pipelines:
            assert identity_problems(docs, cluster) == [], name
        binding = _find(docs, "RoleBinding", "posttrain-workflow")
        namespace = _find(docs, "Namespace", binding["metadata"]["namespace"])["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "posttrain-workflow", "namespace": namespace}]


def test_the_identity_check_can_fail(builds: dict[str, list[Doc]]) -> None:
    from spec.cluster import ClusterSpec

    docs = copy.deepcopy(builds["base"])
    cluster = ClusterSpec()
    _find(docs, "RoleBinding", "posttrain-workflow")["subjects"].append(
        {"kind": "ServiceAccount", "name": "posttrain-runner", "namespace": "posttrain"}
    )
    del _find(docs, "ServiceAccount", "posttrain-runner")["automountServiceAccountToken"]
    _find(docs, "ServiceAccount", "posttrain-workflow")["automountServiceAccountToken"] = False
    docs = [d for d in docs if not _matches(d, "Secret", "posttrain-executor.service-account-token")]
    assert identity_problems(docs, cluster) == [
        "ServiceAccount posttrain-runner is bound to ['Role/posttrain-workflow'], expected []",
        "posttrain-workflow switches its token off: the resource steps would have none",
        "posttrain-runner does not set automountServiceAccountToken: false",
        "Secret posttrain-executor.service-account-token (the executor's token, which Argo mounts) is missing",
    ]
