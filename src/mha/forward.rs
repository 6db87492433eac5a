//! One forward pass of the layer: projections, head split, attention, merge, output projection.

use ndarray::{Array3, Array4, Axis};

use crate::device::buffers::{binding, f32_bytes, fits, output, Operand, Uploaded};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::ops::{copy, linear};
use crate::options::Options;
use crate::sdpa::{GpuOutput, Path, Sdpa};
use crate::storage::Storage;
use crate::tensor::Tensor;

use super::{MhaGpuOutput, MhaOutput, MhaTimings, MultiHeadAttention, NeedWeights};

/// Builder of one forward pass of a [`MultiHeadAttention`]; finish with
/// [`run`](MhaForward::run) or [`run_blocking`](MhaForward::run_blocking).
#[derive(Debug, Clone)]
pub struct MhaForward<'a> {
    mha: &'a MultiHeadAttention,
    query: Tensor<'a>,
    key: Option<Tensor<'a>>,
    value: Option<Tensor<'a>>,
    query_heads: Option<Tensor<'a>>,
    key_heads: Option<Tensor<'a>>,
    value_heads: Option<Tensor<'a>>,
    pub(super) options: Options<'a>,
    need_weights: NeedWeights,
    path: Path,
    profile: bool,
    /// The caller's output buffer `[B, L, d_model]`, if any.
    out: Option<Tensor<'a>>,
}

/// Shapes of one forward pass, validated.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) l: usize,
    pub(super) s: usize,
    pub(super) h: usize,
    pub(super) g: usize,
    pub(super) d: usize,
    pub(super) e: usize,
}

impl Dims {
    /// Query heads `[B, H, L, d]`.
    pub(super) fn heads_q(&self) -> [usize; 4] {
        [self.b, self.h, self.l, self.d]
    }

    /// Key and value heads `[B, G, S, d]`.
    pub(super) fn heads_kv(&self) -> [usize; 4] {
        [self.b, self.g, self.s, self.d]
    }
}

impl<'a> MhaForward<'a> {
    /// A forward pass of `mha` over `query` with default options.
    pub(super) fn new(mha: &'a MultiHeadAttention, query: Tensor<'a>) -> Self {
        MhaForward {
            mha,
            query,
            key: None,
            value: None,
            query_heads: None,
            key_heads: None,
            value_heads: None,
            options: Options::default(),
            need_weights: NeedWeights::No,
            path: Path::Auto,
            profile: false,
            out: None,
        }
    }

    /// Cross-attention: keys from `key` `[B, S, kdim]`, values from `value` `[B, S, vdim]`.
    pub fn key_value(mut self, key: impl Into<Tensor<'a>>, value: impl Into<Tensor<'a>>) -> Self {
        self.key = Some(key.into());
        self.value = Some(value.into());
        self
    }

    /// Use these query heads `[B or 1, H, L, d_k]` (e.g. a learned constant query, broadcast
    /// over the batch when its batch is 1) instead of projecting the query input, which then
    /// only supplies keys and values (self-attention) or is ignored (with
    /// [`key_value`](Self::key_value)); `L` comes from these heads.
    pub fn query_heads(mut self, q: impl Into<Tensor<'a>>) -> Self {
        self.query_heads = Some(q.into());
        self
    }

    /// Use these key heads `[B or 1, G, S, d_k]` instead of projecting the key input: a KV
    /// cache of keys projected by earlier steps (with [`value_heads`](Self::value_heads), a
    /// decode step projects only the new query). `S` comes from these heads, and must agree
    /// with the value heads or the value input.
    pub fn key_heads(mut self, k: impl Into<Tensor<'a>>) -> Self {
        self.key_heads = Some(k.into());
        self
    }

    /// Use these value heads `[B or 1, G, S, d_k]` instead of projecting the value input.
    pub fn value_heads(mut self, v: impl Into<Tensor<'a>>) -> Self {
        self.value_heads = Some(v.into());
        self
    }

    option_setters!();

