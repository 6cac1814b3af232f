"""Tiny models of every family `model.from_config` builds, and mixture-of-experts training done right: LoRA on
the stacked experts (trained, saved, loaded, merged), the router's auxiliary loss, the fused experts kernel on a
GPU, and QLoRA's preparation leaving unquantized experts in bf16 (4-bit experts: tests/test_quantized_experts.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from training_fixtures import make_run_dir, run_stage

from spec.document import SpecError
from spec.loading import load_pipeline
from spec.model import ModelSpec
from spec.training import SftStage
from stages import modeling
from stages.expert_lora import GROUPED_EXPERTS
from stages.modeling import (
    build_from_config,
    expert_parameters,
    experts_note,
    load_adapter,
    lora_config,
    prepare_for_kbit_training,
    router_aux_loss,
)
from stages.packing import PackedCollator
from stages.router_loss import mask_router_loss
from stages.training import read_log_history

ARCHITECTURES = ["qwen2", "qwen3", "qwen3_moe", "llama", "gemma3", "exaone4", "mistral"]
MODEL_TYPES = {"gemma3": "gemma3_text"}  # the text-only Gemma3ForCausalLM's config


class Tokenizer:
    """What build_from_config reads of a tokenizer: its size and special token ids."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return 300


def tiny(architecture: str, **sizes: Any) -> Any:
    """A seeded tiny model of `architecture`, as the stages build it, without a KV cache (as they train it)."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    config = {
        "architecture": architecture,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 32,  # gemma3 and exaone4 then slide a window of 8
        **(moe if architecture == "qwen3_moe" else {}),
        **sizes,
    }
    model = build_from_config(ModelSpec(name_or_path=f"tiny-{architecture}", from_config=config), Tokenizer())
    model.config.use_cache = False
    return model


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows as PackedCollator makes them: three documents (the second longer than the sliding window) and a
    padded one; position ids restart per document, and there is no attention mask."""
    rows = [
        {
            "input_ids": list(range(5, 29)),
            "labels": [-100, *range(6, 12), -100, *range(13, 25), -100, *range(26, 29)],
            "position_ids": [*range(6), *range(12), *range(6)],
        },
        {"input_ids": list(range(40, 50)), "labels": [-100, *range(41, 50)], "position_ids": list(range(10))},
    ]
    return PackedCollator(pad_token_id=Tokenizer.pad_token_id)(rows)


def moe_section(**lora: Any) -> SftStage:
    return SftStage.model_validate({"enabled": False, "method": "lora", "lora": {"r": 4, "alpha": 8, **lora}})


def logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


# --------------------------------------------------------------------------- every family


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_family_builds_and_trains_on_packed_rows(architecture: str) -> None:
    model = tiny(architecture)
    assert model.config.model_type == MODEL_TYPES.get(architecture, architecture)
    assert model.config.vocab_size == 300 and model.config.pad_token_id == 0 and model.config.eos_token_id == 2
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 8  # heads × head_dim, whatever hidden is
    batch = packed_batch()
    assert "attention_mask" not in batch

    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    # Documents stay apart through the position ids: a document's logits packed are its logits alone.
    packed = logits(model, batch)
    for start, end in [(0, 6), (6, 18), (18, 24)]:
        alone = logits(model, {"input_ids": batch["input_ids"][:1, start:end], "position_ids": None})
        torch.testing.assert_close(packed[0, start:end], alone[0], atol=1e-5, rtol=1e-5)


def test_family_settings_fit_a_small_model() -> None:
    gemma = tiny("gemma3", num_hidden_layers=7).config
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"] * 2  # 5:1, and the last layer full
    assert gemma.sliding_window == 8 and gemma.tie_word_embeddings and gemma.query_pre_attn_scalar == 8
    exaone = tiny("exaone4", num_hidden_layers=5).config
    assert exaone.layer_types == ["sliding_attention"] * 3 + ["full_attention"] * 2  # 3:1, and the last layer full
    assert exaone.sliding_window == 8 and not exaone.tie_word_embeddings
    assert tiny("mistral").config.sliding_window is None
    moe = tiny("qwen3_moe").config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 16)
    assert moe.norm_topk_prob and moe.mlp_only_layers == [] and not moe.tie_word_embeddings
    assert not expert_parameters(tiny("qwen3"))


