"""CHANGELOG.md's rename tables: each row names an old name the code no longer has and the new one it has.

A rename applied to the whole repository once rewrote the "before" column too (every row read
"new | new"); this fails on such a table.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rename_rows() -> list[tuple[str, str]]:
    rows = []
    for line in (REPO / "CHANGELOG.md").read_text().splitlines():
        cells = re.findall(r"`([^`]+)`", line)
        if line.strip().startswith("|") and len(cells) >= 2 and "before" not in line:
            before, now = cells[-2], cells[-1]
            # a counter's name in the code lacks the _total that prometheus-client adds
            rows.append(tuple(re.sub(r"_total$", "", c.split("{")[0]) for c in (before, now)))
    return rows


def test_every_rename_row_names_an_old_name_gone_from_the_code_and_a_new_one_in_it():
    code = "\n".join(p.read_text() for p in (REPO / "guard").rglob("*.py"))
    rows = rename_rows()
    assert rows, "no rename table found in CHANGELOG.md"
    for before, now in rows:
        assert before != now, f"CHANGELOG.md rename row names the same thing twice: {now}"
        assert now.rsplit(".", 1)[-1] in code, f"{now} is not in guard/"
        assert before.rsplit(".", 1)[-1] not in code, f"{before} is still in guard/"
