//! burn's tensors through the crate's kernels on lavapipe: the forward against burn's own
//! attention and the CPU reference (every option burn has, and the crate's own), gradients
//! through burn's autodiff against both, a few training steps of a tiny burn model against the
//! same steps with burn's attention, and misuse as typed errors.

use burn::prelude::*;
use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, TensorData};
use ndarray::{Array4, ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use wgpu_attention::check::{compare, Tolerance, F32_TOLERANCE};
use wgpu_attention::{half, reference, Options};
use wgpu_attention_burn::{attention, device_on, new_context, Attention, Causal, Context, Error};

/// The context and burn's device on it; fails (never skips) without an adapter.
fn setup() -> (Context, Device) {
    let ctx = new_context().expect("a GPU context (lavapipe here)");
    let device = device_on(&ctx).expect("burn's runtime on the context");
    (ctx, device)
}

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn tensor(data: &[f32], shape: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::from_data(TensorData::new(data.to_vec(), shape), device)
}

fn host(t: Tensor<4>) -> Vec<f32> {
    t.into_data().as_slice::<f32>().expect("f32").to_vec()
}

fn arr(data: &[f32], shape: [usize; 4]) -> Array4<f32> {
    Array4::from_shape_vec(shape, data.to_vec()).unwrap()
}

/// Twice the crate's f32 tolerance: gradients, and results two implementations computed.
const TWICE: Tolerance = Tolerance {
    atol: 2.0 * F32_TOLERANCE.atol,
    rtol: 2.0 * F32_TOLERANCE.rtol,
};

fn assert_close<E: Into<f64> + Copy>(
    got: &[f32],
    want: impl IntoIterator<Item = E>,
    tol: Tolerance,
    label: &str,
) {
    let want: Vec<f64> = want.into_iter().map(Into::into).collect();
    assert_eq!(got.len(), want.len(), "{label}: length");
    let r = compare(got.iter().copied(), want, tol);
    assert!(r.passed(), "{label}: {r}");
}

/// One forward case: shapes `[B, H, L, S, E, Ev]` with `hkv` key/value heads.
struct Case {
    b: usize,
    h: usize,
    hkv: usize,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
}

impl Case {
    /// `[B, H, Hkv, L, S, E, Ev]`.
    const fn new([b, h, hkv, l, s, e, ev]: [usize; 7]) -> Case {
        Case {
            b,
            h,
            hkv,
            l,
            s,
            e,
            ev,
        }
    }
    /// q, k, v filled from seeds `seed`, `seed + 1`, `seed + 2`.
    fn qkv(&self, seed: u64) -> [Vec<f32>; 3] {
        let n = |shape| Case::n(shape);
        [
            randn(n(self.q()), seed),
            randn(n(self.k()), seed + 1),
            randn(n(self.v()), seed + 2),
        ]
    }
    /// The f64 reference's output for q, k, v with options `r`.
    fn reference(&self, [q, k, v]: &[Vec<f32>; 3], r: &Options) -> Vec<f64> {
        let out = reference::sdpa(
            arr(q, self.q()).view(),
            arr(k, self.k()).view(),
            arr(v, self.v()).view(),
            r,
        );
        out.unwrap().out.iter().copied().collect()
    }
    fn q(&self) -> [usize; 4] {
        [self.b, self.h, self.l, self.e]
    }
    fn k(&self) -> [usize; 4] {
        [self.b, self.hkv, self.s, self.e]
    }
    fn v(&self) -> [usize; 4] {
        [self.b, self.hkv, self.s, self.ev]
    }
    fn scores(&self) -> [usize; 4] {
        [self.b, self.h, self.l, self.s]
    }
    fn n(s: [usize; 4]) -> usize {
        s.iter().product()
    }
}

/// burn's mask (true = masked): random, with query row 3 of every batch and head masked
/// entirely (a fully masked row: 0 in both libraries).
fn burn_mask(c: &Case, seed: u64) -> Vec<bool> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut m: Vec<bool> = (0..Case::n(c.scores()))
        .map(|_| rng.random::<f32>() < 0.3)
        .collect();
    for bh in 0..c.b * c.h {
        for j in 0..c.s {
            m[(bh * c.l + 3) * c.s + j] = true;
        }
    }
    m
}

