"""Benchmarks run by ``mlx-worker bench``: ratios against baselines measured in the same run."""
