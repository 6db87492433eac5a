//! wgpu-attention in the browser: the web demo page (`web/index.html`, built by
//! `scripts/web.sh build` into `target/web/`).
//!
//! The page calls three functions, all async (the web has no blocking waits):
//! - [`self_check`]: shows the adapter, runs a prefill and a decoding problem on every path,
//!   checks each against the CPU reference computed here in the browser, and reports the
//!   timings; it ends by writing `check: PASS` (or `check: FAIL ...`) into the element with id
//!   `status`.
//! - [`draw_sentence`]: the attention weights of a typed sentence, drawn on a canvas.
//! - [`bench`]: the crate's named benchmark shapes timed in the browser (`?bench=a_h8_s1024,...`),
//!   as the CLI's `bench` times them natively.
//!
//! Everything here is for wasm32; on other targets the crate is empty.
#![cfg(target_arch = "wasm32")]
#![deny(missing_docs)]

use std::cell::RefCell;
use std::fmt::Write;

use ndarray::Array4;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wasm_bindgen::prelude::*;
use wgpu_attention::check::{compare, F32_TOLERANCE};
use wgpu_attention::{reference, shapes, Causal, Context, Options, Path, Sdpa};

thread_local! {
    /// The page's one GPU context (wasm32 is single-threaded).
    static CTX: RefCell<Option<Context>> = const { RefCell::new(None) };
}

/// The page's context, created on first use.
async fn context() -> Result<Context, String> {
    if let Some(c) = CTX.with(|c| c.borrow().clone()) {
        return Ok(c);
    }
    let ctx = Context::new()
        .await
        .map_err(|e| format!("no WebGPU device: {e}"))?;
    CTX.with(|c| *c.borrow_mut() = Some(ctx.clone()));
    Ok(ctx)
}

fn document() -> web_sys::Document {
    web_sys::window().and_then(|w| w.document()).expect("a document")
}

fn set_html(id: &str, html: &str) {
    if let Some(el) = document().get_element_by_id(id) {
        el.set_inner_html(html);
    }
}

fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map(|p| p.now())
        .unwrap_or(0.0)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Uniform values in [-1, 1).
fn random(shape: (usize, usize, usize, usize), seed: u64) -> Array4<f32> {
    let mut r = StdRng::seed_from_u64(seed);
    Array4::from_shape_simple_fn(shape, || r.random_range(-1.0f32..1.0))
}

/// `(B, Hq, Hkv, L, S, E)` of a self-check problem.
type Dims = (usize, usize, usize, usize, usize, usize);

/// Median of `times` (not empty).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    }
}

/// Time `sdpa`: its first call (which compiles its kernels), then the median of `iters` calls.
/// A call uploads the inputs given as host arrays (none for GPU buffers), runs the kernels and
/// reads the output back.
async fn time(
    ctx: &Context,
    sdpa: &Sdpa<'_>,
    iters: usize,
) -> Result<(f64, f64, wgpu_attention::Output), String> {
    let t = now_ms();
    let mut out = sdpa.run(ctx).await.map_err(|e| e.to_string())?;
    let first = now_ms() - t;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = now_ms();
        out = sdpa.run(ctx).await.map_err(|e| e.to_string())?;
        times.push(now_ms() - t);
    }
    Ok((first, median(times), out))
}

/// The self-check: the adapter, then a prefill and a decoding problem on every path against
/// the CPU reference, with timings. Writes the adapter into `#adapter` and a table into
/// `#results`; returns `check: PASS` or `check: FAIL ...` (the page writes it into `#status`
/// once its heatmap is drawn too).
#[wasm_bindgen]
pub async fn self_check() -> String {
    match self_check_inner().await {
        Ok(()) => "check: PASS".to_string(),
        Err(e) => format!("check: FAIL {e}"),
    }
}

