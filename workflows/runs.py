"""The runs CLI: commands on runs, through the Argo server, the Kubernetes API and the run directories.

    python -m workflows.runs list [--pipeline P] [--phase Running|Succeeded|Failed|Error] [--limit N]
    python -m workflows.runs list [...] -o json|yaml                    # machine-readable
    python -m workflows.runs get NAME [-o json|yaml]
    python -m workflows.runs watch NAME [--interval SECONDS]
    python -m workflows.runs logs NAME [--stage S] [--rank R] [--follow] [--tail N]
    python -m workflows.runs stop NAME [--terminate] [--message M]
    python -m workflows.runs retry NAME [--restart-successful] [--node-field-selector S]
    python -m workflows.runs delete NAME
    python -m workflows.runs prune --keep-last N [--keep-days D] [--pipeline P] [--dry-run] [--checkpoints DIR]
    python -m workflows.runs sync-tracking runs/korean-llm-20260101-000000

The Argo server is configured as for `workflows.submit` (ARGO_SERVER, ARGO_TOKEN); the namespace is --namespace,
else ARGO_NAMESPACE, else the current kubeconfig context's, else posttrain (workflows/namespace.py); the Kubernetes
API (the training jobs, their pods' logs, the InferenceService) from the kubeconfig, or the pod's service account in
the cluster. `watch` follows a run as `submit --watch` does: exit 0 when it Succeeded, 1 when it Failed or Errored.
`stop` lets Argo run the exit handler, which deletes the run's unfinished training jobs; `stop --terminate` skips
exit handlers, so this command deletes them itself (`workflows.cleanup`), as `delete` does before it deletes the
workflow. `prune` deletes old run directories (workflows/retention.py says which it never deletes). `list` and
`get` print JSON or YAML with `-o json|yaml`: times in UTC (ISO 8601), durations in seconds.

`sync-tracking DIR` sends to MLflow what the stages of a run directory could not send during an outage (each
stage's `<stage>/logs/tracking-unsent.jsonl`) and ends the MLflow runs of stage attempts that died without
ending them (KILLED), so that no run of a finished stage stays RUNNING. It is safe to run any number of times,
also while a stage runs (that stage's journal is left to it). Exit status: 0 when everything got through, 1 when
something is still pending (the server is unreachable, or a process runs that stage), 2 when DIR is not a
run directory.

Every failure is one `error:` line: exit 2 for bad input, 1 when a server refused or could not be reached.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from run.names import PIPELINE_LABEL, RUN_ROOT, STAGE_LABEL
from workflows.namespace import DEFAULT_NAMESPACE, RULE, resolve_namespace

if TYPE_CHECKING:
    from hera.workflows.models import NodeStatus, Workflow

    from workflows.argo import ArgoClient
    from workflows.retention import Run

EXAMPLE = """example:
  python -m workflows.runs sync-tracking runs/korean-llm-20260101-000000
  MLFLOW_TRACKING_URI=https://mlflow.example.com python -m workflows.runs sync-tracking /mnt/checkpoints/runs/NAME

The tracking server is the run's own: spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the
local store its tracking.json names (mlflow.db beside the run directories)."""


EXIT_FAILED = 1
"""A server refused or could not be reached."""
EXIT_USAGE = 2
"""Bad input: an unknown workflow or stage, a bad option."""
OUTPUTS = ("json", "yaml")
"""The machine-readable formats of -o/--output (the default is the table)."""
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Error")
PHASE_LABEL = "workflows.argoproj.io/phase"
"""The label the workflow controller keeps at the workflow's phase (what --phase selects on)."""
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
STEP_CONTAINER = "main"
"""The container of a container step's pod that runs the stage (Argo's name for it)."""


