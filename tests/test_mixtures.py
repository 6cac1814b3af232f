"""A stage's data as a list of datasets (issue 36, item 1): each with its own uri, format, columns, cleaning and
weight; rows keep their dataset of origin through the split, the token cache and the errors; prepare's record and
the report show rows, tokens and share per dataset; `--set`, the Argo form and the importers address a dataset by
its index."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_import_recipes import _import
from test_parameters import _params_dir
from test_tool_calls import agent_rows

from spec.data import DataSpec
from spec.document import SpecError
from spec.form import resolve_parameters
from spec.loading import load_pipeline
from stages.check_data import check_data
from stages.prepared_data import mix_counts, prepare_split
from workflows import parameters

REPO = Path(__file__).resolve().parents[1]

# The user's own files, as they have them: a JSON array in Korean column names, a spreadsheet export, and a data
# platform's Parquet file of tool-call conversations.
MIXTURE = """\
name: mixed-sft
model:
  name_or_path: tiny-qwen3-agent
  revision: null
  from_config: { architecture: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, vocab_size: 2048 }
stages:
  sft:
    enabled: true
    data:
      - uri: own.json
        format: alpaca
        columns: { instruction: 질문, output: 답변 }
        weight: 2
        eval_fraction: 0.1
      - { uri: extra.csv, format: alpaca, weight: 1, eval_fraction: 0.1 }
      - { uri: tools.parquet, format: messages, weight: 1, eval_fraction: 0.1 }
    training: { max_steps: 3, learning_rate: 1.0e-3, seed: 7 }
"""

PHONE = "010-2345-6789"


def write_mixture(folder: Path, own: int = 30, extra: int = 12, tools: int = 20) -> Path:
    """The three files and the pipeline that mixes them; a row of the JSON array carries a phone number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"질문": f"{i}번째 질문: 한국의 수도는 어디인가요?", "답변": f"서울입니다. ({i})"} for i in range(own)]
    rows[3]["답변"] = f"담당자 연락처는 {PHONE}입니다."
    (folder / "own.json").write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    with (folder / "extra.csv").open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["instruction", "output"])
        for i in range(extra):
            writer.writerow([f"숫자 {i}을 두 배로 하면?", f"{2 * i}입니다."])
    chats = [
        {"tools": json.dumps(r["tools"], ensure_ascii=False), "messages": r["messages"]} for r in agent_rows(tools)
    ]
    pq.write_table(pa.Table.from_pylist(chats), folder / "tools.parquet")
    (folder / "mixed.yaml").write_text(MIXTURE, encoding="utf-8")
    return folder / "mixed.yaml"


def _spec(path: Path, *overrides: str) -> Any:
    return load_pipeline(str(path), None, list(overrides)).spec


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            ("weight: 1, eval_fraction: 0.1 }\n      - { uri: tools", "eval_fraction: 0.1 }\n      - { uri: tools"),
            r"mixed\.yaml:15: stages\.sft\.data\[1\]\.weight: weights set on some datasets of the list only",
        ),
        (
            ("format: alpaca, weight: 1", "format: text, weight: 1"),
            r"mixed\.yaml:15: stages\.sft\.data\[1\]\.format: sft reads messages, alpaca or sharegpt: 'text'",
        ),
        (
            ("data:\n      - uri: own.json", "data:\n      - uri: own.json\n        formatt: x"),
            r"stages\.sft\.data\[0\]\.formatt: unknown field",
        ),
    ],
)
def test_a_list_of_datasets_is_checked_dataset_by_dataset(tmp_path: Path, edit: tuple[str, str], error: str) -> None:
    path = write_mixture(tmp_path)
    path.write_text(MIXTURE.replace(*edit), encoding="utf-8")
    with pytest.raises(SpecError, match=error):
        _spec(path)