def test_moe_sizes_are_validated_and_named() -> None:
    def error(*overrides: str) -> str:
        with pytest.raises(SpecError) as info:
            load_pipeline("korean-llm", profile="local", overrides=list(overrides))
        return str(info.value)

    assert "model.from_config.num_experts: " in error("model.from_config.num_experts=4")  # qwen3 is dense
    assert "architecture 'qwen3' is dense" in error("model.from_config.num_experts=4")
    message = error(
        "model.from_config.architecture=qwen3_moe",
        "model.from_config.num_experts=2",
        "model.from_config.num_experts_per_tok=3",
    )
    assert "model.from_config.num_experts_per_tok: " in message and "more than num_experts (2)" in message
    assert "stages.sft.training.router_aux_loss_coef" in error("stages.sft.training.router_aux_loss_coef=-0.1")
    spec = load_pipeline("korean-llm", profile="local", overrides=["model.from_config.architecture=qwen3_moe"]).spec
    assert spec.model.from_config.moe_sizes() == (8, 2, 128)  # the defaults: 8 experts, 2 active, the MLP's size
    assert spec.model.from_config.attention().heads == 4


# --------------------------------------------------------------------------- LoRA on the experts


def adapted(section: SftStage) -> Any:
    """A tiny qwen3_moe with the adapter a new LoRA stage puts on it."""
    model = tiny("qwen3_moe")
    return get_peft_model(model, lora_config(section, model))


def test_lora_on_a_moe_model_targets_the_experts() -> None:
    model = adapted(moe_section(dropout=0.05))  # dropped: one adapter, one dropout
    config = model.peft_config["default"]
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(config.target_parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert config.lora_dropout == 0.0  # PEFT has no dropout on parameter adapters
    assert not config.rank_pattern  # the rank asked for, not PEFT's 2r on gate_up_proj
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in name for name in trainable)
    for layer in (0, 1):
        assert sum(f"layers.{layer}.mlp.experts." in name for name in trainable) == 4  # A and B, two matrices
        assert not any(f"layers.{layer}.mlp.gate." in name for name in trainable)  # the router stays frozen


def test_target_experts_off_leaves_the_experts_without_adapters() -> None:
    model = adapted(moe_section(target_experts=False, dropout=0.05))
    config = model.peft_config["default"]
    assert not config.target_parameters and config.lora_dropout == 0.05
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and not any("mlp." in name for name in trainable)

    dense = lora_config(moe_section(dropout=0.05), tiny("llama"))  # a dense model: as the spec says, nothing added
    assert dense.target_modules == "all-linear" and not dense.target_parameters and dense.lora_dropout == 0.05


def test_moe_lora_trains_saves_loads_and_merges(tmp_path: Path) -> None:
    model = adapted(moe_section())
    batch = packed_batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for layer in (0, 1):
        experts = [name for name in saved if f"layers.{layer}.mlp.experts." in name]
        assert len(experts) == 4 and all(".lora_A." in n or ".lora_B." in n for n in experts)  # both matrices
    model.eval()
    trained = logits(model, batch)

    loaded = load_adapter(tiny("qwen3_moe"), tmp_path / "adapter")  # onto a fresh copy of the base
    torch.testing.assert_close(logits(loaded, batch), trained)
    merged = loaded.merge_and_unload()  # as _merge_adapter and load_stage_model do
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, batch), trained, atol=1e-5, rtol=1e-5)
    base = tiny("qwen3_moe")
    for name, param in expert_parameters(merged).items():
        assert not torch.allclose(param, expert_parameters(base)[name])  # the expert adapters, merged in


# --------------------------------------------------------------------------- the router's auxiliary loss


