//! The batched product `C[g] = alpha · A[g] op(B[g])` (`op`: the identity or the transpose)
//! over slices `g` of heads, with the keys' grouped-query mapping, and a bias or accumulating
//! epilogue: the one way above the kernels to run
//! `shaders/matmul.wgsl` ([`crate::kernels::matmul`], which picks the form for the device).
//! Below it, the crate's public matmul ([`matmul`], [`record_matmul`]): the same kernel the
//! unfused attention path uses for `Q Kᵀ` and `P V`; benchmarks compare attention throughput
//! against it.

use ndarray::Array3;

use super::{param, u32_param, Mats};
use crate::device::buffers::{binding, f32_bytes, fits, Operand};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::matmul as kernel;
use crate::storage::Storage;
use crate::tensor::{Tensor, TensorData};

/// One batched product, built from its operands and recorded with [`Matmul::record`]: `A`
/// `[M, K]`, `B` `[K, N]` (or `[N, K]` with [`Matmul::trans_b`]) and `C` `[M, N]` per slice;
/// M, N and K are read off the operands, which must agree.
#[derive(Clone, Debug)]
#[must_use = "a product does nothing until it is recorded"]
pub(crate) struct Matmul<'a> {
    a: Mats<'a>,
    b: Mats<'a>,
    c: Mats<'a>,
    trans_b: bool,
    alpha: f32,
    count: usize,
    heads: usize,
    group: usize,
    bias: Option<(wgpu::BufferBinding<'a>, Storage)>,
    accumulate: bool,
}

impl<'a> Matmul<'a> {
    /// `C = A B` for one slice, alpha 1.
    pub(crate) fn new(a: Mats<'a>, b: Mats<'a>, c: Mats<'a>) -> Self {
        Matmul {
            a,
            b,
            c,
            trans_b: false,
            alpha: 1.0,
            count: 1,
            heads: 1,
            group: 1,
            bias: None,
            accumulate: false,
        }
    }

    /// Whether B holds `[N, K]` matrices: `C = A Bᵀ`.
    pub(crate) fn trans_b(self, trans_b: bool) -> Self {
        Matmul { trans_b, ..self }
    }

    /// `C = alpha · A op(B)`.
    pub(crate) fn alpha(self, alpha: f32) -> Self {
        Matmul { alpha, ..self }
    }

    /// `count` slices (one workgroup layer each), the first of each operand at its
    /// [`Mats::starting_at`].
    pub(crate) fn slices(self, count: usize) -> Self {
        Matmul { count, ..self }
    }

    /// Slices are heads of batches of `heads` (views split them so), B shared by groups of
    /// `group` consecutive heads (grouped-query attention: head `h` reads B's head
    /// `h / group`). Dense operands do not depend on it.
    pub(crate) fn heads(self, heads: usize, group: usize) -> Self {
        Matmul { heads, group, ..self }
    }

    /// Add `bias[n]` (N elements in `storage`) to every row of C.
    pub(crate) fn bias(self, bias: wgpu::BufferBinding<'a>, storage: Storage) -> Self {
        Matmul {
            bias: Some((bias, storage)),
            ..self
        }
    }

    /// Whether to add the product to C as it is (f32 C).
    pub(crate) fn accumulate(self, accumulate: bool) -> Self {
        Matmul { accumulate, ..self }
    }

    /// `[M, N, K]`, after checking that the operands agree.
    fn mnk(&self) -> Result<[usize; 3]> {
        let (a, b, c) = (&self.a.at, &self.b.at, &self.c.at);
        let [m, k] = [a.rows, a.cols];
        let (n, bk) = if self.trans_b {
            (b.rows, b.cols)
        } else {
            (b.cols, b.rows)
        };
        if bk != k || [c.rows, c.cols] != [m, n] {
            return Err(Error::Internal(format!(
                "matmul: A {m} x {k}, B {} x {}{}, C {} x {}",
                b.rows,
                b.cols,
                if self.trans_b { " (transposed)" } else { "" },
                c.rows,
                c.cols
            )));
        }
        if self.heads == 0 || self.group == 0 || !self.heads.is_multiple_of(self.group) {
            return Err(Error::Internal(format!(
                "matmul: {} heads in groups of {}",
                self.heads, self.group
            )));
        }
        if self.accumulate && self.c.storage != Storage::F32 {
            return Err(Error::Internal(format!(
                "matmul: accumulating into {} C (f32 only)",
                self.c.storage
            )));
        }
        Ok([m, n, k])
    }

