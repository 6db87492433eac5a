//! User WGSL score and mask functions (programmable attention, FlexAttention's `score_mod` and
//! `mask_mod`), assembled into every attention kernel like the built-in masks.
//!
//! One WGSL source defines `fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32`
//! and/or `fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool`, with any helper functions and
//! constants of its own. Captured f32 tensors (any shape, row-major) are read in it as
//! `NAME(idx: u32) -> f32`, `idx` the flat index (clamped into the tensor). The source is
//! checked by naga on the host before any GPU work (a rejected source is
//! [`Error::UserMod`](crate::Error::UserMod) quoting its line and naga's message), and every
//! name it declares is renamed with a `u_` prefix when it is assembled, so that it cannot
//! collide with the kernels' own. The captures travel in the kernels' auxiliary words (no
//! extra storage binding: WebGPU's 8 per stage still hold). Pipelines are cached by the
//! source and the capture names: a new sequence length or new capture values compile nothing.
//!
//! Positions: `i` and `j` are the query's and the key's indices in the call (plus a ring
//! chunk's start). The key index is the key's position; the query index is not when the
//! queries are the newest positions of longer sequences (a KV cache's decode query is `i = 0`,
//! a prefill chunk's first query too), as in FlexAttention. `q_pos(b, i) -> u32`, which the
//! source may call, gives the query's position among the keys: `S - L + i`, or
//! `kv_lens[b] - L + i` with key lengths (a paged call's sequence lengths), so a relative
//! bias written `f32(j) - f32(q_pos(b, i))` means the same in training (L = S: `q_pos` is
//! `i`) and in decode. The CPU closures read it as [`Captures::q_pos`].
//!
//! The backward runs `mask_mod` as it is; through a `score_mod` it needs the derivative in `s`,
//! given in the same source as `fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32`
//! (WGSL has no automatic differentiation). The gradients of the captures come from
//! `fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32)`: given the
//! gradient `g` of the loss in `score_mod`'s result, it adds `g` times the derivative of that
//! result in each capture element it read, by calling `d_NAME(idx, x)` (at most
//! [`MAX_DCAPTURE_CALLS`] calls, none in a loop: the backward sums them per tile, in a fixed
//! order, then over the tiles: the same bits every run, no atomics). Without it the captures
//! are constants.
//!
//! The CPU reference cannot run WGSL: it takes the same functions as Rust closures
//! ([`UserMod::cpu_score`], reading the captures through [`Captures`], and
//! [`UserMod::cpu_mask`]); its backward differentiates the score closure numerically (a
//! central difference in f64) in `s` and in every capture element it read, which checks the
//! WGSL derivatives too.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

mod check;
mod source;

pub use check::MAX_DCAPTURE_CALLS;
use check::{check_source, user_err};
pub(crate) use source::{prelude, Checked};

/// A score function for the CPU reference: the logit (after the softcap, bias and ALiBi),
/// `[b, h, i, j]` and the captures, giving the new logit.
pub type CpuScore = dyn Fn(f64, [usize; 4], &Captures<'_>) -> f64 + Send + Sync;

/// The captured tensors as a CPU score closure reads them: `c.get("rel", idx)` is WGSL's
/// `rel(idx)` (an index past the end reads the last element; a name that was not captured
/// reads NaN). The reference's backward reads through it which elements a logit depends on.
pub struct Captures<'c> {
    data: &'c [(String, Cow<'c, [f32]>)],
    /// One element moved by a delta (capture, index, delta): the reference's derivatives.
    bump: Option<(usize, usize, f64)>,
    /// The elements read (capture, index), when recording.
    reads: Option<RefCell<Vec<(usize, usize)>>>,
    /// Each batch's key length and the call's query count, for [`Captures::q_pos`].
    positions: Option<(Vec<usize>, usize)>,
}

