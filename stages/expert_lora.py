"""The stages' experts forward on a GPU: grouped GEMMs with cheaper routing, and LoRA on stacked experts beside them.

transformers 5 keeps each layer's experts as 3-D parameters (qwen3_moe: `gate_up_proj` [experts, 2 x moe width,
hidden] and `down_proj` [experts, hidden, moe width]) and runs them as one grouped GEMM over the tokens sorted by
expert ('grouped_mm'). PEFT reaches them through `target_parameters`: its ParamWrapper puts the adapter into the
weight itself on every forward (W + s * B @ A for all experts at once, a tensor the size of the whole expert stack,
and its gradient of the same size in the backward), which is what made LoRA on the experts 4x slower than LoRA on
attention alone (issue 35: 2,896 tok/s on an H200).

Here the adapter is applied to the tokens instead, with the same routing: for the tokens of expert e,
`x @ W_e^T + s * (x @ A_e^T) @ B_e^T`, as two more grouped GEMMs of rank r beside the base grouped GEMM. Nothing
of the expert stack's size is made, and the frozen base weights get no gradient. The adapter's parameters,
its initialisation, saving, loading and merging stay PEFT's: only where its factors are multiplied changes
(`use_low_rank_experts` swaps the ParamWrapper's weight parametrization for handing the factors to the experts'
forward, `low_rank_experts_forward`, registered with transformers' ExpertsInterface as GROUPED_EXPERTS).

The path is taken where it can be exact and fast: one active adapter, weights in a dtype PEFT does not upcast, and a
rank whose rows fill the 16 bytes CUDA's grouped GEMM aligns to; anything else keeps PEFT's own path.
tests/test_expert_lora.py checks the loss and every gradient against PEFT's merged weights.

Under expert parallelism (`distributed.expert_parallel`) it is the only path: each rank holds its experts' slice of
the stack (transformers' plan), and PEFT's path would add a whole adapter to that slice. The adapter stays whole and
replicated on every rank (PEFT's parameters, broadcast and gradient-averaged by the Trainer as any adapter beside a
model sharded at load); each rank multiplies the tokens routed to its experts by its experts' rows of the factors
(`_local_experts`), so a rank's gradient is non-zero on its own experts' rows only, and the Trainer's average over
the world is the sum over the ranks holding that expert divided by the world: the scaling transformers gives the
expert weights themselves (`set_gradient_divide_factor(dp_size)`). Memory: the whole adapter on every rank (its
rank-r rows for all experts), as on one GPU. tests/test_expert_parallel.py trains it over two processes as one.

The same forward runs a mixture of experts on a GPU without adapters too (`stages.modeling.experts_implementation`),
as transformers' grouped_mm with its routing made cheaper: the routing weight on the intermediate activation, and
gathers whose backward gathers (1.09-1.14x the stock forward for B5 on an H200; docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch

# _grouped_mm is private, but it is the dispatcher the stock 'grouped_mm' experts run through
# (torch's grouped_mm where the device and dtype have it, else transformers' per-expert loop).
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_mm

from stages.quantized_experts import autocast_weight, grouped_projection, is_quantized, shaped, weight_dtype

GROUPED_EXPERTS = "grouped_mm_routed"
"""The experts implementation the stages run on a GPU (`low_rank_experts_forward`): transformers' grouped_mm with
cheaper routing, plus LoRA factors as grouped low-rank products where the experts have adapters."""

FACTORS = "_lora_factors"
"""The experts module's attribute that holds, while its adapters are active, parameter name → (lhs, rhs, scaling)
with lhs @ rhs the shape of the parameter (PEFT's `get_delta_factors`)."""

EXPERT_OFFSET = "_first_expert"
"""Under expert parallelism, the experts module's attribute that holds the global id of its first (local) expert."""

ALIGNMENT_BYTES = 16
"""CUDA's grouped GEMM wants each row of its operands to start on 16 bytes: the rank's row of the low-rank product
(r x element size) must fill it."""


def low_rank_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' grouped_mm experts forward (`grouped_mm_experts_forward`), each projection plus its adapter's
    low-rank product where the module has factors (FACTORS), through 4-bit weights where they are
    (stages/quantized_experts.py), and with the routing made cheaper (measured in docs/performance.md, B5):

    - each token's routing weight multiplies its expert's intermediate activation (the moe width, 768 for
      Qwen3-30B-A3B) before the down projection, not the projection's output (the hidden width, 2048) in float32:
      the same product, as the down projection is linear (not for experts with biases or a norm after them);
    - the tokens are sorted by expert and back by gathers whose backward is a gather too (`Gather`), not the
      scatter-add that indexing's backward is.

    Under expert parallelism `self` holds this rank's experts only (local ids); transformers' dispatch may hand it
    routes to other ranks' experts (id `num_experts`, weight 0), which are masked as its stock forward masks them:
    the grouped GEMM leaves their rows unwritten."""
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = getattr(self, FACTORS, {})
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)
    expert_ids = top_k_index.reshape(-1)
    # The tokens sorted by expert, and where each expert's run ends (as the stock forward counts them).
    expert_ids_g, perm = torch.sort(expert_ids)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    selected = Gather.apply(hidden_states, perm // num_top_k, inverse, num_top_k)
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    device = hidden_states.device
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    # Routes to other ranks' experts sort last and histc leaves them out: no GEMM reads or writes their rows.
    split = getattr(self, "_is_expert_parallel", False)
    elsewhere = (expert_ids_g >= self.num_experts).unsqueeze(-1) if split else None
    if elsewhere is not None:
        expert_ids_g = expert_ids_g.clamp(max=self.num_experts - 1)  # in bounds for the bias gathers
        selected = selected.masked_fill(elsewhere, 0.0)  # its backward zeroes their unwritten input gradients

    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    up_bias = getattr(self, f"{up_name}_bias")[expert_ids_g] if self.has_bias else None
    out = _masked(_projection(self, up_name, selected, offsets, up_bias, factors), elsewhere)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    linear_down = not self.has_bias and not self.has_post_expert_norm
    if linear_down:
        out = out * sample_weights_g.to(out.dtype).unsqueeze(-1)
    down_bias = self.down_proj_bias[expert_ids_g] if self.has_bias else None
    out = _masked(_projection(self, "down_proj", out, offsets, down_bias, factors), elsewhere)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    if not linear_down:
        out = out * sample_weights_g.unsqueeze(-1)
    # Back to token order, each token's top-k rows summed (accumulated in float32 by the reduction).
    tokens = Gather.apply(out, inverse, perm, 1)
    return tokens.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def _masked(rows: torch.Tensor, elsewhere: torch.Tensor | None) -> torch.Tensor:
    """`rows` with those of routes to other ranks' experts zeroed (the grouped GEMM left them unwritten)."""
    return rows if elsewhere is None else rows.masked_fill(elsewhere, 0.0)


class Gather(torch.autograd.Function):
    """`source[index]`, with a backward that gathers too. `index` reads every row of `source` `copies` times
    (the tokens, once per routed expert) or once (a permutation); `inverse` holds, for each row of the result in
    `source`'s order (copies consecutive), where it went. The gradient of a row of `source` is then the sum of its
    copies' gradients, read with `inverse`: a gather and a reduction, where indexing's own backward scatter-adds
    (measured: 11% of B5's step on an H200)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, source: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return source[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        rows = grad[inverse]
        if ctx.copies > 1:
            rows = rows.view(-1, ctx.copies, grad.size(-1)).sum(dim=1)
        return rows, None, None, None


def _projection(
    experts: torch.nn.Module,
    name: str,
    tokens: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
) -> torch.Tensor:
    """One grouped projection of the sorted tokens through parameter `name` (4-bit or not: quantized_experts),
    plus its adapter's low-rank product (scaling x tokens @ (lhs @ rhs) in the layout the experts multiply the
    parameter in)."""
    out = grouped_projection(experts, getattr(experts, name), tokens, offsets)
    if bias is not None:
        out = out + bias
    if name not in factors:
        return out
    lhs, rhs, scaling = factors[name]
    # contiguous, then transposed: a column-major operand is one grouped_mm takes; PEFT's permuted view is not.
    lhs, rhs = autocast_weight(lhs).contiguous(), autocast_weight(rhs).contiguous()
    if experts.is_transposed:  # the parameter is [experts, in, out]: tokens @ lhs @ rhs
        first, second = lhs, rhs
    else:  # [experts, out, in], used transposed: tokens @ rhs^T @ lhs^T
        first, second = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
    low = _grouped_mm(tokens, first, offsets) * scaling
    return out + _grouped_mm(low, second, offsets)


ALL_EXPERTS_FUNCTIONS.register(GROUPED_EXPERTS, low_rank_experts_forward)


def low_rank_possible(experts: torch.nn.Module, wrapper: Any, adapters: list[str]) -> bool:
    """Whether the low-rank path computes what PEFT's would, fast: the experts run GROUPED_EXPERTS, one adapter is
    active, the weights are in a dtype PEFT adds to as it is (not an upcast low-precision one), and the rank's rows
    are aligned for the grouped GEMM."""
    if getattr(getattr(experts, "config", None), "_experts_implementation", None) != GROUPED_EXPERTS:
        return False
    if len(adapters) != 1 or wrapper.num_experts <= 1:
        return False
    dtype = weight_dtype(wrapper.get_param())  # a 4-bit stack computes in the dtype it was quantized from
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return wrapper.r[adapters[0]] * dtype.itemsize % ALIGNMENT_BYTES == 0


@contextmanager
def _activate_low_rank(self: Any, active_adapters: list[str]) -> Iterator[None]:
    """A ParamWrapper's `_activate_lora` for experts: the active adapter's factors handed to the experts' forward
    (FACTORS) for the duration of the call, or PEFT's own parametrization where the low-rank path does not apply."""
    adapters = [a for a in active_adapters or [] if a in self.lora_A]
    experts = self.get_base_layer()
    if adapters and _only_low_rank(experts, self) and not low_rank_possible(experts, self, adapters):
        # PEFT's path adds the adapter to the weight itself, which a 4-bit stack or a rank's slice cannot take.
        raise ValueError(
            f"LoRA on 4-bit or expert-parallel experts ({self.parameter_name}) runs only as low-rank grouped "
            f"products: one active adapter, and lora.r x {weight_dtype(self.get_param()).itemsize} bytes a "
            f"multiple of {ALIGNMENT_BYTES} (lora.r is {self.r[adapters[0]]}; a multiple of 8 always fits)"
        )
    if not adapters or not low_rank_possible(experts, self, adapters):
        with type(self)._activate_lora(self, active_adapters):
            yield
        return
    held = experts.__dict__.setdefault(FACTORS, {})
    with shaped(experts, self.parameter_name):  # PEFT casts the factors to the parameter's dtype
        held[self.parameter_name] = _local_experts(experts, *self.get_delta_factors(adapters[0]))
    try:
        yield
    finally:
        held.pop(self.parameter_name, None)


