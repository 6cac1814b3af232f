"""Everything the cluster, Argo, vLLM or a later stage would refuse hours after submission is refused when the spec
is loaded: cron ranges, head divisibility, replica bounds, Kubernetes names, labels, tolerations, affinity,
images, annotation size, infinite numbers, eval_steps without held-out rows; and the YAML traps (duplicate keys,
alias bombs, dates) in pipeline files and in the form's overrides alike. Credentials in any value are refused too:
the spec is embedded in the template, which anyone who may submit can read.

Each refusal names the place to fix: the file and line (or the --set / form line) and the field path.
"""

from __future__ import annotations

import math
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import AfterValidator, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from test_parameters import _params_dir

from spec import form as spec_form
from spec.document import MAX_EXPANDED_NODES, SpecError
from spec.fields import IntegerRange, out_of_int64
from spec.loading import known_pipelines, load_pipeline, pipeline_path
from spec.model_shapes import AttentionShape, known_shape, tensor_parallel_problem
from spec.pipeline import PipelineSpec
from spec.reference import _models

PIPELINE = textwrap.dedent(
    """\
    name: demo
    model:
      name_or_path: Qwen/Qwen3-8B-Base
    data_version: v1
    stages:
      sft:
        data:
          uri: /mnt/datasets/sft.jsonl
          format: messages
    """
)


def _refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_pipeline(str(path))
    return str(info.value).replace(str(path), "pipeline.yaml")


