//! Views: q, k, v, the output and dout read (written) in place in the caller's buffers through
//! layouts, sequence capacities, strides and element offsets, and the bias through strides of
//! its own and offsets, on every path and in the backward, against the CPU reference. Inputs sit in buffers whose other elements are NaN (a
//! stray read shows up as a NaN output); outputs in buffers whose other elements hold a
//! sentinel that must survive (a stray write shows up too).

mod common;

use common::{assert_report, ctx, twice_storage_tolerance, Case, TOL};
use ndarray::Array4;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{wgpu, Causal, Context, Error, Path, Sdpa, Storage, Tensor, TensorLayout};

/// Where a `[B, H, S, E]` tensor lies in a buffer of `len` elements: the byte offset given to
/// `at_offset` and the element strides given to `with_strides`.
#[derive(Debug, Clone, Copy)]
struct Place {
    offset_bytes: u64,
    strides: [usize; 4],
    len: usize,
}

impl Place {
    /// The element of index `i` (from the buffer's start).
    fn at(&self, i: [usize; 4], s: Storage) -> usize {
        self.offset_bytes as usize / s.element_bytes() as usize
            + (0..4).map(|d| i[d] * self.strides[d]).sum::<usize>()
    }

    /// A layout with `cap` rows per head, `pad` spare elements before the tensor (its offset)
    /// and after it.
    fn layout(layout: TensorLayout, shape: [usize; 4], cap: usize, pad: usize, s: Storage) -> Place {
        let strides = layout.strides(shape[1], cap, shape[3]);
        let len = pad + shape[0] * strides[0] + pad;
        Place {
            offset_bytes: pad as u64 * s.element_bytes(),
            strides,
            len,
        }
    }
}

fn encode(values: &[f32], s: Storage) -> Vec<u8> {
    let mut bytes: Vec<u8> = match s {
        Storage::F32 => bytemuck::cast_slice(values).to_vec(),
        Storage::F16 => values
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        _ => values
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
    };
    bytes.resize(bytes.len().next_multiple_of(4), 0);
    bytes
}

/// A buffer of `place.len` elements in format `s`, `fill` everywhere but at the tensor `a`.
fn placed(ctx: &Context, a: &Array4<f32>, place: &Place, s: Storage, fill: f32) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    let mut host = vec![fill; place.len];
    for (i, &x) in a.indexed_iter() {
        host[place.at([i.0, i.1, i.2, i.3], s)] = x;
    }
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("view test"),
            contents: &encode(&host, s),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        })
}

fn tensor<'a>(buf: &'a wgpu::Buffer, place: &Place, s: Storage, shape: [usize; 4]) -> Tensor<'a> {
    Tensor::from_buffer(buf, s, &shape)
        .at_offset(place.offset_bytes)
        .with_strides(&place.strides)
}

/// The whole buffer back: the tensor at `place`, and whether every other element still holds
/// `fill`.
fn read_back(
    ctx: &Context,
    buf: &wgpu::Buffer,
    place: &Place,
    s: Storage,
    shape: [usize; 4],
    fill: f32,
) -> (Array4<f32>, usize) {
    let all = pollster::block_on(ctx.read_as_f32(buf, 0, place.len, s)).unwrap();
    let mut inside = vec![false; place.len];
    let a = Array4::from_shape_fn(shape, |(b, h, i, e)| {
        let at = place.at([b, h, i, e], s);
        inside[at] = true;
        all[at]
    });
    let stray = all
        .iter()
        .zip(&inside)
        .filter(|(x, inside)| !**inside && x.to_bits() != fill.to_bits())
        .count();
    (a, stray)
}

const SENTINEL: f32 = 7.0;

/// The views of one test: q, k, v and the output.
struct Views {
    name: &'static str,
    q: Place,
    k: Place,
    v: Place,
    out: Place,
}

