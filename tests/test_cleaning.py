"""Data cleaning (stages/cleaning.py) on real Korean text: NFC, exact and near duplicates, filters, decontamination,
the lm-eval evaluation texts, and the `data.cleaning` spec section.

The Korean text is read at test time from the installed konlpy package (the constitution and National Assembly
bills, through stages.builtin_data, which finds them without importing konlpy); none of it is in the repository.
"""

from __future__ import annotations

import pickle
import random
import re
import unicodedata
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from spec.data import CleaningSpec
from spec.document import SpecError
from spec.lm_eval_tasks import LM_EVAL_TASKS
from spec.loading import load_pipeline
from stages.builtin_data import constitution, ko_constitution_mc, write_lm_eval_tasks
from stages.cleaning import (
    DROP_REASONS,
    HANGUL_RANGES,
    SHINGLE_CHARS,
    CheckedRow,
    CleaningCounts,
    Contamination,
    Deduplication,
    NearDuplicates,
    SeenKeys,
    _Words,
    check_row,
    filter_reason,
    hangul_letters,
    lm_eval_texts,
    minhash,
    nfc_row,
    ngram_keys,
    normalized_key,
    row_text,
)

pytestmark = pytest.mark.skipif(find_spec("konlpy") is None, reason="the Korean test text comes from konlpy")


def _articles(min_words: int) -> list[str]:
    """Constitution articles of at least `min_words` words, in order."""
    return [a.text for a in constitution().articles if len(a.text.split()) >= min_words]


def _shingles(text: str) -> set[str]:
    """The module's shingles, computed the slow and obvious way: SHINGLE_CHARS-character runs of the word
    characters of the text, casefolded."""
    chars = "".join(re.findall(r"\w", unicodedata.normalize("NFC", text).casefold()))
    return {chars[i : i + SHINGLE_CHARS] for i in range(max(1, len(chars) - SHINGLE_CHARS + 1))}


def _jaccard(a: str, b: str) -> float:
    x, y = _shingles(a), _shingles(b)
    return len(x & y) / len(x | y)


def _replace_words(text: str, count: int, seed: int) -> str:
    """`text` with `count` of its words replaced by other Korean words."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(1, len(words)), count):
        words[i] = rng.choice(["그리고", "또한", "해당", "모든", "이에"])
    return " ".join(words)


def _clean(rows: list[dict], cleaning: CleaningSpec, contamination: Contamination | None = None) -> CleaningCounts:
    """Rows through the worker checks and the parent's deduplication, as the prepare stage runs them."""
    counts = CleaningCounts()
    dedup = Deduplication(cleaning)
    for i, row in enumerate(rows):
        checked = pickle.loads(pickle.dumps(check_row(row, cleaning, contamination)))  # it crosses processes
        counts.record(dedup.reason(checked, f"train.jsonl:{i + 1}"), checked.pii)
    return counts


# --------------------------------------------------------------------------- NFC and exact duplicates


def test_nfd_korean_becomes_nfc_in_every_string_of_every_row_form() -> None:
    nfd = unicodedata.normalize("NFD", "한국어 문서")
    assert len(nfd) == 14 and nfd != "한국어 문서"  # 5 syllables as 13 jamo, and the space
    assert nfc_row({"text": nfd}) == {"text": "한국어 문서"}
    chat = {"messages": [{"role": "user", "content": nfd}, {"role": "assistant", "content": "네"}]}
    composed = {"messages": [{"role": "user", "content": "한국어 문서"}, {"role": "assistant", "content": "네"}]}
    assert nfc_row(chat) == composed
    turn = [{"role": "assistant", "content": nfd}]
    preference = {"prompt": [{"role": "user", "content": nfd}], "chosen": turn, "rejected": turn}
    assert all(m["content"] == "한국어 문서" for part in nfc_row(preference).values() for m in part)
    article = _articles(40)[0]
    assert nfc_row({"text": unicodedata.normalize("NFD", article)}) == {"text": article}


def test_a_duplicate_differing_only_in_normalization_case_or_whitespace_is_exact() -> None:
    article = "대한민국헌법 Article 1: " + constitution().articles[0].text
    variants = [
        unicodedata.normalize("NFD", article),
        article.upper(),
        "  " + article.replace(" ", " \n\t ") + "\n",
    ]
    key = normalized_key(article)
    assert len(key) == 16
    assert [normalized_key(v) for v in variants] == [key] * 3
    assert normalized_key(article.replace(".", "")) != key  # punctuation counts
    assert normalized_key(article.replace(" ", "", 1)) != key  # so does a missing space

    counts = _clean([{"text": t} for t in [article, *variants, "다른 문서"]], CleaningSpec())
    dropped = {**dict.fromkeys(DROP_REASONS, 0), "duplicate": 3}
    assert counts.as_dict() == {"read": 5, "kept": 2, "dropped": dropped, "pii": {}}


