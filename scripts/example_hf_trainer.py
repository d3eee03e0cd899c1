"""A transformers ``Trainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesTrainer``.

It is an ordinary Trainer script -- ``HfArgumentParser``, ``TrainingArguments``, a
tokenized dataset, transformers' padding-free ``DataCollatorWithFlattening`` (packed
documents with ``position_ids``), ``train`` / ``evaluate`` / ``save_model`` -- with one
change: ``Trainer(...)`` became ``UlyssesTrainer(..., ulysses_args=ulysses_args)``, and
``UlyssesArguments`` joined the parser (``--sp_size``, ``--ring_size``,
``--dp_replicate_size``, ``--tiled_mlp``, ``--loss_chunks``, ...).

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_hf_trainer.py --model_dir /tmp/tiny-llama \\
        --output_dir /tmp/tiny-llama-trained --use_cpu --sp_size 2 --max_steps 4 --logging_steps 1 --do_eval

GPU, Llama-3.1-8B from a local directory, 64K-token rows on 8 GPUs (sp 8):

    torchrun --nproc_per_node=8 scripts/example_hf_trainer.py --model_dir /models/Llama-3.1-8B \\
        --output_dir /ckpt/llama-8b-cpt --sp_size 8 --max_length 65536 --bf16 --activation_checkpointing \\
        --loss_chunks 0 --learning_rate 1e-5 --max_steps 1000 --save_steps 200

Data: ``--dataset`` is a .txt / .jsonl file or a directory (default: the Python
standard library's sources, always present); each paragraph is a document of at most
``--max_length`` tokens.
"""

from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    HfArgumentParser,
    TrainingArguments,
)

from ulysses_dtensor.data import build_source
from ulysses_dtensor.integrations.hf import UlyssesArguments, UlyssesTrainer


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={"help": ".txt / .jsonl file or directory; default: stdlib sources"})
    max_length: int = field(default=48, metadata={"help": "tokens per document at most"})
    num_docs: int = field(default=64, metadata={"help": "training documents (paragraphs)"})
    num_eval_docs: int = field(default=4, metadata={"help": "evaluation documents, after the training ones"})
    collator: str = field(default="flatten", metadata={
        "help": "'flatten': documents packed into one row with position_ids (padding-free); 'pad': one document "
                "per row, right-padded"})
    predict: bool = field(default=False, metadata={
        "help": "also predict the evaluation documents (trainer.predict: logits of whole sequences)"})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, TrainingArguments, UlyssesArguments))


def parse_args(argv=None):
    """The command line's flags, checked (the dataclasses, built in ``main``, also check the
    machine: ``--bf16`` needs a GPU)."""
    return build_parser().parse_args(argv)


def documents(source: str, tokenizer, count: int, max_length: int) -> list[list[int]]:
    """The first ``count`` paragraphs of ``source`` as token ids (each ends with EOS)."""
    docs, corpus = [], build_source(source)
    for i in range(len(corpus)):
        for paragraph in corpus[i].split("\n\n"):
            text = paragraph.strip()
            if len(text) < 8:
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1]
            docs.append(ids + [tokenizer.eos_token_id])
            if len(docs) == count:
                return docs
    raise ValueError(f"{source or 'the stdlib corpus'} has fewer than {count} paragraphs")


def main(argv=None) -> dict:
    """Train (evaluate with --do_eval, predict with --predict), save; return what a test compares."""
    script, training_args, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)

    from datasets import Dataset

    docs = documents(script.dataset, tokenizer, script.num_docs + script.num_eval_docs, script.max_length)
    rows = [{"input_ids": ids, "labels": ids} for ids in docs]
    train, held_out = Dataset.from_list(rows[: script.num_docs]), Dataset.from_list(rows[script.num_docs:])
    if script.collator == "flatten":
        collator = DataCollatorWithFlattening()
    else:
        tokenizer.padding_side = "right"
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    # The one change: Trainer -> UlyssesTrainer, and ulysses_args.
    trainer = UlyssesTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                             data_collator=collator, processing_class=tokenizer, ulysses_args=ulysses_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    out = {"losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}}
    if training_args.do_eval:
        out["eval_loss"] = trainer.evaluate()["eval_loss"]
    if script.predict:
        prediction = trainer.predict(held_out)
        out["predictions"], out["label_ids"] = prediction.predictions, prediction.label_ids
        out["eval_input_ids"] = [row["input_ids"] for row in held_out]
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"{out}; saved {training_args.output_dir}" if not script.predict else f"losses {out['losses']}",
              flush=True)
    return out


if __name__ == "__main__":
    main()
