"""Benchmarks: a suite matrix measured for real, kept in a results store, and scaling studies.

    suite = load_suite("suites/quick.toml")        # or builtin_suite("quick", fingerprint())
    with Store("results.sqlite") as store:
        run_suite(suite, store)                    # each cell in fresh worker processes
        rows = store.rows()                        # dicts, with speedup and efficiency

``suite`` reads and validates the matrix, ``runner`` runs cells as ``partrain train``
subprocesses, ``store`` keeps them in SQLite, ``hardware`` fingerprints the machine, and
``scaling`` builds and plots the batch-size, learning-rate, strong and weak scaling studies.
"""

from partrain.bench.runner import run_cells, run_suite
from partrain.bench.store import Store, default_store_path
from partrain.bench.suite import Cell, Suite, builtin_suite, load_suite
from partrain.predict.machine import Hardware, fingerprint

__all__ = [
    "Cell", "Hardware", "Store", "Suite", "builtin_suite", "default_store_path", "fingerprint", "load_suite",
    "run_cells", "run_suite",
]
