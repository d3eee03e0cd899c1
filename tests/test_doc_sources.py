"""Citation format: (PATH, "Heading") for a Markdown section, (PATH: key=value ...) for JSON records.

One source for every figure and option: the config reference is generated from the schema;
what the docs (README.md, docs/*.md) and the configs' comments (train_configs/*.toml) point
at exists; every figure they cite is in its source.

* Citations, the same in configs and docs, PATH from the repository root, each on one line:
  ``(PATH.md, "Heading")`` names a section of a Markdown file by its heading, or by the
  heading's start when only one heading starts so, e.g.
  ``(benchmarks/RESULTS.md, "PLANNED longest context with head chunks")``;
  ``(PATH.json[l]: key=value ...)`` names the records of a JSON / JSON-lines file whose fields
  (dotted keys reach inside: ``features.save_attention=false``) have those values, e.g.
  ``(benchmarks/max_seq_len_2026-11-28.jsonl: model=qwen3_8b gpus=8)``; a test id
  ``tests/x.py::test_y`` names a test that measures and prints the paragraph's figures.
  Citations, test ids, repository paths and config names must resolve.
* A *figure* is a number with a unit (GiB, GB, tok/s, s/step, %, min, s, ...), a count
  with a K / M suffix, or a number of 5 digits or more. Every figure of a paragraph that
  cites sections or records must be in one of them, rounded as written (6.64M is 6,637,568,
  128K is 131,072). In a config's header, and in its comments that say PLANNED, every figure
  needs such a citation, except the config's own values and their quotients (128K for
  seq_len 131072, seq_len / sp per GPU), GPU sizes (8 x 80 GB), flags' values and commands,
  and arithmetic shown where it stands (``a x b = 67 GB``). The same for the paragraphs of
  :data:`FIGURE_PAGES` that say PLANNED or measured.
* GPU runs: a GPU config (its header starts ``# NEEDS``) and a docs command block that needs
  GPUs (:func:`_needs_gpus`) say "Not yet run on a GPU" (in the config's header; in the
  paragraph leading into the block, the 3 lines above its fence or a comment in it), or cite
  the section of benchmarks/RESULTS.md recording a GPU run (its heading names the NVIDIA
  device) that names the config or the block's programs.

Each failure is one line ``file:line: problem``.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from test_docs import PAGES, REPO_PATH, ROOT, TESTED_BY, Block, _check_reference, _code_lines, _command_blocks, _rel

CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# Pages whose PLANNED / measured figures must cite their source: page -> the section
# checked (None: the whole page).
FIGURE_PAGES = {ROOT / "README.md": "Figures", ROOT / "docs" / "memory-and-planner.md": None,
                ROOT / "docs" / "hf-checkpoints.md": None}
NOT_RUN = "not yet run on a gpu"

MD_CITE = re.compile(r'\(([\w./-]+\.md), "([^"]+)"\)')
JSON_CITE = re.compile(r"\(([\w./-]+\.jsonl?):((?:\s+[\w.]+=[^\s()]+)+)\s*\)")
TEST_ID = re.compile(r"tests/[\w/]+\.py::\w+(?:::\w+)?")
# A file named with a quoted section that is not the format above: (README, "X"), RESULTS.md ("X").
LOOSE_CITE = re.compile(r'(?<![\w/.])((?:[\w./-]+/)?(?:README|RESULTS)(?:\.md)?|[\w./-]+\.md)\)?,?\s*\(?"([^"]+)"')
CONFIG_NAME = re.compile(r"(?<![\w/.-])([a-z0-9_]+\.toml)\b")
UNITS = r"GiB|MiB|TiB|GB|MB|TB|tok/s|tokens/s|s/step|TFLOP/s|ms|min|s|%"
NUMBER = re.compile(
    rf"(?<![\w.,/=])(?P<int>\d{{1,3}}(?:,\d{{3}})+|\d+)(?P<dec>\.\d+)?"
    rf"(?:(?P<sfx>[KM])(?![\w])|\s?(?P<unit>{UNITS})(?![\w/])|(?![\w]|\.\d))")
RANGE_END = re.compile(rf"\s*(?:->|-|to)\s*[\d,.]+(?:(?P<sfx>[KM])(?!\w)|\s?(?P<unit>{UNITS})(?![\w/]))")
FLAG_VALUE = re.compile(r"--[\w.-]+[ =]\S+")  # numbers given to a flag are settings, not figures
GPU_SIZE = re.compile(r"^(?:\+|\s*\(?(?:GPU|H100|H200|A100|class))")
GPU_BEFORE = re.compile(r"(?:\bx|H100|H200|A100)[/\w]*\s*$")
# Words of commands that need GPUs: the device, vLLM rollouts, several nodes, the GPU kit.
GPU_WORDS = re.compile(r"\bcuda\b|--use_vllm|\bNNODES=|multinode_torchrun\.sh|\bsbatch\b|gpu_perf\.py|gpu_attention_matrix\.py")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
FILE_NAME = re.compile(r"[\w./-]+\.(?:jsonl?|md|py|toml)")  # max_seq_len_2026-11-28.jsonl: no figures


# --------------------------------------------------------------------------- #
# Figures and the numbers of a source
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Figure:
    text: str
    value: float
    decimals: int
    suffix: str  # "", "K" or "M"
    unit: str

    def matches(self, number: float) -> bool:
        """``number`` (from a source) written as this figure is written: 606K is 606,336; 128K is 131,072."""
        scales = {"": [1], "K": [1e3, 2**10], "M": [1e6, 2**20]}[self.suffix]
        return any(math.isclose(round(number / s, self.decimals), self.value, rel_tol=1e-9, abs_tol=1e-9)
                   for s in scales)


def _figure(m: re.Match, suffix: str, unit: str) -> Figure:
    value = float(m["int"].replace(",", "") + (m["dec"] or ""))
    return Figure(m.group(0).strip(), value, len(m["dec"] or ".") - 1, suffix, unit)


def _numbers(text: str) -> list[float]:
    """Every number of a text as a value; a K / M count both ways (128K: 128,000 and 131,072)."""
    out = []
    for m in NUMBER.finditer(text):
        value = _figure(m, "", "").value
        scales = {"K": (1e3, 2**10), "M": (1e6, 2**20)}.get(m["sfx"] or "", (1,))
        out += [value * s for s in scales]
    return out


def _worked_out(text: str) -> list[tuple[int, int]]:
    """Spans of arithmetic shown where it stands, ``a x b = c (d)``: its figures need no source."""
    spans = []
    for m in re.finditer(r"=\s*~?(?:[\d,.]+\s*\w+/?\w*)(?:\s*\([^()]*\))?", text):
        start, depth = m.start(), 0
        while start > 0:  # back to the expression's start: an unclosed "(", or a ":" / ";" outside brackets
            ch = text[start - 1]
            depth += {")": 1, "(": -1}.get(ch, 0)
            if depth < 0 or (depth == 0 and ch in ":;"):
                break
            start -= 1
        if re.search(r"\sx\s", text[start:m.start()]):
            spans.append((start, m.end()))
    return spans


def _figures(text: str) -> list[tuple[Figure, int]]:
    """(figure, offset) for the figures of a text: a unit, a K / M count, or 5 digits or more."""
    text = FLAG_VALUE.sub(lambda m: " " * len(m.group(0)), text)
    arithmetic = _worked_out(text)
    out = []
    for m in NUMBER.finditer(text):
        unit, sfx = m["unit"] or "", m["sfx"] or ""
        if not (unit or sfx) and (later := RANGE_END.match(text[m.end():])):
            unit, sfx = later["unit"] or "", later["sfx"] or ""  # 20.9 -> 25.0 GiB, 72-80 MiB: the unit of both
        big = not m["dec"] and int(m["int"].replace(",", "")) >= 10_000
        if not (unit or sfx or big) or any(a <= m.start() < b for a, b in arithmetic):
            continue
        if unit in ("GB", "TB") and (GPU_SIZE.match(text[m.end():]) or GPU_BEFORE.search(text[:m.start()])):
            continue  # the GPU's size (80 GB GPUs, 8 x 80 GB, a 141 GB H200): hardware, not a result
        out.append((_figure(m, sfx, unit), m.start()))
    return out


def _values(obj) -> list[float]:
    """Every number in a JSON value, recursively."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in _values(x)]
    if isinstance(obj, (list, tuple)):
        return [v for x in obj for v in _values(x)]
    return []


