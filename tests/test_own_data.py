"""Own data first: a profile keeps the data the user names, the runner says what it will train on and warns, a
failed gate ends with the command that registers anyway, and the README's walkthrough works as written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from training_fixtures import chat_rows, runner_env, write_jsonl

from run.exits import EXIT_GATE_FAILED
from spec.document import SpecError
from spec.loading import load_pipeline
from workflows.local import effective_plan
from workflows.plan import MIN_EVAL_ROWS, plan_warnings, prepared_warnings
from workflows.submit import EXIT_USAGE
from workflows.submit import main as submit_main

REPO = Path(__file__).resolve().parents[1]

PIPELINE = """\
name: my-chat
model: {{ name_or_path: Qwen/Qwen3-8B-Base }}
stages:
  sft:
    enabled: true
    data: {{ uri: {uri}, format: messages }}
    training: {{ epochs: 2 }}
profiles:
  local:
{marker}    model:
      name_or_path: tiny-qwen3-ko
      revision: null
      from_config: {{ hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, vocab_size: 2048 }}
    stages:
      sft:
        data: {{ uri: "builtin:korean-instructions", format: sharegpt, eval_fraction: 0.1 }}
        training: {{ max_steps: 30 }}
      evaluate:
        data: {{ uri: "builtin:korean-heldout", format: text }}
