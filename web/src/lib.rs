//! wgpu-attention in the browser (wasm32 only).
#![cfg(target_arch = "wasm32")]
