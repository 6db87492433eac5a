//! The pipeline cache a [`Context`](crate::Context) owns: compute pipelines with their
//! bind-group layouts, built once per (kernel, prelude, override constants), and the kernels
//! being compiled on background threads (tiered compilation on CPU adapters, see
//! [`crate::kernels::warm`]).
//!
//! This module knows nothing about the kernels: it is given a finished WGSL source and the
//! binding types. The kernels (`src/kernels/`) assemble their sources and use it through the
//! context, so the context never imports the kernels.

use std::collections::HashMap;
#[cfg(not(target_arch = "wasm32"))]
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// What makes two pipelines the same: the kernel, the host-generated prelude (constants and
/// chosen snippets), the override constants, and whether wgpu's runtime checks are off.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    name: &'static str,
    prelude: String,
    constants: Vec<(&'static str, u64)>,
    unchecked: bool,
}

impl Key {
    pub(crate) fn new(
        name: &'static str,
        prelude: &str,
        constants: &[(&'static str, f64)],
        unchecked: bool,
    ) -> Self {
        Key {
            name,
            prelude: prelude.to_string(),
            constants: constants.iter().map(|&(n, v)| (n, v.to_bits())).collect(),
            unchecked,
        }
    }
}

/// A compute pipeline with its bind-group layout.
pub(crate) struct Pipeline {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
    /// The number of its bindings.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    bindings: usize,
}

impl Pipeline {
    /// Create the pipeline of `source` (entry point `main`) whose bindings `0..` have `bindings`
    /// types, all visible to the compute stage.
    pub(crate) fn new(
        device: &wgpu::Device,
        label: &str,
        source: String,
        bindings: &[wgpu::BufferBindingType],
        constants: &[(&'static str, f64)],
        unchecked: bool,
    ) -> Self {
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        // SAFETY: `unchecked` is set for kernels whose every storage index is in range by
        // construction (`KernelSpec::trusted`: rows clamped, tails guarded, loops bounded by
        // params), whose bindings the crate checks against the shapes before any dispatch; or by
        // the `unchecked` tuning knob, a developer's measurement switch.
        #[cfg(not(target_arch = "wasm32"))]
        let module = if unchecked {
            unsafe { device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
        } else {
            device.create_shader_module(desc)
        };
        // The browser checks every shader itself.
        #[cfg(target_arch = "wasm32")]
        let module = {
            let _ = unchecked;
            device.create_shader_module(desc)
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .enumerate()
            .map(|(i, &ty)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(label),
            entries: &entries,
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        Pipeline {
            pipeline,
            layout,
            bindings: bindings.len(),
        }
    }

    /// Record and submit one workgroup of it on zeroed buffers (params all zero: every kernel
    /// returns at once), so that a driver that compiles at the first dispatch (lavapipe)
    /// compiles it now. Each binding gets 64 KiB, the most a uniform binding may hold.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn dispatch_zeroed(&self, device: &wgpu::Device, queue: &wgpu::Queue) {
        let buffers: Vec<wgpu::Buffer> = (0..self.bindings)
            .map(|_| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("wgpu-attention warm-up"),
                    size: 1 << 16,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::UNIFORM,
                    mapped_at_creation: false,
                })
            })
            .collect();
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("wgpu-attention warm-up"),
            layout: &self.layout,
            entries: &entries,
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        queue.submit([encoder.finish()]);
    }
}

/// The most pipelines a cache keeps: past it, the least recently used is dropped (a caller
/// still holding it keeps it alive; a later call rebuilds it). Head dims are compiled into
/// the kernels, so distinct shapes add pipelines (about one per three random shapes).
pub(crate) const MAX_PIPELINES: usize = 256;

/// Pipelines by [`Key`] with the tick of their last use, and the background compilations in
/// flight.
#[derive(Default)]
pub(crate) struct PipelineCache {
    ready: Mutex<HashMap<Key, (Arc<Pipeline>, u64)>>,
    tick: std::sync::atomic::AtomicU64,
    #[cfg(not(target_arch = "wasm32"))]
    warming: Mutex<HashSet<Key>>,
    #[cfg(not(target_arch = "wasm32"))]
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl PipelineCache {
    /// The pipeline of `key`, built by `build` the first time (or again after eviction).
    pub(crate) fn get_or_build(&self, key: Key, build: impl FnOnce() -> Pipeline) -> Arc<Pipeline> {
        let now = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some((p, used)) = self.ready.lock().unwrap().get_mut(&key) {
            *used = now;
            return p.clone();
        }
        // Built outside the lock: compiling may take seconds, and other kernels may be wanted
        // meanwhile. Two threads building the same key both build; the first insert wins.
        let p = Arc::new(build());
        let mut ready = self.ready.lock().unwrap();
        if ready.len() >= MAX_PIPELINES && !ready.contains_key(&key) {
            let oldest = ready
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                ready.remove(&k);
            }
        }
        ready.entry(key).or_insert((p, now)).0.clone()
    }

    /// The number of pipelines built and kept.
    pub(crate) fn len(&self) -> usize {
        self.ready.lock().unwrap().len()
    }

    /// Whether the pipeline of `key` has been built.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    pub(crate) fn contains(&self, key: &Key) -> bool {
        self.ready.lock().unwrap().contains_key(key)
    }

    /// Mark `key` as being compiled in the background; false if it already is.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn start_warming(&self, key: Key) -> bool {
        self.warming.lock().unwrap().insert(key)
    }

    /// The background compilation of `key` has ended.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn end_warming(&self, key: &Key) {
        self.warming.lock().unwrap().remove(key);
    }

