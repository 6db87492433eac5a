//! The layer's backward pass: the forward recorded again, the output projection's gradients,
//! the attention backward ([`Sdpa::backward`]) and the input projections' gradients, all in
//! one submission. Every weight gradient is a product of the crate's matmul kernel.
//!
//! With `Y = merge(O) W_Oᵀ + b_O`, the heads `O = SDPA(Q, K, V)` and each projection
//! `P = x Wᵀ + b` (split into heads), for the upstream gradient `dY`:
//! - `dW_O = dYᵀ merge(O)`, `db_O = Σ dY`, `dO = split(dY W_O)`;
//! - `dQ, dK, dV` by the attention backward;
//! - for each projection, with `dP` its merged head gradient: `dW = dPᵀ x`, `db = Σ dP`,
//!   `dx = dP W` (self-attention adds the three into the query input's gradient).
//!
//! The transposes (`dYᵀ`, `dPᵀ`) are strided copies into f32; the bias gradients are products
//! with a vector of ones; every gradient is accumulated and returned in f32.

use ndarray::{Array1, Array2, Array3, Array4, Axis};

use crate::device::buffers::{binding, f32_bytes, fits, output, storage_init, Operand};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::ops::copy;
use crate::ops::matmul::{self, Matmul};
use crate::ops::Mats;
use crate::storage::Storage;
use crate::tensor::Tensor;

use super::forward::{split_heads, Dims, Inputs, Pass};
use super::{MhaForward, MhaGrads};

/// Builder of the backward pass of one [`MhaForward`]: the gradients of `sum(dY ∘ Y)` with
/// respect to the layer's inputs and parameters, from [`MhaForward::backward`]. Finish with
/// [`run`](MhaBackward::run) or [`run_blocking`](MhaBackward::run_blocking).
///
/// The forward's inputs, masks, key lengths, scale and path apply; its
/// [`need_weights`](MhaForward::need_weights) and [`profile`](MhaForward::profile) do not (the
/// backward returns no attention weights). The attention backward runs on the forward's path
/// ([`Path::Auto`](crate::Path::Auto): fused wherever it can; [`Path::Decode`](crate::Path::Decode)
/// is an [`Error::Unsupported`]).
///
/// ```no_run
/// use ndarray::Array3;
/// use wgpu_attention::{Causal, Context, MhaConfig, MhaWeights, MultiHeadAttention};
/// let ctx = Context::new_blocking()?;
/// let weights = MhaWeights::xavier_uniform(MhaConfig::new(64, 4), 0)?;
/// let mha = MultiHeadAttention::new(&ctx, &weights)?;
/// let x = Array3::<f32>::ones((2, 16, 64));
/// let dy = Array3::<f32>::ones((2, 16, 64));
/// let g = mha.forward(&x).causal(Causal::TopLeft).backward(&dy).run_blocking(&ctx)?;
/// assert_eq!(g.w_q.shape(), &[64, 64]);
/// assert_eq!(g.query.shape(), &[2, 16, 64]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MhaBackward<'a> {
    fwd: MhaForward<'a>,
    dout: Tensor<'a>,
    into: MhaGradsInto<'a>,
}

