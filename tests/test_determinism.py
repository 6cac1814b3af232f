"""Same inputs, same model: what a training stage starts from is drawn from the spec's seed, not from whatever the
process's random state happens to be (a fresh interpreter, a fork of the warm-start server, a second run)."""

from __future__ import annotations

from pathlib import Path

import torch
from training_fixtures import make_run_dir

from run.run_dir import RunDir
from stages.modeling import load_starting_model, load_tokenizer


def _adapter(run_dir: RunDir, seed_before: int) -> dict[str, torch.Tensor]:
    """The new LoRA adapter sft starts from, after the process's random state was set to `seed_before`."""
    spec = run_dir.load_spec()
    torch.manual_seed(seed_before)
    model = load_starting_model(run_dir, spec, "sft", load_tokenizer(run_dir, spec.model)).model
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def test_a_new_adapter_starts_from_the_specs_seed(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "a", ["stages.cpt.enabled=false"], n_text=40, n_chat=40)
    first, second = _adapter(run_dir, 1), _adapter(run_dir, 2)
    assert first and first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    # the seed is the spec's: another training.seed starts elsewhere
    other = make_run_dir(tmp_path / "b", ["stages.cpt.enabled=false", "stages.sft.training.seed=7"], 40, 40)
    third = _adapter(other, 1)
    assert not all(torch.equal(first[name], third[name]) for name in first)
