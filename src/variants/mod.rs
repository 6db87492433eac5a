//! The literature's attention variants on the GPU, beside scaled dot-product attention:
//! Luong's general (multiplicative) score, Bahdanau's additive score, a low-rank factorised V,
//! and two ways around the O(L·S) cost, Nyström landmarks and Linformer's projections.
//!
//! | kind | score / output | GPU stages (`record.rs`) | masks |
//! |---|---|---|---|
//! | [`VariantKind::General`] | `scale · qᵢᵀ W kⱼ` | matmul `Q W`, then SDPA | all |
//! | [`VariantKind::Additive`] | `scale · Σₐ uₐ tanh((W_q qᵢ)ₐ + (W_k kⱼ)ₐ + bₐ)` | two projections, then the attention with the score as a user `score_mod` reading them (every path) | all |
//! | [`VariantKind::LowRankV`] | `(softmax(scale · Q Kᵀ) U) A` | SDPA with U as values, matmul by A | all |
//! | [`VariantKind::Nystrom`] | `F · Z · (B' V)`, `Z ≈ pinv(A)` | landmark means, three softmaxes, the pseudo-inverse iteration | none |
//! | [`VariantKind::Linformer`] | `softmax(scale · Q (E_p K)ᵀ) (F_p V)` | two sequence projections, then SDPA | none |
//!
//! [`Variant`] is the one entry point; [`VariantParams`] holds each kind's parameters (from
//! arrays or a safetensors file); [`crate::reference::variant`] is the f64 reference.

use std::str::FromStr;

use ndarray::{Array1, Array2, Array4};

use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::options::Options;
use crate::sdpa::Path;
use crate::storage::Storage;
use crate::tensor::Tensor;

mod record;

/// Which variant.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VariantKind {
    /// Luong's general (multiplicative) score `qᵢᵀ W kⱼ`, W `[E, E]` shared by the heads.
    General,
    /// Bahdanau's additive score (Luong's "concat") `Σₐ uₐ tanh((W_q qᵢ)ₐ + (W_k kⱼ)ₐ + bₐ)`.
    Additive,
    /// Scaled dot-product attention with V given as factors `U A` (never formed).
    LowRankV,
    /// Nyströmformer's landmark approximation of softmax attention (linear in L and S).
    Nystrom,
    /// Linformer: keys and values projected along the sequence to `k_p` rows.
    Linformer,
}

impl VariantKind {
    /// Every kind.
    pub const ALL: [VariantKind; 5] = [
        VariantKind::General,
        VariantKind::Additive,
        VariantKind::LowRankV,
        VariantKind::Nystrom,
        VariantKind::Linformer,
    ];

    /// The name the CLI uses: `general`, `additive`, `lowrank-v`, `nystrom`, `linformer`.
    pub fn name(self) -> &'static str {
        match self {
            VariantKind::General => "general",
            VariantKind::Additive => "additive",
            VariantKind::LowRankV => "lowrank-v",
            VariantKind::Nystrom => "nystrom",
            VariantKind::Linformer => "linformer",
        }
    }

    /// The default scale for head dim `e`: 1 for the general and additive scores (Luong's and
    /// Bahdanau's are unscaled), `1/√E` for the others.
    pub fn default_scale(self, e: usize) -> f64 {
        match self {
            VariantKind::General | VariantKind::Additive => 1.0,
            _ => 1.0 / (e as f64).sqrt(),
        }
    }

    /// Whether masks (boolean mask, bias, causal, key lengths) apply.
    pub fn takes_masks(self) -> bool {
        !matches!(self, VariantKind::Nystrom | VariantKind::Linformer)
    }
}

impl FromStr for VariantKind {
    type Err = Error;
    /// Parses the names [`VariantKind::name`] gives.
    fn from_str(s: &str) -> Result<Self> {
        VariantKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "variant",
                name: s.to_string(),
                expected: "general, additive, lowrank-v, nystrom, linformer",
            })
    }
}