    /// Return the attention weights, per head or averaged (runs the unfused path).
    pub fn need_weights(mut self, w: NeedWeights) -> Self {
        self.need_weights = w;
        self
    }

    /// Return the attention weights per head `[B, H, L, S]` (as [`Sdpa::return_weights`]; the
    /// same as `need_weights(NeedWeights::PerHead)`; runs the unfused path).
    pub fn return_weights(self) -> Self {
        self.need_weights(NeedWeights::PerHead)
    }

    /// Write the layer's output `[B, L, d_model]` into `out`: a GPU buffer
    /// ([`Tensor::from_buffer`]) in the layer's format ([`MultiHeadAttention::storage`]), dense.
    /// [`run`](Self::run) reads it back from there (it then needs `COPY_SRC`);
    /// [`record`](Self::record) leaves it there.
    pub fn output_into(mut self, out: Tensor<'a>) -> Self {
        self.out = Some(out);
        self
    }

    /// Force an attention path (default [`Path::Auto`]).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// Submit each stage on its own and time it ([`MhaOutput::timings`]); slower, for
    /// benchmarks.
    pub fn profile(mut self) -> Self {
        self.profile = true;
        self
    }

    /// Validate every shape; nothing touches the GPU.
    pub(super) fn dims(&self) -> Result<Dims> {
        let c = self.mha.config;
        c.validate()?;
        let (h, g) = (c.num_heads, c.num_kv_heads);
        let (d, e) = (c.head_dim(), c.d_model);
        let [b, lq, wq] = self.query.dims::<3>("query")?;
        if self.query_heads.is_none() && wq != e {
            return Err(Error::ShapeMismatch {
                tensor: "query",
                expected: vec![b, lq, e],
                actual: self.query.shape().to_vec(),
            });
        }
        let l = match &self.query_heads {
            Some(qh) => {
                let s = qh.dims::<4>("query_heads")?;
                if (s[0] != b && s[0] != 1) || s[1] != h || s[3] != d {
                    return Err(Error::ShapeMismatch {
                        tensor: "query_heads",
                        expected: vec![b, h, s[2], d],
                        actual: s.to_vec(),
                    });
                }
                s[2]
            }
            None => lq,
        };
        // Keys: the key input, or the query input (self-attention).
        let (key, kname) = match &self.key {
            Some(k) => (k, "key"),
            None => (&self.query, "query"),
        };
        let s = match &self.key_heads {
            Some(kh) => {
                if self.key.is_some() {
                    key.dims::<3>("key")?; // unused, but its (zero) gradient has its shape
                }
                let sh = kh.dims::<4>("key_heads")?;
                if (sh[0] != b && sh[0] != 1) || sh[1] != g || sh[3] != d {
                    return Err(Error::ShapeMismatch {
                        tensor: "key_heads",
                        expected: vec![b, g, sh[2], d],
                        actual: sh.to_vec(),
                    });
                }
                sh[2]
            }
            None => {
                let [kb, s, kw] = key.dims::<3>(kname)?;
                if kb != b || kw != c.kdim {
                    return Err(Error::ShapeMismatch {
                        tensor: kname,
                        expected: vec![b, s, c.kdim],
                        actual: key.shape().to_vec(),
                    });
                }
                s
            }
        };
        match &self.value_heads {
            Some(vh) => {
                let sh = vh.dims::<4>("value_heads")?;
                if (sh[0] != b && sh[0] != 1) || sh[1] != g || sh[2] != s || sh[3] != d {
                    return Err(Error::ShapeMismatch {
                        tensor: "value_heads",
                        expected: vec![b, g, s, d],
                        actual: sh.to_vec(),
                    });
                }
            }
            None => {
                let (value, vname) = match &self.value {
                    Some(v) => (v, "value"),
                    None => (&self.query, "query"),
                };
                let [vb, vs, vw] = value.dims::<3>(vname)?;
                if vb != b || vs != s || vw != c.vdim {
                    return Err(Error::ShapeMismatch {
                        tensor: vname,
                        expected: vec![b, s, c.vdim],
                        actual: value.shape().to_vec(),
                    });
                }
            }
        }
        // Every index of the split/merge copies must fit in u32.
        let biggest = [b * l * e, b * s * g * d, b * l * h * d]
            .into_iter()
            .max()
            .unwrap_or(0);
        fits(
            "multi-head attention activations",
            f32_bytes(biggest),
            u32::MAX as u64,
            "u32 element indices",
        )?;
        Ok(Dims { b, l, s, h, g, d, e })
    }

