//! A source-level loop unroller for WGSL.
//!
//! A loop written as
//!
//! ```wgsl
//! for (var r = 0u; r < RQ; r++) { // unroll
//!     acc[r] += x;
//! }
//! ```
//!
//! where the bound is a literal or a `const NAME: u32 = Nu;` declared in the source (the kernels'
//! host-generated preludes), is replaced by `RQ` copies of its body, each in its own block that
//! starts with `const r = <k>u;`. Indices into private arrays then become constants, which
//! matters on CPU adapters (lavapipe/llvmpipe): a dynamically indexed private array lives in
//! scratch memory with a per-lane loop on every access, a constant-indexed one in registers.
//! GPU compilers usually unroll such loops themselves; unrolling at the source costs them nothing.
//!
//! `// unroll if NAME` unrolls only when the source also declares `const NAME: bool = true;`.
//!
//! The pass runs only on sources that declare `const UNROLL: bool = true;` (a kernel's prelude
//! decides: unrolled code runs faster on CPU adapters but takes far longer to compile there).
//! The shader stays valid WGSL without this pass (the marker is a comment), so the kernels read
//! as ordinary loops. Bodies must not use `break` or `continue` (checked).

use std::collections::HashMap;

/// Unroll every marked loop in `src` (nested ones included) if `src` declares
/// `const UNROLL: bool = true;`; otherwise return it as is.
pub(crate) fn unroll(src: &str) -> String {
    if !src.lines().any(|l| l.trim() == "const UNROLL: bool = true;") {
        return src.to_string();
    }
    let consts = consts(src);
    let flags: Vec<String> = src
        .lines()
        .filter_map(|l| {
            let name = l.trim().strip_prefix("const ")?.strip_suffix(": bool = true;")?;
            Some(name.trim().to_string())
        })
        .collect();
    let lines: Vec<&str> = src.lines().collect();
    let mut out = String::with_capacity(src.len() * 4);
    expand(&lines, &consts, &flags, &mut out);
    out
}

/// Whether `line` is a loop header marked for unrolling (given the true flags).
fn marked(line: &str, flags: &[String]) -> bool {
    let Some((_, comment)) = line.split_once("//") else {
        return false;
    };
    let comment = comment.trim();
    match comment.strip_prefix("unroll") {
        Some("") => true,
        Some(rest) => rest
            .trim()
            .strip_prefix("if ")
            .is_some_and(|flag| flags.iter().any(|f| f == flag.trim())),
        None => false,
    }
}

/// The `const NAME: u32 = Nu;` (or `= N;`) declarations of `src`.
fn consts(src: &str) -> HashMap<String, u32> {
    let mut map = HashMap::new();
    for line in src.lines() {
        let Some(rest) = line.trim().strip_prefix("const ") else {
            continue;
        };
        let Some((name, value)) = rest.split_once('=') else {
            continue;
        };
        let name = name.split(':').next().unwrap_or("").trim();
        let value = value.trim().trim_end_matches(';').trim().trim_end_matches('u');
        if let Ok(v) = value.parse::<u32>() {
            map.insert(name.to_string(), v);
        }
    }
    map
}

/// `for (var X = 0u; X < N; X++) { // unroll` -> (X, N).
fn header(line: &str, consts: &HashMap<String, u32>) -> Option<(String, u32)> {
    let code = line.split("//").next()?.trim();
    let inner = code.strip_prefix("for (var ")?.strip_suffix(") {")?;
    let mut parts = inner.split(';').map(str::trim);
    let (init, cond, step) = (parts.next()?, parts.next()?, parts.next()?);
    let (var, start) = init.split_once('=')?;
    let var = var.trim();
    if start.trim() != "0u" || step != format!("{var}++") {
        return None;
    }
    let bound = cond.strip_prefix(var)?.trim().strip_prefix('<')?.trim();
    let n = match consts.get(bound) {
        Some(&n) => n,
        None => bound.trim_end_matches('u').parse().ok()?,
    };
    Some((var.to_string(), n))
}

/// Net `{` minus `}` on a line, ignoring a trailing `//` comment.
fn depth(line: &str) -> i32 {
    let code = line.split("//").next().unwrap_or("");
    code.matches('{').count() as i32 - code.matches('}').count() as i32
}

fn expand(lines: &[&str], consts: &HashMap<String, u32>, flags: &[String], out: &mut String) {
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if !marked(line, flags) {
            out.push_str(line);
            out.push('\n');
            i += 1;
            continue;
        }
        let (var, n) = header(line, consts)
            .unwrap_or_else(|| panic!("unroll: cannot parse loop header `{}`", line.trim()));
        // The body runs to the line that closes the loop's brace.
        let mut d = 1;
        let mut end = i + 1;
        while end < lines.len() {
            d += depth(lines[end]);
            if d <= 0 {
                break;
            }
            end += 1;
        }
        assert!(end < lines.len(), "unroll: unterminated loop `{}`", line.trim());
        let body = &lines[i + 1..end];
        assert!(
            body.iter().all(|l| {
                let code = l.split("//").next().unwrap_or("");
                !code.contains("break") && !code.contains("continue")
            }),
            "unroll: `break`/`continue` in the body of `{}`",
            line.trim()
        );
        let mut inner = String::new();
        expand(body, consts, flags, &mut inner);
        for k in 0..n {
            out.push_str(&format!("{{ const {var} = {k}u;\n"));
            out.push_str(&inner);
            out.push_str("}\n");
        }
        i = end + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrolls_nested_loops_with_const_and_literal_bounds() {
        let src = "const UNROLL: bool = true;\nconst N: u32 = 2u;\nfn f() {\n    for (var r = 0u; r < N; r++) { // unroll\n        for (var c = 0u; c < 3u; c++) { // unroll\n            x[r * 3u + c] = 1.0; // not { a brace\n        }\n    }\n    for (var j = 0u; j < N; j++) {\n    }\n}\n";
        let out = unroll(src);
        assert_eq!(out.matches("x[r * 3u + c] = 1.0;").count(), 6);
        assert_eq!(out.matches("const r = 1u;").count(), 1);
        assert_eq!(out.matches("const c = 2u;").count(), 2);
        // The unmarked loop stays a loop.
        assert!(out.contains("for (var j = 0u; j < N; j++) {"));
        let code: String = out.lines().map(|l| l.split("//").next().unwrap()).collect();
        assert_eq!(code.matches('{').count(), code.matches('}').count());
    }

    #[test]
    fn conditional_marker_follows_its_flag() {
        let src = "const UNROLL: bool = true;\nconst A: bool = true;\nconst B: bool = false;\nfn f() {\n    for (var i = 0u; i < 2u; i++) { // unroll if A\n        x += 1.0;\n    }\n    for (var j = 0u; j < 2u; j++) { // unroll if B\n        y += 1.0;\n    }\n}\n";
        let out = unroll(src);
        assert_eq!(out.matches("x += 1.0;").count(), 2);
        assert_eq!(out.matches("y += 1.0;").count(), 1);
        assert!(out.contains("for (var j = 0u; j < 2u; j++) { // unroll if B"));
    }

    #[test]
    fn leaves_unmarked_source_alone() {
        let src = "const UNROLL: bool = true;\nfn f() {\n    for (var r = 0u; r < 4u; r++) {\n    }\n}\n";
        assert_eq!(unroll(src), src);
        // Without the switch, marked loops stay loops.
        let src = "fn f() {\n    for (var r = 0u; r < 4u; r++) { // unroll\n    }\n}\n";
        assert_eq!(unroll(src), src);
    }
}
