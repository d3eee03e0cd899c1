"""Ulysses sequence parallelism + FSDP2 in your own training loop.

CPU (gloo), 4 processes: 2 data-parallel groups of 2 sequence-parallel ranks:

    torchrun --nproc_per_node=4 scripts/example_custom_loop.py --sp_size 2
    torchrun --nproc_per_node=4 scripts/example_custom_loop.py --sp_size 4 --ring_size 2   # USP: ring 2 x ulysses 2

GPU (nccl), e.g. Llama-3-8B at 64K tokens on 8 GPUs:

    torchrun --nproc_per_node=8 scripts/example_custom_loop.py --sp_size 8 \
        --flavor llama3_8b --seq_len 65536 --per_device_train_batch_size 1 --ac_mode full --torch_compile
"""

import argparse
import os

import torch
import torch.distributed as dist

from ulysses_dtensor import (
    ParallelDims,
    clip_grad_norm_,
    global_loss,
    parallelize_llama,
    shard_batch,
    sp_cross_entropy,
)
from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.runtime.process_group import exit_process, finish_together


def synthetic_batch(step, batch_size, seq_len, vocab, dp_rank):
    """Rows of packed documents; each document counts up from a random token.

    Seeded by (step, dp_rank) only, so every sp rank of a group draws the same
    sequences, as SP requires. Positions restart at 0 at each document.
    """
    g = torch.Generator().manual_seed(step * 100_003 + dp_rank)
    ids, pos = [], []
    for _ in range(batch_size):
        row_ids, row_pos = [], []
        while len(row_ids) < seq_len:
            n = int(torch.randint(8, max(9, seq_len // 2), (1,), generator=g))
            start = int(torch.randint(0, vocab, (1,), generator=g))
            row_ids += [(start + i) % vocab for i in range(n)]
            row_pos += list(range(n))
        ids.append(row_ids[:seq_len])
        pos.append(row_pos[:seq_len])
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos)}


def build_parser() -> argparse.ArgumentParser:
    # Flag names as the Trainer / TRL examples spell the same switches (the old spellings still parse).
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp_size", "--sp", type=int, default=2, help="sequence-parallel degree")
    p.add_argument("--ring_size", "--ring", type=int, default=1,
                   help="ring attention inside sp (sp = ring x ulysses; shard_batch reads it off pmesh.sp)")
    p.add_argument("--dp_replicate_size", "--dp-replicate", type=int, default=1, help="HSDP replicas (dp_shard fills the rest)")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq_len", "--seq-len", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", "--batch-size", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--max_steps", "--steps", type=int, default=10)
    p.add_argument("--learning_rate", "--lr", type=float, default=3e-3)
    p.add_argument("--ac_mode", "--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--torch_compile", "--compile", action="store_true")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main():
    args = parse_args()
    # 1. Process group and the 3-D mesh (dp_replicate, dp_shard, sp).
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with finish_together():  # barrier, then destroy the process group
        train(args, device)


def train(args, device):
    cuda = device.type == "cuda"
    pmesh = ParallelDims(dp_replicate=args.dp_replicate_size, dp_shard=-1, sp=args.sp_size, ring=args.ring_size).build_mesh(device.type)

    # 2. Model on meta, parallelized (Ulysses attention, AC, compile, FSDP2), then materialised.
    with torch.device("meta"):
        model = Llama(llama_args(args.flavor))
    parallelize_llama(
        model, pmesh, ac_mode=args.ac_mode, compile=args.torch_compile,
        param_dtype=torch.bfloat16 if cuda else torch.float32,
    )
    model.to_empty(device=device)
    model.init_weights(seed=0)  # the same full weights on any mesh
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)

    # 3. Training loop.
    for step in range(1, args.max_steps + 1):
        # This data-parallel rank's sequences (identical on the sp ranks of its group) ...
        batch = synthetic_batch(step, args.per_device_train_batch_size, args.seq_len, model.args.vocab_size, pmesh.dp_rank)
        # ... padded to a multiple of sp, labels shifted, cut to this rank's slice.
        local = shard_batch({k: v.to(device) for k, v in batch.items()}, pmesh.sp)
        logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
        # This rank's share of the global token mean: the shares SUM to the mean,
        # and parallelize_llama makes FSDP2 sum (not average) the gradients.
        loss = sp_cross_entropy(logits, local["labels"], pmesh.loss)
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = global_loss(loss, pmesh.loss).item()  # a collective: every rank calls it
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss_value:.4f} grad_norm {grad_norm.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank skips interpreter teardown (see ulysses_dtensor.runtime.process_group)
