"""`python -m workflows.import`: LLaMA-Factory and axolotl recipes, in the upstream projects' own format (from
LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml and axolotl's examples/llama-3/lora-1b.yml), become
pipeline files that load; what does not map is listed; an existing output is kept without --force."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spec.loading import load_pipeline

REPO = Path(__file__).resolve().parent.parent

LLAMAFACTORY_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
deepspeed: examples/deepspeed/ds_z3_config.json
"""

LLAMAFACTORY_DPO = """\
model_name_or_path: Qwen/Qwen2.5-7B-Instruct
stage: dpo
do_train: true
finetuning_type: lora
lora_target: q_proj,v_proj
additional_target: embed_tokens,lm_head
pref_beta: 0.1
pref_loss: sigmoid  # choices: [sigmoid (dpo), orpo, simpo]
dataset: dpo_en_demo
template: qwen
cutoff_len: 2048
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine_with_min_lr
bf16: true
"""

DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "dpo_en_demo": {
        "file_name": "dpo_en_demo.json",
        "ranking": True,
        "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"},
    },
    "my_chats": {
        "file_name": "chats.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "dialog", "system": "sys"},
        "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "customer", "assistant_tag": "agent"},
    },
    # LLaMA-Factory's function-calling layout (its glaive_toolcall data): a tools column, call and answer tags
    "my_tools": {
        "file_name": "tools.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "functions"},
        "tags": {"function_tag": "call", "observation_tag": "result"},
    },
}

DATA_FILES: dict[str, list[dict[str, Any]]] = {
    "identity.json": [{"instruction": "너는 누구니?", "input": "", "output": "저는 도우미입니다."}],
    "alpaca_en_demo.json": [{"instruction": "Say hi.", "input": "", "output": "Hi."}],
    "dpo_en_demo.json": [{"instruction": "인사해 줘.", "chosen": "안녕하세요.", "rejected": "Hello."}],
    "chats.jsonl": [
        {
            "sys": "짧게 답하세요.",
            "dialog": [
                {"speaker": "customer", "text": "배송은 언제 오나요?"},
                {"speaker": "agent", "text": "내일 도착합니다."},
            ],
        }
    ],
    "tools.json": [
        {
            "functions": json.dumps([{"name": "get_weather", "parameters": {"type": "object"}}]),
            "conversations": [
                {"from": "human", "value": "서울 날씨?"},
                {"from": "call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "서울"}})},
                {"from": "result", "value": '{"temp": 3}'},
                {"from": "gpt", "value": "3도입니다."},
            ],
        }
    ],
}

DEEPSPEED_Z3 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_gather_16bit_weights_on_model_save": True},
}

AXOLOTL_LORA = """\
base_model: NousResearch/Llama-3.2-1B

load_in_8bit: false
load_in_4bit: false
strict: false

datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
dataset_prepared_path:
val_set_size: 0.1
output_dir: ./outputs/lora-out

adapter: lora
lora_model_dir:

sequence_len: 2048
sample_packing: true
eval_sample_packing: true
pad_to_sequence_len: true

lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_fan_in_fan_out:
lora_modules_to_save:
  - embed_tokens
  - lm_head
lora_target_modules:
  - gate_proj
  - down_proj
  - up_proj
  - q_proj
  - v_proj
  - k_proj
  - o_proj

wandb_project:
wandb_entity:

gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 0.0002

train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false

gradient_checkpointing: true
resume_from_checkpoint:
logging_steps: 1
flash_attention: true

warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
  pad_token: "<|end_of_text|>"
"""

AXOLOTL_CHAT = """\
base_model: Qwen/Qwen2.5-0.5B
chat_template: chatml
datasets:
  - path: ./data/chats.jsonl
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
    roles:
      user: ["human"]
      assistant: ["gpt"]
adapter: qlora
load_in_4bit: true
sequence_len: 1024
micro_batch_size: 4
num_epochs: 2
learning_rate: 0.0001
deepspeed: deepspeed_configs/zero3_bf16.json
"""


