"""Benchmark (not a test): the cost of 4-bit experts in a QLoRA step, per layer of Qwen3-30B-A3B's shape.

    python bench/nf4_dequant.py --out DIR     # on a CUDA GPU with bitsandbytes: DIR/results.json
    python bench/nf4_dequant.py --tiny        # a smoke run of the script itself, on CPU

For one layer's expert stacks (gate_up_proj [128, 1536, 2048], down_proj [128, 2048, 768], bf16, quantized to NF4
with double quantization as stages/experts_quantizer.py does):
- dequantization alone: bitsandbytes' `dequantize_4bit` (what stages/quantized_experts.py calls) and
  `dequantize_compiled` here (the same arithmetic in torch, compiled into one kernel), in ms and GB/s
  of bytes read and written;
- one expert block forward + backward (the up, gate and down grouped products over 4096 tokens x 8 experts, routed
  at random), through bf16 weights (the baseline: the stock grouped GEMM) and through the 4-bit ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn: Any, repeats: int, device: str) -> float:
    """Median milliseconds of `fn()` after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return round(sorted(times)[len(times) // 2], 3)


def dequantize_compiled(weight: Any, dtype: Any) -> Any:
    """bitsandbytes' dequantization as torch arithmetic, compiled into one kernel on a GPU (eager on CPU): each
    byte's two NF4 codes looked up in the code table and scaled by their block's absmax in float32, as bitsandbytes
    does, then cast. The double-quantized absmax is bitsandbytes' own (`dequantize_blockwise`, a small tensor). The
    alternative measured against the stage's `quantized_experts.dequantize`."""
    import bitsandbytes.functional as F

    from stages.quantized_experts import dequantize

    state = weight.quant_state
    numel = state.shape.numel()
    if state.quant_type != "nf4" or numel % state.blocksize:
        return dequantize(weight, dtype)
    absmax = state.absmax
    if state.nested:
        absmax = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    run = _nf4_kernel() if weight.device.type == "cuda" else _nf4_values
    return run(weight.data.view(-1), absmax, state.code, state.blocksize, dtype).view(state.shape)


def _nf4_values(packed: Any, absmax: Any, code: Any, blocksize: int, dtype: Any) -> Any:
    import torch

    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).view(-1).long()  # the high nibble is the first
    return (code[codes].view(-1, blocksize) * absmax.view(-1, 1)).view(-1).to(dtype)


_compiled: list[Any] = []


def _nf4_kernel() -> Any:
    import torch

    if not _compiled:
        _compiled.append(torch.compile(_nf4_values, fullgraph=True, dynamic=False))
    return _compiled[0]


def main(argv: list[str] | None = None) -> int:
    import bitsandbytes as bnb
    import torch

    from stages.quantized_experts import NF4GroupedLinear, dequantize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts, hidden, width, tokens, top_k = (8, 64, 32, 128, 2) if args.tiny else (128, 2048, 768, 4096, 8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    shapes = {"gate_up_proj": (experts, 2 * width, hidden), "down_proj": (experts, hidden, width)}
    weights, quantized = {}, {}
    for name, shape in shapes.items():
        weights[name] = (torch.randn(shape, device=device) * 0.02).to(dtype)
        four_bit = bnb.nn.Params4bit(weights[name], requires_grad=False, compress_statistics=True, quant_type="nf4")
        quantized[name] = four_bit.to(device)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "bitsandbytes": bnb.__version__,
        "dequantize": {},
    }
    for name, weight in quantized.items():
        numel = weights[name].numel()
        moved = numel * (0.5 + dtype.itemsize)  # the packed bytes read, the dequantized ones written
        exact = torch.equal(dequantize(weight, dtype), dequantize_compiled(weight, dtype))
        row = {"exact": exact}
        for label, fn in (("bitsandbytes", dequantize), ("compiled", dequantize_compiled)):
            ms = timed(lambda fn=fn, weight=weight: fn(weight, dtype), args.repeats, device)
            row[label] = {"ms": ms, "gb_per_s": round(moved / ms / 1e6, 1)}
        results["dequantize"][name] = row
        print(name, json.dumps(row), flush=True)

    # one expert block: tokens sorted by expert, the up/gate product, SiLU, the down product
    from transformers.integrations.moe import _grouped_linear

    routes = torch.randint(0, experts, (tokens * top_k,), device=device).sort().values
    counts = torch.bincount(routes, minlength=experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(tokens * top_k, hidden, device=device, dtype=dtype, requires_grad=True)

    def block(four_bit: bool) -> None:
        def project(name: str, tokens_in: torch.Tensor) -> torch.Tensor:
            if four_bit:
                return NF4GroupedLinear.apply(tokens_in, quantized[name], offsets, False)
            return _grouped_linear(tokens_in, weights[name], offsets)

        gate, up = project("gate_up_proj", x).chunk(2, dim=-1)
        out = project("down_proj", torch.nn.functional.silu(gate) * up)
        out.float().square().mean().backward()
        x.grad = None

    results["block_forward_backward_ms"] = {
        "bf16": timed(lambda: block(False), args.repeats, device),
        "nf4": timed(lambda: block(True), args.repeats, device),
    }
    print(json.dumps(results["block_forward_backward_ms"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
