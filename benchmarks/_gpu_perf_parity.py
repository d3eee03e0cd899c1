"""The kit's 1-GPU check: kernels against references, on a real process group of one rank
(``python benchmarks/gpu_perf.py parity --out OUT``; NCCL on a GPU, gloo on the CPU).

The shape pieces time steps on the fake process group; this piece checks, on a small
Llama with the same parallelization (FSDP2, full activation checkpointing), that what
they time computes the right thing:

* ``save_attention`` against full AC, both on cuDNN attention (``sdpa`` on the CPU):
  the same kernel on the same inputs, so the loss and the gradients must be equal.
  Full AC runs twice: the difference between those two runs is the kernel's own
  run-to-run noise (cuDNN's backward may accumulate in a varying order), and the
  tolerance is the larger of :data:`EQUAL_GRAD_RTOL` and four times that noise;
* ``auto`` in the run's 16-bit dtype against the same model in float64 on SDPA's math
  kernel (its loss in float64 too): the loss and the gradients within
  :data:`KERNEL_RTOL` of the dtype;
* the comparison itself: ``auto`` against a PERTURBED float64 reference (the first
  block's query weight scaled by :data:`PERTURBATION`) must fail it, else the check
  could not tell.

The weights are the model's init with the query and key projections scaled by
:data:`QK_SCALE` (the init's attention is nearly uniform, which hides a wrong kernel).
Differences are relative: ``|a - b| / |b|`` for the loss, ``||g_a - g_b|| / ||g_b||`` over
all gradients, and the same for the worst single parameter; each has a tolerance. Writes
``OUT/parity.json``; exits 1 when a check fails.
"""

from __future__ import annotations

import dataclasses
import math
import time

from _gpu_perf_common import device_of, dump, tiny_mode

# The small Llama: on a GPU head dim 64 (cuDNN's fast path), 2 layers, 2K tokens; on the CPU the debug model.
GPU_SPEC = {"flavor": "debug", "overrides": ["dim=512", "n_heads=8", "n_kv_heads=4", "ffn_dim=1536",
                                             "vocab_size=4096", "n_layers=2"], "seq": 2048, "dtype": "bfloat16"}
CPU_SPEC = {"flavor": "debug", "overrides": ["n_layers=2"], "seq": 128, "dtype": "float32"}
# The query and key projections of the model's init, scaled by this: attention far from uniform
# (the init's scores are nearly equal), so that a wrong attention shows in the gradients.
QK_SCALE = 4.0
EQUAL_RTOL = {"loss": 1e-6, "grad": 2e-3, "worst": 1e-2}
# 16-bit: a few units of bf16's rounding (2^-8) after two blocks; float32 (the CPU): far tighter.
KERNEL_RTOL = {"bfloat16": {"loss": 1e-2, "grad": 3e-2, "worst": 1e-1},
               "float32": {"loss": 1e-5, "grad": 1e-4, "worst": 1e-3}}
PERTURBATION = 1.5


def _clean(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def compare(a: dict, b: dict) -> dict:
    """Relative differences of run ``a`` from run ``b`` (each ``{"loss", "grads"}``)."""
    import torch

    if set(a["grads"]) != set(b["grads"]):
        raise ValueError(f"different parameters: {sorted(set(a['grads']) ^ set(b['grads']))[:4]}")
    diff2 = sum(float((a["grads"][n] - g).square().sum()) for n, g in b["grads"].items())
    ref2 = sum(float(g.square().sum()) for g in b["grads"].values())
    per = {n: float(torch.linalg.vector_norm(a["grads"][n] - g) / max(float(torch.linalg.vector_norm(g)), 1e-30))
           for n, g in b["grads"].items()}
    worst = max(per, key=per.get)
    return {"loss_rel": abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30),
            "grad_rel": math.sqrt(diff2 / max(ref2, 1e-300)), "worst_param": worst, "worst_param_rel": per[worst]}


def _judge(diff: dict, tol: dict) -> dict:
    """``diff`` (:func:`compare`) against ``tol`` (``loss``, ``grad``, ``worst``: relative)."""
    measured = {"loss": diff["loss_rel"], "grad": diff["grad_rel"], "worst": diff["worst_param_rel"]}
    passed = all(math.isfinite(v) and v <= tol[k] for k, v in measured.items())
    return {**{k: (round(v, 9) if isinstance(v, float) else v) for k, v in diff.items()},
            "tolerance": dict(tol), "passed": passed}


def _bench_args(spec: dict, device, kernel: str, save_attention: bool):
    import bench_train as B

    argv = ["--mode", "real", "--flavor", spec["flavor"], "--ac", "full", "--attn-backend", kernel,
            "--device", device.type, "--dtype", spec["dtype"], "--warmup", "1", "--iters", "1"]
    for o in spec["overrides"]:
        argv += ["--override", o]
    return B.parse_args(argv + (["--save-attention"] if save_attention else []))


