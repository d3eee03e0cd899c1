"""On CUDA: evaluation at a training length needs no more memory than training at it,
and the all-to-all timer's CUDA events read without synchronising the step.

Skipped without CUDA; scripts/gpu_check.sh runs it (the `tests` piece). One GPU, a
world of one (nccl): the exchange itself is covered on CPU ranks.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_event_timer_reads_span_time():
    from ulysses_dtensor.parallel.comm_timing import ExchangeTimer

    timer = ExchangeTimer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    with timer.span("forward"):
        for _ in range(8):
            x = x @ x / 2048
    with timer.span("backward"):
        x = x @ x
    reading = timer.read()
    assert reading["calls"] == 2 and reading["forward_s"] > 0 and reading["backward_s"] > 0
    assert timer.read()["total_s"] == 0.0  # read clears


def test_gpu_eval_memory_within_a_training_step(tmp_path):
    import torch.distributed as dist

    from ulysses_dtensor.data import ByteTokenizer, FileCorpus
    from ulysses_dtensor.evaluation.runner import EvalSpec, Evaluator
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import count_valid_tokens
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.step import train_step

    seq = 16384
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        pmesh = ParallelDims(1, 1, 1, world_size=1).build_mesh("cuda")
        with torch.device("meta"):
            model = Llama(llama_args("debug", dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                     ffn_dim=1536, vocab_size=32768))
        model = parallelize_llama(model, pmesh, ac_mode="full", param_dtype=torch.bfloat16,
                                  tiled_mlp=True, tiled_loss=True)
        model.to_empty(device="cuda")
        model.init_weights(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 256, (1, seq))
        batch = {k: None if v is None else v.cuda() for k, v in shard_batch({"input_ids": ids}, pmesh.sp).items()}
        n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
        train_step(model, opt, batch, n_valid)  # warm-up: optimizer state exists
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train_step(model, opt, batch, n_valid)
        train_peak = torch.cuda.max_memory_allocated() - base

        docs = tmp_path / "held.txt"
        docs.write_text("Some held-out text to predict. " * 4000)
        ev = Evaluator(model, pmesh, ByteTokenizer(), EvalSpec(tasks=["loss", "passkey"], depths=2,
                       loss_rows=1), torch.device("cuda"), FileCorpus(docs))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = ev.run(1, [seq])
        eval_peak = torch.cuda.max_memory_allocated() - base
        print(f"step peak {train_peak / 2**20:.0f} MiB, eval peak {eval_peak / 2**20:.0f} MiB at {seq} tokens")
        assert eval_peak <= train_peak
        (loss,) = result.of_kind("loss")
        assert loss["tokens"] > 0 and loss["loss"] > 0
        assert torch.cuda.memory_allocated() <= base + 2**20  # nothing left gathered
    finally:
        dist.destroy_process_group()