/// Every kind of view for the case's shape in format `s`: `[B, S, H, E]` everywhere, a KV
/// cache with spare capacity (both layouts), odd element offsets and strides (the scalar
/// accessors), and q, k, v packed in one `[B, S, 3, H, E]` buffer (when Hq = Hkv and E = Ev).
fn views(case: &Case, s: Storage) -> Vec<(Views, bool)> {
    let (b, hq, l, e) = case.q.dim();
    let (_, hkv, sk, ev) = case.v.dim();
    let (qs, ks, vs, os) = ([b, hq, l, e], [b, hkv, sk, e], [b, hkv, sk, ev], [b, hq, l, ev]);
    let lay = |layout, shape: [usize; 4], cap, pad| Place::layout(layout, shape, cap, pad, s);
    let mut out = vec![
        (
            Views {
                name: "bshe",
                q: lay(TensorLayout::Bshe, qs, l, 0),
                k: lay(TensorLayout::Bshe, ks, sk, 0),
                v: lay(TensorLayout::Bshe, vs, sk, 0),
                out: lay(TensorLayout::Bshe, os, l, 0),
            },
            false,
        ),
        (
            Views {
                name: "kv cache capacity",
                q: lay(TensorLayout::Bhse, qs, l, 0),
                k: lay(TensorLayout::Bhse, ks, sk + 9, 0),
                v: lay(TensorLayout::Bshe, vs, sk + 4, 0),
                out: lay(TensorLayout::Bhse, os, l + 3, 0),
            },
            false,
        ),
    ];
    // Odd offsets and strides: rows 1 element apart from each other's ends, heads and batches
    // further.
    let odd = |shape: [usize; 4], off: usize| {
        let row = shape[3] + 1;
        let head = shape[2] * row + 3;
        let batch = shape[1] * head + 5;
        Place {
            offset_bytes: off as u64 * s.element_bytes(),
            strides: [batch, head, row, 1],
            len: off + shape[0] * batch + 2,
        }
    };
    out.push((
        Views {
            name: "odd offsets and strides",
            q: odd(qs, 3),
            k: odd(ks, 1),
            v: odd(vs, 129),
            out: odd(os, 5),
        },
        false,
    ));
    if hq == hkv && e == ev {
        // One [B, S, 3, H, E] buffer: q, k, v at element offsets 0, H·E, 2·H·E.
        let row = 3 * hq * e;
        let packed = |which: usize, rows: usize| Place {
            offset_bytes: (which * hq * e) as u64 * s.element_bytes(),
            strides: [rows * row, e, row, 1],
            len: b * rows.max(l).max(sk) * row,
        };
        out.push((
            Views {
                name: "packed qkv",
                q: packed(0, l.max(sk)),
                k: packed(1, l.max(sk)),
                v: packed(2, l.max(sk)),
                out: lay(TensorLayout::Bshe, os, l, 0),
            },
            true,
        ));
    }
    out
}

/// Run the case with its q, k, v and output through every view, on `path`, against the
/// reference; the output buffer's other elements must be untouched.
fn check_views(ctx: &Context, case: &Case, path: Path, label: &str) {
    let s = case.storage;
    let tol = if s == Storage::F32 {
        TOL
    } else {
        twice_storage_tolerance(s)
    };
    let want = case.reference();
    let (b, hq, l, _) = case.q.dim();
    let ev = case.v.dim().3;
    let os = [b, hq, l, ev];
    for (v, packed) in views(case, s) {
        let label = format!("{label} {} {path:?} {s:?}", v.name);
        let nan = f32::NAN;
        let (qb, kb, vb);
        let shared;
        let (qbuf, kbuf, vbuf) = if packed {
            // One buffer holding all three.
            let mut host = vec![nan; v.q.len];
            for (a, p) in [(&case.q, &v.q), (&case.k, &v.k), (&case.v, &v.v)] {
                for (i, &x) in a.indexed_iter() {
                    host[p.at([i.0, i.1, i.2, i.3], s)] = x;
                }
            }
            use wgpu::util::DeviceExt;
            shared = ctx
                .device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("packed qkv"),
                    contents: &encode(&host, s),
                    usage: wgpu::BufferUsages::STORAGE,
                });
            (&shared, &shared, &shared)
        } else {
            qb = placed(ctx, &case.q, &v.q, s, nan);
            kb = placed(ctx, &case.k, &v.k, s, nan);
            vb = placed(ctx, &case.v, &v.v, s, nan);
            (&qb, &kb, &vb)
        };
        let outb = placed(ctx, &Array4::zeros(os), &v.out, s, SENTINEL);
        let call = || {
            Sdpa::new(
                tensor(qbuf, &v.q, s, case.q.dim().into()),
                tensor(kbuf, &v.k, s, case.k.dim().into()),
                tensor(vbuf, &v.v, s, case.v.dim().into()),
            )
            .options(case.options())
            .path(path)
            .output_into(tensor(&outb, &v.out, s, os))
        };
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        call()
            .record(ctx, &mut enc)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        ctx.queue().submit([enc.finish()]);
        let (got, stray) = read_back(ctx, &outb, &v.out, s, os, SENTINEL);
        assert_report(
            compare(got.iter().copied(), want.out.iter().copied(), tol),
            &label,
        );
        assert_eq!(stray, 0, "{label}: elements outside the output view were written");
        // run: the host output gathered through the output's view.
        let host = call()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label} run: {e}"));
        assert_report(
            compare(host.output.iter().copied(), want.out.iter().copied(), tol),
            &format!("{label} run"),
        );
    }
}

