"""Data cleaning (`data.cleaning`): deciding, row by row, which rows of a stage's data the prepare stage keeps.

Rows arrive in their canonical forms (`stages.data`). The work is split so that the prepare stage can spread it
over processes:

- in the worker processes, pure functions of one row and the (picklable) spec: `nfc_row`, `row_text`,
  `normalized_key`, `filter_reason`, `minhash`, `Contamination.contains`, or all of them at once in `check_row`,
  whose `CheckedRow` (the row, a drop reason, its key and signature) is small and picklable;
- in the parent, in the order the rows were read, the state across rows: `SeenKeys` (exact duplicates) and
  `NearDuplicates` (near duplicates), or both at once in `Deduplication`; and the `CleaningCounts` of the stage.

A row is dropped for the first of these reasons, checked in this order (cheap checks first; a row dropped by a
worker never reaches the parent's state): pii (with cleaning.pii 'drop'), too_short, too_long, low_hangul,
contaminated (worker); duplicate, near_duplicate (parent). With cleaning.pii 'mask' (the default), the personal data
of every string is masked first (`mask_row`, stages/pii.py), and the checks see the masked row. Only kept rows are
remembered, so "duplicate" means "of a kept row".

Normalizations, each for its purpose:
- the row itself: every string NFC (Hangul jamo composed into syllables), nothing else changed;
- exact duplicates: NFC, casefolded, whitespace runs collapsed to one space, stripped (punctuation counts);
- near duplicates and decontamination: NFC, casefolded, only the word characters kept (`\\w`, so punctuation and
  whitespace do not count): words for the n-grams, and the words run together for the character shingles.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

import numpy as np

from spec.data import CleaningSpec
from stages.pii import MASKS, mask_counting

DROP_REASONS = ("pii", "too_short", "too_long", "low_hangul", "contaminated", "duplicate", "near_duplicate")
"""Why a row is dropped, in the order the checks run."""

SHINGLE_CHARS = 4
"""Characters per MinHash shingle. Measured on konlpy's kolaw/kobill paragraphs (143 of 400+ characters), as
Jaccard similarity of true shingle sets (near duplicate: median/min; distinct pairs: median):

    shingles                         5% of words replaced   spacing changed (30%)   distinct
    5-grams of chars, spaces kept    0.86 / 0.79            0.55 / 0.42             0.003
    4-grams of chars, spaces gone    0.85 / 0.75            1.00 / 1.00             0.002
    word 2-grams                     0.84 / 0.77            0.31 / 0.12             0.000