class RunsError(Exception):
    """An expected failure: printed as one `error:` line, exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def parser() -> argparse.ArgumentParser:
    """The command line."""
    from workflows.commands import add_version_option

    p = argparse.ArgumentParser(
        prog="python -m workflows.runs",
        description="Commands on runs: list, inspect, follow, stop, retry and delete workflows; prune run "
        "directories; send unsent tracking records.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_option(p)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("-n", "--namespace", help=f"Namespace of the workflows (default: {RULE}).")
        return sub

    def output(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "-o", "--output", choices=OUTPUTS, help="Print JSON or YAML instead of the table (for scripts)."
        )

    listing = command("list", "List runs, newest first: phase, timing, progress and the stage each is in.")
    listing.add_argument("--pipeline", metavar="P", help="Only runs of pipeline P.")
    listing.add_argument("--phase", choices=PHASES, help="Only runs in this phase.")
    listing.add_argument("--limit", type=int, default=20, metavar="N", help="Show at most N runs (default 20).")
    output(listing)

    get = command("get", "A run's phase, message, stages, training jobs and Argo UI link.")
    get.add_argument("name", metavar="NAME", help="The workflow's name.")
    output(get)

    follow = command(
        "watch",
        "Follow a run until it ends, with the table `submit --watch` shows; exit 0 when it Succeeded, 1 when it "
        "Failed or Errored. Ctrl-C stops watching, not the run.",
    )
    follow.add_argument("name", metavar="NAME", help="The workflow's name.")
    follow.add_argument(
        "--interval", type=float, default=5.0, metavar="SECONDS", help="Seconds between polls (default 5)."
    )

    logs = command(
        "logs",
        "Print a run's pod logs: a training stage's from its job's pod (rank 0 unless --rank), any other stage's "
        "through the Argo server; without --stage every step pod's.",
    )
    logs.add_argument("name", metavar="NAME", help="The workflow's name.")
    logs.add_argument("--stage", metavar="S", help="The stage (prepare, cpt, sft, rlhf, evaluate, deploy, ...).")
    logs.add_argument("--rank", type=int, default=0, metavar="R", help="Training stages: the node rank (0: Master).")
    logs.add_argument("-f", "--follow", action="store_true", help="Keep printing as the pod writes.")
    logs.add_argument("--tail", type=int, metavar="N", help="Only the last N lines (of each pod).")

    stop = command(
        "stop",
        "Stop a run: steps get SIGTERM and the exit handler deletes its unfinished training jobs. --terminate "
        "skips exit handlers; this command then deletes the jobs itself.",
    )
    stop.add_argument("name", metavar="NAME", help="The workflow's name.")
    stop.add_argument("--terminate", action="store_true", help="Terminate: no exit handler runs.")
    stop.add_argument("--message", metavar="M", help="Why it was stopped (shown on the workflow).")

    retry = command("retry", "Retry a Failed or Errored run from its failed steps.")
    retry.add_argument("name", metavar="NAME", help="The workflow's name.")
    retry.add_argument(
        "--restart-successful", action="store_true", help="Also run again the succeeded steps the selector matches."
    )
    retry.add_argument(
        "--node-field-selector",
        metavar="SELECTOR",
        help="The steps to run again with --restart-successful, e.g. displayName=evaluate.",
    )

    delete = command("delete", "Delete a run's unfinished training jobs, then the workflow.")
    delete.add_argument("name", metavar="NAME", help="The workflow's name.")

    prune = command(
        "prune",
        "Delete old run directories under <checkpoints>/runs/, keeping the newest N per pipeline and never a run "
        "without a final state, the run whose model is champion or challenger, or one a serving revision uses.",
    )
    prune.add_argument("--keep-last", type=int, metavar="N", help="Keep the newest N runs of each pipeline.")
    prune.add_argument("--keep-days", type=float, metavar="D", help="Keep every run younger than D days.")
    prune.add_argument("--pipeline", metavar="P", help="Only runs of pipeline P.")
    prune.add_argument("--dry-run", action="store_true", help="Say what would be deleted; delete nothing.")
    prune.add_argument(
        "--checkpoints",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="The checkpoints volume (its runs/ folder is pruned); default: this directory (local runs/).",
    )
    prune.add_argument(
        "--current",
        metavar="RUN",
        help="The run doing the pruning, never deleted (default: $ARGO_WORKFLOW_NAME).",
    )
    prune.add_argument(
        "--served-uri",
        action="append",
        default=[],
        metavar="URI",
        help="A storage URI a server uses besides the InferenceServices read from the cluster (repeatable).",
    )

    sync = commands.add_parser(
        "sync-tracking",
        help="Send what the stages could not send to MLflow during an outage; end runs left RUNNING.",
        description="Send every stage's unsent MLflow records (<stage>/logs/tracking-unsent.jsonl) of a run\n"
        "directory, and end the MLflow runs of stage attempts that died (KILLED). Exit 0 when everything got\n"
        "through, 1 when something is still pending, 2 when DIR is not a run directory.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sync.add_argument("run_dir", metavar="DIR", type=Path, help="A run directory (the one holding spec.json).")
    return p


def sync_tracking_command(run_dir: Path) -> int:
    """Run `sync-tracking` on `run_dir` (`python -m stages sync-tracking`, stages/tracking_outbox.py, as a pod would
    run it), which prints what was sent and what is pending; returns its exit status."""
    if not (run_dir / "spec.json").is_file():
        what = "does not exist" if not run_dir.exists() else "has no spec.json"
        print(
            f"error: {run_dir} is not a run directory ({what}); give the directory a run was started in, "
            "e.g. runs/korean-llm-20260101-000000",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    command = [sys.executable, "-m", "stages", "sync-tracking", "--run-dir", str(run_dir)]
    return subprocess.run(command, check=False).returncode


# --------------------------------------------------------------------------- clients


def argo_client(args: argparse.Namespace) -> ArgoClient:
    """An ArgoClient from ARGO_* variables, in the namespace workflows/namespace.py picks."""
    from workflows.argo import ArgoClient, ArgoConfig, ArgoError

    namespace = resolve_namespace(args.namespace)
    try:
        return ArgoClient(ArgoConfig.from_env(namespace, {**os.environ, "ARGO_NAMESPACE": namespace}))
    except ArgoError as exc:
        raise RunsError(str(exc), EXIT_USAGE) from None


@contextmanager
def argo(args: argparse.Namespace) -> Iterator[ArgoClient]:
    """An open ArgoClient; its errors become RunsError (404: bad input, anything else: the server's fault)."""
    from workflows.argo import ArgoError

    client = argo_client(args)
    try:
        with client:
            yield client
    except ArgoError as exc:
        raise RunsError(str(exc), EXIT_USAGE if exc.status == 404 else EXIT_FAILED) from None


def kube_api_client() -> Any:
    """A kubernetes ApiClient from the kubeconfig ($KUBECONFIG, read now), else the pod's service account;
    RunsError when neither."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    path = (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
    try:
        return config.new_client_from_config(config_file=os.path.expanduser(path))
    except (ConfigException, OSError, TypeError) as kube_exc:
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            raise RunsError(
                f"cannot reach the Kubernetes API: no kubeconfig ({kube_exc}) and not running in a pod; set KUBECONFIG"
            ) from None
        return client.ApiClient(configuration)


def _kube_error(exc: Exception, what: str) -> RunsError:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status:
        hint = " (the identity lacks the RBAC verb for it)" if status == 403 else ""
        return RunsError(f"cannot {what}: the Kubernetes API answered {status} {reason}{hint}")
    return RunsError(f"cannot {what}: the Kubernetes API could not be reached ({type(exc).__name__})")


# --------------------------------------------------------------------------- reading a workflow


@dataclass(frozen=True)
class StageRow:
    """One top-level task of the pipeline's DAG."""

    name: str
    phase: str
    started: str
    duration: str
    message: str


def _phase(wf: Workflow) -> str:
    return (wf.status.phase if wf.status is not None else None) or "Pending"


def _nodes(wf: Workflow) -> dict[str, NodeStatus]:
    return (wf.status.nodes if wf.status is not None else None) or {}


def stage_nodes(wf: Workflow) -> list[NodeStatus]:
    """The DAG's own tasks (prepare, the stages, serve...), by start time: the nodes whose boundary is the
    workflow's root DAG node."""
    from workflows.watch import _time

    nodes = _nodes(wf)
    root = next((n.id for n in nodes.values() if n.name == wf.metadata.name), wf.metadata.name)
    tasks = [n for n in nodes.values() if n.boundary_id == root and n.id != root]
    far = datetime.max.replace(tzinfo=timezone.utc)
    return sorted(tasks, key=lambda n: (_time(n.started_at) or far, n.display_name or ""))


def stage_rows(wf: Workflow, now: datetime) -> list[StageRow]:
    """The table of `get`: one row per DAG task."""
    from workflows.watch import _duration, _started, _time

    return [
        StageRow(
            name=n.display_name or n.name or "",
            phase=n.phase or "Pending",
            started=_started(_time(n.started_at)),
            duration=_duration(_time(n.started_at), _time(n.finished_at), now),
            message=" ".join((n.message or "").split()),
        )
        for n in stage_nodes(wf)
    ]


def failed_at(wf: Workflow) -> str | None:
    """The first stage that failed (or errored), if any."""
    return next((n.display_name or "" for n in stage_nodes(wf) if n.phase in ("Failed", "Error")), None)


def current_stages(wf: Workflow) -> list[str]:
    """The stages running or waiting to start, by start time."""
    return [n.display_name or "" for n in stage_nodes(wf) if n.phase in ("Running", "Pending")]


def where(wf: Workflow) -> str:
    """The stage a run is in, or failed at: 'sft', 'failed at sft', '' when neither."""
    failed = failed_at(wf)
    return f"failed at {failed}" if failed is not None else ", ".join(current_stages(wf))


def job_names(wf: Workflow) -> list[str]:
    """The training jobs the run created, from the nodes' `job-name` outputs, in order of appearance."""
    names: list[str] = []
    for node in sorted(_nodes(wf).values(), key=lambda n: str(getattr(n.started_at, "root", n.started_at) or "")):
        for param in (node.outputs.parameters if node.outputs is not None else None) or []:
            if param.name == "job-name" and param.value and param.value not in names:
                names.append(str(param.value))
    return names


# --------------------------------------------------------------------------- machine-readable output


def _iso(moment: datetime | None) -> str | None:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if moment is not None else None


def _seconds(started: datetime | None, finished: datetime | None, now: datetime) -> int | None:
    return None if started is None else max(0, round(((finished or now) - started).total_seconds()))


def _timing(started_at: Any, finished_at: Any, now: datetime) -> dict[str, Any]:
    """started and finished (ISO 8601, UTC), duration_s (up to now while it runs)."""
    from workflows.watch import _time

    started, finished = _time(started_at), _time(finished_at)
    return {"started": _iso(started), "finished": _iso(finished), "duration_s": _seconds(started, finished, now)}


def run_record(wf: Workflow, now: datetime) -> dict[str, Any]:
    """One run as `list -o json|yaml` prints it: the table's columns as values (times in UTC, durations in
    seconds), `stage` the stages running or pending, `failed_at` the stage that failed."""
    status = wf.status
    return {
        "name": wf.metadata.name,
        "namespace": wf.metadata.namespace,
        "pipeline": (wf.metadata.labels or {}).get(PIPELINE_LABEL),
        "phase": _phase(wf),
        **_timing(status.started_at if status else None, status.finished_at if status else None, now),
        "progress": (status.progress if status is not None else None) or None,
        "stage": current_stages(wf),
        "failed_at": failed_at(wf),
    }


def run_detail(wf: Workflow, now: datetime, url: str) -> dict[str, Any]:
    """One run as `get -o json|yaml` prints it: its record, message, a row per stage, training jobs and UI link."""
    status = wf.status
    stages = [
        {
            "name": n.display_name or n.name or "",
            "phase": n.phase or "Pending",
            **_timing(n.started_at, n.finished_at, now),
            "message": " ".join((n.message or "").split()) or None,
        }
        for n in stage_nodes(wf)
    ]
    message = " ".join(((status.message if status is not None else None) or "").split()) or None
    return {**run_record(wf, now), "message": message, "stages": stages, "training_jobs": job_names(wf), "url": url}


def print_output(data: Any, output: str) -> None:
    """`data` as JSON or YAML on stdout."""
    import json

    import yaml

    if output == "json":
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))


