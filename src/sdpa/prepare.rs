//! [`Sdpa::prepare`]: a call's kernels compiled ahead of a generation loop, for every key
//! length it will see, on zero inputs recorded into an encoder that is never submitted.

use super::plan::{self, Plan};
use super::Sdpa;
use crate::device::context::Context;
use crate::error::Result;
use crate::options::Options;
use crate::problem::{PagedKv, Problem};
use crate::storage::Storage;
use crate::tensor::Tensor;

impl Sdpa<'_> {
    /// Compile, before the first call, every kernel this call can need as its key length
    /// grows over `seq_kv` (a generation loop's KV cache): the query, head and mask shapes,
    /// formats, options and path are this call's, only `S` varies. A loop that crosses a path
    /// threshold (the decode path from 512 keys) or a form's size limit then compiles nothing
    /// mid-generation. Returns the number of distinct kernel forms prepared. No result is
    /// computed: each form is recorded once on zero inputs of the smallest length that needs
    /// it, into an encoder that is never submitted; on CPU adapters the fastest forms, compiled
    /// in the background, are waited for. A [`paged`](Sdpa::paged) call is prepared with every
    /// sequence at each length (from its query count up: a sequence has at least as many keys
    /// as new queries), in caches of its block size and layout; RoPE with it.
    pub async fn prepare(&self, ctx: &Context, seq_kv: std::ops::RangeInclusive<usize>) -> Result<usize> {
        let base = self.problem()?;
        let caps = ctx.caps();
        let req = self.request();
        // The smallest S of each distinct form (tiles that are run-time parameters excluded).
        let mut forms: Vec<(String, usize)> = Vec::new();
        for s in seq_kv {
            if s == 0 || (base.paged.is_some() && s < base.seq_q) {
                continue;
            }
            let mut p = base.clone();
            p.seq_kv = s;
            if let Some(lens) = &mut p.kv_lens {
                lens.iter_mut().for_each(|l| *l = s as u32);
            }
            let plan = Plan::new(&p, &req, &caps)?;
            let tiles = match plan.tiles() {
                plan::Tiles::Decode { invocations, .. } => format!("decode {invocations}"),
                plan::Tiles::Unfused { .. } => "unfused".to_string(),
                t => format!("{t:?}"),
            };
            // The kernel's variant (its prelude) and the tiles, which set the passes around it
            // (a decode's merge).
            let variant = plan
                .variant()
                .map(|(spec, prelude)| format!("{} {}", spec.name, prelude.text()))
                .unwrap_or_default();
            let key = format!("{:?} {tiles}\n{variant}", plan.form());
            if !forms.iter().any(|(k, _)| *k == key) {
                forms.push((key, s));
            }
        }
        for &(_, s) in &forms {
            self.prepare_at(ctx, &base, s).await?;
        }
        ctx.wait_idle()?;
        Ok(forms.len())
    }

    /// [`Sdpa::prepare`]'s recording of one form: this call on zero inputs with `s` keys (views
    /// kept as views), into an encoder that is never submitted.
    async fn prepare_at(&self, ctx: &Context, base: &Problem, s: usize) -> Result<()> {
        let [b, hq, l, e] = base.q_shape();
        let (hkv, ev) = (base.kv_heads, base.head_dim_v);
        let f = base.storage;
        let zeros = |n: usize| vec![0f32; n];
        let paged = base.paged.as_ref().map(|pg| zero_pages(pg, [b, hkv, s, e, ev]));
        let (k_shape, v_shape) = match &paged {
            Some((_, kd, vd)) => (*kd, *vd),
            None => ([b, hkv, s, e], [b, hkv, s, ev]),
        };
        let (q, k, v) = (
            zeros(b * hq * l * e),
            zeros(k_shape.iter().product()),
            zeros(v_shape.iter().product()),
        );
        let with_s = |shape: &[usize]| -> Vec<usize> {
            let mut sh = shape.to_vec();
            if let Some(last) = sh.last_mut() {
                if *last != 1 {
                    *last = s;
                }
            }
            sh
        };
        let (mask_shape, bias_shape) = (
            self.options.mask.as_ref().map(|m| with_s(&m.shape)),
            self.options.bias.as_ref().map(|b| with_s(&b.shape)),
        );
        let mask_data = mask_shape.as_ref().map(|sh| vec![true; sh.iter().product()]);
        let bias_data = bias_shape.as_ref().map(|sh| zeros(sh.iter().product()));
        let options = self.stand_in_options(
            [b, l, s],
            mask_shape.as_deref().zip(mask_data.as_deref()),
            bias_shape.as_deref().zip(bias_data.as_deref()),
            paged.is_none(),
        );
        // Tensors read through views are prepared as views (the kernels differ); a paged call's
        // caches are dense.
        let shapes = [[b, hq, l, e], k_shape, v_shape, base.out_shape()];
        let formats = [f.q, f.k, f.v, f.out];
        let dense = paged.is_none();
        let given = [
            Some(&self.q),
            Some(&self.k).filter(|_| dense),
            Some(&self.v).filter(|_| dense),
            self.out.as_ref(),
        ];
        let scratch_views = given
            .into_iter()
            .zip(shapes)
            .zip(formats)
            .map(|((t, shape), st)| {
                t.map(|t| scratch_view(ctx, t, shape, st))
                    .transpose()
                    .map(Option::flatten)
            })
            .collect::<Result<Vec<_>>>()?;
        let viewed = |i: usize| {
            scratch_views[i].as_ref().map(|(buf, rem, spec)| {
                let mut t = Tensor::from_buffer(buf, formats[i], &shapes[i]).at_offset(*rem);
                t.view = spec.clone();
                t
            })
        };
        let mut call = Sdpa::new(
            viewed(0).unwrap_or_else(|| Tensor::from_slice(&q, &shapes[0]).with_storage(f.q)),
            viewed(1).unwrap_or_else(|| Tensor::from_slice(&k, &shapes[1]).with_storage(f.k)),
            viewed(2).unwrap_or_else(|| Tensor::from_slice(&v, &shapes[2]).with_storage(f.v)),
        )
        .options(options)
        .path(self.path)
        .output_storage(f.out);
        if let Some(out) = viewed(3) {
            call = call.output_into(out);
        }
        call.paged = paged.map(|(pg, ..)| Ok(pg));
        if let Some(r) = self.rope {
            call = call.rope(r);
        }
        (call.weights, call.lse, call.max_scores_bytes) = (self.weights, self.lse, self.max_scores_bytes);
        ctx.scoped(|| {
            let mut encoder = ctx
                .device()
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgpu-attention prepare"),
                });
            call.record(ctx, &mut encoder).map(|_| ())
        })
        .await?;
        Ok(())
    }

    /// [`Sdpa::prepare_at`]'s options: this call's, with `s` keys for `[b, l]` queries, the
    /// stand-in mask and bias (`(shape, values)`), key lengths where the call has them (a paged
    /// call's come with its pages) and zero document ids.
    fn stand_in_options<'x>(
        &'x self,
        [b, l, s]: [usize; 3],
        mask: Option<(&'x [usize], &'x [bool])>,
        bias: Option<(&'x [usize], &'x [f32])>,
        dense: bool,
    ) -> Options<'x> {
        let bias_st = self.options.bias.as_ref().map_or(Storage::F32, |b| b.storage());
        Options {
            causal: self.options.causal,
            scale: self.options.scale,
            mask: mask.map(|(sh, d)| crate::tensor::Mask::from_slice(d, sh)),
            bias: bias.map(|(sh, d)| Tensor::from_slice(d, sh).with_storage(bias_st)),
            kv_lens: self
                .options
                .kv_lens
                .as_ref()
                .filter(|_| dense)
                .map(|l| vec![s; l.len()]),
            window: self.options.window,
            sink_tokens: self.options.sink_tokens,
            softcap: self.options.softcap,
            alibi: self.options.alibi.clone(),
            sink_logits: self.options.sink_logits.clone(),
            doc_ids: self.options.doc_ids.as_ref().map(|_| crate::problem::DocIds {
                q: vec![0; b * l],
                k: vec![0; b * s],
            }),
            user_mod: self.options.user_mod.clone(),
        }
    }

    /// Blocking version of [`prepare`](Sdpa::prepare).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn prepare_blocking(&self, ctx: &Context, seq_kv: std::ops::RangeInclusive<usize>) -> Result<usize> {
        pollster::block_on(self.prepare(ctx, seq_kv))
    }
}

