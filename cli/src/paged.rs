//! `paged`: attention of a ragged batch over paged KV caches in `.npy` files.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, ValueEnum};
use ndarray::{Array3, Array4, ArrayD};
use wgpu_attention::{Causal, PagedAttention, Path, Rope, RopeStyle, Storage, Tensor};

use crate::npy::{read_cache, read_float, read_int, write_array};
use crate::paged_quant::CacheIn;
use crate::timing::ms;
use crate::{context, path_parser, CliResult};

/// RoPE's pairing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RopeArg {
    /// Pairs (k, k + D/2): GPT-NeoX, Llama, Hugging Face's rotate_half.
    Half,
    /// Pairs (2k, 2k + 1): GPT-J.
    Interleaved,
}

/// An 8-bit cache format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum KvFormat {
    /// Symmetric int8 codes with a scale per token and kv head (max |x| / 127).
    Int8,
    /// e4m3 codes (PyTorch's float8_e4m3fn) with a scale per kv head, saturating at ±448.
    Fp8,
}

impl KvFormat {
    pub(crate) fn storage(self) -> Storage {
        match self {
            KvFormat::Int8 => Storage::Int8,
            KvFormat::Fp8 => Storage::Fp8,
        }
    }
}

#[derive(Args)]
pub(crate) struct PagedArgs {
    /// Queries packed by sequence, f32 or f16 .npy [T, Hq, E].
    #[arg(long, value_name = "Q.npy")]
    q: PathBuf,
    /// New queries per sequence, comma separated (summing to T).
    #[arg(long, value_delimiter = ',', value_name = "N0,N1,..", required = true)]
    q_lens: Vec<usize>,
    /// The K cache, .npy [NB, BS, Hkv, E]: f32 or f16 values, int8 codes (dtype i1, with
    /// --k-scales), or fp8 e4m3 bit patterns (dtype u1, with --kv-format fp8 and --k-scales).
    #[arg(long, value_name = "KC.npy")]
    k_cache: PathBuf,
    /// The V cache, .npy [NB, BS, Hkv, Ev], as the K cache.
    #[arg(long, value_name = "VC.npy")]
    v_cache: PathBuf,
    /// 8-bit caches: float caches are quantised on the GPU by the crate's rule (int8 computes
    /// a scale per token and kv head; fp8 takes --k-scales/--v-scales); code caches are read
    /// with their scales. q and the output stay in --storage.
    #[arg(long, value_enum)]
    kv_format: Option<KvFormat>,
    /// The K cache's scales, f32 .npy: [NB, BS, Hkv] for int8 codes, [Hkv] for fp8.
    #[arg(long, value_name = "KS.npy")]
    k_scales: Option<PathBuf>,
    /// The V cache's scales, as --k-scales.
    #[arg(long, value_name = "VS.npy")]
    v_scales: Option<PathBuf>,
    /// The block table, int32 .npy [num_seqs, max_blocks]: key t of sequence s is in block
    /// BT[s, t / BS], slot t % BS; entries past a sequence's last block are ignored (-1 say).
    #[arg(long, value_name = "BT.npy")]
    block_table: PathBuf,
    /// Keys per sequence, comma separated (its new queries' own keys included).
    #[arg(long, value_delimiter = ',', value_name = "L0,L1,..", required = true)]
    seq_lens: Vec<usize>,
    /// Causal by position: query i of a sequence of l keys with n new queries is at l - n + i.
    #[arg(long)]
    causal: bool,
    /// RoPE: q and the caches hold un-rotated vectors, attention runs over the rotated ones
    /// (key t at position t, query i at l - n + i).
    #[arg(long, value_enum)]
    rope: Option<RopeArg>,
    /// RoPE's base.
    #[arg(long, value_name = "F", default_value_t = 10000.0, requires = "rope")]
    rope_theta: f64,
    /// RoPE's rotated leading dims (even) [default: E].
    #[arg(long, value_name = "D", requires = "rope")]
    rope_dim: Option<usize>,
    /// Sink logits, f32 .npy [Hq].
    #[arg(long, value_name = "SK.npy")]
    sink_logits: Option<PathBuf>,
    #[command(flatten)]
    modifiers: crate::input::ModifierArgs,
    /// Device storage format of q, float caches and the output (inputs rounded to it; the
    /// output, rounded to it, written as f32).
    #[arg(long, value_parser = crate::storage_parser(), default_value = "f32")]
    storage: Storage,
    /// Implementation of each group's call on the GPU (fused or decode).
    #[arg(long, value_parser = path_parser(), default_value = "auto")]
    path: Path,
    /// Run the CPU reference (f64) instead of the GPU.
    #[arg(long, conflicts_with = "path")]
    cpu: bool,
    /// Where to write the output, f32 .npy [T, Hq, Ev].
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Also write each query row's logsumexp, f32 .npy [T, Hq].
    #[arg(long, value_name = "LSE.npy")]
    lse_out: Option<PathBuf>,
}

