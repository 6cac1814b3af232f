"""Korean personal data (stages/pii.py): every generated identifier with a valid check digit is found and masked,
the numbers of Korean law and bill texts are not, and no raw value survives masking."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from stages.pii import MASKS, find, luhn_valid, mask, registration_check

WEIGHTS = (2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5)


def registration(draw: random.Random, alien: bool) -> str:
    """A registration number with a valid check digit: a real birth date, 1-4 (resident) or 5-8 (alien)."""
    date = f"{draw.randrange(0, 100):02d}{draw.randrange(1, 13):02d}{draw.randrange(1, 29):02d}"
    body = date + str(draw.choice("5678" if alien else "1234")) + "".join(str(draw.randrange(10)) for _ in range(5))
    total = sum(int(d) * w for d, w in zip(body, WEIGHTS, strict=True))
    check = (13 - total % 11) % 10 if alien else (11 - total % 11) % 10
    return body + str(check)


def card(draw: random.Random, length: int = 16) -> str:
    """A card number of `length` digits with a valid Luhn digit."""
    body = str(draw.choice([4, 5, 9])) + "".join(str(draw.randrange(10)) for _ in range(length - 2))
    return next(body + str(d) for d in range(10) if luhn_valid(body + str(d)))


def generated(draw: random.Random) -> list[tuple[str, str]]:
    """(kind, text as people write it) for every kind and writing of it."""
    rrn, arn = registration(draw, False), registration(draw, True)
    number = card(draw)
    amex = card(draw, 15)
    mobile = f"010{draw.randrange(10**7, 10**8)}"
    return [
        ("rrn", f"{rrn[:6]}-{rrn[6:]}"),
        ("rrn", rrn),
        ("rrn", f"{rrn[:6]} - {rrn[6:]}"),
        ("arn", f"{arn[:6]}-{arn[6:]}"),
        ("arn", arn),
        ("phone", f"{mobile[:3]}-{mobile[3:7]}-{mobile[7:]}"),
        ("phone", mobile),
        ("phone", f"{mobile[:3]}.{mobile[3:7]}.{mobile[7:]}"),
        ("phone", f"+82 10-{mobile[3:7]}-{mobile[7:]}"),
        ("phone", f"02-{draw.randrange(100, 1000)}-{draw.randrange(1000, 10000)}"),
        ("phone", f"031-{draw.randrange(1000, 10000)}-{draw.randrange(1000, 10000)}"),
        ("phone", f"070-{draw.randrange(1000, 10000)}-{draw.randrange(1000, 10000)}"),
        ("card", "-".join(number[i : i + 4] for i in range(0, 16, 4))),
        ("card", " ".join(number[i : i + 4] for i in range(0, 16, 4))),
        ("card", number),
        ("card", f"{amex[:4]}-{amex[4:10]}-{amex[10:]}"),
        ("email", f"user{draw.randrange(1000)}.kim@example.co.kr"),
        ("passport", f"M{draw.randrange(10**7, 10**8)}"),
        ("passport", f"M{draw.randrange(100, 1000)}A{draw.randrange(1000, 10000)}"),
    ]


SENTENCES = ["제 번호는 {}입니다.", "연락처{}로 주세요", "연락처: {} (평일만)", "{}", "신청인 홍길동({})"]
SENTENCES.append("확인 바랍니다.\n{}\n감사합니다.")  # Hangul right before an identifier, above, too


@pytest.mark.parametrize("seed", range(40))
def test_every_generated_identifier_is_found_and_masked(seed: int) -> None:
    draw = random.Random(seed)
    for kind, value in generated(draw):
        text = draw.choice(SENTENCES).format(value)
        found = find(text)
        assert [f.kind for f in found] == [kind], (kind, value, found)
        masked, counts = mask(text)
        assert value not in masked and MASKS[kind] in masked and counts == {kind: 1}
        assert masked.replace(MASKS[kind], value) == text  # only the identifier changed


def test_bank_accounts_are_found_beside_a_bank_word() -> None:
    accounts = ["입금 계좌: 110-123-456789 (신한)", "국민은행 123456-01-234567로 송금", "우리 1002-345-678901"]
    accounts.append("계좌 123-456-78-90")
    for text in accounts:
        assert [f.kind for f in find(text)] == ["account"], text
    assert not find("의안번호 110-123-456789 참조")  # the same digits without a bank word


def test_numbers_that_are_not_identifiers_stay() -> None:
    draw = random.Random(0)
    rrn = registration(draw, False)
    wrong = rrn[:12] + str((int(rrn[12]) + 1) % 10)
    texts = [
        wrong,  # 13 bare digits with a wrong check digit
        "901301-1234567",  # month 13: no birth date
        "제1조(목적) 이 법은 2012. 1. 1.부터 시행한다.",
        "2026-11-28 회의, 2026.11.28., 20261128",
        "총 1,234,567,890원 중 12,345,678원",
        "의안번호 1809890, 제출연월일 2012. 7. 4.",
        "ISBN 978-89-01-23456-7",
        "카드 4111 1111 1111 1112",  # the Luhn digit is wrong
        "model M1 and S2, GPU H100 x 8",
    ]
    for text in texts:
        assert not find(text), (text, find(text))


def test_masking_counts_by_kind_and_keeps_no_value() -> None:
    draw = random.Random(7)
    values = dict(generated(draw))
    text = " / ".join(f"{kind}: {value}" for kind, value in values.items())
    masked, counts = mask(text)
    assert counts == {kind: 1 for kind in values}
    for value in values.values():
        assert value not in masked


def test_korean_law_and_bill_texts_hold_only_their_office_contacts() -> None:
    # The konlpy corpus (Korean laws and National Assembly bills) is full of article numbers, dates, bill numbers
    # and amounts; the only identifiers in it are a budget office's phone number and e-mail in four bills.
    spec = importlib.util.find_spec("konlpy")
    assert spec is not None and spec.origin is not None
    corpus = Path(spec.origin).parent / "data" / "corpus"
    files = sorted(corpus.glob("*/*.txt"))
    assert len(files) >= 10
    kinds = [f.kind for path in files for f in find(path.read_text(encoding="utf-8"))]
    assert sorted(kinds) == ["email"] * 4 + ["phone"] * 4


def test_check_digits() -> None:
    draw = random.Random(3)
    assert registration_check(registration(draw, False)) == "rrn"
    assert registration_check(registration(draw, True)) == "arn"
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