fn masked(case: Case) -> Case {
    let mut c = case.with_causal(Causal::BottomRight).with_random_bias(5);
    let b = c.q.dim().0;
    let s = c.k.dim().2;
    c.kv_lens = Some((0..b).map(|i| [s, s / 2 + 1][i % 2]).collect());
    c
}

#[test]
fn views_on_every_path_match_reference() {
    let Some(ctx) = ctx() else { return };
    // Tails everywhere; GQA; E != Ev; vec4 rows (E, Ev multiples of 4) and scalar ones.
    let shapes = [
        ((2, 4, 2, 7, 13, 16, 8), 1),
        ((1, 2, 2, 5, 11, 8, 8), 2),
        ((2, 2, 1, 3, 9, 6, 5), 3),
    ];
    for (shape, seed) in shapes {
        for s in [Storage::F32, Storage::F16] {
            let plain = Case::random(shape, seed).with_storage(s);
            let mask = masked(Case::random(shape, seed + 10).with_storage(s));
            for path in Path::ALL {
                check_views(ctx, &plain, path, &format!("{shape:?}"));
                check_views(ctx, &mask, path, &format!("{shape:?} masked"));
            }
        }
    }
}

/// A decode step: one query per sequence against a KV cache of capacity 640 in `[B, S, H, E]`
/// holding 600 and 77 tokens (key lengths), on the decode path's split-K kernels and merge.
#[test]
fn decode_step_on_a_bshe_kv_cache() {
    let Some(ctx) = ctx() else { return };
    for s in [Storage::F32, Storage::Bf16] {
        let mut case = Case::random((2, 4, 2, 1, 600, 16, 16), 40).with_storage(s);
        case.kv_lens = Some(vec![600, 77]);
        case.causal = Causal::BottomRight;
        let want = case.reference();
        let tol = if s == Storage::F32 {
            TOL
        } else {
            twice_storage_tolerance(s)
        };
        let kp = Place::layout(TensorLayout::Bshe, [2, 2, 600, 16], 640, 0, s);
        let (kb, vb) = (
            placed(ctx, &case.k, &kp, s, f32::NAN),
            placed(ctx, &case.v, &kp, s, f32::NAN),
        );
        for path in [Path::Decode, Path::Auto] {
            // The named layout and capacity, not explicit strides.
            let kv = |b| {
                Tensor::from_buffer(b, s, &[2, 2, 600, 16])
                    .with_layout(TensorLayout::Bshe)
                    .with_seq_capacity(640)
            };
            let got = Sdpa::new(Tensor::from(&case.q).with_storage(s), kv(&kb), kv(&vb))
                .options(case.options())
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            assert_report(
                compare(got.output.iter().copied(), want.out.iter().copied(), tol),
                &format!("decode {path:?} {s:?}"),
            );
        }
    }
}

