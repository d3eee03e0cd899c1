"""The user's data and reward functions for the example scripts (``--dataset``, ``--reward``).

:func:`read_dataset` reads a dataset a trainer is given -- a ``.jsonl``, ``.json`` or
``.parquet`` file, or a folder written by ``Dataset.save_to_disk`` -- into a
``datasets.Dataset`` and checks, before any model is loaded, that it has the columns
the trainer reads (:data:`NEEDS`), each holding text or chat messages (a list of
``{role, content}``) in every row. :func:`load_rewards` loads reward functions named
``FILE.py:FUNCTION`` (TRL's signature ``f(prompts, completions, **kwargs) -> list[float]``).

Whatever cannot be used is a :class:`UserDataError` (a ``ValueError``) whose one
message names the flag, the path and what would do, e.g. ``--dataset /x/pairs.jsonl
has no column 'rejected'; found: prompt, chosen; DPO needs prompt, chosen, rejected``.
Every rank reads the data, so every rank meets the same error: uncaught, it ends the
script with that one line per node instead of a traceback per rank.

Files are read without ``datasets``' cache (pyarrow for JSON Lines and Parquet): the
ranks of a launch read the same file at once, and nothing is written beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ulysses_dtensor.runtime.node_report import report_once_per_node

__all__ = ["UserDataError", "NEEDS", "read_dataset", "check_columns", "load_reward", "load_rewards"]

TEXT, MESSAGES, EITHER = "text", "chat messages", "text or chat messages"
# trainer -> the column sets it reads (any one of them will do), column -> what it holds.
NEEDS: dict[str, list[dict[str, str]]] = {
    "GRPO": [{"prompt": EITHER}],
    "DPO": [{"prompt": EITHER, "chosen": EITHER, "rejected": EITHER}],
    "SFT": [{"messages": MESSAGES}, {"prompt": EITHER, "completion": EITHER}, {"text": TEXT}],
    "Trainer": [{"text": TEXT}],
}
FORMATS = ".jsonl, .json, .parquet or a folder saved with Dataset.save_to_disk"


class UserDataError(ValueError):
    """A ``--dataset`` or ``--reward`` that cannot be used; the message says why."""

    def __init__(self, *args):
        super().__init__(*args)
        _install_report_hook()


_previous_hook = None


def _install_report_hook() -> None:
    global _previous_hook
    if _previous_hook is None:
        _previous_hook, sys.excepthook = sys.excepthook, _report_hook


def _report_hook(exc_type, exc, tb) -> None:
    if isinstance(exc, UserDataError):
        report_once_per_node("", exc)  # the message starts with the flag: no prefix needed
    else:
        _previous_hook(exc_type, exc, tb)


# -- datasets -------------------------------------------------------------------------------


def read_dataset(path: str, trainer: str, *, text_column: str = "text"):
    """The rows of ``path`` as a ``datasets.Dataset``, checked for what ``trainer`` (a key of
    :data:`NEEDS`) reads; ``text_column``: the text column's name (SFT's ``dataset_text_field``)."""
    dataset = _read(path)
    if len(dataset) == 0:
        raise UserDataError(f"--dataset {path} has no rows")
    check_columns(dataset, path, trainer, text_column=text_column)
    return dataset


def check_columns(dataset, path: str, trainer: str, *, text_column: str = "text") -> dict[str, str]:
    """The first column set of ``NEEDS[trainer]`` that ``dataset`` has (column -> what it
    holds), each column's type and rows checked; else one :class:`UserDataError`."""
    needs = [{(text_column if c == "text" else c): kind for c, kind in s.items()} for s in NEEDS[trainer]]
    found = list(dataset.column_names)
    wanted = ", or ".join(_names(s) for s in needs)
    for columns in needs:
        if all(c in found for c in columns):
            for column, kind in columns.items():
                _check_values(dataset, path, trainer, column, kind)
            return columns
    # Name what is missing from the set the file comes closest to (the first, if none is begun).
    best = max(needs, key=lambda s: sum(c in found for c in s))
    missing = [c for c in best if c not in found]
    if len(needs) > 1 and not any(c in found for c in best):
        head = f"has none of the columns {trainer} reads"
    else:
        head = f"has no column{'s' if len(missing) > 1 else ''} {', '.join(repr(c) for c in missing)}"
    raise UserDataError(f"--dataset {path} {head}; found: {', '.join(found) or 'no columns'}; "
                        f"{trainer} needs {wanted}")


def _names(columns: dict[str, str]) -> str:
    names = list(columns)
    return names[0] if len(names) == 1 else ", ".join(names) if len(names) > 2 else " and ".join(names)


