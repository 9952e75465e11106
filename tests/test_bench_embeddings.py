"""`mlx-worker bench embeddings`: the engine against mlx-embeddings directly, in one process."""

from __future__ import annotations

import argparse

from mlx_redis_worker.bench.embeddings_bench import (
    DIRECT,
    ENGINE,
    Measured,
    format_embeddings,
    measure,
)


def test_ratios_are_medians_of_per_rotation_ratios() -> None:
    measured = Measured()
    for direct_1, engine_1, direct_64, engine_64 in (
        (10, 9, 50, 45),
        (20, 18, 100, 100),
        (5, 5, 30, 27),
    ):
        measured.add(DIRECT, 1, direct_1)
        measured.add(ENGINE, 1, engine_1)
        measured.add(DIRECT, 64, direct_64)
        measured.add(ENGINE, 64, engine_64)
    args = argparse.Namespace(model="m", batch=[1, 64], inputs=8, words=4, repeat=3)
    out = format_embeddings(measured, args)
    assert "    64         50.0         45.0             0.90" in out
    # Per rotation 45/9, 100/18, 27/5: 5.00, 5.56, 5.40 (the ratio of the medians is 5.00).
    assert "batching gain, engine: 5.40x (batch 64 over batch 1)" in out
    assert "batching gain, direct: 5.00x" in out


def test_one_small_run_measures_both_ways() -> None:
    args = argparse.Namespace(model="tiny-embed", batch=[1, 4], inputs=16, words=4, repeat=1)
    measured = measure(args, log=lambda line: None)
    assert set(measured.rates) == {(DIRECT, 1), (ENGINE, 1), (DIRECT, 4), (ENGINE, 4)}
    assert all(len(rates) == 1 and rates[0] > 0 for rates in measured.rates.values())