impl PagedArgs {
    pub(crate) fn kv_format(&self) -> Option<KvFormat> {
        self.kv_format
    }
}

/// The library call on the inputs (`k` the K cache, rotated or not; float caches in
/// --storage, 8-bit ones as their codes and scales).
#[allow(clippy::too_many_arguments)] // the command's inputs, each its own
fn call<'a>(
    a: &'a PagedArgs,
    q: &'a Array3<f32>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    table: &'a [i32],
    sink_logits: Option<&'a [f32]>,
    rope: Option<Rope>,
) -> PagedAttention<'a> {
    let st = a.storage;
    let mut c = PagedAttention::new(
        Tensor::from(q).with_storage(st),
        &a.q_lens,
        wgpu_attention::Pages::new(k, v, wgpu_attention::PagedLayout::TokenMajor),
        table,
        &a.seq_lens,
    )
    .path(a.path)
    .options(a.modifiers.apply(Default::default()));
    if a.causal {
        c = c.causal(Causal::BottomRight);
    }
    if let Some(sk) = sink_logits {
        c = c.sink_logits(sk);
    }
    if let Some(r) = rope {
        c = c.rope(r);
    }
    c
}

fn rank<const N: usize>(a: &ArrayD<f32>, what: &str, named: &str) -> CliResult<[usize; N]> {
    dims(a.shape(), what, named)
}

fn dims<const N: usize>(shape: &[usize], what: &str, named: &str) -> CliResult<[usize; N]> {
    shape
        .try_into()
        .map_err(|_| format!("{what}: shape {shape:?} is not {named}").into())
}

fn dims4(shape: &[usize], what: &str, named: &str) -> CliResult<[usize; 4]> {
    dims(shape, what, named)
}

/// RoPE on the K cache: every used slot rotated at its key's position (a block shared by
/// forked sequences holds the same positions in each), rounded to the cache's format.
fn rotate_cache(
    a: &PagedArgs,
    r: &Rope,
    table: &[i32],
    k: &mut Array4<f32>,
    round: &dyn Fn(f32) -> f32,
) -> CliResult<()> {
    let (nb, bs) = (k.dim().0, k.dim().1);
    let mb = table.len() / a.seq_lens.len();
    let mut pos_of = vec![None::<usize>; nb * bs];
    for (s, &len) in a.seq_lens.iter().enumerate() {
        for tk in 0..len {
            let slot = table[s * mb + tk / bs] as usize * bs + tk % bs;
            match pos_of[slot] {
                Some(p) if p != tk => {
                    return Err(format!(
                        "--rope: block {} slot {} holds key {p} of one sequence and key {tk} of sequence {s}: a slot has one position",
                        slot / bs,
                        slot % bs
                    )
                    .into())
                }
                _ => pos_of[slot] = Some(tk),
            }
        }
    }
    for (slot, p) in pos_of.iter().enumerate() {
        if let Some(p) = p {
            let mut row = k
                .slice(ndarray::s![slot / bs, slot % bs, .., ..])
                .to_owned()
                .insert_axis(ndarray::Axis(0));
            r.apply(row.view_mut(), &[*p])?;
            let row = row.mapv(round);
            k.slice_mut(ndarray::s![slot / bs, slot % bs, .., ..])
                .assign(&row.index_axis(ndarray::Axis(0), 0));
        }
    }
    Ok(())
}

/// The K and V caches, checked against q's shape `[T, Hq, E]` and each other, with their
/// 8-bit format and scales.
fn read_caches(a: &PagedArgs, q: &[usize]) -> CliResult<(CacheIn, CacheIn)> {
    let kc = read_cache(&a.k_cache, "k cache")?;
    let [nb, bs, hkv, ke] = dims4(kc.shape(), "k cache", "[NB, BS, Hkv, E]")?;
    let vc = read_cache(&a.v_cache, "v cache")?;
    let [vnb, vbs, vh, _] = dims4(vc.shape(), "v cache", "[NB, BS, Hkv, Ev]")?;
    if ke != q[2] || (vnb, vbs, vh) != (nb, bs, hkv) {
        return Err(format!(
            "the caches {:?} and {:?} disagree with q {q:?}: K [NB, BS, Hkv, E] and V [NB, BS, Hkv, Ev] with q's E",
            kc.shape(),
            vc.shape(),
        )
        .into());
    }
    let kin = CacheIn::new(a, "k", kc, a.k_scales.as_deref(), [nb, bs, hkv])?;
    let vin = CacheIn::new(a, "v", vc, a.v_scales.as_deref(), [nb, bs, hkv])?;
    if a.rope.is_some() && (kin.codes.is_some() || vin.codes.is_some()) {
        return Err("--rope rotates float caches (un-rotated keys) before they are quantised; 8-bit code caches hold rotated keys already: rotate q yourself, or give float caches with --kv-format".into());
    }
    Ok((kin, vin))
}

