"""The local serve step: the deployed model answers through the real vLLM engine on 127.0.0.1, as it will in KServe.

    python -m workflows.local_serving --run-dir DIR

Under `--local` it runs after deploy, where the cluster DAG runs workflows/rollout.py:

1. Start vLLM's OpenAI-compatible server from the serving environment (`.venv-vllm/bin/python` of this checkout,
   which `make local` sets up, or `$POSTTRAIN_VLLM_PYTHON`; `off` serves nothing) with the command line of the
   predictor pod (`run.serving.server_argv`, the same function that renders the InferenceService's arguments), on
   a free port of 127.0.0.1 and the model deploy wrote in `<run>/deploy/model`. vLLM pins its own transformers,
   so it lives in an environment of its own, as it has a pod of its own.
2. Wait for `/health`, within stages.deploy.serving.smoke_check.ready_timeout_seconds; a server that exits
   first fails the step with the last lines of its log (`<run>/deploy/logs/vllm.log`).
3. The cluster rollout's smoke check (workflows/rollout.py `smoke_check`): the same prompts and rules.
4. Record the engine (vLLM's `/version`), the command line and the answers in deploy's stage.json (`extra.served`),
   stop the server, and move `champion` to the deployed version when its gate passed, as the rollout does.

A machine without the serving environment says so in one line and skips the step; deploy then promoted the model
itself (the runner tells deploy whether a serve step follows: POSTTRAIN_LOCAL_SERVE=1). A failed start or check
leaves `champion` where it was and exits 1.

Control plane: no torch; vLLM runs in its own process and environment.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from run.run_dir import RunDir, StageResult
from run.serving import LOCAL_HOST, RUNTIME_ENV, inference_service_name, server_argv
from run.vllm_server import (
    ServerFailed,
    engine_version,
    server_env,
    start_ready,
    vllm_python,
    where_expected,
)
from spec.pipeline import PipelineSpec
from workflows.rollout import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    BadInput,
    RolloutFailed,
    not_promoted,
    promote,
    read_run,
    smoke_check,
    smoke_prompts,
)


def serve(spec: PipelineSpec, run_dir: Path, python: Path) -> dict[str, Any]:
    """Start vLLM on the deployed model, check it as the rollout does, stop it; the record of what answered."""
    deploy_dir = RunDir(run_dir).stage_dir("deploy")
    model_dir = deploy_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise BadInput(f"{model_dir} holds no model: deploy writes it")
    name = inference_service_name(spec)
    server, base_url, ready = start_ready(
        lambda port: [*server_argv(spec, str(python), str(model_dir), name, port), f"--host={LOCAL_HOST}"],
        server_env(RUNTIME_ENV, spec.stages.deploy.serving.gpus),
        deploy_dir / "logs" / "vllm.log",
        spec.stages.deploy.serving.smoke_check.ready_timeout_seconds,
        "stages.deploy.serving.smoke_check.ready_timeout_seconds",
        lambda argv: print(f"[serve] starting vLLM: {' '.join(argv)}", flush=True),
    )
    try:
        version = engine_version(base_url)
        print(f"[serve] vLLM {version} ready on {base_url} after {ready:.0f}s", flush=True)
        answers = smoke_check(base_url, name, smoke_prompts(spec), spec.stages.deploy.serving)
    finally:
        server.stop()
    return {
        "engine": "vllm",
        "engine_version": version,
        "argv": server.argv,
        "ready_seconds": round(ready, 1),
        "answers": [{"prompt": a.prompt, "answer": a.text, "seconds": round(a.seconds, 2)} for a in answers],
    }


def record(run_dir: Path, served: dict[str, Any]) -> None:
    """deploy's stage.json with `extra.served`, written atomically."""
    run = RunDir(run_dir)
    result = run.read_result("deploy")
    assert result is not None  # read_run checked it
    run.write_result(StageResult(**{**result.model_dump(), "extra": {**result.extra, "served": served}}))


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.local_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="The run directory (deploy has run in it).")
    args = parser.parse_args(argv)
    # SIGTERM (the runner passing an interrupt on) unwinds like Ctrl-C, so that the server is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        spec, deployed, _ = read_run(args.run_dir)
        python = vllm_python()
        if python is None:
            print(
                f"[serve] skipped: no vLLM serving environment at {where_expected()} (`make local` sets it up); deploy "
                "promoted the model itself",
                flush=True,
            )
            return EXIT_OK
        served = serve(spec, args.run_dir, python)
    except BadInput as exc:
        print(f"[serve] error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (RolloutFailed, ServerFailed) as exc:
        print(not_promoted(deployed, exc), file=sys.stderr, flush=True)
        return EXIT_FAILED
    record(args.run_dir, served)
    if deployed.get("promoted") == "true":  # deploy moved it already: nothing was to be served when it ran
        print(f"[serve] vLLM {served['engine_version']} served it (deploy had promoted it)", flush=True)
        return EXIT_OK
    promoted = promote(spec, args.run_dir, deployed)
    print(f"[serve] vLLM {served['engine_version']} served it; {promoted}", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