# --------------------------------------------------------------------------- #
# Sources: Markdown sections and JSON records
# --------------------------------------------------------------------------- #


def _plain(heading: str) -> str:
    return re.sub(r"[`*]", "", heading).strip()


@lru_cache(maxsize=None)
def _sections(path: Path) -> tuple[tuple[str, int, str], ...]:
    """(heading, line, the section's text up to the next heading of its level or above)."""
    lines = path.read_text().splitlines()
    code = _code_lines(path) if path.suffix == ".md" else frozenset()
    heads = [(n, len(m[1]), _plain(m[2])) for n, text in enumerate(lines, 1)
             if n not in code and (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", text))]
    out = []
    for i, (n, level, title) in enumerate(heads):
        end = next((m for m, lv, _ in heads[i + 1:] if lv <= level), len(lines) + 1)
        out.append((title, n, "\n".join(lines[n - 1:end - 1])))
    return tuple(out)


def _section(path: Path, title: str) -> tuple[str | None, str]:
    """(the section's text, "") or (None, the problem)."""
    want = _plain(title)
    found = [s for s in _sections(path) if s[0] == want]
    if not found:  # the start of a heading, at a word boundary
        found = [s for s in _sections(path)
                 if s[0].startswith(want) and not (s[0][len(want):len(want) + 1].isalnum())]
    if len(found) == 1:
        return found[0][2], ""
    if not found:
        return None, f"{_rel(path)} has no heading {title!r} (nor one starting with it)"
    return None, f"{_rel(path)} has {len(found)} headings starting with {title!r} (lines " \
                 f"{', '.join(str(s[1]) for s in found)}): quote more of it"


@lru_cache(maxsize=None)
def _records(path: Path) -> tuple[dict, ...]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return tuple(data) if isinstance(data, list) else (data,)
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


_MISSING = object()


def _field(record: dict, key: str):
    """``record[key]``, a dotted key reaching into nested objects (features.save_attention)."""
    for part in key.split("."):
        if not isinstance(record, dict) or part not in record:
            return _MISSING
        record = record[part]
    return record


def _same(value, wanted: str) -> bool:
    """A record's field equals a filter's value, written as JSON writes it (240 is 240.0; null, true)."""
    try:
        wanted = json.loads(wanted)
    except ValueError:
        pass  # a bare word: a string
    if value is _MISSING:
        return False
    if isinstance(value, bool) or isinstance(wanted, bool) or value is None or wanted is None:
        return value is wanted
    if isinstance(value, (int, float)) and isinstance(wanted, (int, float)):
        return float(value) == float(wanted)
    return str(value) == str(wanted)


@dataclass
class Source:
    text: str  # the citation as written
    numbers: list[float] | None  # None: a test id, the figure is what it prints
    problem: str = ""


def _resolve(cite: re.Match, kind: str) -> Source:
    if kind == "md":
        path = ROOT / cite[1]
        if not path.is_file():
            return Source(cite[0], [], f"{cite[0]}: no file {cite[1]}")
        text, problem = _section(path, cite[2])
        if text is None:
            return Source(cite[0], [], f"{cite[0]}: {problem}")
        return Source(cite[0], _numbers(text))
    if kind == "json":
        path = ROOT / cite[1]
        if not path.is_file():
            return Source(cite[0], [], f"{cite[0]}: no file {cite[1]}")
        filters = [f.split("=", 1) for f in cite[2].split()]
        rows = [r for r in _records(path) if all(_same(_field(r, k), v) for k, v in filters)]
        if not rows:
            return Source(cite[0], [], f"{cite[0]}: no record of {cite[1]} has {cite[2].strip()}")
        return Source(cite[0], [v for r in rows for v in _values(r)])
    problem = _check_reference(cite[0])
    return Source(cite[0], None, f"{cite[0]}: {problem}" if problem else "")


def _citations(text: str) -> list[Source]:
    return ([_resolve(m, "md") for m in MD_CITE.finditer(text)]
            + [_resolve(m, "json") for m in JSON_CITE.finditer(text)]
            + [_resolve(m, "test") for m in TEST_ID.finditer(text)])


def _without_citations(text: str) -> str:
    """The text with citations, links' targets and test ids blanked (their numbers are no figures)."""
    for pattern in (MD_CITE, JSON_CITE, TEST_ID, LINK_TARGET, FILE_NAME):
        text = pattern.sub(lambda m: " " * len(m.group(0)), text)
    return text


def _loose(text: str) -> list[str]:
    """Citations by section name that are not in the format."""
    well_formed = {m.start(1) for m in MD_CITE.finditer(text)}
    return [f'{m.group(0)!r}: write (PATH, "Heading") with PATH from the repository root, e.g. '
            f'({m[1] if m[1].endswith(".md") else m[1] + ".md"}, "{m[2]}")'
            for m in LOOSE_CITE.finditer(text) if m.start(1) not in well_formed]


# --------------------------------------------------------------------------- #
# Paragraphs: configs' comments and docs' prose
# --------------------------------------------------------------------------- #


@dataclass
class Paragraph:
    file: Path
    lines: list[tuple[int, str]]  # (line number, text)
    must_cite: bool = False  # its figures need a citation (a config header; a PLANNED page paragraph)
    context: str = ""  # text whose citations also count (a table's caption)
    exempt: set[float] = field(default_factory=set)  # a config's own values

    @property
    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)


def _command_line(text: str) -> bool:
    word = text.strip().split(" ", 1)[0]
    return bool(word) and (word in ("python", "torchrun", "hf", "pip", "bash", "sbatch", "accelerate")
                           or word.startswith("scripts/") or re.fullmatch(r"[A-Z_]+=\S*", word) is not None)


def _toml_values(path: Path) -> set[float]:
    """A config's numbers and their quotients (seq_len / sp: tokens per GPU)."""
    values = {v for v in _values(tomllib.loads(path.read_text())) if v > 0}
    return values | {a / b for a in values for b in values if a > b and (a / b).is_integer()}


@lru_cache(maxsize=None)
def _header_end(path: Path) -> int:
    """The last line of a config's header: its leading comment block."""
    lines = path.read_text().splitlines()
    n = 0
    while n < len(lines) and lines[n].startswith("#"):
        n += 1
    return n


def _config_paragraphs(path: Path) -> list[Paragraph]:
    """The header's paragraphs (split at `#` lines and `* ` bullets; command lines dropped), then
    the comment blocks below it."""
    out, current, continued = [], [], False
    for n, raw in enumerate(path.read_text().splitlines()[:_header_end(path)], 1):
        text = raw[1:]
        command = continued or _command_line(text)
        continued = command and text.rstrip().endswith("\\")
        if not text.strip() or text.lstrip().startswith("* "):
            if current:
                out.append(current)
            current = []
        if text.strip() and not command:
            current.append((n, text))
    if current:
        out.append(current)
    values = _toml_values(path)
    header = [Paragraph(path, p, must_cite=True, exempt=values) for p in out]
    # Below the header, each run of whole-line comments: its figures need a source when it says PLANNED.
    body, current = [], []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if n > _header_end(path) and raw.lstrip().startswith("#") and not _command_line(raw.lstrip()[1:]):
            current.append((n, raw.lstrip()[1:]))
        elif current:
            body.append(current)
            current = []
    body.append(current)
    return header + [Paragraph(path, p, must_cite="PLANNED" in "".join(t for _, t in p), exempt=values)
                     for p in body if p]


def _doc_paragraphs(page: Path) -> list[Paragraph]:
    """Prose paragraphs (list items and tables each their own), code blocks left out."""
    code = _code_lines(page)
    checked = FIGURE_PAGES.get(page, False)
    lines = page.read_text().splitlines()
    in_scope = set(range(1, len(lines) + 1)) if checked is None else set()
    if checked:
        for title, n, body in _sections(page):
            if title == checked:
                in_scope = set(range(n, n + body.count("\n") + 1))
    out: list[Paragraph] = []
    current: list[tuple[int, str]] = []
    caption = ""

    def close():
        nonlocal current, caption
        if current:
            table = current[0][1].lstrip().startswith("|")
            para = Paragraph(page, current, context=caption if table else "")
            para.must_cite = (any(n in in_scope for n, _ in current)
                              and re.search(r"\bPLANNED\b|\b[Mm]easured\b", para.text + para.context) is not None)
            out.append(para)
            caption = "" if table else para.text
        current = []

    for n, text in enumerate(lines, 1):
        if n in code or not text.strip() or text.startswith("#"):
            close()
            if n in code or text.startswith("#"):
                caption = ""
            continue
        new_item = re.match(r"^\s*(?:[-*]|\d+\.)\s", text) is not None
        table = text.lstrip().startswith("|")
        if current and (new_item or table != current[-1][1].lstrip().startswith("|")):
            close()
        current.append((n, text))
    close()
    return out


def _all_paragraphs() -> list[Paragraph]:
    return [p for c in CONFIGS for p in _config_paragraphs(c)] + [p for page in PAGES for p in _doc_paragraphs(page)]


def _figure_problems(para: Paragraph) -> list[str]:
    sources = _citations(para.text) + _citations(para.context)
    found = [s for s in sources if not s.problem]
    if any(s.numbers is None for s in found):
        return []  # measured by a test the paragraph names: the figures are what it prints
    problems = []
    text = _without_citations(para.text)
    for fig, offset in _figures(text):
        where = f"{_rel(para.file)}:{para.lines[text.count(chr(10), 0, offset)][0]}"
        if fig.unit == "" and any(fig.matches(v) for v in para.exempt):
            continue  # a setting of the config itself (128K: seq_len 131072, or seq_len / sp)
        if found and not any(fig.matches(v) for s in found for v in s.numbers):
            problems.append(f"{where}: figure {fig.text!r} is not in {' nor '.join(s.text for s in found)}: "
                            f"correct it, or cite where it is")
        elif para.must_cite and not sources:
            problems.append(f'{where}: figure {fig.text!r} cites no source: add (benchmarks/RESULTS.md, "Heading") '
                            f"or (benchmarks/FILE.jsonl: key=value ...) to its paragraph")
    return problems


# --------------------------------------------------------------------------- #
# GPU runs
# --------------------------------------------------------------------------- #


@lru_cache(maxsize=None)
def _gpu_configs() -> frozenset[str]:
    return frozenset(c.name for c in CONFIGS if c.read_text().startswith("# NEEDS"))


@lru_cache(maxsize=None)
def _gpu_run_sections() -> tuple[tuple[str, str], ...]:
    """(heading, text) of RESULTS.md's sections recording a GPU run: their heading names the device."""
    return tuple((t, body) for t, _, body in _sections(RESULTS) if re.search(r"\bNVIDIA\b", t))


def _program(command: str) -> str:
    """What a command runs: a script, or a module with its config."""
    words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    for i, w in enumerate(words):
        if w in ("-m", "--module") and i + 1 < len(words):
            config = next((words[j + 1] for j in range(i, len(words) - 1) if words[j] == "--config"), "")
            return f"{words[i + 1]} {Path(config).name}".strip()
        if re.search(r"\.(?:py|sh)$", w):
            return Path(w).name
    return words[0] if words else ""


def _needs_gpus(command: str) -> bool:
    m = re.search(r"--nproc_per_node[= ](\d+)", command)
    if m and int(m[1]) >= 8:
        return True
    if GPU_WORDS.search(command):
        return True
    if re.search(r"scripts/gpu_\w+\.sh", command) and "--list" not in command:
        return True
    trainer = re.search(r"-m ulysses_dtensor\.(?:train|eval)\b|scripts/run_train\.sh", command)
    config = re.search(r"--config\s+\S*?([\w.-]+\.toml)", command)
    return bool(trainer and config and config[1] in _gpu_configs())


def _ran_on_a_gpu(text: str, names: list[str]) -> bool:
    """``text`` cites a GPU run's section of RESULTS.md that names each of ``names``."""
    for m in MD_CITE.finditer(text):
        if (ROOT / m[1]).resolve() != RESULTS:
            continue
        body, _ = _section(RESULTS, m[2])
        if body is not None and any(body == b for _, b in _gpu_run_sections()) \
                and all(name.split()[-1] in body for name in names):
            return True
    return False


def _lead_in(block: Block) -> list[str]:
    """The paragraph that leads into a block: above its fence, past blank lines and HTML comments."""
    lines = block.page.read_text().splitlines()[:block.line - 1]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("<!--")):
        lines.pop()
    out = []
    while lines and lines[-1].strip() and not lines[-1].startswith(("#", "```")):
        out.insert(0, lines.pop())
    return out


