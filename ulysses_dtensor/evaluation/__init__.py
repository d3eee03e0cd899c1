"""Long-context evaluation that runs under the training mesh.

* :mod:`.tasks`: seeded, offline generators of retrieval samples (passkey,
  multi-key needle with distractors, variable tracking) at an exact token
  length, with the needle at an exact token index;
* :mod:`.scoring`: teacher-forced scoring (every answer token the argmax; the
  answer's mean log-probability);
* :mod:`.position_loss`: next-token loss in log-spaced position buckets;
* :mod:`.heldout`: a held-out split of the training documents;
* :mod:`.runner`: :class:`Evaluator`, the forward passes under sp / dp and the
  one reduction at the end;
* :mod:`.report`: JSON lines and TensorBoard scalars; :mod:`.plots`: PNGs.

The trainer runs it every ``eval.interval`` steps; ``python -m
ulysses_dtensor.eval`` runs the same code on a checkpoint.
"""

from .position_loss import bucket_edges
from .runner import EvalResult, Evaluator
from .scoring import teacher_forced_score
from .tasks import RETRIEVAL_TASKS, TASKS, Sample, generate, min_length

__all__ = [
    "EvalResult",
    "Evaluator",
    "RETRIEVAL_TASKS",
    "Sample",
    "TASKS",
    "bucket_edges",
    "generate",
    "min_length",
    "teacher_forced_score",
]