/// Your own f32 buffers for the layer's gradients ([`MhaBackward::grads_into`]): each one given
/// receives that gradient, row-major in the shape [`MhaGrads`] gives it, at offset 0 (usage
/// `STORAGE`; `COPY_DST`, as it is zeroed first, unless accumulating; `COPY_SRC` to read it
/// back with [`MhaBackward::run`]); the crate makes the rest. With `accumulate`, every given
/// buffer gets the gradient added to what it holds (gradient accumulation over micro-batches)
/// instead of overwritten.
///
/// ```no_run
/// # use wgpu_attention::{wgpu, Context, MhaConfig, MhaWeights, MhaGradsInto, MultiHeadAttention};
/// # let ctx = Context::new_blocking()?;
/// # let mha = MultiHeadAttention::new(&ctx, &MhaWeights::xavier_uniform(MhaConfig::new(64, 4), 0)?)?;
/// # let x = ndarray::Array3::<f32>::ones((2, 16, 64));
/// # let dy = x.clone();
/// // Your optimizer's gradient buffer for W_Q, [64, 64] f32, summed over micro-batches.
/// let dw_q = ctx.device().create_buffer(&wgpu::BufferDescriptor {
///     label: Some("dW_Q"),
///     size: 64 * 64 * 4,
///     usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
///     mapped_at_creation: false,
/// });
/// let into = MhaGradsInto { w: [Some(&dw_q), None, None, None], accumulate: true, ..Default::default() };
/// let mut enc = ctx.device().create_command_encoder(&Default::default());
/// mha.forward(&x).backward(&dy).grads_into(into).record(&ctx, &mut enc)?;
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct MhaGradsInto<'b> {
    /// With respect to the query input `[B, L, d_model]` (or given query heads' input shape).
    pub query: Option<&'b wgpu::Buffer>,
    /// With respect to the key input, in cross-attention.
    pub key: Option<&'b wgpu::Buffer>,
    /// With respect to the value input, in cross-attention.
    pub value: Option<&'b wgpu::Buffer>,
    /// `[dW_Q, dW_K, dW_V, dW_O]`.
    pub w: [Option<&'b wgpu::Buffer>; 4],
    /// `[db_Q, db_K, db_V, db_O]` (for the biases the layer has).
    pub b: [Option<&'b wgpu::Buffer>; 4],
    /// Add to the buffers' contents instead of overwriting them.
    pub accumulate: bool,
}

/// The gradients' names, in the order of [`MhaGradsInto::slots`] and [`grad_elems`].
const GRAD_NAMES: [&str; 11] = [
    "query gradient",
    "key gradient",
    "value gradient",
    "w_q gradient",
    "w_k gradient",
    "w_v gradient",
    "w_o gradient",
    "b_q gradient",
    "b_k gradient",
    "b_v gradient",
    "b_o gradient",
];

impl MhaGradsInto<'_> {
    /// Every gradient's buffer, given or not, in the order of [`GRAD_NAMES`].
    fn slots(&self) -> [Option<&wgpu::Buffer>; 11] {
        let [wq, wk, wv, wo] = self.w;
        let [bq, bk, bv, bo] = self.b;
        [self.query, self.key, self.value, wq, wk, wv, wo, bq, bk, bv, bo]
    }

    /// The given buffers, named.
    fn given(&self) -> impl Iterator<Item = (&'static str, &wgpu::Buffer)> + '_ {
        GRAD_NAMES
            .into_iter()
            .zip(self.slots())
            .filter_map(|(n, b)| b.map(|b| (n, b)))
    }
}

impl<'a> MhaForward<'a> {
    /// The backward pass of this forward for the upstream gradient `dout` `[B, L, d_model]`
    /// (host data or a GPU buffer, any storage format).
    pub fn backward(self, dout: impl Into<Tensor<'a>>) -> MhaBackward<'a> {
        MhaBackward {
            fwd: self.for_backward(),
            dout: dout.into(),
            into: MhaGradsInto::default(),
        }
    }
}

/// The layer's gradients left on the GPU by [`MhaBackward::record`], each in f32 (given heads'
/// in the layer's format) in its own buffer, row-major in the shape [`MhaGrads`] gives it.
#[derive(Debug, Clone)]
pub struct MhaGpuGrads {
    /// The layer's output `Y` `[B, L, d_model]` in the layer's format, at
    /// [`output_offset`](Self::output_offset) (the forward's `output_into` buffer, when given).
    pub output: wgpu::Buffer,
    /// Byte offset of the output.
    pub output_offset: u64,
    /// With respect to the query input (see [`MhaGrads::query`]).
    pub query: wgpu::Buffer,
    /// With respect to the key input, in cross-attention.
    pub key: Option<wgpu::Buffer>,
    /// With respect to the value input, in cross-attention.
    pub value: Option<wgpu::Buffer>,
    /// `[dW_Q, dW_K, dW_V, dW_O]`.
    pub w: [wgpu::Buffer; 4],
    /// `[db_Q, db_K, db_V, db_O]`, where the layer has them.
    pub b: [Option<wgpu::Buffer>; 4],
    /// With respect to given query, key and value heads, per batch element `[B, H|G, T, d_k]`
    /// in the layer's format (not yet summed over a broadcast batch, which
    /// [`MhaBackward::run`] does on the host).
    pub heads: [Option<wgpu::Buffer>; 3],
    /// d(sink logits) `[H]` in f32, when the attention has sink logits.
    pub dsink: Option<wgpu::Buffer>,
    /// The captures' gradients in f32, packed in capture order, when the user source defines
    /// `score_mod_dcapture`.
    pub dcaptures: Option<wgpu::Buffer>,
}

impl<'a> MhaBackward<'a> {
    /// Write the gradients into your own buffers (each optional), overwriting or accumulating
    /// ([`MhaGradsInto`]). Their sizes, usages and distinctness are checked before anything is
    /// recorded.
    pub fn grads_into(mut self, into: MhaGradsInto<'a>) -> Self {
        self.into = into;
        self
    }

    /// Upload host inputs and record the layer's forward and backward into your `encoder`;
    /// nothing is submitted. Every bad input is an error before anything is recorded; device
    /// errors go to your error scope. The gradients stay on the GPU ([`MhaGpuGrads`]).
    pub fn record(&self, ctx: &Context, enc: &mut wgpu::CommandEncoder) -> Result<MhaGpuGrads> {
        let fwd = &self.fwd;
        if let Some(m) = &fwd.options.user_mod {
            m.fns()?.check_backward()?;
        }
        let pass = Pass::new(fwd, ctx, true)?;
        let dims = pass.dims;
        let Dims { b, l, s, h, d, e, .. } = dims;
        let (st, m) = (fwd.layer().storage, fwd.layer());
        let (query_shape, key_shape, value_shape) = self.input_shapes(&pass);
        let dout = self.check(ctx, &pass)?;
        let into = &self.into;
        let f32_buf = |label: &str, n: usize| output(ctx, label, f32_bytes(n.max(1)));
        let inputs = pass.upload_inputs();
        pass.record_heads(enc, &inputs)?;
        let dy = dout.upload(ctx, "dout");
        let ones = storage_init(
            ctx,
            "ones",
            bytemuck::cast_slice(&vec![1.0f32; (b * l.max(s)).max(1)]),
        );
        let f = Storage::F32;
        let lin = Linear {
            ctx,
            ones: ones.as_entire_buffer_binding(),
            weights: st,
            accumulate: into.accumulate,
        };

        // dO = split(dY W_O), in the layer's format.
        let dmerged = output(ctx, "d merged", st.bytes((b * l * h * d).max(1)));
        product(
            (dy.binding(), dout.storage),
            (m.w_o.as_entire_buffer_binding(), st),
            (dmerged.as_entire_buffer_binding(), st),
            [b * l, h * d, e],
        )
        .record(ctx, enc)?;
        let dheads = output(ctx, "d heads", st.bytes((b * l * h * d).max(1)));
        split_heads(ctx, enc, &dmerged, &dheads, [b, l, h, d], st)?;

        // The attention backward (it records the forward it needs), then Y.
        let attn = pass
            .sdpa()
            .backward(Tensor::from_buffer(&dheads, st, &dims.heads_q()))
            .path(fwd.path_of())
            .record(ctx, enc)?;
        let fw = attn.forward.as_ref().expect("the backward ran the forward");
        pass.record_output(enc, &fw.output, fw.output_offset)?;

        let (out, output_offset) = pass.out_buffer();
        let shapes = (query_shape.as_slice(), [key_shape, value_shape]);
        let bufs = self.grad_buffers(ctx, enc, &dims, shapes, &attn, (out.clone(), output_offset));

        // Output projection: dYᵀ [E, B·L].
        let dy_t = f32_buf("dY transposed", b * l * e);
        copy::transpose(
            ctx,
            enc,
            (dy.binding(), dout.storage),
            (binding(&dy_t, 0, dy_t.size()), f),
            [b * l, e],
        )?;
        lin.record(
            enc,
            &dy_t,
            (dy.binding(), dout.storage),
            (binding(&pass.merged, 0, st.bytes(b * l * h * d)), st),
            &m.w_o,
            [b * l, e, h * d],
            (&bufs.w[3], bufs.b[3].as_ref(), None),
        )?;

        self.record_input_grads(enc, (&lin, &pass, &inputs), &attn, &bufs)?;
        Ok(bufs)
    }

    /// The input projections' gradients from the attention's head gradients (layer format),
    /// into `bufs`; none for inputs given as heads.
    fn record_input_grads(
        &self,
        enc: &mut wgpu::CommandEncoder,
        (lin, pass, inputs): (&Linear<'_>, &Pass<'_, '_>, &Inputs<'_>),
        attn: &crate::sdpa::backward::GpuGrads,
        bufs: &MhaGpuGrads,
    ) -> Result<()> {
        let (fwd, m, c) = (&self.fwd, self.fwd.layer(), self.fwd.layer().config);
        let Dims { b, l, s, h, g, d, e } = pass.dims;
        let x_q = (inputs.query.binding(), pass.query.storage);
        let [qd, kd, vd] = [(h, l), (g, s), (g, s)].map(|(n, t)| [b, n, t, d]);
        let dx_k = bufs.key.as_ref().unwrap_or(&bufs.query);
        let dx_v = bufs.value.as_ref().unwrap_or(&bufs.query);
        let input = |i: usize, dx| (&bufs.w[i], bufs.b[i].as_ref(), dx);
        if !fwd.has_query_heads() {
            lin.record_heads(enc, (&attn.dq, qd), x_q, (&m.w_q, e), input(0, &bufs.query))?;
        }
        if !fwd.has_key_heads() {
            lin.record_heads(
                enc,
                (&attn.dk, kd),
                pass.key_input(inputs),
                (&m.w_k, c.kdim),
                input(1, dx_k),
            )?;
        }
        if !fwd.has_value_heads() {
            lin.record_heads(
                enc,
                (&attn.dv, vd),
                pass.value_input(inputs),
                (&m.w_v, c.vdim),
                input(2, dx_v),
            )?;
        }
        Ok(())
    }

    /// The query input's shape, and the key and value inputs' (in cross-attention; the key
    /// input's is unused, a zero gradient, under given key heads).
    fn input_shapes(&self, pass: &Pass<'_, '_>) -> (Vec<usize>, Option<[usize; 3]>, Option<[usize; 3]>) {
        let Dims { b, s, .. } = pass.dims;
        let vdim = self.fwd.layer().config.vdim;
        (
            self.fwd.query().shape().to_vec(),
            self.fwd.key_input_shape(),
            pass.value.as_ref().map(|_| [b, s, vdim]),
        )
    }

    /// Check dO, the device's limits and the caller's gradient buffers before any GPU work.
    fn check<'t>(&'t self, ctx: &Context, pass: &Pass<'_, '_>) -> Result<Operand<'t, 'a>> {
        let Dims { b, l, e, .. } = pass.dims;
        if self.dout.shape() != [b, l, e] {
            return Err(Error::ShapeMismatch {
                tensor: "dout",
                expected: vec![b, l, e],
                actual: self.dout.shape().to_vec(),
            });
        }
        let dout = Operand::check(ctx, "dout", &self.dout)?;
        let (query_shape, key_shape, value_shape) = self.input_shapes(pass);
        let m = self.fwd.layer();
        check_sizes(ctx, &m.config, &pass.dims, &query_shape)?;
        let elems = grad_elems(m, &pass.dims, &query_shape, [key_shape, value_shape]);
        check_into(&self.into, m, &elems)?;
        Ok(dout)
    }

    /// The gradient buffers (the caller's where given), zeroed, the caller's too unless they
    /// accumulate: unused inputs and parameters keep zeros, and the input gradients accumulate.
    /// `shapes`: the query input's, the key and value inputs' (in cross-attention); `output`:
    /// the layer's output buffer and offset.
    fn grad_buffers(
        &self,
        ctx: &Context,
        enc: &mut wgpu::CommandEncoder,
        dims: &Dims,
        (query_shape, [key_shape, value_shape]): (&[usize], [Option<[usize; 3]>; 2]),
        attn: &crate::sdpa::backward::GpuGrads,
        (out, output_offset): (wgpu::Buffer, u64),
    ) -> MhaGpuGrads {
        let (fwd, into) = (&self.fwd, &self.into);
        let sizes = grad_elems(fwd.layer(), dims, query_shape, [key_shape, value_shape]);
        // Gradient i: the given buffer, or one of the crate's; None where the layer has none.
        let slots = into.slots();
        let pick = |i: usize| {
            sizes[i].map(|n| match slots[i] {
                Some(buf) => buf.clone(),
                None => output(ctx, GRAD_NAMES[i], f32_bytes(n.max(1))),
            })
        };
        let bufs = MhaGpuGrads {
            output: out,
            output_offset,
            query: pick(0).expect("the query input always has a gradient"),
            key: pick(1),
            value: pick(2),
            w: [3, 4, 5, 6].map(|i| pick(i).expect("every weight has a gradient")),
            b: [7, 8, 9, 10].map(pick),
            heads: [
                fwd.has_query_heads().then(|| attn.dq.clone()),
                fwd.has_key_heads().then(|| attn.dk.clone()),
                fwd.has_value_heads().then(|| attn.dv.clone()),
            ],
            dsink: attn.dsink.clone(),
            dcaptures: attn.dcaptures.clone(),
        };
        for buf in [Some(&bufs.query), bufs.key.as_ref(), bufs.value.as_ref()]
            .into_iter()
            .chain(bufs.w.iter().map(Some))
            .chain(bufs.b.iter().map(Option::as_ref))
            .flatten()
        {
            let callers = into.given().any(|(_, given)| given == buf);
            if !(callers && into.accumulate) {
                enc.clear_buffer(buf, 0, None);
            }
        }
        bufs
    }

    /// Run on the GPU and read the gradients (and the layer's output) back.
    pub async fn run(&self, ctx: &Context) -> Result<MhaGrads<f32>> {
        for (name, buf) in self.into.given() {
            if !buf.usage().contains(wgpu::BufferUsages::COPY_SRC) {
                return Err(Error::BadBuffer {
                    tensor: name,
                    reason: "run reads the gradients back: the buffer needs wgpu::BufferUsages::COPY_SRC (or use record)".into(),
                });
            }
        }
        let bufs = ctx
            .submit("wgpu-attention mha backward", |enc| self.record(ctx, enc))
            .await?;
        let fwd = &self.fwd;
        let dims = fwd.dims()?;
        let Dims { b, l, s, h, g, d, e } = dims;
        let c = fwd.layer().config;
        let st = fwd.layer().storage;
        let query_shape = fwd.query().shape().to_vec();
        let shape3 = |s: &[usize]| [s[0], s[1], s[2]];
        let key_shape = fwd.key_input_shape();
        let value_shape = fwd.value_input_shape();

        // Read back.
        let read = |buf: &wgpu::Buffer, n: usize| {
            let buf = buf.clone();
            async move { ctx.read_f32(&buf, 0, f32_bytes(n)).await }
        };
        let arr3 = |v: Vec<f32>, sh: [usize; 3]| Array3::from_shape_vec(sh, v).expect("gradient length");
        let arr2 =
            |v: Vec<f32>, r: usize, cc: usize| Array2::from_shape_vec((r, cc), v).expect("gradient length");
        let output = ctx
            .read_as_f32(&bufs.output, bufs.output_offset, b * l * e, st)
            .await?;
        let output = arr3(output, [b, l, e]);
        let query = arr3(
            read(&bufs.query, elems(&query_shape)).await?,
            shape3(&query_shape),
        );
        let key = match (&bufs.key, key_shape) {
            (Some(buf), Some(sh)) => Some(arr3(read(buf, elems(&sh[..])).await?, sh)),
            _ => None,
        };
        let value = match (&bufs.value, value_shape) {
            (Some(buf), Some(sh)) => Some(arr3(read(buf, elems(&sh[..])).await?, sh)),
            _ => None,
        };
        let kv = c.kv_width();
        let w_q = arr2(read(&bufs.w[0], e * e).await?, e, e);
        let w_k = arr2(read(&bufs.w[1], kv * c.kdim).await?, kv, c.kdim);
        let w_v = arr2(read(&bufs.w[2], kv * c.vdim).await?, kv, c.vdim);
        let w_o = arr2(read(&bufs.w[3], e * e).await?, e, e);
        let mut bias = Vec::new();
        for (buf, n) in bufs.b.iter().zip([e, kv, kv, e]) {
            bias.push(read_opt(ctx, buf.as_ref(), n).await?.map(Array1::from_vec));
        }
        let [b_q, b_k, b_v, b_o]: [Option<Array1<f32>>; 4] = bias.try_into().expect("four biases");
        // Given heads: their gradient, summed over a broadcast batch (on the host).
        let given = |grad: Option<Vec<f32>>, shape: [usize; 4], given_batch: usize| {
            grad.map(|v| {
                let a = Array4::from_shape_vec(shape, v).expect("head gradient length");
                if given_batch == 1 && shape[0] != 1 {
                    a.sum_axis(Axis(0)).insert_axis(Axis(0))
                } else {
                    a
                }
            })
        };
        let mut heads = Vec::new();
        for (buf, n) in bufs
            .heads
            .iter()
            .zip([b * h * l * d, b * g * s * d, b * g * s * d])
        {
            heads.push(match buf {
                Some(buf) => Some(ctx.read_as_f32(buf, 0, n, st).await?),
                None => None,
            });
        }
        let [dq, dk, dv]: [Option<Vec<f32>>; 3] = heads.try_into().expect("three head gradients");
        let (dsink, dcaptures) = self.attention_extras(ctx, &bufs, h).await?;
        Ok(MhaGrads {
            output,
            query,
            key,
            value,
            query_heads: given(dq, dims.heads_q(), fwd.query_heads_batch()),
            key_heads: given(dk, dims.heads_kv(), fwd.key_heads_batch()),
            value_heads: given(dv, dims.heads_kv(), fwd.value_heads_batch()),
            w_q,
            w_k,
            w_v,
            w_o,
            b_q,
            b_k,
            b_v,
            b_o,
            dsink,
            dcaptures,
        })
    }

    /// d(sink logits) (`h` heads) and the captures' gradients, read back where recorded.
    async fn attention_extras(
        &self,
        ctx: &Context,
        bufs: &MhaGpuGrads,
        h: usize,
    ) -> Result<(Option<Array1<f32>>, Option<Vec<Array1<f32>>>)> {
        let dsink = read_opt(ctx, bufs.dsink.as_ref(), h).await?.map(Array1::from_vec);
        let dcaptures = match (&bufs.dcaptures, &self.fwd.options.user_mod) {
            (Some(buf), Some(m)) => {
                let u = m.fns()?;
                Some(u.split(&ctx.read_f32(buf, 0, f32_bytes(u.capture_len())).await?))
            }
            _ => None,
        };
        Ok((dsink, dcaptures))
    }

    /// Blocking version of [`run`](MhaBackward::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<MhaGrads<f32>> {
        pollster::block_on(self.run(ctx))
    }
}

