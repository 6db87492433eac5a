//! Attention on burn's tensors: the options, the forward on burn's buffers, and the backward
//! registered with burn's autodiff.

use std::sync::{Arc, Mutex};

use burn::backend::ir::TensorId;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Cube, DType};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, GradientCheckpointingStrategy, Tensor};
use burn_cubecl::tensor::CubeTensor;
use wgpu_attention::{Causal, Options, Path, Sdpa, UserMod};

use crate::cube::{self, Bound, Fused};
use crate::{Error, Result};

/// Attention on burn tensors with the crate's options: q `[B, Hq, L, E]`, k `[B, Hkv, S, E]`,
/// v `[B, Hkv, S, Ev]` (`Hkv` dividing `Hq`: grouped-query heads), the output `[B, Hq, L, Ev]`
/// in q's format. On an autodiff device the call is one node of burn's graph, whose backward is
/// the crate's fused backward (dq, dk, dv, and d(bias) when the bias is tracked).
///
/// ```no_run
/// use burn::tensor::{Distribution, Tensor};
/// use wgpu_attention_burn::{device_on, new_context, Attention, Causal};
/// let ctx = new_context()?;
/// let device = device_on(&ctx)?;
/// let q = Tensor::<4>::random([1, 8, 128, 64], Distribution::Normal(0.0, 1.0), &device);
/// let kv = Tensor::<4>::random([1, 2, 300, 64], Distribution::Normal(0.0, 1.0), &device);
/// let out = Attention::new().causal(Causal::BottomRight).softcap(30.0).forward(q, kv.clone(), kv)?;
/// assert_eq!(out.dims(), [1, 8, 128, 64]);
/// # Ok::<(), wgpu_attention_burn::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Attention {
    options: Options<'static>,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    path: Path,
}

impl Attention {
    /// No options: softmax(q kᵀ / sqrt(E)) v.
    pub fn new() -> Self {
        Self::default()
    }

    /// A causal mask, aligned top-left (PyTorch's `is_causal`) or bottom-right (burn's
    /// `is_causal`, FlashAttention's, a KV cache's); the same when L = S.
    pub fn causal(mut self, causal: Causal) -> Self {
        self.options.causal = causal;
        self
    }

    /// The softmax scale (default `1/sqrt(E)`).
    pub fn scale(mut self, scale: f64) -> Self {
        self.options.scale = Some(scale);
        self
    }

    /// A boolean mask in **burn's convention: `true` = masked** (the opposite of PyTorch's
    /// SDPA), broadcastable to `[B, Hq, L, S]`, on q's device. A row it masks entirely gives 0.
    pub fn mask(mut self, mask: Tensor<4, Bool>) -> Self {
        self.mask = Some(mask);
        self
    }

