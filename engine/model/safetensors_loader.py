"""Read a Hugging Face checkpoint directory: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The shards named by the index file, or every *.safetensors file when there is no index."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"shards named in {INDEX_FILE} are missing: {missing}")
    return files


def iter_safetensors_weights(directory: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, shard.get_tensor(name).to(dtype)