def _set_refused(*overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_pipeline("korean-llm", overrides=overrides)
    return str(info.value)


def test_the_base_pipeline_loads(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE, encoding="utf-8")
    assert load_pipeline(str(path)).spec.data_version == "v1"


# --------------------------------------------------------------------------- what Kubernetes, Argo, vLLM check late

LATE = [
    ("schedule.cron=['61 25 32 13 8']", "schedule.cron[0]", "minute 61 is outside 0-59"),
    ("schedule.cron=['0 25 * * *']", "schedule.cron[0]", "hour 25 is outside 0-23"),
    ("schedule.cron=['0 2 32 * *']", "schedule.cron[0]", "day of month 32 is outside 1-31"),
    ("schedule.cron=['0 2 * 13 *']", "schedule.cron[0]", "month 13 is outside 1-12"),
    ("schedule.cron=['0 2 * * 8']", "schedule.cron[0]", "day of week 8 is outside 0-6"),
    ("schedule.cron=['*/0 * * * *']", "schedule.cron[0]", "step '0' must be a number greater than 0"),
    ("schedule.cron=['0 5-1 * * *']", "schedule.cron[0]", "range 5-1 runs backwards"),
    ("schedule.cron=['@fortnightly']", "schedule.cron[0]", "unknown descriptor"),
    ("stages.deploy.serving.gpus=3", "stages.deploy.serving.gpus", "3 does not divide the model's 32 attention heads"),
    ("stages.deploy.serving.gpus=6", "stages.deploy.serving.gpus", "6 does not divide the model's 32 attention heads"),
    ("stages.deploy.serving.min_replicas=2", "stages.deploy.serving.min_replicas", "above max_replicas (1)"),
    ("stages.sft.resources.labels={'team name': a}", "stages.sft.resources.labels", "'team name' is not a valid"),
    ("stages.sft.resources.labels={team: 'a b'}", "stages.sft.resources.labels", "label value 'a b' is not valid"),
    ("stages.sft.resources.node_selector={'-x': a}", "stages.sft.resources.node_selector", "'-x' is not a valid"),
    ("stages.sft.resources.annotations={'a/b/c': x}", "stages.sft.resources.annotations", "prefix before '/'"),
    ("workflow.labels={'Bad Key': x}", "workflow.labels", "'Bad Key' is not a valid"),
    (
        "stages.sft.resources.tolerations=[{operator: Exists, value: gpu}]",
        "stages.sft.resources.tolerations[0]",
        "operator Exists takes no value",
    ),
    (
        "stages.sft.resources.tolerations=[{value: gpu}]",
        "stages.sft.resources.tolerations[0]",
        "without a key must use operator Exists",
    ),
    (
        "stages.sft.resources.tolerations=[{key: a, tolerationSeconds: 30}]",
        "stages.sft.resources.tolerations[0]",
        "tolerationSeconds only applies to effect NoExecute",
    ),
    ("stages.sft.resources.affinity={nodeAfinity: {}}", "stages.sft.resources.affinity", "unknown field"),
    (
        "stages.sft.resources.affinity={podAntiAffinity: {requiredDuringSchedulingIgnoredDuringExecution: "
        "[{labelSelector: {matchLabels: {a: b}}}]}}",
        "stages.sft.resources.affinity",
        "topologyKey is required",
    ),
    (
        "stages.sft.resources.affinity={nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: "
        "{nodeSelectorTerms: [{matchExpressions: [{key: a, operator: Equals}]}]}}}",
        "stages.sft.resources.affinity",
        "'Equals' is not one of In, NotIn",
    ),
    ("stages.sft.resources.priority_class=High_Priority", "stages.sft.resources.priority_class", "not a valid"),
    ("stages.sft.resources.queue='my queue'", "stages.sft.resources.queue", "not a valid"),
    ("cluster.image='ghcr.io/posttrain/trainer:0.1.0\ntouch /x'", "cluster.image", "is not an image reference"),
    ("stages.sft.resources.image='ghcr.io/Team/trainer'", "stages.sft.resources.image", "is not an image reference"),
    ("cluster.image_pull_secrets=[Registry_Creds]", "cluster.image_pull_secrets[0]", "not a valid"),
    ("description=" + "설명" * 50_000, "description", "over the 262144 the API server accepts"),
    ("stages.sft.training.weight_decay=.inf", "stages.sft.training.weight_decay", "finite number"),
    ("stages.sft.training.learning_rate=.nan", "stages.sft.training.learning_rate", "finite number"),
    ("stages.evaluate.gate.0.max_regression=.inf", "stages.evaluate.gate[0].max_regression", "finite number"),
    ("stages.sft.training.eval_steps=10", "stages.sft.training.eval_steps", "data.eval_fraction is 0"),
    ("stages.deploy.serving.runtime=Kserve_vLLM", "stages.deploy.serving.runtime", "not a valid"),
    ("cluster.training_runtime=Posttrain_Torch", "cluster.training_runtime", "must be a DNS-1123 label"),
    ("cluster.job_kind=mpijob", "cluster.job_kind", "'pytorchjob' or 'trainjob'"),
]


@pytest.mark.parametrize(("override", "field", "says"), LATE, ids=[o[:40] for o, _, _ in LATE])
def test_what_the_cluster_would_refuse_later_is_refused_at_load(override: str, field: str, says: str) -> None:
    overrides = [override]
    if "eval_steps" in override:
        overrides.append("stages.sft.data.eval_fraction=0")
    message = _set_refused(*overrides)
    assert message.startswith(f"--set: {field}: ") or f": {field}: " in message, message
    assert says in message, message


def test_kv_heads_must_divide_heads_of_a_model_built_from_config() -> None:
    message = _set_refused("model.from_config={num_attention_heads: 6, num_key_value_heads: 4, head_dim: 8}")
    assert "model.from_config.num_key_value_heads: num_key_value_heads (4) must divide" in message


def test_serving_gpus_are_checked_against_the_model_built_from_config() -> None:
    """The local profile's tiny model has 4 heads and 2 key/value heads: 2 GPUs fit, 3 do not."""
    assert load_pipeline("korean-llm", "local", ["stages.deploy.serving.gpus=2"]).spec
    with pytest.raises(SpecError, match=r"serving\.gpus: .*3 does not divide the model's 4 attention heads"):
        load_pipeline("korean-llm", "local", ["stages.deploy.serving.gpus=3"])


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("Qwen/Qwen3-8B-Base", AttentionShape(32, 8)),
        ("Qwen/Qwen3-30B-A3B", AttentionShape(32, 4)),
        ("meta-llama/Meta-Llama-3-8B-Instruct", AttentionShape(32, 8)),
        ("/mnt/datasets/models/gemma-3-27b-it", AttentionShape(32, 16)),
        ("my-org/some-private-model", None),
    ],
)
def test_known_model_shapes(name: str, shape: AttentionShape | None) -> None:
    assert known_shape(name) == shape


