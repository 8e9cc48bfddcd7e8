"""A tiny GPT, in the style of nanoGPT: one file, read top to bottom.

Every chapter of the course reuses this model, and the distributed chapters
shard it *by module name*, so the names below are part of the contract::

    wte, wpe, drop                     token / position embeddings
    blocks.{i}.ln_1                    LayerNorm before attention
    blocks.{i}.attn.c_attn             fused q,k,v projection  h -> 3h
    blocks.{i}.attn.c_proj             attention output        h -> h
    blocks.{i}.ln_2                    LayerNorm before the MLP
    blocks.{i}.mlp.c_fc                MLP up projection       h -> r*h
    blocks.{i}.mlp.c_proj              MLP down projection     r*h -> h
    ln_f, lm_head                      final LayerNorm and output projection

With ``tie_weights`` the output projection reuses the token embedding
(``lm_head.weight is wte.weight``, Press & Wolf 2017): one tensor, two names in
``state_dict()``, one entry in ``parameters()``.

Notation used throughout the course (Megatron / Korthikanti et al. 2022):
``b`` batch size, ``s`` sequence length, ``h`` hidden size (``d_model``),
``a`` attention heads, ``L`` layers, ``V`` vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "tiny_config",
    "equality_config",
]


@dataclass
class GPTConfig:
    """Hyper-parameters of the tiny GPT.

    ``attn="sdpa"`` uses ``F.scaled_dot_product_attention`` (fused; on CPU it
    keeps no ``s x s`` matrix for backward). ``attn="math"`` writes softmax
    attention out explicitly, so the ``a*s*s`` attention probabilities are saved
    for backward -- the term in the activation-memory formula (see ``memory.py``).
    """

    vocab_size: int = 32
    block_size: int = 32  # maximum sequence length
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    bias: bool = True  # biases in Linear and LayerNorm layers
    dropout: float = 0.0
    tie_weights: bool = True  # lm_head.weight is wte.weight
    attn: str = "sdpa"  # "sdpa" | "math"
    mlp_ratio: int = 4  # MLP hidden size = mlp_ratio * d_model

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first rule the config breaks."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an int")
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.attn not in ("sdpa", "math"):
            raise ValueError(f"attn={self.attn!r} must be 'sdpa' or 'math'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def tiny_config(**overrides) -> GPTConfig:
    """The default course model: 2 layers, 4 heads, d_model=64, V=32, s=32 (~0.1M params)."""
    return GPTConfig(**overrides)


def equality_config(**overrides) -> GPTConfig:
    """Config for "distributed == single device" tests: no biases, no dropout.

    Why no biases: Adam divides by sqrt(v). A parameter whose true gradient is
    ~0 (e.g. the key bias: softmax is invariant to adding a constant to every
    score) gets gradients of pure rounding noise, and Adam scales that noise up
    to a full-size step -- so two mathematically equal runs drift apart.
    """
    return GPTConfig(**{"bias": False, "dropout": 0.0, **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    per head i:  q_i, k_i, v_i = x W_qkv[i];  y_i = softmax(q_i k_i^T / sqrt(h/a) + causal mask) v_i;
    heads are concatenated and projected by ``c_proj``.

    The fused ``c_attn`` output is laid out head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``
    (Megatron's layout), not ``[q | k | v]``: splitting its output columns evenly
    across ranks then hands every rank whole heads, which is all tensor
    parallelism needs. The head count is read off the tensor, so the same code
    runs on a column-sharded ``c_attn``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.attn = config.attn
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        qkv = self.c_attn(x)  # (B, T, 3h), laid out head by head: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
        heads = qkv.size(-1) // (3 * hd)  # = n_head, or this rank's share under tensor parallelism
        q, k, v = qkv.view(B, T, heads, 3, hd).unbind(dim=3)  # each (B, T, a, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, a, T, hd)

        if self.attn == "sdpa":
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, a, T, T)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(diagonal=1)
            att = att.masked_fill(future, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, a, T, hd)

        y = y.transpose(1, 2).contiguous().view(B, T, heads * hd)  # concatenate heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: c_proj(GELU(c_fc(x))), hidden size mlp_ratio*h."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer: embeddings -> L blocks -> ln_f -> lm_head.

    ``forward(idx, targets=None)`` returns ``(logits, loss)``: logits (B, T, V);
    loss = mean over all B*T positions of -log softmax(logits)[target], or None.

    Initialisation (GPT-2 / nanoGPT): every Linear and Embedding weight
    ~ N(0, 0.02), biases 0, LayerNorm weight 1; the two projections that write
    into the residual stream (``c_proj``) ~ N(0, 0.02 / sqrt(2L)) so the
    residual's variance does not grow with depth. Values are drawn from a
    private ``torch.Generator(seed)`` on the CPU and copied in, so the same seed
    gives bit-identical weights in every process and on every device, and the
    caller's (CPU) global RNG is left as it was. ``seed=None`` draws from the
    global RNG instead.
    """

    def __init__(self, config: GPTConfig, *, seed: int | None = 0):
        super().__init__()
        config.validate()
        self.config = config
        # nn.Linear & co. draw a default init from the global RNG; with a seed we overwrite it
        # anyway, so run construction on a forked RNG and leave the caller's CPU RNG as it was.
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.block_size, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        """(Re)initialise all parameters deterministically; see the class docstring."""
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # registration order; tied weight once
            if p.is_meta:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def num_params(self, unique: bool = True) -> int:
        """Number of parameters; ``unique=False`` counts a tied weight once per name."""
        if unique:
            return sum(p.numel() for p in self.parameters())
        return sum(p.numel() for _, p in self.named_parameters(remove_duplicate=False))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, sequence), got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
