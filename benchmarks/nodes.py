"""Predictions across emulated nodes, checked against runs across them (issue 18).

For each link rate: N network namespaces joined by shaped links (``partrain.testing.netns``),
``partrain profile --hardware`` run across them under torchrun (the link measured for real,
not written by hand), then each plan trained across them under torchrun and predicted with
``partrain predict --cluster <that measured profile>``. Prints measured against predicted
ms/step per plan and link (the mean step after warm-up against the predicted mean, which
amortizes local SGD's averaging over its K steps), and the bandwidth the profile measured
against the shaped rate.

    sudo .venv/bin/python benchmarks/nodes.py --rates 100,1000 --nodes 2 --model cnn --batch-size 64

Needs root (namespaces). Every run is a fresh torchrun job; the machine's other load shows in
the figures, so run it on a quiet machine and read the ratios.
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

from partrain.testing.netns import EmulatedNodes, Link, available, torchrun_across

PLANS = {  # label -> train arguments
    "ddp": ["--strategy", "ddp"],
    "ddp 1MB buckets": ["--strategy", "ddp", "--bucket-mb", "1"],
    "local-sgd K=8": ["--strategy", "local-sgd", "--average-every", "8"],
    "gpipe": ["--strategy", "gpipe"],
}


def across(nodes: EmulatedNodes, args: list[str], env: dict, port: int) -> str:
    """Run ``partrain args`` on every node under torchrun; rank 0's stdout."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in torchrun_across(nodes, 1, args, port=port)]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        said = [line for _, err in outs for line in err.splitlines() if line.startswith("partrain: error")]
        raise SystemExit(f"partrain {' '.join(args)} failed across the nodes: {said[0] if said else outs[0][1][-1500:]}")
    return outs[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--plans", default=",".join(PLANS))
    args = ap.parse_args()
    if reason := available():
        sys.exit(f"benchmarks/nodes.py: {reason}")
    profiles = Path(tempfile.mkdtemp(prefix="partrain-nodes-"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PARTRAIN_PROFILE_DIR": str(profiles)}
    job = ["--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size), "--threads", "1"]
    rows = []
    for port, rate in enumerate(float(r) for r in args.rates.split(",")):
        with EmulatedNodes(args.nodes, Link(rate_mbit=rate), tag=f"b{port}") as nodes:
            node_env = nodes.env(env)
            across(nodes, ["profile", "--hardware", "--max-mb", "16", "--threads", "1"], node_env, 29400 + port)
            hw_file = next(profiles.glob(f"hardware-w{args.nodes}-n{args.nodes}-*.json"))
            hw = json.loads(hw_file.read_text())
            big = max(hw["points"]["inter"][str(args.nodes)]["sendrecv"], key=lambda p: p[0])  # [bytes, seconds]
            measured_mbit = big[0] * 8 / big[1] / 1e6
            print(f"link {rate:g} Mbit/s: profile --hardware measured {measured_mbit:.0f} Mbit/s "
                  f"({measured_mbit / rate - 1:+.0%}) for a {big[0] / 2**20:.0f} MiB send/recv", flush=True)
            saved = profiles / f"cluster-{rate:g}.json"
            hw_file.rename(saved)
            for label in args.plans.split(","):
                train = ["train", *job, *PLANS[label], "--steps", str(args.steps), "--no-eval", "--json", "--quiet"]
                result = json.loads(across(nodes, train, node_env, 29500 + port).strip().splitlines()[-1])
                steps = result["step_seconds"][5:]  # warm-up left out
                # the mean: a local SGD step that averages is one in K, and the epoch pays for it
                measured = statistics.fmean(steps)
                pred = subprocess.run(
                    [sys.executable, "-P", "-m", "partrain", "predict", *job, "--workers", str(args.nodes),
                     "--cluster", str(saved), "--json"], env={**os.environ, **env}, capture_output=True, text=True)
                plans = json.loads(pred.stdout)["predictions"] if pred.returncode == 0 else []
                want = {"strategy": PLANS[label][1]}
                match = [p for p in plans if p["plan"]["strategy"] == want["strategy"]
                         and (label != "ddp 1MB buckets" or p["plan"]["bucket_mb"] == 1)
                         and (label != "local-sgd K=8" or p["plan"]["average_every"] == 8)]
                predicted = match[0]["seconds_per_step"] if match else None
                rows.append((rate, label, measured, predicted))
                err = f"{predicted / measured - 1:+.0%}" if predicted else "n/a"
                print(f"  {label:<16} measured {measured * 1e3:7.1f} ms/step, predicted "
                      f"{predicted * 1e3 if predicted else float('nan'):7.1f} ({err})", flush=True)
    errors = [abs(p / m - 1) for _, _, m, p in rows if p]
    if errors:
        print(f"MAPE {statistics.fmean(errors):.1%}, worst {max(errors):.1%} over {len(errors)} cells")


if __name__ == "__main__":
    main()
