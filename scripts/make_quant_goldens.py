#!/usr/bin/env python3
"""Golden fixtures for attention over 8-bit paged KV caches, in float64 with PyTorch: a ragged
batch with RoPE (Hugging Face's rotate_half over the first D elements), K rotated before it is
quantised, as a cache appending would.

- int8: one scale per (token, kv head) row, computed in float32 as the crate's rule says
  (scale = max |x| / 127, code = round(x / scale), torch.round: half to even, clamped to ±127;
  a zero row has scale 0), and dequantised explicitly (code * scale, float64);
- fp8: e4m3 through torch.float8_e4m3fn with one scale per kv head: code =
  (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn) (saturated first: the cast alone turns
  values past 464 into NaN), dequantised by torch's cast back (.to(torch.float64)) * scale.

Regenerate from the repository root (a Python with scripts/requirements-goldens.txt):

    python3 scripts/make_quant_goldens.py

It deletes and rewrites tests/fixtures/quant/ only. Deterministic: numpy's PCG64 with fixed
seeds; torch computes on the CPU.

Each case directory (token-major pages, vLLM's layout [NB, BS, Hkv, E]):
  meta.json      k_format, v_format ("int8" or "fp8"), block_size, q_lens, seq_lens, rope
                 (style "half", theta, dim), causal ("bottom_right")
  q.npy          f32 [T, Hq, E] packed queries, un-rotated (query i of a sequence of l keys
                 with n new queries at position l - n + i)
  k_rot.npy      f32 [NB, BS, Hkv, E] the pages' K values, rotated (key t at position t), before
                 quantisation; v_vals.npy f32 [NB, BS, Hkv, Ev] the V values (slots past a
                 sequence hold 0)
  k_codes.npy    i1 (int8) or u1 (fp8 bit patterns) [NB, BS, Hkv, E]; v_codes.npy the same for V
  k_scales.npy   f32 [NB, BS, Hkv] (int8) or [Hkv] (fp8); v_scales.npy the same for V
  table.npy      i32 [B, max_blocks] block table (-1 past a sequence's blocks)
  out.npy        f64 [T, Hq, Ev] attention over the rotated queries and the dequantised pages
  lse.npy        f64 [T, Hq]
Every golden is checked against an independent numpy computation over the dequantised values
(the e4m3 values decoded from their bit fields by hand) to 1e-9.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from make_rope_goldens import rope_torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "quant"


def rope(x, positions, theta, dim):
    """x: float64 [T, H, E], half-split pairs over the first dim elements (make_rope_goldens's)."""
    return rope_torch(x, positions, "half", theta, dim)


def int8_quant(x):
    """x: float32 tensor [..., E]: (codes int8, scales float32 [...], values float64)."""
    amax = x.abs().amax(dim=-1)
    scale = amax / torch.tensor(127.0, dtype=torch.float32)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(x / safe[..., None]).clamp(-127, 127)
    codes = torch.where(scale[..., None] == 0, torch.zeros_like(codes), codes).to(torch.int8)
    return codes, scale, codes.to(torch.float64) * scale.to(torch.float64)[..., None]


def fp8_quant(x, scales, head_axis):
    """x: float32 [..., Hkv, E] with the head at head_axis; scales float32 [Hkv]."""
    shape = [1] * x.dim()
    shape[head_axis] = -1
    s = scales.view(shape)
    f8 = (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return f8.view(torch.uint8), scales, f8.to(torch.float64) * s.to(torch.float64)


def e4m3_numpy(bits):
    """Decode e4m3 bit patterns by hand (no NaN codes here)."""
    b = bits.astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 15
    m = (b & 7).astype(np.float64)
    assert not np.any((b & 0x7F) == 0x7F)
    return s * np.where(e == 0, m * 2.0**-9, (8 + m) * 2.0 ** (e - 10))


def case(name, seed, Hq, Hkv, E, Ev, q_lens, seq_lens, bs, k_format, v_format, theta, dim):
    rng = np.random.default_rng(seed)
    B, T = len(q_lens), sum(q_lens)
    max_blocks = max(seq_lens) // bs + 1
    nb = sum(-(-l // bs) for l in seq_lens) + 2
    order = rng.permutation(nb)
    table = -np.ones((B, max_blocks), dtype=np.int32)
    q = rng.standard_normal((T, Hq, E), dtype=np.float32)
    k = np.zeros((nb, bs, Hkv, E), dtype=np.float32)
    v = np.zeros((nb, bs, Hkv, Ev), dtype=np.float32)
    nxt = iter(order)
    for b, l in enumerate(seq_lens):
        kb = rng.standard_normal((l, Hkv, E), dtype=np.float32)
        vb = rng.standard_normal((l, Hkv, Ev), dtype=np.float32)
        if b == 0:
            kb[0, 0, :] = 0.0  # a zero row: int8 scale 0
            kb[1, 1, 3] = 30.0  # past fp8's range at the head's scale: saturated
            vb[2, 0, 1] = -25.0
        kr = rope(torch.from_numpy(kb.astype(np.float64)), torch.arange(l), theta, dim).to(torch.float32).numpy()
        for blk in range(-(-l // bs)):
            phys = next(nxt)
            table[b, blk] = phys
            n = min(bs, l - blk * bs)
            k[phys, :n] = kr[blk * bs : blk * bs + n]
            v[phys, :n] = vb[blk * bs : blk * bs + n]
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    quant = {}
    for name_, t, fmt, seed_s in [("k", tk, k_format, 1), ("v", tv, v_format, 2)]:
        if fmt == "int8":
            codes, scales, vals = int8_quant(t)
            quant[name_] = (codes.numpy(), scales.numpy(), vals)
        else:
            # vLLM's calibration: about the head's largest |x| over 448, here a little less, so
            # that some values saturate.
            amax = t.abs().amax(dim=(0, 1, 3))
            scales = (amax / 448.0 * 0.5).to(torch.float32)
            codes, scales, vals = fp8_quant(t, scales, 2)
            vals_np = e4m3_numpy(codes.numpy()) * scales.numpy().astype(np.float64)[None, None, :, None]
            assert np.array_equal(vals.numpy(), vals_np), name
            quant[name_] = (codes.numpy(), scales.numpy(), vals)
    kd, vd = quant["k"][2], quant["v"][2]  # float64 [NB, BS, Hkv, *]
    g, scale = Hq // Hkv, 1.0 / math.sqrt(E)
    out, lse, out_np = np.zeros((T, Hq, Ev)), np.zeros((T, Hq)), np.zeros((T, Hq, Ev))
    tok = 0
    for b, (n, l) in enumerate(zip(q_lens, seq_lens)):
        rows = [table[b, t // bs] for t in range(l)]
        kk = torch.stack([kd[r, t % bs] for t, r in enumerate(rows)])  # [l, Hkv, E]
        vv = torch.stack([vd[r, t % bs] for t, r in enumerate(rows)])
        qb = rope(torch.from_numpy(q[tok : tok + n].astype(np.float64)), torch.arange(l - n, l), theta, dim)
        s = torch.einsum("nhe,lhe->hnl", qb, kk.repeat_interleave(g, 1)) * scale
        i, j = torch.arange(n).view(n, 1), torch.arange(l).view(1, l)
        s = s.masked_fill(~(j <= i + l - n), float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        o = torch.einsum("hnl,lhe->nhe", torch.exp(s - m[..., None]), vv.repeat_interleave(g, 1))
        out[tok : tok + n], lse[tok : tok + n] = o.numpy(), m.permute(1, 0).numpy()
        # numpy, independently, from the same dequantised values.
        qn, kn, vn = qb.numpy(), kk.numpy(), vv.numpy()
        for h in range(Hq):
            for ii in range(n):
                sc = kn[:, h // g] @ qn[ii, h] * scale
                sc[np.arange(l) > ii + l - n] = -np.inf
                w = np.exp(sc - sc.max())
                out_np[tok + ii, h] = (w / w.sum()) @ vn[:, h // g]
        tok += n
    assert np.abs(out - out_np).max() < 1e-9, name
    d = OUT / name
    d.mkdir(parents=True)
    arrays = {
        "q.npy": q,
        "k_rot.npy": k,
        "v_vals.npy": v,
        "k_codes.npy": quant["k"][0],
        "v_codes.npy": quant["v"][0],
        "k_scales.npy": quant["k"][1],
        "v_scales.npy": quant["v"][1],
        "table.npy": table,
        "out.npy": out,
        "lse.npy": lse,
    }
    for f, a in arrays.items():
        np.save(d / f, np.ascontiguousarray(a))
    meta = {
        "k_format": k_format,
        "v_format": v_format,
        "block_size": bs,
        "q_lens": q_lens,
        "seq_lens": seq_lens,
        "rope": {"style": "half", "theta": theta, "dim": dim},
        "causal": "bottom_right",
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main():
    torch.manual_seed(0)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    case("int8_rope_ragged", 20, 4, 2, 32, 24, [3, 1, 5], [40, 17, 5], 16, "int8", "int8", 10000.0, 32)
    case("fp8_rope_ragged", 21, 4, 2, 32, 32, [1, 2, 1], [50, 9, 33], 8, "fp8", "fp8", 500000.0, 24)
    case("int8_k_fp8_v_rope_ragged", 22, 6, 2, 64, 16, [2, 1], [70, 23], 16, "int8", "fp8", 10000.0, 64)


if __name__ == "__main__":
    main()
