"""A TRL ``DPOTrainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesDPOTrainer``.

An ordinary TRL DPO script -- ``DPOConfig`` (any ``loss_type``, or several with
``loss_weights``; ``precompute_ref_log_probs``), a preference dataset TRL tokenizes
itself, an optional peft LoRA (``--lora_r``: the reference is then the model with its
adapter off) -- with one change: ``DPOTrainer(...)`` became
``UlyssesDPOTrainer(..., ulysses_args=ulysses_args)``, and ``UlyssesArguments`` joined
the parser.

Data: ``--dataset PATH`` is yours, every row of it -- a ``.jsonl``, ``.json`` or
``.parquet`` file or a ``Dataset.save_to_disk`` folder with ``prompt``, ``chosen`` and
``rejected`` columns (each text, or chat messages: a list of ``{role, content}``).
Without it the script trains on toy data: ``--num_pairs`` pairs cut from the Python
standard library's sources (a paragraph's start is the prompt, its true continuation
the chosen completion, the continuation of another paragraph the rejected one, of
different lengths, at most ``--max_chars`` characters).

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes, toy data:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_trl_dpo.py --model_dir /tmp/tiny-llama --output_dir /tmp/tiny-dpo \\
        --use_cpu --bf16 false --sp_size 2 --per_device_train_batch_size 2 --max_steps 3 --logging_steps 1

GPU, Qwen3-8B, 8 GPUs, your pairs of up to 64K tokens, IPO with the reference precomputed
(not yet run on a GPU):

    torchrun --nproc_per_node=8 scripts/example_trl_dpo.py --model_dir /models/Qwen3-8B --output_dir /ckpt/dpo \\
        --dataset /data/pairs.jsonl --sp_size 8 --loss_type ipo --precompute_ref_log_probs \\
        --max_length 65536 --offload_activations --tiled_mlp --loss_chunks 0
"""

import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import DPOConfig

from ulysses_dtensor.data import build_source
from ulysses_dtensor.integrations.hf import UlyssesArguments
from ulysses_dtensor.integrations.trl import UlyssesDPOTrainer
from ulysses_dtensor.integrations.trl.user_data import read_dataset


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={
        "help": "your pairs: .jsonl / .json / .parquet file or Dataset.save_to_disk folder with 'prompt', 'chosen' and "
                "'rejected' columns (text or chat messages); default: toy data"})
    num_pairs: int = field(default=16, metadata={"help": "toy data: how many pairs"})
    max_chars: int = field(default=48, metadata={"help": "toy data: characters per prompt / completion at most"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the attention projections (0: full fine-tuning)"})
    lora_targets: str = field(default="q_proj,v_proj", metadata={"help": "comma-separated LoRA target modules"})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, DPOConfig, UlyssesArguments))


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def pairs(count: int, max_chars: int) -> list[dict]:
    """The toy data: ``count`` prompt / chosen / rejected texts from the paragraphs of the
    Python standard library's sources."""
    texts, corpus = [], build_source("")
    for i in range(len(corpus)):
        for paragraph in corpus[i].split("\n\n"):
            text = " ".join(paragraph.split())
            if len(text) >= 24:
                texts.append(text)
        if len(texts) > count:
            break
    if len(texts) <= count:
        raise ValueError(f"the stdlib corpus has fewer than {count + 1} paragraphs")
    rows = []
    for i in range(count):
        cut = 6 + i % 5
        other = texts[i + 1]
        rows.append({"prompt": texts[i][:cut], "chosen": texts[i][cut:cut + 4 + (3 * i) % max_chars],
                     "rejected": other[cut:cut + 6 + (5 * i) % max_chars]})
    return rows


def training_pairs(script: ScriptArguments):
    """The user's pairs (every row of ``--dataset``), or the toy data."""
    from datasets import Dataset

    if script.dataset:
        train = read_dataset(script.dataset, "DPO")
        data = f"{script.dataset} ({len(train)} pairs)"
    else:
        train = Dataset.from_list(pairs(script.num_pairs, script.max_chars))
        data = (f"toy data ({script.num_pairs} pairs cut from the standard library's sources; --dataset PATH "
                f"for yours)")
    if os.environ.get("RANK", "0") == "0":
        print(f"data: {data}", flush=True)
    return train


def main(argv=None) -> dict:
    """Train, save; return what a test compares: the logged metrics per step."""
    script, config, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    train = training_pairs(script)  # before the model: a file that cannot be used is refused at once
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=script.lora_targets.split(","), task_type="CAUSAL_LM")
    from datasets import load_from_disk

    if config.precompute_ref_log_probs:
        # TRL caches the reference log-probs beside the dataset's files: on disk, every process finds them
        # (a copy in output_dir: nothing is written into a --dataset folder).
        from accelerate import PartialState

        path, state = os.path.join(config.output_dir, "pairs"), PartialState()
        with state.main_process_first():
            if state.is_main_process:
                train.save_to_disk(path)
            train = load_from_disk(path)

    # The one change: DPOTrainer -> UlyssesDPOTrainer, and ulysses_args.
    trainer = UlyssesDPOTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                                peft_config=peft_config, ulysses_args=ulysses_args)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"losses { {s: e['loss'] for s, e in logs.items()} }; saved {config.output_dir}", flush=True)
    return {"logs": logs}


if __name__ == "__main__":
    main()
