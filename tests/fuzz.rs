//! Fuzzing, proptest-driven (cargo-fuzz needs a nightly toolchain, which this project's
//! machines cannot fetch): the safetensors readers (bytes and files) on random bytes and on
//! valid files cut, flipped and given lying headers, and the problem validation on random
//! shapes, masks, biases, key lengths and scales. Every case must return (no panic, no abort),
//! and allocate no single block larger than a stated bound: four times the input's size plus
//! 1 MiB for the readers, 1 MiB for the validation (whose inputs are small slices, whatever
//! shapes they claim). `PROPTEST_CASES` scales every property (the CI runs the defaults:
//! 3,000 cases in all).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proptest::prelude::*;
use wgpu_attention::{Causal, Error, Mask, MhaConfig, MhaWeights, Sdpa, Tensor, VariantKind, VariantParams};

/// The system allocator, noting on each thread the largest block asked for while armed.
struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Run `f`, returning its result and the largest block it allocated on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, LARGEST.with(|l| l.get()))
}

/// A valid safetensors file of a layer (`in_proj_weight [3E, E]` and the rest) with `e` = 8.
fn valid_layer_file() -> Vec<u8> {
    use safetensors::tensor::{serialize, TensorView};
    use safetensors::Dtype;
    let w = MhaWeights::xavier_uniform(MhaConfig::new(8, 2), 1).unwrap();
    let bytes = |a: &[f32]| a.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let wq = w.w_q.as_standard_layout();
    let mut in_proj = bytes(wq.as_slice().unwrap());
    in_proj.extend(bytes(w.w_k.as_standard_layout().as_slice().unwrap()));
    in_proj.extend(bytes(w.w_v.as_standard_layout().as_slice().unwrap()));
    let out = bytes(w.w_o.as_standard_layout().as_slice().unwrap());
    let bias = bytes(&[0.5f32; 24]);
    let views = vec![
        (
            "in_proj_weight",
            TensorView::new(Dtype::F32, vec![24, 8], &in_proj).unwrap(),
        ),
        (
            "out_proj.weight",
            TensorView::new(Dtype::F32, vec![8, 8], &out).unwrap(),
        ),
        (
            "in_proj_bias",
            TensorView::new(Dtype::F32, vec![24], &bias).unwrap(),
        ),
    ];
    serialize(views, None).unwrap()
}

/// A file whose header claims `claim` for `in_proj_weight` (dtype, shape, offsets), then
/// `data` bytes.
fn lying_file(dtype: &str, shape: &[u64], offsets: (u64, u64), data: usize) -> Vec<u8> {
    let header = format!(
        r#"{{"in_proj_weight":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{},{}]}}}}"#,
        offsets.0, offsets.1
    );
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.extend(std::iter::repeat_n(0u8, data));
    f
}

