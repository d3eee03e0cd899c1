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


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect anything: the check sees every test
def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (tests/quick_tier.py); an entry naming no test is an error."""
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