    /// A copy for the backward: no weights, no profiling.
    pub(super) fn for_backward(&self) -> Self {
        MhaForward {
            need_weights: NeedWeights::No,
            profile: false,
            ..self.clone()
        }
    }

    /// The forward's path.
    pub(super) fn path_of(&self) -> Path {
        self.path
    }

    /// The layer.
    pub(super) fn layer(&self) -> &'a MultiHeadAttention {
        self.mha
    }

    /// Whether query heads are given.
    pub(super) fn has_query_heads(&self) -> bool {
        self.query_heads.is_some()
    }

    /// The key input's shape `[B, S, kdim]` in cross-attention.
    pub(super) fn key_input_shape(&self) -> Option<[usize; 3]> {
        let s = self.key.as_ref()?.shape();
        Some([s[0], s[1], s[2]])
    }

    /// The value input's shape `[B, S, vdim]` in cross-attention.
    pub(super) fn value_input_shape(&self) -> Option<[usize; 3]> {
        let s = self.value.as_ref()?.shape();
        Some([s[0], s[1], s[2]])
    }

    /// Whether key heads are given.
    pub(super) fn has_key_heads(&self) -> bool {
        self.key_heads.is_some()
    }

    /// The batch of the given key heads (1: broadcast).
    pub(super) fn key_heads_batch(&self) -> usize {
        self.key_heads.as_ref().map_or(0, |t| t.shape()[0])
    }

    /// Whether value heads are given.
    pub(super) fn has_value_heads(&self) -> bool {
        self.value_heads.is_some()
    }

    /// The batch of the given query heads (1: broadcast).
    pub(super) fn query_heads_batch(&self) -> usize {
        self.query_heads.as_ref().map_or(0, |t| t.shape()[0])
    }

    /// The batch of the given value heads (1: broadcast).
    pub(super) fn value_heads_batch(&self) -> usize {
        self.value_heads.as_ref().map_or(0, |t| t.shape()[0])
    }

    /// The query input.
    pub(super) fn query(&self) -> &Tensor<'a> {
        &self.query
    }

    /// The attention call's options on `sdpa`.
    fn configure<'s>(&'s self, sdpa: Sdpa<'s>) -> Sdpa<'s> {
        let mut sdpa = sdpa.options(self.options.clone()).path(self.path);
        if self.need_weights != NeedWeights::No {
            sdpa = sdpa.return_weights();
        }
        sdpa
    }

    /// Upload host inputs and record the whole layer (projections, attention, output
    /// projection) into your `encoder`; nothing is submitted. Every bad input is an error
    /// before anything is recorded; device errors go to your error scope (as with
    /// [`Sdpa::record`]). The output stays on the GPU (in the
    /// [`output_into`](Self::output_into) buffer when given); weights, when asked for, are per
    /// head (average them yourself for [`NeedWeights::Averaged`]). Profiling does not apply.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<MhaGpuOutput> {
        let pass = Pass::new(self, ctx, false)?;
        pass.record_heads(encoder, &pass.upload_inputs())?;
        let gpu = pass.sdpa_forward().record(ctx, encoder)?;
        pass.record_output(encoder, &gpu.output, gpu.output_offset)?;
        let (output, output_offset) = pass.out_buffer();
        Ok(MhaGpuOutput {
            output: output.clone(),
            output_offset,
            weights: gpu.weights,
        })
    }

    /// Run on the GPU and read the output (and the weights, if asked for) back.
    pub async fn run(&self, ctx: &Context) -> Result<MhaOutput> {
        let pass = Pass::new(self, ctx, false)?;
        let (gpu, times) = pass.submit().await?;
        pass.read_back(&gpu, times).await
    }

    /// Blocking version of [`run`](MhaForward::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<MhaOutput> {
        pollster::block_on(self.run(ctx))
    }
}

