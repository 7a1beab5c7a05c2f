"""The documentation is checked like code, so it cannot drift from the tree it describes.

Checked in ``README.md``, every ``docs/*.md`` and ``bench/README.md``:

* links: every relative link (``[text](path#anchor)``, images too) names a file or directory of the tree, and an
  anchor names a heading of the linked Markdown file (GitHub's heading ids);
* commands: every line of a fenced ``sh`` block and every inline ``make ...`` / ``python -m ...`` names Makefile
  targets, or a module of the tree (or an installed one) and only ``--flags`` that module's ``--help`` lists (its
  subcommands followed); a ``<NAME>_ARGS=--flag`` make variable is checked against the program its recipe runs;
  a ``ztunnel ...`` command line names the console script and its commands; any other program must be listed in ``EXTERNAL``;
* paths: every backticked path into the tree (``ztunnel/...``, ``tests/...``, globs too) exists, and a
  ``file.py::name`` (``::Class.method``, or a bare ``::name`` after a file in the same table row or paragraph)
  is defined in that file;
* the front door: README is at most 10 KiB, links to every file in ``docs/``, and shows ``make test`` and
  ``make demo``;
* the layers: every module of ``ztunnel/`` is in the diagram of docs/architecture.md, and its imports (local and
  ``TYPE_CHECKING`` ones included) point down or sideways, but for the one upward import the page names; the
  generated protobuf code in ``xds/`` imports nothing of the project.

Each checker returns the problems it found as ``file:line: what``; the ``test_*_can_fail`` tests feed it broken
text, so a checker that stopped looking fails too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from tests import importcheck

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
README_MAX_BYTES = 10 * 1024

# Programs the docs may run that are not part of this tree (their arguments are not checked, except repo paths).
EXTERNAL = frozenset({"docker", "helm", "kubectl"})
# Backticked text starting with one of these is a path into the tree.
TREE_ROOTS = ("ztunnel/", "tests/", "xds/", "bench/", "examples/", "charts/", "docs/", ".ci/")
SHELL_LANGS = frozenset({"sh", "shell", "bash", "console"})
PYTHONS = frozenset({"python", "python3", ".venv/bin/python", ".venv/bin/python3"})

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
ARGS_VAR = re.compile(r"^([A-Z][A-Z0-9_]*_ARGS)=(.*)$")
PY_MODULE_CMD = re.compile(r"^(?:\.venv/bin/)?python3? -m ")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS_DIR.glob("*.md")), ROOT / "bench" / "README.md"]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# -- Markdown structure --------------------------------------------------------------------------------------------


def split_fences(text: str) -> tuple[str, list[tuple[int, str, list[str]]]]:
    """(the text with fenced blocks blanked, line numbers kept; [(first line number, language, lines)] of blocks)."""
    prose: list[str] = []
    blocks: list[tuple[int, str, list[str]]] = []
    fence: str | None = None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append((number + 1, m.group(2).lower(), []))
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                blocks[-1][2].append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def strip_spans(prose: str) -> str:
    """Code spans replaced by spaces (same length, so offsets still map to lines): links inside them are code."""
    return SPAN.sub(lambda m: " " * len(m.group(0)), prose)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def heading_ids(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lowercased, punctuation dropped, spaces as hyphens,
    ``-1``, ``-2``, ... for repeats."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    ids = set()
    for line in prose.split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "")
        slug = "".join(c for c in title.lower() if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def units(prose: str) -> Iterator[tuple[int, str]]:
    """(offset, text) of each table row and each other paragraph: the scope of a bare ``::name``."""
    offset = 0
    for para in re.split(r"(\n\s*\n)", prose):
        if para.strip() and not para.startswith("\n"):
            lines = para.split("\n")
            if all(ln.lstrip().startswith("|") for ln in lines if ln.strip()):
                pos = offset
                for ln in lines:
                    yield pos, ln
                    pos += len(ln) + 1
            else:
                yield offset, para
        offset += len(para)


# -- links ---------------------------------------------------------------------------------------------------------


def check_links(text: str, source: Path) -> list[str]:
    problems = []
    prose = strip_spans(split_fences(text)[0])
    for m in LINK.finditer(prose):
        target = m.group(1)
        where = f"{rel(source)}:{line_of(prose, m.start())}"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto: (not fetched: no network in tests)
        path_part, _, anchor = target.partition("#")
        if not path_part:
            if anchor not in heading_ids(text):
                problems.append(f"{where}: link to {target}: no heading #{anchor} here")
            continue
        path = (source.parent / path_part).resolve()
        if not path.exists():
            problems.append(f"{where}: link to {target}: {rel(path)} does not exist")
            continue
        if ROOT not in path.parents and path != ROOT:
            problems.append(f"{where}: link to {target} leaves the repository")
            continue
        if anchor:
            if path.suffix != ".md":
                problems.append(f"{where}: link to {target}: an anchor into a file that is not Markdown")
            elif anchor not in heading_ids(path.read_text(encoding="utf-8")):
                problems.append(f"{where}: link to {target}: no heading #{anchor} in {rel(path)}")
    return problems


def link_targets(text: str, source: Path) -> set[Path]:
    prose = strip_spans(split_fences(text)[0])
    out = set()
    for m in LINK.finditer(prose):
        path_part = m.group(1).partition("#")[0]
        if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", path_part):
            out.add((source.parent / path_part).resolve())
    return out


# -- commands ------------------------------------------------------------------------------------------------------


@functools.cache
def makefile() -> tuple[frozenset[str], dict[str, str]]:
    """(targets, {NAME_ARGS: module its recipe runs with ``$(PY) -m``})."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M))
    args_vars = {}
    for line in text.split("\n"):
        m = re.search(r"-m ([\w.]+)\b.*\$\((\w+_ARGS)\)", line)
        if m:
            args_vars[m.group(2)] = m.group(1)
    return frozenset(targets), args_vars


