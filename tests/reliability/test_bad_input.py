"""A corpus of malformed inputs (data files, pipeline files, `--set` overrides, UI parameters, stage invocations):
each one fails with a message that names what to fix, none with a traceback, and none leaves anything lost or
half-written. Every case runs through a real entry point in-process; a representative subset also runs the CLIs
as subprocesses (`python -m workflows.submit`, `python -m workflows.register`, `python -m stages`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_parameters import _params_dir

from run.run_dir import RunDir
from spec.form import SPEC_FILE
from spec.loading import PIPELINES_DIR, load_pipeline
from stages.__main__ import main as stages_main
from workflows import register, submit

REPO = Path(__file__).resolve().parents[2]
PIPELINE_TEXT = (PIPELINES_DIR / "korean-llm.yaml").read_text(encoding="utf-8")
TRAINING = ("cpt", "sft", "rlhf")


@dataclass(frozen=True)
class Case:
    """One malformed input: how to run it (an argv built in a scratch directory), what the message must say."""

    id: str
    tool: str  # submit, register, stages
    build: Callable[[Path], list[str]]
    says: tuple[str, ...]
    code: int = 2
    subprocess: bool = False  # also run the real CLI as a subprocess
    env: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- builders


def pipeline_file(text: str | bytes) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / "pipeline.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return [str(path)]

    return build


def edited(old: str, new: str) -> Callable[[Path], list[str]]:
    assert old in PIPELINE_TEXT
    return pipeline_file(PIPELINE_TEXT.replace(old, new, 1))


def with_set(*overrides: str, extra: tuple[str, ...] = ()) -> Callable[[Path], list[str]]:
    return lambda tmp: ["korean-llm", *extra, *(f"--set={o}" for o in overrides)]


def with_params(values: dict[str, str], damage: Callable[[Path], None] | None = None) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        params = _params_dir(tmp, values)
        if damage is not None:
            damage(params)
        return ["prepare", "--run-dir", str(tmp / "run"), "--params-dir", str(params)]

    return build


def only(stage: str) -> list[str]:
    """Overrides that leave `stage` the only training stage (and no evaluate or deploy)."""
    return [f"stages.{s}.enabled=false" for s in (*TRAINING, "evaluate", "deploy") if s != stage]


def with_run_dir(
    overrides: list[str], prepare: Callable[[Path], None] | None = None, stage: str = "cpt"
) -> Callable[[Path], list[str]]:
    """`python -m stages <stage>` in a run directory holding the spec (and whatever `prepare` adds)."""

    def build(tmp: Path) -> list[str]:
        run_dir = RunDir(tmp / "run")
        run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *overrides]).spec)
        if prepare is not None:
            prepare(run_dir.root)
        return [stage, "--run-dir", str(run_dir.root)]

    return build


def bad_data(
    stage: str, fmt: str, content: str | bytes | None, name: str = "data.jsonl"
) -> Callable[[Path], list[str]]:
    """prepare over a data file (or directory when `content` is None) for `stage`."""

    def build(tmp: Path) -> list[str]:
        path = tmp / name
        if content is None:
            path.mkdir()
            (path / "README.md").write_text("no data here")
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        uri = f"stages.{stage}.data.uri={path}"
        return with_run_dir([*only(stage), uri, f"stages.{stage}.data.format={fmt}"], stage="prepare")(tmp)

    return build


def broken_file(relative: str, text: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text, encoding="utf-8")

    return damage


def deepspeed_file(text: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        (tmp / "ds.json").write_text(text, encoding="utf-8")
        return ["korean-llm", "--set=stages.sft.distributed.strategy=deepspeed_zero3",
                f"--set=stages.sft.distributed.deepspeed_config={tmp / 'ds.json'}"]  # fmt: skip

    return build


DEEP = "[" * 20_000 + "]" * 20_000
"""A value nested 20,000 levels deep: Python's recursion limit, were a reader to recurse into it."""


def msgs(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}, ensure_ascii=False)


GOOD_TEXT = '{"text": "서울은 아름답습니다."}\n'
GOOD_CHAT = msgs(("user", "안녕?"), ("assistant", "안녕하세요.")) + "\n"
PAIR = {"prompt": "질문", "chosen": "좋은 답", "rejected": "좋은 답"}

