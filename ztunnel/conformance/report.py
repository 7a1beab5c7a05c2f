"""The report: a table for people, JSON (``-o json``) for programs."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections import Counter
from collections.abc import Sequence

from ztunnel.conformance.checks import Result, Verdict


def summary(results: Sequence[Result]) -> dict[str, int]:
    counts = Counter(r.outcome.verdict for r in results)
    return {str(v): counts.get(v, 0) for v in Verdict}


def table(results: Sequence[Result], header: str) -> str:
    """One row per check: verdict, id, what was observed; each DIFF and FAIL is followed by upstream's behaviour."""
    width = max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))
    id_width = max((len(r.check.id) for r in results), default=10)
    lines = [header, ""]
    for r in results:
        lead = f"{r.outcome.verdict:<5}  {r.check.id:<{id_width}}  "
        body = textwrap.wrap(r.outcome.observed, width - len(lead)) or [""]
        lines.append(lead + body[0])
        lines += [" " * len(lead) + more for more in body[1:]]
        if r.outcome.verdict in (Verdict.DIFF, Verdict.FAIL):
            for more in textwrap.wrap(f"upstream: {r.check.upstream}", width - len(lead)):
                lines.append(" " * len(lead) + more)
    counts = summary(results)
    lines += ["", "  ".join(f"{k} {v}" for k, v in counts.items())]
    return "\n".join(lines)


def as_json(results: Sequence[Result], about: dict[str, object]) -> str:
    return json.dumps({**about, "summary": summary(results), "checks": [r.as_dict() for r in results]}, indent=2)
