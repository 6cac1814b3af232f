"""Benchmark (not a test): how fast prepare finds and masks Korean personal data (stages/pii.py), per CPU core.

    python bench/pii_throughput.py --documents 20000 --out OUT

The documents are konlpy's kolaw and kobill paragraphs (the wheel's `konlpy/data/corpus`, read without importing
konlpy), recombined with a seeded generator into documents of 3-12 paragraphs (about 2 KB, a CPT document's size),
one in ten with an identifier of a random kind inserted (valid check digits). Three passes over the same documents,
each timed in CPU seconds of this process (one core):

- `mask`: stages.pii.mask on each document's text (what the cleaning adds per string);
- `check_row, pii off`: the worker's whole per-row cleaning (NFC, filters, the duplicate key) without it: the
  in-run baseline;
- `check_row, pii mask`: the same with masking on (the default).

OUT/pii-throughput.json has documents/s for each, the masked documents, and the share masking adds to check_row.
The issue's target: at least 5,000 documents/s per core (the open ko-pii filter's 5,350).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spec.data import CleaningSpec  # noqa: E402
from stages.cleaning import check_row  # noqa: E402
from stages.pii import luhn_valid, mask  # noqa: E402


def paragraphs() -> list[str]:
    spec = importlib.util.find_spec("konlpy")
    if spec is None or spec.origin is None:
        raise SystemExit("konlpy is not installed (pip install konlpy): its corpus is the benchmark's text")
    corpus = Path(spec.origin).parent / "data" / "corpus"
    found = []
    for path in sorted(corpus.glob("*/*.txt")):
        found += [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if len(p.strip()) > 40]
    return found


def identifier(draw: random.Random) -> str:
    kind = draw.randrange(4)
    if kind == 0:
        return f"010-{draw.randrange(1000, 10000)}-{draw.randrange(1000, 10000)}"
    if kind == 1:
        return f"user{draw.randrange(10000)}@example.co.kr"
    if kind == 2:
        body = "4" + "".join(str(draw.randrange(10)) for _ in range(14))
        return next(body + str(d) for d in range(10) if luhn_valid(body + str(d)))
    body = f"{draw.randrange(100):02d}{draw.randrange(1, 13):02d}{draw.randrange(1, 29):02d}1"
    body += "".join(str(draw.randrange(10)) for _ in range(5))
    total = sum(int(d) * w for d, w in zip(body, (2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5), strict=True))
    return f"{body[:6]}-{body[6:]}{(11 - total % 11) % 10}"


def documents(count: int, seed: int = 0) -> list[str]:
    draw = random.Random(seed)
    source = paragraphs()
    out = []
    for _ in range(count):
        text = "\n\n".join(draw.choice(source) for _ in range(draw.randrange(3, 13)))
        if draw.random() < 0.1:
            at = draw.randrange(len(text))
            text = f"{text[:at]} 연락처 {identifier(draw)} {text[at:]}"
        out.append(text)
    return out


def rate(work: list[str], run: object) -> float:
    started = time.process_time()
    for text in work:
        run(text)  # type: ignore[operator]
    return len(work) / (time.process_time() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = documents(args.documents)
    off, on = CleaningSpec(pii="off"), CleaningSpec()
    masked = sum(bool(mask(text)[1]) for text in work)
    results = {
        "documents": len(work),
        "mean_chars": sum(map(len, work)) / len(work),
        "masked_documents": masked,
        "mask_docs_per_s": rate(work, mask),
        "check_row_pii_off_docs_per_s": rate(work, lambda t: check_row({"text": t}, off, None)),
        "check_row_pii_mask_docs_per_s": rate(work, lambda t: check_row({"text": t}, on, None)),
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }
    results["mask_share_of_check_row"] = (
        1 - results["check_row_pii_mask_docs_per_s"] / results["check_row_pii_off_docs_per_s"]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pii-throughput.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for key, value in results.items():
        print(f"{key:32} {value:,.3f}" if isinstance(value, float) else f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
