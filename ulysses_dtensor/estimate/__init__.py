"""Memory planner: the per-rank peak memory of one training step, traced, not guessed.

    python -m ulysses_dtensor.estimate --config train_configs/llama3_8b_1m.toml --world-size 8
    python -m ulysses_dtensor.estimate --config ... --world-size 8 --max-seq-len --budget-gib 80 --host-budget-gib 240

How the figure is made
----------------------
One process plays rank 0 of a world of ``N`` ranks: a ``fake`` process group
stands in for the other ranks (collectives return tensors of the right shape
and move nothing), and ``FakeTensorMode`` gives every tensor a shape, dtype and
device but no storage. Inside it the planner runs the trainer's own code:
:func:`~ulysses_dtensor.trainer.build.build_model` (meta build, Ulysses, AC,
tiling, offload, FSDP2), the trainer's AdamW, and the trainer's step
(:func:`~ulysses_dtensor.trainer.step.train_step`: forward with labels,
backward, clip, optimizer step, zero grad) on a batch of this rank's shape.
PyTorch's ``FSDPMemTracker`` (a dispatch mode) sees every tensor the step
creates and frees, and keeps the bytes alive by category; the peak is the high
water mark of that running sum. So the plan follows the code as it changes;
there is no formula of the model in here.

It is the figure ``torch.cuda.max_memory_allocated()`` reports for a step
(bytes of live tensors, optimizer state already created), NOT what
``nvidia-smi`` shows: the CUDA caching allocator's reserved-but-free blocks
(fragmentation), the CUDA context, NCCL's buffers and kernel workspaces that
never become tensors all come on top. Keep a headroom (``--headroom-gib``).

Attribution
-----------
By tracker category (sums to the peak): parameters (sharded masters / gathered
for compute), gradients (sharded / unsharded before reduce-scatter), optimizer
state (plus the step's temporaries while it runs), activations (saved for
backward, and recomputed ones), backward temporaries (activation gradients),
FSDP all-gather and reduce-scatter buffers, inputs. A second, cross-cutting
view of the activation and temporary bytes by what made them: logits
(``(tokens, vocab)``-shaped tensors), MLP hidden states (``(tokens, ffn_dim)``),
attention kernel outputs (SDPA out + logsumexp), Ulysses all-to-all outputs,
other. Offloaded block inputs land on the ``meta`` device (free on the traced
device) and are reported as host memory.

What the trace cannot see, and the planner adds from the traced shapes when
planning for CUDA (``device="cuda"``, labelled as such): the workspace the
FlashAttention-2 backward kernel allocates internally (an fp32 dq accumulator
and, under GQA, dk/dv expanded to all query heads).

Speed
-----
Tracing costs about a quarter of a millisecond per dispatched op, so what a
trace costs is the ops it dispatches. Loops over the sequence (the MLP tiles,
the loss chunks, RMSNorm's chunks: hundreds each at millions of tokens) are
traced at their edge pieces, the first and last two
(:func:`~ulysses_dtensor.memory.tiling.edge_pieces_only`): the pieces between
only repeat their memory pattern, and what the loop accumulates (the tiles'
outputs) is stood in for by one empty tensor as large. The memory is the same
(tests compare every phase's peak with ``loops="all"``), and a step costs the
same to trace at 10M tokens as at 100K: an 8B step of 4 blocks in 5-8 s of one
core. ``layers="extrapolate"`` traces 4-, 5- and 6-block versions of the model
instead of all of it, checks that the 5-block peaks (device and host, every
phase) lie on the line through the other two (else it traces every block), and
extrapolates every phase's peak, category and kind linearly in the block count
(exact where tested: see tests and benchmarks/RESULTS.md); ``"auto"`` (the
default) picks whichever costs less, and the output says which was done.

A search (``--max-seq-len``) solves for the limit instead of walking to it
(see :mod:`.search`): two to four lengths planned from 4- and 6-block traces,
the 5-block check once at the answer, about 20-40 s of one core for an 8B or a
70B model. The answer fits, the limit lies within ``--precision`` (0.5 %) above
it, and a second ceiling, host memory per GPU (``--host-budget-gib``, 240 by
default), stops it when offloaded activations and parameter state outgrow the
node's RAM; the answer names the ceiling that binds.

Layout
------
``plan`` (:class:`MemoryPlan`, the labels), ``tracker`` (the tracker subclass,
the by-kind classifier, the FA2 workspace), ``trace`` (the fake world, tracing
one step, extrapolation), ``planner`` (:func:`plan_memory`), ``search``
(:func:`find_max_seq_len`), ``grpo`` (a GRPO step of ``UlyssesGRPOTrainer``:
``--grpo``), ``cli`` (:func:`main`; ``__main__`` runs it).
"""

from .cli import main
from .plan import CATEGORY_LABELS, GIB, KIND_LABELS, PHASES, MemoryPlan
from .planner import plan_memory
from .search import HOST_BUDGET_GIB, SeqLenSearch, find_max_seq_len

__all__ = [
    "MemoryPlan",
    "SeqLenSearch",
    "plan_memory",
    "find_max_seq_len",
    "HOST_BUDGET_GIB",
    "main",
    "GIB",
    "CATEGORY_LABELS",
    "KIND_LABELS",
    "PHASES",
]
