//! The layer's parameters on the host: PyTorch state dicts (safetensors), Xavier init, checks.

use ndarray::{Array1, Array2};

use crate::error::{Error, Result};
use crate::storage::Storage;

use super::MhaConfig;

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
    /// The device format of the parameters, and so of the layer's activations and output
    /// (accumulation is f32). The host arrays hold values of this format (see
    /// [`with_storage`](Self::with_storage)).
    pub storage: Storage,
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
            storage: Storage::F32,
        })
    }

    /// The same parameters held in `storage` on the device: every value rounded to it (round
    /// to nearest even), so the host arrays hold what the device does.
    pub fn with_storage(mut self, storage: Storage) -> Self {
        for w in [&mut self.w_q, &mut self.w_k, &mut self.w_v, &mut self.w_o] {
            w.mapv_inplace(|x| storage.round(x));
        }
        for b in [&mut self.b_q, &mut self.b_k, &mut self.b_v, &mut self.b_o]
            .into_iter()
            .flatten()
        {
            b.mapv_inplace(|x| storage.round(x));
        }
        self.storage = storage;
        self
    }

    /// Load a PyTorch `nn.MultiheadAttention` state dict saved with safetensors
    /// (`safetensors.torch.save_file(mha.state_dict(), ...)`): `in_proj_weight [3E, E]` (or
    /// `q_proj_weight`, `k_proj_weight [E, kdim]`, `v_proj_weight [E, vdim]`), optional
    /// `in_proj_bias [3E]`, `out_proj.weight [E, E]`, optional `out_proj.bias [E]`. F16 and BF16
    /// tensors stay in their format on the device ([`MhaWeights::storage`]; the layer then runs
    /// in it), F32 and F64 load as f32. Every tensor must be of one format (F32 and F64 count as
    /// one): mixing F16 with BF16 or with F32 is a [`Error::StorageMismatch`]. Missing or mis-shaped tensors are errors naming
    /// the key. `add_bias_kv` (`bias_k`, `bias_v`) is not supported. Grouped-query weights use
    /// the separate keys with `k_proj_weight` and `v_proj_weight` of `G · d_k` rows (and
    /// `in_proj_bias` of `E + 2 G d_k`); `G` is inferred.
    pub fn from_safetensors(bytes: &[u8], num_heads: usize) -> Result<Self> {
        Self::from_safetensors_prefixed(bytes, "", num_heads)
    }

    /// [`from_safetensors`](Self::from_safetensors) for a layer inside a larger model: every key
    /// is looked up as `prefix + key` (e.g. `"encoder.layers.0.self_attn."`).
    pub fn from_safetensors_prefixed(bytes: &[u8], prefix: &str, num_heads: usize) -> Result<Self> {
        let st = parse(bytes)?;
        let r = Reader {
            st: &st,
            prefix,
            format: std::cell::Cell::new(None),
        };
        for unsupported in ["bias_k", "bias_v"] {
            if r.get(unsupported)?.is_some() {
                return Err(Error::WeightFile {
                    reason: format!("{prefix}{unsupported}: add_bias_kv is not supported"),
                });
            }
        }
        let ([w_q, w_k, w_v], e) = r.in_projections()?;
        let w_o = r.matrix("out_proj.weight", r.need("out_proj.weight")?, Some([e, e]))?;
        let kv = w_k.nrows();
        let (b_q, b_k, b_v) = match r.get("in_proj_bias")? {
            Some(b) => {
                let b = r.vector("in_proj_bias", b, e + 2 * kv)?;
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
        let b_o = r
            .get("out_proj.bias")?
            .map(|b| r.vector("out_proj.bias", b, e))
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
            storage: r.format.get().unwrap_or(Storage::F32),
        };
        w.validate()?;
        Ok(w)
    }

    /// [`from_safetensors`](Self::from_safetensors) from a file.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_safetensors_file(path: impl AsRef<std::path::Path>, num_heads: usize) -> Result<Self> {
        let keys: Vec<String> = MHA_KEYS.iter().map(|k| k.to_string()).collect();
        Self::from_safetensors(&read_file(path.as_ref(), &keys)?, num_heads)
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

/// A tensor's shape and its values widened to f32.
type Loaded = (Vec<usize>, Vec<f32>);

/// Reads one layer's tensors (every key under `prefix`), all of one storage format.
struct Reader<'s> {
    st: &'s safetensors::SafeTensors<'s>,
    prefix: &'s str,
    /// The format of the tensors read so far.
    format: std::cell::Cell<Option<Storage>>,
}

