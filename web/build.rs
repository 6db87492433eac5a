//! Embeds the PyTorch golden fixtures (`../tests/fixtures/sdpa/<case>/*`) into the browser
//! test suite, which has no file system: `$OUT_DIR/goldens.rs` holds
//! `GOLDENS: &[(case, &[(file, bytes)])]`.

use std::fmt::Write;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sdpa");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut cases: Vec<_> = std::fs::read_dir(&root)
        .expect("tests/fixtures/sdpa")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    let mut src = String::from(
        "/// A golden's files: name and bytes.\npub type Files = &'static [(&'static str, &'static [u8])];\n\
         pub static GOLDENS: &[(&str, Files)] = &[\n",
    );
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        writeln!(src, "    ({name:?}, &[").unwrap();
        for f in files {
            let file = f.file_name().unwrap().to_string_lossy().into_owned();
            let abs = f.canonicalize().unwrap();
            writeln!(
                src,
                "        ({file:?}, include_bytes!({:?})),",
                abs.display().to_string()
            )
            .unwrap();
        }
        src.push_str("    ]),\n");
    }
    src.push_str("];\n");
    let out = Path::new(&std::env::var("OUT_DIR").unwrap()).join("goldens.rs");
    std::fs::write(out, src).unwrap();
}
