//! The attention inputs and options `run`, `backward` and `variant` share: the `.npy` files,
//! the mask, bias, key lengths, causal alignment, scale, path, storage format and ring flags.

use std::path::PathBuf;

use clap::Args;
use ndarray::{Array4, ArrayD};
use wgpu_attention::{Options, Path, Sdpa, Storage, Tensor, UserMod};

use crate::npy::{read_array, read_float, read_int, read_qkv};
use crate::{path_parser, CausalArg, CliResult};

/// The attention inputs and options `run` and `backward` share.
#[derive(Args)]
pub(crate) struct InputArgs {
    /// Queries, f32 or f16 .npy [B, Hq, L, E].
    #[arg(long, value_name = "Q.npy")]
    q: PathBuf,
    /// Keys, f32 or f16 .npy [B, Hkv, S, E].
    #[arg(long, value_name = "K.npy")]
    k: PathBuf,
    /// Values, f32 or f16 .npy [B, Hkv, S, Ev].
    #[arg(long, value_name = "V.npy")]
    v: PathBuf,
    /// Boolean mask .npy (true = may attend), rank 1-4, broadcastable to [B, Hq, L, S].
    #[arg(long, value_name = "M.npy")]
    mask: Option<PathBuf>,
    /// Additive f32 or f16 bias .npy, rank 1-4, broadcastable to [B, Hq, L, S] (-inf masks a key).
    #[arg(long, value_name = "B.npy")]
    bias: Option<PathBuf>,
    /// Per-batch key lengths (key padding), comma separated: batch b attends keys j < len[b].
    #[arg(long, value_delimiter = ',', value_name = "LEN,..")]
    kv_lens: Option<Vec<usize>>,
    /// Causal mask alignment.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    causal: CausalArg,
    #[command(flatten)]
    modifiers: ModifierArgs,
    /// Sink logits, f32 .npy [Hq]: one per query head, added to each row's softmax
    /// denominator with no value (gpt-oss's attention sinks).
    #[arg(long, value_name = "SK.npy")]
    pub(crate) sink_logits: Option<PathBuf>,
    /// Document ids of packed sequences, two integer .npy files (int32 or int64): the query
    /// documents [B, L] and the key documents [B, S]; query i of batch b sees key j only if
    /// QD[b, i] == KD[b, j].
    #[arg(long, value_name = "QD.npy,KD.npy", value_delimiter = ',', num_args = 1)]
    doc_ids: Option<Vec<PathBuf>>,
    /// User WGSL functions: a file defining `fn score_mod(s: f32, b: u32, h: u32, i: u32, j:
    /// u32) -> f32` and/or `fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool` (and helpers);
    /// captures (--capture) are read in it as NAME(idx: u32) -> f32. GPU only.
    #[arg(long = "mod", value_name = "F.wgsl")]
    user_mod: Option<PathBuf>,
    /// A tensor the --mod source reads as NAME(idx) (f32 or f16 .npy, any shape, flattened
    /// row-major); repeatable.
    #[arg(long, value_name = "NAME=X.npy", requires = "user_mod")]
    capture: Vec<String>,
    /// Implementation to run on the GPU.
    #[arg(long, value_parser = path_parser(), default_value = "auto")]
    pub(crate) path: Path,
    /// Run the CPU reference (f64, slow) instead of the GPU; outputs are written as f32.
    #[arg(long, conflicts_with = "path")]
    pub(crate) cpu: bool,
    /// Device storage format of q, k, v, the bias and the output (f32 accumulation): inputs
    /// are rounded to it (to nearest even) and the output, rounded to it, is written as f32.
    /// With --cpu the reference runs on the rounded inputs and its output is rounded too.
    #[arg(long, value_parser = crate::storage_parser(), default_value = "f32")]
    pub(crate) storage: Storage,
    /// Run on a ring of N devices of the chosen adapter in one process (ring attention: the
    /// sequence split across them, key/value blocks passed round; the same results as one).
    #[arg(long, value_name = "N", conflicts_with = "cpu")]
    pub(crate) devices: Option<usize>,
    /// Run as one rank of an MPI ring, started by `mpirun -np N` (each rank one GPU context):
    /// every rank reads the inputs and keeps its shards; rank 0 writes the outputs.
    #[cfg(feature = "mpi")]
    #[arg(long, conflicts_with_all = ["cpu", "devices"])]
    pub(crate) mpi: bool,
    /// How a ring (--devices, --mpi) deals the sequence out: zigzag balances causal work,
    /// contiguous does not.
    #[arg(long, default_value = "zigzag")]
    pub(crate) layout: wgpu_attention::Layout,
}

