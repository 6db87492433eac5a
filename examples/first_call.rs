//! Where a cold first call's time goes: device creation, the first `Sdpa::run` (upload,
//! compiling the kernel, running it, reading back), then the wait for the kernel's fastest form,
//! which CPU adapters compile in the background after a first use, and a warm run. Run it with Mesa's shader cache
//! disabled to see a fresh machine's first call:
//! `MESA_SHADER_CACHE_DISABLE=true cargo run --release --example first_call [-- B H L S E]`
use ndarray::Array4;
use std::time::Instant;
use wgpu_attention::{Context, Sdpa};

fn main() -> Result<(), wgpu_attention::Error> {
    let start = Instant::now();
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());
    println!("context     {:8.1} ms", ms(start));
    // `first_call [B H L S E]`; by default shape `a` of the benchmarks: B1 H8 L=S=1024 E64.
    let arg: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [b, h, l, s, e] = <[usize; 5]>::try_from(arg).unwrap_or([1, 8, 1024, 1024, 64]);
    println!("shape       B{b} H{h} L{l} S{s} E{e}");
    let f = |i: usize| ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
    let q = Array4::from_shape_fn((b, h, l, e), |(_, h, l, e)| f(h * 131 + l * 17 + e));
    let k = Array4::from_shape_fn((b, h, s, e), |(_, h, s, e)| f(h * 71 + s * 13 + e + 5));
    let v = Array4::from_shape_fn((b, h, s, e), |(_, h, s, e)| f(h * 37 + s * 11 + e + 9));
    let t = Instant::now();
    let out = Sdpa::new(&q, &k, &v).run_blocking(&ctx)?;
    println!("first run   {:8.1} ms (output {:?})", ms(t), out.output.shape());
    println!("to result   {:8.1} ms", ms(start));
    let t = Instant::now();
    ctx.wait_idle()?;
    println!("background  {:8.1} ms (the fastest form's compilation)", ms(t));
    let t = Instant::now();
    let again = Sdpa::new(&q, &k, &v).run_blocking(&ctx)?;
    println!("warm run    {:8.1} ms", ms(t));
    assert_eq!(out.output, again.output, "both forms give the same bits");
    Ok(())
}