def _only_low_rank(experts: torch.nn.Module, wrapper: Any) -> bool:
    """Whether PEFT's path cannot run these experts' adapter: 4-bit weights, or this rank's slice of the experts
    (expert parallelism)."""
    return is_quantized(wrapper.get_param()) or getattr(experts, "_is_expert_parallel", False)


def _local_experts(
    experts: torch.nn.Module, lhs: torch.Tensor, rhs: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The factors of the experts this rank holds (all of them without expert parallelism): rows
    [EXPERT_OFFSET, + num_experts) of the stack, as transformers' plan splits the weights (Shard(0) over the group)."""
    if not getattr(experts, "_is_expert_parallel", False):
        return lhs, rhs, scaling
    first = getattr(experts, EXPERT_OFFSET)
    local = slice(first, first + experts.num_experts)
    return lhs[local], rhs[local], scaling


def unfit_adapters(model: Any) -> list[str]:
    """The 4-bit or expert-parallel expert stacks (by parameter name) whose active adapter the low-rank path cannot
    apply; PEFT's path cannot either (it adds the whole adapter to the weight itself)."""
    from peft.tuners.lora.layer import ParamWrapper

    unfit = set()
    for wrapper in model.modules():
        if isinstance(wrapper, ParamWrapper) and _only_low_rank(wrapper.get_base_layer(), wrapper):
            adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            if adapters and not low_rank_possible(wrapper.get_base_layer(), wrapper, adapters):
                unfit.add(wrapper.parameter_name)
    return sorted(unfit)


def use_low_rank_experts(model: Any, group_rank: int | None = None) -> int:
    """Switch `model`'s adapters on stacked experts (PEFT ParamWrappers over a module with `num_experts`) to the
    low-rank path, and its experts to GROUPED_EXPERTS. Returns how many adapted parameters switched; 0 leaves the
    model as it was. `group_rank`: this rank's place in its expert group where the experts were spread after the
    model was made (pipeline stages); else transformers' mesh says it."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = [
        m
        for m in model.modules()
        if isinstance(m, ParamWrapper) and isinstance(getattr(m.get_base_layer(), "num_experts", None), int)
    ]
    if not wrappers:
        return 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_experts_implementation(GROUPED_EXPERTS)
    for wrapper in wrappers:
        wrapper._activate_lora = MethodType(_activate_low_rank, wrapper)
        experts = wrapper.get_base_layer()
        if getattr(experts, "_is_expert_parallel", False):
            # this rank's place in its expert group: its experts are that many local counts in
            rank = group_rank if group_rank is not None else base._mesh_manager.get_mesh("ep").get_local_rank()
            setattr(experts, EXPERT_OFFSET, rank * experts.num_experts)
    return len(wrappers)