"""


def _pipeline(tmp_path: Path, marker: str = "", rows: int = 30) -> tuple[Path, Path]:
    data = tmp_path / "chat.jsonl"
    write_jsonl(data, chat_rows(rows))
    path = tmp_path / "my-chat.yaml"
    path.write_text(PIPELINE.format(uri=data, marker=marker), encoding="utf-8")
    return path, data


# --------------------------------------------------------------------------- the profile merge


def test_a_profile_keeps_the_data_uri_the_pipeline_file_sets(tmp_path: Path) -> None:
    path, data = _pipeline(tmp_path)
    loaded = load_pipeline(str(path), profile="local")
    sft = loaded.spec.stages.sft
    # The profile's whole data section stays out (its format and split describe its own data) ...
    assert (sft.data.uri, sft.data.format, sft.data.eval_fraction) == (str(data), "messages", 0.02)
    assert loaded.origins.data_kept == {"sft": str(data)}
    assert loaded.origins.by_path[("stages", "sft", "data", "uri")].endswith("my-chat.yaml:6")
    # ... while the rest of it applies: the model, the step cap, and data for a stage the file gives none.
    assert loaded.spec.model.name_or_path == "tiny-qwen3-ko" and sft.training.max_steps == 30
    assert loaded.spec.stages.evaluate.data.uri == "builtin:korean-heldout"


def test_a_set_uri_is_kept_even_over_a_profile_that_replaces_data(tmp_path: Path) -> None:
    own = tmp_path / "mine.jsonl"
    loaded = load_pipeline("korean-llm", profile="local", overrides=[f"stages.sft.data.uri={own}"])
    assert loaded.spec.stages.sft.data.uri == str(own)
    assert loaded.spec.stages.cpt.data.uri == "builtin:korean-corpus"  # the stages not --set keep the profile's
    sft = next(line for line in effective_plan(loaded) if line.startswith("sft:"))
    assert f"data {own} (messages) [--set]" in sft


def test_a_profile_that_says_replaces_data_swaps_it(tmp_path: Path) -> None:
    path, _ = _pipeline(tmp_path, marker="    replaces_data: true\n")
    loaded = load_pipeline(str(path), profile="local")
    assert (loaded.spec.stages.sft.data.uri, loaded.spec.stages.sft.data.format) == (
        "builtin:korean-instructions",
        "sharegpt",
    )
    assert loaded.origins.data_kept == {}
    # The shipped pipelines' local profiles run offline on built-in data: they say so.
    for name in ("korean-llm", "llama3-dolly", "qwen-multi", "qwen3-30b-a3b"):
        shipped = load_pipeline(name, profile="local")
        assert shipped.spec.profiles["local"]["replaces_data"] is True
        assert shipped.spec.stages.sft.data.uri.startswith("builtin:")


def test_replaces_data_takes_true_or_false_only(tmp_path: Path) -> None:
    path, _ = _pipeline(tmp_path, marker="    replaces_data: yes please\n")
    with pytest.raises(SpecError, match=r"my-chat\.yaml:10: profiles\.local\.replaces_data: expected true or false"):
        load_pipeline(str(path), profile="local")


# --------------------------------------------------------------------------- the plan and its warnings


def test_the_plan_shows_the_profile_the_effective_data_and_steps(tmp_path: Path) -> None:
    path, data = _pipeline(tmp_path)
    plan = effective_plan(load_pipeline(str(path), profile="local"))
    assert plan[0] == "profile local: sets model, stages.sft.training, stages.evaluate.data"
    assert plan[1].startswith("model: tiny-qwen3-ko (built from config: qwen3, 2 layers")
    sft = next(line for line in plan if line.startswith("sft:"))
    assert sft == (
        f"sft: data {data} (messages) [the pipeline file's; profile local's data left out: it has no "
        "replaces_data: true], 30 steps [profile local] (the pipeline file says 2 epochs)"
    )
    assert "evaluate: data builtin:korean-heldout (text) [profile local]" in plan
    replacing = effective_plan(load_pipeline("korean-llm", profile="local"))
    assert replacing[0].endswith("; replaces the pipeline file's data (replaces_data: true)")


def test_warnings_max_steps_over_epochs_small_eval_split_and_unrelated_evaluation(tmp_path: Path) -> None:
    path, data = _pipeline(tmp_path, rows=30)
    warnings = plan_warnings(load_pipeline(str(path), profile="local"))
    assert len(warnings) == 3, warnings
    steps, small, unrelated = warnings
    assert steps.startswith("sft: max_steps 30 (") and "overrides epochs 2 (" in steps
    assert "--set stages.sft.training.max_steps=null" in steps
    # 30 rows × eval_fraction 0.02: about one held-out row
    assert small.startswith(
        f"sft: about 1 of the 30 rows are held out for eval (eval_fraction 0.02), under {MIN_EVAL_ROWS}"
    )
    assert unrelated.startswith("evaluate: measures builtin:korean-heldout (text), built-in data unrelated")
    assert f"sft on {data} (messages)" in unrelated

    # Enough held-out rows, epochs kept, evaluate on the user's own held-out file: nothing to say.
    write_jsonl(data, chat_rows(60))  # 0.4 of them held out: 24
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(heldout, chat_rows(MIN_EVAL_ROWS, seed=1))
    quiet = load_pipeline(
        str(path),
        profile="local",
        overrides=[
            "stages.sft.training.max_steps=null",
            "stages.sft.data.eval_fraction=0.4",
            f"stages.evaluate.data.uri={heldout}",
            "stages.evaluate.data.format=messages",
        ],
    )
    assert plan_warnings(quiet) == []


def test_prepare_counts_warn_of_a_small_eval_split_of_own_data_not_already_warned() -> None:
    extra = {
        "data": {
            "sft": {"uri": "/data/chat.jsonl", "rows": 30, "eval_rows": 1},
            "evaluate": {"uri": "/data/heldout.jsonl", "rows": 5, "eval_rows": 5},
            "rlhf": {"uri": "builtin:korean-preferences", "rows": 120, "eval_rows": 12},  # the project's own
        }
    }
    warnings = prepared_warnings(extra)
    assert [w.split(":", 1)[0] for w in warnings] == ["sft", "evaluate"]
    assert warnings[0].startswith("sft: 1 of the 30 rows are held out for eval") and "has 5 rows" in warnings[1]
    assert prepared_warnings(extra, {"sft"}) == warnings[1:]
    assert prepared_warnings({"data": {"sft": {"uri": "a.jsonl", "rows": 99, "eval_rows": MIN_EVAL_ROWS}}}) == []


def test_the_shipped_local_profiles_plan_without_warnings() -> None:
    # Their step caps go with the built-in data they swap in (the plan shows them against the file's epochs).
    for name in ("korean-llm", "llama3-dolly", "qwen3-30b-a3b"):
        assert plan_warnings(load_pipeline(name, profile="local")) == [], name


def test_fail_on_gate_goes_with_local(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        submit_main(["korean-llm", "--render", "out", "--fail-on-gate"])
    assert exited.value.code == EXIT_USAGE and "--fail-on-gate go with --local" in capsys.readouterr().err


# --------------------------------------------------------------------------- the README walkthrough, run


def readme_walkthrough() -> str:
    """The shell lines of the README's 'Your own data' walkthrough, from `mkdir` on (the venv is this one)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Your own data\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README: the 'Your own data' section has no bash block"
    lines = block.group(1).splitlines()
    assert lines[0].startswith("make .venv/.installed"), lines[0]
    return "\n".join(lines[1:]) + "\n"


