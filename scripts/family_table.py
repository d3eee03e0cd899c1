"""The family table of docs/transformers-models.md, generated from the family matrix's checked-in results.

Reads ``ulysses_dtensor/integrations/hf/matrix/results.json`` (what
``tests/test_family_matrix.py`` measured and checks) and rewrites the block of
``docs/transformers-models.md`` between ``<!-- family-table:begin -->`` and ``<!-- family-table:end -->``:
the counts by category, one row per passing family (its class, the patterns its
layers passed, its token mixers, the meshes and worst errors), and the refused
families grouped by reason::

    python scripts/family_table.py              # rewrite docs/transformers-models.md
    python scripts/family_table.py --check      # exit 1 if the page's table differs
    python scripts/family_matrix.py             # measure again first (runs the matrix), then this
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "transformers-models.md"
RESULTS = ROOT / "ulysses_dtensor" / "integrations" / "hf" / "matrix" / "results.json"
BEGIN, END = "<!-- family-table:begin -->", "<!-- family-table:end -->"
CATEGORIES = {"decoder": "decoder-only", "multimodal": "multimodal", "encoder_decoder": "encoder-decoder halves",
              "encoder": "encoders as decoders", "attention_free": "attention-free"}


def short_reason(reason: str) -> str:
    """A refusal reason in a few words (the full one is in the JSON and in the error message)."""
    if reason.startswith("its text model ") and " is refused: " in reason:  # a multimodal model: its text model's
        return short_reason(reason.split(" is refused: ", 1)[1])
    checks = [
        ("does not dispatch attention", "no pluggable attention (not through transformers' attention registry)"),
        ("does not build", "its default config does not build"),
        ("bidirectional", "bidirectional attention"),
        ("an attention mask reached", "an attention mask of its own (dynamic masking)"),
        ("list of decoder layers", "two stacks of decoder layers (hierarchical recurrence)"),
        ("encoder-decoder", "decoder half of an encoder-decoder"),
        ("BERT-style", "bidirectional encoder"),
        ("no attention at all", "attention-free (recurrent / state-space)"),
        ("is not a decoder family of the matrix", "its text model is not a matrix family"),
    ]
    for needle, short in checks:
        if needle in reason:
            return short
    if "layer types" in reason:
        kinds = reason.split("layer types ", 1)[1].split("]", 1)[0] + "]"
        mixers = reason.split("convolution: ", 1)[1].split("]", 1)[0] + "]" if "convolution: " in reason else ""
        return f"layer types {kinds}" + (f" ({mixers})" if mixers else "") + " not exchanged"
    return reason[:120]


def _mark(entry: dict) -> str:
    marks = list(entry.get("patterns", []))
    if entry.get("mla"):
        marks.append("MLA")
    if entry.get("moe"):
        marks.append("MoE" + (" + router loss" if entry.get("router") else ""))
    marks += entry.get("mixers", [])
    return ", ".join(marks)


def render(doc: dict) -> str:
    fams = doc["families"]
    counts = Counter((e["category"], e["status"]) for e in fams.values())
    lines = [f"Measured with transformers {doc['transformers']} (torch {doc['torch']}), fp32, tolerances: loss "
             f"{doc['tolerances']['loss_rel']:g}, every gradient {doc['tolerances']['grad_rel']:g} (relative).", "",
             "| category | pass | text path | refused | fail |", "| --- | --- | --- | --- | --- |"]
    for cat, label in CATEGORIES.items():
        row = [counts.get((cat, s), 0) for s in ("pass", "text path", "refused", "fail")]
        lines.append(f"| {label} | " + " | ".join(map(str, row)) + " |")
    lines += ["", "| family | class | patterns, MLA, MoE, mixers | meshes | worst loss rel. err. | "
                  "worst grad rel. err. |", "| --- | --- | --- | --- | --- | --- |"]
    for name, e in sorted(fams.items()):
        if e["status"] != "pass":
            continue
        meshes = e["meshes"]
        loss = max(m["loss_rel"] for m in meshes.values())
        grad = max(m["grad_rel"] for m in meshes.values())
        lines.append(f"| {name} | {e.get('class', '')} | {_mark(e)} | {', '.join(meshes)} | {loss:.1e} | {grad:.1e} |")
    text = sorted(f"{n} (-> {e['text']})" for n, e in fams.items() if e["status"] == "text path")
    lines += ["", f"Multimodal models whose text model passes (text path): {', '.join(text)}."]
    by_reason = defaultdict(list)
    for name, e in sorted(fams.items()):
        if e["status"] in ("refused", "fail") and e["category"] in ("decoder", "multimodal"):
            by_reason[short_reason(e.get("reason", ""))].append(name)
    lines += ["", "Refused decoder-only and multimodal families, by reason:", ""]
    lines += [f"- {reason}: {', '.join(names)}" for reason, names in sorted(by_reason.items())]
    others = sorted(n for n, e in fams.items() if e["category"] not in ("decoder", "multimodal"))
    lines += ["", f"Refused for what they are (encoder-decoder halves, encoders, attention-free): {', '.join(others)}."]
    return "\n".join(lines)


def rewrite(page: Path, table: str) -> str:
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} block")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    note = "<!-- generated by scripts/family_table.py from ulysses_dtensor/integrations/hf/matrix/results.json -->"
    return f"{before}{BEGIN}\n{note}\n{table}\n{END}{after}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the family matrix's results (JSON)")
    parser.add_argument("--page", "--readme", dest="page", type=Path, default=PAGE,
                        help="the Markdown page holding the table's block (default: docs/transformers-models.md)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page's block differs")
    args = parser.parse_args(argv)
    table = render(json.loads(args.results.read_text()))
    new = rewrite(args.page, table)
    if args.check:
        return int(new != args.page.read_text())
    args.page.write_text(new)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
