//! Rotary position embedding (RoPE): the angles (computed on the host in f64), the CPU
//! reference, and the GPU op that rotates token rows `[T, H, E]` in place. The paged KV cache
//! ([`KvCache`](crate::KvCache)) applies it to K as it writes, and [`Sdpa::rope`](crate::Sdpa::rope)
//! to q inside the attention kernels.

use ndarray::ArrayViewMut3;

use crate::error::{Error, Result};

/// Which elements RoPE pairs.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RopeStyle {
    /// Pairs `(k, k + D/2)`: GPT-NeoX, Llama and Hugging Face's `rotate_half`.
    #[default]
    HalfSplit,
    /// Pairs `(2k, 2k + 1)`: GPT-J.
    Interleaved,
}

/// Rotary position embedding: the first `dim` elements of each head's vector (all when
/// `None`) rotated in pairs by angles `position · theta^(-2k/dim)`, `k < dim/2`; a pair
/// `(x0, x1)` becomes `(x0 cos - x1 sin, x1 cos + x0 sin)` (Hugging Face's
/// `q * cos + rotate_half(q) * sin`). The angles are computed on the host in f64 and rounded
/// to f32 once, so positions far past 2^16 (131072 and beyond) keep f32 accuracy: WGSL's `cos`
/// and `sin` promise nothing outside `[-pi, pi]`.
///
/// ```
/// use wgpu_attention::{Rope, RopeStyle};
/// let rope = Rope { style: RopeStyle::HalfSplit, theta: 10000.0, dim: None };
/// let mut x = ndarray::Array3::<f32>::ones((1, 1, 4)); // [T, H, E]
/// rope.apply(x.view_mut(), &[0])?; // position 0: no rotation
/// assert_eq!(x.as_slice().unwrap(), &[1.0; 4]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// Which elements are paired.
    pub style: RopeStyle,
    /// The base (10000 in most models; 500000 in Llama 3).
    pub theta: f64,
    /// The rotated leading elements of each head (even, at most the head dim); `None`: all.
    pub dim: Option<usize>,
}

impl Default for Rope {
    fn default() -> Self {
        Rope {
            style: RopeStyle::HalfSplit,
            theta: 10000.0,
            dim: None,
        }
    }
}

impl Rope {
    /// The rotated dims for head dim `e`, checked: even, positive, at most `e`, and a finite
    /// theta above 0.
    pub fn rotated_dims(&self, e: usize) -> Result<usize> {
        let d = self.dim.unwrap_or(e);
        let bad = |reason: String| {
            Err(Error::InvalidModifier {
                modifier: "rope",
                reason,
            })
        };
        if d == 0 || !d.is_multiple_of(2) || d > e {
            return bad(format!(
                "the rotary dimension {d} must be even, positive and at most the head dim {e}"
            ));
        }
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return bad(format!("theta must be finite and positive, got {}", self.theta));
        }
        Ok(d)
    }

    /// The (cos, sin) of each position's `d/2` angles as f32 bits, position-major: the words
    /// the kernels read.
    pub(crate) fn angle_words(&self, d: usize, positions: impl IntoIterator<Item = usize>) -> Vec<u32> {
        let hd = d / 2;
        let inv: Vec<f64> = (0..hd)
            .map(|k| self.theta.powf(-2.0 * k as f64 / d as f64))
            .collect();
        let mut w = Vec::new();
        for pos in positions {
            for f in &inv {
                let a = pos as f64 * f;
                w.push((a.cos() as f32).to_bits());
                w.push((a.sin() as f32).to_bits());
            }
        }
        w
    }

    /// The pair of element `k` (`k < d/2`).
    fn pair(&self, d: usize, k: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::HalfSplit => (k, k + d / 2),
            RopeStyle::Interleaved => (2 * k, 2 * k + 1),
        }
    }

    /// The CPU reference in f64: rotate `x` `[T, H, E]` in place, token `t` at `positions[t]`.
    pub fn apply(&self, mut x: ArrayViewMut3<f32>, positions: &[usize]) -> Result<()> {
        let (t, h, e) = x.dim();
        let d = self.rotated_dims(e)?;
        check_positions(positions, t)?;
        for (ti, &pos) in positions.iter().enumerate() {
            for k in 0..d / 2 {
                let a = pos as f64 * self.theta.powf(-2.0 * k as f64 / d as f64);
                let (c, s) = (a.cos(), a.sin());
                let (i0, i1) = self.pair(d, k);
                for hi in 0..h {
                    let (x0, x1) = (x[[ti, hi, i0]] as f64, x[[ti, hi, i1]] as f64);
                    x[[ti, hi, i0]] = (x0 * c - x1 * s) as f32;
                    x[[ti, hi, i1]] = (x1 * c + x0 * s) as f32;
                }
            }
        }
        Ok(())
    }
}

/// One position per token, or [`Error::InvalidModifier`].
pub(crate) fn check_positions(positions: &[usize], tokens: usize) -> Result<()> {
    if positions.len() != tokens {
        return Err(Error::InvalidModifier {
            modifier: "rope",
            reason: format!("{} positions for {tokens} tokens: one per token", positions.len()),
        });
    }
    Ok(())
}
