"""The prepare stage on the local profile: normalized data, the builtin lm-eval tasks, quarantine, tokenizer,
stage.json, Argo outputs, rerun as a no-op, a changed config refused, and the comparison with the last successful
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from run.config_hash import canonical_hash
from run.run_dir import RunDir, write_json_atomic
from spec.loading import load_pipeline
from stages.contract import StageContext
from stages.prepare import last_success, run

REPO = Path(__file__).resolve().parents[1]
ROLES = {"system", "user", "assistant"}
ONLY_CPT = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")]


def prepare(run_root: Path, outputs: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "stages", "prepare", "--run-dir", str(run_root)]
    command += ["--outputs-dir", str(outputs)] if outputs else []
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=run_root.parent)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("runs") / "korean-llm-test"
    RunDir(root).write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    outputs = root.parent / "argo-outputs"
    done = prepare(root, outputs)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, outputs, done


def test_normalized_data_is_written_per_stage_in_canonical_form(prepared):
    root, _, _ = prepared
    data = root / "prepare" / "data"
    for stage in ("cpt", "sft", "rlhf"):
        assert read_jsonl(data / stage / "train.jsonl") and read_jsonl(data / stage / "eval.jsonl")
    assert not (data / "evaluate" / "train.jsonl").exists() and read_jsonl(data / "evaluate" / "eval.jsonl")
    assert all(set(r) == {"text"} for r in read_jsonl(data / "cpt" / "train.jsonl"))
    for row in read_jsonl(data / "sft" / "train.jsonl"):
        assert set(row) == {"messages"} and {m["role"] for m in row["messages"]} <= ROLES
        assert all(set(m) == {"role", "content"} for m in row["messages"])
    for row in read_jsonl(data / "rlhf" / "train.jsonl"):
        assert set(row) == {"prompt", "chosen", "rejected"}
        assert [m["role"] for m in row["chosen"]] == ["assistant"] == [m["role"] for m in row["rejected"]]
    assert not (root / "prepare" / "quarantine").exists() or not list((root / "prepare" / "quarantine").iterdir())


def test_stage_json_records_inputs_counts_fingerprints_and_tracking(prepared):
    root, _, _ = prepared
    result = RunDir(root).read_result("prepare")
    assert result is not None and result.status == "succeeded"
    assert set(result.inputs) == {
        "cpt:builtin:korean-corpus",
        "sft:builtin:korean-instructions",
        "rlhf:builtin:korean-preferences",
        "evaluate:builtin:korean-heldout",
        "evaluate:builtin:korean-lm-eval",
    }
    assert all(ref.fingerprint.startswith("sha256:") for ref in result.inputs.values())
    data = result.extra["data"]
    for stage, counts in data.items():
        train = root / "prepare" / "data" / stage / "train.jsonl"
        assert counts["train_rows"] == (len(read_jsonl(train)) if train.exists() else 0)
        assert counts["eval_rows"] == len(read_jsonl(root / "prepare" / "data" / stage / "eval.jsonl"))
        assert counts["rows"] == counts["train_rows"] + counts["eval_rows"] and counts["quarantined"] == 0
    assert data["sft"]["eval_rows"] >= 1 and data["evaluate"]["train_rows"] == 0
    assert result.extra["fingerprint"].startswith("sha256:")
    parent = json.loads((root / "tracking.json").read_text())["mlflow"]["parent_run_id"]
    assert result.extra["mlflow_parent_run_id"] == parent and result.mlflow_run_id not in (None, parent)
    assert result.outputs["tokenizer"] == "prepare/tokenizer"


def test_the_builtin_lm_eval_tasks_are_written_for_evaluate_and_fingerprinted(prepared):
    root, _, _ = prepared
    result = RunDir(root).read_result("prepare")
    tasks = result.extra["lm_eval_tasks"]
    folder = root / "prepare" / "data" / "evaluate" / "lm_eval"
    assert tasks["uri"] == "builtin:korean-lm-eval" and tasks["dir"] == "prepare/data/evaluate/lm_eval"
    assert result.outputs["evaluate_lm_eval"] == tasks["dir"]
    assert tasks["rows"] == {"ko_constitution_mc": len(read_jsonl(folder / "ko_constitution_mc.jsonl"))}
    assert (folder / "ko_constitution_mc.yaml").is_file()
    assert result.inputs["evaluate:builtin:korean-lm-eval"].fingerprint == tasks["fingerprint"]
    # Part of the run's fingerprint, like every stage's data: other questions are other data.
    assert result.extra["inputs"]["data:evaluate:lm_eval"] == tasks["fingerprint"]
    assert result.extra["fingerprint"] == "sha256:" + canonical_hash(result.extra["inputs"])


def test_argo_output_parameters_are_written(prepared):
    root, outputs, _ = prepared
    extra = RunDir(root).read_result("prepare").extra
    assert (outputs / "status").read_text() == "succeeded"
    for name in ("fingerprint", "unchanged", "tokenizer_hash", "mlflow_parent_run_id"):
        assert (outputs / name).read_text() == extra[name]


def test_tokenizer_has_the_chat_template_and_special_tokens(prepared):
    transformers = pytest.importorskip("transformers")
    root, _, _ = prepared
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "prepare" / "tokenizer"))
    assert len(tokenizer) <= 2048 and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "헌법 제1조는?"}, {"role": "assistant", "content": "민주공화국"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\n헌법 제1조는?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n민주공화국<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_rerun_is_a_no_op_and_a_changed_config_is_refused(prepared):
    root, _, _ = prepared
    before = RunDir(root).read_result("prepare")
    again = prepare(root)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert RunDir(root).read_result("prepare").ended_at == before.ended_at

    changed = load_pipeline(
        "korean-llm", "local", ["tracking.wandb_project=null", "stages.sft.data.eval_fraction=0.1"]
    ).spec
    RunDir(root).write_spec(changed)
    try:
        refused = prepare(root)
    finally:
        RunDir(root).write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    assert refused.returncode == 2 and "another config" in refused.stderr


def cpt_only(tmp_path: Path, rows: list[str], bad_fraction: float) -> StageContext:
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    overrides = [*ONLY_CPT, "tracking.wandb_project=null", f"stages.cpt.data.uri={data}"]
    overrides.append(f"stages.cpt.data.max_bad_row_fraction={bad_fraction}")
    spec = load_pipeline("korean-llm", "local", overrides).spec
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    return StageContext(run_dir, "prepare", spec)


def test_bad_data_fails_the_stage_naming_file_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    ctx = cpt_only(tmp_path, ['{"text": "좋은 문서"}', '{"text": ["not", "a", "string"]}'], 0.0)
    assert run(ctx) == 1
    result = ctx.run_dir.read_result("prepare")
    assert result.status == "failed"
    assert f"{tmp_path / 'corpus.jsonl'}:2: field 'text': expected a string, got a list" in result.message
    assert "corpus.jsonl:2" in capsys.readouterr().err
    assert not (ctx.dir / "tokenizer").exists()


def test_bad_rows_within_the_limit_are_quarantined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    rows = [json.dumps({"text": f"대한민국 헌법 문서 {i} " * 5}, ensure_ascii=False) for i in range(6)]
    ctx = cpt_only(tmp_path, [*rows, "{broken json"], 0.2)
    assert run(ctx) == 0
    quarantine = read_jsonl(ctx.dir / "quarantine" / "cpt.jsonl")
    assert quarantine == [
        {
            "file": str(tmp_path / "corpus.jsonl"),
            "line": 7,
            "field": "",
            "error": quarantine[0]["error"],
            "raw": "{broken json",
        }
    ]
    assert quarantine[0]["error"].startswith("not valid JSON")
    counts = ctx.run_dir.read_result("prepare").extra["data"]["cpt"]
    assert (counts["rows"], counts["quarantined"], counts["read_rows"]) == (6, 1, 7)


def _fake_run(parent: Path, name: str, pipeline: str, statuses: dict[str, str], fingerprint: str, ended: str) -> None:
    root = parent / name
    stages = {s: {"enabled": s in statuses} for s in ("prepare", "cpt", "sft", "rlhf", "evaluate", "deploy")}
    write_json_atomic(root / "spec.json", {"name": pipeline, "stages": stages})
    for stage, status in statuses.items():
        extra = {"fingerprint": fingerprint} if stage == "prepare" else {}
        write_json_atomic(root / stage / "stage.json", {"status": status, "ended_at": ended, "extra": extra})


def test_last_success_is_the_newest_fully_successful_sibling_run(tmp_path: Path):
    spec = load_pipeline("korean-llm", "local").spec
    _fake_run(tmp_path, "a", "korean-llm", {"prepare": "succeeded", "cpt": "succeeded"}, "sha256:old", "2026-01-01")
    _fake_run(tmp_path, "b", "korean-llm", {"prepare": "succeeded", "cpt": "succeeded"}, "sha256:new", "2026-02-01")
    _fake_run(tmp_path, "c", "korean-llm", {"prepare": "succeeded", "cpt": "failed"}, "sha256:bad", "2026-03-01")
    _fake_run(tmp_path, "d", "other-pipeline", {"prepare": "succeeded"}, "sha256:other", "2026-04-01")
    this = RunDir(tmp_path / "now")
    assert last_success(this, spec) == ("b", "sha256:new")
    assert last_success(RunDir(tmp_path / "empty" / "now"), spec) == (None, None)


def test_a_run_that_ended_at_a_failed_gate_counts_as_completed(tmp_path: Path):
    spec = load_pipeline("korean-llm", "local").spec
    chain = {"prepare": "succeeded", "cpt": "succeeded", "evaluate": "succeeded", "deploy": "succeeded"}
    _fake_run(tmp_path, "a", "korean-llm", chain, "sha256:a", "2026-01-01")
    # deploy never ran after a failed gate (the DAG's `when`): the run ended as designed.
    _fake_run(tmp_path, "b", "korean-llm", {**chain, "deploy": "skipped"}, "sha256:b", "2026-02-01")
    gate = {"status": "succeeded", "ended_at": "2026-02-01", "extra": {"gate": "fail"}}
    write_json_atomic(tmp_path / "b" / "evaluate" / "stage.json", gate)
    (tmp_path / "b" / "deploy" / "stage.json").unlink()
    assert last_success(RunDir(tmp_path / "now"), spec) == ("b", "sha256:b")

    # Not complete: an evaluate that failed, a passed gate whose deploy never ran, a stage after it that failed.
    for name, evaluate, deploy in (
        ("c", {"status": "failed", "extra": {}}, None),
        ("d", {"status": "succeeded", "extra": {"gate": "pass"}}, None),
        ("e", {"status": "succeeded", "extra": {"gate": "fail"}}, {"status": "failed"}),
    ):
        _fake_run(tmp_path, name, "korean-llm", chain, f"sha256:{name}", "2026-03-01")
        write_json_atomic(tmp_path / name / "evaluate" / "stage.json", {**evaluate, "ended_at": "2026-03-01"})
        (tmp_path / name / "deploy" / "stage.json").unlink()
        if deploy is not None:
            write_json_atomic(tmp_path / name / "deploy" / "stage.json", deploy)
        assert last_success(RunDir(tmp_path / "now"), spec) == ("b", "sha256:b"), name


def test_a_builtin_lm_eval_task_folder_is_part_of_prepare_config() -> None:
    from run.config_hash import config_hash

    with_tasks = load_pipeline("korean-llm", "local").spec
    without = load_pipeline("korean-llm", "local", ["stages.evaluate.lm_eval_include_path=null"]).spec
    assert with_tasks.stages.evaluate.lm_eval_include_path.startswith("builtin:")
    assert config_hash(with_tasks, "prepare") != config_hash(without, "prepare")


def test_an_unknown_lm_eval_task_fails_prepare_before_anything_trains(tmp_path: Path) -> None:
    """A spec that got past submit without lm-eval installed there (or a run directory written by hand): prepare
    checks the task names against the image's lm-eval and the builtin task folder, and fails with the field."""
    root = tmp_path / "korean-llm-typo"
    spec = load_pipeline(
        "korean-llm", "local", ["tracking.wandb_project=null", "stages.evaluate.lm_eval_tasks=[ko_constitution]"]
    ).spec
    RunDir(root).write_spec(spec)
    done = prepare(root)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "stages.evaluate.lm_eval_tasks[0]: 'ko_constitution' is not a task of lm-eval" in done.stderr
    result = RunDir(root).read_result("prepare")
    assert result.status == "failed" and "did you mean ko_constitution_mc?" in result.message
    assert not (root / "prepare" / "tokenizer").exists()


