//! Mixed calls, each checked against the reference on its own inputs: what the concurrency
//! test's threads make (`tests/concurrency.rs`) and what the soak makes for hours
//! (`examples/soak.rs`, `tests/soak.rs`). Every path, every mask kind, every storage format,
//! forward and backward, and a layer shared by every caller.

use std::collections::HashSet;
use std::sync::Mutex;

use rand::Rng;
use wgpu_attention::check::Tolerance;
use wgpu_attention::reference;
use wgpu_attention::{Causal, Context, MhaConfig, MultiHeadAttention, NeedWeights, Path, Storage, Tensor};

use super::*;

/// A multi-head attention layer shared by every caller, and its weights for the reference.
pub struct SharedLayer {
    pub layer: MultiHeadAttention,
    pub case: MhaCase,
}

impl SharedLayer {
    /// Grouped-query heads (4 query heads over 2 key/value heads), biases, width 32.
    pub fn new(ctx: &Context) -> SharedLayer {
        let case = MhaCase::random(layer_grid(1, 1, 1, 0), 77, Storage::F32);
        SharedLayer {
            layer: MultiHeadAttention::new(ctx, &case.w).expect("the shared layer"),
            case,
        }
    }
}

fn layer_grid(b: usize, l: usize, s: usize, n: usize) -> MhaGrid {
    let cross = n % 2 == 1;
    MhaGrid {
        config: MhaConfig::new(32, 4).kv_heads(2),
        b,
        l,
        // Self-attention's keys are its queries.
        s: if cross { s } else { l },
        cross,
        causal: [Causal::None, Causal::TopLeft, Causal::BottomRight][n % 3],
        mask: n % 4 == 1,
        bias: n % 5 == 2,
        lens: n % 3 == 2,
        weights: [NeedWeights::No, NeedWeights::Averaged][(n / 2) % 2],
    }
}

/// Call number `n` on `shape`: one in six (with a layer) the shared layer's forward, one in
/// five of the rest the backward (fused or unfused, checked by FlashAttention's rule), the
/// others the forward on the automatic, fused, unfused or decode path; every mask kind and
/// storage format in turn. Returns a label; panics naming the call on an error or a wrong
/// answer.
pub fn mixed_call(ctx: &Context, n: usize, shape: Shape, layer: Option<&SharedLayer>) -> String {
    if let Some(shared) = layer.filter(|_| n % 6 == 5) {
        let (b, _, _, l, s, _, _) = shape;
        let mut case = MhaCase::random(layer_grid(b, l, s, n / 6), n as u64, Storage::F32);
        // The shared layer's weights, this call's inputs.
        case.w = shared.case.w.clone();
        let label = format!("call {n}: the shared layer, {}", case.label());
        let want = reference::mha(&case.w, &case.inputs(), &case.options()).expect("reference");
        let got = case
            .forward(&shared.layer)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_mha_output(&got, &want, case.grid.weights, TOL, &label);
        return label;
    }
    let kinds = mask_kinds();
    let (name, kind) = &kinds[n % kinds.len()];
    let storage = [Storage::F32, Storage::F32, Storage::F16, Storage::Bf16][(n / 7) % 4];
    let case = kind(Case::random(shape, n as u64)).with_storage(storage);
    let label = format!("call {n}: {shape:?} {name} {storage}");
    if n % 5 == 4 {
        let path = [Path::Fused, Path::Unfused][(n / 5) % 2];
        let (b, h, l, _) = case.dims();
        let dout = rand_array(&mut rng(n as u64 + 7), (b, h, l, case.v.dim().3)).mapv(|x| storage.round(x));
        let g = case
            .sdpa()
            .backward(Tensor::from(&dout).with_storage(storage))
            .path(path)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label} backward {path:?}: {e}"));
        assert_grads(&case, &g, &dout, &label);
        return format!("{label} backward {path:?}");
    }
    let mut path = [Path::Auto, Path::Fused, Path::Unfused, Path::Decode][n % 4];
    if path == Path::Decode && case.checked_sdpa(path).resolved_path(ctx).is_err() {
        // Shapes the decode path does not take run on the automatic path instead.
        path = Path::Auto;
    }
    let label = format!("{label} {path:?}");
    let got = case
        .checked_sdpa(path)
        .run_blocking(ctx)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    case.assert_output(
        &got,
        &case.reference(),
        path,
        Tolerance::for_storage(storage),
        &label,
    );
    label
}

/// How a soak draws its shapes: batch, heads and lengths at random (rarely multiples of the
/// tiles; a single query row one call in six), head dims `(E, Ev)` from `dims`, and with
/// `new_dims_every = k > 0` one call in k a head-dim pair drawn from 1 to 96 instead (each a
/// new set of kernels: the pipeline cache must stay bounded).
#[derive(Debug, Clone)]
pub struct SoakShapes {
    pub dims: Vec<(usize, usize)>,
    pub new_dims_every: usize,
}

impl SoakShapes {
    pub fn draw(&self, r: &mut rand::rngs::StdRng) -> Shape {
        let hkv = r.random_range(1..=3);
        let hq = hkv * r.random_range(1..=2);
        let b = r.random_range(1..=2);
        let l = if r.random_range(0..6) == 0 {
            1
        } else {
            r.random_range(1..=70)
        };
        let s = r.random_range(1..=150);
        let (e, ev) = if self.new_dims_every > 0 && r.random_range(0..self.new_dims_every) == 0 {
            (r.random_range(1..=96), r.random_range(1..=96))
        } else {
            self.dims[r.random_range(0..self.dims.len())]
        };
        (b, hq, hkv, l, s, e, ev)
    }
}

