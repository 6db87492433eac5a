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

/// A score function for the CPU reference: the logit (after the softcap, bias and ALiBi),
/// `[b, h, i, j]` and the captures, giving the new logit.
pub type CpuScore = dyn Fn(f64, [usize; 4], &Captures<'_>) -> f64 + Send + Sync;

/// The most `d_NAME` calls `score_mod_dcapture` may make (each at most once per logit: none in
/// a loop).
pub const MAX_DCAPTURE_CALLS: usize = 8;

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

/// A checked source as the kernels include it: it travels with the problem
/// ([`UserFns::code`]) into the kernels' preludes, so a kernel is assembled from the very source
/// that was checked.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Checked {
    pub(crate) score: bool,
    pub(crate) mask: bool,
    pub(crate) score_ds: bool,
    /// The renamed source with the capture readers and the stubs of what it does not define,
    /// without `score_mod_dcapture`.
    pub(crate) wgsl: String,
    /// `score_mod_dcapture` renamed, with the `d_NAME` accumulators (the capture-gradient
    /// kernel's alone), when the source defines it.
    pub(crate) dcapture: Option<String>,
    /// No loops and no dynamic indexing ([`proved_safe`]), or the crate's own source: its
    /// pipelines may run without wgpu's runtime checks like the crate's own.
    pub(crate) proved_safe: bool,
}

/// The WGSL the kernels' prelude includes for the user functions `code` (none: the stubs).
pub(crate) fn prelude(code: Option<&Checked>) -> String {
    match code {
        Some(c) => c.wgsl.clone(),
        None => format!("{SCORE_STUB}{SCORE_DS_STUB}{MASK_STUB}"),
    }
}

/// Whether the user's module has no loop and no dynamically indexed access (`a[i]` with `i`
/// not a constant) in any function: then it cannot spin or index out of bounds, and its
/// pipelines need none of wgpu's runtime checks. The user's functions name nothing of the
/// kernel's (they are checked standalone, with no module-scope variables), and the capture
/// readers clamp their indices.
fn proved_safe(module: &naga::Module) -> bool {
    fn has_loop(block: &naga::Block) -> bool {
        use naga::Statement as S;
        block.iter().any(|st| match st {
            S::Loop { .. } => true,
            S::Block(b) => has_loop(b),
            S::If { accept, reject, .. } => has_loop(accept) || has_loop(reject),
            S::Switch { cases, .. } => cases.iter().any(|c| has_loop(&c.body)),
            _ => false,
        })
    }
    module.functions.iter().all(|(_, f)| {
        !has_loop(&f.body)
            && !f
                .expressions
                .iter()
                .any(|(_, e)| matches!(e, naga::Expression::Access { .. }))
    })
}

/// The position function the kernels give user code (`q_pos` in common/masks.wgsl), as naga
/// checks the source standalone.
const Q_POS_STUB: &str = "fn q_pos(b: u32, i: u32) -> u32 { return i; }\n";

const SCORE_STUB: &str = "fn u_score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s; }\n";
const SCORE_DS_STUB: &str =
    "fn u_score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n";
const MASK_STUB: &str = "fn u_mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return true; }\n";