#[test]
fn backward_reads_views() {
    let Some(ctx) = ctx() else { return };
    for (shape, seed) in [((2, 4, 2, 7, 13, 16, 8), 50), ((1, 2, 1, 6, 9, 6, 5), 51)] {
        let case = masked(Case::random(shape, seed));
        let (b, hq, l, _) = case.q.dim();
        let ev = case.v.dim().3;
        let os = [b, hq, l, ev];
        let dout = common::rand_array(&mut common::rng(seed + 1), os);
        for (v, packed) in views(&case, Storage::F32) {
            if packed {
                continue;
            }
            let nan = f32::NAN;
            let qb = placed(ctx, &case.q, &v.q, Storage::F32, nan);
            let kb = placed(ctx, &case.k, &v.k, Storage::F32, nan);
            let vb = placed(ctx, &case.v, &v.v, Storage::F32, nan);
            let gb = placed(ctx, &dout, &v.out, Storage::F32, nan);
            let f = Storage::F32;
            for path in [Path::Fused, Path::Unfused] {
                let label = format!("{shape:?} {} {path:?}", v.name);
                let sdpa = Sdpa::new(
                    tensor(&qb, &v.q, f, case.q.dim().into()),
                    tensor(&kb, &v.k, f, case.k.dim().into()),
                    tensor(&vb, &v.v, f, case.v.dim().into()),
                )
                .options(case.options());
                let g = sdpa
                    .clone()
                    .backward(tensor(&gb, &v.out, f, os))
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                common::assert_grads(&case, &g, &dout, &label);
                // The saved output given through a view too (the forward's into a view).
                let ob = placed(ctx, &Array4::zeros(os), &v.out, f, SENTINEL);
                let fw = sdpa
                    .clone()
                    .output_into(tensor(&ob, &v.out, f, os))
                    .return_lse()
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap();
                assert_report(
                    compare(
                        fw.output.iter().copied(),
                        case.reference().out.iter().copied(),
                        TOL,
                    ),
                    &format!("{label} forward into a view"),
                );
                let lse = fw.lse.unwrap();
                // The forward run by the backward, into the output view: Grads::output.
                let g3 = sdpa
                    .clone()
                    .output_into(tensor(&ob, &v.out, f, os))
                    .backward(tensor(&gb, &v.out, f, os))
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{label} forward into a view: {e}"));
                common::assert_grads(&case, &g3, &dout, &format!("{label} forward into a view"));
                let g2 = sdpa
                    .backward(tensor(&gb, &v.out, f, os))
                    .saved(tensor(&ob, &v.out, f, os), &lse)
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{label} saved: {e}"));
                let tol = Tolerance {
                    atol: 1e-5,
                    rtol: 1e-5,
                };
                for (a, b, n) in [
                    (&g.dq, &g2.dq, "dq"),
                    (&g.dk, &g2.dk, "dk"),
                    (&g.dv, &g2.dv, "dv"),
                ] {
                    assert_report(
                        compare(b.iter().copied(), a.iter().map(|&x| x as f64), tol),
                        &format!("{label} saved {n}"),
                    );
                }
            }
        }
    }
}

/// A bias of `shape` (rank 1 to 4) in a buffer of `len` elements: from element `offset`, with
/// one stride per dimension (`explicit`: given by `with_strides`; else the dense ones, the view
/// being its offset alone).
struct BiasPlace {
    name: &'static str,
    shape: Vec<usize>,
    offset: usize,
    strides: Vec<usize>,
    explicit: bool,
    len: usize,
}

impl BiasPlace {
    /// The bias's GPU tensor in `buf`.
    fn tensor<'a>(&self, buf: &'a wgpu::Buffer, s: Storage) -> Tensor<'a> {
        let t = Tensor::from_buffer(buf, s, &self.shape).at_offset(self.offset as u64 * s.element_bytes());
        if self.explicit {
            t.with_strides(&self.strides)
        } else {
            t
        }
    }

    /// A buffer holding `bias` at this place in format `s`, NaN everywhere else.
    fn buffer(&self, ctx: &Context, bias: &ndarray::ArrayD<f32>, s: Storage) -> wgpu::Buffer {
        use wgpu::util::DeviceExt;
        let mut host = vec![f32::NAN; self.len];
        for (i, &x) in bias.indexed_iter() {
            let at = self.offset
                + (0..self.shape.len())
                    .map(|d| i[d] * self.strides[d])
                    .sum::<usize>();
            host[at] = x;
        }
        ctx.device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("bias view test"),
                contents: &encode(&host, s),
                usage: wgpu::BufferUsages::STORAGE,
            })
    }
}

/// The bias's places for a problem of batch `b`, `h` heads, `l` queries and `s` keys: a whole
/// `[B, H, L, S]` bias in a buffer allocated for S + 7 keys (a KV cache's capacity) from an odd
/// element; a `[1, H, L, S]` one stored `[L, S, H]` (the key stride is not 1; the size-1
/// dimension's stride, 999, is ignored); a `[L, S]` one, dense, at an odd element offset (a view
/// by its offset alone).
fn bias_places(b: usize, h: usize, l: usize, s: usize) -> Vec<BiasPlace> {
    let cap = s + 7;
    vec![
        BiasPlace {
            name: "[B, H, L, S] in a key capacity of S + 7",
            shape: vec![b, h, l, s],
            offset: 3,
            strides: vec![h * l * cap, l * cap, cap, 1],
            explicit: true,
            len: 3 + b * h * l * cap + 2,
        },
        BiasPlace {
            name: "[1, H, L, S] stored [L, S, H]",
            shape: vec![1, h, l, s],
            offset: 0,
            strides: vec![999, 1, s * h, h],
            explicit: true,
            len: l * s * h,
        },
        BiasPlace {
            name: "[L, S] dense at element 5",
            shape: vec![l, s],
            offset: 5,
            strides: vec![s, 1],
            explicit: false,
            len: 5 + l * s + 1,
        },
    ]
}