# --------------------------------------------------------------------------- commands


def list_command(args: argparse.Namespace) -> int:
    """`list`: a table of runs, newest first."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from workflows.watch import _PHASE_STYLE, _duration, _started, _time

    if args.limit < 1:
        raise RunsError("--limit must be 1 or more", EXIT_USAGE)
    selector = [f"{PIPELINE_LABEL}={args.pipeline}"] if args.pipeline else [f"{PIPELINE_LABEL}"]
    if args.phase:
        selector.append(f"{PHASE_LABEL}={args.phase}")
    with argo(args) as client:
        workflows = client.list_workflows(",".join(selector))
        namespace = client.namespace
    now = datetime.now(timezone.utc)
    if args.output:
        print_output([run_record(wf, now) for wf in workflows[: args.limit]], args.output)
        if len(workflows) > args.limit:
            print(f"{len(workflows) - args.limit} older runs not shown (--limit)", file=sys.stderr)
        return 0
    table = Table(title=f"runs in {namespace}", title_justify="left")
    shown = workflows[: args.limit]
    # Names are what the other commands take: never shortened.
    table.add_column("name", no_wrap=True, min_width=max((len(wf.metadata.name or "") for wf in shown), default=4))
    for column in ("pipeline", "phase", "started (UTC)", "duration", "progress"):
        table.add_column(column, no_wrap=True)
    table.add_column("stage", overflow="fold")
    for wf in shown:
        status = wf.status
        started = _time(status.started_at) if status is not None else None
        finished = _time(status.finished_at) if status is not None else None
        phase = _phase(wf)
        table.add_row(
            wf.metadata.name or "",
            (wf.metadata.labels or {}).get(PIPELINE_LABEL, ""),
            Text(phase, style=_PHASE_STYLE.get(phase, "")),
            _started(started),
            _duration(started, finished, now),
            (status.progress if status is not None else None) or "",
            where(wf),
        )
    console = Console()
    if not workflows:
        console.print(f"no runs in {namespace}" + (f" of pipeline {args.pipeline}" if args.pipeline else ""))
        return 0
    console.print(table)
    if len(workflows) > args.limit:
        console.print(f"{len(workflows) - args.limit} older runs not shown (--limit)")
    return 0


def get_command(args: argparse.Namespace) -> int:
    """`get`: a run's phase, message, stages, jobs and UI link."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from workflows.watch import _PHASE_STYLE, _duration, _time

    with argo(args) as client:
        wf = client.get_workflow(args.name)
        url = client.ui_url(args.name)
    now = datetime.now(timezone.utc)
    if args.output:
        print_output(run_detail(wf, now, url), args.output)
        return 0
    status = wf.status
    phase = _phase(wf)
    started = _time(status.started_at) if status is not None else None
    finished = _time(status.finished_at) if status is not None else None
    console = Console()
    console.print(f"{wf.metadata.name}  {phase}  {_duration(started, finished, now)}".rstrip(), soft_wrap=True)
    pipeline = (wf.metadata.labels or {}).get(PIPELINE_LABEL)
    if pipeline:
        console.print(f"pipeline: {pipeline}", soft_wrap=True)
    if status is not None and status.message:
        console.print(f"message: {' '.join(status.message.split())}", soft_wrap=True)
    table = Table(title_justify="left")
    for column in ("stage", "phase", "started (UTC)", "duration"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="fold")
    for row in stage_rows(wf, now):
        table.add_row(
            row.name, Text(row.phase, style=_PHASE_STYLE.get(row.phase, "")), row.started, row.duration, row.message
        )
    console.print(table)
    jobs = job_names(wf)
    if jobs:
        console.print("training jobs: " + ", ".join(jobs), soft_wrap=True)
    console.print(url, soft_wrap=True)
    return 0


