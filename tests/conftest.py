import os
import sys

# Spawned ranks import test modules by name; make `tests/` importable there too.
sys.path.insert(0, os.path.dirname(__file__))
