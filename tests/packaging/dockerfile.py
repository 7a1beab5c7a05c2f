"""A small Dockerfile reader and ``.dockerignore`` matcher, enough to check our Dockerfile without a Docker engine.

Only what the repository's Dockerfile uses is supported: line continuations, comments, ``ARG`` defaults substituted
into ``FROM``, flags such as ``--from=``, exec (JSON) and shell forms, ``KEY=value`` pairs in ``ENV``. The ignore
matcher follows moby's patternmatcher: patterns are cleaned paths, ``*`` and ``?`` stay within one path segment,
``**`` spans segments, a pattern that matches a directory matches everything below it, ``!`` re-includes, and the
last matching pattern wins.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the text after the keyword and its --flags, continuations joined
    flags: dict[str, str]
    stage: int  # index of the FROM this instruction belongs to (-1 before the first FROM)
    line: int  # 1-based line of the keyword

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None for the shell form."""
        try:
            value = json.loads(self.args)
        except json.JSONDecodeError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        return None

    def words(self) -> list[str]:
        return self.exec_form() or shlex.split(self.args)


_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?\s+")


def parse(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    stage = -1
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        # Comment lines are dropped, also inside a continuation (as BuildKit does); blank lines too.
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(p for p in pending if p)
        pending = []
        keyword, _, rest = joined.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        rest = rest.strip() + " "
        while m := _FLAG.match(rest):
            flags[m.group(1)] = m.group(2) or ""
            rest = rest[m.end() :]
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, rest.strip(), flags, stage, start))
    return out


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG`` defaults declared before the first ``FROM`` (the ones ``FROM`` may use)."""
    args: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip()
    return args


def substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def env_of_stage(instructions: list[Instruction], stage: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.stage == stage and ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                name, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"line {ins.line}: ENV {word!r}: use the KEY=value form")
                env[name] = value
    return env


def last(instructions: list[Instruction], keyword: str, stage: int) -> Instruction | None:
    found = [i for i in instructions if i.keyword == keyword and i.stage == stage]
    return found[-1] if found else None


def copy_sources(ins: Instruction) -> list[str]:
    """Build-context sources of a COPY/ADD (all words but the destination)."""
    words = ins.words()
    return words[:-1]


# --- .dockerignore -------------------------------------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class IgnoreRules:
    rules: tuple[tuple[re.Pattern[str], bool], ...]  # (pattern, is_exclusion_reversed)

    @classmethod
    def load(cls, path: Path) -> IgnoreRules:
        rules = []
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:].strip()
            line = posixpath.normpath(line).lstrip("/")
            rules.append((_glob_regex(line), negate))
        return cls(tuple(rules))

    def ignored(self, rel_path: str) -> bool:
        """Whether ``rel_path`` (relative to the context, '/'-separated) is left out of the build context."""
        parts = rel_path.strip("/").split("/")
        candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for regex, negate in self.rules:
            if any(regex.match(c) for c in candidates):
                result = not negate
        return result
