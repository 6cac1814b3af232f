"""The evaluate stage's score cache: a model's numbers kept by what the model is and by what they were measured on.

A scheduled run of a pipeline trains a new candidate, but its base model is the one of the runs before it, and
its champion changes only when a candidate passes the gate. Measuring both again every run doubles or triples
evaluate's time (loading and scoring a 30B model is tens of minutes on a GPU) for numbers already known. With
`stages.evaluate.cache_scores`, evaluate files each part of a base model's or champion's measurement here and
reads it back in a later run with the same model and the same measurement, so such a run measures only the
candidate. The candidate is always measured.

An entry is one part of one model's measurement: 'heldout' (the perplexity numbers), 'lm_eval' (the harness
metrics) or 'generations' (the greedy answers to the prompts). It is filed under sha256 of (model identity, part,
key) as a JSON file in `.scores/` beside the pipeline's run directories (`runs/` locally, the runs folder on the
checkpoints volume in the cluster), written atomically, and read back only when its stored identity, part and key
equal the ones asked for. The key (built by the evaluate stage) holds everything else the numbers depend on: the
held-out rows' fingerprint, the tokenizer, the lm-eval tasks with their include folder's content and limit, the
prompts, the scoring length, dtype, device and the library versions. A measurement that failed is not filed.

A model's identity is what its weights are, by content, known before it loads:
- the champion: its model version's `posttrain.model_fingerprint` tag (deploy's content fingerprint of the files
  it registered);
- a base model built by `model.from_config`: the hash of that config (the build is seeded);
- a base model in a local folder: the folder's content fingerprint (one read of its files: 16 s for an 8B model
  on an H100 host), taken again only when a file's size, modification or change time or inode differs from when
  it was taken (as git's index does; a file rewritten gets a new change time, which nothing sets back);
- a base model by hub id: the commit of its snapshot in the local Hugging Face cache (a commit pins every file);
  a model not in that cache yet has no identity before it loads, so it is measured, and filed under the commit
  of the snapshot its loading downloaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from run.run_dir import write_json_atomic
from spec.model import ModelSpec

SCORES_DIR = ".scores"
PARTS = ("heldout", "lm_eval", "generations")
MODEL_FINGERPRINT_TAG = "posttrain.model_fingerprint"


@dataclass(frozen=True)
class Entry:
    """A part of a model's measurement read back from the cache, and the run that measured it."""

    value: Any
    run: str
    measured_at: str


class ScoreCache:
    """The entries beside a pipeline's run directories."""

    def __init__(self, runs_root: Path) -> None:
        self.root = runs_root / SCORES_DIR

    def _path(self, identity: str, part: str, key: dict[str, Any]) -> Path:
        blob = json.dumps({"model": identity, "part": part, "key": key}, sort_keys=True)
        return self.root / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"

    def lookup(self, identity: str, part: str, key: dict[str, Any]) -> Entry | None:
        """The entry for this model, part and key, or None (none filed, unreadable, or filed for another)."""
        path = self._path(identity, part, key)
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        same = stored.get("model") == identity and stored.get("part") == part and stored.get("key") == _plain(key)
        if not same or "value" not in stored:
            return None
        return Entry(value=stored["value"], run=str(stored.get("run", "")), measured_at=str(stored.get("at", "")))

    def store(self, identity: str, part: str, key: dict[str, Any], value: Any, run: str) -> Path:
        """File a part of a model's measurement (replacing an older entry for the same model, part and key)."""
        path = self._path(identity, part, key)
        write_json_atomic(
            path,
            {
                "model": identity,
                "part": part,
                "key": key,
                "value": value,
                "run": run,
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
            },
        )
        return path


def _plain(key: dict[str, Any]) -> Any:
    """The key as JSON reads it back (tuples become lists)."""
    return json.loads(json.dumps(key))


# --------------------------------------------------------------------------- identities


def champion_identity(tags: dict[str, str]) -> str | None:
    """The champion version's content fingerprint (deploy's tag), or None for a version registered without one."""
    return tags.get(MODEL_FINGERPRINT_TAG) or None


def base_identity(model: ModelSpec, cache: ScoreCache | None = None) -> str | None:
    """The spec's base model by content, or None when that is not known before it loads (see the module's
    docstring). With `cache`, a local folder's fingerprint is kept there with its files' stat."""
    if model.from_config is not None:
        config = json.dumps(model.from_config.model_dump(mode="json"), sort_keys=True)
        return f"from_config:sha256:{hashlib.sha256(config.encode()).hexdigest()}"
    folder = Path(model.name_or_path)
    if folder.is_dir():
        return f"folder:{folder_fingerprint(folder, cache)}"
    return hub_identity(model.name_or_path, model.revision)


def folder_fingerprint(folder: Path, cache: ScoreCache | None) -> str:
    """`model_fingerprint(folder)`, or the one `cache` kept for it while every file stats as it did then."""
    from stages.modeling import model_fingerprint

    def stats() -> dict[str, list[int]]:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return {
            f.relative_to(folder).as_posix(): [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            for f, st in ((f, f.stat()) for f in files)
        }

    if cache is None:
        return model_fingerprint(folder)
    folder = folder.absolute()
    memo = cache.root / "folders" / f"{hashlib.sha256(str(folder).encode()).hexdigest()}.json"
    before = stats()
    try:
        kept = json.loads(memo.read_text(encoding="utf-8"))
        if kept["path"] == str(folder) and kept["stat"] == before:
            return str(kept["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fingerprint = model_fingerprint(folder)
    if stats() == before:  # nothing changed while it was read
        write_json_atomic(memo, {"path": str(folder), "stat": before, "fingerprint": fingerprint})
    return fingerprint


def hub_identity(repo_id: str, revision: str | None) -> str | None:
    """'hub:<repo>@<commit>' of the snapshot the local Hugging Face cache holds for `revision`, or None."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a repo id at all
        return None
    return f"hub:{repo_id}@{Path(snapshot).name}"
