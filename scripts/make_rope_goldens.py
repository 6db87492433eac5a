#!/usr/bin/env python3
"""Golden fixtures for RoPE and paged attention with RoPE, in float64 with PyTorch,
rotating by Hugging Face's definitions: `q * cos + rotate_half(q) * sin` (Llama, NeoX: the
half-split pairs) and GPT-J's `rotate_every_two` (interleaved pairs), with
`inv_freq = 1 / theta ** (arange(0, D, 2) / D)` over the first D elements of each head.

Regenerate from the repository root (a Python with scripts/requirements-goldens.txt):

    python3 scripts/make_rope_goldens.py

It deletes and rewrites tests/fixtures/rope/ only. Deterministic: numpy's PCG64 with fixed
seeds; torch computes in float64 on the CPU.

Each case directory:
  meta.json      style ("half" or "interleaved"), theta, dim (the rotated leading elements),
                 and for attention cases q_lens, seq_lens, causal ("bottom_right" or "none"),
                 offset (see attn_case: the keys before are hidden by a window)
  rotation cases (op_*):
    x.npy          f32 [T, H, E] token rows
    positions.npy  i64 [T]
    out.npy        f64 [T, H, E]: x rotated, token t at positions[t]
  attention cases (attn_*), a ragged batch of sequences (PagedAttention's semantics):
    q.npy          f32 [T, Hq, E] packed queries, un-rotated (q_lens per sequence)
    k.npy, v.npy   f32 [B, Hkv, S, E] / [.., Ev] each sequence's keys and values, keys
                   un-rotated (key t at position t; past seq_lens[b] unused)
    out.npy        f64 [T, Hq, Ev]: attention of each query (query i of a sequence of l keys
                   with n new queries at position l - n + i) over its sequence's rotated keys
    lse.npy        f64 [T, Hq]
Every golden is checked against an independent numpy computation (angles formed the other way
round: position * theta^(-2k/D)) to 1e-9 (f64 angles near 2.6e5 rad agree to ~1e-11).
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "rope"


def rotate_half(x):
    # Hugging Face transformers (modeling_llama.rotate_half).
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    # Hugging Face transformers (modeling_gptj.rotate_every_two).
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_torch(x, positions, style, theta, dim):
    """x: float64 [T, H, E]; positions: int64 [T]. The first `dim` elements rotated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    freqs = torch.outer(positions.to(torch.float64), inv_freq)  # [T, dim/2]
    if style == "half":
        emb = torch.cat((freqs, freqs), dim=-1)
        rot = rotate_half
    else:
        emb = freqs.repeat_interleave(2, dim=-1)
        rot = rotate_every_two
    cos = emb.cos()[:, None, :]
    sin = emb.sin()[:, None, :]
    xr, rest = x[..., :dim], x[..., dim:]
    return torch.cat((xr * cos + rot(xr) * sin, rest), dim=-1)


def rope_numpy(x, positions, style, theta, dim):
    """The same by pairs, written out: pair (a, b) at angle p * theta^(-2k/dim)."""
    out = x.copy()
    T, H, E = x.shape
    for t in range(T):
        for k in range(dim // 2):
            ang = positions[t] * theta ** (-2.0 * k / dim)
            c, s = math.cos(ang), math.sin(ang)
            a, b = (k, k + dim // 2) if style == "half" else (2 * k, 2 * k + 1)
            x0, x1 = x[t, :, a], x[t, :, b]
            out[t, :, a] = x0 * c - x1 * s
            out[t, :, b] = x1 * c + x0 * s
    return out


def save(d, name, a):
    np.save(d / name, np.ascontiguousarray(a))


def op_case(name, seed, T, H, E, style, theta, dim, positions):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, E), dtype=np.float32)
    pos = np.array(positions, dtype=np.int64)
    assert pos.shape == (T,)
    got = rope_torch(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(pos), style, theta, dim).numpy()
    check = rope_numpy(x.astype(np.float64), pos, style, theta, dim)
    # Angles near 2.6e5 rad: the two ways of forming them differ by ~1e-11 (f64 rounding).
    assert np.abs(got - check).max() < 1e-9, name
    d = OUT / name
    d.mkdir(parents=True)
    save(d, "x.npy", x)
    save(d, "positions.npy", pos)
    save(d, "out.npy", got)
    (d / "meta.json").write_text(json.dumps({"style": style, "theta": theta, "dim": dim}, indent=1) + "\n")


