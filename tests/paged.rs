//! Paged KV caches (`Sdpa::paged`): attention read through a block table against the f64
//! reference on the contiguous keys, over block sizes (1, 3, 16, 64 and exact multiples),
//! decode and same-length prefill chunks, GQA, every modifier and the masks (fully masked rows
//! included), the three storage formats, and each path that reads pages (fused, decode).
//! Unwritten cache slots hold NaN, so a read past a sequence or through an unused table entry
//! shows.

mod common;

use common::*;
use ndarray::Array4;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{reference, Causal, Context, Error, PagedLayout, Pages, Path, Sdpa, Storage, Tensor};

/// A token-major cache `[NB, BS, Hkv, E]`'s blocks head-major: `[NB, Hkv, BS, E]`.
fn head_major(a: &Array4<f32>) -> Array4<f32> {
    a.view()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned()
}

/// Run `case` (its kv_lens the sequence lengths) paged with `block_size` on `path` and compare
/// the output and logsumexp with the reference on its contiguous keys.
fn check_paged(ctx: &Context, case: &Case, block_size: usize, path: Path, tol: Tolerance, label: &str) {
    let lens = case
        .kv_lens
        .clone()
        .expect("the case's kv_lens are its sequence lengths");
    let want = case.reference();
    let pg = page(case, &lens, block_size, block_size as u64 + 7);
    let mut options = case.options();
    options.kv_lens = None;
    fn t(a: &Array4<f32>, s: Storage) -> Tensor<'_> {
        Tensor::from(a).with_storage(s)
    }
    let st = case.storage;
    let (hk, hv) = (head_major(&pg.k), head_major(&pg.v));
    for (layout, k, v) in [
        (PagedLayout::TokenMajor, &pg.k, &pg.v),
        (PagedLayout::HeadMajor, &hk, &hv),
    ] {
        let got = Sdpa::paged(
            t(&case.q, st),
            Pages::new(t(k, st), t(v, st), layout),
            &pg.table,
            &pg.lens,
        )
        .options(options.clone())
        .path(path)
        .return_lse()
        .run_blocking(ctx)
        .unwrap_or_else(|e| panic!("{label} {layout:?}: {e}"));
        let label = format!("{label} block {block_size} {layout:?} [{path:?}]");
        case.assert_output(&got, &want, path, tol, &label);
    }
}

#[test]
fn decode_and_prefill_through_block_tables() {
    let Some(ctx) = ctx() else { return };
    // (B, Hq, Hkv, n, S, E, Ev): decode with GQA, a prefill chunk, head dims not multiples of 4.
    let shapes = [
        (3, 4, 2, 1, 77, 32, 32),
        (3, 2, 1, 5, 48, 16, 24),
        (2, 3, 3, 1, 33, 6, 10),
    ];
    for (si, &shape) in shapes.iter().enumerate() {
        for causal in [Causal::None, Causal::BottomRight] {
            let mut case = Case::random(shape, 40 + si as u64).with_causal(causal);
            case.kv_lens = Some(seq_lens(&case));
            for block_size in [1, 3, 16, 64] {
                for path in [Path::Auto, Path::Fused, Path::Decode] {
                    check_paged(
                        ctx,
                        &case,
                        block_size,
                        path,
                        TOL,
                        &format!("{shape:?} {causal:?}"),
                    );
                }
            }
        }
    }
}

#[test]
fn sequences_of_exact_block_multiples() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((2, 2, 2, 4, 64, 16, 16), 51).with_causal(Causal::BottomRight);
    case.kv_lens = Some(vec![64, 32]);
    for block_size in [16, 32, 64] {
        for path in [Path::Fused, Path::Decode] {
            check_paged(ctx, &case, block_size, path, TOL, "exact multiples");
        }
    }
}

#[test]
fn every_modifier_and_mask_through_block_tables() {
    let Some(ctx) = ctx() else { return };
    for (name, kind) in mask_kinds()
        .into_iter()
        .chain(window_kinds())
        .chain(modifier_kinds())
    {
        let mut case = kind(Case::random((3, 2, 1, 3, 41, 16, 16), 60));
        if case.causal == Causal::TopLeft {
            case.causal = Causal::BottomRight;
        }
        case.kv_lens = Some(seq_lens(&case));
        for path in [Path::Fused, Path::Decode] {
            check_paged(ctx, &case, 16, path, TOL, name);
        }
    }
}

