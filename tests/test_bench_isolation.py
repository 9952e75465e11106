"""`mlx-worker bench isolation`: each attacker against the baselines on either side of it."""

from __future__ import annotations

import re
from collections import Counter

from mlx_redis_worker.bench.attackers import attacks
from mlx_redis_worker.bench.isolation_bench import Phase, format_isolation
from mlx_redis_worker.bench.long_prompts import LONG_PROMPT_ATTACKS
from tests.support.processes import mlx_worker


def _phase(
    attacker: str, tokens: float, ttft: float, health: float, gap: float = 0.05, **got: int
) -> Phase:
    cores = {"gateway_cores": 0.25, "worker_cores": 1.5} if attacker else {}
    if attacker:
        cores["attacker_cores"] = 0.125
    rate = 200.0 if attacker else 0.0
    return Phase(
        attacker,
        tokens,
        ttft,
        [health] * 10,
        Counter(got),
        **cores,
        exchanges_per_second=rate,
        gap_p99=gap,
    )


def test_ratios_are_against_the_neighbouring_baselines_and_goals_judged() -> None:
    phases = [
        _phase("", 100, 1.0, 0.01),
        _phase("huge header", 90, 1.5, 0.02, **{"431": 5}),
        _phase("", 80, 1.0, 0.01),
        _phase("read flood", 40, 2.0, 1.5, **{"429": 100, "404": 30}),
        _phase("", 80, 1.0, 0.01),
    ]
    out = format_isolation(phases)
    # 90 against the mean of 100 and 80; 40 against 80.
    # Cores and the attacker's rate as measured; a baseline without CPU figures shows "–".
    assert "| alone (baselines) | 1.00 | 1.00 | 1.00 | 10 | – | – | – | | | |" in out
    row = "| huge header | 1.00 | 1.50 | 1.00 | 20 | 0.25 | – | 1.50 | 0.12 | 200 | 431 ×5 |"
    assert row in out
    row = "| read flood | 0.50 | 2.00 | 1.00 | 1500 | 0.25 | – | 1.50 | 0.12 | 200 | "
    row += "429 ×100, 404 ×30 |"
    assert row in out
    assert "victim alone: 80 tok/s, inter-token p99 50 ms" in out
    assert out.rstrip().endswith("NOT met")


def test_a_victim_whose_gaps_grow_past_the_goal_fails_it_though_its_speed_holds() -> None:
    def run(gap: float) -> str:
        phases = [
            _phase("", 100, 1.0, 0.01, gap=0.04),
            _phase("long prompts", 100, 1.0, 0.01, gap, **{"200": 9}),
            _phase("", 100, 1.0, 0.01, gap=0.06),
        ]
        return format_isolation(phases)

    # 0.125 s against the mean of 0.04 and 0.06: 2.5x, the goal's edge; a little more fails.
    assert "| long prompts | 1.00 | 1.00 | 2.50 | 10 |" in run(0.125)
    assert run(0.125).rstrip().endswith(": met")
    assert "| long prompts | 1.00 | 1.00 | 2.60 | 10 |" in run(0.13)
    assert run(0.13).rstrip().endswith("NOT met")


def test_cli_runs_every_attacker_and_prints_the_table() -> None:
    # A process of its own: the bench starts its own redis-server, worker and gateway. The
    # long-prompt attackers (minutes of prefill on a CPU) have a test of their own, below.
    others = [name for name in attacks(0) if name not in LONG_PROMPT_ATTACKS]
    args = ["bench", "isolation", "--concurrency", "2", "--max-tokens", "8", "--idle-sockets", "20"]
    # Each attacker is under way before the victim starts (its process says so); the 1 s the
    # bench otherwise adds, 13 times, is flood traffic that this test asserts nothing about.
    args += ["--attack-lead", "0.2", "--attackers", ",".join(others)]
    done = mlx_worker(*args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    attackers = ["huge header", "huge body", "read flood", "resume flood", "hostile schema"]
    attackers += ["nested anyof", "logprobs fanout", "image bomb", "image 50mb", "image flood"]
    attackers += ["keep alive sockets", "big bodies", "many tools"]
    for attacker in [*attackers, "20 idle sockets"]:
        row = rf"^\| {attacker} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \| .*\|$"
        assert re.search(row, done.stdout, re.M), done.stdout
    assert re.search(r"^goals: .*: (met|NOT met)$", done.stdout, re.M), done.stdout
    # Each phase is a tenant of its own inside its own quota: the floods before them spent
    # the attacker key's 30 a minute, not these phases' (which then got 429 and attacked
    # nothing).
    for attacker in ("hostile schema", "nested anyof", "logprobs fanout", "many tools"):
        row = re.search(rf"^\| {attacker} \|(.*)\|$", done.stdout, re.M)
        assert row is not None and "429" not in row.group(1).split("|")[-1], done.stdout
    # The attackers are clients of their own, as on another host (Linux: all of 127/8 is lo).
    assert "connects from an address of its own (127.0.0.2, 127.0.0.3, …)" in done.stdout


def test_long_prompt_attackers_are_admitted_inside_their_quota() -> None:
    # A tenant inside its quota (30 a minute, 4 at once) sending long uncached prompts: every
    # request it sends is admitted (200, no 429), and the victim finishes all its streams.
    args = ["bench", "isolation", "--concurrency", "2", "--max-tokens", "8"]
    args += ["--attackers", "long-prompts,long-prompt-26k"]
    done = mlx_worker(*args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # The prompts are as long as asked on tiny's tokenizer (its context: max_prompt_tokens).
    assert "long-prompts: prompts of 2300 tokens and a salt" in done.stdout
    assert "long-prompt-26k: prompts of 26000 tokens and a salt" in done.stdout
    for attacker in ("long prompts", "long prompt 26k"):
        row = re.search(rf"^\| {attacker} \|(.*)\|$", done.stdout, re.M)
        assert row is not None, done.stdout
        cells = [cell.strip() for cell in row.group(1).split("|")]
        got = cells[-1]
        accepted = re.match(r"200 ×(\d+)", got)
        assert accepted is not None and int(accepted.group(1)) >= 1, got
        assert "429" not in got and "not done" not in got, got  # inside quota; victim done
        assert float(cells[0]) > 0, cells  # the victim's tok/s: it streamed to the end
