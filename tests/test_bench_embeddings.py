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
    # Inputs/s, then CPU seconds per input, of direct and engine at 1 and at 64.
    for direct_1, engine_1, direct_64, engine_64 in (
        ((10, 0.04), (9, 0.05), (50, 0.008), (45, 0.010)),
        ((20, 0.02), (18, 0.03), (100, 0.004), (100, 0.004)),
        ((5, 0.08), (5, 0.09), (30, 0.010), (27, 0.015)),
    ):
        measured.add(DIRECT, 1, *direct_1)
        measured.add(ENGINE, 1, *engine_1)
        measured.add(DIRECT, 64, *direct_64)
        measured.add(ENGINE, 64, *engine_64)
    args = argparse.Namespace(model="m", batch=[1, 64], inputs=8, words=4, repeat=3)
    out = format_embeddings(measured, args)
    # By CPU (direct's CPU per input over the engine's), per rotation at 64: 0.80, 1.00, 0.67.
    assert (
        "    64         50.0         45.0             0.90             8.000            10.000"
        "    0.80"
    ) in out
    # Per rotation 45/9, 100/18, 27/5: 5.00, 5.56, 5.40 (the ratio of the medians is 5.00);
    # by CPU 0.05/0.010, 0.03/0.004, 0.09/0.015: 5.00, 7.50, 6.00.
    assert "batching gain, engine: 5.40x in inputs/s, 6.00x in CPU per input" in out
    assert "batching gain, direct: 5.00x in inputs/s, 5.00x in CPU per input" in out


def test_one_small_run_measures_both_ways() -> None:
    args = argparse.Namespace(model="tiny-embed", batch=[1, 4], inputs=16, words=4, repeat=1)
    measured = measure(args, log=lambda line: None)
    assert set(measured.rates) == {(DIRECT, 1), (ENGINE, 1), (DIRECT, 4), (ENGINE, 4)}
    assert all(len(rates) == 1 and rates[0] > 0 for rates in measured.rates.values())
    assert set(measured.cpu) == set(measured.rates)
    assert all(len(cpu) == 1 and cpu[0] > 0 for cpu in measured.cpu.values())
