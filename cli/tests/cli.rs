//! The command-line tool end to end: `mha` on the PyTorch fixtures (GPU and `--cpu`, masks in
//! PyTorch's convention, weights and heatmap outputs) and its typed failures (exit status 2);
//! `.npy` files whose header claims more (or less) data than they hold; and `--path` /
//! `--paths` naming the path that really runs.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use ndarray::{Array4, ArrayD};
use ndarray_npy::{read_npy, write_npy};
use wgpu_attention::check::compare;

/// The library's test fixtures (`tests/fixtures` at the repository root).
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn fixture(case: &str, file: &str) -> PathBuf {
    fixtures().join("mha").join(case).join(file)
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wgpu-attention-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wgpu-attention"))
        .args(args)
        .output()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The f32 `.npy` the tool wrote at `got` has rank `ndim`, the shape of the f64 fixture
/// `want`, and matches it at the crate tolerance.
fn assert_npy_matches(got: &Path, want: &Path, ndim: usize, label: &str) {
    let got: ArrayD<f32> = read_npy(got).unwrap();
    let want: ArrayD<f64> = read_npy(want).unwrap();
    assert_eq!(got.ndim(), ndim, "{label}: rank");
    assert_eq!(got.shape(), want.shape(), "{label}: shape");
    common::assert_report(
        compare(got.iter().copied(), want.iter().copied(), common::TOL),
        label,
    );
}

#[test]
fn mha_cross_attention_on_the_gpu_with_weights_and_heatmap() {
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("cross");
    let (o, w, png) = (dir.join("o.npy"), dir.join("w.npy"), dir.join("map.png"));
    let c = "cross_attn_kdim_vdim";
    let r = cli(&[
        "mha",
        "--query",
        s(&fixture(c, "query.npy")),
        "--key",
        s(&fixture(c, "key.npy")),
        "--value",
        s(&fixture(c, "value.npy")),
        "--weights",
        s(&fixture(c, "weights.safetensors")),
        "--heads",
        "3",
        "--out",
        s(&o),
        "--weights-out",
        s(&w),
        "--heatmap",
        s(&png),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_npy_matches(&o, &fixture(c, "out.npy"), 3, "cli out");
    assert_npy_matches(&w, &fixture(c, "attn_weights_per_head.npy"), 4, "cli weights");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
}

/// Every tensor of the safetensors file the tool wrote at `got` (f32) against the f64
/// PyTorch autograd golden `want`: the same names and shapes, and values within
/// 1e-4 · max|golden| (f32 arithmetic; the GPU's accuracy is checked in tests/mha_backward.rs).
fn assert_grads_match(got: &Path, want: &Path, label: &str) {
    let got_bytes = std::fs::read(got).unwrap();
    let want_bytes = std::fs::read(want).unwrap();
    let got = safetensors::SafeTensors::deserialize(&got_bytes).unwrap();
    let want = safetensors::SafeTensors::deserialize(&want_bytes).unwrap();
    let mut names = got.names();
    let mut want_names = want.names();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names, "{label}: gradient names");
    for name in names {
        let (g, w) = (got.tensor(name).unwrap(), want.tensor(name).unwrap());
        assert_eq!(g.dtype(), safetensors::Dtype::F32, "{label}: {name}");
        assert_eq!(g.shape(), w.shape(), "{label}: {name} shape");
        let g: Vec<f32> = g
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let w: Vec<f64> = w
            .data()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let max = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let tol = wgpu_attention::check::Tolerance {
            atol: 1e-4 * max + 1e-6,
            rtol: 0.0,
        };
        common::assert_report(
            compare(g.iter().copied(), w.iter().copied(), tol),
            &format!("{label}: {name}"),
        );
    }
}

/// `mha --dout --grads-out`: the gradients of a cross-attention layer with separate q/k/v
/// projection weights (GPU) and of a self-attention layer with a key padding mask and a packed
/// `in_proj_weight` (CPU reference), named as PyTorch names them, against PyTorch autograd.
#[test]
fn mha_gradients_to_safetensors() {
    let dir = out_dir("grads");
    for (c, heads, cross, cpu) in [
        ("cross_attn_kdim_vdim", "3", true, false),
        ("key_padding", "2", false, true),
    ] {
        if !cpu && common::ctx().is_none() {
            continue;
        }
        let (o, g) = (
            dir.join(format!("{c}-o.npy")),
            dir.join(format!("{c}-g.safetensors")),
        );
        let (q, k, v, w, dy, kpm) = (
            fixture(c, "query.npy"),
            fixture(c, "key.npy"),
            fixture(c, "value.npy"),
            fixture(c, "weights.safetensors"),
            fixture(c, "dout.npy"),
            fixture(c, "key_padding_mask.npy"),
        );
        let mut args = vec!["mha", "--query", s(&q), "--weights", s(&w), "--heads", heads];
        if cross {
            args.extend(["--key", s(&k), "--value", s(&v)]);
        } else {
            args.extend(["--key-padding-mask", s(&kpm), "--torch-masks"]);
        }
        if cpu {
            args.push("--cpu");
        }
        args.extend(["--out", s(&o), "--dout", s(&dy), "--grads-out", s(&g)]);
        let r = cli(&args);
        assert!(r.status.success(), "{c}: {}", String::from_utf8_lossy(&r.stderr));
        assert_npy_matches(&o, &fixture(c, "out.npy"), 3, c);
        assert_grads_match(&g, &fixture(c, "grads.safetensors"), c);
    }
    // --dout without --grads-out is refused.
    let r = cli(&[
        "mha",
        "--query",
        "q.npy",
        "--weights",
        "w.st",
        "--heads",
        "2",
        "--out",
        "o.npy",
        "--dout",
        "d.npy",
    ]);
    assert_eq!(r.status.code(), Some(2));
}

#[test]
fn mha_key_padding_in_pytorch_convention_on_the_cpu_reference() {
    let dir = out_dir("kpm");
    let (o, w) = (dir.join("o.npy"), dir.join("w.npy"));
    let c = "key_padding";
    let r = cli(&[
        "mha",
        "--query",
        s(&fixture(c, "query.npy")),
        "--weights",
        s(&fixture(c, "weights.safetensors")),
        "--heads",
        "2",
        "--key-padding-mask",
        s(&fixture(c, "key_padding_mask.npy")),
        "--torch-masks",
        "--out",
        s(&o),
        "--weights-out",
        s(&w),
        "--average-weights",
        "--cpu",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_npy_matches(&o, &fixture(c, "out.npy"), 3, "cli cpu out");
    assert_npy_matches(&w, &fixture(c, "attn_weights_avg.npy"), 3, "cli avg weights");
}

#[test]
fn mha_errors_exit_with_status_2_and_a_message() {
    let dir = out_dir("err");
    let o = dir.join("o.npy");
    let c = "self_attn";
    let run = |heads: &str, weights: &Path| {
        cli(&[
            "mha",
            "--query",
            s(&fixture(c, "query.npy")),
            "--weights",
            s(weights),
            "--heads",
            heads,
            "--out",
            s(&o),
            "--cpu",
        ])
    };
    let r = run("5", &fixture(c, "weights.safetensors"));
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("does not divide"));
    let r = run("4", &fixture(c, "no-such.safetensors"));
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("no-such.safetensors"));
    let r = run("4", &fixture(c, "query.npy"));
    assert_eq!(r.status.code(), Some(2));
    assert!(!o.exists());
}

/// A version 1.0 `.npy` file: a header claiming `shape` (a Python tuple literal) of `descr`,
/// padded as numpy pads it, then `data_bytes` zero bytes.
fn npy_with_header(path: &Path, descr: &str, shape: &str, data_bytes: usize) {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + dict.len() + 1;
    let text = format!("{dict}{}\n", " ".repeat(unpadded.next_multiple_of(64) - unpadded));
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend(u16::try_from(text.len()).unwrap().to_le_bytes());
    bytes.extend(text.as_bytes());
    bytes.resize(bytes.len() + data_bytes, 0);
    std::fs::write(path, bytes).unwrap();
}

/// `run --q q --k k --v v` followed by `rest`.
fn run_qkv(q: &Path, k: &Path, v: &Path, rest: &[&str]) -> std::process::Output {
    cli(&[&["run", "--q", s(q), "--k", s(k), "--v", s(v)][..], rest].concat())
}

/// `run` with `q` as --q, --k and --v (it is read first).
fn run_on(q: &Path, out: &Path) -> std::process::Output {
    run_qkv(q, q, q, &["--out", s(out)])
}

#[test]
fn npy_claiming_a_huge_shape_is_an_error_not_an_aborted_allocation() {
    let dir = out_dir("npy-huge");
    let (q, o) = (dir.join("q.npy"), dir.join("o.npy"));
    // 16 PB of f32 claimed, 8 bytes present: ndarray-npy would allocate the claim and abort.
    npy_with_header(&q, "<f4", "(2000000, 2000000, 1000)", 8);
    let r = run_on(&q, &o);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("[2000000, 2000000, 1000]"), "{err}");
    assert!(err.contains("q.npy") && err.contains("8 bytes"), "{err}");
    assert!(!err.contains("memory allocation"), "{err}");
    assert!(!o.exists());
}

#[test]
fn npy_with_fewer_data_bytes_than_its_shape_needs_is_an_error() {
    let dir = out_dir("npy-short");
    let (q, o) = (dir.join("q.npy"), dir.join("o.npy"));
    npy_with_header(&q, "<f4", "(4, 4)", 8);
    let r = run_on(&q, &o);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("[4, 4]") && err.contains("64 bytes") && err.contains("8 bytes"),
        "{err}"
    );
    assert!(!o.exists());
}