/// The query, key and value inputs on the GPU.
pub(super) struct Inputs<'a> {
    pub(super) query: Uploaded<'a>,
    pub(super) key: Option<Uploaded<'a>>,
    pub(super) value: Option<Uploaded<'a>>,
}

/// Activations up to this size are the context's scratch ([`activation`]).
const SCRATCH_ACTIVATION: u64 = 16 << 20;

/// A buffer for a stage's activation of `bytes` that lives only within one call: the
/// context's scratch for `role` when small and `shared` (shared by every call: the GPU runs
/// one queue's commands in order, so one call's write-then-read within one submission cannot
/// interleave with another's), else the call's own.
fn activation(ctx: &Context, role: &'static str, bytes: u64, shared: bool) -> wgpu::Buffer {
    if !shared || bytes > SCRATCH_ACTIVATION {
        return output(ctx, role, bytes);
    }
    ctx.cache().scratch(role, bytes, || output(ctx, role, bytes))
}

/// One validated forward pass: the checked inputs and the buffers of every stage. Built
/// before any GPU work, so every bad input is an error before anything is submitted.
pub(super) struct Pass<'p, 'a> {
    pub(super) fwd: &'p MhaForward<'a>,
    ctx: &'p Context,
    pub(super) dims: Dims,
    pub(super) query: Operand<'p, 'a>,
    pub(super) key: Option<Operand<'p, 'a>>,
    pub(super) value: Option<Operand<'p, 'a>>,
    given_q: Option<Operand<'p, 'a>>,
    given_k: Option<Operand<'p, 'a>>,
    given_v: Option<Operand<'p, 'a>>,
    /// Query, key and value heads `[B, H|G, T, d]`, where they are not the given ones read
    /// in place.
    qh: Option<wgpu::Buffer>,
    kh: Option<wgpu::Buffer>,
    vh: Option<wgpu::Buffer>,
    /// Attention output merged back to `[B, L, H·d]`, and the layer output `[B, L, E]` (ours,
    /// or the caller's `out_op`).
    pub(super) merged: wgpu::Buffer,
    out: Option<wgpu::Buffer>,
    /// The attention's output in a forward alone, when small (else the call's own).
    /// Its output and logsumexp.
    attn: Option<(wgpu::Buffer, wgpu::Buffer)>,
}

/// The layer's output tensor `t` checked: a GPU buffer of `[B, L, E]` in the layer's format
/// that overlaps no input.
fn check_output<'t, 'a>(
    fwd: &MhaForward<'_>,
    ctx: &Context,
    t: &'t Tensor<'a>,
    [b, l, e]: [usize; 3],
) -> Result<Operand<'t, 'a>> {
    let st = fwd.mha.storage;
    if !matches!(t.data, crate::tensor::TensorData::Gpu { .. }) {
        return Err(Error::BadBuffer {
            tensor: "output",
            reason: "output_into takes a GPU buffer (Tensor::from_buffer), not host data".into(),
        });
    }
    if t.shape() != [b, l, e] {
        return Err(Error::ShapeMismatch {
            tensor: "output",
            expected: vec![b, l, e],
            actual: t.shape().to_vec(),
        });
    }
    if t.storage() != st {
        return Err(Error::StorageMismatch {
            tensor: "output",
            expected: st,
            actual: t.storage(),
            why: "the layer writes its output in its own format",
        });
    }
    let inputs: Vec<(&'static str, &Tensor)> = [
        ("query", Some(&fwd.query)),
        ("key", fwd.key.as_ref()),
        ("value", fwd.value.as_ref()),
        ("query_heads", fwd.query_heads.as_ref()),
        ("key_heads", fwd.key_heads.as_ref()),
        ("value_heads", fwd.value_heads.as_ref()),
    ]
    .into_iter()
    .filter_map(|(n, t)| t.map(|t| (n, t)))
    .collect();
    crate::device::buffers::check_aliasing(&[("output", t)], &inputs)?;
    Operand::check(ctx, "output", t)
}