/// Check `source` with captures `names` by naga, standalone (captures as stubs), and assemble
/// it renamed.
fn check_source(source: &str, names: &[&str], vouched: bool) -> Result<Checked> {
    check_tokens(source, names)?;
    let module = parse_checked(source, names)?;
    let Defined {
        score,
        score_ds,
        mask,
        dcapture,
    } = signatures(&module)?;
    dcapture_calls(&module, names)?;
    // Every name the source declares at module scope, and the captures, get the u_ prefix.
    let mut declared: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    declared.extend(
        module
            .functions
            .iter()
            .filter_map(|(_, f)| f.name.clone())
            .filter(|n| n != "q_pos"),
    );
    declared.extend(module.constants.iter().filter_map(|(_, c)| c.name.clone()));
    declared.extend(module.overrides.iter().filter_map(|(_, o)| o.name.clone()));
    declared.extend(module.types.iter().filter_map(|(_, t)| t.name.clone()));
    // naga drops what it does not keep in its module (constants without a type, aliases):
    // the declarations at module scope from the source's own tokens too.
    declared.extend(module_scope_names(source));
    let (renamed, dcap_fn) = split_fn(&rename(source, &declared), "u_score_mod_dcapture");
    let dcapture = dcapture.then(|| {
        let mut w = format!("{}\n", dcap_fn.unwrap_or_default());
        for (k, n) in names.iter().enumerate() {
            w.push_str(&format!(
                "fn u_d_{n}(idx: u32, x: f32) {{\n    let t = p.m.cap_tab + {}u;\n    \
                 dcap_record(aux_word(t) - aux_word(p.m.cap_tab) + min(idx, max(aux_word(t + 1u), 1u) - 1u), x);\n}}\n",
                2 * k
            ));
        }
        w
    });
    // Without loops and dynamic indexing the user's code cannot index out of bounds or spin
    // (it names nothing of the crate's, and the capture readers clamp): its pipelines may run
    // without wgpu's runtime checks like the crate's own.
    let proved_safe = vouched || proved_safe(&module);
    let mut wgsl = String::new();
    for (k, n) in names.iter().enumerate() {
        wgsl.push_str(&format!(
            "fn u_{n}(idx: u32) -> f32 {{\n    let t = p.m.cap_tab + {}u;\n    \
             return bitcast<f32>(aux_word(aux_word(t) + min(idx, max(aux_word(t + 1u), 1u) - 1u)));\n}}\n",
            2 * k
        ));
    }
    wgsl.push_str(&renamed);
    wgsl.push('\n');
    for (given, stub) in [(score, SCORE_STUB), (score_ds, SCORE_DS_STUB), (mask, MASK_STUB)] {
        if !given {
            wgsl.push_str(stub);
        }
    }
    Ok(Checked {
        score,
        mask,
        score_ds,
        wgsl,
        dcapture,
        proved_safe,
    })
}

fn user_err(line: Option<usize>, message: String) -> Error {
    Error::UserMod { line, message }
}

/// The capture names (identifiers, distinct, not the functions', each named by the source),
/// and what naga accepts in a module of its own but the kernels cannot take: barriers (the
/// functions run in non-uniform control flow) and directives (they must open a module).
fn check_tokens(source: &str, names: &[&str]) -> Result<()> {
    let err = |m: String| user_err(None, m);
    for (i, n) in names.iter().enumerate() {
        let ident = n
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !n.starts_with("__");
        if !ident {
            return Err(err(format!("capture name {n:?} is not a WGSL identifier")));
        }
        if names[..i].contains(n) {
            return Err(err(format!("capture name {n:?} is given twice")));
        }
        if ["score_mod", "mask_mod", "score_mod_ds", "score_mod_dcapture"].contains(n) {
            return Err(err(format!("capture name {n:?} is the function's own")));
        }
        if !tokens(source).any(|t| t == *n) {
            return Err(err(format!(
                "capture {n:?} is not used by the source (unknown capture name)"
            )));
        }
    }
    for t in tokens(source) {
        let why = match t {
            "workgroupBarrier" | "storageBarrier" | "textureBarrier" | "workgroupUniformLoad" => {
                "a barrier (the functions run per logit, in non-uniform control flow)"
            }
            "enable" | "requires" | "diagnostic" => "a directive (the kernels declare their own)",
            _ => continue,
        };
        return Err(err(format!("the source uses {t}: {why} is not allowed")));
    }
    Ok(())
}