    /// An additive bias, broadcastable to `[B, Hq, L, S]`, on q's device, added after the
    /// softcap; a `-inf` entry masks its key. Its gradient flows where it is tracked.
    pub fn bias(mut self, bias: Tensor<4>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// Key lengths per batch: batch `b` attends keys `j < kv_lens[b]`.
    pub fn kv_lens(mut self, lens: &[usize]) -> Self {
        self.options.kv_lens = Some(lens.to_vec());
        self
    }

    /// A sliding window `(left, right)`, FlashAttention's `window_size` (`-1` unbounded).
    pub fn window(mut self, left: i64, right: i64) -> Self {
        self.options.window = Some((left, right));
        self
    }

    /// Keys `j < n` exempt from the window (attention sinks, StreamingLLM).
    pub fn sink_tokens(mut self, n: usize) -> Self {
        self.options.sink_tokens = n;
        self
    }

    /// The logit softcap `C`: `s = C tanh(s / C)` (Gemma 2).
    pub fn softcap(mut self, cap: f32) -> Self {
        self.options.softcap = Some(cap);
        self
    }

    /// ALiBi slopes, one per query head.
    pub fn alibi(mut self, slopes: &[f32]) -> Self {
        self.options.alibi = Some(slopes.to_vec());
        self
    }

    /// Sink logits, one per query head (gpt-oss); constants in burn's graph.
    pub fn sink_logits(mut self, logits: &[f32]) -> Self {
        self.options.sink_logits = Some(logits.to_vec());
        self
    }

    /// User WGSL `score_mod` / `mask_mod` (see [`UserMod`]); its captures are constants in
    /// burn's graph. The backward needs `score_mod_ds` where a `score_mod` is given.
    pub fn user_mod(mut self, m: UserMod<'static>) -> Self {
        self.options.user_mod = Some(m);
        self
    }

    /// Every option of the crate's [`Options`] at once (document ids among them), replacing
    /// those set before; the mask and bias here stay.
    pub fn options(mut self, options: Options<'static>) -> Self {
        self.options = options;
        self
    }

    /// Force the kernels' path ([`Path::Auto`] by default).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// The attention of q, k, v (tensors of one device made by [`device_on`](crate::device_on)
    /// or [`new_device`](crate::new_device)), written into a tensor burn allocates.
    pub fn forward(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Result<Tensor<4>> {
        let device = q.device();
        for (name, other) in [("k", k.device()), ("v", v.device())]
            .into_iter()
            .chain(self.bias.as_ref().map(|b| ("bias", b.device())))
            .chain(self.mask.as_ref().map(|m| ("mask", m.device())))
        {
            if other != device {
                return Err(Error::DifferentDevices {
                    name,
                    got: format!("{other:?}"),
                    want: format!("{device:?}"),
                });
            }
        }
        crate::device::wgpu_device(&device, "q")?;
        let bias = self.bias_with_mask();
        let call = Arc::new(Call {
            options: self.options.clone(),
            path: self.path,
        });
        macro_rules! on_autodiff {
            ($c:ty) => {{
                type A = Autodiff<Cube, $c>;
                let p = |t: Tensor<4>, name| {
                    t.try_into_primitive::<A>().map_err(|e| Error::NotWgpu {
                        name,
                        detail: format!("{e:?}"),
                    })
                };
                let bias = bias.map(|b| p(b, "bias")).transpose()?;
                let out = forward_autodiff::<$c>(call, p(q, "q")?, p(k, "k")?, p(v, "v")?, bias)?;
                Ok(Tensor::from_primitive::<A>(out))
            }};
        }
        match device.gradient_checkpointing_strategy() {
            None => {
                let p = |t: Tensor<4>, name| {
                    t.try_into_primitive::<Cube>().map_err(|e| Error::NotWgpu {
                        name,
                        detail: format!("{e:?}"),
                    })
                };
                let bias = bias.map(|b| p(b, "bias")).transpose()?.map(cube::resolve);
                let (q, k, v) = (
                    cube::resolve(p(q, "q")?),
                    cube::resolve(p(k, "k")?),
                    cube::resolve(p(v, "v")?),
                );
                let (out, _) = forward_cube(&call, q, k, v, bias, false)?;
                Ok(Tensor::from_primitive::<Cube>(cube::fuse(out)))
            }
            Some(GradientCheckpointingStrategy::Disabled) => on_autodiff!(NoCheckpointing),
            Some(GradientCheckpointingStrategy::Balanced) => on_autodiff!(BalancedCheckpointing),
        }
    }

    /// The bias the kernels add: the caller's, plus `-inf` where burn's mask is true (burn
    /// adds the bias after masking, which gives the same scores).
    fn bias_with_mask(&self) -> Option<Tensor<4>> {
        let masked = self.mask.as_ref().map(additive);
        match (self.bias.clone(), masked) {
            (Some(b), Some(m)) => Some(b + m),
            (b, m) => b.or(m),
        }
    }
}

/// The masks made additive most recently, by burn's id of the mask tensor (and whether it is
/// an autodiff device's): a mask passed again (by every layer of a forward, by every step of a
/// fixed padding) is converted once. burn's tensors are immutable and its ids are never given
/// twice, so an id names one mask's values for as long as it lives. Four at most: the oldest
/// goes first; masks over 64 MiB as f32 are not kept.
static ADDITIVE: Mutex<Vec<((TensorId, bool), Tensor<4>)>> = Mutex::new(Vec::new());
const ADDITIVE_KEPT: usize = 4;
/// The largest additive mask kept (bytes): larger ones are made on every call.
const ADDITIVE_BYTES: usize = 64 << 20;

/// burn's boolean mask (true = masked) as an additive f32 bias: 0, or `-inf` where masked.
fn additive(mask: &Tensor<4, Bool>) -> Tensor<4> {
    let device = mask.device();
    let make = || Tensor::<4>::zeros(mask.shape(), &device).mask_fill(mask.clone(), f32::NEG_INFINITY);
    let bytes = mask.shape().num_elements() * 4;
    let Some(key) = mask_id(mask)
        .filter(|_| bytes <= ADDITIVE_BYTES)
        .map(|id| (id, device.is_autodiff()))
    else {
        return make();
    };
    let mut kept = ADDITIVE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, bias)) = kept.iter().find(|(k, _)| *k == key) {
        return bias.clone();
    }
    let bias = make();
    if kept.len() == ADDITIVE_KEPT {
        kept.remove(0);
    }
    kept.push((key, bias.clone()));
    bias
}

