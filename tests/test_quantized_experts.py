"""4-bit experts for QLoRA (stages/experts_quantizer.py, stages/quantized_experts.py): a mixture-of-experts model's
stacked experts load as NF4 through transformers' loader, train as the same weights dequantized into a plain model
would (LoRA on attention, and on the experts themselves), and keep nothing of the dequantized size for the backward.
bitsandbytes' CPU backend quantizes here as its CUDA one does on a GPU."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_expert_lora import loss_and_grads
from test_model_families import packed_batch, tiny
from transformers import AutoModelForCausalLM

from stages import expert_lora
from stages.expert_lora import GROUPED_EXPERTS, use_low_rank_experts
from stages.experts_quantizer import ExpertsBitsAndBytesConfig
from stages.modeling import expert_parameters, experts_note, prepare_for_kbit_training
from stages.quantized_experts import dequantize, is_quantized, quantized_experts, shaped_experts

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(autouse=True, scope="module")
def bitsandbytes_reference_kernels() -> Iterator[None]:
    """bitsandbytes' own reference (PyTorch) kernels where its native CPU ones are wrong. On CPUs with AVX512-BF16
    (e.g. Sapphire Rapids Xeons) bitsandbytes 0.50.2 dequantizes NF4 blocks of 64 with a mean relative error of
    0.35 where its reference kernel (which its CUDA kernel matches) gives 0.09, and its Linear4bit repacks the
    weight for a CPU GEMM that refuses layers narrower than 32 (measured 2026-12-03). These tests hold the stages'
    4-bit experts to PEFT's path on the same dequantized weights, so both must dequantize as a GPU does. The kernel
    override lasts for the rest of the test process (torch.library cannot take it back); it is bitsandbytes' own."""
    if not bnb.functional.has_avx512bf16():
        yield
        return
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    def reference(
        A: torch.Tensor,
        absmax: torch.Tensor,
        blocksize: int,
        quant_type: str,
        shape: Sequence[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        code = _get_4bit_code(quant_type, A.device)
        return _dequantize_4bit_compute(A.view(torch.uint8).reshape(-1), absmax, code, blocksize, shape, dtype)

    torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu", reference)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: False)
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny qwen3_moe saved as a checkpoint, and its expert stacks."""
    model = tiny("qwen3_moe")
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return path, {name: p.detach().clone() for name, p in expert_parameters(model).items()}


def load_4bit(path: Path) -> Any:
    """The checkpoint as the qlora stages load it (modeling._quantization_config's settings), on CPU."""
    config = ExpertsBitsAndBytesConfig(
        bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, device_map={"": "cpu"}, dtype=torch.float32
    )
    model.config.use_cache = False
    return model


def test_the_experts_load_in_4bit(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, original = saved
    model = load_4bit(path)
    four_bit = quantized_experts(model)
    assert four_bit.keys() == original.keys() == expert_parameters(model).keys()  # both matrices, both layers
    for name, weight in four_bit.items():
        assert isinstance(weight, bnb.nn.Params4bit) and weight.dtype == torch.uint8
        assert weight.numel() == original[name].numel() // 2  # two weights a byte
        assert weight.quant_state.shape == original[name].shape and weight.quant_state.quant_type == "nf4"
        restored = dequantize(weight, torch.float32)
        error = (restored - original[name]).abs().mean() / original[name].abs().mean()
        assert 0 < error < 0.15, name  # NF4's rounding, not another tensor
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)  # bitsandbytes' own, as before
    assert model.config._experts_implementation == GROUPED_EXPERTS
    assert model.quantization_method == "bitsandbytes"  # a bitsandbytes model to the Trainer and PEFT
    note = experts_note(model)
    assert note is not None and "4 stacked expert tensors" in note and "4-bit NF4" in note
    prepared = prepare_for_kbit_training(model, gradient_checkpointing=False)
    assert quantized_experts(prepared).keys() == original.keys()  # PEFT's float32 cast leaves them 4-bit


def dequantized_copy(model: Any) -> Any:
    """`model` with its 4-bit expert stacks replaced by their dequantized float32 weights, run by transformers'
    stock grouped experts (through PEFT's own path for adapters on them)."""
    plain = copy.deepcopy(model)
    for name, weight in quantized_experts(plain).items():
        module_name, _, attribute = name.rpartition(".")
        module = plain.get_submodule(module_name)
        module._parameters[attribute] = torch.nn.Parameter(dequantize(weight, torch.float32), requires_grad=False)
    assert not quantized_experts(plain)
    plain.set_experts_implementation("grouped_mm")
    return plain


def with_adapter(model: Any, experts: bool) -> Any:
    torch.manual_seed(0)  # the same adapter on both models; B not zero, so that every adapter changes the output
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERTS if experts else None,
        init_lora_weights=False,
    )
    with shaped_experts(model):
        model = get_peft_model(model, config)
    if quantized_experts(model):  # as modeling.low_rank_experts on CPU: the plain copy keeps PEFT's path
        use_low_rank_experts(model)
    return model


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "attention+experts"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_4bit_experts_train_as_their_dequantized_weights(
    saved: tuple[Path, dict[str, torch.Tensor]], experts: bool, checkpointing: bool
) -> None:
    model = load_4bit(saved[0])
    reference = with_adapter(dequantized_copy(model), experts)
    quantized = with_adapter(model, experts)
    assert quantized_experts(quantized)  # the stacks are 4-bit again after PEFT saw their shapes
    assert reference.get_base_model().config._experts_implementation == "grouped_mm"  # PEFT's merged path there

    calls = []
    original = expert_lora._projection
    counted = lambda *args: calls.append(is_quantized(getattr(args[0], args[1]))) or original(*args)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_lora, "_projection", counted)
        loss, grads = loss_and_grads(quantized, checkpointing)
    expected_loss, expected_grads = loss_and_grads(reference, checkpointing)

    assert calls and all(calls)  # every projection read a 4-bit stack
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == expected_grads.keys()
    assert sum(".mlp.experts." in n for n in grads) == (8 if experts else 0)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_nothing_of_the_dequantized_size_is_kept_for_the_backward(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    def saved_sizes(model: Any) -> list[torch.Size]:
        sizes: list[torch.Size] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape) or t, lambda t: t):
            model(**packed_batch()).loss.backward()
        return sizes

    stacks = {p.shape for p in saved[1].values()}
    model = load_4bit(saved[0])
    reference = with_adapter(dequantized_copy(model), experts=False)
    assert stacks & set(saved_sizes(reference))  # the stock path keeps each stack it multiplied by
    assert not stacks & set(saved_sizes(with_adapter(model, experts=False)))


