"""The planner and the disk tier (issue 54, item 4): with ``memory.offload_dir`` the offloaded
layer inputs are planned on the disk (``--disk-gib``), the host holds a staging area of
``STAGING_LAYERS`` layers and the parameter state, the answer names the ceiling that binds
(device, host or disk), and the plan carries a MODELLED step time with the disk traffic.
Planning never touches the directory."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest

from ulysses_dtensor.estimate import GIB, find_max_seq_len, plan_memory
from ulysses_dtensor.estimate import disk as disk_tier
from ulysses_dtensor.trainer.config import load_config

TINY = [
    "--model.flavor", "debug", "--model.dim", "64", "--model.ffn_dim", "256", "--model.vocab_size", "2048",
    "--training.global_batch_size", "1", "--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
    "--memory.tiled_mlp", "true", "--memory.tiled_loss", "true", "--memory.offload_activations", "true",
    "--memory.mlp_tiles", "8", "--memory.loss_chunks", "8",
]
# Four blocks (traced whole): the staging area (two layers) is half of what goes to the disk.
LAYERS = 4
HOST_ONLY = TINY + ["--model.n_layers", str(LAYERS)]
SEQ = 65536
BLOCK_INPUT = SEQ // 2 * 64 * 4  # a rank's slice of one block input, float32


@pytest.fixture(scope="module")
def nvme(tmp_path_factory):
    """An empty directory named as memory.offload_dir (nothing may be created in it)."""
    return tmp_path_factory.mktemp("nvme")


def _disk_cfg(nvme, *extra: str):
    return load_config(HOST_ONLY + ["--memory.offload_dir", str(nvme), *extra])


@functools.cache
def _search(nvme, **kw):
    base = dict(budget_gib=0.5, headroom_gib=0, host_budget_gib=None)
    return find_max_seq_len(_disk_cfg(nvme), 2, **{**base, **kw})


def test_the_staging_area_follows_the_rule_and_the_rest_goes_to_the_disk(nvme, monkeypatch):
    host = plan_memory(load_config(HOST_ONLY), 2, SEQ)
    disk = plan_memory(_disk_cfg(nvme), 2, SEQ)
    # The device holds what it held with host offload; the offloaded bytes move to the disk.
    assert disk.peak_bytes == host.peak_bytes and disk.phase_peaks == host.phase_peaks
    assert host.host_bytes == disk.disk_bytes == LAYERS * BLOCK_INPUT and host.disk_bytes == 0
    assert disk.staging_bytes == disk_tier.STAGING_LAYERS * BLOCK_INPUT == disk.host_bytes  # no parameter state
    assert disk.features["offload_dir"] == str(nvme) and host.features["offload_dir"] is None
    # With save_attention a layer's slot holds its kept attention outputs too: the staging area
    # holds two such slots.
    kept = plan_memory(_disk_cfg(nvme, "--activation_checkpoint.save_attention", "true"), 2, SEQ)
    slot = kept.disk_bytes // LAYERS
    assert slot > BLOCK_INPUT and kept.staging_bytes == disk_tier.STAGING_LAYERS * slot
    assert kept.step_time["layer_bytes"] == slot
    # Under offload_params the parameter state (and the host AdamW step) is on the host beside
    # the staging area: what the host holds without any offloaded activation.
    params = plan_memory(_disk_cfg(nvme, "--memory.offload_params", "true"), 2, SEQ)
    state = plan_memory(load_config(HOST_ONLY + ["--memory.offload_params", "true", "--memory.offload_activations",
                                                 "false"]), 2, SEQ)
    assert params.staging_bytes == 2 * BLOCK_INPUT and params.host_bytes == params.staging_bytes + state.host_bytes > 0
    # The staging area's size is one constant.
    monkeypatch.setattr(disk_tier, "STAGING_LAYERS", 3)
    split = disk_tier.disk_split(SimpleNamespace(layer_offload=BLOCK_INPUT, disk_peak=LAYERS * BLOCK_INPUT,
                                                 host_fixed=state.host_bytes))
    assert split == {"disk_bytes": LAYERS * BLOCK_INPUT, "staging_bytes": 3 * BLOCK_INPUT,
                     "host_bytes": state.host_bytes + 3 * BLOCK_INPUT}
    assert list(nvme.iterdir()) == []


def test_each_ceiling_binds_where_it_is_the_tightest_and_is_named(nvme):
    free = _search(nvme)  # about 250K tokens, the device's limit
    assert free.binding == "device" and free.disk_tier and free.disk_budget_gib is None
    # Host memory: 0.05 GiB binds; with the disk tier it holds the staging area only, so it
    # binds later than with the offloaded inputs held there.
    host = _search(nvme, host_budget_gib=0.05)
    host_only = find_max_seq_len(load_config(HOST_ONLY), 2, budget_gib=0.5, headroom_gib=0, host_budget_gib=0.05)
    assert host.binding == host_only.binding == "host" and not host_only.disk_tier
    assert host.best.host_bytes <= 0.05 * GIB < host.next_up.host_bytes
    assert host.max_seq_len >= 1.9 * host_only.max_seq_len  # half the offloaded bytes stage on the host
    # The disk: 0.08 GiB binds before the 0.05 GiB of host staging (half of it) would.
    disk = _search(nvme, host_budget_gib=0.05, disk_budget_gib=0.08)
    assert disk.binding == "disk" and disk.disk_budget_gib == 0.08
    assert disk.best.disk_bytes <= 0.08 * GIB < disk.next_up.disk_bytes
    assert disk.best.host_bytes <= 0.85 * 0.05 * GIB and disk.max_seq_len < host.max_seq_len  # host to spare
    for res in (free, host, disk):
        assert res.precision <= 0.005 and res.best.peak_bytes <= 0.5 * GIB
        assert res.to_dict()["binding"] == res.binding and len(res.to_dict()["tried_disk_bytes"]) == len(res.plans)
    assert list(nvme.iterdir()) == []


def test_modelled_disk_seconds_are_bytes_over_bandwidth_and_exposed_past_compute():
    # Llama-3-8B's block on 8 ranks at 1M tokens: attention 2 x 32 heads x 256 x S(S+1)/2 FLOPs
    # forward, the matmuls 2 x 218M weights per token, per rank / 8.
    args = SimpleNamespace(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, n_layers=32)
    dims = SimpleNamespace(sp=8, tp=1)
    s = 1 << 20
    weights = 4096 * (32 * 128 + 8 * 256) + 32 * 128 * 4096 + 3 * 4096 * 14336
    mm, attn = 2 * weights * s / 8, 2 * 32 * 256 * s * (s + 1) / 2 / 8
    rates = disk_tier.Rates(attention_tflops=500, matmul_tflops=800, disk_gbps=2)
    fwd = mm / 800e12 + attn / 500e12
    bwd = 3 * mm / 800e12 + 3 * attn / 500e12  # attention recomputed (no save_attention)
    layer = int(2e9 * (fwd + bwd) / 2)  # a write slower than a layer's forward, a read faster than its backward
    t = disk_tier.modelled_step_time(args, dims, seq_len=s, rows=1, micro=1, vocab=128256, layer_bytes=layer,
                                     save_attention=False, tiled_loss=True, rates=rates)
    assert t["label"] == "MODELLED" and t["write_per_layer_s"] == t["read_per_layer_s"] == layer / 2e9
    assert t["forward_per_layer_s"] == pytest.approx(fwd) and t["backward_per_layer_s"] == pytest.approx(bwd)
    assert t["exposed_forward_s"] == pytest.approx(32 * (layer / 2e9 - fwd)) and t["exposed_backward_s"] == 0
    assert t["exposed_in"] == ["forward"] and t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_s"])
    assert t["disk_bytes_per_step"] == 2 * 32 * layer and t["hidden_down_to_gbps"] == pytest.approx(layer / fwd / 1e9)
    # Keeping attention skips its recompute: less backward to hide the read behind.
    kept = disk_tier.modelled_step_time(args, dims, seq_len=s, rows=1, micro=1, vocab=128256, layer_bytes=layer,
                                        save_attention=True, tiled_loss=True, rates=rates)
    assert kept["backward_per_layer_s"] == pytest.approx(bwd - attn / 500e12)
    with pytest.raises(ValueError, match="disk_gbps"):
        disk_tier.Rates(disk_gbps=0)


def test_cli_names_the_binding_and_prints_the_modelled_step_time(nvme, capsys):
    from ulysses_dtensor.estimate.cli import main

    args = [*HOST_ONLY, "--memory.offload_dir", str(nvme / "not-made"), "--world-size", "2", "--max-seq-len",
            "--budget-gib", "0.5", "--headroom-gib", "0", "--host-budget-gib", "0.05", "--disk-gib", "0.08",
            "--disk-gbps", "1.5", "--achieved-tflops", "400", "600"]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "binding ceiling: disk\n" in out and "disk: 0.08 GiB per GPU (--disk-gib)" in out
    assert "MODELLED step time" in out and "400 TFLOP/s (attention) and 600 TFLOP/s (matmuls)" in out
    assert "1.5 GB/s" in out and "staging area" in out
    assert main(args + ["--disk-gib", "-1"]) == 2 and "--disk-gib" in capsys.readouterr().err
    assert not (nvme / "not-made").exists() and list(nvme.iterdir()) == []
    # --json prints the search's dict: the same search through the API (the test above's).
    res = json.loads(json.dumps(_search(nvme, host_budget_gib=0.05, disk_budget_gib=0.08).to_dict()))
    assert res["binding"] == "disk" and res["disk_budget_gib"] == 0.08 and res["disk_tier"]
    assert res["best"]["step_time"]["label"] == "MODELLED" and res["best"]["disk_bytes"] <= 0.08 * GIB