def _parallel_run(spec, pmesh, device, kernel: str, save_attention: bool, weights: dict | None) -> dict:
    """One forward + backward of the parallelized model (FSDP2, full AC) on the real group."""
    import torch

    import bench_train as B
    from ulysses_dtensor.parallel.loss import count_valid_tokens

    a = _bench_args(spec, device, kernel, save_attention)
    margs = B.model_args(a, None)
    model, _ = B.build(a, margs, pmesh, device)
    params = {_clean(n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        if weights is None:
            for n, p in params.items():
                if n.endswith(("attention.wq.weight", "attention.wk.weight")):
                    _local(p).mul_(QK_SCALE)
            weights = {n: _local(p).detach().clone() for n, p in params.items()}
        else:
            for n, p in params.items():
                _local(p).copy_(weights[n])
    batch = B.make_batch(a, pmesh, spec["seq"], margs.vocab_size, device)
    n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
    loss = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch.get("document_ids"),
                 labels=batch["labels"], num_valid_tokens=n_valid)
    loss.backward()
    grads = {n: _local(p.grad).detach().double().cpu() for n, p in params.items()}
    return {"loss": float(loss.detach()), "grads": grads, "weights": weights, "margs": margs, "batch": batch,
            "n_valid": int(n_valid)}


def _reference_run(base: dict, device, perturb: bool = False) -> dict:
    """The same model, weights and batch unparallelized in float64 on SDPA's math kernel."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ulysses_dtensor.models.llama import Llama

    with torch.device("meta"):
        ref = Llama(dataclasses.replace(base["margs"], attn_backend="sdpa"))
    ref.to_empty(device=device)
    ref.init_weights(seed=0)  # buffers (rope); the parameters are overwritten next
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(base["weights"][_clean(n)])
        ref.double()
        if perturb:
            dict(ref.named_parameters())["layers.0.attention.wq.weight"].mul_(PERTURBATION)
    batch = base["batch"]
    with sdpa_kernel([SDPBackend.MATH]):
        logits = ref(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch.get("document_ids"))
    # The loss in float64 too (the model's own loss takes its log-softmax in float32).
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum") / base["n_valid"]
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {_clean(n): p.grad.detach().cpu() for n, p in ref.named_parameters()}}


def piece_parity(args) -> int:
    import torch
    import torch.distributed as dist

    from ulysses_dtensor.attention.select import backend_refusal, resolve_backend
    from ulysses_dtensor.parallel.mesh import ParallelDims

    t0 = time.perf_counter()
    device = device_of(args)
    spec = CPU_SPEC if tiny_mode(args) else GPU_SPEC
    dtype = getattr(torch, spec["dtype"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pmesh = ParallelDims(dp_replicate=1, dp_shard=-1, sp=1, world_size=1).build_mesh(device.type)
        probe = _bench_args(spec, device, "auto", False)
        head_dim = __import__("bench_train").model_args(probe, None).head_dim
        kernel = "cudnn" if backend_refusal("cudnn", device, dtype, head_dim) is None else "sdpa"
        full = _parallel_run(spec, pmesh, device, kernel, False, None)
        weights = full["weights"]
        again = _parallel_run(spec, pmesh, device, kernel, False, weights)
        kept = _parallel_run(spec, pmesh, device, kernel, True, weights)
        auto = _parallel_run(spec, pmesh, device, "auto", False, weights)
        ref = _reference_run(full, device)
        wrong = _reference_run(full, device, perturb=True)
        noise = compare(again, full)
        tol = KERNEL_RTOL[spec["dtype"]]
        checks = {
            "save_attention_equals_full_ac": _judge(compare(kept, full), {
                "loss": EQUAL_RTOL["loss"], "grad": max(EQUAL_RTOL["grad"], 4 * noise["grad_rel"]),
                "worst": max(EQUAL_RTOL["worst"], 4 * noise["worst_param_rel"])}),
            "auto_matches_float64": _judge(compare(auto, ref), tol),
        }
        self_test = _judge(compare(auto, wrong), tol)
        self_test = {**self_test, "failed_as_it_must": not self_test.pop("passed")}
        auto_is = resolve_backend("auto", frozenset(), device, dtype, head_dim)
    finally:
        dist.destroy_process_group()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "process_group": "nccl" if device.type == "cuda" else "gloo", "world_size": 1,
        "model": {"flavor": spec["flavor"], "overrides": spec["overrides"], "seq": spec["seq"],
                  "dtype": spec["dtype"], "head_dim": head_dim},
        "kernel": kernel, "auto_is": auto_is,
        "losses": {"full_ac": full["loss"], "full_ac_again": again["loss"], "save_attention": kept["loss"],
                   "auto": auto["loss"], "float64": ref["loss"], "float64_perturbed": wrong["loss"]},
        "run_to_run": {k: round(v, 9) if isinstance(v, float) else v for k, v in noise.items()},
        "checks": checks, "perturbed_reference": {**self_test, "perturbation": f"first block's wq x {PERTURBATION}"},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result["passed"] = all(c["passed"] for c in checks.values()) and self_test["failed_as_it_must"]
    dump(args.out / "parity.json", result)
    print({k: result[k] for k in ("kernel", "auto_is", "passed", "seconds")})
    return 0 if result["passed"] else 1
