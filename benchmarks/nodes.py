"""Predictions across emulated nodes, checked against runs across them (issue 18).

For each link rate: N network namespaces joined by shaped links (``partrain.testing.netns``),
``partrain profile --hardware`` run across them under torchrun (the link measured for real,
not written by hand), then each plan trained across them under torchrun and predicted with
``partrain predict --cluster <that measured profile>``. Prints measured against predicted
ms/step per plan and link (the mean step after warm-up against the predicted mean, which
amortizes local SGD's averaging over its K steps), and the bandwidth the profile measured
against the shaped rate.

    sudo .venv/bin/python benchmarks/nodes.py --rates 100,1000 --nodes 2 --model cnn --batch-size 64

With ``--what-if`` it checks the recommender's "what would change the answer" instead: it
profiles the link at the first rate, asks ``partrain recommend --cluster`` (that profile) for
the best plan on ``--nodes`` workers, reads its claim ("With a 10x slower link, serial on 1
worker would win", or "A 10x faster or slower link would not change the choice"), then trains
the winner and the plan the claim names (for "would not change": the best plan of another
strategy) at the first rate and at the rate the claim is about (10x lower or higher), and
reports whether the measured order turned as the claim says:

    sudo .venv/bin/python benchmarks/nodes.py --what-if --rates 1000 --nodes 2 --model cnn --batch-size 64

The recommender's 10x slower link scales every plan's exposed communication by 10; the
emulated link divides the rate by 10 (without ``netem`` the latency stays).

Needs root (namespaces). Every run is a fresh torchrun job; the machine's other load shows in
the figures, so run it on a quiet machine and read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from partrain.bench.nodes import shares_cores
from partrain.predict.profiles import HardwareProfile
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


def profile_link(nodes: EmulatedNodes, env: dict, port: int, profiles: Path) -> tuple[Path, float]:
    """``profile --hardware`` across ``nodes``, kept as ``cluster-<rate>.json`` with the cores the
    emulated nodes share (``bench.nodes.shares_cores``); (its path, the link rate it measured in
    Mbit/s: ``HardwareProfile.link_rate``, as ``validate`` reads it)."""
    across(nodes, ["profile", "--hardware", "--max-mb", "16", "--threads", "1"], env, port)
    hw_file = next(profiles.glob(f"hardware-w{nodes.n}-n{nodes.n}-*.json"))
    hw = HardwareProfile.load(hw_file)
    rate = hw.link_rate("inter")
    saved = shares_cores(hw, nodes.n, os.cpu_count() or 1).save(profiles / f"cluster-{nodes.link.rate_mbit:g}.json")
    hw_file.unlink()
    return saved, rate * 8 / 1e6


def train_seconds(train_args: list[str], workers: int, rate: float, env: dict, port: int) -> float:
    """The mean step after warm-up of ``partrain train train_args``: on ``workers`` emulated nodes
    joined at ``rate`` Mbit/s, or here when one worker (it has no link)."""
    train = ["train", *train_args, "--no-eval", "--json", "--quiet"]
    if workers == 1:
        done = subprocess.run([sys.executable, "-P", "-m", "partrain", *train], env={**os.environ, **env},
                              capture_output=True, text=True, check=True)
        out = done.stdout
    else:
        with EmulatedNodes(workers, Link(rate_mbit=rate), tag=f"w{port}") as nodes:
            out = across(nodes, train, nodes.env(env), port)
    # the mean: a local SGD step that averages is one in K, and the epoch pays for it
    return statistics.fmean(json.loads(out.strip().splitlines()[-1])["step_seconds"][5:])


CLAIM = re.compile(r"With a 10x (slower|faster) link, (.+?) on (\d+) workers? would win\.")


def claims(rec: dict) -> list[tuple[float, dict, bool]]:
    """(rate factor, the other plan, whether the claim says it overtakes the winner) per claim of
    the recommendation; "would not change the choice" is two claims, one per factor, with the
    best plan of another strategy staying behind."""
    ranked, text = rec["ranked"], rec["explanation"]
    found = [(0.1 if slower == "slower" else 10.0,
              next(p for p in ranked if p["label"] == label and p["plan"]["workers"] == int(workers)), True)
             for slower, label, workers in CLAIM.findall(text)]
    if "would not change the choice" in text:
        other = next(p for p in ranked if p["plan"]["strategy"] != rec["winner"]["plan"]["strategy"])
        found = [(0.1, other, False), (10.0, other, False)]
    return found


def check_what_if(args, env: dict, profiles: Path) -> None:
    """Take the recommendation at the first rate, and measure whether its claim holds."""
    rate = float(args.rates.split(",")[0])
    with EmulatedNodes(args.nodes, Link(rate_mbit=rate), tag="q") as nodes:
        cluster, measured_mbit = profile_link(nodes, nodes.env(env), 29400, profiles)
    print(f"link {rate:g} Mbit/s, profiled at {measured_mbit:.0f} Mbit/s", flush=True)
    job = ["--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size)]
    rec = json.loads(subprocess.run(
        [sys.executable, "-P", "-m", "partrain", "recommend", *job, "--workers", str(args.nodes), "--threads", "1",
         "--cluster", str(cluster), "--json"], env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout)
    winner = rec["winner"]
    print(f"recommend: {rec['explanation']}")
    run = ["--model", args.model, "--dataset", args.dataset, "--steps", str(args.steps)]
    port, held, measured = 29600, [], {}
    for factor, other, overtakes in claims(rec):
        changed, times = rate * factor, {}  # a 10x slower link: a tenth of the rate
        for at in (rate, changed):
            for p in (winner, other):
                one = p["plan"]["workers"] == 1  # no link: measured once, at whatever rate
                key = (p["label"], p["plan"]["workers"], None if one else at)
                if key not in measured:
                    port += 1
                    measured[key] = train_seconds([*run, *p["cli_args"]], p["plan"]["workers"], at, env, port)
                times[at, p["label"]] = measured[key]
        ahead = times[changed, other["label"]] < times[changed, winner["label"]]
        held.append(ahead == overtakes)
        claim = (f"{other['label']} overtakes {winner['label']}" if overtakes else
                 f"{winner['label']} stays ahead of {other['label']}")
        picked_right = times[rate, winner["label"]] <= times[rate, other["label"]]
        print(f"claim at {changed:g} Mbit/s: {claim}: "
              + ", ".join(f"{label} {t * 1e3:.1f} ms/step at {at:g}" for (at, label), t in times.items())
              + f" -> {'held' if held[-1] else 'did not hold'}"
              + ("" if picked_right else f" (at {rate:g} Mbit/s the pick was not the measured faster of the two)"), flush=True)
    print(f"{sum(held)} of {len(held)} claims held")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--what-if", action="store_true", help="check the recommender's claim of what a 10x slower or "
                    "faster link would change, at the first rate")
    args = ap.parse_args()
    if reason := available():
        sys.exit(f"benchmarks/nodes.py: {reason}")
    profiles = Path(tempfile.mkdtemp(prefix="partrain-nodes-"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PARTRAIN_PROFILE_DIR": str(profiles)}
    if args.what_if:
        return check_what_if(args, env, profiles)
    job = ["--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size), "--threads", "1"]
    rows = []
    for port, rate in enumerate(float(r) for r in args.rates.split(",")):
        with EmulatedNodes(args.nodes, Link(rate_mbit=rate), tag=f"b{port}") as nodes:
            node_env = nodes.env(env)
            saved, measured_mbit = profile_link(nodes, node_env, 29400 + port, profiles)
            print(f"link {rate:g} Mbit/s: profile --hardware measured {measured_mbit:.0f} Mbit/s "
                  f"({measured_mbit / rate - 1:+.0%}) with the link alone", flush=True)
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