impl<'p, 'a> Pass<'p, 'a> {
    /// Validate `fwd` on `ctx` (with `backward`, the attention backward's plan too, for the
    /// upstream gradient in the layer's format) and allocate the stages' buffers.
    pub(super) fn new(fwd: &'p MhaForward<'a>, ctx: &'p Context, backward: bool) -> Result<Self> {
        let dims = fwd.dims()?;
        let Dims { b, l, s, h, g, d, e } = dims;
        let max = ctx.max_binding();
        for (what, n) in [
            ("query projection", b * l * e),
            ("key/value projection", b * s * g * d),
            ("attention output", b * l * h * d),
        ] {
            fits(what, f32_bytes(n), max, "max_storage_buffer_binding_size")?;
        }
        for (rows, cols) in [(b * l, e.max(h * d)), (b * s, g * d)] {
            crate::ops::matmul::check_grid(ctx, "projection", rows, cols, 1)?;
        }
        // The attention problem is validated (and planned) before any GPU work too.
        let empty: &[f32] = &[];
        let st = fwd.mha.storage;
        let check = fwd.configure(Sdpa::new(
            Tensor::from_slice(empty, &dims.heads_q()).with_storage(st),
            Tensor::from_slice(empty, &dims.heads_kv()).with_storage(st),
            Tensor::from_slice(empty, &dims.heads_kv()).with_storage(st),
        ));
        if backward {
            check
                .backward(Tensor::from_slice(empty, &dims.heads_q()).with_storage(st))
                .path(fwd.path)
                .resolved_path(ctx)?;
        } else {
            check.plan(ctx)?;
        }
        let optional =
            |t: &'p Option<Tensor<'a>>, name| t.as_ref().map(|t| Operand::check(ctx, name, t)).transpose();
        // Given heads with the batch and format of the layer are read where they are.
        let in_place =
            |t: &Option<Tensor<'a>>| t.as_ref().is_some_and(|t| t.shape()[0] == b && t.storage() == st);
        let out_op = fwd
            .out
            .as_ref()
            .map(|t| check_output(fwd, ctx, t, [b, l, e]))
            .transpose()?;
        // An empty activation still needs a non-empty buffer. The stages' activations live
        // only within the call: small ones are the context's scratch, shared by every call
        // (a decode step allocates nothing), large ones the call's own.
        // Not when profiling: its stages are separate submissions, between which another
        // thread's call could use the same scratch.
        let shared = !fwd.profile;
        let buffer =
            |label: &'static str, elems: usize| activation(ctx, label, st.bytes(elems.max(1)), shared);
        Ok(Pass {
            fwd,
            ctx,
            dims,
            query: Operand::check(ctx, "query", &fwd.query)?,
            key: optional(&fwd.key, "key")?,
            value: optional(&fwd.value, "value")?,
            given_q: optional(&fwd.query_heads, "query_heads")?,
            given_k: optional(&fwd.key_heads, "key_heads")?,
            given_v: optional(&fwd.value_heads, "value_heads")?,
            qh: (!in_place(&fwd.query_heads)).then(|| buffer("mha query heads", b * h * l * d)),
            kh: (!in_place(&fwd.key_heads)).then(|| buffer("mha key heads", b * g * s * d)),
            vh: (!in_place(&fwd.value_heads)).then(|| buffer("mha value heads", b * g * s * d)),
            merged: buffer("mha merged heads", b * l * h * d),
            out: match &out_op {
                Some(_) => None,
                None => Some(output(ctx, "mha output", st.bytes((b * l * e).max(1)))),
            },
            attn: (shared && !backward && st.bytes(b * h * l * d) <= SCRATCH_ACTIVATION).then(|| {
                let lse = f32_bytes((b * h * l).max(1));
                (
                    buffer("mha attention", b * h * l * d),
                    ctx.cache()
                        .scratch("mha lse", lse, || output(ctx, "mha lse", lse)),
                )
            }),
        })
    }