def test_tensor_parallel_rule_is_vllms() -> None:
    qwen_moe = AttentionShape(32, 4)
    assert [n for n in range(1, 17) if tensor_parallel_problem(qwen_moe, n) is None] == [1, 2, 4, 8, 16]
    assert tensor_parallel_problem(AttentionShape(40, 8), 8) is None
    assert "key/value heads" in (tensor_parallel_problem(AttentionShape(24, 8), 6) or "")


def test_an_unknown_model_is_left_to_vllm() -> None:
    overrides = ["model.name_or_path=my-org/private-7b", "stages.deploy.serving.gpus=3"]
    assert load_pipeline("korean-llm", overrides=overrides).spec.stages.deploy.serving.gpus == 3


def test_key_value_heads_that_cannot_be_split_are_refused() -> None:
    message = _set_refused("model.name_or_path=meta-llama/Llama-3.2-3B-Instruct", "stages.deploy.serving.gpus=6")
    assert "6 and the model's 8 key/value heads do not divide one another; use one of 1, 2, 4, 8" in message


def test_a_late_error_in_a_file_names_its_line(tmp_path: Path) -> None:
    text = PIPELINE + "schedule:\n  cron:\n    - '0 2 * * 1'\n    - '61 25 32 13 8'\n"
    message = _refused(tmp_path, text)
    assert message.startswith("pipeline.yaml:13: schedule.cron[1]: cron expression '61 25 32 13 8'"), message


def test_the_shipped_pipelines_pass_every_rule() -> None:
    """Every shipped pipeline, with each of its profiles."""
    for name in known_pipelines():
        profiles = yaml.safe_load(pipeline_path(name).read_text(encoding="utf-8")).get("profiles") or {}
        for profile in (None, *profiles):
            load_pipeline(name, profile)


# --------------------------------------------------------------------------- YAML traps


def test_a_key_given_twice_is_an_error_not_the_last_one_winning(tmp_path: Path) -> None:
    text = PIPELINE + "schedule:\n  timezone: Asia/Seoul\n  timezone: UTC\n"
    message = _refused(tmp_path, text)
    assert message == "pipeline.yaml:12: not valid YAML: key 'timezone' appears twice (first on line 11); keep one"


def test_a_key_given_twice_in_an_override_is_an_error() -> None:
    message = _set_refused("stages.sft.training={learning_rate: 1.0e-4, learning_rate: 1.0}")
    assert "key 'learning_rate' appears twice" in message


LEVELS = ["a", "b", "c", "d", "e", "f", "g", "h"]
BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9 if prev else ['x'] * 9)}]\n"
    for prev, name in zip(["", *LEVELS[:-1]], LEVELS, strict=True)
)


def test_an_alias_bomb_in_a_pipeline_file_is_refused_before_it_expands(tmp_path: Path) -> None:
    assert len(BOMB) < 500
    message = _refused(tmp_path, PIPELINE + BOMB)
    assert message.startswith("pipeline.yaml: its anchors and aliases expand to ")
    assert f"more than the {MAX_EXPANDED_NODES} a pipeline spec may hold" in message


def test_an_alias_bomb_in_the_form_is_refused(tmp_path: Path) -> None:
    bomb = "stages.sft.training=" + "{" + BOMB.replace("\n", ", ").rstrip(", ") + "}"
    with pytest.raises(SpecError, match="anchors and aliases expand to"):
        spec_form.resolve_params_dir(_params_dir(tmp_path, {spec_form.OVERRIDES: bomb}))


def test_an_alias_that_contains_itself_is_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, PIPELINE + "loop: &loop [*loop]\n")
    assert "an alias refers to the value that contains it" in message