def test_row_text_of_each_form_and_preference_duplicates_ignore_the_rejected_answer() -> None:
    assert row_text({"text": "본문"}) == "본문"
    system = {"role": "system", "content": "시스템"}
    chat = {"messages": [system, {"role": "user", "content": "질문"}, {"role": "assistant", "content": "답"}]}
    assert row_text(chat) == "시스템\n질문\n답"
    prompt, chosen = [{"role": "user", "content": "질문"}], [{"role": "assistant", "content": "좋은 답"}]
    rows = [
        {"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": rejected}]}
        for rejected in ("나쁜 답", "다른 나쁜 답")
    ]
    assert row_text(rows[0]) == "질문\n좋은 답"
    assert _clean(rows, CleaningSpec()).duplicate == 1
    with pytest.raises(ValueError, match="not a canonical row"):
        row_text({"instruction": "x"})


@pytest.mark.parametrize("merge_min", [SeenKeys.MERGE_MIN, 1000])
def test_seen_keys_count_exactly_across_merges(merge_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SeenKeys, "MERGE_MIN", merge_min)
    rng = random.Random(0)
    seen, fresh, added = SeenKeys(), [], []
    for i in range(200_000):
        if i % 5 == 4:  # every fifth key repeats one from anywhere before: in the sorted array or still pending
            key = rng.choice(fresh)
        else:
            key = normalized_key(f"문서 {i}")
            fresh.append(key)
        added.append(seen.add(key))
    assert sum(added) == 160_000 and len(seen) == 160_000
    assert all(key in seen for key in fresh)
    assert normalized_key("문서 4") not in seen  # i == 4 was a repeat, never a fresh key
    assert len(seen._pending) < max(merge_min, len(seen._sorted) >> 4)  # merged along the way
    assert np.all(np.diff(seen._sorted) > 0)


# --------------------------------------------------------------------------- near duplicates


def test_minhash_signatures_are_datasketchs_for_the_same_shingles() -> None:
    from datasketch import MinHash

    text = _articles(60)[0]
    cleaning = CleaningSpec(near_dedup_threshold=0.8, near_dedup_num_perm=64)
    reference = MinHash(num_perm=64, seed=1, hashfunc=lambda h: h)
    reference.update_batch([int(h) for h in _Words.of(text).shingle_hashes()])
    assert np.array_equal(minhash(text, cleaning), reference.hashvalues)
    assert minhash(text, CleaningSpec()) is None  # no threshold, no signature
    assert len(_Words.of(text).shingle_hashes()) == len(_shingles(text))


def test_korean_paragraphs_differing_by_a_few_words_are_near_duplicates_distinct_ones_are_not() -> None:
    paragraphs = _articles(60)  # 11 articles of 60 to 180 words
    variants = [_replace_words(p, 2, seed=i) for i, p in enumerate(paragraphs)]
    respaced = [p.replace(" ", "", 5) for p in paragraphs[:4]]  # 띄어쓰기 differs: not exact, but near
    # Guards on the data itself, measured without the module: distinct articles share little (at most 0.05),
    # variants most (0.89 to 0.96); 128 permutations estimate a similarity within about 0.03 (one sigma).
    assert len(paragraphs) == 11
    assert max(_jaccard(a, b) for i, a in enumerate(paragraphs) for b in paragraphs[i + 1 :]) < 0.1
    assert min(_jaccard(p, v) for p, v in zip(paragraphs, variants, strict=True)) > 0.88

    cleaning = CleaningSpec(near_dedup_threshold=0.8)
    counts = _clean([{"text": t} for t in paragraphs + variants + respaced], cleaning)
    assert (counts.kept, counts.near_duplicate, counts.duplicate) == (11, 15, 0)

    near = NearDuplicates(0.8)
    signatures = [minhash(t, cleaning) for t in (paragraphs[0], variants[0])]
    estimate = np.count_nonzero(signatures[0] == signatures[1]) / 128
    assert abs(estimate - _jaccard(paragraphs[0], variants[0])) < 0.1
    assert not near.near_duplicate("a", signatures[0])
    assert near.near_duplicate("b", signatures[1]) and len(near) == 1
    with pytest.raises(ValueError, match="given before"):
        near.near_duplicate("a", signatures[1])