def _shell(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = runner_env()  # its PATH starts with the venv's bin (tests/conftest.py): `python` is the venv's
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_the_readme_walkthrough_trains_on_own_rows_and_registers_the_model(tmp_path: Path) -> None:
    done = _shell(readme_walkthrough(), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "my-chat"
    assert "sft: data chat.jsonl (messages), 3 epochs" in done.stdout
    assert "deploy: succeeded" in done.stdout
    assert done.stdout.rstrip().endswith("registered my-chat version 1 gate pass")
    assert (folder / "runs" / "my-chat-1" / "prepare" / "data" / "sft" / "train.jsonl").is_file()
    # typed in a shell of its own (its PWD, SHLVL, ...), the run still forked its stages from the tests' shared server
    header = (folder / "runs" / "my-chat-1" / "sft" / "logs" / "stage.log").read_text(encoding="utf-8").splitlines()[0]
    assert header.endswith("(warm start, shared server)") and "warning" not in done.stderr, (header, done.stderr)


@pytest.mark.slow
def test_a_failed_gate_ends_with_the_command_that_registers_anyway(tmp_path: Path) -> None:
    # The README's files, then a gate the trained model cannot pass: perplexity falls, scored higher-is-better.
    script = readme_walkthrough().split("\npython -m workflows.submit", 1)[0]
    gate = "stages.evaluate.gate=[{metric: perplexity, higher_is_better: true}]"
    script += f"\npython -m workflows.submit my-chat.yaml --local --run-dir runs/gated --set '{gate}' --fail-on-gate\n"
    done = _shell(script, tmp_path)
    assert done.returncode == EXIT_GATE_FAILED, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = (tmp_path / "my-chat" / "runs" / "gated").absolute()
    assert "skipping deploy: gate fail" in done.stdout
    command = f"python -m stages deploy --run-dir {run_dir}"
    lines = [line.strip() for line in done.stdout.splitlines()]
    hint = next(i for i, line in enumerate(lines) if line.startswith("To register this candidate anyway"))
    assert lines[hint + 1] == command, done.stdout[-2000:]
    assert not (run_dir / "deploy" / "stage.json").exists()

    forced = _shell(command + "\n", tmp_path / "my-chat")
    assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    version = client.get_model_version_by_alias("my-chat", "challenger")
    assert version.tags["posttrain.gate"] == "fail" and version.tags["posttrain.gate_overridden"] == "true"
    assert "champion" not in client.get_registered_model("my-chat").aliases


# --------------------------------------------------------------------------- own data refused before the run starts

OWN_DATA = """\
name: my-data
model: {{ name_or_path: tiny-qwen3-ko, revision: null, from_config: {{ hidden_size: 64, num_hidden_layers: 2 }} }}
stages:
  {stage}:
    enabled: true
    data: {data}
"""

ALPACA_ROW = {"instruction": "인사해 주세요.", "output": "안녕하세요!"}
PAIR_ROW = {"prompt": "인사해 주세요.", "chosen": "안녕하세요!", "rejected": "싫어요."}
MESSAGES_ROW = {"messages": [{"role": "user", "content": "안녕?"}, {"role": "assistant", "content": "안녕하세요!"}]}


def _submit_local(tmp_path: Path, stage: str, data: str) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """`python -m workflows.submit my-data.yaml --local --run-dir run` in `tmp_path`, the pipeline training
    `stage` on `data` (a flow mapping); its outcome, how long it took, and the run directory it was given."""
    import sys
    import time

    (tmp_path / "my-data.yaml").write_text(OWN_DATA.format(stage=stage, data=data), encoding="utf-8")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "workflows.submit", "my-data.yaml", "--local", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env=runner_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started, run_dir


def _rows(path: Path, rows: list[dict[str, object]], encoding: str = "utf-8") -> None:
    import json

    path.write_bytes(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode(encoding) for r in rows))


REFUSED = [
    # (id, stage, data, rows written to the file (None: no file), the expected error lines)
    (
        "missing-file",
        "sft",
        "{ uri: chat.jsonl, format: messages }",
        None,
        ["error: stages.sft.data: chat.jsonl: no such file or directory"],
    ),
    (
        "alpaca-column",
        "sft",
        "{ uri: chat.jsonl, format: alpaca, columns: { output: response } }",
        [ALPACA_ROW] * 3,
        [
            "error: stages.sft.data (chat.jsonl): columns.output names column 'response', which no row has (all 3 "
            "rows lack it; they have 'instruction', 'output'): fix stages.sft.data.columns.output. The first row: "
            "chat.jsonl:1: field 'response' (columns.output): missing (the row has 'output', the format's own "
            "name: is columns.output wrong?)"
        ],
    ),
    (
        "messages-column",
        "sft",
        "{ uri: chat.jsonl, format: messages, columns: { messages: dialog } }",
        [MESSAGES_ROW] * 25,
        [
            "error: stages.sft.data (chat.jsonl): columns.messages names column 'dialog', which no row has (the "
            "first 20 rows all lack it; they have 'messages'): fix stages.sft.data.columns.messages. The first "
            "row: chat.jsonl:1: field 'dialog' (columns.messages): missing (the row has 'messages', the format's "
            "own name: is columns.messages wrong?)"
        ],
    ),
    (
        "preference-column",
        "rlhf",
        "{ uri: pairs.jsonl, format: preference, columns: { chosen: good } }",
        [PAIR_ROW, {**PAIR_ROW, "rejected": "몰라요."}],
        [
            "error: stages.rlhf.data (pairs.jsonl): columns.chosen names column 'good', which no row has (all 2 "
            "rows lack it; they have 'chosen', 'prompt', 'rejected'): fix stages.rlhf.data.columns.chosen. The "
            "first row: pairs.jsonl:1: field 'good' (columns.chosen): missing (the row has 'chosen', the format's "
            "own name: is columns.chosen wrong?)"
        ],
    ),
    (
        "cp949",
        "sft",
        "{ uri: chat.jsonl, format: messages }",
        [MESSAGES_ROW] * 12,  # written in CP949
        [
            "error: stages.sft.data (chat.jsonl): chat.jsonl:1: invalid UTF-8 at byte 43 of the line (0xbe), and "
            "so are 11 more of its 12 lines; the file decodes as cp949 (CP949/EUC-KR, a Korean Windows export): "
            "convert the file to UTF-8 (`iconv -f cp949 -t utf-8 chat.jsonl > chat.utf8.jsonl`, then read the new "
            "file) or set stages.sft.data.encoding: cp949"
        ],
    ),
]


@pytest.mark.parametrize(("stage", "data", "rows", "expected"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_own_data_is_refused_before_the_run_starts(
    tmp_path: Path, stage: str, data: str, rows: list[dict[str, object]] | None, expected: list[str]
) -> None:
    """A missing file, a column mapping the data lacks, a CP949 file: exit 2 at once, one `error:` line per problem
    naming the file, line and column, and no run directory (nothing to resume)."""
    if rows is not None:
        name = data.split("uri: ", 1)[1].split(",", 1)[0]
        _rows(tmp_path / name, rows, "cp949" if "decodes as cp949" in expected[0] else "utf-8")
    done, seconds, run_dir = _submit_local(tmp_path, stage, data)
    assert done.returncode == EXIT_USAGE, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.splitlines() == expected
    assert "Resume" not in done.stdout and "Traceback" not in done.stderr
    assert not run_dir.exists()
    assert seconds < 20


def test_the_check_refuses_only_what_prepare_would_fail_on(tmp_path: Path) -> None:
    """One bad row among many is prepare's to quarantine when max_bad_row_fraction allows it, rows past max_samples
    are never read, data this machine cannot see is the cluster's: none of them is refused up front."""
    from stages.check_data import check_data

    bad_row = {"messages": [{"role": "user", "content": "안녕?"}]}  # no assistant turn
    _rows(tmp_path / "chat.jsonl", [MESSAGES_ROW, bad_row, *[MESSAGES_ROW] * 30])
    (tmp_path / "my-data.yaml").write_text(
        OWN_DATA.format(stage="sft", data=f"{{ uri: {tmp_path / 'chat.jsonl'}, format: messages }}"), encoding="utf-8"
    )

    def problems(*overrides: str, visible_only: bool = False) -> list[str]:
        return check_data(load_pipeline(str(tmp_path / "my-data.yaml"), None, list(overrides)).spec, None,
                          visible_only=visible_only)  # fmt: skip

    assert problems() == [
        f"stages.sft.data ({tmp_path / 'chat.jsonl'}): {tmp_path / 'chat.jsonl'}:2: field 'messages': no assistant "
        "turn: nothing to learn from"
    ]
    assert problems("stages.sft.data.max_bad_row_fraction=0.05") == []
    assert problems("stages.sft.data.max_samples=1") == []
    missing = str(tmp_path / "elsewhere" / "*.jsonl")
    assert problems(f"stages.sft.data.uri={missing}", visible_only=True) == []
    assert problems(f"stages.sft.data.uri={missing}") == [
        f"stages.sft.data: {missing}: the pattern matches nothing: {tmp_path / 'elsewhere'} is not a directory"
    ]
    assert problems("stages.sft.data.uri=s3://bucket/chat.jsonl") == []  # prepare checks it in the cluster


def test_dry_run_refuses_bad_data_this_machine_can_read(tmp_path: Path) -> None:
    import sys

    _rows(tmp_path / "chat.jsonl", [ALPACA_ROW] * 3)
    (tmp_path / "my-data.yaml").write_text(
        OWN_DATA.format(stage="sft", data="{ uri: chat.jsonl, format: messages }"), encoding="utf-8"
    )
    done = subprocess.run(
        [sys.executable, "-m", "workflows.submit", "my-data.yaml", "--dry-run"],
        cwd=tmp_path,
        env=runner_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_USAGE and not done.stdout
    assert [line for line in done.stderr.splitlines() if not line.startswith("warning: ")] == [
        "error: stages.sft.data (chat.jsonl): chat.jsonl:1: field 'messages': missing (the row has 'instruction', "
        "'output': is it in format 'alpaca'?) (also lines 2, 3)"
    ]