def _gpu_block_problems(block: Block) -> list[str]:
    gpu = [c for _, c in block.commands() if _needs_gpus(c)]
    if not gpu:
        return []
    comments = [line for line in block.lines if line.lstrip().startswith("#")]
    around = "\n".join(block.above + _lead_in(block) + comments)
    if NOT_RUN in re.sub(r"\s+", " ", around.lower()) or _ran_on_a_gpu(around, [_program(c) for c in gpu]):
        return []
    return [f"{block.where}: needs GPUs ({gpu[0][:60]!r}) and does not say whether it ran on one: put "
            f"'Not yet run on a GPU' in the paragraph that leads into it, or cite its GPU run "
            f'(benchmarks/RESULTS.md, "NVIDIA ...")']


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_config_reference_is_generated():
    from ulysses_dtensor.trainer.config_reference import COMMAND, stale

    problem = stale()
    assert problem is None, f"{problem}\nregenerate it: {COMMAND}"


def _pointer_problems(file: Path, lines: list[tuple[int, str]], paths: bool) -> list[str]:
    problems = []
    for n, text in lines:
        where = f"{_rel(file)}:{n}"
        problems += [f"{where}: {s.problem}" for s in _citations(text) if s.problem]
        problems += [f"{where}: {p}" for p in _loose(text)]
        opened = len(re.findall(r'\((?:[\w.-]*/[\w./-]*|README)\.(?:md, "|jsonl?:)', text))
        if opened > len(MD_CITE.findall(text)) + len(JSON_CITE.findall(text)):
            problems.append(f"{where}: a citation that does not close on its line: keep each citation on one line")
        if paths:
            problems += [f"{where}: {p} does not exist" for p in REPO_PATH.findall(text) if not (ROOT / p).exists()]
        problems += [f"{where}: {name} is not in train_configs/" for name in CONFIG_NAME.findall(text)
                     if name != "pyproject.toml" and not (ROOT / "train_configs" / name).exists()]
    return problems


