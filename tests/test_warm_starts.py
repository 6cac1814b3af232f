"""Warm starts (stages/warm.py, workflows/warm_starts.py): a stage forked from a local run's server says, writes and
exits what a fresh `python -m stages` process does; whatever the server cannot take starts the usual way. The
runner's use of it is checked end to end by tests/test_local_dag.py (every stage forked) and by the
interrupt tests (tests/reliability/test_runner_interrupts.py: SIGTERM and SIGKILL of the runner)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.warm import bind, follow_current_streams, same_user
from workflows.warm_starts import (
    RUNTIME_VARIABLES,
    SERVER,
    SWITCH,
    WarmStarts,
    _close_kept,
    alive,
    connect,
    wanted,
    warm_starts,
)

REPO = Path(__file__).resolve().parents[1]
SECRET = "hf_warmstartsecret123"


def stage_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "HF_TOKEN": SECRET, **extra})
    return env


@pytest.fixture(scope="module")
def server() -> Iterator[WarmStarts]:
    """A connection to the tests' shared server (training_fixtures.start_warm_server), as a local run makes one; its
    stages may differ from the server in HF_TOKEN (see env_of)."""
    starts = WarmStarts({}, {*RUNTIME_VARIABLES, "HF_TOKEN"}, address=os.environ[SERVER])
    assert starts._ready.wait(120), starts.error
    yield starts
    starts.close()


def env_of(starts: WarmStarts) -> dict[str, str]:
    """The server's environment with SECRET as HF_TOKEN: what the stages below run with."""
    return {**starts.env, "HF_TOKEN": SECRET}


def warm_run(starts: WarmStarts, argv: list[str]) -> tuple[int, str]:
    process = starts.start([sys.executable, "-m", "stages", *argv], env_of(starts))
    assert process is not None, starts.error
    output = process.stdout.read().decode("utf-8")
    return process.wait(timeout=120), output


