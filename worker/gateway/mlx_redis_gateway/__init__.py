"""The OpenAI-compatible HTTP gateway: a stateless producer and subscriber of the protocol
(it imports ``mlx_redis_protocol`` and nothing of the worker: no MLX)."""
