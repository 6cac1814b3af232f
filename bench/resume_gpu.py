"""Benchmark (not a test): a training stage resumed after one of its ranks was killed, against an uninterrupted run.

    python bench/resume_gpu.py --run-dir PREPARED --out OUT [--work DIR --stage cpt --steps 8 --kill-after 4 --procs 2]

PREPARED is a run directory prepare finished (the P7 run of `--local --profile gpu`, or any pipeline's). Two copies
are made under --work (default OUT; checkpoints of real size go there, so keep it off a folder that is shipped), and
in both the stage's plan becomes --steps optimizer steps with the loss logged at every step. Copy A trains without
interruption and checkpoints only at its end (saving changes no training state, and a full checkpoint of a 1.7B
model takes half a minute). Copy B checkpoints every --kill-after steps; once its checkpoint at step --kill-after
is complete (its COMPLETE marker written), local rank 1 gets SIGKILL and torchrun tears the group down,
as the Training Operator sees a failed replica. The stage is then launched again with the same argv and environment
(workflows/launch.py: what its pod runs), and resumes from the newest complete checkpoint. OUT/resume.json has both
loss curves, the largest relative difference of a loss after the checkpoint (target: within 0.1%), and how the
two final models' weights differ (bit-identical is the expectation: the losses are logged at bf16's resolution).
--side-by-side runs both copies at once, A on GPUs 0..procs-1 and B on the next procs; --share-gpus runs both at
once on the same procs GPUs (a 1.7B model's two FSDP2 copies fit two 80 GB GPUs; the losses do not depend on the
other copy, only the times do). On CPU (--procs 2) the processes talk over gloo: a smoke run of the bench itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from run.run_dir import RunDir  # noqa: E402
from stages.checkpoints import MARKER  # noqa: E402
from workflows.launch import local_launch  # noqa: E402


def plan(root: Path, stage: str, steps: int, every: int) -> None:
    """The stage trains `steps` steps, checkpoints every `every`, logs the loss at every step."""
    run_dir = RunDir(root)
    spec = run_dir.load_spec()
    training = spec.stage(stage).training  # type: ignore[attr-defined]
    training.max_steps, training.save_steps, training.logging_steps = steps, every, 1
    training.eval_steps = None
    run_dir.write_spec(spec)


def stage_folders(source: Path) -> Any:
    """A copytree ignore: the stages' folders of the run directory `source` (not prepare's data for them)."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        if Path(directory) != source:
            return set()
        return {name for name in names if name in ("cpt", "sft", "rlhf", "evaluate", "deploy")}

    return ignore


def launch(root: Path, stage: str, procs: int, log: Path, gpus: str | None = None) -> subprocess.Popen[bytes]:
    """The stage as its pod starts it: torchrun with the operator's variables, one process per GPU (on the GPUs
    `gpus` names, a CUDA_VISIBLE_DEVICES value, when given)."""
    spec = RunDir(root).load_spec()
    command, env = local_launch(spec, stage, root, procs)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    handle = log.open("ab")
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT)


def rank_pid(agent: int, local_rank: int) -> int | None:
    """The process of `local_rank` among the torchrun agent's children."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    return None


def losses(root: Path, stage: str) -> dict[int, float]:
    """Step → training loss, from the stage's log history."""
    path = root / stage / "logs" / "log_history.json"
    history: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def weight_difference(first: Path, second: Path) -> dict[str, Any]:
    """How the safetensors weights of two model folders differ: tensors compared, how many are not bit-identical,
    and the largest absolute difference of an element relative to the largest magnitude in its tensor."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, Path]:
        return {name: path for path in sorted(folder.glob("*.safetensors")) for name in safe_open(path, "pt").keys()}  # noqa: SIM118

    left, right = tensors(first), tensors(second)
    if left.keys() != right.keys():
        return {"tensors": len(left), "different_names": sorted(left.keys() ^ right.keys())[:5]}
    unequal, largest = 0, 0.0
    for name, path in left.items():
        a = safe_open(path, "pt").get_tensor(name).float()
        b = safe_open(right[name], "pt").get_tensor(name).float()
        if not a.equal(b):
            unequal += 1
            largest = max(largest, ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item())
    return {"tensors": len(left), "not_bit_identical": unequal, "max_relative_difference": largest}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="a run directory prepare finished")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, help="where the two run copies go (default: OUT)")
    parser.add_argument("--stage", default="cpt")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the two copies at once, the uninterrupted one on GPUs 0..procs-1 and the other on the next procs",
    )
    parser.add_argument("--share-gpus", action="store_true", help="run the two copies at once on the same GPUs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copies = {}
    for name in ("uninterrupted", "killed"):
        root = (args.work or args.out) / name
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(args.run_dir, root, ignore=stage_folders(args.run_dir))
        plan(root, args.stage, args.steps, args.steps if name == "uninterrupted" else args.kill_after)
        copies[name] = root

    first_gpus = second_gpus = None
    if args.side_by_side:
        first_gpus = ",".join(str(i) for i in range(args.procs))
        second_gpus = ",".join(str(i) for i in range(args.procs, 2 * args.procs))
    started = time.time()
    together = args.side_by_side or args.share_gpus
    first = launch(copies["uninterrupted"], args.stage, args.procs, args.out / "uninterrupted.log", first_gpus)
    if not together:
        first.wait()
    uninterrupted_s: float | None = time.time() - started

    killed = copies["killed"]
    started = time.time()
    attempt = launch(killed, args.stage, args.procs, args.out / "killed.log", second_gpus)
    marker = killed / args.stage / "checkpoints" / f"checkpoint-{args.kill_after}" / MARKER
    while not marker.is_file() and attempt.poll() is None:
        time.sleep(0.2)
    victim = rank_pid(attempt.pid, 1)
    if victim is None:
        raise SystemExit(f"no rank 1 to kill (the attempt exited {attempt.returncode}); see {args.out}/killed.log")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time() - started
    first_exit = attempt.wait()
    relaunched = launch(killed, args.stage, args.procs, args.out / "killed.log", second_gpus)
    relaunched.wait()
    resumed_s = time.time() - started
    first.wait()
    if together:
        uninterrupted_s = None  # it ran beside the other; its stage.json has its own times

    reference, resumed = losses(copies["uninterrupted"], args.stage), losses(killed, args.stage)
    after = [step for step in sorted(reference) if step > args.kill_after]
    differences = {step: abs(resumed[step] - reference[step]) / abs(reference[step]) for step in after}
    weights = weight_difference(copies["uninterrupted"] / args.stage / "model", killed / args.stage / "model")
    stage_json = json.loads((killed / args.stage / "stage.json").read_text(encoding="utf-8"))
    result = {
        "stage": args.stage,
        "procs": args.procs,
        "steps": args.steps,
        "copies": "side by side" if args.side_by_side else "sharing the GPUs" if args.share_gpus else "one by one",
        "killed_rank": 1,
        "killed_after_s": killed_at,
        "first_attempt_exit": first_exit,
        "relaunch_exit": relaunched.returncode,
        "uninterrupted_exit": first.returncode,
        "uninterrupted_s": uninterrupted_s,
        "killed_and_resumed_s": resumed_s,
        "resumed_from": stage_json.get("extra", {}).get("resumed_from"),
        "status": stage_json.get("status"),
        "loss_uninterrupted": reference,
        "loss_resumed": resumed,
        "max_relative_difference_after_checkpoint": max(differences.values()) if differences else None,
        "final_weights": weights,
    }
    (args.out / "resume.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("loss_")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
