//! Every input error is a typed error returned before any GPU work; device errors are returned.

mod common;

use common::{ctx, Case};
use ndarray::{Array, Array4, IxDyn};
use wgpu_attention::{Causal, Error, Sdpa, Tensor};

fn q() -> Array4<f32> {
    Array4::zeros((2, 4, 5, 8))
}

#[test]
fn shape_errors_are_typed() {
    let (q, k, v) = (
        q(),
        Array4::<f32>::zeros((2, 2, 7, 8)),
        Array4::<f32>::zeros((2, 2, 7, 3)),
    );
    // Validation needs no device: `problem()` reports the same errors `run` would.
    let bad_k = Array4::<f32>::zeros((2, 2, 7, 9));
    assert!(matches!(
        Sdpa::new(&q, &bad_k, &v).problem(),
        Err(Error::ShapeMismatch { tensor: "k", ref expected, ref actual }) if expected == &[2, 2, 7, 8] && actual == &[2, 2, 7, 9]
    ));
    let bad_v = Array4::<f32>::zeros((2, 2, 6, 3));
    assert!(matches!(
        Sdpa::new(&q, &k, &bad_v).problem(),
        Err(Error::ShapeMismatch { tensor: "v", .. })
    ));
    let bad_b = Array4::<f32>::zeros((3, 2, 7, 8));
    assert!(matches!(
        Sdpa::new(&q, &bad_b, &v).problem(),
        Err(Error::ShapeMismatch { tensor: "k", .. })
    ));
    let q3 = ndarray::Array3::<f32>::zeros((4, 5, 8));
    assert!(matches!(
        Sdpa::new(&q3, &k, &v).problem(),
        Err(Error::WrongRank {
            tensor: "q",
            expected: 4,
            actual: 3,
            ..
        })
    ));
    let empty = Array4::<f32>::zeros((2, 4, 0, 8));
    assert!(matches!(
        Sdpa::new(&empty, &k, &v).problem(),
        Err(Error::ZeroSized { tensor: "q", .. })
    ));
    let k3 = Array4::<f32>::zeros((2, 3, 7, 8));
    let v3 = Array4::<f32>::zeros((2, 3, 7, 3));
    assert!(matches!(
        Sdpa::new(&q, &k3, &v3).problem(),
        Err(Error::HeadsNotDivisible {
            q_heads: 4,
            kv_heads: 3
        })
    ));
}

#[test]
fn mask_bias_and_lengths_are_validated() {
    let (q, k, v) = (
        q(),
        Array4::<f32>::zeros((2, 2, 7, 8)),
        Array4::<f32>::zeros((2, 2, 7, 3)),
    );
    let m = Array::from_elem(IxDyn(&[3, 1, 5, 7]), true);
    assert!(matches!(
        Sdpa::new(&q, &k, &v).mask(&m).problem(),
        Err(Error::NotBroadcastable { tensor: "mask", .. })
    ));
    let m = Array::from_elem(IxDyn(&[5, 6]), true);
    assert!(matches!(
        Sdpa::new(&q, &k, &v).mask(&m).problem(),
        Err(Error::NotBroadcastable { tensor: "mask", .. })
    ));
    let m = Array::from_elem(IxDyn(&[1, 1, 1, 5, 7]), true);
    assert!(matches!(
        Sdpa::new(&q, &k, &v).mask(&m).problem(),
        Err(Error::WrongRank { tensor: "mask", .. })
    ));
    let b = Array::from_elem(IxDyn(&[2, 2, 5, 7]), 0.0f32);
    assert!(matches!(
        Sdpa::new(&q, &k, &v).bias(&b).problem(),
        Err(Error::NotBroadcastable { tensor: "bias", .. })
    ));
    let b = Array::from_elem(IxDyn(&[2, 4, 0, 7]), 0.0f32);
    assert!(matches!(
        Sdpa::new(&q, &k, &v).bias(&b).problem(),
        Err(Error::ZeroSized { tensor: "bias", .. })
    ));
    assert!(matches!(
        Sdpa::new(&q, &k, &v).kv_lens(&[7]).problem(),
        Err(Error::KvLensCount {
            expected: 2,
            actual: 1
        })
    ));
    assert!(matches!(
        Sdpa::new(&q, &k, &v).kv_lens(&[7, 8]).problem(),
        Err(Error::KvLenOutOfRange {
            batch: 1,
            len: 8,
            max: 7
        })
    ));
    assert!(matches!(
        Sdpa::new(&q, &k, &v).scale(f32::NAN).problem(),
        Err(Error::InvalidScale { .. })
    ));
    assert!(matches!(
        Sdpa::new(&q, &k, &v).scale(f32::INFINITY).problem(),
        Err(Error::InvalidScale { .. })
    ));
    let data = vec![true; 10];
    assert!(matches!(
        Sdpa::new(&q, &k, &v)
            .mask(wgpu_attention::Mask::from_slice(&data, &[5, 7]))
            .problem(),
        Err(Error::DataLength {
            tensor: "mask",
            expected: 35,
            actual: 10,
            ..
        })
    ));
}