/// Output paths that cannot be written (a missing folder, a folder, a read-only file) fail
/// at once, before any input is read or anything computed, naming the flag and the path.
#[test]
fn unwritable_outputs_fail_before_computing() {
    let dir = out_dir("unwritable");
    let [q, k, v] = decode_inputs(&dir);
    let missing = dir.join("no-such-folder").join("o.npy");
    let readonly = dir.join("readonly.npy");
    std::fs::write(&readonly, b"x").unwrap();
    let mut perms = std::fs::metadata(&readonly).unwrap().permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(&readonly, perms).unwrap();
    // Root writes read-only files anyway: that case is checked only where it is refused.
    let readonly_refused = std::fs::OpenOptions::new().append(true).open(&readonly).is_err();
    let good = dir.join("o.npy");
    let mut cases = vec![
        (vec!["--out", s(&missing)], "--out", s(&missing).to_string()),
        (vec!["--out", s(&dir)], "--out", s(&dir).to_string()),
        (
            vec!["--out", s(&good), "--lse-out", s(&missing)],
            "--lse-out",
            s(&missing).to_string(),
        ),
    ];
    if readonly_refused {
        cases.push((vec!["--out", s(&readonly)], "--out", s(&readonly).to_string()));
    }
    for (rest, flag, path) in cases {
        // A q that cannot be read: the output check must come first to be the error reported.
        let r = run_qkv(&dir.join("absent-q.npy"), &k, &v, &rest);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{err}");
        assert!(
            err.contains(flag) && err.contains(&path) && err.contains("before computing"),
            "{err}"
        );
        assert!(!good.exists(), "a checked output was left behind");
    }
    let r = run_qkv(&q, &k, &v, &["--out", s(&good)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

/// Decode-shaped inputs (one query row, 512 keys) in `dir`: the paths of q, k and v.
fn decode_inputs(dir: &Path) -> [PathBuf; 3] {
    let names = ["q.npy", "k.npy", "v.npy"].map(|n| dir.join(n));
    let fill =
        |shape: [usize; 4]| Array4::from_shape_fn(shape, |(_, _, i, j)| ((i * 7 + j) % 5) as f32 * 0.1);
    write_npy(&names[0], &fill([1, 2, 1, 8])).unwrap();
    write_npy(&names[1], &fill([1, 2, 512, 8])).unwrap();
    write_npy(&names[2], &fill([1, 2, 512, 8])).unwrap();
    names
}

/// `--path decode` runs the decode path and says so ("path decode"); `--path auto` on the
/// same inputs resolves to it and says "path auto -> decode", which is what `--path decode`
/// printed when the CLI mapped "decode" to auto.
#[test]
fn run_path_decode_runs_the_decode_path() {
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("run-decode");
    let [q, k, v] = decode_inputs(&dir);
    let o = dir.join("o.npy");
    let run = |path: &str| {
        let r = run_qkv(&q, &k, &v, &["--path", path, "--out", s(&o)]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stdout).into_owned()
    };
    let out = run("decode");
    assert!(out.contains(", path decode, storage f32, in "), "{out}");
    let out = run("auto");
    assert!(out.contains(", path auto -> decode, storage f32, in "), "{out}");
}

/// `bench --paths decode` times the decode path: its row is labelled `decode` (the requested
/// path), not `auto`.
#[test]
fn bench_paths_decode_times_the_decode_path() {
    if common::ctx().is_none() {
        return;
    }
    let r = cli(&[
        "bench",
        "--paths",
        "decode",
        "--shapes",
        "small_h4_s128",
        "--iters",
        "1",
    ]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{out}{}", String::from_utf8_lossy(&r.stderr));
    let rows: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| l.starts_with("small_h4_s128 "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0][1], "decode", "{out}");
    assert!(!rows[0].contains(&"error:"), "{out}");
}

#[test]
fn unknown_path_names_are_usage_errors() {
    let r = cli(&[
        "run", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy", "--path", "flash",
    ]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("flash"));
    let r = cli(&["bench", "--paths", "fused,flash"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("flash"));
}

/// A little-endian f16 `.npy` (`<f2`) of `a`.
fn write_f16_npy(path: &Path, a: &Array4<f32>) {
    let shape = format!(
        "({})",
        a.shape().iter().map(|d| format!("{d}, ")).collect::<String>()
    );
    let dict = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + dict.len() + 1;
    let text = format!("{dict}{}\n", " ".repeat(unpadded.next_multiple_of(64) - unpadded));
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend(u16::try_from(text.len()).unwrap().to_le_bytes());
    bytes.extend(text.as_bytes());
    for &x in a.iter() {
        bytes.extend(half::f16::from_f32(x).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

/// `run --storage f16|bf16`: f32 inputs rounded to the format, the output rounded to it and
/// written as f32, within the format's tolerance of the f64 reference on the rounded inputs
/// (`--cpu --storage`, which rounds its output too); `<f2` inputs are read as they are.
#[test]
fn run_storage_formats_round_inputs_and_output() {
    use wgpu_attention::Storage;
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("storage");
    let [q, k, v] = ["q.npy", "k.npy", "v.npy"].map(|n| dir.join(n));
    let fill = |shape: [usize; 4], seed: usize| {
        Array4::from_shape_fn(shape, |(a, b, i, j)| {
            (((a + b * 3 + i * 7 + j * 13 + seed) % 17) as f32 - 8.0) * 0.0731
        })
    };
    let (qa, ka, va) = (
        fill([1, 2, 5, 6], 1),
        fill([1, 2, 9, 6], 2),
        fill([1, 2, 9, 7], 3),
    );
    write_npy(&q, &qa).unwrap();
    write_npy(&k, &ka).unwrap();
    write_npy(&v, &va).unwrap();
    for st in [Storage::F16, Storage::Bf16] {
        let (o, oc) = (dir.join(format!("o-{st}.npy")), dir.join(format!("oc-{st}.npy")));
        let base = ["--causal", "bottom-right", "--storage", st.name()];
        let r = run_qkv(&q, &k, &v, &[&base[..], &["--out", s(&o)]].concat());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        assert!(String::from_utf8_lossy(&r.stdout).contains(&format!("storage {st}")));
        let r = run_qkv(&q, &k, &v, &[&base[..], &["--cpu", "--out", s(&oc)]].concat());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let got: ArrayD<f32> = read_npy(&o).unwrap();
        let want: ArrayD<f32> = read_npy(&oc).unwrap();
        assert!(
            got.iter().all(|&x| st.round(x) == x),
            "{st}: output not rounded to the format"
        );
        common::assert_report(
            compare(
                got.iter().copied(),
                want.iter().copied(),
                wgpu_attention::check::Tolerance::for_storage(st),
            ),
            &format!("run --storage {st}"),
        );
    }
    // f16 .npy inputs: the same values as the f32 ones rounded to f16.
    let [qh, kh, vh] = ["qh.npy", "kh.npy", "vh.npy"].map(|n| dir.join(n));
    write_f16_npy(&qh, &qa);
    write_f16_npy(&kh, &ka);
    write_f16_npy(&vh, &va);
    let (o1, o2) = (dir.join("o1.npy"), dir.join("o2.npy"));
    let r = run_qkv(&qh, &kh, &vh, &["--storage", "f16", "--out", s(&o1)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = run_qkv(&q, &k, &v, &["--storage", "f16", "--out", s(&o2)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (a, b): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&o1).unwrap(), read_npy(&o2).unwrap());
    assert_eq!(
        a, b,
        "<f2 inputs and f32 inputs rounded to f16 give the same output"
    );
    // An unknown format is a usage error.
    let r = run_qkv(&q, &k, &v, &["--storage", "f64", "--out", s(&o1)]);
    assert_eq!(r.status.code(), Some(2));
}

/// `mha --storage f16` on a PyTorch fixture: within twice the f16 tolerance of the f64
/// reference on the rounded weights and inputs (`--cpu --storage f16`), output in f16.
#[test]
fn mha_storage_f16_matches_the_rounded_reference() {
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("mha-storage");
    let (o, oc) = (dir.join("o.npy"), dir.join("oc.npy"));
    let c = "self_attn";
    let (w, x) = (fixture(c, "weights.safetensors"), fixture(c, "query.npy"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(c, "meta.json")).unwrap()).unwrap();
    let heads = meta["num_heads"].to_string();
    let base = [
        "mha",
        "--query",
        s(&x),
        "--weights",
        s(&w),
        "--heads",
        &heads,
        "--storage",
        "f16",
    ];
    let r = cli(&[&base[..], &["--out", s(&o)]].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = cli(&[&base[..], &["--cpu", "--out", s(&oc)]].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got: ArrayD<f32> = read_npy(&o).unwrap();
    let want: ArrayD<f32> = read_npy(&oc).unwrap();
    let st = wgpu_attention::Storage::F16;
    assert!(got.iter().all(|&x| st.round(x) == x));
    let tol = common::twice_storage_tolerance(st);
    common::assert_report(
        compare(got.iter().copied(), want.iter().copied(), tol),
        "mha --storage f16",
    );
}

/// `backward` with `--q --k --v --dout` from `inputs` and `--dq-out --dk-out --dv-out` to `outs`.
fn backward_cli<P: AsRef<Path>>(inputs: &[P], outs: &[PathBuf], rest: &[&str]) -> std::process::Output {
    cli(&[&["backward"][..], &backward_args(inputs, outs, rest)].concat())
}

/// [`backward_cli`]'s arguments after the command.
fn backward_args<'a, P: AsRef<Path>>(inputs: &'a [P], outs: &'a [PathBuf], rest: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![];
    for (flag, p) in ["--q", "--k", "--v", "--dout"].iter().zip(inputs) {
        args.extend([*flag, s(p.as_ref())]);
    }
    for (flag, p) in ["--dq-out", "--dk-out", "--dv-out"].iter().zip(outs) {
        args.extend([*flag, s(p)]);
    }
    args.extend(rest);
    args
}

/// The tool as `np` MPI ranks (`mpirun --oversubscribe`, allowed as root), under a time limit.
#[cfg(feature = "mpi")]
fn mpirun(np: usize, command: &str, args: &[&str]) -> std::process::Output {
    Command::new("timeout")
        .args([
            "-s",
            "INT",
            "300",
            "mpirun",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .arg(env!("CARGO_BIN_EXE_wgpu-attention"))
        .arg(command)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap()
}

#[cfg(not(feature = "mpi"))]
fn mpirun(_: usize, _: &str, _: &[&str]) -> std::process::Output {
    unreachable!("--mpi needs the mpi feature")
}

/// `run --devices N` (and, built with the feature, `run --mpi` under mpirun) write the same
/// output, logsumexp and weights as one device, with GQA, a mask, causal bottom-right and key
/// lengths; a ring longer than the sequence is an error (status 2).
#[test]
fn run_on_a_ring_matches_one_device() {
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("ring");
    let mut r = common::rng(31);
    let q = common::rand_array(&mut r, (2, 4, 45, 16));
    let k = common::rand_array(&mut r, (2, 2, 37, 16));
    let v = common::rand_array(&mut r, (2, 2, 37, 8));
    let mask = ArrayD::from_shape_fn(ndarray::IxDyn(&[2, 1, 45, 37]), |ix| {
        (ix[2] * 7 + ix[3] * 3 + ix[0]) % 4 != 0
    });
    let files = ["q", "k", "v", "m"].map(|n| dir.join(format!("{n}.npy")));
    write_npy(&files[0], &q).unwrap();
    write_npy(&files[1], &k).unwrap();
    write_npy(&files[2], &v).unwrap();
    write_npy(&files[3], &mask).unwrap();
    let run = |tag: &str, extra: &[&str], mpi: usize| {
        let outs = ["o", "lse", "w"].map(|n| dir.join(format!("{tag}_{n}.npy")));
        let mut args = vec![];
        for (flag, p) in ["--q", "--k", "--v", "--mask"].iter().zip(&files) {
            args.extend([*flag, s(p)]);
        }
        for (flag, p) in ["--out", "--lse-out", "--weights-out"].iter().zip(&outs) {
            args.extend([*flag, s(p)]);
        }
        // Equal key lengths: bottom-right causal aligns each batch to its own length, and the
        // ring takes one diagonal for all batches (unequal lengths are refused, tests/ring.rs).
        args.extend(["--causal", "bottom-right", "--kv-lens", "30,30"]);
        args.extend(extra);
        let res = if mpi > 0 {
            mpirun(mpi, "run", &args)
        } else {
            cli(&[&["run"][..], &args].concat())
        };
        assert!(
            res.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&res.stderr)
        );
        outs.map(|p| read_npy::<_, ArrayD<f32>>(p).unwrap())
    };
    let one = run("one", &["--path", "unfused"], 0);
    let mut rings = vec![
        (
            "devices 3",
            run("dev3", &["--devices", "3", "--path", "unfused"], 0),
        ),
        (
            "devices 4 contiguous",
            run(
                "dev4",
                &["--devices", "4", "--path", "unfused", "--layout", "contiguous"],
                0,
            ),
        ),
    ];
    #[cfg(feature = "mpi")]
    rings.push(("mpi 3", run("mpi3", &["--mpi", "--path", "unfused"], 3)));
    for (label, got) in rings.drain(..) {
        for (name, (g, w)) in ["output", "lse", "weights"].iter().zip(got.iter().zip(&one)) {
            assert_eq!(g.shape(), w.shape(), "{label} {name}");
            common::assert_report(
                compare(g.iter().copied(), w.iter().copied(), common::TOL),
                &format!("{label} {name}"),
            );
        }
    }
    let res = cli(&[
        "run",
        "--q",
        s(&files[0]),
        "--k",
        s(&files[1]),
        "--v",
        s(&files[2]),
        "--out",
        s(&dir.join("x.npy")),
        "--devices",
        "50",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(err.contains("more devices than sequence positions"), "{err}");
}

/// `backward` on .npy files: the GPU's gradients (fused and unfused, with a mask, a broadcast
/// bias, key lengths, causal and GQA) match the f64 reference computed in the test, and
/// `--cpu` writes the reference's; bad input exits with status 2.
#[test]
fn backward_writes_gradients_matching_the_reference() {
    if common::ctx().is_none() {
        return;
    }
    let dir = out_dir("backward");
    let mut r = common::rng(21);
    let (q, k, v) = (
        common::rand_array(&mut r, (2, 4, 7, 8)),
        common::rand_array(&mut r, (2, 2, 9, 8)),
        common::rand_array(&mut r, (2, 2, 9, 6)),
    );
    let dout = common::rand_array(&mut r, (2, 4, 7, 6));
    let bias = common::rand_array(&mut r, ndarray::IxDyn(&[4, 1, 9]));
    let mask = ArrayD::from_shape_fn(ndarray::IxDyn(&[7, 9]), |ix| (ix[0] + 2 * ix[1]) % 5 != 0);
    let files = ["q", "k", "v", "dout", "bias", "mask"].map(|n| dir.join(format!("{n}.npy")));
    for (file, x) in files[..4].iter().zip([&q, &k, &v, &dout]) {
        write_npy(file, x).unwrap();
    }
    write_npy(&files[4], &bias).unwrap();
    write_npy(&files[5], &mask).unwrap();
    let opts = wgpu_attention::Options {
        causal: wgpu_attention::Causal::BottomRight,
        mask: Some((&mask).into()),
        bias: Some((&bias).into()),
        // Equal lengths, as the ring needs under bottom-right causal (see the forward's test).
        kv_lens: Some(vec![9, 9]),
        ..Default::default()
    };
    let want =
        wgpu_attention::reference::sdpa_backward(q.view(), k.view(), v.view(), dout.view(), &opts).unwrap();
    let outs = ["dq", "dk", "dv", "db"].map(|n| dir.join(format!("{n}.npy")));
    for how in [
        &["--path", "fused"][..],
        &["--path", "unfused"],
        &["--cpu"],
        &["--devices", "3"],
        &["--devices", "2", "--path", "unfused", "--layout", "contiguous"],
    ] {
        let rest = [
            &["--bias", s(&files[4]), "--mask", s(&files[5])][..],
            &[
                "--kv-lens",
                "9,9",
                "--causal",
                "bottom-right",
                "--dbias-out",
                s(&outs[3]),
            ],
            how,
        ]
        .concat();
        let res = backward_cli(&files[..4], &outs[..3], &rest);
        #[cfg(feature = "mpi")]
        if how == ["--devices", "3"] {
            // The same as 2 MPI ranks: rank 0 writes the gradients.
            let _ = std::fs::remove_file(&outs[0]);
            let res = mpirun(
                2,
                "backward",
                &backward_args(
                    &files[..4],
                    &outs[..3],
                    &[&rest[..rest.len() - 2], &["--mpi"]].concat(),
                ),
            );
            assert!(
                res.status.success(),
                "--mpi: {}",
                String::from_utf8_lossy(&res.stderr)
            );
        }
        assert!(
            res.status.success(),
            "{how:?}: {}",
            String::from_utf8_lossy(&res.stderr)
        );
        for (file, w) in outs.iter().zip([
            want.dq.view().into_dyn(),
            want.dk.view().into_dyn(),
            want.dv.view().into_dyn(),
            want.dbias.as_ref().unwrap().view(),
        ]) {
            let got: ArrayD<f32> = read_npy(file).unwrap();
            assert_eq!(got.shape(), w.shape(), "{how:?} {file:?}");
            let max = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let tol = wgpu_attention::check::Tolerance {
                atol: 1e-5 * max + 1e-5,
                rtol: 1e-4,
            };
            common::assert_report(
                compare(got.iter().copied(), w.iter().copied(), tol),
                &format!("{how:?} {file:?}"),
            );
        }
    }
    // A dO of the wrong shape: status 2 and a message naming it.
    let res = backward_cli(&[&files[0], &files[1], &files[2], &files[0]], &outs[..3], &[]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.code() == Some(2) && err.contains("dout"), "{err}");
}

/// The `variant` arguments of the golden in `d` (its `meta.json` read into `meta`): inputs,
/// parameters, masks, key lengths, causal, scale, landmarks; the output to `out` and the
/// weights to `weights_out`.
fn variant_args(d: &Path, meta: &serde_json::Value, out: &Path, weights_out: Option<&Path>) -> Vec<String> {
    let kind = meta["kind"].as_str().unwrap().to_string();
    let mut args: Vec<String> = vec!["variant".into(), "--kind".into(), kind];
    for f in ["q", "k", "v"] {
        args.push(format!("--{f}"));
        args.push(s(&d.join(format!("{f}.npy"))).into());
    }
    for (flag, file) in [
        ("--params", "params.safetensors"),
        ("--mask", "mask.npy"),
        ("--bias", "bias.npy"),
    ] {
        if d.join(file).exists() {
            args.push(flag.into());
            args.push(s(&d.join(file)).into());
        }
    }
    if d.join("kv_lens.npy").exists() {
        let lens: ndarray::Array1<i64> = read_npy(d.join("kv_lens.npy")).unwrap();
        args.push("--kv-lens".into());
        args.push(lens.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(","));
    }
    args.push("--causal".into());
    args.push(meta["causal"].as_str().unwrap().replace('_', "-"));
    if let Some(sc) = meta["scale"].as_f64() {
        args.push(format!("--scale={sc}"));
    }
    if let Some(m) = meta["landmarks"].as_u64() {
        args.extend(["--landmarks".into(), m.to_string()]);
        args.extend([
            "--pinv-iters".into(),
            meta["pinv_iters"].as_u64().unwrap().to_string(),
        ]);
    }
    args.extend(["--out".into(), s(out).into()]);
    if let Some(w) = weights_out {
        args.extend(["--weights-out".into(), s(w).into()]);
    }
    args
}

/// `variant`: every kind on its PyTorch golden (GPU, and the CPU reference for one), with the
/// golden's masks, parameters and weights; refused options exit 2 with a one-line reason.
#[test]
fn variant_kinds_match_their_goldens() {
    if common::ctx().is_none() {
        return;
    }
    let root = fixtures().join("variants");
    let dir = out_dir("variant");
    for (case, cpu) in [
        ("general_masks_gqa", false),
        ("additive_masks", false),
        ("additive_basic", true),
        ("lowrank_v_causal_gqa", false),
        ("nystrom_uneven", false),
        ("linformer_gqa", false),
    ] {
        let d = root.join(case);
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("meta.json")).unwrap()).unwrap();
        let kind = meta["kind"].as_str().unwrap().to_string();
        let out = dir.join(format!("{case}_out.npy"));
        let w = dir.join(format!("{case}_w.npy"));
        let has_weights = d.join("weights.npy").exists();
        let mut args = variant_args(&d, &meta, &out, has_weights.then_some(w.as_path()));
        if cpu {
            args.push("--cpu".into());
        }
        let argv: Vec<&str> = args.iter().map(|a| a.as_str()).collect();
        let r = cli(&argv);
        assert!(
            r.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        if kind == "nystrom" {
            let got: ArrayD<f32> = read_npy(&out).unwrap();
            let want: ArrayD<f64> = read_npy(d.join("out.npy")).unwrap();
            let tol = common::nystrom_tolerance(&want);
            common::assert_report(compare(got.iter().copied(), want.iter().copied(), tol), case);
        } else {
            assert_npy_matches(&out, &d.join("out.npy"), 4, case);
        }
        if has_weights {
            assert_npy_matches(&w, &d.join("weights.npy"), 4, &format!("{case} weights"));
        }
    }
    // Refused: a mask for Nyström, landmarks out of range, a kind without its parameters.
    let nys = root.join("nystrom_basic");
    let q = nys.join("q.npy");
    let (k, v) = (nys.join("k.npy"), nys.join("v.npy"));
    let out = dir.join("refused.npy");
    for (extra, needle) in [
        (vec!["--kind", "nystrom", "--causal", "top-left"], "causal"),
        (vec!["--kind", "nystrom", "--landmarks", "0"], "landmarks"),
        (vec!["--kind", "linformer"], "--params"),
    ] {
        let mut argv = vec![
            "variant",
            "--q",
            s(&q),
            "--k",
            s(&k),
            "--v",
            s(&v),
            "--out",
            s(&out),
        ];
        argv.extend(extra);
        let r = cli(&argv);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{argv:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

/// `mha --heatmap --tokens` (CPU reference): the words label the picture (it differs from the
/// unlabelled one and is wider); a word count that is not L, or a `--key-tokens` count that is
/// not S, exits with status 2 and a one-line reason before anything is written.
#[test]
fn mha_heatmap_with_tokens_and_wrong_token_counts() {
    let dir = out_dir("tokens");
    let (self_c, cross_c) = ("self_attn", "cross_attn_kdim_vdim"); // L = S = 9; L = 7, S = 11
    let mha = |c: &str, heads: &str, out: &Path, extra: &[&str]| {
        let (q, k, v, w) = (
            fixture(c, "query.npy"),
            fixture(c, "key.npy"),
            fixture(c, "value.npy"),
            fixture(c, "weights.safetensors"),
        );
        let mut args = vec!["mha", "--query", s(&q), "--weights", s(&w), "--heads", heads];
        if c == cross_c {
            args.extend(["--key", s(&k), "--value", s(&v)]);
        }
        args.extend(["--cpu", "--out", s(out)]);
        args.extend(extra);
        cli(&args)
    };
    let size = |p: &Path| {
        let reader = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(p).unwrap()))
            .read_info()
            .unwrap();
        (reader.info().width, reader.info().height)
    };
    let (plain, words) = (dir.join("plain.png"), dir.join("words.png"));
    let sentence = "the quick brown fox jumps over the lazy dog";
    let r = mha(self_c, "4", &dir.join("o1.npy"), &["--heatmap", s(&plain)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = mha(
        self_c,
        "4",
        &dir.join("o2.npy"),
        &["--heatmap", s(&words), "--tokens", sentence],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_ne!(std::fs::read(&plain).unwrap(), std::fs::read(&words).unwrap());
    assert!(
        size(&words).0 > size(&plain).0,
        "{:?} {:?}",
        size(&words),
        size(&plain)
    );
    // Cross-attention: query words and key words of their own lengths, averaged weights.
    let cross = dir.join("cross.png");
    let r = mha(
        cross_c,
        "3",
        &dir.join("o3.npy"),
        &[
            "--heatmap",
            s(&cross),
            "--average-weights",
            "--tokens",
            "a b c d e f g",
            "--key-tokens",
            "k0 k1 k2 k3 k4 k5 k6 k7 k8 k9 k10",
        ],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(cross.exists());

    // Wrong counts: one line naming the option, the count and the length; nothing written.
    for (c, heads, extra, want) in [
        (
            self_c,
            "4",
            vec!["--tokens", "the cat sat"],
            "--tokens has 3 words, but the queries have length L = 9",
        ),
        (
            cross_c,
            "3",
            vec!["--tokens", "a b c d e f g h"],
            "--tokens has 8 words, but the queries have length L = 7",
        ),
        (
            cross_c,
            "3",
            vec!["--tokens", "a b c d e f g", "--key-tokens", "k0 k1"],
            "--key-tokens has 2 words, but the keys have length S = 11",
        ),
    ] {
        let (o, map) = (dir.join("bad.npy"), dir.join("bad.png"));
        let r = mha(c, heads, &o, &[&["--heatmap", s(&map)], &extra[..]].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(!o.exists() && !map.exists());
    }
    // --tokens without --heatmap is a usage error.
    let r = mha(self_c, "4", &dir.join("o4.npy"), &["--tokens", sentence]);
    assert_eq!(r.status.code(), Some(2));
}

/// `run --window LEFT,RIGHT --sink-tokens N` on the GPU matches `--cpu` on the same flags;
/// a side below -1, a malformed window and sink tokens without a window are one-line errors
/// with exit status 2 that write nothing.
#[test]
fn run_window_and_sink_tokens() {
    let dir = out_dir("run-window");
    let names = ["q.npy", "k.npy", "v.npy"].map(|n| dir.join(n));
    let fill = |shape: [usize; 4], m: usize| {
        Array4::from_shape_fn(shape, |(_, h, i, j)| {
            ((h * 3 + i * m + j * 5) % 11) as f32 * 0.1 - 0.5
        })
    };
    write_npy(&names[0], &fill([1, 2, 20, 8], 7)).unwrap();
    write_npy(&names[1], &fill([1, 2, 33, 8], 3)).unwrap();
    write_npy(&names[2], &fill([1, 2, 33, 8], 2)).unwrap();
    let [q, k, v] = &names;
    let (gpu, cpu) = (dir.join("gpu.npy"), dir.join("cpu.npy"));
    let flags = [
        "--window",
        "4,-1",
        "--sink-tokens",
        "2",
        "--causal",
        "bottom-right",
    ];
    let r = run_qkv(q, k, v, &[&["--cpu", "--out", s(&cpu)][..], &flags].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    if common::ctx().is_some() {
        let r = run_qkv(q, k, v, &[&["--out", s(&gpu)][..], &flags].concat());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let (g, c): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&gpu).unwrap(), read_npy(&cpu).unwrap());
        common::assert_report(
            compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
            "window gpu vs cpu",
        );
    }
    for bad in [
        &["--window", "-2,0"][..],
        &["--window", "3"],
        &["--window", "a,1"],
        &["--sink-tokens", "3"],
    ] {
        let o = dir.join("bad.npy");
        let r = run_qkv(q, k, v, &[&["--cpu", "--out", s(&o)][..], bad].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{bad:?}: {err}");
        assert!(!o.exists(), "{bad:?} wrote its output");
        assert!(err.contains("window") || err.contains("sink"), "{bad:?}: {err}");
    }
}

/// `run --softcap C --alibi S0,S1` on the GPU matches the CPU reference (and changes the
/// output); a softcap <= 0, a slope count that is not Hq and a malformed slope are one-line
/// errors with exit status 2 that write nothing.
#[test]
fn run_softcap_and_alibi() {
    let dir = out_dir("run-softcap-alibi");
    let names = ["q.npy", "k.npy", "v.npy"].map(|n| dir.join(n));
    let fill = |shape: [usize; 4], m: usize| {
        Array4::from_shape_fn(shape, |(_, h, i, j)| {
            ((h * 3 + i * m + j * 5) % 11) as f32 * 0.3 - 1.5
        })
    };
    write_npy(&names[0], &fill([1, 2, 20, 8], 7)).unwrap();
    write_npy(&names[1], &fill([1, 2, 33, 8], 3)).unwrap();
    write_npy(&names[2], &fill([1, 2, 33, 8], 2)).unwrap();
    let [q, k, v] = &names;
    let (gpu, cpu, plain) = (dir.join("gpu.npy"), dir.join("cpu.npy"), dir.join("plain.npy"));
    let flags = [
        "--softcap",
        "0.7",
        "--alibi",
        "0.25,-0.125",
        "--causal",
        "bottom-right",
    ];
    let r = run_qkv(q, k, v, &[&["--cpu", "--out", s(&cpu)][..], &flags].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = run_qkv(
        q,
        k,
        v,
        &["--cpu", "--out", s(&plain), "--causal", "bottom-right"],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (c, p): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&cpu).unwrap(), read_npy(&plain).unwrap());
    assert!(
        c.iter().zip(p.iter()).any(|(a, b)| (a - b).abs() > 1e-2),
        "the modifiers change the output"
    );
    if common::ctx().is_some() {
        let r = run_qkv(q, k, v, &[&["--out", s(&gpu)][..], &flags].concat());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let g: ArrayD<f32> = read_npy(&gpu).unwrap();
        common::assert_report(
            compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
            "softcap alibi gpu vs cpu",
        );
    }
    for (bad, word) in [
        (&["--softcap", "0"][..], "softcap"),
        (&["--softcap", "-3"], "softcap"),
        (&["--alibi", "0.5"], "alibi"),
        (&["--alibi", "0.5,0.25,1"], "alibi"),
        (&["--alibi", "0.5,x"], "alibi"),
    ] {
        let o = dir.join("bad.npy");
        let r = run_qkv(q, k, v, &[&["--out", s(&o)][..], bad].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{bad:?}: {err}");
        assert!(!o.exists(), "{bad:?} wrote its output");
        assert!(err.contains(word), "{bad:?}: {err}");
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.contains("XDG_RUNTIME_DIR"))
            .collect();
        assert!(lines.len() <= 2, "{bad:?}: not a short message: {err}");
    }
}

/// `run --sink-logits SK.npy` and `backward --sink-logits SK.npy --dsink-out D.npy` on the GPU
/// match the CPU reference; sink logits of the wrong shape, and --dsink-out without sink
/// logits, exit with status 2 and write nothing.
#[test]
fn sink_logits_and_their_gradient() {
    let dir = out_dir("sink-logits");
    let names = ["q.npy", "k.npy", "v.npy", "dout.npy", "sk.npy", "bad.npy"].map(|n| dir.join(n));
    let fill = |shape: [usize; 4], m: usize| {
        Array4::from_shape_fn(shape, |(_, h, i, j)| {
            ((h * 3 + i * m + j * 5) % 11) as f32 * 0.2 - 1.0
        })
    };
    write_npy(&names[0], &fill([1, 3, 9, 8], 7)).unwrap();
    write_npy(&names[1], &fill([1, 3, 13, 8], 3)).unwrap();
    write_npy(&names[2], &fill([1, 3, 13, 4], 2)).unwrap();
    write_npy(&names[3], &fill([1, 3, 9, 4], 5)).unwrap();
    write_npy(&names[4], &ndarray::arr1(&[0.5f32, -1.0, 2.0])).unwrap();
    write_npy(&names[5], &ndarray::arr1(&[0.5f32, -1.0])).unwrap();
    let [q, k, v, dout, sk, bad] = &names;
    let (gpu, cpu) = (dir.join("gpu.npy"), dir.join("cpu.npy"));
    let flags = ["--sink-logits", s(sk), "--causal", "bottom-right"];
    let r = run_qkv(q, k, v, &[&["--cpu", "--out", s(&cpu)][..], &flags].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let grads = |tag: &str, cpu_flag: bool| {
        let outs = ["dq", "dk", "dv", "dsink"].map(|n| dir.join(format!("{tag}-{n}.npy")));
        let mut args = vec![
            "backward",
            "--q",
            s(q),
            "--k",
            s(k),
            "--v",
            s(v),
            "--dout",
            s(dout),
            "--dq-out",
            s(&outs[0]),
            "--dk-out",
            s(&outs[1]),
            "--dv-out",
            s(&outs[2]),
            "--dsink-out",
            s(&outs[3]),
        ];
        args.extend(flags);
        if cpu_flag {
            args.push("--cpu");
        }
        let r = cli(&args);
        assert!(
            r.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let d: ArrayD<f32> = read_npy(&outs[3]).unwrap();
        assert_eq!(d.shape(), &[3]);
        d
    };
    let dcpu = grads("cpu", true);
    assert!(dcpu.iter().any(|&x| x.abs() > 1e-3), "{dcpu:?}");
    if common::ctx().is_some() {
        let r = run_qkv(q, k, v, &[&["--out", s(&gpu)][..], &flags].concat());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let (g, c): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&gpu).unwrap(), read_npy(&cpu).unwrap());
        common::assert_report(
            compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
            "sink logits gpu vs cpu",
        );
        let dgpu = grads("gpu", false);
        common::assert_report(
            compare(dgpu.iter().copied(), dcpu.iter().map(|&x| x as f64), common::TOL),
            "dsink gpu vs cpu",
        );
    }
    let o = dir.join("bad-out.npy");
    let r = run_qkv(q, k, v, &["--cpu", "--out", s(&o), "--sink-logits", s(bad)]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("sink logits") && err.contains("[3]"), "{err}");
    assert!(!o.exists());
    let r = cli(&[
        "backward",
        "--q",
        s(q),
        "--k",
        s(k),
        "--v",
        s(v),
        "--dout",
        s(dout),
        "--dq-out",
        s(&o),
        "--dk-out",
        s(&o),
        "--dv-out",
        s(&o),
        "--dsink-out",
        s(&o),
        "--cpu",
    ]);
    assert_eq!(r.status.code(), Some(2), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(!o.exists());
}

/// `--doc-ids QD.npy,KD.npy` (int32 and int64 files) on `run` and `backward`: the GPU against
/// the CPU reference, the documents changing the result; misshapen ids, a float file and one
/// file only exit 2 and write nothing.
#[test]
fn doc_ids_on_run_and_backward() {
    let dir = out_dir("doc-ids");
    let p = |n: &str| dir.join(n);
    let fill = |shape: [usize; 4], m: usize| {
        Array4::from_shape_fn(shape, |(b, h, i, j)| {
            ((b * 7 + h * 3 + i * m + j * 5) % 11) as f32 * 0.2 - 1.0
        })
    };
    let (q, k, v, dout) = (p("q.npy"), p("k.npy"), p("v.npy"), p("dout.npy"));
    write_npy(&q, &fill([2, 2, 9, 8], 7)).unwrap();
    write_npy(&k, &fill([2, 2, 13, 8], 3)).unwrap();
    write_npy(&v, &fill([2, 2, 13, 4], 2)).unwrap();
    write_npy(&dout, &fill([2, 2, 9, 4], 5)).unwrap();
    // Queries in documents 0..3 (document 3 has no key: fully masked rows), keys 0..2.
    let qd = ndarray::Array2::from_shape_fn((2, 9), |(b, i)| ((i + b) / 3) as i32 % 4);
    let kd = ndarray::Array2::from_shape_fn((2, 13), |(b, j)| ((j + 2 * b) / 5) as i64 % 3);
    let (qdp, kdp) = (p("qd.npy"), p("kd.npy"));
    write_npy(&qdp, &qd).unwrap();
    write_npy(&kdp, &kd).unwrap();
    write_npy(p("bad.npy"), &ndarray::Array2::<i32>::zeros((2, 8))).unwrap();
    write_npy(p("float.npy"), &ndarray::Array2::<f32>::zeros((2, 13))).unwrap();
    let ids = format!("{},{}", s(&qdp), s(&kdp));
    let flags = ["--doc-ids", ids.as_str(), "--causal", "bottom-right"];
    let run = |tag: &str, cpu: bool, extra: &[&str]| {
        let out = p(&format!("{tag}.npy"));
        let mut args = vec!["--out", s(&out)];
        args.extend(extra);
        if cpu {
            args.push("--cpu");
        }
        let r = run_qkv(&q, &k, &v, &args);
        assert!(
            r.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        read_npy::<_, ArrayD<f32>>(&out).unwrap()
    };
    let cpu = run("cpu", true, &flags);
    let plain = run("plain", true, &flags[2..]);
    assert!(cpu.iter().zip(&plain).any(|(a, b)| (a - b).abs() > 1e-3));
    // Batch 1's last row is in document 3, which no key has: zero.
    assert!(cpu.slice(ndarray::s![1, .., 7, ..]).iter().any(|&x| x != 0.0));
    assert!(
        cpu.slice(ndarray::s![1, .., 8, ..]).iter().all(|&x| x == 0.0),
        "{cpu:?}"
    );
    let grads = |tag: &str, cpu_flag: bool| {
        let outs = ["dq", "dk", "dv"].map(|n| p(&format!("{tag}-{n}.npy")));
        let mut args = vec![
            "backward",
            "--q",
            s(&q),
            "--k",
            s(&k),
            "--v",
            s(&v),
            "--dout",
            s(&dout),
        ];
        args.extend([
            "--dq-out",
            s(&outs[0]),
            "--dk-out",
            s(&outs[1]),
            "--dv-out",
            s(&outs[2]),
        ]);
        args.extend(flags);
        if cpu_flag {
            args.push("--cpu");
        }
        let r = cli(&args);
        assert!(
            r.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        outs.map(|o| read_npy::<_, ArrayD<f32>>(&o).unwrap())
    };
    let dcpu = grads("cpu", true);
    if common::ctx().is_some() {
        let gpu = run("gpu", false, &flags);
        common::assert_report(
            compare(gpu.iter().copied(), cpu.iter().map(|&x| x as f64), common::TOL),
            "doc ids gpu vs cpu",
        );
        for (g, c) in grads("gpu", false).iter().zip(&dcpu) {
            common::assert_report(
                compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
                "doc ids gradients gpu vs cpu",
            );
        }
    }
    refuse_bad_doc_ids(&dir, [&q, &k, &v], [&qdp, &kdp]);
}

/// The files of the user-function tests in `dir`: q, k, v; a source with a relative-position
/// score_mod (and its derivatives) and a mask_mod; its capture `rel`; and the same as a bias
/// and a boolean mask for the built-in options.
struct UserModFiles {
    p: Box<dyn Fn(&str) -> std::path::PathBuf>,
    q: std::path::PathBuf,
    k: std::path::PathBuf,
    v: std::path::PathBuf,
    modf: std::path::PathBuf,
    relf: std::path::PathBuf,
    biasf: std::path::PathBuf,
    maskf: std::path::PathBuf,
    capture: String,
    /// L, S.
    dims: [usize; 2],
}

fn user_mod_files(name: &str) -> UserModFiles {
    let dir = out_dir(name);
    let p = move |n: &str| dir.join(n);
    let fill = user_mod_fill;
    let (q, k, v) = (p("q.npy"), p("k.npy"), p("v.npy"));
    let (l, sl) = (9, 13);
    write_npy(&q, &fill([1, 2, l, 8], 7)).unwrap();
    write_npy(&k, &fill([1, 2, sl, 8], 3)).unwrap();
    write_npy(&v, &fill([1, 2, sl, 4], 2)).unwrap();
    // rel[h, d + 4] for the distance d = j - i clamped to [-4, 4].
    let table = ndarray::Array2::from_shape_fn((2, 9), |(h, d)| (h as f32 - 0.5) * 0.3 * d as f32 - 0.4);
    write_npy(p("rel.npy"), &table).unwrap();
    std::fs::write(
        p("mod.wgsl"),
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n\
         \x20   let d = clamp(i32(j) - i32(i), -4, 4) + 4;\n\
         \x20   return s + rel(h * 9u + u32(d));\n\
         }\n\
         fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n\
         fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {\n\
         \x20   d_rel(h * 9u + u32(clamp(i32(j) - i32(i), -4, 4) + 4), g);\n\
         }\n\
         fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return (i + j) % 3u != 0u; }\n",
    )
    .unwrap();
    let bias = ndarray::Array4::from_shape_fn((1, 2, l, sl), |(_, h, i, j)| {
        table[[h, ((j as i64 - i as i64).clamp(-4, 4) + 4) as usize]]
    });
    let mask = ndarray::Array4::from_shape_fn((1, 1, l, sl), |(_, _, i, j)| (i + j) % 3 != 0);
    write_npy(p("bias.npy"), &bias).unwrap();
    write_npy(p("mask.npy"), &mask).unwrap();
    let [modf, relf, biasf, maskf] = ["mod.wgsl", "rel.npy", "bias.npy", "mask.npy"].map(&p);
    let capture = format!("rel={}", s(&relf));
    UserModFiles {
        q,
        k,
        v,
        modf,
        relf,
        biasf,
        maskf,
        capture,
        dims: [l, sl],
        p: Box::new(p),
    }
}

/// Deterministic inputs of `shape`.
fn user_mod_fill(shape: [usize; 4], m: usize) -> Array4<f32> {
    Array4::from_shape_fn(shape, |(b, h, i, j)| {
        ((b * 7 + h * 3 + i * m + j * 5) % 11) as f32 * 0.2 - 1.0
    })
}

/// `run` with misshapen key or query ids, a float ids file, or one file only: one line, exit
/// status 2, nothing written (`dir` holds `bad.npy` `[2, 8]` int32 and `float.npy` f32).
fn refuse_bad_doc_ids(dir: &Path, [q, k, v]: [&Path; 3], [qdp, kdp]: [&Path; 2]) {
    let p = |n: &str| dir.join(n);
    let o = p("bad-out.npy");
    let bad_ids = [
        format!("{},{}", s(qdp), s(&p("bad.npy"))),
        format!("{},{}", s(&p("bad.npy")), s(kdp)),
        format!("{},{}", s(qdp), s(&p("float.npy"))),
        s(qdp).to_string(),
    ];
    for (bad, want) in bad_ids.iter().zip(["[B, S]", "[B, L]", "int32", "two files"]) {
        let r = run_qkv(q, k, v, &["--out", s(&o), "--doc-ids", bad]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains(want) && err.lines().count() == 1, "{bad}: {err}");
        assert!(!o.exists());
    }
}

/// `--mod F.wgsl` with `--capture NAME=X.npy` on `run`: a relative-position bias table read
/// by a `score_mod` and a `mask_mod`, on the GPU, against the same attention written with the
/// built-in options on the CPU (the table's values as a dense bias, the mask as a boolean
/// mask).
#[test]
fn user_mod_and_captures() {
    let f = user_mod_files("user-mod");
    let (p, q, k, v) = (&f.p, &f.q, &f.k, &f.v);
    let (modf, biasf, maskf, capture) = (&f.modf, &f.biasf, &f.maskf, &f.capture);
    let out = p("out.npy");
    let user = ["--mod", s(modf), "--capture", capture.as_str()];
    if common::ctx().is_none() {
        return;
    }
    let r = run_qkv(q, k, v, &[&["--out", s(&out)][..], &user].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let want = p("want.npy");
    let r = run_qkv(
        q,
        k,
        v,
        &["--cpu", "--out", s(&want), "--bias", s(biasf), "--mask", s(maskf)],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (g, c): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&out).unwrap(), read_npy(&want).unwrap());
    common::assert_report(
        compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
        "--mod gpu vs the built-in options on the cpu",
    );
    std::fs::remove_file(&out).unwrap();
}

/// The backward through a user function: d(rel) by `--dcapture-out` equals the CPU's d(bias)
/// of the same bias summed per bucket; a name that is not a capture, or a source without
/// score_mod_dcapture, is one line, exit 2, nothing written.
#[test]
fn user_mod_capture_gradients() {
    let f = user_mod_files("user-mod-backward");
    let (p, q, k, v) = (&f.p, &f.q, &f.k, &f.v);
    let (modf, biasf, maskf, capture) = (&f.modf, &f.biasf, &f.maskf, &f.capture);
    let [l, _] = f.dims;
    let out = p("out.npy");
    let user = ["--mod", s(modf), "--capture", capture.as_str()];
    let _ = &out;
    if common::ctx().is_none() {
        return;
    }
    let fill = user_mod_fill;
    // The backward: d(rel) in rel's shape [2, 9], against the CPU's d(bias) of the same
    // bias summed per bucket.
    let dout = p("dout.npy");
    write_npy(&dout, &fill([1, 2, l, 4], 5)).unwrap();
    let outs = ["dq", "dk", "dv"].map(|n| p(&format!("{n}.npy")));
    let (drel, dbias) = (p("drel.npy"), p("dbias.npy"));
    let dcap = format!("rel={}", s(&drel));
    let r = backward_cli(
        &[q, k, v, &dout],
        &outs,
        &[&user[..], &["--dcapture-out", dcap.as_str()]].concat(),
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = backward_cli(
        &[q, k, v, &dout],
        &outs,
        &[
            "--cpu",
            "--bias",
            s(biasf),
            "--mask",
            s(maskf),
            "--dbias-out",
            s(&dbias),
        ],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (got, db): (ArrayD<f32>, ArrayD<f32>) = (read_npy(&drel).unwrap(), read_npy(&dbias).unwrap());
    assert_eq!(got.shape(), &[2, 9]);
    let mut want = ndarray::Array2::<f64>::zeros((2, 9));
    for ((_, h, i, j), &x) in db.into_dimensionality::<ndarray::Ix4>().unwrap().indexed_iter() {
        want[[h, ((j as i64 - i as i64).clamp(-4, 4) + 4) as usize]] += f64::from(x);
    }
    assert!(want.iter().any(|&x| x.abs() > 1e-3));
    common::assert_report(
        compare(got.iter().copied(), want.iter().copied(), common::TOL),
        "--dcapture-out gpu vs d(bias) per bucket on the cpu",
    );
    // A name that is not a capture, or a source without score_mod_dcapture: exit 2, nothing
    // written.
    std::fs::remove_file(&drel).unwrap();
    std::fs::write(
        p("plain.wgsl"),
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + rel(h); }\n\
         fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n",
    )
    .unwrap();
    let plain = p("plain.wgsl");
    let other = format!("other={}", s(&drel));
    for (args, want) in [
        (vec!["--dcapture-out", other.as_str()], "no --capture other"),
        (vec!["--dcapture-out", "rel"], "NAME=FILE.npy"),
        (
            vec![
                "--mod",
                s(&plain),
                "--capture",
                capture.as_str(),
                "--dcapture-out",
                dcap.as_str(),
            ],
            "score_mod_dcapture",
        ),
    ] {
        let outs = ["dq", "dk", "dv"].map(|n| p(&format!("bad-{n}.npy")));
        let extra: &[&str] = if args[0] == "--mod" { &[] } else { &user };
        let r = backward_cli(&[q, k, v, &dout], &outs, &[extra, &args[..]].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(want) && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(!drel.exists() && !outs[0].exists(), "{args:?}");
    }
}

/// A source naga rejects, a capture the source does not use, `--cpu` with `--mod`, a capture
/// without its file: one line, exit 2, nothing written.
#[test]
fn user_mod_mistakes_are_one_line() {
    let f = user_mod_files("user-mod-mistakes");
    let (p, q, k, v) = (&f.p, &f.q, &f.k, &f.v);
    let (modf, relf, capture) = (&f.modf, &f.relf, &f.capture);
    let out = p("out.npy");
    let badf = p("bad.wgsl");
    std::fs::write(
        &badf,
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {\n    return s + nope;\n}\n",
    )
    .unwrap();
    let bad_capture = format!("other={}", s(relf));
    for (args, want) in [
        (vec!["--mod", s(&badf)], "line 2"),
        (
            vec![
                "--mod",
                s(modf),
                "--capture",
                capture.as_str(),
                "--capture",
                bad_capture.as_str(),
            ],
            "unknown",
        ),
        (
            vec!["--mod", s(modf), "--capture", capture.as_str(), "--cpu"],
            "--cpu",
        ),
        (vec!["--mod", s(modf), "--capture", "rel"], "NAME=X.npy"),
    ] {
        let r = run_qkv(q, k, v, &[&["--out", s(&out)][..], &args].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(want) && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(!out.exists());
    }
}

/// The `paged` tests' files in a directory of their own: q `[4, 4, 8]` (3 prefill queries, 1
/// decode), caches of 6 blocks of 4 tokens (2 heads), block tables (a good one and bad ones),
/// and a cache of the wrong head dim; with the arguments of the good call writing `out`.
fn paged_files(name: &str) -> (std::path::PathBuf, impl Fn(&str) -> Vec<String>) {
    let dir = out_dir(name);
    let (t, hq, hkv, e, nb, bs) = (4usize, 4usize, 2usize, 8usize, 6usize, 4usize);
    let fill3 = |shape: [usize; 3], m: usize| {
        ndarray::Array3::from_shape_fn(shape, |(a, b, c)| {
            ((a * 7 + b * m + c * 5) % 13) as f32 * 0.1 - 0.6
        })
    };
    let fill4 = |m: usize| {
        Array4::from_shape_fn((nb, bs, hkv, e), |(a, b, c, d)| {
            ((a * 3 + b * m + c * 5 + d) % 11) as f32 * 0.1 - 0.5
        })
    };
    let p = |n: &str| dir.join(n);
    write_npy(p("q.npy"), &fill3([t, hq, e], 3)).unwrap();
    write_npy(p("kc.npy"), &fill4(7)).unwrap();
    write_npy(p("vc.npy"), &fill4(2)).unwrap();
    write_npy(p("kc_bad.npy"), &Array4::<f32>::zeros((nb, bs, hkv, e + 2))).unwrap();
    let table = |rows: Vec<i32>| ndarray::Array2::from_shape_vec((2, 3), rows).unwrap();
    write_npy(p("bt.npy"), &table(vec![4, 1, 2, 0, -1, -1])).unwrap();
    write_npy(p("bt_range.npy"), &table(vec![4, 6, 2, 0, -1, -1])).unwrap();
    write_npy(p("bt_neg.npy"), &table(vec![4, -1, 2, 0, -1, -1])).unwrap();
    let d = dir.clone();
    let base = move |out: &str| -> Vec<String> {
        let p = |n: &str| d.join(n);
        [
            "paged",
            "--q",
            s(&p("q.npy")),
            "--q-lens",
            "3,1",
            "--k-cache",
            s(&p("kc.npy")),
            "--v-cache",
            s(&p("vc.npy")),
            "--block-table",
            s(&p("bt.npy")),
            "--seq-lens",
            "10,2",
            "--out",
            s(&p(out)),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    (dir, base)
}

/// `paged`: a ragged batch (3 prefill queries and 1 decode query) over paged caches with RoPE,
/// causal, a window and ALiBi on the GPU matches the CPU reference, f32 and f16.
#[test]
fn paged_ragged_batch_with_rope() {
    let (dir, base) = paged_files("paged");
    let (t, hq, e) = (4usize, 4usize, 8usize);
    let p = |n: &str| dir.join(n);
    let run = |args: &[String]| cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let flags = [
        "--causal",
        "--rope",
        "half",
        "--rope-theta",
        "500000",
        "--window",
        "5,0",
        "--alibi",
        "0.5,0.25,0.1,0.05",
    ];
    for storage in ["f32", "f16"] {
        let mut cpu = base("cpu.npy");
        cpu.extend(flags.iter().map(|x| x.to_string()));
        cpu.extend([
            "--storage".into(),
            storage.into(),
            "--cpu".into(),
            "--lse-out".into(),
            s(&p("cpu_lse.npy")).into(),
        ]);
        let r = run(&cpu);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        if common::ctx().is_none() {
            continue;
        }
        let mut gpu = base("gpu.npy");
        gpu.extend(flags.iter().map(|x| x.to_string()));
        gpu.extend([
            "--storage".into(),
            storage.into(),
            "--lse-out".into(),
            s(&p("gpu_lse.npy")).into(),
        ]);
        let r = run(&gpu);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let tol = if storage == "f32" {
            common::TOL
        } else {
            wgpu_attention::check::Tolerance::for_storage(wgpu_attention::Storage::F16)
        };
        for (g, c, shape) in [
            ("gpu.npy", "cpu.npy", vec![t, hq, e]),
            ("gpu_lse.npy", "cpu_lse.npy", vec![t, hq]),
        ] {
            let (g, c): (ArrayD<f32>, ArrayD<f32>) = (read_npy(p(g)).unwrap(), read_npy(p(c)).unwrap());
            assert_eq!(g.shape(), shape.as_slice());
            common::assert_report(
                compare(g.iter().copied(), c.iter().map(|&x| x as f64), tol),
                &format!("paged {storage} {shape:?}"),
            );
        }
    }
}

/// `paged`: every bad input (shapes, tables, lengths, formats) is a one-line error with exit
/// status 2 that writes nothing.
#[test]
fn paged_bad_input_is_one_line() {
    let (dir, base) = paged_files("paged-bad");
    let p = |n: &str| dir.join(n);
    let run = |args: &[String]| cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let bt_range = s(&p("bt_range.npy")).to_string();
    let bt_neg = s(&p("bt_neg.npy")).to_string();
    let kc_bad = s(&p("kc_bad.npy")).to_string();
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "entry out of range",
            vec![("--block-table", bt_range)],
            "block_table[0, 1] = 6",
        ),
        (
            "negative used entry",
            vec![("--block-table", bt_neg)],
            "block_table[0, 1] = -1",
        ),
        (
            "sequence longer than its table",
            vec![("--seq-lens", "13,2".into())],
            "more than its table",
        ),
        ("n > l", vec![("--seq-lens", "10,0".into())], "fewer than"),
        (
            "q-lens not summing to T",
            vec![("--q-lens", "2,1".into())],
            "sum to 3",
        ),
        (
            "odd rope dim",
            vec![("--rope", "half".into()), ("--rope-dim", "5".into())],
            "rope",
        ),
        ("cache shape", vec![("--k-cache", kc_bad)], "disagree"),
    ];
    for (what, changes, expect) in cases {
        let out = format!("bad_{}.npy", what.replace(' ', "_"));
        let mut args = base(&out);
        for (flag, value) in &changes {
            match args.iter().position(|a| a == flag) {
                Some(i) => args[i + 1] = value.clone(),
                None => args.extend([flag.to_string(), value.clone()]),
            }
        }
        args.push("--cpu".into());
        let r = run(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{what}: {err}");
        assert!(err.contains(expect), "{what}: {err} should say {expect:?}");
        assert!(!p(&out).exists(), "{what} wrote its output");
    }
}

/// A newcomer's first command prints no error lines on a machine without a display: the crate's
/// instance lists the GPUs without the window systems' surface extensions (with them, Mesa's
/// device-selection layer connects to Wayland and libwayland complains about XDG_RUNTIME_DIR).
#[test]
fn demo_prints_no_error_lines_without_a_display() {
    if common::ctx().is_none() {
        return;
    }
    let r = Command::new(env!("CARGO_BIN_EXE_wgpu-attention"))
        .args(["demo", "--seq", "64", "--heads", "2"])
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("DISPLAY")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr),
    );
    assert!(r.status.success(), "demo failed:\n{out}\n{err}");
    assert!(out.contains("check:   PASS"), "{out}");
    let noisy: Vec<&str> = err
        .lines()
        .filter(|l| l.to_lowercase().contains("error"))
        .collect();
    assert!(noisy.is_empty(), "error lines on stderr: {noisy:?}");
}

/// The `paged` tests' caches as int8 codes with their scales (`{k,v}_i8.npy`,
/// `{k,v}_i8_scales.npy`) and fp8 bit patterns (`{k,v}_f8.npy`) at the scales in
/// `fp8_scales.npy`, by the host rules.
fn write_code_caches(dir: &Path) {
    use wgpu_attention::quant;
    let (nb, bs, hkv, e) = (6usize, 4usize, 2usize, 8usize);
    write_npy(dir.join("fp8_scales.npy"), &ndarray::arr1(&[0.004f32, 0.002])).unwrap();
    // Code caches from the float ones by the host rules.
    for (x, m) in [("k", "kc.npy"), ("v", "vc.npy")] {
        let vals: Array4<f32> = read_npy(dir.join(m)).unwrap();
        let flat = vals.as_slice().unwrap();
        let (c, sc) = quant::quantize_int8(flat, e);
        write_npy(
            dir.join(format!("{x}_i8.npy")),
            &Array4::from_shape_vec((nb, bs, hkv, e), c).unwrap(),
        )
        .unwrap();
        write_npy(
            dir.join(format!("{x}_i8_scales.npy")),
            &ndarray::Array3::from_shape_vec((nb, bs, hkv), sc).unwrap(),
        )
        .unwrap();
        let f8 = quant::quantize_fp8_heads(flat, e, &[nb, bs, hkv], 2, &[0.004, 0.002]);
        let bits: Vec<u8> = f8.iter().map(|c| c.0).collect();
        write_npy(
            dir.join(format!("{x}_f8.npy")),
            &Array4::from_shape_vec((nb, bs, hkv, e), bits).unwrap(),
        )
        .unwrap();
    }
}

/// `paged` with 8-bit caches: float caches quantised on the GPU (int8 with its own scales,
/// fp8 at the given per-head scales, RoPE first) agree with `--cpu`'s host quantisation, and
/// caches of codes (int8 `i1`, fp8 `u1`) with their scales files run on the GPU as the CPU
/// reference over their values says.
#[test]
fn paged_8_bit_caches() {
    let (dir, base) = paged_files("paged-8bit");
    let p = |n: &str| dir.join(n);
    let run = |args: &[String]| cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    write_code_caches(&dir);
    let sc = |x: &str| s(&p(x)).to_string();
    type Setup = (&'static str, Vec<(&'static str, String)>, bool);
    let setups: Vec<Setup> = vec![
        ("int8 quantised", vec![("--kv-format", "int8".into())], true),
        (
            "fp8 quantised",
            vec![
                ("--kv-format", "fp8".into()),
                ("--k-scales", sc("fp8_scales.npy")),
                ("--v-scales", sc("fp8_scales.npy")),
            ],
            true,
        ),
        (
            "int8 codes",
            vec![
                ("--k-cache", sc("k_i8.npy")),
                ("--v-cache", sc("v_i8.npy")),
                ("--k-scales", sc("k_i8_scales.npy")),
                ("--v-scales", sc("v_i8_scales.npy")),
            ],
            false,
        ),
        (
            "fp8 codes",
            vec![
                ("--kv-format", "fp8".into()),
                ("--k-cache", sc("k_f8.npy")),
                ("--v-cache", sc("v_f8.npy")),
                ("--k-scales", sc("fp8_scales.npy")),
                ("--v-scales", sc("fp8_scales.npy")),
            ],
            false,
        ),
    ];
    for (name, changes, rope) in setups {
        let args = |out: &str, extra: &[&str]| {
            let mut a = base(out);
            for (flag, value) in &changes {
                match a.iter().position(|x| x == flag) {
                    Some(i) => a[i + 1] = value.clone(),
                    None => a.extend([flag.to_string(), value.clone()]),
                }
            }
            a.extend(["--causal".to_string()]);
            if rope {
                a.extend(["--rope".to_string(), "half".to_string()]);
            }
            a.extend(extra.iter().map(|x| x.to_string()));
            a
        };
        let r = run(&args("q_cpu.npy", &["--cpu"]));
        assert!(
            r.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        if common::ctx().is_none() {
            continue;
        }
        let r = run(&args("q_gpu.npy", &[]));
        let said = String::from_utf8_lossy(&r.stdout);
        assert!(
            r.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        assert!(
            said.contains("K int8") || said.contains("K fp8"),
            "{name}: {said}"
        );
        let (g, c): (ArrayD<f32>, ArrayD<f32>) = (
            read_npy(p("q_gpu.npy")).unwrap(),
            read_npy(p("q_cpu.npy")).unwrap(),
        );
        // The GPU's codes equal the host's on these inputs (a code 1 off needs x / scale within
        // float rounding of a tie: none here, checked), so the f32 tolerance holds throughout.
        common::assert_report(
            compare(g.iter().copied(), c.iter().map(|&x| x as f64), common::TOL),
            name,
        );
    }
}

/// `paged`: bad 8-bit inputs (missing, misshapen, negative or NaN scales, a u1 cache without
/// `--kv-format fp8`, scales for a float cache, RoPE over codes) are one-line errors with
/// exit status 2 that write nothing; `--help` lists the flags.
#[test]
fn paged_bad_8_bit_input_is_one_line() {
    let (dir, base) = paged_files("paged-8bit-bad");
    let p = |n: &str| dir.join(n);
    let run = |args: &[String]| cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    write_code_caches(&dir);
    write_npy(p("k_u8.npy"), &Array4::<u8>::zeros((6, 4, 2, 8))).unwrap();
    for (name, x) in [
        ("head", [0.5f32, 0.5]),
        ("neg", [0.5, -0.5]),
        ("nan", [0.5, f32::NAN]),
    ] {
        write_npy(p(&format!("{name}_scales.npy")), &ndarray::arr1(&x)).unwrap();
    }
    write_npy(p("three_scales.npy"), &ndarray::arr1(&[0.5f32, 0.5, 0.5])).unwrap();
    let f = |n: &str| s(&p(n)).to_string();
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "int8 codes without scales",
            vec![("--k-cache", f("k_i8.npy"))],
            "needs --k-scales",
        ),
        (
            "int8 codes with per-head scales",
            vec![("--k-cache", f("k_i8.npy")), ("--k-scales", f("head_scales.npy"))],
            "expected [6, 4, 2]",
        ),
        (
            "fp8 without scales",
            vec![("--kv-format", "fp8".into())],
            "needs --k-scales",
        ),
        (
            "fp8 scales of the wrong shape",
            vec![
                ("--kv-format", "fp8".into()),
                ("--k-scales", f("three_scales.npy")),
                ("--v-scales", f("head_scales.npy")),
            ],
            "expected [2]",
        ),
        (
            "negative scale",
            vec![
                ("--kv-format", "fp8".into()),
                ("--k-scales", f("neg_scales.npy")),
                ("--v-scales", f("head_scales.npy")),
            ],
            "holds -0.5",
        ),
        (
            "NaN scale",
            vec![
                ("--kv-format", "fp8".into()),
                ("--k-scales", f("head_scales.npy")),
                ("--v-scales", f("nan_scales.npy")),
            ],
            "holds NaN",
        ),
        (
            "u1 without fp8",
            vec![("--k-cache", f("k_u8.npy"))],
            "--kv-format fp8",
        ),
        (
            "scales for a float cache",
            vec![("--k-scales", f("head_scales.npy"))],
            "for 8-bit caches",
        ),
        (
            "rope over codes",
            vec![
                ("--k-cache", f("k_i8.npy")),
                ("--k-scales", f("k_i8_scales.npy")),
                ("--rope", "half".into()),
            ],
            "hold rotated keys",
        ),
    ];
    for (what, changes, expect) in cases {
        let out = format!("bad_{}.npy", what.replace(' ', "_"));
        let mut args = base(&out);
        for (flag, value) in &changes {
            match args.iter().position(|a| a == flag) {
                Some(i) => args[i + 1] = value.clone(),
                None => args.extend([flag.to_string(), value.clone()]),
            }
        }
        let r = run(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{what}: {err}");
        assert!(err.contains(expect), "{what}: {err} should say {expect:?}");
        assert!(!p(&out).exists(), "{what} wrote its output");
    }
    let help = String::from_utf8_lossy(&cli(&["paged", "--help"]).stdout).to_string();
    for flag in ["--kv-format", "--k-scales", "--v-scales", "int8", "fp8"] {
        assert!(help.contains(flag), "paged --help lists {flag}");
    }
}
