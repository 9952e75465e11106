"""What the tests share, one module per concept; test packages import from here instead of
keeping their own copies.

- ``processes``: ``mlx-worker run`` child processes (``WorkerProcess``, ``WorkerFactory``) and
  one-shot CLI commands (``mlx_worker``).
- ``environment``: the clean environment they run in, and the fast intervals tests give them.
- ``waiting``: ``run`` a coroutine, poll with ``wait_until`` / ``until``.
- ``prompts``: random prompts for the tiny model; ``references``: its greedy texts.
- ``events``: what a subscriber makes of a request's events.
- ``engines``: engines on real models for the engine tests.
- ``speculation``: the rejection rule's tests: a two-position target, the two tokens a verdict
  emits, the chi-square statistic.
- ``drivers``: what the reliability drivers share (result table, work directory, CLI tail).
- ``sse``: a raw HTTP client for the gateway: SSE messages with their ids, a TCP connection
  dropped at will (mid-stream or before the answer).

Redis servers, Clusters and Sentinels come from ``mlx_redis_worker.local_redis``.
"""
