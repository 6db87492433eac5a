//! `shaders/mod_map.wgsl`: the block map of a user `mask_mod` (FlexAttention's block mask),
//! 2 bits per block of 16 queries x 16 keys of each (batch, query head): whether the function
//! allows some pair, and every pair. Built on the GPU by its own submission the first time a
//! fused forward needs it, then cached in the [`Context`] by the source, the captures' values
//! and the shape: later calls read it instead of evaluating the function on every block (the
//! fused kernels skip the empty blocks' key tiles and the full blocks' per-logit evaluation).

use std::hash::{Hash, Hasher};

use super::{common, dispatch, grid_1d, mask_consts, params_of, Binding, KernelSpec, Masks, Mods};
use crate::device::buffers::create;
use crate::device::context::Context;
use crate::error::Result;
use crate::problem::Problem;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "mod_map",
    source: include_str!("../../shaders/mod_map.wgsl"),
    common: &[common::SOFTMAX, common::MASKS],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

/// Queries and keys per block of the map (`MAP_BLOCK` in `shaders/common/modifiers/mask_mod.wgsl`).
pub(crate) const MAP_BLOCK: usize = 16;

wgsl_struct! {
    /// The map kernel's params (`p` in `mod_map.wgsl`).
    pub(crate) struct Params {
        m: Masks,
        l: u32,
        s: u32,
        heads: u32,
        /// Blocks, all of them, and the words that hold them (16 per word).
        entries: u32,
        words: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

/// The map's blocks for `p`: `B·Hq·⌈L/16⌉·⌈S/16⌉`.
pub(crate) fn entries(p: &Problem) -> usize {
    p.batch_heads() * p.seq_q.div_ceil(MAP_BLOCK) * p.seq_kv.div_ceil(MAP_BLOCK)
}

/// The map's size in bytes (a whole number of 16-byte units, for the copies).
pub(crate) fn bytes(p: &Problem) -> u64 {
    (entries(p).div_ceil(16) as u64 * 4).next_multiple_of(16)
}

/// The cache key: the source (with the capture names), the captures' values, the shape and
/// the positions' offset (a ring pair's).
fn key_of(p: &Problem) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Some(u) = &p.user_fns {
        u.code.hash(&mut h);
        for (_, d) in &u.captures {
            d.iter().for_each(|x| x.to_bits().hash(&mut h));
        }
    }
    (p.batch, p.q_heads, p.seq_q, p.seq_kv, p.pos_offset).hash(&mut h);
    h.finish()
}

/// The block map of `p`'s mask_mod (the problem must have one): the cached one, or one built
/// now by its own submission (ordered before the caller's), reading the captures from the
/// problem's auxiliary words.
pub(crate) fn get(ctx: &Context, p: &Problem) -> Result<wgpu::Buffer> {
    let key = key_of(p);
    if let Some(b) = ctx.mod_map(key) {
        return Ok(b);
    }
    let aux = crate::kernels::aux::words(p).map(|w| {
        crate::device::buffers::storage_init(ctx, "mask_mod block map captures", bytemuck::cast_slice(&w))
    });
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let map = create(ctx, "mask_mod block map", bytes(p), usage);
    let words = entries(p).div_ceil(16);
    let params = Params {
        m: Masks::new(p, None),
        l: p.seq_q as u32,
        s: p.seq_kv as u32,
        heads: p.q_heads as u32,
        entries: entries(p) as u32,
        words: words as u32,
        ..Default::default()
    };
    let mods = Mods {
        mask_mod: true,
        user: p.user_fns.as_ref().map(|u| u.code.clone()),
        ..Default::default()
    };
    let dummy = crate::device::buffers::dummy(ctx);
    let mut encoder = ctx
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("wgpu-attention mask_mod block map"),
        });
    dispatch(
        ctx,
        &mut encoder,
        &SPEC,
        &mask_consts(false, false, mods.clone(), crate::storage::Storage::F32),
        &[],
        &[
            dummy.as_entire_buffer_binding(),
            dummy.as_entire_buffer_binding(),
            aux.as_ref().unwrap_or(&dummy).as_entire_buffer_binding(),
            map.as_entire_buffer_binding(),
        ],
        bytemuck::bytes_of(&params),
        grid_1d(
            words.div_ceil(64) as u32,
            ctx.limits().max_compute_workgroups_per_dimension,
        ),
        mods.checks(),
    )?;
    ctx.queue().submit([encoder.finish()]);
    ctx.keep_mod_map(key, map.clone());
    Ok(map)
}
