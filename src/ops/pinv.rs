//! The Moore–Penrose pseudo-inverse of a batch of f32 `m × m` matrices by Newton–Schulz
//! iteration (Nyströmformer's): `Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞)` (`shaders/pinv_init.wgsl`), then
//! `Z ← ¼ Z (13I − AZ (15I − AZ (7I − AZ)))` by the matmul op and `c·I − X`
//! (`shaders/eye_minus.wgsl`), through [`crate::kernels::pinv`].

use super::matmul::Matmul;
use super::Mats;
use crate::device::buffers::{f32_bytes, output};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::pinv as kernel;
use crate::storage::Storage;

/// Record `iters` iterations towards the pseudo-inverses of the `count` f32 `m × m` matrices
/// in `a` (`[count, m]` = `dims`), and return the buffer that holds them.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: &wgpu::Buffer,
    [count, m]: [usize; 2],
    iters: usize,
) -> Result<wgpu::Buffer> {
    let elems = count * m * m;
    if a.size() < f32_bytes(elems) || u32::try_from(elems).is_err() {
        return Err(Error::Internal(format!(
            "pinv of {count} matrices of {m} x {m} from a buffer of {} bytes",
            a.size()
        )));
    }
    let scratch = |label: &str| output(ctx, label, f32_bytes(elems.max(1)));
    let (mut z, mut z_next) = (scratch("Z"), scratch("Z next"));
    let (az, t, u) = (scratch("A Z"), scratch("T"), scratch("U"));
    fn whole(b: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
        b.as_entire_buffer_binding()
    }
    kernel::record_init(ctx, encoder, whole(a), whole(&z), m, count)?;
    let product = |enc: &mut wgpu::CommandEncoder, [x, y, out]: [&wgpu::Buffer; 3], alpha: f32| {
        let square = |b| Mats::dense(whole(b), Storage::F32, m, m);
        Matmul::new(square(x), square(y), square(out))
            .alpha(alpha)
            .slices(count)
            .record(ctx, enc)
    };
    let eye_minus = |enc: &mut wgpu::CommandEncoder, x: &wgpu::Buffer, c: f32| {
        kernel::record_eye_minus(ctx, enc, [whole(x), whole(&t)], m, count, c)
    };
    for _ in 0..iters {
        product(encoder, [a, &z, &az], 1.0)?;
        eye_minus(encoder, &az, 7.0)?;
        product(encoder, [&az, &t, &u], 1.0)?;
        eye_minus(encoder, &u, 15.0)?;
        product(encoder, [&az, &t, &u], 1.0)?;
        eye_minus(encoder, &u, 13.0)?;
        product(encoder, [&z, &t, &z_next], 0.25)?;
        std::mem::swap(&mut z, &mut z_next);
    }
    Ok(z)
}
