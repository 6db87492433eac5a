//! The logsumexp merge of partial attention results, on the GPU.

use ndarray::{Array3, Array4};

use crate::device::buffers::{f32_bytes, fits, output, storage_init};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::ops::merge;
use crate::storage::Storage;
use crate::tensor::Tensor;

/// Combine two partial attention results computed over disjoint key sets (the rule behind
/// split-K decoding, sequence-parallel and ring attention):
/// `lse = logaddexp(lse1, lse2)`, `o = (e^{lse1} o1 + e^{lse2} o2) / e^{lse}`.
/// o `[B, H, L, Ev]` (host data in f32, f16 or bf16, both parts in one format: the merged
/// output is stored in it, and returned widened to f32), lse `[B, H, L]`; a part with
/// `lse = -inf` (no allowed key) contributes nothing, and two empty parts give 0 and `-inf`.
/// Runs on the GPU.
pub async fn merge<'a>(
    ctx: &Context,
    o1: impl Into<Tensor<'a>>,
    lse1: &Array3<f32>,
    o2: impl Into<Tensor<'a>>,
    lse2: &Array3<f32>,
) -> Result<(Array4<f32>, Array3<f32>)> {
    let (o1, o2) = (o1.into(), o2.into());
    let [b, h, l, ev] = o1.dims::<4>("o1")?;
    let shape = o1.shape().to_vec();
    if o2.shape() != shape.as_slice() {
        return Err(Error::ShapeMismatch {
            tensor: "o2",
            expected: shape.clone(),
            actual: o2.shape().to_vec(),
        });
    }
    let storage = o1.storage();
    if o2.storage() != storage {
        return Err(Error::StorageMismatch {
            tensor: "o2",
            expected: storage,
            actual: o2.storage(),
            why: "the merged output is stored in the parts' format",
        });
    }
    let (d1, d2) = (host_data("o1", &o1)?, host_data("o2", &o2)?);
    for (name, d) in [("o1", &d1), ("o2", &d2)] {
        crate::tensor::check_len(name, &shape, d.len())?;
    }
    for (name, s) in [("lse1", lse1.shape()), ("lse2", lse2.shape())] {
        if s != [b, h, l] {
            return Err(Error::ShapeMismatch {
                tensor: name,
                expected: vec![b, h, l],
                actual: s.to_vec(),
            });
        }
    }
    let rows = b * h * l;
    let out_bytes = storage.bytes(rows * ev);
    // The parts go up as f32 (exact); the merged output is stored in their format.
    fits(
        "merge inputs",
        2 * f32_bytes(rows * ev),
        ctx.max_binding(),
        "max_storage_buffer_binding_size",
    )?;
    let parts: Vec<f32> = d1.iter().chain(d2.iter()).copied().collect();
    let lses: Vec<f32> = lse1.iter().chain(lse2.iter()).copied().collect();
    let (out, lse) = ctx
        .submit("merge", |encoder| {
            let po = storage_init(ctx, "merge parts", bytemuck::cast_slice(&parts));
            let pl = storage_init(ctx, "merge lse parts", bytemuck::cast_slice(&lses));
            let out = output(ctx, "merged output", out_bytes);
            let lse = output(ctx, "merged lse", f32_bytes(rows));
            merge::record(
                ctx,
                encoder,
                &merge::Parts {
                    outputs: po.as_entire_buffer_binding(),
                    storage: Storage::F32,
                    lses: pl.as_entire_buffer_binding(),
                    splits: 2,
                },
                &merge::Merged {
                    output: out.as_entire_buffer_binding(),
                    storage,
                    view: None,
                    lse: lse.as_entire_buffer_binding(),
                },
                [rows, ev],
            )?;
            Ok((out, lse))
        })
        .await?;
    let o = ctx.read_as_f32(&out, 0, rows * ev, storage).await?;
    let s = ctx.read_f32(&lse, 0, f32_bytes(rows)).await?;
    Ok((
        Array4::from_shape_vec((b, h, l, ev), o).expect("merged output length"),
        Array3::from_shape_vec((b, h, l), s).expect("merged lse length"),
    ))
}

/// A part's host data widened to f32, or the typed error for a GPU buffer.
fn host_data<'t>(name: &'static str, t: &'t Tensor<'_>) -> Result<std::borrow::Cow<'t, [f32]>> {
    t.host_f32().ok_or_else(|| Error::BadBuffer {
        tensor: name,
        reason: "merge takes host data".into(),
    })
}

/// Blocking version of [`merge`].
#[cfg(not(target_arch = "wasm32"))]
pub fn merge_blocking<'a>(
    ctx: &Context,
    o1: impl Into<Tensor<'a>>,
    lse1: &Array3<f32>,
    o2: impl Into<Tensor<'a>>,
    lse2: &Array3<f32>,
) -> Result<(Array4<f32>, Array3<f32>)> {
    pollster::block_on(merge(ctx, o1, lse1, o2, lse2))
}
