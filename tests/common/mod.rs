//! Shared test support for the native suite: the GPU context (skip or fail when there is none),
//! the blocking runs of the cases in `cases.rs` (shared with the browser suite) and the golden
//! files.
#![allow(dead_code)]

mod cases;
mod mixed;

pub use cases::*;
#[allow(unused_imports)]
pub use mixed::*;
use ndarray::{Array4, ArrayD};
use wgpu_attention::check::{compare, flash_rule, Report, Tolerance};
use wgpu_attention::reference;
use wgpu_attention::{wgpu, Context, Path};
use wgpu_attention::{Grads, Storage};

/// Nyström's tolerance (the pseudo-inverse iteration amplifies rounding):
/// `1e-4 · max|ref| + 1e-3 · |ref|`.
pub fn nystrom_tolerance<'r>(reference: impl IntoIterator<Item = &'r f64>) -> Tolerance {
    let max = reference.into_iter().fold(0.0f64, |m, x| m.max(x.abs()));
    Tolerance {
        atol: 1e-4 * max,
        rtol: 1e-3,
    }
}

/// A GPU context for one test: its own device, so that tests running in parallel compile
/// their shaders in parallel (lavapipe compiles a pipeline on its device's queue thread; one
/// shared device would serialise every compilation). Without an adapter: `None` (the test
/// returns early) unless `WGPU_ATTENTION_REQUIRE_GPU=1`, in which case the test fails.
pub fn ctx() -> Option<&'static Context> {
    match Context::new_blocking() {
        Ok(c) => {
            // A backend asked for by name (scripts/test.sh's GL pass) is the one that runs.
            if let Some(want) = wgpu::Backends::from_env() {
                let got = c.adapter_info().backend;
                assert!(
                    want.contains(got.into()),
                    "WGPU_BACKEND asks for {want:?}, got {got:?}"
                );
            }
            // Leaked: the context lives as long as the test process, like a static one.
            Some(Box::leak(Box::new(c)))
        }
        Err(e) => {
            if std::env::var("WGPU_ATTENTION_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("WGPU_ATTENTION_REQUIRE_GPU=1 but no GPU context: {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}

/// [`ctx`] made once per thread: for property tests, whose cases reuse one device and its
/// pipelines.
pub fn thread_ctx() -> Option<&'static Context> {
    thread_local!(static CTX: std::cell::OnceCell<Option<&'static Context>> = const { std::cell::OnceCell::new() });
    CTX.with(|c| *c.get_or_init(ctx))
}

impl Case {
    /// [`Case::check`] on every path.
    pub fn check_all_paths(&self, ctx: &Context, tol: Tolerance, label: &str) {
        for path in Path::ALL {
            self.check(ctx, path, tol, &format!("{label} [{path:?}]"));
        }
    }

    /// Run `path` on the GPU (with weights where the path offers them, and lse) and compare
    /// everything with the reference at `tol`. Panics with a report on mismatch.
    pub fn check(&self, ctx: &Context, path: Path, tol: Tolerance, label: &str) {
        self.check_against(&self.reference(), ctx, path, tol, label);
    }

    /// [`Case::check`] against a reference computed once.
    pub fn check_against(
        &self,
        want: &reference::Output,
        ctx: &Context,
        path: Path,
        tol: Tolerance,
        label: &str,
    ) {
        let got = self
            .checked_sdpa(path)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        self.assert_output(&got, want, path, tol, label);
    }
}

/// Every SDPA golden (`tests/fixtures/sdpa/<name>`), sorted by name.
pub fn goldens() -> Vec<Golden> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sdpa");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    let g: Vec<Golden> = dirs
        .iter()
        .map(|dir| {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            golden(&name, |f| std::fs::read(dir.join(f)).ok())
        })
        .collect();
    assert!(
        g.len() >= 12,
        "expected at least a dozen golden cases, found {}",
        g.len()
    );
    g
}

/// The boolean mask of an MHA fixture directory in this crate's convention (true = may
/// attend): its `key_padding_mask.npy` `[B, S]` as `[B, 1, 1, S]`, or its `attn_mask.npy`
/// `[L, S]` (PyTorch's masks are true = masked out).
pub fn mha_fixture_mask(dir: &std::path::Path) -> Option<ndarray::ArrayD<bool>> {
    use ndarray_npy::read_npy;
    if dir.join("attn_mask.npy").exists() {
        let am: ndarray::Array2<bool> = read_npy(dir.join("attn_mask.npy")).unwrap();
        return Some(am.mapv(|x| !x).into_dyn());
    }
    if dir.join("key_padding_mask.npy").exists() {
        let kpm: ndarray::Array2<bool> = read_npy(dir.join("key_padding_mask.npy")).unwrap();
        let (b, s) = kpm.dim();
        return Some(
            kpm.mapv(|x| !x)
                .into_shape_with_order(ndarray::IxDyn(&[b, 1, 1, s]))
                .unwrap(),
        );
    }
    None
}

/// One gradient against the f64 reference: in f32 by FlashAttention's rule (`plain`: the same
/// gradient from a plain f32 implementation); in a half format within the format's rounding of
/// `scale` (`atol = rtol(format) · scale + atol(format)`).
pub fn gradient_report<G, P>(got: &[G], want: &[f64], plain: &[P], storage: Storage, scale: f64) -> Report
where
    G: Copy + Into<f64>,
    P: Copy + Into<f64>,
{
    if storage == Storage::F32 {
        flash_rule(got.iter().copied(), want.iter().copied(), plain.iter().copied())
    } else {
        let t = Tolerance::for_storage(storage);
        compare(
            got.iter().copied(),
            want.iter().copied(),
            Tolerance {
                atol: t.rtol * scale + t.atol,
                rtol: 0.0,
            },
        )
    }
}

/// Check backward results `g` of `case` for upstream gradient `dout` against the f64
/// reference by FlashAttention's rule (f32: at most twice the plain f32 implementation's
/// error, plus 1e-5·max|ref| + 1e-6; half formats: twice the format's rounding of the largest
/// gradient), d(bias) included, and the forward output when the backward ran it.
pub fn assert_grads(case: &Case, g: &Grads, dout: &Array4<f32>, label: &str) {
    assert_grads_at(case, g, dout, case.storage, label)
}

/// [`assert_grads`] with the gradients held to `rule`'s rule: a half format's where a kernel
/// rounds f32 inputs to it (the matrix units' forms, pinned on f32 inputs).
pub fn assert_grads_at(case: &Case, g: &Grads, dout: &Array4<f32>, rule: Storage, label: &str) {
    let opts = case.options();
    let r64 =
        reference::sdpa_backward(case.q.view(), case.k.view(), case.v.view(), dout.view(), &opts).unwrap();
    let r32 = reference::sdpa_backward_f32(case.q.view(), case.k.view(), case.v.view(), dout.view(), &opts)
        .unwrap();
    let rule = |name: &str, got: &[f32], want: &[f64], plain: &[f32]| {
        // Half outputs: the format's rounding relative to the largest gradient.
        let max = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let report = gradient_report(got, want, plain, rule, 2.0 * max);
        assert!(report.passed(), "{label} {name}: {report}");
    };
    let flat = |a: &ArrayD<f64>| a.iter().copied().collect::<Vec<_>>();
    rule(
        "dq",
        g.dq.as_slice().unwrap(),
        r64.dq.as_slice().unwrap(),
        r32.dq.as_slice().unwrap(),
    );
    rule(
        "dk",
        g.dk.as_slice().unwrap(),
        r64.dk.as_slice().unwrap(),
        r32.dk.as_slice().unwrap(),
    );
    rule(
        "dv",
        g.dv.as_slice().unwrap(),
        r64.dv.as_slice().unwrap(),
        r32.dv.as_slice().unwrap(),
    );
    match (&g.dbias, &r64.dbias, &r32.dbias) {
        (Some(got), Some(want), Some(plain)) => {
            assert_eq!(got.shape(), want.shape(), "{label}: dbias shape");
            let got: Vec<f32> = got.iter().copied().collect();
            let plain: Vec<f32> = plain.iter().copied().collect();
            rule("dbias", &got, &flat(want), &plain);
        }
        (None, None, None) => {}
        _ => panic!("{label}: dbias presence differs"),
    }
    match (&g.dsink, &r64.dsink, &r32.dsink) {
        (Some(got), Some(want), Some(plain)) => rule(
            "dsink",
            got.as_slice().unwrap(),
            want.as_slice().unwrap(),
            plain.as_slice().unwrap(),
        ),
        (None, None, None) => {}
        _ => panic!("{label}: dsink presence differs"),
    }
    match (&g.dcaptures, &r64.dcaptures, &r32.dcaptures) {
        (Some(got), Some(want), Some(plain)) => {
            assert_eq!(got.len(), want.len(), "{label}: captures");
            for (k, ((got, want), plain)) in got.iter().zip(want).zip(plain).enumerate() {
                rule(
                    &format!("dcapture {k}"),
                    got.as_slice().unwrap(),
                    want.as_slice().unwrap(),
                    plain.as_slice().unwrap(),
                );
            }
        }
        // The reference differentiates every score closure; the GPU needs score_mod_dcapture.
        (None, _, _) if !has_dcapture(case) => {}
        _ => panic!("{label}: dcaptures presence differs"),
    }
    // The forward it ran on the way.
    let out = g.output.as_ref().expect("the forward's output");
    let report = compare(
        out.iter().copied(),
        r64.out.iter().copied(),
        twice_storage_tolerance(case.storage),
    );
    assert!(report.passed(), "{label}: forward output: {report}");
}

/// Whether the case's user source defines `score_mod_dcapture`.
fn has_dcapture(case: &Case) -> bool {
    case.user_mod
        .as_ref()
        .is_some_and(|m| format!("{m:?}").contains("score_mod_dcapture"))
}

/// `n` devices of the default adapter for the ring tests (as [`ctx`]: `None` without an
/// adapter, a failure instead under `WGPU_ATTENTION_REQUIRE_GPU=1`).
pub fn devices(n: usize) -> Option<Vec<Context>> {
    ctx()?;
    Some(Context::devices_blocking(n).expect("devices"))
}
