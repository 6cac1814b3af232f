"""A user's own model directory of each family Korean teams fine-tune (Llama-3, EXAONE 4, Gemma 3, Mistral: the real
architecture, the real chat template, safetensors weights, a trained BPE tokenizer), given as model.name_or_path,
with the user's own messages and preference files, runs prepare → sft (LoRA) → rlhf (DPO) → evaluate as a user
runs it: `python -m workflows.submit FILE --local` (its main function, in the test's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from training_fixtures import REPO, chat_rows, text_rows, write_jsonl

from stages.tokenizer import render_for_training, train_bpe_tokenizer
from workflows.submit import main as submit_main

FAMILIES = {
    # architecture → (transformers config class, its chat template, extra config)
    "llama": ("LlamaConfig", "llama3", {}),
    "qwen2": ("Qwen2Config", "qwen2_5", {}),
    "exaone4": ("Exaone4Config", "exaone4", {"sliding_window": 64, "sliding_window_pattern": 2}),
    "gemma3": ("Gemma3TextConfig", "gemma3", {"sliding_window": 64, "query_pre_attn_scalar": 16}),
    "mistral": ("MistralConfig", "mistral", {"sliding_window": None}),
}


def make_model_dir(root: Path, architecture: str) -> Path:
    """A model folder as a user has one on a volume: config.json, model.safetensors, the tokenizer files with
    the family's chat template."""
    import torch
    import transformers

    config_class, template, extra = FAMILIES[architecture]
    corpus = [render_for_training(row) for row in text_rows(80) + chat_rows(80)]
    tokenizer = train_bpe_tokenizer(corpus, 512, 512, template)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = root / f"tiny-{architecture}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert (path / "model.safetensors").is_file() and json.loads((path / "config.json").read_text())
    return path


def preference_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i, row in enumerate(chat_rows(n, seed=3)):
        prompt, answer = row["messages"][:-1], row["messages"][-1]["content"]
        rows.append({"prompt": prompt, "chosen": answer, "rejected": f"{answer[::-1]} {i}"})
    return rows


def pipeline_file(root: Path, model_dir: Path, architecture: str) -> Path:
    """The user's pipeline: their model folder, their chat file, their preference file."""
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(60, seed=1))
    write_jsonl(root / "data" / "heldout.jsonl", chat_rows(12, seed=2))
    write_jsonl(root / "data" / "preferences.jsonl", preference_rows(40))
    steps = {
        "max_steps": 2,
        "per_device_batch_size": 4,
        "max_seq_length": 128,
        "save_steps": 2,
        "logging_steps": 1,
        "warmup_ratio": 0.0,
        "learning_rate": 1.0e-3,
    }
    spec = {
        "name": f"tiny-{architecture.replace('_', '-')}",
        "model": {"name_or_path": str(model_dir)},
        "stages": {
            "sft": {
                "method": "lora",
                "data": {"uri": str(root / "data" / "chat.jsonl"), "format": "messages", "eval_fraction": 0.1},
                "training": steps,
                "lora": {"r": 4, "alpha": 8},
            },
            "rlhf": {
                "algorithm": "dpo",
                "method": "lora",
                "data": {"uri": str(root / "data" / "preferences.jsonl"), "format": "preference"},
                "training": steps,
            },
            "evaluate": {
                "data": {"uri": str(root / "data" / "heldout.jsonl"), "format": "messages"},
                "lm_eval_tasks": [],
                "prompts": ["서울은 어떤가요?"],
                "gate": [{"metric": "perplexity", "higher_is_better": False, "max_regression": 100.0}],
            },
            "deploy": {"enabled": False},
        },
        "tracking": {"mlflow_tracking_uri": None, "wandb_project": None},
    }
    path = root / f"{architecture}.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True), encoding="utf-8")
    return path


