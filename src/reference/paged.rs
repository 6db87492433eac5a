//! Paged KV caches on the host: the contiguous keys a block table describes, and attention
//! over them ([`Sdpa::paged`](crate::Sdpa::paged)'s reference).

use ndarray::{Array2, Array3, Array4, ArrayView4};

use crate::error::{Error, Result};
use crate::options::Options;
use crate::paged::{PagedAttention, PagedOutput};
use crate::tensor::Tensor;

use super::sdpa::{sdpa, Output};

/// The contiguous `[B, Hkv, S, E]` of a paged cache `[num_blocks, block_size, Hkv, E]` read
/// through `block_table` (`[B, max_blocks]` row-major) for sequences of `seq_lens` keys, S
/// the longest; keys past a sequence's length are 0. The checks are
/// [`Sdpa::paged`](crate::Sdpa::paged)'s ([`Error::Paged`]).
pub fn gather_paged<T: Copy + Default>(
    cache: ArrayView4<T>,
    block_table: &[i32],
    seq_lens: &[usize],
) -> Result<Array4<T>> {
    let (nb, bs, hkv, e) = cache.dim();
    let b = seq_lens.len();
    if bs == 0 {
        return Err(Error::Paged {
            reason: "the cache's block size is 0".into(),
        });
    }
    let (max_blocks, table) = crate::paged::check_block_table(block_table, seq_lens, &vec![0; b], nb, bs)?;
    let s = seq_lens.iter().copied().max().unwrap_or(1).max(1);
    let mut out = Array4::from_elem((b, hkv, s, e), T::default());
    for (seq, &len) in seq_lens.iter().enumerate() {
        for t in 0..len {
            let entry = table[seq * max_blocks + t / bs] as usize;
            for h in 0..hkv {
                for d in 0..e {
                    out[[seq, h, t, d]] = cache[[entry, t % bs, h, d]];
                }
            }
        }
    }
    Ok(out)
}

/// Attention of q `[B, Hq, n, E]` (each sequence's `n` newest positions) over paged caches,
/// as [`Sdpa::paged`](crate::Sdpa::paged) computes it: [`sdpa`] over the gathered keys with
/// `seq_lens` as the key lengths (`opts` must not give key lengths of its own).
pub fn sdpa_paged<T: Copy + Default + Into<f64>>(
    q: ArrayView4<T>,
    k_cache: ArrayView4<T>,
    v_cache: ArrayView4<T>,
    block_table: &[i32],
    seq_lens: &[usize],
    opts: &Options,
) -> Result<Output> {
    if opts.kv_lens.is_some() {
        return Err(Error::Paged {
            reason: "seq_lens are the key lengths: do not also give kv_lens".into(),
        });
    }
    let k = gather_paged(k_cache, block_table, seq_lens)?;
    let v = gather_paged(v_cache, block_table, seq_lens)?;
    let mut o = opts.clone();
    o.kv_lens = Some(seq_lens.to_vec());
    sdpa(q, k.view(), v.view(), &o)
}

/// The CPU side of [`PagedAttention`]: its reference on host data.
impl PagedAttention<'_> {
    /// The CPU reference (f64) of this call on host data: [`reference::sdpa_paged`](crate::reference::sdpa_paged)
    /// per sequence, packed like the GPU's output.
    pub fn reference(&self) -> Result<PagedOutput> {
        self.validate()?;
        let batch = self.check()?;
        let ([t, hq, e], ev) = (batch.dims, batch.ev);
        // An 8-bit cache's values are its codes times their scales (fp8's per kv head, at
        // axis 2 of token-major pages).
        let heads = if self.layout == crate::paged::PagedLayout::HeadMajor {
            1
        } else {
            2
        };
        let host = |x: &Tensor, name: &'static str| -> Result<Vec<f32>> {
            x.host_values(heads)
                .map(|d| d.into_owned())
                .ok_or(Error::BadBuffer {
                    tensor: name,
                    reason:
                        "the CPU reference reads host data (an 8-bit cache's scales too), not a GPU buffer"
                            .into(),
                })
        };
        let (q, k, v) = (host(&self.q, "q")?, host(&self.k, "k")?, host(&self.v, "v")?);
        let array = |x: &Tensor, d: Vec<f32>, name: &'static str| -> Result<ndarray::Array4<f32>> {
            let shape: [usize; 4] = x.shape.as_slice().try_into().expect("checked");
            let n = d.len();
            ndarray::Array4::from_shape_vec(shape, d).map_err(|_| Error::DataLength {
                tensor: name,
                shape: x.shape.clone(),
                expected: x.shape.iter().product(),
                actual: n,
            })
        };
        let (mut k, mut v) = (array(&self.k, k, "k")?, array(&self.v, v, "v")?);
        if self.layout == crate::paged::PagedLayout::HeadMajor {
            // The reference reads `[num_blocks, block_size, Hkv, E]`.
            k = k.permuted_axes([0, 2, 1, 3]).as_standard_layout().to_owned();
            v = v.permuted_axes([0, 2, 1, 3]).as_standard_layout().to_owned();
        }
        if q.len() != t * hq * e {
            return Err(Error::DataLength {
                tensor: "q",
                shape: self.q.shape.clone(),
                expected: t * hq * e,
                actual: q.len(),
            });
        }
        let mut out = Array3::<f32>::zeros((t, hq, ev));
        let mut lse = Array2::<f32>::zeros((t, hq));
        let max_blocks = self.table.len() / self.seq_lens.len();
        let mut token = 0;
        for (s, (&n, &len)) in self.q_lens.iter().zip(&self.seq_lens).enumerate() {
            let mut qs = ndarray::Array4::<f32>::zeros((1, hq, n, e));
            for i in 0..n {
                for h in 0..hq {
                    for d in 0..e {
                        qs[[0, h, i, d]] = q[((token + i) * hq + h) * e + d];
                    }
                }
            }
            if let Some(r) = &self.rope {
                // The caches hold rotated keys; rotate q at its positions.
                let mut rows = qs
                    .slice(ndarray::s![0, .., .., ..])
                    .permuted_axes([1, 0, 2])
                    .to_owned();
                let pos: Vec<usize> = (0..n).map(|i| len - n + i).collect();
                r.apply(rows.view_mut(), &pos)?;
                qs.slice_mut(ndarray::s![0, .., .., ..])
                    .assign(&rows.permuted_axes([1, 0, 2]));
            }
            let r = crate::reference::sdpa_paged(
                qs.view(),
                k.view(),
                v.view(),
                &self.table[s * max_blocks..(s + 1) * max_blocks],
                &[len],
                &self.options,
            )?;
            for i in 0..n {
                for h in 0..hq {
                    for d in 0..ev {
                        out[[token + i, h, d]] = r.out[[0, h, i, d]] as f32;
                    }
                    lse[[token + i, h]] = r.lse[[0, h, i]] as f32;
                }
            }
            token += n;
        }
        Ok(PagedOutput { output: out, lse })
    }
}