/// The built-in modifiers and the scale: `run`'s (through [`InputArgs`]) and `paged`'s flags.
#[derive(Args, Clone, Debug)]
pub(crate) struct ModifierArgs {
    /// Sliding window LEFT,RIGHT (FlashAttention's window_size): the query at position p sees
    /// keys p - LEFT <= j <= p + RIGHT (p = i + S - L, with key lengths kv_len - L + i; in
    /// `paged` l - n + i); -1 leaves that side unbounded.
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true, value_parser = parse_window)]
    window: Option<(i64, i64)>,
    /// The first N keys, seen by every query whatever the window (attention sinks; needs --window).
    #[arg(long, value_name = "N", default_value_t = 0)]
    sink_tokens: usize,
    /// Logit softcap C: each scaled logit s becomes C tanh(s / C) before the bias and ALiBi
    /// (Gemma 2, Grok); C > 0.
    #[arg(long, value_name = "C", allow_negative_numbers = true)]
    softcap: Option<f32>,
    /// ALiBi slopes, one per query head, comma separated: the logit of the query at position p
    /// and key j in head h gets -slope[h] |p - j|.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "S0,S1,..",
        allow_negative_numbers = true
    )]
    alibi: Option<Vec<f32>>,
    /// Softmax scale [default: 1/sqrt(E)].
    #[arg(long, allow_negative_numbers = true)]
    scale: Option<f32>,
}

impl ModifierArgs {
    /// `o` with these modifiers and scale.
    pub(crate) fn apply<'a>(&self, o: Options<'a>) -> Options<'a> {
        Options {
            window: self.window,
            sink_tokens: self.sink_tokens,
            softcap: self.softcap,
            alibi: self.alibi.clone(),
            scale: self.scale.map(f64::from),
            ..o
        }
    }
}

/// A `--mod` source and its captures (name, values, shape).
pub(crate) type UserSource = (String, Vec<(String, Vec<f32>, Vec<usize>)>);

/// The inputs as the device holds them (rounded to the storage format).
pub(crate) struct Inputs {
    pub(crate) q: Array4<f32>,
    pub(crate) k: Array4<f32>,
    pub(crate) v: Array4<f32>,
    pub(crate) mask: Option<ArrayD<bool>>,
    pub(crate) bias: Option<ArrayD<f32>>,
    pub(crate) sink_logits: Option<Vec<f32>>,
    pub(crate) doc_ids: Option<wgpu_attention::DocIds>,
    /// The --mod source and its captures (name, values).
    pub(crate) user_mod: Option<UserSource>,
}

impl InputArgs {
    /// Read and round the inputs.
    pub(crate) fn load(&self) -> CliResult<Inputs> {
        let q = read_qkv(&self.q, "q", "[B, Hq, L, E]")?;
        let k = read_qkv(&self.k, "k", "[B, Hkv, S, E]")?;
        let v = read_qkv(&self.v, "v", "[B, Hkv, S, Ev]")?;
        let mask = self
            .mask
            .as_deref()
            .map(|p| read_array::<bool>(p, "mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
            .transpose()?;
        let bias = self.bias.as_deref().map(|p| read_float(p, "bias")).transpose()?;
        let hq = q.shape()[1];
        let sink_logits = self
            .sink_logits
            .as_deref()
            .map(|p| {
                let a = read_float(p, "sink logits")?;
                if a.shape() != [hq] {
                    return Err(format!(
                        "sink logits: shape {:?} is not [Hq] = [{hq}] (one per query head)",
                        a.shape()
                    )
                    .into());
                }
                Ok::<_, Box<dyn std::error::Error>>(a.iter().copied().collect::<Vec<f32>>())
            })
            .transpose()?;
        let doc_ids = self
            .doc_ids
            .as_deref()
            .map(|paths| read_docs(paths, &q, &k))
            .transpose()?;
        let user_mod = self.read_user_mod()?;
        // The values the device holds: every input rounded to the storage format.
        let st = self.storage;
        let round = |x: f32| st.round(x);
        Ok(Inputs {
            q: q.mapv(round),
            k: k.mapv(round),
            v: v.mapv(round),
            mask,
            bias: bias.map(|b| b.mapv(round)),
            sink_logits,
            doc_ids,
            user_mod,
        })
    }

    /// One set of options for the GPU call and the CPU reference.
    pub(crate) fn options<'a>(&self, x: &'a Inputs) -> Options<'a> {
        self.modifiers.apply(Options {
            causal: self.causal.into(),
            mask: x.mask.as_ref().map(|m| m.into()),
            bias: x
                .bias
                .as_ref()
                .map(|b| Tensor::from(b).with_storage(self.storage)),
            kv_lens: self.kv_lens.clone(),
            sink_logits: x.sink_logits.clone(),
            doc_ids: x.doc_ids.clone(),
            user_mod: x.user_mod.as_ref().map(|(src, caps)| {
                caps.iter()
                    .fold(UserMod::wgsl(src), |m, (name, data, _)| m.capture(name, data))
            }),
            ..Default::default()
        })
    }

