"""Float8 training (`training.fp8`): the stage runs its linear layers' matmuls in float8 through torchao (on CPU
too, through torchao's emulation of the float8 GEMM), keeps the output layer, a mixture's router and experts and
odd-sized layers out, saves an ordinary model, reruns to the same weights, resumes from a checkpoint to the same
weights, and refuses what it cannot combine with, naming the field."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import (
    losses,
    make_preference_run_dir,
    make_run_dir,
    run_stage,
    spec_error,
    start_stage,
    wait_for_file,
)

from run.run_dir import RunDir
from spec.loading import load_pipeline
from stages.checkpoints import MARKER
from stages.contract import NotSupportedHere
from stages.float8 import (
    RECIPE,
    check_float8,
    compile_decoder_layers,
    compiles_decoder_layers,
    float8_layers,
    train_in_float8,
)
from stages.modeling import model_fingerprint
from stages.training import read_log_history

FAST = [
    "stages.sft.enabled=false",
    "stages.cpt.training.max_steps=6",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
]
FP8 = [*FAST, "stages.cpt.training.fp8=true"]


def tiny(architecture: str = "llama", **sizes: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    if architecture == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        config = LlamaConfig(**{**common, "intermediate_size": 128, **sizes})
    return AutoModelForCausalLM.from_config(config)


def test_the_linear_layers_float8_takes_and_those_it_leaves() -> None:
    dense = float8_layers(tiny())
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert sorted(dense) == sorted(
        f"model.layers.{i}.{part}.{name}"
        for i in range(2)
        for part, names in (("self_attn", per_layer[:4]), ("mlp", per_layer[4:]))
        for name in names
    )
    assert "lm_head" not in dense
    # A mixture: attention only; the router and the experts (3-D grouped weights) stay as they are.
    moe = float8_layers(tiny("qwen3_moe"))
    assert sorted({name.rsplit(".", 1)[1] for name in moe}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # Sizes float8 GEMMs cannot take (not multiples of 16): the MLP's 120-wide layers stay.
    odd = float8_layers(tiny(intermediate_size=120))
    assert not [name for name in odd if ".mlp." in name] and len(odd) == 8


def test_converted_layers_keep_their_weights_and_state_dict() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert train_in_float8(model, "cpt", compile_layers=False) == 14
    assert isinstance(model.model.layers[0].mlp.down_proj, Float8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids = torch.randint(0, 256, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_on_a_cpu_the_float8_layers_emulate_the_gemm_with_the_outputs_and_gradients_of_scaled_mm() -> None:
    """torch._scaled_mm's CPU kernel is hundreds of times slower than torchao's emulation (stages/float8.py): on a CPU
    the stage's float8 layers emulate, with what _scaled_mm gives: the same float8 values and scales multiplied.

    Not bit for bit: the two sum in different orders, and a last-bit difference in an output can round a gradient's
    element to the neighbouring float8 value (1 seed in 70 flipped one at a 1e-5 elementwise tolerance). Measured over
    300 seeds: emulation against _scaled_mm differs by at most 0.3% of a gradient's norm (0.03% of an output's); float8
    against the same layers in float32 by at least 7.6% (6%). So each is held to 1% of its norm, and float8's own
    error shown to be far above it."""
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model.model.layers[0].mlp)
    float32 = copy.deepcopy(reference)
    train_in_float8(model, "cpt", compile_layers=False)
    mlp = model.model.layers[0].mlp
    assert all(getattr(mlp, name).config.emulate for name in ("gate_proj", "up_proj", "down_proj"))
    convert_to_float8_training(reference, config=Float8LinearConfig.from_recipe_name(RECIPE))
    assert not reference.down_proj.config.emulate

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    x = torch.randn(2, 16, 64)
    ours, theirs, exact = mlp(x), reference(x), float32(x)
    assert relative(ours, theirs) < 0.01 < relative(exact, theirs)
    for output in (ours, theirs, exact):
        output.square().sum().backward()
    for name, parameter in mlp.named_parameters():
        theirs_grad, exact_grad = reference.get_parameter(name).grad, float32.get_parameter(name).grad
        assert relative(parameter.grad, theirs_grad) < 0.01 < relative(exact_grad, theirs_grad), name


def test_a_gpu_without_float8_tensor_cores_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(NotSupportedHere, match=r"stages\.sft\.training\.fp8: .* this NVIDIA A100-SXM4-80GB is 8\.0"):
        check_float8("sft")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    check_float8("sft")  # an H100


def test_decoder_layers_compiled_whole_train_as_the_model_does_checkpointed_and_named_as_before() -> None:
    """The fp8 stages' compile on a GPU (stages.float8.compile_decoder_layers), run here on CPU's Inductor: the same
    loss and gradients as the eager model, one graph for every layer, no graph break, the parameters' names and the
    saved keys unchanged, and the checkpointing inside the compiled region (fewer activations kept)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = tiny()
    ids = torch.randint(0, 256, (2, 48))

    def kept_activations(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        sizes: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the stages train
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(sizes)

    loss, grads, _ = kept_activations(eager)
    results = {}
    for checkpointing in (True, False):
        torch._dynamo.reset()
        counters.clear()
        model = tiny()
        model.load_state_dict(eager.state_dict())
        assert compile_decoder_layers(model, checkpointing) == 2
        results[checkpointing] = kept_activations(model)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        assert model.state_dict().keys() == eager.state_dict().keys()
        assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    compiled_loss, compiled_grads, checkpointed = results[True]
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert checkpointed < results[False][2]  # the checkpointed layers keep only their inputs


def test_whole_decoder_layers_compile_for_float8_in_cpt_and_sft_under_ddp_and_fsdp_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stages import training
    from stages.distributed import strategy_arguments

    def section(overrides: list[str], stage: str = "cpt") -> object:
        return getattr(load_pipeline("korean-llm", overrides=overrides).spec.stages, stage)

    fp8 = ["stages.cpt.training.fp8=true", "stages.cpt.distributed.strategy=ddp"]
    assert not compiles_decoder_layers("cpt", section(fp8))  # CPU: nothing compiles
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compiles_decoder_layers("cpt", section(fp8))
    assert not compiles_decoder_layers("cpt", section(fp8[1:]))  # bf16
    fsdp = [fp8[0], "stages.cpt.distributed.strategy=fsdp"]
    assert compiles_decoder_layers("cpt", section(fsdp))  # FSDP2 shards the compiled layers
    for parallel in ("tensor_parallel", "pipeline_parallel"):  # these plans rebuild the layers (fp8 refuses experts')
        assert not compiles_decoder_layers("cpt", section([*fsdp, f"stages.cpt.distributed.{parallel}=2"]))
    # FSDP's own recomputation off there: it would wrap the compiled layers, which checkpoint themselves
    settings = strategy_arguments("cpt", section(fsdp), tiny())
    assert settings["fsdp_config"]["activation_checkpointing"] is False
    assert section(fsdp).recomputes_activations
    assert section([*fsdp, "stages.cpt.training.gradient_checkpointing=false"]).recomputes_activations is False
    fsdp_recomputes = [
        *fsdp,
        "stages.cpt.training.gradient_checkpointing=false",
        "stages.cpt.distributed.activation_checkpointing=true",
    ]
    assert section(fsdp_recomputes).recomputes_activations
    unchanged = strategy_arguments("cpt", section([*fp8[1:], "stages.cpt.distributed.strategy=fsdp"]), tiny())
    assert unchanged["fsdp_config"]["activation_checkpointing"] is True  # bf16: FSDP recomputes
    rlhf = ["stages.rlhf.training.fp8=true", "stages.rlhf.method=full", "stages.rlhf.distributed.strategy=ddp"]
    assert not compiles_decoder_layers("rlhf", section(rlhf, "rlhf"))  # rlhf generates through its policy
    # Liger: in cpt its fused cross-entropy only (Inductor fuses the rest inside a layer); sft's trainer has its own.
    monkeypatch.setattr(training, "on_gpu", lambda: True)
    monkeypatch.setattr(training.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    dense = tiny()
    assert training.kernel_arguments(dense, "cpt", whole_layers=True)["liger_kernel_config"] == {
        "rope": False,
        "rms_norm": False,
        "swiglu": False,
        "geglu": False,
        "fused_linear_cross_entropy": True,
    }
    assert training.kernel_arguments(dense, "sft", whole_layers=True) == {}


def test_the_spec_refuses_what_float8_cannot_combine_with() -> None:
    fp8 = "stages.sft.training.fp8=true"
    assert "stages.sft.training.fp8" in spec_error("llama3-dolly", [fp8, "stages.sft.method=lora"])
    assert "method 'lora' trains adapters on frozen ones" in spec_error("llama3-dolly", [fp8, "stages.sft.method=lora"])
    zero3 = spec_error(
        "llama3-dolly", [fp8, "stages.sft.method=full", "stages.sft.distributed.strategy=deepspeed_zero3"]
    )
    assert "DeepSpeed (deepspeed_zero3) flattens the weights" in zero3
    grpo = ["stages.rlhf.training.fp8=true", "stages.rlhf.method=full", "stages.rlhf.algorithm=grpo"]
    assert "grpo generates with the policy it trains" in spec_error("korean-llm", grpo)
    fsdp = [fp8, "stages.sft.method=full", "stages.sft.distributed.strategy=fsdp"]
    full = load_pipeline("llama3-dolly", overrides=fsdp)
    assert full.spec.stages.sft.training.fp8


def trained(root: Path, overrides: list[str]) -> tuple[RunDir, str]:
    run_dir = make_run_dir(root, overrides=overrides, n_text=80, n_chat=10)
    done = run_stage(run_dir, "cpt")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done.stdout + done.stderr


@pytest.mark.slow
def test_cpt_in_float8_trains_saves_an_ordinary_model_reruns_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    plain, _ = trained(tmp_path / "plain", FAST)
    fp8, log = trained(tmp_path / "fp8", FP8)
    assert "[cpt] fp8: 14 linear layers in float8, 1 not" in log

    # Float8 changes the products, a little: the same data and seed give other losses, close to the plain run's.
    ours, theirs = losses(fp8, "cpt"), losses(plain, "cpt")
    assert len(ours) == len(theirs) == 6 and ours != theirs
    assert ours[0] == pytest.approx(theirs[0], rel=0.01) and ours[-1] < ours[0]
    saved = load_file(fp8.stage_dir("cpt") / "model/model.safetensors")
    reference = load_file(plain.stage_dir("cpt") / "model/model.safetensors")
    assert saved.keys() == reference.keys()  # an ordinary model: no float8 state, every stage and vLLM load it
    assert all(saved[k].dtype == reference[k].dtype for k in saved)
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(saved[down], reference[down])

    # Same inputs, same model (CPU: bit-identical).
    again, _ = trained(tmp_path / "again", FP8)
    fingerprint = model_fingerprint(fp8.stage_dir("cpt") / "model")
    assert model_fingerprint(again.stage_dir("cpt") / "model") == fingerprint

    # Killed after checkpoint-3, the rerun resumes from it to the same model.
    killed = make_run_dir(tmp_path / "killed", overrides=FP8, n_text=80, n_chat=10)
    child = start_stage(killed, "cpt", HOLD_AFTER_CHECKPOINT="3")
    wait_for_file(killed.stage_dir("cpt") / "checkpoints/checkpoint-3" / MARKER, child)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    done = run_stage(killed, "cpt")
    assert done.returncode == 0, done.stderr[-3000:]
    result = killed.read_result("cpt")
    assert result is not None and result.extra["resumed_from"] == "checkpoint-3"
    assert model_fingerprint(killed.stage_dir("cpt") / "model") == fingerprint


@pytest.mark.slow
def test_dpo_trains_a_full_policy_in_float8(tmp_path: Path) -> None:
    overrides = [
        "stages.cpt.enabled=false",
        "stages.sft.enabled=false",
        "stages.rlhf.method=full",
        "stages.rlhf.training.fp8=true",
        "stages.rlhf.training.max_steps=4",
        "stages.rlhf.training.logging_steps=1",
    ]
    run_dir = make_preference_run_dir(tmp_path / "run", overrides)
    done = run_stage(run_dir, "rlhf")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[rlhf] fp8: 14 linear layers in float8" in done.stdout + done.stderr
    history = read_log_history(run_dir.stage_dir("rlhf") / "logs/log_history.json")
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]
    assert (run_dir.stage_dir("rlhf") / "model/model.safetensors").is_file()