impl<'c> Captures<'c> {
    pub(crate) fn new(data: &'c [(String, Cow<'c, [f32]>)]) -> Self {
        Captures {
            data,
            bump: None,
            reads: None,
            positions: None,
        }
    }

    /// The call's key lengths per batch (`kv_lens`, or S for each) and query count L, for
    /// [`Captures::q_pos`].
    pub(crate) fn at_positions(mut self, kv_lens: Vec<usize>, l: usize) -> Self {
        self.positions = Some((kv_lens, l));
        self
    }

    /// The position of query `i` of batch `b` among the keys, as WGSL's `q_pos(b, i)` gives
    /// it: the queries are the newest positions (`S - L + i`, or `kv_lens[b] - L + i` with
    /// key lengths; a paged call's sequence lengths), saturating at 0.
    pub fn q_pos(&self, b: usize, i: usize) -> usize {
        match &self.positions {
            Some((lens, l)) => (i + lens.get(b).copied().unwrap_or(*l)).saturating_sub(*l),
            None => i,
        }
    }

    /// Element `idx` of capture `name`, widened to f64 (clamped into the tensor, as in WGSL).
    pub fn get(&self, name: &str, idx: usize) -> f64 {
        let Some(k) = self.data.iter().position(|(n, _)| n == name) else {
            return f64::NAN;
        };
        let d = &self.data[k].1;
        let at = idx.min(d.len().saturating_sub(1));
        if let Some(r) = &self.reads {
            r.borrow_mut().push((k, at));
        }
        let x = d.get(at).map_or(f64::NAN, |&x| f64::from(x));
        match self.bump {
            Some((bk, bi, dx)) if (bk, bi) == (k, at) => x + dx,
            _ => x,
        }
    }

    /// The captures' names and lengths, in the order given.
    pub fn lens(&self) -> impl Iterator<Item = (&str, usize)> {
        self.data.iter().map(|(n, d)| (n.as_str(), d.len()))
    }

    /// These captures recording which elements are read.
    pub(crate) fn recording(&self) -> Self {
        Captures {
            data: self.data,
            bump: None,
            reads: Some(RefCell::new(Vec::new())),
            positions: self.positions.clone(),
        }
    }

    /// The elements read so far (capture, index), each once, in first-read order.
    pub(crate) fn read(&self) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for r in self
            .reads
            .as_ref()
            .map(|r| r.borrow().clone())
            .unwrap_or_default()
        {
            if !out.contains(&r) {
                out.push(r);
            }
        }
        out
    }

    /// These captures with element `at` of capture `k` moved by `dx`.
    pub(crate) fn bumped(&self, (k, at): (usize, usize), dx: f64) -> Self {
        Captures {
            data: self.data,
            bump: Some((k, at, dx)),
            reads: None,
            positions: self.positions.clone(),
        }
    }

    /// The value of element `at` of capture `k`.
    pub(crate) fn value(&self, (k, at): (usize, usize)) -> f64 {
        f64::from(self.data[k].1[at])
    }
}
/// A mask function for the CPU reference: whether query `i` of batch `b`, head `h` may see key
/// `j`, from `[b, h, i, j]`.
pub type CpuMask = dyn Fn([usize; 4]) -> bool + Send + Sync;

/// User WGSL `score_mod` and/or `mask_mod` with their captured tensors (see the module
/// documentation and `docs/semantics.md`), given to [`Sdpa`](crate::Sdpa) (and the backward,
/// the layer) by `.user_mod(m)`.
///
/// ```
/// use wgpu_attention::UserMod;
/// // A relative-position bias table of 2 heads x 17 buckets, and a prefix-LM mask.
/// let table = vec![0.1f32; 2 * 17];
/// let m = UserMod::wgsl(
///     "const R: i32 = 8;
///      fn bucket(i: u32, j: u32) -> u32 { return u32(clamp(i32(j) - i32(i), -R, R) + R); }
///      fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
///          return s + rel(h * 17u + bucket(i, j));
///      }
///      fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return j <= i || j < 4u; }",
/// )
/// .capture("rel", &table)
/// .cpu_score(|s, [_, h, i, j], c| {
///     let bucket = (j as i64 - i as i64).clamp(-8, 8) + 8;
///     s + c.get("rel", h * 17 + bucket as usize)
/// })
/// .cpu_mask(|[_, _, i, j]| j <= i || j < 4);
/// assert!(m.check().is_ok());
/// ```
#[derive(Clone)]
pub struct UserMod<'a> {
    source: Arc<str>,
    captures: Vec<(String, Cow<'a, [f32]>)>,
    cpu_score: Option<Arc<CpuScore>>,
    cpu_mask: Option<Arc<CpuMask>>,
    /// The crate's own source, known to terminate and to index only through the clamping
    /// capture readers: its pipelines run without wgpu's runtime checks even with loops.
    vouched: bool,
    /// The source checked with these capture names, once ([`fns`](Self::fns)); shared by
    /// clones, renewed when a capture is added.
    checked: Arc<OnceLock<Result<Arc<Checked>>>>,
}