CASES = [
    # --- pipeline files (submit --render, register)
    Case("yaml-tab", "submit", edited("description: ", "\tdescription: "), ("pipeline.yaml:", "not valid YAML")),
    Case("unknown-field", "submit", edited("name: korean-llm", "name: korean-llm\nmodle: {}"),
         ("pipeline.yaml:", "modle", "unknown field"), subprocess=True),
    Case("wrong-type", "submit", edited("learning_rate: 2.0e-5", "learning_rate: fast"),
         ("stages.cpt.training.learning_rate", "valid number")),
    Case("list-document", "submit", pipeline_file("- a\n- b\n"), ("must be a mapping",)),
    Case("not-utf8", "submit", pipeline_file(b"name: \xff\xfe\n"), ("not UTF-8",)),
    Case("deep-nesting", "submit", edited("name: korean-llm", f"name: korean-llm\nvariants: {DEEP}"),
         ("pipeline.yaml:7: values nest more than 64 levels deep",), subprocess=True),
    Case("deadline-over-int64", "submit", edited("259200   # 3 days", "100000000000000000000"),
         ("pipeline.yaml:52: stages.cpt.run_policy.active_deadline_seconds", "64-bit")),
    Case("deepspeed-deep-nesting", "submit", deepspeed_file('{"zero_optimization": {"stage": 3}, "x": ' + DEEP + "}"),
         ("stages.sft.distributed.deepspeed_config", "ds.json:1: values nest more than 64 levels deep")),
    Case("unknown-pipeline", "submit", lambda tmp: ["korean-lm"], ("unknown pipeline 'korean-lm'", "korean-llm")),
    Case("missing-file", "submit", lambda tmp: [str(tmp / "nope" / "p.yaml")], ("does not exist",)),
    Case("register-unknown-field", "register", edited("namespace: llm-training", "namespace: llm-training\n  nodes: 3"),
         ("cluster.nodes", "unknown field"), subprocess=True),
    Case("register-bad-set", "register", with_set("schedule.cron=['0 2 * *']"), ("schedule.cron", "5 fields")),
    # --- --set overrides
    Case("set-no-equals", "submit", with_set("stages.sft.training.learning_rate"),
         ("expected path.to.field=value",), subprocess=True),
    Case("set-empty-part", "submit", with_set("stages..sft=1"), ("empty part",)),
    Case("set-profiles", "submit", with_set("profiles.local.name=x"), ("profiles cannot be set", "--profile")),
    Case("set-into-a-value", "submit", with_set("model.name_or_path.x=1"), ("model.name_or_path", "not a section")),
    Case("set-negative", "submit", with_set("stages.sft.training.learning_rate=-1"),
         ("--set", "stages.sft.training.learning_rate", "greater than 0")),
    Case("set-deep-nesting", "submit", with_set(f"stages.sft.training.extra_args={DEEP}"),
         ("--set stages.sft.training.extra_args:1: values nest more than 64 levels deep",), subprocess=True),
    Case("set-replicas-over-int32", "submit", with_set("stages.deploy.serving.max_replicas=2147483648"),
         ("--set", "stages.deploy.serving.max_replicas", "the range of an int32")),
    Case("set-affinity-over-int64", "submit",
         with_set("stages.sft.resources.affinity={nodeAffinity: {preferredDuringSchedulingIgnoredDuringExecution: "
                  "[{weight: 100000000000000000000, preference: {}}]}}"),
         ("stages.sft.resources.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight",
          "64-bit")),
    Case("set-uri-scheme", "submit", with_set("stages.cpt.data.uri=ftp://host/x"), ("unsupported URI scheme 'ftp'",)),
    Case("set-data-version", "submit", with_set("data_version=v1;rm -rf /"), ("data_version may hold",)),
    Case("set-secret-env", "submit", with_set("stages.sft.env.HF_TOKEN=abc"),
         ("looks like a secret", "cluster.secrets")),
    Case("set-root-pods", "submit", with_set("cluster.run_as_user=0"), ("cluster.run_as_user", "non-root")),
    Case("set-deploy-without-evaluate", "submit", with_set("stages.evaluate.enabled=false"),
         ("stages.deploy needs stages.evaluate",)),
    Case("unknown-profile", "submit", with_set(extra=("--profile", "h100")), ("no profile 'h100'", "local")),
    Case("local-bad-set", "submit", with_set("stages.sft.training.max_steps=0", extra=("--local",)),
         ("stages.sft.training.max_steps", "greater than 0"), subprocess=True),
    # --- UI parameters (prepare --params-dir, as the pod runs it)
    Case("param-switch", "stages", with_params({"run-cpt": "yes"}), ("parameter run-cpt: expected true or false",),
         subprocess=True),
    Case("param-empty-model", "stages", with_params({"base-model": " "}), ("parameter base-model: must not be empty",)),
    Case("param-compiled-field", "stages", with_params({"overrides": "stages.sft.resources.gpus_per_node=1"}),
         ("parameter overrides, line 1", "fixed when the template is compiled")),
    Case("param-unknown-field", "stages", with_params({"overrides": "# tuned\nstages.sft.trainig.lr=1"}),
         ("parameter overrides, line 2", "stages.sft.trainig", "unknown field")),
    Case("param-deep-nesting", "stages", with_params({"overrides": f"stages.sft.training.extra_args={DEEP}"}),
         ("parameter overrides, line 1", "values nest more than 64 levels deep")),
    Case("param-ttl-over-int32", "stages",
         with_params({"overrides": "stages.sft.training.max_steps=9223372036854775808"}),
         ("parameter overrides, line 1", "stages.sft.training.max_steps", "64-bit")),
    Case("param-data-version", "stages", with_params({"data-version": "$(id)"}), ("parameter data-version",)),
    Case("param-no-spec", "stages", with_params({}, lambda p: (p / SPEC_FILE).unlink()),
         (SPEC_FILE, "is missing")),
    Case("param-corrupt-spec", "stages", with_params({}, lambda p: (p / SPEC_FILE).write_text("not base64!")),
         ("not a base64-encoded JSON spec",)),
    Case("param-not-utf8", "stages", with_params({}, lambda p: (p / "base-model").write_bytes(b"\xff\xfe")),
         ("parameter base-model: not UTF-8",)),
    # --- stage invocations
    Case("no-spec", "stages", lambda tmp: ["cpt", "--run-dir", str(tmp / "run")],
         ("spec.json is missing", "run the prepare stage first"), subprocess=True),
    Case("torn-spec", "stages", with_run_dir([], broken_file("spec.json", '{"name": "korean-llm", "mo')),
         ("spec.json:1: not valid JSON",)),
    Case("garbage-stage-json", "stages", with_run_dir([], broken_file("cpt/stage.json", '{"stage": 3}')),
         ("cpt/stage.json is not a valid stage record",)),
    Case("cpt-before-prepare", "stages", with_run_dir([]), ("prepare/tokenizer", "run the prepare stage first")),
    Case("sft-before-cpt", "stages",
         with_run_dir([], lambda root: [broken_file(f"prepare/{p}", "{}")(root)
                                        for p in ("tokenizer/tokenizer.json", "data/sft/train.jsonl")], stage="sft"),
         ("starts from the output of cpt, which has not run", "python -m stages cpt")),
    Case("params-dir-not-prepare", "stages",
         lambda tmp: ["cpt", "--run-dir", str(tmp / "run"), "--params-dir", str(tmp)], ("only for the prepare stage",)),
    Case("stage-name-path", "stages", lambda tmp: ["../../etc", "--run-dir", str(tmp / "run")], ("invalid choice",)),
    # --- data files (prepare)
    Case("data-bad-json", "stages", bad_data("cpt", "text", GOOD_TEXT + '{"text": "a",}\n'),
         ("data.jsonl:2", "not valid JSON"), code=1, subprocess=True),
    Case("data-null-text", "stages", bad_data("cpt", "text", '{"text": null}\n'),
         ("data.jsonl:1: field 'text': expected a string, got null",), code=1),
    Case("data-list-row", "stages", bad_data("cpt", "text", "[1, 2]\n"), ("expected a JSON object per row",), code=1),
    Case("data-not-utf8", "stages", bad_data("cpt", "text", b'{"text": "\xff"}\n'), ("invalid UTF-8",), code=1),
    Case("data-wrong-format", "stages", bad_data("cpt", "text", GOOD_CHAT),
         ("field 'text': missing", "is it in format 'messages'"), code=1),
    Case("data-unknown-role", "stages", bad_data("sft", "messages", msgs(("robot", "x"), ("assistant", "y")) + "\n"),
         ("field 'messages[0].role': unknown role 'robot'",), code=1),
    Case("data-no-assistant", "stages", bad_data("sft", "messages", msgs(("user", "안녕?")) + "\n"),
         ("field 'messages': no assistant turn",), code=1),
    Case("data-empty-file", "stages", bad_data("cpt", "text", ""), ("empty file",), code=1),
    Case("data-dir-without-data", "stages", bad_data("cpt", "text", None, "corpus"),
         ("the directory has no .jsonl, .json, .csv, .tsv, their .gz and .zst, .parquet or .arrow files",), code=1),
    Case("data-missing", "stages",
         with_run_dir([*only("cpt"), "stages.cpt.data.uri=/nonexistent/corpus.jsonl"], stage="prepare"),
         ("/nonexistent/corpus.jsonl: no such file or directory",), code=1),
    Case("data-not-parquet", "stages", bad_data("cpt", "text", "not parquet", "data.parquet"),
         ("not a readable Parquet file",), code=1),
    Case("data-same-pair", "stages", bad_data("rlhf", "preference", json.dumps(PAIR) + "\n"),
         ("field 'rejected': identical to 'chosen'",), code=1),
    Case("data-object-storage", "stages",
         with_run_dir([*only("cpt"), "stages.cpt.data.uri=gs://bucket/corpus.jsonl"], stage="prepare"),
         ("gs://bucket/corpus.jsonl: no usable Google credentials were found",), code=1),
    Case("data-unknown-builtin", "stages", with_run_dir([*only("cpt"), "stages.cpt.data.uri=builtin:nope"],
         stage="prepare"), ("builtin:nope",), code=1),
    Case("data-row-too-long", "stages", bad_data("cpt", "text", '{"text": "' + "가" * 40 + '"}\n'),
         ("over the limit of 50", "POSTTRAIN_MAX_ROW_BYTES"), code=1, env={"POSTTRAIN_MAX_ROW_BYTES": "50"}),
]  # fmt: skip

