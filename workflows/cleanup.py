"""Deleting a run's unfinished training jobs, so that a stopped or failed workflow frees its GPUs at once.

Stopping a workflow ends only the Argo pod that waits on a PyTorchJob or TrainJob; the job itself keeps its GPUs
until the Workflow object is deleted (its owner reference) or the job's own deadline. This module lists the jobs a
workflow created (every rendered job carries the label `workflows.argoproj.io/workflow: <workflow>`), and deletes
those that have not finished (no Succeeded, Complete or Failed condition True), with their pods (propagation
Background).

    python -m workflows.cleanup --namespace NS --workflow NAME [--stage STAGE] [--kind pytorchjob|trainjob]
                                [--experiments]

With `--experiments` (a pipeline with a hyperparameter search) it first deletes the workflow's unfinished Katib
Experiments too, by the same label: Katib then deletes their trials, and the trials' jobs with them.

The exit handler runs it when a workflow did not succeed, and each retry of a training stage runs it for that stage
before it creates a new job (one job per stage at a time). Argo runs no exit handler when a workflow is terminated
(`argo terminate`): the kit's reaper (workflows/reaper.py, a CronJob) deletes its jobs within minutes, and
`python -m workflows.runs stop --terminate NAME` at once.
Exit status 0 (also when there was nothing to delete); 1 with one `error:` line when the API refused or could not
be reached (the exit handler retries); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from run.names import PIPELINE_LABEL, STAGE_LABEL
from workflows import job_kinds, katib
from workflows.pytorchjob import WORKFLOW_LABEL

JOB_RESOURCES: dict[str, tuple[str, str, str]] = {name: job_kinds.job_resource(name) for name in job_kinds.KINDS}
"""(group, version, plural) of each `cluster.job_kind` (workflows/job_kinds.py)."""

JOB_KINDS = (JOB_RESOURCES[job_kinds.DEFAULT_JOB_KIND],)
"""The resources a workflow of the default job kind creates."""

FINISHED_CONDITIONS = ("Succeeded", "Complete", "Failed")
"""A PyTorchJob's verdicts (Succeeded, Failed) and a TrainJob's (Complete, Failed)."""
REQUEST_TIMEOUT_S = 30


def is_finished(job: dict[str, Any]) -> bool:
    """Whether the operator has given its verdict: a Succeeded, Complete or Failed condition with status True."""
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in FINISHED_CONDITIONS and c.get("status") == "True" for c in conditions)


def default_api_client() -> Any:
    """An ApiClient from the in-cluster service account, else from the kubeconfig."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        # $KUBECONFIG read now: the client library reads its default location once, when it is imported.
        path = (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
        try:
            return config.new_client_from_config(config_file=os.path.expanduser(path))
        except (ConfigException, OSError, TypeError) as exc:
            raise RuntimeError(f"not running in a pod and no usable kubeconfig ({exc})") from None
    return client.ApiClient(configuration)


def delete_running_jobs(
    namespace: str,
    workflow: str,
    api_client: Any = None,
    stage: str | None = None,
    kind: str = job_kinds.DEFAULT_JOB_KIND,
    pipeline: str | None = None,
) -> list[str]:
    """Delete the unfinished jobs of `workflow` in `namespace` (of one `stage` only, when given, and of one
    `pipeline`: a variant's, whose stages share their names with the other variants' in the same workflow) of
    `kind` (a `cluster.job_kind`); return their names. Finished jobs stay (their status and logs are the run's
    record until their TTL or the workflow's). A job deleted meanwhile by someone else is not an error."""
    selector = f"{WORKFLOW_LABEL}={workflow}" + (f",{STAGE_LABEL}={stage}" if stage else "")
    selector += f",{PIPELINE_LABEL}={pipeline}" if pipeline else ""
    return _delete_unfinished(api_client, JOB_RESOURCES[kind], namespace, selector, workflow)


def _delete_unfinished(
    api_client: Any, resource: tuple[str, str, str], namespace: str, selector: str, workflow: str, kind: str = ""
) -> list[str]:
    """Delete the unfinished objects of `resource` (group, version, plural) that `selector` finds in `namespace`
    (named `kind`, default each object's own kind, in the lines it prints); return their names. One deleted
    meanwhile by someone else is not an error."""
    api_client = api_client or default_api_client()
    deleted: list[str] = []
    for item in list_unfinished(api_client, resource, namespace, selector):
        name = item["metadata"]["name"]
        if delete_object(api_client, resource, namespace, name):
            what = kind or item.get("kind", resource[2])
            print(f"deleted {what} {namespace}/{name} (workflow {workflow})", flush=True)
            deleted.append(name)
    return deleted


def list_unfinished(
    api_client: Any, resource: tuple[str, str, str], namespace: str, selector: str
) -> list[dict[str, Any]]:
    """The objects of `resource` (group, version, plural) in `namespace` that `selector` finds and that have no
    verdict yet (`is_finished`)."""
    from kubernetes import client

    group, version, plural = resource
    listed = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        group, version, namespace, plural, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
    )
    return [item for item in listed.get("items", []) if not is_finished(item)]


