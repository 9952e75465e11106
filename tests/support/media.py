"""Real image and video files for the media tests, made here with Pillow and PyAV, and the
hostile ones: a decompression bomb's header, cut files, a file that is no image."""

from __future__ import annotations

import contextlib
import http.server
import io
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from mlx_redis_worker.bench.hostile_images import picture, png_bomb

__all__ = ["image_file", "png_bomb", "serving_media", "video_file"]


def image_file(seed: int = 0, size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> bytes:
    """A real image file of random pixels (the same for the same seed)."""
    return picture(seed, size, fmt)


def video_file(frames: int = 30, rate: int = 10, size: tuple[int, int] = (64, 48)) -> bytes:
    """A real MP4 (MPEG-4 part 2) whose frame i is grey level 8 i: ``frames / rate`` s."""
    import av
    import numpy as np

    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream: Any = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            pixels = np.full((height, width, 3), (index * 8) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


@contextlib.contextmanager
def serving_media(files: Mapping[str, bytes]) -> Iterator[str]:
    """An HTTP server on loopback answering each path of ``files`` with its bytes, and
    ``/moved`` with a redirect to the cloud metadata address; its base URL (by name,
    ``localhost``)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest")
                self.end_headers()
                return
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
