//! The crate's errors.

/// What can go wrong between burn's tensors and the kernels; each is returned before any GPU
/// work of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The attention call itself was refused or failed (shapes, options, device errors).
    #[error(transparent)]
    Attention(#[from] wgpu_attention::Error),
    /// A tensor of another burn runtime or backend (CUDA, ROCm, the CPU): the kernels run on
    /// burn's wgpu runtime only.
    #[error("{name}: not a tensor of burn's wgpu runtime ({detail})")]
    NotWgpu {
        /// The tensor (`q`, `k`, `v`, `bias`, `mask`).
        name: &'static str,
        /// What it is instead.
        detail: String,
    },
    /// A wgpu device that this crate did not make or adopt: burn made it lazily, so its
    /// wgpu handles cannot be had. Make the device with [`device_on`](crate::device_on) or
    /// [`new_device`](crate::new_device).
    #[error("{name}: burn's wgpu device {device} has no wgpu-attention context (make it with wgpu_attention_burn::device_on or new_device)")]
    UnknownDevice {
        /// The tensor.
        name: &'static str,
        /// burn's name of the device.
        device: String,
    },
    /// Tensors on different devices.
    #[error("{name} is on {got}, q on {want}: every tensor must be on q's device")]
    DifferentDevices {
        /// The tensor.
        name: &'static str,
        /// Its device.
        got: String,
        /// q's device.
        want: String,
    },
    /// A format the kernels do not store: f32, f16 and bf16 only.
    #[error("{name}: burn dtype {dtype} is not one of the kernels' formats (f32, f16, bf16)")]
    DType {
        /// The tensor.
        name: &'static str,
        /// Its burn dtype.
        dtype: String,
    },
    /// The context cannot hand its device to burn (made by `Context::from_device`, which has
    /// no adapter or instance; use `Context::new` or `Context::from_instance_parts`), or burn
    /// refused it.
    #[error("burn's wgpu runtime on this context: {0}")]
    Setup(String),
}

/// This crate's `Result`.
pub type Result<T> = std::result::Result<T, Error>;