    /// The kernel's params, after checking shapes, bounds and the device's grid.
    fn params(&self, ctx: &Context) -> Result<kernel::Params> {
        let [m, n, k] = self.mnk()?;
        let (heads, group, count) = (self.heads, self.group, self.count);
        self.a.check_bounds("matmul A", count, heads, 1)?;
        self.b.check_bounds("matmul B", count, heads, group)?;
        self.c.check_bounds("matmul C", count, heads, 1)?;
        check_grid(ctx, "matmul", m, n, count)?;
        let (a, b, c) = (&self.a.at, &self.b.at, &self.c.at);
        let [a_batch, a_head] = a.strides(heads);
        let [b_batch, b_head] = b.strides(heads / group);
        let [c_batch, c_head] = c.strides(heads);
        let u = |x: usize| u32_param("matmul", x);
        Ok(kernel::Params {
            m: u(m)?,
            n: u(n)?,
            k: u(k)?,
            heads: u(heads)?,
            group: u(group)?,
            a_z0: u(a.first)?,
            b_z0: u(b.first)?,
            c_z0: u(c.first)?,
            // Checked above: every element reached is below 2^32 (see `param`).
            a_batch: param(a_batch),
            a_head: param(a_head),
            a_row: param(a.row_stride),
            a_off: param(a.offset),
            b_batch: param(b_batch),
            b_head: param(b_head),
            b_row: param(b.row_stride),
            b_off: param(b.offset),
            c_batch: param(c_batch),
            c_head: param(c_head),
            c_row: param(c.row_stride),
            c_off: param(c.offset),
            alpha: self.alpha,
            ..Default::default()
        })
    }

    /// Record the product into `encoder`, in the form the device runs.
    pub(crate) fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        let params = self.params(ctx)?;
        let (bias, bias_storage) = match &self.bias {
            Some((b, f)) => (Some(b.clone()), *f),
            None => (None, Storage::F32),
        };
        kernel::Matmul {
            a: self.a.binding.clone(),
            b: self.b.binding.clone(),
            bias,
            c: self.c.binding.clone(),
            params,
            batch: self.count as u32,
            trans_b: self.trans_b,
            formats: [self.a.storage, self.b.storage, bias_storage, self.c.storage],
            accumulate: self.accumulate,
        }
        .record(ctx, encoder, ctx.dummy())
    }
}

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
            let c = crate::device::buffers::create(
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
/// (`Tensor::from_buffer(&buf, storage, &[batch, m, n])`, at an offset if wanted), bytes that
/// overlap neither A nor B (another range of their buffer is fine: it needs `COPY_SRC` and
/// `COPY_DST` usage, see `docs/storage.md`). Host inputs are uploaded with `queue.write_buffer` (ordered before
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
    let _ = buffer;
    crate::device::buffers::check_aliasing(&[("c", &c)], &[("a", &a), ("b", &b)])?;
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
        check_grid(ctx, "matmul", m, n, batch)?;
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
        let (m, n, k) = (self.m, self.n, self.k);
        let [b_rows, b_cols] = if self.trans_b { [n, k] } else { [k, n] };
        let b = if self.shared_b {
            Mats::shared(b_buf.binding(), self.b.storage, b_rows, b_cols)
        } else {
            Mats::dense(b_buf.binding(), self.b.storage, b_rows, b_cols)
        };
        Matmul::new(
            Mats::dense(a_buf.binding(), self.a.storage, m, k),
            b,
            Mats::dense(c, c_storage, m, n),
        )
        .trans_b(self.trans_b)
        .alpha(alpha)
        .slices(self.batch)
        .record(ctx, encoder)
    }
}

/// Check that `count` products of `m × n` fit the device's grid (in the form it runs), before
/// any GPU work: `what` names them in the error.
pub(crate) fn check_grid(ctx: &Context, what: &str, m: usize, n: usize, count: usize) -> Result<()> {
    kernel::check_grid(ctx, what, m, n)?;
    let max = ctx.limits().max_compute_workgroups_per_dimension as usize;
    if count > max {
        return Err(Error::TooLargeForDevice {
            what: format!("matmul grid for a batch of {count}"),
            bytes: 0,
            limit_name: "max_compute_workgroups_per_dimension",
            limit: max as u64,
            hint: "",
        });
    }
    Ok(())
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