    /// `--mod F.wgsl` and its `--capture NAME=X.npy` files (checked by the library when the
    /// call is built, before any GPU work).
    fn read_user_mod(&self) -> CliResult<Option<UserSource>> {
        let Some(path) = &self.user_mod else {
            return Ok(None);
        };
        if self.cpu {
            return Err(
                "--mod: the CPU reference cannot run WGSL: drop --cpu (the library's \
                        reference takes the functions as Rust closures)"
                    .into(),
            );
        }
        let src = std::fs::read_to_string(path)
            .map_err(|e| format!("--mod: cannot read {}: {e}", path.display()))?;
        let mut caps: Vec<(String, Vec<f32>, Vec<usize>)> = Vec::new();
        for c in &self.capture {
            let Some((name, file)) = c.split_once('=') else {
                return Err(format!("--capture {c:?}: give NAME=X.npy").into());
            };
            let a = read_float(std::path::Path::new(file), &format!("capture {name}"))?;
            caps.push((name.to_string(), a.iter().copied().collect(), a.shape().to_vec()));
        }
        // The library's checks (naga, capture names), as a one-line error before any work.
        let mut m = UserMod::wgsl(&src);
        for (name, data, _) in &caps {
            m = m.capture(name, data);
        }
        m.check()
            .map_err(|e| format!("--mod {}: {e}", path.display()).replace('\n', " "))?;
        Ok(Some((src, caps)))
    }

    /// The GPU call on the inputs.
    pub(crate) fn sdpa<'a>(&self, x: &'a Inputs) -> Sdpa<'a> {
        let t = |a| Tensor::from(a).with_storage(self.storage);
        Sdpa::new(t(&x.q), t(&x.k), t(&x.v)).options(self.options(x))
    }
}

/// `--doc-ids QD.npy,KD.npy`: two integer arrays, `[B, L]` and `[B, S]` of q and k.
fn read_docs(paths: &[PathBuf], q: &Array4<f32>, k: &Array4<f32>) -> CliResult<wgpu_attention::DocIds> {
    let [qd, kd] = paths else {
        return Err(format!("--doc-ids: give two files, QD.npy,KD.npy (got {})", paths.len()).into());
    };
    let (b, l, s) = (q.shape()[0], q.shape()[2], k.shape()[2]);
    let mut ids = Vec::new();
    let parts = [
        (qd, "query document ids", [b, l], "[B, L]"),
        (kd, "key document ids", [b, s], "[B, S]"),
    ];
    for (path, what, want, named) in parts {
        let a = read_int(path, what)?;
        if a.shape() != want {
            return Err(format!("{what}: shape {:?} is not {named} = {want:?}", a.shape()).into());
        }
        ids.push(a.iter().copied().collect::<Vec<i32>>());
    }
    let k_ids = ids.pop().expect("two");
    let q_ids = ids.pop().expect("two");
    Ok(wgpu_attention::DocIds { q: q_ids, k: k_ids })
}

/// `LEFT,RIGHT`: two integers (range checks are the library's: a typed error before any work).
pub(crate) fn parse_window(s: &str) -> Result<(i64, i64), String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    match parts.as_slice() {
        [l, r] => Ok((
            l.parse().map_err(|e| format!("LEFT {l:?}: {e}"))?,
            r.parse().map_err(|e| format!("RIGHT {r:?}: {e}"))?,
        )),
        _ => Err(format!(
            "expected LEFT,RIGHT (two integers, -1 = unbounded), got {s:?}"
        )),
    }
}