/// The bias read in place through its own strides and offset, on every path (f32, f16) and
/// in the backward (both paths: d(bias) in the bias's shape), against the reference on the
/// same values; every other element of its buffer is NaN, so a stray read shows.
#[test]
fn bias_views_on_every_path_and_in_the_backward() {
    let Some(ctx) = ctx() else { return };
    for (shape, seed) in [((2, 4, 2, 7, 13, 16, 8), 70u64), ((1, 2, 1, 5, 9, 6, 5), 71)] {
        let (b, hq, l, sk) = (shape.0, shape.1, shape.3, shape.4);
        for place in bias_places(b, hq, l, sk) {
            for st in [Storage::F32, Storage::F16] {
                let mut case = Case::random(shape, seed).with_causal(Causal::BottomRight);
                case.kv_lens = Some((0..b).map(|i| [sk, sk / 2 + 1][i % 2]).collect());
                case.bias = Some(
                    common::rand_array(&mut common::rng(seed + 5), ndarray::IxDyn(&place.shape))
                        .mapv(|x| 2.0 * x),
                );
                let case = case.with_storage(st);
                let buf = place.buffer(ctx, case.bias.as_ref().unwrap(), st);
                let with_view = || {
                    let mut o = case.options();
                    o.bias = Some(place.tensor(&buf, st));
                    o
                };
                let t = |a| Tensor::from(a).with_storage(st);
                let tol = if st == Storage::F32 {
                    TOL
                } else {
                    twice_storage_tolerance(st)
                };
                let want = case.reference();
                for path in Path::ALL {
                    let label = format!("{shape:?} {} {st:?} {path:?}", place.name);
                    let got = Sdpa::new(t(&case.q), t(&case.k), t(&case.v))
                        .options(with_view())
                        .path(path)
                        .run_blocking(ctx)
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_report(
                        compare(got.output.iter().copied(), want.out.iter().copied(), tol),
                        &label,
                    );
                }
                if st != Storage::F32 {
                    continue;
                }
                let dout = common::rand_array(&mut common::rng(seed + 6), [b, hq, l, shape.6]);
                for path in [Path::Fused, Path::Unfused] {
                    let label = format!("{shape:?} {} backward {path:?}", place.name);
                    let g = Sdpa::new(t(&case.q), t(&case.k), t(&case.v))
                        .options(with_view())
                        .backward(&dout)
                        .path(path)
                        .run_blocking(ctx)
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(
                        g.dbias.as_ref().map(|d| d.shape().to_vec()),
                        Some(place.shape.clone()),
                        "{label}: d(bias) in the bias's shape"
                    );
                    common::assert_grads(&case, &g, &dout, &label);
                }
            }
        }
    }
}

/// A 4 KiB storage buffer for the mistakes' views.
fn mistakes_buffer(ctx: &wgpu_attention::Context) -> wgpu::Buffer {
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    })
}

/// `r` is an [`Error::BadBuffer`] whose reason says `what`.
fn bad(r: Result<(), Error>, what: &str, label: &str) {
    match r {
        Err(Error::BadBuffer { reason, .. }) => assert!(reason.contains(what), "{label}: {reason}"),
        other => panic!("{label}: expected BadBuffer mentioning {what:?}, got {other:?}"),
    }
}

