import os
import sys

# Spawned ranks import test modules by name; make `tests/` importable there too.
sys.path.insert(0, os.path.dirname(__file__))

# Inductor compiles in the process that asks (no pool of compile workers per
# rank): several ranks each spawning workers on a 2-core machine only contend.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# pyarrow's jemalloc starts a background thread on import; the pooled ranks
# fork from a server that imports pyarrow (through torchtitan): no thread there.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
