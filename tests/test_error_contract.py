"""The error contract where a new user meets it (issue 20): a stage run before its inputs exist ends with one
`error:` line naming what is missing and the stage that makes it, exit 2, and writes nothing; the local runner's
resume command is the one the user typed (a pipeline by path stays a path, --profile and --set stay); and a SIGTERM
to `python -m workflows.submit ... --local` stops the stage with a checkpoint, a truthful stage.json and the resume
command, after which the same command resumes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_hpo import SEARCHED, TRIAL
from training_fixtures import make_run_dir, run_stages_cli, runner_env

import workflows.local as local
from run.exits import EXIT_RETRYABLE, EXIT_USAGE
from run.run_dir import LOCK_FILE, RunDir, StageResult, StageStatus, now, try_lock
from spec.loading import load_pipeline
from workflows import stage_process
from workflows.warm_starts import SWITCH, alive

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- a stage before its inputs


def _spec_only(*overrides: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        RunDir(root).write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *overrides]).spec)

    return setup


def _prepared(*overrides: str, records: dict[str, StageStatus] | None = None) -> Callable[[Path], None]:
    """A run directory as prepare leaves it (training_fixtures.make_run_dir), with stage records of `records`."""

    def setup(root: Path) -> None:
        run_dir = make_run_dir(root, overrides, n_text=40, n_chat=40)
        for stage, status in (records or {}).items():
            run_dir.write_result(StageResult(stage=stage, status=status, config_hash="0" * 64, started_at=now()))

    return setup


ONLY_SFT = ("stages.cpt.enabled=false", "stages.rlhf.enabled=false")
STAGE_CASES = [
    # (id, setup of the run directory, the stage's arguments, what the error line must name)
    ("prepare-no-spec", None, ["prepare"], ["spec.json is missing", "python -m workflows.submit"]),
    ("cpt-no-spec", None, ["cpt"], ["spec.json is missing", "run the prepare stage first"]),
    ("cpt-fresh", _spec_only(), ["cpt"], ["prepare/tokenizer", "python -m stages prepare"]),
    ("sft-fresh", _spec_only(), ["sft"], ["prepare/data/sft/train.jsonl", "python -m stages prepare"]),
    ("rlhf-fresh", _spec_only(), ["rlhf"], ["prepare/data/rlhf/train.jsonl", "python -m stages prepare"]),
    ("sft-before-cpt", _prepared(), ["sft"], ["output of cpt, which has not run", "python -m stages cpt"]),
    ("evaluate-fresh", _spec_only(), ["evaluate"], ["prepare/tokenizer is missing", "python -m stages prepare"]),
    (
        "evaluate-before-sft",
        _prepared(*ONLY_SFT),
        ["evaluate"],
        ["measures the output of sft, which has not run", "python -m stages sft"],
    ),
    (
        "evaluate-after-failed-sft",
        _prepared(*ONLY_SFT, records={"sft": "failed"}),
        ["evaluate"],
        ["output of sft, which is failed", "python -m stages sft"],
    ),
    ("deploy-fresh", _spec_only(), ["deploy"], ["evaluate's gate decision", "python -m stages evaluate"]),
    (
        "deploy-after-interrupted-evaluate",
        _prepared(*ONLY_SFT, records={"sft": "succeeded", "evaluate": "interrupted"}),
        ["deploy"],
        ["evaluate is interrupted", "python -m stages evaluate"],
    ),
    (
        "deploy-forced-after-failed-evaluate",
        _prepared(*ONLY_SFT, records={"sft": "succeeded", "evaluate": "failed", "deploy": "succeeded"}),
        ["deploy", "--force"],
        ["evaluate is failed", "python -m stages evaluate"],
    ),
    ("trial-fresh", _spec_only(*SEARCHED), ["sft", "--trial", "t-1", *TRIAL], ["prepare/tokenizer", "stages prepare"]),
    ("trial-no-spec", None, ["sft", "--trial", "t-1", *TRIAL], ["spec.json is missing"]),
    (
        "hpo-select-no-spec",
        None,
        ["hpo-select", "--stage", "sft", "--optimal-trial", "optimal.json"],
        ["spec.json is missing"],
    ),
]


def _tree(root: Path) -> dict[str, int]:
    """Every file and folder under `root`, with its modification time (what a refused stage must not change)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("setup", "args", "names"), [c[1:] for c in STAGE_CASES], ids=[c[0] for c in STAGE_CASES])