/// `source` parsed and validated by naga with the captures as stubs before it: naga's message
/// with the user's line (quoted) on failure; functions and constants only.
fn parse_checked(source: &str, names: &[&str]) -> Result<naga::Module> {
    let mut header: String = names
        .iter()
        .map(|n| format!("fn {n}(idx: u32) -> f32 {{ return f32(idx); }}\nfn d_{n}(idx: u32, x: f32) {{}}\n"))
        .collect();
    // The kernels' own `q_pos` (common/masks.wgsl), which the source may call.
    header.push_str(Q_POS_STUB);
    let header_lines = 2 * names.len() + 1;
    let full = format!("{header}{source}");
    let user_line = |line: u32| (line as usize).checked_sub(header_lines).filter(|&l| l > 0);
    let quote = |line: Option<usize>, msg: &str| {
        let text = line
            .and_then(|l| source.lines().nth(l - 1))
            .map(|t| format!(": `{}`", t.trim()))
            .unwrap_or_default();
        user_err(line, format!("{msg}{text}"))
    };
    let module = naga::front::wgsl::parse_str(&full).map_err(|e| {
        let line = e.location(&full).and_then(|l| user_line(l.line_number));
        quote(line, e.message())
    })?;
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::empty(),
    );
    if let Err(e) = validator.validate(&module) {
        let line = e.location(&full).and_then(|l| user_line(l.line_number));
        let mut msg = e.as_inner().to_string();
        let mut src: &dyn std::error::Error = e.as_inner();
        while let Some(next) = src.source() {
            msg.push_str(&format!(": {next}"));
            src = next;
        }
        return Err(quote(line, &msg));
    }
    if !module.entry_points.is_empty() {
        return Err(user_err(
            None,
            "the source declares an entry point: give functions only".into(),
        ));
    }
    if module.global_variables.iter().next().is_some() {
        return Err(user_err(
            None,
            "the source declares a module-scope variable: give functions and constants only".into(),
        ));
    }
    Ok(module)
}

/// Which of the user functions a source defines.
struct Defined {
    score: bool,
    score_ds: bool,
    mask: bool,
    dcapture: bool,
}

/// Which of `score_mod`, `score_mod_ds`, `score_mod_dcapture` and `mask_mod` the module
/// defines, each with its signature checked; at least one of `score_mod` and `mask_mod`.
fn signatures(module: &naga::Module) -> Result<Defined> {
    let (f32t, u32t, boolt) = (
        naga::TypeInner::Scalar(naga::Scalar::F32),
        naga::TypeInner::Scalar(naga::Scalar::U32),
        naga::TypeInner::Scalar(naga::Scalar::BOOL),
    );
    let signature = |name: &str, args: &[&naga::TypeInner], ret: Option<&naga::TypeInner>, text: &str| {
        let Some((_, f)) = module
            .functions
            .iter()
            .find(|(_, f)| f.name.as_deref() == Some(name))
        else {
            return Ok(false);
        };
        let ok = f.arguments.len() == args.len()
            && f.arguments
                .iter()
                .zip(args)
                .all(|(a, t)| module.types[a.ty].inner == **t)
            && f.result.as_ref().map(|r| &module.types[r.ty].inner) == ret;
        if ok {
            Ok(true)
        } else {
            Err(user_err(None, format!("{name} must be `{text}`")))
        }
    };
    let score_args = [&f32t, &u32t, &u32t, &u32t, &u32t];
    let score = signature(
        "score_mod",
        &score_args,
        Some(&f32t),
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32",
    )?;
    let score_ds = signature(
        "score_mod_ds",
        &score_args,
        Some(&f32t),
        "fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32",
    )?;
    let dcapture = signature(
        "score_mod_dcapture",
        &[&f32t, &u32t, &u32t, &u32t, &u32t, &f32t],
        None,
        "fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32)",
    )?;
    for (given, what) in [(score_ds, "score_mod_ds"), (dcapture, "score_mod_dcapture")] {
        if given && !score {
            return Err(user_err(None, format!("{what} is given without score_mod")));
        }
    }
    let mask = signature(
        "mask_mod",
        &[&u32t, &u32t, &u32t, &u32t],
        Some(&boolt),
        "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool",
    )?;
    if !score && !mask {
        return Err(user_err(
            None,
            "the source defines neither score_mod nor mask_mod".into(),
        ));
    }
    Ok(Defined {
        score,
        score_ds,
        mask,
        dcapture,
    })
}

