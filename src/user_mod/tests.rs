//! The user functions' checks and assembly, without a GPU.

use super::check::check_source;
use super::source::{module_scope_names, rename};
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