#[test]
fn user_functions_through_block_tables() {
    let Some(ctx) = ctx() else { return };
    for (name, kind) in user_kinds() {
        let mut case = kind(Case::random((3, 2, 1, 2, 40, 16, 16), 61));
        case.kv_lens = Some(seq_lens(&case));
        for path in [Path::Fused, Path::Decode] {
            check_paged(ctx, &case, 16, path, TOL, name);
        }
    }
}

#[test]
fn half_caches() {
    let Some(ctx) = ctx() else { return };
    for st in [Storage::F16, Storage::Bf16] {
        for (shape, path) in [
            ((3, 4, 2, 1, 70, 64, 64), Path::Decode),
            ((3, 4, 2, 1, 70, 64, 64), Path::Fused),
            ((2, 2, 1, 6, 45, 32, 16), Path::Fused),
        ] {
            let mut case = Case::random(shape, 70)
                .with_causal(Causal::BottomRight)
                .with_storage(st);
            case.kv_lens = Some(seq_lens(&case));
            check_paged(
                ctx,
                &case,
                16,
                path,
                Tolerance::for_storage(st),
                &format!("{st:?}"),
            );
        }
    }
}

/// The host reference's own paging agrees with the contiguous reference (gather_paged reads
/// what page() wrote).
#[test]
fn reference_gathers_what_was_paged() {
    let mut case = Case::random((3, 2, 1, 2, 30, 8, 8), 80).with_causal(Causal::BottomRight);
    let lens = seq_lens(&case);
    case.kv_lens = Some(lens.clone());
    let pg = page(&case, &lens, 4, 3);
    let mut options = case.options();
    options.kv_lens = None;
    let got = reference::sdpa_paged(
        case.q.view(),
        pg.k.view(),
        pg.v.view(),
        &pg.table,
        &lens,
        &options,
    )
    .unwrap();
    let want = case.reference();
    assert_report(
        compare(
            got.out.iter().copied(),
            want.out.iter().copied(),
            Tolerance { atol: 0.0, rtol: 0.0 },
        ),
        "sdpa_paged",
    );
}