impl Reader<'_> {
    /// The tensor `name`, if present; an error if its format differs from the others'.
    fn get(&self, name: &str) -> Result<Option<Loaded>> {
        let Some((shape, dtype, data)) = tensor_f32(self.st, &format!("{}{name}", self.prefix))? else {
            return Ok(None);
        };
        let this = match dtype {
            safetensors::Dtype::F16 => Storage::F16,
            safetensors::Dtype::BF16 => Storage::Bf16,
            _ => Storage::F32,
        };
        match self.format.get() {
            Some(f) if f != this => {
                return Err(Error::StorageMismatch {
                    tensor: "weights",
                    expected: f,
                    actual: this,
                    why: "every tensor of the layer must be of one format",
                })
            }
            _ => self.format.set(Some(this)),
        }
        Ok(Some((shape, data)))
    }

    /// The tensor `name`, which must be present.
    fn need(&self, name: &str) -> Result<Loaded> {
        self.get(name)?.ok_or_else(|| Error::MissingWeight {
            key: format!("{}{name}", self.prefix),
        })
    }

    /// `t` as a matrix (of shape `expected`, when given).
    fn matrix(&self, name: &str, (shape, data): Loaded, expected: Option<[usize; 2]>) -> Result<Array2<f32>> {
        let ok = shape.len() == 2 && expected.is_none_or(|e| shape == e);
        if !ok {
            return Err(Error::WeightShape {
                key: format!("{}{name}", self.prefix),
                expected: expected.map(|e| e.to_vec()).unwrap_or_default(),
                actual: shape,
            });
        }
        Ok(Array2::from_shape_vec((shape[0], shape[1]), data).expect("safetensors length"))
    }

    /// `t` as a vector of `n`.
    fn vector(&self, name: &str, (shape, data): Loaded, n: usize) -> Result<Array1<f32>> {
        if shape != [n] {
            return Err(Error::WeightShape {
                key: format!("{}{name}", self.prefix),
                expected: vec![n],
                actual: shape,
            });
        }
        Ok(Array1::from_vec(data))
    }

    /// W_Q, W_K, W_V and d_model: packed (`in_proj_weight`) or separate (`q_proj_weight` ..,
    /// whose fewer key/value rows mean grouped-query heads).
    fn in_projections(&self) -> Result<([Array2<f32>; 3], usize)> {
        let shape_error = |name: &str, expected: Vec<usize>, w: &Array2<f32>| Error::WeightShape {
            key: format!("{}{name}", self.prefix),
            expected,
            actual: w.shape().to_vec(),
        };
        if let Some(packed) = self.get("in_proj_weight")? {
            let rows = packed.0.first().copied().unwrap_or(0);
            let e = rows / 3;
            let w = self.matrix("in_proj_weight", packed, Some([3 * e.max(1), e.max(1)]))?;
            if rows % 3 != 0 || e == 0 {
                return Err(shape_error("in_proj_weight", vec![3 * e.max(1), e.max(1)], &w));
            }
            let part = |i: usize| w.slice(ndarray::s![i * e..(i + 1) * e, ..]).to_owned();
            return Ok(([part(0), part(1), part(2)], e));
        }
        let w_q = self.matrix("q_proj_weight", self.need("q_proj_weight")?, None)?;
        let e = w_q.nrows();
        if w_q.ncols() != e {
            return Err(shape_error("q_proj_weight", vec![e, e], &w_q));
        }
        let w_k = self.matrix("k_proj_weight", self.need("k_proj_weight")?, None)?;
        let w_v = self.matrix("v_proj_weight", self.need("v_proj_weight")?, None)?;
        // PyTorch's rows are E; fewer rows (G · d_k) mean grouped-query heads.
        let kv = w_k.nrows();
        for (name, w) in [("k_proj_weight", &w_k), ("v_proj_weight", &w_v)] {
            if w.nrows() != kv || w.nrows() > e || w.nrows() == 0 {
                return Err(shape_error(name, vec![e, w.ncols()], w));
            }
        }
        Ok(([w_q, w_k, w_v], e))
    }
}

/// Parse safetensors bytes.
pub(crate) fn parse(bytes: &[u8]) -> Result<safetensors::SafeTensors<'_>> {
    safetensors::SafeTensors::deserialize(bytes).map_err(|e| Error::WeightFile {
        reason: e.to_string(),
    })
}

