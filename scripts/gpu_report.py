#!/usr/bin/env python3
"""Format scripts/gpu_report.sh's logs as docs/gpu/<adapter>.md.

    python3 scripts/gpu_report.py REPORT_DIR ADAPTER_NAME [DOC_DIR]

Writes DOC_DIR/<adapter>.md (DOC_DIR default docs/gpu).
"""
import os
import re
import sys


def main():
    d, adapter = sys.argv[1], sys.argv[2] or "unknown"
    read = lambda n: open(os.path.join(d, n)).read() if os.path.exists(os.path.join(d, n)) else ""
    info, tests, bench, torch = read("info.txt"), read("tests.txt"), read("bench.txt"), read("torch.txt")
    peer = {}
    for line in torch.splitlines():
        m = re.match(r"torch (\S+) (\S+) (fwd|bwd) (\S+) median_ms=(\S+) gflops=(\S+)", line)
        if m:
            peer[(m[1], m[2], m[3])] = (m[4], float(m[5]), float(m[6]))
    rows, other = [], []
    for line in bench.splitlines():
        f = line.split()
        if len(f) >= 8 and f[2] in ("f32", "f16", "bf16") and re.match(r"[\d.]+$", f[3] or ""):
            rows.append(f)
        elif f and not line.startswith(("shape ", "adapter")):
            other.append(line)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", adapter).strip("-").lower()
    doc_dir = sys.argv[3] if len(sys.argv) > 3 else "docs/gpu"
    os.makedirs(doc_dir, exist_ok=True)
    path = os.path.join(doc_dir, f"{slug}.md")
    o = [f"# {adapter}", "", "Written by `scripts/gpu_report.sh` (rerun it to reproduce every figure here).", ""]
    o += ["## Adapter", "", "```", info.strip(), "```", ""]
    if tests.strip():
        o += ["## Tests (`WGPU_ATTENTION_REQUIRE_GPU=1`)", "", "```", tests.strip(), "```", ""]
    o += [
        "## Attention",
        "",
        "`bench --gpu-time`: wall ms = record + submit + wait; GPU ms = between timestamps written",
        "before and after the dispatches (median of the timed runs); GFLOP/s from the GPU time",
        "(backward rows: 2.5x the forward's FLOPs). PyTorch: `scaled_dot_product_attention` on the",
        "same shape and dtype, CUDA-event median, backend named; share = PyTorch ms / our GPU ms.",
        "",
        "| shape | fmt | path | wall ms | GPU ms | GFLOP/s | PyTorch ms (backend) | share |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in rows:
        shape, p, fmt = f[0], f[1], f[2]
        if len(f) >= 10 and f[8] != "-":
            gpu_ms, gf = f[8], f[9]
        else:
            gpu_ms, gf = "-", f[6]
        pk = (shape, fmt, "bwd" if p.endswith("-bwd") else "fwd")
        if pk in peer and gpu_ms != "-":
            be, pms, _ = peer[pk]
            ps, share = f"{pms:.3f} ({be})", f"{100 * pms / float(gpu_ms):.0f}%"
        else:
            ps, share = "-", "-"
        o.append(f"| {shape} | {fmt} | {p} | {f[4]} | {gpu_ms} | {gf} | {ps} | {share} |")
    o += ["", "## Other rows (layers, matmul, errors)", "", "```", "\n".join(other).strip(), "```", ""]
    if torch.strip():
        o += ["## PyTorch (raw)", "", "```", torch.strip(), "```", ""]
    open(path, "w").write("\n".join(o))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