ENTRY_POINTS = {"submit": submit.main, "register": register.main}
MODULES = {"submit": "workflows.submit", "register": "workflows.register", "stages": "stages"}


def test_the_corpus_is_large_and_covers_every_kind_of_input() -> None:
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    prefixes = {c.id.split("-")[0] for c in CASES}
    assert {"data", "set", "param", "register"} <= prefixes
    assert {c.tool for c in CASES if c.subprocess} == set(MODULES)


def snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def check_nothing_half_written(tmp: Path, case: Case, before: dict[Path, bytes]) -> None:
    """Files that were there are unchanged (records apart); nothing temporary is left; a failed stage says why."""
    run = tmp / "run"
    assert not [p for p in tmp.rglob("*") if p.name.endswith(".tmp")]
    for path, data in before.items():
        if path.name not in ("stage.json", "tracking.json"):
            assert path.read_bytes() == data, f"{path} changed"
    if case.tool == "stages" and case.code == 1:
        stage = json.loads((run / "prepare" / "stage.json").read_text(encoding="utf-8"))
        assert stage["status"] == "failed" and case.says[0] in stage["message"]
        assert not (run / "prepare" / "tokenizer").exists()
    if case.id.startswith("param"):
        assert not (run / "spec.json").exists()
    assert not (tmp / "runs").exists()  # no run directory for a spec that does not load