/// Every f32 buffer of the layer's backward, and every product's grid, against the device
/// (before any GPU work).
fn check_sizes(ctx: &Context, c: &super::MhaConfig, dims: &Dims, query_shape: &[usize]) -> Result<()> {
    let Dims { b, l, s, h, g, d, e } = *dims;
    let limit = "max_storage_buffer_binding_size";
    let max = ctx.max_binding();
    for (what, n) in [
        ("query gradient", elems(query_shape)),
        ("key gradient", b * s * c.kdim),
        ("value gradient", b * s * c.vdim),
        ("transposed output gradient", b * l * e),
        ("query head gradients (f32)", b * l * h * d),
        ("key/value head gradients (f32)", b * s * g * d),
        ("parameter gradients", e * e.max(c.kdim).max(c.vdim)),
    ] {
        fits(what, f32_bytes(n), max, limit)?;
        fits(what, n as u64, u32::MAX as u64, "u32 element indices")?;
    }
    let tq = query_shape[1];
    for (m, n) in [
        (e, h * d),
        (b * l, h * d),
        (h * d, e.max(query_shape[2])),
        (g * d, c.kdim.max(c.vdim)),
        (b * tq.max(s), e.max(c.kdim).max(c.vdim)),
    ] {
        matmul::check_grid(ctx, "multi-head attention backward", m, n, 1)?;
    }
    Ok(())
}

