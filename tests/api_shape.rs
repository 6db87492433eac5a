//! The public API's shape, checked on the source: every public enum is `#[non_exhaustive]`, so
//! that a variant added later (as `Causal::Diagonal` was) breaks no caller's `match`.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_public_enum_is_non_exhaustive() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut missing = Vec::new();
    let mut seen = 0;
    for f in files.iter().filter(|f| !f.to_string_lossy().contains("/bin/")) {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            // Crate-visible enums only (`pub enum` at the start of a line, not `pub(crate)`).
            if !line.starts_with("pub enum ") {
                continue;
            }
            seen += 1;
            let attrs = lines[..i]
                .iter()
                .rev()
                .take_while(|l| l.starts_with("#[") || l.starts_with("///"));
            if !attrs.clone().any(|l| l.starts_with("#[non_exhaustive]")) {
                missing.push(format!("{}:{}: {line}", f.display(), i + 1));
            }
        }
    }
    assert!(seen >= 10, "found only {seen} public enums: the scan is broken");
    assert!(
        missing.is_empty(),
        "public enums without #[non_exhaustive]:\n{}",
        missing.join("\n")
    );
}
