//! The crate's batched matrix product on the GPU, the same kernel the unfused attention path
//! uses for `Q Kᵀ` and `P V` (and that projections build on). Benchmarks compare attention
//! throughput against it.

use ndarray::Array3;

use crate::buffers::{binding, dummy, f32_bytes, fits, Operand};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels::matmul as kernel;
use crate::storage::Storage;
use crate::tensor::{Tensor, TensorData};

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
    let prod = Product::check(ctx, &a, &b, trans_b)?;
    let c_bytes = f32_bytes(prod.batch * prod.m * prod.n);
    fits("c", c_bytes, ctx.max_binding(), "max_storage_buffer_binding_size")?;
    let c = ctx
        .submit("matmul", |encoder| {
            let c = crate::buffers::create(
                ctx,
                "c",
                c_bytes,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            );
            prod.record(ctx, encoder, binding(&c, 0, c_bytes), Storage::F32, alpha)?;
            Ok(c)
        })
        .await?;
    let v = ctx.read_f32(&c, 0, c_bytes).await?;
    Ok(Array3::from_shape_vec((prod.batch, prod.m, prod.n), v).expect("c length"))
}

/// [`matmul`] recorded into the caller's `encoder` (nothing is submitted), C written into the
/// caller's buffer: `c` is a GPU tensor `[batch, M, N]` in any storage format
/// (`Tensor::from_buffer(&buf, storage, &[batch, m, n])`, at an offset if wanted), in a buffer
/// that holds neither A nor B. Host inputs are uploaded with `queue.write_buffer` (ordered before
/// the encoder's commands once it is submitted). Everything is checked before anything is
/// recorded.
pub fn record_matmul<'a>(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: impl Into<Tensor<'a>>,
    b: impl Into<Tensor<'a>>,
    c: Tensor<'a>,
    trans_b: bool,
    alpha: f32,
) -> Result<()> {
    let (a, b) = (a.into(), b.into());
    let prod = Product::check(ctx, &a, &b, trans_b)?;
    let want = [prod.batch, prod.m, prod.n];
    if c.shape() != want {
        return Err(Error::ShapeMismatch {
            tensor: "c",
            expected: want.to_vec(),
            actual: c.shape().to_vec(),
        });
    }
    let c_op = Operand::check(ctx, "c", &c)?;
    let TensorData::Gpu { buffer, .. } = &c.data else {
        return Err(Error::BadBuffer {
            tensor: "c",
            reason: "the product is written into a GPU buffer: give c as Tensor::from_buffer".into(),
        });
    };
    for (name, t) in [("a", &a), ("b", &b)] {
        if matches!(&t.data, TensorData::Gpu { buffer: other, .. } if *other == *buffer) {
            return Err(Error::BadBuffer {
                tensor: "c",
                reason: format!("c's buffer also holds {name}: the product needs a buffer of its own"),
            });
        }
    }
    // A GPU tensor: its own buffer, bound at its offset (nothing is uploaded).
    let c_buf = c_op.upload(ctx, "c");
    prod.record(ctx, encoder, c_buf.binding(), c_op.storage, alpha)
}

/// The operands of one product, checked against each other and the device.
struct Product<'t, 'a> {
    a: Operand<'t, 'a>,
    b: Operand<'t, 'a>,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    /// B has one slice, shared by every slice of A.
    shared_b: bool,
    trans_b: bool,
}

impl<'t, 'a> Product<'t, 'a> {
    fn check(ctx: &Context, a: &'t Tensor<'a>, b: &'t Tensor<'a>, trans_b: bool) -> Result<Self> {
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
        let a_op = Operand::check(ctx, "a", a)?;
        let b_op = Operand::check(ctx, "b", b)?;
        kernel::check_grid(ctx, "matmul", m, n)?;
        let max = ctx.limits().max_compute_workgroups_per_dimension as usize;
        if batch > max {
            return Err(Error::TooLargeForDevice {
                what: format!("matmul grid for a batch of {batch}"),
                bytes: 0,
                limit_name: "max_compute_workgroups_per_dimension",
                limit: max as u64,
                hint: "",
            });
        }
        Ok(Product {
            a: a_op,
            b: b_op,
            batch,
            m,
            n,
            k,
            shared_b: bb == 1,
            trans_b,
        })
    }

    /// Upload host operands and record the product into `c` (format `c_storage`).
    fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        c: wgpu::BufferBinding<'_>,
        c_storage: Storage,
        alpha: f32,
    ) -> Result<()> {
        let (a_buf, b_buf) = (self.a.upload(ctx, "a"), self.b.upload(ctx, "b"));
        // A shared B (batch 1) maps every z to slice 0: heads = group = batch.
        let (heads, group) = if self.shared_b {
            (self.batch, self.batch)
        } else {
            (1, 1)
        };
        let (m, n, k) = (self.m as u32, self.n as u32, self.k as u32);
        kernel::Matmul {
            a: a_buf.binding(),
            b: b_buf.binding(),
            bias: None,
            c,
            params: kernel::Params {
                heads: heads as u32,
                group: group as u32,
                ..kernel::Params::dense(m, n, k, self.trans_b, alpha)
            }
            .split_heads(),
            batch: self.batch as u32,
            trans_b: self.trans_b,
            formats: [self.a.storage, self.b.storage, Storage::F32, c_storage],
            accumulate: false,
            additive: false,
        }
        .record(ctx, encoder, &dummy(ctx))
    }
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