#[test]
fn bad_tables_are_typed_errors_before_gpu_work() {
    let case = Case::random((2, 2, 1, 2, 20, 8, 8), 90);
    let pg = page(&case, &[20, 10], 4, 5);
    fn t(a: &Array4<f32>) -> Tensor<'_> {
        Tensor::from(a)
    }
    let call = |table: &[i32], lens: &[usize]| -> Result<_, Error> {
        let table = table.to_vec();
        let lens = lens.to_vec();
        let k = t(&pg.k);
        let v = t(&pg.v);
        let q = t(&case.q);
        Sdpa::paged(q, Pages::new(k, v, PagedLayout::TokenMajor), &table, &lens)
            .problem()
            .map(|_| ())
    };
    let paged_err = |r: Result<(), Error>, what: &str| match r {
        Err(Error::Paged { reason }) => assert!(reason.contains(what), "{reason:?} should say {what:?}"),
        other => panic!("expected Error::Paged saying {what:?}, got {other:?}"),
    };
    assert!(call(&pg.table, &pg.lens).is_ok());
    // An entry out of range, a negative used entry, a sequence longer than its table, fewer
    // keys than queries, a table that is not [B, max_blocks], lengths not one per sequence.
    let mut t1 = pg.table.clone();
    t1[1] = 1000;
    paged_err(call(&t1, &pg.lens), "block_table[0, 1] = 1000");
    let mut t2 = pg.table.clone();
    t2[0] = -1;
    paged_err(call(&t2, &pg.lens), "block_table[0, 0] = -1");
    paged_err(call(&pg.table, &[20, 40]), "more than its table");
    paged_err(call(&pg.table, &[20, 1]), "fewer than its 2 new queries");
    paged_err(call(&pg.table[1..], &pg.lens), "not a positive multiple");
    paged_err(call(&pg.table, &[20]), "seq_lens has 1 lengths");
    // Key lengths or top-left causal beside the table; the unfused path and the weights.
    let (k, v) = (t(&pg.k), t(&pg.v));
    let tm = PagedLayout::TokenMajor;
    let lens_too = Sdpa::paged(
        t(&case.q),
        Pages::new(k.clone(), v.clone(), tm),
        &pg.table,
        &pg.lens,
    )
    .kv_lens(&[20, 10])
    .problem();
    assert!(matches!(lens_too, Err(Error::Paged { .. })), "{lens_too:?}");
    let top_left = Sdpa::paged(
        t(&case.q),
        Pages::new(k.clone(), v.clone(), tm),
        &pg.table,
        &pg.lens,
    )
    .causal(Causal::TopLeft)
    .problem();
    assert!(matches!(top_left, Err(Error::Paged { .. })), "{top_left:?}");
    // Caches that disagree.
    let v_short = Array4::<f32>::zeros((pg.v.dim().0 - 1, 4, 1, 8));
    let r = Sdpa::paged(
        t(&case.q),
        Pages::new(k.clone(), t(&v_short), tm),
        &pg.table,
        &pg.lens,
    )
    .problem();
    assert!(matches!(r, Err(Error::Paged { .. })), "{r:?}");
    let Some(ctx) = ctx() else { return };
    for (path, weights) in [(Path::Unfused, false), (Path::Auto, true)] {
        let mut c = Sdpa::paged(
            t(&case.q),
            Pages::new(k.clone(), v.clone(), tm),
            &pg.table,
            &pg.lens,
        )
        .path(path);
        if weights {
            c = c.return_weights();
        }
        let r = c.run_blocking(ctx);
        assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    }
}

/// The caches in the caller's GPU buffers, each at an offset that is not a multiple of 256
/// bytes (the kernels' element offset), f16 and f32.
#[test]
fn caches_in_the_callers_buffers_at_offsets() {
    use wgpu_attention::wgpu::{self, util::DeviceExt};
    let Some(ctx) = ctx() else { return };
    for (st, pad) in [(Storage::F32, 12usize), (Storage::F16, 6)] {
        let mut case = Case::random((3, 4, 2, 1, 50, 16, 16), 95)
            .with_causal(Causal::BottomRight)
            .with_storage(st);
        case.kv_lens = Some(seq_lens(&case));
        let want = case.reference();
        let pg = page(&case, case.kv_lens.as_ref().unwrap(), 16, 9);
        let buffer = |a: &Array4<f32>| {
            let mut host = vec![0.0f32; pad];
            host.extend(a.iter());
            let mut bytes = st.encode(&host);
            bytes.resize(bytes.len().next_multiple_of(4), 0);
            ctx.device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("paged cache"),
                    contents: &bytes,
                    usage: wgpu::BufferUsages::STORAGE,
                })
        };
        let (kb, vb) = (buffer(&pg.k), buffer(&pg.v));
        let at = pad as u64 * st.element_bytes();
        let mut options = case.options();
        options.kv_lens = None;
        for path in [Path::Fused, Path::Decode] {
            let got = Sdpa::paged(
                Tensor::from(&case.q).with_storage(st),
                Pages::new(
                    Tensor::from_buffer(&kb, st, pg.k.shape()).at_offset(at),
                    Tensor::from_buffer(&vb, st, pg.v.shape()).at_offset(at),
                    PagedLayout::TokenMajor,
                ),
                &pg.table,
                &pg.lens,
            )
            .options(options.clone())
            .path(path)
            .return_lse()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{st:?} {path:?}: {e}"));
            case.assert_output(
                &got,
                &want,
                path,
                Tolerance::for_storage(st),
                &format!("buffers {st:?} {path:?}"),
            );
        }
    }
}

