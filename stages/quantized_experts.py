"""4-bit (NF4) experts for QLoRA: a mixture-of-experts model's stacked expert weights quantized as they load, and
dequantized inside the grouped path.

bitsandbytes, through transformers 5, quantizes nn.Linear modules only. transformers 5 keeps a layer's experts as
3-D parameters (qwen3_moe: `gate_up_proj` [experts, 2 x moe width, hidden], `down_proj` [experts, hidden, moe
width]), so under plain QLoRA they stay bf16: 54 of Qwen3-30B-A3B's 55.6 GiB (docs/performance.md, MoE QLoRA
memory). Here they are 4-bit too:

- **Loading** (stages/experts_quantizer.py): transformers' bitsandbytes quantizer, which also quantizes each
  stacked expert tensor as it arrives (bitsandbytes' `Params4bit`, the same NF4 blocks, double quantization and
  storage as its Linear4bit layers), so no bf16 copy of the experts is ever whole on the GPU.
- **Forward** (`NF4GroupedLinear`): the grouped GEMM over the dequantized weight, which autograd does not keep:
  the backward dequantizes again (what bitsandbytes' own 4-bit matmul does for Linear4bit), so a layer's bf16
  experts exist only while it computes. The experts run expert_lora's GROUPED_EXPERTS forward, which reads each
  weight through `grouped_projection` here.
- **Adapters on the 4-bit experts** (`lora.target_experts`): PEFT's own, created while `shaped_experts` shows it
  each stack's shape (a packed 4-bit tensor has none), applied as expert_lora's low-rank grouped products.

tests/test_quantized_experts.py checks loss and gradients against the same weights dequantized into a plain model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def is_expert_stack(module: Any, name: str, shape: torch.Size) -> bool:
    """Whether `module.name` is a stack of expert weights: a 3-D parameter, one matrix per expert, of a module that
    counts its experts in `num_experts` (transformers 5's experts modules)."""
    count = getattr(module, "num_experts", None)
    return isinstance(count, int) and len(shape) == 3 and shape[0] == count and not name.endswith("bias")


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether `weight` is a 4-bit bitsandbytes tensor (its shape then is the packed bytes', `quant_state.shape` the
    weight's)."""
    return getattr(weight, "quant_state", None) is not None and getattr(weight, "bnb_quantized", False)


def quantized_experts(model: Any) -> dict[str, torch.Tensor]:
    """The model's 4-bit expert stacks, by name (empty when its experts are not quantized)."""
    found: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if not isinstance(getattr(module, "num_experts", None), int):
            continue
        for name, param in module.named_parameters(recurse=False):
            if is_quantized(param) and len(param.quant_state.shape) == 3:
                found[f"{module_name}.{name}"] = param
    return found


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit weight as a `dtype` tensor of its own shape (bitsandbytes' kernel)."""
    import bitsandbytes.functional as F

    return F.dequantize_4bit(weight.data, weight.quant_state).to(dtype)


class NF4GroupedLinear(torch.autograd.Function):
    """The grouped linear layer over a frozen 4-bit expert stack: forward and backward each dequantize it, and
    nothing of the dequantized size is kept between them. The weight is dequantized to the dtype it was quantized
    from and the tokens meet it in that dtype, as the stock grouped product casts them (under QLoRA's autocast the
    tokens arrive in float32 from the float32 norms: a float32 product would be a 3.5x slower step)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> Any:
        from transformers.integrations.moe import _grouped_linear

        ctx.weight, ctx.transposed, ctx.tokens_dtype = weight, transposed, tokens.dtype
        ctx.save_for_backward(offsets)
        return _grouped_linear(tokens, dequantize(weight, weight_dtype(weight)), offsets, is_transposed=transposed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from transformers.integrations.moe import _grouped_linear

        (offsets,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # out = x @ W^T for [experts, out, in] (x @ W when transposed): d x = grad @ W (grad @ W^T)
        weight = dequantize(ctx.weight, weight_dtype(ctx.weight))
        grad_tokens = _grouped_linear(grad, weight, offsets, is_transposed=not ctx.transposed)
        return grad_tokens.to(ctx.tokens_dtype), None, None, None


def grouped_projection(
    experts: torch.nn.Module, weight: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The sorted tokens through one expert stack, 4-bit or not, as the stock grouped forward multiplies it."""
    # _grouped_linear is private, but it is the grouped product the stock 'grouped_mm' experts compute (torch's
    # grouped GEMM where the device and dtype have it, else a per-expert loop): the 4-bit path multiplies alike.
    from transformers.integrations.moe import _grouped_linear

    if is_quantized(weight):
        return NF4GroupedLinear.apply(tokens, weight, offsets, experts.is_transposed)
    return _grouped_linear(tokens, autocast_weight(weight), offsets, is_transposed=experts.is_transposed)


def autocast_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in autocast's dtype where autocast is on and the weight is float32 (float32 master weights, or
    PEFT's float32 adapters), as autocast casts a linear layer's weight; as it is otherwise. torch's grouped GEMM is
    not autocast-enabled: float32 experts would run in float32, through transformers' per-expert loop (measured on
    an H200: full fine-tuning of the B5 shape at 5.3% MFU; docs/performance.md). The gradient reaches the float32
    weight through the cast."""
    device = weight.device.type
    if weight.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return weight
    return weight.to(torch.get_autocast_dtype(device))


@contextmanager
def shaped_experts(model: Any) -> Iterator[None]:
    """While PEFT puts adapters on the experts (get_peft_model, PeftModel.from_pretrained): each 4-bit stack shown
    as a tensor of its own shape and dtype (`stand_in`). PEFT sizes a parameter's adapter from the parameter's
    shape and moves the adapter to its device and dtype; the packed 4-bit tensor has neither. The 4-bit stacks are
    back in place afterwards; the adapters then run through `grouped_projection`."""
    held: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        if not isinstance(getattr(module, "num_experts", None), int):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if is_quantized(param) and len(param.quant_state.shape) == 3:
                module._parameters[name] = stand_in(param)
                held.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in held:
            module._parameters[name] = param


@contextmanager
def shaped(module: torch.nn.Module, name: str) -> Iterator[None]:
    """`shaped_experts` for one parameter (a no-op where it is not 4-bit): PEFT's `get_delta_factors` casts the
    adapter's factors to the parameter's dtype."""
    param = module._parameters[name]
    if not is_quantized(param):
        yield
        return
    module._parameters[name] = stand_in(param)
    try:
        yield
    finally:
        module._parameters[name] = param


def stand_in(weight: torch.Tensor) -> torch.nn.Parameter:
    """A frozen parameter of a 4-bit weight's shape, dtype and device that takes no memory (one element, expanded)."""
    one = torch.zeros((), dtype=weight.quant_state.dtype, device=weight.device)
    return torch.nn.Parameter(one.expand(weight.quant_state.shape), requires_grad=False)


def weight_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight computes in: a 4-bit one's is the dtype it was quantized from."""
    return weight.quant_state.dtype if is_quantized(weight) else weight.dtype
