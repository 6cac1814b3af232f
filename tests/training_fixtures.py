"""A small run directory for the training-stage tests: the korean-llm `local` spec, a few hundred normalized
rows per stage (as prepare writes them) and the run's tokenizer (a byte-level BPE with the Qwen3 chat
template, built as prepare builds it)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import environment
import pytest
import stage_hooks
from warm_ranks import WARM_RANKS

from run.exits import die_with_runner
from run.names import METRICS_PORT_ENV
from run.run_dir import RunDir
from spec.document import SpecError
from spec.loading import load_pipeline
from stages.tokenizer import build_tokenizer, render_for_training
from stages.training import read_log_history
from stages.trials import METRICS_FILE_ENV
from workflows import warm_starts
from workflows.warm_starts import WarmProcess, WarmStarts

REPO = Path(__file__).resolve().parents[1]

_SUBJECTS = ["서울은", "부산은", "한국어는", "김치는", "한강은", "제주도는", "학생들은", "고양이는"]
_PREDICATES = ["아름답습니다", "크고 넓습니다", "오래되었습니다", "맛있습니다", "유명합니다", "조용합니다"]
_EXTRAS = ["오늘도", "언제나", "봄에는", "밤에는", "정말로", "아주"]


def sentence(rng: random.Random) -> str:
    """A short Korean sentence from a small grammar (learnable by a tiny model in a few steps)."""
    return f"{rng.choice(_EXTRAS)} {rng.choice(_SUBJECTS)} {rng.choice(_PREDICATES)}."


def text_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": " ".join(sentence(rng) for _ in range(rng.randint(2, 12)))} for _ in range(n)]


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "당신은 친절한 한국어 도우미입니다."}] if i % 2 else []
        for _ in range(1 + i % 3):
            subject = rng.choice(_SUBJECTS)
            messages.append({"role": "user", "content": f"{subject} 어떤가요?"})
            messages.append({"role": "assistant", "content": f"{subject} {rng.choice(_PREDICATES)}."})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def make_run_dir(
    root: Path,
    overrides: list[str] | tuple[str, ...] = (),
    n_text: int = 240,
    n_chat: int = 240,
) -> RunDir:
    """A run directory as prepare leaves it: spec.json, normalized data for cpt and sft, the tokenizer."""
    run_dir = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    overrides = ("tracking.wandb_project=null", *overrides)
    run_dir.write_spec(load_pipeline("korean-llm", profile="local", overrides=list(overrides)).spec)
    texts, chats = text_rows(n_text), chat_rows(n_chat)
    n_eval_text, n_eval_chat = max(1, n_text // 20), max(1, n_chat // 20)
    write_jsonl(root / "prepare/data/cpt/train.jsonl", texts[n_eval_text:])
    write_jsonl(root / "prepare/data/cpt/eval.jsonl", texts[:n_eval_text])
    write_jsonl(root / "prepare/data/sft/train.jsonl", chats[n_eval_chat:])
    write_jsonl(root / "prepare/data/sft/eval.jsonl", chats[:n_eval_chat])
    corpus = [render_for_training(row) for row in texts + chats]
    build_tokenizer(run_dir.load_spec(), corpus, root / "prepare/tokenizer")
    return run_dir


def checkpoint_run_dir(root: Path, architecture: str, overrides: list[str]) -> RunDir:
    """A run directory whose base model is a Hugging Face checkpoint on disk (safetensors, config, tokenizer) of
    `architecture` (the local profile's tiny shape, changed by `model.from_config.*` in `overrides`), its stages set
    by `overrides`."""
    from stages.modeling import build_from_config, load_tokenizer

    run_dir = make_run_dir(root, [f"model.from_config.architecture={architecture}", *overrides], n_text=24, n_chat=24)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    checkpoint = root / "checkpoint"
    build_from_config(spec.model, tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    model = spec.model.model_copy(update={"from_config": None, "name_or_path": str(checkpoint)})
    run_dir.write_spec(spec.model_copy(update={"model": model}))
    return run_dir


def write_tiny_model(root: Path) -> Path:
    """`root/model`: a tiny korean-llm model as deploy writes it (the local profile's config, built with a run's
    tokenizer and its qwen3 chat template, saved as safetensors with that tokenizer), for the real vLLM engine."""
    from stages.modeling import build_from_config, load_tokenizer

    run_dir = make_run_dir(root / "run", n_text=40, n_chat=40)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    build_from_config(spec.model, tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


def stage_script(directory: Path) -> Path:
    """A script that runs `python -m stages` with the test hooks (tests/stage_hooks.py); usable by torchrun."""
    path = directory / "run_stage.py"
    path.write_text(stage_hooks.script(), encoding="utf-8")
    return path


def stage_command(run_dir: RunDir, stage: str) -> list[str]:
    return [sys.executable, str(stage_script(run_dir.root)), stage, "--run-dir", str(run_dir.root)]


def runner_env(**extra: str) -> dict[str, str]:
    """The environment of a local runner started as a subprocess (`python -m workflows.submit ... --local`): the
    tests' own, so its stages fork from the worker's warm-start server (start_warm_server), without the test
    process's MLflow and W&B settings; `extra` sets variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE")}
    return {**env, **extra}


def child_env(base: dict[str, str] | None = None, **extra: str | None) -> dict[str, str]:
    """The environment of a stage child: this process's (or `base`), offline, W&B off; `extra` sets variables (None
    unsets)."""
    env = {**(os.environ if base is None else base), "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("WANDB_SERVICE", None)  # an in-process W&B test's service: a child must start its own
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


TORCHRUN_VARIABLES = (
    *("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME"),
    *("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"),
    *("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
)
"""What torchrun sets in each rank's environment."""

RUNTIME_VARIABLES = (
    *warm_starts.RUNTIME_VARIABLES,  # the local runner's: MLflow's, pytest's test name
    *stage_hooks.SWITCHES,
    METRICS_PORT_ENV,
    METRICS_FILE_ENV,  # a Katib trial's metrics file, opened when the trial reports
    "WANDB_MODE",  # W&B reads its settings when a run starts (wandb.init), not at import
    "WANDB_API_KEY",
    "WANDB_BASE_URL",
    "PYTEST_XDIST_WORKER",  # set in each pytest-xdist worker, whose runs share the controller's server
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_XDIST_TESTRUNUID",
    *TORCHRUN_VARIABLES,  # a warm rank's (tests/warm_ranks.py): read when the stage sets up its process group
)
"""Variables the stages (and the hooks) read when they run, never at import: a child whose environment differs
from the warm-start server's only in these is still forked from it."""

_warm: WarmStarts | None = None


TESTS_SERVER = "POSTTRAIN_TESTS_WARM_SERVER"
"""The socket of the server this test session started; pytest-xdist's workers inherit it from the controller."""


def start_warm_server() -> None:
    """Start the session's warm-start server, with the test hooks, listening on a socket that every local run of the
    tests finds in POSTTRAIN_WARM_SERVER (set here, before tests/environment.py takes the environment tests start
    with, which is the server's): the runs of `python -m workflows.submit --local` in a test's subprocess, those of
    `run_local` in the test process and the stages of run_stage/start_stage below fork from it instead of each
    importing torch, transformers, TRL, MLflow and W&B again. Called in the controller (or the only process) before
    pytest-xdist starts its workers, which take the controller's server; it ends with the controller."""
    started = os.environ.get(TESTS_SERVER)
    if started:  # a worker: the controller's
        os.environ[warm_starts.SERVER] = started
        return
    os.environ.pop(warm_starts.SERVER, None)  # a developer's own server has no test hooks
    if not warm_starts.wanted(0):
        return
    address = Path(tempfile.mkdtemp(prefix="posttrain-warm-")) / "server.sock"
    os.environ[warm_starts.SERVER] = os.environ[TESTS_SERVER] = str(address)
    own = sorted(set(RUNTIME_VARIABLES) - set(warm_starts.RUNTIME_VARIABLES))  # the hooks' switches, W&B's settings
    command = [*stage_hooks.server_command(), "--listen", str(address), *(f"--runtime-variable={n}" for n in own)]
    server = subprocess.Popen(
        command,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_runner(),  # the controller's end is the server's
    )

    def stop() -> None:
        server.terminate()  # it removes its socket
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        shutil.rmtree(address.parent, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 120
    while not address.exists():  # bound before its imports; a run that finds no socket would start its own
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the tests' warm-start server did not listen at {address} ({server.poll()})")
        time.sleep(0.05)


def _warm_starts(env: dict[str, str]) -> WarmStarts:
    """This worker's warm-start server (workflows/warm_starts.py) with the test hooks: the one every local run of
    the tests shares (start_warm_server), else one of its own started with the tests' stage environment."""
    global _warm
    if _warm is None:
        address = os.environ.get(warm_starts.SERVER)
        # connect waits for the server's ready message, which brings its environment: a stage started before it
        # came would be compared with an empty one and started as a fresh process.
        _warm = (address and warm_starts.connect(address, env)) or WarmStarts(
            env, RUNTIME_VARIABLES, server=stage_hooks.server_command()
        )
        atexit.register(_warm.close)
    return _warm


def _warm_start(
    run_dir: RunDir, stage: str, args: tuple[str, ...], env: dict[str, str | None], **how: Any
) -> WarmProcess | None:
    """The stage forked from this worker's server, as the local runner forks its stages; None where its environment
    differs from the server's in more than RUNTIME_VARIABLES (a test that changed os.environ)."""
    return _warm_command([stage, "--run-dir", str(run_dir.root), *args], env, **how)


def _warm_command(argv: list[str], env: dict[str, str | None], **how: Any) -> WarmProcess | None:
    """`python -m stages ARGV` forked from this worker's server, in this process's working directory; None where it
    must start as a fresh process (`_warm_start`)."""
    command = [sys.executable, "-m", "stages", *argv]
    stage = argv[0] if argv else ""
    # The environment tests start with (a test that started the server must not give it its own changes).
    server_env = {k: v for k, v in child_env(environment.baseline()).items() if k not in RUNTIME_VARIABLES}
    warm, stage_env = _warm_starts(server_env), child_env(**env)
    process = warm.start(command, stage_env, **how)
    if process is None and (log := os.environ.get(FRESH_LOG)):
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {stage} {warm.differences(stage_env)}\n")
    return process


FRESH_LOG = "POSTTRAIN_TESTS_FRESH_LOG"
"""A file to list each stage a test started as a fresh process instead of forking it, with the variables why: the
suite's time depends on how few there are."""


def _read_all(stream: Any, into: list[bytes]) -> threading.Thread:
    reader = threading.Thread(target=lambda: into.append(stream.read()), daemon=True)
    reader.start()
    return reader


def run_stage(run_dir: RunDir, stage: str, *args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run a stage to completion in a child process (`args`: more options, e.g. --force; `env`: variables to set,
    None to unset), forked from this worker's warm-start server where it can be, else a fresh process."""
    process = _warm_start(run_dir, stage, args, env, separate_stderr=True)
    if process is None:
        return subprocess.run(
            [*stage_command(run_dir, stage), *args], env=child_env(**env), capture_output=True, text=True, timeout=600
        )
    return _completed(process)


def run_stages_cli(
    argv: list[str], cwd: Path, timeout: float = 120, **env: str | None
) -> subprocess.CompletedProcess[str]:
    """`python -m stages ARGV` run to completion in `cwd` (`env`: variables to set, None to unset), forked from this
    worker's warm-start server where it can be, else a fresh process: for tests of what the command line says,
    returns and leaves, which are the same either way (tests/test_warm_starts.py)."""
    with contextlib.chdir(cwd):  # the server starts a forked stage in the requester's working directory
        process = _warm_command(argv, env, separate_stderr=True)
    if process is None:
        command = [sys.executable, "-m", "stages", *argv]
        return subprocess.run(command, cwd=cwd, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    return _completed(process, timeout)


def _completed(process: WarmProcess, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """A forked stage waited for (killed past `timeout`), with what it printed, as subprocess.run returns it."""
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [_read_all(process.stdout, out), _read_all(process.stderr, err)]
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    for reader in readers:
        reader.join(timeout=60)
    text = [b"".join(chunks).decode("utf-8", errors="replace") for chunks in (out, err)]
    return subprocess.CompletedProcess(process.args, returncode, text[0], text[1])


def start_stage(
    run_dir: RunDir, stage: str, log: Path | None = None, **env: str | None
) -> subprocess.Popen[str] | WarmProcess:
    """Start a stage in a child process, its output to `log` (by default a new log file in the run directory), forked
    from this worker's warm-start server where it can be."""
    log = log or run_dir.root / f"{stage}.{time.time_ns()}.log"
    with log.open("w") as out:
        process = _warm_start(run_dir, stage, (), env, output=out.fileno())
        if process is None:
            process = subprocess.Popen(
                stage_command(run_dir, stage), env=child_env(**env), stdout=out, stderr=subprocess.STDOUT, text=True
            )
    return process


def wait_for_file(path: Path, process: subprocess.Popen[str], timeout: float = 300) -> None:
    """Wait until `path` exists; fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the stage exited ({process.returncode}) before {path} appeared")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.05)


# --------------------------------------------------------------------------- preference data (rlhf)

EVAL_ROWS = 8  # two full batches of 4: TRL's mean of batch means is then the mean over rows


def preference_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Preference rows in prepare's normalized form: a Korean answer chosen; an English, garbled or cut-off one
    rejected."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        subject, predicate = rng.choice(_SUBJECTS), rng.choice(_PREDICATES)
        chosen = f"{subject} {predicate}."
        rejected = ["I do not know.", f"{predicate} {subject}", subject][i % 3]
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{subject} 어떤가요?"}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def make_preference_run_dir(root: Path, overrides: list[str], n_train: int = 64) -> RunDir:
    """A run directory as prepare leaves it (see training_fixtures.make_run_dir), with preference rows for rlhf."""
    run_dir = make_run_dir(root, overrides=overrides, n_text=40, n_chat=120)
    rows = preference_rows(n_train + EVAL_ROWS)
    write_jsonl(root / "prepare/data/rlhf/train.jsonl", rows[EVAL_ROWS:])
    write_jsonl(root / "prepare/data/rlhf/eval.jsonl", rows[:EVAL_ROWS])
    return run_dir


def grpo_settings(method: str, steps: int) -> list[str]:
    """rlhf's GRPO alone (cpt and sft off), full or LoRA: two completions a prompt of up to 32 tokens, scored by two
    built-in rewards; `steps` logged steps of 2 rows a process."""
    return [
        "stages.cpt.enabled=false",
        "stages.sft.enabled=false",
        f"stages.rlhf.method={method}",
        "stages.rlhf.algorithm=grpo",
        "stages.rlhf.num_generations=2",
        "stages.rlhf.reward_functions=[{name: hangul_ratio}, {name: format, weight: 0.5}]",
        "stages.rlhf.training.max_seq_length=64",
        f"stages.rlhf.training.max_steps={steps}",
        "stages.rlhf.training.logging_steps=1",
        "stages.rlhf.training.per_device_batch_size=2",
    ]


def run_ok(run_dir: RunDir, stage: str, **env: str) -> None:
    done = run_stage(run_dir, stage, **env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# --------------------------------------------------------------------------- W&B offline runs

_WANDB_BLOCK = 32768
_WANDB_HEADER = 7  # ":W&B", magic 0xBEE1, version


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's `.wandb` file (wandb's LevelDB-style log of protobuf `Record`s: blocks
    of 32 KiB, each record chunked with a 7-byte header: checksum, length, chunk type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = _WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _run_record(path: Path) -> Any:
    """The run record of an offline W&B file; None while W&B has not written it (or not even the header)."""
    try:
        return next((r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"), None)
    except AssertionError:  # the header is not written yet
        return None


def wandb_offline_runs(root: Path, wait_seconds: float = 60) -> list[dict[str, str]]:
    """Each offline W&B run under `<root>/wandb/`: its id, project, group, job type and name, as recorded. W&B's
    service writes the file in the background, even after `wandb.finish()` returns: wait up to `wait_seconds` for
    each run record."""
    runs = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        deadline = time.monotonic() + wait_seconds
        while (run := _run_record(path)) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert run is not None, f"{path}: no run record"
        runs.append(
            {
                "id": run.run_id,
                "project": run.project,
                "group": run.run_group,
                "job_type": run.job_type,
                "name": run.display_name,
                "dir": str(path.parent),
            }
        )
    return runs


def losses(run_dir: RunDir, stage: str) -> list[float]:
    """The training losses `stage` logged (its logs/log_history.json), step by step."""
    history = read_log_history(run_dir.stage_dir(stage) / "logs/log_history.json")
    return [entry["loss"] for entry in history if "loss" in entry]


def torchrun_stage(
    run_dir: RunDir, stage: str, processes: int = 2, hold_after_checkpoint: int | None = None, warm: bool = True
) -> subprocess.Popen[str]:
    """`stage` on `processes` processes of one node under torchrun, its output appended to
    `<run>/<stage>.torchrun.log`; paused after a checkpoint if asked (tests/stage_hooks.py). Each rank forks its stage
    from the tests' warm-start server (tests/warm_ranks.py) unless `warm` is False: then it is a fresh
    `python -m stages` process, as in the pod."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command += [str(stage_script(run_dir.root)), stage, "--run-dir", str(run_dir.root)]
    log = (run_dir.root / f"{stage}.torchrun.log").open("a")
    hold = str(hold_after_checkpoint) if hold_after_checkpoint else None
    env = child_env(OMP_NUM_THREADS="1", HOLD_AFTER_CHECKPOINT=hold, **{WARM_RANKS: "1" if warm else None})
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def preempt_after_checkpoint(run_dir: RunDir, stage: str, processes: int = 2, warm: bool = True) -> None:
    """Start `stage` on `processes` processes (two unless told) and stop it as a preempted pod is stopped (SIGTERM
    to torchrun, which passes it to the ranks) once checkpoint-2 is complete: the ranks save checkpoint-3 together,
    shards included, at the end of the next step and stop; stage.json says interrupted."""
    from stages.checkpoints import MARKER

    checkpoints = run_dir.stage_dir(stage) / "checkpoints"
    first = torchrun_stage(run_dir, stage, processes, hold_after_checkpoint=2, warm=warm)
    wait_for_file(checkpoints / "checkpoint-2" / MARKER, first)  # type: ignore[arg-type]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) != 0
    stopped = run_dir.read_result(stage)
    assert stopped is not None and stopped.status == "interrupted", stopped
    assert (checkpoints / "checkpoint-3" / MARKER).exists()  # saved by every rank at the end of the next step
    assert (checkpoints / "checkpoint-3" / "sharded").is_dir()  # the model's and optimizer's shards


def resume_sharded_run(
    run_dir: RunDir, stage: str, checkpoint: str, processes: int = 2, warm: bool = True, **sizes: int
) -> None:
    """Rerun `stage` on `processes` processes (two unless told) after it was stopped: it succeeds, resumed from
    `checkpoint`, with the model sharded in groups of `sizes` (distributed.json: tensor_parallel, expert_parallel,
    pipeline_parallel), not by accelerate's FSDP."""
    again = torchrun_stage(run_dir, stage, processes, warm=warm)
    assert again.wait(timeout=600) == 0, (run_dir.root / f"{stage}.torchrun.log").read_text()[-4000:]
    result = run_dir.read_result(stage)
    assert result is not None and result.status == "succeeded"
    assert result.extra["resumed_from"] == checkpoint
    written = json.loads((run_dir.stage_dir(stage) / "logs/distributed.json").read_text())
    assert {name: written[name] for name in sizes} == sizes and written["fsdp"] is None


def assert_trains_as_one(
    one: RunDir, split: RunDir, stage: str, steps: int, weights: str = "model.safetensors", atol: float = 1e-5
) -> None:
    """`split` (several processes) trained `stage` as `one` (one process) did on the same global batch: the same
    loss at every step and the same saved weights (`model/<weights>`), within float32 summation-order noise (`atol`
    for the weights)."""
    import torch
    from safetensors.torch import load_file

    a, b = losses(one, stage), losses(split, stage)
    assert len(a) == len(b) == steps, (a, b)
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)
    expected, got = (
        load_file(one.stage_dir(stage) / "model" / weights),
        folder_weights(split.stage_dir(stage) / "model", weights),
    )
    assert expected.keys() == got.keys()  # whole weights, in the layout one process saves
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=atol, msg=name)


SAVED = {"full": "model.safetensors", "lora": "adapter_model.safetensors"}
"""The weights file a stage's model folder holds, by training method."""


def assert_four_train_sft_as_one(root: Path, common: list[str], mesh: list[str], method: str = "full") -> RunDir:
    """sft (3 logged steps, full training or LoRA) on one process with 4 rows a step, and on 4 processes (torchrun)
    with 2 rows each and the `mesh` settings, each run with `common`: both succeed and train as one
    (`assert_trains_as_one`). Returns the 4-process run."""
    sft = [*common, "stages.cpt.enabled=false", f"stages.sft.method={method}", "stages.sft.training.max_steps=3"]
    sft.append("stages.sft.training.logging_steps=1")
    single = make_run_dir(root / "one", [*sft, "stages.sft.training.per_device_batch_size=4"], 10, 160)
    done = run_stage(single, "sft", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    split = make_run_dir(root / "four", [*sft, "stages.sft.training.per_device_batch_size=2", *mesh], 10, 160)
    process = torchrun_stage(split, "sft", processes=4)
    assert process.wait(timeout=900) == 0, (split.root / "sft.torchrun.log").read_text()[-4000:]
    assert_trains_as_one(single, split, "sft", steps=3, weights=SAVED[method])
    return split


def folder_weights(folder: Path, weights: str = "model.safetensors") -> dict[str, Any]:
    """A model folder's tensors: `weights`, or where the folder is sharded, every file its index names."""
    from safetensors.torch import load_file

    if (folder / weights).is_file():
        return load_file(folder / weights)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, Any] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors |= load_file(folder / name)
    assert tensors.keys() == index["weight_map"].keys()
    return tensors


def spec_error(pipeline: str, overrides: list[str]) -> str:
    """The message of the SpecError that loading `pipeline` with `overrides` raises (the test fails without one)."""
    with pytest.raises(SpecError) as caught:
        load_pipeline(pipeline, overrides=overrides)
    return str(caught.value)