def test_router_aux_loss_coef_weighs_the_load_balancing_loss(capsys: pytest.CaptureFixture[str]) -> None:
    batch = packed_batch()

    def loss_with(coef: float | None) -> tuple[float, float, dict[str, Any]]:
        model = tiny("qwen3_moe")
        section = SftStage.model_validate({"enabled": False, "training": {"router_aux_loss_coef": coef}})
        loaded = router_aux_loss(model, "sft", section)
        with torch.no_grad():
            out = model(**batch)
        aux = out.aux_loss.item() if out.aux_loss is not None else 0.0
        return out.loss.item(), aux, loaded

    off, no_aux, loaded = loss_with(0.0)
    assert no_aux == 0.0 and loaded == {"output_router_logits": False, "router_aux_loss_coef": 0.001}
    heavy, aux, _ = loss_with(0.5)
    assert aux > 0 and heavy == pytest.approx(off + 0.5 * aux, rel=1e-5)
    default, _, _ = loss_with(None)  # the config's own coefficient, Qwen3-MoE's 0.001
    assert default == pytest.approx(off + 0.001 * aux, rel=1e-5)

    dense = tiny("llama")
    section = SftStage.model_validate({"enabled": False, "training": {"router_aux_loss_coef": 0.1}})
    assert router_aux_loss(dense, "sft", section) == {}
    assert "training.router_aux_loss_coef (0.1) ignored" in capsys.readouterr().out


def test_the_router_loss_counts_no_padding() -> None:
    """A padded batch trains as the same rows without padding: the padding is in no load-balancing loss and its
    positions get no gradient. Counted, as a segment of its own, its gradient reached the residual stream at
    positions whose hidden states stay zero (the pad token's embedding row is zero), and RMSNorm's backward at zero
    grows it a thousandfold a norm: on 48 layers, NaN in bf16 (docs/performance.md, B5)."""
    row = {"input_ids": list(range(5, 17)), "labels": [-100, *range(6, 17)], "position_ids": list(range(12))}
    section = SftStage.model_validate({"enabled": False, "training": {"router_aux_loss_coef": 0.5}})

    def step(width: int, mark: bool) -> tuple[float, float, torch.Tensor, dict[str, torch.Tensor]]:
        model = tiny("qwen3_moe", num_hidden_layers=4)
        router_aux_loss(model, "sft", section)
        hooked = mask_router_loss(model) if mark else False
        batch = PackedCollator(Tokenizer.pad_token_id, pad_to_multiple_of=width, mark_padding=hooked)([row])
        embeds = model.model.embed_tokens(batch.pop("input_ids")).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, **batch)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return out.loss.item(), out.aux_loss.item(), embeds.grad[0], grads

    assert torch.count_nonzero(tiny("qwen3_moe").model.embed_tokens.weight[Tokenizer.pad_token_id]) == 0
    loss, aux, at_tokens, grads = step(width=1, mark=True)  # 12 tokens: no padding
    padded_loss, padded_aux, padded_at, padded_grads = step(width=32, mark=True)  # and 20 of padding
    assert padded_loss == pytest.approx(loss, rel=1e-6) and padded_aux == pytest.approx(aux, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(padded_at[:12], at_tokens, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(padded_at[12:]) == 0

    # Unmarked, the padding is balanced too. Its gradient meets one norm at zero, the first (the pad token's zero
    # embedding row, whose gradient the embedding drops), because the padding runs on from the last document
    # (PackedCollator); as a segment of its own its hidden states stayed zero in every layer: about 1e5 times the
    # tokens' gradient here, against about 50.
    _, counted_aux, counted_at, _ = step(width=32, mark=False)
    assert counted_aux != pytest.approx(aux, rel=1e-3)
    assert 0 < counted_at[12:].abs().max() < 1e3 * at_tokens.abs().max()


@pytest.mark.parametrize("fused", [False, True], ids=["model_forward", "trl_fused_head"])
def test_the_router_loss_mask_reaches_through_the_adapter_wrapper(fused: bool) -> None:
    """As the stages hook it: on the PEFT model the trainer calls, with the mask in the batch the collator makes,
    through the model's own forward (cpt's Trainer) and TRL's fused LM head (sft's SFTTrainer), which takes the
    load-balancing loss itself, without a mask."""
    from trl.trainer.utils import add_fused_lm_head

    row = {"input_ids": list(range(5, 17)), "labels": [-100, *range(6, 17)], "position_ids": list(range(12))}
    section = moe_section(target_experts=True)

    def losses(width: int) -> tuple[float, float]:
        model = tiny("qwen3_moe")
        router_aux_loss(model, "sft", section)
        model = get_peft_model(model, lora_config(section, model))
        if fused:
            add_fused_lm_head(model.get_base_model())  # as SFTTrainer does
        batch = PackedCollator(Tokenizer.pad_token_id, pad_to_multiple_of=width, mark_padding=mask_router_loss(model))
        with torch.no_grad():
            out = model(**batch([row]), **({"fused_lm_head": True} if fused else {}))
        return out.loss.item(), out.aux_loss.item()

    padded, alone = losses(width=32), losses(width=1)
    assert padded == pytest.approx(alone, rel=1e-6)
    assert not mask_router_loss(tiny("llama"))  # no router: nothing to mask, and the collator marks nothing


def test_the_saved_model_keeps_its_own_router_settings(tmp_path: Path) -> None:
    """The coefficient a stage trained with is a training setting: the model it saves has its config's own."""
    import json

    from transformers import Trainer, TrainingArguments

    from stages.modeling import BaseRef, StartingModel
    from stages.training import save_stage_model

    run_dir = make_run_dir(tmp_path / "run", n_text=20, n_chat=20)
    spec = run_dir.load_spec()
    model = tiny("qwen3_moe")
    section = SftStage.model_validate({"enabled": False, "training": {"router_aux_loss_coef": 0.5}})
    loaded = router_aux_loss(model, "cpt", section)
    assert model.config.output_router_logits and model.router_aux_loss_coef == 0.5
    start = StartingModel(
        model=model, kind="full", base=BaseRef("pretrained", "x"), upstream=None, loaded_config=loaded
    )
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True))
    save_stage_model(trainer, modeling.load_tokenizer(run_dir, spec.model), run_dir, spec, "cpt", start)
    saved = json.loads((run_dir.stage_dir("cpt") / "model" / "config.json").read_text())
    assert (saved["output_router_logits"], saved["router_aux_loss_coef"]) == (False, 0.001)


