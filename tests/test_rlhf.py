"""DPO after SFT on the tiny local profile: the reward margin on the held-out preference rows goes up, the stage
writes stage.json and safetensors, continues sft's adapter, and resumes from a checkpoint after SIGKILL."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import EVAL_ROWS, make_preference_run_dir, preference_rows, run_ok, start_stage, wait_for_file

from run.run_dir import RunDir
from spec.loading import load_pipeline
from stages.checkpoints import MARKER
from stages.modeling import load_stage_model, load_starting_model, load_tokenizer
from stages.training import read_log_history

pytestmark = pytest.mark.slow

FAST = [
    "stages.cpt.enabled=false",  # sft starts from the base model; rlhf continues sft's adapter
    "stages.sft.training.max_steps=10",
    "stages.sft.training.save_steps=10",
    "stages.rlhf.training.max_steps=10",
    "stages.rlhf.training.save_steps=5",
    "stages.rlhf.training.logging_steps=1",
    "stages.rlhf.training.learning_rate=2.0e-3",
]


@pytest.fixture(scope="module")
def chained(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """sft (LoRA, from the base model), then DPO continuing sft's adapter."""
    run_dir = make_preference_run_dir(tmp_path_factory.mktemp("rlhf") / "run", FAST)
    run_ok(run_dir, "sft")
    run_ok(run_dir, "rlhf")
    return run_dir


# --------------------------------------------------------------------------- the margin, measured here