    /// Upload the query, key and value inputs (the caller's buffers are bound as they are).
    pub(super) fn upload_inputs(&self) -> Inputs<'a> {
        Inputs {
            query: self.query.upload(self.ctx, "query"),
            key: self.key.as_ref().map(|k| k.upload(self.ctx, "key")),
            value: self.value.as_ref().map(|v| v.upload(self.ctx, "value")),
        }
    }

    /// The key input (the query input in self-attention), bound, with its format.
    pub(super) fn key_input<'u>(&self, inputs: &'u Inputs<'a>) -> (wgpu::BufferBinding<'u>, Storage) {
        match (&inputs.key, &self.key) {
            (Some(k), Some(op)) => (k.binding(), op.storage),
            _ => (inputs.query.binding(), self.query.storage),
        }
    }

    /// The value input (the query input in self-attention), bound, with its format.
    pub(super) fn value_input<'u>(&self, inputs: &'u Inputs<'a>) -> (wgpu::BufferBinding<'u>, Storage) {
        match (&inputs.value, &self.value) {
            (Some(v), Some(op)) => (v.binding(), op.storage),
            _ => (inputs.query.binding(), self.query.storage),
        }
    }

    /// Stage 1: the query, key and value heads, each given (broadcast over the batch if its
    /// batch is 1) or projected from the uploaded `inputs` and split.
    pub(super) fn record_heads(&self, encoder: &mut wgpu::CommandEncoder, inputs: &Inputs<'a>) -> Result<()> {
        let (c, m) = (&self.fwd.mha.config, &self.fwd.mha);
        let Dims { l, s, h, g, e, .. } = self.dims;
        let given_q = self.given_q.as_ref().zip(self.fwd.query_heads.as_ref());
        let given_k = self.given_k.as_ref().zip(self.fwd.key_heads.as_ref());
        let given_v = self.given_v.as_ref().zip(self.fwd.value_heads.as_ref());
        if let Some(qh) = &self.qh {
            self.heads(
                encoder,
                given_q,
                (inputs.query.binding(), self.query.storage),
                (&m.w_q, m.b_q.as_ref()),
                qh,
                [l, h, e],
            )?;
        }
        if let Some(kh) = &self.kh {
            self.heads(
                encoder,
                given_k,
                self.key_input(inputs),
                (&m.w_k, m.b_k.as_ref()),
                kh,
                [s, g, c.kdim],
            )?;
        }
        if let Some(vh) = &self.vh {
            self.heads(
                encoder,
                given_v,
                self.value_input(inputs),
                (&m.w_v, m.b_v.as_ref()),
                vh,
                [s, g, c.vdim],
            )?;
        }
        Ok(())
    }

    /// Heads `[B, n, t, d]` into `dst`: the `given` ones, or the projection of `x`
    /// `[B, t, in_dim]` by `(w, bias)`, split.
    #[allow(clippy::too_many_arguments)] // each is a distinct operand
    fn heads(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        given: Option<(&Operand<'p, 'a>, &Tensor<'a>)>,
        (x, x_storage): (wgpu::BufferBinding<'_>, Storage),
        (w, bias): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        dst: &wgpu::Buffer,
        [t, n, in_dim]: [usize; 3],
    ) -> Result<()> {
        let Dims { b, d, .. } = self.dims;
        match given {
            Some((op, tensor)) => {
                let given = op.upload(self.ctx, "given heads");
                let bstride = if tensor.shape()[0] == 1 { 0 } else { n * t * d };
                let given = copy::Strided::new((given.binding(), op.storage), [bstride, t * d, d, 1]);
                copy::record(
                    self.ctx,
                    encoder,
                    &given,
                    (binding(dst, 0, dst.size()), self.fwd.mha.storage),
                    [b, n, t, d],
                )
            }
            None => {
                let st = self.fwd.mha.storage;
                let bytes = st.bytes((b * t * n * d).max(1));
                let proj = activation(self.ctx, "mha projection", bytes, !self.fwd.profile);
                linear::record(
                    self.ctx,
                    encoder,
                    (x, x_storage),
                    linear::Weights {
                        w,
                        b: bias,
                        storage: st,
                    },
                    binding(&proj, 0, st.bytes(b * t * n * d)),
                    [b * t, n * d, in_dim],
                )?;
                split_heads(self.ctx, encoder, &proj, dst, [b, t, n, d], st)
            }
        }
    }

    /// Stage 2: attention over the heads.
    pub(super) fn sdpa(&self) -> Sdpa<'_> {
        let st = self.fwd.mha.storage;
        fn heads<'s>(
            own: &'s Option<wgpu::Buffer>,
            given: &'s Option<Tensor<'s>>,
            st: Storage,
            shape: &[usize],
        ) -> Tensor<'s> {
            match own {
                Some(buf) => Tensor::from_buffer(buf, st, shape),
                None => given.clone().expect("given heads are read in place"),
            }
        }
        let (q, kv) = (self.dims.heads_q(), self.dims.heads_kv());
        self.fwd.configure(Sdpa::new(
            heads(&self.qh, &self.fwd.query_heads, st, &q),
            heads(&self.kh, &self.fwd.key_heads, st, &kv),
            heads(&self.vh, &self.fwd.value_heads, st, &kv),
        ))
    }

    /// Stage 2 of a forward alone: the attention's output in the context's scratch when it
    /// is small (it lives only until the output projection has read it).
    pub(super) fn sdpa_forward(&self) -> Sdpa<'_> {
        let st = self.fwd.mha.storage;
        let shape = self.dims.heads_q();
        match &self.attn {
            Some((out, lse)) => self
                .sdpa()
                .output_into(Tensor::from_buffer(out, st, &shape))
                .lse_into(Tensor::from_buffer(lse, Storage::F32, &shape[..3])),
            None => self.sdpa(),
        }
    }

    /// Stage 3: merge the heads `[B, H, L, d]` (at `off` in `attn`) to `[B, L, H, d]`, then the
    /// output projection.
    pub(super) fn record_output(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        attn: &wgpu::Buffer,
        off: u64,
    ) -> Result<()> {
        let Dims { b, l, h, d, e, .. } = self.dims;
        let st = self.fwd.mha.storage;
        copy::merge_heads(
            self.ctx,
            encoder,
            (binding(attn, off, st.bytes(b * h * l * d)), st),
            (binding(&self.merged, 0, self.merged.size()), st),
            [b, h, l, d],
        )?;
        let (out, off) = self.out_buffer();
        linear::record(
            self.ctx,
            encoder,
            (binding(&self.merged, 0, self.merged.size()), st),
            linear::Weights {
                w: &self.fwd.mha.w_o,
                b: self.fwd.mha.b_o.as_ref(),
                storage: st,
            },
            binding(out, off, st.bytes(b * l * e)),
            [b * l, e, h * d],
        )
    }

    /// Where the layer's output goes: the caller's buffer and offset, or ours.
    pub(super) fn out_buffer(&self) -> (&wgpu::Buffer, u64) {
        match (&self.out, &self.fwd.out) {
            (Some(b), _) => (b, 0),
            (None, Some(t)) => match &t.data {
                crate::tensor::TensorData::Gpu { buffer, offset, .. } => (buffer, *offset),
                crate::tensor::TensorData::Host(_) => unreachable!("checked in Pass::new"),
            },
            (None, None) => unreachable!("one output buffer"),
        }
    }

    /// Submit the three stages: in one submission, or (profiling) one each, waited for, with
    /// their wall times in seconds.
    async fn submit(&self) -> Result<(GpuOutput, [f64; 3])> {
        let ctx = self.ctx;
        let encoder = || {
            ctx.device()
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgpu-attention mha"),
                })
        };
        let sdpa = self.sdpa_forward();
        if !self.fwd.profile {
            let gpu = ctx
                .scoped(|| {
                    let mut enc = encoder();
                    self.record_heads(&mut enc, &self.upload_inputs())?;
                    let gpu = sdpa.record(ctx, &mut enc)?;
                    self.record_output(&mut enc, &gpu.output, gpu.output_offset)?;
                    ctx.queue().submit([enc.finish()]);
                    Ok(gpu)
                })
                .await?;
            return Ok((gpu, [0.0; 3]));
        }
        // Each stage submitted and waited for on its own.
        let t0 = web_time_now();
        ctx.scoped(|| {
            let mut enc = encoder();
            self.record_heads(&mut enc, &self.upload_inputs())?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .await?;
        ctx.wait()?;
        let t1 = web_time_now();
        let gpu = ctx
            .scoped(|| {
                let mut enc = encoder();
                let gpu = sdpa.record(ctx, &mut enc)?;
                ctx.queue().submit([enc.finish()]);
                Ok(gpu)
            })
            .await?;
        ctx.wait()?;
        let t2 = web_time_now();
        ctx.scoped(|| {
            let mut enc = encoder();
            self.record_output(&mut enc, &gpu.output, gpu.output_offset)?;
            ctx.queue().submit([enc.finish()]);
            Ok(())
        })
        .await?;
        ctx.wait()?;
        Ok((gpu, [t1 - t0, t2 - t1, web_time_now() - t2]))
    }

    /// Read the output (and the weights, if asked for) back; the readback counts as the
    /// output stage's time.
    async fn read_back(&self, gpu: &GpuOutput, mut times: [f64; 3]) -> Result<MhaOutput> {
        let Dims { b, l, s, h, e, .. } = self.dims;
        let t3 = web_time_now();
        let (out, off) = self.out_buffer();
        let output = self
            .ctx
            .read_as_f32(out, off, b * l * e, self.fwd.mha.storage)
            .await?;
        let output = Array3::from_shape_vec((b, l, e), output).expect("output length");
        times[2] += web_time_now() - t3;
        let (mut weights, mut avg_weights) = (None, None);
        if let Some(w) = &gpu.weights {
            let v = self.ctx.read_f32(w, 0, w.size()).await?;
            let w = Array4::from_shape_vec((b, h, l, s), v).expect("weights length");
            match self.fwd.need_weights {
                NeedWeights::Averaged => avg_weights = Some(w.mean_axis(Axis(1)).expect("heads")),
                _ => weights = Some(w),
            }
        }
        let timings = self.fwd.profile.then(|| MhaTimings {
            projections: std::time::Duration::from_secs_f64(times[0]),
            attention: std::time::Duration::from_secs_f64(times[1]),
            output: std::time::Duration::from_secs_f64(times[2]),
        });
        Ok(MhaOutput {
            output,
            weights,
            avg_weights,
            timings,
        })
    }
}

/// Seconds since an arbitrary origin (0 on the web, where profiling is not available).
fn web_time_now() -> f64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        static ORIGIN: OnceLock<std::time::Instant> = OnceLock::new();
        ORIGIN
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_secs_f64()
    }
    #[cfg(target_arch = "wasm32")]
    {
        0.0
    }
}

/// `[B, T, heads, d]` (a projection) to `[B, heads, T, d]`.
pub(super) fn split_heads(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    [b, t, heads, d]: [usize; 4],
    storage: Storage,
) -> Result<()> {
    let bytes = storage.bytes(b * t * heads * d);
    copy::split_heads(
        ctx,
        encoder,
        (binding(src, 0, bytes), storage),
        (binding(dst, 0, bytes), storage),
        [b, t, heads, d],
    )
}
