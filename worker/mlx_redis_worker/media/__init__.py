"""Images and videos of jobs: untrusted bytes made into the frames a vision model takes.

The one way in is ``images.decode_image`` / ``video.decode_video`` (the daemon's jobs and
the engine's direct API alike): bounded by ``mlx_redis_protocol.limits.Limits`` before any
decoding, each failure an ``errors.MediaError`` (a ``ValueError``) with the protocol's code.
Those two modules need the worker's ``vision`` extra (Pillow, PyAV), so nothing is imported
here: a text-only worker imports ``errors`` alone. Nothing here touches MLX.
"""
