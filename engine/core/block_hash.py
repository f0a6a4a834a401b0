"""Block hashes for prefix caching, chained as vLLM v1 chains them.

A full block's hash covers its parent block's hash, its own token ids and any extra keys (empty today; the slot is
for what else makes equal tokens different KV, such as a LoRA adapter or an image). Equal hashes therefore mean an
equal whole prefix, not only an equal block. SHA-256, so that a collision (two prefixes sharing KV they do not
have in common) is out of reach in practice.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# The parent of a sequence's first block.
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(b"\x00extra\x00" + extra_keys)
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> None:
    """Append the hash of every full block of ``token_ids`` that ``hashes`` does not cover yet."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, token_ids[start : start + block_size]))
