"""transformers' bitsandbytes 4-bit quantizer, extended to quantize a mixture-of-experts model's stacked experts as
they load (what stages/quantized_experts.py then computes with).

transformers 5 keeps a layer's experts as 3-D parameters, and its bitsandbytes quantizer quantizes nn.Linear
modules only. `ExpertsBitsAndBytesConfig` (the qlora stages' config) selects `ExpertsBnb4BitQuantizer` through
transformers' quantizer registry: every nn.Linear as bitsandbytes does it, and each expert stack as it arrives from
the checkpoint, into bitsandbytes' `Params4bit` with the same NF4 settings, on the device it loads to, so no bf16
copy of the experts is ever whole there. The model is then a bitsandbytes model to transformers, PEFT and the
Trainer (`quantization_method`), and its experts run the GROUPED_EXPERTS forward, which reads 4-bit stacks
through `quantized_experts.grouped_projection`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.utils.quantization_config import QuantizationMethod

from stages.quantized_experts import is_expert_stack, quantized_experts

EXPERTS_4BIT = "bitsandbytes_4bit_experts"
"""The quant_method that selects ExpertsBnb4BitQuantizer in transformers' quantizer registry."""


@register_quantization_config(EXPERTS_4BIT)
class ExpertsBitsAndBytesConfig(BitsAndBytesConfig):
    """BitsAndBytesConfig for 4-bit loading that also quantizes stacked experts (with the same NF4 settings)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("quant_method", None)
        super().__init__(load_in_4bit=True, **{k: v for k, v in kwargs.items() if k != "load_in_4bit"})
        self.quant_method = EXPERTS_4BIT


@register_quantizer(EXPERTS_4BIT)
class ExpertsBnb4BitQuantizer(Bnb4BitHfQuantizer):
    """transformers' bitsandbytes 4-bit quantizer, which also quantizes stacked expert tensors while they load."""

    def _process_model_before_weight_loading(self, model: Any, device_map: Any, **kwargs: Any) -> None:
        super()._process_model_before_weight_loading(model, device_map, **kwargs)
        # A bitsandbytes model to every reader (the Trainer does not move it, PEFT prepares it as one).
        model.quantization_method = QuantizationMethod.BITS_AND_BYTES

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        if super().param_needs_quantization(model, param_name, **kwargs):
            return True
        module_name, _, name = param_name.rpartition(".")
        if any(skip == module_name or module_name.startswith(f"{skip}.") for skip in self.modules_to_not_convert):
            return False
        module = model.get_submodule(module_name)
        param = getattr(module, name, None)
        return isinstance(param, torch.Tensor) and is_expert_stack(module, name, param.shape)

    def get_quantize_ops(self) -> ConversionOps:
        return ExpertsQuantize(self)

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        from stages.expert_lora import GROUPED_EXPERTS

        model = super()._process_model_after_weight_loading(model, **kwargs)
        if quantized_experts(model):
            model.set_experts_implementation(GROUPED_EXPERTS)
        return model


class ExpertsQuantize(ConversionOps):
    """transformers' loading op for a parameter to quantize: an expert stack becomes a 4-bit Params4bit (quantized
    on the device it arrives on); anything else goes to transformers' own bitsandbytes op."""

    def __init__(self, hf_quantizer: ExpertsBnb4BitQuantizer) -> None:
        from transformers.integrations.bitsandbytes import Bnb4bitQuantize

        self.hf_quantizer = hf_quantizer
        self.linear = Bnb4bitQuantize(hf_quantizer)

    def convert(
        self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        import bitsandbytes as bnb

        result: dict[str, Any] = {}
        for param_name, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module_name, _, name = param_name.rpartition(".")
            module = model.get_submodule(module_name)
            if not is_expert_stack(module, name, tensor.shape):
                result.update(self.linear.convert({param_name: value}, full_layer_name=full_layer_name, model=model))
                continue
            config = self.hf_quantizer.quantization_config
            result[param_name] = bnb.nn.Params4bit(
                tensor,
                requires_grad=False,
                compress_statistics=config.bnb_4bit_use_double_quant,
                quant_type=config.bnb_4bit_quant_type,
                quant_storage=config.bnb_4bit_quant_storage,
            ).to(tensor.device)
            module._is_hf_initialized = True
        return result