    /// Keep the thread compiling in the background, to be joined by [`PipelineCache::join`].
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn push_thread(&self, handle: std::thread::JoinHandle<()>) {
        self.threads.lock().unwrap().push(handle);
    }

    /// Wait for every background compilation.
    pub(crate) fn join(&self) {
        #[cfg(not(target_arch = "wasm32"))]
        loop {
            let handle = self.threads.lock().unwrap().pop();
            match handle {
                Some(h) => {
                    let _ = h.join();
                }
                None => break,
            }
        }
    }
}

/// A developer's aid for the test suite's compile time: with `WGPU_ATTENTION_COMPILE_LOG=FILE`
/// set (native targets), every pipeline built is dispatched once at once on zeroed buffers
/// (params all zero: every kernel returns at once), so that drivers which compile at the first
/// dispatch (lavapipe) compile it there, and a line is appended to FILE: the kernel's name, a
/// hash of its source and constants (the same hash is the same specialisation, which a
/// driver's shader cache compiles once), the milliseconds from creation to the end of that
/// dispatch, and the process's arguments (a test runner's test name).
/// `scripts/compile_profile.py` sums it per kernel and per test.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) mod compile_log {
    use super::Pipeline;
    use std::hash::{Hash, Hasher};
    use std::io::Write;
    use std::sync::{Mutex, OnceLock};

    fn file() -> &'static Option<Mutex<std::fs::File>> {
        static FILE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
        FILE.get_or_init(|| {
            let path = std::env::var_os("WGPU_ATTENTION_COMPILE_LOG")?;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok()?;
            Some(Mutex::new(f))
        })
    }

    /// Whether the log is on.
    pub(crate) fn enabled() -> bool {
        file().is_some()
    }

    /// Dispatch `pipeline` once on zeroed buffers ([`Pipeline::dispatch_zeroed`]), wait for it,
    /// and log the time since `t0` under a hash of `source` and `constants`.
    pub(crate) fn first_dispatch(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        pipeline: &Pipeline,
        label: &str,
        source: &str,
        constants: &[(&str, f64)],
        t0: std::time::Instant,
    ) {
        pipeline.dispatch_zeroed(device, queue);
        let _ = device.poll(wgpu::PollType::wait_indefinitely());
        let mut h = std::collections::hash_map::DefaultHasher::new();
        source.hash(&mut h);
        for (n, v) in constants {
            n.hash(&mut h);
            v.to_bits().hash(&mut h);
        }
        if let Some(f) = file() {
            let args: Vec<String> = std::env::args().skip(1).collect();
            let line = format!(
                "{label}\t{:016x}\t{:.1}\t{}\n",
                h.finish(),
                t0.elapsed().as_secs_f64() * 1e3,
                args.join(" ")
            );
            // One write per line (O_APPEND): lines of concurrent processes do not interleave.
            let _ = f.lock().unwrap().write_all(line.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache keeps at most MAX_PIPELINES, dropping the least recently used.
    #[test]
    fn the_cache_is_bounded_and_drops_the_least_recently_used() {
        let Ok(ctx) = crate::device::context::Context::new_blocking() else {
            return;
        };
        let cache = PipelineCache::default();
        let src = "@compute @workgroup_size(1) fn main() {}".to_string();
        let build = || Pipeline::new(ctx.device(), "t", src.clone(), &[], &[], false);
        let key = |i: usize| Key::new("t", &format!("// {i}"), &[], false);
        for i in 0..MAX_PIPELINES + 40 {
            cache.get_or_build(key(i), build);
            // Key 0 stays in use.
            cache.get_or_build(key(0), || unreachable!("key 0 is kept"));
        }
        assert_eq!(cache.len(), MAX_PIPELINES);
        assert!(cache.contains(&key(0)));
        assert!(!cache.contains(&key(1)));
        assert!(cache.contains(&key(MAX_PIPELINES + 39)));
    }
}