def test_a_weight_needs_a_list_and_held_out_data_takes_none(tmp_path: Path) -> None:
    path = write_mixture(tmp_path)
    with pytest.raises(SpecError, match=r"stages\.sft\.data\.weight: weight is a dataset's share in a list"):
        _spec(path, "stages.sft.data={uri: own.json, format: alpaca, weight: 1}")
    with pytest.raises(SpecError, match=r"stages\.evaluate\.data\[0\]\.weight: held-out data is never resampled"):
        _spec(path, "stages.evaluate.data=[{uri: a.jsonl, format: text, weight: 1}, {uri: b.jsonl, format: text}]")
    with pytest.raises(SpecError, match=r"stages\.sft\.data: an empty list of datasets"):
        _spec(path, "stages.sft.data=[]")


def test_set_and_the_form_address_a_dataset_by_index(tmp_path: Path) -> None:
    path = write_mixture(tmp_path)
    spec = _spec(path, "stages.sft.data.1.uri=other.csv", "stages.sft.data.2.weight=3")
    assert [(d.uri, d.weight) for d in spec.stages.sft.data] == [
        ("own.json", 2),
        ("other.csv", 1),
        ("tools.parquet", 3),
    ]

    form = {p.name: p for p in parameters.ui_parameters(_spec(path))}
    assert "sft-data" not in form and [form[f"sft-data-{i}"].default for i in range(3)] == [
        "own.json",
        "extra.csv",
        "tools.parquet",
    ]
    assert "weight 2" in form["sft-data-0"].description
    document = parameters.embedded_document(_spec(path))
    resolved = resolve_parameters(document, {"sft-data-2": "/mnt/datasets/agent/v2.parquet"})
    assert [d.uri for d in resolved.stages.sft.data] == ["own.json", "extra.csv", "/mnt/datasets/agent/v2.parquet"]
    assert [d.weight for d in resolved.stages.sft.data] == [2, 1, 1]  # only the URI is the form's
    with pytest.raises(SpecError, match="parameter sft-data-3"):
        resolve_parameters(document, {"sft-data-3": "x.jsonl"})


# --------------------------------------------------------------------------- the weights


def test_mix_counts_keep_the_total_and_split_it_by_weight() -> None:
    assert mix_counts([29, 11, 19], [None, None, None]) == [29, 11, 19]  # no weights: every row of each
    assert mix_counts([29, 11, 19], [2.0, 1.0, 1.0]) == [29, 15, 15]  # 59 rows: 29.5, 14.75, 14.75
    assert mix_counts([100, 10], [1.0, 1.0]) == [55, 55]  # the small one repeated, the large one sampled
    counts = mix_counts([1000, 7, 333], [0.7, 0.2, 0.1])
    assert sum(counts) == 1340 and counts == [938, 268, 134]


# --------------------------------------------------------------------------- prepare


@pytest.fixture(autouse=True)
def _back_to_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path.cwd())  # _prepare changes directory; this puts it back after each test


