"""The doctor's results and their report: PASS/WARN/FAIL/SKIP, one Result per check, the table and the summary
line `dskit doctor` prints, and the guard that turns a crash inside a check into a WARN row.
"""

from __future__ import annotations

import enum
import functools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from model_utils.errors import ConfigError, first_line


class Status(enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Result:
    check: str
    status: Status
    found: str
    fix: str = ""


def _guarded(name: str, fn: Callable[[], Result]) -> Result:
    """A crash inside one check is the doctor's bug, not the node's: report it and let the launch go on."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:
        return Result(name, Status.WARN, f"the check itself failed: {type(e).__name__}: {first_line(e)}", "")


def format_table(results: list[Result], width: int = 120) -> str:
    check_w = max(len("check"), *(len(r.check) for r in results))
    status_w = 6
    text_w = max(30, (width - check_w - status_w - 6) // 2)
    head = f"{'check':<{check_w}}  {'status':<{status_w}}  {'found':<{text_w}}  fix"
    lines = [head, f"{'-' * check_w}  {'-' * status_w}  {'-' * text_w}  {'-' * text_w}"]
    # Paths and commands stay whole (a cell grows instead), so they can be copied from the table.
    wrap = functools.partial(textwrap.wrap, width=text_w, break_long_words=False, break_on_hyphens=False)
    for r in results:
        found = wrap(r.found) or [""]
        fix = wrap(r.fix) or [""]
        for i in range(max(len(found), len(fix))):
            left = r.check if i == 0 else ""
            status = r.status.value if i == 0 else ""
            f1 = found[i] if i < len(found) else ""
            f2 = fix[i] if i < len(fix) else ""
            lines.append(f"{left:<{check_w}}  {status:<{status_w}}  {f1:<{text_w}}  {f2}".rstrip())
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    counts = {s: sum(r.status is s for r in results) for s in Status}
    text = ", ".join(f"{n} {s.value}" for s, n in counts.items())
    failed = [r.check for r in results if r.status is Status.FAIL]
    if failed:
        return f"doctor: {text}: fix {', '.join(failed)} before training (see the fix column)"
    return f"doctor: {text}: ready" + (" (see the WARN rows)" if counts[Status.WARN] else "")