def test_a_threshold_above_the_similarity_keeps_the_row() -> None:
    paragraph = _articles(60)[0]
    variant = _replace_words(paragraph, 20, seed=1)
    assert 0.5 < _jaccard(paragraph, variant) < 0.75
    assert _clean([{"text": paragraph}, {"text": variant}], CleaningSpec(near_dedup_threshold=0.9)).kept == 2


# --------------------------------------------------------------------------- filters


def test_length_filters_count_characters_after_nfc() -> None:
    cleaning = CleaningSpec(min_chars=5, max_chars=10)
    assert filter_reason("한국어문", cleaning) == "too_short"
    assert filter_reason("한국어문서", cleaning) is None
    assert filter_reason(unicodedata.normalize("NFD", "한국어문서"), cleaning) is None  # 13 jamo, 5 syllables
    assert filter_reason("가" * 10, cleaning) is None
    assert filter_reason("가" * 11, cleaning) == "too_long"
    assert filter_reason(unicodedata.normalize("NFD", "가" * 10), CleaningSpec(max_chars=10)) is None


def test_hangul_ratio_counts_letters_only() -> None:
    assert hangul_letters("This is an English sentence.") == (0, 23)
    assert hangul_letters("한국어 text 123 ①!") == (3, 7)  # digits, ①, punctuation and spaces are not letters
    assert hangul_letters("ㅋㅋㅋ ᄒᆞᆫ") == (6, 6)  # compatibility jamo and old-Hangul jamo are Hangul
    assert hangul_letters("대한민국 大韓民國") == (4, 8)  # Hanja are letters, not Hangul
    assert hangul_letters("😀 𝐀") == (0, 1)  # beyond the BMP: the emoji is no letter, the bold A is

    half = CleaningSpec(min_hangul_ratio=0.5)
    assert filter_reason("This is an English sentence.", half) == "low_hangul"
    assert filter_reason("한국어 text 123 ①!", half) == "low_hangul"  # 3/7
    assert filter_reason("한국어 text 123 ①!", CleaningSpec(min_hangul_ratio=3 / 7)) is None  # the ratio reached
    assert filter_reason("한국어abcdefg", CleaningSpec(min_hangul_ratio=0.3)) is None  # 3/10 is 0.3 exactly
    assert filter_reason("한국어abcdefg", CleaningSpec(min_hangul_ratio=0.31)) == "low_hangul"
    assert filter_reason("123 !!! ①", half) == "low_hangul"  # no letters: ratio 0 when the check is on
    assert filter_reason("123 !!! ①", CleaningSpec()) is None  # and no check at 0
    article = _articles(40)[0]
    hangul, letters = hangul_letters(article)
    assert hangul == letters == len(re.findall(r"[가-힣]", article))


def test_the_hangul_ranges_are_exactly_the_letters_unicode_names_hangul() -> None:
    in_ranges = {chr(c) for lo, hi in HANGUL_RANGES for c in range(lo, hi + 1)}
    named = {chr(c) for c in range(0x110000) if chr(c).isalpha() and "HANGUL" in unicodedata.name(chr(c), "")}
    assert in_ranges == named and len(named) == 11_675
    assert hangul_letters("".join(sorted(named))) == (11_675, 11_675)


# --------------------------------------------------------------------------- decontamination


def test_decontamination_by_equality_and_by_a_13_word_span() -> None:
    evaluation = _articles(30)[0]  # at least 30 words
    words = re.findall(r"\w+", evaluation)  # the words decontamination sees: '목적·조직과' is two
    other = re.findall(r"\w+", _articles(30)[1])
    contamination = Contamination([evaluation, "국민의 권리와 의무"], 13)

    assert contamination.contains(evaluation)
    assert contamination.contains(unicodedata.normalize("NFD", evaluation.upper().replace(".", " . ")))
    assert contamination.contains(" ".join(other[:10] + words[5:18] + other[10:20]))  # a 13-word span inside
    assert not contamination.contains(" ".join(other[:10] + words[5:17] + other[10:20]))  # only 12 words shared
    assert contamination.contains("국민의 권리와 의무!")  # a short evaluation text: equality only
    assert not contamination.contains("국민의 권리와 의무를 정한다")
    assert not contamination.contains("")

    counts = _clean([{"text": evaluation}, {"text": " ".join(other)}], CleaningSpec(), contamination)
    assert (counts.contaminated, counts.kept) == (1, 1)
    assert _clean([{"text": evaluation}], CleaningSpec(decontaminate=False), contamination).kept == 1