/// The options burn's attention has, each alone and all together.
#[derive(Clone, Copy, Debug)]
struct BurnOpts {
    causal: bool,
    mask: bool,
    bias: bool,
    scale: Option<f64>,
    softcap: Option<f64>,
}

impl BurnOpts {
    /// The same options in the crate's terms: the mask `allowed` (true = may attend) and the
    /// bias where asked for.
    fn in_crate_terms<'a>(&self, allowed: &'a [bool], bias: &'a Array4<f32>) -> Options<'a> {
        Options {
            causal: if self.causal {
                Causal::BottomRight
            } else {
                Causal::None
            },
            scale: self.scale,
            softcap: self.softcap.map(|x| x as f32),
            mask: self
                .mask
                .then(|| wgpu_attention::Mask::from_slice(allowed, bias.shape())),
            bias: self.bias.then(|| bias.into()),
            ..Default::default()
        }
    }
}

const NONE: BurnOpts = BurnOpts {
    causal: false,
    mask: false,
    bias: false,
    scale: None,
    softcap: None,
};

#[test]
fn forward_matches_burns_attention_and_the_reference() {
    let (_ctx, device) = setup();
    // Not multiples of any tile; L != S; Ev != E.
    let c = Case::new([2, 3, 3, 37, 53, 24, 20]);
    let qkv = c.qkv(1);
    let [q, k, v] = &qkv;
    let bias = randn(Case::n(c.scores()), 4);
    let mask = burn_mask(&c, 5);
    let cases = [
        NONE,
        BurnOpts { causal: true, ..NONE },
        BurnOpts { mask: true, ..NONE },
        BurnOpts { bias: true, ..NONE },
        BurnOpts {
            scale: Some(0.3),
            ..NONE
        },
        BurnOpts {
            softcap: Some(2.5),
            ..NONE
        },
        BurnOpts {
            causal: true,
            mask: true,
            bias: true,
            scale: Some(0.2),
            softcap: Some(3.0),
        },
    ];
    for o in cases {
        let label = format!("{o:?}");
        let bt = |d: &[f32], s| tensor(d, s, &device);
        let burn_m = o
            .mask
            .then(|| Tensor::<4, Bool>::from_data(TensorData::new(mask.clone(), c.scores()), &device));
        let burn_b = o.bias.then(|| bt(&bias, c.scores()));
        let opts = AttentionModuleOptions {
            scale: o.scale,
            softcap: o.softcap,
            is_causal: o.causal,
        };
        let ours = attention(
            bt(q, c.q()),
            bt(k, c.k()),
            bt(v, c.v()),
            burn_m.clone(),
            burn_b.clone(),
            opts,
        )
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(ours.dims(), [c.b, c.h, c.l, c.ev], "{label}");
        let ours = host(ours);
        let theirs = host(burn_attention(
            bt(q, c.q()),
            bt(k, c.k()),
            bt(v, c.v()),
            burn_m,
            burn_b,
            opts,
        ));
        assert_close(
            &ours,
            theirs.iter().copied(),
            TWICE,
            &format!("{label}: against burn"),
        );

        // The CPU reference (f64) with the same options in the crate's terms.
        let allowed: Vec<bool> = mask.iter().map(|m| !m).collect();
        let bias_arr = arr(&bias, c.scores());
        let r = o.in_crate_terms(&allowed, &bias_arr);
        assert_close(
            &ours,
            c.reference(&qkv, &r),
            F32_TOLERANCE,
            &format!("{label}: against the reference"),
        );
    }
}

