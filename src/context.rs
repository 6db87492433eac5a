//! The GPU context: a `wgpu::Device` + `Queue`, owned or adopted, with its limits, features
//! and a cache of compute pipelines.

use std::collections::HashMap;
#[cfg(not(target_arch = "wasm32"))]
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::kernels::{Binding, KernelSpec};

/// A device and queue plus what this crate needs to know about them.
///
/// Create one with [`Context::new`] (wgpu's default adapter; `WGPU_BACKEND`,
/// `WGPU_ADAPTER_NAME` and `WGPU_POWER_PREF` are honoured) or adopt your own device with
/// [`Context::from_device`]. Cloning is cheap and shares the pipeline cache.
///
/// On CPU adapters (lavapipe), where compiling the fastest form of the fused kernel takes
/// seconds, a large problem's first call is served by a quicker-to-compile form while the
/// fastest one compiles in the background (same results, bit for bit). [`Context::wait_idle`]
/// waits for that; call it before timing steady-state runs and before the process exits.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: Option<wgpu::AdapterInfo>,
    limits: wgpu::Limits,
    features: wgpu::Features,
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    /// Pipelines being created and warmed on background threads (see [`Context::warm`]).
    #[cfg(not(target_arch = "wasm32"))]
    warming: Mutex<HashSet<PipelineKey>>,
    #[cfg(not(target_arch = "wasm32"))]
    warm_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    lost: Arc<Mutex<Option<String>>>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    name: &'static str,
    prelude: String,
    constants: Vec<(&'static str, u64)>,
}

impl PipelineKey {
    fn new(spec: &KernelSpec, prelude: &str, constants: &[(&'static str, f64)]) -> Self {
        PipelineKey {
            name: spec.name,
            prelude: prelude.to_string(),
            constants: constants.iter().map(|&(n, v)| (n, v.to_bits())).collect(),
        }
    }
}

/// A compute pipeline with its bind-group layout.
pub(crate) struct Pipeline {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.inner.info.as_ref().map(|i| &i.name))
            .field("backend", &self.inner.info.as_ref().map(|i| i.backend))
            .finish()
    }
}

/// Optional features this crate can make use of when the adapter has them.
fn wanted_features() -> wgpu::Features {
    wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY
}

impl Context {
    /// Create a device on wgpu's default adapter, requesting the adapter's own limits.
    ///
    /// Honours `WGPU_BACKEND` (e.g. `vulkan`, `metal`, `dx12`, `gl`, `webgpu`),
    /// `WGPU_ADAPTER_NAME` (substring of the adapter name) and `WGPU_POWER_PREF`.
    pub async fn new() -> Result<Self> {
        // Without WGPU_BACKEND, try the primary backends (Vulkan, Metal, DX12, WebGPU) first and
        // fall back to every backend (GL included) only when they find nothing.
        let from_env = wgpu::Backends::from_env();
        let mut tries = vec![from_env.unwrap_or(wgpu::Backends::PRIMARY)];
        if from_env.is_none() {
            tries.push(wgpu::Backends::all());
        }
        let mut last = None;
        for backends in tries {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            desc.backends = backends;
            let instance = wgpu::Instance::new(desc);
            match select_adapter(&instance).await {
                Ok(adapter) => return Self::from_adapter(&adapter).await,
                Err(e @ Error::AdapterNotFound { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// Blocking version of [`Context::new`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new_blocking() -> Result<Self> {
        pollster::block_on(Self::new())
    }

    /// Create a device on a given adapter with its own limits and the optional features this
    /// crate can use.
    pub async fn from_adapter(adapter: &wgpu::Adapter) -> Result<Self> {
        let limits = adapter.limits();
        let features = adapter.features() & wanted_features();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("wgpu-attention"),
                required_features: features,
                required_limits: limits,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::RequestDevice(e.to_string()))?;
        // Errors outside our error scopes are logged, never panicked on.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            eprintln!("wgpu-attention: uncaptured GPU error: {e}");
        }));
        let ctx = Self::build(device, queue, Some(adapter.get_info()));
        Ok(ctx)
    }