@pytest.mark.parametrize("version", ["2026-11-24", "2026", "2026.11", "1e3", "on"])
def test_set_takes_a_text_field_as_text(version: str) -> None:
    """`--set data_version=2026-11-24` is the text the form would send, not a date."""
    assert load_pipeline("korean-llm", overrides=[f"data_version={version}"]).spec.data_version == version


def test_a_date_in_a_pipeline_file_is_text(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.replace("data_version: v1", "data_version: 2026-11-24"), encoding="utf-8")
    assert load_pipeline(str(path)).spec.data_version == "2026-11-24"


def test_the_form_takes_dates_as_text_too(tmp_path: Path) -> None:
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {spec_form.OVERRIDES: "model.revision=2026-11-24"}))
    assert spec.model.revision == "2026-11-24"
    (tmp_path / "2").mkdir()
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path / "2", {"data-version": "2026-11-24"}))
    assert spec.data_version == "2026-11-24"


# --------------------------------------------------------------------------- credentials in the spec

CREDENTIALS = [
    ("tracking.mlflow_tracking_uri=https://alice:s3cret@mlflow.example.com", "mlflow_tracking_uri", "mlflow_password"),
    ("stages.sft.data.uri=s3://AKIAFAKEFAKEFAKE1234:x@bucket/sft.jsonl", "stages.sft.data.uri", "aws_access_key_id"),
    ("cluster.env={DATABASE_URL: 'postgresql://mlflow:pw@db:5432/mlflow'}", "cluster.env.DATABASE_URL", "URI"),
    ("stages.sft.env={NOTE: 'token hf_FAKEtokenZ9q8w7e6r5t4y3u2i1o0'}", "stages.sft.env.NOTE", "Hugging Face"),
    ("description='ping https://hooks.slack.com/services/T0/B0/xyz'", "description", "Slack webhook"),
    ("stages.evaluate.prompts=['Authorization: Bearer eyJhbGciOi.eyJzdWIiOi.c2lnbmF0dXJl']", "prompts[0]", "token"),
]


@pytest.mark.parametrize(("override", "field", "kind"), CREDENTIALS, ids=[c[1] for c in CREDENTIALS])
def test_a_credential_anywhere_in_the_spec_is_refused(override: str, field: str, kind: str) -> None:
    message = _set_refused(override)
    assert f"{field}: holds " in message and kind in message, message
    assert "put them in a Kubernetes Secret and reference it from cluster.secrets" in message
    secret = re.search(r"(s3cret|AKIA\w+|:pw@|hf_\w+|xyz|eyJ\w+)", override)
    assert secret is not None
    assert secret.group(1) not in message  # the refusal itself never repeats the credential


@pytest.mark.parametrize(
    ("name", "value"),
    [("WANDB_KEY", "abcdef123456"), ("aws_access_key_id", "AKIA..."), ("MyServiceToken", "x" * 10)],
)
def test_secret_looking_env_names_are_refused_in_any_casing(name: str, value: str) -> None:
    message = _set_refused(f"cluster.env={{{name}: '{value}'}}")
    assert f"{name} looks like a secret" in message


def test_ordinary_env_names_are_not_secrets() -> None:
    spec = load_pipeline(
        "korean-llm",
        overrides=[
            "cluster.env={TOKENIZERS_PARALLELISM: 'false', NCCL_DEBUG: WARN}",
            "stages.sft.env={GOOGLE_APPLICATION_CREDENTIALS: /var/run/secrets/gcp/key.json}",
        ],
    ).spec
    assert spec.cluster.env["TOKENIZERS_PARALLELISM"] == "false"
    assert spec.stages.sft.env["GOOGLE_APPLICATION_CREDENTIALS"].startswith("/var/run")


# --------------------------------------------------------------------------- lm-eval task names


