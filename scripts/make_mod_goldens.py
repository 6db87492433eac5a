#!/usr/bin/env python3
"""Golden fixtures for the score modifiers and user functions: sliding window with
sink tokens, sink logits, logit softcap, ALiBi, document ids, and a user score_mod with captured
tensors plus a mask_mod, forward and backward, in float64 with PyTorch autograd.

Regenerate from the repository root (a Python with scripts/requirements-goldens.txt):

    python3 scripts/make_mod_goldens.py

It deletes and rewrites tests/fixtures/mods/ only (scripts/make_goldens.py writes the others).
Deterministic: numpy's PCG64 with fixed seeds; torch computes in float64 on the CPU.

Each case directory (conventions as tests/fixtures/README.md, `mods/` section):
  q.npy, k.npy, v.npy, dout.npy        f32 inputs, [B,Hq,L,E], [B,Hkv,S,E], [B,Hkv,S,Ev], [B,Hq,L,Ev]
  bias.npy (f32, 4-D), kv_lens.npy (i64 [B]), sinks.npy (f32 [Hq]), q_docs.npy (i32 [B,L]),
  k_docs.npy (i32 [B,S]), rel.npy and hs.npy (f32 captures)           when the case has them
  meta.json                            causal, scale, window, sink_tokens, softcap, alibi, user
  out.npy, lse.npy                     f64 forward goldens (lse -inf on fully masked rows)
  d{q,k,v,bias,sinks,rel,hs}.npy       f64 autograd of sum(dout * out); *_f32.npy the same in
                                       float32 (the plain implementation of FlashAttention's rule)

The semantics are docs/semantics.md's: s = scale q.k, softcap C tanh(s / C), plus the bias and
ALiBi (-slope[h] |i + S_b - L - j|, S_b the batch's key length when kv_lens is given), the user
score_mod, then every mask (causal, key lengths, the window i + S_b - L - left <= j <= i + S_b -
L + right with keys j < sink_tokens exempt, documents, mask_mod), softmax with the sink logit
in the denominator (no value), P V. A row with no allowed key and no sink logit has out 0 and
lse -inf, and zero gradients. Every forward golden is checked against an independent numpy
loop to 1e-12.
"""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "mods"

# The user functions of case user_relbias_prefix, in WGSL (the kernels') and below in torch and
# numpy (the goldens'); the Rust test gives the reference the same as closures.
RELBIAS_WGSL = """fn bucket(i: u32, j: u32) -> u32 { return u32(clamp(i32(j) - i32(i), -4, 4) + 4); }
fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    return 3.0 * tanh(s / 3.0) * hs(h) + rel(h * 9u + bucket(i, j));
}
fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    let t = tanh(s / 3.0);
    return (1.0 - t * t) * hs(h);
}
fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {
    d_rel(h * 9u + bucket(i, j), g);
    d_hs(h, g * 3.0 * tanh(s / 3.0));
}
fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool {
    return (j < 3u || j <= i + 8u) && i % 7u != 4u;
}
"""