def test_ngram_keys_and_a_contamination_that_pickles_as_its_hashes() -> None:
    text = " ".join(f"단어{i}" for i in range(20))
    keys = ngram_keys(text, 13)
    assert keys.dtype == np.uint64 and len(keys) == 8 and len(set(keys.tolist())) == 8
    assert np.array_equal(ngram_keys(text.replace(" ", ", "), 13), keys)  # punctuation is not a word
    assert np.array_equal(ngram_keys(f"앞 {text} 뒤", 13)[1:-1], keys)  # an n-gram hashes alike anywhere
    assert len(ngram_keys(" ".join(text.split()[:12]), 13)) == 0

    contamination = Contamination(_articles(30), 13)
    size = len(pickle.dumps(contamination))
    assert 8 * len(contamination) < size < 8 * len(contamination) + 1000
    assert pickle.loads(pickle.dumps(contamination)).contains(_articles(30)[3])


def test_lm_eval_texts_of_the_builtin_task_folder_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    counts, _ = write_lm_eval_tasks(LM_EVAL_TASKS, tmp_path / "tasks")
    texts, failed = lm_eval_texts(["ko_constitution_mc", "no_such_task"], str(tmp_path / "tasks"))
    assert failed == ["no_such_task"]
    rows = ko_constitution_mc()
    assert counts == {"ko_constitution_mc": len(rows)}
    # Per question: the question followed by its answer, and each of the four choices alone.
    assert len(texts) == len(rows) * 5
    first = rows[0]
    assert texts[:5] == [f"{first['context']} {first['choices'][first['answer']]}", *first["choices"]]

    contamination = Contamination(texts, 13)
    assert contamination.contains(texts[0]) and not contamination.contains(_articles(30)[0])


def test_a_task_whose_data_cannot_be_read_is_reported(tmp_path: Path) -> None:
    write_lm_eval_tasks(LM_EVAL_TASKS, tmp_path)
    (tmp_path / "ko_constitution_mc.jsonl").unlink()  # as a hub dataset offline: the task is known, its data not
    assert lm_eval_texts(["ko_constitution_mc"], str(tmp_path)) == ([], ["ko_constitution_mc"])


# --------------------------------------------------------------------------- everything at once


def test_every_reason_counted_once_in_check_order() -> None:
    articles = _articles(40)
    evaluation = articles[-1]
    rows = [
        {"text": "짧다"},  # too_short
        {"text": "가" * 5000},  # too_long
        {"text": "An English row, long enough to pass the length filter."},  # low_hangul
        {"text": evaluation},  # contaminated
        {"text": "short"},  # too_short and low_hangul: counted once, for the first check
        *({"text": a} for a in articles[:3]),  # kept
        {"text": unicodedata.normalize("NFD", articles[0])},  # duplicate
        {"text": f"  {articles[1]}  "},  # duplicate
        {"text": _replace_words(articles[2], 2, seed=3)},  # near_duplicate
    ]
    cleaning = CleaningSpec(min_chars=10, max_chars=4000, min_hangul_ratio=0.5, near_dedup_threshold=0.8)
    counts = _clean(rows, cleaning, Contamination([evaluation], 13))
    assert counts.as_dict() == {
        "read": 11,
        "kept": 3,
        "dropped": {
            "pii": 0,
            "too_short": 2,
            "too_long": 1,
            "low_hangul": 1,
            "contaminated": 1,
            "duplicate": 2,
            "near_duplicate": 1,
        },
        "pii": {},
    }
    total = CleaningCounts()
    total.merge(counts)
    total.merge(counts)
    assert total.read == 22 and total.read == total.kept + sum(total.as_dict()["dropped"].values())
    with pytest.raises(ValueError, match="unknown drop reason"):
        total.record("noise")


def test_check_row_keeps_the_row_as_read_when_nfc_is_off() -> None:
    nfd = unicodedata.normalize("NFD", "한국어 문서입니다")
    checked = check_row({"text": nfd}, CleaningSpec(unicode_nfc=False, min_chars=9), None)
    assert checked.row == {"text": nfd} and checked.reason is None  # 9 characters after NFC, though 22 as read
    assert checked.key == normalized_key("한국어 문서입니다")
    dropped = check_row({"text": "짧다"}, CleaningSpec(min_chars=5, near_dedup_threshold=0.8), None)
    assert isinstance(dropped, CheckedRow) and dropped.reason == "too_short"
    assert dropped.key is None and dropped.signature is None  # nothing for the parent to remember


