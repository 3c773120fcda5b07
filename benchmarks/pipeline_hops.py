"""A pipeline's measured timeline against its simulation: where a step's time goes.

    PYTHONPATH=src python3 benchmarks/pipeline_hops.py --model-profile M.json --hardware H.json \\
        [--model mlp --dataset mnist --batch-size 64 --microbatches 4 --schedules 1f1b,gpipe] \\
        [--workers 2] [--split-points 2] [--link-mbit 100] [--steps 40] [--runs 1]

Trains the pipeline, a stage on each of ``--workers`` workers, with ``partrain train --events``
(on 127.0.0.1, or with ``--link-mbit`` across that many emulated nodes of one worker joined by
links of that rate, as a nodes suite places a 2x1 or 4x1 cell: needs root), then prints,
measured beside simulated (``predict``'s event simulation from the model profile and the
hardware profile given, e.g. the ones a nodes pass kept):

- the step: rank 0's median (measured) and the steady-state period (simulated);
- each action kind per rank: its median seconds (forward, backward, data, optimizer);
- each hop between neighbouring stages: from the moment a stage could take its input (its
  sender's action ended and it had reached the action) to the action's start; the median and
  the mean (a few long stalls move the mean, not the median).

A gallery model (``--model tests.gallery:tuple_out``) needs the repository root on PYTHONPATH.
Session 78 took issue 18's mlp 2-stage cells apart with it, session 79 issue 17's 4-stage
cells of small models (docs/predictions.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from partrain.predict.pipeline import simulate_plan
from partrain.predict.plan import Plan
from partrain.predict.profiles import HardwareProfile, ModelProfile
from partrain.profile.pace import at_later_pace

KINDS = {"forward": "F", "backward": "B", "data": "data", "optimizer": "optimizer"}


def train(args, schedule: str, events: str) -> None:
    argv = ["train", "--model", args.model, "--dataset", args.dataset, "--strategy", schedule,
            "--workers", str(args.workers), "--microbatches", str(args.microbatches), "--batch-size", str(args.batch_size), "--threads", "1",
            "--steps", str(args.steps), "--no-eval", "--events", events, "--json", "--quiet"]
    if args.split_points:
        argv += ["--split-points", args.split_points]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    if not args.link_mbit:
        subprocess.run([sys.executable, "-m", "partrain", *argv], env=env, check=True, capture_output=True, timeout=600)
        return
    from partrain.testing.netns import EmulatedNodes, Link, torchrun_across

    with EmulatedNodes(args.workers, Link(rate_mbit=args.link_mbit), tag="hop") as nodes:
        procs = [subprocess.Popen(cmd, env=nodes.env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for cmd in torchrun_across(nodes, 1, argv)]
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"a node's torchrun failed:\n{err[-2000:]}")


def measured(events: str, skip: int, workers: int) -> list[list[tuple[str, int, float, float]]]:
    """Per rank, per step after the first ``skip``: (kind, micro-batch, start, end), on rank 0's clock."""
    ranks = []
    wall0 = json.loads(Path(events, "rank0.meta.json").read_text())["wall0"]
    for r in range(workers):
        shift = json.loads(Path(events, f"rank{r}.meta.json").read_text())["wall0"] - wall0
        steps, cur = [], []
        for line in Path(events, f"rank{r}.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["name"] in KINDS:
                cur.append((KINDS[e["name"]], e.get("mb", -1), e["start"] + shift, e["end"] + shift))
            elif e["name"] == "step":
                steps.append(sorted(cur, key=lambda a: a[2]))
                cur = []
        ranks.append(steps[skip:])
    return ranks


def hops(ranks) -> dict[str, list[float]]:
    """Seconds from when each F (B) on a receiving rank could start to when it did, over every
    pair of neighbouring stages (rank r runs stage r)."""
    out = {"activation": [], "gradient": []}
    for r in range(len(ranks) - 1):
        for s0, s1 in zip(ranks[r], ranks[r + 1]):
            for kind, sender, receiver, name in (("F", s0, s1, "activation"), ("B", s1, s0, "gradient")):
                ends = {mb: end for k, mb, _, end in sender if k == kind}
                for prev, (k, mb, start, _) in zip(receiver, receiver[1:]):
                    if k == kind and mb in ends:
                        out[name].append(start - max(ends[mb], prev[3]))
    return out


def simulated(args, schedule: str):
    hw = HardwareProfile.load(args.hardware)
    profile = at_later_pace(ModelProfile.load(args.model_profile))
    plan = Plan(strategy=schedule, workers=args.workers, batch_size=args.batch_size, pp=args.workers, dp=1,
                microbatches=args.microbatches, schedule=schedule, threads=1,
                split_points=tuple(int(i) for i in args.split_points.split(",")) if args.split_points else None)
    res = simulate_plan(profile, hw, plan)
    steps = [[(k, mb, st, en) for rank, k, _, mb, st, en in sorted(res.spans, key=lambda s: s[4]) if rank == r]
             for r in range(args.workers)]
    return res.step_s, [[s] for s in steps]


def summary(step_s: float, ranks) -> dict:
    kinds = [{k: statistics.median(en - st for kk, _, st, en in (a for step in steps for a in step) if kk == k)
              for k in KINDS.values() if any(a[0] == k for step in steps for a in step)} for steps in ranks]
    return {"step": step_s, "kinds": kinds, "hops": hops(ranks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-profile", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", default="1f1b,gpipe")
    p.add_argument("--workers", type=int, default=2, help="pipeline stages, one per worker (default: 2)")
    p.add_argument("--link-mbit", type=float, help="across that many emulated nodes at this rate (root); default 127.0.0.1")
    p.add_argument("--split-points", help="the stages' first blocks after the first, e.g. 2 or 1,2,3 (default: balanced)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--runs", type=int, default=1, help="runs per schedule, alternating")
    args = p.parse_args()
    where = f"{args.workers} emulated nodes at {args.link_mbit:g} Mbit/s" if args.link_mbit else "127.0.0.1"
    print(f"{args.model}/{args.dataset} b{args.batch_size} M={args.microbatches}, {args.workers} stages on {where}; ms")
    for _ in range(args.runs):
        for schedule in args.schedules.split(","):
            with tempfile.TemporaryDirectory() as events:
                train(args, schedule, events)
                ranks = measured(events, skip=min(8, args.steps // 4), workers=args.workers)
            step0 = statistics.median(steps[-1][3] - steps[0][2] for steps in ranks[0])
            rows = {"measured": summary(step0, ranks), "simulated": summary(*simulated(args, schedule))}
            print(f"\n{schedule}: step measured {rows['measured']['step'] * 1e3:.2f}, "
                  f"simulated {rows['simulated']['step'] * 1e3:.2f}")
            for name, row in rows.items():
                kinds = " | ".join(" ".join(f"{k} {v * 1e3:.3f}" for k, v in ks.items()) for ks in row["kinds"])
                hop = " ".join(f"{h} {statistics.median(v) * 1e3:.2f} (mean {statistics.fmean(v) * 1e3:.2f})"
                               for h, v in row["hops"].items() if v)
                print(f"  {name:9s} actions r0 | r1 ...: {kinds}\n  {'':9s} hops: {hop}")


if __name__ == "__main__":
    main()
