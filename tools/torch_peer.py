#!/usr/bin/env python3
"""The peer a user would otherwise pick: the same MoE transformer in eager
PyTorch on the CPU (deterministic algorithms), timed for training tokens/s.

Same shape and work as Lockstep's model: byte embedding + learned positions,
pre-norm RMSNorm, causal MHA, top-k softmax-gated SwiGLU experts in every
layer (loop over experts with index_select / index_add_, as eager MoE code
does), Switch aux loss and router z-loss, AdamW. Prints one JSON line.

With --precision bf16 the forward runs under torch.autocast(device_type=
"cpu", dtype=torch.bfloat16), what a PyTorch user runs for mixed precision
on a CPU: the matrix products in bf16 (oneDNN), fp32 master weights and
AdamW; the router kept in fp32 as Lockstep's recipe keeps it (autocast
disabled around it), softmax and norms fp32 as autocast leaves them. The
JSON names the GEMM libraries the process mapped.
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


class MoE(nn.Module):
    def __init__(self, d, f, experts, top_k):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, f) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, d, f) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, f, d) * 0.02)
        self.experts, self.top_k = experts, top_k

    def forward(self, x):
        with torch.autocast(device_type="cpu", enabled=False):  # the router in fp32 at bf16 too
            z = self.router(x.float())
        g = z.softmax(-1)
        gate, sel = g.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            tok, slot = (sel == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x.index_select(0, tok)
            h = F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])
            out.index_add_(0, tok, (h @ self.w2[e]) * gate[tok, slot].unsqueeze(-1))
        counts = torch.bincount(sel.flatten(), minlength=self.experts).float() / sel.numel()
        aux = self.experts * (counts * g.mean(0)).sum()
        zl = torch.logsumexp(z, -1).pow(2).mean()
        return out, aux, zl


class Block(nn.Module):
    def __init__(self, d, heads, f, experts, top_k):
        super().__init__()
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.moe = MoE(d, f, experts, top_k)
        self.heads = heads

    def forward(self, x, B, T):
        D = x.shape[-1]
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (D // self.heads) ** 0.5
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B * T, D)
        x = x + self.o(y)
        m, aux, zl = self.moe(self.n2(x))
        return x + m, aux, zl


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(256, a.d_model)
        self.pos = nn.Embedding(a.seq_len, a.d_model)
        self.blocks = nn.ModuleList(Block(a.d_model, a.n_heads, a.d_ff, a.experts, a.top_k) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.d_model)
        self.head = nn.Linear(a.d_model, 256, bias=False)

    def forward(self, x, y):
        B, T = x.shape
        h = (self.tok(x) + self.pos(torch.arange(T))).view(B * T, -1)
        aux = zl = 0.0
        for b in self.blocks:
            h, a, z = b(h, B, T)
            aux, zl = aux + a, zl + z
        ce = F.cross_entropy(self.head(self.norm(h)), y.reshape(-1))
        return ce + 0.01 * aux + 0.001 * zl


def main():
    p = argparse.ArgumentParser(description=__doc__)
    for name, default in [("d_model", 64), ("n_layers", 2), ("n_heads", 4), ("seq_len", 64), ("d_ff", 128),
                          ("experts", 8), ("top_k", 2), ("batch", 16), ("steps", 20), ("threads", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the forward under torch.autocast(cpu, bfloat16)")
    a = p.parse_args()
    bf16 = a.precision == "bf16"
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = Model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, 256, (a.steps + 2, a.batch, a.seq_len + 1))
    seconds = 0.0
    for s in range(a.steps + 2):
        t0 = time.perf_counter()
        x, y = data[s, :, :-1], data[s, :, 1:]
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s >= 2:  # two warm-up steps
            seconds += time.perf_counter() - t0
    tps = a.steps * a.batch * a.seq_len / seconds
    print(json.dumps({"peer": "pytorch-eager", "torch": torch.__version__, "threads": a.threads,
                      "precision": a.precision, "tokens_per_second": tps, "blas": loaded_blas(),
                      "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}}))


def loaded_blas():
    """The GEMM libraries this process mapped (after training ran its matmuls): what PyTorch's GEMMs call
    (a BLAS for fp32; oneDNN, `dnnl`, for autocast's bf16 products where libtorch links it apart)."""
    libs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            name = os.path.basename(path)
            if "blas" in name or "mkl" in name or "dnnl" in name:
                libs.add(os.path.realpath(path))
    return sorted(libs)


if __name__ == "__main__":
    main()