/// The parameters of a variant (f32 on the host; uploaded per call).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub enum VariantParams {
    /// Luong's general score.
    General {
        /// `[E, E]`: score `qᵀ W k`.
        w: Array2<f32>,
    },
    /// Bahdanau's additive score.
    Additive {
        /// `[A, E]`, applied to the queries.
        w_q: Array2<f32>,
        /// `[A, E]`, applied to the keys.
        w_k: Array2<f32>,
        /// `[A]`, the score's weights.
        u: Array1<f32>,
        /// `[A]`, optional (zero).
        b: Option<Array1<f32>>,
    },
    /// Low-rank V: the value input holds U `[B, Hkv, S, r]`.
    LowRankV {
        /// `[r, Ev]`, shared by batch and heads.
        a: Array2<f32>,
    },
    /// Nyström: the number of landmarks `m`, `1 ≤ m ≤ min(L, S)`.
    Nystrom {
        /// Landmarks (segment means of the queries and of the keys).
        landmarks: usize,
    },
    /// Linformer's sequence projections.
    Linformer {
        /// `[k_p, S]`, applied to the keys.
        e: Array2<f32>,
        /// `[k_p, S]`, applied to the values.
        f: Array2<f32>,
    },
}

impl VariantParams {
    /// The kind these parameters are for.
    pub fn kind(&self) -> VariantKind {
        match self {
            VariantParams::General { .. } => VariantKind::General,
            VariantParams::Additive { .. } => VariantKind::Additive,
            VariantParams::LowRankV { .. } => VariantKind::LowRankV,
            VariantParams::Nystrom { .. } => VariantKind::Nystrom,
            VariantParams::Linformer { .. } => VariantKind::Linformer,
        }
    }

    /// The `[rows, len]` matrix whose row `t` averages elements `⌊t·len/rows⌋ ..
    /// ⌊(t+1)·len/rows⌋ − 1` (Nyström's landmarks; a Linformer E_p / F_p whose output means
    /// something without training). `1 ≤ rows ≤ len`.
    pub fn segment_means(rows: usize, len: usize) -> Array2<f32> {
        // 1/n rounded once from f64 is 1/n correctly rounded in f32.
        segment_means_f64(rows, len).mapv(|x| x as f32)
    }

    /// Load the parameters of `kind` from safetensors bytes (f32, f64, f16 or bf16 tensors):
    /// general `w`; additive `w_q`, `w_k`, `u`, optional `b`; lowrank-v `a`; linformer `e`,
    /// `f`. Nyström has no parameter file (give [`VariantParams::Nystrom`] directly).
    /// Shapes are checked against the inputs when the variant runs.
    pub fn from_safetensors(kind: VariantKind, bytes: &[u8]) -> Result<Self> {
        use crate::mha::weights::{parse, tensor_f32};
        let st = parse(bytes)?;
        let get = |key: &str| Ok::<_, Error>(tensor_f32(&st, key)?.map(|(shape, _, data)| (shape, data)));
        let need = |key: &str| get(key)?.ok_or_else(|| Error::MissingWeight { key: key.into() });
        let matrix = |key: &str, (shape, data): (Vec<usize>, Vec<f32>)| match shape[..] {
            [r, c] => Ok(Array2::from_shape_vec((r, c), data).expect("safetensors length")),
            _ => Err(Error::WeightShape {
                key: key.into(),
                expected: vec![],
                actual: shape,
            }),
        };
        let vector = |key: &str, (shape, data): (Vec<usize>, Vec<f32>)| match shape[..] {
            [_] => Ok(Array1::from_vec(data)),
            _ => Err(Error::WeightShape {
                key: key.into(),
                expected: vec![],
                actual: shape,
            }),
        };
        Ok(match kind {
            VariantKind::General => VariantParams::General {
                w: matrix("w", need("w")?)?,
            },
            VariantKind::Additive => VariantParams::Additive {
                w_q: matrix("w_q", need("w_q")?)?,
                w_k: matrix("w_k", need("w_k")?)?,
                u: vector("u", need("u")?)?,
                b: get("b")?.map(|t| vector("b", t)).transpose()?,
            },
            VariantKind::LowRankV => VariantParams::LowRankV {
                a: matrix("a", need("a")?)?,
            },
            VariantKind::Linformer => VariantParams::Linformer {
                e: matrix("e", need("e")?)?,
                f: matrix("f", need("f")?)?,
            },
            VariantKind::Nystrom => {
                return Err(Error::VariantOption {
                    variant: "nystrom",
                    option: "params",
                    reason: "Nyström has no learned parameters; give the number of landmarks".into(),
                })
            }
        })
    }