def module_exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@functools.cache
def help_text(module: str, subcommands: tuple[str, ...], pythonpath: str = "") -> str | None:
    """``python -m module [subcommands] --help``, or None when that is not a valid invocation."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", module, *subcommands, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout if proc.returncode == 0 else None


def check_flags(module: str, args: list[str], pythonpath: str = "") -> list[str]:
    """Every ``--flag`` in ``args`` appears in the help of ``module`` or of one of its subcommands given."""
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2}
    if not flags:
        return []
    positionals: list[str] = []
    for a in args:
        if a.startswith("-"):
            break
        positionals.append(a)
    helps = []
    for i in range(len(positionals) + 1):
        h = help_text(module, tuple(positionals[:i]), pythonpath)
        if h is None:
            break
        helps.append(h)
    if not helps:
        return [f"`python -m {module} --help` fails"]
    text = "\n".join(helps)
    return [
        f"`python -m {module}` has no option {flag} (not in its --help)"
        for flag in sorted(flags)
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    ]


@functools.cache
def console_scripts() -> dict[str, str]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    scripts: dict[str, str] = data["project"]["scripts"]
    return scripts


def check_tree_paths_in(tokens: list[str]) -> list[str]:
    return [
        f"{t} does not exist" for t in tokens if t.startswith(TREE_ROOTS) and "<" not in t and not _tree_path_exists(t)
    ]


def _tree_path_exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return next(ROOT.glob(path), None) is not None
    return (ROOT / path).exists()


def check_command(command: str) -> list[str]:
    """Problems with one shell command line (continuations joined): see the module docstring."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as e:
        return [f"cannot parse {command!r}: {e}"]
    make_vars = []
    while tokens and ENV_ASSIGN.match(tokens[0]):
        tokens.pop(0)
    if tokens and tokens[0] == "sudo":
        tokens.pop(0)
    if not tokens:
        return []
    program, args = tokens[0], tokens[1:]
    problems = check_tree_paths_in(args)
    if program == "make":
        targets, args_vars = makefile()
        for a in args:
            if a.startswith("-"):
                continue
            if "=" in a:
                make_vars.append(a)
            elif a not in targets:
                problems.append(f"`make {a}`: no such target in the Makefile")
        for assignment in make_vars:
            problems += check_args_var(assignment, args_vars)
    elif program in PYTHONS:
        if len(args) < 2 or args[0] != "-m":
            return [*problems, f"{command!r}: only `python -m <module>` commands are checked; say which module"]
        module, rest = args[1], args[2:]
        if not module_exists(module):
            problems.append(f"`python -m {module}`: no such module")
        elif module != "pytest":  # pytest's paths into the tree are checked above
            problems += check_flags(module, rest)
    elif program.removeprefix(".venv/bin/") in console_scripts():
        name = program.removeprefix(".venv/bin/")
        entry = console_scripts()[name].split(":")[0]
        usage = help_text(entry, ("help",)) or ""
        # The commands (words before the first flag) are in `ztunnel help`; a command's flags in its own --help.
        commands = args[: next((i for i, a in enumerate(args) if a.startswith("-")), len(args))]
        problems += [f"`{name} {a}`: not a command in `{name} help`" for a in commands if a not in usage]
        if len(commands) < len(args):
            problems += check_flags(entry, args)
    elif program.startswith(("./", *TREE_ROOTS)) and (ROOT / program).is_file():
        pass  # a script of the tree (its arguments are its own)
    elif program not in EXTERNAL:
        problems.append(f"{program!r} is not a program of this tree nor in EXTERNAL (tests/test_docs.py)")
    return problems


