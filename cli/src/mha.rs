//! `mha`: a multi-head attention layer (PyTorch `nn.MultiheadAttention` weights) on `.npy`
//! inputs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::{MhaGrads, MhaWeights, MultiHeadAttention, NeedWeights, Options, Storage, Tensor};

use crate::npy::{combine_masks, read_3d, read_array, write_array};
use crate::timing::ms;
use crate::{context, CausalArg, CliResult};

#[derive(Args)]
pub(crate) struct MhaArgs {
    /// Query input [B, L, d_model] (f32 or f16); also keys and values unless --key/--value are given.
    #[arg(long, value_name = "X.npy")]
    query: PathBuf,
    /// Key input [B, S, kdim] for cross-attention (needs --value).
    #[arg(long, value_name = "XK.npy", requires = "value")]
    key: Option<PathBuf>,
    /// Value input [B, S, vdim] for cross-attention (needs --key).
    #[arg(long, value_name = "XV.npy", requires = "key")]
    value: Option<PathBuf>,
    /// safetensors state dict of torch.nn.MultiheadAttention (in_proj_weight or
    /// q/k/v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias).
    #[arg(long, value_name = "MHA.safetensors")]
    weights: PathBuf,
    /// Prefix of the layer's keys in the state dict (e.g. "encoder.layers.0.self_attn.").
    #[arg(long, default_value = "")]
    prefix: String,
    /// Query heads.
    #[arg(long)]
    heads: usize,
    /// Key/value heads (grouped-query); checked against the weights, which determine it.
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Boolean mask broadcastable to [B, H, L, S]; true = may attend (see --torch-masks).
    #[arg(long, value_name = "M.npy")]
    mask: Option<PathBuf>,
    /// Key padding mask [B, S]; true = real key (see --torch-masks). Combined with --mask.
    #[arg(long, value_name = "KPM.npy")]
    key_padding_mask: Option<PathBuf>,
    /// --mask and --key-padding-mask use PyTorch's nn.MultiheadAttention convention
    /// (true = masked out / padding).
    #[arg(long)]
    torch_masks: bool,
    /// Causal mask.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    causal: CausalArg,
    /// Valid key length of each batch element (masks key tails).
    #[arg(long, value_delimiter = ',', value_name = "LEN,..")]
    kv_lens: Option<Vec<usize>>,
    /// Output [B, L, d_model] (f32).
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Write the attention weights: [B, H, L, S], or [B, L, S] with --average-weights.
    #[arg(long, value_name = "W.npy")]
    weights_out: Option<PathBuf>,
    /// Average the weights over heads (PyTorch's average_attn_weights=True).
    #[arg(long)]
    average_weights: bool,
    /// Draw the first batch element's attention weights as a PNG (one panel per head, or one
    /// for --average-weights), rows = queries, columns = keys, labelled with --tokens or indices.
    #[arg(long, value_name = "MAP.png")]
    heatmap: Option<PathBuf>,
    /// Pixels per weight in the heatmap [default: 8, or 20 with --tokens/--key-tokens].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    cell: Option<u32>,
    /// The heatmap's query labels, whitespace-separated, one per query position (L): e.g.
    /// "the cat sat on the mat". In self-attention they label the keys too.
    #[arg(long, value_name = "\"W1 W2 ..\"", requires = "heatmap")]
    tokens: Option<String>,
    /// The heatmap's key labels in cross-attention, whitespace-separated, one per key position
    /// (S) [default: indices].
    #[arg(long, value_name = "\"W1 W2 ..\"", requires = "heatmap")]
    key_tokens: Option<String>,
    /// Upstream gradient dY [B, L, d_model] of the output: also run the backward and write
    /// the gradients of sum(dY * Y) to --grads-out.
    #[arg(long, value_name = "DY.npy", requires = "grads_out")]
    dout: Option<PathBuf>,
    /// Gradients (f32 safetensors): `query` (in self-attention the total through q, k and v),
    /// `key` and `value` with --key/--value, and each parameter under its key in the weights
    /// file (with --prefix), as PyTorch's `{n: p.grad}` names them.
    #[arg(long, value_name = "G.safetensors", requires = "dout")]
    grads_out: Option<PathBuf>,
    /// Run the f64 CPU reference instead of the GPU.
    #[arg(long)]
    cpu: bool,
    /// Device storage format of the weights, activations and output (f32 accumulation)
    /// [default: the weights file's: f16 or bf16 for F16/BF16 tensors, else f32]. Inputs and
    /// weights are rounded to it (to nearest even); the output, rounded to it, is written as
    /// f32. With --cpu the reference runs on the rounded inputs and weights.
    #[arg(long, value_parser = crate::storage_parser())]
    storage: Option<Storage>,
}