def delete_object(api_client: Any, resource: tuple[str, str, str], namespace: str, name: str) -> bool:
    """Delete one object of `resource` with its dependents (their pods; propagation Background); False when it was
    already gone."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    group, version, plural = resource
    try:
        client.CustomObjectsApi(api_client).delete_namespaced_custom_object(
            group,
            version,
            namespace,
            plural,
            name,
            body=client.V1DeleteOptions(propagation_policy="Background"),
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


EXPERIMENT_RESOURCE = (*katib.API_VERSION.split("/"), katib.PLURAL)
"""(group, version, plural) of Katib's Experiment (workflows/katib.py)."""


def delete_running_experiments(namespace: str, workflow: str, api_client: Any = None) -> list[str]:
    """Delete the unfinished Katib Experiments of `workflow` in `namespace` (no Succeeded or Failed condition
    True); return their names. A finished search stays: its trials are the run's record."""
    selector = f"{WORKFLOW_LABEL}={workflow}"
    return _delete_unfinished(api_client, EXPERIMENT_RESOURCE, namespace, selector, workflow, "Experiment")


def api_error(exc: Exception, plural: str = "pytorchjobs", verbs: str = "verbs list and delete") -> str:
    """One line about a failed API call, without the response body's noise; a refusal (403) names the RBAC `verbs`
    on `plural` the identity lacks."""
    if isinstance(exc, RuntimeError):
        return str(exc)
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status:
        hint = f" (the identity lacks the RBAC {verbs} on {plural})" if status == 403 else ""
        return f"the Kubernetes API answered {status} {reason}{hint}"
    return f"the Kubernetes API could not be reached ({type(exc).__name__}: {exc})"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m workflows.cleanup", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", required=True, help="The workflow's namespace.")
    parser.add_argument("--workflow", required=True, help="The workflow's name (the jobs' label value).")
    parser.add_argument("--stage", help="Only this training stage's jobs.")
    parser.add_argument("--pipeline", help="Only this pipeline's jobs (a variant's: '<pipeline>-<variant>').")
    parser.add_argument(
        "--kind",
        choices=sorted(JOB_RESOURCES),
        default=job_kinds.DEFAULT_JOB_KIND,
        help="The jobs' kind (cluster.job_kind).",
    )
    parser.add_argument(
        "--experiments",
        action="store_true",
        help="Also delete the workflow's unfinished Katib Experiments (a pipeline with a hyperparameter search).",
    )
    args = parser.parse_args(argv)
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    if args.experiments:
        try:
            delete_running_experiments(args.namespace, args.workflow)
        except (ApiException, HTTPError, OSError, RuntimeError) as exc:
            reason = api_error(exc, EXPERIMENT_RESOURCE[2])
            print(
                f"error: could not delete the Katib Experiments of workflow {args.workflow} in namespace "
                f"{args.namespace}: {reason}",
                file=sys.stderr,
            )
            return 1
    try:
        deleted = delete_running_jobs(
            args.namespace, args.workflow, stage=args.stage, kind=args.kind, pipeline=args.pipeline
        )
    except (ApiException, HTTPError, OSError, RuntimeError) as exc:
        plural = JOB_RESOURCES[args.kind][2]
        what = f"the jobs of workflow {args.workflow}" + (f", stage {args.stage}" if args.stage else "")
        reason = api_error(exc, plural)
        print(f"error: could not delete {what} in namespace {args.namespace}: {reason}", file=sys.stderr)
        return 1
    if not deleted:
        print(f"no unfinished job of workflow {args.workflow}" + (f", stage {args.stage}" if args.stage else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