def attn_case(name, seed, Hq, Hkv, E, Ev, q_lens, seq_lens, style, theta, dim, causal, offset=0):
    """A ragged batch. With `offset`, each sequence continues a long context: it has offset +
    seq_lens[b] keys, of which only the last seq_lens[b] are given (key t here at position
    offset + t), and a sliding window of seq_lens[b] - q_lens[b] keys to the left hides the rest
    (query i sees keys t >= i): positions past 100k without a 100k-key cache."""
    rng = np.random.default_rng(seed)
    B, T, S = len(q_lens), sum(q_lens), max(seq_lens)
    q = rng.standard_normal((T, Hq, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, Ev), dtype=np.float32)
    g = Hq // Hkv
    out = np.zeros((T, Hq, Ev))
    lse = np.zeros((T, Hq))
    out_np = np.zeros((T, Hq, Ev))
    scale = 1.0 / math.sqrt(E)
    tok = 0
    for b, (n, l) in enumerate(zip(q_lens, seq_lens)):
        qpos = torch.arange(l - n, l, dtype=torch.int64) + offset
        kpos = torch.arange(0, l, dtype=torch.int64) + offset
        qb = rope_torch(torch.from_numpy(q[tok : tok + n].astype(np.float64)), qpos, style, theta, dim)
        kb = rope_torch(
            torch.from_numpy(k[b, :, :l].astype(np.float64)).permute(1, 0, 2), kpos, style, theta, dim
        ).permute(1, 0, 2)  # [Hkv, l, E]
        vb = torch.from_numpy(v[b, :, :l].astype(np.float64))
        qh = qb.permute(1, 0, 2)  # [Hq, n, E]
        s = torch.einsum("hne,hle->hnl", qh, kb.repeat_interleave(g, 0)) * scale
        i = torch.arange(n).view(n, 1)
        j = torch.arange(l).view(1, l)
        allowed = torch.ones(n, l, dtype=torch.bool)
        if causal == "bottom_right":
            allowed &= j <= i + l - n
        if offset > 0:
            allowed &= j >= i
        s = s.masked_fill(~allowed, float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # [Hq, n]
        p = torch.exp(s - m[..., None])
        o = torch.einsum("hnl,hle->hne", p, vb.repeat_interleave(g, 0))
        out[tok : tok + n] = o.permute(1, 0, 2).numpy()
        lse[tok : tok + n] = m.permute(1, 0).numpy()
        # numpy, independently: rotation by pairs, softmax by max subtraction.
        qn = rope_numpy(q[tok : tok + n].astype(np.float64), np.arange(l - n, l) + offset, style, theta, dim)
        kn = rope_numpy(
            k[b, :, :l].astype(np.float64).transpose(1, 0, 2), np.arange(l) + offset, style, theta, dim
        )  # [l, Hkv, E]
        for h in range(Hq):
            for ii in range(n):
                sc = np.array([qn[ii, h] @ kn[jj, h // g] for jj in range(l)]) * scale
                jr = np.arange(l)
                if causal == "bottom_right":
                    sc[jr > ii + l - n] = -np.inf
                if offset > 0:
                    sc[jr < ii] = -np.inf
                w = np.exp(sc - sc.max())
                out_np[tok + ii, h] = (w / w.sum()) @ v[b, h // g, :l].astype(np.float64)
        tok += n
    assert np.abs(out - out_np).max() < 1e-9, name
    d = OUT / name
    d.mkdir(parents=True)
    for f, a in [("q.npy", q), ("k.npy", k), ("v.npy", v), ("out.npy", out), ("lse.npy", lse)]:
        save(d, f, a)
    meta = {
        "style": style,
        "theta": theta,
        "dim": dim,
        "q_lens": q_lens,
        "seq_lens": seq_lens,
        "causal": causal,
        "offset": offset,
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main():
    torch.manual_seed(0)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    far = [0, 1, 2, 4095, 4096, 65535, 65536, 100000, 131071, 131072, 140000, 262143]
    op_case("op_half_theta1e4", 1, 12, 3, 64, "half", 10000.0, 64, far)
    op_case("op_interleaved_theta5e5", 2, 12, 2, 48, "interleaved", 500000.0, 48, far)
    op_case("op_half_partial_odd_e", 3, 12, 2, 37, "half", 10000.0, 20, far)
    op_case("op_interleaved_partial", 4, 7, 4, 32, "interleaved", 10000.0, 8, [3, 17, 999, 1 << 17, 123456, 7, 0])
    attn_case("attn_half_causal_ragged", 10, 4, 2, 32, 24, [3, 1, 5], [40, 17, 5], "half", 10000.0, 32, "bottom_right")
    attn_case("attn_interleaved_noncausal", 13, 2, 1, 16, 16, [2, 1], [7, 12], "interleaved", 10000.0, 16, "none")
    attn_case(
        "attn_interleaved_partial_far", 11, 4, 1, 16, 16, [1, 3], [29, 9], "interleaved", 500000.0, 8,
        "bottom_right", offset=131072,
    )
    attn_case(
        "attn_half_theta1e4_far", 12, 2, 2, 24, 8, [2, 1], [21, 33], "half", 10000.0, 24, "bottom_right",
        offset=100000,
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