async fn self_check_inner() -> Result<(), String> {
    set_html("status", "running: requesting a WebGPU device…");
    let ctx = context().await?;
    let l = ctx.limits();
    set_html(
        "adapter",
        &escape(&format!(
            "{} · plan inputs: {} adapter, subgroup size {} · limits: {} storage buffers per stage, {} KiB workgroup memory, {} invocations per workgroup, {} MiB per storage binding",
            ctx.describe(),
            if ctx.is_cpu() { "CPU (fallback)" } else { "GPU" },
            ctx.caps().subgroup.map_or("not fixed".into(), |s| s.to_string()),
            l.max_storage_buffers_per_shader_stage,
            l.max_compute_workgroup_storage_size / 1024,
            l.max_compute_invocations_per_workgroup,
            l.max_storage_buffer_binding_size >> 20,
        )),
    );
    // A prefill (causal self-attention) and a KV-cache decoding step with grouped heads.
    let problems: [(&str, Dims, Causal); 2] = [
        (
            "prefill B1 H8 L=S=256 E64 causal",
            (1, 8, 8, 256, 256, 64),
            Causal::TopLeft,
        ),
        (
            "decode B1 Hq8 Hkv2 L1 S2048 E64",
            (1, 8, 2, 1, 2048, 64),
            Causal::BottomRight,
        ),
    ];
    let mut rows = String::new();
    let mut failures = Vec::new();
    for (pi, (name, (b, hq, hkv, lq, s, e), causal)) in problems.into_iter().enumerate() {
        let q = random((b, hq, lq, e), 10 * pi as u64 + 1);
        let k = random((b, hkv, s, e), 10 * pi as u64 + 2);
        let v = random((b, hkv, s, e), 10 * pi as u64 + 3);
        let opts = Options {
            causal,
            ..Options::default()
        };
        set_html("status", &format!("running: CPU reference for {name}…"));
        let want = reference::sdpa(q.view(), k.view(), v.view(), &opts).map_err(|e| e.to_string())?;
        for path in Path::ALL {
            set_html("status", &format!("running: {name} on the {} path…", path.name()));
            let sdpa = Sdpa::new(&q, &k, &v).options(opts.clone()).path(path);
            let plan = sdpa.plan(&ctx).map_err(|e| e.to_string())?;
            let flops = sdpa.problem().map_err(|e| e.to_string())?.flops();
            let (first, med, out) = time(&ctx, &sdpa, 5)
                .await
                .map_err(|e| format!("{name} {}: {e}", path.name()))?;
            let rep = compare(
                out.output.iter().copied(),
                want.out.iter().copied(),
                F32_TOLERANCE,
            );
            if !rep.passed() {
                failures.push(format!("{name} {}: {rep}", path.name()));
            }
            let _ = write!(
                rows,
                "<tr><td>{name}</td><td>{}</td><td>{:?}</td><td>{first:.1}</td><td>{med:.1}</td><td>{:.2}</td><td>{:.1e}</td><td class=\"{}\">{}</td></tr>",
                path.name(),
                plan.form(),
                flops / (med * 1e-3) / 1e9,
                rep.max_abs_err,
                if rep.passed() { "ok" } else { "bad" },
                if rep.passed() { "pass" } else { "FAIL" },
            );
            set_html("results", &rows);
        }
    }
    set_html("status", "running: drawing the heatmap…");
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// FNV-1a: the toy embedding's word hash.
fn fnv1a(word: &str) -> u64 {
    word.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The words of `sentence`, lower-cased, without surrounding punctuation (at most 40).
fn words(sentence: &str) -> Vec<String> {
    sentence
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase())
        .filter(|w| !w.is_empty())
        .take(40)
        .collect()
}

/// Head dim of the toy embedding.
const TOY_E: usize = 32;

/// The toy embedding: each word hashed into a seeded random vector (the same word, the same
/// vector), plus a small sinusoidal position signal. Not a trained model: similar words are not
/// close, only equal ones are.
fn embed(words: &[String]) -> Array4<f32> {
    let mut x = Array4::zeros((1, 1, words.len(), TOY_E));
    for (i, w) in words.iter().enumerate() {
        let mut r = StdRng::seed_from_u64(fnv1a(w));
        for d in 0..TOY_E {
            let angle = i as f32 / 10_000f32.powf((d / 2 * 2) as f32 / TOY_E as f32);
            let pos = if d % 2 == 0 { angle.sin() } else { angle.cos() };
            x[[0, 0, i, d]] = r.random_range(-1.0f32..1.0) + 0.3 * pos;
        }
    }
    x
}

/// Draw the self-attention weights of `sentence` (toy embedding, one head, q = k = v, scale
/// 1/sqrt(32), computed on the GPU's unfused path, the one that returns weights) on the canvas
/// with id `canvas_id`, queries down the left, keys along the top.
#[wasm_bindgen]
pub async fn draw_sentence(sentence: String, canvas_id: String) -> Result<(), JsValue> {
    draw(&sentence, &canvas_id)
        .await
        .map_err(|e| JsValue::from_str(&e))
}

async fn draw(sentence: &str, canvas_id: &str) -> Result<(), String> {
    let words = words(sentence);
    if words.is_empty() {
        return Err("type a sentence with at least one word".into());
    }
    let ctx = context().await?;
    let x = embed(&words);
    let out = Sdpa::new(&x, &x, &x)
        .return_weights()
        .run(&ctx)
        .await
        .map_err(|e| e.to_string())?;
    let w = out.weights.ok_or("no weights returned")?;
    let n = words.len();
    let canvas: web_sys::HtmlCanvasElement = document()
        .get_element_by_id(canvas_id)
        .ok_or_else(|| format!("no element #{canvas_id}"))?
        .dyn_into()
        .map_err(|_| format!("#{canvas_id} is not a canvas"))?;
    let cell = (420 / n).clamp(10, 36) as f64;
    let label = 110.0;
    let side = label + cell * n as f64 + 10.0;
    canvas.set_width(side as u32);
    canvas.set_height(side as u32);
    let g: web_sys::CanvasRenderingContext2d = canvas
        .get_context("2d")
        .map_err(|_| "no 2d context")?
        .ok_or("no 2d context")?
        .dyn_into()
        .map_err(|_| "not a 2d context")?;
    g.set_fill_style_str("#fff");
    g.fill_rect(0.0, 0.0, side, side);
    let max = w.iter().copied().fold(0f32, f32::max).max(f32::MIN_POSITIVE);
    for i in 0..n {
        for j in 0..n {
            let [r, gr, b] = wgpu_attention::heatmap::colour(w[[0, 0, i, j]] / max);
            g.set_fill_style_str(&format!("rgb({r},{gr},{b})"));
            g.fill_rect(label + j as f64 * cell, label + i as f64 * cell, cell, cell);
        }
    }
    g.set_fill_style_str("#222");
    g.set_font(&format!("{}px sans-serif", (cell * 0.6).clamp(9.0, 14.0)));
    g.set_text_align("right");
    g.set_text_baseline("middle");
    for (i, word) in words.iter().enumerate() {
        let _ = g.fill_text(word, label - 6.0, label + (i as f64 + 0.5) * cell);
        g.save();
        let _ = g.translate(label + (i as f64 + 0.5) * cell, label - 6.0);
        let _ = g.rotate(-std::f64::consts::FRAC_PI_2);
        g.set_text_align("left");
        let _ = g.fill_text(word, 0.0, 0.0);
        g.restore();
    }
    Ok(())
}

/// Time the crate's named benchmark shapes (comma separated; `default` for the `bench`
/// defaults) in this browser, as the CLI's `bench` does natively: inputs uploaded once as GPU
/// buffers, each timed call runs the kernels and reads the output back; 2 warm-up calls, then
/// the median of `iters`. Writes a table into `#bench` and returns it as text, one line per
/// shape: `name path form median_ms gflops`.
#[wasm_bindgen]
pub async fn bench(names: String, iters: u32) -> Result<String, JsValue> {
    bench_inner(&names, iters.max(1) as usize)
        .await
        .map_err(|e| JsValue::from_str(&e))
}

async fn bench_inner(names: &str, iters: usize) -> Result<String, String> {
    let ctx = context().await?;
    let list: Vec<&shapes::Shape> = if names.trim() == "default" {
        shapes::SHAPES.iter().filter(|s| s.default).collect()
    } else {
        names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| {
                shapes::find(n)
                    .or_else(|| {
                        shapes::SHAPES
                            .iter()
                            .find(|s| s.name.split('_').next() == Some(n))
                    })
                    .ok_or_else(|| format!("unknown shape {n}: one of {}", shapes::names()))
            })
            .collect::<Result<_, _>>()?
    };
    let mut text = String::new();
    let mut html = String::new();
    for shape in list {
        set_html("status", &format!("bench: {}…", shape.name));
        let host = shape.random_inputs(1);
        let gpu = shapes::GpuInputs::upload(&ctx, shape, &host)?;
        let sdpa = gpu.sdpa();
        let plan = sdpa.plan(&ctx).map_err(|e| e.to_string())?;
        let flops = sdpa.problem().map_err(|e| e.to_string())?.flops();
        sdpa.run(&ctx).await.map_err(|e| e.to_string())?;
        let (_, med, _) = time(&ctx, &sdpa, iters).await?;
        let gflops = flops / (med * 1e-3) / 1e9;
        let _ = writeln!(
            text,
            "{} {} {:?} {med:.2} {gflops:.2}",
            shape.name,
            plan.path().name(),
            plan.form()
        );
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{:?}</td><td>{med:.1}</td><td>{gflops:.2}</td></tr>",
            shape.name,
            plan.path().name(),
            plan.form()
        );
        set_html("bench", &html);
    }
    set_html("status", "bench: done");
    Ok(text)
}
