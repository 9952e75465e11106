"""The one command that installs a part of the project that is missing here.

The three distributions are not on any package index: they install from a checkout of the
repository (``pip install ./protocol ./worker/gateway .``). So a hint names the checkout's path
of the distribution, not its name: the checkout this code runs from (a source tree or an
editable install), else the one pip installed it from (PEP 610's ``direct_url.json``), else the
path inside any checkout, said as such.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlparse

PROTOCOL_DISTRIBUTION: Final = "mlx-redis-protocol"
# Each distribution's folder in the repository.
CHECKOUT_PATHS: Final = {
    PROTOCOL_DISTRIBUTION: "protocol",
    "mlx-redis-gateway": "worker/gateway",
    "mlx-redis-worker": ".",
}


def install_command(distribution: str, extra: str | None = None) -> str:
    """``pip install ./worker/gateway`` (or the checkout's absolute path when the working
    directory is elsewhere); ``extra``: one of its extras (``'.[vision]'``)."""
    folder = CHECKOUT_PATHS[distribution]
    root = checkout_root()
    if root is None:
        return f"pip install {_target(f'./{folder}', extra)} (in a checkout of the repository)"
    if root == Path.cwd().resolve():
        return f"pip install {_target('.' if folder == '.' else f'./{folder}', extra)}"
    return f"pip install {_target(str(root if folder == '.' else root / folder), extra)}"


def _target(path: str, extra: str | None) -> str:
    path = path.removesuffix("/.")
    return f"'{path}[{extra}]'" if extra else path


def checkout_root() -> Path | None:
    """The repository checkout this installation comes from, when it can be told."""
    here = Path(__file__).resolve().parents[2]  # <root>/protocol/mlx_redis_protocol/install.py
    if _is_checkout(here):
        return here
    try:
        recorded = metadata.distribution(PROTOCOL_DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        url = urlparse(str(json.loads(recorded or "{}").get("url", "")))
    except (ValueError, AttributeError):
        return None
    if url.scheme != "file":
        return None
    root = Path(unquote(url.path)).resolve().parent  # it was installed from <root>/protocol
    return root if _is_checkout(root) else None


def _is_checkout(root: Path) -> bool:
    return all((root / folder / "pyproject.toml").is_file() for folder in CHECKOUT_PATHS.values())
