//! The crate's batched matrix product on the GPU, the same kernel the unfused attention path
//! uses for `Q Kᵀ` and `P V` (and that projections build on). Benchmarks compare attention
//! throughput against it.

use ndarray::Array3;

use crate::buffers::{binding, dummy, f32_bytes, fits, Operand};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels::matmul as kernel;
use crate::storage::Storage;
use crate::tensor::Tensor;

/// `C[i] = alpha · A[i] · op(B[i])`, f32, row-major: A `[batch, M, K]`; B `[batch | 1, N, K]` when
/// `trans_b` (so `C = A Bᵀ`) or `[batch | 1, K, N]` otherwise; a batch of 1 in B is shared.
/// Returns C `[batch, M, N]`.
pub async fn matmul<'a>(
    ctx: &Context,
    a: impl Into<Tensor<'a>>,
    b: impl Into<Tensor<'a>>,
    trans_b: bool,
    alpha: f32,
) -> Result<Array3<f32>> {
    let (a, b) = (a.into(), b.into());
    let [batch, m, k] = a.dims::<3>("a")?;
    let [bb, b1, b2] = b.dims::<3>("b")?;
    let (n, bk) = if trans_b { (b1, b2) } else { (b2, b1) };
    if bk != k || (bb != batch && bb != 1) {
        let expected = if trans_b {
            vec![batch, n, k]
        } else {
            vec![batch, k, n]
        };
        return Err(Error::ShapeMismatch {
            tensor: "b",
            expected,
            actual: b.shape().to_vec(),
        });
    }
    let c_bytes = f32_bytes(batch * m * n);
    fits("c", c_bytes, ctx.max_binding(), "max_storage_buffer_binding_size")?;
    let a_op = Operand::check(ctx, "a", &a)?;
    let b_op = Operand::check(ctx, "b", &b)?;
    let max = ctx.limits().max_compute_workgroups_per_dimension as usize;
    let tile = kernel::TILE as usize;
    if batch > max || m.div_ceil(tile) > max || n.div_ceil(tile) > max {
        return Err(Error::TooLargeForDevice {
            what: format!("matmul grid for [{batch}, {m}, {n}]"),
            bytes: c_bytes,
            limit_name: "max_compute_workgroups_per_dimension",
            limit: max as u64,
            hint: "",
        });
    }
    let c = ctx
        .submit("matmul", |encoder| {
            let (a_buf, b_buf) = (a_op.upload(ctx, "a"), b_op.upload(ctx, "b"));
            let c = crate::buffers::create(
                ctx,
                "c",
                c_bytes,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            );
            // A shared B (batch 1) maps every z to slice 0: heads = group = batch.
            let (heads, group) = if bb == 1 { (batch, batch) } else { (1, 1) };
            kernel::Matmul {
                a: a_buf.binding(),
                b: b_buf.binding(),
                bias: None,
                c: binding(&c, 0, c_bytes),
                params: kernel::Params {
                    heads: heads as u32,
                    group: group as u32,
                    ..kernel::Params::dense(m as u32, n as u32, k as u32, trans_b, alpha)
                }
                .split_heads(),
                batch: batch as u32,
                trans_b,
                formats: [a_op.storage, b_op.storage, Storage::F32, Storage::F32],
                accumulate: false,
                additive: false,
            }
            .record(ctx, encoder, &dummy(ctx))?;
            Ok(c)
        })
        .await?;
    let v = ctx.read_f32(&c, 0, c_bytes).await?;
    Ok(Array3::from_shape_vec((batch, m, n), v).expect("c length"))
}

/// Blocking version of [`matmul`].
#[cfg(not(target_arch = "wasm32"))]
pub fn matmul_blocking<'a>(
    ctx: &Context,
    a: impl Into<Tensor<'a>>,
    b: impl Into<Tensor<'a>>,
    trans_b: bool,
    alpha: f32,
) -> Result<Array3<f32>> {
    pollster::block_on(matmul(ctx, a, b, trans_b, alpha))
}
