"""The MLflow model registry as the stages read it: the registered model, its champion, its version tags."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from run.release import CHAMPION
from spec.pipeline import PipelineSpec

METRIC_TAG_PREFIX = "posttrain.metric."
"""Model version tags holding the metrics a version was gated with (written by deploy, read here)."""
HELDOUT_TAG = "posttrain.heldout_fingerprint"
"""Model version tag: the fingerprint of the held-out rows its perplexity was measured on (evaluate's
`heldout_fingerprint`, written by deploy)."""
EVALUATE_DATA_TAG = "posttrain.data.evaluate.fingerprint"
"""Model version tag: the fingerprint of evaluate's source data in the run that registered it (from prepare)."""


def registered_model_name(spec: PipelineSpec) -> str:
    """The MLflow registered model: deploy.registered_model, else the pipeline name."""
    return spec.stages.deploy.registered_model or spec.name


@dataclass
class Champion:
    """The registered model version under the `champion` alias, and the numbers it was gated with."""

    name: str
    version: str
    run_id: str | None
    metrics: dict[str, float]
    source: dict[str, str]  # metric -> where its value came from: 'tag', 'run' or 're-evaluated'
    tags: dict[str, str] = field(default_factory=dict)
    remeasured: dict[str, str] = field(default_factory=dict)  # metric -> why it was measured again


def registry_client(spec: PipelineSpec, run_root: Path) -> tuple[Any, str]:
    """An MLflow client for the tracking server and its model registry (the same URI), and that URI."""
    from mlflow import MlflowClient

    from run.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(spec, run_root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def find_champion(client: Any, name: str) -> Champion | None:
    """The champion version with its recorded metrics (tags first, then its run's metrics), or None when the
    registered model or the alias does not exist yet. Other registry errors propagate."""
    from mlflow.exceptions import MlflowException

    try:
        registered = client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    aliases = registered.aliases or {}
    if CHAMPION not in aliases:
        return None
    version = client.get_model_version(name, str(aliases[CHAMPION]))
    metrics: dict[str, float] = {}
    source: dict[str, str] = {}
    for key, value in (version.tags or {}).items():
        if key.startswith(METRIC_TAG_PREFIX):
            try:
                metrics[key.removeprefix(METRIC_TAG_PREFIX)] = float(value)
                source[key.removeprefix(METRIC_TAG_PREFIX)] = "tag"
            except ValueError:
                continue
    if version.run_id:
        try:
            run_metrics = client.get_run(version.run_id).data.metrics
        except MlflowException:
            run_metrics = {}
        for key, value in run_metrics.items():
            if key not in metrics:
                metrics[key], source[key] = float(value), "run"
    return Champion(
        name=name,
        version=str(version.version),
        run_id=version.run_id,
        metrics=metrics,
        source=source,
        tags=dict(version.tags or {}),
    )


def download_champion(client: Any, champion: Champion, dst: Path, tracking_uri: str) -> Path:
    """The champion's model files (safetensors, config, tokenizer), downloaded from the registry into `dst`."""
    import mlflow

    uri = client.get_model_version_download_uri(champion.name, champion.version)
    dst.mkdir(parents=True, exist_ok=True)
    path = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst), tracking_uri=tracking_uri)
    return registered_files(Path(path))  # an MLflow transformers model keeps its weights in model/


def registered_files(downloaded: Path) -> Path:
    """The model folder (config, safetensors weights, tokenizer) of a registered version downloaded to
    `downloaded`: an MLflow transformers model keeps its weights in `model/` and its tokenizer in
    `components/tokenizer/` (copied beside the weights here); a version registered as plain files is the folder."""
    weights = downloaded / "model"
    if not (downloaded / "MLmodel").is_file() or not weights.is_dir():
        return downloaded
    tokenizer = downloaded / "components" / "tokenizer"
    if tokenizer.is_dir():
        for path in tokenizer.iterdir():
            if path.is_file() and not (weights / path.name).exists():
                shutil.copy2(path, weights / path.name)
    return weights
