"""Create tiny SFT data and a tokenizer directory with a chat template, offline.

    python scripts/make_tiny_sft_data.py --out outputs/tiny_sft [--template chatml|llama3] [--model]

Writes, into ``--out``:

* ``model/`` (with ``--model``): a tiny random HF Llama (``make_tiny_hf_model.py``)
  and the tokenizer files below, as a model directory ``model.hf_path`` reads.
* ``tokenizer/``: a byte-level BPE ``tokenizer.json`` (trained on the data
  below, with the ChatML and Llama-3 header tokens as special tokens) and a
  ``tokenizer_config.json`` holding the chat template (``chatml``: Qwen-style
  ``<|im_start|>role ... <|im_end|>`` turns and a default system turn;
  ``llama3``: ``<|start_header_id|>role<|end_header_id|>`` turns ended by
  ``<|eot_id|>``, BOS first, system / user / assistant only).
* ``chat.jsonl``: ``messages`` records (one to three user/assistant exchanges
  about small sums, some with a system message).
* ``prompt_completion.jsonl``: ``prompt`` + ``completion`` strings.

Then (see ``train_configs/debug_sft.toml``)::

    python -m ulysses_dtensor.prepare_data --format chat --input outputs/tiny_sft/chat.jsonl \\
        --tokenizer outputs/tiny_sft/model/tokenizer.json --output outputs/tiny_sft/store
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Written for this project in the two common styles (each turn rendered append-only).
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('role ' + message['role'] + ' is not supported') }}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` chat records: 1-3 exchanges about sums, a system message in every third."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "Answer with the sum."}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
            messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
        out.append({"messages": messages})
    return out


def prompt_completions(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        out.append({"prompt": f"Add {a} and {b}.", "completion": f" The sum is {a + b}."})
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer_dir(folder: str | os.PathLike, texts: list[str], template: str | None = "chatml",
                        vocab_size: int = 320) -> Path:
    """``folder/tokenizer.json`` + ``tokenizer_config.json`` (with ``template``, None: without one)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, vocab_size).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
              "bos_token": BOS if template == "llama3" else None}
    if template is not None:
        config["chat_template"] = TEMPLATES[template]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder / "tokenizer.json"


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_tiny_sft_data(out: str | os.PathLike, template: str = "chatml", n: int = 240,
                       model: bool = False) -> Path:
    """Write the tokenizer directory and both .jsonl files to ``out`` (and with ``model``
    a tiny HF Llama with the same tokenizer in ``out/model``); return the tokenizer.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chats, pcs = conversations(n), prompt_completions(n)
    write_jsonl(out / "chat.jsonl", chats)
    write_jsonl(out / "prompt_completion.jsonl", pcs)
    texts = [m["content"] for c in chats for m in c["messages"]] + [p["prompt"] + p["completion"] for p in pcs]
    tok = write_tokenizer_dir(out / "tokenizer", texts, template)
    if model:
        import shutil
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_tiny_hf_model import make_tiny_hf_model

        make_tiny_hf_model(out / "model", "llama", tokenizer=False, vocab_size=384, perturb=0.1)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(out / "tokenizer" / name, out / "model" / name)
    return tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--template", default="chatml", choices=sorted(TEMPLATES))
    p.add_argument("--records", type=int, default=240)
    p.add_argument("--model", action="store_true", help="also write a tiny HF Llama with this tokenizer to OUT/model")
    a = p.parse_args()
    tok = make_tiny_sft_data(a.out, a.template, a.records, a.model)
    print(f"wrote {a.records} chat and prompt/completion records and {tok} ({a.template} template) to {a.out}")


if __name__ == "__main__":
    main()
