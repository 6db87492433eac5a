//! Pictures of results: attention weights as labelled heatmaps (`heatmap.rs`, public as
//! `wgpu_attention::heatmap`), line charts (`plot.rs`, public as `wgpu_attention::plot`), and
//! what both draw with (`picture.rs`: text, ticks, areas). Nothing here touches the GPU.

#[cfg(feature = "heatmap")]
pub mod heatmap;
#[cfg(all(any(feature = "heatmap", feature = "plot"), not(target_arch = "wasm32")))]
mod picture;
#[cfg(all(feature = "plot", not(target_arch = "wasm32")))]
pub mod plot;
