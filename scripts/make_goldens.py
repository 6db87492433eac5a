#!/usr/bin/env python3
"""Generate golden attention fixtures for the wgpu-attention test suite.

Generated with: torch 2.15.0 (CPU execution), numpy 2.4.6, safetensors 0.8.0, Python 3.11.
(See scripts/requirements-goldens.txt.)

Regenerate from the repository root with:

    python3 scripts/make_goldens.py

Everything is deterministic: every input comes from numpy's PCG64 generator with a fixed
per-case seed (torch's RNG is never used), goldens are computed in float64 on CPU.

Outputs (see tests/fixtures/README.md for the conventions):
  tests/fixtures/sdpa/<case>/  scaled_dot_product_attention cases
  tests/fixtures/mha/<case>/   torch.nn.MultiheadAttention(batch_first=True) cases, with the
                               autograd gradients of sum(dout * Y) (grads.safetensors, float64,
                               keyed query/key/value and by the state dict's names)
  tests/fixtures/variants/<case>/  attention variants: general (Luong), additive (Bahdanau),
                               low-rank values, Nystromformer, Linformer (forward only)

Every SDPA golden is computed twice: with torch.nn.functional.scaled_dot_product_attention
in float64 (torch's own is_causal / causal_lower_right / enable_gqa where possible) and with
an explicit float64 formula in this file; the two must agree. Where torch returns NaN on a
fully masked row (all keys excluded), the explicit formula's value (output 0, weights 0,
lse -inf) is written and the fact is printed.  MHA goldens are likewise cross-checked
against an explicit float64 re-implementation of the module, forward and autograd; the
grouped-query case (which torch's module cannot express) comes from the explicit layer.
Variant goldens are computed with torch ops in float64 and checked against an independent
explicit numpy float64 formula (and against torch's SDPA where the variant reduces to it).
"""

import copy
import json
import math
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

# Agreement required between torch and the explicit formula (absolute, on values of
# magnitude ~1).  The large_logits case gets a looser bound: its logits are ~1e4, so a
# single ulp of float64 rounding in the logit (~2e-12) already moves the weights by ~2e-12.
TOL = 1e-12
TOL_LARGE_LOGITS = 1e-11

torch.set_default_dtype(torch.float64)
# torch warns that causal_lower_right "will produce NaNs" when L > S; we handle those rows.
warnings.filterwarnings("ignore", message="Lower right causal bias")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

def randn32(rng, shape, std=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def save_npy(path, arr):
    np.save(path, np.ascontiguousarray(arr))


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def max_abs_diff(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


# --------------------------------------------------------------------------------------
# SDPA
# --------------------------------------------------------------------------------------

def allowed_mask(B, Hq, L, S, causal, mask, kv_lens):
    """Combined bool [B,Hq,L,S], True = may attend (explicit definition)."""
    allowed = torch.ones(B, Hq, L, S, dtype=torch.bool)
    i = torch.arange(L).view(L, 1)
    j = torch.arange(S).view(1, S)
    if causal == "top_left":
        allowed &= (j <= i)
    elif causal == "bottom_right" and kv_lens is not None:
        # FlashAttention's rule (varlen, flash_attn_with_kvcache): aligned to each batch's
        # key length, not the tensor's S.
        kl = torch.from_numpy(kv_lens).view(B, 1, 1, 1)
        allowed &= (j.view(1, 1, 1, S) <= i.view(1, 1, L, 1) + (kl - L))
    elif causal == "bottom_right":
        allowed &= (j <= i + (S - L))
    elif causal != "none":
        raise ValueError(causal)
    if mask is not None:
        allowed &= torch.from_numpy(mask)
    if kv_lens is not None:
        kl = torch.from_numpy(kv_lens).view(B, 1, 1, 1)
        allowed &= (torch.arange(S).view(1, 1, 1, S) < kl)
    return allowed


def explicit_sdpa(q, k, v, allowed, bias, scale):
    """float64 reference. Returns out [B,Hq,L,Ev], lse [B,Hq,L], weights [B,Hq,L,S]."""
    Hq, Hkv = q.shape[1], k.shape[1]
    g = Hq // Hkv
    kk = k.repeat_interleave(g, dim=1)  # query head h -> kv head h // g
    vv = v.repeat_interleave(g, dim=1)
    logits = torch.einsum("bhle,bhse->bhls", q, kk) * scale
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf on fully masked rows
    row_dead = ~allowed.any(dim=-1)
    w = torch.exp(logits - lse.unsqueeze(-1))
    w = torch.where(row_dead.unsqueeze(-1), torch.zeros_like(w), w)
    out = torch.einsum("bhls,bhsv->bhlv", w, vv)
    return out, lse, w, row_dead


def torch_sdpa(q, k, v, allowed, bias, scale, causal, mask, kv_lens):
    """float64 torch.nn.functional.scaled_dot_product_attention with enable_gqa=True.

    Pure-causal cases (no other mask kind) use torch's own causal conventions
    (is_causal=True for top-left, causal_lower_right for bottom-right), so the explicit
    causal definitions above are checked against torch rather than against themselves.
    """
    only_causal = mask is None and bias is None and kv_lens is None
    kwargs = dict(scale=scale, enable_gqa=True)
    if causal == "top_left" and only_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs), "is_causal=True"
    if causal == "bottom_right" and only_causal:
        from torch.nn.attention.bias import causal_lower_right

        L, S = q.shape[2], k.shape[2]
        cm = causal_lower_right(L, S)
        # The CausalBias object does not combine with enable_gqa; repeat kv heads instead.
        g = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=cm, scale=scale)
        return out, "causal_lower_right"
    if bias is not None:
        fm = torch.where(allowed, bias.expand_as(allowed), torch.tensor(float("-inf")))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=fm, **kwargs), "float mask"
    if not bool(allowed.all()) or causal != "none" or mask is not None or kv_lens is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **kwargs), "bool mask"
    return F.scaled_dot_product_attention(q, k, v, **kwargs), "no mask"


def torch_lse(q, k, v, allowed, bias, scale):
    """Logsumexp from torch's private CPU flash kernel, or None where it cannot be used.

    Used only as an extra cross-check of the explicit lse on rows that are not fully masked
    (this kernel reports 0 rather than -inf for fully masked rows).
    """
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    # The kernel needs equal head sizes; zero-padding q/k (E) and v (Ev) to a common width
    # leaves the logits, and hence the lse, unchanged (scale is passed explicitly).
    D = max(q.shape[-1], v.shape[-1])
    q = F.pad(q, (0, D - q.shape[-1]))
    k = F.pad(k, (0, D - k.shape[-1]))
    v = F.pad(v, (0, D - v.shape[-1]))
    g = q.shape[1] // k.shape[1]
    base = bias.expand_as(allowed) if bias is not None else torch.zeros(allowed.shape)
    fm = torch.where(allowed, base, torch.tensor(float("-inf"))).contiguous()
    try:
        return op(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), 0.0, False,
                  attn_mask=fm, scale=scale)[1]
    except RuntimeError:
        return None


def round_to(storage, a32):
    """a32 (float32) rounded to `storage` by PyTorch (.half() / .bfloat16(), round to nearest
    even) and widened back to float32 exactly."""
    if storage == "f32":
        return a32
    t = torch.from_numpy(a32)
    t = t.half() if storage == "f16" else t.bfloat16()
    return t.float().numpy()