def test_an_unknown_lm_eval_task_is_refused_before_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from workflows import submit

    argv = ["korean-llm", "--render", str(tmp_path / "out"), "--set", "stages.evaluate.lm_eval_tasks=[kobest_bolq]"]
    with pytest.raises(SystemExit) as exit_:
        submit.run_cli(submit.main, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "stages.evaluate.lm_eval_tasks[0]: 'kobest_bolq' is not a task of lm-eval" in err
    assert "did you mean kobest_boolq?" in err
    assert not (tmp_path / "out").exists()


def test_lm_eval_tasks_of_the_registry_and_of_the_include_path_are_known() -> None:
    from spec.lm_eval_tasks import unknown_tasks

    assert unknown_tasks(load_pipeline("korean-llm").spec) == []  # kobest_boolq, kmmlu, haerae...
    assert unknown_tasks(load_pipeline("korean-llm", "local").spec) == []  # ko_constitution_mc, a builtin folder
    typo = load_pipeline("korean-llm", "local", ["stages.evaluate.lm_eval_tasks=[ko_constitution]"]).spec
    [problem] = unknown_tasks(typo)
    assert "'ko_constitution' is not a task of lm-eval" in problem and "or in builtin:korean-lm-eval" in problem
    assert "did you mean ko_constitution_mc?" in problem


def test_an_include_path_that_cannot_be_read_here_leaves_the_check_to_prepare() -> None:
    from spec.lm_eval_tasks import unknown_tasks

    spec = load_pipeline(
        "korean-llm",
        overrides=[
            "stages.evaluate.lm_eval_include_path=/mnt/datasets/lm-eval-tasks",
            "stages.evaluate.lm_eval_tasks=[our_private_task]",
        ],
    ).spec
    assert unknown_tasks(spec) == []


def test_a_template_too_large_for_kubernetes_is_refused_at_compile() -> None:
    from workflows.compile import MAX_OBJECT_BYTES, compile_pipeline

    prompts = [f"질문 {i}: " + "한국어 문장. " * 200 for i in range(300)]
    spec = load_pipeline("korean-llm").spec
    spec.stages.evaluate.prompts = prompts
    with pytest.raises(ValueError, match=rf"over the {MAX_OBJECT_BYTES} a Kubernetes object may have"):
        compile_pipeline(spec)


def test_a_trainjob_refuses_what_only_its_runtime_can_say() -> None:
    message = _set_refused("cluster.job_kind=trainjob")  # korean-llm's cpt has one
    assert ": stages.cpt.resources.priority_class: " in message and "a TrainJob cannot set a PriorityClass" in message
    message = _set_refused(
        "cluster.job_kind=trainjob",
        "stages.cpt.resources.priority_class=null",
        "stages.cpt.resources.rdma={resource: rdma/ib, count: 1}",
    )
    assert ": stages.cpt.resources.rdma: " in message and "IPC_LOCK" in message
    # The same settings are a PyTorchJob's to carry.
    spec = load_pipeline("korean-llm", overrides=["stages.sft.resources.priority_class=training-high"]).spec
    assert spec.stages.sft.resources.priority_class == "training-high"


# --------------------------------------------------------------------------- integer bounds


def _integer_bounds(annotation: object, inherited: tuple = ()) -> Iterator[tuple[float, float]]:
    """(lowest, highest) allowed for each integer inside a field's annotation (through Optional, unions, lists,
    mappings and Annotated), from the constraints on the way to it."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        found = list(inherited)
        for item in extra:
            if isinstance(item, AfterValidator) and isinstance(item.func, IntegerRange):
                found += [Ge(item.func.low), Le(item.func.high)]
            else:
                found += getattr(item, "metadata", [item])
        yield from _integer_bounds(base, tuple(found))
        return
    if annotation is int:
        low = max([c.ge for c in inherited if isinstance(c, Ge)] + [c.gt + 1 for c in inherited if isinstance(c, Gt)],
                  default=-math.inf)  # fmt: skip
        high = min([c.le for c in inherited if isinstance(c, Le)] + [c.lt - 1 for c in inherited if isinstance(c, Lt)],
                   default=math.inf)  # fmt: skip
        yield low, high
        return
    unions = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for arg in typing.get_args(annotation):
        yield from _integer_bounds(arg, inherited if unions else ())


def _annotated(info: FieldInfo) -> object:
    """A field's annotation with its own constraints (pydantic keeps them apart)."""
    return typing.Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


INTEGER_FIELDS = [
    (model, name, bounds)
    for model in _models(PipelineSpec)
    for name, info in model.model_fields.items()
    for bounds in _integer_bounds(_annotated(info))
]

INT32_FIELDS = {
    # What the cluster reads as int32 (PyTorchJob runPolicy, Argo's ttlStrategy and CronWorkflow history limits,
    # Katib's trial counts, KServe's and Knative's replicas and scale target).
    ("RunPolicy", "backoff_limit"),
    ("RunPolicy", "ttl_seconds_after_finished"),
    ("WorkflowSpec", "ttl_seconds_after_success"),
    ("WorkflowSpec", "ttl_seconds_after_failure"),
    ("ScheduleSpec", "successful_history"),
    ("ScheduleSpec", "failed_history"),
    ("HpoSpec", "max_trials"),
    ("HpoSpec", "parallel_trials"),
    ("HpoSpec", "max_failed_trials"),
    ("ServingSpec", "min_replicas"),
    ("ServingSpec", "max_replicas"),
    ("AutoscalingSpec", "target"),
    ("Resources", "nodes"),
    ("Resources", "gpus_per_node"),
    ("ClusterSpec", "metrics_port"),
}


def test_every_integer_field_is_bounded_within_64_bits() -> None:
    assert len(INTEGER_FIELDS) > 50  # the walk reaches the nested models and the integers inside lists and unions
    unbounded = [
        f"{model.__name__}.{name}: {low}..{high}"
        for model, name, (low, high) in INTEGER_FIELDS
        if not -(2**63) <= low <= high <= 2**63 - 1
    ]
    assert unbounded == []
    fields = {(model.__name__, name): high for model, name, (_, high) in INTEGER_FIELDS}
    assert set(fields) >= INT32_FIELDS
    assert [f for f in INT32_FIELDS if fields[f] > 2**31 - 1] == []


@pytest.mark.parametrize("field", sorted({(m.__name__, n) for m, n, _ in INTEGER_FIELDS}), ids=".".join)
def test_each_integer_field_refuses_a_value_beyond_its_bound(field: tuple[str, str]) -> None:
    model = next(m for m in _models(PipelineSpec) if m.__name__ == field[0])
    info = model.model_fields[field[1]]
    adapter = TypeAdapter(_annotated(info))
    origin = typing.get_origin(info.annotation)
    for value in (2**63, -(2**63) - 1):
        wrapped = [value] if origin is list else {"k": value} if origin is dict else value
        try:
            accepted = adapter.validate_python(wrapped)
        except ValidationError:
            continue
        # A field that also takes floats reads it as one (extra_args); the spec's own check refuses the integer.
        assert out_of_int64(accepted) is None, f"{field} kept {value}"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("stages.sft.run_policy.active_deadline_seconds=100000000000000000000", "64-bit"),
        ("stages.sft.run_policy.active_deadline_seconds=400000000", "outside 0..315360000, at most ten years"),
        ("stages.deploy.serving.max_replicas=2147483648", "outside -2147483648..2147483647, the range of an int32"),
        ("stages.sft.run_policy.backoff_limit=2147483648", "outside -2147483648..2147483647, the range of an int32"),
        ("stages.sft.resources.nodes=513", "less than or equal to 512"),  # a field's own bound stays the tighter
        ("stages.sft.run_policy.termination_grace_period_seconds=5", "greater than or equal to 30"),
        ("stages.sft.distributed.deepspeed_config={train_batch_size: 100000000000000000000}", "64-bit"),
        ("stages.sft.training.extra_args={warmup_steps: -100000000000000000000}", "64-bit"),
    ],
)
def test_integers_beyond_what_the_cluster_reads_are_refused_at_load(override: str, says: str) -> None:
    with pytest.raises(SpecError) as exc:
        load_pipeline("llama3-dolly", overrides=[override])
    path = override.split("=")[0]
    assert f"--set: {path}" in str(exc.value) and says in str(exc.value)
    assert "\n" not in str(exc.value)
