//! The crate's one error type.
//!
//! Every input problem is reported before any GPU work starts; device problems (validation,
//! out-of-memory, device loss, failed readback) are captured with error scopes and returned.

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, with structured fields.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// wgpu found no adapter at all.
    #[error(
        "no GPU adapter found ({details}). {hint}",
        hint = NO_ADAPTER_HINT
    )]
    NoAdapter {
        /// What wgpu reported.
        details: String,
    },
    /// `WGPU_ADAPTER_NAME` was set but no adapter's name contains it.
    #[error("WGPU_ADAPTER_NAME={wanted:?} matches no adapter; available: {available:?}")]
    AdapterNotFound {
        /// The requested (lower-cased) substring.
        wanted: String,
        /// Names of the adapters that were found.
        available: Vec<String>,
    },
    /// The adapter refused to create a device.
    #[error("could not create a device: {0}")]
    RequestDevice(String),
    /// A tensor has the wrong number of dimensions.
    #[error("{tensor}: expected {expected} dimensions, got {actual} (shape {shape:?})")]
    WrongRank {
        /// Which tensor (`"q"`, `"k"`, `"mask"`, ...).
        tensor: &'static str,
        /// Expected rank.
        expected: usize,
        /// Actual rank.
        actual: usize,
        /// Actual shape.
        shape: Vec<usize>,
    },
    /// A tensor's shape does not agree with the others.
    #[error("{tensor}: expected shape {expected:?}, got {actual:?}")]
    ShapeMismatch {
        /// Which tensor.
        tensor: &'static str,
        /// The shape it must have, given the other tensors.
        expected: Vec<usize>,
        /// The shape it has.
        actual: Vec<usize>,
    },
    /// A name (of a path, a kernel form, ...) that the crate does not know.
    #[error("unknown {kind} {name:?} (expected one of: {expected})")]
    UnknownName {
        /// What was being named (`"path"`, ...).
        kind: &'static str,
        /// The name given.
        name: String,
        /// The names accepted.
        expected: &'static str,
    },
    /// A multi-head attention configuration breaks a divisibility rule.
    #[error("invalid multi-head attention config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// A weight file lacks a tensor the layer needs.
    #[error("weights: missing tensor {key:?}")]
    MissingWeight {
        /// The (prefixed) state-dict key.
        key: String,
    },
    /// A weight has the wrong shape.
    #[error("weights: {key:?} has shape {actual:?}, expected {expected:?}")]
    WeightShape {
        /// The state-dict key or field name.
        key: String,
        /// The shape it must have.
        expected: Vec<usize>,
        /// The shape it has.
        actual: Vec<usize>,
    },
    /// A weight file cannot be read or parsed, or holds an unsupported tensor.
    #[error("weights: {reason}")]
    WeightFile {
        /// What went wrong.
        reason: String,
    },
    /// A dimension is zero.
    #[error("{tensor}: zero-sized dimension in shape {shape:?}")]
    ZeroSized {
        /// Which tensor.
        tensor: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The number of query heads is not a multiple of the number of key/value heads.
    #[error("query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")]
    HeadsNotDivisible {
        /// Query heads `Hq`.
        q_heads: usize,
        /// Key/value heads `Hkv`.
        kv_heads: usize,
    },
    /// A mask or bias cannot be broadcast to `[B, Hq, L, S]`.
    #[error("{tensor}: shape {shape:?} does not broadcast to {target:?} (numpy broadcasting, aligned at the right: each dimension must be 1 or equal to the target's)")]
    NotBroadcastable {
        /// `"mask"` or `"bias"`.
        tensor: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The score shape `[B, Hq, L, S]`.
        target: Vec<usize>,
    },
    /// `kv_lens` has the wrong number of entries.
    #[error("kv_lens: expected one length per batch ({expected}), got {actual}")]
    KvLensCount {
        /// Batch size `B`.
        expected: usize,
        /// Entries given.
        actual: usize,
    },
    /// A key length is larger than `S`.
    #[error("kv_lens[{batch}] = {len} exceeds the key sequence length {max}")]
    KvLenOutOfRange {
        /// Batch index.
        batch: usize,
        /// The given length.
        len: usize,
        /// `S`.
        max: usize,
    },
    /// A host slice has the wrong number of elements for the shape it was given with.
    #[error("{tensor}: shape {shape:?} needs {expected} elements, the data has {actual}")]
    DataLength {
        /// Which tensor.
        tensor: &'static str,
        /// The declared shape.
        shape: Vec<usize>,
        /// Product of the shape.
        expected: usize,
        /// Length of the data.
        actual: usize,
    },
    /// A caller's GPU buffer is too small, lacks a usage flag, or is misaligned.
    #[error("{tensor}: unusable buffer: {reason}")]
    BadBuffer {
        /// Which tensor.
        tensor: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// User WGSL functions ([`UserMod`](crate::UserMod)) that naga rejects, with a wrong
    /// signature, or unknown, duplicate or misnamed captures.
    #[error("user WGSL{}: {message}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    UserMod {
        /// The source's line (1-based) the message is about, where naga gives one.
        line: Option<usize>,
        /// What is wrong (naga's message, with the line quoted).
        message: String,
    },
    /// A built-in score or mask modifier with a value outside its domain.
    #[error("{modifier}: {reason}")]
    InvalidModifier {
        /// The modifier (`window`, `sink_tokens`, ...).
        modifier: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A paged KV cache call ([`Sdpa::paged`](crate::Sdpa::paged)) whose block table, sequence
    /// lengths or caches do not fit together.
    #[error("paged KV cache: {reason}")]
    Paged {
        /// What is wrong.
        reason: String,
    },
    /// An 8-bit K/V cache ([`Storage::Int8`](crate::Storage::Int8),
    /// [`Storage::Fp8`](crate::Storage::Fp8)) that cannot be read as given: its scales missing,
    /// of the wrong shape or format, given to a float tensor, a head dim that is not a multiple
    /// of 4, an 8-bit q, bias or output, or a path, form or call that does not read 8-bit caches
    /// (the backward, the variants, the unfused path, the matrix units' forms).
    #[error("8-bit K/V cache: {reason}")]
    Quantized {
        /// What is wrong.
        reason: String,
    },
    /// The scale is NaN or infinite (or too large for the kernels' f32).
    #[error("scale must be finite in f32, got {scale}")]
    InvalidScale {
        /// The rejected scale, as given.
        scale: f64,
    },
    /// An option combination that a path cannot serve.
    #[error("path {path} cannot run this problem: {reason}")]
    Unsupported {
        /// The requested path.
        path: &'static str,
        /// Why.
        reason: String,
    },
    /// An option or setting an attention variant cannot take (a mask where the variant has no
    /// place for one, landmarks out of range, ...).
    #[error("{variant}: {option}: {reason}")]
    VariantOption {
        /// The variant's name.
        variant: &'static str,
        /// The refused option.
        option: &'static str,
        /// Why.
        reason: String,
    },
    /// Tensors whose storage formats must agree do not.
    #[error("{tensor}: storage format {actual} where {expected} is required ({why})")]
    StorageMismatch {
        /// Which tensor.
        tensor: &'static str,
        /// The format it must have.
        expected: crate::storage::Storage,
        /// The format it has.
        actual: crate::storage::Storage,
        /// Why the formats must agree.
        why: &'static str,
    },
    /// A buffer would exceed a device limit.
    #[error("{what} needs {bytes} bytes, over the device limit {limit_name} = {limit}{hint}")]
    TooLargeForDevice {
        /// What was being allocated or bound.
        what: String,
        /// Bytes needed.
        bytes: u64,
        /// Which `wgpu::Limits` field.
        limit_name: &'static str,
        /// Its value.
        limit: u64,
        /// Extra advice (may be empty).
        hint: &'static str,
    },
    /// A wgpu validation error (a bug in this crate or a misuse of caller-provided buffers).
    #[error("GPU validation error: {0}")]
    Validation(String),
    /// The device ran out of memory.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
    /// Writing a file (or encoding a picture) failed.
    #[error("I/O: {0}")]
    Io(String),
    /// A picture (a heatmap, a line chart) cannot be drawn from what it was given (labels that
    /// do not match the data, nothing drawable, a size out of range), or drawing it failed.
    #[error("picture: {0}")]
    Picture(String),
    /// An internal device error.
    #[error("internal GPU error: {0}")]
    Internal(String),
    /// The device was lost.
    #[error("GPU device lost: {0}")]
    DeviceLost(String),
    /// Reading results back failed.
    #[error("reading results back from the GPU failed: {0}")]
    Readback(String),
    /// A ring of devices cannot take this problem (more devices than sequence positions, an
    /// option the ring cannot shard, inputs it cannot slice).
    #[error("ring of {devices} devices: {reason}")]
    Ring {
        /// The ring's size.
        devices: usize,
        /// Why.
        reason: String,
    },
    /// The ranks of a ring disagree on the problem (shapes, options, formats or layout): every
    /// rank gets this error before any GPU work.
    #[error("ring rank {rank} differs from rank {other}: {what}")]
    RingMismatch {
        /// The rank reporting the error.
        rank: usize,
        /// The first rank whose description differs from it.
        other: usize,
        /// What differs.
        what: String,
    },
    /// A neighbour in the ring failed, went away or did not answer within the ring's timeout.
    #[error("ring rank {rank}: peer {peer} {reason}")]
    RingPeer {
        /// The rank reporting the error.
        rank: usize,
        /// The neighbour.
        peer: usize,
        /// What happened (an error, a closed link, a timeout).
        reason: String,
    },
}

impl From<wgpu::Error> for Error {
    fn from(e: wgpu::Error) -> Self {
        match e {
            wgpu::Error::OutOfMemory { source } => Error::OutOfMemory(source.to_string()),
            wgpu::Error::Validation { description, .. } => Error::Validation(description),
            wgpu::Error::Internal { description, .. } => Error::Internal(description),
        }
    }
}

/// What to do when no adapter is found, where the crate runs.
#[cfg(not(target_arch = "wasm32"))]
const NO_ADAPTER_HINT: &str = "On a machine without a GPU, install Mesa's software Vulkan driver \
     (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers libvulkan1`), or select another backend \
     with WGPU_BACKEND=vulkan|metal|dx12|gl";
#[cfg(target_arch = "wasm32")]
const NO_ADAPTER_HINT: &str = "This browser offers no WebGPU adapter: use one with WebGPU enabled \
     (Chrome or Edge 113+, Safari 26+, Firefox 141+ on Windows; on Linux Chrome with \
     --enable-unsafe-webgpu), served from a secure context (https, localhost or 127.0.0.1)";

// Here rather than in storage.rs, so that the formats stand below the error that names them.
impl std::str::FromStr for crate::storage::Storage {
    type Err = Error;
    /// Parses `f32`, `f16`, `bf16`, `int8`, `fp8`.
    fn from_str(s: &str) -> Result<Self> {
        crate::storage::Storage::ALL
            .into_iter()
            .chain(crate::storage::Storage::QUANTIZED)
            .find(|f| f.name() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "storage format",
                name: s.to_string(),
                expected: "f32, f16, bf16, int8, fp8",
            })
    }
}
