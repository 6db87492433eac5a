//! Binding 2 of the attention kernels, the auxiliary words (`aux_word(i)` in
//! `shaders/common/masks.wgsl`): its layout and its writing, in one place. In order: the B key
//! lengths, the ALiBi slopes and the sink logits (f32 bits), the document ids and their
//! blocks' (min, max), the user functions' captures, a paged call's block table, q's RoPE
//! angles; each part only when the problem has it. The forward binds them alone; the
//! backward after its statistics (`shaders/common/backward.wgsl`).

use crate::problem::Problem;

/// The block of queries or keys whose (min, max) document id the kernels read to skip key
/// tiles (`DOC_BLOCK` in `shaders/common/modifiers/docs.wgsl`).
pub(crate) const DOC_BLOCK: usize = 16;

/// Where the document ids' four parts start among the auxiliary words (see
/// [`words`]): the queries' ids, the keys', the query blocks' and the
/// key blocks' (min, max) pairs.
pub(crate) fn doc_offsets(p: &Problem) -> [usize; 4] {
    let q = p.batch + p.alibi.as_ref().map_or(0, Vec::len) + p.sink_logits.as_ref().map_or(0, Vec::len);
    let k = q + p.batch * p.seq_q;
    let qb = k + p.batch * p.seq_kv;
    let kb = qb + 2 * p.batch * p.seq_q.div_ceil(DOC_BLOCK);
    [q, k, qb, kb]
}

/// Where the auxiliary words' tail (the user functions' captures) starts: after the document
/// ids (and their blocks), if any.
pub(crate) fn aux_tail(p: &Problem) -> usize {
    let [q, _, _, kb] = doc_offsets(p);
    if p.doc_ids.is_some() {
        kb + 2 * p.batch * p.seq_kv.div_ceil(DOC_BLOCK)
    } else {
        q
    }
}

/// Where a paged call's block table starts among the auxiliary words: after the user
/// functions' captures, if any.
pub(crate) fn page_table_at(p: &Problem) -> usize {
    aux_tail(p) + p.user_fns.as_ref().map_or(0, |u| u.aux_len())
}

/// Where q's RoPE angles start among the auxiliary words: after a paged call's block table.
pub(crate) fn rope_at(p: &Problem) -> usize {
    page_table_at(p) + p.paged.as_ref().map_or(0, |pg| pg.table.len())
}

/// The positions of q's rows `(b, i)`, batch-major, for RoPE: each batch's keys end at its
/// newest query (bottom-right): `kv_len(b) - L + i` with key lengths (a paged call's sequence
/// lengths), `S - L + i` else (0 where that is negative).
pub(crate) fn q_positions(p: &Problem) -> Vec<usize> {
    let (l, s) = (p.seq_q, p.seq_kv);
    (0..p.batch)
        .flat_map(|b| {
            let end = p.kv_lens.as_ref().map_or(s, |k| k[b] as usize);
            (0..l).map(move |i| (end + i).saturating_sub(l))
        })
        .collect()
}

/// The (min, max) of each block of [`DOC_BLOCK`] ids of each of the `rows` rows of `n` ids.
pub(crate) fn doc_blocks(ids: &[i32], n: usize) -> Vec<i32> {
    ids.chunks(n)
        .flat_map(|row| row.chunks(DOC_BLOCK))
        .flat_map(|blk| {
            let lo = blk.iter().copied().min().unwrap_or(0);
            let hi = blk.iter().copied().max().unwrap_or(0);
            [lo, hi]
        })
        .collect()
}

/// The auxiliary words of binding 2 (`aux_word` in the kernels), when the problem has any: the
/// B key lengths (0 without them), then the Hq ALiBi slopes and the Hq sink logits as f32
/// bits (each when given), then the document ids: the queries' `[B, L]`, the keys' `[B, S]`
/// and each block's (min, max) of each (`doc_offsets`), the user functions'
/// captures, a paged call's block table (`page_table_at`) and q's RoPE
/// angles (`rope_at`).
pub(crate) fn words(p: &Problem) -> Option<Vec<u32>> {
    if p.kv_lens.is_none()
        && p.alibi.is_none()
        && p.sink_logits.is_none()
        && p.doc_ids.is_none()
        && p.user_fns.is_none()
        && p.paged.is_none()
        && p.rope.is_none()
    {
        return None;
    }
    let mut w = p.kv_lens.clone().unwrap_or_else(|| vec![0; p.batch]);
    w.extend(p.alibi.iter().flatten().map(|x| x.to_bits()));
    w.extend(p.sink_logits.iter().flatten().map(|x| x.to_bits()));
    if let Some(d) = &p.doc_ids {
        debug_assert_eq!(w.len(), doc_offsets(p)[0]);
        let blocks = |ids: &[i32], n| doc_blocks(ids, n);
        for ids in [
            &d.q[..],
            &d.k[..],
            &blocks(&d.q, p.seq_q),
            &blocks(&d.k, p.seq_kv),
        ] {
            w.extend(ids.iter().map(|&x| x as u32));
        }
    }
    if let Some(u) = &p.user_fns {
        debug_assert_eq!(w.len(), aux_tail(p));
        let base = w.len();
        w.extend(u.aux_words(base));
    }
    if let Some(pg) = &p.paged {
        debug_assert_eq!(w.len(), page_table_at(p));
        w.extend(&pg.table);
    }
    if let Some((rope, d)) = &p.rope {
        debug_assert_eq!(w.len(), rope_at(p));
        w.extend(rope.angle_words(*d, q_positions(p)));
    }
    Some(w)
}
