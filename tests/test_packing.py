"""Packing keeps documents apart: position ids restart per document, and through the model the training
stages use, a document's logits are the same packed with others as alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_fixtures import make_run_dir

from stages.modeling import load_starting_model, load_tokenizer
from stages.packing import (
    IGNORE_INDEX,
    PackedCollator,
    build_token_cache,
    load_token_cache,
    pack_best_fit,
    pack_stream,
    split_documents,
)


def segments(position_ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of positions 0, 1, 2, ..."""
    starts = [i for i, p in enumerate(position_ids) if p == 0]
    return list(zip(starts, [*starts[1:], len(position_ids)], strict=True))


def test_stream_packing_resets_positions_and_keeps_every_token() -> None:
    docs = [list(range(100, 105)), list(range(200, 203)), list(range(300, 311))]
    rows = list(pack_stream(docs, max_seq_length=8))

    assert [len(r["input_ids"]) for r in rows] == [8, 8, 3]
    assert [t for r in rows for t in r["input_ids"]] == [t for d in docs for t in d]
    assert rows[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows[1]["position_ids"] == list(range(8))  # the long document fills the next row from position 0
    assert rows[2]["position_ids"] == [0, 1, 2]  # ... and goes on in the one after, from 0 again
    for row in rows:
        for start, end in segments(row["position_ids"]):
            assert row["labels"][start] == IGNORE_INDEX  # nothing earlier in the row predicts a segment's start
            assert row["labels"][start + 1 : end] == row["input_ids"][start + 1 : end]


def test_unpacked_documents_get_rows_of_their_own() -> None:
    rows = list(split_documents([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], max_seq_length=4))
    assert [r["input_ids"] for r in rows] == [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in rows)


def test_best_fit_packs_whole_examples_within_the_row_length() -> None:
    lengths = [7, 5, 4, 3, 3, 2, 1, 8, 6]
    examples = [([i] * n, [i] * n) for i, n in enumerate(lengths)]
    rows = pack_best_fit(examples, max_seq_length=8)

    assert all(len(r["input_ids"]) <= 8 for r in rows)
    assert len(rows) == 5  # 39 tokens in rows of 8: the fewest possible
    seen = []
    for row in rows:
        for start, end in segments(row["position_ids"]):
            ids = row["input_ids"][start:end]
            assert len(set(ids)) == 1 and len(ids) == lengths[ids[0]]  # each example whole, in one segment
            seen.append(ids[0])
    assert sorted(seen) == list(range(len(lengths)))


def test_collator_pads_as_the_last_document_running_on_without_attention_mask() -> None:
    batch = PackedCollator(pad_token_id=0)(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
            {"input_ids": [8], "labels": [-100], "position_ids": [0]},
        ]
    )
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_run_dir(tmp_path_factory.mktemp("packing") / "run", n_text=60, n_chat=60)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_document_logits_match_the_document_alone(run_dir, attn: str) -> None:
    spec = run_dir.load_spec()
    spec.model.attn_implementation = attn
    tokenizer = load_tokenizer(run_dir, spec.model)
    model = load_starting_model(run_dir, spec, "cpt", tokenizer).model  # as the cpt stage builds it
    cache = load_token_cache(run_dir, spec, "cpt")
    collate = PackedCollator(pad_token_id=tokenizer.pad_token_id)

    rows = [row for row in cache.train if len(segments(row["position_ids"])) >= 3][:2]
    assert rows, "the fixture data should pack several documents into a row"
    batch = collate(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for b, row in enumerate(rows):
            for start, end in segments(row["position_ids"]):
                alone = model(input_ids=torch.tensor([row["input_ids"][start:end]])).logits[0]
                torch.testing.assert_close(packed[b, start:end], alone, atol=1e-4, rtol=1e-4)

        # The check has teeth: with positions running on across the row, later documents see earlier ones.
        running = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
        leaky = model(input_ids=batch["input_ids"], position_ids=running).logits
        start, end = segments(rows[0]["position_ids"])[1]
        alone = model(input_ids=torch.tensor([rows[0]["input_ids"][start:end]])).logits[0]
        assert not torch.allclose(leaky[0, start:end], alone, atol=1e-3)


def test_token_cache_is_reused_and_keyed_by_its_inputs(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", n_text=60, n_chat=10)
    spec = run_dir.load_spec()
    first = build_token_cache(run_dir, spec, "cpt")
    meta = json.loads((first / "meta.json").read_text())
    assert meta["train"]["rows"] > 0 and meta["train"]["documents"] == 57
    assert build_token_cache(run_dir, spec, "cpt") == first  # unchanged inputs: the same cache

    spec.stages.cpt.training.max_seq_length = 128
    shorter = build_token_cache(run_dir, spec, "cpt")
    assert shorter != first
    assert max(len(row["input_ids"]) for row in load_token_cache(run_dir, spec, "cpt").train) == 128

    data = Path(run_dir.root / "prepare/data/cpt/train.jsonl")
    data.write_text(data.read_text() + json.dumps({"text": "새 문서입니다."}) + "\n")
    assert build_token_cache(run_dir, spec, "cpt") not in (first, shorter)  # new data: a new cache


def test_the_stages_flex_attention_reaches_the_kernel_with_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_attention` (what a packing stage on a GPU switches to) hands FLEX_KERNEL_OPTIONS to flex attention in
    every layer's call, through PEFT's wrapper around the model (which calls the model's forward directly). The
    kernel runs eagerly here (CPU); on a GPU bench/flex_shapes.py runs it compiled."""
    from peft import LoraConfig, get_peft_model
    from torch.nn.attention.flex_attention import flex_attention
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import flex_attention as hf_flex

    from stages.modeling import FLEX_KERNEL_OPTIONS, use_attention

    seen: list[object] = []

    def eager(query, key, value, training=False, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        kwargs["kernel_options"] = None  # the options are the compiled kernel's; eager flex takes none
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager)
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    use_attention(model, "flex_attention")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 128, (2, 24))
    positions = torch.tensor([[*range(10), *range(14)], [*range(24)]])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions).logits
    assert seen == [FLEX_KERNEL_OPTIONS] * 2 and torch.isfinite(logits).all()
