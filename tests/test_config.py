"""Bad configurations are refused before any work starts, each with one clear line."""

from __future__ import annotations

import pytest

from partrain.config import ParallelDims, RunConfig
from partrain.errors import PartrainError


def refused(**kwargs) -> str:
    with pytest.raises(PartrainError) as err:
        RunConfig(**kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_defaults_are_the_main_job():
    cfg = RunConfig()
    assert (cfg.model, cfg.dataset, cfg.strategy, cfg.workers) == ("mlp", "mnist", "serial", 1)
    assert cfg.dims == ParallelDims(1, 1, 1)


def test_pp_times_dp_must_equal_world_size():
    assert "pp x dp = 2 x 3 = 6 differs from the world size 4" in refused(strategy="hybrid", workers=4, pp=2, dp=3)


def test_fewer_microbatches_than_stages():
    assert "needs at least as many micro-batches as stages" in refused(strategy="1f1b", workers=4, microbatches=2)


def test_global_batch_not_divisible_by_dp_times_microbatches():
    assert "not divisible by dp x micro-batches = 2 x 2" in refused(strategy="hybrid", workers=4, pp=2, dp=2, microbatches=2, batch_size=66)
    assert "not divisible by 4 micro-batches" in refused(strategy="gpipe", workers=2, microbatches=4, batch_size=30)


def test_unknown_strategy_and_schedule():
    assert "unknown strategy 'zero'" in refused(strategy="zero")
    assert "unknown schedule 'zigzag'" in refused(strategy="gpipe", workers=2, schedule="zigzag")


def test_schedule_needs_a_pipeline_and_interleaving_needs_stages():
    assert "--schedule applies to pipeline strategies" in refused(strategy="ddp", workers=2, schedule="1f1b")
    assert "needs --stages-per-worker 2" in refused(strategy="1f1b", workers=2, schedule="interleaved-1f1b")
    assert "needs --schedule interleaved-1f1b" in refused(strategy="1f1b", workers=2, stages_per_worker=2)


def test_serial_is_one_worker_and_pp_dp_are_for_hybrid():
    assert "serial runs on one worker" in refused(strategy="serial", workers=2)
    assert "--pp/--dp apply to the hybrid strategy" in refused(strategy="ddp", workers=2, pp=2)


def test_numbers_out_of_range():
    assert "--batch-size must be an integer >= 1, got 0" in refused(batch_size=0)
    assert "--lr must be a finite number > 0 that float32 holds, got 0" in refused(lr=0)
    assert "--average-every takes a number of steps or 'epoch'" in refused(strategy="local-sgd", workers=2, average_every="often")


def test_derived_pipeline_settings():
    assert RunConfig(strategy="model-parallel", workers=2).num_microbatches == 1
    assert RunConfig(strategy="gpipe", workers=2).num_microbatches == 4  # 2 x stages by default
    assert RunConfig(strategy="1f1b", workers=2).pipeline_schedule == "1f1b"
    assert RunConfig(strategy="hybrid", workers=4).dims == ParallelDims(4, pp=2, dp=2)
    assert RunConfig(strategy="ddp", workers=3, batch_size=63).dims == ParallelDims(3, pp=1, dp=3)
