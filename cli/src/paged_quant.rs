//! `paged`'s 8-bit caches: float caches quantised (on the GPU, or by the host's identical rules
//! for `--cpu`), or int8 / fp8 code caches read with their scales, every flag and scale checked
//! before any GPU work.

use std::path::Path as FsPath;

use ndarray::Array4;
use wgpu_attention::quant::{self, E4m3};
use wgpu_attention::{wgpu, Storage, Tensor};

use crate::npy::{read_float, CacheFile};
use crate::paged::PagedArgs;
use crate::CliResult;

/// 8-bit codes from a file or the host's quantisation.
#[derive(Clone)]
pub(crate) enum Codes {
    Int8(Vec<i8>),
    Fp8(Vec<E4m3>),
}

/// One cache as the command reads it.
pub(crate) struct CacheIn {
    name: &'static str,
    /// The values of a float cache (to quantise where `format` is set).
    floats: Option<Array4<f32>>,
    /// The 8-bit format: `--kv-format`, or the codes' own.
    pub(crate) format: Option<Storage>,
    /// Codes read from the file.
    pub(crate) codes: Option<Codes>,
    /// The scales read (int8 codes: `[NB, BS, Hkv]`; fp8: `[Hkv]`).
    scales: Option<Vec<f32>>,
    dims: [usize; 4],
}

impl CacheIn {
    /// Check the cache file, `--kv-format` and its scales file together.
    pub(crate) fn new(
        a: &PagedArgs,
        name: &'static str,
        file: CacheFile,
        scales: Option<&FsPath>,
        [nb, bs, hkv]: [usize; 3],
    ) -> CliResult<CacheIn> {
        let dims = [nb, bs, hkv, file.shape()[3]];
        let asked = a.kv_format().map(|f| f.storage());
        let flag = format!("--{name}-scales");
        let (floats, codes, format) = match file {
            CacheFile::Float(x) => (Some(x.into_dimensionality()?), None, asked),
            CacheFile::Int8(c) => {
                if asked == Some(Storage::Fp8) {
                    return Err(format!("{name} cache: int8 codes (dtype i1) with --kv-format fp8: fp8 caches are e4m3 bit patterns (dtype u1)").into());
                }
                (
                    None,
                    Some(Codes::Int8(c.iter().copied().collect())),
                    Some(Storage::Int8),
                )
            }
            CacheFile::Fp8(c) => {
                if asked != Some(Storage::Fp8) {
                    return Err(format!(
                        "{name} cache: dtype u1 holds fp8 e4m3 bit patterns only with --kv-format fp8"
                    )
                    .into());
                }
                (
                    None,
                    Some(Codes::Fp8(c.iter().map(|&b| E4m3(b)).collect())),
                    Some(Storage::Fp8),
                )
            }
        };
        // Which scales the cache needs: int8 codes per row, fp8 per head, int8 quantised here none.
        let want: Option<Vec<usize>> = match (format, codes.is_some()) {
            (Some(Storage::Int8), true) => Some(vec![nb, bs, hkv]),
            (Some(Storage::Fp8), _) => Some(vec![hkv]),
            _ => None,
        };
        let scales = match (scales, want) {
            (None, None) => None,
            (Some(_), None) if format.is_none() => {
                return Err(format!("{flag} is for 8-bit caches: give --kv-format, or a cache of codes").into())
            }
            (Some(_), None) => {
                return Err(format!("{flag}: int8 quantisation computes a scale per token and kv head; scales are read for int8 code caches (dtype i1) and fp8").into())
            }
            (None, Some(w)) => {
                return Err(format!("{name} cache: {} needs {flag}, f32 .npy {w:?}", format.expect("8-bit")).into())
            }
            (Some(p), Some(w)) => Some(read_scales(p, &flag, &w, format == Some(Storage::Fp8))?),
        };
        Ok(CacheIn {
            name,
            floats,
            format,
            codes,
            scales,
            dims,
        })
    }

    /// The values the cache stands for: floats (rounded to `st` unless they are quantised
    /// next), or the codes' dequantised values.
    pub(crate) fn values(&self, st: Storage) -> Array4<f32> {
        let [nb, bs, h, e] = self.dims;
        match (&self.floats, &self.codes) {
            (Some(x), _) if self.format.is_none() => x.mapv(|v| st.round(v)),
            (Some(x), _) => x.clone(),
            (None, codes) => {
                let sc = self.scales.as_deref().expect("checked");
                let v = match codes.as_ref().expect("checked") {
                    Codes::Int8(c) => quant::dequantize_int8(c, sc, e),
                    Codes::Fp8(c) => quant::dequantize_fp8_heads(c, e, &[nb, bs, h], 2, sc),
                };
                Array4::from_shape_vec((nb, bs, h, e), v).expect("shape")
            }
        }
    }