def test_a_rank_the_grouped_product_cannot_take_is_refused_by_name(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    # Neither path can apply it to a 4-bit stack: the stage says so before training, naming the field; the
    # forward refuses too, should a model reach it another way.
    from stages.contract import NotSupportedHere
    from stages.modeling import low_rank_experts

    model = load_4bit(saved[0])
    config = LoraConfig(r=3, target_modules=["q_proj"], target_parameters=EXPERTS)
    with shaped_experts(model):
        model = get_peft_model(model, config)
    with pytest.raises(
        NotSupportedHere, match=r"stages\.sft\.lora\.r: LoRA on 4-bit or split experts \(down_proj, gate_up_proj\)"
    ):
        low_rank_experts(model, "sft")
    with pytest.raises(ValueError, match=r"4-bit or expert-parallel experts \((gate_up|down)_proj\).*lora.r is 3"):
        model(**packed_batch())


def test_the_qlora_stage_loads_4bit_experts_and_puts_its_adapters_on_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stage's own loading (load_starting_model): its quantization config, PEFT's preparation, adapters on
    # attention and experts through shaped_experts, the low-rank path. QLoRA needs a GPU in a real run
    # (check_method); bitsandbytes' CPU backend does the same here.
    from training_fixtures import make_run_dir

    from stages import modeling

    overrides = ["stages.cpt.enabled=false", "stages.sft.method=qlora", "stages.sft.lora.target_experts=true"]
    run_dir = make_run_dir(tmp_path / "run", overrides=overrides, n_text=20, n_chat=20)
    spec = run_dir.load_spec()
    tokenizer = modeling.load_tokenizer(run_dir, spec.model)
    assert spec.model.from_config is not None
    sizes = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    moe = spec.model.model_copy(update={"from_config": spec.model.from_config.model_copy(update=sizes)})
    modeling.build_from_config(moe, tokenizer).save_pretrained(tmp_path / "moe")
    spec.model = spec.model.model_copy(update={"from_config": None, "name_or_path": str(tmp_path / "moe")})
    monkeypatch.setattr(modeling, "check_method", lambda stage, section: None)

    model = modeling.load_starting_model(run_dir, spec, "sft", tokenizer).model
    assert len(quantized_experts(model)) == 4
    wrapped = [n for n, p in model.named_parameters() if p.requires_grad and ".mlp.experts." in n and "lora_" in n]
    assert len(wrapped) == 8  # A and B on both stacks of both layers
    assert model.get_base_model().config._experts_implementation == GROUPED_EXPERTS
    ids = torch.tensor([tokenizer("안녕하세요. 반갑습니다.")["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if n in wrapped}
    assert all(g is not None for g in grads.values())
    assert all(
        g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n
    )  # a new adapter's B starts at 0, so A's is 0


def test_float32_tokens_meet_a_bf16_stack_in_bf16_as_the_stock_product_does() -> None:
    # QLoRA's float32 norms hand the experts float32 tokens; the stock grouped product casts them to the weight's
    # dtype, and so must the 4-bit one (a float32 product made QLoRA steps 3.5x slower on an H200).
    from transformers.integrations.moe import _grouped_linear

    from stages.quantized_experts import NF4GroupedLinear

    torch.manual_seed(0)
    weight = (torch.randn(4, 16, 32) * 0.02).to(torch.bfloat16)
    four_bit = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4").to("cpu")
    plain = dequantize(four_bit, torch.bfloat16)
    offsets = torch.tensor([3, 5, 9, 12], dtype=torch.int32)
    tokens = torch.randn(12, 32, requires_grad=True)

    out = NF4GroupedLinear.apply(tokens, four_bit, offsets, False)
    expected = _grouped_linear(tokens, plain, offsets)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    (grad,) = torch.autograd.grad(out.float().sum(), tokens)
    (expected_grad,) = torch.autograd.grad(expected.float().sum(), tokens)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_zero2", "fsdp"])
def test_the_experts_are_4bit_except_under_fsdp(strategy: str) -> None:
    # FSDP2 replaces each parameter it shards by a DTensor, which drops a 4-bit stack's quantization state.
    from transformers import BitsAndBytesConfig

    from spec.model import ModelSpec
    from spec.training import SftStage
    from stages.modeling import _quantization_config

    section = SftStage.model_validate({"enabled": False, "method": "qlora", "distributed": {"strategy": strategy}})
    config = _quantization_config(section, ModelSpec(name_or_path="Qwen/Qwen3-30B-A3B-Base"))
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert isinstance(config, ExpertsBitsAndBytesConfig) == (strategy != "fsdp")
    assert isinstance(config, BitsAndBytesConfig)
