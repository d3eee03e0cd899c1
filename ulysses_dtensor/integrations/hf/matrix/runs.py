"""Running the family matrix on a group of ranks: every family of :mod:`.tiny_configs`, measured by
:mod:`.check`, as the entries of :mod:`.results`.

Called by every rank of a process group (pooled test ranks: ``scripts/family_matrix.py``
for every family, ``tests/test_family_matrix.py`` for its live sample). Each tiny model is built once per rank
and mesh; the unsharded reference -- the same on every rank -- is computed
once per family (each rank takes every world-th family) and shared with one
``all_gather_object``. Meshes: sp 2 for every family
(:data:`FIRST_MESH`), and :data:`EXTRA_MESHES` (sp 4, dp_shard 2 x sp 2) for the
families whose layers pass a window, a soft-cap or sinks, use MLA or hold
token mixers other than attention (:func:`needs_extra_meshes`).
"""

from __future__ import annotations

import torch

from ..parallelize_model import parallelize_hf_model
from . import check as family_check
from . import tiny_configs as family_matrix

__all__ = ["CATEGORY_REASONS", "EXTRA_MESHES", "FIRST_MESH", "ROWS", "SEQ", "assemble", "family_reference", "mesh_name",
           "multimodal_status", "needs_extra_meshes", "references", "run_mesh", "structure", "text_family"]

FIRST_MESH = (1, 1, 2)
EXTRA_MESHES = ((1, 1, 4), (1, 2, 2))
# Two rows (one per data-parallel rank of dp_shard 2) of 29 tokens, which no sp divides.
ROWS, SEQ = 2, 29


def mesh_name(dims) -> str:
    dp_replicate, dp_shard, sp = dims
    parts = [f"dp_replicate {dp_replicate}"] * (dp_replicate > 1) + [f"dp_shard {dp_shard}"] * (dp_shard > 1)
    return " x ".join(parts + [f"sp {sp}"])


def _class_name(model) -> str:
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")).__name__


def structure(model_type: str, sp: int = 2) -> dict:
    """What the matrix knows of a family before measuring it: category, classes, and either
    the reason it is refused (its override's, a config that does not build, or
    ``parallelize_hf_model``'s structural checks) or its features (MLA, MoE, mixers)."""
    from ..parallelize_model import _check_model

    info = {"category": family_matrix.category(model_type), "config": family_matrix.config_class(model_type).__name__}
    override = family_matrix.OVERRIDES.get(model_type, family_matrix.Override())
    if override.reason:
        info["override"] = override.reason
    if info["category"] == "multimodal":
        info["text"] = text_family(model_type)
    if info["category"] != "decoder":
        return info
    if override.refused:
        return {**info, "status": "refused", "reason": override.refused}
    try:
        config = family_matrix.tiny_config(model_type)
        with torch.device("meta"):
            model = family_matrix.tiny_model(config, noise=False)
    except Exception as e:  # noqa: BLE001 - a config or model that does not build is a finding
        return {**info, "status": "refused", "reason": f"does not build: {type(e).__name__}: {e}"[:300]}
    info["class"] = _class_name(model)
    try:
        _, _, mixers, _ = _check_model(model, sp, allow_untested=True)
    except (ValueError, TypeError) as e:
        return {**info, "status": "refused", "reason": str(e)}
    text = config.get_text_config()
    info["mla"] = bool(getattr(text, "kv_lora_rank", None))
    info["moe"] = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                        "moe_num_experts"))
    info["mixers"] = sorted({mixer.kind for _, mixer in mixers})
    return info


def needs_extra_meshes(entry: dict) -> bool:
    """Windows, soft-caps, sinks (as the layers passed them at sp 2), MLA, other token mixers."""
    return bool(entry.get("patterns") or entry.get("mla") or entry.get("mixers"))


def family_reference(model_type: str) -> tuple:
    """transformers' own unsharded tiny model of ``model_type`` on the matrix's batch: (loss, gradients, router)."""
    model = family_matrix.tiny_model(family_matrix.tiny_config(model_type))
    batch = family_check.packed_batch(ROWS, SEQ, model.config.get_text_config().vocab_size)
    return family_check.reference(model, batch, family_check.router_loss(model) is not None)


def references(model_types: list[str], rank: int, world: int) -> tuple[dict, dict]:
    """(structure per family, (loss, gradients, router) per family that passed the structural
    checks), every rank computing every world-th family's, shared with all."""
    import torch.distributed as dist

    mine_info, mine_refs = {}, {}
    for i, model_type in enumerate(model_types):
        if i % world != rank:
            continue
        info = structure(model_type)
        mine_info[model_type] = info
        if info["category"] == "decoder" and "status" not in info:
            try:
                mine_refs[model_type] = family_reference(model_type)
            except Exception as e:  # noqa: BLE001 - the unsharded model itself fails: a finding
                info.update(status="refused", reason=f"transformers' own model fails: {type(e).__name__}: {e}"[:300])
    gathered = [None] * world
    dist.all_gather_object(gathered, (mine_info, mine_refs))
    infos, refs = {}, {}
    for part_info, part_refs in gathered:
        infos.update(part_info)
        refs.update(part_refs)
    return infos, refs


