//! `mha`: a multi-head attention layer (PyTorch `nn.MultiheadAttention` weights) on `.npy`
//! inputs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::{MhaWeights, MultiHeadAttention, NeedWeights, Options, Storage, Tensor};

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
    let round = |x: f32| st.round(x);
    let x = read_3d(&a.query, "query", "[B, L, d_model]")?.mapv(round);
    let key = a
        .key
        .as_deref()
        .map(|p| read_3d(p, "key", "[B, S, kdim]").map(|k| k.mapv(round)))
        .transpose()?;
    let value = a
        .value
        .as_deref()
        .map(|p| read_3d(p, "value", "[B, S, vdim]").map(|v| v.mapv(round)))
        .transpose()?;
    let mask = a
        .mask
        .as_deref()
        .map(|p| read_array::<bool>(p, "mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
        .transpose()?
        .map(|m| if a.torch_masks { m.mapv(|x| !x) } else { m });
    let kpm = a
        .key_padding_mask
        .as_deref()
        .map(|p| read_array::<bool>(p, "key padding mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
        .transpose()?
        .map(|m| if a.torch_masks { m.mapv(|x| !x) } else { m });
    let mask = combine_masks(mask, kpm)?;
    // The heatmap's labels, checked against L and S before any work.
    let words = |s: &Option<String>| {
        s.as_deref()
            .map(|t| t.split_whitespace().map(String::from).collect::<Vec<_>>())
    };
    let (queries, mut keys) = (words(&a.tokens), words(&a.key_tokens));
    let q_len = x.dim().1;
    let k_len = key.as_ref().map_or(q_len, |k| k.dim().1);
    if let Some(q) = &queries {
        if q.len() != q_len {
            return Err(format!(
                "--tokens has {} words, but the queries have length L = {q_len}",
                q.len()
            )
            .into());
        }
        if key.is_none() && keys.is_none() {
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
    // One set of options for the GPU layer and the CPU reference.
    let options = Options {
        causal: a.causal.into(),
        mask: mask.as_ref().map(|m| m.into()),
        kv_lens: a.kv_lens.clone(),
        ..Default::default()
    };
    let need = match (a.weights_out.is_some() || a.heatmap.is_some(), a.average_weights) {
        (false, _) => NeedWeights::No,
        (true, false) => NeedWeights::PerHead,
        (true, true) => NeedWeights::Averaged,
    };
    let dout = a
        .dout
        .as_deref()
        .map(|p| read_3d(p, "dout", "[B, L, d_model]").map(|d| d.mapv(round)))
        .transpose()?;
    // The gradients, when --dout is given, and the time they took.
    let (out, w, how, grads) = if a.cpu {
        let inputs = match (&key, &value) {
            (Some(k), Some(v)) => MhaInputs::cross(x.view(), k.view(), v.view()),
            _ => MhaInputs::self_attention(x.view()),
        };
        let started = Instant::now();
        let r = reference::mha(&weights, &inputs, &options)?;
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
        let grads = dout
            .as_ref()
            .map(|dy| reference::mha_backward(&weights, &inputs, &options, dy.view()))
            .transpose()?
            .map(|g| (g.mapv(|x| x as f32), started.elapsed()));
        (r.out.mapv(|x| st.round(x as f32)).into_dyn(), w, how, grads)
    } else {
        let ctx = context()?;
        let layer = MultiHeadAttention::new(&ctx, &weights)?;
        let t = |x| Tensor::from(x).with_storage(st);
        let mut f = layer.forward(t(&x)).options(options.clone()).need_weights(need);
        if let (Some(k), Some(v)) = (&key, &value) {
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
        match &dout {
            // The backward runs the forward and returns its output.
            Some(dy) if need == NeedWeights::No => {
                let g = f.backward(t(dy)).run_blocking(&ctx)?;
                let elapsed = started.elapsed();
                (
                    g.output.clone().into_dyn(),
                    None,
                    how("forward and backward"),
                    Some((g, elapsed)),
                )
            }
            _ => {
                let r = f.clone().run_blocking(&ctx)?;
                let how = how("the forward");
                let w = r
                    .weights
                    .map(|w| w.into_dyn())
                    .or(r.avg_weights.map(|w| w.into_dyn()));
                let started = Instant::now();
                let grads = dout
                    .as_ref()
                    .map(|dy| f.backward(t(dy)).run_blocking(&ctx))
                    .transpose()?
                    .map(|g| (g, started.elapsed()));
                (r.output.into_dyn(), w, how, grads)
            }
        }
    };
    println!("{how}");
    write_array(&a.out, "output", &out)?;
    if let (Some((grads, elapsed)), Some(path)) = (&grads, &a.grads_out) {
        let packed = safetensors::SafeTensors::deserialize(&weight_bytes)
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
            ms(*elapsed),
            if a.cpu {
                "CPU reference, f64 rounded to f32"
            } else {
                "GPU"
            }
        );
    }
    if let Some(p) = &a.weights_out {
        write_array(p, "weights", w.as_ref().ok_or("no attention weights")?)?;
    }
    if let Some(p) = &a.heatmap {
        let w = w.as_ref().ok_or("no attention weights")?;
        // Batch element 0: [H, L, S] per head, [1, L, S] averaged.
        let first = w.index_axis(ndarray::Axis(0), 0).to_owned();
        let panels = match first.ndim() {
            2 => first.insert_axis(ndarray::Axis(0)),
            _ => first,
        }
        .into_dimensionality::<ndarray::Ix3>()?;
        let labelled = queries.is_some() || keys.is_some();
        let mut map = wgpu_attention::heatmap::Heatmap::new(panels.view())
            .cell(a.cell.unwrap_or(if labelled { 20 } else { 8 }));
        if let Some(q) = &queries {
            map = map.queries(q);
        }
        if let Some(k) = &keys {
            map = map.keys(k);
        }
        if a.average_weights {
            map = map.titles(&["mean over heads"]);
        }
        map.write(p)?;
        println!("wrote heatmap of {} panel(s) to {}", panels.dim().0, p.display());
    }
    Ok(ExitCode::SUCCESS)
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