def run_in_process(case: Case, argv: list[str], tmp: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        if case.tool == "stages":
            code = stages_main(argv)
        else:
            submit.run_cli(ENTRY_POINTS[case.tool], [*argv, "--render", str(tmp / "out")] if case.tool == "submit"
                           and "--local" not in argv else argv)  # fmt: skip
            code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_is_named_in_one_message(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    argv = case.build(tmp_path)
    before = snapshot(tmp_path)  # what the case laid out, which the failed command must leave as it was
    code, output = run_in_process(case, argv, tmp_path, capsys)
    assert code == case.code, output
    for fragment in case.says:
        assert fragment in output, f"{fragment!r} not in:\n{output}"
    assert "Traceback" not in output
    check_nothing_half_written(tmp_path, case, before)


def test_the_half_written_check_can_fail(tmp_path: Path) -> None:
    """Built first, then snapshotted: a command that changed or removed a file of its input would be caught."""
    case = next(c for c in CASES if c.id == "data-bad-json")
    case.build(tmp_path)
    before = snapshot(tmp_path)
    data = next(p for p in before if p.name == "data.jsonl")
    data.write_text('{"text": "rewritten"}\n', encoding="utf-8")
    with pytest.raises(AssertionError, match=r"data\.jsonl changed"):
        check_nothing_half_written(tmp_path, case, before)
    spec = next(p for p in before if p.name == "spec.json")
    spec.unlink()
    with pytest.raises(FileNotFoundError):
        check_nothing_half_written(tmp_path, case, {spec: before[spec]})


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.subprocess], ids=[c.id for c in CASES if c.subprocess])
def test_the_real_cli_says_the_same(case: Case, tmp_path: Path) -> None:
    argv = case.build(tmp_path)
    if case.tool == "submit" and "--local" not in argv:
        argv = [*argv, "--render", str(tmp_path / "out")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path), **case.env}
    proc = subprocess.run(
        [sys.executable, "-m", MODULES[case.tool], *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == case.code, proc.stdout + proc.stderr
    for fragment in case.says:
        assert fragment in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "error:" in proc.stderr + proc.stdout
