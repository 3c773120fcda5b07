"""The zoo's accuracy on the real datasets, trained to the figures the reports published.

    PYTHONPATH=src python3 benchmarks/accuracy.py [--data-dir DIR] [--only cnn-mnist]

Each row trains serially, as ``partrain train`` does with its defaults (seed 0, 2 threads), and
prints the test accuracy of every epoch beside its target; the exit status is 1 if a row
missed it. The test suite checks shorter runs (``tests/test_train.py``: the cnn's first epoch,
the mlp's five); the full ones take minutes on 2 cores: the cnn's three epochs about a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from partrain.config import RunConfig
from partrain.runner import run_training

# name: (what it trains, the best epoch's accuracy it reaches)
ROWS = {
    "cnn-mnist": (dict(model="cnn", epochs=3), 0.988),
    "mlp-mnist": (dict(model="mlp", epochs=5), 0.975),
    # the reports' Linear+Sigmoid network; validation accuracy wobbles by ~1% epoch to epoch
    "mlp-ocr-letters": (dict(model="mlp", model_options={"activation": "sigmoid"}, dataset="ocr-letters",
                             epochs=12, batch_size=32, lr=0.1), 0.88),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("PARTRAIN_DATA_DIR", "../shared/data"))
    parser.add_argument("--only", default=",".join(ROWS), help=f"comma-separated rows of {', '.join(ROWS)}")
    args = parser.parse_args()
    missed = 0
    for name in args.only.split(","):
        options, target = ROWS[name]
        started = time.perf_counter()
        result = run_training(RunConfig(data_dir=args.data_dir, threads=2, **options), show_progress=False)
        accuracies = [e.test_accuracy for e in result.epochs]
        met = max(accuracies) >= target
        missed += not met
        print(f"{name:16s} best {max(accuracies):.2%} (target {target:.1%}: {'met' if met else 'MISSED'}), by epoch "
              f"{' '.join(f'{a:.2%}' for a in accuracies)}, {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