/// The `d_NAME` accumulators are called by `score_mod_dcapture` alone, outside loops (so each
/// call runs at most once per logit: WGSL has no recursion), at most [`MAX_DCAPTURE_CALLS`]
/// times.
fn dcapture_calls(module: &naga::Module, names: &[&str]) -> Result<()> {
    let stubs: Vec<String> = names.iter().map(|n| format!("d_{n}")).collect();
    let is_stub = |h: naga::Handle<naga::Function>| {
        module.functions[h]
            .name
            .as_ref()
            .is_some_and(|n| stubs.contains(n))
    };
    let is_dcapture =
        |h: naga::Handle<naga::Function>| module.functions[h].name.as_deref() == Some("score_mod_dcapture");
    for (_, f) in module.functions.iter() {
        let name = f.name.as_deref().unwrap_or("");
        let mut calls = Vec::new();
        block_calls(&f.body, false, &is_dcapture, &mut calls);
        if !calls.is_empty() {
            return Err(user_err(
                None,
                format!("{name} calls score_mod_dcapture: the backward alone calls it"),
            ));
        }
        if stubs.iter().any(|s| s == name) {
            continue;
        }
        let mut calls = Vec::new();
        block_calls(&f.body, false, &is_stub, &mut calls);
        if calls.is_empty() {
            continue;
        }
        if name != "score_mod_dcapture" {
            return Err(user_err(
                None,
                format!("{name} calls a d_NAME accumulator: only score_mod_dcapture may"),
            ));
        }
        if calls.iter().any(|&in_loop| in_loop) {
            return Err(user_err(
                None,
                "score_mod_dcapture calls a d_NAME accumulator in a loop: call it at most once per element it adds to"
                    .into(),
            ));
        }
        if calls.len() > MAX_DCAPTURE_CALLS {
            return Err(user_err(
                None,
                format!(
                    "score_mod_dcapture calls the d_NAME accumulators {} times: at most {MAX_DCAPTURE_CALLS}",
                    calls.len()
                ),
            ));
        }
    }
    Ok(())
}

/// The calls in `block` to functions `is_stub` accepts, each as whether it is in a loop.
fn block_calls(
    block: &naga::Block,
    in_loop: bool,
    is_stub: &dyn Fn(naga::Handle<naga::Function>) -> bool,
    out: &mut Vec<bool>,
) {
    use naga::Statement as S;
    for st in block.iter() {
        match st {
            S::Block(b) => block_calls(b, in_loop, is_stub, out),
            S::If { accept, reject, .. } => {
                block_calls(accept, in_loop, is_stub, out);
                block_calls(reject, in_loop, is_stub, out);
            }
            S::Switch { cases, .. } => {
                for c in cases {
                    block_calls(&c.body, in_loop, is_stub, out);
                }
            }
            S::Loop { body, continuing, .. } => {
                block_calls(body, true, is_stub, out);
                block_calls(continuing, true, is_stub, out);
            }
            S::Call { function, .. } if is_stub(*function) => out.push(in_loop),
            _ => {}
        }
    }
}

/// `src` without function `name` (its lines kept, blank), and that function's text.
fn split_fn(src: &str, name: &str) -> (String, Option<String>) {
    let spans = token_spans(src);
    let Some(w) = spans
        .windows(2)
        .find(|w| &src[w[0].0..w[0].1] == "fn" && &src[w[1].0..w[1].1] == name)
    else {
        return (src.to_string(), None);
    };
    let start = w[0].0;
    let mut depth = 0usize;
    let mut end = src.len();
    let open = src[start..].find('{').map_or(src.len(), |o| start + o);
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = open + i + 1;
                    break;
                }
            }
            _ => {}
        }
    }
    let text = src[start..end].to_string();
    let blank: String = text.chars().filter(|&c| c == '\n').collect();
    (format!("{}{blank}{}", &src[..start], &src[end..]), Some(text))
}