#[test]
fn host_slice_length_is_checked_before_gpu_work() {
    let Some(ctx) = ctx() else { return };
    let data = vec![0f32; 10];
    let k = Array4::<f32>::zeros((1, 1, 3, 4));
    let e = Sdpa::new(Tensor::from_slice(&data, &[1, 1, 3, 4]), &k, &k)
        .run_blocking(ctx)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::DataLength {
                tensor: "q",
                expected: 12,
                actual: 10,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn caller_buffers_are_checked() {
    let Some(ctx) = ctx() else { return };
    let dev = ctx.device();
    let mk = |size: u64, usage: wgpu::BufferUsages| {
        dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage,
            mapped_at_creation: false,
        })
    };
    let k = Array4::<f32>::zeros((1, 1, 3, 4));
    let small = mk(16, wgpu::BufferUsages::STORAGE);
    let e = Sdpa::new(
        Tensor::from_buffer(&small, wgpu_attention::Storage::F32, &[1, 1, 3, 4]),
        &k,
        &k,
    )
    .run_blocking(ctx)
    .unwrap_err();
    assert!(matches!(e, Error::BadBuffer { tensor: "q", .. }), "{e}");
    let no_storage = mk(48, wgpu::BufferUsages::COPY_DST);
    let e = Sdpa::new(
        Tensor::from_buffer(&no_storage, wgpu_attention::Storage::F32, &[1, 1, 3, 4]),
        &k,
        &k,
    )
    .run_blocking(ctx)
    .unwrap_err();
    assert!(matches!(e, Error::BadBuffer { tensor: "q", .. }), "{e}");
    let big = mk(4096, wgpu::BufferUsages::STORAGE);
    // An offset inside an element.
    let e = Sdpa::new(
        Tensor::from_buffer(&big, wgpu_attention::Storage::F32, &[1, 1, 3, 4]).at_offset(6),
        &k,
        &k,
    )
    .run_blocking(ctx)
    .unwrap_err();
    assert!(matches!(e, Error::BadBuffer { tensor: "q", .. }), "{e}");
    // Any whole element is fine for Sdpa (read through a view); the layer needs the device's
    // alignment.
    Sdpa::new(
        Tensor::from_buffer(&big, wgpu_attention::Storage::F32, &[1, 1, 3, 4]).at_offset(4),
        &k,
        &k,
    )
    .run_blocking(ctx)
    .unwrap();
    let e = wgpu_attention::matmul_blocking(
        ctx,
        Tensor::from_buffer(&big, wgpu_attention::Storage::F32, &[1, 3, 4]).at_offset(4),
        Tensor::from_buffer(&big, wgpu_attention::Storage::F32, &[1, 3, 4]),
        true,
        1.0,
    )
    .unwrap_err();
    assert!(matches!(e, Error::BadBuffer { tensor: "a", .. }), "{e}");
    let e = Sdpa::new(&k, &k, &k)
        .output_into(Tensor::from_buffer(
            &small,
            wgpu_attention::Storage::F32,
            &[1, 1, 3, 4],
        ))
        .run_blocking(ctx)
        .unwrap_err();
    assert!(matches!(e, Error::BadBuffer { tensor: "output", .. }), "{e}");
}

#[test]
fn scores_that_cannot_be_chunked_are_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 1, 1, 4, 8, 2, 2), 1);
    let e = case
        .sdpa()
        .path(wgpu_attention::Path::Unfused)
        .max_scores_bytes(16)
        .run_blocking(ctx)
        .unwrap_err();
    assert!(matches!(e, Error::TooLargeForDevice { .. }), "{e}");
    assert!(e.to_string().contains("smallest chunk"), "{e}");
}