/// Rotate `[B, H, N, E]` rows in place on the host, row (b, i) at `pos(b, i)`.
fn rotate(x: &mut Array4<f32>, rope: &wgpu_attention::Rope, pos: impl Fn(usize, usize) -> usize) {
    let (b, _, n, _) = x.dim();
    for bi in 0..b {
        // [H, N, E] -> [N, H, E]
        let mut rows = x
            .slice(ndarray::s![bi, .., .., ..])
            .permuted_axes([1, 0, 2])
            .to_owned();
        let p: Vec<usize> = (0..n).map(|i| pos(bi, i)).collect();
        rope.apply(rows.view_mut(), &p).unwrap();
        x.slice_mut(ndarray::s![bi, .., .., ..])
            .assign(&rows.permuted_axes([1, 0, 2]));
    }
}

/// RoPE on q inside the attention kernels (`Sdpa::rope`): q un-rotated, the keys rotated at
/// their positions, against the reference on rotated q and k. Paged (positions seq_len - n +
/// i) and contiguous (S - L + i, and with key lengths kv_len - L + i), both styles, partial
/// rotary dims, theta 1e4 and 5e5, both paths.
#[test]
fn rope_on_q_inside_the_kernels() {
    use wgpu_attention::{Rope, RopeStyle};
    let Some(ctx) = ctx() else { return };
    let ropes = [
        Rope {
            style: RopeStyle::HalfSplit,
            theta: 1e4,
            dim: None,
        },
        Rope {
            style: RopeStyle::Interleaved,
            theta: 5e5,
            dim: Some(12),
        },
        Rope {
            style: RopeStyle::HalfSplit,
            theta: 5e5,
            dim: Some(6),
        },
    ];
    for (ri, rope) in ropes.iter().enumerate() {
        for (shape, paged) in [
            ((3, 4, 2, 3, 40, 16, 16), true),
            ((2, 2, 1, 1, 70, 20, 8), true),
            ((2, 2, 2, 5, 23, 16, 16), false),
        ] {
            let mut case = Case::random(shape, 100 + ri as u64).with_causal(Causal::BottomRight);
            case.kv_lens = Some(seq_lens(&case));
            if !paged && ri == 1 {
                case.kv_lens = None; // positions S - L + i
            }
            let (_, _, n, s) = case.dims();
            let lens = case.kv_lens.clone().unwrap_or(vec![s; shape.0]);
            // Keys rotated at their positions; the reference also sees q rotated.
            rotate(&mut case.k, rope, |_, j| j);
            let raw_q = case.q.clone();
            rotate(&mut case.q, rope, |b, i| lens[b] - n + i);
            let want = case.reference();
            let mut options = case.options();
            let pg = page(&case, &lens, 16, 5);
            for path in [Path::Fused, Path::Decode] {
                let call = if paged {
                    options.kv_lens = None;
                    let pages = Pages::new(&pg.k, &pg.v, PagedLayout::TokenMajor);
                    Sdpa::paged(Tensor::from(&raw_q), pages, &pg.table, &pg.lens).options(options.clone())
                } else {
                    Sdpa::new(Tensor::from(&raw_q), Tensor::from(&case.k), Tensor::from(&case.v))
                        .options(options.clone())
                };
                let got = call
                    .rope(*rope)
                    .path(path)
                    .return_lse()
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{rope:?} {shape:?}: {e}"));
                case.assert_output(
                    &got,
                    &want,
                    path,
                    TOL,
                    &format!("rope {rope:?} {shape:?} paged {paged} [{path:?}]"),
                );
            }
        }
    }
    // Refused where q is not read by the attention kernels.
    let case = Case::random((1, 1, 1, 2, 8, 8, 8), 1);
    for r in [
        case.sdpa()
            .rope(Rope::default())
            .path(Path::Unfused)
            .run_blocking(ctx)
            .map(|_| ()),
        case.sdpa()
            .rope(Rope::default())
            .return_weights()
            .run_blocking(ctx)
            .map(|_| ()),
    ] {
        assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    }
    let dout = Array4::<f32>::zeros((1, 1, 2, 8));
    let r = case
        .sdpa()
        .rope(Rope::default())
        .backward(&dout)
        .run_blocking(ctx);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    let r = case
        .sdpa()
        .rope(Rope {
            dim: Some(9),
            ..Rope::default()
        })
        .problem();
    assert!(matches!(r, Err(Error::InvalidModifier { .. })), "{r:?}");
}