#[test]
fn grouped_query_heads_and_the_crates_own_options() {
    let (_ctx, device) = setup();
    let c = Case::new([2, 6, 2, 19, 45, 16, 16]);
    let (q, k, v) = (
        randn(Case::n(c.q()), 11),
        randn(Case::n(c.k()), 12),
        randn(Case::n(c.v()), 13),
    );
    let slopes = wgpu_attention::alibi_slopes(c.h);
    let calls: Vec<(&str, Attention, Options<'static>)> = vec![
        ("gqa", Attention::new(), Options::default()),
        (
            "window with sinks, top-left causal",
            Attention::new()
                .causal(Causal::TopLeft)
                .window(7, 0)
                .sink_tokens(2),
            Options {
                causal: Causal::TopLeft,
                window: Some((7, 0)),
                sink_tokens: 2,
                ..Default::default()
            },
        ),
        (
            "alibi, key lengths, sink logits",
            Attention::new()
                .alibi(&slopes)
                .kv_lens(&[45, 20])
                .sink_logits(&[0.5; 6]),
            Options {
                alibi: Some(slopes.clone()),
                kv_lens: Some(vec![45, 20]),
                sink_logits: Some(vec![0.5; 6]),
                ..Default::default()
            },
        ),
    ];
    for (label, call, r) in calls {
        let out = call
            .forward(
                tensor(&q, c.q(), &device),
                tensor(&k, c.k(), &device),
                tensor(&v, c.v(), &device),
            )
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let want = reference::sdpa(
            arr(&q, c.q()).view(),
            arr(&k, c.k()).view(),
            arr(&v, c.v()).view(),
            &r,
        )
        .unwrap();
        assert_close(&host(out), want.out.iter().copied(), F32_TOLERANCE, label);
    }
}

#[test]
fn views_burn_made_are_read_in_place() {
    // q, k, v as head-split views of [B, L, H, E] projections (burn's swap_dims: strided,
    // not contiguous), and a bias broadcast from [1, 1, L, S].
    let (_ctx, device) = setup();
    let (b, l, h, e) = (2, 21, 4, 8);
    let x = randn(b * l * h * e * 3, 21);
    let packed = Tensor::<3>::from_data(TensorData::new(x.clone(), [b, l, 3 * h * e]), &device);
    let part = |i: usize| {
        packed
            .clone()
            .narrow(2, i * h * e, h * e)
            .reshape([b, l, h, e])
            .swap_dims(1, 2)
    };
    let bias = randn(l * l, 22);
    let out = Attention::new()
        .bias(tensor(&bias, [1, 1, l, l], &device))
        .forward(part(0), part(1), part(2))
        .unwrap();
    // The reference on the same values, made contiguous on the host.
    let host_part = |i: usize| {
        let mut a = Array4::<f32>::zeros((b, h, l, e));
        for ((bi, hi, li, ei), x_) in a.indexed_iter_mut() {
            *x_ = x[(bi * l + li) * 3 * h * e + i * h * e + hi * e + ei];
        }
        a
    };
    let bias_arr = ArrayD::from_shape_vec(IxDyn(&[1, 1, l, l]), bias).unwrap();
    let r = Options {
        bias: Some((&bias_arr).into()),
        ..Default::default()
    };
    let want = reference::sdpa(host_part(0).view(), host_part(1).view(), host_part(2).view(), &r).unwrap();
    assert_close(
        &host(out),
        want.out.iter().copied(),
        F32_TOLERANCE,
        "strided views",
    );
}

#[test]
fn half_precision_tensors_keep_their_format() {
    let (_ctx, device) = setup();
    let c = Case::new([1, 2, 2, 13, 29, 32, 32]);
    let f16 = |x: &[f32]| x.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>();
    let (q, k, v) = (
        f16(&randn(Case::n(c.q()), 31)),
        f16(&randn(Case::n(c.k()), 32)),
        f16(&randn(Case::n(c.v()), 33)),
    );
    // The format given at creation (without it, `from_data` converts to the device's default
    // float format).
    let t = |d: &[half::f16], s: [usize; 4]| {
        let f16 = burn::tensor::TensorCreationOptions {
            device: device.clone(),
            dtype: Some(burn::tensor::DType::F16),
        };
        Tensor::<4>::from_data(TensorData::new(d.to_vec(), s), f16)
    };
    let out = Attention::new()
        .causal(Causal::BottomRight)
        .forward(t(&q, c.q()), t(&k, c.k()), t(&v, c.v()))
        .unwrap();
    assert_eq!(out.dtype(), burn::tensor::DType::F16);
    let got: Vec<f32> = out
        .into_data()
        .as_slice::<half::f16>()
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let wide =
        |x: &[half::f16], s| Array4::from_shape_vec(s, x.iter().map(|v| v.to_f32()).collect()).unwrap();
    let r = Options {
        causal: Causal::BottomRight,
        ..Default::default()
    };
    let want = reference::sdpa(
        wide(&q, c.q()).view(),
        wide(&k, c.k()).view(),
        wide(&v, c.v()).view(),
        &r,
    )
    .unwrap();
    let tol = wgpu_attention::check::F16_TOLERANCE;
    assert_close(&got, want.out.iter().copied(), tol, "f16");
}