Korean spacing (띄어쓰기) varies between copies of one text (할 수 있다 / 할수있다), so the shingles skip
whitespace and punctuation; a syllable carries about two Latin letters, so 4 syllables span as much as 5-grams
over spaced text (on English docstrings both score alike: 0.89 vs 0.90 near, 0.04 distinct)."""

MINHASH_SEED = 1
"""Seed of the MinHash permutations (datasketch's default): workers and parent must agree."""

MINHASH_SCHEME = "affine32"
"""datasketch's permutation scheme the signatures follow (its default since 2.0)."""

LSH_WEIGHTS = (0.1, 0.9)
"""datasketch's weights of the LSH's false positives and false negatives when it picks bands and rows. Its
default (0.5, 0.5) finds, at threshold 0.8 and 128 permutations, 40% of the pairs at 0.8 and 69% at 0.85; these
find 87% and 97.5% (99.9% at 0.9), at 14 bands instead of 9. NearDuplicates checks every candidate's similarity,
so the extra false positives cost a comparison each, never a row."""

_MINHASH_CHUNK = 2048
"""Shingles per step of the signature computation (bounds its memory at 8 KiB per permutation)."""

HANGUL_RANGES = (
    (0x1100, 0x11FF),  # Hangul Jamo
    (0x3131, 0x318E),  # Hangul Compatibility Jamo
    (0xA960, 0xA97C),  # Hangul Jamo Extended-A
    (0xAC00, 0xD7A3),  # Hangul Syllables
    (0xD7B0, 0xD7C6),  # Hangul Jamo Extended-B
    (0xD7CB, 0xD7FB),
    (0xFFA0, 0xFFBE),  # Halfwidth Hangul
    (0xFFC2, 0xFFC7),
    (0xFFCA, 0xFFCF),
    (0xFFD2, 0xFFD7),
    (0xFFDA, 0xFFDC),
)
"""The Hangul letters, inclusive code point ranges: exactly the alphabetic characters Unicode names HANGUL."""

_LETTER, _HANGUL, _WORD = 1, 2, 4  # character flags: str.isalpha(), in HANGUL_RANGES, a regex \w (isalnum or _)

_BASE = 0x9E3779B97F4A7C15
"""Base of the polynomial hashes, modulo 2**64: odd, so it has an inverse and a span hashes alike anywhere."""


# --------------------------------------------------------------------------- per row (worker processes)


def _nfc(text: str) -> str:
    # The quick check is a fraction of normalize's cost, and most text is NFC already.
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


def _nfc_value(value: Any) -> Any:
    if isinstance(value, str):
        return _nfc(value)
    if isinstance(value, list):
        return [_nfc_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _nfc_value(v) for k, v in value.items()}
    return value


def _masked_value(value: Any, found: Counter[str]) -> Any:
    if isinstance(value, str):
        return mask_counting(value, found)
    if isinstance(value, list):
        return [_masked_value(v, found) for v in value]
    if isinstance(value, dict):
        return {k: _masked_value(v, found) for k, v in value.items()}
    return value


def mask_row(row: dict[str, Any]) -> tuple[dict[str, Any], Counter[str]]:
    """The canonical row with the personal data of every string value masked (stages/pii.py), at any depth (message
    contents, tool calls' arguments, reasoning); keys and other values unchanged. Also how many of each kind."""
    found: Counter[str] = Counter()
    return {key: _masked_value(value, found) for key, value in row.items()}, found


def nfc_row(row: dict[str, Any]) -> dict[str, Any]:
    """The canonical row with every string value NFC-normalized, at any depth; keys and other values unchanged."""
    return {key: _nfc_value(value) for key, value in row.items()}


def _contents(messages: list[dict[str, Any]]) -> list[str]:
    """Each message's content, and the tool calls it makes (rows that call differently are not duplicates)."""
    return [
        message["content"] + (json.dumps(message["tool_calls"], ensure_ascii=False) if "tool_calls" in message else "")
        for message in messages
    ]


def row_text(row: dict[str, Any]) -> str:
    """The text the checks look at: a text row's text; a chat row's message contents joined by newlines; a
    preference row's prompt and chosen contents (not the rejected answer, which the model learns to avoid)."""
    if "text" in row:
        return row["text"]
    if "messages" in row:
        return "\n".join(_contents(row["messages"]))
    if "prompt" in row and "chosen" in row:
        return "\n".join(_contents(row["prompt"]) + _contents(row["chosen"]))
    raise ValueError(f"not a canonical row (text, messages or prompt/chosen/rejected): keys {sorted(row)}")


def _key_of_folded(folded: str) -> bytes:
    normal = " ".join(folded.split())
    return hashlib.blake2b(normal.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def normalized_key(text: str) -> bytes:
    """The exact-duplicate key: a 16-byte blake2b digest of the text NFC-normalized, casefolded, with whitespace
    runs collapsed to one space and stripped (punctuation counts)."""
    return _key_of_folded(_nfc(text).casefold())


def _char_flags(character: str) -> int:
    hangul = any(lo <= ord(character) <= hi for lo, hi in HANGUL_RANGES)
    word = character.isalnum() or character == "_"
    return _LETTER * character.isalpha() | _HANGUL * hangul | _WORD * word


@cache
def _bmp_flags() -> np.ndarray:
    """The flags of every character of the Basic Multilingual Plane (64 KiB, built once per process in ~20 ms)."""
    characters = [chr(code) for code in range(0x10000)]
    letter = np.fromiter(map(str.isalpha, characters), dtype=bool, count=len(characters))
    word = np.fromiter(map(str.isalnum, characters), dtype=bool, count=len(characters))
    word[ord("_")] = True
    flags = letter * np.uint8(_LETTER) | word * np.uint8(_WORD)
    for lo, hi in HANGUL_RANGES:
        flags[lo : hi + 1] |= _HANGUL
    return flags


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _flags(codes: np.ndarray) -> np.ndarray:
    """The flags of each code point: a table lookup, in Python only for the rare ones beyond the BMP."""
    astral = codes > 0xFFFF
    if not astral.any():
        return _bmp_flags()[codes]
    flags = _bmp_flags()[np.where(astral, 0, codes)]
    for i in np.flatnonzero(astral):
        flags[i] = _char_flags(chr(codes[i]))
    return flags


def hangul_letters(text: str) -> tuple[int, int]:
    """(Hangul letters, all letters) of `text`: letters are the characters str.isalpha() accepts (Unicode
    category L: Hangul, Latin, Hanja...), so digits, punctuation, symbols such as ①, and spaces do not count;
    Hangul letters are those in HANGUL_RANGES, the syllables and the jamo in all their forms."""
    counts = np.bincount(_flags(_code_points(text)) & (_LETTER | _HANGUL), minlength=4)
    return int(counts[_LETTER | _HANGUL]), int(counts[_LETTER] + counts[_LETTER | _HANGUL])


def filter_reason(text: str, cleaning: CleaningSpec) -> str | None:
    """Why `text` (a row's `row_text`) fails the filters of `cleaning`: 'too_short' (fewer than min_chars
    characters after NFC), 'too_long' (more than max_chars), 'low_hangul' (Hangul letters / letters below
    min_hangul_ratio; a text without letters has ratio 0); None when it passes."""
    text = _nfc(text)
    if len(text) < cleaning.min_chars:
        return "too_short"
    if cleaning.max_chars is not None and len(text) > cleaning.max_chars:
        return "too_long"
    if cleaning.min_hangul_ratio > 0:
        hangul, letters = hangul_letters(text)
        # A division, not hangul < ratio * letters: 3/10 is the double 0.3, while 0.3 * 10 is not 3.
        if not letters or hangul / letters < cleaning.min_hangul_ratio:
            return "low_hangul"
    return None


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: spreads every input bit over the output (uint64 arrays wrap on purpose)."""
    h = h ^ (h >> np.uint64(33))
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, which datasketch's affine32 scheme applies to every input hash."""
    h = h ^ (h >> np.uint32(16))
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


@cache
def _power_table(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """_BASE**i and _BASE**-i modulo 2**64 for i < 2**bits."""
    powers, inverses = np.full(1 << bits, _BASE, np.uint64), np.full(1 << bits, pow(_BASE, -1, 1 << 64), np.uint64)
    powers[0] = inverses[0] = 1
    return np.cumprod(powers), np.cumprod(inverses)


def _span_hashes(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Polynomial hashes of the spans values[start:end] (uint64, mod 2**64), from one prefix sum: a span hashes
    the same wherever it is."""
    powers, inverses = _power_table(max(12, len(values).bit_length()))
    prefix = np.zeros(len(values) + 1, np.uint64)
    np.cumsum(values * powers[: len(values)], out=prefix[1:])
    return (prefix[ends] - prefix[starts]) * inverses[starts]


class _Words:
    """A text's words for near duplicates and decontamination: the code points of the text NFC-normalized and
    casefolded, the mask of its word characters (regex \\w), and the spans of the words (runs of them)."""

    def __init__(self, folded: str) -> None:
        self.codes = _code_points(folded)
        self.mask = (_flags(self.codes) & _WORD).astype(bool)
        edges = np.flatnonzero(np.diff(self.mask, prepend=False, append=False))
        self.starts, self.ends = edges[0::2], edges[1::2]

    @classmethod
    def of(cls, text: str) -> _Words:
        return cls(_nfc(text).casefold())

    def __len__(self) -> int:
        return len(self.starts)

    def hashes(self) -> np.ndarray:
        """64-bit hashes of the words, in order."""
        mixed = _fmix64(self.codes.astype(np.uint64) + np.uint64(_BASE))  # close code points hash far apart
        return _fmix64(_span_hashes(mixed, self.starts, self.ends))

    def ngram_hashes(self, n: int) -> np.ndarray:
        """64-bit hashes of the word n-grams, in order (empty when there are fewer than n words)."""
        if len(self) < n:
            return np.empty(0, np.uint64)
        starts = np.arange(len(self) - n + 1)
        return _fmix64(_span_hashes(self.hashes(), starts, starts + n))

    def key(self) -> np.ndarray:
        """A 64-bit hash of the whole word sequence (one value)."""
        return _fmix64(_span_hashes(self.hashes(), np.zeros(1, np.intp), np.full(1, len(self))))

    def shingle_hashes(self) -> np.ndarray:
        """32-bit hashes of the distinct SHINGLE_CHARS-character shingles of the words run together, sorted (a
        shorter text is one shingle)."""
        chars = _fmix64(self.codes[self.mask].astype(np.uint64) + np.uint64(_BASE))
        width = max(1, min(SHINGLE_CHARS, len(chars)))
        starts = np.arange(max(1, len(chars) - width + 1))
        hashes = np.sort((_fmix64(_span_hashes(chars, starts, starts + width)) >> np.uint64(32)).astype(np.uint32))
        # np.unique does the same at several times the cost on arrays of a row's size.
        return hashes[np.concatenate(([True], hashes[1:] != hashes[:-1]))]


@cache
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 permutation parameters (a, b) for `num_perm`, made once per process."""
    from datasketch import MinHash

    a, b = MinHash(num_perm=num_perm, seed=MINHASH_SEED, scheme=MINHASH_SCHEME).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _signature(words: _Words, num_perm: int) -> np.ndarray:
    a, b = _permutations(num_perm)
    hashes = _fmix32(words.shingle_hashes())
    signature = np.full(num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
    for start in range(0, len(hashes), _MINHASH_CHUNK):
        permuted = np.multiply(hashes[start : start + _MINHASH_CHUNK, None], a)
        permuted += b
        np.minimum(signature, permuted.min(axis=0), out=signature)
    return signature


def minhash(text: str, cleaning: CleaningSpec) -> np.ndarray | None:
    """The MinHash signature of `text` (uint32, near_dedup_num_perm values) when near_dedup_threshold is set,
    else None. Its shingles are SHINGLE_CHARS-character runs of the text's words run together; the values are
    those datasketch's MinHash (affine32 scheme, seed MINHASH_SEED) gives for the same shingle hashes, computed
    here with numpy over all shingles at once."""
    if cleaning.near_dedup_threshold is None:
        return None
    return _signature(_Words.of(text), cleaning.near_dedup_num_perm)


def ngram_keys(text: str, n: int) -> np.ndarray:
    """The hashed word n-grams of `text` (uint64, in text order, repeats kept), its words NFC-normalized,
    casefolded, without punctuation: what decontamination compares. Empty when the text has fewer than n words."""
    return _Words.of(text).ngram_hashes(n)


def _sorted_contains(haystack: np.ndarray, needles: np.ndarray) -> bool:
    """Whether any needle is in the sorted array `haystack`."""
    if not len(haystack) or not len(needles):
        return False
    at = np.minimum(np.searchsorted(haystack, needles), len(haystack) - 1)
    return bool((haystack[at] == needles).any())


class Contamination:
    """The evaluation texts a training row must not contain, as sorted hash arrays: 8 bytes per distinct word
    n-gram of the evaluation texts and per evaluation text shorter than n words, nothing per training row. It
    pickles as two numpy buffers, and forked workers share it without copying.

    A text contains evaluation text when its words (NFC, casefolded, without punctuation) equal those of an
    evaluation text, or when it shares a word n-gram with one; an evaluation text of fewer than n words matches
    only a text equal to it (a short answer such as '예' would otherwise drop every row that says it). Evaluation
    texts without words are ignored. Hashes are 64-bit: a row of a thousand words matches a million evaluation
    n-grams by collision with probability 5e-11.

    Build it once in the parent and hand it to the workers (fork inherits it; a pool initializer pickles it)."""

    def __init__(self, texts: Iterable[str], n: int) -> None:
        self.n = n
        ngrams, short = [], []
        for text in texts:
            words = _Words.of(text)
            if len(words) >= n:
                ngrams.append(words.ngram_hashes(n))
            elif len(words):
                short.append(words.key())
        self.ngrams = np.unique(np.concatenate(ngrams)) if ngrams else np.empty(0, np.uint64)
        self.short_texts = np.unique(np.concatenate(short)) if short else np.empty(0, np.uint64)

    def __len__(self) -> int:
        """Evaluation n-grams and short texts held."""
        return len(self.ngrams) + len(self.short_texts)

    def contains(self, text: str) -> bool:
        """Whether `text` equals an evaluation text or shares a word n-gram with one."""
        return self._contains(_Words.of(text))

    def _contains(self, words: _Words) -> bool:
        if len(words) < self.n:
            return bool(len(words)) and _sorted_contains(self.short_texts, words.key())
        return _sorted_contains(self.ngrams, words.ngram_hashes(self.n))


@dataclass(frozen=True, eq=False)
class CheckedRow:
    """What a worker found about one row: the row (NFC-normalized when cleaning.unicode_nfc), the reason to drop
    it found without looking at other rows, and, when there is none, its keys for the parent's deduplication."""

    row: dict[str, Any]
    reason: str | None
    key: bytes | None = None
    signature: np.ndarray | None = None
    pii: dict[str, int] = field(default_factory=dict)
    """Personal data found in the row, by kind (stages/pii.py), masked or the reason it is dropped."""


def check_row(row: dict[str, Any], cleaning: CleaningSpec, contamination: Contamination | None) -> CheckedRow:
    """Every per-row check of `cleaning` on a canonical row, in order (worker side): NFC, the filters,
    decontamination (when `contamination` is given and cleaning.decontaminate), then the exact-duplicate key
    (when cleaning.dedup) and the MinHash signature (when near_dedup_threshold is set). The same results as the
    functions one by one, with the text normalized once."""
    if cleaning.unicode_nfc:
        row = nfc_row(row)
    pii: dict[str, int] = {}
    if cleaning.pii != "off":
        row, found = mask_row(row)
        pii = dict(found)
        if pii and cleaning.pii == "drop":
            return CheckedRow(row, "pii", pii=pii)
    text = _nfc(row_text(row))
    reason = filter_reason(text, cleaning)
    folded = text.casefold()
    check = cleaning.decontaminate and contamination is not None and len(contamination) > 0
    near = cleaning.near_dedup_threshold is not None
    words = _Words(folded) if reason is None and (check or near) else None
    if reason is None and check and contamination._contains(words):
        reason = "contaminated"
    if reason is not None:
        return CheckedRow(row, reason, pii=pii)
    key = _key_of_folded(folded) if cleaning.dedup else None
    return CheckedRow(row, None, key, _signature(words, cleaning.near_dedup_num_perm) if near else None, pii)


# --------------------------------------------------------------------------- across rows (the parent process)


class SeenKeys:
    """The exact-duplicate keys seen so far, in little memory: the first 8 bytes of each key as an int64, in one
    sorted numpy array, plus the keys added since the last merge in a Python set (at most 1/16 of the array, at
    least MERGE_MIN). Memory: 8 bytes per key in the array, about 90 per pending key, so 8 to 14 bytes per key
    once there are millions (measured: 10.9 with 5 million keys), and at most 18 while a merge copies the array.
    A false duplicate needs two 64-bit prefixes to collide: about once in 3,700 runs of 10^8 distinct rows."""

    MERGE_MIN = 1 << 16

    def __init__(self) -> None:
        self._sorted = np.empty(0, np.int64)
        self._pending: set[int] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._pending)

    def __contains__(self, key: bytes) -> bool:
        prefix = int.from_bytes(key[:8], "little", signed=True)
        return prefix in self._pending or self._in_sorted(prefix)

    def _in_sorted(self, prefix: int) -> bool:
        at = self._sorted.searchsorted(prefix)
        return bool(at < len(self._sorted) and self._sorted[at] == prefix)

    def add(self, key: bytes) -> bool:
        """Remember `key` (a `normalized_key`); True when it was not seen before."""
        prefix = int.from_bytes(key[:8], "little", signed=True)
        if prefix in self._pending or self._in_sorted(prefix):
            return False
        self._pending.add(prefix)
        if len(self._pending) >= max(self.MERGE_MIN, len(self._sorted) >> 4):
            self._merge()
        return True

    def _merge(self) -> None:
        pending = np.fromiter(self._pending, dtype=np.int64, count=len(self._pending))
        self._pending.clear()  # before the copy below: the set is the larger of the two
        pending.sort()
        self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, pending), pending)


class NearDuplicates:
    """The MinHash signatures of the rows kept so far, indexed by datasketch's MinHashLSH, which finds the
    candidates; a candidate is a near duplicate when the signatures' estimated Jaccard similarity (the share of
    equal values) reaches the threshold, so the LSH's false positives do not drop rows. Memory, per kept row:
    datasketch's dict storage holds a Python set and a bytes key per band, the signature is kept as bytes (4 per
    permutation): measured 5.5 KB at num_perm 128 and threshold 0.8 (14 bands of 9), plus the key string."""

    def __init__(self, threshold: float, num_perm: int = 128) -> None:
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.num_perm = num_perm
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
        self._signatures: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._signatures)

    def near_duplicate(self, key: str, signature: np.ndarray) -> bool:
        """Whether the row `key` (unique per row, e.g. its file and line) with this `minhash` signature is a near
        duplicate of a row kept before; when it is not, it is kept: added to the index."""
        from datasketch import LeanMinHash

        if key in self._signatures:
            raise ValueError(f"row key {key!r} was given before; each row needs its own (e.g. file:line)")
        sketch = LeanMinHash(seed=MINHASH_SEED, hashvalues=signature, scheme=MINHASH_SCHEME)
        for other in self._lsh.query(sketch):
            kept = np.frombuffer(self._signatures[other], dtype=np.uint32)
            if np.count_nonzero(kept == signature) / self.num_perm >= self.threshold:
                return True
        self._lsh.insert(key, sketch, check_duplication=False)
        self._signatures[key] = signature.astype(np.uint32).tobytes()
        return False


class Deduplication:
    """The parent's state across the rows of one stage (all its files): exact duplicates when cleaning.dedup,
    near duplicates when cleaning.near_dedup_threshold is set."""

    def __init__(self, cleaning: CleaningSpec) -> None:
        self.seen = SeenKeys() if cleaning.dedup else None
        self.near = (
            NearDuplicates(cleaning.near_dedup_threshold, cleaning.near_dedup_num_perm)
            if cleaning.near_dedup_threshold is not None
            else None
        )

    def reason(self, checked: CheckedRow, row_id: str) -> str | None:
        """Why the worker-checked row `row_id` (unique, e.g. file:line) is dropped: its own reason, 'duplicate'
        or 'near_duplicate'; None when it is kept (and then remembered). Call it in the order rows were read."""
        if checked.reason is not None:
            return checked.reason
        if self.seen is not None and checked.key is not None and not self.seen.add(checked.key):
            return "duplicate"
        near = self.near is not None and checked.signature is not None
        if near and self.near.near_duplicate(row_id, checked.signature):
            return "near_duplicate"
        return None


@dataclass
class CleaningCounts:
    """Rows of one stage read, kept, and dropped per reason (read = kept + every drop); and the personal data found
    in them, by kind."""

    read: int = 0
    kept: int = 0
    pii: int = 0
    too_short: int = 0
    too_long: int = 0
    low_hangul: int = 0
    contaminated: int = 0
    duplicate: int = 0
    near_duplicate: int = 0
    pii_found: dict[str, int] = field(default_factory=dict)
    """Identifiers found (masked, or in dropped rows), by kind (stages/pii.MASKS)."""

    def record(self, reason: str | None, pii: dict[str, int] | None = None) -> None:
        """Count one row: kept when `reason` is None, else dropped for it; and the personal data found in it."""
        for kind, n in (pii or {}).items():
            self.pii_found[kind] = self.pii_found.get(kind, 0) + n
        self.read += 1
        if reason is None:
            self.kept += 1
        elif reason in DROP_REASONS:
            setattr(self, reason, getattr(self, reason) + 1)
        else:
            raise ValueError(f"unknown drop reason {reason!r}; known: {', '.join(DROP_REASONS)}")

    def merge(self, other: CleaningCounts) -> None:
        """Add the counts of `other` (e.g. a worker's) to these."""
        for counter in fields(self):
            if counter.name != "pii_found":
                setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))
        for kind, n in other.pii_found.items():
            self.pii_found[kind] = self.pii_found.get(kind, 0) + n

    def as_dict(self) -> dict[str, Any]:
        """{read, kept, dropped: {reason: rows}, pii: {kind: found}} for stage.json (kinds in MASKS' order)."""
        return {
            "read": self.read,
            "kept": self.kept,
            "dropped": {r: getattr(self, r) for r in DROP_REASONS},
            "pii": {kind: self.pii_found[kind] for kind in MASKS if kind in self.pii_found},
        }


