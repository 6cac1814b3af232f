"""A mixture-of-experts model's router load-balancing loss over a packed batch's own tokens, not its padding.

The packed collator pads a batch to one width (on a GPU to `max_seq_length`, so that flex attention compiles once),
and passes no attention mask: transformers keeps packed documents apart through the position ids only when there is
none. A family's load-balancing loss (`load_balancing_loss_func` in its modeling module, weighted by
`router_aux_loss_coef`) takes its token mask from that same attention mask, so without one it counts the padding as
tokens: they skew the balance it asks for (all padding routes alike), and its gradient reaches positions no label
reaches. (Where the padding was a segment of its own with a zero embedding row, that gradient grew a thousandfold a
layer: see PackedCollator.)

So the collator marks its padding (`TOKEN_MASK` in the batch: 1 for a row's own tokens, 0 for padding) where the model
has such a loss, and `mask_router_loss` hooks the model: the mask is taken out of the forward's inputs, and the
load-balancing loss is taken again over the marked tokens only (the family's own function, with the mask as its
attention mask, over the router logits the decoder returned); the forward's loss, where it has one, is corrected by
coef x the difference. That covers both forwards a stage's trainer runs: the model's own (transformers' Trainer, cpt)
and TRL's fused LM head (`add_fused_lm_head`, SFTTrainer), which takes the same loss without a mask and returns no
router logits of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

TOKEN_MASK = "token_mask"
"""The batch key of the packed collator's mask (1 for a row's own tokens, 0 for padding); taken out of the inputs
before the model's forward sees them."""


def _balancing_loss(model: Any) -> tuple[Any, Callable[..., torch.Tensor]] | None:
    """The causal LM under `model` (PEFT's wrapper unwrapped) and its family's load-balancing loss function, when
    the model returns its router logits for one; else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    function = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    config = base.config.get_text_config()
    if function is None or not getattr(config, "output_router_logits", False):
        return None
    return base, function


def mask_router_loss(model: Any) -> bool:
    """Hook `model` (the one the trainer calls) so that a batch's TOKEN_MASK narrows its load-balancing loss to the
    marked tokens. Returns whether it was hooked (False: the model has no such loss, and the collator marks
    nothing)."""
    found = _balancing_loss(model)
    if found is None:
        return False
    base, function = found
    held: dict[str, Any] = {"mask": None, "router_logits": None}

    def take_mask(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        held["mask"] = kwargs.pop(TOKEN_MASK, None)
        held["router_logits"] = None
        return args, kwargs

    def keep_router_logits(module: Any, args: tuple[Any, ...], output: Any) -> None:
        if held["mask"] is not None:
            held["router_logits"] = getattr(output, "router_logits", None)

    def narrow(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        mask, router_logits = held["mask"], held["router_logits"]
        held["mask"] = held["router_logits"] = None
        if mask is None or router_logits is None or getattr(output, "aux_loss", None) is None:
            return output
        config = base.config.get_text_config()
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        aux = function(router_logits, experts, config.num_experts_per_tok, mask)
        if output.loss is not None:
            coef = getattr(base, "router_aux_loss_coef", config.router_aux_loss_coef)  # the copy the forward reads
            output.loss = output.loss + coef * (aux - output.aux_loss).to(output.loss.device)
        output.aux_loss = aux
        return output

    model.register_forward_pre_hook(take_mask, with_kwargs=True)
    base.get_decoder().register_forward_hook(keep_router_logits)  # the decoder under either forward
    model.register_forward_hook(narrow, with_kwargs=True)
    return True
