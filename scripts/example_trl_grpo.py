"""A TRL ``GRPOTrainer`` script, trained under Ulysses SP + FSDP2 with ``UlyssesGRPOTrainer``.

An ordinary TRL GRPO script -- ``GRPOConfig``, a prompt dataset, a reward function, an
optional peft LoRA (``--lora_r``), rollouts from TRL's own generation or from a
``rollout_func`` -- with one change: ``GRPOTrainer(...)`` became
``UlyssesGRPOTrainer(..., ulysses_args=ulysses_args)``, and ``UlyssesArguments`` joined
the parser.

Rollouts (``--rollout``): ``generate`` samples completions with TRL's own generation
(transformers ``generate``); ``fixed`` is a ``rollout_func`` that writes completions
of different lengths from the prompt alone (the k-th copy of a prompt in a call gets
the k-th completion), so that runs on different meshes train on the same data. The
reward is the share of letters a completion has from ``--reward_letters``.

CPU (gloo), a tiny Llama that scripts/make_tiny_hf_model.py writes:

    python scripts/make_tiny_hf_model.py --out /tmp/tiny-llama
    torchrun --nproc_per_node=4 scripts/example_trl_grpo.py --model_dir /tmp/tiny-llama --output_dir /tmp/tiny-grpo \\
        --use_cpu --bf16 false --sp_size 2 --per_device_train_batch_size 4 --num_generations 4 \\
        --max_completion_length 16 --max_steps 3 --logging_steps 1

GPU, Qwen3-8B, 8 GPUs, rollouts of up to 32K tokens from vLLM (server mode: start
``trl vllm-serve --model /models/Qwen3-8B`` on other GPUs first), LoRA, every memory switch:

    torchrun --nproc_per_node=8 scripts/example_trl_grpo.py --model_dir /models/Qwen3-8B --output_dir /ckpt/grpo \\
        --sp_size 8 --use_vllm --vllm_mode server --max_completion_length 32768 --num_generations 8 \\
        --per_device_train_batch_size 8 --beta 0.04 --lora_r 16 --offload_activations --tiled_mlp --loss_chunks 0
"""

from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import GRPOConfig

from ulysses_dtensor.integrations.hf import UlyssesArguments
from ulysses_dtensor.integrations.trl import UlyssesGRPOTrainer

WORDS = ("the cat sat on a mat ", "so it goes ", "to be or not ", "xyzzy plugh ")


@dataclass
class ScriptArguments:
    model_dir: str = field(metadata={"help": "a local Hugging Face model directory (config, weights, tokenizer)"})
    num_prompts: int = field(default=16, metadata={"help": "training prompts"})
    rollout: str = field(default="generate", metadata={"help": "generate (TRL's generation) or fixed (rollout_func)"})
    reward_letters: str = field(default="aeiou", metadata={"help": "the reward: the share of these letters"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the attention projections (0: full fine-tuning)"})
    lora_targets: str = field(default="q_proj,v_proj", metadata={"help": "comma-separated LoRA target modules"})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, GRPOConfig, UlyssesArguments))


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def prompts(count: int) -> list[dict]:
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
    def reward(completions, **kwargs) -> list[float]:
        return [sum(c in letters for c in text) / max(1, len(text)) for text in completions]

    reward.__name__ = "letters"
    return reward


def main(argv=None) -> dict:
    """Train, save; return what a test compares: the logged metrics per step and the completions."""
    script, config, ulysses_args = build_parser().parse_args_into_dataclasses(args=argv)
    tokenizer = AutoTokenizer.from_pretrained(script.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=script.lora_targets.split(","), task_type="CAUSAL_LM")
    if script.rollout not in ("generate", "fixed"):
        raise ValueError(f"--rollout {script.rollout!r}: generate or fixed")
    from datasets import Dataset

    # The one change: GRPOTrainer -> UlyssesGRPOTrainer, and ulysses_args.
    trainer = UlyssesGRPOTrainer(model=model, reward_funcs=letter_reward(script.reward_letters), args=config,
                                 train_dataset=Dataset.from_list(prompts(script.num_prompts)),
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
