"""Probe (not a test): torchtitan, the engine for tensor, pipeline and expert parallelism, on this project's CPU
machine: its Qwen3 against transformers' and its tensor-parallel mesh over gloo.

Run in an environment of its own (torchtitan 0.3.0 pins datasets < 4.8; the project uses 5.2), as vLLM has:

    python3 -m venv .venv-titan
    .venv-titan/bin/pip install torch==2.13.0                     # the CPU build, first
    .venv-titan/bin/pip install torchtitan==0.3.0 triton transformers==5.23.0
    .venv-titan/bin/python bench/torchtitan_cpu.py hf --out OUT
    .venv-titan/bin/torchrun --nproc-per-node 2 bench/torchtitan_cpu.py tp --out OUT

`hf`: a random transformers Qwen3 of torchtitan's Qwen3 debug shape (8 layers, width 256, 16 heads, 8 key/value
heads, head_dim 128, tied embeddings), converted into torchtitan's model by its own state-dict adapter
(`Qwen3StateDictAdapter.from_hf`), converted back (`to_hf`) and compared tensor by tensor, and both models' logits on
the same tokens (one document a row). `tp`: torchtitan's debug Qwen3 built once whole and once tensor parallel over
the processes (its own `parallelize_qwen3`: the model's sharding plan, then FSDP over a mesh of one), the whole
model's weights copied into the parallel one, and their logits compared on rows of two packed documents (position
ids restarting, torchtitan's document masks from them, as the stages pack).

What it takes on CPU, found by running it: torchtitan picks its device type when imported and assumes CUDA where
there is none (set `torchtitan.tools.utils.device_type` and `torchtitan.distributed.parallel_dims.device_type` to
"cpu" first); its default `spmd_types` backend leaves the parameters plain tensors that FSDP then refuses, and
`full_dtensor` wants DTensor inputs: `partial_dtensor` runs; the fused QKV projection's tensor-parallel layout is not
a plain split of the three (copying the whole model's weights in needs `fuse_qkv=False`, its `non_fused_qkv` debug
config); FSDP's mixed precision casts the parameters to bf16 for compute unless `mixed_precision_param` is float32;
flex attention has no backward on CPU (forward only here, or sdpa).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def on_cpu() -> None:
    """torchtitan on CPU: its device type (chosen at import, CUDA by default) set to cpu."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type = "cpu"
    parallel_dims.device_type = "cpu"


def debug_config(tensor_parallel: int = 1) -> Any:
    """torchtitan's Qwen3 debug job config, unfused QKV, float32 throughout, `tensor_parallel` wide."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel_non_fused_qkv

    config = qwen3_debugmodel_non_fused_qkv()
    config.parallelism.tensor_parallel_degree = tensor_parallel
    config.parallelism.data_parallel_shard_degree = 1
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.dtype = "float32"
    config.training.mixed_precision_param = "float32"
    config.model_spec.model.update_from_config(config=config)
    return config


def build(config: Any, parallel_dims: Any = None) -> Any:
    """The config's model on CPU with its own initialisation; tensor parallel when `parallel_dims` is given."""
    import torch

    spec = config.model_spec
    with torch.device("meta"):
        model = spec.model.build()
    if parallel_dims is not None:
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=None,
            dump_folder=os.environ.get("TMPDIR", "/tmp"),
        )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def compare(a: Any, b: Any) -> dict[str, float]:
    import torch

    return {
        "max_abs_diff": (a - b).abs().max().item(),
        "cosine": torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item(),
    }


def hf_round_trip() -> dict[str, Any]:
    import torch
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = debug_config()
    hf_config = Qwen3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=qwen3._EPS,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config).eval()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    adapter = Qwen3StateDictAdapter(config.model_spec.model, None)
    model = build(config)
    missing, unexpected = model.load_state_dict(adapter.from_hf(dict(hf_state)), strict=False)
    back = adapter.to_hf(dict(model.state_dict()))
    identical = sorted(k for k in hf_state if k in back and torch.equal(hf_state[k], back[k]))
    torch.manual_seed(1)
    ids = torch.randint(0, hf_config.vocab_size, (2, 64))
    positions = torch.arange(64).repeat(2, 1)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
    return {
        "missing": list(missing),
        "unexpected": list(unexpected),
        "tensors": len(hf_state),
        "identical_after_round_trip": len(identical),
        "not_written_back": sorted(set(hf_state) - set(back)),  # the tied head: the embedding's own tensor
        "logits": compare(expected, got),
    }


def tensor_parallel() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    config = debug_config(tensor_parallel=world)
    whole = build(config)
    weights = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    dims = ParallelDims.from_config(config.parallelism, world)
    dims.build_mesh()
    parallel = build(config, dims)
    with torch.no_grad():
        for name, value in parallel.state_dict().items():
            source = weights[name]
            value.copy_(
                distribute_tensor(source, value.device_mesh, value.placements) if isinstance(value, DTensor) else source
            )
    torch.manual_seed(1)
    ids = torch.randint(0, 2048, (2, 64))
    positions = torch.cat([torch.arange(40), torch.arange(24)]).repeat(2, 1)  # two documents a row
    with torch.no_grad():
        expected = whole(ids, positions=positions, attention_masks=whole.get_attention_masks(positions=positions))
        got = parallel(ids, positions=positions, attention_masks=parallel.get_attention_masks(positions=positions))
    got = got.full_tensor() if isinstance(got, DTensor) else got
    sharded = sum(isinstance(p, DTensor) for p in parallel.parameters())
    result = {"world_size": world, "dtensor_parameters": sharded, "logits": compare(expected, got)}
    dist.destroy_process_group()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["hf", "tp"])
    parser.add_argument("--out", required=True, help="a directory: <probe>.json")
    args = parser.parse_args()
    on_cpu()
    import torch
    import torchtitan

    result = hf_round_trip() if args.probe == "hf" else tensor_parallel()
    if int(os.environ.get("RANK", "0")) == 0:
        record = {"torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "0.3.0"), **result}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.probe}.json").write_text(json.dumps(record, indent=1))
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
