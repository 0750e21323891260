"""A translation task with real structure, generated: a date written in one
of many surface forms (words, ordinals, weekdays, numeric orders, two-digit
years, mixed case) -> its ISO form YYYY-MM-DD. Nothing is downloaded.

Every surface form is unambiguous: "/" is the US order (month/day/year),
"." the European one (day.month.year), and a two-digit year means 1950-2049.
The held-out dates are never seen in training in any form.
"""

from __future__ import annotations

import datetime
import random
from typing import List, Sequence, Tuple

MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december"]
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_UNITS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
ORDINAL_WORDS = (_UNITS + ["tenth", "eleventh", "twelfth", "thirteenth", "fourteenth",
                           "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth",
                           "twentieth"] + ["twenty-" + u for u in _UNITS] +
                 ["thirtieth", "thirty-first"])
FIRST = datetime.date(1950, 1, 1)
DAYS = (datetime.date(2049, 12, 31) - FIRST).days + 1

PAD, BOS, EOS = 0, 1, 2
TARGET_CHARS = "0123456789-"
TARGET_LENGTH = 10  # YYYY-MM-DD


def ordinal(n: int) -> str:
    """1 -> "1st", 22 -> "22nd", 13 -> "13th"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def surface_forms(d: datetime.date) -> List[str]:
    """Every way the task writes date d (before the choice of case)."""
    y, m, dd = d.year, d.month, d.day
    mon, wd = MONTHS[m - 1], WEEKDAYS[d.weekday()]
    return [
        f"{dd} {mon} {y}",
        f"{mon} {dd}, {y}",
        f"{m:02d}/{dd:02d}/{y}",
        f"{m}/{dd}/{y}",
        f"{dd}.{m}.{y}",
        f"{dd:02d}.{m:02d}.{y % 100:02d}",
        f"{y}/{m:02d}/{dd:02d}",
        f"{ordinal(dd)} of {mon}, {y}",
        f"{mon[:3]} {dd} {y}",
        f"{wd}, {mon} {dd}, {y}",
        f"{wd[:3]} {dd} {mon[:3]} {y}",
        f"{dd:02d}-{mon[:3]}-{y % 100:02d}",
        f"the {ORDINAL_WORDS[dd - 1]} of {mon} {y}",
        f"{y}{m:02d}{dd:02d}",
    ]


def write(d: datetime.date, rng: random.Random) -> str:
    """Date d in a random surface form and case."""
    text = rng.choice(surface_forms(d))
    case = rng.random()
    return text.upper() if case < 0.15 else text.title() if case < 0.4 else text


def iso(d: datetime.date) -> str:
    return d.isoformat()


class Vocab:
    """Characters <-> ids; ids 0, 1, 2 are PAD, BOS, EOS."""

    def __init__(self, chars: Sequence[str]):
        self.chars = ["<pad>", "<s>", "</s>"] + sorted(set(chars))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        return [self.index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            if i == EOS:
                break
            if i > EOS:
                out.append(self.chars[i])
        return "".join(out)


def source_vocab() -> Vocab:
    chars = set()
    for d in (FIRST + datetime.timedelta(days=i) for i in range(0, DAYS, 97)):
        for form in surface_forms(d):
            chars |= set(form) | set(form.upper()) | set(form.title())
    for word in MONTHS + WEEKDAYS + ORDINAL_WORDS:
        chars |= set(word) | set(word.upper()) | set(word.title())
    return Vocab(sorted(chars))


def target_vocab() -> Vocab:
    return Vocab(TARGET_CHARS)


def split_dates(seed: int, test_fraction: float = 0.1) -> Tuple[List[datetime.date],
                                                                List[datetime.date]]:
    """All dates of 1950-2049 split at random: (training dates, held-out dates)."""
    rng = random.Random(seed)
    days = list(range(DAYS))
    rng.shuffle(days)
    cut = int(len(days) * test_fraction)
    to_date = lambda i: FIRST + datetime.timedelta(days=i)  # noqa: E731
    return [to_date(i) for i in days[cut:]], [to_date(i) for i in days[:cut]]
