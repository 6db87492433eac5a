//! The logsumexp merge: attention over disjoint key sets, each part normalised with its own
//! logsumexp, combined into the attention over their union (`shaders/merge.wgsl`, through
//! [`crate::kernels::merge`]): the decode path's splits, [`crate::merge`] and the ring's
//! blocks.

use crate::device::context::Context;
use crate::error::Result;
use crate::kernels::merge as kernel;
use crate::kernels::TensorViews;
use crate::storage::Storage;
use crate::view::View;

/// The parts: `splits` partial outputs `[splits, rows, ev]` and their logsumexps
/// `[splits, rows]`, f32 (or the format `storage` for the outputs).
#[derive(Clone, Debug)]
pub(crate) struct Parts<'a> {
    pub(crate) outputs: wgpu::BufferBinding<'a>,
    pub(crate) storage: Storage,
    pub(crate) lses: wgpu::BufferBinding<'a>,
    pub(crate) splits: usize,
}

/// Where the merged output goes: `rows × ev` row-major in `storage`, or through the view of
/// a `[B, H, L, Ev]` tensor (`[heads, per_head]`: its H and L, which split the row index).
#[derive(Clone, Debug)]
pub(crate) struct Merged<'a> {
    pub(crate) output: wgpu::BufferBinding<'a>,
    pub(crate) storage: Storage,
    pub(crate) view: Option<(View, [usize; 2])>,
    /// The merged logsumexp `[rows]`, f32.
    pub(crate) lse: wgpu::BufferBinding<'a>,
}

/// Record the merge of `parts` into `merged`: `rows` rows of `ev` values each.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    parts: &Parts<'_>,
    merged: &Merged<'_>,
    [rows, ev]: [usize; 2],
) -> Result<()> {
    let u = |x: usize| super::u32_param("merge", x);
    let x = match merged.view {
        Some((v, [heads, per_head])) => TensorViews::output(v, heads, per_head),
        None => TensorViews::default(),
    };
    kernel::record(
        ctx,
        encoder,
        [
            parts.outputs.clone(),
            parts.lses.clone(),
            merged.output.clone(),
            merged.lse.clone(),
        ],
        &kernel::Params {
            rows: u(rows)?,
            splits: u(parts.splits)?,
            ev: u(ev)?,
            x,
            ..Default::default()
        },
        (parts.storage, merged.storage),
        merged.view.map(|(v, _)| v),
    )
}