impl std::fmt::Debug for UserMod<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserMod")
            .field("source", &self.source)
            .field(
                "captures",
                &self
                    .captures
                    .iter()
                    .map(|(n, d)| (n, d.len()))
                    .collect::<Vec<_>>(),
            )
            .field("cpu_score", &self.cpu_score.is_some())
            .field("cpu_mask", &self.cpu_mask.is_some())
            .finish()
    }
}

impl<'a> UserMod<'a> {
    /// The WGSL source defining `score_mod` and/or `mask_mod` (and helpers).
    pub fn wgsl(source: &str) -> Self {
        UserMod {
            source: source.into(),
            captures: Vec::new(),
            cpu_score: None,
            cpu_mask: None,
            vouched: false,
            checked: Default::default(),
        }
    }

    /// This source vouched for by the crate (see `vouched`): its own functions alone.
    pub(crate) fn vouched(mut self) -> Self {
        self.vouched = true;
        self.checked = Default::default();
        self
    }

    /// Capture an f32 tensor (any shape, row-major, flattened) as `name(idx: u32) -> f32` in
    /// the source. An index past its end reads its last element.
    pub fn capture(mut self, name: &str, data: &'a [f32]) -> Self {
        self.captures.push((name.to_string(), Cow::Borrowed(data)));
        self.checked = Default::default();
        self
    }

    /// This source with its captures copied: a `UserMod` that outlives the caller's slices (the
    /// ring's plan keeps one for its pairs).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    pub(crate) fn to_owned_mod(&self) -> UserMod<'static> {
        UserMod {
            source: self.source.clone(),
            captures: self
                .captures
                .iter()
                .map(|(n, d)| (n.clone(), Cow::Owned(d.to_vec())))
                .collect(),
            cpu_score: self.cpu_score.clone(),
            cpu_mask: self.cpu_mask.clone(),
            vouched: self.vouched,
            checked: self.checked.clone(),
        }
    }

    /// [`capture`](Self::capture) of owned values (the attention variants' additive score).
    pub(crate) fn capture_owned(mut self, name: &str, data: Vec<f32>) -> Self {
        self.captures.push((name.to_string(), Cow::Owned(data)));
        self.checked = Default::default();
        self
    }

    /// The score function as a Rust closure, for the CPU reference: the logit (after the
    /// softcap, the bias and ALiBi), `[b, h, i, j]` and the captures (read them through
    /// [`Captures::get`], so that the reference's backward sees what the logit depends on),
    /// giving the new logit.
    pub fn cpu_score(
        mut self,
        f: impl Fn(f64, [usize; 4], &Captures<'_>) -> f64 + Send + Sync + 'static,
    ) -> Self {
        self.cpu_score = Some(Arc::new(f));
        self
    }

    /// The mask function as a Rust closure, for the CPU reference: whether `[b, h, i, j]`
    /// may attend.
    pub fn cpu_mask(mut self, f: impl Fn([usize; 4]) -> bool + Send + Sync + 'static) -> Self {
        self.cpu_mask = Some(Arc::new(f));
        self
    }

    /// Check the source and the captures (naga, on the host), as every entry point does
    /// before any GPU work.
    pub fn check(&self) -> Result<()> {
        self.fns().map(|_| ())
    }

    /// Whether the backward returns the captures' gradients (the source defines
    /// `score_mod_dcapture`); the source checked as by [`check`](Self::check).
    pub fn gives_capture_gradients(&self) -> Result<bool> {
        Ok(self.fns()?.dcapture)
    }

    /// The reference's score function: the closure, or an error when the source has a
    /// `score_mod` and no closure was given.
    pub(crate) fn cpu_score_fn(&self) -> Result<Option<&CpuScore>> {
        let f = self.fns()?;
        closure_for(self.cpu_score.as_deref(), f.score, "score_mod", "cpu_score")
    }

    /// The captures as the reference's score closure reads them.
    pub(crate) fn cpu_captures(&self) -> Captures<'_> {
        Captures::new(&self.captures)
    }

    /// The mask closure, unchecked (the reference checks once with
    /// [`cpu_mask_fn`](Self::cpu_mask_fn), then reads it per element).
    pub(crate) fn mask_closure(&self) -> Option<&CpuMask> {
        self.cpu_mask.as_deref()
    }

    /// The reference's mask function (see [`cpu_score_fn`](Self::cpu_score_fn)).
    pub(crate) fn cpu_mask_fn(&self) -> Result<Option<&CpuMask>> {
        let f = self.fns()?;
        closure_for(self.cpu_mask.as_deref(), f.mask, "mask_mod", "cpu_mask")
    }

    /// The checked functions (checked once per source and capture names: the result is kept
    /// with this value and its clones).
    pub(crate) fn fns(&self) -> Result<Arc<UserFns>> {
        if let Some((n, _)) = self.captures.iter().find(|(_, d)| d.is_empty()) {
            return Err(Error::UserMod {
                line: None,
                message: format!("capture {n:?} is empty: give at least one value"),
            });
        }
        let names: Vec<&str> = self.captures.iter().map(|(n, _)| n.as_str()).collect();
        let code = self
            .checked
            .get_or_init(|| check_source(&self.source, &names, self.vouched).map(Arc::new))
            .clone()?;
        Ok(Arc::new(UserFns {
            code: code.clone(),
            score: code.score,
            mask: code.mask,
            score_ds: code.score_ds,
            dcapture: code.dcapture.is_some(),
            captures: self
                .captures
                .iter()
                .map(|(n, d)| (n.clone(), Arc::from(&d[..])))
                .collect(),
        }))
    }
}