/// The process's resident memory in bytes (Linux's `VmRSS`; 0 elsewhere).
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// One line of a soak's figures.
#[derive(Debug, Clone, Copy)]
pub struct SoakPoint {
    pub calls: usize,
    pub seconds: f64,
    pub resident: u64,
    pub device: u64,
    pub buffers: isize,
    pub pipelines: usize,
    pub shapes: usize,
}

impl SoakPoint {
    pub const HEADER: &'static str =
        "    calls   seconds  process MiB  device MiB  live buffers  pipelines  distinct shapes";
    pub fn line(&self) -> String {
        format!(
            "{:>9} {:>9.1} {:>12.1} {:>11.2} {:>13} {:>10} {:>16}",
            self.calls,
            self.seconds,
            self.resident as f64 / 1048576.0,
            self.device as f64 / 1048576.0,
            self.buffers,
            self.pipelines,
            self.shapes
        )
    }
}

/// What a soak makes: `calls` mixed calls on `threads` threads sharing one context and one
/// layer, cycling through `distinct` different calls (call n is call n mod `distinct`: its
/// shape drawn by `shapes` from `seed`, its path, mask kind, format and direction from its
/// number), with figures every `every` calls. The first [`WARM_CYCLES`] cycles are the warm-up
/// (every kernel the cycle needs compiled, the context's cache filled); the cycles after them
/// repeat their calls, so every byte they add is a leak, or a recompilation when the cycle
/// needs more kernels than the cache holds.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub calls: usize,
    pub distinct: usize,
    pub threads: usize,
    pub every: usize,
    pub seed: u64,
    pub shapes: SoakShapes,
}

/// What a soak measured: a point every `every` calls.
pub struct Soak {
    pub points: Vec<SoakPoint>,
    /// The point at the end of the warm-up, after which memory must stay flat.
    pub warm: usize,
}

impl Soak {
    /// Largest growth of process and device memory and of live buffers over the warm point,
    /// as fractions.
    pub fn growth(&self) -> (f64, f64, f64) {
        let w = self.points[self.warm];
        let after = &self.points[self.warm..];
        let max = |f: &dyn Fn(&SoakPoint) -> f64| after.iter().map(f).fold(f64::MIN, f64::max);
        let grow = |now: f64, then: f64| if then > 0.0 { now / then - 1.0 } else { 0.0 };
        (
            grow(max(&|p| p.resident as f64), w.resident as f64),
            grow(max(&|p| p.device as f64), w.device as f64),
            grow(max(&|p| p.buffers as f64), w.buffers as f64),
        )
    }
}

/// Cycles of the distinct calls that warm up: the first compiles every kernel, the second
/// fills the context's cache (kept from a call's second time on).
pub const WARM_CYCLES: usize = 2;

/// Run the soak `o` on `ctx`; `print` sees each point as it is taken (after the device has
/// gone idle). Panics, naming the call, on an error or a wrong answer.
pub fn soak(ctx: &Context, o: &SoakOptions, print: &dyn Fn(&SoakPoint)) -> Soak {
    let layer = SharedLayer::new(ctx);
    let shapes = Mutex::new(HashSet::new());
    let started = std::time::Instant::now();
    let point = |calls: usize, shapes: usize| {
        ctx.wait_idle().expect("the device went idle");
        let counters = ctx.device().get_internal_counters();
        SoakPoint {
            calls,
            seconds: started.elapsed().as_secs_f64(),
            resident: resident_bytes(),
            device: ctx
                .buffer_memory()
                .expect("the tests turn on the `counters` feature"),
            buffers: counters.hal.buffers.read(),
            pipelines: ctx.cached_pipelines(),
            shapes,
        }
    };
    let mut points = vec![point(0, 0)];
    print(&points[0]);
    let (every, distinct) = (o.every.max(1), o.distinct.max(1));
    let mut warm = None;
    let mut done = 0;
    while done < o.calls {
        // Batches end at the end of the warm-up: two cycles, as the context caches what a
        // call asks for a second time (parameter buffers, constant inputs, bind groups).
        let to_warm = if done < WARM_CYCLES * distinct {
            WARM_CYCLES * distinct - done
        } else {
            usize::MAX
        };
        let batch = every.min(o.calls - done).min(to_warm);
        std::thread::scope(|s| {
            for t in 0..o.threads.max(1) {
                let (layer, shapes) = (&layer, &shapes);
                s.spawn(move || {
                    for i in (t..batch).step_by(o.threads.max(1)) {
                        let m = (done + i) % distinct;
                        let seed = o.seed ^ (m as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        let shape = o.shapes.draw(&mut rng(seed));
                        shapes.lock().unwrap().insert(shape);
                        mixed_call(ctx, m, shape, Some(layer));
                    }
                });
            }
        });
        done += batch;
        let p = point(done, shapes.lock().unwrap().len());
        print(&p);
        points.push(p);
        if done == WARM_CYCLES * distinct {
            warm = Some(points.len() - 1);
        }
    }
    Soak {
        warm: warm.unwrap_or(points.len() - 1),
        points,
    }
}