def test_a_stage_before_its_inputs_says_what_is_missing_and_writes_nothing(
    tmp_path: Path, setup: Callable[[Path], None] | None, args: list[str], names: list[str]
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    if setup is not None:
        setup(root)
    before = _tree(root)
    done = run_stages_cli([*args, "--run-dir", str(root)], cwd=tmp_path)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for name in names:
        assert name in lines[0]
    assert _tree(root) == before  # no lock, no record, no trial folder: nothing half-written


# --------------------------------------------------------------------------- the resume command


def test_the_resume_command_is_the_one_the_user_typed(tmp_path: Path) -> None:
    pipeline = tmp_path / "my pipeline.yaml"  # a path, with a space to quote
    pipeline.write_text((REPO / "workflows/pipelines/korean-llm.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    loaded = load_pipeline(str(pipeline), "local", ["stages.sft.training.max_steps=7"])
    typed = ["python", "-m", "workflows.submit", str(pipeline), "--local", "--profile", "local"]
    typed += ["--set=stages.sft.training.max_steps=7"]
    hint = local.rerun_hint(loaded, tmp_path / "run", "sft", typed)
    command = hint.splitlines()[1].strip()
    assert shlex.split(command) == [*typed, "--run-dir", str(tmp_path / "run")]
    assert "unknown pipeline" not in command and " korean-llm " not in command

    # Without the command line (run_local called from Python): the path as loaded, and a reminder of the --set.
    fallback = local.rerun_hint(loaded, tmp_path / "run", "sft").splitlines()[1]
    assert shlex.split(fallback.split("   (")[0])[3] == str(pipeline) and "same --set options" in fallback
    shipped = local.rerun_hint(load_pipeline("korean-llm", "local"), tmp_path / "run", "sft").splitlines()[1]
    assert shlex.split(shipped)[:5] == ["python", "-m", "workflows.submit", "korean-llm", "--local"]


def test_a_variant_is_resumed_as_a_variant() -> None:
    from spec.variants import select

    chosen = select(load_pipeline("qwen-multi", "local"), [])
    name, loaded = next(iter(chosen.items()))
    typed = ["python", "-m", "workflows.submit", "qwen-multi", "--local", "--set=data_version=v2"]
    hint = local.rerun_hint(loaded, Path("/runs/x"), "sft", typed).splitlines()[1]
    assert shlex.split(hint) == [*typed, "--variant", name, "--run-dir", "/runs/x"]


def test_submit_passes_the_command_line_as_typed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from workflows import submit

    seen: list[list[str] | None] = []
    monkeypatch.setattr(local, "run_local", lambda *args, resume=None, **options: seen.append(resume) or 0)
    pipeline = tmp_path / "mine.yaml"
    pipeline.write_text((REPO / "workflows/pipelines/korean-llm.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    argv = [str(pipeline), "--local", "--profile", "local", "--set", "data_version=v2", "--run-dir", "r", "--force"]
    assert submit.main(argv) == 0
    assert seen == [
        ["python", "-m", "workflows.submit", str(pipeline), "--local", "--profile", "local", "--set=data_version=v2"]
    ]


# --------------------------------------------------------------------------- stopping a stage


_STUBBORN = """
import json, signal, sys, time, subprocess
from pathlib import Path
from run.run_dir import RunDir, StageResult, hold_stage_lock, now

run_dir = RunDir(sys.argv[1])
hold_stage_lock(run_dir, "sft")
run_dir.write_result(StageResult(stage="sft", status="running", config_hash="0" * 64, started_at=now()))
signal.signal(signal.SIGTERM, lambda signum, frame: Path(sys.argv[2]).write_text("stage"))
helper = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[2] + ".helper"])
Path(sys.argv[2] + ".ready").touch()
while True:
    time.sleep(0.1)  # saves nothing, exits never: the runner must kill it
"""

_HELPER = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda signum, frame: Path(sys.argv[1]).write_text("helper"))
while True:
    time.sleep(0.1)
"""


def test_a_stage_that_does_not_stop_is_killed_after_its_grace_and_recorded_interrupted(tmp_path: Path) -> None:
    got = tmp_path / "got"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stage = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN, str(tmp_path), str(got), _HELPER], env=env, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not Path(f"{got}.ready").exists():
        assert time.monotonic() < deadline and stage.poll() is None, "the stage did not start"
        time.sleep(0.05)
    time.sleep(0.3)  # the helper's handler is set
    assert stage_process.stop_stage(stage, signal.SIGTERM, grace=2) == -signal.SIGKILL
    assert got.read_text() == "stage" and Path(f"{got}.helper").read_text() == "helper"  # the whole group got it
    assert RunDir(tmp_path).read_result("sft").status == "running"  # what the killed stage left
    stage_process.record_interrupted(tmp_path, "sft", "killed by the runner")
    result = RunDir(tmp_path).read_result("sft")
    assert (result.status, result.message) == ("interrupted", "killed by the runner") and result.ended_at
    handle, _ = try_lock(tmp_path / "sft" / LOCK_FILE, "test")  # the runner let go of the stage's lock
    assert handle is not None
    handle.close()


# --------------------------------------------------------------------------- SIGTERM to a real --local run

STEPS = 30
OPTIONS = [
    *(f"--set=stages.{s}.enabled=false" for s in ("cpt", "rlhf", "evaluate", "deploy")),
    "--set=tracking.wandb_project=null",
    f"--set=stages.sft.training.max_steps={STEPS}",
    "--set=stages.sft.training.save_steps=5",
    "--set=stages.sft.training.logging_steps=1",
]


def _runner_env(cwd: Path) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(cwd), "CUDA_VISIBLE_DEVICES": ""}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _runner(cwd: Path, log: Path, **extra_env: str) -> subprocess.Popen[str]:
    """`python -m workflows.submit ./my-pipeline.yaml --local --run-dir run` in `cwd`: the user's own pipeline file,
    by a relative path, prepare then a 30-step sft."""
    command = [sys.executable, "-m", "workflows.submit", "./my-pipeline.yaml", "--local", "--run-dir", "run", *OPTIONS]
    env = {**_runner_env(cwd), **extra_env}
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigterm_to_a_local_run_stops_the_stage_truthfully_and_the_printed_command_resumes(tmp_path: Path) -> None:
    (tmp_path / "my-pipeline.yaml").write_text(
        (REPO / "workflows/pipelines/korean-llm.yaml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    run_dir = RunDir(tmp_path / "run")
    # sft as a fresh process (warm starts off): tests/reliability/test_runner_interrupts.py stops a forked one
    first = _runner(tmp_path, tmp_path / "first.log", **{SWITCH: "0"})
    marker = run_dir.stage_dir("sft") / "checkpoints" / "checkpoint-5" / "COMPLETE"
    deadline = time.monotonic() + 400
    while not marker.is_file():
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "sft never reached its first checkpoint"
        time.sleep(0.1)
    stage_pid = int((run_dir.stage_dir("sft") / LOCK_FILE).read_text(encoding="utf-8").split()[1])
    assert alive(stage_pid) and stage_pid != first.pid

    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()
    output = (tmp_path / "first.log").read_text()
    assert not alive(stage_pid)  # no orphan left training
    result = run_dir.read_result("sft")
    assert result is not None and result.status == "interrupted" and "SIGTERM" in result.message
    saved = sorted(int(p.name.split("-")[1]) for p in run_dir.stage_dir("sft").glob("checkpoints/checkpoint-*"))
    assert saved and 5 <= saved[-1] < STEPS  # saved where the signal came, not at the end
    log = (run_dir.stage_dir("sft") / "logs" / "stage.log").read_text()
    assert "BrokenPipeError" not in log and "SIGTERM received: saving a checkpoint" in log
    assert "(warm start)" not in log.splitlines()[0]
    hint = next(line.strip() for line in output.splitlines() if "python -m workflows.submit" in line)
    command = shlex.split(hint)
    assert command[3:5] == ["./my-pipeline.yaml", "--local"] and command[-2:] == ["--run-dir", str(run_dir.root)]
    assert all(option in command for option in OPTIONS)

    # The printed command, as printed, resumes: prepare is a no-op, sft continues from its checkpoint (forked from
    # the tests' shared warm-start server this time).
    second = subprocess.run(
        [sys.executable, *command[1:]],
        cwd=tmp_path,
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    result = run_dir.read_result("sft")
    assert result is not None and result.status == "succeeded" and result.attempts == 2
    assert "done before" in second.stdout  # prepare
    resumed = (run_dir.stage_dir("sft") / "logs" / "stage.log").read_text().split("=====")[-1]
    assert result.extra["resumed_from"] == f"checkpoint-{saved[-1]}"
    assert f"step {saved[-1] + 1}/{STEPS}" in resumed and "step 1/" not in resumed


def test_the_runner_exit_codes_are_documented() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Failure behaviour", 1)[1].split("\n## ", 1)[0]
    assert str(128 + signal.SIGTERM) in section and str(128 + signal.SIGINT) in section
    assert str(EXIT_RETRYABLE) in section and "grace" in section
