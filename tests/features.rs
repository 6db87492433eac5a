//! The library's default features pull in none of the command-line tool's dependencies (clap,
//! ndarray-npy, indicatif, and plotters for its pictures): the tool is its own package (cli/),
//! and a library user's dependency tree holds only what attention needs.

use std::process::Command;

/// What only the tool (or the optional `heatmap` / `plot` features) should bring.
const TOOL_ONLY: [&str; 4] = ["clap", "plotters", "indicatif", "ndarray-npy"];

/// `cargo tree -p wgpu-attention --prefix none --locked --offline` with `args`: its output.
fn cargo_tree(args: &[&str]) -> String {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--manifest-path", manifest, "-p", "wgpu-attention"])
        .args(["--prefix", "none", "--locked", "--offline"])
        .args(args)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The normal (non-dev, non-build) dependency tree of the library with `features` on top of
/// its defaults, one package name per line.
fn normal_tree(extra: &[&str]) -> Vec<String> {
    let args = [&["-e", "normal", "--format", "{p}"], extra].concat();
    cargo_tree(&args)
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

/// wgpu's features as the library turns them on (its normal dependencies only) with `args`.
fn wgpu_features(args: &[&str]) -> Vec<String> {
    let args = [&["-e", "normal,features", "-i", "wgpu"], args].concat();
    let mut f: Vec<String> = cargo_tree(&args)
        .lines()
        .filter_map(|l| {
            l.strip_prefix("wgpu feature \"")?
                .split('"')
                .next()
                .map(str::to_owned)
        })
        .collect();
    f.sort();
    f.dedup();
    f
}

/// wgpu without its default features: the backends pass through, `counters` is opt-in.
#[test]
fn wgpu_features_pass_through_and_counters_are_opt_in() {
    let defaults = wgpu_features(&[]);
    for backend in ["vulkan", "metal", "dx12", "gles", "webgpu", "wgsl"] {
        assert!(
            defaults.iter().any(|f| f == backend),
            "default features lack wgpu's {backend}: {defaults:?}"
        );
    }
    assert!(
        !defaults.iter().any(|f| f == "counters"),
        "counters on by default: {defaults:?}"
    );
    let vulkan = wgpu_features(&["--no-default-features", "--features", "vulkan"]);
    assert_eq!(
        vulkan,
        ["parking_lot", "std", "vulkan", "wgsl"],
        "one backend asked for"
    );
    let counted = wgpu_features(&["--features", "counters"]);
    assert!(counted.iter().any(|f| f == "counters"), "{counted:?}");
}
