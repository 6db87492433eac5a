//! Multi-head attention with learned projections: the layer models call.
//!
//! `Y = concat_h(SDPA(X_q W_Qh^T + b_Qh, X_k W_Kh^T + b_Kh, X_v W_Vh^T + b_Vh)) W_O^T + b_O`,
//! PyTorch's `nn.MultiheadAttention(batch_first=True)` in inference (no dropout), plus
//! grouped-query heads (`num_kv_heads < num_heads`; 1 is multi-query).
//!
//! Everything runs on the GPU in one submission: the three input projections with the crate's
//! tiled matmul kernel (bias added in its epilogue), a strided copy that splits `[B, L, H, d]`
//! into heads `[B, H, L, d]`, [`Sdpa`] (fused, decode or unfused path, every mask), the merge
//! back to `[B, L, H·d]` and the output projection. Only the result (and the weights, when
//! asked for) is read back.
//!
//! ```no_run
//! use ndarray::Array3;
//! use wgpu_attention::{Causal, Context, MhaConfig, MhaWeights, MultiHeadAttention};
//! let ctx = Context::new_blocking()?;
//! let weights = MhaWeights::xavier_uniform(MhaConfig::new(512, 8), 0)?;
//! let mha = MultiHeadAttention::new(&ctx, &weights)?;
//! let x = Array3::<f32>::zeros((2, 128, 512));
//! let y = mha.forward(&x).causal(Causal::TopLeft).run_blocking(&ctx)?;
//! assert_eq!(y.output.shape(), &[2, 128, 512]);
//! # Ok::<(), wgpu_attention::Error>(())
//! ```

use ndarray::{Array1, Array2, Array3, Array4, Axis};
use wgpu::util::DeviceExt;

use crate::buffers::{binding, fits, Operand};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels::{matmul as mm, permute};
use crate::problem::Causal;
use crate::sdpa::{Path, Sdpa};
use crate::tensor::{Mask, Tensor};

/// The shape of a multi-head attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MhaConfig {
    /// Model width `E` (query input width and output width).
    pub d_model: usize,
    /// Query heads `H`; must divide `d_model` (head dim `d_k = d_model / H`).
    pub num_heads: usize,
    /// Key/value heads `G`; must divide `num_heads` (`G = H`: standard, `G = 1`: multi-query).
    pub num_kv_heads: usize,
    /// Width of the key input (cross-attention); `d_model` by default.
    pub kdim: usize,
    /// Width of the value input (cross-attention); `d_model` by default.
    pub vdim: usize,
    /// Whether the projections have biases (used by [`MhaWeights::xavier_uniform`]).
    pub bias: bool,
}

impl MhaConfig {
    /// `d_model` wide, `num_heads` heads, standard (not grouped) heads, self-attention widths,
    /// with biases.
    pub fn new(d_model: usize, num_heads: usize) -> Self {
        MhaConfig {
            d_model,
            num_heads,
            num_kv_heads: num_heads,
            kdim: d_model,
            vdim: d_model,
            bias: true,
        }
    }

    /// Grouped-query attention with `g` key/value heads (1: multi-query).
    pub fn kv_heads(mut self, g: usize) -> Self {
        self.num_kv_heads = g;
        self
    }

    /// Key and value input widths for cross-attention.
    pub fn kv_dims(mut self, kdim: usize, vdim: usize) -> Self {
        self.kdim = kdim;
        self.vdim = vdim;
        self
    }

    /// With or without projection biases.
    pub fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Head dim `d_k = d_model / num_heads` (also the value head dim).
    pub fn head_dim(&self) -> usize {
        self.d_model / self.num_heads.max(1)
    }

    /// Check the divisibility rules.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidConfig { reason });
        if self.d_model == 0
            || self.num_heads == 0
            || self.num_kv_heads == 0
            || self.kdim == 0
            || self.vdim == 0
        {
            return bad(format!("every dimension must be positive: {self:?}"));
        }
        if !self.d_model.is_multiple_of(self.num_heads) {
            return bad(format!(
                "num_heads = {} does not divide d_model = {}",
                self.num_heads, self.d_model
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_kv_heads = {} does not divide num_heads = {}",
                self.num_kv_heads, self.num_heads
            ));
        }
        Ok(())
    }

    /// Rows of W_K and W_V: `num_kv_heads · d_k`.
    fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }
}