/// burn's id of a mask on the cubecl runtimes (an autodiff device's bool tensors are the inner
/// backend's).
fn mask_id(mask: &Tensor<4, Bool>) -> Option<TensorId> {
    let m = mask.clone();
    match mask.device().gradient_checkpointing_strategy() {
        None => m.try_into_primitive::<Cube>().ok().map(|t| t.id),
        Some(GradientCheckpointingStrategy::Disabled) => m
            .try_into_primitive::<Autodiff<Cube, NoCheckpointing>>()
            .ok()
            .map(|t| t.id),
        Some(GradientCheckpointingStrategy::Balanced) => m
            .try_into_primitive::<Autodiff<Cube, BalancedCheckpointing>>()
            .ok()
            .map(|t| t.id),
    }
}

/// burn's attention call, `burn::tensor::module::attention`'s signature, on this crate's
/// kernels: `mask` true = masked, `attn_bias` added after the softcap, `is_causal` aligned
/// bottom-right (burn's rule), `scale` and `softcap` as burn has them. Unlike burn's, k and v
/// may have fewer heads than q (grouped-query attention), and on an autodiff device the
/// backward is fused.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    attn_bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Result<Tensor<4>> {
    let mut a = Attention::new();
    if options.is_causal {
        a = a.causal(Causal::BottomRight);
    }
    if let Some(s) = options.scale {
        a = a.scale(s);
    }
    if let Some(c) = options.softcap {
        a = a.softcap(c as f32);
    }
    if let Some(m) = mask {
        a = a.mask(m);
    }
    if let Some(b) = attn_bias {
        a = a.bias(b);
    }
    a.forward(q, k, v)
}

/// The options of one call, kept for its backward.
#[derive(Debug)]
pub(crate) struct Call {
    options: Options<'static>,
    path: Path,
}

impl Call {
    fn sdpa<'a>(&self, q: &'a Bound, k: &'a Bound, v: &'a Bound, bias: Option<&'a Bound>) -> Sdpa<'a> {
        let mut sdpa = Sdpa::new(q.view(), k.view(), v.view()).options(self.options.clone());
        if let Some(b) = bias {
            sdpa = sdpa.bias(b.view());
        }
        sdpa
    }
}

