//! burn's attention against this crate's on burn's tensors, in one process, on one device (the
//! crate's context, burn's runtime made on it with burn's default features: fusion, autotune),
//! interleaved: burn, ours, standalone, burn, ours, standalone, ... Each round times `iters`
//! calls of each and prints the median times, their GFLOP/s and the ratio burn / ours (above 1:
//! ours is faster). "standalone" is the crate's own `Sdpa` on wgpu buffers holding the same
//! values (the mask as the same additive bias), recorded, submitted and waited for: burn /
//! standalone is the ratio the crate shows against burn without burn's tensors, in the same
//! sitting.
//!
//! ```sh
//! cargo bench -p wgpu-attention-burn --bench vs_burn -- [cases] [modes] [rounds] [iters]
//! cargo bench -p wgpu-attention-burn --bench vs_burn -- a,b,e,a-bias,a-softcap,a-scale fwd,fwdbwd 5 3
//! ```
//!
//! Cases (f32): a `[1, 8, 1024, 1024, 64]`; b the same, causal; e `[4, 12, 256, 256, 64]` with a
//! key-padding mask (batch i keeps its first 256 - 37 i keys); a-bias, a-softcap, a-scale: a with
//! an additive `[1, 8, 1024, 1024]` bias, a softcap of 50, a scale of 0.1. Modes: `fwd` (the
//! output synchronised), `fwdbwd` (forward, `(out * dout).sum().backward()`, dq, dk, dv
//! synchronised, on the autodiff device).

use std::time::Instant;

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Distribution, Tensor, TensorData};
use wgpu_attention_burn::wgpu_attention::wgpu::util::DeviceExt;
use wgpu_attention_burn::wgpu_attention::{self as wa, wgpu};
use wgpu_attention_burn::{attention, device_on, new_context, Context};

struct Case {
    b: usize,
    h: usize,
    l: usize,
    e: usize,
    causal: bool,
    pad: bool,
    bias: bool,
    softcap: Option<f64>,
    scale: Option<f64>,
}

fn case(name: &str) -> Case {
    let a = Case {
        b: 1,
        h: 8,
        l: 1024,
        e: 64,
        causal: false,
        pad: false,
        bias: false,
        softcap: None,
        scale: None,
    };
    match name {
        "a" => a,
        "b" => Case { causal: true, ..a },
        "e" => Case {
            b: 4,
            h: 12,
            l: 256,
            pad: true,
            ..a
        },
        "a-bias" => Case { bias: true, ..a },
        "a-softcap" => Case {
            softcap: Some(50.0),
            ..a
        },
        "a-scale" => Case {
            scale: Some(0.1),
            ..a
        },
        _ => panic!("unknown case {name} (a, b, e, a-bias, a-softcap, a-scale)"),
    }
}

struct Inputs {
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dout: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    opts: AttentionModuleOptions,
}

fn inputs(c: &Case, device: &Device, grad: bool) -> Inputs {
    let n = Distribution::Normal(0.0, 1.0);
    let shape = [c.b, c.h, c.l, c.e];
    let t = || {
        let x = Tensor::<4>::random(shape, n, device);
        if grad {
            x.require_grad()
        } else {
            x
        }
    };
    let mask = c.pad.then(|| {
        let mut m = vec![false; c.b * c.h * c.l * c.l];
        for b in 0..c.b {
            for row in 0..c.h * c.l {
                for j in c.l - 37 * b..c.l {
                    m[(b * c.h * c.l + row) * c.l + j] = true;
                }
            }
        }
        Tensor::<4, Bool>::from_data(TensorData::new(m, [c.b, c.h, c.l, c.l]), device)
    });
    Inputs {
        q: t(),
        k: t(),
        v: t(),
        dout: Tensor::<4>::random(shape, n, device),
        mask,
        bias: c.bias.then(|| Tensor::<4>::random([1, c.h, c.l, c.l], n, device)),
        opts: AttentionModuleOptions {
            scale: c.scale,
            softcap: c.softcap,
            is_causal: c.causal,
        },
    }
}

/// One call of either attention, synchronised: the forward's output, or the gradients.
fn call(x: &Inputs, ours: bool, backward: bool, device: &Device) {
    let out = if ours {
        attention(
            x.q.clone(),
            x.k.clone(),
            x.v.clone(),
            x.mask.clone(),
            x.bias.clone(),
            x.opts,
        )
        .expect("attention")
    } else {
        burn_attention(
            x.q.clone(),
            x.k.clone(),
            x.v.clone(),
            x.mask.clone(),
            x.bias.clone(),
            x.opts,
        )
    };
    if backward {
        let g = (out * x.dout.clone()).sum().backward();
        let grads = [x.q.grad(&g), x.k.grad(&g), x.v.grad(&g)];
        assert!(grads.iter().all(Option::is_some), "q, k and v have gradients");
        drop(grads);
    } else {
        drop(out);
    }
    device.sync().expect("the device ran the call");
}

/// The same inputs in the crate's own buffers (the mask as the additive bias the burn route
/// makes of it).
struct Standalone {
    bufs: Vec<(wgpu::Buffer, Vec<usize>)>,
    causal: bool,
    scale: Option<f64>,
    softcap: Option<f64>,
}

