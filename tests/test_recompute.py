"""training.recompute_layers (stages/recompute.py): only the first N decoder layers recompute their activations, under
transformers' checkpointing, FSDP2's checkpoint wrappers and the decoder layers compiled whole; the loss and every
gradient stay those of recomputing every layer; a real Trainer applies it after turning checkpointing on; the spec
refuses it where nothing recomputes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_model_families import packed_batch, tiny
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from training_fixtures import spec_error

from stages.float8 import compile_decoder_layers
from stages.recompute import RecomputeLayers, keep_activations, recomputing_layers


def attention_calls(model: Any) -> Counter[int]:
    """A counter of each decoder layer's attention calls: one in the forward, one more in a recomputation."""
    calls: Counter[int] = Counter()
    for index, layer in enumerate(model.get_decoder().layers):
        layer.self_attn.register_forward_hook(lambda *_, index=index: calls.update([index]))
    return calls


def step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(**packed_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointed(architecture: str, layers: int, lora: bool = False) -> Any:
    torch.manual_seed(0)
    model = tiny(architecture, num_hidden_layers=layers)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


@pytest.mark.parametrize(("architecture", "lora"), [("qwen3_moe", True), ("llama", False)])
def test_only_the_first_layers_recompute_with_the_same_loss_and_gradients(architecture: str, lora: bool) -> None:
    every = checkpointed(architecture, 4, lora)
    every_calls = attention_calls(every)
    loss, grads = step(every)
    assert every_calls == {0: 2, 1: 2, 2: 2, 3: 2}

    partial = checkpointed(architecture, 4, lora)
    assert keep_activations(partial, 1) == (1, 4)
    calls = attention_calls(partial)
    partial_loss, partial_grads = step(partial)
    assert calls == {0: 2, 1: 1, 2: 1, 3: 1}  # layers 1-3 kept their activations
    assert torch.equal(partial_loss, loss)
    assert partial_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(partial_grads[name], grad), name


def test_fsdp_s_checkpoint_wrappers_keep_the_first_layers_only() -> None:
    """accelerate's activation_checkpointing under FSDP2 wraps each decoder layer in torch's checkpoint_wrapper (the
    layer's own flag off): the layers after the first N call the wrapped layer directly."""
    torch.manual_seed(0)
    model = tiny("qwen3", num_hidden_layers=3)
    layers = model.model.layers
    for index in range(len(layers)):
        layers[index] = checkpoint_wrapper(layers[index], preserve_rng_state=False)
    calls = Counter()
    for index, wrapper in enumerate(layers):
        wrapper._checkpoint_wrapped_module.self_attn.register_forward_hook(lambda *_, i=index: calls.update([i]))
    assert len(recomputing_layers(model)) == 3
    loss, _ = step(model)
    assert calls == {0: 2, 1: 2, 2: 2}

    calls.clear()
    model.zero_grad()
    assert keep_activations(model, 2) == (2, 3)
    partial_loss, _ = step(model)
    assert calls == {0: 2, 1: 2, 2: 1}
    assert torch.equal(partial_loss, loss)


def test_more_layers_than_the_model_has_recompute_every_layer() -> None:
    model = checkpointed("qwen3", 2)
    assert keep_activations(model, 10) == (2, 2)
    calls = attention_calls(model)
    step(model)
    assert calls == {0: 2, 1: 2}


def test_the_trainer_applies_it_after_turning_checkpointing_on(tmp_path: Any, capsys: Any) -> None:
    """The callback's on_train_begin comes after the Trainer enabled checkpointing in every layer (were it before,
    the Trainer would turn it back on everywhere)."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = tiny("qwen3_moe", num_hidden_layers=3)
    calls = attention_calls(model)
    batch = {k: v[0] for k, v in packed_batch().items()}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=1,
        activation_checkpointing=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=[batch], callbacks=[RecomputeLayers("sft", 1)])
    trainer.train()
    assert calls == {0: 2, 1: 1, 2: 1}
    said = "[sft] activation recomputation in 1 of 3 decoder layers (training.recompute_layers)"
    assert said in capsys.readouterr().out


def test_layers_compiled_whole_checkpoint_the_first_ones_only() -> None:
    model = tiny("qwen3", num_hidden_layers=3)
    plain = type(model.model.layers[0])
    compile_decoder_layers(model, checkpointing=True, recompute_layers=1)
    assert [type(layer) is plain for layer in model.model.layers] == [False, True, True]


def test_the_spec_refuses_it_where_no_layer_recomputes() -> None:
    message = spec_error(
        "korean-llm", ["stages.sft.training.gradient_checkpointing=false", "stages.sft.training.recompute_layers=40"]
    )
    assert "recompute_layers" in message and "gradient_checkpointing: true" in message
