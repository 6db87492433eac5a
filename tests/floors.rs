//! The crate's floors, held by a test: each module of `src/` stands on a floor and may use
//! (`crate::...`) only modules on lower floors, so the layering survives without any outside
//! tool. From the ground up:
//!
//! ```text
//! values    storage < error < {check, view, forms, rope, user_mod, pictures} < problem < tensor < options
//! device    the Context, buffers, pipelines, faults, timer, subgroup probe
//! kernels   one module per shader: params, preludes, dispatch
//! ops       typed GPU ops over the kernels (matmul, linear, copy, merge, pinv, rope)
//! sdpa      attention calls, their plans, the backward
//! layers    mha, ring, paged
//! variants  the literature's variants, on the layers above
//! checks    reference (f64 CPU), shapes (benchmark inputs): nothing in production reads them
//! ```
//!
//! Imports are spelled by module path (`crate::sdpa::Sdpa`), never through the crate root's
//! re-exports (`crate::Sdpa`), so that every edge names the floor it reaches. A new module
//! gets a line in [`FLOORS`]; a new edge that runs down-to-up fails here with the file and the
//! name.

use std::path::{Path, PathBuf};

/// Every module under `src/` and its floor (higher stands on lower).
const FLOORS: &[(&str, u32)] = &[
    ("storage", 0),
    ("error", 1),
    ("check", 2),
    ("view", 2),
    ("forms", 2),
    ("rope", 2),
    ("user_mod", 2),
    ("pictures", 2),
    ("problem", 3),
    ("tensor", 4),
    ("options", 5),
    ("device", 10),
    ("kernels", 20),
    ("ops", 30),
    ("quant", 35),
    ("sdpa", 40),
    ("mha", 50),
    ("ring", 50),
    ("paged", 50),
    ("variants", 60),
    ("reference", 70),
    ("shapes", 70),
];

fn floor(module: &str) -> Option<u32> {
    FLOORS.iter().find(|(m, _)| *m == module).map(|&(_, f)| f)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `path` is a module only tests compile: its declaration in its parent
/// (`mod.rs` beside it, or `mod.rs` of the folder it names) follows `#[cfg(test)]`.
fn test_only(path: &Path) -> bool {
    let (Some(dir), Some(stem)) = (path.parent(), path.file_stem().and_then(|s| s.to_str())) else {
        return false;
    };
    let (parent, name) = if stem == "mod" {
        match (dir.parent(), dir.file_name().and_then(|n| n.to_str())) {
            (Some(up), Some(n)) => (up.join("mod.rs"), n.to_string()),
            _ => return false,
        }
    } else {
        (dir.join("mod.rs"), stem.to_string())
    };
    let Ok(text) = std::fs::read_to_string(parent) else {
        return false;
    };
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines.windows(2).any(|w| {
        w[0] == "#[cfg(test)]"
            && (w[1] == format!("mod {name};") || w[1] == format!("pub(crate) mod {name};"))
    })
}

/// The code of a file without comments or its `mod tests`; none for the files only tests
/// compile (`stage_tests.rs`, `tests.rs`, and any module declared under `#[cfg(test)]`).
fn production_code(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    if name == "stage_tests.rs" || name == "tests.rs" || test_only(path) {
        return None;
    }
    let text = std::fs::read_to_string(path).expect("read a source file");
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    let mut code = String::new();
    for line in text.lines() {
        // A `//` inside a string literal ("http://...") would cut a line short: there is none
        // before a `crate::` in this crate, and a miss would only hide an edge, never add one.
        let line = line.split("//").next().unwrap_or("");
        code.push_str(line);
        code.push('\n');
    }
    Some(code)
}

/// The first path segments after `crate::` in `code`, groups (`use crate::{a::X, b}`) included.
fn crate_edges(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let head = item.trim().split("::").next().unwrap_or("").trim();
                if !head.is_empty() {
                    out.push(head.to_string());
                }
            }
        } else {
            let head: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !head.is_empty() {
                out.push(head);
            }
        }
        rest = after;
    }
    out
}

#[test]
fn every_import_runs_down_a_floor() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    let mut seen = 0;
    for path in &files {
        let rel = path.strip_prefix(&src).expect("under src/");
        let module = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .expect("a module");
        if module == "lib" {
            continue; // the crate's face: declares the modules and re-exports them
        }
        let Some(own) = floor(&module) else {
            wrong.push(format!(
                "{}: module `{module}` has no floor in FLOORS",
                rel.display()
            ));
            continue;
        };
        let Some(code) = production_code(path) else {
            continue;
        };
        let edges = crate_edges(&code);
        seen += edges.len();
        wrong.extend(violations(&rel.display().to_string(), &module, own, &edges));
    }
    assert!(
        seen > 500,
        "only {seen} crate:: paths read: is the parser still reading the code?"
    );
    assert!(
        wrong.is_empty(),
        "imports against the floors:\n{}",
        wrong.join("\n")
    );
}

/// What is wrong with the edges of a file `rel` of `module` on floor `own`.
fn violations(rel: &str, module: &str, own: u32, edges: &[String]) -> Vec<String> {
    let mut wrong = Vec::new();
    for target in edges.iter().filter(|t| *t != module) {
        match floor(target) {
            None => wrong.push(format!(
                "{rel}: `crate::{target}` goes through the crate root; spell it by module path"
            )),
            Some(f) if f >= own => wrong.push(format!(
                "{rel}: `{module}` (floor {own}) uses `{target}` (floor {f}), which is not below it"
            )),
            Some(_) => {}
        }
    }
    wrong
}

/// The parser sees what the rule needs: paths, groups, and not comments.
#[test]
fn the_parser_reads_paths_and_groups() {
    let code = "use crate::sdpa::Sdpa;\nuse crate::{device::context::Context, error};\nlet x = crate::ops::copy::convert(a);";
    assert_eq!(crate_edges(code), ["sdpa", "device", "error", "ops"]);
    let dir = std::env::temp_dir().join(format!("floors-{}.rs", std::process::id()));
    std::fs::write(
        &dir,
        "// crate::variants in a comment\nuse crate::view::View; // crate::mha\n",
    )
    .expect("write");
    let code = production_code(&dir).expect("read");
    std::fs::remove_file(&dir).ok();
    assert_eq!(crate_edges(&code), ["view"]);
}

/// A down-to-up edge, a same-floor edge and a crate-root spelling are each named; a
/// down edge is not.
#[test]
fn a_wrong_edge_is_named() {
    let code = "use crate::sdpa::Sdpa;\nuse crate::Context;\nuse crate::device::buffers::f32_bytes;\nuse crate::kernels::wgsl;";
    let wrong = violations("kernels/x.rs", "kernels", 20, &crate_edges(code));
    assert_eq!(wrong.len(), 2, "{wrong:?}");
    assert!(wrong[0].contains("uses `sdpa` (floor 40)"), "{wrong:?}");
    assert!(
        wrong[1].contains("`crate::Context` goes through the crate root"),
        "{wrong:?}"
    );
    let same = violations("mha/x.rs", "mha", 50, &crate_edges("crate::paged::KvCache"));
    assert_eq!(same.len(), 1, "{same:?}");
}