def test_pointers_resolve():
    """Citations, test ids, paths and config names in the configs' comments and the docs' prose."""
    problems = []
    for config in CONFIGS:
        comments = [(n, line[line.index("#"):]) for n, line in enumerate(config.read_text().splitlines(), 1)
                    if "#" in line]
        problems += _pointer_problems(config, comments, paths=True)
    for page in PAGES:  # test_docs checks the pages' paths, links and tested-by lines
        code = _code_lines(page)
        problems += _pointer_problems(page, [(n, t) for n, t in enumerate(page.read_text().splitlines(), 1)
                                             if n not in code and not TESTED_BY.match(t)], paths=False)
    assert not problems, "\n".join(problems)


def test_figures_come_from_their_cited_source():
    """Figures in a citing paragraph are in its sources; config headers and PLANNED pages cite theirs."""
    problems = [p for para in _all_paragraphs() for p in _figure_problems(para)]
    assert not problems, "\n".join(problems)


def test_gpu_configs_say_whether_they_ran_on_a_gpu():
    problems = []
    for config in CONFIGS:
        text = config.read_text()
        header = "\n".join(text.splitlines()[:_header_end(config)])
        if not config.name.startswith("debug_") and not text.startswith("# NEEDS"):
            problems.append(f"{_rel(config)}:1: not a debug_ config, and its header does not start with "
                            f"'# NEEDS GPUs' (or '# NEEDS one GPU')")
        elif config.name in _gpu_configs() and NOT_RUN not in header.lower() \
                and not _ran_on_a_gpu(header, [config.name]):
            problems.append(f"{_rel(config)}:1: GPU config whose header does not say 'Not yet run on a GPU' "
                            f'nor cite its GPU run (benchmarks/RESULTS.md, "NVIDIA ...")')
    assert not problems, "\n".join(problems)
    assert len(_gpu_configs()) >= 10