def watch_command(args: argparse.Namespace) -> int:
    """`watch`: follow a run with `submit --watch`'s table until it ends; 0 when it Succeeded, 1 otherwise."""
    from workflows.watch import watch

    if args.interval < 0:
        raise RunsError("--interval must be zero or more seconds", EXIT_USAGE)
    with argo(args) as client:
        client.get_workflow(args.name)  # an unknown run is one error line, before any table is drawn
        return watch(client, args.name, interval=args.interval)


def _training_job(api_client: Any, namespace: str, workflow: str, stage: str) -> str | None:
    """The newest PyTorchJob of a run's stage (a retried stage has one per attempt)."""
    from kubernetes import client

    from workflows.cleanup import JOB_KINDS, WORKFLOW_LABEL

    group, version, plural = JOB_KINDS[0]
    try:
        listed = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
            group, version, namespace, plural, label_selector=f"{WORKFLOW_LABEL}={workflow},{STAGE_LABEL}={stage}"
        )
    except Exception as exc:
        raise _kube_error(exc, f"list the {stage} jobs of {workflow}") from None
    jobs = sorted(
        listed.get("items") or [],
        key=lambda j: (j["metadata"].get("creationTimestamp") or "", j["metadata"]["name"]),
    )
    return jobs[-1]["metadata"]["name"] if jobs else None


