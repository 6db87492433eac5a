//! The library's default features pull in none of the command-line tool's dependencies (clap,
//! ndarray-npy, indicatif, and plotters for its pictures): the tool is its own package (cli/),
//! and a library user's dependency tree holds only what attention needs.

use std::process::Command;

/// What only the tool (or the optional `heatmap` / `plot` features) should bring.
const TOOL_ONLY: [&str; 4] = ["clap", "plotters", "indicatif", "ndarray-npy"];

/// The normal (non-dev, non-build) dependency tree of the library with `features` on top of
/// its defaults, one package name per line.
fn normal_tree(extra: &[&str]) -> Vec<String> {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--manifest-path", manifest, "-p", "wgpu-attention"])
        .args([
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
            "--locked",
            "--offline",
        ])
        .args(extra)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn default_features_hold_none_of_the_tools_dependencies() {
    let tree = normal_tree(&[]);
    assert!(tree.iter().any(|p| p == "wgpu"), "the tree names wgpu: {tree:?}");
    let found: Vec<_> = tree.iter().filter(|p| TOOL_ONLY.contains(&p.as_str())).collect();
    assert!(
        found.is_empty(),
        "the library's default features pull in {found:?}"
    );
}

/// The check above can fail: the pictures' features do bring plotters.
#[test]
fn the_picture_features_do_bring_plotters() {
    let tree = normal_tree(&["--features", "heatmap"]);
    assert!(tree.iter().any(|p| p == "plotters"), "{tree:?}");
    assert!(!tree.iter().any(|p| p == "clap"), "{tree:?}");
}
