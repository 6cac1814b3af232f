"""The stages' experts forward (stages/expert_lora.py): without adapters, transformers' grouped_mm forward's loss and
gradients for every weight (the routing weight moved onto the intermediate, gathers whose backward gathers); LoRA on
stacked experts as low-rank grouped products with the same loss and the same gradient for every trained parameter
as PEFT's merged weights, with and without activation checkpointing; PEFT's path where the low-rank one does not
apply; nothing of it saved with the model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_model_families import packed_batch, tiny

from stages import expert_lora, modeling
from stages.expert_lora import FACTORS, GROUPED_EXPERTS, use_low_rank_experts

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def adapted(r: int = 4, experts_implementation: str = "grouped_mm") -> Any:
    """A tiny qwen3_moe with adapters on attention and on both expert matrices, B not zero (as after training), so
    that every adapter changes the output; its experts run as the stock grouped GEMM (PEFT's merged weights)."""
    torch.manual_seed(0)
    model = tiny("qwen3_moe")
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS, init_lora_weights=False
    )
    model = get_peft_model(model, config)
    model.get_base_model().set_experts_implementation(experts_implementation)
    return model


def loss_and_grads(model: Any, checkpointing: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    loss = model(**packed_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def full_loss_and_grads(
    experts_implementation: str, checkpointing: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full fine-tuning's loss and gradients (router and experts included) of a tiny qwen3_moe."""
    torch.manual_seed(0)
    model = tiny("qwen3_moe")
    model.set_experts_implementation(experts_implementation)
    return loss_and_grads(model, checkpointing)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_stage_experts_forward_gives_grouped_mm_s_loss_and_gradients(checkpointing: bool) -> None:
    loss, grads = full_loss_and_grads(GROUPED_EXPERTS, checkpointing)
    expected_loss, expected_grads = full_loss_and_grads("grouped_mm", checkpointing)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == expected_grads.keys()
    assert any(".mlp.gate." in n for n in grads) and any(".mlp.experts." in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_gather_s_backward_sums_each_row_s_copies() -> None:
    # Three tokens, each routed to two experts, sorted by expert: the backward of the gather that sorts them is
    # the scatter-add indexing's backward would do, as a gather and a sum.
    tokens = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    experts = torch.tensor([[2, 0], [1, 2], [0, 1]])
    _, perm = torch.sort(experts.reshape(-1))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    upstream = torch.randn(6, 4, dtype=torch.float64)
    (expert_lora.Gather.apply(tokens, perm // 2, inverse, 2) * upstream).sum().backward()
    expected = torch.zeros(3, 4, dtype=torch.float64).index_add_(0, perm // 2, upstream)
    torch.testing.assert_close(tokens.grad, expected)
    # and back to token order: a permutation, whose backward is the inverse permutation
    rows = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    (expert_lora.Gather.apply(rows, inverse, perm, 1) * upstream).sum().backward()
    torch.testing.assert_close(rows.grad, upstream[perm])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_low_rank_experts_give_peft_s_loss_and_gradients(checkpointing: bool) -> None:
    reference = adapted()
    low_rank = copy.deepcopy(reference)
    assert use_low_rank_experts(low_rank) == 4  # two matrices in each of two layers
    assert low_rank.get_base_model().config._experts_implementation == GROUPED_EXPERTS

    calls = []
    original = expert_lora._projection
    counted = lambda *args: calls.append(args[1]) or original(*args)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_lora, "_projection", counted)
        loss, grads = loss_and_grads(low_rank, checkpointing)
    expected_loss, expected_grads = loss_and_grads(reference, checkpointing)

    assert calls.count("gate_up_proj") >= 2 and calls.count("down_proj") >= 2  # the low-rank path ran
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == expected_grads.keys()
    assert sum(".mlp.experts." in n for n in grads) == 8  # A and B of both matrices, both layers
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    for module in low_rank.modules():  # the factors are the call's only
        assert not getattr(module, FACTORS, {})


def test_the_eager_loop_agrees_too() -> None:
    # transformers' per-expert loop (the CPU default) over PEFT's merged weights: the same model.
    eager = adapted(experts_implementation="eager")
    low_rank = copy.deepcopy(eager)
    use_low_rank_experts(low_rank)
    loss, grads = loss_and_grads(low_rank)
    expected_loss, expected_grads = loss_and_grads(eager)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_rank_the_grouped_gemm_cannot_align_keeps_peft_s_path() -> None:
    # r = 2 in fp32: a row of the low-rank product is 8 bytes, not the 16 CUDA's grouped GEMM aligns to.
    reference = adapted(r=2)
    low_rank = copy.deepcopy(reference)
    use_low_rank_experts(low_rank)
    calls = []
    original = expert_lora._projection
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_lora, "_projection", lambda *args: calls.append(args) or original(*args))
        loss, _ = loss_and_grads(low_rank)
    assert calls and not any(factors for *_, factors in calls)  # grouped products, none with factors
    torch.testing.assert_close(loss, loss_and_grads(reference)[0])


def test_a_model_without_expert_adapters_is_left_as_it_is() -> None:
    model = get_peft_model(tiny("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]))
    before = model.get_base_model().config._experts_implementation
    assert use_low_rank_experts(model) == 0
    assert model.get_base_model().config._experts_implementation == before


def test_what_is_saved_names_no_low_rank_path(tmp_path: Path) -> None:
    # The adapter and the merged model are PEFT's and transformers' own: vLLM and a plain transformers load them.
    model = adapted()
    use_low_rank_experts(model)
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    for path in (tmp_path / "adapter").iterdir():
        if path.suffix == ".json":
            assert GROUPED_EXPERTS not in path.read_text(encoding="utf-8"), path
    config = json.loads((tmp_path / "merged" / "config.json").read_text(encoding="utf-8"))
    assert GROUPED_EXPERTS not in json.dumps(config)


def test_a_lora_stage_on_grouped_experts_takes_the_low_rank_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the stages do where the experts run grouped (a GPU; here the choice is forced): the new adapter's expert
    # wrappers switch; on CPU's per-expert loop they stay PEFT's.
    model = adapted(experts_implementation="eager")
    modeling.low_rank_experts(model, "sft")
    assert model.get_base_model().config._experts_implementation == "eager"
    monkeypatch.setattr(modeling, "experts_implementation", lambda: GROUPED_EXPERTS)
    modeling.low_rank_experts(model, "sft")
    assert model.get_base_model().config._experts_implementation == GROUPED_EXPERTS
    wrappers = [m for m in model.modules() if "_activate_lora" in m.__dict__]
    assert len(wrappers) == 4


def test_float32_experts_multiply_in_autocast_s_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # Full fine-tuning's float32 master weights under the Trainer's bf16 autocast: the grouped GEMM (which autocast
    # does not cast) gets the experts in bf16, and their gradient reaches the float32 weights.
    from transformers.integrations import moe

    dtypes: list[torch.dtype] = []
    original = moe._grouped_linear
    monkeypatch.setattr(moe, "_grouped_linear", lambda x, w, *a, **k: dtypes.append(w.dtype) or original(x, w, *a, **k))
    torch.manual_seed(0)
    model = tiny("qwen3_moe")
    model.set_experts_implementation(GROUPED_EXPERTS)
    expected = model(**packed_batch()).loss.detach()
    dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**packed_batch()).loss
    loss.backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    torch.testing.assert_close(loss.float(), expected, rtol=2e-2, atol=0)
    experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
    assert experts and all(p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0 for p in experts)


def test_a_rank_s_experts_mask_the_routes_to_other_ranks() -> None:
    # Expert parallelism with a shared batch (transformers' all-reduce dispatch): this rank holds experts 2 and 3 of
    # four, and the routes to the others come as local id 2 (one past its experts) with weight 0. Its output and
    # gradients are the whole layer's with those routes' weights zeroed: the unwritten rows never reach either.
    torch.manual_seed(0)
    whole = tiny("qwen3_moe").model.layers[0].mlp.experts
    whole.config._experts_implementation = GROUPED_EXPERTS
    half = copy.deepcopy(whole)
    half.num_experts = 2
    half._is_expert_parallel = True
    for name in ("gate_up_proj", "down_proj"):
        setattr(half, name, torch.nn.Parameter(getattr(whole, name).detach()[2:].clone()))
    tokens = torch.randn(6, whole.gate_up_proj.size(-1), requires_grad=True)
    routes = torch.tensor([[0, 2], [3, 1], [2, 3], [1, 0], [3, 0], [0, 1]])
    weights = torch.rand(6, 2)
    here = routes >= 2

    (whole(tokens, routes, weights * here) ** 2).sum().backward()
    expected_tokens, expected = tokens.grad.clone(), {n: p.grad[2:] for n, p in whole.named_parameters()}
    tokens.grad = None
    output = half(tokens, torch.where(here, routes - 2, 2), weights * here)
    torch.testing.assert_close(output, whole(tokens, routes, weights * here))
    (output**2).sum().backward()
    torch.testing.assert_close(tokens.grad, expected_tokens)
    for name, parameter in half.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], msg=name)