#[test]
fn destroyed_caller_buffer_is_a_returned_device_error() {
    let Some(ctx) = ctx() else { return };
    use wgpu::util::DeviceExt;
    let q = ctx
        .device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: &[0u8; 48],
            usage: wgpu::BufferUsages::STORAGE,
        });
    q.destroy();
    let k = Array4::<f32>::zeros((1, 1, 3, 4));
    let e = Sdpa::new(
        Tensor::from_buffer(&q, wgpu_attention::Storage::F32, &[1, 1, 3, 4]),
        &k,
        &k,
    )
    .causal(Causal::TopLeft)
    .run_blocking(ctx)
    .unwrap_err();
    assert!(matches!(e, Error::Validation(_)), "{e}");
    // The context is still usable afterwards.
    Case::random((1, 1, 1, 2, 2, 2, 2), 2).check(
        ctx,
        wgpu_attention::Path::Unfused,
        common::TOL,
        "after error",
    );
}

#[test]
fn fused_path_refuses_what_it_cannot_do() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::Path;
    let case = Case::random((1, 1, 1, 3, 4, 8, 8), 3);
    let e = case
        .sdpa()
        .path(Path::Fused)
        .return_weights()
        .run_blocking(ctx)
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { path: "fused", .. }), "{e}");
    // Head dim beyond the fused kernel: forced is an error, auto falls back to unfused.
    let big = Case::random((1, 1, 1, 3, 4, 300, 8), 4);
    let e = big.sdpa().path(Path::Fused).run_blocking(ctx).unwrap_err();
    assert!(matches!(e, Error::Unsupported { path: "fused", .. }), "{e}");
    assert_eq!(big.sdpa().resolved_path(ctx).unwrap(), Path::Unfused);
    assert_eq!(case.sdpa().resolved_path(ctx).unwrap(), Path::Fused);
    assert_eq!(
        case.sdpa().return_weights().resolved_path(ctx).unwrap(),
        Path::Unfused
    );
    big.check(ctx, Path::Auto, common::TOL, "E = 300 via auto");
}

/// Window sides below -1 and sink tokens without a window are typed errors before any GPU
/// work, on the forward, the backward and the layer alike; the ring refuses windows.
#[test]
fn window_options_are_validated() {
    let (q, k, v) = (
        q(),
        Array4::<f32>::zeros((2, 2, 7, 8)),
        Array4::<f32>::zeros((2, 2, 7, 3)),
    );
    for (left, right) in [(-2, 0), (0, -2), (i64::MIN, 5)] {
        let r = Sdpa::new(&q, &k, &v).window(left, right).problem();
        assert!(
            matches!(
                r,
                Err(Error::InvalidModifier {
                    modifier: "window",
                    ..
                })
            ),
            "({left}, {right}): {r:?}"
        );
    }
    let r = Sdpa::new(&q, &k, &v).sink_tokens(4).problem();
    assert!(
        matches!(
            r,
            Err(Error::InvalidModifier {
                modifier: "sink_tokens",
                ..
            })
        ),
        "{r:?}"
    );
    let msg = Sdpa::new(&q, &k, &v)
        .window(-3, 0)
        .problem()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("window") && msg.contains("-3"), "{msg}");
    // Unbounded both ways, huge sides and sinks past S are valid.
    for (l, r, n) in [(-1, -1, 0), (i64::MAX, i64::MAX, 0), (0, 0, 100)] {
        Sdpa::new(&q, &k, &v)
            .window(l, r)
            .sink_tokens(n)
            .problem()
            .unwrap();
    }
    let Some(ctx) = ctx() else { return };
    let dout = Array4::<f32>::zeros((2, 4, 5, 3));
    let r = Sdpa::new(&q, &k, &v)
        .window(-2, 0)
        .backward(&dout)
        .run_blocking(ctx);
    assert!(matches!(r, Err(Error::InvalidModifier { .. })), "{:?}", r.err());
    // The ring splits a window over the keys (tests/ring.rs), not with key lengths.
    let ring = wgpu_attention::Ring::new(std::slice::from_ref(ctx));
    let r = ring.run_blocking(&Sdpa::new(&q, &k, &v).window(4, 0).kv_lens(&[7, 5]));
    assert!(
        matches!(&r, Err(e @ Error::Ring { .. }) if e.to_string().contains("key lengths")),
        "{:?}",
        r.err()
    );
}