    /// [`from_safetensors`](Self::from_safetensors) from a file.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_safetensors_file(kind: VariantKind, path: impl AsRef<std::path::Path>) -> Result<Self> {
        let keys = ["w", "w_q", "w_k", "u", "b", "a", "e", "f"].map(String::from);
        Self::from_safetensors(kind, &crate::mha::weights::read_file(path.as_ref(), &keys)?)
    }

    /// Validate these parameters and `options` against the input shapes (q `[B, Hq, L, E]`,
    /// k `[B, Hkv, S, E]`, v `[B, Hkv, S, Ev]`; for lowrank-v v holds U `[B, Hkv, S, r]`) and
    /// return the dimensions (no GPU work). `weights`: the caller asks for the attention weights.
    pub(crate) fn check(
        &self,
        q: &[usize],
        k: &[usize],
        v: &[usize],
        options: &Options,
        weights: bool,
        pinv_iters: usize,
    ) -> Result<Dims> {
        let p = options.problem(q, k, v)?;
        let kind = self.kind();
        check_options(kind, options, weights)?;
        let (ev_out, inner) = self.check_params(&p, pinv_iters)?;
        let (e, s, l) = (p.head_dim, p.seq_kv, p.seq_q);
        Ok(Dims {
            batch: p.batch,
            hq: p.q_heads,
            hkv: p.kv_heads,
            l,
            s,
            e,
            ev: p.head_dim_v,
            ev_out,
            inner,
            scale: options.scale.unwrap_or_else(|| kind.default_scale(e)),
        })
    }

    /// Check the parameters' shapes against the problem: the output's head dim and the
    /// variant's inner dimension (a, r, m or k_p).
    fn check_params(&self, p: &crate::problem::Problem, pinv_iters: usize) -> Result<(usize, usize)> {
        let (e, s, l) = (p.head_dim, p.seq_kv, p.seq_q);
        let kind = self.kind();
        let mismatch = |tensor: &'static str, expected: Vec<usize>, actual: &[usize]| {
            if expected.as_slice() != actual {
                return Err(Error::ShapeMismatch {
                    tensor,
                    expected,
                    actual: actual.to_vec(),
                });
            }
            Ok(())
        };
        let refuse = |option: &'static str, reason: &str| Error::VariantOption {
            variant: kind.name(),
            option,
            reason: reason.into(),
        };
        let mut ev_out = p.head_dim_v;
        let mut inner = 0;
        match self {
            VariantParams::General { w } => mismatch("w", vec![e, e], w.shape())?,
            VariantParams::Additive { w_q, w_k, u, b } => {
                let a = w_q.nrows();
                if a == 0 {
                    return Err(Error::ZeroSized {
                        tensor: "w_q",
                        shape: w_q.shape().to_vec(),
                    });
                }
                mismatch("w_q", vec![a, e], w_q.shape())?;
                mismatch("w_k", vec![a, e], w_k.shape())?;
                mismatch("u", vec![a], u.shape())?;
                if let Some(b) = b {
                    mismatch("b", vec![a], b.shape())?;
                }
                inner = a;
            }
            VariantParams::LowRankV { a } => {
                let r = p.head_dim_v;
                if a.ncols() == 0 {
                    return Err(Error::ZeroSized {
                        tensor: "a",
                        shape: a.shape().to_vec(),
                    });
                }
                mismatch("a", vec![r, a.ncols()], a.shape())?;
                ev_out = a.ncols();
                inner = r;
            }
            VariantParams::Nystrom { landmarks } => {
                let m = *landmarks;
                if m == 0 || m > l.min(s) {
                    return Err(refuse(
                        "landmarks",
                        &format!("m = {m} is out of range 1 ..= min(L, S) = {}", l.min(s)),
                    ));
                }
                if pinv_iters == 0 {
                    return Err(refuse("pinv_iters", "at least one iteration is needed"));
                }
                inner = m;
            }
            VariantParams::Linformer { e: ep, f: fp } => {
                let kp = ep.nrows();
                if kp == 0 {
                    return Err(Error::ZeroSized {
                        tensor: "e",
                        shape: ep.shape().to_vec(),
                    });
                }
                mismatch("e", vec![kp, s], ep.shape())?;
                mismatch("f", vec![kp, s], fp.shape())?;
                inner = kp;
            }
        }
        Ok((ev_out, inner))
    }
}