def _check_values(dataset, path: str, trainer: str, column: str, kind: str) -> None:
    """From the Arrow schema (no row is read): text is a string column, chat messages a list
    of structs with ``role`` and ``content``; no row may lack the value."""
    import pyarrow as pa

    arrow = dataset.data.schema.field(column).type
    is_text = pa.types.is_string(arrow) or pa.types.is_large_string(arrow)
    is_messages = ((pa.types.is_list(arrow) or pa.types.is_large_list(arrow)) and pa.types.is_struct(arrow.value_type)
                   and {"role", "content"} <= {f.name for f in arrow.value_type})
    if not ((is_text and kind != MESSAGES) or (is_messages and kind != TEXT)):
        raise UserDataError(f"--dataset {path} column {column!r} holds {arrow}; {trainer} reads {kind} there "
                            f"(chat messages: a list of {{role, content}})")
    chunks = dataset.data.column(column)
    if chunks.null_count:
        first = next(i for i, v in enumerate(chunks.is_null().to_pylist()) if v)
        raise UserDataError(f"--dataset {path} has no {column!r} in {chunks.null_count} of {len(dataset)} rows "
                            f"(the first: row {first})")


def _read(path: str):
    from datasets import Dataset

    where = Path(path).expanduser()
    if where.is_dir():
        return _from_disk(path, where)
    if not where.is_file():
        raise UserDataError(f"--dataset {path}: no such file or folder; give {FORMATS}")
    suffix = where.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise UserDataError(f"--dataset {path}: unknown format {suffix or '(no suffix)'!r}; give {FORMATS}")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return Dataset(pq.read_table(where))
        except Exception as e:  # noqa: BLE001 -- pyarrow's errors are of several kinds
            raise UserDataError(f"--dataset {path} is not a Parquet file pyarrow reads: {e}") from e
    if not where.read_bytes().strip():
        raise UserDataError(f"--dataset {path} has no rows")
    if suffix == ".json":
        # A JSON array of rows, or an object of columns; Hugging Face's .json files are
        # often JSON Lines too (datasets' json loader reads both): those go to pyarrow.
        try:
            data = json.loads(where.read_text())
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":
                raise UserDataError(f"--dataset {path} is not JSON: {e}") from e
        else:
            if isinstance(data, list) and all(isinstance(row, dict) for row in data):
                return Dataset.from_list(data)
            if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
                return Dataset.from_dict(data)
            raise UserDataError(f"--dataset {path}: a .json file holds a list of rows (objects) or an object of "
                                f"columns (lists), not a {type(data).__name__} of that shape")
    import pyarrow.json as pj

    try:
        return Dataset(pj.read_json(where))
    except Exception as e:  # noqa: BLE001 -- pyarrow.lib.ArrowInvalid and friends
        raise UserDataError(f"--dataset {path} is not JSON Lines (one object per line): {e}") from e


def _from_disk(path: str, where: Path):
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(where))
    except FileNotFoundError as e:
        raise UserDataError(f"--dataset {path} is a folder not saved with Dataset.save_to_disk; give "
                            f"{FORMATS}") from e
    if isinstance(loaded, DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) != 1:
            raise UserDataError(f"--dataset {path} holds the splits {', '.join(loaded)} and none is 'train'; "
                                f"save the one to train on")
        return next(iter(loaded.values()))
    return loaded


# -- reward functions -------------------------------------------------------------------------

_modules: dict[Path, object] = {}  # a file's module, run once however many of its functions are named


def load_reward(spec: str) -> Callable:
    """The function ``FUNCTION`` of the Python file ``FILE.py`` (``spec``: ``FILE.py:FUNCTION``),
    which must take ``completions`` and ``**kwargs`` (TRL passes prompts, completions,
    completion ids and the dataset's other columns, by keyword)."""
    file, _, name = spec.rpartition(":")  # the last colon: a Windows path has one of its own
    if not file or not name.isidentifier():
        raise UserDataError(f"--reward {spec}: expected FILE.py:FUNCTION, e.g. my_rewards.py:length_reward")
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise UserDataError(f"--reward {spec}: no file {path}")
    if path.suffix != ".py":
        raise UserDataError(f"--reward {spec}: {path} is not a .py file")
    if path not in _modules:
        # A name of its own per file (two rewards.py in different folders do not collide),
        # registered so that what the file defines pickles and inspects as a module's.
        module_name = f"reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
        _modules[path] = module
    function = getattr(_modules[path], name, None)
    if function is None:
        defined = sorted(n for n, v in vars(_modules[path]).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise UserDataError(f"--reward {spec}: {path} has no function {name!r} (it defines: "
                            f"{', '.join(defined) or 'no functions'})")
    if not callable(function):
        raise UserDataError(f"--reward {spec}: {name} in {path} is a {type(function).__name__}, not a function")
    params = inspect.signature(function).parameters.values()
    takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" not in takes or not any(p.kind == p.VAR_KEYWORD for p in params):
        raise UserDataError(f"--reward {spec}: {name}{inspect.signature(function)} must take completions and "
                            f"**kwargs: TRL calls f(prompts=, completions=, completion_ids=, **columns) -> "
                            f"list[float]")
    return function


def load_rewards(specs: Iterable) -> list[Callable]:
    """:func:`load_reward` of each spec; a nested list (``--reward`` given several times,
    each with one or more specs) is flattened."""
    flat = [s for item in specs for s in ([item] if isinstance(item, str) else item)]
    return [load_reward(s) for s in flat]
