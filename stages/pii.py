"""Korean personal data in text: which identifiers prepare finds (issue 36, item 4) and how it masks them.

What counts, and how each is told apart from the numbers a Korean corpus is full of (article numbers, years, dates,
bill numbers, amounts):
- resident and alien registration numbers (주민등록번호, 외국인등록번호): a birth date YYMMDD, then a digit 1-8 and six
  more. Written with its hyphen (`900101-1234567`) the shape is the evidence, checksum or not: numbers issued since
  October 2020 end in random digits, not a check digit. Written as 13 bare digits it counts only with a valid check
  digit (the resident formula for 1-4, the alien one for 5-8), since a 13-digit run may be anything;
- mobile numbers (010, 011, 016-019) and landlines (02, 031-064, 070), with hyphens, dots or spaces, or `+82`;
- card numbers: 13-19 digits in groups (4-4-4-4, Amex's 4-6-5) or bare, with a valid Luhn digit;
- bank accounts: three or four hyphenated groups of 10-14 digits with a bank word (계좌, 은행, 입금, a bank's name)
  within 20 characters before: account formats differ by bank and carry no public check digit, so the word is the
  evidence that keeps law texts' and invoices' hyphenated numbers out;
- e-mail addresses;
- passport numbers: M, S, R, G or D and eight digits, or the 2021 form with a letter in the fifth place (M123A4567).

`mask` replaces each with its kind's tag (MASKS) and counts them by kind; `find` lists them. The raw values are
never returned or counted by value, so nothing downstream (caches, quarantine, logs) can carry them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

MASKS = {
    "rrn": "[주민등록번호]",
    "arn": "[외국인등록번호]",
    "phone": "[전화번호]",
    "card": "[카드번호]",
    "account": "[계좌번호]",
    "email": "[이메일]",
    "passport": "[여권번호]",
}
"""What each kind of identifier is replaced with."""

_NOT_DIGIT_BEFORE = r"(?<![0-9A-Za-z-])"
_NOT_DIGIT_AFTER = r"(?![\d-]?\d)"

_REGISTRATION = re.compile(
    _NOT_DIGIT_BEFORE + r"(?P<date>\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01]))(?P<sep>\s?-\s?|)(?P<rest>[1-8]\d{6})"
    r"(?!\d)"
)
_PHONE = re.compile(
    r"(?<![0-9A-Za-z.+-])(?:\+82[\s.-]?(?:0)?|0)(?:1[016789]|2|[3-6][1-5]|70)[\s.-]?\d{3,4}[\s.-]?\d{4}"
    + _NOT_DIGIT_AFTER
)
_CARD = re.compile(
    _NOT_DIGIT_BEFORE + r"(?:\d{4}(?:[\s-]?\d{4}){2}[\s-]?\d{1,7}|\d{4}[\s-]?\d{6}[\s-]?\d{5})" + _NOT_DIGIT_AFTER
)
_ACCOUNT = re.compile(
    r"(?P<context>(?:계좌|은행|입금|송금|이체|예금주|국민|신한|우리|하나|농협|기업|카카오뱅크|토스|케이뱅크|우체국|새마을)"
    r"[^\n]{0,20}?)" + _NOT_DIGIT_BEFORE + r"(?P<number>\d{2,6}(?:-\d{2,8}){2,3})" + _NOT_DIGIT_AFTER
)
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![\w-])", re.ASCII)
_PASSPORT = re.compile(r"(?<![A-Za-z\d])[MSRGD](?:\d{8}|\d{3}[A-Z]\d{4})(?![A-Za-z\d])")

_NUMBER_RUN = re.compile(r"\+?\d[\d \t.-]{7,}\d")
"""A run of digits and separators long enough to hold a numeric identifier (the shortest, a Seoul landline, is
11 characters): the numeric patterns run only on these runs and the 40 characters before them (an account's bank
word), not over the whole text, which keeps a text full of numbers (laws, bills) fast."""

_RUN_CONTEXT = 40

_PRIORITY = ("rrn", "arn", "card", "phone", "account", "email", "passport")

_PASSPORT_HINT = re.compile(r"[MSRGD]\d{3}")

_REGISTRATION_WEIGHTS = (2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5)


@dataclass(frozen=True)
class Found:
    """One identifier in a text: its kind and where it is (never its value)."""

    kind: str
    start: int
    end: int


def registration_check(digits: str) -> str | None:
    """The kind of a 13-digit registration number whose check digit is valid: 'rrn' (resident, 7th digit 1-4) or
    'arn' (alien, 5-8), else None."""
    total = sum(int(d) * w for d, w in zip(digits[:12], _REGISTRATION_WEIGHTS, strict=True))
    if digits[6] in "1234":
        return "rrn" if (11 - total % 11) % 10 == int(digits[12]) else None
    return "arn" if (13 - total % 11) % 10 == int(digits[12]) else None


def luhn_valid(digits: str) -> bool:
    """Whether a card number's last digit is its Luhn check digit."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def find(text: str) -> list[Found]:
    """Every identifier in `text`, in order, none overlapping (where two kinds match the same digits, the earlier
    one in `text` wins, then the longer, then the first of _PRIORITY: 13 digits with a valid check digit are a
    registration number, even where Luhn's digit happens to be valid too)."""
    found: list[Found] = []
    for run in _NUMBER_RUN.finditer(text):
        start = max(0, run.start() - _RUN_CONTEXT)
        window = text[start : run.end() + 2]  # two characters on: the patterns' end checks look that far
        for item in _numeric(window):
            if item.end > run.start() - start:  # not one of an earlier run's
                found.append(Found(item.kind, item.start + start, item.end + start))
    if "@" in text:
        found += [Found("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
    if _PASSPORT_HINT.search(text):
        found += [Found("passport", m.start(), m.end()) for m in _PASSPORT.finditer(text)]
    if not found:  # most strings: nothing to order
        return found
    ordered = sorted(set(found), key=lambda f: (f.start, -(f.end - f.start), _PRIORITY.index(f.kind)))
    kept: list[Found] = []
    for item in ordered:
        if not kept or item.start >= kept[-1].end:
            kept.append(item)
    return kept


def _numeric(text: str) -> list[Found]:
    """The registration, card, phone and account numbers of `text`."""
    found = []
    for match in _REGISTRATION.finditer(text):
        digits = match["date"] + match["rest"]
        kind = registration_check(digits)
        if kind is None and match["sep"]:  # the hyphenated shape counts without a check digit (post-2020 numbers)
            kind = "rrn" if match["rest"][0] in "1234" else "arn"
        if kind is not None:
            found.append(Found(kind, match.start(), match.end()))
    for match in _CARD.finditer(text):
        digits = re.sub(r"\D", "", match[0])
        if 13 <= len(digits) <= 19 and luhn_valid(digits):
            found.append(Found("card", match.start(), match.end()))
    found += [Found("phone", m.start(), m.end()) for m in _PHONE.finditer(text)]
    for match in _ACCOUNT.finditer(text):
        if 10 <= sum(c.isdigit() for c in match["number"]) <= 14:
            found.append(Found("account", match.start("number"), match.end("number")))
    return found


def mask(text: str) -> tuple[str, Counter[str]]:
    """`text` with every identifier replaced by its kind's tag (MASKS), and how many of each kind it held."""
    counts: Counter[str] = Counter()
    return mask_counting(text, counts), counts


def mask_counting(text: str, counts: Counter[str]) -> str:
    """`mask`, adding what it found to `counts` (one Counter for a whole row's strings, not one per string)."""
    found = find(text)
    if not found:
        return text
    parts, at = [], 0
    for item in found:
        parts += [text[at : item.start], MASKS[item.kind]]
        at = item.end
        counts[item.kind] += 1
    parts.append(text[at:])
    return "".join(parts)