def test_prepare_refuses_a_bad_file_before_its_workers_start_with_the_checks_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """The data check of `submit --local` (`python -m stages check-data`) runs first in prepare too: in the
    cluster a CP949 file or a column the data lacks fails in seconds, with the same lines, before any worker."""
    import stages.prepare

    def read_the_data(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("prepare started reading the data")

    monkeypatch.setattr(stages.prepare, "prepare_split", read_the_data)
    ctx = cpt_only(tmp_path, [], 0.1)  # a tenth of the rows may be bad: a whole file in CP949 is still refused
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        "".join(json.dumps({"text": f"좋은 문서 {i}"}, ensure_ascii=False) + "\n" for i in range(50)).encode("cp949")
    )
    assert run(ctx) == 1
    message = ctx.run_dir.read_result("prepare").message
    assert message.startswith(f"stages.cpt.data ({corpus}): {corpus}:1: invalid UTF-8 at byte 10 of the line (0xc1)")
    assert "and so are 19 more of its first 20 lines" in message and "iconv -f cp949 -t utf-8" in message
    assert capsys.readouterr().err.splitlines() == [f"[prepare] error: {message}"]
    check = subprocess.run(
        [sys.executable, "-m", "stages", "check-data", "--spec", str(ctx.run_dir.spec_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert (check.returncode, check.stderr) == (2, f"error: {message}\n")
    assert not (ctx.dir / "data").exists() and not (ctx.dir / "tokenizer").exists()
