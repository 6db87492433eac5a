//! The common call: causal grouped-query attention on the default GPU, checked against the
//! CPU reference. `cargo run --release --example basic`
use ndarray::Array4;
use wgpu_attention::check::{compare, F32_TOLERANCE};
use wgpu_attention::reference;
use wgpu_attention::{Causal, Context, Options, Sdpa};

fn main() -> Result<(), wgpu_attention::Error> {
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());
    // 8 query heads share 2 key/value heads; 100 new queries attend a 300-key cache.
    let f = |i: usize| ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
    let q = Array4::from_shape_fn((1, 8, 100, 64), |(_, h, l, e)| f(h * 131 + l * 17 + e));
    let k = Array4::from_shape_fn((1, 2, 300, 64), |(_, h, s, e)| f(h * 71 + s * 13 + e + 5));
    let v = Array4::from_shape_fn((1, 2, 300, 48), |(_, h, s, e)| f(h * 37 + s * 11 + e + 9));

    let out = Sdpa::new(&q, &k, &v)
        .causal(Causal::BottomRight)
        .return_lse()
        .run_blocking(&ctx)?;
    println!(
        "output {:?}, lse {:?}",
        out.output.shape(),
        out.lse.as_ref().map(|l| l.shape().to_vec())
    );

    let spec = Options {
        causal: Causal::BottomRight,
        ..Default::default()
    };
    let want = reference::sdpa(q.view(), k.view(), v.view(), &spec)?;
    let report = compare(
        out.output.iter().copied(),
        want.out.iter().copied(),
        F32_TOLERANCE,
    );
    println!("against the CPU reference: {report}");
    assert!(report.passed());
    Ok(())
}
