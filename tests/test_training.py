"""cpt then sft on the tiny local profile: the loss goes down, stage.json records the run, the models are
safetensors, and sft continues from cpt's output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import losses, make_run_dir, run_stage

from run.run_dir import RunDir
from stages.modeling import NotSupportedHere, check_method, load_stage_model, load_tokenizer, model_fingerprint

pytestmark = pytest.mark.slow

FAST = [
    "stages.cpt.training.max_steps=12",
    "stages.cpt.training.save_steps=6",
    "stages.cpt.training.logging_steps=1",
    "stages.sft.training.max_steps=10",
    "stages.sft.training.save_steps=5",
    "stages.sft.training.logging_steps=1",
]


def no_pickles(model_dir: Path) -> None:
    assert not [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    run_dir = make_run_dir(tmp_path_factory.mktemp("training") / "run", overrides=FAST)
    for stage in ("cpt", "sft"):
        done = run_stage(run_dir, stage)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def test_cpt_trains_a_full_model(trained: RunDir) -> None:
    result = trained.read_result("cpt")
    assert result is not None and result.status == "succeeded"
    assert result.extra["model_kind"] == "full" and result.extra["base_kind"] == "from_config"
    assert result.outputs == {"model": "cpt/model"}
    metrics = result.metrics
    assert metrics["steps"] == 12 and metrics["tokens"] > 0
    assert metrics["train_loss_last"] < metrics["train_loss_first"] - 0.5
    assert metrics["perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-5)
    curve = losses(trained, "cpt")
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3

    model_dir = trained.stage_dir("cpt") / "model"
    assert result.extra["model_fingerprint"] == model_fingerprint(model_dir)  # what the stages after it hold to
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()
    assert (model_dir / "tokenizer.json").is_file()
    no_pickles(model_dir)
    assert sorted(p.name for p in (trained.stage_dir("cpt") / "checkpoints").iterdir()) == [
        "checkpoint-12",
        "checkpoint-6",
        "config_hash",  # the config these checkpoints belong to
    ]
    assert (trained.stage_dir("cpt") / "checkpoints" / "config_hash").read_text().strip() == result.config_hash
    distributed = json.loads((trained.stage_dir("cpt") / "logs" / "distributed.json").read_text())
    assert distributed == {
        "strategy": "ddp",
        "expert_parallel": 1,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "world_size": 1,
        "parallel_mode": "not_parallel",
        "ddp_backend": None,
        "ddp_find_unused_parameters": False,
        "fsdp": None,
        "fsdp_config": None,
        "deepspeed": None,
        "mixed_precision": "no",
        "fsdp_mixed_precision": None,
        "gradient_checkpointing": False,
        "compiled_decoder_layers": False,
    }


def test_sft_continues_from_cpt_with_a_lora_adapter(trained: RunDir) -> None:
    result = trained.read_result("sft")
    assert result is not None and result.status == "succeeded"
    extra = result.extra
    assert (extra["model_kind"], extra["base"], extra["base_kind"], extra["upstream"]) == (
        "adapter",
        "cpt/model",
        "stage",
        "cpt",
    )
    # The model it started from, by content: what cpt recorded, and what is there.
    cpt_model = trained.stage_dir("cpt") / "model"
    assert result.inputs["model"].uri == "cpt/model"
    assert result.inputs["model"].fingerprint == trained.read_result("cpt").extra["model_fingerprint"]
    assert result.inputs["model"].fingerprint == model_fingerprint(cpt_model)
    assert result.extra["model_fingerprint"] == model_fingerprint(trained.stage_dir("sft") / "model")
    assert result.metrics["train_loss_last"] < result.metrics["train_loss_first"]

    model_dir = trained.stage_dir("sft") / "model"
    assert (model_dir / "adapter_model.safetensors").is_file() and not (model_dir / "model.safetensors").exists()
    no_pickles(model_dir)
    # PEFT writes its target modules in a set's order, which differs between processes: the stage sorts them, so
    # that a rerun writes the same bytes (and the folder the same fingerprint)
    targets = json.loads((model_dir / "adapter_config.json").read_text())["target_modules"]
    assert len(targets) == 14 and targets == sorted(targets)  # 7 projections in each of 2 layers

    # The adapter sits on cpt's weights: merged, everything but the adapted projections is cpt's model.
    spec = trained.load_spec()
    merged = load_stage_model(trained, spec, "sft", load_tokenizer(trained, spec.model)).state_dict()
    cpt = load_file(trained.stage_dir("cpt") / "model/model.safetensors")
    assert torch.equal(merged["model.embed_tokens.weight"], cpt["model.embed_tokens.weight"])
    assert torch.equal(merged["model.norm.weight"], cpt["model.norm.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], cpt[q])  # the trained adapter, merged in


def test_lora_without_cpt_merges_into_the_base_when_asked(tmp_path: Path) -> None:
    overrides = [
        *FAST,
        "stages.cpt.enabled=false",
        "stages.sft.training.max_steps=3",
        "stages.sft.lora.merge_after=true",
        "stages.sft.training.recompute_layers=1",  # the stage's callback says that a CPU recomputes nothing
    ]
    run_dir = make_run_dir(tmp_path / "run", overrides=overrides, n_text=20, n_chat=60)
    done = run_stage(run_dir, "sft")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[sft] training.recompute_layers: no decoder layer recomputes on a CPU" in done.stdout
    result = run_dir.read_result("sft")
    assert result is not None
    assert (result.extra["model_kind"], result.extra["base_kind"]) == ("full", "from_config")
    model_dir = run_dir.stage_dir("sft") / "model"
    assert (model_dir / "model.safetensors").is_file() and not (model_dir / "adapter_model.safetensors").exists()
    assert not any("lora" in name for name in load_file(model_dir / "model.safetensors"))


def test_qlora_on_cpu_names_the_spec_field() -> None:
    from spec.loading import load_pipeline

    spec = load_pipeline("korean-llm", profile="local", overrides=["stages.sft.method=qlora"]).spec
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(NotSupportedHere, match=r"stages\.sft\.method"):
        check_method("sft", spec.stages.sft)


def _tiny_bf16_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def _fraction_moved_by_one_adam_step(model: torch.nn.Module, lr: float) -> float:
    weight = model.model.layers[0].mlp.down_proj.weight
    before = weight.detach().float().clone()
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    return (weight.detach().float() != before).float().mean().item()


@pytest.mark.parametrize(
    ("strategy", "pure_bf16", "upcast"),
    [("ddp", False, True), ("ddp", True, False), ("fsdp", False, False), ("deepspeed_zero3", False, False)],
)
def test_full_fine_tuning_on_gpu_trains_float32_masters(
    monkeypatch: pytest.MonkeyPatch, strategy: str, pure_bf16: bool, upcast: bool
) -> None:
    """Under DDP the stage upcasts bf16 weights to float32 masters (FSDP and DeepSpeed do it themselves), unless
    training.pure_bf16; the final model is saved in the dtype it was loaded in."""
    from spec.training import SftStage
    from stages import modeling

    monkeypatch.setattr(modeling, "on_gpu", lambda: True)
    section = SftStage.model_validate(
        {
            "enabled": False,
            "method": "full",
            "distributed": {"strategy": strategy},
            "training": {"pure_bf16": pure_bf16},
        }
    )
    model = _tiny_bf16_model()
    save_dtype = modeling.float32_masters(model, section)
    assert save_dtype == (torch.bfloat16 if upcast else None)
    assert {p.dtype for p in model.parameters()} == {torch.float32 if upcast else torch.bfloat16}


def test_bf16_weights_lose_fine_tuning_updates_that_float32_masters_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the masters: one AdamW step at a fine-tuning learning rate moves almost every float32 weight and leaves
    most bf16 weights where they were."""
    from spec.training import SftStage
    from stages import modeling

    monkeypatch.setattr(modeling, "on_gpu", lambda: True)
    masters = _tiny_bf16_model()
    modeling.float32_masters(masters, SftStage.model_validate({"enabled": False, "method": "full"}))
    assert _fraction_moved_by_one_adam_step(masters, lr=2e-5) > 0.95
    assert _fraction_moved_by_one_adam_step(_tiny_bf16_model(), lr=2e-5) < 0.5


def test_a_model_trained_on_float32_masters_is_saved_in_its_loaded_dtype(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from stages.modeling import BaseRef, StartingModel
    from stages.training import save_stage_model

    run_dir = make_run_dir(tmp_path / "run", n_text=20, n_chat=20)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    model = _tiny_bf16_model().float()  # what float32_masters leaves for training
    start = StartingModel(model=model, kind="full", base=BaseRef("pretrained", "x"), upstream=None)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True))

    save_stage_model(trainer, tokenizer, run_dir, spec, "cpt", replace(start, save_dtype=torch.bfloat16))
    assert {t.dtype for t in load_file(run_dir.stage_dir("cpt") / "model" / "model.safetensors").values()} == {
        torch.bfloat16
    }
    model = _tiny_bf16_model().float()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True))
    save_stage_model(trainer, tokenizer, run_dir, spec, "sft", replace(start, model=model))
    # without save_dtype (CPU, LoRA, FSDP, DeepSpeed, pure_bf16) the weights are saved as they trained
    assert torch.float32 in {
        t.dtype for t in load_file(run_dir.stage_dir("sft") / "model" / "model.safetensors").values()
    }