/// The most bytes one tensor may take once widened to f32: 4 GiB, past what any wgpu device
/// binds at once (WebGPU's binding sizes are 32-bit). A file claiming a larger tensor is
/// refused before anything is allocated for it.
pub(crate) const MAX_TENSOR_F32_BYTES: u64 = 4 << 30;

/// The safetensors format's own bound on its JSON header (the `safetensors` crate's).
#[cfg(not(target_arch = "wasm32"))]
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The tensors `keys` (those present) of the safetensors file at `path`, as a compact
/// safetensors buffer holding only them. Only the header and those tensors are read: a layer
/// inside a model file of any size costs the layer's bytes. Every size the header claims is
/// checked against the file before anything is allocated for it: the header's length (at most
/// the format's 100 MB and what the file holds), each tensor's offsets and byte length (its
/// shape times its dtype's size, without overflow: the header's own validation), each wanted
/// tensor's offsets within the file's data, and its f32 size (at most
/// [`MAX_TENSOR_F32_BYTES`]). Every failure is an [`Error::WeightFile`] naming
/// the file and what is wrong.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn read_file(path: &std::path::Path, keys: &[String]) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |reason: String| Error::WeightFile {
        reason: format!("{}: {reason}", path.display()),
    };
    let io = |e: std::io::Error| bad(e.to_string());
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(bad(format!(
            "{len} bytes: too short for a safetensors file (it starts with an 8-byte header length)"
        )));
    }
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(io)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES.min(len - 8) {
        return Err(bad(format!(
            "its header claims {n} bytes, but the file has {} after the length (and headers are \
             at most {MAX_HEADER_BYTES})",
            len - 8
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("malformed header: {e}")))?;
    let data_len = len - 8 - n;
    let mut tensors = Vec::new();
    for key in keys {
        let Some(info) = metadata.info(key) else { continue };
        // The header's own validation (run by its deserialiser) has checked that the offsets
        // are ordered and contiguous and that the shape times the dtype's size, without
        // overflow, is the bytes they span; what it cannot know is the file's length.
        let (begin, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if end > data_len {
            return Err(bad(format!(
                "{key}: its offsets {begin}..{end} are not within the file's {data_len} bytes of data"
            )));
        }
        let elems: u64 = info.shape.iter().map(|&d| d as u64).product();
        if elems.saturating_mul(4) > MAX_TENSOR_F32_BYTES {
            return Err(bad(format!(
                "{key}: shape {:?} is {elems} elements, {} bytes as f32: over the {} bytes one \
                 tensor may take",
                info.shape,
                elems.saturating_mul(4),
                MAX_TENSOR_F32_BYTES
            )));
        }
        let mut data = vec![0u8; (end - begin) as usize];
        file.seek(SeekFrom::Start(8 + n + begin)).map_err(io)?;
        file.read_exact(&mut data).map_err(io)?;
        tensors.push((key.clone(), (info.dtype, info.shape.clone()), data));
    }
    let views = tensors
        .iter()
        .map(|(k, (dtype, shape), data)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (k.clone(), v))
                .map_err(|e| bad(format!("{k}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, None).map_err(|e| bad(e.to_string()))
}

/// The keys a layer's state dict may have, after `prefix`.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) const MHA_KEYS: [&str; 9] = [
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
    "bias_k",
    "bias_v",
];

/// A tensor read from a safetensors file: its shape, its dtype, its values widened to f32.
pub(crate) type TensorF32 = (Vec<usize>, safetensors::Dtype, Vec<f32>);

/// Tensor `key` of `st`; `None` when the file has no such tensor.
pub(crate) fn tensor_f32(st: &safetensors::SafeTensors, key: &str) -> Result<Option<TensorF32>> {
    match st.tensor(key) {
        Ok(t) => Ok(Some((
            t.shape().to_vec(),
            t.dtype(),
            to_f32(key, t.dtype(), t.data())?,
        ))),
        Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
        Err(e) => Err(Error::WeightFile {
            reason: format!("{key}: {e}"),
        }),
    }
}

/// Little-endian tensor bytes to f32.
fn to_f32(key: &str, dtype: safetensors::Dtype, data: &[u8]) -> Result<Vec<f32>> {
    use safetensors::Dtype;
    Ok(match dtype {
        Dtype::F32 => Storage::F32.decode(data, data.len() / 4),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        Dtype::F16 => Storage::F16.decode(data, data.len() / 2),
        Dtype::BF16 => Storage::Bf16.decode(data, data.len() / 2),
        other => {
            return Err(Error::WeightFile {
                reason: format!("{key}: dtype {other:?} is not a float type"),
            })
        }
    })
}
