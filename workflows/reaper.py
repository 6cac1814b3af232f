"""Reaping the unfinished training jobs of ended workflows, so that a terminated run frees its GPUs too.

Argo runs no exit handler when a workflow is terminated (`argo terminate`, Terminate in the Argo UI), so the jobs it
created keep their GPUs. The kit's CronJob `posttrain-reaper` (manifests/base/reaper.yaml) runs this every few
minutes:

    python -m workflows.reaper --namespace NS [--dry-run]

It lists the namespace's Katib Experiments, PyTorchJobs and TrainJobs that carry the project's labels
(`app.kubernetes.io/part-of: posttrain` and `workflows.argoproj.io/workflow: <workflow>`) and have no verdict yet
(workflows/cleanup.py's `is_finished`), reads each of their workflows once, and deletes those whose workflow ended:
its phase is Succeeded, Failed or Error, its `status.finishedAt` is set, or the Workflow no longer exists. The jobs
of a pending or running workflow, jobs without the labels and finished jobs (left to their TTL and their owner
reference to the Workflow) stay. Experiments go first: Katib deletes their trials and the trials' jobs. A kind whose
CRD is not installed (its list answers 404) has nothing to delete.

Each deletion is one line, `deleted pytorchjob NS/NAME (workflow W ended: Failed)`; with `--dry-run`, `would
delete ...` and nothing is deleted. Exit status 0 (also when there was nothing to delete); 1 with one `error:`
line when the API refused or could not be reached (the next schedule tries again); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from run.names import PART_OF
from workflows import cleanup
from workflows.pytorchjob import WORKFLOW_LABEL
from workflows.watch import FINAL_PHASES

WORKFLOW_RESOURCE = ("argoproj.io", "v1alpha1", "workflows")
"""(group, version, plural) of Argo's Workflow."""

RESOURCES = (cleanup.EXPERIMENT_RESOURCE, *cleanup.JOB_RESOURCES.values())
"""What a workflow creates that holds GPUs, in the order the reaper deletes them (a search before its trials' jobs)."""

SELECTOR = f"app.kubernetes.io/part-of={PART_OF},{WORKFLOW_LABEL}"
"""The project's objects that a workflow created."""

NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ReaperError(Exception):
    """An API call failed: the one line that says which and why."""


@dataclass(frozen=True)
class Reaped:
    """One unfinished object of an ended workflow: deleted, or (dry run) to be deleted."""

    kind: str
    """The object's kind, lower case: pytorchjob, trainjob, experiment."""
    namespace: str
    name: str
    workflow: str
    ended: str
    """Why the workflow counts as ended: its phase, `finished at <time>`, or `deleted`."""

    def line(self, dry_run: bool = False) -> str:
        verb = "would delete" if dry_run else "deleted"
        return f"{verb} {self.kind} {self.namespace}/{self.name} (workflow {self.workflow} ended: {self.ended})"


def workflow_end(api_client: Any, namespace: str, workflow: str) -> str | None:
    """Why `workflow` counts as ended (its final phase, `finished at <time>`, or `deleted`); None while it is pending
    or running. A 404 counts as deleted only when the API server says that Workflow is not found, never when it does
    not serve Workflows at all."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    group, version, plural = WORKFLOW_RESOURCE
    try:
        wf = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            group, version, namespace, plural, workflow, _request_timeout=cleanup.REQUEST_TIMEOUT_S
        )
    except ApiException as exc:
        if exc.status == 404 and _not_found_name(exc) == workflow:
            return "deleted"
        if exc.status == 404:
            raise ReaperError(
                f"could not get workflow {namespace}/{workflow}: the Kubernetes API does not serve "
                f"{plural}.{group}/{version} (is Argo Workflows installed?)"
            ) from None
        reason = cleanup.api_error(exc, plural, "verb get")
        raise ReaperError(f"could not get workflow {namespace}/{workflow}: {reason}") from None
    status = wf.get("status") or {}
    if status.get("phase") in FINAL_PHASES:
        return str(status["phase"])
    if status.get("finishedAt"):
        return f"finished at {status['finishedAt']}"
    return None


def _not_found_name(exc: Any) -> str | None:
    """The object name a 404's Status names (`details.name`): absent when the resource itself is not served."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return None
    details = body.get("details") if isinstance(body, dict) else None
    return details.get("name") if isinstance(details, dict) else None


def _unfinished(api_client: Any, namespace: str) -> list[tuple[tuple[str, str, str], dict[str, Any]]]:
    """(resource, object) of every unfinished labelled object in `namespace`, in RESOURCES' order."""
    from kubernetes.client.exceptions import ApiException

    found = []
    for resource in RESOURCES:
        try:
            items = cleanup.list_unfinished(api_client, resource, namespace, SELECTOR)
        except ApiException as exc:
            if exc.status == 404:
                continue  # its CRD is not installed: none of that kind
            reason = cleanup.api_error(exc, resource[2], "verb list")
            raise ReaperError(f"could not list {resource[2]} in namespace {namespace}: {reason}") from None
        found += [(resource, item) for item in items if item["metadata"]["labels"].get(WORKFLOW_LABEL)]
    return found


def reap(namespace: str, api_client: Any = None, dry_run: bool = False) -> list[Reaped]:
    """Delete (with `dry_run`, only name) the unfinished training jobs and Experiments in `namespace` whose workflow
    ended; print one line each and return them. ReaperError when an API call fails."""
    from kubernetes.client.exceptions import ApiException

    api_client = api_client or cleanup.default_api_client()
    ended: dict[str, str | None] = {}
    reaped = []
    for resource, item in _unfinished(api_client, namespace):
        name, workflow = item["metadata"]["name"], item["metadata"]["labels"][WORKFLOW_LABEL]
        if workflow not in ended:
            ended[workflow] = workflow_end(api_client, namespace, workflow)
        if ended[workflow] is None:
            continue
        kind = str(item.get("kind") or resource[2].removesuffix("s")).lower()
        what = Reaped(kind, namespace, name, workflow, str(ended[workflow]))
        if not dry_run:
            try:
                if not cleanup.delete_object(api_client, resource, namespace, name):
                    continue  # deleted meanwhile (the exit handler, or Katib with its Experiment)
            except ApiException as exc:
                reason = cleanup.api_error(exc, resource[2], "verb delete")
                raise ReaperError(f"could not delete {kind} {namespace}/{name}: {reason}") from None
        print(what.line(dry_run), flush=True)
        reaped.append(what)
    return reaped


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m workflows.reaper", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", required=True, help="The namespace whose runs' jobs to reap.")
    parser.add_argument("--dry-run", action="store_true", help="Print what would be deleted; delete nothing.")
    args = parser.parse_args(argv)
    if not NAMESPACE.match(args.namespace):
        parser.error(f"--namespace {args.namespace!r} is not a namespace name")
    from urllib3.exceptions import HTTPError

    try:
        reap(args.namespace, dry_run=args.dry_run)
    except ReaperError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (HTTPError, OSError, RuntimeError) as exc:
        print(f"error: could not reap in namespace {args.namespace}: {cleanup.api_error(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