/// A softcap that is not finite and > 0, an ALiBi slope count that is not Hq or a slope that
/// is not finite: typed errors before any GPU work, forward and backward; the approximate
/// variants refuse both; the ring ALiBi with key lengths, and sink logits where the causal
/// mask hides the first keys from a whole query chunk.
#[test]
fn softcap_and_alibi_are_validated() {
    let (q, k, v) = (
        q(),
        Array4::<f32>::zeros((2, 2, 7, 8)),
        Array4::<f32>::zeros((2, 2, 7, 3)),
    );
    let is = |r: &wgpu_attention::Result<wgpu_attention::Problem>, m: &str| matches!(r, Err(Error::InvalidModifier { modifier, .. }) if *modifier == m);
    for c in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MAX, 1e38, 1e-39] {
        let r = Sdpa::new(&q, &k, &v).softcap(c).problem();
        assert!(is(&r, "softcap"), "{c}: {r:?}");
    }
    for slopes in [vec![0.5; 3], vec![0.5; 5], vec![], vec![0.5, f32::NAN, 0.5, 0.5]] {
        let r = Sdpa::new(&q, &k, &v).alibi(&slopes).problem();
        assert!(is(&r, "alibi"), "{slopes:?}: {r:?}");
    }
    for sinks in [vec![0.5; 3], vec![], vec![0.5, f32::INFINITY, 0.5, 0.5]] {
        let r = Sdpa::new(&q, &k, &v).sink_logits(&sinks).problem();
        assert!(is(&r, "sink_logits"), "{sinks:?}: {r:?}");
    }
    Sdpa::new(&q, &k, &v)
        .sink_logits(&[-30.0, 0.0, 3.0, 1e30])
        .problem()
        .unwrap();
    // Document ids: [B, L] = 10 and [B, S] = 14 (B 2, L 5, S 7), any values.
    for (qd, kd) in [(9, 14), (10, 13), (5, 7), (14, 10), (0, 0)] {
        let r = Sdpa::new(&q, &k, &v)
            .doc_ids(&vec![0; qd], &vec![0; kd])
            .problem();
        assert!(is(&r, "doc_ids"), "{qd}, {kd}: {r:?}");
    }
    let msg = Sdpa::new(&q, &k, &v)
        .doc_ids(&[0; 9], &[0; 14])
        .problem()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("9 query") && msg.contains("[B, L] = 10"), "{msg}");
    Sdpa::new(&q, &k, &v)
        .doc_ids(
            &[i32::MIN; 10],
            &[-1, 0, 1, i32::MAX, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0],
        )
        .problem()
        .unwrap();
    let msg = Sdpa::new(&q, &k, &v)
        .alibi(&[1.0; 3])
        .problem()
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("alibi") && msg.contains("3 slopes") && msg.contains("4 query heads"),
        "{msg}"
    );
    // Negative and zero slopes, tiny and huge caps are valid.
    Sdpa::new(&q, &k, &v)
        .softcap(1e-3)
        .alibi(&[0.0, -0.5, 1e6, 2.0])
        .problem()
        .unwrap();
    Sdpa::new(&q, &k, &v).softcap(8e37).problem().unwrap();
    let Some(ctx) = ctx() else { return };
    let dout = Array4::<f32>::zeros((2, 4, 5, 3));
    let r = Sdpa::new(&q, &k, &v)
        .softcap(-2.0)
        .backward(&dout)
        .run_blocking(ctx);
    assert!(matches!(r, Err(Error::InvalidModifier { .. })), "{:?}", r.err());
    // The ring splits a softcap, document ids, ALiBi and sink logits with the keys
    // (tests/ring.rs), with these exceptions.
    let ring = wgpu_attention::Ring::new(std::slice::from_ref(ctx));
    let q_long = Array4::<f32>::zeros((2, 4, 14, 8));
    for (sdpa, why) in [
        (
            Sdpa::new(&q, &k, &v).alibi(&[0.5; 4]).kv_lens(&[7, 5]),
            "key lengths",
        ),
        (
            Sdpa::new(&q_long, &k, &v)
                .sink_logits(&[0.5; 4])
                .causal(wgpu_attention::Causal::BottomRight),
            "first keys",
        ),
    ] {
        let r = ring.run_blocking(&sdpa);
        assert!(
            matches!(&r, Err(e @ Error::Ring { .. }) if e.to_string().contains(why)),
            "{why}: {:?}",
            r.err()
        );
    }
}