    /// Adopt a caller's device and queue. Their limits and features are read from the device;
    /// the caller's uncaptured-error handler is left alone (this crate uses error scopes).
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue) -> Self {
        Self::build(device, queue, None)
    }

    fn build(device: wgpu::Device, queue: wgpu::Queue, info: Option<wgpu::AdapterInfo>) -> Self {
        let lost = Arc::new(Mutex::new(None));
        let lost2 = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            *lost2.lock().unwrap() = Some(format!("{reason:?}: {msg}"));
        });
        Context {
            inner: Arc::new(Inner {
                limits: device.limits(),
                features: device.features(),
                device,
                queue,
                info,
                pipelines: Mutex::new(HashMap::new()),
                #[cfg(not(target_arch = "wasm32"))]
                warming: Mutex::new(HashSet::new()),
                #[cfg(not(target_arch = "wasm32"))]
                warm_threads: Mutex::new(Vec::new()),
                lost,
            }),
        }
    }

    /// The device.
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    /// The queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    /// Adapter information, when this context created the device.
    pub fn adapter_info(&self) -> Option<&wgpu::AdapterInfo> {
        self.inner.info.as_ref()
    }

    /// The device's limits.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.inner.limits
    }

    /// The device's enabled features.
    pub fn features(&self) -> wgpu::Features {
        self.inner.features
    }

    /// Whether the adapter is a CPU implementation (e.g. lavapipe); kernels pick tile shapes
    /// that suit it.
    pub fn is_cpu(&self) -> bool {
        self.inner
            .info
            .as_ref()
            .is_some_and(|i| i.device_type == wgpu::DeviceType::Cpu)
    }

    /// A one-line description of the adapter (name, backend, driver).
    pub fn describe(&self) -> String {
        match &self.inner.info {
            Some(i) => format!(
                "{} ({:?}, {:?}, driver {} {})",
                i.name, i.backend, i.device_type, i.driver, i.driver_info
            ),
            None => "caller-provided device".to_string(),
        }
    }

    /// Largest size of one storage binding, in bytes.
    pub(crate) fn max_binding(&self) -> u64 {
        self.inner
            .limits
            .max_storage_buffer_binding_size
            .min(self.inner.limits.max_buffer_size)
    }

    /// Return the device-lost reason if the device is gone.
    pub(crate) fn check_lost(&self) -> Result<()> {
        match self.inner.lost.lock().unwrap().as_ref() {
            Some(msg) => Err(Error::DeviceLost(msg.clone())),
            None => Ok(()),
        }
    }

    /// The cached pipeline for a kernel specialised with `constants`.
    /// `prelude` (WGSL `const` declarations generated by the host) is prepended to the source.
    pub(crate) fn pipeline(
        &self,
        spec: &KernelSpec,
        prelude: &str,
        constants: &[(&'static str, f64)],
    ) -> Arc<Pipeline> {
        let key = PipelineKey::new(spec, prelude, constants);
        if let Some(p) = self.inner.pipelines.lock().unwrap().get(&key) {
            return p.clone();
        }
        let device = &self.inner.device;
        let storage_params = self.params_in_storage(spec.bindings.len());
        let mut source = crate::kernels::unroll::unroll(&format!("{prelude}{}", spec.source));
        if storage_params {
            source = source.replace("var<uniform> p: Params;", "var<storage, read> p: Params;");
        }
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(spec.name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let entries: Vec<wgpu::BindGroupLayoutEntry> = spec
            .bindings
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: match b {
                    Binding::Read => wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: true },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    Binding::ReadWrite => wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: false },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    Binding::Uniform => wgpu::BindingType::Buffer {
                        ty: if storage_params {
                            wgpu::BufferBindingType::Storage { read_only: true }
                        } else {
                            wgpu::BufferBindingType::Uniform
                        },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                },
                count: None,
            })
            .collect();
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(spec.name),
            entries: &entries,
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(spec.name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(spec.name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        let p = Arc::new(Pipeline { pipeline, layout });
        self.inner.pipelines.lock().unwrap().insert(key, p.clone());
        p
    }

    /// Run `f` inside validation, out-of-memory and internal error scopes and return the
    /// first error captured, if any.
    pub(crate) async fn scoped<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check_lost()?;
        let device = &self.inner.device;
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let result = f();
        let v = validation.pop().await;
        let o = oom.pop().await;
        let i = internal.pop().await;
        if let Some(e) = v.or(o).or(i) {
            return Err(e.into());
        }
        self.check_lost()?;
        result
    }

    /// Block until the queue is idle (native); a no-op on the web, where the browser drives it.
    pub(crate) fn wait(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.inner
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| match e {
                wgpu::PollError::Timeout => Error::Readback("timed out waiting for the GPU".into()),
                other => Error::DeviceLost(other.to_string()),
            })?;
        self.check_lost()
    }

    /// Tiered compilation, for kernels whose fastest form compiles slowly on CPU adapters
    /// (lavapipe compiles a shader with LLVM at its first dispatch: seconds for the unrolled
    /// fused kernel). Returns whether the pipeline of `spec` with `prelude` is ready. If it is
    /// not, and this is a native CPU adapter, it is created on a background thread and
    /// dispatched once on an empty problem (`params` all zero: the kernel returns at once) so
    /// that the driver compiles it while the caller is served by a quicker-to-compile form;
    /// returns `false` then, and the caller uses that form. Elsewhere (GPUs compile at pipeline
    /// creation; the web has no threads) returns `true`: use the pipeline directly.
    pub(crate) fn warm(&self, spec: &'static KernelSpec, prelude: String, params_size: usize) -> bool {
        #[cfg(target_arch = "wasm32")]
        {
            let _ = (spec, prelude, params_size);
            true
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            if !self.is_cpu() {
                return true;
            }
            let key = PipelineKey::new(spec, &prelude, &[]);
            if self.inner.pipelines.lock().unwrap().contains_key(&key) {
                return true;
            }
            if !self.inner.warming.lock().unwrap().insert(key.clone()) {
                return false;
            }
            let ctx = self.clone();
            let handle = std::thread::spawn(move || {
                // Errors here would recur, and be reported, where the pipeline is used.
                let _ = pollster::block_on(ctx.scoped(|| {
                    let device = ctx.device();
                    let buffers: Vec<wgpu::Buffer> = (1..spec.bindings.len())
                        .map(|_| {
                            device.create_buffer(&wgpu::BufferDescriptor {
                                label: Some("wgpu-attention warm-up"),
                                size: 256,
                                usage: wgpu::BufferUsages::STORAGE,
                                mapped_at_creation: false,
                            })
                        })
                        .collect();
                    let bindings: Vec<wgpu::BufferBinding> =
                        buffers.iter().map(|b| b.as_entire_buffer_binding()).collect();
                    let mut encoder = device.create_command_encoder(&Default::default());
                    crate::kernels::dispatch(
                        &ctx,
                        &mut encoder,
                        spec,
                        &prelude,
                        &[],
                        &bindings,
                        &vec![0u8; params_size],
                        [1, 1, 1],
                    )?;
                    ctx.queue().submit([encoder.finish()]);
                    Ok(())
                }));
                ctx.inner.warming.lock().unwrap().remove(&key);
            });
            self.inner.warm_threads.lock().unwrap().push(handle);
            false
        }
    }

    /// Wait until the queue is idle and every kernel being compiled in the background (on CPU
    /// adapters the fused kernel's fastest form is compiled on a thread after its first use, which
    /// a quicker-to-compile form serves) is ready. Call it before timing steady-state runs, or
    /// before the process exits so that no compilation is cut off.
    pub fn wait_idle(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        loop {
            let handle = self.inner.warm_threads.lock().unwrap().pop();
            match handle {
                Some(h) => {
                    let _ = h.join();
                }
                None => break,
            }
        }
        self.wait()
    }

    /// Whether kernels read their params struct from a read-only storage buffer instead of a
    /// uniform buffer: on CPU adapters that allow the extra storage binding. Mesa's lavapipe
    /// inlines uniform-buffer values that feed loop bounds into the shader and recompiles it on
    /// every dispatch (seconds for the unrolled kernels); storage buffers are not inlined.
    pub(crate) fn params_in_storage(&self, bindings: usize) -> bool {
        self.is_cpu() && self.limits().max_storage_buffers_per_shader_stage as usize >= bindings
    }

    /// The subgroup size when subgroup operations are enabled and the adapter reports a single
    /// size (lavapipe: 8); `None` otherwise (or for an adopted device, whose adapter is unknown).
    pub(crate) fn fixed_subgroup_size(&self) -> Option<u32> {
        let info = self.adapter_info()?;
        (self.features().contains(wgpu::Features::SUBGROUP)
            && info.subgroup_min_size == info.subgroup_max_size)
            .then_some(info.subgroup_min_size)
    }

    /// Copy `size` bytes at `offset` of `buffer` (which needs `COPY_SRC`) back to the host as f32.
    pub async fn read_f32(&self, buffer: &wgpu::Buffer, offset: u64, size: u64) -> Result<Vec<f32>> {
        let device = &self.inner.device;
        let mut out = vec![0f32; (size / 4) as usize];
        // Stage in pieces no larger than a quarter of the buffer limit (and 256 MiB).
        let piece_max = (self.inner.limits.max_buffer_size / 4).clamp(4, 256 << 20) & !3;
        let mut done = 0u64;
        while done < size {
            let n = piece_max.min(size - done);
            let staging = self.scoped(|| {
                let staging = device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("wgpu-attention readback"),
                    size: n,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgpu-attention readback"),
                });
                enc.copy_buffer_to_buffer(buffer, offset + done, &staging, 0, n);
                self.inner.queue.submit([enc.finish()]);
                Ok(staging)
            });
            let staging = staging.await?;
            let (tx, rx) = futures_intrusive::channel::shared::oneshot_channel();
            staging.map_async(wgpu::MapMode::Read, .., move |r| {
                let _ = tx.send(r);
            });
            self.wait()?;
            match rx.receive().await {
                Some(Ok(())) => {}
                Some(Err(e)) => return Err(Error::Readback(e.to_string())),
                None => return Err(Error::Readback("map callback dropped".into())),
            }
            {
                let view = staging
                    .get_mapped_range(..)
                    .map_err(|e| Error::Readback(e.to_string()))?;
                let start = (done / 4) as usize;
                out[start..start + (n / 4) as usize].copy_from_slice(bytemuck::cast_slice(&view));
            }
            staging.unmap();
            done += n;
        }
        Ok(out)
    }
}

/// Pick the adapter: `WGPU_ADAPTER_NAME` if set, else wgpu's default choice.
async fn select_adapter(instance: &wgpu::Instance) -> Result<wgpu::Adapter> {
    #[cfg(not(target_arch = "wasm32"))]
    if let Ok(wanted) = std::env::var("WGPU_ADAPTER_NAME") {
        let wanted = wanted.to_lowercase();
        let adapters = instance.enumerate_adapters(wgpu::Backends::all()).await;
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        return adapters
            .into_iter()
            .find(|a| a.get_info().name.to_lowercase().contains(&wanted))
            .ok_or(Error::AdapterNotFound {
                wanted,
                available: names,
            });
    }
    instance
        .request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::from_env()
                .unwrap_or(wgpu::PowerPreference::HighPerformance),
            ..Default::default()
        })
        .await
        .map_err(|e| Error::NoAdapter {
            details: e.to_string(),
        })
}