/// [`Sdpa::prepare`]'s paged caches for `[B, Hkv, S, E, Ev]`: each sequence's S keys in blocks
/// of its own (caches `[B·blocks, BS, Hkv, E]` in `pg`'s layout), its table those blocks in
/// order, valid by construction (no table to check); with the K and V caches' shapes.
fn zero_pages(
    pg: &crate::problem::Paged,
    [b, hkv, s, e, ev]: [usize; 5],
) -> (PagedKv, [usize; 4], [usize; 4]) {
    let per = s.div_ceil(pg.block_size);
    let dims = |d: usize| {
        let [nb, bs] = [b * per, pg.block_size];
        if pg.head_major {
            [nb, hkv, bs, d]
        } else {
            [nb, bs, hkv, d]
        }
    };
    let table = crate::problem::Paged {
        num_blocks: b * per,
        max_blocks: per,
        table: (0..(b * per) as u32).collect(),
        ..pg.clone()
    };
    (
        PagedKv::new(table, vec![s; b], [hkv, e, ev], [0, 0]),
        dims(e),
        dims(ev),
    )
}

/// For [`Sdpa::prepare`]: when `t` is read through a view, zeroed scratch holding a tensor of
/// `shape` in format `st` read the same way (the same offset within 256 bytes, the same layout,
/// its capacity at least `shape`'s S): its buffer, that offset and the view request.
fn scratch_view(
    ctx: &Context,
    t: &Tensor,
    shape: [usize; 4],
    st: Storage,
) -> Result<Option<(wgpu::Buffer, u64, crate::view::ViewSpec)>> {
    let crate::tensor::TensorData::Gpu { offset, .. } = &t.data else {
        return Ok(None);
    };
    let rem = offset % crate::view::BIND_ALIGN;
    if !t.view.is_set() && rem == 0 {
        return Ok(None);
    }
    let mut spec = t.view.clone();
    if let Some(c) = &mut spec.capacity {
        *c = (*c).max(shape[2]);
    }
    let view =
        crate::view::resolve("prepare", &spec, &shape, rem, st)?.unwrap_or(crate::view::View::dense(shape));
    let bytes = (rem + st.bytes(view.extent(shape))).next_multiple_of(16);
    Ok(Some((
        crate::device::buffers::scratch(ctx, "prepare view", bytes),
        rem,
        spec,
    )))
}
