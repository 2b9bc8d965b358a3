"""Spec-Bench prompts: one JSON object a line with `question_id`, `category` and `turns`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from outpace.errors import InvalidParameterError


@dataclass(frozen=True)
class Record:
    question_id: int
    category: str
    turns: tuple[str, ...]      # user messages; turn i sees the model's own answers to turns < i


def load_spec_bench(path: str | Path, categories: list[str] | None = None,
                    limit_per_category: int | None = None) -> list[Record]:
    """Records in file order, kept only for `categories` (all when None), the first
    `limit_per_category` of each."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"no dataset file {path}: give a Spec-Bench JSONL file "
                                    "(question_id, category, turns on each line)")
    if limit_per_category is not None and limit_per_category < 1:
        raise InvalidParameterError(f"limit_per_category must be >= 1, got {limit_per_category}")
    records: list[Record] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                record = Record(int(raw["question_id"]), str(raw["category"]), tuple(str(t) for t in raw["turns"]))
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidParameterError(f"{path}:{number} is not a Spec-Bench record ({e!r}); each line "
                                            "must be a JSON object with question_id, category and turns") from None
            if not record.turns:
                raise InvalidParameterError(f"{path}:{number}: record {record.question_id} has no turns")
            seen[record.category] = seen.get(record.category, 0) + 1
            if categories and record.category not in categories:
                continue
            if limit_per_category is not None and seen[record.category] > limit_per_category:
                continue
            records.append(record)
    unknown = sorted(set(categories or []) - set(seen))
    if unknown:
        raise InvalidParameterError(f"no records of categories {', '.join(unknown)} in {path}; "
                                    f"it has: {', '.join(sorted(seen))}")
    return records