@pytest.fixture
def submit_local(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, str]]:
    """`python -m workflows.submit PIPELINE --local --run-dir RUN_ROOT [...]` as its main function in this process:
    the exit code and what it printed. Its stages are forked from the warm-start server the last local run of this
    process left idle (the families' runs share one server's imports)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(REPO)

    def submit(pipeline: Path, run_root: Path, *extra: str) -> tuple[int, str]:
        capsys.readouterr()
        code = submit_main([str(pipeline), "--local", "--run-dir", str(run_root), *extra])
        said = capsys.readouterr()
        return code, said.out + said.err

    return submit


@pytest.mark.slow
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_a_users_model_directory_trains_through_sft_dpo_and_evaluate(
    tmp_path: Path, architecture: str, submit_local: Callable[..., tuple[int, str]]
) -> None:
    model_dir = make_model_dir(tmp_path, architecture)
    pipeline = pipeline_file(tmp_path, model_dir, architecture)
    run_root = tmp_path / "run"
    code, said = submit_local(pipeline, run_root)
    assert code == 0, said[-8000:]

    results = {s: json.loads((run_root / s / "stage.json").read_text()) for s in ("prepare", "sft", "rlhf", "evaluate")}
    assert all(r["status"] == "succeeded" for r in results.values()), results
    assert results["sft"]["extra"]["model_kind"] == "adapter" and results["rlhf"]["extra"]["model_kind"] == "adapter"
    assert (run_root / "rlhf" / "model" / "adapter_model.safetensors").is_file()
    assert results["evaluate"]["metrics"]["perplexity"] > 0
    # The run's tokenizer is the user's, with its own template.
    saved = json.loads((run_root / "prepare" / "tokenizer" / "tokenizer_config.json").read_text())
    original = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert saved.get("chat_template", "") == original.get("chat_template", "") or (
        (run_root / "prepare" / "tokenizer" / "chat_template.jinja").read_text()
        == (model_dir / "chat_template.jinja").read_text()
    )


@pytest.mark.slow
def test_a_base_model_without_a_chat_template_is_given_one_and_learns_its_new_tokens(
    tmp_path: Path, submit_local: Callable[..., tuple[int, str]]
) -> None:
    """A *-Base model ships no chat template: prepare says to set model.chat_template; with `chatml`, its tokens are
    added, the embeddings grow, LoRA trains the new rows, and the later stages load the grown model."""
    from safetensors import safe_open

    model_dir = make_model_dir(tmp_path, "mistral")
    for name in ("chat_template.jinja",):
        (model_dir / name).unlink(missing_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    pipeline = pipeline_file(tmp_path, model_dir, "mistral")

    code, said = submit_local(pipeline, tmp_path / "without")
    assert code != 0
    assert "has no chat template" in said and "model.chat_template" in said
    assert not (tmp_path / "without" / "sft" / "stage.json").exists()

    code, said = submit_local(pipeline, tmp_path / "run", "--set", "model.chat_template=chatml")
    assert code == 0, said[-8000:]
    tokenizer_config = json.loads((tmp_path / "run" / "prepare" / "tokenizer" / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    with safe_open(str(tmp_path / "run" / "sft" / "model" / "adapter_model.safetensors"), "pt") as f:
        token_rows = [k for k in f.keys() if "trainable_tokens" in k]  # noqa: SIM118 (safe_open has keys(), no __iter__)
        assert token_rows and any("embed_tokens" in k for k in token_rows)
        delta = next(f.get_tensor(k) for k in token_rows if "embed_tokens" in k)
        heads = [k for k in f.keys() if "lm_head" in k]  # noqa: SIM118
        assert heads and f.get_tensor(heads[0]).shape[0] > vocab  # the whole (grown) head trained, in the adapter
    assert delta.abs().sum() > 0  # the new tokens' rows moved
    added = json.loads((tmp_path / "run" / "prepare" / "tokenizer" / "tokenizer.json").read_text())["added_tokens"]
    assert max(t["id"] for t in added) >= vocab  # ChatML's tokens are new rows: the embeddings grew to hold them
    evaluate = json.loads((tmp_path / "run" / "evaluate" / "stage.json").read_text())
    assert evaluate["status"] == "succeeded"


def test_a_conversation_the_template_refuses_fails_prepare_naming_the_users_file_and_line(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path, "mistral")
    pipeline = pipeline_file(tmp_path, model_dir, "mistral")
    rows = chat_rows(60, seed=1)
    # Mistral's template requires user/assistant alternation: two user turns in a row is refused, by the template.
    rows[4] = {
        "messages": [{"role": "user", "content": "하나"}, {"role": "user", "content": "둘"}, rows[4]["messages"][-1]]
    }
    write_jsonl(tmp_path / "data" / "chat.jsonl", rows)
    command = [sys.executable, "-m", "stages", "prepare", "--run-dir", str(tmp_path / "run")]
    from spec.loading import load_pipeline

    # evaluate reads the training file too (so prepare keeps the training rows that are also evaluation data)
    same = [f"stages.evaluate.data.uri={tmp_path / 'data' / 'chat.jsonl'}"]
    same.append("stages.sft.data.cleaning.decontaminate=false")
    (tmp_path / "run").mkdir()
    spec_json = load_pipeline(str(pipeline), overrides=same).spec.model_dump_json()
    (tmp_path / "run" / "spec.json").write_text(spec_json, encoding="utf-8")
    done = subprocess.run(
        command, env={**os.environ, "WANDB_MODE": "disabled"}, cwd=REPO, capture_output=True, text=True, timeout=600
    )

    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    # evaluate reads the same file, and is checked first (the trainers template their rows later).
    assert len(errors) == 1 and "stages.evaluate.data" in errors[0]
    assert f"{tmp_path / 'data' / 'chat.jsonl'}:5: the chat template rejects this conversation" in done.stderr
    assert "roles must alternate" in done.stderr and "Traceback" not in done.stderr
    assert json.loads((tmp_path / "run" / "prepare" / "stage.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "run" / "prepare").glob("cache/sft/*/meta.json"))  # no token cache left behind

    # Without evaluate reading it, the SFT token cache finds the same row, and names it the same way.
    write_jsonl(tmp_path / "data" / "heldout.jsonl", text_rows(5))
    spec = load_pipeline(
        str(pipeline),
        overrides=[
            f"stages.evaluate.data.uri={tmp_path / 'data' / 'heldout.jsonl'}",
            "stages.evaluate.data.format=text",
        ],
    ).spec
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "spec.json").write_text(spec.model_dump_json(), encoding="utf-8")
    command[-1] = str(tmp_path / "run2")
    done = subprocess.run(
        command, env={**os.environ, "WANDB_MODE": "disabled"}, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error: stages.sft.data" in done.stderr and "Traceback" not in done.stderr
    eval_rows = 6  # 60 rows, eval_fraction 0.1: the refused row is a training row (or the message names eval's file)
    assert f"{tmp_path / 'data' / 'chat.jsonl'}:5: the chat template rejects this conversation" in done.stderr, (
        eval_rows
    )


@pytest.mark.parametrize("tied", [False, True])
def test_lora_trains_the_template_token_rows_where_trls_fused_loss_sees_them(tied: bool) -> None:
    """Untied head: the new tokens' input rows train (PEFT trainable tokens). Tied: PEFT would wrap the shared head,
    which TRL's fused loss reads directly (lm_head.bias), so the rows are left alone and the head stays a Linear."""
    import transformers
    from peft import get_peft_model

    from spec.loading import load_pipeline
    from stages.modeling import lora_config

    section = load_pipeline("korean-llm", profile="local").spec.stages.sft
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_config(config)
    model = get_peft_model(base, lora_config(section, base, [298, 299]))
    head = model.get_base_model().get_output_embeddings()
    assert hasattr(head, "bias")  # what TRL's fused loss reads
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "trainable_tokens" in n]
    assert bool(trainable) is (not tied)
    # Untied, the head trains as a copy, which TRL's fused loss reads: head.weight is the trained copy.
    if not tied:
        assert head.weight.requires_grad and head.weight is head.modules_to_save["default"].weight