#[test]
fn gradients_through_burns_autodiff_match_burn_and_the_reference() {
    let (_ctx, device) = setup();
    let device = device.autodiff();
    let c = Case::new([2, 2, 2, 23, 31, 16, 12]);
    let [q, k, v] = c.qkv(41);
    let (bias, dout) = (randn(Case::n(c.scores()), 44), randn(c.b * c.h * c.l * c.ev, 45));
    let mask = burn_mask(&c, 46);
    for causal in [false, true] {
        let label = format!("causal {causal}");
        let leaf = |d: &[f32], s| tensor(d, s, &device).require_grad();
        let (tq, tk, tv, tb) = (
            leaf(&q, c.q()),
            leaf(&k, c.k()),
            leaf(&v, c.v()),
            leaf(&bias, c.scores()),
        );
        let m = Tensor::<4, Bool>::from_data(TensorData::new(mask.clone(), c.scores()), &device);
        let opts = AttentionModuleOptions {
            scale: None,
            softcap: Some(4.0),
            is_causal: causal,
        };
        let grads_of = |out: Tensor<4>| {
            let loss = (out * tensor(&dout, [c.b, c.h, c.l, c.ev], &device)).sum();
            let g = loss.backward();
            let get = |t: &Tensor<4>| host(t.grad(&g).expect("a gradient"));
            [get(&tq), get(&tk), get(&tv), get(&tb)]
        };
        let ours = grads_of(
            attention(
                tq.clone(),
                tk.clone(),
                tv.clone(),
                Some(m.clone()),
                Some(tb.clone()),
                opts,
            )
            .unwrap(),
        );
        let theirs = grads_of(burn_attention(
            tq.clone(),
            tk.clone(),
            tv.clone(),
            Some(m.clone()),
            Some(tb.clone()),
            opts,
        ));

        let allowed: Vec<bool> = mask.iter().map(|m| !m).collect();
        let bias_arr = arr(&bias, c.scores());
        let r = Options {
            causal: if causal { Causal::BottomRight } else { Causal::None },
            softcap: Some(4.0),
            mask: Some(wgpu_attention::Mask::from_slice(&allowed, &c.scores())),
            bias: Some((&bias_arr).into()),
            ..Default::default()
        };
        let dout_arr = arr(&dout, [c.b, c.h, c.l, c.ev]);
        let want = reference::sdpa_backward(
            arr(&q, c.q()).view(),
            arr(&k, c.k()).view(),
            arr(&v, c.v()).view(),
            dout_arr.view(),
            &r,
        )
        .unwrap();
        let dbias = want.dbias.expect("a bias");
        let wants: [Vec<f64>; 4] = [
            want.dq.iter().copied().collect(),
            want.dk.iter().copied().collect(),
            want.dv.iter().copied().collect(),
            dbias.iter().copied().collect(),
        ];
        for (i, name) in ["dq", "dk", "dv", "dbias"].iter().enumerate() {
            assert_close(
                &ours[i],
                wants[i].iter().copied(),
                TWICE,
                &format!("{label}: {name} against the reference"),
            );
            assert_against_burns_gradient(&c, name, &ours[i], &theirs[i], &label);
        }
    }
}

/// `ours` against burn's gradient `theirs` of `name`. burn's own (unfused) backward gives NaN
/// in d(bias) on the fully masked rows (query row 3), where the reference and this crate give 0:
/// compared everywhere else.
fn assert_against_burns_gradient(c: &Case, name: &str, ours: &[f32], theirs: &[f32], label: &str) {
    let theirs: Vec<f32> = theirs
        .iter()
        .enumerate()
        .map(|(j, &t)| {
            if t.is_nan() {
                assert_eq!(
                    (name, (j / c.s) % c.l),
                    ("dbias", 3),
                    "{label}: burn's NaN at {j}"
                );
                assert_eq!(ours[j], 0.0, "{label}: ours on a fully masked row");
                0.0
            } else {
                t
            }
        })
        .collect();
    assert_close(ours, theirs, TWICE, &format!("{label}: {name} against burn"));
}