/// `mha`: the multi-head attention layer on the `.npy` inputs.
pub(crate) fn mha(a: &MhaArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([
        ("--out", Some(a.out.as_path())),
        ("--weights-out", a.weights_out.as_deref()),
        ("--heatmap", a.heatmap.as_deref()),
        ("--grads-out", a.grads_out.as_deref()),
    ])?;
    let weight_bytes = std::fs::read(&a.weights)
        .map_err(|e| format!("weights: cannot read {}: {e}", a.weights.display()))?;
    let weights = MhaWeights::from_safetensors_prefixed(&weight_bytes, &a.prefix, a.heads)?;
    if let Some(g) = a.kv_heads {
        if g != weights.config.num_kv_heads {
            return Err(format!(
                "--kv-heads {g}, but the weights have {} key/value heads",
                weights.config.num_kv_heads
            )
            .into());
        }
    }
    let st = a.storage.unwrap_or(weights.storage);
    let weights = weights.with_storage(st);
    let inputs = Inputs::read(a, st)?;
    // The heatmap's labels, checked against L and S before any work.
    let labels = labels(a, &inputs)?;
    // One set of options for the GPU layer and the CPU reference.
    let options = Options {
        causal: a.causal.into(),
        mask: inputs.mask.as_ref().map(|m| m.into()),
        kv_lens: a.kv_lens.clone(),
        ..Default::default()
    };
    let need = match (a.weights_out.is_some() || a.heatmap.is_some(), a.average_weights) {
        (false, _) => NeedWeights::No,
        (true, false) => NeedWeights::PerHead,
        (true, true) => NeedWeights::Averaged,
    };
    let run = if a.cpu {
        run_cpu(&weights, &inputs, &options, need, st)?
    } else {
        run_gpu(&weights, &inputs, &options, need, st)?
    };
    println!("{}", run.how);
    write_array(&a.out, "output", &run.out)?;
    if let (Some((grads, elapsed)), Some(path)) = (&run.grads, &a.grads_out) {
        write_grads(a, &weight_bytes, grads, *elapsed, path)?;
    }
    if let Some(p) = &a.weights_out {
        write_array(p, "weights", run.weights.as_ref().ok_or("no attention weights")?)?;
    }
    if let Some(p) = &a.heatmap {
        write_heatmap(a, run.weights.as_ref().ok_or("no attention weights")?, &labels, p)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The layer's inputs read from their files (rounded to the layer's format), masks combined.
struct Inputs {
    x: ndarray::Array3<f32>,
    key: Option<ndarray::Array3<f32>>,
    value: Option<ndarray::Array3<f32>>,
    mask: Option<ndarray::ArrayD<bool>>,
    dout: Option<ndarray::Array3<f32>>,
}

impl Inputs {
    fn read(a: &MhaArgs, st: Storage) -> CliResult<Inputs> {
        let round = |x: f32| st.round(x);
        let read3 = |p: &Option<PathBuf>, name, shape| {
            p.as_deref()
                .map(|p| read_3d(p, name, shape).map(|k| k.mapv(round)))
                .transpose()
        };
        let read_mask = |p: &Option<PathBuf>, name| {
            p.as_deref()
                .map(|p| read_array::<bool>(p, name, "bool ('|b1')", "np.asarray(m, dtype=bool)"))
                .transpose()
                .map(|m| m.map(|m| if a.torch_masks { m.mapv(|x| !x) } else { m }))
        };
        let mask = read_mask(&a.mask, "mask")?;
        let kpm = read_mask(&a.key_padding_mask, "key padding mask")?;
        Ok(Inputs {
            x: read_3d(&a.query, "query", "[B, L, d_model]")?.mapv(round),
            key: read3(&a.key, "key", "[B, S, kdim]")?,
            value: read3(&a.value, "value", "[B, S, vdim]")?,
            mask: combine_masks(mask, kpm)?,
            dout: read3(&a.dout, "dout", "[B, L, d_model]")?,
        })
    }
}

/// The heatmap's query and key labels (`--tokens`, `--key-tokens`: the keys are the queries'
/// words in self-attention), checked against L and S.
type Labels = (Option<Vec<String>>, Option<Vec<String>>);

fn labels(a: &MhaArgs, inputs: &Inputs) -> CliResult<Labels> {
    let words = |s: &Option<String>| {
        s.as_deref()
            .map(|t| t.split_whitespace().map(String::from).collect::<Vec<_>>())
    };
    let (queries, mut keys) = (words(&a.tokens), words(&a.key_tokens));
    let q_len = inputs.x.dim().1;
    let k_len = inputs.key.as_ref().map_or(q_len, |k| k.dim().1);
    if let Some(q) = &queries {
        if q.len() != q_len {
            return Err(format!(
                "--tokens has {} words, but the queries have length L = {q_len}",
                q.len()
            )
            .into());
        }
        if inputs.key.is_none() && keys.is_none() {
            keys = queries.clone();
        }
    }
    if let Some(k) = &keys {
        if k.len() != k_len {
            return Err(format!(
                "--key-tokens has {} words, but the keys have length S = {k_len}",
                k.len()
            )
            .into());
        }
    }
    Ok((queries, keys))
}

/// What one run gives: the output, the attention weights asked for, how it ran, and the
/// gradients (with the time they took) when `--dout` is given.
struct Run {
    out: ndarray::ArrayD<f32>,
    weights: Option<ndarray::ArrayD<f32>>,
    how: String,
    grads: Option<(MhaGrads<f32>, std::time::Duration)>,
}

/// The CPU reference (f64 on the rounded inputs and weights).
fn run_cpu(
    weights: &MhaWeights,
    inputs: &Inputs,
    options: &Options,
    need: NeedWeights,
    st: Storage,
) -> CliResult<Run> {
    let cross = match (&inputs.key, &inputs.value) {
        (Some(k), Some(v)) => MhaInputs::cross(inputs.x.view(), k.view(), v.view()),
        _ => MhaInputs::self_attention(inputs.x.view()),
    };
    let started = Instant::now();
    let r = reference::mha(weights, &cross, options)?;
    let how = format!(
        "ran the CPU reference (f64 on {st} inputs and weights, output rounded to {st}, written as f32) in {:.3} ms",
        ms(started.elapsed())
    );
    let w = match need {
        NeedWeights::No => None,
        NeedWeights::PerHead => Some(r.weights.mapv(|x| x as f32).into_dyn()),
        NeedWeights::Averaged => Some(
            reference::mean_over_heads(&r.weights)
                .mapv(|x| x as f32)
                .into_dyn(),
        ),
        other => return Err(format!("--cpu: no reference weights for {other:?}").into()),
    };
    let started = Instant::now();
    let grads = inputs
        .dout
        .as_ref()
        .map(|dy| reference::mha_backward(weights, &cross, options, dy.view()))
        .transpose()?
        .map(|g| (g.mapv(|x| x as f32), started.elapsed()));
    Ok(Run {
        out: r.out.mapv(|x| st.round(x as f32)).into_dyn(),
        weights: w,
        how,
        grads,
    })
}

/// The layer on the GPU (the backward too with `--dout`).
fn run_gpu(
    weights: &MhaWeights,
    inputs: &Inputs,
    options: &Options,
    need: NeedWeights,
    st: Storage,
) -> CliResult<Run> {
    let ctx = context()?;
    let layer = MultiHeadAttention::new(&ctx, weights)?;
    let t = |x| Tensor::from(x).with_storage(st);
    let mut f = layer
        .forward(t(&inputs.x))
        .options(options.clone())
        .need_weights(need);
    if let (Some(k), Some(v)) = (&inputs.key, &inputs.value) {
        f = f.key_value(t(k), t(v));
    }
    let started = Instant::now();
    let how = |what: &str| {
        format!(
            "ran {what} on {}, storage {st}, in {:.3} ms (incl. upload, shader compilation and readback)",
            ctx.describe(),
            ms(started.elapsed())
        )
    };
    match &inputs.dout {
        // The backward runs the forward and returns its output.
        Some(dy) if need == NeedWeights::No => {
            let g = f.backward(t(dy)).run_blocking(&ctx)?;
            let elapsed = started.elapsed();
            Ok(Run {
                out: g.output.clone().into_dyn(),
                weights: None,
                how: how("forward and backward"),
                grads: Some((g, elapsed)),
            })
        }
        _ => {
            let r = f.clone().run_blocking(&ctx)?;
            let how = how("the forward");
            let w = r
                .weights
                .map(|w| w.into_dyn())
                .or(r.avg_weights.map(|w| w.into_dyn()));
            let started = Instant::now();
            let grads = inputs
                .dout
                .as_ref()
                .map(|dy| f.backward(t(dy)).run_blocking(&ctx))
                .transpose()?
                .map(|g| (g, started.elapsed()));
            Ok(Run {
                out: r.output.into_dyn(),
                weights: w,
                how,
                grads,
            })
        }
    }
}

/// The inputs' and the weights' gradients as a safetensors state dict (PyTorch's names).
fn write_grads(
    a: &MhaArgs,
    weight_bytes: &[u8],
    grads: &MhaGrads<f32>,
    elapsed: std::time::Duration,
    path: &std::path::Path,
) -> CliResult<()> {
    let packed = safetensors::SafeTensors::deserialize(weight_bytes)
        .map(|st| st.tensor(&format!("{}in_proj_weight", a.prefix)).is_ok())
        .unwrap_or(false);
    let mut tensors: Vec<(String, ndarray::ArrayD<f32>)> =
        vec![("query".into(), grads.query.clone().into_dyn())];
    if let (Some(k), Some(v)) = (&grads.key, &grads.value) {
        tensors.push(("key".into(), k.clone().into_dyn()));
        tensors.push(("value".into(), v.clone().into_dyn()));
    }
    tensors.extend(grads.state_dict(packed, &a.prefix));
    write_safetensors(path, &tensors)?;
    println!(
        "wrote {} gradients to {} (computed in {:.3} ms, {})",
        tensors.len(),
        path.display(),
        ms(elapsed),
        if a.cpu {
            "CPU reference, f64 rounded to f32"
        } else {
            "GPU"
        }
    );
    Ok(())
}

/// Batch element 0's attention weights `w` as a heatmap: `[H, L, S]` per head, `[1, L, S]`
/// averaged, with the tokens as labels.
fn write_heatmap(
    a: &MhaArgs,
    w: &ndarray::ArrayD<f32>,
    (queries, keys): &Labels,
    p: &std::path::Path,
) -> CliResult<()> {
    let first = w.index_axis(ndarray::Axis(0), 0).to_owned();
    let panels = match first.ndim() {
        2 => first.insert_axis(ndarray::Axis(0)),
        _ => first,
    }
    .into_dimensionality::<ndarray::Ix3>()?;
    let labelled = queries.is_some() || keys.is_some();
    let mut map = wgpu_attention::heatmap::Heatmap::new(panels.view()).cell(a.cell.unwrap_or(if labelled {
        20
    } else {
        8
    }));
    if let Some(q) = queries {
        map = map.queries(q);
    }
    if let Some(k) = keys {
        map = map.keys(k);
    }
    if a.average_weights {
        map = map.titles(&["mean over heads"]);
    }
    map.write(p)?;
    println!("wrote heatmap of {} panel(s) to {}", panels.dim().0, p.display());
    Ok(())
}

/// Write f32 tensors to a safetensors file.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, ndarray::ArrayD<f32>)]) -> CliResult<()> {
    use safetensors::tensor::TensorView;
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(k, a)| {
            let bytes = a.iter().flat_map(|x| x.to_le_bytes()).collect();
            (k.clone(), a.shape().to_vec(), bytes)
        })
        .collect();
    let views = data
        .iter()
        .map(|(k, shape, bytes)| {
            Ok((
                k.clone(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("grads: cannot write {}: {e}", path.display()))?;
    Ok(())
}
