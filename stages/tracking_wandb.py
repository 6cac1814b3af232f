"""The W&B backend: a W&B run per stage, grouped by pipeline run, in the mode W&B's own variables choose."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spec.pipeline import PipelineSpec
from stages.contract import StageContext
from stages.tracking_backend import Breaker, TrackingBackend

WANDB_INIT_TIMEOUT_SECONDS = 20
"""How long W&B may take to start a run (its own default is 90 s); $WANDB_INIT_TIMEOUT overrides it. An
unreachable W&B server then costs one warning and this many seconds, not minutes."""


def _wandb_init_timeout() -> float:
    """$WANDB_INIT_TIMEOUT when it is a positive number, else WANDB_INIT_TIMEOUT_SECONDS."""
    try:
        value = float(os.environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return WANDB_INIT_TIMEOUT_SECONDS
    return value if value > 0 else WANDB_INIT_TIMEOUT_SECONDS


def wandb_logged_in() -> bool:
    """Whether W&B has an API key: $WANDB_API_KEY, or the entry `wandb login` wrote in ~/.netrc ($NETRC) for the
    server ($WANDB_BASE_URL, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"))
    except Exception:  # no readable netrc, or a W&B without this reader: no key known
        return False


def wandb_mode() -> str:
    """W&B's mode as its users set it: $WANDB_MODE (`disabled`, `offline`, `online`; W&B's old `dryrun` is offline,
    `run` online), else online when logged in (`wandb_logged_in`), else offline."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if mode in ("disabled", "offline", "online"):
        return mode
    return "online" if wandb_logged_in() else "offline"


def wandb_target(spec: PipelineSpec) -> tuple[str | None, str | None]:
    """(project, entity): $WANDB_PROJECT and $WANDB_ENTITY override spec.tracking.wandb_project and wandb_entity, as
    environment variables override settings everywhere in W&B. No project: W&B is off."""
    tracking = spec.tracking
    return (
        os.environ.get("WANDB_PROJECT") or tracking.wandb_project,
        os.environ.get("WANDB_ENTITY") or tracking.wandb_entity,
    )


class WandbBackend(TrackingBackend):
    """A W&B run per stage, grouped by pipeline run, in `wandb_mode()`."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.warn = warn
        self.breaker = Breaker("W&B", warn)
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> str | None:
        project, entity = wandb_target(self.ctx.spec)
        root = self.ctx.run_dir.root
        os.environ.setdefault("WANDB_SILENT", "true")
        mode = wandb_mode()
        if mode == "online" and not wandb_logged_in():
            self.warn("W&B: WANDB_MODE=online but no API key (WANDB_API_KEY or `wandb login`): logging offline")
            mode = "offline"
        run_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{root}#{self.ctx.stage}").hex[:16]
        try:
            import wandb

            self.run = wandb.init(
                project=project,
                entity=entity,
                group=root.name,
                job_type=self.ctx.stage,
                name=f"{root.name}/{self.ctx.stage}",
                id=run_id,
                resume="allow",
                dir=str(root),
                mode=mode,
                config=config,
                reinit="create_new",
                settings=wandb.Settings(
                    init_timeout=_wandb_init_timeout(),
                    # No console capture: "wrap" (W&B's default) patches the write method of the sys.stdout it
                    # finds, which in a stage is the masking stream, so it would see text before it is masked;
                    # "redirect" reads the file descriptors, which native code and child processes write to
                    # without masking. The stage's output is in its log (<stage>/logs/stage.log, the pod's log).
                    console="off",
                    # No git metadata: W&B keeps a remote's user name (a token in `https://<token>:x@host/...`)
                    # and can save a diff of uncommitted files. The commit is in the config (git_commit).
                    disable_git=True,
                    save_code=False,
                ),
            )
        except Exception as exc:
            self.breaker.failed("starting the run", exc)
            return None
        if mode == "online":
            return self.run.path if isinstance(self.run.path, str) else "/".join(self.run.path)
        return str(Path(self.run.dir).parent)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None or not self.breaker.ready():
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as exc:
            self.breaker.failed("logging", exc)

    def update_config(self, params: dict[str, str]) -> None:
        """Add settings to the run's config (a setting logged again takes the new value)."""
        if self.run is None:
            return
        try:
            self.run.config.update(params, allow_val_change=True)
        except Exception as exc:
            self.breaker.failed("updating the config", exc)

    def image(self, key: str, path: Path) -> None:
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({key: wandb.Image(str(path))})
        except Exception as exc:
            self.breaker.failed("logging an image", exc)

    def end(self, failed: bool) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=1 if failed else 0)
        except Exception as exc:
            self.breaker.failed("finishing the run", exc)
        self.run = None

    def close(self, status: str, parent_tags: dict[str, str] | None) -> None:
        self.end(failed=status != "FINISHED")
