"""pipetrain's zoo GPT (`pipetrain train --model gpt`) and its synthetic data in plain PyTorch, for the
benchmarks that compare against PyTorch itself (peer_pipe.py, gpt_reference.py).

The model: [token + position embedding] [pre-norm block with causal self-attention and a GELU MLP 4x] *
layers [LayerNorm + head without bias], each layer built after seeding the generator as pipetrain's
ranks seed it (layer_seed), so its initial weights equal LibTorch's; SyntheticTokens replays zoo::make_synthetic_tokens (seed + 1 in
pipetrain train) with the same generator calls, so both train on the same tokens.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Embedding(nn.Module):
    def __init__(self, vocab, seq_len, d_model):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        return self.tokens(idx) + self.positions(pos).unsqueeze(0)


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, 2)
        q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in (q, k, v))
        att = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        y = att.matmul(v).transpose(1, 2).contiguous().view(b, t, c)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Head(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


M64 = (1 << 64) - 1


def splitmix64(x):
    """pipetrain/core/random.h's integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def layer_seed(seed, layer):
    """The seed pipetrain builds layer `layer` of a layerwise model with (runtime/layers.cpp)."""
    return splitmix64(seed ^ splitmix64((0x6C61796572 + layer) & M64))


def make_layers(a):
    """The gpt's layers+2 pipeline layers, each built from its own seed as pipetrain's ranks build them."""
    makers = [lambda: Embedding(a.vocab, a.seq_len, a.d_model)]
    makers += [lambda: Block(a.d_model, a.heads) for _ in range(a.layers)]
    makers.append(lambda: Head(a.d_model, a.vocab))
    layers = []
    for i, make in enumerate(makers):
        torch.manual_seed(layer_seed(a.seed, i))
        layers.append(make())
    return layers


def pipetrain_parameter_count(a):
    c, v = a.d_model, a.vocab
    block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    return v * c + a.seq_len * c + a.layers * block + 2 * c + v * c


class SyntheticTokens:
    """zoo::make_synthetic_tokens, call for call."""

    def __init__(self, vocab, seq_len, seed):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(vocab, (vocab,), generator=g, dtype=torch.long)

    def batch(self, step, n):
        g = torch.Generator().manual_seed((self.seed * 1000003 + step + 1) % (1 << 64))
        seq = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        cur = torch.randint(self.vocab, (n,), generator=g, dtype=torch.long)
        seq[:, 0] = cur
        for t in range(1, self.seq_len + 1):
            follow = self.next.index_select(0, cur)
            noise = torch.randint(self.vocab, (n,), generator=g, dtype=torch.long)
            keep = torch.rand(n, generator=g) < 0.9
            cur = torch.where(keep, follow, noise)
            seq[:, t] = cur
        return seq[:, : self.seq_len].contiguous(), seq[:, 1:].contiguous()