def run_mesh(model_types: list[str], dims: tuple, refs: dict, world: int, build_pmesh) -> dict:
    """Measure each family on the mesh ``dims`` (``build_pmesh(world, dims)`` -> (pmesh, replica)),
    against its shared reference: ``{model_type: {"loss_rel", "grad_rel", "worst", "forward",
    "patterns", "router"}}`` (or ``{"error": ...}``). Ranks of a second replica of the mesh idle."""
    out = {}
    pmesh, replica = build_pmesh(world, dims)  # one mesh (its process groups) for every family
    if replica:
        return out
    for model_type in model_types:
        ref_loss, ref_grads, router = refs[model_type]
        model = family_matrix.tiny_model(family_matrix.tiny_config(model_type))
        batch = family_check.packed_batch(ROWS, SEQ, model.config.get_text_config().vocab_size)
        try:
            loss, squared, counts, patterns = family_check.run_sharded(
                model, pmesh, batch, router, ref_grads, parallelize=parallelize_hf_model, attn_backend="sdpa",
                allow_untested=True)
        except Exception as e:  # noqa: BLE001 - recorded; every rank raises alike (same code, same shapes)
            out[model_type] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        loss_rel, grad_rel, worst = family_check.compare(loss, squared, ref_loss, ref_grads)
        out[model_type] = {"loss_rel": loss_rel, "grad_rel": grad_rel, "worst": worst, "forward": counts,
                           "patterns": patterns, "router": router}
    return out


# Why the families outside the decoder-only category are refused.
CATEGORY_REASONS = {
    "encoder_decoder": "the decoder half of an encoder-decoder model (it cross-attends to an encoder); Ulysses SP "
                       "here runs decoder-only causal LMs",
    "encoder": "a bidirectional encoder (BERT-style) usable as a decoder only when reconfigured; not a decoder-only "
               "causal LM",
    "attention_free": "no attention at all: a recurrent / state-space LM, outside the decoder-only families",
}


def text_family(model_type: str) -> str | None:
    """The model type of a multimodal model's text config (None where it has none of its own)."""
    try:
        config = family_matrix.config_class(model_type)()
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 - defaults that do not build, ambiguous text configs
        return None
    return text.model_type if text is not config else None


def multimodal_status(text: str | None, families: dict) -> dict:
    """A multimodal family's status from its text family's: ``text path`` where the text family
    passes, else refused with the text family's reason."""
    text_entry = families.get(text) if text else None
    if text_entry is None or text_entry.get("category") != "decoder":
        return dict(status="refused", reason=f"its text model ({text or 'none of its own'}) is not a decoder "
                                             "family of the matrix")
    if text_entry["status"] != "pass":
        return dict(status="refused", text=text, reason=f"its text model {text} is refused: {text_entry['reason']}")
    return dict(status="text path", text=text)


def assemble(infos: dict, runs: dict[str, dict], transformers_version: str, torch_version: str) -> dict:
    """The results document: per family its structure, status and per-mesh errors (``runs``:
    mesh name -> {model_type: run}); multimodal families point at their text family."""
    families = {}
    for model_type, info in sorted(infos.items()):
        entry = dict(info)
        category = entry["category"]
        if category in CATEGORY_REASONS:
            entry.update(status="refused", reason=CATEGORY_REASONS[category])
        elif category == "multimodal":
            pass  # below, once every decoder family has its status
        elif "status" not in entry:
            meshes = {name: per[model_type] for name, per in runs.items() if model_type in per}
            errors = [f"{name}: {m['error']}" for name, m in meshes.items() if "error" in m]
            bad = [f"{name}: loss rel. err. {m['loss_rel']:.1e}, gradient {m['grad_rel']:.1e} ({m['worst']})"
                   for name, m in meshes.items() if "error" not in m and not (
                       m["loss_rel"] <= family_check.LOSS_RTOL and m["grad_rel"] <= family_check.GRAD_RTOL)]
            first = next((m for m in meshes.values() if "error" not in m), {})
            entry["patterns"] = first.get("patterns", [])
            entry["router"] = first.get("router", False)
            entry["meshes"] = {name: {k: m[k] for k in ("loss_rel", "grad_rel", "worst", "forward")}
                               for name, m in meshes.items() if "error" not in m}
            if errors:
                entry.update(status="refused", reason=errors[0])
            elif bad:
                entry.update(status="fail", reason="; ".join(bad))
            else:
                entry["status"] = "pass"
        families[model_type] = entry
    for model_type, entry in families.items():
        if entry["category"] == "multimodal":
            entry.update(multimodal_status(entry.pop("text", None), families))
    return {"transformers": transformers_version, "torch": torch_version,
            "tolerances": {"loss_rel": family_check.LOSS_RTOL, "grad_rel": family_check.GRAD_RTOL},
            "families": families}