/// Plausible mistakes with views are typed errors before any GPU work.
#[test]
fn view_mistakes_are_typed_errors() {
    let Some(ctx) = ctx() else { return };
    let buf = mistakes_buffer(ctx);
    let f = Storage::F32;
    let q = || Tensor::from_buffer(&buf, f, &[1, 2, 4, 8]);
    let run = |q: Tensor, out: Option<Tensor>| {
        let mut s = Sdpa::new(
            q,
            Tensor::from_buffer(&buf, f, &[1, 2, 4, 8]),
            Tensor::from_buffer(&buf, f, &[1, 2, 4, 8]),
        );
        if let Some(o) = out {
            s = s.output_into(o);
        }
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        s.record(ctx, &mut enc).map(|_| ())
    };
    // A head dim that is not contiguous.
    bad(
        run(q().with_strides(&[64, 32, 8, 2]), None),
        "contiguous",
        "E stride 2",
    );
    // Three strides.
    bad(
        run(q().with_strides(&[64, 32, 8]), None),
        "4 strides",
        "three strides",
    );
    // Strides and a layout at once.
    bad(
        run(
            q().with_strides(&[64, 32, 8, 1]).with_layout(TensorLayout::Bshe),
            None,
        ),
        "cannot be combined",
        "strides and layout",
    );
    // A capacity below S.
    bad(run(q().with_seq_capacity(3), None), "capacity 3", "capacity");
    // Past the buffer's end: 1 x 2 heads x 200 rows of capacity x 8 > 1024 elements.
    bad(
        run(q().with_seq_capacity(200), None),
        "reaches byte",
        "past the end",
    );
    // An offset that is not a multiple of the element.
    bad(
        run(q().at_offset(6), None),
        "not a multiple of the 4-byte element",
        "offset",
    );
    // An output whose heads overlap.
    let out = Tensor::from_buffer(&buf, f, &[1, 2, 4, 8]).with_strides(&[64, 16, 8, 1]);
    bad(run(q(), Some(out)), "overlap", "overlapping output");
    // Views of host data.
    let host = Array4::<f32>::zeros((1, 2, 4, 8));
    bad(
        run(Tensor::from(&host).with_layout(TensorLayout::Bshe), None),
        "host data",
        "host layout",
    );
    // A rank-3 tensor with a layout.
    let r3 = Tensor::from_buffer(&buf, f, &[2, 4, 8]).with_layout(TensorLayout::Bshe);
    assert!(
        matches!(run(r3, None), Err(Error::WrongRank { .. })),
        "rank 3 with a layout"
    );
}

/// A bias through a view: a layout or capacity (they describe [B, H, S, E] tensors), a stride
/// per dimension missing, strides past the buffer's end, an offset inside an element; and a
/// view given to the matmul. Typed errors before any GPU work.
#[test]
fn bias_view_mistakes_are_typed_errors() {
    let Some(ctx) = ctx() else { return };
    let buf = mistakes_buffer(ctx);
    let f = Storage::F32;
    let q = || Tensor::from_buffer(&buf, f, &[1, 2, 4, 8]);
    let run_bias = |bias: Tensor| {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        Sdpa::new(q(), q(), q())
            .bias(bias)
            .record(ctx, &mut enc)
            .map(|_| ())
    };
    let bias = || Tensor::from_buffer(&buf, f, &[1, 2, 4, 4]);
    bad(
        run_bias(bias().with_layout(TensorLayout::Bshe)),
        "with_strides",
        "bias layout",
    );
    bad(
        run_bias(bias().with_seq_capacity(8)),
        "with_strides",
        "bias capacity",
    );
    bad(
        run_bias(bias().with_strides(&[16, 4, 1])),
        "one stride per dimension",
        "bias strides",
    );
    bad(
        run_bias(bias().with_strides(&[0, 1000, 64, 1])),
        "reaches byte",
        "bias past the end",
    );
    bad(run_bias(bias().at_offset(2)), "not a multiple", "bias offset");
    // The layer takes dense tensors only: a view there is refused, not misread.
    let m = wgpu_attention::matmul_blocking(
        ctx,
        Tensor::from_buffer(&buf, f, &[2, 4, 8]).with_strides(&[32, 8, 1]),
        Tensor::from_buffer(&buf, f, &[2, 8, 4]),
        false,
        1.0,
    );
    assert!(
        matches!(m, Err(Error::BadBuffer { .. })),
        "matmul of a view: {m:?}"
    );
}

