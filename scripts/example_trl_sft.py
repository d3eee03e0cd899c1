"""A TRL ``SFTTrainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesSFTTrainer``.

An ordinary TRL script -- ``SFTConfig`` (``--packing`` with best-fit decreasing and
padding-free rows, or padded rows), a dataset TRL tokenizes itself, an optional
peft LoRA (``--lora_r``) -- with one change: ``SFTTrainer(...)`` became
``UlyssesSFTTrainer(..., ulysses_args=ulysses_args)``, and ``UlyssesArguments`` joined
the parser.

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes, toy data, packed, LoRA:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_trl_sft.py --model_dir /tmp/tiny-llama --output_dir /tmp/tiny-sft \\
        --use_cpu --bf16 false --packing --lora_r 8 --sp_size 4 --max_steps 4 --logging_steps 1

The same with accelerate's launcher (a multi-process configuration, no DeepSpeed / FSDP
plugin: the trainer shards the model itself):

    accelerate launch --cpu --num_processes 4 scripts/example_trl_sft.py --model_dir /tmp/tiny-llama \\
        --output_dir /tmp/tiny-sft --use_cpu --bf16 false --packing --sp_size 4 --max_steps 4

GPU, Qwen3-8B, your conversations packed into 128K-token rows on 8 GPUs, LoRA,
host-offloaded activations (not yet run on a GPU):

    torchrun --nproc_per_node=8 scripts/example_trl_sft.py --model_dir /models/Qwen3-8B --output_dir /ckpt/qwen3-sft \\
        --dataset /data/chats.jsonl --packing --max_length 131072 --sp_size 8 --offload_activations --tiled_mlp \\
        --loss_chunks 0 --lora_r 16 --learning_rate 1e-4 --max_steps 500

Data: ``--dataset PATH`` is yours -- a ``.jsonl``, ``.json`` or ``.parquet`` file or a
``Dataset.save_to_disk`` folder with the columns TRL's SFTTrainer reads: ``messages``
(chat), ``prompt`` and ``completion`` (text or chat), or ``text`` (``--dataset_text_field``);
its last ``--num_eval_docs`` rows are held out for evaluation. Without it the script
trains on toy data: paragraphs of the Python standard library's sources, one ``text``
example each.
"""

import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig

from ulysses_dtensor.data import build_source
from ulysses_dtensor.integrations.hf import UlyssesArguments
from ulysses_dtensor.integrations.trl import UlyssesSFTTrainer
from ulysses_dtensor.integrations.trl.user_data import UserDataError, read_dataset


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={
        "help": "your rows: .jsonl / .json / .parquet file or Dataset.save_to_disk folder with 'messages', or "
                "'prompt' and 'completion', or 'text' columns; default: toy data"})
    num_docs: int = field(default=64, metadata={"help": "toy data: training examples (paragraphs)"})
    num_eval_docs: int = field(default=4, metadata={
        "help": "evaluation examples: toy data's after the training ones, --dataset's last rows"})
    max_chars: int = field(default=160, metadata={"help": "toy data: characters per example at most"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the attention projections (0: full fine-tuning)"})
    lora_targets: str = field(default="q_proj,v_proj", metadata={"help": "comma-separated LoRA target modules"})
    predict: bool = field(default=False, metadata={
        "help": "also predict the evaluation examples (trainer.predict: logits of whole sequences)"})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, SFTConfig, UlyssesArguments))


def parse_args(argv=None):
    """The command line's flags, checked (the dataclasses, built in ``main``, also check the
    machine: ``--bf16`` needs a GPU)."""
    return build_parser().parse_args(argv)


def examples(count: int, max_chars: int) -> list[dict]:
    """The toy data: the first ``count`` paragraphs of the Python standard library's sources
    as ``{"text": ...}`` examples."""
    rows, corpus = [], build_source("")
    for i in range(len(corpus)):
        for paragraph in corpus[i].split("\n\n"):
            text = paragraph.strip()[:max_chars]
            if len(text) >= 8:
                rows.append({"text": text})
                if len(rows) == count:
                    return rows
    raise ValueError(f"the stdlib corpus has fewer than {count} paragraphs")


def training_data(script: ScriptArguments, text_field: str):
    """(train, held-out) datasets: the user's rows, the last ``num_eval_docs`` held out, or the toy data."""
    from datasets import Dataset

    if script.dataset:
        rows = read_dataset(script.dataset, "SFT", text_column=text_field)
        if len(rows) <= script.num_eval_docs:
            raise UserDataError(f"--dataset {script.dataset} has {len(rows)} rows: none left to train on once "
                                f"--num_eval_docs {script.num_eval_docs} are held out for evaluation")
        cut = len(rows) - script.num_eval_docs
        train, held_out = rows.select(range(cut)), rows.select(range(cut, len(rows)))
        data = f"{script.dataset} ({len(train)} rows to train on, {len(held_out)} held out)"
    else:
        rows = examples(script.num_docs + script.num_eval_docs, script.max_chars)
        train, held_out = Dataset.from_list(rows[: script.num_docs]), Dataset.from_list(rows[script.num_docs:])
        data = f"toy data ({script.num_docs} + {script.num_eval_docs} paragraphs built in; --dataset PATH for yours)"
    if os.environ.get("RANK", "0") == "0":
        print(f"data: {data}", flush=True)
    return train, (held_out if len(held_out) else None)


def main(argv=None) -> dict:
    """Train (evaluate with --do_eval, predict with --predict), save; return what a test compares."""
    script, sft_config, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    # Before the model: a file that cannot be used is refused at once.
    train, held_out = training_data(script, sft_config.dataset_text_field)
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=script.lora_targets.split(","), task_type="CAUSAL_LM")

    # The one change: SFTTrainer -> UlyssesSFTTrainer, and ulysses_args.
    trainer = UlyssesSFTTrainer(model=model, args=sft_config, train_dataset=train, eval_dataset=held_out,
                                processing_class=tokenizer, peft_config=peft_config, ulysses_args=ulysses_args)
    trainer.train(resume_from_checkpoint=sft_config.resume_from_checkpoint)
    out = {"losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}}
    if sft_config.do_eval:
        out["eval_loss"] = trainer.evaluate()["eval_loss"]
    if script.predict:  # the examples as TRL prepared them, and the logits of their whole sequences
        prediction = trainer.predict(trainer.eval_dataset)
        out["predictions"], out["label_ids"] = prediction.predictions, prediction.label_ids
        out["eval_input_ids"] = [row["input_ids"] for row in trainer.eval_dataset]
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"losses {out['losses']}; saved {sft_config.output_dir}", flush=True)
    return out


if __name__ == "__main__":
    main()
