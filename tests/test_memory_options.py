"""One options object for the memory switches (issue 54): MemoryOptions.

* its rules between switches, one message each, checked when it is made;
* every switch reaches the object from each front end -- the trainer's config sections,
  UlyssesArguments (transformers' Trainer and TRL) -- so a new field that one of them does
  not set fails here;
* the keyword form (``parallelize_llama(model, pmesh, tiled_mlp=True)``) and the object
  (``memory=MemoryOptions(tiled_mlp=True)``) parallelize the same model the same way, for
  our Llama and a transformers model; an unknown keyword is refused, naming the switches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from ulysses_dtensor import MemoryOptions, ParallelDims, parallelize_llama
from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.trainer.config import parse_config
from ulysses_dtensor.trainer.memory_config import memory_options

# A value other than the default for every switch, and the trainer keys / UlyssesArguments
# fields that set it (the trainer stores 0 for "from the shapes").
NON_DEFAULT = {
    "ac_mode": "full", "selective_ac": 2, "save_attention": True, "tiled_mlp": True, "mlp_tiles": 3,
    "tiled_loss": True, "loss_chunks": 5, "offload_activations": True, "offload_dir": "/nvme/offload",
    "offload_params": True, "head_chunks": 2,
}
# Counts and the disk tier act only with their switch on.
NEEDS = {"mlp_tiles": "tiled_mlp", "loss_chunks": "tiled_loss", "offload_dir": "offload_activations"}
TRAINER_KEYS = {
    "ac_mode": ("activation_checkpoint", "mode"), "selective_ac": ("activation_checkpoint", "selective"),
    "save_attention": ("activation_checkpoint", "save_attention"),
}


def test_the_rules_between_switches_are_checked_when_the_object_is_made():
    with pytest.raises(ValueError, match=r"offload_activations=True needs ac_mode='full' .* got ac_mode='none'"):
        MemoryOptions(offload_activations=True)
    with pytest.raises(ValueError, match=r"save_attention=True needs ac_mode='full'"):
        MemoryOptions(ac_mode="selective", save_attention=True)
    with pytest.raises(ValueError, match=r"mlp_tiles=0 must be a positive integer, or None for automatic"):
        MemoryOptions(mlp_tiles=0)
    with pytest.raises(ValueError, match=r"head_chunks=True must be a positive integer"):
        MemoryOptions(head_chunks=True)
    with pytest.raises(ValueError, match=r"offload_dir='/nvme' needs offload_activations=True"):
        MemoryOptions(ac_mode="full", offload_dir="/nvme")
    with pytest.raises(ValueError, match=r"ac_mode='some' must be one of \('none', 'full', 'selective'\)"):
        MemoryOptions(ac_mode="some")
    with pytest.raises(ValueError, match=r"selective_ac='x' must be 'op' or a positive integer"):
        MemoryOptions(ac_mode="selective", selective_ac="x")
    assert MemoryOptions(ac_mode="selective", selective_ac=2).every_k == 2
    assert MemoryOptions(ac_mode="full", tiled_mlp=True).describe() == "ac_mode='full', tiled_mlp=True"


def test_keywords_fold_into_the_object_and_unknown_ones_are_refused():
    base = MemoryOptions(ac_mode="full")
    assert MemoryOptions.merged(base, {"tiled_mlp": True}, "f") == MemoryOptions(ac_mode="full", tiled_mlp=True)
    assert MemoryOptions.merged(None, {}, "f") == MemoryOptions()
    with pytest.raises(TypeError, match=r"f\(\) got unexpected keyword argument\(s\) 'tiled_mpl'; memory "
                                        r"switches: ac_mode, selective_ac, .*head_chunks"):
        MemoryOptions.merged(None, {"tiled_mpl": True}, "f")
    with pytest.raises(TypeError, match=r"takes a MemoryOptions, got dict"):
        MemoryOptions.merged({"tiled_mlp": True}, {}, "f")


def test_every_switch_reaches_the_object_from_the_trainer_config():
    for name, value in NON_DEFAULT.items():
        section, key = TRAINER_KEYS.get(name, ("memory", name))
        toml = {section: {key: str(value) if key == "selective" else value}}
        if name != "ac_mode":  # what the other switches need
            toml.setdefault("activation_checkpoint", {})["mode"] = "selective" if name == "selective_ac" else "full"
        if name in NEEDS:
            toml["memory"][NEEDS[name]] = True
        got = memory_options(parse_config(toml))
        assert getattr(got, name) == value, (name, got)
        others = {f: getattr(got, f) for f in MemoryOptions.field_names() if f not in (name, "ac_mode", NEEDS.get(name))}
        assert others == {f: getattr(MemoryOptions(), f) for f in others}, (name, others)


def test_every_switch_reaches_the_object_from_ulysses_arguments():
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from ulysses_dtensor.integrations.hf import UlyssesArguments
    from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import parallelize_options

    plain = TrainingArguments(output_dir="/tmp/unused", use_cpu=True, report_to=[])
    checkpointing = dataclasses.replace(plain, activation_checkpointing=True)
    every_2 = dataclasses.replace(plain, activation_checkpointing=True,
                                  activation_checkpointing_kwargs={"every_n_layers": 2})
    # The Trainer's own arguments set activation checkpointing; UlyssesArguments the rest.
    # UlyssesArguments.loss_chunks says both whether and how: 1 untiled, 0 from the shapes, n chunks.
    via_args = {"ac_mode": (checkpointing, {}), "selective_ac": (every_2, {}),
                "tiled_loss": (checkpointing, {"loss_chunks": 0})}
    for name, value in NON_DEFAULT.items():
        args, fields = via_args.get(name, (checkpointing, {name: value}))
        if name in NEEDS and NEEDS[name] == "offload_activations":
            fields = {**fields, "offload_activations": True}
        got = parallelize_options(args, UlyssesArguments(**fields))["memory"]
        assert getattr(got, name) == value, (name, got)
    assert parallelize_options(plain, UlyssesArguments())["memory"] == MemoryOptions()


def _structure(model) -> dict:
    return {
        "tiles": [layer.feed_forward.num_tiles for layer in model.layers.values()],
        "loss_chunks": model.output.loss_chunks,
        "blocks": [type(layer).__name__ for layer in model.layers.values()],
        "offloader": model.offloader is not None,
        "memory": model.memory_options,
    }


def test_the_keyword_form_and_the_object_parallelize_alike():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pmesh = ParallelDims(1, 1, 1, world_size=1).build_mesh("cpu")
        built = []
        for kwargs in ({"ac_mode": "full", "tiled_mlp": True, "mlp_tiles": 2, "tiled_loss": True,
                        "offload_activations": True},
                       {"memory": MemoryOptions(ac_mode="full", tiled_mlp=True, mlp_tiles=2, tiled_loss=True,
                                                offload_activations=True)},
                       {"memory": MemoryOptions(ac_mode="full", tiled_mlp=True, mlp_tiles=2), "tiled_loss": True,
                        "offload_activations": True}):
            with torch.device("meta"):
                model = Llama(llama_args("debug"))
            built.append(_structure(parallelize_llama(model, pmesh, **kwargs)))
        assert built[0] == built[1] == built[2]
        assert built[0]["tiles"] == [2, 2] and built[0]["offloader"]
        with torch.device("meta"):
            model = Llama(llama_args("debug"))
        with pytest.raises(TypeError, match=r"parallelize_llama\(\) got unexpected keyword argument\(s\) 'tile_mlp'"):
            parallelize_llama(model, pmesh, tile_mlp=True)
    finally:
        dist.destroy_process_group()
