"""A TRL ``SFTTrainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesSFTTrainer``.

An ordinary TRL script -- ``SFTConfig`` (``--packing`` with best-fit decreasing and
padding-free rows, or padded rows), a text dataset TRL tokenizes itself, an optional
peft LoRA (``--lora_r``) -- with one change: ``SFTTrainer(...)`` became
``UlyssesSFTTrainer(..., ulysses_args=ulysses_args)``, and ``UlyssesArguments`` joined
the parser.

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes, packed, LoRA:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_trl_sft.py --model_dir /tmp/tiny-llama --output_dir /tmp/tiny-sft \\
        --use_cpu --bf16 false --packing --lora_r 8 --sp_size 4 --max_steps 4 --logging_steps 1

The same with accelerate's launcher (a multi-process configuration, no DeepSpeed / FSDP
plugin: the trainer shards the model itself):

    accelerate launch --cpu --num_processes 4 scripts/example_trl_sft.py --model_dir /tmp/tiny-llama \\
        --output_dir /tmp/tiny-sft --use_cpu --bf16 false --packing --sp_size 4 --max_steps 4

GPU, Qwen3-8B at 128K-token packed rows on 8 GPUs, LoRA, host-offloaded activations:

    torchrun --nproc_per_node=8 scripts/example_trl_sft.py --model_dir /models/Qwen3-8B --output_dir /ckpt/qwen3-sft \\
        --packing --max_length 131072 --sp_size 8 --activation_offloading --tiled_mlp --loss_chunks 0 \\
        --lora_r 16 --learning_rate 1e-4 --max_steps 500

Data: ``--dataset`` is a .txt / .jsonl file or a directory (default: the Python standard
library's sources); each paragraph is one ``text`` example.
"""

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig

from ulysses_dtensor.data import build_source
from ulysses_dtensor.integrations.hf import UlyssesArguments
from ulysses_dtensor.integrations.trl import UlyssesSFTTrainer


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={"help": ".txt / .jsonl file or directory; default: stdlib sources"})
    num_docs: int = field(default=64, metadata={"help": "training examples (paragraphs)"})
    num_eval_docs: int = field(default=4, metadata={"help": "evaluation examples, after the training ones"})
    max_chars: int = field(default=160, metadata={"help": "characters per example at most"})
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


def examples(source: str, count: int, max_chars: int) -> list[dict]:
    """The first ``count`` paragraphs of ``source`` as ``{"text": ...}`` examples."""
    rows, corpus = [], build_source(source)
    for i in range(len(corpus)):
        for paragraph in corpus[i].split("\n\n"):
            text = paragraph.strip()[:max_chars]
            if len(text) >= 8:
                rows.append({"text": text})
                if len(rows) == count:
                    return rows
    raise ValueError(f"{source or 'the stdlib corpus'} has fewer than {count} paragraphs")


def main(argv=None) -> dict:
    """Train (evaluate with --do_eval, predict with --predict), save; return what a test compares."""
    script, sft_config, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=script.lora_targets.split(","), task_type="CAUSAL_LM")

    from datasets import Dataset

    rows = examples(script.dataset, script.num_docs + script.num_eval_docs, script.max_chars)
    train, held_out = Dataset.from_list(rows[: script.num_docs]), Dataset.from_list(rows[script.num_docs:])

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
