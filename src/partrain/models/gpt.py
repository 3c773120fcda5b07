"""A decoder-only transformer (GPT-2 shaped, after Karpathy's nanoGPT), sized by options.

Blocks: ``embed`` (token + learned position embedding), ``layers`` pre-norm transformer
blocks (LayerNorm -> causal self-attention through ``F.scaled_dot_product_attention`` ->
residual; LayerNorm -> 4x MLP with GELU -> residual; Radford et al. 2019), and ``head``
(final LayerNorm, Linear to the vocabulary). Input ``[n, T]`` int64 token ids, output
``[n, T, vocab]`` logits. No dropout, so parallel runs can equal serial ones. Init as
GPT-2: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 * layers).
``tie=True`` shares the token embedding with the output layer (Press & Wolf, 2017); across
pipeline stages the two copies' gradients are summed each step (``strategies/tied.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from partrain.errors import PartrainError


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [n, heads, t, c / heads]
        return self.proj(y.transpose(1, 2).reshape(n, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, context: int, d_model: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(context, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(input_shape: tuple[int, ...], num_classes: int, layers: int = 2, d_model: int = 64, heads: int = 4,
        context: int | None = None, tie: bool = False) -> nn.Sequential:
    """GPT over ``num_classes`` tokens; ``input_shape`` is ``(T,)``, ``context`` (default T) the longest sequence."""
    if len(input_shape) != 1:
        raise PartrainError(f"model 'gpt' needs token sequences (T,), got input shape {tuple(input_shape)}: "
                            "use --dataset tokens or --dataset text:PATH")
    for name, value in (("layers", layers), ("d_model", d_model), ("heads", heads), ("context", context)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PartrainError(f"gpt: {name} must be a whole number >= 1, got {value!r}")  # 2.5 was cut to 2
    if not (isinstance(tie, int) and tie in (0, 1)):  # true, false, 1 or 0: 'maybe' was taken as true
        raise PartrainError(f"gpt: tie must be true or false, got {tie!r}")
    context = context if context is not None else input_shape[0]
    if d_model % heads:
        raise PartrainError(f"gpt: d_model {d_model} must be a multiple of heads {heads}")
    if context < input_shape[0]:
        raise PartrainError(f"gpt: context {context} is shorter than the dataset's {input_shape[0]}-token windows")
    model = nn.Sequential()
    model.add_module("embed", Embed(num_classes, context, d_model))
    for i in range(layers):
        model.add_module(f"block{i}", Block(d_model, heads))
    model.add_module("head", Head(d_model, num_classes))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)
    if tie:
        model.head.out.weight = model.embed.tok.weight
    return model
