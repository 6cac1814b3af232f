"""Retention of run directories: which runs under `<checkpoints>/runs/` prune deletes, and deleting them.

A run directory (`runs/<run>`, holding spec.json) is kept when any of these holds, else deleted:

- it is among the newest `keep_last` runs of its pipeline (by the time its spec.json was written), or younger than
  `keep_days`;
- it is the run doing the pruning (the workflow's own, ARGO_WORKFLOW_NAME, or the local runner's);
- it has no final state: its workflow's phase is not final (when the Argo server is asked), or, without a word from
  Argo, a stage record (`<stage>/stage.json`) says running, a local runner holds it, or its records do not show
  the run ended (every enabled stage succeeded or was skipped, a stage failed, prepare ended the run, or evaluate's
  gate kept deploy from running);
- its model is a registered `champion` or `challenger` (the MLflow model version's `posttrain.run` lineage tag,
  which deploy records, names the run);
- a serving revision uses its model (an InferenceService's storageUri, current or canary/previous, is the run's).

Deleting renames the directory aside first (`.deleting-<run>`), so a half-deleted directory never looks like a run,
then removes it; a `.deleting-*` left by an interrupted prune is removed by the next one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from run.names import RUN_ROOT

FINAL_PHASES = frozenset({"Succeeded", "Failed", "Error"})
"""Workflow phases after which nothing in the run directory changes."""
DELETING_PREFIX = ".deleting-"
ALIASES = ("champion", "challenger")
RUN_TAG = "posttrain.run"
"""The lineage tag deploy records on a model version: the run directory's name."""
RUN_DIR_TAG = "posttrain.run_dir"


class RetentionError(Exception):
    """What protects a run could not be read (registry or serving unreachable): nothing is deleted."""


@dataclass(frozen=True)
class Run:
    """A run directory and what its spec.json says."""

    name: str
    path: Path
    pipeline: str
    written: float
    """When spec.json was written (seconds since the epoch): the run's age."""
    spec: dict[str, Any]

    def storage_uris(self) -> set[str]:
        """Where this run's model would be served from (run/serving.py): the run directory on the
        checkpoints volume, and `<stages.deploy.storage_uri>/<run>` when the run published elsewhere."""
        claim = _get(self.spec, "cluster", "checkpoints", "claim_name")
        uris = {f"pvc://{claim}/{RUN_ROOT}/{self.name}/deploy/model"} if claim else set()
        prefix = _get(self.spec, "stages", "deploy", "storage_uri")
        if isinstance(prefix, str) and prefix:
            uris.add(f"{prefix.rstrip('/')}/{self.name}")
        return uris


@dataclass(frozen=True)
class Decision:
    """What prune does with one run, and why."""

    run: Run
    keep: bool
    reason: str


