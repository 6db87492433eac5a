#!/usr/bin/env bash
# How fast the CPU reference is in a library user's unoptimised build: builds a
# throwaway crate that depends on this checkout with `opt-level = 0` for everything, and times
# reference::sdpa and reference::sdpa_backward at B1 H8 L128 S256 E64 (the size a new user's
# first check has). Prints the two times; nothing is asserted (speed is measured, not tested).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${REFSPEED_DIR:-$root/target/refspeed}
mkdir -p "$dir/src"
cat >"$dir/Cargo.toml" <<TOML
[package]
name = "refspeed"
version = "0.1.0"
edition = "2021"
publish = false
[workspace]
[dependencies]
wgpu-attention = { path = "$root", default-features = false }
ndarray = "0.16"
[profile.dev]
opt-level = 0
[profile.dev.package."*"]
opt-level = 0
TOML
cat >"$dir/src/main.rs" <<'RS'
use std::time::Instant;
fn main() {
    let (b, h, l, s, e) = (1, 8, 128, 256, 64);
    let f = |n: usize, seed: u64| -> Vec<f32> {
        (0..n).map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 1000.0 - 0.5).collect()
    };
    let a4 = |d: (usize, usize, usize, usize), seed| ndarray::Array4::from_shape_vec(d, f(d.0 * d.1 * d.2 * d.3, seed)).unwrap();
    let (q, k, v, dout) = (a4((b, h, l, e), 1), a4((b, h, s, e), 2), a4((b, h, s, e), 3), a4((b, h, l, e), 4));
    let opts = wgpu_attention::Options::default();
    let t = Instant::now();
    wgpu_attention::reference::sdpa(q.view(), k.view(), v.view(), &opts).unwrap();
    println!("reference::sdpa, opt-level 0: {:.2} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    wgpu_attention::reference::sdpa_backward(q.view(), k.view(), v.view(), dout.view(), &opts).unwrap();
    println!("reference::sdpa_backward, opt-level 0: {:.2} s", t.elapsed().as_secs_f64());
}
RS
cp "$root/Cargo.lock" "$dir/Cargo.lock"
cargo run --quiet --manifest-path "$dir/Cargo.toml" --target-dir "$dir/target"