# --------------------------------------------------------------------------- fused experts, QLoRA


def test_experts_run_as_a_grouped_gemm_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert modeling.experts_implementation() is None  # CPU: transformers' default
    monkeypatch.setattr(modeling, "on_gpu", lambda: True)
    assert modeling.experts_implementation() == GROUPED_EXPERTS  # the grouped GEMM, through the stages' experts forward
    switched: list[str] = []
    moe = tiny("qwen3_moe")
    monkeypatch.setattr(moe, "set_experts_implementation", switched.append)
    modeling._fused_experts(moe)
    assert switched == [GROUPED_EXPERTS]
    modeling._fused_experts(tiny("llama"))  # a dense model refuses the setting: it is not asked


def test_liger_leaves_a_mixture_of_experts_its_grouped_experts_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's SwiGLU swaps transformers' experts for a per-expert loop and breaks on the experts' LoRA wrapper
    (measured, B5 in docs/performance.md): a mixture of experts gets Liger's other kernels only."""
    from stages import training

    moe, dense = tiny("qwen3_moe"), tiny("llama")
    assert training.kernel_arguments(moe) == {}  # CPU: no Liger
    monkeypatch.setattr(training, "on_gpu", lambda: True)
    monkeypatch.setattr(training.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    assert training.kernel_arguments(dense) == {"use_liger_kernel": True}
    expected = {"use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}}
    assert training.kernel_arguments(moe) == expected
    adapted = get_peft_model(moe, lora_config(moe_section(target_experts=True), moe))
    assert training.kernel_arguments(adapted) == expected  # the experts found under PEFT's wrapper too


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_adapter_inputs_skip_peft_float32_cast_only_where_autocast_runs(
    architecture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpt/sft on a GPU: LoRA layers take bf16 inputs (PEFT's cast to the float32 adapter is a round trip under
    autocast); the logits are bit for bit those of PEFT's casting path under autocast. Not on CPU, not in rlhf."""
    model = tiny(architecture).to(torch.bfloat16)
    adapter = get_peft_model(model, lora_config(moe_section(dropout=0.0), model))
    for name, param in adapter.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # B starts at 0: make the adapter count
    assert modeling.adapter_inputs_uncast(adapter, "sft") == 0  # CPU: nothing changes
    batch = {"input_ids": torch.randint(3, 300, (2, 12)), "position_ids": torch.arange(12).repeat(2, 1)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = logits(adapter, batch)

    monkeypatch.setattr(modeling, "on_gpu", lambda: True)
    assert modeling.adapter_inputs_uncast(adapter, "rlhf") == 0
    layers = modeling.adapter_inputs_uncast(adapter, "sft")
    assert layers >= 4 * 2  # q, k, v, o of both layers (and the dense MLP's)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        uncast = logits(adapter, batch)
    assert torch.equal(cast, uncast)
    with pytest.raises(RuntimeError):  # outside autocast a bf16 input meets the float32 adapter: why rlhf keeps it
        logits(adapter, batch)


def test_qlora_preparation_keeps_unquantized_experts_in_bf16() -> None:
    # Experts that did not load in 4-bit (stages/experts_quantizer.py) are not cast to float32 by PEFT's preparation.
    model = tiny("qwen3_moe").to(torch.bfloat16)
    note = experts_note(model)
    experts = sum(p.numel() * 2 for p in expert_parameters(model).values())
    assert note is not None and "4 stacked expert tensors" in note and "stay bfloat16" in note
    assert f"{experts / 2**30:.2f} GiB" in note
    model = prepare_for_kbit_training(model, gradient_checkpointing=False)
    assert {p.dtype for p in expert_parameters(model).values()} == {torch.bfloat16}
    assert all(p.numel() > 0 for p in expert_parameters(model).values())
    others = [p for name, p in model.named_parameters() if name not in expert_parameters(model)]
    assert {p.dtype for p in others} == {torch.float32}  # PEFT's float32 cast, everywhere else
    assert not any(p.requires_grad for p in model.parameters())
    assert experts_note(tiny("qwen3")) is None


# --------------------------------------------------------------------------- the sft stage


@pytest.mark.slow
def test_sft_stage_trains_and_merges_lora_on_a_moe_model(tmp_path: Path) -> None:
    """The sft stage on a tiny qwen3_moe: LoRA on attention and experts, the router aux loss in the loss, the
    adapter merged at the end (lora.merge_after); the merged model computes what the adapter on its base does."""
    overrides = [
        "model.from_config.architecture=qwen3_moe",
        "model.from_config.num_experts=4",
        "stages.cpt.enabled=false",
        "stages.sft.training.max_steps=4",
        "stages.sft.training.save_steps=4",
        "stages.sft.training.logging_steps=1",
        "stages.sft.training.router_aux_loss_coef=0.01",
        "stages.sft.lora.merge_after=true",
        "stages.sft.lora.dropout=0.05",
    ]
    run_dir = make_run_dir(tmp_path / "run", overrides=overrides, n_text=20, n_chat=60)
    done = run_stage(run_dir, "sft")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "router load-balancing loss: 0.01 × aux loss" in done.stdout
    # The progress line at each logging interval (every step here), the last with nothing left to go.
    assert re.search(r"^\[sft\] step 1/4 · loss [\d.]+ · [\d.]+k? tok/s · ETA \d+s$", done.stdout, re.M)
    assert re.search(r"^\[sft\] step 4/4 · loss [\d.]+ · [\d.]+k? tok/s · ETA 0s$", done.stdout, re.M)
    assert "lora.dropout 0.05 → 0" in done.stdout
    result = run_dir.read_result("sft")
    assert result is not None and result.extra["model_kind"] == "full"
    history = read_log_history(run_dir.stage_dir("sft") / "logs" / "log_history.json")
    assert all(entry["aux_loss"] > 0 for entry in history if "loss" in entry)  # TRL's aux_loss metric

    spec = run_dir.load_spec()
    tokenizer = modeling.load_tokenizer(run_dir, spec.model)
    checkpoint = run_dir.stage_dir("sft") / "checkpoints" / "checkpoint-4"
    adapter_keys = load_file(checkpoint / "adapter_model.safetensors")
    assert any("mlp.experts.lora_A" in name for name in adapter_keys)
    merged = modeling.load_stage_model(run_dir, spec, "sft", tokenizer)
    assert merged.config.output_router_logits is False  # the training setting is not the model's
    adapter = load_adapter(modeling.load_base(run_dir, spec, modeling.spec_base(spec), tokenizer), checkpoint)
    ids = torch.tensor([tokenizer("서울은 아름답습니다. 한강은 유명합니다.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