def check_args_var(assignment: str, args_vars: dict[str, str]) -> list[str]:
    m = ARGS_VAR.match(assignment)
    if m is None:
        return []
    name, value = m.groups()
    module = args_vars.get(name)
    if module is None:
        return [f"{name}: no Makefile recipe passes $({name}) to `$(PY) -m <module>`"]
    if module == "pytest":
        return []
    return check_flags(module, shlex.split(value))


def shell_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(index of the first line, command) with backslash continuations joined."""
    current: list[str] = []
    start = 0
    for i, line in enumerate(lines):
        if not current:
            start = i
        if line.rstrip().endswith("\\"):
            current.append(line.rstrip()[:-1])
            continue
        current.append(line)
        yield start, " ".join(current)
        current = []
    if current:
        yield start, " ".join(current)


def check_commands(text: str, source: Path) -> list[str]:
    problems = []
    prose, blocks = split_fences(text)
    for first, lang, lines in blocks:
        if lang not in SHELL_LANGS:
            continue
        for i, command in shell_lines(lines):
            problems += [f"{rel(source)}:{first + i}: {p}" for p in check_command(command)]
    _, args_vars = makefile()
    for m in SPAN.finditer(prose):
        span = " ".join(m.group(1).split())
        where = f"{rel(source)}:{line_of(prose, m.start())}"
        if span.startswith("make ") or PY_MODULE_CMD.match(span) or ARGS_VAR.match(span):
            if "..." in span or "<" in span:
                span = span.split("...")[0].split("<")[0]
            if ARGS_VAR.match(span):
                problems += [f"{where}: {p}" for p in check_args_var(span, args_vars)]
            else:
                problems += [f"{where}: {p}" for p in check_command(span)]
    return problems


# -- paths and names -----------------------------------------------------------------------------------------------


@functools.cache
def definitions(path: Path) -> frozenset[str]:
    """Qualified names defined in a Python file: ``f``, ``C``, ``C.method``, ``C.Inner.method``, module constants."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(prefix + t.id for t in targets if isinstance(t, ast.Name))

    visit(tree.body, "")
    return frozenset(names)