/// The call on the GPU: float caches to quantise quantised there first. The output and what
/// ran, for the report line.
#[allow(clippy::too_many_arguments)] // the command's inputs, each its own
fn run_gpu(
    a: &PagedArgs,
    q: &Array3<f32>,
    (kin, vin): (&CacheIn, &CacheIn),
    (k, v): (&Array4<f32>, &Array4<f32>),
    table: &[i32],
    sink_logits: Option<&[f32]>,
    rope: Option<Rope>,
) -> CliResult<(wgpu_attention::PagedOutput, String)> {
    let (st, t) = (a.storage, q.dim().0);
    let started = Instant::now();
    let ctx = context()?;
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let kg = kin.on_gpu(&ctx, &mut enc, k)?;
    let vg = vin.on_gpu(&ctx, &mut enc, v)?;
    ctx.queue().submit([enc.finish()]);
    let call = call(
        a,
        q,
        kin.gpu_tensor(&kg, k, st),
        vin.gpu_tensor(&vg, v, st),
        table,
        sink_logits,
        rope,
    );
    let r = call.run_blocking(&ctx)?;
    let how = format!(
        "ran on {}, storage {st}{}, {} sequences, {t} queries, in {:.3} ms (incl. upload, shader compilation and readback)",
        ctx.describe(),
        kin.describe(vin),
        a.seq_lens.len(),
        ms(started.elapsed())
    );
    Ok((r, how))
}

/// `paged`: read, check (everything before any GPU work or any file written), run, write.
pub(crate) fn paged(a: &PagedArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([
        ("--out", Some(a.out.as_path())),
        ("--lse-out", a.lse_out.as_deref()),
    ])?;
    let st = a.storage;
    let q = read_float(&a.q, "q")?;
    let [t, hq, e] = rank::<3>(&q, "q", "[T, Hq, E]")?;
    let (kin, vin) = read_caches(a, q.shape())?;
    let bt = read_int(&a.block_table, "block table")?;
    if bt.ndim() != 2 || bt.shape()[0] != a.seq_lens.len() {
        return Err(format!(
            "block table: shape {:?} is not [num_seqs, max_blocks] with num_seqs = {} (--seq-lens)",
            bt.shape(),
            a.seq_lens.len()
        )
        .into());
    }
    let table: Vec<i32> = bt.iter().copied().collect();
    let sink_logits = a
        .sink_logits
        .as_deref()
        .map(|p| -> CliResult<Vec<f32>> {
            let s = read_float(p, "sink logits")?;
            if s.shape() != [hq] {
                return Err(format!("sink logits: shape {:?} is not [Hq] = [{hq}]", s.shape()).into());
            }
            Ok(s.iter().copied().collect())
        })
        .transpose()?;
    let rope = a.rope.map(|r| Rope {
        style: if r == RopeArg::Half {
            RopeStyle::HalfSplit
        } else {
            RopeStyle::Interleaved
        },
        theta: a.rope_theta,
        dim: a.rope_dim,
    });
    let round = |x: f32| st.round(x);
    let q = Array3::from_shape_vec((t, hq, e), q.iter().map(|&x| round(x)).collect())?;
    let (mut k, v) = (kin.values(st), vin.values(st));
    // The call, checked before the caches are rotated (its table checks come first).
    call(
        a,
        &q,
        kin.tensor(&k, st),
        vin.tensor(&v, st),
        &table,
        sink_logits.as_deref(),
        rope,
    )
    .validate()?;
    if let Some(r) = &rope {
        // Floats to quantise keep f32 until then.
        let keep = kin.format.is_some();
        rotate_cache(a, r, &table, &mut k, &|x| if keep { x } else { st.round(x) })?;
    }
    let started = Instant::now();
    let (r, how) = if a.cpu {
        // 8-bit caches by the host's rules (the GPU's), the reference over their values.
        let (kq, vq) = (kin.quantized_on_host(&k)?, vin.quantized_on_host(&v)?);
        let call = call(
            a,
            &q,
            kq.tensor(&k, st),
            vq.tensor(&v, st),
            &table,
            sink_logits.as_deref(),
            rope,
        );
        let r = call.reference()?;
        (
            wgpu_attention::PagedOutput {
                output: r.output.mapv(round),
                lse: r.lse,
            },
            format!("ran the CPU reference (f64) in {:.3} ms", ms(started.elapsed())),
        )
    } else {
        run_gpu(
            a,
            &q,
            (&kin, &vin),
            (&k, &v),
            &table,
            sink_logits.as_deref(),
            rope,
        )?
    };
    println!("{how}");
    write_array(&a.out, "output", &r.output.into_dyn())?;
    if let Some(p) = &a.lse_out {
        write_array(p, "lse", &r.lse.into_dyn())?;
    }
    Ok(ExitCode::SUCCESS)
}
