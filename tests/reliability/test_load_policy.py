"""Models load from safetensors only, and model code from the hub runs only when the spec sets
`model.trust_remote_code` for that model.

The source scan fails when a `from_pretrained` call of a model class lacks `use_safetensors=True`, when any
`trust_remote_code=` is not the spec's `<model spec>.trust_remote_code`, or when `torch.load` may unpickle.
The behavioural checks load through stages.modeling as the stages do."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from spec.loading import load_pipeline
from stages.modeling import load_pretrained

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*REPO.glob("stages/*.py"), *REPO.glob("workflows/*.py")])
MODEL_LOADERS = ("AutoModel", "ForCausalLM", "PreTrainedModel", "AutoModelFor")
"""A `<name>.from_pretrained` call loads model weights when <name> contains one of these."""
OWNERSHIP_TABLES = {"TRAINER_ARGS_OWNED"}
"""Module-level tables that name trainer arguments (key) and the spec field that owns each (a text value): they are
never passed to a loader, so their `trust_remote_code` entry is documentation, not a setting."""


def _table_dicts(tree: ast.AST) -> set[int]:
    """ids of the dict literals assigned to an OWNERSHIP_TABLES name whose values are all text."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = any(isinstance(t, ast.Name) and t.id in OWNERSHIP_TABLES for t in targets)
            texts = all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.value.values)
            if named and texts:
                found.add(id(node.value))
    return found


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Call)]


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{node.lineno}"


def load_policy_violations(paths: list[Path]) -> list[str]:
    """Every model load without use_safetensors=True, every trust_remote_code not from the spec, every torch.load
    without weights_only=True."""
    problems = []
    for path in paths:
        for call in _calls(path):
            func = call.func
            if not isinstance(func, ast.Attribute):
                continue
            owner = ast.unparse(func.value)
            if func.attr == "from_pretrained" and any(m in owner for m in MODEL_LOADERS):
                value = _keyword(call, "use_safetensors")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{_where(path, call)}: {owner}.from_pretrained without use_safetensors=True")
            if func.attr == "load" and owner == "torch":
                value = _keyword(call, "weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{_where(path, call)}: torch.load without weights_only=True")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tables = _table_dicts(tree)
        for node in ast.walk(tree):
            value = None
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                value = node.value
            elif isinstance(node, ast.Dict) and id(node) not in tables:
                keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
                value = node.values[keys.index("trust_remote_code")] if "trust_remote_code" in keys else None
            if value is not None:
                from_spec = isinstance(value, ast.Attribute) and value.attr == "trust_remote_code"
                if not from_spec:
                    problems.append(f"{_where(path, value)}: trust_remote_code={ast.unparse(value)}, not from the spec")
    return problems


def test_every_model_load_is_safetensors_only_and_remote_code_comes_from_the_spec() -> None:
    assert any("from_pretrained" in p.read_text() for p in SOURCES)  # the scan looks at the loading code
    assert load_policy_violations(SOURCES) == []


def test_the_scan_catches_each_kind_of_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "AutoModelForCausalLM.from_pretrained(p)\n"
        "AutoTokenizer.from_pretrained(p, trust_remote_code=True)\n"
        "config = {'trust_remote_code': flag}\n"
        "torch.load(f)\n"
        "AutoModelForCausalLM.from_pretrained(p, use_safetensors=True, trust_remote_code=m.trust_remote_code)\n"
        "TRAINER_ARGS_OWNED = {'trust_remote_code': 'model.trust_remote_code'}\n"  # a table of owners: allowed
        "OTHER = {'trust_remote_code': 'yes'}\n"
        "TRAINER_ARGS_OWNED = {'trust_remote_code': True}\n"
    )
    problems = load_policy_violations([bad])
    assert sorted(p.split(": ", 1)[1] for p in problems) == [
        "AutoModelForCausalLM.from_pretrained without use_safetensors=True",
        "torch.load without weights_only=True",
        "trust_remote_code='yes', not from the spec",
        "trust_remote_code=True, not from the spec",
        "trust_remote_code=True, not from the spec",
        "trust_remote_code=flag, not from the spec",
    ]


def _tiny_model_dir(tmp_path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model_dir = tmp_path / "model"
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def test_pickled_weights_are_not_loaded(tmp_path: Path) -> None:
    model_dir = _tiny_model_dir(tmp_path)
    spec = load_pipeline("korean-llm", "local").spec
    assert load_pretrained(model_dir, spec.model) is not None  # safetensors: fine
    weights = model_dir / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), model_dir / "pytorch_model.bin")  # the same weights, as a pickle only
    weights.unlink()
    with pytest.raises(OSError, match=r"safetensors|model\.safetensors"):
        load_pretrained(model_dir, spec.model)


def test_remote_code_needs_the_spec_to_allow_it(tmp_path: Path) -> None:
    model_dir = _tiny_model_dir(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "evil"  # not a model transformers knows: only the repository's own code could load it
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('code ran')\n")
    spec = load_pipeline("korean-llm", "local").spec
    assert spec.model.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_pretrained(model_dir, spec.model)
    assert not (tmp_path / "ran").exists()


def test_adapters_load_only_through_the_safetensors_check() -> None:
    """Every `PeftModel.from_pretrained` call sits in stages.modeling.load_adapter, which checks the file first."""
    callers = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                if ast.unparse(call.func) == "PeftModel.from_pretrained":
                    callers.append(f"{path.name}:{function.name}")
    assert callers == ["modeling.py:load_adapter"]


def test_pickled_adapters_are_not_loaded(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.modeling import NotSupportedHere, load_adapter

    model_dir = _tiny_model_dir(tmp_path)
    adapter_dir = tmp_path / "adapter"
    lora = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True), lora).save_pretrained(
        adapter_dir
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
    assert load_adapter(base, adapter_dir) is not None  # safetensors: fine
    weights = adapter_dir / "adapter_model.safetensors"
    torch.save(load_file(weights), adapter_dir / "adapter_model.bin")  # the same adapter, as a pickle only
    weights.unlink()
    base = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
    with pytest.raises(NotSupportedHere, match=r"no adapter_model\.safetensors \(found: .*adapter_model\.bin\)"):
        load_adapter(base, adapter_dir)