# --------------------------------------------------------------------------- the spec section


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        ("near_dedup_threshold=1.0", "near_dedup_threshold", "less than 1"),
        ("near_dedup_threshold=0", "near_dedup_threshold", "greater than 0"),
        ("near_dedup_num_perm=8", "near_dedup_num_perm", "greater than or equal to 16"),
        ("min_hangul_ratio=1.5", "min_hangul_ratio", "less than or equal to 1"),
        ("min_chars=-1", "min_chars", "greater than or equal to 0"),
        ("{min_chars: 100, max_chars: 100}", "max_chars", "max_chars (100) must be greater than min_chars (100)"),
        ("decontamination_ngram=0", "decontamination_ngram", "greater than or equal to 3"),
        ("dedupe=true", "dedupe", "unknown field"),
    ],
)
def test_bad_cleaning_settings_are_refused_naming_the_field(override: str, field: str, says: str) -> None:
    prefix = "stages.sft.data.cleaning"
    setting = f"{prefix}={override}" if override.startswith("{") else f"{prefix}.{override}"
    with pytest.raises(SpecError) as info:
        load_pipeline("korean-llm", overrides=[setting])
    message = str(info.value)
    assert message.startswith(f"--set: {prefix}.{field}: "), message
    assert says in message, message


def test_encoding_is_one_of_the_supported() -> None:
    with pytest.raises(SpecError, match=r"stages\.sft\.data\.encoding: .*'utf-8', 'cp949' or 'euc-kr'"):
        load_pipeline("korean-llm", overrides=["stages.sft.data.encoding=latin-1"])
    spec = load_pipeline("korean-llm", overrides=["stages.sft.data.encoding=cp949"]).spec
    assert spec.stages.sft.data.encoding == "cp949"
    assert spec.stages.sft.data.cleaning == CleaningSpec()  # the defaults: NFC, dedup, decontaminate


def test_cleaning_defaults() -> None:
    cleaning = CleaningSpec()
    assert (cleaning.unicode_nfc, cleaning.dedup, cleaning.decontaminate) == (True, True, True)
    assert (cleaning.near_dedup_threshold, cleaning.min_chars, cleaning.max_chars) == (None, 0, None)
    assert (cleaning.min_hangul_ratio, cleaning.decontamination_ngram, cleaning.near_dedup_num_perm) == (0.0, 13, 128)
    assert cleaning.pii == "mask"
    with pytest.raises(ValidationError, match="max_chars"):
        CleaningSpec(min_chars=10, max_chars=5)


# --------------------------------------------------------------------------- personal data


PHONE, EMAIL = "010-2345-6789", "minji.kim@example.co.kr"


def test_personal_data_is_masked_in_every_string_of_every_row_form() -> None:
    rows = [
        {"text": f"문의는 {PHONE} 또는 {EMAIL}로 해 주세요."},
        {"messages": [{"role": "user", "content": f"{PHONE} 저장해 줘"}, {"role": "assistant", "content": "네"}]},
        {
            "prompt": [{"role": "user", "content": "연락처?"}],
            "chosen": [{"role": "assistant", "content": f"{EMAIL}입니다"}],
            "rejected": [{"role": "assistant", "content": f"{PHONE}입니다"}],  # not the checks' text, masked too
        },
    ]
    for row in rows:
        checked = check_row(row, CleaningSpec(), None)
        assert checked.reason is None and checked.pii
        assert PHONE not in str(checked.row) and EMAIL not in str(checked.row)
        assert "[전화번호]" in str(checked.row) or "[이메일]" in str(checked.row)
    assert check_row(rows[0], CleaningSpec(), None).pii == {"phone": 1, "email": 1}
    assert check_row(rows[2], CleaningSpec(), None).pii == {"email": 1, "phone": 1}


def test_pii_drop_drops_the_row_and_off_keeps_it() -> None:
    row = {"text": f"문의는 {PHONE}로 해 주세요."}
    dropped = check_row(row, CleaningSpec(pii="drop"), None)
    assert dropped.reason == "pii" and dropped.pii == {"phone": 1}
    kept = check_row(row, CleaningSpec(pii="off"), None)
    assert kept.reason is None and kept.row == row and not kept.pii
    counts = _clean([row, {"text": "개인정보가 없는 문서입니다."}], CleaningSpec(pii="drop"))
    assert counts.as_dict()["dropped"]["pii"] == 1 and counts.kept == 1 and counts.as_dict()["pii"] == {"phone": 1}


def test_masked_rows_deduplicate_as_masked() -> None:
    # Two rows differing only in the phone number are one row once masked.
    rows = [{"text": f"연락처는 {number}입니다. 감사합니다."} for number in (PHONE, "010-9876-5432")]
    counts = _clean(rows, CleaningSpec())
    assert (counts.kept, counts.duplicate, counts.pii_found) == (1, 1, {"phone": 2})