/// Refuse the masks (and the weights) for the variants that cannot take them.
fn check_options(kind: VariantKind, options: &Options, weights: bool) -> Result<()> {
    let refuse = |option: &'static str, reason: &str| Error::VariantOption {
        variant: kind.name(),
        option,
        reason: reason.into(),
    };
    // The softcap and ALiBi are modifiers of the scaled dot-product score: the variants' scores
    // are their own.
    let why = "the softcap and ALiBi modify the scaled dot-product score, which this variant replaces";
    if options.softcap.is_some() {
        return Err(refuse("softcap", why));
    }
    if options.alibi.is_some() {
        return Err(refuse("alibi", why));
    }
    if options.sink_logits.is_some() {
        return Err(refuse(
            "sink_logits",
            "sink logits join the scaled dot-product softmax, which this variant replaces",
        ));
    }
    if options.user_mod.is_some() {
        return Err(refuse(
            "user_mod",
            "user score and mask functions act on the scaled dot-product attention only",
        ));
    }
    if options.doc_ids.is_some() {
        return Err(refuse(
            "doc_ids",
            "document ids are a mask of the scaled dot-product attention only (give a boolean mask where this variant takes one)",
        ));
    }
    if !kind.takes_masks() {
        let why = match kind {
                VariantKind::Nystrom => {
                    "its landmarks average whole segments of queries and keys, so a per-key or per-row mask has no place in A = softmax(Q̃ K̃ᵀ)"
                }
                _ => "its projections mix every key position into each of the k_p rows, so a per-key mask has no meaning after them",
            };
        if options.mask.is_some() {
            return Err(refuse("mask", why));
        }
        if options.bias.is_some() {
            return Err(refuse("bias", why));
        }
        if options.kv_lens.is_some() {
            return Err(refuse("kv_lens", why));
        }
        if options.causal != crate::problem::Causal::None {
            return Err(refuse("causal", why));
        }
        if options.window.is_some() {
            return Err(refuse("window", why));
        }
        if weights {
            return Err(refuse(
                "weights",
                "it never forms the L × S attention matrix; use the exact SDPA for weights",
            ));
        }
    }
    Ok(())
}

/// [`VariantParams::segment_means`] in f64 (the reference's landmarks).
pub(crate) fn segment_means_f64(rows: usize, len: usize) -> Array2<f64> {
    let mut m = Array2::<f64>::zeros((rows, len));
    for t in 0..rows {
        let (lo, hi) = (t * len / rows, (t + 1) * len / rows);
        m.slice_mut(ndarray::s![t, lo..hi]).fill(1.0 / (hi - lo) as f64);
    }
    m
}

/// The validated dimensions of a variant call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub hq: usize,
    pub hkv: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    /// The value input's last dim (r for lowrank-v).
    pub ev: usize,
    /// The output's last dim.
    pub ev_out: usize,
    /// A (additive), r (lowrank-v), m (Nyström), k_p (Linformer); 0 for general.
    pub inner: usize,
    /// The scale, its default resolved (f64, as the reference uses it).
    pub scale: f64,
}

impl Dims {
    /// The output's shape.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.hq, self.l, self.ev_out]
    }
}

/// Results of a variant on the host.
#[derive(Debug, Clone)]
pub struct VariantOutput {
    /// `[B, Hq, L, Ev]` (lowrank-v: A's columns), widened to f32 from the output's format.
    pub output: Array4<f32>,
    /// The attention weights `[B, Hq, L, S]` when asked for (general, additive, lowrank-v).
    pub weights: Option<Array4<f32>>,
}

/// Results of a variant left on the GPU by [`Variant::record`].
#[derive(Debug, Clone)]
pub struct GpuVariantOutput {
    /// The output `[B, Hq, L, Ev]` in [`GpuVariantOutput::storage`], at byte 0.
    pub output: wgpu::Buffer,
    /// The output's shape.
    pub shape: [usize; 4],
    /// The output's storage format.
    pub storage: Storage,
    /// The attention weights `[B, Hq, L, S]` (f32), when asked for.
    pub weights: Option<wgpu::Buffer>,
}

/// One of the literature's attention variants ([`VariantKind`]) on the GPU, in the builder
/// style of [`crate::Sdpa`]: q `[B, Hq, L, E]`, k `[B, Hkv, S, E]`, v `[B, Hkv, S, Ev]` (for
/// lowrank-v, v is U `[B, Hkv, S, r]`), host data or the caller's buffers in any supported
/// storage format; the parameters from [`VariantParams`]. Then [`run`](Variant::run),
/// [`run_blocking`](Variant::run_blocking) or [`record`](Variant::record).
///
/// ```no_run
/// use ndarray::{Array2, Array4};
/// use wgpu_attention::{Context, Variant, VariantParams};
/// let ctx = Context::new_blocking()?;
/// let q = Array4::<f32>::zeros((1, 8, 4096, 64));
/// let k = Array4::<f32>::zeros((1, 8, 4096, 64));
/// let v = Array4::<f32>::zeros((1, 8, 4096, 64));
/// let params = VariantParams::Nystrom { landmarks: 64 };
/// let out = Variant::new(&q, &k, &v, &params).run_blocking(&ctx)?;
/// assert_eq!(out.output.shape(), &[1, 8, 4096, 64]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
///
/// Masks, the scale and the weights follow [`crate::Sdpa`] (PyTorch semantics; a fully masked
/// row gives zeros) where the kind takes them ([`VariantKind::takes_masks`]); elsewhere they
/// are a typed error, before any GPU work.
#[derive(Debug, Clone)]
pub struct Variant<'a> {
    params: &'a VariantParams,
    q: Tensor<'a>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    options: Options<'a>,
    path: Path,
    weights: bool,
    pinv_iters: usize,
    out_storage: Option<Storage>,
}

