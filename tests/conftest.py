import os
import sys

import pytest

# Spawned ranks import test modules by name; make `tests/` importable there too.
sys.path.insert(0, os.path.dirname(__file__))

# fla-core (test extra) must not take transformers' CPU reference models off their torch path.
import transformers_torch_paths  # noqa: E402, F401

# Inductor compiles in the process that asks (no pool of compile workers per
# rank): several ranks each spawning workers on a 2-core machine only contend.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# pyarrow's jemalloc starts a background thread on import; the pooled ranks
# fork from a server that imports pyarrow (through torchtitan): no thread there.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")


# The files that take longest, longest first (worker-seconds on 2 cores; the full suite,
# then the quick tier). pytest-xdist (--dist loadfile) hands whole files to its workers in
# collection order: the long ones go first and the short ones fill in at the end, where
# one long file last would leave the other core idle for its whole run.
LONGEST_FIRST = {
    "full": ["test_estimate.py", "test_restarts.py", "test_hf_trainer.py", "test_estimate_speed.py",
             "test_parallelize.py", "test_gpu_perf.py", "test_lora.py", "test_trainer_transformers.py",
             "test_train.py", "test_benchmarks.py", "test_known_errors.py", "test_head_chunks.py",
             "test_estimate_grpo.py", "test_trl_grpo.py", "test_trl_dpo.py"],
    "quick": ["test_hf_linear_attention.py", "test_data_checks.py", "test_hf_integration.py",
              "test_estimate_speed.py", "test_hf_memory.py", "test_docs.py", "test_attention.py",
              "test_tensor_parallel.py", "test_hf_trainer.py", "test_ring.py", "test_trainer_transformers.py"],
}


def _longest_first(config, items) -> None:
    tier = "quick" if (config.option.markexpr or "").strip() == "quick" else "full"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST[tier])}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect anything: the check sees every test
def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (tests/quick_tier.py); an entry naming no test is an error. Then
    the files that take longest first (:data:`LONGEST_FIRST`)."""
    from quick_tier import TESTS, WHOLE_FILES

    found = set()
    for item in items:
        name = item.path.name
        if name in WHOLE_FILES:
            item.add_marker(pytest.mark.quick)
            continue
        for entry in TESTS.get(name, ()):
            if entry in (item.name, getattr(item, "originalname", None)):
                item.add_marker(pytest.mark.quick)
                found.add((name, entry))
    collected = {item.path.name for item in items}
    here = os.path.dirname(__file__)
    stale = [f"{name}::{entry}" for name, entries in TESTS.items() if name in collected
             for entry in entries if (name, entry) not in found]
    stale += [name for name in sorted(WHOLE_FILES | TESTS.keys()) if not os.path.exists(os.path.join(here, name))]
    if stale:
        raise pytest.UsageError(f"tests/quick_tier.py names tests that do not exist: {stale}")
    _longest_first(config, items)


def pytest_collection_finish(session):
    # The test modules imported torch, transformers, ...: hundreds of thousands of
    # objects that live for the whole session. Out of the collector's sight, each
    # full collection (gc's own, and the tests' gc.collect()) scans only what the
    # tests made since.
    import gc

    gc.freeze()


def pytest_unconfigure(config):
    # Back in sight for the interpreter's own teardown (extension modules check
    # at exit that their objects were freed, and complain otherwise).
    import gc

    gc.unfreeze()
