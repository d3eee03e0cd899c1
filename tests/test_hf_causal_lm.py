"""The trainer's interface on transformers models, and their weights, against transformers itself.

One process, tiny random models built from configs (no download):

* ``adapt_causal_lm``: the loss share (whole and over sequence chunks) and every
  gradient equal transformers' own loss, for heads that transform the logits
  (Gemma2's soft-cap, Granite's ``logits_scaling``, Cohere's ``logit_scale``;
  each transform changes the loss, so a dropped one would fail); a head the
  class computes differently is refused with the class named;
* ``load_transformers_weights``: a model built on ``meta`` loads what
  ``save_pretrained`` wrote, converting per-expert files into fused experts
  (DeepSeek-V3: MLA + MoE; Mixtral) and recomputing non-persistent buffers
  (Gemma3's ``embed_scale``, rotary ``inv_freq``): transformers' logits exactly;
* ``flops_per_token``: counted against a brute-force count (MoE: active experts
  only; sliding windows: the keys each position sees).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm  # noqa: E402
from ulysses_dtensor.integrations.hf.output_head import check_output_head  # noqa: E402
from ulysses_dtensor.integrations.hf.weights import load_transformers_weights  # noqa: E402

VOCAB, SEQ = 96, 20
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=1)


def _model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    with torch.no_grad():  # norms and biases away from 1 and 0, so that they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


HEADS = {  # family: (config, the config key of its logit transform, its neutral value)
    "gemma2": (transformers.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=0.5), "final_logit_softcapping",
               None),
    "granite": (transformers.GraniteConfig(**COMMON, logits_scaling=4.0), "logits_scaling", 1.0),
    "cohere": (transformers.CohereConfig(**COMMON, logit_scale=0.25), "logit_scale", 1.0),
}


@pytest.mark.parametrize("family", sorted(HEADS))
def test_loss_share_and_gradients_equal_transformers_with_the_heads_transform(family):
    config, key, neutral = HEADS[family]
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # shifted: token t predicts t + 1
    labels[1, :5] = -100  # some positions without a target
    n_valid = int((labels != -100).sum())

    def hf_loss(cfg):
        model = _model(cfg)
        logits = model(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        return model, loss.item()

    ref, want = hf_loss(config)
    _, plain = hf_loss(type(config).from_dict({**config.to_dict(), key: neutral}))
    assert abs(want - plain) > 1e-3, f"{family}: {key} does not change the loss; the test would not see it dropped"
    for chunks in (1, 3):
        model = adapt_causal_lm(_model(config), loss_chunks=chunks)
        loss = model(ids, labels=labels, num_valid_tokens=n_valid)
        loss.backward()
        assert loss.item() == pytest.approx(want, rel=1e-6), (family, chunks)
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g, r = p.grad, grads[name].grad
            assert torch.allclose(g, r, rtol=1e-4, atol=1e-6 * r.abs().max().item()), (family, chunks, name)
        with torch.no_grad():  # logits and the evaluator's path: hidden states, then the head
            assert torch.allclose(model(ids), ref(ids).logits, atol=1e-6)
            assert torch.allclose(model.output(model.hidden_states(ids)), ref(ids).logits, atol=1e-6)


def test_a_head_the_interface_does_not_know_is_refused():
    class DoubledLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    with torch.device("meta"):
        model = DoubledLlama(transformers.LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match=r"DoubledLlama: its forward does more to the logits than lm_head"):
        check_output_head(model)
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    assert str(check_output_head(plain)) == "none"


LAYOUTS = {
    # MLA (q/k head 12, v head 8) + fused routed experts from per-expert files, a persistent router buffer
    "deepseek_v3": transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
        topk_group=1, first_k_dense_replace=1),
    "mixtral": transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # tied embeddings, non-persistent embed_scale and per-layer-type rotary buffers
    "gemma3": transformers.Gemma3TextConfig(**COMMON, head_dim=8),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_weights_load_through_transformers_conversions(family, tmp_path):
    from safetensors import safe_open

    ref = _model(LAYOUTS[family]).eval()
    ref.save_pretrained(tmp_path)
    on_disk = {k for f in tmp_path.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    in_memory = set(ref.state_dict())
    if family != "gemma3":  # the files hold one tensor per expert, the model fused ones
        assert any(".experts.0." in k for k in on_disk) and not any(".experts.0." in k for k in in_memory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(LAYOUTS[family], dtype=torch.float32)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty re-creates tied parameters one by one (FSDP keeps them tied)
    load_transformers_weights(model, tmp_path)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, ref(ids).logits), family
    for name, buf in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


def test_loading_the_wrong_directory_names_what_does_not_fit(tmp_path):
    from ulysses_dtensor.models.llama_checkpoint import HFCheckpointError

    _model(LAYOUTS["mixtral"]).save_pretrained(tmp_path)
    other = transformers.MixtralConfig(**{**COMMON, "num_hidden_layers": 3}, num_local_experts=4)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(other, dtype=torch.float32)
    model.to_empty(device="cpu")
    with pytest.raises(HFCheckpointError, match=r"lacks model\.layers\.2\."):
        load_transformers_weights(model, tmp_path)


def test_flops_per_token_counts_active_experts_and_windows():
    moe = adapt_causal_lm(_model(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)))
    dense, experts = 0, 0
    for name, p in moe.named_parameters():
        if name == "model.embed_tokens.weight":
            continue
        if ".mlp.experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    seq, layers, heads, hd = 64, 2, 4, 8
    attention = 6 * heads * (hd + hd) * layers * (seq / 2)  # causal: seq / 2 keys per query, as our Llama
    assert moe.flops_per_token(seq) == int(6 * (dense + experts * 2 / 4) + attention)
    # a sliding window of 16 keys in the first layer of two; tied embeddings count (the head's matmul)
    windowed = adapt_causal_lm(_model(transformers.Gemma2Config(**COMMON, head_dim=8, sliding_window=16)))
    assert windowed.args.attention_windows == (16, None)
    params = sum(p.numel() for p in windowed.parameters())
    seen = sum(min(i + 1, 16) for i in range(seq)) / seq  # keys each position sees, on average
    assert windowed.flops_per_token(seq) == int(6 * params + 6 * heads * (hd + hd) * (seen + seq / 2))
