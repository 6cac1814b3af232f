"""Every container the compiler renders asks for CPU and memory, sized from the spec or from the model and stage."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import yaml
from conftest import fresh_spec

from spec.pipeline import PipelineSpec
from spec.sizing import _host_copies, model_parameters, pod_size, quantity
from workflows.compile import compile_pipeline


def _containers(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, resources) of every container in a document: Argo's container and script templates, the pods of the
    manifests that resource templates create (PyTorchJob replicas, Katib trial jobs), a TrainJob's trainer."""
    if isinstance(node, dict):
        if isinstance(node.get("manifest"), str):
            yield from _containers(yaml.safe_load(node["manifest"]), f"{where}.manifest")
        for key in ("container", "script"):
            if isinstance(node.get(key), dict):
                yield f"{where}.{node.get('name')}.{key}", node[key].get("resources") or {}
        for key in ("containers", "initContainers"):
            for container in node.get(key) or []:
                yield f"{where}.{key}.{container.get('name')}", container.get("resources") or {}
        if "resourcesPerNode" in node:
            yield f"{where}.resourcesPerNode", node["resourcesPerNode"] or {}
        for key, value in node.items():
            if key != "podTemplateOverrides":  # patches of the trainer's pods, sized by resourcesPerNode
                yield from _containers(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _containers(value, f"{where}[{i}]")


def _sizes(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    found = {}
    for name, doc in compile_pipeline(spec).documents().items():
        for where, resources in _containers(doc):
            found[f"{name}{where}"] = resources
    return found


def test_every_rendered_container_has_requests_and_limits(spec: PipelineSpec) -> None:
    sizes = _sizes(spec)
    assert any("deploy" in where for where in sizes)
    assert any(".manifest." in where for where in sizes)  # the training jobs' pods are walked too
    for where, resources in sizes.items():
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        assert {"cpu", "memory"} <= set(requests), f"{where}: requests {requests}"
        assert set(requests) <= set(limits), f"{where}: limits {limits} lack a request's resource"
        for resource, amount in requests.items():
            assert quantity(str(limits[resource])) >= quantity(str(amount)), f"{where}: {resource} limit < request"
        assert limits["memory"] == requests["memory"], f"{where}: a memory limit over the request"


def _deploy(spec: PipelineSpec) -> dict[str, Any]:
    (resources,) = [r for where, r in _sizes(spec).items() if where.endswith(".deploy.container")]
    return resources


def test_deploy_is_sized_from_the_model_and_the_spec_overrides_it() -> None:
    small = fresh_spec("llama3-dolly")
    derived = _deploy(small)
    assert model_parameters(small) == 8 * 10**9
    # A merge of 8B parameters in bfloat16 (16 GB of weights) needs room for two and a half copies; MLflow stages a
    # copy in /tmp.
    assert quantity(derived["requests"]["memory"]) >= 2.5 * 16 * 10**9
    assert quantity(derived["requests"]["ephemeral-storage"]) >= 16 * 10**9

    big = fresh_spec("llama3-dolly")
    big.model.name_or_path = "Qwen/Qwen2.5-72B-Instruct"
    assert quantity(_deploy(big)["requests"]["memory"]) >= 9 * quantity(derived["requests"]["memory"]) / 2

    small.stages.deploy.resources.cpu = "2"
    small.stages.deploy.resources.memory = "500Gi"
    small.stages.deploy.resources.ephemeral_storage = "1Ti"
    overridden = _deploy(small)
    wanted = {"cpu": "2", "memory": "500Gi", "ephemeral-storage": "1Ti"}
    assert overridden == {"requests": wanted, "limits": wanted}


def test_a_training_pod_holds_the_weights_once_per_gpu() -> None:
    spec = fresh_spec("llama3-dolly")
    spec.stages.sft.resources.cpu = spec.stages.sft.resources.memory = None
    size = pod_size(spec, "sft")
    assert size.cpu == "64"  # 8 GPUs
    assert quantity(size.memory) >= 8 * 16 * 10**9 + quantity("64Gi")  # eight copies of 16 GB, and /dev/shm
    spec.stages.sft.distributed.cpu_offload = True
    offloaded = quantity(pod_size(spec, "sft").memory) - quantity(size.memory)
    assert offloaded >= 16 * 8 * 10**9 - quantity("1Gi")  # the Adam state of 8B parameters (sizes round up to 1Gi)


def test_an_fsdp_pod_holds_the_weights_rank_0_loaded() -> None:
    """Under FSDP2 over several processes rank 0 alone loads the weights (stages/sharded_loading.py): host memory
    for them and, in full training, accelerate's float32 upcast, not one copy per GPU."""
    spec = fresh_spec("korean-llm")  # Qwen3-8B, cpt: full training, FSDP, 2 nodes of 8 GPUs
    cpt = spec.stages.cpt
    cpt.resources.memory = cpt.resources.shm_size = None
    ddp = cpt.model_copy(update={"distributed": cpt.distributed.model_copy(update={"strategy": "ddp"})})
    weights, runtime = 8 * 10**9 * 2, quantity("17Gi")  # 16 GB of bf16 weights; Python, CUDA, NCCL, loaders

    def memory() -> Decimal:
        return quantity(pod_size(spec, "cpt").memory)

    assert 2 * weights <= memory() < 2 * weights + runtime
    spec.stages.cpt = ddp
    assert memory() >= 8 * weights
    spec.stages.cpt = cpt.model_copy(update={"method": "lora"})
    assert weights <= memory() < weights + runtime
    cpt.resources.nodes = cpt.resources.gpus_per_node = 1  # one process loads as any single process does
    spec.stages.cpt = cpt
    assert weights <= memory() < weights + runtime


def test_an_expert_parallel_pod_holds_the_weights_once() -> None:
    """With expert parallelism each rank reads its own shards (stages/model_parallel.py); full training after an
    upstream adapter merges it into whole weights in every process first."""
    spec = fresh_spec("qwen3-30b-a3b")  # sft: full training, 2 nodes of 8 GPUs
    sft = spec.stages.sft
    sft.resources.memory = sft.resources.shm_size = None
    weights, runtime = 30 * 10**9 * 2, quantity("17Gi")
    distributed = sft.distributed.model_copy(update={"strategy": "fsdp", "expert_parallel": 8})
    spec.stages.sft = sft.model_copy(update={"distributed": distributed})
    assert weights <= quantity(pod_size(spec, "sft").memory) < weights + runtime
    spec.stages.sft.distributed.expert_parallel = 1  # FSDP2 alone: rank 0 loads, and upcasts for full training
    assert quantity(pod_size(spec, "sft").memory) >= 2 * weights
    spec.stages.sft.distributed.expert_parallel = 8
    assert _host_copies(spec.stages.sft, spec.stages.sft.resources, whole=True) == 8


def test_a_zero3_pod_holds_the_weights_once() -> None:
    """Under ZeRO-3 over several processes the model is created partitioned and rank 0 alone reads the checkpoint
    (stages/sharded_loading.py): host memory for one copy, in full training and under LoRA; ZeRO-2 loads the whole
    model in every process."""
    spec = fresh_spec("korean-llm")  # Qwen3-8B, 2 nodes of 8 GPUs
    cpt = spec.stages.cpt
    cpt.resources.memory = cpt.resources.shm_size = None
    weights, runtime = 8 * 10**9 * 2, quantity("17Gi")

    def with_strategy(strategy: str, method: str = "full") -> Decimal:
        distributed = cpt.distributed.model_copy(update={"strategy": strategy})
        spec.stages.cpt = cpt.model_copy(update={"distributed": distributed, "method": method})
        return quantity(pod_size(spec, "cpt").memory)

    assert weights <= with_strategy("deepspeed_zero3") < weights + runtime
    assert weights <= with_strategy("deepspeed_zero3", "lora") < weights + runtime
    assert with_strategy("deepspeed_zero2") >= 8 * weights
    # Full training from a LoRA stage's adapter merges it into whole weights, in every process.
    spec.stages.cpt = cpt.model_copy(update={"method": "lora"})
    zero3 = spec.stages.sft.distributed.model_copy(update={"strategy": "deepspeed_zero3"})
    spec.stages.sft = spec.stages.sft.model_copy(update={"method": "full", "enabled": True, "distributed": zero3})
    spec.stages.sft.resources.memory = spec.stages.sft.resources.shm_size = None
    spec.stages.sft.resources.nodes, spec.stages.sft.resources.gpus_per_node = 1, 8
    assert quantity(pod_size(spec, "sft").memory) >= 8 * weights
    spec.stages.cpt = cpt.model_copy(update={"method": "full"})
    assert weights <= quantity(pod_size(spec, "sft").memory) < weights + runtime
    # rlhf's full DPO loads its reference partitioned too, after the policy: one copy at a time
    spec.stages.rlhf = spec.stages.rlhf.model_copy(update={"method": "full", "enabled": True, "distributed": zero3})
    spec.stages.rlhf.resources.memory = spec.stages.rlhf.resources.shm_size = None
    spec.stages.rlhf.resources.nodes, spec.stages.rlhf.resources.gpus_per_node = 1, 8
    assert weights <= quantity(pod_size(spec, "rlhf").memory) < weights + runtime
    # GRPO's full training reads its reference from a saved copy of the whole starting weights: whole in every process
    grpo = {"algorithm": "grpo", "reward_functions": [{"name": "hangul_ratio"}]}
    spec.stages.rlhf = type(spec.stages.rlhf).model_validate({**spec.stages.rlhf.model_dump(), **grpo})
    assert quantity(pod_size(spec, "rlhf").memory) >= 8 * weights
