"""Benchmark probe (not a test): one mixture-of-experts block's backward at Qwen3-30B-A3B's shape, with and without
LoRA on the experts, checked against a float32 reference: the one-call GPU check of the B5 experts NaN.

    python bench/experts_backward.py --out DIR                 # on a CUDA GPU: bf16, grouped_mm, full shape
    python bench/experts_backward.py --tiny --out DIR          # a smoke run of the script itself, on CPU
    python bench/experts_backward.py --stack 4 --out DIR       # the stage's way: a model of 4 full layers, a loss

Why (docs/performance.md, B5, "Bisected on one H200"): with adapters on the experts every B5 case trains on NaN
gradients from step 1, the forward finite. The probe of 2026-12-02 recorded, per MoE layer, the largest gradient of
the experts' output (the residual stream's) and of the tokens the experts got: the first grows about a thousandfold
a layer from layer 46 down (1.5e-6 → 69 → 1e8 ...) while the second stays at 3e-7 in every layer. The experts'
backward is linear in the gradient of their output, so the two cannot both be right: either the experts' input
gradient is not computed from their output gradient (the grouped GEMM's backward when it also makes weight
gradients: the one thing adapters on the experts add), or the recorded output gradient is not the one the experts
read. This script tells the two apart on one block, in seconds, without training.

Run on one H200 on 2026-12-02: the block is linear and right, and the stage's way (`--stack 48`) is finite; the NaN
was the stage's padding (docs/performance.md, B5, "Found and fixed").

For each variant (`frozen`: the experts frozen, as with LoRA on attention only; `merged`: PEFT's adapters on the
experts' 3-D weights, merged into the weight on every forward; `low_rank`: the same adapters applied as low-rank
grouped products, stages/expert_lora.py) it builds one Qwen3-MoE layer's sparse block (router + experts, random
weights, init as the model's), runs it on random tokens, and takes the gradients of the tokens, of the adapter's
factors, for a random output gradient `g` (residual-sized, 1e-6) and again for 1000·g, twice each (the second
backward meets memory the caching allocator recycled). Reported per variant and backward: non-finite counts, the
largest magnitude, the relative error of the token gradient against the same block in float32 with the per-expert
loop (`experts_implementation='eager'`, the reference) and how the token gradient scaled when g did (1000 when it
is linear). The adapters' B factors are set to small random values (not PEFT's zeros), so that they take part.

`--stack N` builds the model as the sft stage does instead (N decoder layers at the full width and vocabulary, bf16
weights, PEFT's float32 adapters with its own initialisation, LoRA on attention, the step under bf16 autocast) and
takes one loss's backward over a row of 4096 tokens: per decoder layer, the largest gradient of its output (the
residual stream), of the experts' output and of the experts' tokens. PEFT starts B at zero, so an adapter on the
experts changes neither the forward nor the gradient the tokens get: the residual stream's gradients of `merged` and
`low_rank` must equal `frozen`'s, and of the per-expert loop (`eager`) in bf16 as well.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FULL = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, tokens=16384)
TINY = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, tokens=256)
VARIANTS = ("frozen", "merged", "low_rank")


def build(shape: dict[str, int], variant: str, dtype: Any, device: str, implementation: str, seed: int) -> Any:
    """A one-layer Qwen3-MoE model of `shape` (its layer's sparse block is what is measured), with the variant's
    adapters; the same weights for every variant and dtype (built in float32 from `seed`, then cast)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=shape["hidden_size"],
        intermediate_size=4 * shape["hidden_size"],
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.set_experts_implementation(implementation)
    if variant != "frozen":
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"], target_parameters=experts)
        )
        generator = torch.Generator().manual_seed(seed + 1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name and "experts" in name:
                with torch.no_grad():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        if variant == "low_rank":
            from stages.expert_lora import use_low_rank_experts

            use_low_rank_experts(model)
    else:
        model.requires_grad_(False)  # as under LoRA on attention only: the experts get no weight gradient
    return model.to(device=device, dtype=dtype)


def block_of(model: Any) -> Any:
    """The layer's sparse block (router + experts), through PEFT's wrapper where there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers[0].mlp


def stats(tensor: Any) -> dict[str, Any]:
    import torch

    values = tensor.detach().float()
    finite = torch.isfinite(values)
    return {
        "non_finite": int((~finite).sum()),
        "max_abs": values[finite].abs().max().item() if finite.any() else None,
    }


def gradients(model: Any, tokens: Any, grad_output: Any) -> dict[str, Any]:
    """The gradients of the tokens and of the experts' adapter factors for `grad_output`."""
    import torch

    x = tokens.detach().clone().requires_grad_(True)
    out = block_of(model)(x)
    out = out[0] if isinstance(out, tuple) else out
    factors = {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    grads = torch.autograd.grad(out, [x, *factors.values()], grad_output)
    return {"tokens": grads[0], **dict(zip(factors, grads[1:], strict=True)), "output": out.detach()}


def run_variant(shape: dict[str, int], variant: str, device: str, dtype: Any, seed: int) -> dict[str, Any]:
    import torch

    implementation = "grouped_mm" if device == "cuda" else "eager"
    model = build(shape, variant, dtype, device, implementation, seed)
    # the reference: PEFT's own path (or the frozen block) in float32 with the per-expert loop
    reference = build(shape, "frozen" if variant == "frozen" else "merged", torch.float32, device, "eager", seed)
    generator = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randn(1, shape["tokens"], shape["hidden_size"], generator=generator)  # one row of tokens
    g = torch.randn(1, shape["tokens"], shape["hidden_size"], generator=generator) * 1e-6
    tokens_d, g_d = tokens.to(device, dtype), g.to(device, dtype)
    expected = gradients(reference, tokens.to(device), g.to(device))["tokens"]
    result: dict[str, Any] = {"variant": variant, "experts_implementation": implementation, "backwards": []}
    for repeat in range(2):
        small = gradients(model, tokens_d, g_d)
        large = gradients(model, tokens_d, g_d * 1000)
        error = (small["tokens"].float() - expected).norm() / expected.norm()
        ratio = (large["tokens"].float().norm() / small["tokens"].float().norm()).item()
        result["backwards"].append(
            {
                "repeat": repeat,
                "output": stats(small["output"]),
                "grad_tokens": stats(small["tokens"]),
                "grad_tokens_x1000": stats(large["tokens"]),
                "relative_error_vs_float32_eager": error.item(),
                "linearity_ratio": ratio,
                "factor_grads": {k.split("mlp.")[-1]: stats(v) for k, v in small.items() if "lora_" in k},
            }
        )
        del small, large
    result["grad_tokens_reference"] = stats(expected)
    return result


def run_stack(
    layers: int, variant: str, implementation: str, device: str, seed: int, aux_loss: float = 0.0
) -> dict[str, Any]:
    """One loss's backward through a model of `layers` full-width decoder layers, built and adapted as the sft stage
    does it; the per-layer largest gradients."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = dict(FULL) if device == "cuda" else dict(TINY)
    config = Qwen3MoeConfig(
        vocab_size=151936 if device == "cuda" else 512,
        hidden_size=shape["hidden_size"],
        intermediate_size=6144 if device == "cuda" else 128,
        num_hidden_layers=layers,
        num_attention_heads=32 if device == "cuda" else 4,
        num_key_value_heads=4 if device == "cuda" else 2,
        head_dim=128 if device == "cuda" else 16,
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        tie_word_embeddings=False,
        # the router's load-balancing loss, as TRL's SFTTrainer turns it on for a model whose config has one
        output_router_logits=aux_loss != 0,
        router_aux_loss_coef=aux_loss,
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):  # built where it runs, as the bench builds it (and fast)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_experts_implementation(implementation)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if variant != "frozen" else None
    # the whole head trains, as the stage's LoRA trains an untied head (lora_config)
    adapter = LoraConfig(
        r=16, lora_alpha=32, target_modules=attention, target_parameters=experts, modules_to_save=["lm_head"]
    )
    model = get_peft_model(model, adapter)
    if variant == "low_rank":
        from stages.expert_lora import use_low_rank_experts

        use_low_rank_experts(model)
    model.config.use_cache = False
    records: dict[str, dict[int, float | None]] = {"layer_output": {}, "experts_output": {}, "experts_tokens": {}}

    def largest(kind: str, index: int) -> Any:
        def hook(grad: Any) -> None:
            value = grad.detach().float()
            finite = torch.isfinite(value)
            records[kind][index] = value.abs().max().item() if bool(finite.all()) else None

        return hook

    base = model.get_base_model()
    handles = []
    for index, layer in enumerate(base.model.layers):

        def after_layer(module: Any, args: Any, output: Any, index: int = index) -> None:
            (output[0] if isinstance(output, tuple) else output).register_hook(largest("layer_output", index))

        def before_experts(module: Any, args: Any, index: int = index) -> Any:
            tokens = args[0].view_as(args[0])
            tokens.register_hook(largest("experts_tokens", index))
            return (tokens, *args[1:])

        def after_experts(module: Any, args: Any, output: Any, index: int = index) -> None:
            output.register_hook(largest("experts_output", index))

        handles.append(layer.register_forward_hook(after_layer))
        handles.append(layer.mlp.experts.register_forward_pre_hook(before_experts))
        handles.append(layer.mlp.experts.register_forward_hook(after_experts))
    generator = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, config.vocab_size, (1, 4096 if device == "cuda" else 64), generator=generator).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    result = {
        "variant": variant,
        "experts_implementation": implementation,
        "layers": layers,
        "router_aux_loss_coef": aux_loss,
        "loss": loss.item(),
        "non_finite_grads": sum(int((~torch.isfinite(g)).sum()) for g in grads),
        **{kind: [values.get(i) for i in range(layers)] for kind, values in records.items()},
    }
    for handle in handles:
        handle.remove()
    del model, grads
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory: results.json")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (a smoke run)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the block's batch (default: the shape's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stack", type=int, default=0, help="N: the stage's way, a model of N layers (see above)")
    parser.add_argument(
        "--implementations", default="grouped_mm,eager", help="--stack: the experts implementations to compare"
    )
    parser.add_argument("--aux-loss", type=float, default=0.0, help="--stack: the router's load-balancing loss coef")
    args = parser.parse_args()
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = dict(TINY if args.tiny else FULL)
    if args.tokens:
        shape["tokens"] = args.tokens
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "environment": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": str(dtype),
            "shape": shape,
        },
        "results": [],
    }
    if args.stack:
        for implementation in args.implementations.split(","):
            for variant in args.variants.split(","):
                started = time.perf_counter()
                try:
                    result = run_stack(args.stack, variant, implementation, device, args.seed, args.aux_loss)
                except Exception:
                    result = {"variant": variant, "experts_implementation": implementation}
                    result["error"] = traceback.format_exc()[-3000:]
                result["seconds"] = round(time.perf_counter() - started, 1)
                record["results"].append(result)
                (out / "results.json").write_text(json.dumps(record, indent=1))
                print(json.dumps(result), flush=True)
        return 0
    for variant in args.variants.split(","):
        started = time.perf_counter()
        try:
            result = run_variant(shape, variant, device, dtype, args.seed)
        except Exception:  # a variant that fails is recorded; the others still run
            result = {"variant": variant, "error": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 1)
        record["results"].append(result)
        (out / "results.json").write_text(json.dumps(record, indent=1))
        summary = [
            (
                b["repeat"],
                b["grad_tokens"]["max_abs"],
                round(b["linearity_ratio"], 1),
                b["relative_error_vs_float32_eager"],
            )
            for b in result.get("backwards", [])
        ]
        print(variant, summary or result.get("error", "")[-500:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
