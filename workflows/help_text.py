"""What `--help` shows after the options, for `posttrain` and `python -m workflows.submit` alike.

Examples, the shipped pipelines (read from their files), environment variables and exit codes.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from spec.loading import PIPELINES_DIR

EXAMPLES = """\
examples:
  posttrain submit korean-llm --render out/          write the WorkflowTemplate, Workflow and CronWorkflow
  posttrain submit korean-llm --watch                submit to Argo and follow the run
  posttrain submit my-pipeline.yaml --set stages.sft.training.learning_rate=1e-4 --dry-run
  posttrain local korean-llm                         the same DAG on this machine, tiny and offline
  posttrain register korean-llm                      the template (and schedule) in the Argo UI
  posttrain runs list                                recent runs (-o json|yaml for scripts)
  posttrain runs watch korean-llm-x7k2p              follow a run; exit 0 if it Succeeded, 1 if not
  posttrain preflight korean-llm                     does the cluster have what it needs?
  posttrain import llamafactory llama3_lora_sft.yaml -o my-pipeline.yaml"""

ENVIRONMENT = """\
environment variables:
  ARGO_SERVER                  Argo server host:port or URL (submit, register, runs); unset: use --render/--local
  ARGO_SECURE                  with a bare host:port, https (true, the default) or http (false)
  ARGO_TOKEN                   bearer token for the Argo server (never printed)
  ARGO_NAMESPACE               namespace of the workflows; submit and register: must equal the spec's
                               cluster.namespace; runs: after --namespace, before the kubeconfig
                               context's namespace and the default, posttrain
  ARGO_BASE_HREF               path prefix of the Argo server's API and UI (default /)
  ARGO_INSECURE_SKIP_VERIFY    true: do not verify the server's TLS certificate
  KUBECONFIG                   cluster credentials for preflight and `runs`, and the namespace of `runs`
                               (its current context's) (default ~/.kube/config)
  MLFLOW_TRACKING_URI          MLflow server when the spec has no tracking.mlflow_tracking_uri
                               (default: runs/mlflow.db beside the run directories, shared by them)
  WANDB_API_KEY, WANDB_MODE    W&B key and mode (disabled, offline, online); unset: online when a key is
                               known (WANDB_API_KEY or `wandb login`), else offline
  WANDB_PROJECT, WANDB_ENTITY  W&B project and entity; they override tracking.wandb_project/wandb_entity
  LANGFUSE_HOST, LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY
                               stage events to Langfuse when the spec has no tracking.langfuse_host
  CUDA_VISIBLE_DEVICES         GPUs the --local stages may use
  POSTTRAIN_MAX_ROW_BYTES      largest data row prepare accepts
  POSTTRAIN_MAX_INFLATION      most times its size a compressed data file may inflate to (default 1000)
  POSTTRAIN_WARM_STARTS        0: every --local stage starts as a fresh process (no warm-start server)
  POSTTRAIN_WARM_SERVER        socket of a warm-start server that --local runs share
                               (`python -m stages.warm --listen PATH`)
  (in the pods the compiled workflow sets POSTTRAIN_IMAGE, POSTTRAIN_GIT_SHA and POSTTRAIN_METRICS_PORT)"""

EXIT_CODES = """\
exit codes:
  0        done (the watched or local run succeeded)
  1        failed: the server refused, a blocking preflight check failed, or the run/stage failed
  2        bad input: unknown pipeline, invalid spec, --set or option (one `error:` line says what to fix)
  3        --local --fail-on-gate: every stage ran, the gate failed, deploy was skipped; import: the pipeline
           was written, but its data cannot be read as it says (`not runnable:` lines)
  75       a stage was interrupted (SIGTERM, preemption) after saving a checkpoint: rerun to resume
  130/143  interrupted by Ctrl-C (SIGINT) / SIGTERM (128 + the signal's number)"""


def pipeline_descriptions(directory: Path = PIPELINES_DIR) -> list[tuple[str, str]]:
    """(name, description) of each shipped pipeline: its `description` field, else its first comment line."""
    out = []
    for path in sorted(directory.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            doc = None
        described = doc.get("description") if isinstance(doc, dict) else None
        if not described:
            comments = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("# ")]
            described = next((c for c in comments if not c.startswith("yaml-language-server")), "")
        out.append((path.stem, str(described)))
    return out


def pipelines_help() -> str:
    """The shipped pipelines, one a line, for --help."""
    rows = pipeline_descriptions()
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join(["shipped pipelines (workflows/pipelines/):", *(f"  {n:<{width}}  {d}" for n, d in rows)])


def epilog() -> str:
    """What --help shows after the options: examples, pipelines, environment variables and exit codes."""
    return "\n\n".join([EXAMPLES, pipelines_help(), ENVIRONMENT, EXIT_CODES])
