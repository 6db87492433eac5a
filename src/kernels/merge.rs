//! `shaders/merge.wgsl`: the logsumexp merge of partial attention outputs over disjoint key
//! sets, each normalised with its logsumexp: the decode path's splits, [`crate::merge`] and
//! the ring's blocks.

use super::{common, dispatch, grid_1d, params_of, Binding, KernelSpec, TensorViews};
use crate::device::context::Context;
use crate::error::Result;

pub(crate) const MERGE: KernelSpec = KernelSpec {
    name: "merge",
    source: include_str!("../../shaders/merge.wgsl"),
    common: &[common::SOFTMAX],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

wgsl_struct! {
    /// The merge kernel's params (`p` in `merge.wgsl`).
    pub(crate) struct Params {
        rows: u32,
        splits: u32,
        ev: u32,
        _pad0: u32,
        /// The output's view (`x.o`), when it is one.
        x: TensorViews,
    }
}

/// The merge's declarations of part_out (format `parts`) and out (format `out`, rows of `ev`).
pub(crate) fn prelude(
    parts: crate::storage::Storage,
    out: crate::storage::Storage,
    ev: u32,
    view: Option<crate::view::View>,
) -> super::consts::Prelude {
    use super::access::{array, row_base, Access, Dim};
    // Half outputs with an even Ev (and rows at even elements) are stored in whole words;
    // else by atomics.
    let words = out.is_half() && ev.is_multiple_of(2) && view.is_none_or(|v| v.aligned(2));
    let access = if out.is_half() && !words {
        Access::Atomic
    } else {
        Access::Write
    };
    let store = if words {
        "fn store2(row0: u32, d: u32, x: vec2<f32>) {\n    out_set2(row0 + d, x);\n}\n"
    } else {
        "fn store2(row0: u32, d: u32, x: vec2<f32>) {\n    out_set(row0 + d, x.x);\n    if (d + 1u < p.ev) { out_set(row0 + d + 1u, x.y); }\n}\n"
    };
    super::consts::Prelude::from(format!(
        "{}{}{store}{}",
        array("part_out", 0, parts, false, Access::Read),
        array("out", 2, out, false, access),
        row_base("out", Dim::EV, false, view.map(|_| "o"), "")
    ))
    .tag(format!(
        "parts={parts} out={out}{}{}",
        if words { " out-words" } else { "" },
        super::access::viewed(&[("o", view)])
    ))
}

/// Record the merge. `buffers`: part_out, part_lse, out, lse.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    buffers: [wgpu::BufferBinding<'_>; 4],
    params: &Params,
    formats: (crate::storage::Storage, crate::storage::Storage),
    view: Option<crate::view::View>,
) -> Result<()> {
    let grid = grid_1d(params.rows, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &MERGE,
        &prelude(formats.0, formats.1, params.ev, view),
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
        super::Checks::Kernel,
    )
}