    /// The cache as the call reads it from the host: its codes with their scales, else the
    /// values in `st`.
    pub(crate) fn tensor<'t>(&'t self, values: &'t Array4<f32>, st: Storage) -> Tensor<'t> {
        let scales = |s: &'t [f32]| {
            let shape = if self.format == Some(Storage::Int8) {
                self.dims[..3].to_vec()
            } else {
                vec![self.dims[2]]
            };
            Tensor::from_slice(s, &shape)
        };
        match (&self.codes, &self.scales) {
            (Some(Codes::Int8(c)), Some(s)) => Tensor::from_slice(c, &self.dims).with_scales(scales(s)),
            (Some(Codes::Fp8(c)), Some(s)) => Tensor::from_slice(c, &self.dims).with_scales(scales(s)),
            _ if self.format.is_some() => Tensor::from(values),
            _ => Tensor::from(values).with_storage(st),
        }
    }

    /// A float cache to quantise, quantised by the host's rules (`--cpu`): the codes and scales
    /// of `values` (K rotated); else the cache as it is.
    pub(crate) fn quantized_on_host(&self, values: &Array4<f32>) -> CliResult<CacheIn> {
        let [nb, bs, h, e] = self.dims;
        let x = values.as_slice().expect("standard layout");
        let (codes, scales) = match (self.format, &self.floats) {
            (Some(Storage::Int8), Some(_)) => {
                let (c, s) = quant::quantize_int8(x, e);
                (Some(Codes::Int8(c)), Some(s))
            }
            (Some(_), Some(_)) => {
                let s = self.scales.clone().expect("checked");
                (
                    Some(Codes::Fp8(quant::quantize_fp8_heads(x, e, &[nb, bs, h], 2, &s))),
                    Some(s),
                )
            }
            _ => (self.codes.clone(), self.scales.clone()),
        };
        Ok(CacheIn {
            name: self.name,
            floats: self.floats.clone(),
            format: self.format,
            codes,
            scales,
            dims: self.dims,
        })
    }

    /// A float cache to quantise, quantised on the GPU (recorded into `enc`): its codes and
    /// scales buffers.
    pub(crate) fn on_gpu(
        &self,
        ctx: &wgpu_attention::Context,
        enc: &mut wgpu::CommandEncoder,
        values: &Array4<f32>,
    ) -> CliResult<Option<(wgpu::Buffer, wgpu::Buffer)>> {
        let (Some(fmt), Some(_)) = (self.format, &self.floats) else {
            return Ok(None);
        };
        let [nb, bs, h, e] = self.dims;
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let make = |label: &str, bytes: u64| {
            ctx.device().create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.next_multiple_of(16),
                usage,
                mapped_at_creation: false,
            })
        };
        let codes = make("cli codes", fmt.bytes(nb * bs * h * e));
        let scales = match fmt {
            Storage::Int8 => make("cli scales", 4 * (nb * bs * h) as u64),
            _ => {
                let b = make("cli scales", 4 * h as u64);
                ctx.queue().write_buffer(
                    &b,
                    0,
                    &self
                        .scales
                        .as_deref()
                        .expect("checked")
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect::<Vec<u8>>(),
                );
                b
            }
        };
        let x = Tensor::from_slice(values.as_slice().expect("standard layout"), &[nb * bs, h, e]);
        quant::record_quantize(ctx, enc, &x, fmt, &codes, &scales)?;
        Ok(Some((codes, scales)))
    }

    /// The cache as the GPU call reads it: the buffers [`CacheIn::on_gpu`] filled, else as
    /// [`CacheIn::tensor`].
    pub(crate) fn gpu_tensor<'t>(
        &'t self,
        gpu: &'t Option<(wgpu::Buffer, wgpu::Buffer)>,
        values: &'t Array4<f32>,
        st: Storage,
    ) -> Tensor<'t> {
        match (gpu, self.format) {
            (Some((codes, scales)), Some(fmt)) => {
                let shape = if fmt == Storage::Int8 {
                    self.dims[..3].to_vec()
                } else {
                    vec![self.dims[2]]
                };
                Tensor::from_buffer(codes, fmt, &self.dims).with_scales(Tensor::from_buffer(
                    scales,
                    Storage::F32,
                    &shape,
                ))
            }
            _ => self.tensor(values, st),
        }
    }

    /// `, K int8 (quantised on the GPU), V fp8 (codes)` for the caches that are 8-bit.
    pub(crate) fn describe(&self, v: &CacheIn) -> String {
        [("K", self), ("V", v)]
            .iter()
            .filter_map(|(n, c)| {
                c.format.map(|f| {
                    let how = if c.codes.is_some() {
                        "codes"
                    } else {
                        "quantised on the GPU"
                    };
                    format!(", {n} {f} ({how})")
                })
            })
            .collect()
    }
}

/// Read a scales file: f32 (or f16) of shape `want`, every value finite and not negative (fp8's
/// positive).
fn read_scales(path: &FsPath, flag: &str, want: &[usize], positive: bool) -> CliResult<Vec<f32>> {
    let s = read_float(path, flag)?;
    if s.shape() != want {
        return Err(format!(
            "{flag}: {} has shape {:?}, expected {want:?}",
            path.display(),
            s.shape()
        )
        .into());
    }
    if let Some(x) = s
        .iter()
        .find(|x| !x.is_finite() || **x < 0.0 || (positive && **x == 0.0))
    {
        return Err(format!(
            "{flag}: {} holds {x}: scales are finite and {}",
            path.display(),
            if positive { "positive" } else { "not negative" }
        )
        .into());
    }
    Ok(s.iter().copied().collect())
}