impl<'a> Variant<'a> {
    /// The variant `params.kind()` over q, k, v.
    pub fn new(
        q: impl Into<Tensor<'a>>,
        k: impl Into<Tensor<'a>>,
        v: impl Into<Tensor<'a>>,
        params: &'a VariantParams,
    ) -> Self {
        Variant {
            params,
            q: q.into(),
            k: k.into(),
            v: v.into(),
            options: Options::default(),
            path: Path::Auto,
            weights: false,
            pinv_iters: 6,
            out_storage: None,
        }
    }

    option_setters!();

    /// The path of the attention stage (default [`Path::Auto`]), passed to the variant's SDPA
    /// stage.
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// Also return the attention weights `[B, Hq, L, S]` (general, additive, lowrank-v).
    pub fn return_weights(mut self) -> Self {
        self.weights = true;
        self
    }

    /// Iterations of Nyström's pseudo-inverse (default 6, the paper's).
    pub fn pinv_iters(mut self, n: usize) -> Self {
        self.pinv_iters = n;
        self
    }

    /// The output's storage format (default: q's).
    pub fn output_storage(mut self, storage: Storage) -> Self {
        self.out_storage = Some(storage);
        self
    }

    /// The kind.
    pub fn kind(&self) -> VariantKind {
        self.params.kind()
    }

    pub(crate) fn dims(&self) -> Result<Dims> {
        self.params.check(
            &self.q.shape,
            &self.k.shape,
            &self.v.shape,
            &self.options,
            self.weights,
            self.pinv_iters,
        )
    }

    /// Validate shapes, parameters and options (no GPU work); returns the output's shape.
    pub fn output_shape(&self) -> Result<[usize; 4]> {
        Ok(self.dims()?.out_shape())
    }

    /// Bytes of GPU memory one call allocates: inputs, parameters, intermediates, output.
    pub fn device_memory(&self, ctx: &Context) -> Result<u64> {
        record::device_memory(self, ctx)
    }

    /// Run on the GPU and read the results back.
    pub async fn run(&self, ctx: &Context) -> Result<VariantOutput> {
        let gpu = ctx
            .submit("wgpu-attention variant", |encoder| self.record(ctx, encoder))
            .await?;
        let n = gpu.shape.iter().product();
        let output = ctx.read_as_f32(&gpu.output, 0, n, gpu.storage).await?;
        let output = Array4::from_shape_vec(gpu.shape, output).expect("output length");
        let weights = match &gpu.weights {
            Some(w) => {
                let [b, h, l, _] = gpu.shape;
                let v = ctx.read_f32(w, 0, w.size()).await?;
                let s = v.len() / (b * h * l);
                Some(Array4::from_shape_vec((b, h, l, s), v).expect("weights length"))
            }
            None => None,
        };
        Ok(VariantOutput { output, weights })
    }

    /// Blocking version of [`run`](Variant::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<VariantOutput> {
        pollster::block_on(self.run(ctx))
    }

    /// Validate everything, upload host inputs and parameters, and record every dispatch into
    /// `encoder` (nothing is submitted).
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuVariantOutput> {
        record::record(self, ctx, encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_from_their_names() {
        for k in VariantKind::ALL {
            assert_eq!(k.name().parse::<VariantKind>(), Ok(k));
        }
        assert!("luong".parse::<VariantKind>().is_err());
    }

    #[test]
    fn segment_means_average_every_element_once() {
        let m = VariantParams::segment_means(3, 8);
        // segments 0..2, 2..5, 5..8
        assert_eq!(m.row(0).to_vec(), vec![0.5, 0.5, 0., 0., 0., 0., 0., 0.]);
        for t in 0..3 {
            assert!((m.row(t).sum() - 1.0).abs() < 1e-6);
        }
        assert_eq!(
            m.sum_axis(ndarray::Axis(0)).iter().filter(|&&x| x > 0.0).count(),
            8
        );
    }
}