def sdpa_case(name, seed, B, Hq, Hkv, L, S, E, Ev, description, causal="none", scale=None,
              mask_fn=None, bias_fn=None, kv_lens=None, qk_std=1.0, storage="f32"):
    rng = np.random.default_rng(seed)
    q32 = round_to(storage, randn32(rng, (B, Hq, L, E), qk_std))
    k32 = round_to(storage, randn32(rng, (B, Hkv, S, E), qk_std))
    v32 = round_to(storage, randn32(rng, (B, Hkv, S, Ev)))
    mask = mask_fn(rng) if mask_fn else None
    bias32 = round_to(storage, bias_fn(rng).astype(np.float32)) if bias_fn else None
    if kv_lens is not None:
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        assert kv_lens.shape == (B,)
    if mask is not None:
        assert mask.dtype == np.bool_ and mask.ndim == 4
    if bias32 is not None:
        assert bias32.ndim == 4

    q = torch.from_numpy(q32).double()
    k = torch.from_numpy(k32).double()
    v = torch.from_numpy(v32).double()
    bias = torch.from_numpy(bias32).double() if bias32 is not None else None
    sc = scale if scale is not None else 1.0 / math.sqrt(E)

    allowed = allowed_mask(B, Hq, L, S, causal, mask, kv_lens)
    out, lse, w, row_dead = explicit_sdpa(q, k, v, allowed, bias, sc)
    t_out, how = torch_sdpa(q, k, v, allowed, bias, sc, causal, mask, kv_lens)

    tol = TOL_LARGE_LOGITS if name == "large_logits" else TOL
    nan_rows = torch.isnan(t_out).any(dim=-1)
    assert not bool((nan_rows & ~row_dead).any()), f"{name}: torch NaN on a live row"
    live = ~row_dead
    d = max_abs_diff(t_out[live], out[live])
    assert d <= tol, f"{name}: torch vs explicit out differ by {d}"
    t_lse = torch_lse(q, k, v, allowed, bias, sc)
    if t_lse is not None:
        dl = max_abs_diff(t_lse[live], lse[live])
        assert dl <= tol, f"{name}: torch vs explicit lse differ by {dl}"
        lse_note = f"lse max|diff|={dl:.2e}"
    else:
        lse_note = "lse torch check n/a"
    assert bool(torch.isneginf(lse[row_dead]).all()) and bool(torch.isfinite(lse[live]).all())
    n_dead = int(row_dead.sum())
    note = ""
    if n_dead:
        dead_t = t_out[row_dead]
        if bool(torch.isnan(dead_t).any()):
            note = "torch gives NaN on fully masked rows; explicit zeros written"
        else:
            dz = float(dead_t.abs().max())
            note = f"torch gives max|out|={dz:g} on fully masked rows; explicit zeros written"
    # weights sanity
    rs = w.sum(-1)
    assert torch.allclose(rs[live], torch.ones_like(rs[live]), atol=1e-12, rtol=0)
    assert bool((rs[row_dead] == 0).all())
    assert bool((w[~allowed] == 0).all())

    d_ = FIXTURES / "sdpa" / name
    d_.mkdir(parents=True)
    save_npy(d_ / "q.npy", q32)
    save_npy(d_ / "k.npy", k32)
    save_npy(d_ / "v.npy", v32)
    if mask is not None:
        save_npy(d_ / "mask.npy", mask)
    if bias32 is not None:
        save_npy(d_ / "bias.npy", bias32)
    if kv_lens is not None:
        save_npy(d_ / "kv_lens.npy", kv_lens)
    save_npy(d_ / "out.npy", out.numpy())
    save_npy(d_ / "lse.npy", lse.numpy())
    save_npy(d_ / "weights.npy", w.numpy())
    meta = {"causal": causal, "scale": scale, "description": description}
    if storage != "f32":
        meta["storage"] = storage
    write_json(d_ / "meta.json", meta)
    if storage == "f32":
        grads_note = backward_golden(d_, seed, q32, k32, v32, bias32, allowed, row_dead, sc, causal, mask,
                                     kv_lens)
    else:
        grads_note = "no backward golden"

    extras = []
    if mask is not None:
        extras.append(f"mask{list(mask.shape)}")
    if bias32 is not None:
        extras.append(f"bias{list(bias32.shape)}")
    if kv_lens is not None:
        extras.append(f"kv_lens={kv_lens.tolist()}")
    max_logit = float(torch.einsum("bhle,bhse->bhls", q, k.repeat_interleave(Hq // Hkv, 1)).abs().max() * sc)
    print(f"sdpa/{name}: storage={storage} B={B} Hq={Hq} Hkv={Hkv} L={L} S={S} E={E} Ev={Ev} causal={causal} "
          f"scale={scale} {' '.join(extras)} | torch path: {how}, max|diff|={d:.2e}, {lse_note}, "
          f"dead rows={n_dead}, max|logit|={max_logit:.3g}" + (f" | {note}" if note else "")
          + f" | {grads_note}")


def explicit_grads(q, k, v, bias, allowed, row_dead, scale, dout):
    """Autograd of sum(dout * O) through the explicit SDPA in q's dtype (float64: the golden;
    float32: the plain f32 implementation of FlashAttention's accuracy rule). Fully masked rows
    are computed as if unmasked and their output multiplied by 0, so their gradients are exactly
    0 (the crate's semantics) instead of NaN."""
    q = q.clone().requires_grad_(True)
    k = k.clone().requires_grad_(True)
    v = v.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True) if bias is not None else None
    g = q.shape[1] // k.shape[1]
    live_allowed = allowed | row_dead.unsqueeze(-1)
    logits = torch.einsum("bhle,bhse->bhls", q, k.repeat_interleave(g, 1)) * scale
    if b is not None:
        logits = logits + b
    logits = logits.masked_fill(~live_allowed, float("-inf"))
    w = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhls,bhsv->bhlv", w, v.repeat_interleave(g, 1))
    out = out * (~row_dead).unsqueeze(-1).to(out.dtype)
    (out * dout).sum().backward()
    return q.grad, k.grad, v.grad, (b.grad if b is not None else None)


def backward_golden(d_, seed, q32, k32, v32, bias32, allowed, row_dead, sc, causal, mask, kv_lens):
    """dout.npy and PyTorch autograd gradients: float64 (dq.npy, dk.npy, dv.npy, dbias.npy) and
    float32 (dq_f32.npy, ...). A separate random stream, so the forward files are unchanged."""
    rng = np.random.default_rng(seed + 1_000_003)
    B, Hq, L, _ = q32.shape
    dout32 = randn32(rng, (B, Hq, L, v32.shape[-1]))
    t = lambda a, dt: torch.from_numpy(a).to(dt) if a is not None else None
    g64 = explicit_grads(t(q32, torch.float64), t(k32, torch.float64), t(v32, torch.float64),
                         t(bias32, torch.float64), allowed, row_dead, sc, t(dout32, torch.float64))
    g32 = explicit_grads(t(q32, torch.float32), t(k32, torch.float32), t(v32, torch.float32),
                         t(bias32, torch.float32), allowed, row_dead, sc, t(dout32, torch.float32))
    note = ""
    if not bool(row_dead.any()):
        # Cross-check against torch's own SDPA autograd (float64, math backend).
        q = t(q32, torch.float64).requires_grad_(True)
        k = t(k32, torch.float64).requires_grad_(True)
        v = t(v32, torch.float64).requires_grad_(True)
        b = t(bias32, torch.float64).requires_grad_(True) if bias32 is not None else None
        out, _ = torch_sdpa(q, k, v, allowed, b, sc, causal, mask, kv_lens)
        (out * t(dout32, torch.float64)).sum().backward()
        pairs = [(q.grad, g64[0]), (k.grad, g64[1]), (v.grad, g64[2])]
        if b is not None:
            pairs.append((b.grad, g64[3]))
        dg = max(max_abs_diff(a, e) for a, e in pairs)
        assert dg <= 1e-9, f"torch SDPA autograd vs explicit grads differ by {dg}"
        note = f", torch SDPA autograd max|diff|={dg:.1e}"
    save_npy(d_ / "dout.npy", dout32)
    for name, a64, a32 in zip(["dq", "dk", "dv", "dbias"], g64, g32):
        if a64 is None:
            continue
        assert bool(torch.isfinite(a64).all()), f"{name} not finite"
        save_npy(d_ / f"{name}.npy", a64.numpy())
        save_npy(d_ / f"{name}_f32.npy", a32.numpy())
    return "grads written" + note


def bool_mask(rng, shape, p_false):
    return rng.random(shape) >= p_false


def make_sdpa():
    # 1
    sdpa_case("basic", 101, B=2, Hq=3, Hkv=3, L=17, S=17, E=16, Ev=16,
              description="plain SDPA, no mask, default scale")
    # 2
    sdpa_case("l_ne_s_e_ne_ev", 102, B=1, Hq=2, Hkv=2, L=13, S=29, E=24, Ev=40,
              description="L != S and E != Ev, no mask")
    # 3-6 causal
    sdpa_case("causal_top_left_l_lt_s", 103, B=2, Hq=2, Hkv=2, L=11, S=23, E=20, Ev=20,
              causal="top_left", description="top-left causal (j <= i), L < S")
    sdpa_case("causal_top_left_l_gt_s", 104, B=2, Hq=2, Hkv=2, L=23, S=11, E=20, Ev=20,
              causal="top_left", description="top-left causal (j <= i), L > S")
    sdpa_case("causal_bottom_right_l_lt_s", 105, B=2, Hq=2, Hkv=2, L=11, S=23, E=20, Ev=20,
              causal="bottom_right", description="bottom-right causal (j <= i + S - L), L < S")
    sdpa_case("causal_bottom_right_l_gt_s", 106, B=2, Hq=2, Hkv=2, L=23, S=11, E=20, Ev=20,
              causal="bottom_right",
              description="bottom-right causal (j <= i + S - L), L > S: first L-S=12 rows fully "
                          "masked -> out 0, weights 0, lse -inf")

    # 7 bool mask with fully masked rows
    def m7(rng):
        m = bool_mask(rng, (2, 1, 19, 21), 0.3)
        m[0, 0, 3, :] = False
        m[1, 0, 0, :] = False
        m[1, 0, 18, :] = False
        # make sure every other row keeps at least one key
        for b in range(2):
            for i in range(19):
                if (b, i) not in {(0, 3), (1, 0), (1, 18)} and not m[b, 0, i].any():
                    m[b, 0, i, i] = True
        return m

    sdpa_case("bool_mask_fully_masked_rows", 107, B=2, Hq=3, Hkv=3, L=19, S=21, E=16, Ev=16,
              mask_fn=m7,
              description="bool mask [B,1,L,S] (~30% False, True = may attend) broadcast over "
                          "heads; rows (b=0,i=3), (b=1,i=0), (b=1,i=18) entirely False -> out 0, "
                          "weights 0, lse -inf")
    # 8
    sdpa_case("bias_broadcast", 108, B=2, Hq=3, Hkv=3, L=15, S=18, E=16, Ev=16,
              bias_fn=lambda rng: randn32(rng, (1, 3, 15, 18), 2.0),
              description="additive float bias [1,H,L,S] (std 2) broadcast over batch")
    # 9
    sdpa_case("gqa", 109, B=2, Hq=8, Hkv=2, L=17, S=19, E=16, Ev=16,
              description="grouped-query attention: Hq=8, Hkv=2, query head h uses kv head h // 4")
    sdpa_case("mqa", 110, B=2, Hq=4, Hkv=1, L=9, S=33, E=32, Ev=32,
              description="multi-query attention: Hq=4, Hkv=1")
    # 10
    sdpa_case("kv_lens_padding", 111, B=3, Hq=2, Hkv=2, L=7, S=20, E=16, Ev=16,
              kv_lens=[20, 15, 1],
              description="per-batch key padding: keys j >= kv_lens[b] masked, kv_lens=[S, S-5, 1]")
    # 11
    sdpa_case("scale_custom", 112, B=1, Hq=2, Hkv=2, L=10, S=12, E=16, Ev=16, scale=0.3,
              description="explicit scale 0.3")
    sdpa_case("scale_one", 113, B=1, Hq=2, Hkv=2, L=10, S=12, E=16, Ev=16, scale=1.0,
              description="explicit scale 1.0 (unscaled dot product)")

    # 12 combined
    def m12(rng):
        m = bool_mask(rng, (1, 1, 13, 21), 0.2)
        m[..., 0] = True  # key 0 always passes the bool mask
        return m

    sdpa_case("combined", 114, B=2, Hq=6, Hkv=2, L=13, S=21, E=24, Ev=12, causal="bottom_right",
              mask_fn=m12, bias_fn=lambda rng: randn32(rng, (2, 1, 13, 21), 1.0), kv_lens=[21, 9],
              description="bottom-right causal + bool mask [1,1,L,S] + bias [B,1,L,S] + kv_lens "
                          "[21, 9], GQA Hq=6 Hkv=2, E=24 != Ev=12, L=13 != S=21")
    # 13 large logits: q,k std a -> logits std ~ a^2 (default scale), a^2 = 4096
    sdpa_case("large_logits", 115, B=1, Hq=2, Hkv=2, L=16, S=24, E=16, Ev=16, qk_std=64.0,
              description="q,k ~ N(0, 64^2): scaled logits std ~4e3, max |logit| ~1.5e4 (finite "
                          "in float32); tests max-subtraction / online softmax stability. "
                          "Note a float32 kernel's logits carry ~1e-3 absolute rounding error here.")
    # 14 head dims
    sdpa_case("head_dim_odd", 116, B=2, Hq=2, Hkv=2, L=5, S=7, E=3, Ev=5,
              description="odd head dims E=3, Ev=5")
    sdpa_case("head_dim_big", 117, B=1, Hq=2, Hkv=2, L=3, S=5, E=72, Ev=72,
              description="head dim 72 (not a multiple of 64), tiny L,S")
    sdpa_case("head_dim_128", 118, B=1, Hq=2, Hkv=2, L=4, S=6, E=128, Ev=128,
              description="head dim 128, tiny L,S")
    # extra: decode step
    sdpa_case("decode_l1", 119, B=2, Hq=4, Hkv=2, L=1, S=37, E=16, Ev=16, causal="bottom_right",
              kv_lens=[37, 30],
              description="single-query decode step: L=1, S=37, bottom-right causal (all keys "
                          "allowed) + kv_lens [37, 30], GQA Hq=4 Hkv=2")


    # Half-precision storage: inputs (and bias) rounded by PyTorch's .half() / .bfloat16(),
    # outputs computed in float64 from the rounded values (the GPU stores its output in the
    # format: tested at that format's tolerance).
    for st in ("f16", "bf16"):
        sdpa_case(f"{st}_combined", 214, B=2, Hq=6, Hkv=2, L=13, S=21, E=24, Ev=12,
                  causal="bottom_right", mask_fn=m12,
                  bias_fn=lambda rng: randn32(rng, (2, 1, 13, 21), 1.0), kv_lens=[21, 9], storage=st,
                  description=f"{st} inputs: bottom-right causal + bool mask + bias + kv_lens, GQA")
        sdpa_case(f"{st}_fully_masked_rows", 207, B=2, Hq=3, Hkv=3, L=19, S=21, E=16, Ev=16,
                  mask_fn=m7, storage=st,
                  description=f"{st} inputs: bool mask with fully masked rows (out 0, lse -inf)")
        sdpa_case(f"{st}_head_dim_odd", 216, B=2, Hq=2, Hkv=2, L=5, S=7, E=3, Ev=5, storage=st,
                  description=f"{st} inputs: odd head dims E=3, Ev=5")
        sdpa_case(f"{st}_decode_l1", 219, B=2, Hq=4, Hkv=2, L=1, S=37, E=16, Ev=16,
                  causal="bottom_right", kv_lens=[37, 30], storage=st,
                  description=f"{st} inputs: single-query decode step with kv_lens, GQA")
        sdpa_case(f"{st}_large_logits", 215, B=1, Hq=2, Hkv=2, L=16, S=24, E=16, Ev=16,
                  qk_std=8.0, storage=st,
                  description=f"{st} inputs: q,k ~ N(0, 8^2), scaled logits up to ~1e2")


# --------------------------------------------------------------------------------------
# MHA
# --------------------------------------------------------------------------------------

def explicit_mha(sd, query, key, value, H, key_padding_mask, attn_mask):
    """float64 re-implementation of nn.MultiheadAttention (batch_first, no dropout), extended
    to grouped-query heads: k/v_proj_weight of G * d rows (G dividing H) give G key/value heads,
    each shared by H / G query heads (torch's module has no such option)."""
    E = query.shape[-1]
    if "in_proj_weight" in sd:
        wq, wk, wv = sd["in_proj_weight"].chunk(3, 0)
    else:
        wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
    kv = wk.shape[0]
    if "in_proj_bias" in sd:
        bq, bk, bv = sd["in_proj_bias"].split([E, kv, kv], 0)
    else:
        bq, bk, bv = torch.zeros(E), torch.zeros(kv), torch.zeros(kv)
    Q = query @ wq.T + bq
    K = key @ wk.T + bk
    V = value @ wv.T + bv
    B, L, _ = Q.shape
    S = K.shape[1]
    d = E // H
    G = kv // d
    Q = Q.view(B, L, H, d).transpose(1, 2)
    K = K.view(B, S, G, d).transpose(1, 2).repeat_interleave(H // G, 1)
    V = V.view(B, S, G, d).transpose(1, 2).repeat_interleave(H // G, 1)
    logits = Q @ K.transpose(-1, -2) / math.sqrt(d)
    blocked = torch.zeros(B, 1, L, S, dtype=torch.bool)
    if key_padding_mask is not None:
        blocked |= key_padding_mask.view(B, 1, 1, S)
    if attn_mask is not None:
        blocked |= attn_mask.view(1, 1, L, S)
    logits = logits.masked_fill(blocked, float("-inf"))
    P = torch.softmax(logits, -1)
    O = (P @ V).transpose(1, 2).reshape(B, L, E)
    out = O @ sd["out_proj.weight"].T
    if "out_proj.bias" in sd:
        out = out + sd["out_proj.bias"]
    return out, P


def mha_grads(sd32, query32, key32, value32, self_attn, H, kpm_t, am_t, dout32, module=None):
    """Autograd (float64) of sum(dout * Y) through the explicit layer, with respect to the
    inputs (the query alone in self-attention, where it is also the key and value) and every
    parameter; cross-checked against the torch module's own autograd when one is given."""
    sd = {k_: v_.double().clone().requires_grad_(True) for k_, v_ in sd32.items()}
    q = torch.from_numpy(query32).double().requires_grad_(True)
    if self_attn:
        k = v = q
    else:
        k = torch.from_numpy(key32).double().requires_grad_(True)
        v = torch.from_numpy(value32).double().requires_grad_(True)
    dout = torch.from_numpy(dout32).double()
    out, _ = explicit_mha(sd, q, k, v, H, kpm_t, am_t)
    (out * dout).sum().backward()
    grads = {"query": q.grad}
    if not self_attn:
        grads["key"] = k.grad
        grads["value"] = v.grad
    for k_, p in sd.items():
        grads[k_] = p.grad
    diff = None
    if module is not None:
        m = copy.deepcopy(module).double()
        qm = torch.from_numpy(query32).double().requires_grad_(True)
        if self_attn:
            km = vm = qm
        else:
            km = torch.from_numpy(key32).double().requires_grad_(True)
            vm = torch.from_numpy(value32).double().requires_grad_(True)
        y, _ = m(qm, km, vm, key_padding_mask=kpm_t, attn_mask=am_t, need_weights=False)
        (y * dout).sum().backward()
        theirs = {"query": qm.grad}
        if not self_attn:
            theirs["key"] = km.grad
            theirs["value"] = vm.grad
        for n, p in m.named_parameters():
            theirs[n] = p.grad
        assert sorted(theirs) == sorted(grads), (sorted(theirs), sorted(grads))
        diff = max(max_abs_diff(theirs[n], grads[n]) for n in grads)
        assert diff <= 1e-10, f"module autograd vs explicit differ by {diff}"
        grads = theirs
    for n, g in grads.items():
        assert bool(torch.isfinite(g).all()), n
    return {n: g.detach().contiguous() for n, g in grads.items()}, diff


def mha_case(name, seed, E, H, B, L, S, description, kdim=None, vdim=None, bias=True,
             self_attn=True, kpm_lens=None, causal=False, kv_heads=None):
    rng = np.random.default_rng(seed)
    kd = kdim if kdim is not None else E
    vd = vdim if vdim is not None else E
    if kv_heads is None:
        mod = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=vdim,
                                          dtype=torch.float32)
        mod.eval()
        shapes = {k_: tuple(t.shape) for k_, t in mod.state_dict().items()}
    else:
        # Grouped-query heads: the explicit layer only (torch's module has none).
        mod = None
        kv = kv_heads * (E // H)
        shapes = {"q_proj_weight": (E, E), "k_proj_weight": (kv, kd), "v_proj_weight": (kv, vd)}
        if bias:
            shapes["in_proj_bias"] = (E + 2 * kv,)
        shapes["out_proj.weight"] = (E, E)
        if bias:
            shapes["out_proj.bias"] = (E,)
    # Every parameter from numpy (independent of torch's init / RNG); biases are made
    # non-zero so they are actually exercised (torch initialises them to 0).
    new_sd = {}
    for kname, shape in shapes.items():
        if kname.endswith("bias"):
            arr = randn32(rng, shape, 0.5)
        else:
            fan_in = shape[1]
            lim = math.sqrt(3.0 / fan_in)
            arr = rng.uniform(-lim, lim, size=shape).astype(np.float32)
        new_sd[kname] = torch.from_numpy(arr)
    if mod is not None:
        mod.load_state_dict(new_sd)
        sd32 = {k_: v_.detach().clone().contiguous() for k_, v_ in mod.state_dict().items()}
    else:
        sd32 = {k_: v_.float().contiguous() for k_, v_ in new_sd.items()}
    for v_ in sd32.values():
        assert v_.dtype == torch.float32

    query32 = randn32(rng, (B, L, E))
    if self_attn:
        assert S == L and kd == E and vd == E
        key32 = query32.copy()
        value32 = query32.copy()
    else:
        key32 = randn32(rng, (B, S, kd))
        value32 = randn32(rng, (B, S, vd))

    kpm = None
    if kpm_lens is not None:
        kpm = np.arange(S)[None, :] >= np.asarray(kpm_lens)[:, None]  # True = ignore
        assert not kpm.all(axis=1).any()
    am = np.triu(np.ones((L, S), dtype=np.bool_), k=1) if causal else None  # True = blocked

    qd = torch.from_numpy(query32).double()
    kd_ = torch.from_numpy(key32).double()
    vd_ = torch.from_numpy(value32).double()
    if self_attn:
        kd_ = vd_ = qd  # same object, as in genuine self-attention
    kpm_t = torch.from_numpy(kpm) if kpm is not None else None
    am_t = torch.from_numpy(am) if am is not None else None
    with torch.no_grad():
        ref_out, ref_P = explicit_mha({k_: v_.double() for k_, v_ in sd32.items()}, qd, kd_, vd_,
                                      H, kpm_t, am_t)
        if mod is not None:
            mod64 = copy.deepcopy(mod).double()
            out, w_avg = mod64(qd, kd_, vd_, key_padding_mask=kpm_t, attn_mask=am_t,
                               need_weights=True, average_attn_weights=True)
            out2, w_ph = mod64(qd, kd_, vd_, key_padding_mask=kpm_t, attn_mask=am_t,
                               need_weights=True, average_attn_weights=False)
        else:
            out, out2, w_ph, w_avg = ref_out, ref_out, ref_P, ref_P.mean(1)
    assert out.dtype == torch.float64
    for t in (out, out2, w_avg, w_ph):
        assert not bool(torch.isnan(t).any()), name
    d1 = max_abs_diff(out, ref_out)
    d2 = max_abs_diff(w_ph, ref_P)
    d3 = max_abs_diff(w_avg, ref_P.mean(1))
    d4 = max_abs_diff(out, out2)
    assert max(d1, d2, d3, d4) <= TOL, (name, d1, d2, d3, d4)
    assert tuple(out.shape) == (B, L, E)
    assert tuple(w_avg.shape) == (B, L, S)
    assert tuple(w_ph.shape) == (B, H, L, S)

    # Gradients of sum(dout * Y): a separate random stream, so the forward files are unchanged.
    dout32 = randn32(np.random.default_rng(seed + 1_000_003), (B, L, E))
    grads, gdiff = mha_grads(sd32, query32, key32, value32, self_attn, H, kpm_t, am_t, dout32, mod)

    d_ = FIXTURES / "mha" / name
    d_.mkdir(parents=True)
    save_file(sd32, str(d_ / "weights.safetensors"))
    save_npy(d_ / "query.npy", query32)
    save_npy(d_ / "key.npy", key32)
    save_npy(d_ / "value.npy", value32)
    if kpm is not None:
        save_npy(d_ / "key_padding_mask.npy", kpm)
    if am is not None:
        save_npy(d_ / "attn_mask.npy", am)
    save_npy(d_ / "out.npy", out.numpy())
    save_npy(d_ / "attn_weights_avg.npy", w_avg.numpy())
    save_npy(d_ / "attn_weights_per_head.npy", w_ph.numpy())
    save_npy(d_ / "dout.npy", dout32)
    save_file(grads, str(d_ / "grads.safetensors"))
    meta = {"embed_dim": E, "num_heads": H, "kdim": kd, "vdim": vd, "bias": bias, "causal": causal,
            "description": description, "self_attn": self_attn}
    if kv_heads is not None:
        meta["kv_heads"] = kv_heads
    write_json(d_ / "meta.json", meta)
    how = "explicit layer only (GQA)" if mod is None else f"module autograd vs explicit {gdiff:.1e}"
    print(f"mha/{name}: E={E} H={H} G={kv_heads or H} kdim={kd} vdim={vd} bias={bias} B={B} L={L} S={S} "
          f"causal={causal} kpm_lens={kpm_lens} keys={sorted(sd32)} | "
          f"max|diff| vs explicit={max(d1, d2, d3):.2e} | grads {sorted(grads)}: {how}")


def make_mha():
    mha_case("self_attn", 201, E=32, H=4, B=2, L=9, S=9,
             description="self-attention (query = key = value), E=32, H=4")
    mha_case("cross_attn_kdim_vdim", 202, E=24, H=3, B=2, L=7, S=11, kdim=10, vdim=14,
             self_attn=False,
             description="cross-attention with kdim=10, vdim=14 (separate q/k/v_proj_weight)")
    mha_case("key_padding", 203, E=16, H=2, B=3, L=8, S=8, kpm_lens=[8, 5, 2],
             description="self-attention with key_padding_mask (True = ignore) masking key tails; "
                         "valid key lengths [8, 5, 2]")
    mha_case("causal_self", 204, E=16, H=4, B=2, L=10, S=10, causal=True,
             description="causal self-attention: attn_mask = strict upper triangle True "
                         "(True = not allowed)")
    mha_case("no_bias", 205, E=20, H=5, B=2, L=6, S=6, bias=False,
             description="self-attention with bias=False (no in_proj_bias, no out_proj.bias)")
    mha_case("gqa_cross_padding", 206, E=24, H=6, B=3, L=5, S=9, kdim=10, vdim=7, kv_heads=2,
             self_attn=False, kpm_lens=[9, 4, 6],
             description="grouped-query cross-attention (6 query heads, 2 key/value heads; "
                         "explicit layer, torch's module has no GQA) with kdim=10, vdim=7 and "
                         "a key_padding_mask (valid key lengths [9, 4, 6])")


# --------------------------------------------------------------------------------------
# Attention variants (general, additive, lowrank-v, nystrom, linformer)
# --------------------------------------------------------------------------------------
#
# Each golden is computed with torch ops in float64 (the value written) and again with an
# independent explicit numpy float64 formula (per batch/head loops, per-row softmax over the
# allowed keys, the mask rebuilt element by element); the two must agree to TOL.  Where the
# variant reduces to SDPA on transformed inputs (general: q @ W; lowrank-v: values U;
# linformer: projected K', V') torch.nn.functional.scaled_dot_product_attention is a third
# check on the rows that are not fully masked.
#
# Parameters are float32 from numpy: matrices, u, and A of lowrank-v are
# uniform(-sqrt(3/fan_in), sqrt(3/fan_in)) (variance 1/fan_in, as the MHA weights above), with
# fan_in their last dimension, times a gain where a case says so; the additive b ~ N(0, 0.5^2).

VARIANT_SUMMARY = []


def uniform_w(rng, shape, gain=1.0):
    lim = gain * math.sqrt(3.0 / shape[-1])
    return rng.uniform(-lim, lim, size=shape).astype(np.float32)


def segment_bounds(n, m):
    """Landmark / segment t of n rows covers floor(t*n/m) .. floor((t+1)*n/m) - 1."""
    return [((t * n) // m, ((t + 1) * n) // m) for t in range(m)]


def segment_mean_matrix(n, m):
    """[m, n] float64 torch matrix whose row t averages the rows of segment t."""
    P = torch.zeros(m, n)
    for t, (a, b) in enumerate(segment_bounds(n, m)):
        assert b > a, "empty segment"
        P[t, a:b] = 1.0 / (b - a)
    return P


def np_allowed(B, Hq, L, S, causal, mask, kv_lens):
    """Element-by-element numpy rebuild of allowed_mask (True = may attend)."""
    out = np.zeros((B, Hq, L, S), dtype=np.bool_)
    mb = np.broadcast_to(mask, (B, Hq, L, S)) if mask is not None else None
    for b in range(B):
        for h in range(Hq):
            for i in range(L):
                for j in range(S):
                    ok = True
                    if causal == "top_left":
                        ok = j <= i
                    elif causal == "bottom_right":
                        end = int(kv_lens[b]) if kv_lens is not None else S
                        ok = j <= i + end - L
                    if mb is not None:
                        ok = ok and bool(mb[b, h, i, j])
                    if kv_lens is not None:
                        ok = ok and j < int(kv_lens[b])
                    out[b, h, i, j] = ok
    return out


def np_softmax_row(s, allowed_row):
    """Softmax of the float64 scores s over the allowed keys; zeros if none is allowed."""
    p = np.zeros(s.shape, dtype=np.float64)
    if not allowed_row.any():
        return p
    mx = s[allowed_row].max()
    e = np.where(allowed_row, np.exp(np.where(allowed_row, s - mx, 0.0)), 0.0)
    return e / e.sum()


def np_masked_attention(scores_fn, vals_fn, B, Hq, Hkv, L, S, allowed, bias, Ev):
    """Per (b, h, i): scores_fn(b, h, kvh, i) -> [S] scaled scores (float64); the bias is
    added, softmax over allowed keys, out row = sum_j p_j vals_fn(b, kvh)[j]."""
    g = Hq // Hkv
    bb = np.broadcast_to(bias, (B, Hq, L, S)) if bias is not None else None
    out = np.zeros((B, Hq, L, Ev))
    w = np.zeros((B, Hq, L, S))
    for b in range(B):
        for h in range(Hq):
            kvh = h // g
            vals = vals_fn(b, kvh)
            for i in range(L):
                s = scores_fn(b, h, kvh, i)
                if bb is not None:
                    s = s + bb[b, h, i]
                p = np_softmax_row(s, allowed[b, h, i])
                w[b, h, i] = p
                out[b, h, i] = sum(p[j] * vals[j] for j in range(S)) if S else 0.0
    return out, w


def torch_masked_softmax(scores, allowed):
    """Softmax over allowed entries, zeros on rows with none (torch ops)."""
    row_dead = ~allowed.any(dim=-1)
    logits = scores.masked_fill(~allowed, float("-inf"))
    logits = logits.masked_fill(row_dead.unsqueeze(-1), 0.0)
    w = torch.softmax(logits, dim=-1)
    return torch.where(allowed, w, torch.zeros_like(w)), row_dead


def check_weights(name, w, allowed, row_dead):
    live = ~row_dead
    rs = w.sum(-1)
    assert torch.allclose(rs[live], torch.ones_like(rs[live]), atol=1e-12, rtol=0), name
    assert bool((rs[row_dead] == 0).all()), name
    assert bool((w[~allowed] == 0).all()), name


def torch_nystrom(q, k, v, m, sc, pinv_iters):
    """Nystromformer (no conv skip) with torch ops in q's dtype; returns out and F, A, B', Z,
    and the values repeated to the query heads."""
    L, S = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    Ql = segment_mean_matrix(L, m).to(q.dtype) @ q          # [B,Hq,m,E]
    Kl = segment_mean_matrix(S, m).to(q.dtype) @ kk         # [B,Hq,m,E] (per kv head, repeated)
    Fm = torch.softmax(sc * q @ Kl.transpose(-1, -2), -1)       # [B,Hq,L,m]
    Am = torch.softmax(sc * Ql @ Kl.transpose(-1, -2), -1)      # [B,Hq,m,m]
    Bm = torch.softmax(sc * Ql @ kk.transpose(-1, -2), -1)      # [B,Hq,m,S]
    colmax = Am.abs().sum(-2).amax(-1)
    rowmax = Am.abs().sum(-1).amax(-1)
    Z = Am.transpose(-1, -2) / (colmax * rowmax)[..., None, None]
    I = torch.eye(m, dtype=q.dtype)
    for _ in range(pinv_iters):
        AZ = Am @ Z
        Z = 0.25 * Z @ (13 * I - AZ @ (15 * I - AZ @ (7 * I - AZ)))
    out = Fm @ (Z @ (Bm @ vv))
    return out, Fm, Am, Bm, Z, vv


def t64(a):
    return torch.from_numpy(a).double() if a is not None else None


def variant_case(name, seed, kind, B, Hq, Hkv, L, S, E, Ev, description, causal="none", scale=None,
                 mask_fn=None, bias_fn=None, kv_lens=None, A=None, with_b=False, u_target=None,
                 w_gain=1.0, u_gain=1.0, r=None, landmarks=None, pinv_iters=6, k_p=None, proj="random"):
    rng = np.random.default_rng(seed)
    q32 = randn32(rng, (B, Hq, L, E))
    k32 = randn32(rng, (B, Hkv, S, E))
    v_last = r if kind == "lowrank-v" else Ev
    v32 = randn32(rng, (B, Hkv, S, v_last))
    params = {}
    if kind == "general":
        params["w"] = uniform_w(rng, (E, E), w_gain)
    elif kind == "additive":
        params["w_q"] = uniform_w(rng, (A, E), w_gain)
        params["w_k"] = uniform_w(rng, (A, E), w_gain)
        params["u"] = uniform_w(rng, (A,), u_gain)
        if with_b:
            params["b"] = randn32(rng, (A,), 0.5)
    elif kind == "lowrank-v":
        params["a"] = uniform_w(rng, (r, Ev))
    elif kind == "linformer":
        if proj == "random":
            params["e"] = uniform_w(rng, (k_p, S))
            params["f"] = uniform_w(rng, (k_p, S))
        else:
            assert proj == "segment_mean"
            pm = segment_mean_matrix(S, k_p).numpy().astype(np.float32)
            params["e"] = pm
            params["f"] = pm.copy()
    mask = mask_fn(rng) if mask_fn else None
    bias32 = bias_fn(rng).astype(np.float32) if bias_fn else None
    if kv_lens is not None:
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        assert kv_lens.shape == (B,)
    if mask is not None:
        assert mask.dtype == np.bool_ and mask.ndim == 4
    masked = mask is not None or bias32 is not None or kv_lens is not None or causal != "none"
    assert not (masked and kind in ("nystrom", "linformer")), f"{name}: {kind} takes no masks"
    assert Hq % Hkv == 0

    q, k, v = t64(q32), t64(k32), t64(v32)
    bias = t64(bias32)
    g = Hq // Hkv
    default_scale = 1.0 if kind in ("general", "additive") else 1.0 / math.sqrt(E)
    sc = scale if scale is not None else default_scale
    notes = []

    if kind == "additive" and u_target is not None:
        # Rescale u so that max |score| over the case is u_target (tanh saturation and a
        # wide score range); done once in float64, then u is rounded to float32.
        pq = torch.einsum("ae,bhle->bhla", t64(params["w_q"]), q)
        pk = torch.einsum("ae,bhse->bhsa", t64(params["w_k"]), k).repeat_interleave(g, 1)
        pre = pq.unsqueeze(3) + pk.unsqueeze(2)
        s0 = sc * (torch.tanh(pre) * t64(params["u"])).sum(-1)
        params["u"] = (params["u"].astype(np.float64) * (u_target / float(s0.abs().max()))).astype(
            np.float32)
        notes.append(f"max|W_q q + W_k k|={float(pre.abs().max()):.3g}, "
                     f"{int((pre.abs() > 20).sum())} entries beyond +-20")
    P = {k_: t64(a) for k_, a in params.items()}
    Pn = {k_: a.astype(np.float64) for k_, a in params.items()}
    qn, kn, vn = q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64)
    biasn = bias32.astype(np.float64) if bias32 is not None else None

    w = w_np = None
    sdpa_note = ""
    if kind in ("general", "additive", "lowrank-v"):
        allowed = allowed_mask(B, Hq, L, S, causal, mask, kv_lens)
        allowed_n = np_allowed(B, Hq, L, S, causal, mask, kv_lens)
        assert (allowed.numpy() == allowed_n).all(), name
        kk = k.repeat_interleave(g, 1)
        vv = v.repeat_interleave(g, 1)
        # torch ops
        if kind == "general":
            scores = sc * ((q @ P["w"]) @ kk.transpose(-1, -2))
        elif kind == "additive":
            pq = torch.einsum("ae,bhle->bhla", P["w_q"], q)
            pk = torch.einsum("ae,bhse->bhsa", P["w_k"], kk)
            pre = pq.unsqueeze(3) + pk.unsqueeze(2)  # [B,Hq,L,S,A]
            if "b" in P:
                pre = pre + P["b"]
            scores = sc * (torch.tanh(pre) * P["u"]).sum(-1)
        else:
            scores = sc * (q @ kk.transpose(-1, -2))
        if bias is not None:
            scores = scores + bias
        w, row_dead = torch_masked_softmax(scores, allowed)
        out = w @ vv
        if kind == "lowrank-v":
            out = out @ P["a"]
        check_weights(name, w, allowed, row_dead)
        sa = scores[allowed]
        if sa.numel():
            notes.append(f"scores in [{float(sa.min()):.3g}, {float(sa.max()):.3g}]")

        # explicit numpy
        if kind == "general":
            def scores_fn(b, h, kvh, i):
                qi = qn[b, h, i]
                return np.array([sc * sum(qi[e] * sum(Pn["w"][e, f] * kn[b, kvh, j, f] for f in range(E))
                                          for e in range(E)) for j in range(S)])
        elif kind == "additive":
            def scores_fn(b, h, kvh, i):
                bvec = Pn["b"] if "b" in Pn else np.zeros(A)
                a_q = Pn["w_q"] @ qn[b, h, i]
                res = []
                for j in range(S):
                    pre_ = a_q + Pn["w_k"] @ kn[b, kvh, j] + bvec
                    res.append(sc * sum(Pn["u"][a] * math.tanh(pre_[a]) for a in range(A)))
                return np.array(res)
        else:
            def scores_fn(b, h, kvh, i):
                return np.array([sc * float(np.dot(qn[b, h, i], kn[b, kvh, j])) for j in range(S)])
        if kind == "lowrank-v":
            vals_fn = lambda b, kvh: vn[b, kvh] @ Pn["a"]  # rows of U A: the other association
        else:
            vals_fn = lambda b, kvh: vn[b, kvh]
        out_np, w_np = np_masked_attention(scores_fn, vals_fn, B, Hq, Hkv, L, S, allowed_n, biasn, Ev)

        # torch SDPA on the transformed problem (live rows)
        if kind in ("general", "lowrank-v"):
            qq = q @ P["w"] if kind == "general" else q
            t_out, how = torch_sdpa(qq, k, v, allowed, bias, sc, causal, mask, kv_lens)
            if kind == "lowrank-v":
                t_out = t_out @ P["a"]
            live = ~row_dead
            ds = max_abs_diff(t_out[live], out[live])
            assert ds <= TOL, f"{name}: torch SDPA vs torch ops differ by {ds}"
            sdpa_note = f"F.sdpa ({how}) max|diff|={ds:.1e}"
        n_dead = int(row_dead.sum())
        notes.append(f"dead rows={n_dead}")
    elif kind == "nystrom":
        m = landmarks
        assert 1 <= m <= min(L, S)
        out, Fm, Am, Bm, Z, vv = torch_nystrom(q, k, v, m, sc, pinv_iters)
        I = torch.eye(m)
        resid = float(torch.linalg.matrix_norm(I - Am @ Z, ord=2).max())
        cond = float(torch.linalg.cond(Am).max())
        # Diagnostic only: the same formula run in float32 (torch, CPU) from the same inputs.
        out32 = torch_nystrom(q.float(), k.float(), v.float(), m, sc, pinv_iters)[0]
        d32 = float((out32.double() - out).abs().max())
        notes.append(f"max cond(A)={cond:.3g}, max||I - A Z||_2={resid:.2e}, "
                     f"float32 run of the formula max|diff|={d32:.1e}, max|out|={float(out.abs().max()):.3g}")
        if name == "nystrom_m_full":
            Zi = torch.linalg.inv(Am)
            out_inv = Fm @ (Zi @ (Bm @ vv))
            di = max_abs_diff(out_inv, out)
            assert di <= 1e-6, f"{name}: Z vs inv(A) outputs differ by {di}"
            ref, _, _, _ = explicit_sdpa(q, k, v, torch.ones(B, Hq, L, S, dtype=torch.bool), None, sc)
            dr = max_abs_diff(ref, out)
            assert dr <= 1e-6, f"{name}: m = L = S nystrom vs exact softmax attention differ by {dr}"
            sdpa_note = f"vs inv(A) max|diff|={di:.1e}, vs exact softmax attention {dr:.1e}"

        # explicit numpy, per (b, h)
        def np_softmax_rows(X):
            X = X - X.max(axis=1, keepdims=True)
            e = np.exp(X)
            return e / e.sum(axis=1, keepdims=True)

        out_np = np.zeros((B, Hq, L, Ev))
        for b in range(B):
            for h in range(Hq):
                Qb, Kb, Vb = qn[b, h], kn[b, h // g], vn[b, h // g]
                Qt = np.stack([Qb[a_:b_].mean(axis=0) for a_, b_ in segment_bounds(L, m)])
                Kt = np.stack([Kb[a_:b_].mean(axis=0) for a_, b_ in segment_bounds(S, m)])
                F_ = np_softmax_rows(sc * (Qb @ Kt.T))
                A_ = np_softmax_rows(sc * (Qt @ Kt.T))
                B_ = np_softmax_rows(sc * (Qt @ Kb.T))
                c = max(sum(abs(A_[i_, j_]) for i_ in range(m)) for j_ in range(m))
                rr = max(sum(abs(A_[i_, j_]) for j_ in range(m)) for i_ in range(m))
                Zn = A_.T / (c * rr)
                In = np.eye(m)
                for _ in range(pinv_iters):
                    X = A_ @ Zn
                    Zn = 0.25 * (Zn @ (13 * In - X @ (15 * In - X @ (7 * In - X))))
                out_np[b, h] = F_ @ (Zn @ (B_ @ Vb))
    elif kind == "linformer":
        kk = k.repeat_interleave(g, 1)
        vv = v.repeat_interleave(g, 1)
        Kp = torch.einsum("ts,bhse->bhte", P["e"], kk)
        Vp = torch.einsum("ts,bhse->bhte", P["f"], vv)
        wl = torch.softmax(sc * (q @ Kp.transpose(-1, -2)), -1)
        out = wl @ Vp
        t_out, how = torch_sdpa(q, torch.einsum("ts,bhse->bhte", P["e"], k),
                                torch.einsum("ts,bhse->bhte", P["f"], v),
                                torch.ones(B, Hq, L, k_p, dtype=torch.bool), None, sc, "none", None, None)
        ds = max_abs_diff(t_out, out)
        assert ds <= TOL, f"{name}: torch SDPA vs torch ops differ by {ds}"
        sdpa_note = f"F.sdpa ({how}) max|diff|={ds:.1e}"
        out_np = np.zeros((B, Hq, L, Ev))
        for b in range(B):
            for h in range(Hq):
                Kb, Vb = kn[b, h // g], vn[b, h // g]
                Kq = np.array([[sum(Pn["e"][t, s_] * Kb[s_, e_] for s_ in range(S)) for e_ in range(E)]
                               for t in range(k_p)])
                Vq = np.array([[sum(Pn["f"][t, s_] * Vb[s_, e_] for s_ in range(S)) for e_ in range(Ev)]
                               for t in range(k_p)])
                for i in range(L):
                    s = np.array([sc * float(np.dot(qn[b, h, i], Kq[t])) for t in range(k_p)])
                    p = np_softmax_row(s, np.ones(k_p, dtype=np.bool_))
                    out_np[b, h, i] = p @ Vq
    else:
        raise ValueError(kind)

    assert out.dtype == torch.float64 and bool(torch.isfinite(out).all()), name
    assert tuple(out.shape) == (B, Hq, L, Ev), (name, tuple(out.shape))
    d_out = float(np.abs(out.numpy() - out_np).max())
    assert d_out <= TOL, f"{name}: torch vs explicit numpy out differ by {d_out}"
    d_w = None
    if w is not None:
        assert tuple(w.shape) == (B, Hq, L, S)
        d_w = float(np.abs(w.numpy() - w_np).max())
        assert d_w <= TOL, f"{name}: torch vs explicit numpy weights differ by {d_w}"

    d_ = FIXTURES / "variants" / name
    d_.mkdir(parents=True)
    save_npy(d_ / "q.npy", q32)
    save_npy(d_ / "k.npy", k32)
    save_npy(d_ / "v.npy", v32)
    if params:
        save_file({k_: torch.from_numpy(np.ascontiguousarray(a)) for k_, a in params.items()},
                  str(d_ / "params.safetensors"))
    if mask is not None:
        save_npy(d_ / "mask.npy", mask)
    if bias32 is not None:
        save_npy(d_ / "bias.npy", bias32)
    if kv_lens is not None:
        save_npy(d_ / "kv_lens.npy", kv_lens)
    save_npy(d_ / "out.npy", out.numpy())
    if w is not None:
        save_npy(d_ / "weights.npy", w.numpy())
    meta = {"kind": kind, "causal": causal, "scale": scale, "description": description}
    if kind == "nystrom":
        meta["landmarks"] = landmarks
        meta["pinv_iters"] = pinv_iters
    write_json(d_ / "meta.json", meta)

    extras = []
    if mask is not None:
        extras.append(f"mask{list(mask.shape)}")
    if bias32 is not None:
        extras.append(f"bias{list(bias32.shape)}")
    if kv_lens is not None:
        extras.append(f"kv_lens={kv_lens.tolist()}")
    pshapes = " ".join(f"{k_}{list(a.shape)}" for k_, a in params.items())
    wnote = f", weights {d_w:.2e}" if d_w is not None else ""
    print(f"variants/{name}: kind={kind} B={B} Hq={Hq} Hkv={Hkv} L={L} S={S} E={E} "
          f"v{list(v32.shape)} Ev_out={Ev} causal={causal} scale={scale} {pshapes} {' '.join(extras)}"
          + (f" landmarks={landmarks} pinv_iters={pinv_iters}" if kind == "nystrom" else "")
          + f" | torch vs numpy max|diff| out {d_out:.2e}{wnote}"
          + (f" | {sdpa_note}" if sdpa_note else "") + f" | {', '.join(notes)}")
    VARIANT_SUMMARY.append((name, d_out, d_w))


def make_variants():
    # general (Luong): scores = scale * (q @ W) @ k^T, default scale 1
    variant_case("general_basic", 301, "general", B=2, Hq=3, Hkv=3, L=7, S=11, E=5, Ev=6,
                 description="general (Luong) attention q^T W k, W [E,E] shared by heads, no mask, "
                             "default scale 1")

    def m_general(rng):
        # [B,1,L,S]; with bottom-right causal (L=9 > S=6) rows 0..2 are fully masked anyway;
        # key 0 is kept for every other row, and row (b=1, i=6) is made fully masked.
        m = bool_mask(rng, (2, 1, 9, 6), 0.3)
        m[..., 0] = True
        m[1, 0, 6, :] = False
        return m

    variant_case("general_masks_gqa", 302, "general", B=2, Hq=4, Hkv=2, L=9, S=6, E=6, Ev=3,
                 scale=0.5, causal="bottom_right", mask_fn=m_general,
                 bias_fn=lambda rng: randn32(rng, (1, 4, 9, 6), 1.0),
                 description="general attention, GQA Hq=4 Hkv=2, scale 0.5, bottom-right causal "
                             "(L=9 > S=6: rows 0..2 fully masked), bool mask [B,1,L,S] with row "
                             "(b=1, i=6) fully masked, bias [1,Hq,L,S] (std 1)")
    # additive (Bahdanau)
    variant_case("additive_basic", 303, "additive", B=2, Hq=2, Hkv=2, L=6, S=9, E=5, Ev=7, A=7,
                 with_b=True, u_gain=3.0,
                 description="additive (Bahdanau) attention u^T tanh(W_q q + W_k k + b), A=7, "
                             "with b, u uniform(+-3 sqrt(3/A)), no mask, default scale 1")
    variant_case("additive_masks", 304, "additive", B=2, Hq=3, Hkv=1, L=8, S=5, E=4, Ev=3, A=5,
                 u_gain=3.0,
                 causal="top_left", kv_lens=[5, 0],
                 bias_fn=lambda rng: randn32(rng, (8, 5), 1.0),
                 description="additive attention, no b, A=5, MQA Hq=3 Hkv=1, top-left causal, "
                             "kv_lens [5, 0] (batch 1 fully masked: out 0, weights 0), 2-D bias "
                             "[L,S] (std 1) broadcast over batch and heads")
    variant_case("additive_large_logits", 305, "additive", B=1, Hq=2, Hkv=2, L=5, S=13, E=8, Ev=4,
                 A=9, w_gain=10.0, u_target=30.0,
                 description="additive attention, A=9, no b, W_q and W_k uniform(+-10 sqrt(3/E)) so "
                             "W_q q + W_k k reaches beyond +-20 (tanh saturated), u rescaled so "
                             "max |score| = 30 (softmax stability)")
    # lowrank-v: out = (softmax(scale q k^T + masks) U) A
    def m_lowrank(rng):
        m = bool_mask(rng, (2, 2, 7, 10), 0.3)
        m[..., 0] = True
        m[0, 1, 4, :] = False
        return m

    variant_case("lowrank_v", 306, "lowrank-v", B=2, Hq=2, Hkv=2, L=7, S=10, E=6, Ev=9, r=3,
                 mask_fn=m_lowrank,
                 description="low-rank values: v.npy = U [B,Hkv,S,3], params a = A [3,9]; bool mask "
                             "[B,Hq,L,S] with row (b=0, h=1, i=4) fully masked")
    variant_case("lowrank_v_causal_gqa", 307, "lowrank-v", B=1, Hq=4, Hkv=2, L=5, S=8, E=4, Ev=5,
                 r=2, causal="bottom_right", kv_lens=[6],
                 description="low-rank values (r=2, Ev=5), GQA Hq=4 Hkv=2, bottom-right causal "
                             "+ kv_lens [6]")
    # nystrom
    variant_case("nystrom_basic", 308, "nystrom", B=2, Hq=2, Hkv=2, L=37, S=29, E=6, Ev=5,
                 landmarks=8, pinv_iters=6,
                 description="Nystromformer (no conv skip), 8 landmarks (segments of 4-5 rows), "
                             "6 pseudo-inverse iterations, default scale")
    variant_case("nystrom_m1", 309, "nystrom", B=1, Hq=2, Hkv=1, L=10, S=7, E=3, Ev=4,
                 landmarks=1, pinv_iters=6,
                 description="Nystromformer with one landmark (mean of all rows), MQA Hq=2 Hkv=1")
    variant_case("nystrom_m_full", 310, "nystrom", B=1, Hq=1, Hkv=1, L=6, S=6, E=4, Ev=4,
                 landmarks=6, pinv_iters=12,
                 description="Nystromformer with m = L = S = 6 (every landmark one row) and 12 "
                             "iterations: Z ~ inv(A), so out ~ exact softmax attention (checked "
                             "to 1e-6 in the script)")
    variant_case("nystrom_uneven", 311, "nystrom", B=1, Hq=3, Hkv=3, L=50, S=23, E=8, Ev=8,
                 landmarks=7, pinv_iters=6, scale=0.3,
                 description="Nystromformer, 7 landmarks over L=50 (segments 7,7,7,7,7,7,8) and "
                             "S=23 (3,3,3,4,3,3,4), scale 0.3")
    # linformer
    variant_case("linformer_basic", 312, "linformer", B=2, Hq=2, Hkv=2, L=9, S=23, E=6, Ev=5, k_p=5,
                 description="Linformer, k_p=5, E_p and F_p [5,S] random uniform(+-1/sqrt(S))")
    variant_case("linformer_gqa", 313, "linformer", B=1, Hq=4, Hkv=2, L=11, S=16, E=4, Ev=3, k_p=4,
                 proj="segment_mean",
                 description="Linformer, GQA Hq=4 Hkv=2, k_p=4, E_p = F_p = segment means (row t "
                             "averages keys 4t..4t+3)")
    worst_o = max(d for _, d, _ in VARIANT_SUMMARY)
    worst_w = max(d for _, _, d in VARIANT_SUMMARY if d is not None)
    print(f"variants: {len(VARIANT_SUMMARY)} cases, max torch-vs-numpy |diff| out {worst_o:.2e}, "
          f"weights {worst_w:.2e}")


def main():
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    for sub in ("sdpa", "mha", "variants"):
        p = FIXTURES / sub
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
    make_sdpa()
    make_mha()
    make_variants()
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    print(f"total fixture size: {total} bytes ({total / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