def _get(doc: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


# --------------------------------------------------------------------------- reading run directories


def find_runs(runs_root: Path, pipeline: str | None = None) -> list[Run]:
    """The run directories under `runs_root` (those with a readable spec.json), of `pipeline` when given, newest
    first."""
    runs = []
    if not runs_root.is_dir():
        return runs
    for path in runs_root.iterdir():
        spec_file = path / "spec.json"
        if path.name.startswith(".") or not spec_file.is_file():
            continue
        try:
            spec = json.loads(spec_file.read_text(encoding="utf-8"))
            written = spec_file.stat().st_mtime
        except (OSError, ValueError):
            continue
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or (pipeline is not None and name != pipeline):
            continue
        runs.append(Run(path.name, path, name, written, spec))
    return sorted(runs, key=lambda r: (r.written, r.name), reverse=True)


def _record(run: Run, stage: str) -> dict[str, Any] | None:
    try:
        record = json.loads((run.path / stage / "stage.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _runner_holds(run: Run) -> bool:
    """Whether a local runner holds the run directory (workflows/local.py's exclusive flock on `.runner.lock`)."""
    try:
        with open(run.path / ".runner.lock", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while the runner holds it
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES)
    return False


def unfinished(run: Run) -> str | None:
    """Why the run's records show no final state (None when they show it ended)."""
    from spec.fields import STAGE_ORDER

    if _runner_holds(run):
        return "a local runner is running it"
    enabled = [s for s in STAGE_ORDER if _get(run.spec, "stages", s, "enabled") is not False]
    records = {stage: _record(run, stage) for stage in enabled}
    for stage, record in records.items():
        if record is not None and record.get("status") == "running":
            return f"{stage} is running"
    for stage, record in records.items():
        if record is None:
            return f"{stage} has not recorded an outcome"
        status = record.get("status")
        extra = record.get("extra") or {}
        if status == "failed":
            return None  # a failed stage ends the run (a retry would record it running again)
        if status not in ("succeeded", "skipped"):
            return f"{stage} is {status}"
        if stage == "prepare" and extra.get("proceed") == "false":
            return None
        if stage == "evaluate" and extra.get("gate") not in (None, "pass"):
            return None  # deploy does not run
    return None


# --------------------------------------------------------------------------- what protects a run


def alias_runs(registered_model: str, tracking_uri: str, client: Any = None) -> dict[str, str]:
    """Run name → why it is kept, for the run of each model version the champion and challenger aliases point at."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    protected: dict[str, str] = {}
    for alias in ALIASES:
        try:
            version = client.get_model_version_by_alias(registered_model, alias)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                continue  # no such model or alias: nothing to protect
            raise RetentionError(
                f"cannot read alias {alias} of {registered_model} from MLflow at {_redacted(tracking_uri)}: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        except Exception as exc:  # the client raises requests' and sqlalchemy's errors as they come
            raise RetentionError(
                f"cannot reach MLflow at {_redacted(tracking_uri)} to read alias {alias} of {registered_model}: "
                f"{type(exc).__name__}"
            ) from None
        tags = version.tags or {}
        run = tags.get(RUN_TAG) or Path(tags.get(RUN_DIR_TAG, "")).name
        if run:
            why = f"its model is {registered_model} version {version.version}, alias {alias}"
            protected[run] = f"{protected[run]}; {why}" if run in protected else why
    return protected


def _redacted(uri: str) -> str:
    """The URI without user and password."""
    parts = urlsplit(uri)
    if parts.password is None and parts.username is None:
        return uri
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def served_uris(namespace: str, name: str, api_client: Any) -> set[str]:
    """The storageUris an InferenceService serves: its predictor's (the new or canary revision), and for each
    revision still named in its status (previous rolled-out revision, traffic targets) the one KServe stamped on
    that Knative revision. Empty when there is no such service."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api_client)
    try:
        isvc = custom.get_namespaced_custom_object("serving.kserve.io", "v1beta1", namespace, "inferenceservices", name)
    except ApiException as exc:
        if exc.status == 404:
            return set()
        raise RetentionError(
            f"cannot read InferenceService {namespace}/{name} ({exc.status} {exc.reason}): the serving model decides "
            "what must not be deleted"
        ) from None
    except Exception as exc:
        raise RetentionError(
            f"cannot reach the Kubernetes API to read InferenceService {namespace}/{name}: {type(exc).__name__}"
        ) from None
    predictor = _get(isvc, "spec", "predictor") or {}
    uris = {u for u in (_get(predictor, "model", "storageUri"), predictor.get("storageUri")) if isinstance(u, str)}
    status = _get(isvc, "status", "components", "predictor") or {}
    revisions = {status.get(k) for k in ("previousRolledoutRevision", "latestRolledoutRevision", "latestReadyRevision")}
    revisions |= {t.get("revisionName") for t in status.get("traffic") or [] if isinstance(t, dict)}
    for revision in sorted(r for r in revisions if isinstance(r, str) and r):
        try:
            obj = custom.get_namespaced_custom_object("serving.knative.dev", "v1", namespace, "revisions", revision)
        except ApiException as exc:
            if exc.status == 404:
                continue  # gone: it serves nothing
            raise RetentionError(
                f"cannot read Knative revision {namespace}/{revision} of InferenceService {name} ({exc.status} "
                f"{exc.reason}): it may still serve an older run's model"
            ) from None
        uri = _get(obj, "metadata", "annotations", "serving.kserve.io/storage-initializer-sourceuri")
        if isinstance(uri, str):
            uris.add(uri)
    return uris


# --------------------------------------------------------------------------- deciding and deleting


def plan(
    runs: Iterable[Run],
    keep_last: int | None,
    keep_days: float | None = None,
    *,
    phases: Mapping[str, str] | None = None,
    aliased: Mapping[str, str] | None = None,
    served: Iterable[str] = (),
    current: str | None = None,
    now: datetime | None = None,
) -> list[Decision]:
    """What to do with each run, per pipeline newest first. `phases`: workflow name → phase, of the workflows the
    Argo server knows (None when not asked); `aliased`: run name → why its model is registered; `served`: the
    storageUris serving revisions use; `current`: the run doing the pruning."""
    moment = (now or datetime.now(timezone.utc)).timestamp()
    served_set = {u.rstrip("/") for u in served}
    by_pipeline: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (r.written, r.name), reverse=True):
        by_pipeline.setdefault(run.pipeline, []).append(run)
    decisions = []
    for pipeline_runs in by_pipeline.values():
        for index, run in enumerate(pipeline_runs):
            reason = _keep_reason(run, index, keep_last, keep_days, moment, phases, aliased or {}, served_set, current)
            decisions.append(Decision(run, reason is not None, reason or _delete_reason(index, keep_last, keep_days)))
    return decisions


def _keep_reason(
    run: Run,
    index: int,
    keep_last: int | None,
    keep_days: float | None,
    moment: float,
    phases: Mapping[str, str] | None,
    aliased: Mapping[str, str],
    served: set[str],
    current: str | None,
) -> str | None:
    if run.name == current:
        return "it is the run doing the pruning"
    if keep_last is None and keep_days is None:
        return "no retention limit is set"
    if keep_last is not None and index < keep_last:
        return f"one of the newest {keep_last}"
    age_days = (moment - run.written) / 86400
    if keep_days is not None and age_days < keep_days:
        return f"younger than {keep_days:g} days ({age_days:.1f})"
    phase = (phases or {}).get(run.name)
    if phase is not None and phase not in FINAL_PHASES:
        return f"its workflow is {phase}"
    if phase is None and (why := unfinished(run)) is not None:
        return f"no final state: {why}"
    if run.name in aliased:
        return aliased[run.name]
    if uris := sorted(run.storage_uris() & served):
        return f"a serving revision uses its model ({uris[0]})"
    return None


def _delete_reason(index: int, keep_last: int | None, keep_days: float | None) -> str:
    parts = []
    if keep_last is not None:
        parts.append(f"number {index + 1} by age, beyond the newest {keep_last}")
    if keep_days is not None:
        parts.append(f"older than {keep_days:g} days")
    return " and ".join(parts)


def delete_run(run: Run) -> None:
    """Rename the run directory aside (it stops being a run at once), then remove it."""
    aside = run.path.with_name(f"{DELETING_PREFIX}{run.name}-{os.getpid()}")
    run.path.rename(aside)
    shutil.rmtree(aside)


def leftovers(runs_root: Path) -> list[Path]:
    """Directories an interrupted prune renamed aside and did not finish removing."""
    if not runs_root.is_dir():
        return []
    return sorted(p for p in runs_root.iterdir() if p.name.startswith(DELETING_PREFIX) and p.is_dir())