/// Sources a user function is refused for, the captures given with each, and what the
/// error says.
fn rejected_sources(good: &str) -> Vec<(String, &'static [&'static str], &'static str)> {
    vec![
    ("fn score_mod(s: f32, b: u32, h: u32) -> f32 { return s + t(h); }".to_string(), &["t"][..], "score_mod must be"),
    ("fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> u32 { return u32(t(h)); }".to_string(), &["t"], "mask_mod must be"),
    ("fn helper(x: u32) -> f32 { return t(x); }".to_string(), &["t"], "neither"),
    (good.to_string(), &["t", "t"], "twice"),
    (good.to_string(), &["t", "other"], "unknown"),
    (good.to_string(), &["t", "bad name"], "identifier"),
    (
        "@compute @workgroup_size(1) fn main() {}\nfn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return t(h) > 0.0; }".to_string(),
        &["t"],
        "entry point",
    ),
    // The capture gradients' function: its signature, its accumulators' callers, loops
    // and call count.
    (
        "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return t(h) > 0.0; }\n\
         fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) { d_t(h, g); }".to_string(),
        &["t"],
        "without score_mod",
    ),
    (
        format!("{good}\nfn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32) {{ d_t(h, 1.0); }}"),
        &["t"],
        "score_mod_dcapture must be",
    ),
    (
        format!("{good}\nfn helper(h: u32) {{ d_t(h, 1.0); }}"),
        &["t"],
        "only score_mod_dcapture may",
    ),
    (
        format!(
            "{good}\nfn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {{\n\
             for (var x = 0u; x < 2u; x++) {{ d_t(x, g); }}\n}}"
        ),
        &["t"],
        "in a loop",
    ),
    (
        format!(
            "{good}\nfn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {{\n{}}}",
            "d_t(h, g); ".repeat(9)
        ),
        &["t"],
        "at most 8",
    ),
    (
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { score_mod_dcapture(s, b, h, i, j, 1.0); return s + t(h); }\n\
         fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) { d_t(h, g); }".to_string(),
        &["t"],
        "the backward alone",
    ),
]
}

/// User WGSL functions: naga's rejection quoting the line, a wrong signature, no function,
/// duplicate and unknown captures, an entry point: typed errors from `problem()` (no GPU work);
/// the CPU reference without closures, the ring and the variants refuse too.
#[test]
fn user_functions_are_checked() {
    use wgpu_attention::UserMod;
    let (q, k, v) = (
        q(),
        Array4::<f32>::zeros((2, 2, 7, 8)),
        Array4::<f32>::zeros((2, 2, 7, 3)),
    );
    let table = [0.5f32; 4];
    let good = "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n    return s + t(h);\n}";
    let user = |src: &str| UserMod::wgsl(src).capture("t", &table);
    let err = |m: UserMod| Sdpa::new(&q, &k, &v).user_mod(m).problem().unwrap_err();
    // naga's message with the user's line (not the assembled kernel's), quoted.
    let e = err(user("fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n    let x = 1.0;\n    return s + t(h) + y;\n}"));
    let msg = e.to_string();
    assert!(matches!(e, Error::UserMod { line: Some(3), .. }), "{msg}");
    assert!(
        msg.contains("line 3") && msg.contains("return s + t(h) + y;"),
        "{msg}"
    );
    // A type error (validation, not parsing): a bool added to a float.
    let e = err(user(
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n    return s + t(h) + true;\n}",
    ));
    assert!(matches!(e, Error::UserMod { .. }), "{e}");
    for (src, names, want) in rejected_sources(good) {
        let m = names
            .iter()
            .fold(UserMod::wgsl(&src), |m, n| m.capture(n, &table));
        let e = err(m);
        assert!(
            matches!(e, Error::UserMod { .. }) && e.to_string().contains(want),
            "{src}: {e}"
        );
    }
    // A helper whose name is the kernels' own is renamed, not a collision.
    let own = "fn masked_logit(x: f32) -> f32 { return x * 2.0; }\nconst START: f32 = 1.0;\n\
               fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return masked_logit(s) + START + t(h); }";
    Sdpa::new(&q, &k, &v).user_mod(user(own)).problem().unwrap();
    // The reference needs the functions as closures.
    let opts = wgpu_attention::Options {
        user_mod: Some(user(good)),
        ..Default::default()
    };
    let r = wgpu_attention::reference::sdpa(q.view(), k.view(), v.view(), &opts);
    assert!(
        matches!(&r, Err(Error::UserMod { message, .. }) if message.contains("cpu_score")),
        "{:?}",
        r.err()
    );
    let Some(ctx) = ctx() else { return };
    // The ring splits user functions (tests/ring.rs); a rejected source fails it first.
    let ring = wgpu_attention::Ring::new(std::slice::from_ref(ctx));
    let r = ring.run_blocking(&Sdpa::new(&q, &k, &v).user_mod(user("fn score_mod(")));
    assert!(matches!(r, Err(Error::UserMod { .. })), "{:?}", r.err());
    // A rejected source fails the call before any GPU work.
    let r = Sdpa::new(&q, &k, &v)
        .user_mod(user("fn score_mod("))
        .run_blocking(ctx);
    assert!(matches!(r, Err(Error::UserMod { .. })), "{:?}", r.err());
}
