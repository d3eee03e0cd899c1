"""A user's UlyssesHFTrainer script that stops on an error it does not catch (tests/test_known_errors.py).

``python trainer_error_script.py weights OUT``: every rank seeds its own random model,
so the weights differ between ranks, which the trainer finds with a collective once
the process group exists. ``arguments OUT``: ``UlyssesArguments(sp_size=2, ring_size=3)``,
refused before any process group exists. Each path imports what it needs (the second
never imports transformers: a launch of it costs a third of the first's).
"""

import os
import sys


def main(error: str, out: str) -> None:
    from ulysses_dtensor.integrations.hf import UlyssesArguments

    if error == "arguments":
        UlyssesArguments(sp_size=2, ring_size=3)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from ulysses_dtensor.integrations.hf import UlyssesHFTrainer

    torch.manual_seed(int(os.environ.get("RANK", 0)))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1)
    UlyssesHFTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=[{"input_ids": [1, 2, 3, 4]}],
                     ulysses_args=UlyssesArguments(sp_size=2))
    raise SystemExit(f"{error}: not refused")


if __name__ == "__main__":
    main(*sys.argv[1:])