/// Each gradient's element count, in the order of [`GRAD_NAMES`]; None where the layer has no
/// such gradient (the key and value inputs' outside cross-attention, a bias the layer lacks).
/// The key and value inputs' shapes are given in cross-attention.
fn grad_elems(
    m: &super::MultiHeadAttention,
    dims: &Dims,
    query_shape: &[usize],
    [key_shape, value_shape]: [Option<[usize; 3]>; 2],
) -> [Option<usize>; 11] {
    let Dims { h, g, d, e, .. } = *dims;
    let c = m.config;
    let kv = c.kv_width();
    [
        Some(elems(query_shape)),
        key_shape.map(|sh| elems(&sh)),
        value_shape.map(|sh| elems(&sh)),
        Some(e * e),
        Some(kv * c.kdim),
        Some(kv * c.vdim),
        Some(e * h * d),
        m.b_q.as_ref().map(|_| h * d),
        m.b_k.as_ref().map(|_| g * d),
        m.b_v.as_ref().map(|_| g * d),
        m.b_o.as_ref().map(|_| e),
    ]
}

/// The caller's gradient buffers ([`MhaGradsInto`]) against the gradients this layer makes
/// (`sizes`, from [`grad_elems`]): each one a gradient the layer has, large enough, usable as
/// storage, and none the same buffer as another or as one of the layer's parameters.
fn check_into(
    into: &MhaGradsInto<'_>,
    m: &super::MultiHeadAttention,
    sizes: &[Option<usize>; 11],
) -> Result<()> {
    let bad = |tensor: &'static str, reason: String| Err(Error::BadBuffer { tensor, reason });
    let params: Vec<&wgpu::Buffer> = [&m.w_q, &m.w_k, &m.w_v, &m.w_o]
        .into_iter()
        .chain([&m.b_q, &m.b_k, &m.b_v, &m.b_o].into_iter().flatten())
        .collect();
    let slots = into.slots();
    let given: Vec<(usize, &wgpu::Buffer)> = (0..11).filter_map(|i| slots[i].map(|b| (i, b))).collect();
    for (at, &(slot, buf)) in given.iter().enumerate() {
        let name = GRAD_NAMES[slot];
        let Some(n) = sizes[slot] else {
            return bad(
                name,
                "this layer has no such gradient (the key and value inputs' exist in cross-attention, a bias's where the layer has it)".into(),
            );
        };
        if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
            return bad(name, "the buffer needs wgpu::BufferUsages::STORAGE".into());
        }
        if !into.accumulate && !buf.usage().contains(wgpu::BufferUsages::COPY_DST) {
            return bad(
                name,
                "the buffer is zeroed first: it needs wgpu::BufferUsages::COPY_DST (or accumulate)".into(),
            );
        }
        if buf.size() < f32_bytes(n) {
            return bad(
                name,
                format!(
                    "needs {} bytes ({n} f32 values), the buffer has {}",
                    f32_bytes(n),
                    buf.size()
                ),
            );
        }
        if let Some(&(other, _)) = given[..at].iter().find(|(_, b)| *b == buf) {
            let other = GRAD_NAMES[other];
            return bad(
                name,
                format!("the same buffer as the {other}: each gradient needs its own"),
            );
        }
        if params.contains(&buf) {
            return bad(
                name,
                "one of the layer's own parameter buffers: gradients need buffers of their own".into(),
            );
        }
    }
    Ok(())
}

