//! Named multi-head attention benchmark shapes, shared by the command-line tool's `bench` and
//! the criterion benchmark. The layer is Xavier-initialised (seed 0) and its input uploaded
//! once, so a timed forward pass measures projections, attention and the readback of the
//! output.

use wgpu::util::DeviceExt;

use crate::device::context::Context;
use crate::mha::MhaConfig;
use crate::mha::MhaForward;
use crate::mha::MhaWeights;
use crate::mha::MultiHeadAttention;
use crate::problem::Causal;
use crate::tensor::Tensor;

/// A self-attention layer and its input size.
#[derive(Debug, Clone, PartialEq)]
pub struct MhaShape {
    /// Name used on the command line and in reports.
    pub name: &'static str,
    /// Batch `B`.
    pub batch: usize,
    /// Sequence length `L = S`.
    pub seq: usize,
    /// Model width.
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Causal alignment.
    pub causal: Causal,
    /// Part of the default `bench` set.
    pub default: bool,
}

/// The named layer shapes, in report order.
pub const MHA_SHAPES: &[MhaShape] = &[
    MhaShape {
        name: "mha_bert_base_l128",
        batch: 1,
        seq: 128,
        d_model: 768,
        heads: 12,
        kv_heads: 12,
        causal: Causal::None,
        default: true,
    },
    MhaShape {
        name: "mha_bert_base_l512",
        batch: 1,
        seq: 512,
        d_model: 768,
        heads: 12,
        kv_heads: 12,
        causal: Causal::None,
        default: true,
    },
    MhaShape {
        name: "mha_gqa_h32_kv8_d128_l128",
        batch: 1,
        seq: 128,
        d_model: 4096,
        heads: 32,
        kv_heads: 8,
        causal: Causal::TopLeft,
        default: false,
    },
];

/// The shape called `name`.
pub fn find(name: &str) -> Option<&'static MhaShape> {
    MHA_SHAPES.iter().find(|s| s.name == name)
}

impl MhaShape {
    /// The layer's config.
    pub fn config(&self) -> MhaConfig {
        MhaConfig::new(self.d_model, self.heads).kv_heads(self.kv_heads)
    }

    /// FLOPs of one forward pass: (projections, attention).
    pub fn flops(&self) -> (f64, f64) {
        let (b, n, d) = (self.batch as f64, self.seq as f64, self.d_model as f64);
        let kv = (self.kv_heads * (self.d_model / self.heads)) as f64;
        let proj = 2.0 * b * n * (d * d + 2.0 * d * kv + d * d);
        let mut attn = 4.0 * b * self.heads as f64 * n * n * (self.d_model / self.heads) as f64;
        if self.causal != Causal::None {
            attn /= 2.0;
        }
        (proj, attn)
    }

    /// Upload the layer and its input (f32).
    pub fn prepare(&'static self, ctx: &Context) -> crate::error::Result<MhaBench> {
        self.prepare_as(ctx, crate::storage::Storage::F32)
    }

    /// Upload the layer (weights, activations and output in `storage`) and its input in
    /// `storage`.
    pub fn prepare_as(
        &'static self,
        ctx: &Context,
        storage: crate::storage::Storage,
    ) -> crate::error::Result<MhaBench> {
        let weights = MhaWeights::xavier_uniform(self.config(), 0)?.with_storage(storage);
        let layer = MultiHeadAttention::new(ctx, &weights)?;
        let n = self.batch * self.seq * self.d_model;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 2001) as f32 / 1000.0) - 1.0)
            .collect();
        let x = ctx
            .device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("mha bench input"),
                contents: &storage.encode(&x),
                usage: wgpu::BufferUsages::STORAGE,
            });
        Ok(MhaBench {
            shape: self,
            layer,
            x,
            storage,
        })
    }
}

/// A prepared layer and input.
pub struct MhaBench {
    shape: &'static MhaShape,
    layer: MultiHeadAttention,
    x: wgpu::Buffer,
    storage: crate::storage::Storage,
}

impl MhaBench {
    /// The forward pass to time.
    pub fn forward(&self) -> MhaForward<'_> {
        let s = self.shape;
        self.layer
            .forward(Tensor::from_buffer(
                &self.x,
                self.storage,
                &[s.batch, s.seq, s.d_model],
            ))
            .causal(s.causal)
    }

    /// The layer's backward on the same input, with the input also as the upstream gradient.
    pub fn backward(&self) -> crate::mha::MhaBackward<'_> {
        let s = self.shape;
        self.forward().backward(Tensor::from_buffer(
            &self.x,
            self.storage,
            &[s.batch, s.seq, s.d_model],
        ))
    }
}