/// Every tensor on q's device.
fn same_device(q: &CubeTensor, others: &[(&'static str, Option<&CubeTensor>)]) -> Result<()> {
    for (name, t) in others {
        if let Some(t) = t {
            if t.device != q.device {
                return Err(Error::DifferentDevices {
                    name,
                    got: format!("{:?}", t.device),
                    want: format!("{:?}", q.device),
                });
            }
        }
    }
    Ok(())
}

/// The forward on cubecl tensors: the output in q's format, and the logsumexp (f32) when asked.
fn forward_cube(
    call: &Call,
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    bias: Option<CubeTensor>,
    lse: bool,
) -> Result<(CubeTensor, Option<CubeTensor>)> {
    same_device(&q, &[("k", Some(&k)), ("v", Some(&v)), ("bias", bias.as_ref())])?;
    let ctx = cube::context(&q, "q")?;
    let dtype = q.dtype;
    let (q, k, v) = (Bound::new(q, "q")?, Bound::new(k, "k")?, Bound::new(v, "v")?);
    let bias = bias.map(|b| Bound::new(b, "bias")).transpose()?;
    let sdpa = call.sdpa(&q, &k, &v, bias.as_ref()).path(call.path);
    let [b, hq, l, ev] = sdpa.problem()?.out_shape();
    let out = Bound::empty(&q.tensor, vec![b, hq, l, ev], dtype, "output")?;
    let lse = lse
        .then(|| Bound::empty(&q.tensor, vec![b, hq, l], DType::F32, "lse"))
        .transpose()?;
    let mut sdpa = sdpa.output_into(out.view());
    if let Some(lse) = &lse {
        sdpa = sdpa.return_lse().lse_into(lse.view());
    }
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    sdpa.record(&ctx, &mut encoder)?;
    ctx.queue().submit([encoder.finish()]);
    drop(sdpa);
    Ok((out.tensor, lse.map(|l| l.tensor)))
}

/// The gradients on cubecl tensors, each in its input's format and shape.
struct Grads {
    dq: CubeTensor,
    dk: CubeTensor,
    dv: CubeTensor,
    dbias: Option<CubeTensor>,
}

/// The backward on cubecl tensors, from the forward's output and logsumexp; d(bias) only where
/// `dbias` asks (a bias burn tracks).
fn backward_cube(
    call: &Call,
    [q, k, v, out, lse, dout]: [CubeTensor; 6],
    bias: Option<CubeTensor>,
    dbias: bool,
) -> Result<Grads> {
    let ctx = cube::context(&q, "q")?;
    let bound = |t: CubeTensor, name| Bound::new(t, name);
    let (q, k, v) = (bound(q, "q")?, bound(k, "k")?, bound(v, "v")?);
    let (out, lse, dout) = (bound(out, "output")?, bound(lse, "lse")?, bound(dout, "dout")?);
    let bias = bias.map(|b| bound(b, "bias")).transpose()?;
    let path = match call.path {
        Path::Unfused => Path::Unfused,
        _ => Path::Auto,
    };
    let mut backward = call
        .sdpa(&q, &k, &v, bias.as_ref())
        .backward(dout.view())
        .saved(out.view(), lse.view())
        .path(path);
    if !dbias {
        // A constant bias (burn's mask made additive, a bias without a gradient): its
        // gradient's pass over every logit is skipped.
        backward = backward.without_dbias();
    }
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let g = backward.record(&ctx, &mut encoder)?;
    // The gradients into tensors burn allocates, one copy each on the device.
    let mut into = |src: &wgpu_attention::wgpu::Buffer, like: &Bound, name| -> Result<CubeTensor> {
        let t = Bound::empty_padded(&like.tensor, like.shape(), like.tensor.dtype, name)?;
        let (dst, offset, _) = t.buffer();
        let bytes = like.storage.bytes(like.shape().iter().product());
        encoder.copy_buffer_to_buffer(src, 0, dst, offset, bytes);
        Ok(t.tensor)
    };
    let grads = Grads {
        dq: into(&g.dq, &q, "dq")?,
        dk: into(&g.dk, &k, "dk")?,
        dv: into(&g.dv, &v, "dv")?,
        dbias: match (&g.dbias, &bias) {
            (Some(d), Some(b)) => Some(into(d, b, "dbias")?),
            _ => None,
        },
    };
    ctx.queue().submit([encoder.finish()]);
    Ok(grads)
}

/// The forward on an autodiff device: one node of burn's graph over q, k, v (and the bias),
/// keeping q, k, v, the bias, the output and the logsumexp for the backward.
fn forward_autodiff<C: CheckpointStrategy>(
    call: Arc<Call>,
    q: AdTensor<C>,
    k: AdTensor<C>,
    v: AdTensor<C>,
    bias: Option<AdTensor<C>>,
) -> Result<AdTensor<C>> {
    let mut nodes = vec![q.node(), k.node(), v.node()];
    nodes.extend(bias.as_ref().map(|b| b.node()));
    let inner = |t: AdTensor<C>| t.into_primitive();
    let (q, k, v) = (inner(q), inner(k), inner(v));
    let bias = bias.map(inner);
    let resolved = |t: &Fused| cube::resolve(t.clone());
    let (out, lse) = forward_cube(
        &call,
        resolved(&q),
        resolved(&k),
        resolved(&v),
        bias.as_ref().map(resolved),
        true,
    )?;
    let out = cube::fuse(out);
    let lse = cube::fuse(lse.expect("asked for"));
    let state = Saved {
        q,
        k,
        v,
        bias,
        out: out.clone(),
        lse,
    };
    let backward = AttentionBackward { call };
    Ok(match nodes.len() {
        3 => finish::<C, 3>(backward, nodes.try_into().expect("3 nodes"), state, out),
        _ => finish::<C, 4>(backward, nodes.try_into().expect("4 nodes"), state, out),
    })
}

type AdTensor<C> = burn::backend::tensor::FloatTensor<Autodiff<Cube, C>>;

fn finish<C: CheckpointStrategy, const N: usize>(
    backward: AttentionBackward,
    nodes: [burn::backend::autodiff::ops::NodeGuard; N],
    state: Saved,
    out: Fused,
) -> AdTensor<C>
where
    AttentionBackward: Backward<Cube, N, State = Saved>,
{
    match backward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// What the backward keeps from the forward.
#[derive(Debug, Clone)]
struct Saved {
    q: Fused,
    k: Fused,
    v: Fused,
    bias: Option<Fused>,
    out: Fused,
    lse: Fused,
}

/// The attention's node in burn's graph: its backward is the crate's.
#[derive(Debug)]
struct AttentionBackward {
    call: Arc<Call>,
}

impl<const N: usize> Backward<Cube, N> for AttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<Cube>(&ops.node);
        let s = ops.state;
        let r = cube::resolve;
        // The fourth parent is the bias, where one is given; `None` when burn does not track it.
        let dbias = ops.parents.get(3).is_some_and(Option::is_some);
        let g = backward_cube(
            &self.call,
            [r(s.q), r(s.k), r(s.v), r(s.out), r(s.lse), r(dout)],
            s.bias.map(r),
            dbias,
        )
        // burn's backward returns nothing: a device error here is a panic with its message
        // (the call's options and shapes were checked by the forward).
        .unwrap_or_else(|e| panic!("wgpu-attention-burn: the attention backward failed: {e}"));
        let all = [Some(g.dq), Some(g.dk), Some(g.dv), g.dbias];
        for (parent, grad) in ops.parents.iter().zip(all) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<Cube>(node.id, cube::fuse(grad));
            }
        }
    }
}