/// What a hostile file can be.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    let valid = valid_layer_file();
    let n = valid.len();
    let (v1, v2, v3) = (valid.clone(), valid.clone(), valid.clone());
    prop_oneof![
        // Random bytes, empty included.
        prop::collection::vec(any::<u8>(), 0..600),
        // The valid file cut short.
        (0..n).prop_map(move |cut| v1[..cut].to_vec()),
        // The valid file with bytes overwritten (header and data).
        prop::collection::vec((0..n, any::<u8>()), 1..8).prop_map(move |flips| {
            let mut f = v2.clone();
            for (i, b) in flips {
                f[i] = b;
            }
            f
        }),
        // A header length that lies.
        any::<u64>().prop_map(move |len| {
            let mut f = v3.clone();
            f[..8].copy_from_slice(&len.to_le_bytes());
            f
        }),
        // Headers claiming any shape and offsets (tens of gigabytes included) over little data.
        (
            prop::sample::select(vec!["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3"]),
            prop::collection::vec(
                prop_oneof![0..40u64, Just(120_000), Just(u64::MAX / 3), any::<u64>()],
                0..4
            ),
            (
                prop_oneof![0..4000u64, any::<u64>()],
                prop_oneof![0..4000u64, any::<u64>()]
            ),
            0..2000usize,
        )
            .prop_map(|(dtype, shape, offsets, data)| lying_file(dtype, &shape, offsets, data)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// The in-memory readers (the layer's state dict, every variant's parameters).
    #[test]
    fn safetensors_bytes_are_read_or_refused(bytes in hostile_bytes(), heads in 1usize..5) {
        let (_, largest) = largest_allocation(|| {
            let _ = MhaWeights::from_safetensors(&bytes, heads);
            for kind in [VariantKind::General, VariantKind::Additive, VariantKind::LowRankV, VariantKind::Linformer] {
                let _ = VariantParams::from_safetensors(kind, &bytes);
            }
        });
        prop_assert!(largest <= 4 * bytes.len() + (1 << 20), "{largest} bytes for a {}-byte input", bytes.len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// The file readers, which read only the header and the tensors they need.
    #[test]
    fn safetensors_files_are_read_or_refused(bytes in hostile_bytes()) {
        let dir = std::env::temp_dir().join(format!("wgpu-attention-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{:?}.safetensors", std::thread::current().id()));
        std::fs::write(&path, &bytes).unwrap();
        let (results, largest) = largest_allocation(|| {
            (
                MhaWeights::from_safetensors_file(&path, 2),
                VariantParams::from_safetensors_file(VariantKind::Additive, &path),
            )
        });
        prop_assert!(largest <= 4 * bytes.len() + (1 << 20), "{largest} bytes for a {}-byte file", bytes.len());
        for e in [results.0.err(), results.1.err()].into_iter().flatten() {
            prop_assert!(
                matches!(e, Error::WeightFile { .. } | Error::MissingWeight { .. } | Error::WeightShape { .. }
                    | Error::InvalidConfig { .. } | Error::StorageMismatch { .. }),
                "untyped: {e:?}"
            );
        }
    }
}

/// A file claiming a 50 GB tensor (or one that the file does hold past the bound) is refused
/// before anything is allocated for it, with an error naming the file and the tensor.
#[test]
fn claims_of_huge_tensors_are_refused_before_allocation() {
    let dir = std::env::temp_dir().join(format!("wgpu-attention-huge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.safetensors");
    // 360,000 x 36,000 f32 = 51.8 GB claimed over 1 KB of data.
    let bytes = lying_file("F32", &[360_000, 36_000], (0, 51_840_000_000), 1024);
    std::fs::write(&path, &bytes).unwrap();
    let (r, largest) = largest_allocation(|| MhaWeights::from_safetensors_file(&path, 2));
    let e = r.unwrap_err();
    assert!(
        matches!(&e, Error::WeightFile { reason } if reason.contains("in_proj_weight")),
        "{e}"
    );
    assert!(largest < 1 << 20, "{largest} bytes allocated");
    let (r, largest) = largest_allocation(|| MhaWeights::from_safetensors(&bytes, 2));
    assert!(matches!(r, Err(Error::WeightFile { .. })), "{r:?}");
    assert!(largest < 1 << 20, "{largest} bytes allocated");
    // A layer whose weights would be 40 GB per matrix is refused before initialising any.
    let (r, largest) = largest_allocation(|| MhaWeights::xavier_uniform(MhaConfig::new(100_000, 4), 1));
    assert!(matches!(r, Err(Error::InvalidConfig { .. })), "{r:?}");
    assert!(largest < 1 << 20, "{largest} bytes allocated");
}

/// Each kind of bad file gets `Error::WeightFile` naming the file and what is wrong with it:
/// empty, cut inside the length, a header length past the file, cut inside the data, a
/// malformed header, offsets past the data, a shape that does not match its offsets.
#[test]
fn bad_files_are_named_errors() {
    let dir = std::env::temp_dir().join(format!("wgpu-attention-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let valid = valid_layer_file();
    let mut long_header = valid.clone();
    long_header[..8].copy_from_slice(&(valid.len() as u64).to_le_bytes());
    let mut malformed = valid.clone();
    malformed[8] = b'[';
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "too short"),
        ("cut-length", valid[..5].to_vec(), "too short"),
        ("long-header", long_header, "header claims"),
        ("cut-data", valid[..valid.len() - 3].to_vec(), "offsets"),
        ("malformed", malformed, "malformed header"),
        ("past-data", lying_file("F32", &[24, 8], (0, 768), 100), "offsets"),
        (
            "wrong-shape",
            lying_file("F32", &[24, 9], (0, 768), 768),
            "invalid shape",
        ),
    ];
    for (name, bytes, says) in cases {
        let path = dir.join(format!("{name}.safetensors"));
        std::fs::write(&path, &bytes).unwrap();
        match MhaWeights::from_safetensors_file(&path, 2) {
            Err(Error::WeightFile { reason }) => {
                assert!(reason.contains(name) && reason.contains(says), "{name}: {reason}")
            }
            other => panic!("{name}: {other:?}"),
        }
        // The in-memory reader refuses it too, typed.
        assert!(
            matches!(
                MhaWeights::from_safetensors(&bytes, 2),
                Err(Error::WeightFile { .. })
            ),
            "{name}"
        );
    }
}

/// Shapes for the validation fuzz: small, zero, huge and overflowing dimensions.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0usize..6, 1 => Just(1usize << 20), 1 => Just(usize::MAX / 2), 1 => any::<usize>()]
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim(), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// The problem validation: q, k, v, a mask, a bias claiming any shapes over small slices,
    /// any key lengths, scale and causal mode. Every case returns (a typed error or a path),
    /// allocates little, and does no GPU work (validation comes first).
    #[test]
    fn problem_validation_takes_any_shapes(
        q in shape(), k in shape(), v in shape(), mask in prop::option::of(shape()),
        bias in prop::option::of(shape()), lens in prop::option::of(prop::collection::vec(dim(), 0..4)),
        scale in prop::option::of(prop_oneof![any::<f32>(), Just(f32::NAN), Just(f32::INFINITY), Just(0.0f32)]),
        causal in prop::sample::select(vec![Causal::None, Causal::TopLeft, Causal::BottomRight, Causal::Diagonal(-3), Causal::Diagonal(i64::MAX)]),
    ) {
        let Some(ctx) = common::thread_ctx() else { return Ok(()) };
        let data = [0.25f32; 64];
        let flags = [true; 64];
        let (r, largest) = largest_allocation(|| {
            let mut s = Sdpa::new(
                Tensor::from_slice(&data, &q),
                Tensor::from_slice(&data, &k),
                Tensor::from_slice(&data, &v),
            )
            .causal(causal);
            if let Some(m) = &mask {
                s = s.mask(Mask::from_slice(&flags, m));
            }
            if let Some(b) = &bias {
                s = s.bias(Tensor::from_slice(&data, b));
            }
            if let Some(l) = &lens {
                s = s.kv_lens(l);
            }
            if let Some(x) = scale {
                s = s.scale(x);
            }
            s.resolved_path(ctx)
        });
        prop_assert!(largest <= 1 << 20, "{largest} bytes allocated validating");
        if r.is_ok() {
            // Only a consistent problem passes: every tensor's data is what its shape claims.
            let n = |s: &[usize]| s.iter().product::<usize>();
            prop_assert!(q.len() == 4 && n(&q) <= 64 && n(&k) <= 64 && n(&v) <= 64, "{q:?} {k:?} {v:?} passed");
        }
    }
}
