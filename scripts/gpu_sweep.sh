#!/usr/bin/env bash
# Sweep the GPU forms' tuning knobs (WGPU_ATTENTION_TUNE, src/tune.rs) on a real GPU with
# `bench --gpu-time`, one line per knob setting and row: what the plan's GPU defaults are chosen
# from. Usage: scripts/gpu_sweep.sh [fused|tiles|decode|bwd ...] (default all); BIN=<folder holding
# wgpu-attention> (default target/release).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release}
parts=${*:-fused tiles decode bwd}
export WGPU_BACKEND=${WGPU_BACKEND:-vulkan}
row() { # knobs, bench args...
  local knobs=$1
  shift
  WGPU_ATTENTION_TUNE=$knobs "$bin/wgpu-attention" bench --gpu-time --iters 5 --warmup 2 --no-matmul "$@" 2>/dev/null |
    awk -v k="$knobs" '$3 ~ /^(f32|f16|bf16)$/ { print k, $0 }'
}
for part in $parts; do
  case $part in
  fused)
    for mem in 16384 32768 45056; do for wg in 64 128; do for rq in 1 2 4; do for kg in 4 8; do
      row "wg_memory=$mem,fused_wg=$wg,fused_rq=$rq,fused_kg=$kg" --shapes c_h8_s4096_causal,a_h8_s1024 --paths fused --storage f32,f16
    done; done; done; done ;;
  tiles) # the register-tiled form against the one-row GPU form, then its tile sizes
    for form in gpu gpu-tiles; do
      WGPU_ATTENTION_FORMS=fused=$form row "form=$form" --shapes all --paths fused --storage f32,f16
    done
    for k in default tiles_sg=0 tiles_prefetch=1 scalar_logits=0 tiles_tm=8 tiles_tn=8; do
      WGPU_ATTENTION_FORMS=fused=gpu-tiles row "$k" --shapes c_h8_s4096_causal,a_h8_s1024 --paths fused --storage f32,f16
    done
    for t in 64,32 32,32 64,16; do
      WGPU_ATTENTION_FORMS=fused=gpu-tiles row "tiles_bm=${t%,*},tiles_bn=${t#*,},wg_memory=49152" \
        --shapes c_h8_s4096_causal,a_h8_s1024,gpt2_h12_t1024_causal --paths fused --storage f32,f16
    done ;;
  decode) # the one-key-per-invocation form against the tiled one, each over its sizes
    for form in gpu gpu-tiles; do for wg in 64 128 256; do for t in 512 1024 2048 4096; do
      WGPU_ATTENTION_FORMS=decode=$form row "form=$form,decode_wg=$wg,decode_target=$t" \
        --shapes d_decode_h32_s4096_e128 --paths decode --storage f32,f16
    done; done; done
    # the tiled form's invocations per key in the scores, at its sizes
    for kl in 1 2 4 8 16; do
      WGPU_ATTENTION_FORMS=decode=gpu-tiles row "decode_klanes=$kl" \
        --shapes d_decode_h32_s4096_e128 --paths decode --storage f32,f16
    done ;;
  bwd)
    for mem in 16384 32768; do for wg in 64 128; do for rows in 1 2; do for un in 0 1; do
      row "wg_memory=$mem,bwd_wg=$wg,bwd_rows=$rows,bwd_unroll=$un" --shapes a_h8_s1024,c_h8_s4096_causal --paths fused-bwd --storage f32
    done; done; done; done ;;
  esac
done
