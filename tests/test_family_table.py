"""scripts/family_table.py: the README's family table from the parity tests' JSON results."""

import json
from pathlib import Path

from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_family_table_renders_results_and_rewrites_only_its_block(tmp_path):
    table = load_script(ROOT / "scripts" / "family_table.py")
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps({
        "families": {"gpt_oss": {"model_class": "GptOssForCausalLM", "features": ["window", "sinks"], "covers": "x"}},
        "results": [{"family": "gpt_oss", "dims": [1, 1, 2], "loss_rel": 2e-8, "grad_rel": 3e-7},
                    {"family": "gpt_oss", "dims": [1, 2, 2], "loss_rel": 5e-8, "grad_rel": 1e-7}]}))
    # Another test's file fills the hybrid column with the same format.
    (results / "b.json").write_text(json.dumps({
        "families": {"qwen3_next": {"model_class": "Qwen3NextForCausalLM", "features": ["hybrid", "moe"]}},
        "results": [{"family": "qwen3_next", "dims": [2, 1, 2], "loss_rel": 1e-7, "grad_rel": 2e-6}]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{table.BEGIN}\nstale\n{table.END}\noutro\n")
    assert table.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert table.main(["--results", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{table.END}\noutro\n") and "stale" not in text
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    oss, nxt = rows["| gpt_oss (GptOssForCausalLM)"], rows["| qwen3_next (Qwen3NextForCausalLM)"]
    assert oss[1:8] == ["yes", "", "yes", "", "", "", ""]  # window, soft-cap, sinks, MLA, MoE, hybrid, VL rope
    assert oss[8:11] == ["sp 2, dp_shard 2 x sp 2", "5.0e-08", "3.0e-07"]  # the worst over meshes
    assert nxt[5:7] == ["yes", "yes"] and nxt[8] == "dp_replicate 2 x sp 2"
    assert table.main(["--results", str(results), "--readme", str(readme), "--check"]) == 0