impl Standalone {
    fn new(ctx: &Context, c: &Case, x: &Inputs) -> Standalone {
        let up = |t: Tensor<4>| {
            let dims = t.dims().to_vec();
            let data = t.into_data();
            let host: Vec<f32> = data.as_slice::<f32>().expect("f32").to_vec();
            let buf = ctx
                .device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("standalone input"),
                    contents: bytemuck::cast_slice(&host),
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                });
            (buf, dims)
        };
        let masked = x
            .mask
            .clone()
            .map(|m| Tensor::<4>::zeros(m.shape(), &m.device()).mask_fill(m, f32::NEG_INFINITY));
        let bias = match (x.bias.clone(), masked) {
            (Some(b), Some(m)) => Some(b + m),
            (b, m) => b.or(m),
        };
        let mut bufs = vec![
            up(x.q.clone()),
            up(x.k.clone()),
            up(x.v.clone()),
            up(x.dout.clone()),
        ];
        bufs.extend(bias.map(up));
        Standalone {
            bufs,
            causal: c.causal,
            scale: c.scale,
            softcap: c.softcap,
        }
    }

    fn call(&self, ctx: &Context, backward: bool) {
        let t = |i: usize| wa::Tensor::from_buffer(&self.bufs[i].0, wa::Storage::F32, &self.bufs[i].1);
        let mut sdpa = wa::Sdpa::new(t(0), t(1), t(2));
        if self.causal {
            sdpa = sdpa.causal(wa::Causal::BottomRight);
        }
        if let Some(s) = self.scale {
            sdpa = sdpa.scale(s);
        }
        if let Some(c) = self.softcap {
            sdpa = sdpa.softcap(c as f32);
        }
        if self.bufs.len() > 4 {
            sdpa = sdpa.bias(t(4));
        }
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        if backward {
            // The bias is a constant here, as in the burn route: no d(bias).
            sdpa.backward(t(3))
                .without_dbias()
                .record(ctx, &mut enc)
                .expect("backward");
        } else {
            sdpa.record(ctx, &mut enc).expect("forward");
        }
        ctx.queue().submit([enc.finish()]);
        ctx.wait_idle().expect("the device ran the call");
    }
}

fn median_ms(mut f: impl FnMut(), iters: usize) -> f64 {
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench` first.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let cases = args
        .first()
        .map(String::as_str)
        .unwrap_or("a,b,e,a-bias,a-softcap,a-scale");
    let modes = args.get(1).map(String::as_str).unwrap_or("fwd,fwdbwd");
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let iters: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);

    let ctx = new_context().expect("a GPU context");
    let plain = device_on(&ctx).expect("burn on the context");
    println!("adapter: {}", ctx.describe());
    println!("rounds {rounds}, {iters} calls each (median); ratio = burn ms / ours ms");
    for mode in modes.split(',') {
        let backward = match mode {
            "fwd" => false,
            "fwdbwd" => true,
            _ => panic!("unknown mode {mode} (fwd, fwdbwd)"),
        };
        let device = if backward {
            plain.clone().autodiff()
        } else {
            plain.clone()
        };
        for name in cases.split(',') {
            let c = case(name);
            let x = inputs(&c, &device, backward);
            // Forward FLOPs (two matmuls); the backward is 2.5 times more (FlashAttention's count).
            let mut flops = 4.0 * (c.b * c.h * c.l * c.l * c.e) as f64;
            if c.causal {
                flops *= 0.5;
            }
            if backward {
                flops *= 3.5;
            }
            let alone = Standalone::new(&ctx, &c, &x);
            // First calls: compilation and burn's autotuning.
            for _ in 0..2 {
                call(&x, false, backward, &device);
                call(&x, true, backward, &device);
                alone.call(&ctx, backward);
            }
            let (mut ratios, mut alone_ratios) = (Vec::new(), Vec::new());
            for r in 0..rounds {
                let theirs = median_ms(|| call(&x, false, backward, &device), iters);
                let ours = median_ms(|| call(&x, true, backward, &device), iters);
                let standalone = median_ms(|| alone.call(&ctx, backward), iters);
                ratios.push(theirs / ours);
                alone_ratios.push(theirs / standalone);
                println!(
                    "{mode} {name} round {r}: burn {theirs:.1} ms ({:.2} GFLOP/s), ours {ours:.1} ms ({:.2} GFLOP/s), \
                     standalone {standalone:.1} ms; burn/ours {:.3}, burn/standalone {:.3}",
                    flops / theirs / 1e6,
                    flops / ours / 1e6,
                    theirs / ours,
                    theirs / standalone
                );
            }
            let summary = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                format!(
                    "median {:.3}, range {:.3}-{:.3}",
                    v[v.len() / 2],
                    v[0],
                    v[v.len() - 1]
                )
            };
            println!(
                "{mode} {name}: burn/ours {}; burn/standalone {} ({rounds} rounds)",
                summary(&mut ratios),
                summary(&mut alone_ratios)
            );
        }
    }
}