def cold_run(env: dict[str, str], argv: list[str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "stages", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120
    )
    return done.returncode, done.stdout.decode("utf-8")


@pytest.mark.parametrize(
    "argv",
    [
        ["sft", "--run-dir", "{tmp}/none"],  # no spec: one error line, exit 2
        ["deploy", "--run-dir", "{tmp}/" + SECRET],  # the same, with a secret in the path it names: masked
        ["nosuchstage", "--run-dir", "{tmp}"],  # argparse: usage, exit 2
        ["--help"],
    ],
    ids=["missing-spec", "secret-masked", "bad-stage", "help"],
)
def test_a_forked_stage_says_and_exits_what_a_fresh_process_does(
    server: WarmStarts, tmp_path: Path, argv: list[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    warm = warm_run(server, argv)
    assert warm == cold_run(env_of(server), argv)
    assert SECRET not in warm[1] and warm[1].strip()
    if argv[0] in ("sft", "deploy"):
        assert warm[0] == 2 and warm[1].startswith("error: ") and len(warm[1].splitlines()) == 1


def test_stages_forked_one_after_another_are_separate_processes(server: WarmStarts, tmp_path: Path) -> None:
    first = server.start([sys.executable, "-m", "stages", "--help"], env_of(server))
    second = server.start([sys.executable, "-m", "stages", "--help"], env_of(server))
    assert first is not None and second is not None and first.pid != second.pid
    assert os.getpid() not in (first.pid, second.pid)
    for process in (first, second):
        process.stdout.read()
        assert process.wait(timeout=60) == 0 and process.poll() == 0


def test_other_commands_and_environments_start_the_usual_way(server: WarmStarts) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--module", "stages", "sft"]
    assert server.start(torchrun, env_of(server)) is None
    assert server.start([sys.executable, "-m", "stages", "--help"], {**env_of(server), "HF_HUB_OFFLINE": "0"}) is None


def test_a_server_that_cannot_import_leaves_every_stage_to_start_the_usual_way(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n", encoding="utf-8")
    env = stage_env(PYTHONPATH=f"{broken.parent}{os.pathsep}{REPO}")
    starts = WarmStarts(env)
    try:
        assert starts.start([sys.executable, "-m", "stages", "--help"], env) is None
        assert "a broken install" in starts.error
    finally:
        starts.close()
    assert starts._server.returncode is not None
    # the same, listening: one error line, exit 1, its socket gone (runners that connect start their own servers)
    address = tmp_path / "warm.sock"
    listening = subprocess.run(
        [sys.executable, "-m", "stages.warm", "--listen", str(address)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listening.returncode == 1 and not address.exists(), listening.stderr
    assert listening.stderr.startswith("error: the warm-start server could not import: ") and "a broken install" in (
        listening.stderr
    )
    assert len(listening.stderr.splitlines()) == 1


def test_warm_starts_are_for_local_runs_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH, raising=False)
    assert wanted(0) and not wanted(1)
    monkeypatch.setenv(SWITCH, "0")
    assert not wanted(0)


def test_log_handlers_the_imports_made_write_where_the_stage_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # A library's handler, made in the server, holds the server's sys.stderr; the stage replaces sys.stderr with its
    # masking stream (stages/__main__.py), which the handler must then write through.
    logger = logging.getLogger("posttrain.tests.warm")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        follow_current_streams()
        written: list[str] = []

        class Stream:
            def write(self, text: str) -> int:
                written.append(text)
                return len(text)

            def flush(self) -> None:
                pass

        monkeypatch.setattr(sys, "stderr", Stream())
        logger.warning("through the stage's stream")
        assert "".join(written) == "through the stage's stream\n"
    finally:
        logger.removeHandler(handler)


def test_a_stage_may_have_its_stderr_apart(server: WarmStarts, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "stages", "sft", "--run-dir", str(tmp_path / "none")]
    process = server.start(command, env_of(server), separate_stderr=True)
    assert process is not None and process.stderr is not None
    out, err = process.stdout.read().decode(), process.stderr.read().decode()
    assert process.wait(timeout=60) == 2
    cold = subprocess.run(command, env=env_of(server), capture_output=True, text=True, timeout=120)
    assert (out, err) == (cold.stdout, cold.stderr) and err.startswith("error: ") and out == ""


def test_a_stage_may_differ_from_the_server_only_in_variables_read_when_it_runs(
    server: WarmStarts, tmp_path: Path
) -> None:
    # The tests' fault switches are such variables (tests/stage_hooks.py); here a secret, which the stage reads when
    # it masks its output: the child must mask the request's value, not the server's.
    other = "hf_otherwarmsecret456"
    env = env_of(server)
    command = [sys.executable, "-m", "stages", "deploy", "--run-dir", str(tmp_path / other)]
    log = tmp_path / "deploy.log"
    with log.open("wb") as out:
        process = server.start(command, {**env, "HF_TOKEN": other}, output=out.fileno())
    assert process is not None and process.stdout is None, server.error
    assert process.wait(timeout=60) == 2
    said = log.read_text(encoding="utf-8")
    assert said.startswith("error: ") and other not in said and "***" in said
    assert server.start(command, {**env, "HF_HUB_OFFLINE": "0"}) is None  # read at import: not forked


def test_the_next_local_run_of_a_process_forks_from_the_server_the_last_one_left_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv(SERVER, raising=False)  # no server that runs share: each runner process has its own
    env = stage_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}")
    try:
        with warm_starts(env, 0) as first:
            assert first is not None
            process = first.start([sys.executable, "-m", "stages", "--help"], env)  # once its imports are done
            assert process is not None and process.stdout.read() and process.wait(timeout=60) == 0
        # Another run root (its own MLflow store) in another working directory: the same server, the run's own
        # store and directory in the stage.
        monkeypatch.chdir(tmp_path)
        other = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'second' / 'mlflow.db'}"}
        with warm_starts(other, 0) as second:
            assert second is first
            process = second.start([sys.executable, "-m", "stages", "deploy", "--run-dir", "relative"], other)
            assert process is not None
            said = process.stdout.read().decode()
            assert process.wait(timeout=60) == 2 and f"{tmp_path / 'relative' / 'spec.json'} is missing" in said
        with warm_starts({**env, "HF_HUB_OFFLINE": "0"}, 0) as third:  # read at import: a server of its own
            assert third is not first and first._server.poll() is not None
    finally:
        _close_kept()


def blocking_stage(tmp_path: Path) -> list[str]:
    """A stage command that runs until it is stopped: hpo-select waits to open a FIFO that nothing writes."""
    from test_hpo import SEARCHED

    from run.run_dir import RunDir
    from spec.loading import load_pipeline

    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.write_spec(load_pipeline("korean-llm", "local", SEARCHED).spec)
    fifo = tmp_path / "optimal-trial.json"
    os.mkfifo(fifo)
    argv = ["hpo-select", "--run-dir", str(run_dir.root), "--stage", "sft", "--optimal-trial", str(fifo)]
    return [sys.executable, "-m", "stages", *argv]


def test_a_server_that_dies_under_a_stage_takes_the_stage_with_it_and_says_so(tmp_path: Path) -> None:
    # A run's connection to the worker's shared server (training_fixtures.start_warm_server): the server that forked
    # the stage is the connection's own, which dies here as a run's own server would.
    starts = WarmStarts({}, address=os.environ[SERVER])
    try:
        assert starts._ready.wait(120), starts.error
        env = starts.env
        process = starts.start(blocking_stage(tmp_path), env)
        assert process is not None, starts.error
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=2)
        os.kill(parent(process.pid), signal.SIGKILL)  # e.g. the OOM killer's choice: the biggest process
        assert process.wait(timeout=60) == -15 and not alive(process.pid)  # SIGTERM from the kernel, then gone
        assert starts.start([sys.executable, "-m", "stages", "--help"], env) is None
        assert "exited" in starts.error
    finally:
        starts.close()


def test_sigterm_while_the_server_imports_ends_the_run_before_any_stage_began(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", f"--run-dir={run_root}"]
    env = {**stage_env(), "CUDA_VISIBLE_DEVICES": ""}
    env.pop(SWITCH, None)
    env.pop(SERVER, None)  # the runner's own server, which imports
    runner = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # prepare's log is opened, empty, when the runner asks the server for prepare; the server imports for seconds
    log = run_root / "prepare" / "logs" / "stage.log"
    deadline = time.monotonic() + 120
    while not log.exists():
        assert runner.poll() is None and time.monotonic() < deadline, runner.stdout.read()
        time.sleep(0.01)
    time.sleep(0.2)  # past the line that opens the log, into the wait for the server
    assert log.read_text(encoding="utf-8") == ""  # no stage began: its header is written once it has
    runner.send_signal(signal.SIGTERM)
    output = runner.stdout.read()
    assert runner.wait(timeout=60) == 128 + signal.SIGTERM, output
    assert "SIGTERM to the runner before the stage started" in output
    assert not (run_root / "prepare" / "stage.json").exists()  # nothing ran, nothing recorded


# --------------------------------------------------------------------------- a server that runs of many processes share


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_runner_processes_share_a_listening_server_each_through_a_server_of_its_own(tmp_path: Path) -> None:
    # The worker's listening server (training_fixtures.start_warm_server), as `python -m stages.warm --listen` serves
    # the runs of a shell. A runner here is a process that connects to it and starts a stage that runs until stopped.
    script = (
        "import sys, time\n"
        "from workflows.warm_starts import WarmStarts\n"
        "starts = WarmStarts({}, address=sys.argv[1])\n"
        "starts._ready.wait(120)\n"
        "process = starts.start(sys.argv[2:], starts.env)\n"
        "print(process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    stages = []
    runners = []
    try:
        for name in ("first", "second"):
            (tmp_path / name).mkdir()
            command = [sys.executable, "-c", script, os.environ[SERVER], *blocking_stage(tmp_path / name)]
            runner = subprocess.Popen(command, env=os.environ, stdout=subprocess.PIPE, text=True)
            runners.append(runner)
            stages.append(int(runner.stdout.readline()))
        # each stage forked by a server of its runner's own, both forked from the one that imported
        assert parent(stages[0]) != parent(stages[1])
        assert parent(parent(stages[0])) == parent(parent(stages[1])) not in (os.getpid(), 1)
        # a runner killed: its stage gets SIGTERM and stops; the other runner's stage runs on
        runners[0].kill()
        deadline = time.monotonic() + 60
        while alive(stages[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(stages[0]) and alive(stages[1])
    finally:
        for runner in runners:
            runner.kill()
            runner.wait()
    deadline = time.monotonic() + 60
    while alive(stages[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(stages[1])


def test_a_run_the_listening_server_cannot_take_says_why_and_starts_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    address = os.environ[SERVER]
    starts = connect(address, {})
    assert starts is None  # an environment of nothing differs in every variable
    capsys.readouterr()
    starts = WarmStarts({}, address=address)
    assert starts._ready.wait(120) and starts.shared
    env = {**starts.env, "HF_HUB_OFFLINE": "0", "HF_TOKEN": SECRET, "MLFLOW_TRACKING_URI": "sqlite:///x.db"}
    starts.close()
    assert connect(address, env) is None
    said = capsys.readouterr().err
    # the variables read at import that differ are named, never their values; MLflow's URI is read per request
    assert f"{SERVER}={address}: this run's environment differs in HF_HUB_OFFLINE, HF_TOKEN;" in said
    assert SECRET not in said and said.endswith("this run starts its own\n")
    assert connect(str(tmp_path / "none.sock"), env) is None
    assert "No such file or directory; this run starts its own" in capsys.readouterr().err
    # the runner then starts a server of its own for the run
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv(SERVER, str(tmp_path / "none.sock"))
    with warm_starts(env, 0) as own:
        assert own is not None and not own.shared and own._server is not None
    _close_kept()


def test_a_listening_socket_is_its_users_alone_and_one_left_by_a_dead_server_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "warm.sock")
    listener = bind(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(OSError, match="already listens"):
            bind(path)
        started = subprocess.run(  # the command fails before it imports anything
            [sys.executable, "-m", "stages.warm", "--listen", path], capture_output=True, text=True, timeout=60
        )
        assert (
            started.returncode == 2
            and started.stderr == f"error: {path}: a warm-start server already listens at {path}\n"
        )
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(path)
        conn, _ = listener.accept()
        assert same_user(conn)
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # another user's process at the other end
        assert not same_user(conn)
        conn.close()
        client.close()
    finally:
        listener.close()
    assert os.path.exists(path)  # what a killed server leaves
    bind(path).close()


def test_every_test_starts_in_the_environment_of_the_shared_server(tmp_path: Path) -> None:
    # The tests' runs fork from the worker's server only while their environment is its own (tests/environment.py).
    import environment

    from workflows.local import stage_env

    starts = WarmStarts({}, RUNTIME_VARIABLES, address=os.environ[SERVER])
    try:
        assert starts._ready.wait(120), starts.error
        assert starts.differences(stage_env(tmp_path)) == []  # a local run of this test forks from it
        os.environ["POSTTRAIN_TEST_LEAKED"] = "1"  # what an import or an earlier test might leave
        os.environ["HF_HUB_OFFLINE"] = "0"
        assert starts.differences(stage_env(tmp_path)) == ["HF_HUB_OFFLINE", "POSTTRAIN_TEST_LEAKED"]
        environment.restore()  # after every test (tests/conftest.py)
        assert starts.differences(stage_env(tmp_path)) == []
    finally:
        environment.restore()
        starts.close()


@pytest.mark.slow
def test_the_tests_torchrun_ranks_fork_their_stages_and_stop_and_end_as_they_do(tmp_path: Path) -> None:
    """tests/warm_ranks.py: each rank of the tests' torchrun_stage forks its stage from the shared server (none
    starts its own), torchrun's SIGTERM reaches both stages (they checkpoint and record the run interrupted), and the
    rerun resumes from that checkpoint, its ranks ending as their stages did."""
    from training_fixtures import make_run_dir, torchrun_stage, wait_for_file

    from stages.checkpoints import MARKER

    steps = ["stages.cpt.training.max_steps=4", "stages.cpt.training.save_steps=2"]
    run_dir = make_run_dir(tmp_path / "run", [*steps, "stages.cpt.training.per_device_batch_size=2"], 160, 10)
    first = torchrun_stage(run_dir, "cpt", hold_after_checkpoint=2)
    wait_for_file(run_dir.stage_dir("cpt") / "checkpoints" / "checkpoint-2" / MARKER, first)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) != 0
    stopped = run_dir.read_result("cpt")
    assert stopped is not None and stopped.status == "interrupted", stopped

    assert torchrun_stage(run_dir, "cpt").wait(timeout=300) == 0
    log = (run_dir.root / "cpt.torchrun.log").read_text()
    assert sorted(line.split(":")[0] for line in log.splitlines() if "forked from the tests'" in line) == [
        *["rank 0", "rank 0", "rank 1", "rank 1"]
    ]
    assert "starts its own" not in log and "no fork" not in log
    result = run_dir.read_result("cpt")
    assert result is not None and result.status == "succeeded" and result.extra["resumed_from"] == "checkpoint-3"


def test_the_tests_stages_command_lines_fork_in_their_directory_and_say_what_a_fresh_one_does(
    tmp_path: Path,
) -> None:
    """training_fixtures.run_stages_cli (the error contract's refusals): `python -m stages` forked from the shared
    server in the directory given (a relative --spec is read there), its exit status and stderr a fresh process's."""
    import contextlib

    import training_fixtures

    (tmp_path / "bad.yaml").write_text("name: korean-llm\nstages: [unclosed\n", encoding="utf-8")
    argv = ["check-data", "--spec", "bad.yaml"]
    fresh = subprocess.run(
        [sys.executable, "-m", "stages", *argv],
        cwd=tmp_path,
        env=training_fixtures.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    with contextlib.chdir(tmp_path):
        process = training_fixtures._warm_command(argv, {}, separate_stderr=True)
    assert process is not None  # forked: the tests' environment is the server's
    forked = training_fixtures._completed(process)
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (2, fresh.stderr)
    assert "bad.yaml" in fresh.stderr and fresh.stderr.startswith("error: "), fresh.stderr
    assert training_fixtures.run_stages_cli(argv, cwd=tmp_path).stderr == fresh.stderr