REF = re.compile(r"^((?:[\w.*-]+/)*[\w.*-]+/?)?(?:::([\w.]+))?$")


def check_paths(text: str, source: Path) -> list[str]:
    problems = []
    prose, _ = split_fences(text)
    for offset, unit in units(prose):
        current: Path | None = None
        for m in SPAN.finditer(unit):
            span = m.group(1).strip()
            where = f"{rel(source)}:{line_of(prose, offset + m.start())}"
            is_bare_ref = span.startswith("::")
            if not (span.startswith(TREE_ROOTS) or is_bare_ref) or " " in span:
                continue
            ref = REF.match(span)
            if ref is None:
                continue
            path_text, name = ref.group(1), ref.group(2)
            if path_text:
                if not _tree_path_exists(path_text):
                    problems.append(f"{where}: `{span}`: {path_text} does not exist")
                    current = None
                    continue
                current = ROOT / path_text
            if name is None:
                continue
            if current is None or current.suffix != ".py":
                problems.append(f"{where}: `{span}`: no Python file before it to find {name} in")
            elif name not in definitions(current):
                problems.append(f"{where}: `{span}`: {rel(current)} defines no {name}")
    return problems


# -- the layer diagram ---------------------------------------------------------------------------------------------

ARCHITECTURE = DOCS_DIR / "architecture.md"
LAYERS = ("config", "identity", "state/rbac", "proxy", "factory", "app", "CLI")  # bottom to top
# Upward imports docs/architecture.md allows: none ("No import points up").
UPWARD_ALLOWED: frozenset[tuple[str, str]] = frozenset()


