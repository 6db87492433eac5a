//! burn's attention against this crate's on burn's tensors, in one process, on one device (the
//! crate's context, burn's runtime made on it with burn's default features: fusion, autotune),
//! interleaved: burn, ours, burn, ours, ... Each round times `iters` calls of each and prints
//! the median times, their GFLOP/s and the ratio burn / ours (above 1: ours is faster).
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
use wgpu_attention_burn::{attention, device_on, new_context};

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

fn median_ms(x: &Inputs, ours: bool, backward: bool, device: &Device, iters: usize) -> f64 {
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            call(x, ours, backward, device);
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
            // First calls: compilation and burn's autotuning.
            for ours in [false, true] {
                call(&x, ours, backward, &device);
                call(&x, ours, backward, &device);
            }
            let mut ratios = Vec::new();
            for r in 0..rounds {
                let theirs = median_ms(&x, false, backward, &device, iters);
                let ours = median_ms(&x, true, backward, &device, iters);
                let ratio = theirs / ours;
                ratios.push(ratio);
                println!(
                    "{mode} {name} round {r}: burn {theirs:.1} ms ({:.2} GFLOP/s), ours {ours:.1} ms ({:.2} GFLOP/s), ratio {ratio:.3}",
                    flops / theirs / 1e6,
                    flops / ours / 1e6
                );
            }
            ratios.sort_by(f64::total_cmp);
            println!(
                "{mode} {name}: ratio median {:.3}, range {:.3}-{:.3} over {rounds} rounds",
                ratios[ratios.len() / 2],
                ratios[0],
                ratios[ratios.len() - 1]
            );
        }
    }
}
