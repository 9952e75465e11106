"""The OpenAI-compatible HTTP gateway: a stateless producer and subscriber of the protocol
(it imports ``protocol`` and nothing of the engine: no MLX)."""