def _prepare(tmp_path: Path, *overrides: str, seed: int = 7) -> tuple[dict[str, Any], Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    os.chdir(tmp_path)  # the pipeline's paths are relative, as a user's are: read from where the command runs
    spec = _spec(write_mixture(tmp_path), *overrides)
    out = tmp_path / "prepare" / "data" / "sft"
    counts = prepare_split(
        out,
        tmp_path / "prepare" / "quarantine" / "sft.jsonl",
        "sft",
        spec.stages.sft.data,
        spec,
        tmp_path,
        1,
        seed=seed,
    )
    return counts, out


def test_prepare_mixes_by_weight_and_keeps_each_row_s_origin(tmp_path: Path) -> None:
    counts, out = _prepare(tmp_path)
    per = counts["datasets"]
    # each dataset split on its own (a tenth held out), then the 59 training rows split 2:1:1 by weight
    assert [d["read_train_rows"] for d in per] == [29, 11, 19] and [d["eval_rows"] for d in per] == [1, 1, 1]
    assert [d["train_rows"] for d in per] == [29, 15, 15] and counts["train_rows"] == 59
    assert [round(d["share"], 3) for d in per] == [0.492, 0.254, 0.254]
    assert [d["uri"] for d in per] == ["own.json", "extra.csv", "tools.parquet"]
    assert [d["format"] for d in per] == ["alpaca", "alpaca", "messages"]
    train = (out / "train.jsonl").read_text(encoding="utf-8").splitlines()
    origins = (out / "train.origins").read_text(encoding="utf-8").splitlines()
    assert len(train) == len(origins) == 59
    # where each dataset's rows lie, and each row's origin names its dataset and the user's file and line
    assert [d["train_lines"] for d in per] == [[1, 29], [30, 44], [45, 59]]
    assert all(o.startswith("data.0 own.json:") for o in origins[:29])
    assert all(o.startswith("data.1 extra.csv:") for o in origins[29:44])
    assert all(o.startswith("data.2 tools.parquet:") for o in origins[44:])
    # the CSV's 11 training rows repeated: once whole, then 4 of them again; the Parquet file's 19 sampled to 15
    assert len(set(train[29:44])) == 11 and len(set(train[44:])) == 15
    assert all("tools" in json.loads(line) for line in train[44:])
    # held-out rows are never resampled: one of each dataset
    assert [o.split(" ")[0] for o in (out / "eval.origins").read_text(encoding="utf-8").splitlines()] == [
        "data.0",
        "data.1",
        "data.2",
    ]
    assert not (out / ".parts").exists()
    # personal data masked in every dataset before anything is written
    assert PHONE not in (out / "train.jsonl").read_text(encoding="utf-8") + (out / "eval.jsonl").read_text("utf-8")
    assert counts["cleaning"]["pii"].get("phone") == per[0]["cleaning"]["pii"].get("phone") == 1


def test_the_same_mixture_twice_is_the_same_rows_and_another_seed_samples_others(tmp_path: Path) -> None:
    first, out = _prepare(tmp_path / "a")
    again, out_again = _prepare(tmp_path / "b")
    other, out_other = _prepare(tmp_path / "c", seed=8)
    assert (out / "train.jsonl").read_bytes() == (out_again / "train.jsonl").read_bytes()
    assert first["fingerprint"] == again["fingerprint"] != other["fingerprint"]
    assert (out / "train.jsonl").read_bytes() != (out_other / "train.jsonl").read_bytes()


def test_without_weights_every_row_of_each_dataset_is_kept(tmp_path: Path) -> None:
    counts, _ = _prepare(tmp_path, *(f"stages.sft.data.{i}.weight=null" for i in range(3)))
    assert [d["train_rows"] for d in counts["datasets"]] == [29, 11, 19]


def test_a_bad_dataset_is_named_by_its_index(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"stages\.sft\.data\.1 \(extra\.csv\): .*output names column 'answer'"):
        _prepare(tmp_path, "stages.sft.data.1.columns={output: answer}")
    assert not (tmp_path / "prepare" / "data" / "sft" / "train.jsonl").exists()  # nothing half-written
    problems = check_data(_spec(tmp_path / "mixed.yaml", "stages.sft.data.1.columns={output: answer}"))
    assert len(problems) == 1 and problems[0].startswith("stages.sft.data.1 (extra.csv): ")
    assert "fix stages.sft.data.1.columns.output" in problems[0]


# --------------------------------------------------------------------------- the importers


def test_llamafactory_interleave_probs_become_weights(tmp_path: Path) -> None:
    write_mixture(tmp_path)
    (tmp_path / "data").mkdir()
    info = {
        "own": {"file_name": "../own.json", "columns": {"prompt": "질문", "response": "답변"}},
        "extra": {"file_name": "../extra.csv"},
    }
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(info, ensure_ascii=False), encoding="utf-8")
    recipe = (
        "model_name_or_path: Qwen/Qwen3-8B\nstage: sft\nfinetuning_type: lora\ndataset: own, extra\n"
        "mix_strategy: interleave_over\ninterleave_probs: 0.8,0.2\nval_size: 0.1\n"
    )
    (tmp_path / "recipe.yaml").write_text(recipe, encoding="utf-8")
    proc = _import(tmp_path, "llamafactory", "recipe.yaml", "-o", "mixed-import.yaml")
    assert proc.returncode == 0, proc.stderr
    data = load_pipeline(str(tmp_path / "mixed-import.yaml")).spec.stages.sft.data
    assert [(Path(d.uri).name, d.format, d.weight, d.eval_fraction) for d in data] == [
        ("own.json", "alpaca", 0.8, 0.1),
        ("extra.csv", "alpaca", 0.2, 0.1),
    ]
    assert data[0].columns == {"instruction": "질문", "output": "답변"}
    assert "mix_strategy" not in proc.stderr and "interleave_probs" not in proc.stderr

    # interleave_under stops at the first exhausted dataset in LLaMA-Factory: said, as what does not map exactly
    (tmp_path / "recipe.yaml").write_text(recipe.replace("interleave_over", "interleave_under"), encoding="utf-8")
    proc = _import(tmp_path, "llamafactory", "recipe.yaml", "-o", "under.yaml")
    assert proc.returncode == 0 and 'not mapped: mix_strategy: "interleave_under"' in proc.stderr

    # the probabilities as a YAML list, as LLaMA-Factory takes them too; ones that cannot be weights are listed
    (tmp_path / "recipe.yaml").write_text(recipe.replace("0.8,0.2", "[0.8, 0.2]"), encoding="utf-8")
    proc = _import(tmp_path, "llamafactory", "recipe.yaml", "-o", "listed.yaml")
    assert [d.weight for d in load_pipeline(str(tmp_path / "listed.yaml")).spec.stages.sft.data] == [0.8, 0.2]
    (tmp_path / "recipe.yaml").write_text(recipe.replace("0.8,0.2", "high,low"), encoding="utf-8")
    proc = _import(tmp_path, "llamafactory", "recipe.yaml", "-o", "words.yaml")
    assert proc.returncode == 0 and 'not mapped: interleave_probs: "high,low" → not 2 positive' in proc.stderr