/// Host copies of the layer's parameters, in PyTorch's `nn.Linear` layout (`[out, in]`, applied
/// as `x Wᵀ + b`).
#[derive(Debug, Clone, PartialEq)]
pub struct MhaWeights {
    /// The layer's shape.
    pub config: MhaConfig,
    /// `[H·d_k, d_model]`.
    pub w_q: Array2<f32>,
    /// `[G·d_k, kdim]`.
    pub w_k: Array2<f32>,
    /// `[G·d_k, vdim]`.
    pub w_v: Array2<f32>,
    /// `[d_model, H·d_k]`.
    pub w_o: Array2<f32>,
    /// `[H·d_k]`.
    pub b_q: Option<Array1<f32>>,
    /// `[G·d_k]`.
    pub b_k: Option<Array1<f32>>,
    /// `[G·d_k]`.
    pub b_v: Option<Array1<f32>>,
    /// `[d_model]`.
    pub b_o: Option<Array1<f32>>,
}

impl MhaWeights {
    /// PyTorch's initialisation: Xavier-uniform projections (jointly over the packed
    /// `in_proj_weight` when the widths allow packing, as PyTorch does), output projection
    /// uniform in `±1/sqrt(d_model)` (`nn.Linear`'s default), zero biases. Deterministic in `seed`.
    pub fn xavier_uniform(config: MhaConfig, seed: u64) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        config.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (e, kv) = (config.d_model, config.kv_width());
        let packed = config.kdim == e && config.vdim == e && kv == e;
        let mut uniform = |rows: usize, cols: usize, bound: f64| {
            Array2::from_shape_simple_fn((rows, cols), || rng.random_range(-bound..bound) as f32)
        };
        let xavier = |fan_in: usize, fan_out: usize| (6.0 / (fan_in + fan_out) as f64).sqrt();
        let (bq, bk, bv) = if packed {
            let b = xavier(e, 3 * e);
            (b, b, b)
        } else {
            (xavier(e, e), xavier(config.kdim, kv), xavier(config.vdim, kv))
        };
        let w_q = uniform(e, e, bq);
        let w_k = uniform(kv, config.kdim, bk);
        let w_v = uniform(kv, config.vdim, bv);
        let w_o = uniform(e, e, 1.0 / (e as f64).sqrt());
        let zeros = |n: usize| config.bias.then(|| Array1::zeros(n));
        Ok(MhaWeights {
            config,
            w_q,
            w_k,
            w_v,
            w_o,
            b_q: zeros(e),
            b_k: zeros(kv),
            b_v: zeros(kv),
            b_o: zeros(e),
        })
    }

    /// Load a PyTorch `nn.MultiheadAttention` state dict saved with safetensors
    /// (`safetensors.torch.save_file(mha.state_dict(), ...)`): `in_proj_weight [3E, E]` (or
    /// `q_proj_weight`, `k_proj_weight [E, kdim]`, `v_proj_weight [E, vdim]`), optional
    /// `in_proj_bias [3E]`, `out_proj.weight [E, E]`, optional `out_proj.bias [E]`. f32, f64,
    /// f16 and bf16 tensors are read (as f32). Missing or mis-shaped tensors are errors naming
    /// the key. `add_bias_kv` (`bias_k`, `bias_v`) is not supported. Grouped-query weights use
    /// the separate keys with `k_proj_weight` and `v_proj_weight` of `G · d_k` rows (and
    /// `in_proj_bias` of `E + 2 G d_k`); `G` is inferred.
    pub fn from_safetensors(bytes: &[u8], num_heads: usize) -> Result<Self> {
        Self::from_safetensors_prefixed(bytes, "", num_heads)
    }

    /// [`from_safetensors`](Self::from_safetensors) for a layer inside a larger model: every key
    /// is looked up as `prefix + key` (e.g. `"encoder.layers.0.self_attn."`).
    pub fn from_safetensors_prefixed(bytes: &[u8], prefix: &str, num_heads: usize) -> Result<Self> {
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| Error::WeightFile {
            reason: e.to_string(),
        })?;
        let get = |name: &str| -> Result<Option<(Vec<usize>, Vec<f32>)>> {
            let key = format!("{prefix}{name}");
            match st.tensor(&key) {
                Ok(t) => Ok(Some((t.shape().to_vec(), to_f32(&key, t.dtype(), t.data())?))),
                Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
                Err(e) => Err(Error::WeightFile {
                    reason: format!("{key}: {e}"),
                }),
            }
        };
        let need = |name: &str| -> Result<(Vec<usize>, Vec<f32>)> {
            get(name)?.ok_or_else(|| Error::MissingWeight {
                key: format!("{prefix}{name}"),
            })
        };
        for unsupported in ["bias_k", "bias_v"] {
            if get(unsupported)?.is_some() {
                return Err(Error::WeightFile {
                    reason: format!("{prefix}{unsupported}: add_bias_kv is not supported"),
                });
            }
        }
        let matrix = |name: &str, t: (Vec<usize>, Vec<f32>), expected: Option<[usize; 2]>| {
            let key = format!("{prefix}{name}");
            let (shape, data) = t;
            let ok = shape.len() == 2 && expected.is_none_or(|e| shape == e);
            if !ok {
                return Err(Error::WeightShape {
                    key,
                    expected: expected.map(|e| e.to_vec()).unwrap_or_default(),
                    actual: shape,
                });
            }
            Ok(Array2::from_shape_vec((shape[0], shape[1]), data).expect("safetensors length"))
        };
        let vector = |name: &str, t: (Vec<usize>, Vec<f32>), n: usize| {
            if t.0 != [n] {
                return Err(Error::WeightShape {
                    key: format!("{prefix}{name}"),
                    expected: vec![n],
                    actual: t.0,
                });
            }
            Ok(Array1::from_vec(t.1))
        };
        let (w_q, w_k, w_v, e) = if let Some(packed) = get("in_proj_weight")? {
            let rows = packed.0.first().copied().unwrap_or(0);
            let e = rows / 3;
            let w = matrix("in_proj_weight", packed, Some([3 * e.max(1), e.max(1)]))?;
            if rows % 3 != 0 || e == 0 {
                return Err(Error::WeightShape {
                    key: format!("{prefix}in_proj_weight"),
                    expected: vec![3 * e.max(1), e.max(1)],
                    actual: w.shape().to_vec(),
                });
            }
            let part = |i: usize| w.slice(ndarray::s![i * e..(i + 1) * e, ..]).to_owned();
            (part(0), part(1), part(2), e)
        } else {
            let w_q = matrix("q_proj_weight", need("q_proj_weight")?, None)?;
            let e = w_q.nrows();
            if w_q.ncols() != e {
                return Err(Error::WeightShape {
                    key: format!("{prefix}q_proj_weight"),
                    expected: vec![e, e],
                    actual: w_q.shape().to_vec(),
                });
            }
            let w_k = matrix("k_proj_weight", need("k_proj_weight")?, None)?;
            let w_v = matrix("v_proj_weight", need("v_proj_weight")?, None)?;
            // PyTorch's rows are E; fewer rows (G · d_k) mean grouped-query heads.
            let kv = w_k.nrows();
            for (name, w) in [("k_proj_weight", &w_k), ("v_proj_weight", &w_v)] {
                if w.nrows() != kv || w.nrows() > e || w.nrows() == 0 {
                    return Err(Error::WeightShape {
                        key: format!("{prefix}{name}"),
                        expected: vec![e, w.ncols()],
                        actual: w.shape().to_vec(),
                    });
                }
            }
            (w_q, w_k, w_v, e)
        };
        let w_o = matrix("out_proj.weight", need("out_proj.weight")?, Some([e, e]))?;
        let kv = w_k.nrows();
        let (b_q, b_k, b_v) = match get("in_proj_bias")? {
            Some(b) => {
                let b = vector("in_proj_bias", b, e + 2 * kv)?;
                let part = |from: usize, n: usize| Some(b.slice(ndarray::s![from..from + n]).to_owned());
                (part(0, e), part(e, kv), part(e + kv, kv))
            }
            None => (None, None, None),
        };
        if num_heads == 0 || !e.is_multiple_of(num_heads) {
            return Err(Error::InvalidConfig {
                reason: format!("num_heads = {num_heads} does not divide d_model = {e}"),
            });
        }
        let head_dim = e / num_heads;
        if !kv.is_multiple_of(head_dim) {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "{num_heads} heads of d_model = {e}: key/value projections of {kv} rows are not whole heads"
                ),
            });
        }
        let b_o = get("out_proj.bias")?
            .map(|b| vector("out_proj.bias", b, e))
            .transpose()?;
        let config = MhaConfig {
            d_model: e,
            num_heads,
            num_kv_heads: kv / head_dim,
            kdim: w_k.ncols(),
            vdim: w_v.ncols(),
            bias: b_q.is_some(),
        };
        let w = MhaWeights {
            config,
            w_q,
            w_k,
            w_v,
            w_o,
            b_q,
            b_k,
            b_v,
            b_o,
        };
        w.validate()?;
        Ok(w)
    }

    /// [`from_safetensors`](Self::from_safetensors) from a file.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_safetensors_file(path: impl AsRef<std::path::Path>, num_heads: usize) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::WeightFile {
            reason: format!("{}: {e}", path.display()),
        })?;
        Self::from_safetensors(&bytes, num_heads)
    }

    /// Check the config and every parameter's shape against it.
    pub fn validate(&self) -> Result<()> {
        let c = &self.config;
        c.validate()?;
        let (e, kv) = (c.d_model, c.kv_width());
        let m = |key: &str, w: &Array2<f32>, shape: [usize; 2]| {
            if w.shape() != shape {
                return Err(Error::WeightShape {
                    key: key.to_string(),
                    expected: shape.to_vec(),
                    actual: w.shape().to_vec(),
                });
            }
            Ok(())
        };
        m("w_q", &self.w_q, [e, e])?;
        m("w_k", &self.w_k, [kv, c.kdim])?;
        m("w_v", &self.w_v, [kv, c.vdim])?;
        m("w_o", &self.w_o, [e, e])?;
        for (key, b, n) in [
            ("b_q", &self.b_q, e),
            ("b_k", &self.b_k, kv),
            ("b_v", &self.b_v, kv),
            ("b_o", &self.b_o, e),
        ] {
            if let Some(b) = b {
                if b.len() != n {
                    return Err(Error::WeightShape {
                        key: key.to_string(),
                        expected: vec![n],
                        actual: b.shape().to_vec(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Little-endian tensor bytes to f32.
fn to_f32(key: &str, dtype: safetensors::Dtype, data: &[u8]) -> Result<Vec<f32>> {
    use safetensors::Dtype;
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::WeightFile {
                reason: format!("{key}: dtype {other:?} is not a float type"),
            })
        }
    })
}

/// Which attention weights [`MhaForward::run`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NeedWeights {
    /// None (the fused or decode path can run).
    #[default]
    No,
    /// Per head, `[B, H, L, S]`.
    PerHead,
    /// Averaged over heads, `[B, L, S]` (PyTorch's `average_attn_weights=True`).
    Averaged,
}

/// The result of [`MhaForward::run`].
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[B, L, d_model]`.
    pub output: Array3<f32>,
    /// `[B, H, L, S]` with [`NeedWeights::PerHead`].
    pub weights: Option<Array4<f32>>,
    /// `[B, L, S]` with [`NeedWeights::Averaged`].
    pub avg_weights: Option<Array3<f32>>,
    /// Wall-clock time of each stage, with [`MhaForward::profile`].
    pub timings: Option<MhaTimings>,
}

/// Stage times of one profiled forward pass (each stage submitted and waited for on its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MhaTimings {
    /// Input uploads, Q/K/V projections and the head split.
    pub projections: std::time::Duration,
    /// Scaled dot-product attention.
    pub attention: std::time::Duration,
    /// Head merge, output projection and readback.
    pub output: std::time::Duration,
}

/// A multi-head attention layer whose parameters live on the GPU.
#[derive(Debug)]
pub struct MultiHeadAttention {
    config: MhaConfig,
    w_q: wgpu::Buffer,
    w_k: wgpu::Buffer,
    w_v: wgpu::Buffer,
    w_o: wgpu::Buffer,
    b_q: Option<wgpu::Buffer>,
    b_k: Option<wgpu::Buffer>,
    b_v: Option<wgpu::Buffer>,
    b_o: Option<wgpu::Buffer>,
}

impl MultiHeadAttention {
    /// Validate `weights` and upload them.
    pub fn new(ctx: &Context, weights: &MhaWeights) -> Result<Self> {
        weights.validate()?;
        let max = ctx.max_binding();
        for (name, w) in [
            ("w_q", &weights.w_q),
            ("w_k", &weights.w_k),
            ("w_v", &weights.w_v),
            ("w_o", &weights.w_o),
        ] {
            fits(name, w.len() as u64 * 4, max, "max_storage_buffer_binding_size")?;
        }
        let upload = |label: &str, data: &[f32]| {
            ctx.device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytemuck::cast_slice(data),
                    usage: wgpu::BufferUsages::STORAGE,
                })
        };
        let mat = |label: &str, w: &Array2<f32>| {
            upload(
                label,
                &w.as_standard_layout().to_owned().into_raw_vec_and_offset().0,
            )
        };
        let vec = |label: &str, b: &Option<Array1<f32>>| b.as_ref().map(|b| upload(label, &b.to_vec()));
        Ok(MultiHeadAttention {
            config: weights.config,
            w_q: mat("w_q", &weights.w_q),
            w_k: mat("w_k", &weights.w_k),
            w_v: mat("w_v", &weights.w_v),
            w_o: mat("w_o", &weights.w_o),
            b_q: vec("b_q", &weights.b_q),
            b_k: vec("b_k", &weights.b_k),
            b_v: vec("b_v", &weights.b_v),
            b_o: vec("b_o", &weights.b_o),
        })
    }

    /// The layer's shape.
    pub fn config(&self) -> &MhaConfig {
        &self.config
    }

    /// A forward pass over `query` `[B, L, d_model]` (host array/slice or GPU buffer). Without
    /// [`key_value`](MhaForward::key_value) it is self-attention (keys and values from `query`).
    pub fn forward<'a>(&'a self, query: impl Into<Tensor<'a>>) -> MhaForward<'a> {
        MhaForward {
            mha: self,
            query: query.into(),
            key: None,
            value: None,
            query_heads: None,
            value_heads: None,
            causal: Causal::None,
            mask: None,
            bias: None,
            kv_lens: None,
            need_weights: NeedWeights::No,
            path: Path::Auto,
            profile: false,
        }
    }
}

/// Builder of one forward pass of a [`MultiHeadAttention`]; finish with
/// [`run`](MhaForward::run) or [`run_blocking`](MhaForward::run_blocking).
#[derive(Debug, Clone)]
pub struct MhaForward<'a> {
    mha: &'a MultiHeadAttention,
    query: Tensor<'a>,
    key: Option<Tensor<'a>>,
    value: Option<Tensor<'a>>,
    query_heads: Option<Tensor<'a>>,
    value_heads: Option<Tensor<'a>>,
    causal: Causal,
    mask: Option<Mask<'a>>,
    bias: Option<Tensor<'a>>,
    kv_lens: Option<Vec<usize>>,
    need_weights: NeedWeights,
    path: Path,
    profile: bool,
}

/// Shapes of one forward pass, validated.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    l: usize,
    s: usize,
    h: usize,
    g: usize,
    d: usize,
    e: usize,
}

impl<'a> MhaForward<'a> {
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

    /// Use these value heads `[B or 1, G, S, d_k]` instead of projecting the value input.
    pub fn value_heads(mut self, v: impl Into<Tensor<'a>>) -> Self {
        self.value_heads = Some(v.into());
        self
    }

    /// Causal masking (see [`Causal`]).
    pub fn causal(mut self, causal: Causal) -> Self {
        self.causal = causal;
        self
    }

    /// Boolean mask broadcastable to `[B, H, L, S]`; **true = may attend** (PyTorch's
    /// `nn.MultiheadAttention` uses the opposite convention: negate its masks).
    pub fn mask(mut self, mask: impl Into<Mask<'a>>) -> Self {
        self.mask = Some(mask.into());
        self
    }

    /// Additive bias broadcastable to `[B, H, L, S]` (PyTorch's float `attn_mask`).
    pub fn bias(mut self, bias: impl Into<Tensor<'a>>) -> Self {
        self.bias = Some(bias.into());
        self
    }

    /// Per-batch key lengths (a key padding mask that masks each sequence's tail).
    pub fn kv_lens(mut self, lens: &[usize]) -> Self {
        self.kv_lens = Some(lens.to_vec());
        self
    }

    /// Return the attention weights, per head or averaged (runs the unfused path).
    pub fn need_weights(mut self, w: NeedWeights) -> Self {
        self.need_weights = w;
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
    fn dims(&self) -> Result<Dims> {
        let c = self.mha.config;
        c.validate()?;
        let (h, g, d, e) = (c.num_heads, c.num_kv_heads, c.head_dim(), c.d_model);
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
        let [kb, s, kw] = key.dims::<3>(kname)?;
        if kb != b || kw != c.kdim {
            return Err(Error::ShapeMismatch {
                tensor: kname,
                expected: vec![b, s, c.kdim],
                actual: key.shape().to_vec(),
            });
        }
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
            biggest as u64 * 4,
            u32::MAX as u64,
            "u32 element indices",
        )?;
        Ok(Dims { b, l, s, h, g, d, e })
    }

    /// The attention call's options on `sdpa`.
    fn configure<'s>(&'s self, sdpa: Sdpa<'s>) -> Sdpa<'s> {
        let mut sdpa = sdpa.causal(self.causal).path(self.path);
        if let Some(m) = &self.mask {
            sdpa = sdpa.mask(m.clone());
        }
        if let Some(bias) = &self.bias {
            sdpa = sdpa.bias(bias.clone());
        }
        if let Some(lens) = &self.kv_lens {
            sdpa = sdpa.kv_lens(lens);
        }
        if self.need_weights != NeedWeights::No {
            sdpa = sdpa.return_weights();
        }
        sdpa
    }

    /// Run on the GPU and read the output (and the weights, if asked for) back.
    pub async fn run(&self, ctx: &Context) -> Result<MhaOutput> {
        let dims = self.dims()?;
        let Dims { b, l, s, h, g, d, e } = dims;
        let c = self.mha.config;
        let max = ctx.max_binding();
        for (what, n) in [
            ("query projection", b * l * e),
            ("key/value projection", b * s * g * d),
            ("attention output", b * l * h * d),
        ] {
            fits(what, n as u64 * 4, max, "max_storage_buffer_binding_size")?;
        }
        let tiles = ctx.limits().max_compute_workgroups_per_dimension as usize * mm::TILE as usize;
        if b * l.max(s) > tiles {
            return Err(Error::TooLargeForDevice {
                what: format!("projection of {} rows", b * l.max(s)),
                bytes: 0,
                limit_name: "max_compute_workgroups_per_dimension",
                limit: tiles as u64,
                hint: " (rows = batch x sequence, 64 per workgroup)",
            });
        }
        // The attention problem is validated before any GPU work too.
        let heads_q = [b, h, l, d];
        let heads_kv = [b, g, s, d];
        let empty: &[f32] = &[];
        let placeholder = Sdpa::new(
            Tensor::from_slice(empty, &heads_q),
            Tensor::from_slice(empty, &heads_kv),
            Tensor::from_slice(empty, &heads_kv),
        );
        let check = self.configure(placeholder);
        check.problem()?;
        check.resolved_path(ctx)?;

        let device = ctx.device();
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let buffer = |label: &str, elems: usize| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: (elems.max(1) * 4) as u64,
                usage,
                mapped_at_creation: false,
            })
        };
        let query_in = Operand::check(ctx, "query", &self.query)?;
        let key_in = self
            .key
            .as_ref()
            .map(|k| Operand::check(ctx, "key", k))
            .transpose()?;
        let value_in = self
            .value
            .as_ref()
            .map(|v| Operand::check(ctx, "value", v))
            .transpose()?;
        let qh_in = self
            .query_heads
            .as_ref()
            .map(|q| Operand::check(ctx, "query_heads", q))
            .transpose()?;
        let vh_in = self
            .value_heads
            .as_ref()
            .map(|v| Operand::check(ctx, "value_heads", v))
            .transpose()?;

        let qh = buffer("query heads", b * h * l * d);
        let kh = buffer("key heads", b * g * s * d);
        let vh = buffer("value heads", b * g * s * d);
        let merged = buffer("merged heads", b * l * h * d);
        let out = buffer("mha output", b * l * e);
        let dummy = buffer("dummy", 4);
        let mut times = [0.0f64; 3];

        // Stage 1: uploads, projections, head split.
        let stage1 = |encoder: &mut wgpu::CommandEncoder| -> Result<()> {
            let query = query_in.upload(ctx, "query");
            let key = key_in.as_ref().map(|k| k.upload(ctx, "key"));
            let value = value_in.as_ref().map(|v| v.upload(ctx, "value"));
            let key_b = key.as_ref().map(|k| k.binding()).unwrap_or(query.binding());
            let value_b = value.as_ref().map(|v| v.binding()).unwrap_or(query.binding());
            // Heads [B, n, T, d]: given (broadcast over the batch if its batch is 1), or the
            // projection of `x` [B, T, in_dim], split.
            let mut heads = |given: Option<(&Operand, &Tensor, &'static str)>,
                             x: wgpu::BufferBinding<'_>,
                             (w, bias): (&wgpu::Buffer, Option<&wgpu::Buffer>),
                             dst: &wgpu::Buffer,
                             [t, n, in_dim]: [usize; 3]|
             -> Result<()> {
                match given {
                    Some((op, tensor, name)) => {
                        let given = op.upload(ctx, name);
                        let bstride = if tensor.shape()[0] == 1 { 0 } else { n * t * d };
                        permute::record(
                            ctx,
                            encoder,
                            given.binding(),
                            binding(dst, 0, dst.size()),
                            [b, n, t, d],
                            [bstride, t * d, d, 1],
                        )
                    }
                    None => {
                        let proj = buffer("projection", b * t * n * d);
                        project(ctx, encoder, x, w, bias, &proj, [b * t, n * d, in_dim], &dummy)?;
                        split_heads(ctx, encoder, &proj, dst, [b, t, n, d])
                    }
                }
            };
            let m = &self.mha;
            let given_q = qh_in.as_ref().zip(self.query_heads.as_ref());
            let given_v = vh_in.as_ref().zip(self.value_heads.as_ref());
            heads(
                given_q.map(|(o, t)| (o, t, "query_heads")),
                query.binding(),
                (&m.w_q, m.b_q.as_ref()),
                &qh,
                [l, h, e],
            )?;
            heads(None, key_b, (&m.w_k, m.b_k.as_ref()), &kh, [s, g, c.kdim])?;
            heads(
                given_v.map(|(o, t)| (o, t, "value_heads")),
                value_b,
                (&m.w_v, m.b_v.as_ref()),
                &vh,
                [s, g, c.vdim],
            )?;
            Ok(())
        };
        // Stage 2: attention.
        let sdpa = self.configure(Sdpa::new(
            Tensor::from_buffer(&qh, 0, &heads_q),
            Tensor::from_buffer(&kh, 0, &heads_kv),
            Tensor::from_buffer(&vh, 0, &heads_kv),
        ));
        let stage2 = |encoder: &mut wgpu::CommandEncoder| sdpa.record(ctx, encoder);
        // Stage 3: merge heads [B, H, L, d] -> [B, L, H, d], output projection.
        let stage3 = |encoder: &mut wgpu::CommandEncoder, attn: &wgpu::Buffer, off: u64| -> Result<()> {
            permute::record(
                ctx,
                encoder,
                binding(attn, off, (b * h * l * d) as u64 * 4),
                binding(&merged, 0, merged.size()),
                [b, l, h, d],
                [h * l * d, d, l * d, 1],
            )?;
            project(
                ctx,
                encoder,
                binding(&merged, 0, merged.size()),
                &self.mha.w_o,
                self.mha.b_o.as_ref(),
                &out,
                [b * l, e, h * d],
                &dummy,
            )
        };
        let encoder = || {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("wgpu-attention mha"),
            })
        };
        let gpu = if self.profile {
            let t0 = web_time_now();
            ctx.scoped(|| {
                let mut enc = encoder();
                stage1(&mut enc)?;
                ctx.queue().submit([enc.finish()]);
                Ok(())
            })
            .await?;
            ctx.wait()?;
            let t1 = web_time_now();
            let gpu = ctx
                .scoped(|| {
                    let mut enc = encoder();
                    let gpu = stage2(&mut enc)?;
                    ctx.queue().submit([enc.finish()]);
                    Ok(gpu)
                })
                .await?;
            ctx.wait()?;
            let t2 = web_time_now();
            ctx.scoped(|| {
                let mut enc = encoder();
                stage3(&mut enc, &gpu.output, gpu.output_offset)?;
                ctx.queue().submit([enc.finish()]);
                Ok(())
            })
            .await?;
            ctx.wait()?;
            times = [t1 - t0, t2 - t1, web_time_now() - t2];
            gpu
        } else {
            ctx.scoped(|| {
                let mut enc = encoder();
                stage1(&mut enc)?;
                let gpu = stage2(&mut enc)?;
                stage3(&mut enc, &gpu.output, gpu.output_offset)?;
                ctx.queue().submit([enc.finish()]);
                Ok(gpu)
            })
            .await?
        };
        let t3 = web_time_now();
        let output = ctx.read_f32(&out, 0, (b * l * e) as u64 * 4).await?;
        let output = Array3::from_shape_vec((b, l, e), output).expect("output length");
        if self.profile {
            times[2] += web_time_now() - t3;
        }
        let (mut weights, mut avg_weights) = (None, None);
        if let Some(w) = &gpu.weights {
            let v = ctx.read_f32(w, 0, w.size()).await?;
            let w = Array4::from_shape_vec((b, h, l, s), v).expect("weights length");
            match self.need_weights {
                NeedWeights::Averaged => avg_weights = Some(w.mean_axis(Axis(1)).expect("heads")),
                _ => weights = Some(w),
            }
        }
        let timings = self.profile.then(|| MhaTimings {
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

    /// Blocking version of [`run`](MhaForward::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<MhaOutput> {
        pollster::block_on(self.run(ctx))
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

/// Record `out[rows, n] = x[rows, k] · Wᵀ + b` with the tiled matmul kernel (bias in its
/// epilogue). `mnk` = `[rows, n, k]`.
#[allow(clippy::too_many_arguments)] // each is a distinct operand
fn project(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: wgpu::BufferBinding<'_>,
    w: &wgpu::Buffer,
    b: Option<&wgpu::Buffer>,
    out: &wgpu::Buffer,
    mnk: [usize; 3],
    dummy: &wgpu::Buffer,
) -> Result<()> {
    let [m, n, k] = mnk;
    mm::Matmul {
        a: x,
        b: w.as_entire_buffer_binding(),
        bias: b.map(|b| b.as_entire_buffer_binding()),
        c: binding(out, 0, (m * n) as u64 * 4),
        params: mm::Params {
            m: m as u32,
            n: n as u32,
            k: k as u32,
            heads: 1,
            group: 1,
            a_row: k as u32,
            b_row: k as u32,
            c_row: n as u32,
            alpha: 1.0,
            ..Default::default()
        },
        batch: 1,
        trans_b: true,
    }
    .record(ctx, encoder, dummy)
}

/// `[B, T, heads, d]` (a projection) to `[B, heads, T, d]`.
fn split_heads(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    [b, t, heads, d]: [usize; 4],
) -> Result<()> {
    permute::record(
        ctx,
        encoder,
        binding(src, 0, (b * t * heads * d) as u64 * 4),
        binding(dst, 0, (b * t * heads * d) as u64 * 4),
        [b, heads, t, d],
        [t * heads * d, d, heads * d, 1],
    )
}
