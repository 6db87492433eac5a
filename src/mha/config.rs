//! The shape of a multi-head attention layer and its divisibility rules.

use crate::error::{Error, Result};

/// The shape of a multi-head attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MhaConfig {
    /// Model width `E` (query input width and output width).
    pub d_model: usize,
    /// Query heads `H`; must divide `d_model` (head dim `d_k = d_model / H`).
    pub num_heads: usize,
    /// Key/value heads `G`; must divide `num_heads` (`G = H`: standard, `G = 1`: multi-query).
    pub num_kv_heads: usize,
    /// Width of the key input (cross-attention); `d_model` by default.
    pub kdim: usize,
    /// Width of the value input (cross-attention); `d_model` by default.
    pub vdim: usize,
    /// Whether the projections have biases (used by [`MhaWeights::xavier_uniform`](crate::MhaWeights::xavier_uniform)).
    pub bias: bool,
}

impl MhaConfig {
    /// `d_model` wide, `num_heads` heads, standard (not grouped) heads, self-attention widths,
    /// with biases.
    pub fn new(d_model: usize, num_heads: usize) -> Self {
        MhaConfig {
            d_model,
            num_heads,
            num_kv_heads: num_heads,
            kdim: d_model,
            vdim: d_model,
            bias: true,
        }
    }

    /// Grouped-query attention with `g` key/value heads (1: multi-query).
    pub fn kv_heads(mut self, g: usize) -> Self {
        self.num_kv_heads = g;
        self
    }

    /// Key and value input widths for cross-attention.
    pub fn kv_dims(mut self, kdim: usize, vdim: usize) -> Self {
        self.kdim = kdim;
        self.vdim = vdim;
        self
    }

    /// With or without projection biases.
    pub fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Head dim `d_k = d_model / num_heads` (also the value head dim).
    pub fn head_dim(&self) -> usize {
        self.d_model / self.num_heads.max(1)
    }

    /// Check the divisibility rules.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidConfig { reason });
        if self.d_model == 0
            || self.num_heads == 0
            || self.num_kv_heads == 0
            || self.kdim == 0
            || self.vdim == 0
        {
            return bad(format!("every dimension must be positive: {self:?}"));
        }
        if !self.d_model.is_multiple_of(self.num_heads) {
            return bad(format!(
                "num_heads = {} does not divide d_model = {}",
                self.num_heads, self.d_model
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_kv_heads = {} does not divide num_heads = {}",
                self.num_kv_heads, self.num_heads
            ));
        }
        // Every weight matrix must be one a device can hold: refused here, before initialising
        // or loading weights allocates anything (a d_model of 10^5 would be 40 GB per matrix).
        let limit = crate::mha::weights::MAX_TENSOR_F32_BYTES;
        for (name, rows, cols) in [
            ("W_Q and W_O", self.d_model, self.d_model),
            ("W_K", self.kv_width(), self.kdim),
            ("W_V", self.kv_width(), self.vdim),
        ] {
            let bytes = (rows as u64).saturating_mul(cols as u64).saturating_mul(4);
            if bytes > limit {
                return bad(format!(
                    "{name} would be {rows} x {cols} = {bytes} bytes in f32, over the {limit} bytes one \
                     weight matrix may take"
                ));
            }
        }
        Ok(())
    }

    /// Rows of W_K and W_V: `num_kv_heads · d_k`.
    pub(crate) fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }
}
