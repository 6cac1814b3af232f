"""One rank's share of split experts on a GPU: the routes to other ranks' experts masked out of the grouped GEMMs.

Under expert parallelism (`distributed.expert_parallel`) transformers' dispatch hands a rank's experts every token of
the shared batch; the routes to other ranks' experts come as local id `num_experts` with weight 0, and the stages'
experts forward (`stages/expert_lora.py`) masks their rows, which the grouped GEMM leaves unwritten. On CPU
`tests/test_expert_lora.py` checks it, where torch's grouped GEMM fallback may well write zeros there; this runs the
same comparison on a GPU at Qwen3-30B-A3B's expert shape (128 experts of 768, hidden 2048, 8 routes a token, bf16),
with and without LoRA factors on both stacks, after filling the CUDA caching allocator with NaN so that any unwritten
row that reached the output or a gradient would show. The second half of the experts is this rank's; its output and
every gradient must equal the whole stack's with the other half's routing weights zeroed.

    python bench/expert_parallel_mask.py --out results.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.expert_lora import FACTORS, GROUPED_EXPERTS


def experts_pair(device: str, dtype: torch.dtype, tokens: int, rank: int) -> dict[str, Any]:
    """The whole stack and this rank's half (the second), the same weights, with LoRA factors of `rank` when not 0;
    then one forward and backward of each on the same tokens."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    config._experts_implementation = GROUPED_EXPERTS
    whole = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    for parameter in whole.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    experts, half_count = whole.num_experts, whole.num_experts // 2
    half = copy.deepcopy(whole)
    half.num_experts, half._is_expert_parallel = half_count, True
    for name in ("gate_up_proj", "down_proj"):
        setattr(half, name, torch.nn.Parameter(getattr(whole, name).detach()[half_count:].clone()))
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if rank:
        for name in ("gate_up_proj", "down_proj"):
            rows, cols = getattr(whole, name).shape[1:]
            lhs = (torch.randn(experts, rows, rank, device=device) * 0.02).to(dtype).requires_grad_()
            rhs = (torch.randn(experts, rank, cols, device=device) * 0.02).to(dtype).requires_grad_()
            factors[name] = (lhs, rhs)
        whole.__dict__[FACTORS] = {name: (lhs, rhs, 2.0) for name, (lhs, rhs) in factors.items()}
        mine = slice(half_count, experts)
        half.__dict__[FACTORS] = {name: (lhs[mine], rhs[mine], 2.0) for name, (lhs, rhs) in factors.items()}

    hidden = torch.randn(tokens, 2048, device=device, dtype=dtype, requires_grad=True)
    routes = torch.stack([torch.randperm(experts, device=device)[:8] for _ in range(tokens)])
    weights = torch.rand(tokens, 8, device=device, dtype=dtype)
    here = routes >= half_count
    signal = torch.randn(tokens, 2048, device=device, dtype=dtype)

    def run(module: torch.nn.Module, top_k: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden.grad = None
        for parameter in [*module.parameters(), *(t for pair in factors.values() for t in pair)]:
            parameter.grad = None
        out = module(hidden, top_k, weights * here)
        (out.float() * signal).sum().backward()
        grads = {"tokens": hidden.grad.clone()}
        grads |= {name: p.grad for name, p in module.named_parameters()}
        for name, (lhs, rhs) in factors.items():
            grads[f"{name}.lhs"], grads[f"{name}.rhs"] = lhs.grad.clone(), rhs.grad.clone()
        return out.detach(), grads

    expected, expected_grads = run(whole, routes)
    got, got_grads = run(half, torch.where(here, routes - half_count, half_count))
    report: dict[str, Any] = {"lora_rank": rank, "tokens": tokens, "local_routes": int(here.sum())}
    report["output_finite"] = bool(got.isfinite().all())
    report["output_max_difference"] = float((got.float() - expected.float()).abs().max())
    report["output_max"] = float(expected.float().abs().max())
    differences = {}
    for name, grad in got_grads.items():
        reference = expected_grads[name]
        if name in ("gate_up_proj", "down_proj") or name.endswith((".lhs", ".rhs")):
            # this rank's experts' rows; the other half's rows get no gradient from this rank
            if name.endswith((".lhs", ".rhs")):
                outside = grad[:half_count]
                report[f"{name}_other_experts_zero"] = bool((outside == 0).all())
                grad, reference = grad[half_count:], reference[half_count:]
            else:
                reference = reference[half_count:]
        differences[name] = {
            "finite": bool(grad.isfinite().all()),
            "max_difference": float((grad.float() - reference.float()).abs().max()),
            "max": float(reference.float().abs().max()),
        }
    report["gradients"] = differences
    report["passed"] = (
        report["output_finite"]
        and report["output_max_difference"] <= 0.02 * report["output_max"]
        and all(d["finite"] and d["max_difference"] <= 0.02 * max(d["max"], 1e-6) for d in differences.values())
        and all(v for k, v in report.items() if k.endswith("_other_experts_zero"))
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    if gpu:  # whatever the grouped GEMM leaves unwritten reads as NaN
        poison = torch.full((8 * 2**30 // 4,), float("nan"), device=device)
        del poison
    reports = [experts_pair(device, dtype, args.tokens if gpu else 64, rank) for rank in (0, 16)]
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__, "runs": reports}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(r["passed"] for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