# --------------------------------------------------------------------------- evaluation texts


def _as_texts(value: Any, choices: list[str] | None) -> list[str]:
    """A doc_to_text or doc_to_target value as texts: an index into the choices is that choice."""
    if isinstance(value, list):
        return [t for v in value for t in _as_texts(v, choices)]
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        if choices is not None:
            return [choices[value]] if 0 <= value < len(choices) else []
        return [str(value)]
    return [str(value)]


def _task_texts(task: Any) -> list[str]:
    """The evaluation texts of one lm-eval task: per document of its test and validation splits, the question
    followed by each answer (as the harness scores them) and, for multiple choice, every choice alone."""
    docs: list[Any] = []
    if task.has_test_docs():
        docs.extend(task.test_docs())
    if task.has_validation_docs():
        docs.extend(task.validation_docs())
    multiple_choice = task.config.output_type == "multiple_choice"
    delimiter = " " if task.config.target_delimiter is None else task.config.target_delimiter
    texts = []
    for doc in docs:
        choices = [str(c) for c in task.doc_to_choice(doc)] if multiple_choice else None
        questions = _as_texts(task.doc_to_text(doc), choices)
        answers = _as_texts(task.doc_to_target(doc), choices)
        for question in questions:
            texts.extend(question + delimiter + answer for answer in answers)
            if not answers:
                texts.append(question)
        texts.extend(choices or [])
    return texts


def lm_eval_texts(task_names: list[str], include_path: str | None) -> tuple[list[str], list[str]]:
    """The evaluation texts of lm-eval tasks (groups expand to their tasks), from their test and validation
    splits, for `Contamination`; `include_path` is a local folder of task YAMLs. Returns (texts, the names that
    could not be loaded: unknown, or their data unreachable, e.g. a hub dataset offline)."""
    from lm_eval.tasks import TaskManager

    from spec.lm_eval_tasks import registry_tasks

    local = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    known_locally = set(local.all_tasks) if local else set()
    rest = [name for name in task_names if name not in known_locally]
    registry = registry_tasks() if rest else set()
    failed = [name for name in rest if name not in registry]
    # Index the harness's own tasks (seconds) only when one of them is asked for.
    manager = TaskManager(include_path=include_path) if set(rest) - set(failed) else local
    texts: list[str] = []
    for name in task_names:
        if name in failed:
            continue
        try:
            tasks = manager.load([name])["tasks"]
            texts.extend(t for task in tasks.values() for t in _task_texts(task))
        except Exception:  # any failure (download, dataset script, task code) leaves the task out, named
            failed.append(name)
    return texts, [name for name in task_names if name in failed]
