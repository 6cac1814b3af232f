"""The run directory's MLflow server: where it is, its experiment, the pipeline's parent run, the runs' tags."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from run.masking import mask_secrets, secret_values
from run.run_dir import write_json_atomic
from run.tracking import TRACKING_FILE, read_tracking_file, resolve_tracking_uri
from run.version import git_sha
from spec.credentials import looks_secret_name
from spec.pipeline import PipelineSpec

TRIAL_TAG = "posttrain.trial"
"""Tag of a search trial's MLflow run: the trial's name (its stage is in posttrain.stage)."""


BATCH = 1000  # MLflow log_batch limit for metrics
PARAM_BATCH = 100
MAX_PARAM_VALUE = 6000

# Short HTTP retries: a dead tracking server must cost seconds, not the minutes of MLflow's defaults.
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}


def redact_uri(uri: str) -> str:
    """A URI fit for logs: its userinfo (user:password@) and any other credential in it masked."""
    return mask_secrets(uri)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def clean_params(params: dict[str, Any], secrets: set[str] | None = None) -> dict[str, str]:
    """Params as MLflow accepts them (flat, string values, legal keys), without anything secret: a secret-looking
    name or a value holding a secret of the environment is left out, a credential-shaped part of a value (a URI's
    user:password@, a known key format) is masked."""
    secrets = secret_values() if secrets is None else secrets
    out = {}
    for key, value in flatten(params).items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if looks_secret_name(key) or any(s in text for s in secrets):
            continue
        safe_key = mask_secrets(re.sub(r"[^A-Za-z0-9_\-. /:]", "_", key)[:250], secrets)
        out[safe_key] = mask_secrets(text, secrets)[:MAX_PARAM_VALUE]
    return out


def run_tags(spec: PipelineSpec, run_root: Path) -> dict[str, str]:
    """Tags on every MLflow run of a pipeline run: pipeline, run dir, Argo workflow, git commit, image (masked)."""
    tags = {
        "posttrain.pipeline": spec.name,
        "posttrain.run": run_root.name,
        "posttrain.run_dir": str(run_root),
        "posttrain.data_version": spec.data_version,
        "posttrain.model": spec.model.name_or_path,
    }
    if spec.variant is not None:  # the variants of a pipeline share its experiment
        tags["posttrain.variant"] = spec.variant
    env = {
        "argo.workflow.name": "ARGO_WORKFLOW_NAME",
        "argo.workflow.uid": "ARGO_WORKFLOW_UID",
        "posttrain.image": "POSTTRAIN_IMAGE",
    }
    tags.update({tag: os.environ[var] for tag, var in env.items() if os.environ.get(var)})
    if sha := git_sha():
        tags["mlflow.source.git.commit"] = sha
    secrets = secret_values()
    return {key: mask_secrets(value, secrets)[:MAX_PARAM_VALUE] for key, value in tags.items()}


def now_ms() -> int:
    """The time in milliseconds since the epoch, as MLflow stamps metrics and ends runs."""
    return int(time.time() * 1000)


def _store_template() -> Path | None:
    """An empty MLflow database at the installed MLflow's newest schema, made once per MLflow version
    (`$XDG_CACHE_HOME/posttrain/mlflow-<version>-store.db`, else under ~/.cache); None where it cannot be made."""
    from importlib import metadata

    import sqlalchemy
    from mlflow.store.db import utils

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    template = Path(base) / "posttrain" / f"mlflow-{metadata.version('mlflow')}-store.db"
    if template.is_file():
        return template
    initialize = getattr(utils, "_initialize_tables", None)  # private: may go away
    if initialize is None:
        return None
    template.parent.mkdir(parents=True, exist_ok=True)
    building = template.with_suffix(f".{os.getpid()}.tmp")
    engine = sqlalchemy.create_engine(f"sqlite:///{building}")
    try:
        initialize(engine)  # the tables MLflow makes in an empty database: its migrations, all of them
        engine.dispose()
        building.replace(template)
    finally:
        engine.dispose()
        building.unlink(missing_ok=True)
    return template


def seed_local_store(database: Path) -> None:
    """A new local store (SQLite) starts as a copy of the cached empty database (`_store_template`) instead of
    running MLflow's schema migrations, about 2 s of CPU for every new store; MLflow adds its default experiment
    when it opens it, as in a store it made. Anything in the way (a read-only home, an existing file) leaves the
    store to MLflow."""
    if database.exists():
        return
    copy = database.with_name(f".{database.name}.{os.getpid()}.tmp")
    try:
        template = _store_template()
        if template is None:
            return
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, copy)
        os.link(copy, database)  # never over a store another process made in between
    except Exception:  # a faster start only: MLflow makes the store as it would without it
        pass
    finally:
        copy.unlink(missing_ok=True)


class MlflowServer:
    """The run directory's MLflow server: the client, the experiment, the pipeline's parent run and stage runs."""

    def __init__(self, spec: PipelineSpec, root: Path) -> None:
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.spec = spec
        self.root = Path(root)
        self.uri = resolve_tracking_uri(spec, self.root)
        self.experiment_name = spec.tracking.mlflow_experiment or spec.name
        self.client: Any = None
        self.experiment_id: str | None = None

    def _artifact_location(self) -> str | None:
        if self.uri.startswith("sqlite:///"):
            return (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").absolute().as_uri()
        return None

    def connect(self) -> Any:
        """The client, with the experiment looked up or created."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if self.client is None:
            if self.uri.startswith("sqlite:///"):
                seed_local_store(Path(self.uri.removeprefix("sqlite:///")))
            self.client = MlflowClient(tracking_uri=self.uri)
        if self.experiment_id is None:
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                try:
                    self.experiment_id = self.client.create_experiment(
                        self.experiment_name, artifact_location=self._artifact_location()
                    )
                except MlflowException:  # created by someone else in between
                    self.experiment_id = self.client.get_experiment_by_name(self.experiment_name).experiment_id
            else:
                self.experiment_id = experiment.experiment_id
        return self.client

    def exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True

    def parent(self, tags: dict[str, str], reopen: bool) -> str:
        """The pipeline run's parent run: the one `tracking.json` names when it is on this server (set RUNNING
        again with `reopen`: a stage starts), else a new one, written to `tracking.json`."""
        client = self.connect()
        shared = read_tracking_file(self.root).get("mlflow", {})
        parent = shared.get("parent_run_id")
        if parent and shared.get("experiment_id") == self.experiment_id and self.exists(parent):
            if reopen:
                client.update_run(parent, status="RUNNING")
            return parent
        pipeline_tags = {key: value for key, value in tags.items() if key != TRIAL_TAG}  # opened by a trial
        parent = client.create_run(
            self.experiment_id, run_name=self.root.name, tags={**pipeline_tags, "posttrain.kind": "pipeline"}
        ).info.run_id
        shared = {"experiment_id": self.experiment_id, "parent_run_id": parent, "tracking_uri": redact_uri(self.uri)}
        write_json_atomic(self.root / TRACKING_FILE, {**read_tracking_file(self.root), "mlflow": shared})
        return parent

    def create_stage_run(self, stage: str, config_hash: str, parent: str, tags: dict[str, str]) -> str:
        stage_tags = {
            **tags,
            "mlflow.parentRunId": parent,
            "posttrain.stage": stage,
            "posttrain.config_hash": config_hash,
        }
        name = f"{stage} trial {tags[TRIAL_TAG]}" if TRIAL_TAG in tags else stage
        return self.connect().create_run(self.experiment_id, run_name=name, tags=stage_tags).info.run_id

    def end_parent(self, parent: str, status: str, tags: dict[str, str], end_time: int | None = None) -> None:
        """Close the pipeline's parent run, tagged with why it ended."""
        for key, value in tags.items():
            self.client.set_tag(parent, key, mask_secrets(value)[:MAX_PARAM_VALUE])
        self.client.set_terminated(parent, status, end_time=end_time)


def log_to_pipeline_run(
    spec: PipelineSpec, run_root: Path, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str]
) -> str:
    """Log params, metrics (at step 0) and tags on the pipeline run's MLflow parent (opened when there is none yet);
    returns its id. Params the parent already has with the same value are not sent again; raises what MLflow
    raises (the caller decides whether tracking may fail it)."""
    from mlflow.entities import Metric, Param, RunTag

    server = MlflowServer(spec, run_root)
    client = server.connect()
    secrets = secret_values()
    parent = server.parent(run_tags(spec, run_root), reopen=False)
    have = client.get_run(parent).data.params
    fresh = {k: v for k, v in clean_params(params, secrets).items() if have.get(k) != v}
    stamp = now_ms()
    client.log_batch(
        parent,
        params=[Param(k, v) for k, v in fresh.items()],
        metrics=[Metric(k, float(v), stamp, 0) for k, v in metrics.items()],
        tags=[RunTag(k, mask_secrets(v, secrets)[:MAX_PARAM_VALUE]) for k, v in tags.items()],
    )
    return parent
