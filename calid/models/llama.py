"""A compact Llama-family decoder (Llama, Qwen2, SmolLM2) over ragged batches.

The model holds no distributed logic and no cache policy: it reads and writes
the per-sequence KV caches named in a :class:`~calid.runtime.batch.Batch`.
Projections are fused (q|k|v and gate|up) so each layer does four matmuls over
all new tokens of the batch at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from calid.models.config import ModelConfig
from calid.runtime.attention import attention_for
from calid.runtime.batch import Batch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables, grown on demand; rotate-half layout as in HF checkpoints."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._cos = self._sin = None

    def tables(self, max_pos: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < max_pos or self._cos.dtype != dtype or self._cos.device != device:
            n = max(max_pos, 2 * (self._cos.shape[0] if self._cos is not None else 256))
            inv_freq = 1.0 / (
                self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
            )
            freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return self._cos, self._sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """``attend(layer, q, k, v)`` stores k/v in the batch's caches and returns attention [T, heads, head_dim]."""
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        # contiguous: from a strided split, rope's output may put tokens innermost, and SDPA's CPU flash kernel
        # then falls back to its math path (a copy of K/V per query head: half the step at batch 16)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin).contiguous()
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.wo(attend(self.layer, q, k, v).reshape(T, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split([self.intermediate, self.intermediate], dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attend)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    """The decoder, or one pipeline stage of it.

    A stage holds ``cfg.num_layers`` consecutive layers (numbered from 0 in its
    own KV caches); only the first stage has the embedding (``embed=False``
    otherwise) and only the last one the final norm and head (``head=False``).
    """

    def __init__(self, cfg: ModelConfig, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def embed_tokens(self, batch: Batch) -> torch.Tensor:
        return self.embed(batch.input_ids)

    def run_layers(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Hidden states [T, hidden] through this model's layers; writes K/V into the caches."""
        top = batch.max_position if batch.max_position is not None else int(batch.positions.max())  # host sync
        cos, sin = self.rotary.tables(top + 1, x.dtype, x.device)
        cos, sin = cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)
        attend = batch.attention or attention_for(batch)
        for block in self.layers:
            x = block(x, cos, sin, attend)
        return x

    def logits(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logits [L, vocab] of the rows of ``x`` at ``batch.logits_index``."""
        return self.lm_head(self.norm(x[batch.logits_index]))

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [L, vocab] at ``batch.logits_index``."""
        return self.logits(self.run_layers(self.embed_tokens(batch), batch), batch)