def _training_logs(args: argparse.Namespace, namespace: str, job: str) -> None:
    """Print the log of one replica's pod of a PyTorchJob (rank 0: the Master)."""
    from kubernetes import client

    from workflows.pytorchjob import CONTAINER_NAME

    api_client = kube_api_client()
    core = client.CoreV1Api(api_client)
    replica = (
        [f"{REPLICA_TYPE_LABEL}=master"]
        if args.rank == 0
        else [
            f"{REPLICA_TYPE_LABEL}=worker",
            f"{REPLICA_INDEX_LABEL}={args.rank - 1}",
        ]
    )
    selector = ",".join([f"{JOB_NAME_LABEL}={job}", *replica])
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    except Exception as exc:
        raise _kube_error(exc, f"list the pods of job {job}") from None
    if not pods:
        raise RunsError(
            f"job {job} has no pod of rank {args.rank} (yet, or any more: cleanPodPolicy removes them once the job "
            "ends); `python -m workflows.runs get` shows the run's state",
            EXIT_USAGE,
        )
    pod = pods[0].metadata.name
    kwargs: dict[str, Any] = {"container": CONTAINER_NAME, "follow": args.follow, "_preload_content": False}
    if args.tail is not None:
        kwargs["tail_lines"] = args.tail
    try:
        response = core.read_namespaced_pod_log(pod, namespace, **kwargs)
        for chunk in response.stream():
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()
    except RunsError:
        raise
    except Exception as exc:
        raise _kube_error(exc, f"read the log of pod {pod}") from None


