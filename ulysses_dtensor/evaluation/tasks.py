"""Seeded, offline retrieval tasks at an exact token length.

Three tasks, written for this package after the published templates:

* ``passkey`` (passkey retrieval): an instruction, filler made of one repeated
  group of sentences, the needle "The pass key is N. Remember it. N is the pass
  key." at the asked depth, more filler, then "What is the pass key? The pass
  key is" and the answer " N" (5 digits).
* ``multikey`` (needle in a haystack with distractors, after RULER's multi-key
  task): four needles "One of the special magic numbers for KEY is: VALUE."
  with different keys and 7-digit values; the asked one sits at the depth, the
  three distractors at random depths; the question names the asked key.
* ``vartrack`` (variable tracking, after RULER): a chain "VAR A = 12345.",
  "VAR B = VAR A.", ... of 5 variables whose first assignment sits at the
  depth and whose later hops are spread evenly between it and the end, plus a
  distractor chain with another value; the answer lists the chain's variables.

A sample is built from separately tokenized pieces, concatenated: the
instruction (after BOS), filler, needles, the question and the answer. So its
length is exactly the asked number of tokens and every needle's token index is
known exactly: the target needle starts at ``len(instruction) + round(depth *
filler_tokens)`` plus the lengths of needles placed before it. Filler before a
needle ends at a sentence-group boundary (it may start mid-group); the last
filler, before the question, starts at one.

Everything random comes from ``numpy.random.default_rng`` seeded with (seed,
task, depth, sample index) -- not the length, so the needles are the same at
every length and only the haystack grows. The same seed gives the same samples
on any machine and rank. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TASKS", "RETRIEVAL_TASKS", "Sample", "SampleGenerator", "depth_grid", "generate",
           "min_length"]

RETRIEVAL_TASKS = ("passkey", "multikey", "vartrack")
TASKS = ("loss", *RETRIEVAL_TASKS)
_TASK_IDS = {name: i for i, name in enumerate(RETRIEVAL_TASKS)}

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

_INSTRUCTIONS = {
    "passkey": "A pass key is hidden in the long text below. Find it and remember it: "
               "you will be asked for it at the end.\n",
    "multikey": "Special magic numbers are hidden in the text below. Remember them: you "
                "will be asked for one of them at the end.\n",
    "vartrack": "Track the chains of variable assignments hidden in the text below: you "
                "will be asked which variables hold a value.\n",
}

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly",
    "keen", "lucky", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
    "urban", "vivid", "windy", "young", "zesty", "bold", "crisp", "faint", "grand", "humble",
)
_NOUNS = (
    "anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river",
    "saddle", "tunnel", "umbrella", "valley", "walnut", "yarrow", "zipper", "beacon", "canyon",
    "ferry", "glacier", "hammer",
)
N_DISTRACTORS = 3  # multikey: needles with other keys
N_VARIABLES = 5  # vartrack: variables per chain (4 hops)


@dataclass(frozen=True)
class Sample:
    """One retrieval prompt of exactly ``length`` tokens, answer included.

    ``tokens[answer_start:]`` is the answer; teacher-forced scoring checks the
    model's prediction at each position ``answer_start - 1 ... length - 2``.
    ``needle_index`` is the token index of the target needle's first token (for
    ``vartrack``: the chain's first assignment).
    """

    task: str
    length: int
    depth: float
    index: int
    tokens: np.ndarray
    answer: str
    answer_start: int
    needle_index: int
    needle_len: int

    @property
    def answer_len(self) -> int:
        return self.length - self.answer_start


@dataclass
class _Needle:
    tokens: np.ndarray
    depth: float
    target: bool = False


def depth_grid(n: int) -> list[float]:
    """``n`` depths evenly spaced from 0 (just after the instruction) to 1 (just
    before the question); one depth is the middle."""
    if n < 1:
        raise ValueError(f"the number of depths must be >= 1, got {n}")
    if n == 1:
        return [0.5]
    return [round(j / (n - 1), 6) for j in range(n)]


class SampleGenerator:
    """Samples for one tokenizer and seed; tokenizations of fixed texts are cached."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self._cache: dict[str, np.ndarray] = {}

    def encode(self, text: str) -> np.ndarray:
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(self.tokenizer.encode(text, bos=False, eos=False), dtype=np.int64)
            if len(text) < 400:  # fixed texts; needles are small too
                self._cache[text] = ids
        return ids

    def _rng(self, task: str, depth: float, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, _TASK_IDS[task], round(depth * 1e6), index])

    # ------------------------------------------------------------ the tasks
    def _parts(self, task: str, depth: float, index: int):
        """(instruction, needles, question, answer text) of one sample."""
        if task not in _TASK_IDS:
            raise ValueError(f"unknown retrieval task {task!r}; valid: {', '.join(RETRIEVAL_TASKS)}")
        rng = self._rng(task, depth, index)
        if task == "passkey":
            key = int(rng.integers(10_000, 100_000))
            needles = [_Needle(self.encode(f"The pass key is {key}. Remember it. {key} is the pass key. "),
                               depth, True)]
            question = "\nWhat is the pass key? The pass key is"
            answer = f" {key}"
        elif task == "multikey":
            picks = rng.choice(len(_ADJECTIVES) * len(_NOUNS), size=1 + N_DISTRACTORS, replace=False)
            keys = [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in picks]
            values = rng.integers(1_000_000, 10_000_000, size=len(keys))
            depths = [depth, *rng.random(N_DISTRACTORS)]
            needles = [
                _Needle(self.encode(f"One of the special magic numbers for {k} is: {v}. "), float(d), i == 0)
                for i, (k, v, d) in enumerate(zip(keys, values, depths))
            ]
            question = (f"\nWhat is the special magic number for {keys[0]} mentioned in the text? "
                        f"The special magic number for {keys[0]} is:")
            answer = f" {values[0]}"
        else:  # vartrack
            names = _variable_names(rng, 2 * N_VARIABLES)
            value, other = (int(v) for v in rng.choice(np.arange(10_000, 100_000), 2, replace=False))
            target, distract = names[:N_VARIABLES], names[N_VARIABLES:]
            hop_depths = [depth + k * (1.0 - depth) / N_VARIABLES for k in range(N_VARIABLES)]
            other_depths = sorted(rng.random(N_VARIABLES))
            needles = []
            for chain, first_value, depths, is_target in (
                (target, value, hop_depths, True), (distract, other, other_depths, False)
            ):
                for k, (name, d) in enumerate(zip(chain, depths)):
                    rhs = str(first_value) if k == 0 else f"VAR {chain[k - 1]}"
                    needles.append(_Needle(self.encode(f"VAR {name} = {rhs}. "), float(d),
                                           is_target and k == 0))
            question = (f"\nQuestion: which variables are assigned the value {value} in the text "
                        f"above? Answer: the variables assigned the value {value} are:")
            answer = " " + " ".join(target)
        head = self.encode(_INSTRUCTIONS[task])
        if self.tokenizer.bos_id is not None:
            head = np.concatenate([[self.tokenizer.bos_id], head]).astype(np.int64)
        return head, needles, self.encode(question), answer

    def fixed_tokens(self, task: str, depth: float, index: int) -> int:
        """Tokens of a sample that are not filler (its shortest possible length)."""
        head, needles, question, answer = self._parts(task, depth, index)
        return len(head) + sum(len(n.tokens) for n in needles) + len(question) + len(self.encode(answer))

    def sample(self, task: str, length: int, depth: float, index: int = 0) -> Sample:
        head, needles, question, answer_text = self._parts(task, depth, index)
        answer = self.encode(answer_text)
        fixed = len(head) + sum(len(n.tokens) for n in needles) + len(question) + len(answer)
        filler = length - fixed
        if filler < 0:
            raise ValueError(
                f"eval length {length} is too short for task {task!r} with tokenizer "
                f"{getattr(self.tokenizer, 'name', type(self.tokenizer).__name__)}: its instruction, "
                f"needles, question and answer alone take {fixed} tokens"
            )
        unit = self.encode(FILLER)
        # Needle k goes after round(depth_k * filler) filler tokens (stable for ties).
        order = sorted(range(len(needles)), key=lambda k: (round(needles[k].depth * filler), k))
        pieces, done, pos = [head], 0, len(head)
        needle_index = needle_len = -1
        for k in order:
            offset = round(needles[k].depth * filler)
            pieces.append(_filler(unit, offset - done, end_aligned=True))
            pos += offset - done
            done = offset
            if needles[k].target:
                needle_index, needle_len = pos, len(needles[k].tokens)
            pieces.append(needles[k].tokens)
            pos += len(needles[k].tokens)
        pieces += [_filler(unit, filler - done, end_aligned=False), question, answer]
        tokens = np.concatenate(pieces).astype(np.int64)
        assert len(tokens) == length, (len(tokens), length)
        return Sample(task, length, depth, index, tokens, answer_text.strip(), length - len(answer),
                      needle_index, needle_len)


def _filler(unit: np.ndarray, n: int, *, end_aligned: bool) -> np.ndarray:
    """``n`` tokens of the repeated filler; ending (or starting) at a group boundary."""
    if n <= 0:
        return unit[:0]
    reps = np.tile(unit, -(-n // len(unit)))
    return reps[len(reps) - n:] if end_aligned else reps[:n]


def _variable_names(rng: np.random.Generator, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(chr(ord("A") + int(c)) for c in rng.integers(0, 26, size=5))
        if name not in names:
            names.append(name)
    return names


def generate(task: str, tokenizer, length: int, depth: float, index: int = 0, seed: int = 0) -> Sample:
    """One sample (see :class:`SampleGenerator`)."""
    return SampleGenerator(tokenizer, seed).sample(task, length, depth, index)


def min_length(tasks, tokenizer, depths: int, samples: int, seed: int = 0) -> dict[str, int]:
    """Per retrieval task, the shortest length that fits every sample of the grid."""
    gen = SampleGenerator(tokenizer, seed)
    return {
        task: max(gen.fixed_tokens(task, d, i) for d in depth_grid(depths) for i in range(samples))
        for task in tasks if task in _TASK_IDS
    }
