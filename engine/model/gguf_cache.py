"""A GGUF checkpoint converted once into a Hugging Face directory in the user's cache, read from then on.

gguf-py reads every string of a GGUF file's metadata into a NumPy view of its own: the bundled model's vocabulary
(49,152 tokens and 48,900 merges) took it 9 s per reading on a 2-core AMD EPYC, and transformers reads the file
again for the tokenizer, so an engine spent 25 of the 32 s it took to start in those two readings. The converted
directory holds the same configuration, the same weights (float32 as dequantized: an engine in bfloat16 rounds them
as it would have from the file) and the tokenizer transformers built from the file; loading it takes about a second.

The directory is named by the file's path, size and modification time, so a changed file is converted again. It is
built under a temporary name and renamed into place, so a reader never sees half of it and two processes converting
at once both end with a whole one. Where the cache cannot be written the caller reads the GGUF file itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config
from engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVSTORM_CACHE_DIR"
# Part of every directory's name: a change to what a conversion writes gets new directories.
CONVERSION_VERSION = 1
TOKENIZER_FILE = "tokenizer_config.json"


def cache_root() -> Path:
    """``$KVSTORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvstorm``, else ``~/.cache/kvstorm``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstorm"


def converted_directory_name(path: Path) -> str:
    stat = path.stat()
    identity = f"{CONVERSION_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def converted_checkpoint(path: Path) -> Path | None:
    """The directory converted from the GGUF file at ``path`` (``config.json``, ``model.safetensors`` and, where the
    file has a tokenizer, the tokenizer's files), converting it the first time; None where the cache cannot be
    written. A file that cannot be read as a model raises as reading it directly does."""
    target = cache_root() / "gguf" / converted_directory_name(path)
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    except OSError as error:
        logger.warning("cannot write the model cache at %s (%s); reading %s directly", target.parent, error, path)
        return None
    try:
        _convert(path, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's conversion that finished first
                raise
        return target
    except OSError as error:
        logger.warning("cannot convert %s into the model cache (%s); reading it directly", path, error)
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert(path: Path, directory: Path) -> None:
    reader = open_gguf(path)
    config = read_gguf_config(reader)
    save_file(dict(iter_gguf_weights(reader, config, torch.float32)), directory / "model.safetensors")
    if "tokenizer.ggml.model" in reader.fields:
        Tokenizer.from_gguf(path).hf_tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