def randn32(rng, shape, std=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def save(d, name, a):
    np.save(d / name, np.ascontiguousarray(a))


def allowed_of(meta, B, Hq, L, S, kl, qd, kd):
    """bool [B,Hq,L,S]: every mask of the case, True = may attend."""
    i = np.arange(L).reshape(1, 1, L, 1)
    j = np.arange(S).reshape(1, 1, 1, S)
    off = (np.array(kl) - L).reshape(B, 1, 1, 1)
    a = np.ones((B, Hq, L, S), dtype=bool)
    if meta["causal"] == "top_left":
        a &= j <= i
    elif meta["causal"] == "bottom_right":
        a &= j <= i + off
    a &= j < np.array(kl).reshape(B, 1, 1, 1)
    if meta["window"] is not None:
        left, right = meta["window"]
        ok = np.ones_like(a)
        if left >= 0:
            ok &= j >= i + off - left
        if right >= 0:
            ok &= j <= i + off + right
        a &= ok | (j < meta["sink_tokens"])
    if qd is not None:
        a &= qd[:, None, :, None] == kd[:, None, None, :]
    if meta["user"] is not None:
        a &= ((j < 3) | (j <= i + 8)) & (i % 7 != 4)
    return a


def torch_forward(t, meta, allowed, kl):
    """out [B,Hq,L,Ev], lse [B,Hq,L] from the tensors `t` (q, k, v, dout, optional bias, sinks,
    rel, hs: torch, any float dtype, some requiring grad)."""
    q, k, v = t["q"], t["k"], t["v"]
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = meta["scale"] if meta["scale"] is not None else 1.0 / math.sqrt(E)
    s = torch.einsum("bhle,bhse->bhls", q, k.repeat_interleave(g, 1)) * scale
    if meta["softcap"] is not None:
        c = meta["softcap"]
        s = c * torch.tanh(s / c)
    if "bias" in t:
        s = s + t["bias"]
    i = torch.arange(L).view(1, 1, L, 1)
    j = torch.arange(S).view(1, 1, 1, S)
    off = torch.tensor([x - L for x in kl]).view(B, 1, 1, 1)
    if meta["alibi"] is not None:
        slopes = torch.tensor(meta["alibi"], dtype=q.dtype).view(1, Hq, 1, 1)
        s = s - slopes * (i + off - j).abs().to(q.dtype)
    if meta["user"] is not None:
        bucket = (j - i).clamp(-4, 4) + 4
        idx = torch.arange(Hq).view(1, Hq, 1, 1) * 9 + bucket
        s = 3.0 * torch.tanh(s / 3.0) * t["hs"].view(1, Hq, 1, 1) + t["rel"][idx.expand(B, Hq, L, S)]
    a = torch.from_numpy(allowed)
    has_sink = "sinks" in t
    dead = ~a.any(-1) if not has_sink else torch.zeros(B, Hq, L, dtype=torch.bool)
    # Dead rows computed as if every key were allowed, their output then multiplied by 0: their
    # gradients are exactly 0 (the crate's semantics) instead of NaN.
    live = a | dead.unsqueeze(-1)
    logits = s.masked_fill(~live, float("-inf"))
    if has_sink:
        sink = t["sinks"].view(1, Hq, 1, 1).expand(B, Hq, L, 1)
        logits = torch.cat([logits, sink], -1)
    lse = torch.logsumexp(logits, -1)
    w = torch.exp(logits - lse.unsqueeze(-1))[..., :S]
    out = torch.einsum("bhls,bhsv->bhlv", w, v.repeat_interleave(g, 1))
    out = out * (~dead).unsqueeze(-1).to(out.dtype)
    lse = torch.where(dead, torch.full_like(lse, float("-inf")), lse)
    return out, lse


def numpy_forward(x, meta, allowed, kl):
    """The forward again, a row at a time in numpy float64 (an independent check)."""
    q, k, v = (x[n].astype(np.float64) for n in ("q", "k", "v"))
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    g = Hq // Hkv
    scale = meta["scale"] if meta["scale"] is not None else 1.0 / math.sqrt(E)
    out = np.zeros((B, Hq, L, Ev))
    lse = np.full((B, Hq, L), -np.inf)
    for b in range(B):
        for h in range(Hq):
            for i in range(L):
                logits = []
                for jj in range(S):
                    if not allowed[b, h, i, jj]:
                        continue
                    s = scale * float(np.dot(q[b, h, i], k[b, h // g, jj]))
                    if meta["softcap"] is not None:
                        s = meta["softcap"] * math.tanh(s / meta["softcap"])
                    if "bias" in x:
                        s += float(x["bias"][b, h, i, jj])
                    if meta["alibi"] is not None:
                        s -= meta["alibi"][h] * abs(i + kl[b] - L - jj)
                    if meta["user"] is not None:
                        bucket = min(max(jj - i, -4), 4) + 4
                        s = 3.0 * math.tanh(s / 3.0) * float(x["hs"][h]) + float(x["rel"][h * 9 + bucket])
                    logits.append((jj, s))
                terms = [s for _, s in logits] + ([float(x["sinks"][h])] if "sinks" in x else [])
                if not terms:
                    continue
                m = max(terms)
                z = m + math.log(sum(math.exp(s - m) for s in terms))
                lse[b, h, i] = z
                for jj, s in logits:
                    out[b, h, i] += math.exp(s - z) * v[b, h // g, jj].astype(np.float64)
    return out, lse


def case(name, seed, B, Hq, Hkv, L, S, E, Ev, description, causal="none", scale=None,
         window=None, sink_tokens=0, softcap=None, alibi=None, kv_lens=None, sinks=None,
         docs=False, bias=False, user=False, q_std=1.0):
    rng = np.random.default_rng(seed)
    x = {
        "q": randn32(rng, (B, Hq, L, E), q_std),
        "k": randn32(rng, (B, Hkv, S, E), q_std),
        "v": randn32(rng, (B, Hkv, S, Ev)),
        "dout": randn32(rng, (B, Hq, L, Ev)),
    }
    if bias:
        x["bias"] = randn32(rng, (B, Hq, L, S), 0.5)
    if sinks is not None:
        x["sinks"] = np.array(sinks, dtype=np.float32)
    qd = kd = None
    if docs:
        qd = rng.integers(0, 4, size=(B, L)).astype(np.int32)
        kd = rng.integers(0, 3, size=(B, S)).astype(np.int32)
    if user:
        x["rel"] = randn32(rng, (Hq * 9,), 0.8)
        x["hs"] = (1.0 + 0.25 * np.arange(Hq)).astype(np.float32)
    kl = list(kv_lens) if kv_lens is not None else [S] * B
    meta = {
        "description": description,
        "causal": causal,
        "scale": scale,
        "window": window,
        "sink_tokens": sink_tokens,
        "softcap": softcap,
        "alibi": alibi,
        "user": {"wgsl": RELBIAS_WGSL, "captures": ["rel", "hs"]} if user else None,
    }
    allowed = allowed_of(meta, B, Hq, L, S, kl, qd, kd)

    grads = {}
    for dt in (torch.float64, torch.float32):
        t = {n: torch.from_numpy(a).to(dt) for n, a in x.items()}
        for n in t:
            if n != "dout":
                t[n].requires_grad_(True)
        out, lse = torch_forward(t, meta, allowed, kl)
        (out * t["dout"]).sum().backward()
        grads[dt] = {n: t[n].grad for n in t if n != "dout"}
        if dt == torch.float64:
            out64, lse64 = out.detach().numpy(), lse.detach().numpy()
    n_out, n_lse = numpy_forward(x, meta, allowed, kl)
    assert np.array_equal(np.isinf(lse64), np.isinf(n_lse)), name
    fin = ~np.isinf(n_lse)
    diff = max(np.abs(out64 - n_out).max(), np.abs(lse64[fin] - n_lse[fin]).max())
    assert diff <= 1e-12, f"{name}: torch and numpy differ by {diff}"

    d = OUT / name
    d.mkdir(parents=True)
    for n, a in x.items():
        save(d, f"{n}.npy", a)
    if kv_lens is not None:
        save(d, "kv_lens.npy", np.array(kv_lens, dtype=np.int64))
    if docs:
        save(d, "q_docs.npy", qd)
        save(d, "k_docs.npy", kd)
    save(d, "out.npy", out64)
    save(d, "lse.npy", lse64)
    for n, g in grads[torch.float64].items():
        assert bool(torch.isfinite(g).all()), f"{name}: d{n} not finite"
        save(d, f"d{n}.npy", g.numpy())
        save(d, f"d{n}_f32.npy", grads[torch.float32][n].numpy())
    (d / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    dead = int((~allowed.any(-1)).sum())
    print(f"{name}: numpy max|diff| {diff:.1e}, {dead} rows with no allowed key")


def main():
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    case("window_sinks_lens_gqa", 9101, 2, 4, 2, 19, 37, 16, 8,
         "bottom-right causal, key lengths [37, 23], window (6, 1) with 2 sink tokens, sink "
         "logits, GQA, L != S",
         causal="bottom_right", window=[6, 1], sink_tokens=2, kv_lens=[37, 23],
         sinks=[0.3, -0.5, 1.2, 0.0])
    case("softcap_alibi_bias", 9102, 1, 2, 1, 33, 33, 8, 12,
         "top-left causal, softcap 1.5 on logits of a few units, ALiBi slopes, a 4-D bias",
         causal="top_left", softcap=1.5, alibi=[0.5, 0.125], bias=True, q_std=2.0)
    case("docs_unordered_dead_rows", 9103, 2, 2, 2, 24, 24, 8, 8,
         "bottom-right causal with unordered document ids (queries in 0..4, keys in 0..3: rows "
         "of document 3 see no key, fully masked)",
         causal="bottom_right", docs=True)
    case("user_relbias_prefix", 9104, 1, 2, 1, 21, 29, 8, 8,
         "a user score_mod 3 tanh(s / 3) hs[h] + rel[h, clamp(j - i, -4, 4) + 4] with captures "
         "rel [2 x 9] and hs [2] (their gradients), and a mask_mod (j < 3 or j <= i + 8) with rows "
         "i % 7 == 4 fully masked",
         user=True)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"mods fixtures: {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