def logs_command(args: argparse.Namespace) -> int:
    """`logs`: a stage's pod logs (training stages: from the job's pod through the Kubernetes API)."""
    from spec.fields import TRAINING_STAGES

    if args.tail is not None and args.tail < 0:
        raise RunsError("--tail must be 0 or more", EXIT_USAGE)
    if args.rank < 0:
        raise RunsError("--rank must be 0 or more", EXIT_USAGE)
    with argo(args) as client:
        wf = client.get_workflow(args.name)  # an unknown run is reported before anything else
        if args.stage in TRAINING_STAGES:
            job = _training_job(kube_api_client(), client.namespace, args.name, args.stage)
            if job is None:
                raise RunsError(f"{args.name} has no {args.stage} job (yet): stage {args.stage} has not started", 2)
            print(f"==> {job} rank {args.rank} <==", file=sys.stderr)
            _training_logs(args, client.namespace, job)
            return 0
        if args.stage is not None:
            known = {n.display_name for n in stage_nodes(wf)}
            if args.stage not in known:
                shown = ", ".join(sorted(k for k in known if k)) or "none has started"
                raise RunsError(f"{args.name} has no stage {args.stage!r} (its stages: {shown})", EXIT_USAGE)
        selector = f"{STAGE_LABEL}={args.stage}" if args.stage else None
        pod = None
        for pod_name, line in client.workflow_logs(
            args.name, selector=selector, container=STEP_CONTAINER, follow=args.follow, tail_lines=args.tail
        ):
            if pod_name != pod:
                print(f"==> {pod_name} <==", file=sys.stderr, flush=True)
                pod = pod_name
            print(line, flush=True)
    return 0


def _delete_jobs(namespace: str, workflow: str) -> list[str]:
    """Delete the run's unfinished Katib Experiments (a search's trials go with them) and training jobs, PyTorchJobs
    and TrainJobs (whichever cluster.job_kind the run was compiled with; workflows.cleanup prints each). A cluster
    without the Katib or TrainJob CRD answers 404: none."""
    from kubernetes.client.exceptions import ApiException

    from workflows.cleanup import delete_running_experiments, delete_running_jobs

    api_client = kube_api_client()
    try:
        try:
            delete_running_experiments(namespace, workflow, api_client)
        except ApiException as exc:
            if exc.status != 404:
                raise
        deleted = delete_running_jobs(namespace, workflow, api_client)
        try:
            deleted += delete_running_jobs(namespace, workflow, api_client, kind="trainjob")
        except ApiException as exc:
            if exc.status != 404:
                raise
        return deleted
    except Exception as exc:
        raise _kube_error(exc, f"delete the unfinished training jobs of {workflow}") from None


