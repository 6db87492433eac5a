//! The user's source as the kernels include it: [`Checked`] (renamed, with its capture
//! readers and the stubs of what it does not define), the prelude, and the token-level
//! renaming and splitting that assembly uses.

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
    /// A hash of `wgsl` and `dcapture`, taken once when the source is checked: it names the
    /// user code in a pipeline's label ([`id_of`]).
    pub(crate) id: u64,
}

/// [`Checked::id`] of a checked source's kernel code.
pub(crate) fn id_of(wgsl: &str, dcapture: Option<&str>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    wgsl.hash(&mut h);
    dcapture.hash(&mut h);
    h.finish()
}

/// The WGSL the kernels' prelude includes for the user functions `code` (none: the stubs).
pub(crate) fn prelude(code: Option<&Checked>) -> String {
    match code {
        Some(c) => c.wgsl.clone(),
        None => format!("{SCORE_STUB}{SCORE_DS_STUB}{MASK_STUB}"),
    }
}

/// The position function the kernels give user code (`q_pos` in common/masks.wgsl), as naga
/// checks the source standalone.
pub(super) const Q_POS_STUB: &str = "fn q_pos(b: u32, i: u32) -> u32 { return i; }\n";

pub(super) const SCORE_STUB: &str =
    "fn u_score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s; }\n";
pub(super) const SCORE_DS_STUB: &str =
    "fn u_score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n";
pub(super) const MASK_STUB: &str = "fn u_mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return true; }\n";

/// `src` without function `name` (its lines kept, blank), and that function's text.
pub(super) fn split_fn(src: &str, name: &str) -> (String, Option<String>) {
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
pub(super) fn token_spans(src: &str) -> Vec<(usize, usize)> {
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

pub(super) fn tokens(src: &str) -> impl Iterator<Item = &str> {
    token_spans(src).into_iter().map(move |(a, e)| &src[a..e])
}

/// `src` with every identifier in `names` prefixed by `u_`, except member accesses (after `.`)
/// and struct members' declarations (so that `s.x` still names the field), and without
/// comments (the kernels' assembly reads markers such as `// unroll` in them).
pub(super) fn rename(src: &str, names: &[String]) -> String {
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
pub(super) fn strip_comments(src: &str) -> String {
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
pub(super) fn module_scope_names(src: &str) -> Vec<String> {
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
