import os
import sys

# Spawned ranks import test modules by name; make `tests/` importable there too.
sys.path.insert(0, os.path.dirname(__file__))

# Inductor compiles in the process that asks (no pool of compile workers per
# rank): several ranks each spawning workers on a 2-core machine only contend.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