/// A ragged batch in one call (`PagedAttention`): queries packed `[T, Hq, E]`, counts 5, 1,
/// 1, 3, 3 and 2 (prefill chunks beside decode queries), against the per-sequence reference;
/// GQA, the modifiers, RoPE, half formats, both paths.
#[test]
fn ragged_batches_in_one_call() {
    use ndarray::Array3;
    use wgpu_attention::{PagedAttention, Rope, RopeStyle};
    let Some(ctx) = ctx() else { return };
    let q_lens = [5usize, 1, 1, 3, 3, 2];
    let seq_lens = [40usize, 1, 29, 3, 17, 64];
    let (hq, hkv, e, ev, bs) = (4, 2, 16, 8, 8);
    let t: usize = q_lens.iter().sum();
    let mut r = rng(120);
    // Contiguous keys per sequence, paged through a shuffled table.
    let case = Case::random((6, hq, hkv, 1, 64, e, ev), 121);
    let pg = page(&case, &seq_lens, bs, 122);
    type Setup = fn(PagedAttention<'_>) -> PagedAttention<'_>;
    let setups: [(&str, Setup); 4] = [
        ("plain", |c| c),
        ("causal", |c| c.causal(Causal::BottomRight)),
        ("causal_window_sinks_alibi_softcap_sink_logits", |c| {
            c.causal(Causal::BottomRight)
                .window(6, 0)
                .sink_tokens(2)
                .alibi(&[0.5, 0.25, 0.125, 0.0625])
                .softcap(0.8)
                .sink_logits(&[0.5, -1.0, 2.0, 0.0])
        }),
        ("rope_causal", |c| {
            c.causal(Causal::BottomRight).rope(Rope {
                style: RopeStyle::Interleaved,
                theta: 5e5,
                dim: Some(8),
            })
        }),
    ];
    for st in [Storage::F32, Storage::F16] {
        let mut q: Array3<f32> = rand_array(&mut r, (t, hq, e));
        q.mapv_inplace(|x| st.round(x));
        let (mut k, mut v) = (pg.k.clone(), pg.v.clone());
        k.mapv_inplace(|x| st.round(x));
        v.mapv_inplace(|x| st.round(x));
        for (name, setup) in setups {
            let call = |s: Storage| {
                setup(PagedAttention::new(
                    Tensor::from(&q).with_storage(s),
                    &q_lens,
                    Pages::new(
                        Tensor::from(&k).with_storage(s),
                        Tensor::from(&v).with_storage(s),
                        PagedLayout::TokenMajor,
                    ),
                    &pg.table,
                    &seq_lens,
                ))
            };
            let want = call(Storage::F32).reference().unwrap();
            let tol = if st == Storage::F32 {
                TOL
            } else {
                Tolerance::for_storage(st)
            };
            for path in [Path::Auto, Path::Fused, Path::Decode] {
                let got = call(st)
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{name} {st:?} {path:?}: {e}"));
                let label = format!("ragged {name} {st:?} [{path:?}]");
                assert_paged(&got, &want, tol, &label);
            }
        }
    }
    // Bad batches: counts not summing to T, a zero count, more queries than keys, a mask.
    let q = Array3::<f32>::zeros((t, hq, e));
    let bad = |c: PagedAttention<'_>, what: &str| match c.run_blocking(ctx) {
        Err(Error::Paged { reason }) => assert!(reason.contains(what), "{reason:?} should say {what:?}"),
        other => panic!("{what}: expected Error::Paged, got {other:?}"),
    };
    let mk = |ql: &[usize], sl: &[usize]| {
        PagedAttention::new(
            &q,
            ql,
            Pages::new(&pg.k, &pg.v, PagedLayout::TokenMajor),
            &pg.table,
            sl,
        )
    };
    bad(mk(&[5, 1, 1, 3, 3, 1], &[40, 1, 29, 3, 17, 64]), "sum to 14");
    bad(mk(&[5, 0, 2, 3, 3, 2], &[40, 1, 29, 3, 17, 64]), "no query");
    bad(
        mk(&[5, 2, 1, 3, 2, 2], &[40, 1, 29, 3, 17, 64]),
        "fewer than its 2 new queries",
    );
    let mask = ndarray::Array4::from_elem((6, 1, 1, 64), true).into_dyn();
    bad(mk(&q_lens, &seq_lens).mask(&mask), "per batch entry");
}