def test_axolotl_datasets_become_a_list(tmp_path: Path) -> None:
    write_mixture(tmp_path)
    config = (
        "base_model: Qwen/Qwen3-8B\nadapter: lora\ndatasets:\n  - path: extra.csv\n    type: alpaca\n"
        "  - path: tools.parquet\n    type: chat_template\n    field_tools: tools\n"
        "  - path: org/agent-chats\n    type: chat_template\n    revision: 0123abc\n"
    )
    (tmp_path / "config.yml").write_text(config, encoding="utf-8")
    proc = _import(tmp_path, "axolotl", "config.yml", "-o", "from-axolotl.yaml")
    assert proc.returncode == 0, proc.stderr
    data = load_pipeline(str(tmp_path / "from-axolotl.yaml")).spec.stages.sft.data
    assert [(Path(d.uri).name, d.format, d.weight, d.revision) for d in data] == [
        ("extra.csv", "alpaca", None, None),
        ("tools.parquet", "messages", None, None),
        ("agent-chats", "messages", None, "0123abc"),  # a hub dataset, pinned at the commit the config names
    ]
    assert data[2].uri == "hf://datasets/org/agent-chats" and "datasets" not in proc.stderr


# --------------------------------------------------------------------------- the whole run


@pytest.mark.slow
def test_a_mixture_of_a_json_array_a_csv_and_parquet_tool_calls_trains_through_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workflows.submit import main as submit_main

    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):  # as test_shipped_pipelines runs the runner
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    write_mixture(tmp_path)
    run = tmp_path / "run"
    code = submit_main(["mixed.yaml", "--local", "--run-dir", str(run)])
    said = capsys.readouterr()
    assert code == 0, said.out[-4000:] + said.err[-4000:]
    assert "own.json (alpaca; instruction←질문, output←답변, weight 2) + extra.csv" in said.out  # the plan
    assert "[prepare] sft data.1: 15 train rows (25.4% of the stage's, weight 1; it has 11) + 1 eval" in said.out

    data = json.loads((run / "prepare" / "stage.json").read_text(encoding="utf-8"))["extra"]["data"]["sft"]
    per = data["datasets"]
    assert [d["train_rows"] for d in per] == [29, 15, 15]
    # tokens per dataset, as the token cache counted them: they add up to the stage's, and the tool calls (with
    # their function schemas) are most of them
    assert sum(d["train_tokens"] for d in per) == data["tokens"]["train"] > 0
    assert per[2]["token_share"] > per[0]["token_share"] > per[1]["token_share"]
    assert json.loads((run / "sft" / "stage.json").read_text(encoding="utf-8"))["status"] == "succeeded"
    report = (run / "evaluate" / "report" / "report.md").read_text(encoding="utf-8")
    assert "| sft · data.2 | tools.parquet | 16 |" in report and "25.4% of rows" in report
    # the phone number reached none of prepare's outputs
    for path in (run / "prepare").rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".json", ".origins", ".log", ".txt"):
            assert PHONE not in path.read_text(encoding="utf-8", errors="replace"), path


