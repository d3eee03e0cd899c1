"""A TRL ``GRPOTrainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesGRPOTrainer``.

An ordinary TRL GRPO script -- ``GRPOConfig``, a prompt dataset, reward functions, an
optional peft LoRA (``--lora_r``), rollouts from TRL's own generation or from a
``rollout_func`` -- with one change: ``GRPOTrainer(...)`` became
``UlyssesGRPOTrainer(..., ulysses_args=ulysses_args)``, and ``UlyssesArguments`` joined
the parser.

Data and reward: ``--dataset PATH`` is yours -- a ``.jsonl``, ``.json`` or ``.parquet``
file or a ``Dataset.save_to_disk`` folder with a ``prompt`` column (text, or chat
messages: a list of ``{role, content}``; other columns reach the reward functions as
keyword arguments) -- and ``--reward FILE.py:FUNCTION`` (repeatable) your reward
functions, TRL's signature ``f(prompts, completions, **kwargs) -> list[float]``.
Without ``--dataset`` the script trains on toy data (``--num_prompts`` prompts built
in) with the toy reward: the share of a completion's characters that are in
``--reward_letters`` (vowels).

Rollouts (``--rollout``): ``generate`` samples completions with TRL's own generation
(transformers ``generate``; ``--use_vllm`` for vLLM); ``fixed`` is a ``rollout_func``
for tests that writes completions of different lengths from the (text) prompt alone
(the k-th copy of a prompt in a call gets the k-th completion), so that runs on
different meshes train on the same data.

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes, toy data and reward:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_trl_grpo.py --model_dir /tmp/tiny-llama --output_dir /tmp/tiny-grpo \\
        --use_cpu --bf16 false --sp_size 2 --per_device_train_batch_size 4 --num_generations 4 \\
        --max_completion_length 16 --max_steps 3 --logging_steps 1

GPU, Qwen3-8B, 8 GPUs, your prompts and reward, rollouts of up to 32K tokens from vLLM
(server mode: start ``trl vllm-serve --model /models/Qwen3-8B`` on other GPUs first),
LoRA, every memory switch (not yet run on a GPU):

    torchrun --nproc_per_node=8 scripts/example_trl_grpo.py --model_dir /models/Qwen3-8B --output_dir /ckpt/grpo \\
        --dataset /data/prompts.jsonl --reward /data/my_rewards.py:correctness \\
        --sp_size 8 --use_vllm --vllm_mode server --max_completion_length 32768 --num_generations 8 \\
        --per_device_train_batch_size 8 --beta 0.04 --lora_r 16 --offload_activations --tiled_mlp --loss_chunks 0
"""

import os
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import GRPOConfig

from ulysses_dtensor.integrations.hf import UlyssesArguments
from ulysses_dtensor.integrations.trl import UlyssesGRPOTrainer
from ulysses_dtensor.integrations.trl.user_data import UserDataError, load_rewards, read_dataset

WORDS = ("the cat sat on a mat ", "so it goes ", "to be or not ", "xyzzy plugh ")


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    dataset: str = field(default="", metadata={
        "help": "your prompts: .jsonl / .json / .parquet file or Dataset.save_to_disk folder with a 'prompt' column "
                "(text or chat messages); default: toy data"})
    # TRL-style list flag, appended to: --reward a.py:f --reward b.py:g (or --reward a.py:f b.py:g)
    reward: list[str] = field(default_factory=list, metadata={
        "action": "append", "help": "a reward function FILE.py:FUNCTION, f(prompts, completions, **kwargs) -> "
                                    "list[float] (repeatable); needed with --dataset; default: the toy reward"})
    num_prompts: int = field(default=16, metadata={"help": "toy data: how many prompts"})
    rollout: str = field(default="generate", metadata={
        "help": "generate (TRL's generation) or fixed (a rollout_func for tests: text prompts only)"})
    reward_letters: str = field(default="aeiou", metadata={
        "help": "the toy reward: the share of a completion's characters in these letters"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the attention projections (0: full fine-tuning)"})
    lora_targets: str = field(default="q_proj,v_proj", metadata={"help": "comma-separated LoRA target modules"})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, GRPOConfig, UlyssesArguments))


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def prompts(count: int) -> list[dict]:
    """The toy data: ``count`` short text prompts."""
    return [{"prompt": f"Say {i % 7} {'ab' * (i % 3)}:"} for i in range(count)]


def fixed_rollout(prompt_texts: list[str], trainer) -> dict:
    """Completions from the prompts alone: lengths 3-12, some ending in EOS (terminated), some not."""
    tok = trainer.processing_class
    seen, prompt_ids, completion_ids = Counter(), [], []
    for text in prompt_texts:
        k = seen[text]
        seen[text] += 1
        ids = tok(text, add_special_tokens=False)["input_ids"]
        n = 3 + (7 * len(text) + 5 * k) % 10
        completion = tok((WORDS[k % len(WORDS)] * 4)[:n], add_special_tokens=False)["input_ids"][:n]
        if (k + len(text)) % 3 == 0:
            completion = completion + [tok.eos_token_id]
        prompt_ids.append(ids)
        completion_ids.append(completion)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def letter_reward(letters: str):
    """The toy reward: the share of a completion's characters that are in ``letters``."""
    def reward(completions, **kwargs) -> list[float]:
        return [sum(c in letters for c in text) / max(1, len(text)) for text in completions]

    reward.__name__ = "letters"
    return reward


def data_and_rewards(script: ScriptArguments):
    """The training prompts and reward functions: the user's, or the toy data and the toy reward."""
    from datasets import Dataset

    if script.dataset:
        if not script.reward:
            raise UserDataError(f"--dataset {script.dataset} needs --reward FILE.py:FUNCTION (the toy reward is "
                                f"for the toy data)")
        train = read_dataset(script.dataset, "GRPO")
        data = f"{script.dataset} ({len(train)} prompts)"
    else:
        train = Dataset.from_list(prompts(script.num_prompts))
        data = f"toy data ({script.num_prompts} prompts built in; --dataset PATH for yours)"
    if script.reward:
        rewards = load_rewards(script.reward)
        named = ", ".join(f.__name__ for f in rewards)
    else:
        rewards = [letter_reward(script.reward_letters)]
        named = f"toy reward (the share of {script.reward_letters!r}; --reward FILE.py:FUNCTION for yours)"
    if os.environ.get("RANK", "0") == "0":
        print(f"data: {data}\nreward: {named}", flush=True)
    return train, rewards


def main(argv=None) -> dict:
    """Train, save; return what a test compares: the logged metrics per step and the completions."""
    script, config, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    if script.rollout not in ("generate", "fixed"):
        raise ValueError(f"--rollout {script.rollout!r}: generate or fixed")
    train, rewards = data_and_rewards(script)  # before the model: a bad file or reward is refused at once
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=script.lora_targets.split(","), task_type="CAUSAL_LM")

    # The one change: GRPOTrainer -> UlyssesGRPOTrainer, and ulysses_args.
    trainer = UlyssesGRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train,
                                 processing_class=tokenizer, peft_config=peft_config,
                                 rollout_func=fixed_rollout if script.rollout == "fixed" else None,
                                 ulysses_args=ulysses_args)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"losses { {s: e['loss'] for s, e in logs.items()} }; saved {config.output_dir}", flush=True)
    return {"logs": logs, "completions": list(trainer._logs["completion"])}


if __name__ == "__main__":
    main()