/// A ragged batch of forks: two groups of forks around an unrelated sequence (see
/// [`shared_prefixes_read_once`]), in token-major caches of blocks of 16 with NaN in every
/// unwritten slot.
struct Forks {
    table: Vec<i32>,
    seq_lens: Vec<usize>,
    q_lens: Vec<usize>,
    k: Array4<f32>,
    v: Array4<f32>,
}

impl Forks {
    const HQ: usize = 4;
    const E: usize = 16;
    const BS: usize = 16;

    fn new(r: &mut rand::rngs::StdRng) -> Forks {
        let (hkv, ev, bs) = (2, 12, Forks::BS);
        // Parent A: 20 full blocks (320 keys); parent B: 17 (272). The pool holds both, and
        // each sequence's own blocks after.
        let mut next = 0i32;
        let mut take = |n: usize| -> Vec<i32> {
            let v = (next..next + n as i32).collect();
            next += n as i32;
            v
        };
        let parent_a = take(20);
        let parent_b = take(17);
        // (parent, shared blocks, seq_len, q_len): forks of A with tails of 1 to 40 keys, one
        // whose queries reach back into A's blocks (330 keys, 40 queries: 18 whole blocks
        // before them), one parting after 19 blocks; an unrelated sequence; two forks of B
        // (279 and 299 keys before their queries: 17 and 18 blocks).
        let seqs: [(Option<&Vec<i32>>, usize, usize, usize); 8] = [
            (Some(&parent_a), 20, 321, 1),
            (Some(&parent_a), 20, 335, 3),
            (Some(&parent_a), 20, 330, 40),
            (Some(&parent_a), 19, 360, 1),
            (Some(&parent_a), 20, 324, 2),
            (None, 0, 50, 1),
            (Some(&parent_b), 17, 280, 1),
            (Some(&parent_b), 17, 300, 1),
        ];
        let max_blocks = 360usize.div_ceil(bs) + 1;
        let mut table = vec![-1i32; seqs.len() * max_blocks];
        let mut last_blocks = Vec::new();
        for (s, &(parent, shared, len, _)) in seqs.iter().enumerate() {
            let row = &mut table[s * max_blocks..(s + 1) * max_blocks];
            if let Some(p) = parent {
                row[..shared].copy_from_slice(&p[..shared]);
            }
            let own = take(len.div_ceil(bs) - shared);
            row[shared..len.div_ceil(bs)].copy_from_slice(&own);
            last_blocks.push((*own.last().unwrap() as usize, len % bs));
        }
        let nb = next as usize + 1;
        let mut k: Array4<f32> = rand_array(r, (nb, bs, hkv, Forks::E));
        let mut v: Array4<f32> = rand_array(r, (nb, bs, hkv, ev));
        // Unwritten slots hold NaN.
        for &(blk, used) in &last_blocks {
            if used > 0 {
                k.slice_mut(ndarray::s![blk, used.., .., ..]).fill(f32::NAN);
                v.slice_mut(ndarray::s![blk, used.., .., ..]).fill(f32::NAN);
            }
        }
        k.slice_mut(ndarray::s![nb - 1, .., .., ..]).fill(f32::NAN);
        v.slice_mut(ndarray::s![nb - 1, .., .., ..]).fill(f32::NAN);
        Forks {
            table,
            seq_lens: seqs.iter().map(|s| s.2).collect(),
            q_lens: seqs.iter().map(|s| s.3).collect(),
            k,
            v,
        }
    }