/// A tiny burn transformer block: q, k, v, o projections and one attention call.
#[derive(Module, Debug)]
struct Block {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
}

const HEADS: usize = 2;

impl Block {
    fn new(d: usize, device: &Device) -> Block {
        let lin = || nn::LinearConfig::new(d, d).init(device);
        Block {
            q: lin(),
            k: lin(),
            v: lin(),
            o: lin(),
        }
    }

    fn forward(&self, x: Tensor<3>, ours: bool) -> Tensor<3> {
        let [b, l, d] = x.dims();
        let heads = |t: Tensor<3>| t.reshape([b, l, HEADS, d / HEADS]).swap_dims(1, 2);
        let (q, k, v) = (
            heads(self.q.forward(x.clone())),
            heads(self.k.forward(x.clone())),
            heads(self.v.forward(x)),
        );
        let opts = AttentionModuleOptions {
            is_causal: true,
            ..Default::default()
        };
        let a = if ours {
            attention(q, k, v, None, None, opts).expect("attention")
        } else {
            burn_attention(q, k, v, None, None, opts)
        };
        self.o.forward(a.swap_dims(1, 2).reshape([b, l, d]))
    }
}

#[test]
fn a_tiny_transformer_trains_as_with_burns_attention() {
    use burn::optim::{AdamConfig, GradientsParams};
    let (_ctx, device) = setup();
    let device = device.autodiff();
    let (b, l, d) = (2, 12, 16);
    let x = Tensor::<3>::from_data(TensorData::new(randn(b * l * d, 51), [b, l, d]), &device);
    let target = Tensor::<3>::from_data(TensorData::new(randn(b * l * d, 52), [b, l, d]), &device);
    let start = Block::new(d, &device);
    let curve = |ours: bool| {
        let mut model = start.clone();
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::new();
        for _ in 0..6 {
            let loss = (model.forward(x.clone(), ours) - target.clone())
                .powi_scalar(2)
                .mean();
            losses.push(loss.clone().into_scalar::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        losses
    };
    let (ours, theirs) = (curve(true), curve(false));
    assert!(ours.last() < ours.first(), "the loss falls: {ours:?}");
    for (i, (a, t)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            (a - t).abs() <= 1e-4 + 1e-3 * t.abs(),
            "step {i}: ours {a}, burn's {t} ({ours:?} vs {theirs:?})"
        );
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let (ctx, device) = setup();
    let q = Tensor::<4>::zeros([1, 2, 8, 16], &device);
    // Another context's device.
    let other_ctx = new_context().unwrap();
    let other = device_on(&other_ctx).unwrap();
    let k = Tensor::<4>::zeros([1, 2, 8, 16], &other);
    match Attention::new().forward(q.clone(), k, q.clone()) {
        Err(Error::DifferentDevices { name: "k", .. }) => {}
        other => panic!("another device's k: {other:?}"),
    }
    // A device burn made without this crate.
    let lazy = Device::wgpu(DeviceKind::Cpu);
    let lq = Tensor::<4>::zeros([1, 2, 8, 16], &lazy);
    match Attention::new().forward(lq.clone(), lq.clone(), lq) {
        Err(Error::UnknownDevice { name: "q", .. }) => {}
        other => panic!("burn's own device: {other:?}"),
    }
    // Shapes the kernels refuse: an error, before any GPU work.
    let k = Tensor::<4>::zeros([1, 2, 8, 12], &device);
    match Attention::new().forward(q.clone(), k.clone(), k) {
        Err(Error::Attention(_)) => {}
        other => panic!("E of k differs from q's: {other:?}"),
    }
    // A context with no adapter to hand burn.
    let bare = Context::from_device(ctx.device().clone(), ctx.queue().clone());
    assert!(matches!(device_on(&bare), Err(Error::Setup(_))));
    // A device without the adapter's features burn compiles for (lavapipe has 64-bit integers,
    // which burn's matmul uses and the crate's kernels do not request).
    let plain = Context::new_blocking().unwrap();
    let lacking = plain.adapter().unwrap().features() - plain.device().features();
    if lacking.intersects(wgpu_attention_burn::burn_features()) {
        match device_on(&plain) {
            Err(Error::Setup(m)) => assert!(m.contains("new_context"), "{m}"),
            other => panic!("a device without the adapter's features: {other:?}"),
        }
    }
}

#[test]
fn a_device_burn_made_is_adopted() {
    // The other way round: burn makes the device (its default adapter and settings), and the
    // crate adopts it; gradients on its autodiff device with burn's balanced checkpointing.
    let (device, ctx) = wgpu_attention_burn::new_device().expect("burn's device");
    assert!(ctx.instance().is_some() && ctx.adapter().is_some());
    let again = wgpu_attention_burn::context_of(&device.clone().autodiff()).unwrap();
    assert_eq!(again.adapter_info().name, ctx.adapter_info().name);
    let c = Case::new([1, 2, 1, 9, 14, 8, 8]);
    let (q, k, v) = (
        randn(Case::n(c.q()), 61),
        randn(Case::n(c.k()), 62),
        randn(Case::n(c.v()), 63),
    );
    let out = Attention::new()
        .forward(
            tensor(&q, c.q(), &device),
            tensor(&k, c.k(), &device),
            tensor(&v, c.v(), &device),
        )
        .unwrap();
    let want = reference::sdpa(
        arr(&q, c.q()).view(),
        arr(&k, c.k()).view(),
        arr(&v, c.v()).view(),
        &Options::default(),
    )
    .unwrap();
    assert_close(
        &host(out),
        want.out.iter().copied(),
        F32_TOLERANCE,
        "burn's device",
    );

    let ad = device.autodiff().gradient_checkpointing();
    let tk = tensor(&k, c.k(), &ad).require_grad();
    let out = Attention::new()
        .causal(Causal::BottomRight)
        .forward(tensor(&q, c.q(), &ad), tk.clone(), tensor(&v, c.v(), &ad))
        .unwrap();
    let g = out.sum().backward();
    let dk = host(tk.grad(&g).expect("dk"));
    let ones = Array4::<f32>::ones((c.b, c.h, c.l, c.ev));
    let r = Options {
        causal: Causal::BottomRight,
        ..Default::default()
    };
    let want = reference::sdpa_backward(
        arr(&q, c.q()).view(),
        arr(&k, c.k()).view(),
        arr(&v, c.v()).view(),
        ones.view(),
        &r,
    )
    .unwrap();
    assert_close(
        &dk,
        want.dk.iter().copied(),
        TWICE,
        "dk with balanced checkpointing (grouped heads)",
    );
}

#[test]
fn masks_given_again_and_in_turn_each_give_their_own_result() {
    // The additive form of a mask is kept by the mask's id: two masks in turn, each given
    // again, and a new mask with the first one's values, each against the reference.
    let (_ctx, device) = setup();
    let c = Case::new([1, 2, 2, 11, 17, 8, 8]);
    let (q, k, v) = (
        randn(Case::n(c.q()), 71),
        randn(Case::n(c.k()), 72),
        randn(Case::n(c.v()), 73),
    );
    let masks = [burn_mask(&c, 74), burn_mask(&c, 75)];
    let tm = |m: &[bool]| Tensor::<4, Bool>::from_data(TensorData::new(m.to_vec(), c.scores()), &device);
    let (first, second) = (tm(&masks[0]), tm(&masks[1]));
    let runs = [
        (&first, 0),
        (&second, 1),
        (&first, 0),
        (&second, 1),
        (&tm(&masks[0]), 0),
    ];
    for (i, (m, which)) in runs.into_iter().enumerate() {
        let out = Attention::new()
            .mask(m.clone())
            .forward(
                tensor(&q, c.q(), &device),
                tensor(&k, c.k(), &device),
                tensor(&v, c.v(), &device),
            )
            .unwrap();
        let allowed: Vec<bool> = masks[which].iter().map(|x| !x).collect();
        let r = Options {
            mask: Some(wgpu_attention::Mask::from_slice(&allowed, &c.scores())),
            ..Default::default()
        };
        let want = reference::sdpa(
            arr(&q, c.q()).view(),
            arr(&k, c.k()).view(),
            arr(&v, c.v()).view(),
            &r,
        )
        .unwrap();
        assert_close(
            &host(out),
            want.out.iter().copied(),
            F32_TOLERANCE,
            &format!("call {i}, mask {which}"),
        );
    }
}