def test_gpu_commands_in_docs_say_whether_they_ran_on_a_gpu():
    blocks = _command_blocks()
    problems = [p for b in blocks for p in _gpu_block_problems(b)]
    assert not problems, "\n".join(problems)
    assert sum(1 for b in blocks if any(_needs_gpus(c) for _, c in b.commands())) >= 10


def test_the_checks_catch_what_they_should(tmp_path):
    """Each rule on a small made-up case, both ways."""
    # Figures: rounding as written, K in thousands or 1024s, a GPU's size, flags.
    assert [f.text for f, _ in _figures("6.64M tokens at 71.6 GiB, 80 GB GPUs, --budget-gib 80, step 2026")] \
        == ["6.64M", "71.6 GiB"]
    assert [f.text for f, _ in _figures("20.9 -> 25.0 GiB, 72-80 MiB")] == ["20.9", "25.0 GiB", "72", "80 MiB"]
    worked_out = "the logits (128K x 128,256 vocab x 4 bytes = 67 GB per GPU) at 9 GiB"
    assert [f.text for f, _ in _figures(worked_out)] == ["9 GiB"]  # arithmetic shown where it stands
    six = _figures("6.64M")[0][0]
    assert six.matches(6_637_568) and not six.matches(6_659_776)
    assert _figures("128K")[0][0].matches(131_072) and _figures("606K")[0][0].matches(606_336)
    # Sources: a section by its heading's start, records by their fields.
    text, problem = _section(RESULTS, "PLANNED longest context with head chunks")
    assert text and "6,637,568" in text and not problem
    assert _section(RESULTS, "The longest context for every family")[0] is None
    assert _section(RESULTS, "PLANNED")[1].startswith("benchmarks/RESULTS.md has ")  # ambiguous
    cite = "(benchmarks/max_seq_len_2026-11-28.jsonl: model=qwen3_8b gpus=8 host_budget_gib=240)"
    (src,) = _citations(cite)
    assert not src.problem and 6_637_568 in src.numbers
    assert _citations(cite.replace("gpus=8", "gpus=3"))[0].problem
    assert _loose('(README, "Evaluation")') and _loose('benchmarks/RESULTS.md ("LoRA")')
    assert not _loose('(docs/evaluation.md, "What is evaluated")')
    # A config header: a cited figure checked, an uncited one found, its own values exempt.
    config = tmp_path / "x.toml"
    config.write_text('# NEEDS GPUs: 1M tokens on 8 x 80GB GPUs; 7.70M fit\n'
                      '# (benchmarks/RESULTS.md, "PLANNED longest context with head chunks").\n#\n'
                      "# 12.5 GiB per GPU.\n#   python -m ulysses_dtensor.estimate --seq-len 99999\n"
                      "[training]\nseq_len = 1048576\n")
    problems = [p for para in _config_paragraphs(config) for p in _figure_problems(para)]
    assert len(problems) == 1 and "'12.5 GiB' cites no source" in problems[0], problems
    config.write_text(config.read_text().replace("7.70M", "7.71M"))
    problems = [p for para in _config_paragraphs(config) for p in _figure_problems(para)]
    assert any("'7.71M' is not in" in p for p in problems), problems
    # GPU commands: by ranks, device, config; the planner and the CPU debug runs are not.
    assert _needs_gpus("torchrun --nproc_per_node=8 -m ulysses_dtensor.train --config train_configs/debug_model.toml")
    assert _needs_gpus("bash scripts/run_train.sh --config train_configs/llama3_8b_128k.toml")
    assert not _needs_gpus("python -m ulysses_dtensor.estimate --config train_configs/llama3_8b_128k.toml")
    assert not _needs_gpus("bash scripts/gpu_check.sh --list")
    assert _program("NNODES=4 bash scripts/multinode_torchrun.sh --config x.toml") == "multinode_torchrun.sh"
    assert _ran_on_a_gpu('(benchmarks/RESULTS.md, "NVIDIA H200, first GPU run")', ["gpu_check_lease.sh"])
    assert not _ran_on_a_gpu('(benchmarks/RESULTS.md, "NVIDIA H200, first GPU run")', ["gpu_perf.sh"])
