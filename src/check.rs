//! One checker for comparing GPU results with the reference.
//!
//! An element passes when `|actual - expected| <= atol + rtol · |expected|`. A NaN or infinity
//! where the reference is finite fails; matching non-finite values (same infinity, or NaN
//! against NaN) pass. On failure the report names the worst elements.

use std::fmt;

/// The crate's tolerance for f32 kernels against the f64 reference on inputs of order 1.
pub const F32_TOLERANCE: Tolerance = Tolerance {
    atol: 1e-5,
    rtol: 1e-4,
};

/// The tolerance for f16 outputs (f16 inputs and output, f32 accumulation) against the f64
/// reference computed on the rounded inputs: about 8 f16 rounding steps (2⁻¹¹ each).
pub const F16_TOLERANCE: Tolerance = Tolerance {
    atol: 1e-3,
    rtol: 4e-3,
};

/// The tolerance for bf16 outputs against the f64 reference on the rounded inputs: about
/// 4 bf16 rounding steps (2⁻⁸ each).
pub const BF16_TOLERANCE: Tolerance = Tolerance {
    atol: 2e-3,
    rtol: 1.6e-2,
};

impl Tolerance {
    /// The tolerance for outputs stored in `s`. The 8-bit formats hold only K and V, whose
    /// dequantised values the kernels read exactly: the f32 tolerance against the reference
    /// over those values.
    pub fn for_storage(s: crate::storage::Storage) -> Tolerance {
        match s {
            crate::storage::Storage::F32 | crate::storage::Storage::Int8 | crate::storage::Storage::Fp8 => {
                F32_TOLERANCE
            }
            crate::storage::Storage::F16 => F16_TOLERANCE,
            crate::storage::Storage::Bf16 => BF16_TOLERANCE,
        }
    }
}

/// Absolute and relative tolerance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Absolute part.
    pub atol: f64,
    /// Relative part (times `|expected|`).
    pub rtol: f64,
}

/// The outcome of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Elements compared.
    pub count: usize,
    /// Elements out of tolerance.
    pub failures: usize,
    /// Largest `|actual - expected|` over elements where both are finite.
    pub max_abs_err: f64,
    /// Worst offenders: `(flat index, actual, expected)`, at most 5.
    pub worst: Vec<(usize, f64, f64)>,
    /// The tolerance used.
    pub tolerance: Tolerance,
}

impl Report {
    /// True when every element is within tolerance.
    pub fn passed(&self) -> bool {
        self.failures == 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} elements out of tolerance (atol {:e}, rtol {:e}); max abs err {:.3e}",
            self.failures, self.count, self.tolerance.atol, self.tolerance.rtol, self.max_abs_err
        )?;
        for (i, a, e) in &self.worst {
            write!(f, "\n  [{i}] actual {a:e} expected {e:e}")?;
        }
        Ok(())
    }
}

/// Compare `actual` with `expected` element by element (same length, flat row-major order).
pub fn compare<A, E>(actual: A, expected: E, tol: Tolerance) -> Report
where
    A: IntoIterator,
    A::Item: Into<f64>,
    E: IntoIterator,
    E::Item: Into<f64>,
{
    let mut count = 0;
    let mut failures = 0;
    let mut max_abs_err = 0.0f64;
    // (badness, (index, actual, expected)), the worst first.
    let mut worst: Vec<(f64, (usize, f64, f64))> = Vec::new();
    let mut ai = actual.into_iter();
    let mut ei = expected.into_iter();
    loop {
        let (a, e) = match (ai.next(), ei.next()) {
            (Some(a), Some(e)) => (a.into(), e.into()),
            (None, None) => break,
            _ => {
                // Length mismatch: count it as a failure of its own.
                failures += 1;
                break;
            }
        };
        let idx = count;
        count += 1;
        let ok = if e.is_finite() {
            a.is_finite() && (a - e).abs() <= tol.atol + tol.rtol * e.abs()
        } else if e.is_nan() {
            a.is_nan()
        } else {
            a == e
        };
        if a.is_finite() && e.is_finite() {
            max_abs_err = max_abs_err.max((a - e).abs());
        }
        if !ok {
            failures += 1;
            let badness = if a.is_finite() {
                (a - e).abs()
            } else {
                f64::INFINITY
            };
            worst.push((badness, (idx, a, e)));
            worst.sort_by(|x, y| y.0.total_cmp(&x.0));
            worst.truncate(5);
        }
    }
    Report {
        count,
        failures,
        max_abs_err,
        worst: worst.into_iter().map(|(_, x)| x).collect(),
        tolerance: tol,
    }
}

/// FlashAttention's accuracy rule for gradients: `actual`'s max error against the f64
/// `reference` may be at most twice the max error of `plain` (the same computation done in f32
/// by a plain implementation, e.g. [`crate::reference::sdpa_backward_f32`] or PyTorch's math
/// backend) plus `1e-5 · max|reference| + 1e-6`. Returned as a [`Report`] whose tolerance is
/// that bound (absolute); non-finite values must match as in [`compare`].
pub fn flash_rule<A, E, P>(actual: A, reference: E, plain: P) -> Report
where
    A: IntoIterator,
    A::Item: Into<f64>,
    E: IntoIterator + Clone,
    E::Item: Into<f64>,
    P: IntoIterator,
    P::Item: Into<f64>,
{
    let reference: Vec<f64> = reference.into_iter().map(Into::into).collect();
    let max_ref = reference
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let plain_err = compare(
        plain,
        reference.iter().copied(),
        Tolerance { atol: 0.0, rtol: 0.0 },
    )
    .max_abs_err;
    compare(
        actual,
        reference,
        Tolerance {
            atol: 2.0 * plain_err + 1e-5 * max_ref + 1e-6,
            rtol: 0.0,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_where_finite_expected_fails() {
        let r = compare([1.0f32, f32::NAN], [1.0f64, 2.0], F32_TOLERANCE);
        assert_eq!(r.failures, 1);
        assert_eq!(r.worst[0].0, 1);
    }

    #[test]
    fn within_tolerance_passes_and_outside_fails() {
        assert!(compare([1.00005f32], [1.0f64], F32_TOLERANCE).passed());
        assert!(!compare([1.0002f32], [1.0f64], F32_TOLERANCE).passed());
        assert!(!compare([1.0f32, 2.0], [1.0f64], F32_TOLERANCE).passed());
    }

    #[test]
    fn flash_rule_bounds_by_twice_the_plain_error() {
        let r = [1.0f64, -2.0];
        // Plain error 1e-4: the bound is 2e-4 + 2e-5 + 1e-6.
        assert!(flash_rule([1.0002f32, -2.0], r, [1.0001f32, -2.0]).passed());
        assert!(!flash_rule([1.0003f32, -2.0], r, [1.0001f32, -2.0]).passed());
        assert!(!flash_rule([f32::NAN, -2.0], r, [1.0f32, -2.0]).passed());
    }

    #[test]
    fn matching_infinities_pass() {
        assert!(compare([f32::NEG_INFINITY], [f64::NEG_INFINITY], F32_TOLERANCE).passed());
        assert!(!compare([f32::INFINITY], [f64::NEG_INFINITY], F32_TOLERANCE).passed());
    }
}