def stop_command(args: argparse.Namespace) -> int:
    """`stop`: Argo's stop (the exit handler cleans up) or terminate (this command cleans up)."""
    from workflows.watch import FINAL_PHASES

    with argo(args) as client:
        phase = _phase(client.get_workflow(args.name))
        ns = client.namespace
        if phase in FINAL_PHASES:
            print(f"{args.name} already ended ({phase}); nothing to stop")
        elif args.terminate:
            if args.message:
                raise RunsError("--message goes with stop; Argo's terminate takes none", EXIT_USAGE)
            client.terminate_workflow(args.name)
            print(f"terminated {ns}/{args.name} (Argo runs no exit handler on terminate)")
        else:
            client.stop_workflow(args.name, args.message)
            print(f"stopping {ns}/{args.name}: its exit handler deletes its unfinished training jobs")
            return 0
    if args.terminate:
        deleted = _delete_jobs(ns, args.name)
        if not deleted:
            print(f"no unfinished training job of {args.name}")
    return 0


def retry_command(args: argparse.Namespace) -> int:
    """`retry`: Argo's retry of a Failed or Errored run."""
    if args.node_field_selector and not args.restart_successful:
        raise RunsError("--node-field-selector names succeeded steps to run again: add --restart-successful", 2)
    with argo(args) as client:
        phase = _phase(client.get_workflow(args.name))
        if phase not in ("Failed", "Error"):
            raise RunsError(f"{args.name} is {phase}: only a Failed or Errored run can be retried", EXIT_USAGE)
        client.retry_workflow(args.name, args.restart_successful, args.node_field_selector)
        print(f"retrying {client.namespace}/{args.name}")
        print(client.ui_url(args.name))
    return 0


def delete_command(args: argparse.Namespace) -> int:
    """`delete`: the run's unfinished jobs, then the workflow."""
    with argo(args) as client:
        client.get_workflow(args.name)  # an unknown run deletes nothing
        _delete_jobs(client.namespace, args.name)
        client.delete_workflow(args.name)
        print(f"deleted Workflow {client.namespace}/{args.name}")
    return 0


# --------------------------------------------------------------------------- prune


def _phases(pipeline: str | None, namespace: str) -> dict[str, str] | None:
    """Workflow name → phase (of the workflows in `namespace`) from the Argo server when ARGO_SERVER is set and it
    answers; else None (the stage records decide)."""
    from workflows.argo import ArgoClient, ArgoConfig, ArgoError

    if not os.environ.get("ARGO_SERVER"):
        return None
    selector = f"{PIPELINE_LABEL}={pipeline}" if pipeline else PIPELINE_LABEL
    try:
        with ArgoClient(ArgoConfig.from_env(namespace, {**os.environ, "ARGO_NAMESPACE": namespace})) as client:
            return {wf.metadata.name or "": _phase(wf) for wf in client.list_workflows(selector)}
    except ArgoError as exc:
        print(f"note: the Argo server did not answer ({exc}); the stage records decide which runs ended")
        return None