def completion_logps(
    model: Any, tokenizer: Any, prompt: list[dict[str, str]], completion: list[dict[str, str]]
) -> float:
    """Sum of the log-probabilities of the completion's tokens after the prompt, both through the chat template."""
    prompt_ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    full_ids = tokenizer(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
    prompt_ids, full_ids = prompt_ids["input_ids"], full_ids["input_ids"]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    with torch.no_grad():
        logits = model(torch.tensor([full_ids])).logits[0, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(full_ids[1:]).unsqueeze(1)).squeeze(1)
    return float(logps[len(prompt_ids) - 1 :].sum())


def preference_gap(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> list[float]:
    """log p(chosen) − log p(rejected) for each row."""
    model.eval()
    return [
        completion_logps(model, tokenizer, r["prompt"], r["chosen"])
        - completion_logps(model, tokenizer, r["prompt"], r["rejected"])
        for r in rows
    ]


def test_dpo_raises_the_reward_margin_on_held_out_rows(chained: RunDir) -> None:
    spec = chained.load_spec()
    tokenizer = load_tokenizer(chained, spec.model)
    rows = preference_rows(64 + EVAL_ROWS)[:EVAL_ROWS]
    before = preference_gap(load_stage_model(chained, spec, "sft", tokenizer), tokenizer, rows)  # the reference
    after = preference_gap(load_stage_model(chained, spec, "rlhf", tokenizer), tokenizer, rows)

    # DPO's implicit reward margin: beta * ((policy − reference) on chosen − (policy − reference) on rejected).
    margins = [spec.stages.rlhf.beta * (a - b) for a, b in zip(after, before, strict=True)]
    margin = sum(margins) / len(margins)
    assert margin > 0.01
    assert sum(m > 0 for m in margins) > len(margins) / 2

    metrics = chained.read_result("rlhf").metrics
    assert metrics["eval_rewards_margin"] == pytest.approx(margin, rel=0.02, abs=1e-4)  # TRL's own eval agrees
    assert metrics["eval_rewards_accuracy"] > 0.5
    assert metrics["rewards_margin_last"] > metrics["rewards_margin_first"]
    assert abs(metrics["rewards_margin_first"]) < 1e-3  # step 1 starts at the reference: no margin yet
    assert metrics["train_loss_last"] < metrics["train_loss_first"]


def test_rlhf_record_model_and_chaining_from_sft(chained: RunDir) -> None:
    result = chained.read_result("rlhf")
    assert result is not None and result.status == "succeeded"
    assert result.outputs == {"model": "rlhf/model"}
    assert result.metrics["steps"] == 10
    spec = chained.load_spec()
    assert result.extra["algorithm"] == "dpo" and result.extra["upstream"] == "sft"
    # sft's adapter continued: the same base, the same adapter shape; the reference is the sft model.
    assert result.extra["model_kind"] == "adapter" and result.extra["base_kind"] == "from_config"
    assert result.extra["base"] == spec.model.name_or_path
    assert "continued adapter" in result.extra["reference"]
    assert result.inputs["model"].uri == "sft/model"
    assert result.inputs["model"].fingerprint == chained.read_result("sft").extra["model_fingerprint"]
    assert result.inputs["preference_train"].fingerprint.startswith("sha256:")

    model_dir, sft_dir = chained.stage_dir("rlhf") / "model", chained.stage_dir("sft") / "model"
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "adapter_config.json").is_file()
    assert not (model_dir / "ref").exists()  # TRL's frozen reference adapter is not part of the output
    assert not [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    trained, started = (
        load_file(model_dir / "adapter_model.safetensors"),
        load_file(sft_dir / "adapter_model.safetensors"),
    )
    assert trained.keys() == started.keys()
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in started.items()}
    assert any(not torch.equal(trained[k], started[k]) for k in trained)

    history = read_log_history(chained.stage_dir("rlhf") / "logs/log_history.json")
    assert [e["step"] for e in history if "loss" in e] == list(range(1, 11))


def test_rlhf_resumes_after_sigkill(chained: RunDir, tmp_path: Path) -> None:
    # A fresh attempt on a copy of the run, sft done, rlhf not started.
    root = tmp_path / "run"
    shutil.copytree(chained.root, root)
    shutil.rmtree(root / "rlhf")
    run_dir = RunDir(root)
    checkpoints = run_dir.stage_dir("rlhf") / "checkpoints"

    child = start_stage(run_dir, "rlhf", HOLD_AFTER_CHECKPOINT="5")
    wait_for_file(checkpoints / "checkpoint-5" / MARKER, child)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    killed = run_dir.read_result("rlhf")
    assert killed is not None and killed.status == "running"

    run_ok(run_dir, "rlhf")
    result = run_dir.read_result("rlhf")
    assert result.status == "succeeded" and result.attempts == 2
    assert result.extra["resumed_from"] == "checkpoint-5" and result.extra["resumed_from_step"] == 5
    assert result.metrics["steps"] == 10
    assert result.mlflow_run_id == killed.mlflow_run_id
    history = read_log_history(run_dir.stage_dir("rlhf") / "logs/log_history.json")
    assert [e["step"] for e in history if "loss" in e] == list(range(1, 11))  # 1-5 before the kill, 6-10 after

    # Resuming reproduces the uninterrupted run: same data order, same reference, same weights.
    resumed = load_file(run_dir.stage_dir("rlhf") / "model/adapter_model.safetensors")
    straight = load_file(chained.stage_dir("rlhf") / "model/adapter_model.safetensors")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-4, atol=1e-5)


def test_full_training_after_sft_adapter_starts_from_the_merged_sft_model(chained: RunDir) -> None:
    overrides = ["tracking.wandb_project=null", *FAST, "stages.rlhf.method=full"]
    spec = load_pipeline("korean-llm", profile="local", overrides=overrides).spec
    tokenizer = load_tokenizer(chained, spec.model)
    start = load_starting_model(chained, spec, "rlhf", tokenizer)
    assert start.kind == "full" and start.upstream == "sft"
    assert all(p.requires_grad for p in start.model.parameters())  # every weight trains, merged ones included
    merged = load_stage_model(chained, spec, "sft", tokenizer).state_dict()
    for name, weight in start.model.state_dict().items():
        torch.testing.assert_close(weight, merged[name])