def layer_diagram(text: str) -> dict[str, int]:
    """{path as written (``ztunnel/proxy/``, ``ztunnel/app.py``): layer index} from the first block under
    "## Layers"."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    _, blocks = split_fences(section)
    layers: dict[str, int] = {}
    current = -1
    for line in blocks[0][2]:
        words = line.split()
        if words and words[0] in LAYERS:
            current = LAYERS.index(words[0])
        for path in re.findall(r"ztunnel/[\w/.]*", line):
            assert current >= 0, f"{path} before any layer name"
            layers[path] = current
    return layers


def layer_of(path: str, layers: dict[str, int]) -> int | None:
    """The layer of a file: its own entry, else the longest directory entry containing it."""
    if path in layers:
        return layers[path]
    dirs = [d for d in layers if d.endswith("/") and path.startswith(d)]
    return layers[max(dirs, key=len)] if dirs else None


@functools.cache
def _project_modules() -> dict[str, Path]:
    return {**importcheck.modules(ROOT, "ztunnel"), **importcheck.modules(ROOT, "xds")}


def imported_files(path: Path) -> Iterator[tuple[int, str]]:
    """(line, file of the tree) for every import of ``ztunnel``/``xds`` in ``path``, local and TYPE_CHECKING ones
    included: ``from ztunnel import tls`` is ``ztunnel/tls.py``, ``from ztunnel.proxy import Proxy`` is
    ``ztunnel/proxy/__init__.py`` (``tests/importcheck.py`` reads and resolves them)."""
    known = _project_modules()
    for line, name in importcheck.imports(path, ROOT, known):
        if name.split(".")[0] in ("ztunnel", "xds"):
            target = known.get(name)
            yield line, rel(target) if target is not None else name.replace(".", "/") + ".py"


def layer_problems(layers: dict[str, int]) -> tuple[list[str], set[tuple[str, str]]]:
    """(problems, upward imports found) for every module of ``ztunnel/``."""
    problems = []
    upward = set()
    for path in sorted((ROOT / "ztunnel").rglob("*.py")):
        src = rel(path)
        mine = layer_of(src, layers)
        if mine is None:
            problems.append(f"{src} is in no layer of docs/architecture.md")
            continue
        for line, target in imported_files(path):
            if target.startswith("xds/"):
                continue  # the generated code below every layer (checked separately)
            theirs = layer_of(target, layers)
            if theirs is None:
                problems.append(f"{src}:{line}: imports {target}, which is in no layer")
            elif theirs > mine:
                upward.add((src, target))
    return problems, upward


# -- the tests -----------------------------------------------------------------------------------------------------


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES} (depth goes in docs/)"
    _, blocks = split_fences(README.read_text(encoding="utf-8"))
    shown = [c for _, lang, lines in blocks if lang in SHELL_LANGS for _, c in shell_lines(lines)]
    for command in ("make test", "make demo"):
        assert any(c.split("#")[0].strip() == command for c in shown), f"README shows no `{command}` command"


def test_readme_links_every_doc() -> None:
    docs = set(DOCS_DIR.glob("*.md"))
    assert docs, "docs/ holds no Markdown file"
    linked = link_targets(README.read_text(encoding="utf-8"), README)
    assert sorted(rel(d) for d in docs - linked) == []


def test_links_resolve() -> None:
    problems = [p for f in doc_files() for p in check_links(f.read_text(encoding="utf-8"), f)]
    assert problems == []


def test_commands_exist() -> None:
    problems = [p for f in doc_files() for p in check_commands(f.read_text(encoding="utf-8"), f)]
    assert problems == []


def test_paths_and_names_exist() -> None:
    problems = [p for f in doc_files() for p in check_paths(f.read_text(encoding="utf-8"), f)]
    assert problems == []


def test_link_check_can_fail() -> None:
    source = DOCS_DIR / "x.md"
    text = "# Top\n\n[ok](../README.md) [gone](nowhere.md) [bad anchor](../README.md#no-such-heading) [self](#top)\n"
    problems = check_links(text + "[lost](#bottom)\n", source)
    assert len(problems) == 3, problems
    assert "nowhere.md does not exist" in problems[0]
    assert "no heading #no-such-heading" in problems[1]
    assert "no heading #bottom here" in problems[2]
    assert check_links("`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n", source) == []


def test_heading_ids_follow_github() -> None:
    text = "# In-pod mode (PROXY_MODE=shared, the default)\n## `make bench`: numbers\n## Faults\n### Faults\n"
    assert heading_ids(text) == {
        "in-pod-mode-proxy_modeshared-the-default",
        "make-bench-numbers",
        "faults",
        "faults-1",
    }


def test_command_check_can_fail() -> None:
    assert check_command("make test demo") == []
    assert check_command("sudo make nope") == ["`make nope`: no such target in the Makefile"]
    assert check_command(".venv/bin/python -m no_such_module_here") == [
        "`python -m no_such_module_here`: no such module"
    ]
    assert check_command("XDS_ADDRESS= .venv/bin/ztunnel config") == []
    assert check_command("ztunnel frobnicate") == ["`ztunnel frobnicate`: not a command in `ztunnel help`"]
    assert check_command("ztunnel explain --from a/b --to x:80") == []
    assert check_command("ztunnel explain --frm a/b") == [
        "`python -m ztunnel.__main__` has no option --frm (not in its --help)"
    ]
    assert check_command("curl http://x") != []
    assert check_command("make bench BENCH_ARGS=--quick") == []
    assert check_command("make bench BENCH_ARGS=--no-such-flag") == [
        "`python -m bench` has no option --no-such-flag (not in its --help)"
    ]
    assert check_command("helm install z charts/no-such-chart") == ["charts/no-such-chart does not exist"]
    assert check_command(".ci/run") == []
    assert check_command("./no-such-script") != []


FIXTURE_CLI = """
import argparse

