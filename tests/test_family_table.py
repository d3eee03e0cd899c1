"""scripts/family_table.py: the family table of docs/transformers-models.md from the family matrix's results."""

import json
from pathlib import Path

from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


def _doc() -> dict:
    mesh = lambda loss, grad: {"loss_rel": loss, "grad_rel": grad, "worst": "w", "forward": {}}  # noqa: E731
    return {"transformers": "9.9.9", "torch": "2.13", "tolerances": {"loss_rel": 1e-5, "grad_rel": 1e-4},
            "families": {
                "gpt_oss": {"category": "decoder", "status": "pass", "class": "GptOssForCausalLM",
                            "patterns": ["sinks", "window"], "moe": True, "router": True, "mixers": [],
                            "meshes": {"sp 2": mesh(2e-8, 3e-7), "dp_shard 2 x sp 2": mesh(5e-8, 1e-7)}},
                "bamba": {"category": "decoder", "status": "pass", "class": "BambaForCausalLM", "patterns": [],
                          "mixers": ["Mamba-2"], "meshes": {"sp 2": mesh(0.0, 1e-6)}},
                "bloom": {"category": "decoder", "status": "refused",
                          "reason": "BloomForCausalLM does not dispatch attention through transformers' ..."},
                "mpt": {"category": "decoder", "status": "refused",
                        "reason": "MptForCausalLM does not dispatch attention through transformers' ..."},
                "gemma3": {"category": "multimodal", "status": "text path", "text": "gemma3_text"},
                "bert": {"category": "encoder", "status": "refused", "reason": "a bidirectional encoder"},
            }}


def test_family_table_renders_the_results_and_rewrites_only_its_block(tmp_path):
    table = load_script(ROOT / "scripts" / "family_table.py")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_doc()))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{table.BEGIN}\nstale\n{table.END}\noutro\n")
    args = ["--results", str(results), "--page", str(page)]
    assert table.main([*args, "--check"]) == 1
    assert table.main(args) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{table.END}\noutro\n") and "stale" not in text
    assert "transformers 9.9.9" in text
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["| decoder-only"][1:4] == ["2", "0", "2"]  # pass, text path, refused
    assert rows["| multimodal"][1:3] == ["0", "1"]
    oss = rows["| gpt_oss"]
    assert oss[2] == "sinks, window, MoE + router loss"
    assert oss[3:6] == ["sp 2, dp_shard 2 x sp 2", "5.0e-08", "3.0e-07 |"]  # the worst over meshes
    assert rows["| bamba"][2] == "Mamba-2"
    # Refused families grouped under one short reason each.
    assert "- no pluggable attention (not through transformers' attention registry): bloom, mpt" in text
    assert "gemma3 (-> gemma3_text)" in text and "attention-free): bert." in text
    assert table.main([*args, "--check"]) == 0


def test_docs_family_table_is_the_checked_in_results():
    table = load_script(ROOT / "scripts" / "family_table.py")
    assert table.PAGE == ROOT / "docs" / "transformers-models.md"
    assert table.main(["--check"]) == 0, (
        "docs/transformers-models.md's family table is stale: run python scripts/family_table.py")
