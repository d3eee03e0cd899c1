"""One flag name per switch across scripts/example_*.py, and the docs use that name.

The examples mix two parsers (argparse in the custom loops, HfArgumentParser with
TrainingArguments / TRL configs / UlyssesArguments in the others). A switch they share is
spelt one way in all of them: the name the HF side uses. An old spelling may still parse
(an alias), but every example that has the switch accepts the canonical name, and no
command shown in README.md or docs/ uses another.
"""

import re
from pathlib import Path

import pytest

from script_module import load_script

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "scripts").glob("example_*.py"))
# canonical name first, then the spellings it replaced
SWITCHES = [
    ("--sp_size", "--sp"), ("--ring_size", "--ring"), ("--dp_replicate_size", "--dp-replicate"),
    ("--model_dir", "--model-dir"), ("--dataset", "--data"), ("--max_steps", "--steps"),
    ("--learning_rate", "--lr"), ("--output_dir", "--save-dir"), ("--torch_compile", "--compile"),
    ("--attn_backend", "--attn-backend"), ("--seq_len", "--seq-len"),
    ("--per_device_train_batch_size", "--batch-size"), ("--offload_activations", "--activation_offloading"),
]


def _options(script: Path) -> set[str]:
    parser = load_script(script).build_parser()
    return {opt for action in parser._actions for opt in action.option_strings}


def test_every_example_accepts_the_canonical_name_of_each_switch_it_has():
    problems = []
    for script in EXAMPLES:
        options = _options(script)
        for canonical, *old in SWITCHES:
            if options & set(old) and canonical not in options:
                problems.append(f"{script.name}: has {sorted(options & set(old))} but not {canonical}")
    assert not problems, "\n".join(problems)
    assert len(EXAMPLES) >= 6


def test_docs_show_only_the_canonical_names():
    problems = []
    old_names = {o: c for c, *olds in SWITCHES for o in olds}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *EXAMPLES]
    for page in pages:
        command = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "example_" in line and ".py" in line:
                command = True  # a command of an example script, possibly over several lines
            elif not line.rstrip().endswith("\\") and not line.startswith((" ", "\t", "--")):
                command = command and line.strip().startswith("--")
            if not command:
                continue
            for flag in re.findall(r"(?<![\w-])--[\w-]+", line):
                if flag in old_names:
                    problems.append(f"{page.relative_to(ROOT)}:{n}: {flag} (write {old_names[flag]})")
            if not line.rstrip().endswith("\\"):
                command = False
    assert not problems, "\n".join(problems)
