"""A transformers ``Trainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesHFTrainer``.

It is an ordinary Trainer script -- ``HfArgumentParser``, ``TrainingArguments``, a
tokenized dataset, transformers' padding-free ``DataCollatorWithFlattening`` (packed
documents with ``position_ids``), ``train`` / ``evaluate`` / ``save_model`` -- with one
change: ``Trainer(...)`` became ``UlyssesHFTrainer(..., ulysses_args=ulysses_args)``, and
``UlyssesArguments`` joined the parser (``--sp_size``, ``--ring_size``,
``--dp_replicate_size``, ``--tiled_mlp``, ``--loss_chunks``, ...).

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes, toy data:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_hf_trainer.py --model_dir /tmp/tiny-llama \\
        --output_dir /tmp/tiny-llama-trained --use_cpu --sp_size 2 --max_steps 4 --logging_steps 1 --do_eval

GPU, Llama-3.1-8B from a local directory, your documents of up to 64K tokens on 8 GPUs
(sp 8; not yet run on a GPU):

    torchrun --nproc_per_node=8 scripts/example_hf_trainer.py --model_dir /models/Llama-3.1-8B \\
        --output_dir /ckpt/llama-8b-cpt --dataset /data/books.parquet --sp_size 8 --max_length 65536 --bf16 \\
        --activation_checkpointing --loss_chunks 0 --learning_rate 1e-5 --max_steps 1000 --save_steps 200

Data: ``--dataset PATH`` is yours -- a ``.jsonl``, ``.json`` or ``.parquet`` file or a
``Dataset.save_to_disk`` folder with a ``text`` column: each row is a document of at
most ``--max_length`` tokens; its last ``--num_eval_docs`` rows are held out for
evaluation. Without it the script trains on toy data: paragraphs of the Python standard
library's sources.
"""

import os
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
from ulysses_dtensor.integrations.hf import UlyssesArguments, UlyssesHFTrainer
from ulysses_dtensor.integrations.trl.user_data import UserDataError, read_dataset


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={
        "help": "your documents: .jsonl / .json / .parquet file or Dataset.save_to_disk folder with a 'text' column; "
                "default: toy data"})
    max_length: int = field(default=48, metadata={"help": "tokens per document at most"})
    num_docs: int = field(default=64, metadata={"help": "toy data: training documents (paragraphs)"})
    num_eval_docs: int = field(default=4, metadata={
        "help": "evaluation documents: toy data's after the training ones, --dataset's last rows"})
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


def paragraphs(count: int) -> list[str]:
    """The toy data: the first ``count`` paragraphs of the Python standard library's sources."""
    texts, corpus = [], build_source("")
    for i in range(len(corpus)):
        for paragraph in corpus[i].split("\n\n"):
            text = paragraph.strip()
            if len(text) >= 8:
                texts.append(text)
                if len(texts) == count:
                    return texts
    raise ValueError(f"the stdlib corpus has fewer than {count} paragraphs")


def texts_to_train_on(script: ScriptArguments) -> tuple[list[str], list[str]]:
    """(training, held-out) texts: the user's rows, the last ``num_eval_docs`` held out, or the toy data."""
    if script.dataset:
        rows = read_dataset(script.dataset, "Trainer")
        if len(rows) <= script.num_eval_docs:
            raise UserDataError(f"--dataset {script.dataset} has {len(rows)} rows: none left to train on once "
                                f"--num_eval_docs {script.num_eval_docs} are held out for evaluation")
        texts, cut = rows["text"], len(rows) - script.num_eval_docs
        data = f"{script.dataset} ({cut} documents to train on, {script.num_eval_docs} held out)"
    else:
        texts, cut = paragraphs(script.num_docs + script.num_eval_docs), script.num_docs
        data = f"toy data ({script.num_docs} + {script.num_eval_docs} paragraphs built in; --dataset PATH for yours)"
    if os.environ.get("RANK", "0") == "0":
        print(f"data: {data}", flush=True)
    return texts[:cut], texts[cut:]


def tokenized(texts: list[str], tokenizer, max_length: int):
    """``input_ids`` / ``labels`` rows, each text at most ``max_length`` tokens ending with EOS."""
    from datasets import Dataset

    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1] + [tokenizer.eos_token_id]
        rows.append({"input_ids": ids, "labels": ids})
    return Dataset.from_list(rows)


def main(argv=None) -> dict:
    """Train (evaluate with --do_eval, predict with --predict), save; return what a test compares."""
    script, training_args, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    texts, held_out_texts = texts_to_train_on(script)  # before the model: a bad file is refused at once
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)

    train = tokenized(texts, tokenizer, script.max_length)
    held_out = tokenized(held_out_texts, tokenizer, script.max_length) if held_out_texts else None
    if script.collator == "flatten":
        collator = DataCollatorWithFlattening()
    else:
        tokenizer.padding_side = "right"
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    # The one change: Trainer -> UlyssesHFTrainer, and ulysses_args.
    trainer = UlyssesHFTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
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
