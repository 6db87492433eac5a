//! Paged KV caches on the host: the contiguous keys a block table describes, and attention
//! over them ([`Sdpa::paged`](crate::Sdpa::paged)'s reference).

use ndarray::{Array4, ArrayView4};

use crate::error::{Error, Result};
use crate::options::Options;

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
    let (max_blocks, table) = crate::sdpa::check_block_table(block_table, seq_lens, &vec![0; b], nb, bs)?;
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