def _protections(runs: list[Run], served_extra: list[str]) -> tuple[dict[str, str], set[str]]:
    """The runs whose model is champion or challenger, and the storage URIs serving revisions use; per pipeline,
    from its newest run's spec (registered model, tracking server, namespace, service)."""
    from workflows.retention import alias_runs, served_uris

    aliased: dict[str, str] = {}
    served = set(served_extra)
    newest: dict[str, Run] = {}
    for run in runs:
        if run.pipeline not in newest or run.written > newest[run.pipeline].written:
            newest[run.pipeline] = run
    api_client: Any = None
    for pipeline, run in sorted(newest.items()):
        spec = run.spec
        deploy = (spec.get("stages") or {}).get("deploy") or {}
        uri = ((spec.get("tracking") or {}).get("mlflow_tracking_uri")) or os.environ.get("MLFLOW_TRACKING_URI")
        # Local runs share a store beside them (run.tracking.local_store_uri), when there is one.
        if not uri:
            from run.tracking import local_store_uri

            local = local_store_uri(run.path)
            uri = local if Path(local.removeprefix("sqlite:///")).is_file() else None
        if deploy.get("enabled", True) and uri:
            aliased.update(alias_runs(deploy.get("registered_model") or pipeline, uri))
        elif deploy.get("enabled", True):
            print(
                f"note: {pipeline}: no shared MLflow server (each run tracks into its own mlflow.db): aliases not read"
            )
        if deploy.get("enabled", True) and (deploy.get("serving") or {}).get("enabled", True):
            if api_client is None:
                try:
                    api_client = kube_api_client()
                except RunsError:
                    print(f"note: {pipeline}: no kubeconfig and not in a pod: the InferenceService was not read")
                    continue
            namespace = (spec.get("cluster") or {}).get("namespace") or DEFAULT_NAMESPACE
            served |= served_uris(namespace, pipeline, api_client)
    return aliased, served


def prune_command(args: argparse.Namespace) -> int:
    """`prune`: delete old run directories, saying for each run why it is kept or deleted."""
    from workflows import retention

    if args.keep_last is None and args.keep_days is None:
        raise RunsError("prune needs --keep-last N and/or --keep-days D", EXIT_USAGE)
    if args.keep_last is not None and args.keep_last < 1:
        raise RunsError("--keep-last must be 1 or more (the newest run is always kept)", EXIT_USAGE)
    if args.keep_days is not None and args.keep_days <= 0:
        raise RunsError("--keep-days must be more than 0", EXIT_USAGE)
    runs_root = args.checkpoints / RUN_ROOT
    if not runs_root.is_dir():
        raise RunsError(f"--checkpoints {args.checkpoints}: {runs_root} is not a directory of runs", EXIT_USAGE)
    for leftover in retention.leftovers(runs_root):
        if not args.dry_run:
            shutil.rmtree(leftover, ignore_errors=True)
            print(f"removed {leftover} (left by an interrupted prune)")
    runs = retention.find_runs(runs_root, args.pipeline)
    if not runs:
        print(f"no runs in {runs_root}" + (f" of pipeline {args.pipeline}" if args.pipeline else ""))
        return 0
    try:
        aliased, served = _protections(runs, args.served_uri)
    except retention.RetentionError as exc:
        raise RunsError(f"{exc}; nothing was deleted") from None
    decisions = retention.plan(
        runs,
        args.keep_last,
        args.keep_days,
        phases=_phases(args.pipeline, resolve_namespace(args.namespace)),
        aliased=aliased,
        served=served,
        current=args.current or os.environ.get("ARGO_WORKFLOW_NAME"),
    )
    deleted = 0
    for decision in decisions:
        name = decision.run.name
        if decision.keep:
            print(f"keep {name}: {decision.reason}")
        elif args.dry_run:
            print(f"would delete {name}: {decision.reason}")
        else:
            try:
                retention.delete_run(decision.run)
            except OSError as exc:
                raise RunsError(f"cannot delete {decision.run.path}: {exc.strerror or exc}") from None
            deleted += 1
            print(f"deleted {name}: {decision.reason}")
    kept = sum(d.keep for d in decisions)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(decisions) - kept if args.dry_run else deleted} of {len(decisions)} runs in {runs_root}")
    return 0


COMMANDS = {
    "list": list_command,
    "get": get_command,
    "watch": watch_command,
    "logs": logs_command,
    "stop": stop_command,
    "retry": retry_command,
    "delete": delete_command,
    "prune": prune_command,
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and do what it asks; returns the exit status."""
    p = parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words and not words[0].startswith("-") and words[0] not in (*COMMANDS, "sync-tracking"):
        from workflows.commands import unknown_command

        print(f"error: {unknown_command(words[0], [*COMMANDS, 'sync-tracking'])}", file=sys.stderr)
        return EXIT_USAGE
    args = p.parse_args(words)
    if args.command == "sync-tracking":
        return sync_tracking_command(args.run_dir)
    try:
        return COMMANDS[args.command](args)
    except RunsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
