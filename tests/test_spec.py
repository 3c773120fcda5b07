"""One StrategySpec per strategy: the registry every branch on a strategy asks."""

from __future__ import annotations

import json

import pytest

from partrain.cli import main
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.plan import candidate_plans, profile_batch_sizes
from partrain.recommend import needed_batch_sizes
from partrain.spec import FAMILIES, OPTIONS, SPECS, strategy_spec, threads_per_worker

pytestmark = pytest.mark.alone  # profiles a model to predict and recommend from: never beside another test (make test)


def test_every_spec_is_complete_and_its_runtime_resolves():
    from partrain.strategies import PARALLELIZE

    assert set(PARALLELIZE) == set(SPECS)
    for name, spec in SPECS.items():
        assert spec.family in FAMILIES and set(spec.options) <= set(OPTIONS)
        assert callable(spec.runtime()) and PARALLELIZE[name] is spec.runtime()
        assert spec.synchronous or spec.asynchronous_because, name
        assert not spec.micro_batched or spec.pipelined, name


def test_unknown_strategy_names_the_choices():
    with pytest.raises(PartrainError, match="unknown strategy 'warp': choose one of serial, ddp"):
        strategy_spec("warp")


def test_candidates_come_from_the_specs_variants():
    labels = [p.label() for p in candidate_plans(4, 64)]
    assert labels[:2] == ["ddp bucket 25MB", "ddp bucket 1MB"] and "hybrid pp2xdp2 1f1b M=4" in labels
    assert [p.strategy for p in candidate_plans(1, 64)] == ["serial"]
    assert {p.strategy for p in candidate_plans(2, 64)} == set(SPECS) - {"serial", "hybrid"}


def test_refusals_are_the_specs():
    hogwild = SPECS["hogwild"]
    assert hogwild.refusal(2, 2, "gloo") is None
    assert "all its workers on one node, with gloo" in hogwild.refusal(2, 1, "gloo")
    assert "with gloo" in hogwild.refusal(2, 2, "nccl") and SPECS["ddp"].refusal(2, 1, "nccl") is None


def test_threads_per_worker_is_written_once():
    assert threads_per_worker(8, 2) == 4 and threads_per_worker(2, 4) == 1 and threads_per_worker(8, 2, 3) == 3
    assert RunConfig(strategy="1f1b", workers=2).pipeline_schedule == SPECS["1f1b"].default_schedule


TWO_NODES = """
[cluster]
name = "two-nodes"
nodes = 2
workers_per_node = 1
cores_per_node = 1
device_memory_gb = 8
backend = "gloo"
shared_memory = true

[intra]
bandwidth_gb_per_s = 10
latency_us = 5

[inter]
bandwidth_gb_per_s = 1
latency_us = 50
"""


def test_predict_and_recommend_give_the_same_time_for_the_same_plan(tmp_path, capsys, monkeypatch):
    """The issue's cluster case: 2 nodes x 1 worker of 1 core. Both commands profile the
    worker with the one thread it will run, and both refuse hogwild across nodes."""
    from partrain.profile import cache

    # the first command's profiles are kept for the second even on a busy machine (by default a
    # profile taken under load is not kept, and each command would measure its own)
    monkeypatch.setattr(cache, "BUSY_SHARE", float("inf"))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(TWO_NODES)
    common = ["--model", "mlp", "--dataset", "mnist", "--synthetic", "--workers", "2", "--cluster", str(cluster),
              "--batch-size", "64", "--profile-dir", str(tmp_path / "profiles")]
    sizes = ",".join(map(str, profile_batch_sizes(needed_batch_sizes(2, 64))))
    assert main(["predict", *common, "--profile-batch-sizes", sizes, "--all", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert main(["recommend", *common, "--async", "--json"]) == 0
    recommended = json.loads(capsys.readouterr().out)
    by_label = {p["label"]: p["seconds_per_step"] for p in recommended["ranked"] if p["plan"]["workers"] == 2}
    assert len(by_label) >= 5
    for p in predicted["predictions"]:
        if p["label"] in by_label:
            assert p["seconds_per_step"] == pytest.approx(by_label[p["label"]], rel=1e-12), p["label"]
    assert {p["plan"]["threads"] for p in predicted["predictions"]} == {None}
    assert "hogwild" not in {p["plan"]["strategy"] for p in predicted["predictions"]}
    assert any(i["plan"] == "hogwild" and "one node" in i["reason"] for i in predicted["invalid"])
    assert any(r["plan"] == "hogwild" for r in recommended["rejected"])


def test_a_tenth_strategy_is_its_spec(monkeypatch, tmp_path):
    """A strategy added as a StrategySpec alone (here a twin of ddp under another name) is
    configured, enumerated, labelled, printed as a command and costed like the one it copies."""
    import dataclasses as dc

    from partrain.predict import predict_plan
    from partrain.predict.cluster import load_cluster
    from partrain.profile.cache import load_or_profile
    from partrain.spec import COST_MODELS

    assert all(spec.cost in COST_MODELS for spec in SPECS.values())
    monkeypatch.setitem(SPECS, "ddp-twin", dc.replace(SPECS["ddp"], name="ddp-twin"))
    assert RunConfig(strategy="ddp-twin", workers=2).dims.dp == 2
    plans = {(p.strategy, p.bucket_mb): p for p in candidate_plans(2, 64)}
    twin, ddp = plans["ddp-twin", 25.0], plans["ddp", 25.0]
    assert twin.label() == "ddp-twin bucket 25MB"
    assert plans["ddp-twin", 1.0].cli_args() == ["--batch-size", "64", "--strategy", "ddp-twin", "--workers", "2",
                                                  "--bucket-mb", "1.0"]
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(TWO_NODES)
    hw = load_cluster(cluster)
    profile = load_or_profile("mlp", "mnist", [32], 1, tmp_path / "profiles", synthetic=True)[0]
    assert predict_plan(profile, hw, twin).seconds_per_step == predict_plan(profile, hw, ddp).seconds_per_step
