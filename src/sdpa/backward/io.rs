//! The bindings every gradient kernel shares, recorded by both backward paths.

/// What the gradient kernels bind: mask, bias, q, k, v, dout, stats.
pub(super) struct Io<'b> {
    pub(super) mask: wgpu::BufferBinding<'b>,
    pub(super) bias: wgpu::BufferBinding<'b>,
    pub(super) q: wgpu::BufferBinding<'b>,
    pub(super) k: wgpu::BufferBinding<'b>,
    pub(super) v: wgpu::BufferBinding<'b>,
    pub(super) dout: wgpu::BufferBinding<'b>,
    pub(super) stats: wgpu::BufferBinding<'b>,
}

impl<'b> Io<'b> {
    /// The bindings of a gradient kernel writing `out`.
    pub(super) fn with_out<'c>(&self, out: wgpu::BufferBinding<'c>) -> Vec<wgpu::BufferBinding<'c>>
    where
        'b: 'c,
    {
        vec![
            self.mask.clone(),
            self.bias.clone(),
            self.q.clone(),
            self.k.clone(),
            self.v.clone(),
            self.dout.clone(),
            self.stats.clone(),
            out,
        ]
    }
}