/// `prepare` compiles the view kernels a generation loop on a `[B, S, H, E]` cache will run:
/// after it, steps across the decode threshold compile nothing (before, the views' kernels
/// were compiled at the first step: an 8 s stall on lavapipe).
#[test]
fn prepared_views_cover_a_growing_kv_cache() {
    let Some(ctx) = ctx() else { return };
    let fresh = Context::from_device(ctx.device().clone(), ctx.queue().clone());
    let cap = 700;
    let f = Storage::F32;
    let full = Case::random((1, 4, 2, 1, cap, 16, 16), 60);
    let kp = Place::layout(TensorLayout::Bshe, [1, 2, cap, 16], cap, 0, f);
    let (kb, vb) = (
        placed(ctx, &full.k, &kp, f, 0.0),
        placed(ctx, &full.v, &kp, f, 0.0),
    );
    let op = Place::layout(TensorLayout::Bshe, [1, 4, 1, 16], 1, 0, f);
    let outb = placed(ctx, &Array4::zeros((1, 4, 1, 16)), &op, f, SENTINEL);
    let call = |s: usize| {
        let kv = |b| {
            Tensor::from_buffer(b, f, &[1, 2, s, 16])
                .with_layout(TensorLayout::Bshe)
                .with_seq_capacity(cap)
        };
        Sdpa::new(&full.q, kv(&kb), kv(&vb))
            .causal(Causal::BottomRight)
            .output_into(tensor(&outb, &op, f, [1, 4, 1, 16]))
    };
    let forms = call(8).prepare_blocking(&fresh, 1..=cap).unwrap();
    // CPU adapters: the decode path from 512 keys and the fused one below; GPUs run one
    // query row by the decode kernel at every length.
    let least = if ctx.is_cpu() { 2 } else { 1 };
    assert!(forms >= least, "the decode path and another: {forms}");
    let prepared = fresh.cached_pipelines();
    for s in [3, 511, 512, 700] {
        call(s).run_blocking(&fresh).unwrap();
        assert_eq!(fresh.cached_pipelines(), prepared, "S = {s} compiled a kernel");
        let mut case = Case::random((1, 4, 2, 1, s, 16, 16), 60);
        case.q = full.q.clone();
        case.k = full.k.slice(ndarray::s![.., .., ..s, ..]).to_owned();
        case.v = full.v.slice(ndarray::s![.., .., ..s, ..]).to_owned();
        case.causal = Causal::BottomRight;
        let (got, stray) = read_back(&fresh, &outb, &op, f, [1, 4, 1, 16], SENTINEL);
        assert_eq!(stray, 0);
        assert_report(
            compare(got.iter().copied(), case.reference().out.iter().copied(), TOL),
            &format!("S = {s}"),
        );
    }
}

/// The call on `buf` with q, k, v and the output at those elements.
fn shared<'a>(
    buf: &'a wgpu::Buffer,
    st: Storage,
    at: [usize; 4],
    dims: [usize; 5],
    opts: &wgpu_attention::Options<'a>,
) -> Sdpa<'a> {
    let [b, hq, hkv, l, s] = dims;
    let e = 7;
    let t = |at: usize, shape: [usize; 4]| {
        Tensor::from_buffer(buf, st, &shape).at_offset(at as u64 * st.element_bytes())
    };
    Sdpa::new(
        t(at[0], [b, hq, l, e]),
        t(at[1], [b, hkv, s, e]),
        t(at[2], [b, hkv, s, e]),
    )
    .options(opts.clone())
    .output_into(t(at[3], [b, hq, l, e]))
}