/// The identifier tokens of WGSL `src` (comments and numbers skipped), with their byte ranges.
fn token_spans(src: &str) -> Vec<(usize, usize)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}

fn tokens(src: &str) -> impl Iterator<Item = &str> {
    token_spans(src).into_iter().map(move |(a, e)| &src[a..e])
}

/// `src` with every identifier in `names` prefixed by `u_`, except member accesses (after `.`)
/// and struct members' declarations (so that `s.x` still names the field), and without
/// comments (the kernels' assembly reads markers such as `// unroll` in them).
fn rename(src: &str, names: &[String]) -> String {
    let src = &strip_comments(src);
    let mut out = String::with_capacity(src.len() + 64);
    let mut last = 0;
    // The brace depth, and the depth of the struct body being read (if any).
    let (mut depth, mut struct_body) = (0usize, None::<usize>);
    let mut pending_struct = false;
    let mut pos = 0;
    for (a, e) in token_spans(src) {
        for c in src[pos..a].chars() {
            match c {
                '{' => {
                    depth += 1;
                    if pending_struct {
                        struct_body = Some(depth);
                        pending_struct = false;
                    }
                }
                '}' => {
                    if struct_body == Some(depth) {
                        struct_body = None;
                    }
                    depth = depth.saturating_sub(1);
                }
                _ => {}
            }
        }
        pos = e;
        let t = &src[a..e];
        if t == "struct" {
            pending_struct = true;
        }
        let member = src[..a].trim_end().ends_with('.');
        let field = struct_body == Some(depth) && src[e..].trim_start().starts_with(':');
        if !member && !field && names.iter().any(|n| n == t) {
            out.push_str(&src[last..a]);
            out.push_str("u_");
            out.push_str(t);
            last = e;
        }
    }
    out.push_str(&src[last..]);
    out
}

/// `src` with its comments removed (line breaks kept, so that lines still count the same).
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut keep = vec![true; b.len()];
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                keep[i] = false;
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    keep[i] = false;
                    keep[i + 1] = false;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    keep[i] = false;
                    keep[i + 1] = false;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    keep[i] = b[i] == b'\n';
                    i += 1;
                }
            }
        } else {
            i += 1;
        }
    }
    let bytes: Vec<u8> = b.iter().zip(&keep).filter(|(_, &k)| k).map(|(&c, _)| c).collect();
    String::from_utf8(bytes).unwrap_or_default()
}