def test_a_mixture_pipeline_renders_a_form_argo_accepts_and_prepare_resolves(tmp_path: Path) -> None:
    from schema_validation import require_schemas, validate_argo

    from spec.form import resolve_params_dir
    from workflows.compile import compile_pipeline

    require_schemas()
    spec = _spec(write_mixture(tmp_path))
    documents = compile_pipeline(spec).documents()
    for document in documents.values():
        validate_argo(document)
    template = documents["workflowtemplate.yaml"]
    form = {p["name"]: p.get("value") for p in template["spec"]["arguments"]["parameters"]}
    assert [form[f"sft-data-{i}"] for i in range(3)] == ["own.json", "extra.csv", "tools.parquet"]
    # what Argo lays out for prepare: the raw artifacts of the prepare step, one form value changed
    params = _params_dir(tmp_path, {"sft-data-1": "/mnt/datasets/helpdesk/v2.csv"}, str(tmp_path / "mixed.yaml"))
    resolved = resolve_params_dir(params)
    assert [d.uri for d in resolved.stages.sft.data] == ["own.json", "/mnt/datasets/helpdesk/v2.csv", "tools.parquet"]


def test_the_evaluate_stage_reads_every_row_of_each_of_its_datasets(tmp_path: Path) -> None:
    spec = _spec(write_mixture(tmp_path))
    for name, n in (("a.jsonl", 5), ("b.jsonl", 3)):
        lines = [json.dumps({"text": f"{name} 평가 문장 {i}번입니다."}, ensure_ascii=False) for i in range(n)]
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = [
        DataSpec(uri=str(tmp_path / "a.jsonl"), format="text"),
        DataSpec(uri=str(tmp_path / "b.jsonl"), format="text"),
    ]
    out = tmp_path / "evaluate"
    counts = prepare_split(out, tmp_path / "quarantine.jsonl", "evaluate", data, spec, tmp_path, 1)
    assert counts["eval_rows"] == 8 and counts["train_rows"] == 0 and not (out / "train.jsonl").exists()
    assert [(d["eval_rows"], round(d["share"], 3)) for d in counts["datasets"]] == [(5, 0.625), (3, 0.375)]
    assert [line.split(" ")[0] for line in (out / "eval.origins").read_text(encoding="utf-8").splitlines()] == [
        *["data.0"] * 5,
        *["data.1"] * 3,
    ]
