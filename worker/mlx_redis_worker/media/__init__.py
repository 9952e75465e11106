"""Images and videos of jobs: untrusted bytes made into the frames a vision model takes.

The one way in is ``decode_image`` / ``decode_video`` (the daemon's jobs and the engine's
direct API alike): bounded by ``mlx_redis_protocol.limits.Limits`` before any decoding, each
failure a ``MediaError`` (a ``ValueError``) with the protocol's code. Needs the worker's
``vision`` extra (Pillow, PyAV); nothing here touches MLX.
"""

from __future__ import annotations

from mlx_redis_worker.media.errors import MediaError
from mlx_redis_worker.media.images import decode_image
from mlx_redis_worker.media.video import decode_video

__all__ = ["MediaError", "decode_image", "decode_video"]