def _import(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.import", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture
def llamafactory(tmp_path: Path) -> Path:
    """A LLaMA-Factory checkout's layout: examples/, data/dataset_info.json, the recipes run from its root."""
    (tmp_path / "examples" / "train_lora").mkdir(parents=True)
    (tmp_path / "examples" / "deepspeed").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "examples" / "train_lora" / "llama3_lora_sft.yaml").write_text(LLAMAFACTORY_SFT, encoding="utf-8")
    (tmp_path / "examples" / "train_lora" / "qwen2_5_lora_dpo.yaml").write_text(LLAMAFACTORY_DPO, encoding="utf-8")
    (tmp_path / "examples" / "deepspeed" / "ds_z3_config.json").write_text(json.dumps(DEEPSPEED_Z3), encoding="utf-8")
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(DATASET_INFO), encoding="utf-8")
    for name, rows in DATA_FILES.items():  # the files dataset_info.json names, in LLaMA-Factory's own layouts
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) if name.endswith(".jsonl") else ""
        (tmp_path / "data" / name).write_text(text or json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return tmp_path


def test_llamafactory_lora_sft(llamafactory: Path) -> None:
    out = llamafactory / "pipelines" / "sft.yaml"
    out.parent.mkdir()
    proc = _import(llamafactory, "llamafactory", "examples/train_lora/llama3_lora_sft.yaml", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    spec = load_pipeline(str(out)).spec
    sft = spec.stages.sft
    assert spec.model.name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert spec.model.chat_template == "llama3" and spec.model.dtype == "bfloat16" and spec.model.trust_remote_code
    assert sft.enabled and sft.method == "lora" and sft.lora.r == 8 and sft.lora.target_modules == "all-linear"
    t = sft.training
    assert (t.learning_rate, t.epochs, t.per_device_batch_size, t.gradient_accumulation_steps) == (1e-4, 3.0, 1, 8)
    assert (t.max_seq_length, t.warmup_ratio, t.lr_scheduler, t.extra_args) == (
        2048,
        0.1,
        "cosine",
        {"ddp_timeout": 180000000},
    )
    # both datasets, as a mixture that takes every row of each (LLaMA-Factory's default mix_strategy, concat)
    assert isinstance(sft.data, list) and [d.uri for d in sft.data] == [
        str(llamafactory / "data" / "identity.json"),  # JSON arrays as they are
        str(llamafactory / "data" / "alpaca_en_demo.json"),
    ]
    assert [(d.format, d.max_samples, d.weight) for d in sft.data] == [("alpaca", 1000, None)] * 2
    assert sft.distributed.strategy == "deepspeed_zero3" and sft.distributed.deepspeed_config == DEEPSPEED_Z3
    # What did not map, with why: the tool's own options.
    assert "dataset" not in proc.stderr
    assert "convert it" not in proc.stderr and "jq" not in proc.stderr
    assert 'not mapped: output_dir: "saves/llama3-8b/lora/sft" → outputs go to the run directory' in proc.stderr
    assert "# Not mapped:" in out.read_text(encoding="utf-8")

    before = out.read_text(encoding="utf-8")
    again = _import(llamafactory, "llamafactory", "examples/train_lora/llama3_lora_sft.yaml", "-o", str(out))
    assert again.returncode == 2 and "exists; pass --force" in again.stderr
    assert out.read_text(encoding="utf-8") == before
    recipe = "examples/train_lora/llama3_lora_sft.yaml"
    forced = _import(llamafactory, "llamafactory", recipe, "-o", str(out), "--force")
    assert forced.returncode == 0, forced.stderr


def test_llamafactory_dpo_with_preference_columns(llamafactory: Path) -> None:
    out = llamafactory / "dpo.yaml"
    proc = _import(llamafactory, "llamafactory", "examples/train_lora/qwen2_5_lora_dpo.yaml", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    spec = load_pipeline(str(out)).spec
    rlhf = spec.stages.rlhf
    assert rlhf.enabled and rlhf.algorithm == "dpo" and rlhf.beta == 0.1 and not spec.stages.sft.enabled
    assert rlhf.lora.target_modules == ["q_proj", "v_proj"] and spec.model.chat_template == "qwen2_5"
    assert rlhf.lora.modules_to_save == ["embed_tokens", "lm_head"]  # additional_target
    assert rlhf.data.format == "preference" and rlhf.data.columns == {"prompt": "instruction"}
    assert 'lr_scheduler_type: "cosine_with_min_lr" → the spec\'s schedules are' in proc.stderr
    assert 'pref_loss: "sigmoid" → no pipeline field for it' in proc.stderr


def test_llamafactory_sharegpt_columns_and_tags_map_to_columns_and_roles(llamafactory: Path) -> None:
    recipe = llamafactory / "chats.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen3-8B\nstage: sft\nfinetuning_type: full\ndataset: my_chats\n")
    proc = _import(llamafactory, "llamafactory", str(recipe))  # no -o: the pipeline on stdout
    assert proc.returncode == 0, proc.stderr
    out = llamafactory / "printed.yaml"
    out.write_text(proc.stdout, encoding="utf-8")
    data = load_pipeline(str(out)).spec.stages.sft.data
    assert data.format == "sharegpt" and data.uri == str(llamafactory / "data" / "chats.jsonl")
    assert data.columns == {"conversations": "dialog", "system": "sys", "from": "speaker", "value": "text"}
    assert data.roles == {"user": "customer", "assistant": "agent"}


def test_llamafactory_tool_calls_map_to_the_tools_column_and_roles(llamafactory: Path) -> None:
    recipe = llamafactory / "tools.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen3-8B\nstage: sft\nfinetuning_type: lora\ndataset: my_tools\n")
    proc = _import(llamafactory, "llamafactory", str(recipe), "-o", str(llamafactory / "tools-pipeline.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "functions" not in proc.stderr  # nothing left unmapped
    data = load_pipeline(str(llamafactory / "tools-pipeline.yaml")).spec.stages.sft.data
    assert data.format == "sharegpt" and data.uri == str(llamafactory / "data" / "tools.json")
    assert data.columns == {"tools": "functions"}  # conversations is the format's own name
    assert data.roles == {"function_call": "call", "tool": "result"}


def test_axolotl_lora(tmp_path: Path) -> None:
    (tmp_path / "examples" / "llama-3").mkdir(parents=True)
    (tmp_path / "examples" / "llama-3" / "lora-1b.yml").write_text(AXOLOTL_LORA, encoding="utf-8")
    out = tmp_path / "lora-1b.yaml"
    proc = _import(tmp_path, "axolotl", "examples/llama-3/lora-1b.yml", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    spec = load_pipeline(str(out)).spec
    sft = spec.stages.sft
    assert spec.model.name_or_path == "NousResearch/Llama-3.2-1B" and spec.model.dtype == "bfloat16"
    assert sft.method == "lora" and (sft.lora.r, sft.lora.alpha, sft.lora.dropout) == (16, 32, 0.05)
    assert sft.lora.target_modules[:2] == ["gate_proj", "down_proj"]
    assert sft.lora.modules_to_save == ["embed_tokens", "lm_head"]
    assert sft.data.uri == "hf://datasets/teknium/GPT4-LLM-Cleaned" and sft.data.format == "alpaca"
    assert sft.data.eval_fraction == 0.1 and sft.assistant_only_loss
    t = sft.training
    assert (t.per_device_batch_size, t.gradient_accumulation_steps, t.epochs, t.max_seq_length) == (2, 2, 1, 2048)
    assert t.packing and t.gradient_checkpointing and t.extra_args == {"optim": "adamw_torch_fused"}
    assert "not mapped: warmup_steps: 10 → the spec warms up for training.warmup_ratio" in proc.stderr
    assert "lora_fan_in_fan_out" not in proc.stderr  # empty keys are unset, not reported


def test_axolotl_chat_template_qlora_and_deepspeed(tmp_path: Path) -> None:
    (tmp_path / "deepspeed_configs").mkdir()
    (tmp_path / "deepspeed_configs" / "zero3_bf16.json").write_text(json.dumps(DEEPSPEED_Z3), encoding="utf-8")
    (tmp_path / "chat.yml").write_text(AXOLOTL_CHAT, encoding="utf-8")
    out = tmp_path / "out" / "chat.yaml"
    out.parent.mkdir()
    proc = _import(tmp_path, "axolotl", "chat.yml", "-o", str(out))
    # qlora cannot be sharded with deepspeed_zero3: the pipeline would not load, so nothing is written
    assert proc.returncode == 2 and "qlora cannot be sharded with deepspeed_zero3" in proc.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []

    (tmp_path / "chat.yml").write_text(AXOLOTL_CHAT.replace("zero3_bf16", "zero2"), encoding="utf-8")
    (tmp_path / "deepspeed_configs" / "zero2.json").write_text(
        json.dumps({**DEEPSPEED_Z3, "zero_optimization": {"stage": 2}}), encoding="utf-8"
    )
    proc = _import(tmp_path, "axolotl", "chat.yml", "-o", str(out))
    # written, but its data file is not there yet: exit 3, saying so
    assert proc.returncode == 3, proc.stderr
    assert f"not runnable: stages.sft.data: {tmp_path / 'data' / 'chats.jsonl'}: no such file" in proc.stderr
    assert out.is_file()
    (tmp_path / "data").mkdir()
    row = {"conversations": [{"from": "human", "value": "안녕?"}, {"from": "gpt", "value": "안녕하세요."}]}
    (tmp_path / "data" / "chats.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    proc = _import(tmp_path, "axolotl", "chat.yml", "-o", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    spec = load_pipeline(str(out)).spec
    sft = spec.stages.sft
    assert spec.model.chat_template == "chatml" and sft.method == "qlora"
    assert sft.data.format == "messages" and sft.data.uri == str(tmp_path / "data" / "chats.jsonl")
    assert sft.data.columns == {"messages": "conversations", "role": "from", "content": "value"}
    assert sft.data.roles == {"user": "human", "assistant": "gpt"}
    assert sft.distributed.strategy == "deepspeed_zero2"

    # axolotl's tool-calling chat_template datasets: field_tools and the tool role
    tools = AXOLOTL_CHAT.replace("zero3_bf16", "zero2").replace(
        "    field_messages: conversations\n", "    field_messages: conversations\n    field_tools: functions\n"
    )
    (tmp_path / "chat.yml").write_text(
        tools.replace('      assistant: ["gpt"]', '      assistant: ["gpt"]\n      tool: ["ipython"]')
    )
    proc = _import(tmp_path, "axolotl", "chat.yml", "-o", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    sft = load_pipeline(str(out)).spec.stages.sft
    assert sft.data.columns["tools"] == "functions" and sft.data.roles["tool"] == "ipython"


def test_unsupported_recipe_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "ppo.yaml").write_text("model_name_or_path: m/m\nstage: ppo\ndataset: x/y\n", encoding="utf-8")
    proc = _import(tmp_path, "llamafactory", "ppo.yaml", "-o", str(tmp_path / "p.yaml"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "stage 'ppo' is not supported" in proc.stderr
    assert not (tmp_path / "p.yaml").exists()
    missing = _import(tmp_path, "axolotl", "nope.yml")
    assert missing.returncode == 2 and "nope.yml" in missing.stderr
