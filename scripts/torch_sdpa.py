#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the benchmark shapes of `wgpu-attention bench`,
timed on the GPU with CUDA events (or MPS), for side-by-side comparison in scripts/gpu_report.sh.

    python3 scripts/torch_sdpa.py [--iters N] [--dtypes f32,f16,bf16] [--shapes a,b,...]

Prints one line per shape x dtype x pass:
    torch <shape> <dtype> <fwd|bwd> <backend> median_ms=<ms> gflops=<GFLOP/s>
GFLOP/s use the crate's count: 2 B Hq L S (E + Ev), halved under a causal mask; the backward
(`bwd`: the backward alone, dq dk dv from a saved graph) counts 2.5x the forward's, as `bench`.
The backend is the one SDPA can run (flash for f16/bf16, efficient or math for f32), chosen by
trying them in that order with torch.nn.attention.sdpa_kernel.
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

# name: (B, Hq, Hkv, L, S, E, Ev, causal, kv_lens) -- src/shapes/mod.rs
SHAPES = {
    "small_h4_s128": (1, 4, 4, 128, 128, 64, 64, False, None),
    "a_h8_s1024": (1, 8, 8, 1024, 1024, 64, 64, False, None),
    "b_h8_s1024_causal": (1, 8, 8, 1024, 1024, 64, 64, True, None),
    "c_h8_s4096_causal": (1, 8, 8, 4096, 4096, 64, 64, True, None),
    "d_decode_h32_s4096_e128": (1, 32, 32, 1, 4096, 128, 128, False, None),
    "e_b4_h12_s256_padmask": (4, 12, 12, 256, 256, 64, 64, False, [256, 219, 182, 145]),
    "long_h1_s16384_causal": (1, 1, 1, 16384, 16384, 64, 64, True, None),
    "long_h1_s32768_causal": (1, 1, 1, 32768, 32768, 64, 64, True, None),
    "gpt2_h12_t1024_causal": (1, 12, 12, 1024, 1024, 64, 64, True, None),
}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def flops(b, hq, l, s, e, ev, causal):
    f = 2.0 * b * hq * l * s * (e + ev)
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-bwd", action="store_true")
    a = ap.parse_args()
    if torch.cuda.is_available():
        dev = "cuda"
        print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        dev = "mps"
        print(f"torch {torch.__version__} on mps")
    else:
        print("torch: no CUDA or MPS device; no peer figures", file=sys.stderr)
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ]

    def timed(fn, iters):
        for _ in range(3):
            fn()
        if dev == "cuda":
            times = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            return statistics.median(times)
        import time

        times = []
        for _ in range(iters):
            torch.mps.synchronize()
            t = time.perf_counter()
            fn()
            torch.mps.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    for name in a.shapes.split(","):
        b, hq, hkv, l, s, e, ev, causal, kv_lens = SHAPES[name]
        for dn in a.dtypes.split(","):
            dt = DTYPES[dn]
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(b, hq, l, e, device=dev, dtype=dt, generator=g)
            k = torch.randn(b, hkv, s, e, device=dev, dtype=dt, generator=g)
            v = torch.randn(b, hkv, s, ev, device=dev, dtype=dt, generator=g)
            mask = None
            if kv_lens is not None:
                mask = torch.arange(s, device=dev)[None, None, None, :] < torch.tensor(
                    kv_lens, device=dev
                )[:, None, None, None]
            kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=hq != hkv)
            fl = flops(b, hq, l, s, e, ev, causal)
            for bname, be in backends:
                try:
                    with sdpa_kernel([be]):
                        ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, **kw), a.iters)
                except RuntimeError:
                    continue
                print(f"torch {name} {dn} fwd {bname} median_ms={ms:.4f} gflops={fl / ms / 1e6:.1f}", flush=True)
                if not a.no_bwd and l > 1:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    try:
                        with sdpa_kernel([be]):
                            out = F.scaled_dot_product_attention(qg, kg, vg, **kw)
                            do = torch.randn_like(out)
                            ms = timed(
                                lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True),
                                a.iters,
                            )
                        print(
                            f"torch {name} {dn} bwd {bname} median_ms={ms:.4f} gflops={2.5 * fl / ms / 1e6:.1f}",
                            flush=True,
                        )
                    except RuntimeError:
                        pass
                break
            del q, k, v
    return 0


if __name__ == "__main__":
    sys.exit(main())
