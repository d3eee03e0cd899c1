"""README.md and docs/*.md cannot rot: every command shown is run by a test, every name exists.

* Every command block (fenced ``bash`` / ``sh`` / ``shell`` / ``console``, or an
  untagged block whose lines start with ``python``, ``torchrun``, ``bash`` or
  ``pip``) is either cheap enough to run here (``--help``, the family table's
  ``--check``, ``gpu_check.sh --list``: :data:`RUN_HERE`), or has, in the 3 lines
  above its fence, ``<!-- tested by: tests/test_x.py::test_name, ... -->`` naming
  tests that exist (the file, and a ``def test_name`` in it).
* The trainer and evaluation command lines shown parse with the trainer's own
  config parser, and those of scripts with a ``parse_args`` with theirs, so a
  renamed key or flag fails here even for commands that need GPUs.
* Relative links (and ``#anchors`` into Markdown pages) resolve; every
  ``-m ulysses_dtensor.X`` module is runnable (``find_spec``, and a ``__main__``
  for a package); every ``train_configs/``, ``scripts/``, ``benchmarks/``,
  ``tests/``, ``docs/`` and package path named exists; the names Python examples
  import from ``ulysses_dtensor`` exist.
* README.md is at most :data:`README_MAX_LINES` lines, every page of docs/ is
  linked from README.md or docs/README.md, and docs/ stays within :data:`DOCS_MAX_WORDS`.

Each failure is one line ``page:line: problem``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from package_source import parse, source
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 280

SHELL_TAGS = {"bash", "sh", "shell", "console"}
COMMAND_STARTS = ("python", "torchrun", "bash", "pip")
# Commands test_docs runs itself: cheap, read-only, a few seconds at most.
RUN_HERE = [
    re.compile(r"python -m ulysses_dtensor(\.\w+)* --help"),
    re.compile(r"python scripts/family_table\.py --check"),
    re.compile(r"bash scripts/gpu_check\.sh --list"),
]
TESTED_BY = re.compile(r"^\s*<!--\s*tested by:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HTML_REF = re.compile(r"""<(?:img|a)\b[^>]*\b(?:src|href)="([^"]+)\"""")
MODULE = re.compile(r"(?<![\w-])(-m|--module)\s+(ulysses_dtensor(?:\.\w+)*)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:train_configs|scripts|benchmarks|tests|docs|ulysses_dtensor)/[\w./-]*\w)")
PACKAGE_PATH = re.compile(
    r"(?<![\w./-])((?:parallel|memory|attention|data|models|runtime|integrations|trainer|estimate|evaluation|export)"
    r"/[\w/]*\w\.py)\b")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    tag: str
    lines: list[str]
    above: list[str]  # the 3 lines before the fence

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"

    def is_commands(self) -> bool:
        if self.tag in SHELL_TAGS:
            return True
        if self.tag:
            return False
        return any(line.strip().startswith(COMMAND_STARTS) for line in self.lines)

    def commands(self) -> list[tuple[int, str]]:
        """(line number, command) per logical line, comments and continuations resolved."""
        out, pending, start = [], "", 0
        for i, raw in enumerate(self.lines):
            text = raw.strip()
            if not pending and (not text or text.startswith("#")):
                continue
            if not pending:
                start = self.line + 1 + i
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            out.append((start, _strip_comment(pending + text)))
            pending = ""
        return out

    def runs_here(self) -> bool:
        cmds = self.commands()
        return bool(cmds) and all(any(p.fullmatch(c) for p in RUN_HERE) for _, c in cmds)


def _strip_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (outside quotes)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].strip()
    return command.strip()


def _rel(path: Path) -> str:
    return os.path.relpath(path, ROOT)


@lru_cache(maxsize=None)
def _blocks(page: Path) -> tuple[Block, ...]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.group(1), m.group(2), m.group(3).lower()
        body, j = [], i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        blocks.append(Block(page, i + 1, tag, body, lines[max(0, i - 3):i]))
        i = j + 1
    return tuple(blocks)


@lru_cache(maxsize=None)
def _code_lines(page: Path) -> frozenset[int]:
    """Line numbers of the code blocks, their fences included."""
    return frozenset(b.line + k for b in _blocks(page) for k in range(len(b.lines) + 2))


def _prose(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside code blocks, inline code removed."""
    return [(n, re.sub(r"`[^`]*`", "", text)) for n, text in enumerate(page.read_text().splitlines(), 1)
            if n not in _code_lines(page)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    for n, text in enumerate(page.read_text().splitlines(), 1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", text)
        if m and n not in _code_lines(page):
            slug = _slug(m.group(1))
            seen[slug if slug not in seen else f"{slug}-{seen[slug]}"] = seen.get(slug, 0) + 1
    return frozenset(seen)


def _links(page: Path) -> list[tuple[int, str]]:
    return [(n, target) for n, text in _prose(page) for pattern in (LINK, HTML_REF)
            for target in pattern.findall(text)]


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


@lru_cache(maxsize=None)
def _test_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(names)


def _check_reference(ref: str) -> str | None:
    """None if ``tests/file.py::test_name[...]`` names an existing test, else the problem."""
    file, sep, name = ref.partition("::")
    if not sep or not name:
        return f"{ref!r} is not tests/<file>.py::<test>"
    path = ROOT / file
    if not (file.startswith("tests/") and path.is_file()):
        return f"{ref!r}: no file {file}"
    if name.split("[", 1)[0] not in _test_names(path):
        return f"{ref!r}: {file} defines no test {name.split('[', 1)[0]}"
    return None


def _command_blocks() -> list[Block]:
    return [b for page in PAGES for b in _blocks(page) if b.is_commands()]


def test_docs_commands_are_tested():
    """Every command block runs here or names, just above it, the tests that run it."""
    problems, named = [], 0
    for block in _command_blocks():
        refs = [m.group(1) for line in block.above if (m := TESTED_BY.match(line))]
        if not refs:
            if not block.runs_here():
                problems.append(f"{block.where}: command block with no '<!-- tested by: tests/<file>.py::<test> -->' "
                                f"in the 3 lines above it (and not cheap enough for test_docs to run)")
            continue
        named += 1
        for ref in (r.strip() for r in refs[-1].split(",")):
            if (problem := _check_reference(ref)) is not None:
                problems.append(f"{block.where}: tested by {problem}")
    assert not problems, "\n".join(problems)
    assert named > 10  # the pages do show commands


def test_cheap_commands_run():
    """The blocks test_docs runs itself (--help and checks), all at once."""
    commands = [(block.page, line, cmd) for block in _command_blocks() if block.runs_here()
                for line, cmd in block.commands()]
    assert commands, "no command block is run here"

    def run(cmd: str) -> subprocess.CompletedProcess:
        words = shlex.split(cmd)
        if words[0] == "python":
            words[0] = sys.executable
        return subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(len(commands)) as pool:
        done = list(pool.map(run, [c for _, _, c in commands]))
    problems = [f"{_rel(page)}:{line}: {cmd!r} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"
                for (page, line, cmd), proc in zip(commands, done)
                if proc.returncode != 0 or ("--help" in cmd and not proc.stdout.strip())]
    assert not problems, "\n".join(problems)


def _trainer_argv(argv: list[str]) -> list[str]:
    """A trainer command line with --config made absolute."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--config":
            out[i + 1] = str(ROOT / out[i + 1])
    return out


def _parse(words: list[str]) -> str | None:
    """Parse one command with the parser of what it runs; None when fine or not parseable here."""
    from ulysses_dtensor.eval import _own_flags
    from ulysses_dtensor.trainer.config import load_config

    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    module = script = None
    args: list[str] = []
    if words[0] == "bash" and len(words) > 1 and words[1] in ("scripts/run_train.sh", "scripts/multinode_torchrun.sh"):
        module, args = "ulysses_dtensor.train", words[2:]
        if words[1] == "scripts/run_train.sh" and "--config" not in args:
            args = ["--config", "train_configs/debug_model.toml", *args]
    elif words[0] in ("python", "torchrun"):
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]  # torchrun's own options
        if not rest or rest[0] == "-c":
            return None
        if rest[0] == "-m":
            module, args = rest[1], rest[2:]
        else:
            script, args = rest[0], rest[1:]
    try:
        if module == "ulysses_dtensor.train":
            load_config(_trainer_argv(args))
        elif module == "ulysses_dtensor.eval":
            load_config(_trainer_argv(_own_flags(args)[1]))
        elif script is not None and script.endswith(".py") and (ROOT / script).is_file():
            parse_args = getattr(load_script(ROOT / script), "parse_args", None)
            if parse_args is not None:
                parse_args(args)
    except SystemExit as e:  # argparse
        return f"{' '.join(words)!r} does not parse (argparse exit {e.code})"
    except Exception as e:  # noqa: BLE001 -- the trainer's ConfigError and friends
        return f"{' '.join(words)!r} does not parse: {type(e).__name__}: {e}"
    return None


def test_command_lines_parse(capsys):
    """Trainer / eval command lines and script flags shown in the docs parse (GPU ones included)."""
    problems, parsed = [], 0
    for block in _command_blocks():
        for line, cmd in block.commands():
            if "..." in cmd or re.search(r"\[--|<\w+>|\bCONFIG\.toml\b|--help\b", cmd):
                continue  # a placeholder, or a --help test_cheap_commands_run runs
            problem = _parse(shlex.split(cmd))
            parsed += 1
            if problem:
                problems.append(f"{_rel(block.page)}:{line}: {problem}")
    capsys.readouterr()  # argparse's usage lines
    assert not problems, "\n".join(problems)
    assert parsed > 20


def test_links_and_anchors_resolve():
    problems = []
    for page in PAGES:
        for line, target in _links(page):
            if re.match(r"^[a-z][\w+.-]*:", target):  # http:, https:, mailto:
                continue
            path, anchor = _resolve(page, target)
            if not path.exists():
                problems.append(f"{_rel(page)}:{line}: link {target!r}: no such file {_rel(path)}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                problems.append(f"{_rel(page)}:{line}: link {target!r}: {_rel(path)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_named_modules_and_paths_exist():
    """-m ulysses_dtensor.X runs; train_configs/, scripts/, benchmarks/, ... paths exist."""
    problems = []
    for page in PAGES:
        text = page.read_text()
        for m in MODULE.finditer(text):  # across line breaks: prose wraps inside `python -m ...`
            flag, name, line = m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1
            spec = importlib.util.find_spec(name)
            if spec is None:
                problems.append(f"{_rel(page)}:{line}: module {name} does not exist")
            elif flag == "-m" and spec.submodule_search_locations is not None \
                    and importlib.util.find_spec(f"{name}.__main__") is None:
                problems.append(f"{_rel(page)}:{line}: package {name} has no __main__ (python -m fails)")
        for line, text in enumerate(text.splitlines(), 1):
            for path in REPO_PATH.findall(text):
                if not (ROOT / path).exists():
                    problems.append(f"{_rel(page)}:{line}: {path} does not exist")
            for path in PACKAGE_PATH.findall(text):
                if not (ROOT / "ulysses_dtensor" / path).exists():
                    problems.append(f"{_rel(page)}:{line}: ulysses_dtensor/{path} does not exist")
    assert not problems, "\n".join(problems)


def _bound_names(module: str) -> set[str] | None:
    """Names a module of this package defines or imports at its top level (None: no such module)."""
    path = source(module)
    if path is None:
        return None
    names = set()
    for node in parse(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if "_EXPORTS" in {t.id for t in targets if isinstance(t, ast.Name)} and isinstance(node.value, ast.Dict):
                # a package's lazy public names (ulysses_dtensor, integrations.hf)
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return names


def test_python_examples_import_real_names():
    problems = []
    for page in PAGES:
        for block in _blocks(page):
            if block.tag != "python":
                continue
            try:
                tree = ast.parse("\n".join(block.lines))
            except SyntaxError as e:
                problems.append(f"{block.where}: python example does not parse: {e}")
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ulysses_dtensor":
                    names = _bound_names(node.module)
                    if names is None:
                        problems.append(f"{block.where}: no module {node.module}")
                        continue
                    problems += [f"{block.where}: {node.module} has no {a.name}" for a in node.names
                                 if a.name not in names]
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_every_page_is_linked():
    readme = ROOT / "README.md"
    lines = len(readme.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md:{lines}: {lines} lines, more than {README_MAX_LINES}: move a topic to docs/"
    index = ROOT / "docs" / "README.md"
    linked = {_resolve(page, t)[0] for page in (readme, index) for _, t in _links(page)}
    missing = [f"{_rel(p)}:1: not linked from README.md or docs/README.md" for p in PAGES[1:] if p not in linked]
    assert not missing, "\n".join(missing)


# The user's manual stays walkable: docs/ in words, what is generated left out (the config
# reference, the family table), maintainer pages outside docs/ (tests/README.md, benchmarks/README.md).
DOCS_MAX_WORDS = 20_000
GENERATED = re.compile(r"<!-- family-table:begin -->.*?<!-- family-table:end -->", re.S)


def test_docs_stay_within_their_word_budget():
    counts = {_rel(p): len(GENERATED.sub("", p.read_text()).split())
              for p in PAGES[1:] if p.name != "config-reference.md"}
    total = sum(counts.values())
    biggest = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total <= DOCS_MAX_WORDS, f"docs/: {total} words, more than {DOCS_MAX_WORDS} (largest: {biggest})"


def test_ci_runs_the_documented_test_commands():
    """README's test commands are what CI runs: .ci/run calls `bash scripts/run_tests.sh`, which
    hands its arguments to pytest, and `-m quick` selects the tier tests/quick_tier.py lists."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/run_tests.sh" in [line.strip() for line in ci], ".ci/run:1: does not run bash scripts/run_tests.sh"
    readme = (ROOT / "README.md").read_text()
    for cmd in ("bash scripts/run_tests.sh", "bash scripts/run_tests.sh -m quick"):
        assert re.search(rf"^{re.escape(cmd)}(\s|$)", readme, re.M), f"README.md:1: does not show {cmd!r}"
    runner = (ROOT / "scripts" / "run_tests.sh").read_text()
    assert re.search(r'-m pytest .*"\$@"', runner), "scripts/run_tests.sh:1: does not pass its arguments to pytest"
    markers = (ROOT / "pyproject.toml").read_text()
    assert '"quick:' in markers, "pyproject.toml:1: no `quick` pytest marker"
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "pytest.mark.quick" in conftest and "quick_tier" in conftest, "tests/conftest.py:1: does not mark the quick tier"
