"""Continued pretraining of a local Hugging Face model directory with Ulysses SP + FSDP2.

The model is transformers' own (``AutoModelForCausalLM``), unmodified: Ulysses
attention is plugged in through transformers' attention registry. It is built
on the meta device, parallelized, and each rank loads only its FSDP shards
from the safetensors files; ``--output_dir`` writes the trained weights back as
an HF directory.

CPU (gloo), 2 processes, a tiny Llama that the script makes itself:

    torchrun --nproc_per_node=2 scripts/example_hf_custom_loop.py \\
        --model_dir /tmp/tiny-llama --make_tiny --sp_size 2

GPU (nccl, bf16 compute, fp32 master weights), Llama-3.1-8B from a local
directory at 64K tokens per sequence on 8 GPUs:

    torchrun --nproc_per_node=8 scripts/example_hf_custom_loop.py \\
        --model_dir /models/Llama-3.1-8B --sp_size 8 --seq_len 65536 --per_device_train_batch_size 1 \\
        --ac_mode full --torch_compile --learning_rate 1e-5 --max_steps 1000 --output_dir /ckpt/llama-3.1-8b-cpt

Data: ``--dataset`` is a .txt / .jsonl file or directory (default: the Python
standard library's sources, always present), tokenized with the model
directory's ``tokenizer.json`` (bytes when it has none), packed into rows of
documents whose positions restart at 0 (no attention across documents).
"""

import argparse
import os

import torch
import torch.distributed as dist

from ulysses_dtensor import ParallelDims, clip_grad_norm_, global_loss, sp_cross_entropy
from ulysses_dtensor.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedLoader,
    TokenStream,
    build_source,
)
from ulysses_dtensor.integrations.hf import load_hf_weights, parallelize_hf_model, save_hf_weights, shard_hf_batch
from ulysses_dtensor.runtime.process_group import exit_process, finish_together


def make_tiny_model(path):
    """A tiny random Llama saved as an HF directory (no download), vocabulary for bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def param_norm(model):
    """L2 norm of all (sharded) parameters: the same number whatever the mesh."""
    sq = sum(p.detach().float().pow(2).sum() for p in model.parameters())
    return (sq.full_tensor() if hasattr(sq, "full_tensor") else sq).sqrt().item()


def build_parser() -> argparse.ArgumentParser:
    # Flag names as the Trainer / TRL examples spell the same switches (the old spellings still parse).
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", "--model-dir", required=True, help="local HF model directory (config.json + safetensors)")
    p.add_argument("--make_tiny", "--make-tiny", action="store_true", help="first write a tiny random Llama to --model_dir")
    p.add_argument("--dataset", "--data", default="", help=".txt/.jsonl file or directory; default: stdlib sources")
    p.add_argument("--sp_size", "--sp", type=int, default=2, help="sequence-parallel degree")
    p.add_argument("--dp_replicate_size", "--dp-replicate", type=int, default=1, help="HSDP replicas (dp_shard fills the rest)")
    p.add_argument("--seq_len", "--seq-len", type=int, default=256)
    p.add_argument("--per_device_train_batch_size", "--batch-size", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--max_steps", "--steps", type=int, default=10)
    p.add_argument("--learning_rate", "--lr", type=float, default=3e-3)
    p.add_argument("--ac_mode", "--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--torch_compile", "--compile", action="store_true")
    p.add_argument("--attn_backend", "--attn-backend", default="auto", help="local attention: auto, sdpa, flash_attn, varlen, flex")
    p.add_argument("--output_dir", "--save-dir", default="", help="write the trained model here as an HF directory")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main():
    args = parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with finish_together():  # barrier, then destroy the process group
        train(args, device)


def train(args, device) -> dict:
    """Train; return what rank 0 printed (losses, parameter norms) for tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = device.type == "cuda"
    pmesh = ParallelDims(dp_replicate=args.dp_replicate_size, dp_shard=-1, sp=args.sp_size).build_mesh(device.type)
    if args.make_tiny and dist.get_rank() == 0 and not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_tiny_model(args.model_dir)
    dist.barrier()

    # 1. The model on meta (no memory), parallelized, then each rank loads its shards.
    config = AutoConfig.from_pretrained(args.model_dir)
    ckpt_dtype = config.dtype  # what --output_dir writes on GPUs (e.g. bfloat16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 master weights
    name = type(model).__name__
    parallelize_hf_model(
        model, pmesh, ac_mode=args.ac_mode, compile=args.torch_compile, attn_backend=args.attn_backend,
        param_dtype=torch.bfloat16 if cuda else torch.float32,
    )
    model.to_empty(device=device)
    load_hf_weights(model, args.model_dir)
    model.train()
    log = {"loaded_norm": param_norm(model), "losses": []}
    if dist.get_rank() == 0:
        print(f"loaded {args.model_dir}: {name} param_norm {log['loaded_norm']:.6f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)

    # 2. Data: one global token stream; this data-parallel rank's rows of each global batch.
    tok_file = os.path.join(args.model_dir, "tokenizer.json")
    tokenizer = HFTokenizer(tok_file) if os.path.exists(tok_file) else ByteTokenizer()
    if tokenizer.vocab_size > config.get_text_config().vocab_size:
        raise ValueError(
            f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {config.vocab_size} "
            f"({tok_file if os.path.exists(tok_file) else 'byte tokenizer'})"
        )
    loader = PackedLoader(TokenStream(build_source(args.dataset), tokenizer, seed=0),
                          dp_rank=pmesh.dp_rank, dp_size=pmesh.dims.dp)

    # 3. Training loop.
    for step in range(1, args.max_steps + 1):
        batch = loader.next_batch(args.per_device_train_batch_size * pmesh.dims.dp, args.seq_len)
        # Padded to a multiple of sp, labels shifted on the full sequence, this rank's slice,
        # global position ids and the document ids of the whole sequence.
        inputs, labels = shard_hf_batch({k: v.to(device) for k, v in batch.items()}, pmesh.sp)
        logits = model(**inputs).logits
        # This rank's share of the global token mean; FSDP2 sums the gradients.
        loss = sp_cross_entropy(logits, labels, pmesh.loss)
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = global_loss(loss, pmesh.loss).item()  # a collective: every rank calls it
        log["losses"].append(loss_value)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss_value:.4f} grad_norm {grad_norm.item():.4f}", flush=True)

    if args.output_dir:
        # Every rank writes its shards, one merges them: an HF directory again.
        save_hf_weights(model, args.output_dir, dtype=ckpt_dtype if cuda else None)
        log["saved_norm"] = param_norm(model)
        if dist.get_rank() == 0:
            print(f"saved {args.output_dir} param_norm {log['saved_norm']:.6f}", flush=True)
    return log


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank skips interpreter teardown (see ulysses_dtensor.runtime.process_group)