/// The reference's closure `closure` for function `f` of the source (`defined`: the source
/// has it): an error when one is given without the other.
fn closure_for<'s, T: ?Sized>(
    given: Option<&'s T>,
    defined: bool,
    f: &str,
    closure: &str,
) -> Result<Option<&'s T>> {
    match (given, defined) {
        (Some(c), true) => Ok(Some(c)),
        (None, false) => Ok(None),
        (None, true) => Err(user_err(
            None,
            format!(
                "the CPU reference cannot run WGSL: give the source's {f} as a Rust closure with .{closure}(..)"
            ),
        )),
        (Some(_), false) => Err(user_err(
            None,
            format!("a {closure} closure was given but the source has no {f}"),
        )),
    }
}

/// The checked user functions of a problem: their assembled code, which of the two the source
/// defines, and the captures' values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UserFns {
    pub(crate) code: Arc<Checked>,
    pub(crate) score: bool,
    pub(crate) mask: bool,
    /// The source defines `score_mod_ds` (score_mod's derivative in `s`: the backward needs it).
    pub(crate) score_ds: bool,
    /// The source defines `score_mod_dcapture` (the backward gives the captures' gradients).
    pub(crate) dcapture: bool,
    pub(crate) captures: Vec<(String, Arc<[f32]>)>,
}

impl UserFns {
    /// Whether the backward can run them: through a `score_mod` it needs `score_mod_ds`.
    pub(crate) fn check_backward(&self) -> Result<()> {
        if self.score && !self.score_ds {
            return Err(Error::InvalidModifier {
                modifier: "score_mod",
                reason: "the backward through a user score_mod needs its derivative in s: define \
                         fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 in the same source"
                    .into(),
            });
        }
        Ok(())
    }

    /// Where capture `k`'s values lie among the auxiliary words whose capture table starts at
    /// word `base` (as [`aux_words`](Self::aux_words) lays them out): (first word, length).
    pub(crate) fn capture_span(&self, k: usize, base: usize) -> (usize, usize) {
        let before: usize = self.captures[..k].iter().map(|(_, d)| d.len()).sum();
        (base + 2 * self.captures.len() + before, self.captures[k].1.len())
    }

    /// The captures' elements, all of them (their gradients' length, packed in order).
    pub(crate) fn capture_len(&self) -> usize {
        self.captures.iter().map(|(_, d)| d.len()).sum()
    }

    /// The auxiliary words [`aux_words`](Self::aux_words) gives: the table and the values.
    pub(crate) fn aux_len(&self) -> usize {
        2 * self.captures.len() + self.capture_len()
    }

    /// The packed capture gradients `all` split per capture, in capture order.
    pub(crate) fn split(&self, all: &[f32]) -> Vec<ndarray::Array1<f32>> {
        let mut at = 0;
        let mut out = Vec::new();
        for (_, d) in &self.captures {
            out.push(ndarray::Array1::from(all[at..at + d.len()].to_vec()));
            at += d.len();
        }
        out
    }

    /// The capture table (offset, length per capture, offsets from `base`) and the values, as
    /// auxiliary words.
    pub(crate) fn aux_words(&self, base: usize) -> Vec<u32> {
        let mut off = base + 2 * self.captures.len();
        let mut w = Vec::new();
        for (_, d) in &self.captures {
            w.extend([off as u32, d.len() as u32]);
            off += d.len();
        }
        for (_, d) in &self.captures {
            w.extend(d.iter().map(|x| x.to_bits()));
        }
        w
    }
}

#[cfg(test)]
mod tests;
