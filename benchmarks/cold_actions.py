"""How long a pipeline's actions take inside the schedule, against the model profile's times.

    PYTHONPATH=src python3 benchmarks/cold_actions.py --model tests.gallery:tokens3d --workers 4 [--json out.json]

Trains the model for a few steps as one pipeline over ``--workers`` workers (GPipe, 1 thread
each, ``--trace``), and prints per stage the median forward and backward span inside the
schedule (``SpanStage``: the stage's ``forward_one_chunk`` and ``backward_one_chunk``, the
runtime's own work in them included) beside the profile's back-to-back and cold stage times
(``compute.stage_times``; cold: each block from caches written over, ``timing.evict_caches``)
plus the runtime's measured cost per action. The run is told the predictor's cut
(``--split-points``): left to itself it cuts by its own timings, maybe elsewhere.

Where the workers outnumber the cores, a stage that waits gives its core to another worker,
and its next action starts from caches that worker wrote over. On the 2-core VM partrain is
developed on (session 58, torch 2.13), the gallery's LayerNorm/GELU token model at batch 32
over 8 micro-batches on 4 workers (one block a middle stage) ran its middle stages' forwards in
0.32 ms and backwards in 0.40 ms: back to back 0.19 and 0.26 ms with the runtime's 0.08, cold
0.33 and 0.42. The first stage's forwards and the last stage's backwards, which GPipe runs back
to back, took 0.25 and 0.22 ms, near their back-to-back 0.22 and 0.20 (cold 0.44 and 0.34): the
predictor takes every action of such a pipeline cold, which over-counts those runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def spans(trace: Path) -> dict[int, dict[str, list[float]]]:
    """Per rank, the seconds of its forward ("F") and backward ("B") spans, steps after the fifth."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    out: dict[int, dict[str, list[float]]] = {}
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X" and e.get("name") == "step"}):
        steps = sorted(e["ts"] for e in events if e.get("pid") == rank and e.get("name") == "step")
        after = steps[min(5, len(steps) - 1)]
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X" and e["ts"] >= after]
        out[rank] = {kind: [e["dur"] / 1e6 for e in mine if e["name"][:1] == kind and e["name"][1:].isdigit()]
                     for kind in ("F", "B")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tests.gallery:tokens3d")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()

    from partrain.config import RunConfig
    from partrain.predict import Plan, compute
    from partrain.predict.pipeline import stage_bounds
    from partrain.profile.cache import hardware_for, load_or_profile

    micro = args.batch_size // args.microbatches
    profile = load_or_profile(args.model, args.dataset, [micro], 1, args.profile_dir, synthetic=True)[0]
    action = hardware_for(args.workers, args.profile_dir)[0].pipeline_action_s
    cfg = RunConfig(model=args.model, dataset=args.dataset, strategy="gpipe", workers=args.workers,
                    batch_size=args.batch_size, microbatches=args.microbatches, threads=1)
    bounds = stage_bounds(profile, Plan.from_config(cfg))
    hot = compute.stage_times(profile, bounds, micro)
    cold = compute.stage_times(profile, bounds, micro, cold=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        subprocess.run([sys.executable, "-m", "partrain", "train", "--model", args.model, "--dataset", args.dataset,
                        "--synthetic", "--strategy", "gpipe", "--workers", str(args.workers), "--batch-size",
                        str(args.batch_size), "--microbatches", str(args.microbatches), "--threads", "1",
                        "--steps", str(args.steps), "--no-eval", "--no-predicted", "--trace", str(trace),
                        "--split-points", ",".join(str(lo) for lo, _ in bounds[1:])],
                       check=True, stdout=subprocess.DEVNULL)
        measured = spans(trace)
    rows = []
    print(f"{args.model} on {args.workers} workers, micro-batches of {micro}; ms: inside the schedule | "
          f"back to back + action {action * 1e3:.3f} | cold + action")
    for s, (lo, hi) in enumerate(bounds):
        row = {"stage": s, "blocks": [lo, hi]}
        for i, kind in enumerate(("F", "B")):
            row[kind] = {"inside": statistics.median(measured[s][kind]), "back_to_back": hot[i][s] + action,
                         "cold": cold[i][s] + action}
        rows.append(row)
        print(f"stage {s} blocks {lo}-{hi - 1}: " + "   ".join(
            f"{kind} {row[kind]['inside'] * 1e3:.3f} | {row[kind]['back_to_back'] * 1e3:.3f} | {row[kind]['cold'] * 1e3:.3f}"
            for kind in ("F", "B")))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