/// The names `src` declares at module scope (`fn`, `const`, `override`, `struct`, `alias`,
/// `var` at brace depth 0), from its tokens.
fn module_scope_names(src: &str) -> Vec<String> {
    let src = &strip_comments(src);
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut pos = 0;
    let mut want_name = false;
    for (a, e) in token_spans(src) {
        for c in src[pos..a].chars() {
            match c {
                '{' => depth += 1,
                '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        pos = e;
        let t = &src[a..e];
        if want_name {
            // `var<private> x`: the address space's tokens come first.
            let space = matches!(
                t,
                "private" | "workgroup" | "storage" | "uniform" | "function" | "read" | "read_write"
            );
            if !space {
                out.push(t.to_string());
                want_name = false;
            }
            continue;
        }
        if depth == 0 && matches!(t, "fn" | "const" | "override" | "struct" | "alias" | "var") {
            want_name = true;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renaming_skips_comments_numbers_and_members() {
        let src =
            "const R = 1e5; // R here\nfn f(v: vec2<f32>) -> f32 { return v.x + R + x(1u); } /* x /* R */ */";
        let got = rename(src, &["R".into(), "x".into(), "f".into()]);
        assert_eq!(
            got,
            "const u_R = 1e5; \nfn u_f(v: vec2<f32>) -> f32 { return v.x + u_R + u_x(1u); } "
        );
        // A struct member named like a constant keeps its name where declared and used.
        let src = "const R = 2;\nstruct S { R: f32, y: f32 }\nfn f(s: S) -> f32 { return s.R * f32(R); }";
        let got = rename(src, &module_scope_names(src));
        assert_eq!(
            got,
            "const u_R = 2;\nstruct u_S { R: f32, y: f32 }\nfn u_f(s: u_S) -> f32 { return s.R * f32(u_R); }"
        );
        assert_eq!(
            module_scope_names("alias T = f32; const W = 64; override O: u32; fn g() { let z = 1; }"),
            ["T", "W", "O", "g"]
        );
    }

    #[test]
    fn untyped_constants_are_renamed_and_barriers_refused() {
        // Untyped constants (naga drops them from its module) named like the kernels' own.
        let src = "const WG = 2.0;\nconst START = 1.0;\n\
                   fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s * WG + START; }";
        let c = check_source(src, &[], false).unwrap();
        assert!(
            c.wgsl.contains("const u_WG = 2.0;") && c.wgsl.contains("s * u_WG + u_START"),
            "{}",
            c.wgsl
        );
        for bad in [
            "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { workgroupBarrier(); return true; }",
            "diagnostic(off, derivative_uniformity);\nfn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return true; }",
        ] {
            assert!(check_source(bad, &[], false).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_code_without_loops_or_dynamic_indexing_runs_unchecked() {
        let head = "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {";
        let proved = |body: &str, names: &[&str]| {
            check_source(&format!("{head}\n{body}\n}}"), names, false)
                .unwrap()
                .proved_safe
        };
        // Capture reads, constant indices, branches: proved.
        assert!(proved("return s + rel(h * 3u + min(j - i, 2u));", &["rel"]));
        assert!(proved(
            "let v = vec2<f32>(s, 1.0); if (i > j) { return v.x; } return v[1];",
            &[]
        ));
        // A loop, a dynamic index into a local array or vector: the checks stay.
        assert!(!proved(
            "var t = s; for (var k = 0u; k < i; k++) { t += 1.0; } return t;",
            &[]
        ));
        assert!(!proved(
            "var a = array<f32, 4>(1.0, 2.0, 3.0, 4.0); return s + a[j];",
            &[]
        ));
        assert!(!proved("let v = vec4<f32>(s); return v[i];", &[]));
        assert!(!proved("loop { if (i > 0u) { break; } } return s;", &[]));
        // The crate's own source with a loop, vouched for.
        let looped = format!("{head}\nvar t = s; for (var k = 0u; k < i; k++) {{ t += 1.0; }} return t;\n}}");
        assert!(check_source(&looped, &[], true).unwrap().proved_safe);
    }

    #[test]
    fn errors_quote_the_line() {
        let e = check_source(
            "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n  return s + nope;\n}",
            &[],
            false,
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::UserMod { line: Some(2), .. }), "{msg}");
        assert!(msg.contains("return s + nope;"), "{msg}");
        let e = check_source(
            "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }",
            &[],
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("mask_mod must be"), "{e}");
        let e = check_source("fn helper() -> f32 { return 1.0; }", &[], false).unwrap_err();
        assert!(e.to_string().contains("neither"), "{e}");
        let ok = "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + t(i); }";
        assert!(check_source(ok, &["t"], false).is_ok());
        for (names, want) in [
            (&["t", "t"][..], "twice"),
            (&["t", "u"][..], "unknown"),
            (&["1t"][..], "identifier"),
        ] {
            let e = check_source(ok, names, false).unwrap_err();
            assert!(e.to_string().contains(want), "{names:?}: {e}");
        }
        // A helper named like a capture: naga's redefinition.
        let dup = "fn t(i: u32) -> f32 { return 0.0; }\nfn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + t(i); }";
        assert!(check_source(dup, &["t"], false).is_err());
    }
}