/// The element count of a shape.
fn elems(x: &[usize]) -> usize {
    x.iter().product()
}

/// `C = A B` for one row-major product of `[m, n, k]`, each operand with its format.
fn product<'b>(
    (a, fa): (wgpu::BufferBinding<'b>, Storage),
    (b, fb): (wgpu::BufferBinding<'b>, Storage),
    (c, fc): (wgpu::BufferBinding<'b>, Storage),
    [m, n, k]: [usize; 3],
) -> Matmul<'b> {
    Matmul::new(
        Mats::dense(a, fa, m, k),
        Mats::dense(b, fb, k, n),
        Mats::dense(c, fc, m, n),
    )
}

/// Records one linear layer's gradients by the matmul kernel.
struct Linear<'c> {
    ctx: &'c Context,
    /// f32 ones, at least as many as rows.
    ones: wgpu::BufferBinding<'c>,
    /// The weights' format.
    weights: Storage,
    /// `dW` and `db` added to their buffers' contents (the caller's, accumulating).
    accumulate: bool,
}

impl Linear<'_> {
    /// [`Linear::record`] for a projection from its head gradient `heads` `[B, n, t, d]` (the
    /// weights' format): `gᵀ` `[n·d, B·t]` and `g` `[B·t, n·d]` made by strided copies into
    /// f32, then `dW`, `db` written and `dx` accumulated into `outs`.
    fn record_heads(
        &self,
        enc: &mut wgpu::CommandEncoder,
        (heads, [b, n, t, d]): (&wgpu::Buffer, [usize; 4]),
        x: (wgpu::BufferBinding<'_>, Storage),
        (w, inw): (&wgpu::Buffer, usize),
        (dw, db, dx): (&wgpu::Buffer, Option<&wgpu::Buffer>, &wgpu::Buffer),
    ) -> Result<()> {
        let (ctx, st, f) = (self.ctx, self.weights, Storage::F32);
        let size = b * n * t * d;
        let f32_buf = |label: &str| output(ctx, label, f32_bytes(size.max(1)));
        let (g_t, g_m) = (
            f32_buf("head gradient transposed"),
            f32_buf("head gradient merged"),
        );
        let src = || binding(heads, 0, st.bytes(size));
        // gᵀ: element (head, dim, batch, row) of the heads.
        let heads_t = copy::Strided::new((src(), st), [t * d, 1, n * t * d, d]);
        copy::record(
            ctx,
            enc,
            &heads_t,
            (binding(&g_t, 0, g_t.size()), f),
            [n, d, b, t],
        )?;
        copy::merge_heads(
            ctx,
            enc,
            (src(), st),
            (binding(&g_m, 0, g_m.size()), f),
            [b, n, t, d],
        )?;
        self.record(
            enc,
            &g_t,
            (binding(&g_m, 0, f32_bytes(size)), f),
            x,
            w,
            [b * t, n * d, inw],
            (dw, db, Some(dx)),
        )
    }

    /// The gradients of `y = x Wᵀ + b` for the upstream gradient `g` `[rows, n]` (format
    /// `gf`), given also as `g_t` = gᵀ `[n, rows]` (f32): `dW = gᵀ x` `[n, in]` and
    /// `db = gᵀ 1` written, `dx += g W` `[rows, in]` accumulated (all f32).
    #[allow(clippy::too_many_arguments)] // each is a distinct operand
    fn record(
        &self,
        enc: &mut wgpu::CommandEncoder,
        g_t: &wgpu::Buffer,
        (g, gf): (wgpu::BufferBinding<'_>, Storage),
        (x, xf): (wgpu::BufferBinding<'_>, Storage),
        w: &wgpu::Buffer,
        [rows, n, inw]: [usize; 3],
        (dw, db, dx): (&wgpu::Buffer, Option<&wgpu::Buffer>, Option<&wgpu::Buffer>),
    ) -> Result<()> {
        let f = Storage::F32;
        let gt = || binding(g_t, 0, f32_bytes((n * rows).max(1)));
        product(
            (gt(), f),
            (x, xf),
            (dw.as_entire_buffer_binding(), f),
            [n, inw, rows],
        )
        .accumulate(self.accumulate)
        .record(self.ctx, enc)?;
        if let Some(db) = db {
            product(
                (gt(), f),
                (self.ones.clone(), f),
                (db.as_entire_buffer_binding(), f),
                [n, 1, rows],
            )
            .accumulate(self.accumulate)
            .record(self.ctx, enc)?;
        }
        if let Some(dx) = dx {
            product(
                (g, gf),
                (w.as_entire_buffer_binding(), self.weights),
                (dx.as_entire_buffer_binding(), f),
                [rows, inw, n],
            )
            .accumulate(true)
            .record(self.ctx, enc)?;
        }
        Ok(())
    }
}

/// `n` f32 values of `buf`, when given.
async fn read_opt(ctx: &Context, buf: Option<&wgpu::Buffer>, n: usize) -> Result<Option<Vec<f32>>> {
    match buf {
        Some(buf) => Ok(Some(ctx.read_f32(buf, 0, f32_bytes(n)).await?)),
        None => Ok(None),
    }
}
