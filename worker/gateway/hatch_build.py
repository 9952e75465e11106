"""Hatchling metadata hook shared by mlx-redis-gateway and mlx-redis-worker: their
dependencies, with ``{version}`` standing for the version being built (the repository's VERSION
file), so each pins its sibling distributions to exactly its own version."""

from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface


class PinSiblings(MetadataHookInterface):
    def update(self, metadata: dict[str, Any]) -> None:
        version = metadata["version"]
        metadata["dependencies"] = [d.format(version=version) for d in self.config["dependencies"]]