    /// What is shared: A's five forks (18 blocks: the one reaching back limits it) and B's two.
    fn shared() -> Vec<wgpu_attention::SharedPrefix> {
        use wgpu_attention::SharedPrefix;
        vec![
            SharedPrefix {
                first: 0,
                sequences: 5,
                keys: 18 * Forks::BS,
            },
            SharedPrefix {
                first: 6,
                sequences: 2,
                keys: 17 * Forks::BS,
            },
        ]
    }
}

type Setup = fn(wgpu_attention::PagedAttention<'_>) -> wgpu_attention::PagedAttention<'_>;

/// The forks under `setup` in `st` (inputs rounded to it) on each path, with and without
/// sharing, both layouts and the shared keys in 1, 3 and the most runs, against the reference;
/// what is shared checked first (`shares`: whether anything is).
fn check_forks(
    ctx: &Context,
    f: &Forks,
    q: &ndarray::Array3<f32>,
    st: Storage,
    (name, setup, shares): (&str, Setup, bool),
) {
    use wgpu_attention::PagedAttention;
    let round = |a: &Array4<f32>| a.mapv(|x| st.round(x));
    let (k, v) = (round(&f.k), round(&f.v));
    // The same blocks head-major, read through the same tables.
    let (hk, hv) = (head_major(&k), head_major(&v));
    let call = |s: Storage, head_major: bool| {
        let (kc, vc) = if head_major { (&hk, &hv) } else { (&k, &v) };
        let layout = if head_major {
            PagedLayout::HeadMajor
        } else {
            PagedLayout::TokenMajor
        };
        setup(PagedAttention::new(
            Tensor::from(q).with_storage(s),
            &f.q_lens,
            Pages::new(
                Tensor::from(kc).with_storage(s),
                Tensor::from(vc).with_storage(s),
                layout,
            ),
            &f.table,
            &f.seq_lens,
        ))
    };
    let want_shared = if shares { Forks::shared() } else { Vec::new() };
    for hmj in [false, true] {
        assert_eq!(
            call(st, hmj).shared_prefixes().unwrap(),
            want_shared,
            "{name} {hmj}"
        );
    }
    assert!(call(st, false)
        .shared_prefix(false)
        .shared_prefixes()
        .unwrap()
        .is_empty());
    let want = call(Storage::F32, false).reference().unwrap();
    let tol = if st == Storage::F32 {
        TOL
    } else {
        Tolerance::for_storage(st)
    };
    // (path, shared, head-major, runs of the shared keys: 1 is a CPU adapter's, more a GPU's;
    // 3 splits A's 18 blocks 6 + 6 + 6 and B's 17 6 + 6 + 5, 50 the most that leave a run as
    // many keys as the prefix's queries, 3 blocks for A's 47, 1 for B's 2).
    for (path, on, hmj, runs) in [
        (Path::Auto, true, false, 1),
        (Path::Fused, true, false, 3),
        (Path::Decode, true, false, 1),
        (Path::Auto, false, false, 1),
        (Path::Auto, true, true, 3),
        (Path::Decode, true, true, 50),
    ] {
        let got = call(st, hmj)
            .path(path)
            .shared_prefix(on)
            .shared_prefix_splits(runs)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{name} {st:?} {path:?}: {e}"));
        let label =
            format!("shared prefixes {name} {st:?} [{path:?}, shared {on}, head-major {hmj}, {runs} runs]");
        assert_paged(&got, &want, tol, &label);
    }
}

/// Forked sequences (tables beginning with the same blocks) in a ragged batch: the shared
/// keys are read once by one call over all the forks' queries, the tails per sequence, and the
/// two merged by logsumexp. Checked against the reference per sequence (which reads every
/// sequence's keys), with an unrelated sequence between two groups of forks, a fork whose
/// tables part early, and one whose new queries reach back into the shared blocks (so less
/// of them is shared).
#[test]
fn shared_prefixes_read_once() {
    use wgpu_attention::{Rope, RopeStyle};
    let Some(ctx) = ctx() else { return };
    let mut r = rng(130);
    let forks = Forks::new(&mut r);
    let t: usize = forks.q_lens.iter().sum();
    let setups: [(&str, Setup, bool); 5] = [
        ("plain", |c| c, true),
        ("causal", |c| c.causal(Causal::BottomRight), true),
        (
            "causal_softcap_sink_logits_scale",
            |c| {
                c.causal(Causal::BottomRight)
                    .softcap(0.9)
                    .sink_logits(&[0.5, -1.0, 2.0, 0.0])
                    .scale(0.7)
            },
            true,
        ),
        (
            "rope_causal",
            |c| {
                c.causal(Causal::BottomRight).rope(Rope {
                    style: RopeStyle::HalfSplit,
                    theta: 1e4,
                    dim: Some(12),
                })
            },
            true,
        ),
        // A window depends on positions: no shared prefix, every sequence reads its keys.
        ("window", |c| c.causal(Causal::BottomRight).window(100, 0), false),
    ];
    for st in [Storage::F32, Storage::Bf16] {
        let q: ndarray::Array3<f32> = rand_array(&mut r, (t, Forks::HQ, Forks::E));
        let q = q.mapv(|x| st.round(x));
        for setup in setups {
            check_forks(ctx, &forks, &q, st, setup);
        }
    }
}

/// A generation loop over a paged cache prepared over its lengths compiles nothing as it
/// grows (across the decode threshold, 512 keys, on CPU adapters): every step's call finds its
/// pipelines cached on a fresh context, head-major with RoPE on q, and its results match the
/// reference. A prefill chunk of 4 queries is prepared from 4 keys up.
#[test]
fn prepared_paged_kernels_cover_a_growing_cache() {
    use wgpu_attention::{Rope, RopeStyle};
    let Some(ctx) = ctx() else { return };
    let fresh = Context::from_device(ctx.device().clone(), ctx.queue().clone());
    let rope = Rope {
        style: RopeStyle::Interleaved,
        theta: 5e5,
        dim: Some(12),
    };
    let step = |l: usize, s: usize| {
        let mut case = Case::random((2, 4, 2, l, s, 16, 16), s as u64).with_causal(Causal::BottomRight);
        case.kv_lens = Some(vec![s, s.saturating_sub(3).max(l)]);
        case
    };
    for l in [1, 4] {
        let template = step(l, 40);
        let pg = page(&template, template.kv_lens.as_ref().unwrap(), 16, 3);
        let (hk, hv) = (head_major(&pg.k), head_major(&pg.v));
        let forms = Sdpa::paged(
            &template.q,
            Pages::new(&hk, &hv, PagedLayout::HeadMajor),
            &pg.table,
            &pg.lens,
        )
        .causal(Causal::BottomRight)
        .rope(rope)
        .prepare_blocking(&fresh, 1..=700)
        .unwrap();
        assert!(forms >= 1, "{forms}");
        let prepared = fresh.cached_pipelines();
        for s in [l, 64, 511, 512, 513, 700] {
            let case = step(l, s.max(l));
            let lens = case.kv_lens.clone().unwrap();
            let pg = page(&case, &lens, 16, s as u64);
            let (hk, hv) = (head_major(&pg.k), head_major(&pg.v));
            let got = Sdpa::paged(
                &case.q,
                Pages::new(&hk, &hv, PagedLayout::HeadMajor),
                &pg.table,
                &pg.lens,
            )
            .causal(Causal::BottomRight)
            .rope(rope)
            .return_lse()
            .run_blocking(&fresh)
            .unwrap_or_else(|e| panic!("L = {l}, S = {s}: {e}"));
            assert_eq!(
                fresh.cached_pipelines(),
                prepared,
                "L = {l}, S = {s} compiled a kernel"
            );
            // The reference: q rotated at its positions, K as stored (un-rotated here: the
            // cache holds what the kernels read).
            let mut q = case.q.clone();
            rotate(&mut q, &rope, |b, i| lens[b] - l + i);
            let mut rotated = case;
            rotated.q = q;
            let want = rotated.reference();
            rotated.assert_output(
                &got,
                &want,
                Path::Auto,
                TOL,
                &format!("prepared L = {l}, S = {s}"),
            );
        }
    }
}
