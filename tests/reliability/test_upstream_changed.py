"""An upstream model that changed under a stage is refused: stages record their model folder's content fingerprint,
and the stage that loads it (here sft, from cpt's full model) holds it to that record on its first attempt, and to
what it loaded itself on a resumed attempt (its checkpoints were trained from that model). A refusal is one
`error:` line and exit 2, the record says failed and keeps the fingerprint the stage's checkpoints came from, and
nothing is trained; `--force` starts the stage over from the model that is there now."""

from __future__ import annotations

import subprocess
from pathlib import Path

import faults
import pytest
from safetensors.torch import load_file, save_file
from training_fixtures import make_run_dir

from run.exits import EXIT_USAGE
from run.run_dir import RunDir
from stages.modeling import model_fingerprint

pytestmark = pytest.mark.slow

OVERRIDES = [
    f"stages.{stage}.training.{key}={value}"
    for stage in ("cpt", "sft")
    for key, value in (("max_steps", 4), ("save_steps", 2), ("logging_steps", 1), ("eval_steps", "null"))
]


@pytest.fixture(scope="module")
def cpt_done(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A run directory in which cpt finished (full model) and sft has not started."""
    run_dir = make_run_dir(tmp_path_factory.mktemp("upstream") / "run", overrides=OVERRIDES, n_text=40, n_chat=40)
    done = faults.run(run_dir, "cpt")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def rewrite_weights(model_dir: Path) -> bytes:
    """Replace the model's weights with others (what a second writer leaves); returns the bytes from before."""
    weights = model_dir / "model.safetensors"
    before = weights.read_bytes()
    save_file({k: v + 0.01 for k, v in load_file(weights).items()}, weights)
    return before


def refused(done: subprocess.CompletedProcess[str], starts: str) -> str:
    """The stage exited 2 with one `error:` line (no traceback) starting with `starts`; returns that line."""
    assert done.returncode == EXIT_USAGE, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: {starts}"), errors
    assert "Traceback" not in done.stdout + done.stderr
    return errors[0]


def sft_checkpoints(run_dir: RunDir) -> list[str]:
    folder = run_dir.stage_dir("sft") / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("checkpoint-")) if folder.is_dir() else []


def test_a_model_changed_after_its_stage_recorded_it_is_refused(cpt_done: RunDir) -> None:
    run_dir = cpt_done
    cpt_model = run_dir.stage_dir("cpt") / "model"
    recorded = run_dir.read_result("cpt").extra["model_fingerprint"]
    assert recorded == model_fingerprint(cpt_model)
    original = rewrite_weights(cpt_model)
    try:
        line = refused(faults.run(run_dir, "sft"), "[sft] cpt/model changed after cpt recorded it: its files hash to ")
        assert f"cpt/stage.json records {recorded}" in line and "--force" in line
        result = run_dir.read_result("sft")
        assert result.status == "failed" and f"error: {result.message}" == line
        assert "model" not in result.inputs  # the changed model was never taken as an input
        assert sft_checkpoints(run_dir) == [] and not (run_dir.stage_dir("sft") / "model").exists()
    finally:
        (cpt_model / "model.safetensors").write_bytes(original)
    assert model_fingerprint(cpt_model) == recorded


def test_a_model_changed_while_the_stage_was_in_progress_is_refused(cpt_done: RunDir) -> None:
    run_dir = cpt_done
    cpt_model = run_dir.stage_dir("cpt") / "model"
    started_from = model_fingerprint(cpt_model)

    # sft starts from cpt's model and is killed after checkpoint-2.
    child = faults.start(run_dir, "sft", HOLD_AFTER_SAVE="2")
    faults.wait_held(run_dir, "after-save", 2, child)
    faults.sigkill(child)
    killed = run_dir.read_result("sft")
    assert killed.status == "running" and killed.inputs["model"].fingerprint == started_from

    # cpt's model is replaced, and cpt's record with it (cpt run again by hand): cpt's record alone would pass.
    rewrite_weights(cpt_model)
    cpt = run_dir.read_result("cpt")
    cpt.extra["model_fingerprint"] = now = model_fingerprint(cpt_model)
    run_dir.write_result(cpt)

    for _ in range(2):  # refused again on the next try: the record keeps what sft's checkpoints were trained from
        line = refused(faults.run(run_dir, "sft"), "[sft] cpt/model changed while sft was in progress: ")
        assert f"sft loaded {started_from} before, it is {now} now" in line and "--force" in line
        result = run_dir.read_result("sft")
        assert result.status == "failed" and result.inputs["model"].fingerprint == started_from
        assert sft_checkpoints(run_dir) == ["checkpoint-2"] and not (run_dir.stage_dir("sft") / "model").exists()

    # Forced, sft starts over from the model that is there now.
    done = faults.run(run_dir, "sft", "--force")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = run_dir.read_result("sft")
    assert result.status == "succeeded" and result.extra["resumed_from_step"] == 0
    assert result.inputs["model"].fingerprint == now and result.metrics["steps"] == 4
