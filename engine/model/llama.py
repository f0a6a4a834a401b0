"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens of all sequences in a step are flattened into one dimension T; the
attention backend is the only place that knows which token belongs to which
sequence. Weights use fused projections (QKV, gate+up) so each layer makes
four matmuls; ``load_weights`` takes Hugging Face names and fuses on the fly
(``engine.model.weight_names``). On the CPU a layer may run as one kernel call
(``engine.model.decoder_layer_kernel``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCacheLayer
from engine.model.config import ModelConfig
from engine.model.decoder_layer_kernel import forward_in_one_call, runs_in_one_call
from engine.model.packed_linear import PackedLinear, PackedSwiGLU, pack_linear_layers
from engine.model.weight_names import load_hf_weights
from kernels.cpu_layer_ops import rms_norm_cpu, rotate_heads_cpu_


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the activation dtype, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The function that normalises: ``rms_norm``, or a compiled kernel with its contract (``use_cpu_kernels``).
        self.kernel = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings; cos/sin computed in float32 from the positions.

    The inverse frequencies are computed on the CPU (so every device sees the same
    values) and cached per device; they are not a parameter or buffer, so the
    model's dtype never touches them.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
            self._inv_freq_by_device[device] = (1.0 / (self.theta**exponents)).to(device)
        return self._inv_freq_by_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_heads_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotary embeddings of the first ``num_heads`` heads of each row of ``qkv`` [T, width], in place: the query
    and key heads of a fused projection, which share each position's angles."""
    heads = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    heads.copy_(apply_rotary(heads, cos, sin))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5
        # ``rotate_heads_``, or a compiled kernel with its contract (``LlamaForCausalLM.use_cpu_kernels``).
        self.rotate_heads_ = rotate_heads_

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        c = self.config
        qkv = self.qkv_proj(x)
        self.rotate_heads_(qkv, cos, sin, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        out = backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the MLP of ``x`` (the sum is the layer's output, so a packed MLP can fuse it)."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)

    def packed(self, favour: str = "throughput", kernel: str = "auto") -> PackedSwiGLU:
        gate, up = self.gate_up_proj.weight.split(self.intermediate_size)
        return PackedSwiGLU(gate, up, self.down_proj.weight, favour, kernel)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # The whole layer in one call of the compiled CPU kernels, the same bits (``LlamaForCausalLM.use_cpu_kernels``).
        self.runs_as_one_call = False

    def forward(self, x, cos, sin, kv_cache, metadata, backend):
        if self.runs_as_one_call:
            return forward_in_one_call(self, x, cos, sin, kv_cache, metadata)
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, metadata, backend)
        return self.mlp(self.post_attn_norm(x), x)


class LlamaForCausalLM(nn.Module):
    """The decoder stack; ``forward`` returns final hidden states, ``compute_logits`` the LM head."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, metadata, self.backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab]: float32 from a packed LM head (``pack_linear_weights``), else in the model's dtype."""
        if self.lm_head is None:  # tied to the embeddings
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def pack_linear_weights(self, favour: str = "throughput", kernel: str = "auto") -> None:
        """Prepack every matmul weight for CPU inference (see ``packed_linear``): in tiles for kvstorm's own matmuls
        where ``kernel`` is "auto" and they apply (``uses_tiles``), else for oneDNN in the layout that batch-invariant
        calls favouring ``favour`` run best with (``choose_layout``); the MLPs run their element-wise work fused
        into the matmuls. A head tied to the embeddings gets its own packed copy, the embedding lookup keeps the
        plain matrix. The head gives float32 logits (``PackedLinear.float32_output``): in bfloat16 a logit of about 25
        is rounded to a multiple of 1/8, coarser than the gaps greedy decoding decides between. Weights cannot be
        loaded afterwards."""
        for layer in self.layers:
            if isinstance(layer.mlp, MLP):
                layer.mlp = layer.mlp.packed(favour, kernel)
        lm_head = self.lm_head
        pack_linear_layers(self, favour, kernel)
        if lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, favour=favour, kernel=kernel, float32_output=True)
        elif isinstance(self.lm_head, PackedLinear):
            self.lm_head.float32_output = self.lm_head.dtype != torch.float32

    def use_cpu_kernels(self, enabled: bool = True) -> bool:
        """RMSNorm and rotary embeddings through the compiled CPU kernels (``kernels.cpu_layer_ops``): the same
        roundings in one call each, where eager PyTorch makes 8-16 operator calls of them per layer; and where every
        layer's matmuls are packed for the tile matmuls (after ``pack_linear_weights``) and attention is the CPU
        backend's, each decoder layer in one call (``engine.model.decoder_layer_kernel``), which it returns.
        ``False`` goes back to the pure-torch functions (``kvstorm bench layer-ops`` compares the two)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = rms_norm_cpu if enabled else rms_norm
            elif isinstance(module, Attention):
                module.rotate_heads_ = rotate_heads_cpu_ if enabled else rotate_heads_
        one_call = enabled and all(runs_in_one_call(layer, self.backend) for layer in self.layers)
        for layer in self.layers:
            layer.runs_as_one_call = one_call
        return one_call

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters (``engine.model.weight_names``)."""
        load_hf_weights(self, self.config, named_tensors)