parser = argparse.ArgumentParser(prog="docs_fixture_cli")
parser.add_argument("--top")
sub = parser.add_subparsers(dest="command")
sub.add_parser("serve").add_argument("--port")
parser.parse_args()
"""


def test_flag_check_follows_subcommands(tmp_path: Path) -> None:
    (tmp_path / "docs_fixture_cli.py").write_text(FIXTURE_CLI, encoding="utf-8")
    path = str(tmp_path)
    assert check_flags("docs_fixture_cli", ["--top", "x"], path) == []
    assert check_flags("docs_fixture_cli", ["--to"], path) == [
        "`python -m docs_fixture_cli` has no option --to (not in its --help)"
    ]
    # A subcommand's options are found in its own help, and only when the subcommand is given.
    assert check_flags("docs_fixture_cli", ["serve", "--port", "1", "--top=y"], path) == []
    assert check_flags("docs_fixture_cli", ["--port", "1"], path) == [
        "`python -m docs_fixture_cli` has no option --port (not in its --help)"
    ]
    assert check_flags("docs_fixture_cli", ["serve", "--nope"], path) == [
        "`python -m docs_fixture_cli` has no option --nope (not in its --help)"
    ]


def test_path_check_can_fail() -> None:
    text = (
        "| `tests/test_docs.py::test_path_check_can_fail`, `::check_paths` | `ztunnel/nope.py` |\n"
        "| `tests/test_docs.py::no_such_test` | |\n\nA bare `::orphan`.\n\n"
        "See `ztunnel/proxy/hbone/stream.py::HboneStream.attach` and `tests/**/test_*_fuzz.py`, not `ztunnel/proxy/*.rs`.\n"
    )
    problems = check_paths(text, README)
    assert len(problems) == 4, problems
    assert "ztunnel/nope.py does not exist" in problems[0]
    assert "defines no no_such_test" in problems[1]
    assert "no Python file before it to find orphan" in problems[2]
    assert "ztunnel/proxy/*.rs does not exist" in problems[3]


def test_imports_follow_the_layer_diagram() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    layers = layer_diagram(text)
    problems, upward = layer_problems(layers)
    assert problems == []
    assert upward == UPWARD_ALLOWED, f"upward imports (docs/architecture.md names {sorted(UPWARD_ALLOWED)}): {upward}"
    assert "No import points up" in " ".join(text.split())


def test_generated_protobuf_code_imports_nothing_of_the_project() -> None:
    generated = sorted(p for p in (ROOT / "xds").rglob("*.py") if p.stem.endswith(("_pb2", "_pb2_grpc")))
    assert generated
    bad = [
        f"{rel(p)}:{line} imports {t}" for p in generated for line, t in imported_files(p) if t.startswith("ztunnel")
    ]
    assert bad == []


def test_layer_check_can_fail() -> None:
    diagram = (
        "\n## Layers\n\n```\n  proxy   ztunnel/proxy/\n          beside it: ztunnel/sockets.py\n"
        "  state/rbac  ztunnel/state/\n  config  ztunnel/config.py  ztunnel/\n```\n"
    )
    layers = layer_diagram(diagram)
    assert layers == {
        "ztunnel/proxy/": 3,
        "ztunnel/sockets.py": 3,
        "ztunnel/state/": 2,
        "ztunnel/config.py": 0,
        "ztunnel/": 0,
    }
    assert layer_of("ztunnel/proxy/hbone/core.py", layers) == 3
    assert layer_of("ztunnel/app.py", layers) == 0
    # With state below config and everything else at the bottom, state's imports of identity point up... and
    # config's own import of spiffe is no longer upward (same layer): the set differs from the allowed one.
    _, upward = layer_problems(layers)
    assert ("ztunnel/proxy/outbound.py", "ztunnel/proxy/common.py") not in upward  # same layer
    assert any(src.startswith("ztunnel/") and layer_of(src, layers) == 0 for src, _ in upward)
    assert upward != UPWARD_ALLOWED
    problems, _ = layer_problems({"ztunnel/proxy/": 0})
    assert "ztunnel/app.py is in no layer of docs/architecture.md" in problems