def _tiny_llama(tied: bool) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def test_lora_modules_to_save_train_whole_beside_the_adapter_and_reload(tmp_path: Path) -> None:
    """lora.modules_to_save: the embedding and the head train whole (the template's token rows with the embedding,
    no separate token adapter), are saved in the adapter, and come back when the adapter is loaded on a new base."""
    import torch
    from peft import PeftModel, get_peft_model

    from spec.loading import load_pipeline
    from stages.modeling import lora_config

    section = load_pipeline("korean-llm", profile="local").spec.stages.sft
    section.lora.modules_to_save = ["embed_tokens", "lm_head"]
    model = get_peft_model(_tiny_llama(False), lora_config(section, _tiny_llama(False), [298, 299]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("embed_tokens.modules_to_save" in n for n in trainable)
    assert any("lm_head.modules_to_save" in n for n in trainable)
    assert not any("trainable_tokens" in n for n in trainable)
    with torch.no_grad():
        model.get_base_model().model.embed_tokens.weight.add_(1.0)  # the trained copy moves
    model.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(_tiny_llama(False), tmp_path / "adapter")
    assert torch.equal(again.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_lora_modules_to_save_refuses_a_tied_embedding() -> None:
    from spec.loading import load_pipeline
    from stages.contract import ExplainedFailure
    from stages.modeling import lora_config

    section = load_pipeline("korean-llm", profile="local").spec.stages.sft
    section.lora.modules_to_save = ["lm_head"]
    with pytest.raises(ExplainedFailure, match="tied to its head"):
        lora_config(section, _tiny_llama(True))
    section.lora.modules_to_save = ["norm"]  # a module that is neither: trained whole on a tied model too
    assert lora_config(section, _tiny_llama(True)).modules_to_save == ["norm"]


def test_a_tokenizer_without_eos_is_refused(tmp_path: Path) -> None:
    from spec.loading import load_pipeline
    from stages.chat import TemplateError
    from stages.tokenizer import load_pretrained_tokenizer

    tokenizer = train_bpe_tokenizer(["서울은 크고 넓습니다."] * 20, 300, 128, "chatml")
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "model")
    spec = load_pipeline("korean-llm", overrides=[f"model.name_or_path={tmp_path / 'model'}"]).spec
    with pytest.raises(TemplateError, match="has no eos token"):
        load_pretrained_tokenizer(spec)
