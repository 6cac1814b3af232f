"""How a training stage's processes start: the argv and environment its pod runs, which the local runner runs too.

In the cluster a training stage's container runs `torchrun --module stages <stage> --run-dir DIR`, and torchrun
reads the node's shape from the variables the Training Operator sets on each pod of a PyTorchJob (Kubeflow Trainer
v2's torch runtime sets the same for a TrainJob): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and the master's
address and port. The container's own environment adds the spec's plain settings (`cluster.env`, the stage's
`env`), torchrun's shutdown timeout and NCCL's RDMA settings.

Under `--local` the runner starts a training stage the same way, as one node of one process per GPU (one on a
machine without GPUs): `training_command` with torchrun as a module of its own interpreter, `operator_env` for a
single node on 127.0.0.1, and `container_env`. The pod's manifest and the local runner take the argv from the same
function; tests/test_launch.py checks that every variable of `container_env` reaches the rendered containers with
the same value, so the two launches cannot drift. What differs is only what names the cluster: its volumes' paths
(HF_HOME, the caches of a read-only root filesystem), Argo's identity, and the secrets, which a pod reads from
Kubernetes Secrets and the local runner from the user's own environment.
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

from spec.pipeline import PipelineSpec
from spec.stage import RdmaSpec
from spec.training import TrainingStage

TORCHRUN = ("torchrun",)
"""The container's launcher: the image's torchrun."""

LOCAL_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
"""The same launcher under --local: torchrun as a module of this interpreter, whatever PATH says."""

LOCAL_MASTER = "127.0.0.1"

# Seconds of the grace period kept back from torchrun's own shutdown, for the agent to exit after its workers.
SHUTDOWN_MARGIN_SECONDS = 15
MIN_SHUTDOWN_TIMEOUT_SECONDS = 30

SCRATCH_DIR = "/tmp"
"""An emptyDir every pod that runs stage code mounts: the root filesystem is read-only, and what the stages and
their libraries write outside the volumes lands here (torchrun's files, Argo's outputs under /tmp/outputs,
temporary files, the caches of WRITABLE_ENV)."""

WRITABLE_ENV: dict[str, str] = {
    "HOME": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/.cache",
    "XDG_CONFIG_HOME": f"{SCRATCH_DIR}/.config",
    "MPLCONFIGDIR": f"{SCRATCH_DIR}/.cache/matplotlib",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/.cache/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/.cache/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{SCRATCH_DIR}/.cache/torch_extensions",
    "CUDA_CACHE_PATH": f"{SCRATCH_DIR}/.cache/nv",
    "WANDB_DIR": SCRATCH_DIR,
    "WANDB_CACHE_DIR": f"{SCRATCH_DIR}/.cache/wandb",
    "WANDB_CONFIG_DIR": f"{SCRATCH_DIR}/.config/wandb",
}
"""Every cache a stage's libraries write, on the scratch volume: the image's own settings (HOME, MPLCONFIGDIR,
TRITON_CACHE_DIR under /home/posttrain) point at the read-only root filesystem. torch.compile (Inductor, Triton),
DeepSpeed's ops (compiled on first use into TORCH_EXTENSIONS_DIR), the CUDA JIT, matplotlib and W&B's files outside
the run directory. HF_HOME is on the checkpoints volume instead (pod_env), so models and datasets are downloaded
once per cluster. cluster.env or a stage's env may set any of these to another writable path."""

CLUSTER_PATHS = frozenset({*WRITABLE_ENV, "HF_HOME"})
"""Variables that name places of a pod (its scratch volume, the checkpoints volume): not set under --local."""


def training_command(stage: str, run_directory: str, launcher: tuple[str, ...] = TORCHRUN) -> list[str]:
    """The argv of a training stage's processes: torchrun over the stage's entry point. torchrun reads nnodes,
    nproc-per-node, node rank and the master address from the PET_* variables (`operator_env`); only the entry
    point and the run directory are ours."""
    return [*launcher, "--module", "stages", stage, "--run-dir", run_directory]


def operator_env(
    nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """What the Training Operator sets on a PyTorchJob's pod of node `node_rank` (its setPodEnv and master
    variables): the master's address and port, world size and rank as it counts them (pods x processes, the
    pod's index), and torchrun's PET_* options."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(nnodes * nproc_per_node),
        "RANK": str(node_rank),
        "PET_NNODES": str(nnodes),
        "PET_NPROC_PER_NODE": str(nproc_per_node),
        "PET_NODE_RANK": str(node_rank),
    }


def shutdown_timeout(stage: TrainingStage) -> int:
    """Seconds torchrun waits, after SIGTERM, for its workers to exit before it SIGKILLs them: most of the pod's
    grace period, so a preempted worker can finish its step and save a checkpoint (torchrun's default is 30)."""
    grace = stage.run_policy.termination_grace_period_seconds
    return max(grace - SHUTDOWN_MARGIN_SECONDS, MIN_SHUTDOWN_TIMEOUT_SECONDS)


def rdma_env(rdma: RdmaSpec | None) -> dict[str, str]:
    """NCCL's settings for RDMA: InfiniBand/RoCE on (NCCL_IB_DISABLE=0), and the adapters and bootstrap interface
    when the spec names them. Nothing without RDMA (NCCL then finds no IB device and uses TCP sockets)."""
    if rdma is None:
        return {}
    env = {"NCCL_IB_DISABLE": "0"}
    if rdma.nccl_ib_hca:
        env["NCCL_IB_HCA"] = rdma.nccl_ib_hca
    if rdma.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = rdma.nccl_socket_ifname
    return env


def container_env(spec: PipelineSpec, stage_name: str) -> dict[str, str]:
    """The plain settings a training stage's container gets besides the cluster's paths and identity: NCCL's RDMA
    settings, `cluster.env` with the stage's `env` over them, and torchrun's shutdown timeout."""
    stage: TrainingStage = spec.stage(stage_name)  # type: ignore[assignment]
    # The pod lists the shutdown timeout after the spec's env (the later of two equal names wins), RDMA's before.
    return {
        **rdma_env(stage.resources.rdma),
        **spec.cluster.env,
        **stage.env,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_timeout(stage)),
    }


LOCAL_PORTS = range(20000, 32768)
"""Where the local master's port is drawn from: below Linux's ephemeral range (32768-60999), which the kernel hands
out to outgoing connections and to bind(port 0) at any moment, so that no connection takes the port between the
runner choosing it and torchrun binding it. Another process choosing the same port then is still possible: the
runner launches again on another port when torchrun says the port is taken (workflows/stage_process.py)."""


def free_port() -> int:
    """A TCP port nothing listens on now, for the local master: a random one of LOCAL_PORTS that binds (random so
    that runners started together do not try the same ports in the same order)."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.choice(LOCAL_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((LOCAL_MASTER, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # all tried were taken: any the kernel gives
        probe.bind((LOCAL_MASTER, 0))
        return int(probe.getsockname()[1])


def local_launch(spec: PipelineSpec, stage: str, run_root: Path, gpus: int) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment (over the runner's own) of a training stage under --local: what its pod runs,
    as one node of `gpus` processes (one without GPUs) with its master on this machine. Paths of the cluster
    (CLUSTER_PATHS) stay as this machine has them, even where the spec's env sets them."""
    command = training_command(stage, str(run_root), LOCAL_TORCHRUN)
    settings = {k: v for k, v in container_env(spec, stage).items() if k not in CLUSTER_PATHS}
    return command, {**settings, **operator_env(max(gpus, 1), 1, 0, LOCAL_MASTER, free_port())}