/// One buffer holding q, k, v and the output side by side (a fused QKV projection's buffer, a
/// tensor allocator's pool): the output in a range of its own is written right on every path
/// (through a scratch copy: wgpu binds one buffer either read-only or read-write in a
/// dispatch) and every other element survives, also where an f16 tensor of an odd element
/// count ends inside a word the next tensor begins. An output that overlaps an input, or a
/// shared buffer without the copy usages, is a typed error before any GPU work.
#[test]
fn inputs_and_outputs_share_one_buffer() {
    let Some(ctx) = ctx() else { return };
    use wgpu::util::DeviceExt;
    let (b, hq, hkv, l, s, e) = (1, 3, 1, 5, 6, 7);
    let mut r = common::rng(50);
    let q: Array4<f32> = common::rand_array(&mut r, (b, hq, l, e));
    let k: Array4<f32> = common::rand_array(&mut r, (b, hkv, s, e));
    let v: Array4<f32> = common::rand_array(&mut r, (b, hkv, s, e));
    let opts = wgpu_attention::Options {
        causal: Causal::BottomRight,
        ..Default::default()
    };
    let (nq, nk) = (q.len(), k.len()); // 105 and 42: f16 q and the output end inside a word
                                       // Orders: the output first (dense at offset 0, an odd count of halves before q) and last
                                       // (at an odd element offset, a view).
    for (order, st) in [
        ("out first", Storage::F32),
        ("out first", Storage::F16),
        ("out last", Storage::F16),
    ] {
        let out_first = order == "out first";
        let (q_at, out_at) = if out_first { (nq, 0) } else { (0, nq + 2 * nk + 1) };
        let (k_at, v_at) = (q_at + nq, q_at + nq + nk);
        let total = if out_first { v_at + nk + 9 } else { out_at + nq + 9 };
        let mut host: Vec<f32> = (0..total).map(|i| 1000.0 + i as f32).collect();
        for (at, x) in [(q_at, &q), (k_at, &k), (v_at, &v)] {
            for (i, &y) in x.iter().enumerate() {
                host[at + i] = y;
            }
        }
        let host: Vec<f32> = host.iter().map(|&x| st.round(x)).collect();
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let make = |usage| {
            ctx.device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("one buffer"),
                    contents: &encode(&host, st),
                    usage,
                })
        };
        let dims = [b, hq, hkv, l, s];
        let rq = q.mapv(|x| st.round(x));
        let (rk, rv) = (k.mapv(|x| st.round(x)), v.mapv(|x| st.round(x)));
        let want = wgpu_attention::reference::sdpa(rq.view(), rk.view(), rv.view(), &opts).unwrap();
        for path in [Path::Auto, Path::Fused, Path::Decode, Path::Unfused] {
            let buf = make(usage);
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            shared(&buf, st, [q_at, k_at, v_at, out_at], dims, &opts)
                .path(path)
                .record(ctx, &mut enc)
                .unwrap_or_else(|e| panic!("{order} {st:?} {path:?}: {e}"));
            ctx.queue().submit([enc.finish()]);
            let all = pollster::block_on(ctx.read_as_f32(&buf, 0, total, st)).unwrap();
            let got = &all[out_at..out_at + nq];
            let tol = if st == Storage::F32 {
                TOL
            } else {
                twice_storage_tolerance(st)
            };
            assert_report(
                compare(got.iter().copied(), want.out.iter().copied(), tol),
                &format!("{order} {st:?} {path:?}"),
            );
            let stray: Vec<usize> = (0..total)
                .filter(|&i| !(out_at..out_at + nq).contains(&i) && all[i].to_bits() != host[i].to_bits())
                .collect();
            assert!(
                stray.is_empty(),
                "{order} {st:?} {path:?}: elements changed outside the output: {stray:?}"
            );
        }
        // Overlap with q, then with v: typed errors naming the output.
        let buf = make(usage);
        for bad_at in [q_at + 3, v_at + nk - 1] {
            let r = shared(&buf, st, [q_at, k_at, v_at, bad_at], dims, &opts).problem();
            assert!(
                matches!(&r, Err(Error::BadBuffer { tensor: "output", reason }) if reason.contains("overlap")),
                "{order} {st:?} at {bad_at}: {r:?}"
            );
        }
        // Without COPY_SRC and COPY_DST the shared buffer cannot take the scratch copy.
        let plain = make(wgpu::BufferUsages::STORAGE);
        let r = shared(&plain, st, [q_at, k_at, v_at, out_at], dims, &opts).problem();
        assert!(
            matches!(&r, Err(Error::BadBuffer { tensor: "output", reason }) if reason.contains("COPY_DST")),
            "{r:?}"
        );
    }
}

/// record_matmul: a, b and c in one buffer (each at a 256-byte boundary); c overlapping b is
/// a typed error.
#[test]
fn matmul_operands_share_one_buffer() {
    let Some(ctx) = ctx() else { return };
    use wgpu::util::DeviceExt;
    let a: Vec<f32> = (0..15).map(|i| i as f32 * 0.25).collect();
    let bm: Vec<f32> = (0..20).map(|i| 1.0 - i as f32 * 0.125).collect();
    let mut host = vec![-3.0f32; 64 * 3 + 16];
    host[..15].copy_from_slice(&a);
    host[64..84].copy_from_slice(&bm);
    let buf = ctx
        .device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("matmul one buffer"),
            contents: bytemuck::cast_slice(&host),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        });
    let f =
        |at: usize, shape: &[usize]| Tensor::from_buffer(&buf, Storage::F32, shape).at_offset(at as u64 * 4);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    wgpu_attention::record_matmul(
        ctx,
        &mut enc,
        f(0, &[1, 3, 5]),
        f(64, &[1, 5, 4]),
        f(128, &[1, 3, 4]),
        false,
        1.0,
    )
    .unwrap();
    ctx.queue().submit([enc.finish()]);
    let all = pollster::block_on(ctx.read_f32(&buf, 0, host.len() as u64 * 4)).unwrap();
    for i in 0..3 {
        for j in 0..4 {
            let want: f32 = (0..5).map(|x| a[i * 5 + x] * bm[x * 4 + j]).sum();
            assert!((all[128 + i * 4 + j] - want).abs() < 1e-5, "c[{i}, {j}]");
        }
    }
    for (i, (&x, &h)) in all.iter().zip(&host).enumerate() {
        assert!((128..140).contains(&i) || x == h, "matmul changed element {i}");
    }
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let r = wgpu_attention::record_matmul(
        ctx,
        &mut enc,
        f(0, &[1, 3, 5]),
        f(64, &[1, 5, 4]),
        f(64, &[1, 3, 4]),
        false,
        1.0,
    );
    assert!(matches!(&r, Err(Error::BadBuffer { tensor: "c", .. })), "{r:?}");
}
