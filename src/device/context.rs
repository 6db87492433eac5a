//! The GPU context: a `wgpu::Device` + `Queue`, owned or adopted, with its limits, features
//! and a cache of compute pipelines.

use std::sync::{Arc, Mutex};

use crate::device::pipelines::PipelineCache;
use crate::error::{Error, Result};
use crate::forms::{Caps, CoopTiles, Forms, Tuning};

/// A device and queue plus what this crate needs to know about them, and the cache of the
/// kernels' pipelines.
///
/// Create one with [`Context::new`] (wgpu's default adapter; `WGPU_BACKEND`,
/// `WGPU_ADAPTER_NAME` and `WGPU_POWER_PREF` are honoured) or adopt your own device with
/// [`Context::from_device`]. Cloning is cheap and shares the pipeline cache.
///
/// On CPU adapters (lavapipe), where compiling the fastest form of the fused kernel takes
/// seconds, a large problem's first call is served by a quicker-to-compile form while the
/// fastest one compiles in the background (same results, bit for bit). [`Context::wait_idle`]
/// waits for that; call it before timing steady-state runs and before the process exits.
///
/// The kernels' forms are chosen per call by [`Plan`](crate::Plan); [`Context::with_forms`]
/// (or the environment variable `WGPU_ATTENTION_FORMS`, read once when the context is made)
/// pins them.
///
/// **Threads.** On native targets a `Context` is `Send + Sync`: share it (by reference, or a
/// clone per thread) between any number of threads calling [`Sdpa`](crate::Sdpa), the layer or
/// the variants at once. What is serialised: the pipeline cache's lookups and inserts (a short
/// lock; a missing pipeline is built outside it, by every thread that wants it at that moment,
/// the first one built kept, while a CPU adapter's slow forms compile in the background), and
/// the queue's submissions (wgpu orders them). What is not: recording, uploads and readbacks run on the
/// calling thread. Each call's GPU errors are caught in error scopes, which wgpu keeps per
/// thread, so one thread's error is never reported to another. Tested by
/// `tests/concurrency.rs` (8 threads of mixed calls on one context, every result checked). On
/// the web there is one thread.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
    forms: Forms,
    /// Whether the kernels may use the matrix units ([`Context::without_matrix_units`]).
    matrix_units: bool,
    /// The GPU forms' tuning knobs ([`Context::with_tuning`]).
    tuning: Tuning,
}

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    /// The instance and adapter the device came from, where the context knows them: another
    /// runtime made on the same device (burn's `WgpuSetup`) needs all four handles.
    /// Set once, right after the context is built.
    instance: std::sync::OnceLock<wgpu::Instance>,
    adapter: std::sync::OnceLock<wgpu::Adapter>,
    /// The matrix units' tiles, from the adapter where the device enabled them.
    coop: CoopTiles,
    /// Every cooperative-matrix configuration the adapter lists (empty without an adapter).
    coop_list: Vec<wgpu::CooperativeMatrixProperties>,
    limits: wgpu::Limits,
    features: wgpu::Features,
    pipelines: PipelineCache,
    faults: crate::device::faults::Injector,
    lost: Arc<Mutex<Option<String>>>,
    /// The reported fixed subgroup size once `subgroup_probe` has confirmed it (None: not
    /// fixed, or the device's subgroup operations are wrong at it). Native only: the check
    /// blocks on the device.
    #[cfg(not(target_arch = "wasm32"))]
    subgroup: std::sync::OnceLock<Option<u32>>,
    /// A small storage buffer bound where a kernel's optional input is absent (read-only:
    /// one for every call).
    dummy: std::sync::OnceLock<wgpu::Buffer>,
    /// mask_mod block maps by source, captures and shape (`kernels::mod_map`), at most
    /// [`MOD_MAPS`] of them.
    mod_maps: Mutex<Vec<(u64, wgpu::Buffer)>>,
    /// Parameter buffers, small constant inputs and bind groups a repeated call reuses.
    cache: crate::device::cache::Cache,
}

/// At process exit, every live context's background compilations are joined and its queue
/// drained before the drivers' own exit handlers run. A compilation or a submission cut off
/// by the exit crashed Mesa's lavapipe (its exit handler stops the threads it compiles and
/// runs on): an application that forgets [`Context::wait_idle`] must not crash at exit.
#[cfg(not(target_arch = "wasm32"))]
mod at_exit {
    use super::Inner;
    use std::sync::{Arc, Mutex, Once, Weak};

    /// The contexts made in this process, held weakly.
    static LIVE: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());
    static REGISTERED: Once = Once::new();

    extern "C" {
        fn atexit(f: extern "C" fn()) -> std::os::raw::c_int;
    }

    /// Watch `inner` until the process exits. The handler is registered after the first
    /// device was made, so it runs before the handlers its driver registered then (C runs
    /// them in reverse order).
    pub(super) fn watch(inner: &Arc<Inner>) {
        REGISTERED.call_once(|| {
            // SAFETY: `drain` is a plain `extern "C"` function with no arguments, as `atexit`
            // takes; it never unwinds (every lock and wait below is fallible and ignored).
            unsafe {
                atexit(drain);
            }
        });
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(inner));
        }
    }

    /// Join each live context's background compilations and wait (at most a minute) for its
    /// queue.
    extern "C" fn drain() {
        let work = || {
            let live: Vec<Arc<Inner>> = match LIVE.lock() {
                Ok(live) => live.iter().filter_map(Weak::upgrade).collect(),
                Err(_) => return,
            };
            for inner in live {
                inner.pipelines.join();
                let _ = inner.device.poll(wgpu::PollType::Wait {
                    submission_index: None,
                    timeout: Some(std::time::Duration::from_secs(60)),
                });
            }
        };
        // On a thread of its own: the exiting thread's thread-locals may be gone already (wgpu
        // keeps lock traces in one), and touching them panics.
        let _ = std::panic::catch_unwind(|| {
            match std::thread::Builder::new()
                .name("wgpu-attention exit".into())
                .spawn(work)
            {
                Ok(t) => {
                    let _ = t.join();
                }
                Err(_) => work(),
            }
        });
    }
}

/// The most mask_mod block maps a context keeps (the oldest go first).
const MOD_MAPS: usize = 16;

// The thread-safety contract above, checked at compile time.
#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    const fn shared<T: Send + Sync>() {}
    shared::<Context>();
};

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.inner.info.name)
            .field("backend", &self.inner.info.backend)
            .field("forms", &self.forms)
            .finish()
    }
}

/// Optional features this crate can make use of when the adapter has them.
fn wanted_features() -> wgpu::Features {
    wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY
}

/// The matrix units' feature: experimental in wgpu, so a device requests it only with
/// `DeviceDescriptor::experimental_features` enabled.
const COOP: wgpu::Features = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;

/// Whether `WGPU_ATTENTION_MATRIX_UNITS` turns the matrix units off (`off` or `0`) for the
/// devices the crate creates.
fn matrix_units_turned_off() -> bool {
    #[cfg(not(target_arch = "wasm32"))]
    if let Ok(v) = std::env::var("WGPU_ATTENTION_MATRIX_UNITS") {
        return matches!(v.trim(), "off" | "0" | "false");
    }
    false
}

/// Whether `adapter` has matrix units the kernels can use: the feature and a listed tile.
fn adapter_has_units(adapter: &wgpu::Adapter) -> bool {
    adapter.features().contains(COOP)
        && CoopTiles::from_properties(&adapter.cooperative_matrix_properties())
            .largest()
            .is_some()
}

/// The matrix units' tiles of a device made on `adapter` with `features`.
fn coop_tiles(adapter: &wgpu::Adapter, features: wgpu::Features) -> CoopTiles {
    if !adapter.features().contains(COOP) {
        return CoopTiles::none("the adapter has no cooperative matrices (EXPERIMENTAL_COOPERATIVE_MATRIX)");
    }
    if !features.contains(COOP | wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP) {
        return CoopTiles::none(
            "the device did not enable EXPERIMENTAL_COOPERATIVE_MATRIX with SHADER_F16 and SUBGROUP",
        );
    }
    let listed = CoopTiles::from_properties(&adapter.cooperative_matrix_properties());
    // Test-only: tiles the adapter does not list (lavapipe lists 8 x 8 and runs 16 x 16
    // right), so that CI runs the 16 x 16 form too. Said loudly: outside the adapter's list
    // the behaviour is undefined.
    #[cfg(not(target_arch = "wasm32"))]
    if let Ok(v) = std::env::var("WGPU_ATTENTION_TEST_UNLISTED_TILES") {
        if listed.largest().is_some() {
            let mut tiles = listed;
            for t in v.split(',').filter_map(|t| t.trim().parse::<u32>().ok()) {
                if !listed.has(t) {
                    eprintln!(
                        "wgpu-attention: WGPU_ATTENTION_TEST_UNLISTED_TILES: using {t} x {t} tiles, outside what {} lists",
                        adapter.get_info().name
                    );
                }
                match t {
                    8 => tiles.t8 = true,
                    16 => tiles.t16 = true,
                    _ => {}
                }
            }
            return tiles;
        }
    }
    listed
}

impl Context {
    /// Create a device on wgpu's default adapter, requesting the adapter's own limits.
    ///
    /// Honours `WGPU_BACKEND` (e.g. `vulkan`, `metal`, `dx12`, `gl`, `webgpu`),
    /// `WGPU_ADAPTER_NAME` (substring of the adapter name) and `WGPU_POWER_PREF`.
    pub async fn new() -> Result<Self> {
        Self::new_with_features(wgpu::Features::empty()).await
    }

    /// [`Context::new`], the device also requesting `features` where the adapter has them: a
    /// device shared with a runtime that compiles its own kernels for the adapter's features
    /// (burn's requests all of them but `MAPPABLE_PRIMARY_BUFFERS`).
    pub async fn new_with_features(features: wgpu::Features) -> Result<Self> {
        let (instance, adapter) = default_adapter().await?;
        let ctx = Self::from_adapter_with_features(&adapter, features).await?;
        ctx.set_instance(instance);
        Ok(ctx)
    }

    /// `n` devices on the adapter [`Context::new`] would choose (each with its own queue and
    /// pipeline cache): the devices of an in-process ring ([`Ring`](crate::Ring)). On one GPU
    /// they share its memory and cores; lavapipe gives as many as asked for.
    pub async fn devices(n: usize) -> Result<Vec<Self>> {
        let (instance, adapter) = default_adapter().await?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let ctx = Self::from_adapter(&adapter).await?;
            ctx.set_instance(instance.clone());
            out.push(ctx);
        }
        Ok(out)
    }

    /// Blocking version of [`Context::devices`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn devices_blocking(n: usize) -> Result<Vec<Self>> {
        pollster::block_on(Self::devices(n))
    }

    /// Blocking version of [`Context::new`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new_blocking() -> Result<Self> {
        pollster::block_on(Self::new())
    }

    /// Create a device on a given adapter with its own limits and the optional features this
    /// crate can use.
    ///
    /// Where the adapter has matrix units (cooperative matrices listing a square f16 tile of 8
    /// or 16 with f32 accumulators) the device also gets wgpu's experimental
    /// `EXPERIMENTAL_COOPERATIVE_MATRIX` feature, unless `WGPU_ATTENTION_MATRIX_UNITS=off`;
    /// [`Context::without_matrix_units`] turns them off for one context.
    pub async fn from_adapter(adapter: &wgpu::Adapter) -> Result<Self> {
        Self::from_adapter_with_features(adapter, wgpu::Features::empty()).await
    }

    /// [`Context::from_adapter`], the device also requesting `features` where the adapter has
    /// them (see [`Context::new_with_features`]). Experimental ones among them are requested
    /// with wgpu's experimental features enabled: asking for them is taking wgpu's contract for
    /// them.
    pub async fn from_adapter_with_features(adapter: &wgpu::Adapter, extra: wgpu::Features) -> Result<Self> {
        // A mistyped pin must not let a CI step pass on other forms.
        #[cfg(not(target_arch = "wasm32"))]
        if std::env::var("WGPU_ATTENTION_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            if let Ok(v) = std::env::var("WGPU_ATTENTION_FORMS") {
                Forms::parse(&v)?;
            }
        }
        let limits = adapter.limits();
        let mut features = adapter.features() & wanted_features();
        let units = !matrix_units_turned_off()
            && features.contains(wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP)
            && adapter_has_units(adapter);
        if units {
            features |= COOP;
        }
        features |= adapter.features() & extra;
        let experimental = features.intersects(wgpu::Features::all_experimental_mask());
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("wgpu-attention"),
                required_features: features,
                required_limits: limits,
                // SAFETY (wgpu's contract for experimental features): the crate requests
                // only cooperative matrices, and its kernels use only the tiles the adapter
                // lists; other experimental features are the caller's (`extra`).
                experimental_features: if experimental {
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                ..Default::default()
            })
            .await
            .map_err(|e| Error::RequestDevice(e.to_string()))?;
        // Errors outside our error scopes are logged, never panicked on.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            eprintln!("wgpu-attention: uncaptured GPU error: {e}");
        }));
        let coop = match matrix_units_turned_off() {
            true => CoopTiles::none("turned off by WGPU_ATTENTION_MATRIX_UNITS"),
            false => coop_tiles(adapter, device.features()),
        };
        Ok(Self::build_on(adapter, device, queue, coop))
    }

    /// Adopt a caller's device and queue (a clone of wgpu's handles: they are reference
    /// counted). Everything the kernels' plan needs is read from the device itself: its limits,
    /// its enabled features and its adapter's information (`wgpu::Device::adapter_info`: the
    /// device type, so CPU adapters get their own forms and their kernel parameters go into
    /// storage buffers, and the subgroup sizes). The caller's uncaptured-error handler is left
    /// alone: this crate catches its own errors in error scopes, and [`Sdpa::record`]'s
    /// validation errors go to the caller's scopes (see its docs).
    ///
    /// Request the device as [`Context::new`] does to get the fastest kernels: the adapter's own
    /// limits (`adapter.limits()`: wgpu's defaults allow 128 MiB bindings and 16 KiB of
    /// workgroup memory at most) and, where the adapter has them, the features
    /// [`Context::wanted_features`] lists (`SHADER_F16` for half-precision arithmetic,
    /// `SUBGROUP` for the subgroup forms, `TIMESTAMP_QUERY` for GPU timings). Without them the
    /// crate still works, with the forms that need nothing: [`Context::missing`] says what a
    /// device lacks.
    ///
    /// [`Sdpa::record`]: crate::Sdpa::record
    ///
    /// The matrix units need the adapter's list of tiles, which a device does not give: use
    /// [`Context::from_parts`] for them.
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue) -> Self {
        let info = device.adapter_info();
        let coop = CoopTiles::none(
            "adopted by Context::from_device, which has no adapter to list the tiles (use Context::from_parts)",
        );
        Self::build(device, queue, info, (coop, Vec::new()))
    }

    /// Adopt a caller's device and queue created on `adapter`: the same as
    /// [`Context::from_device`], with the adapter's information taken from the adapter (the one
    /// obvious way when you hold it; burn's `WgpuSetup` carries the same four handles).
    /// The matrix units are used where the device enabled
    /// [`Context::wanted_experimental_features`] and the adapter lists their tiles.
    pub fn from_parts(adapter: &wgpu::Adapter, device: wgpu::Device, queue: wgpu::Queue) -> Self {
        let coop = coop_tiles(adapter, device.features());
        Self::build_on(adapter, device, queue, coop)
    }

    /// [`Context::build`] for a device made on `adapter`: its information and matrix
    /// configurations taken from it, and the adapter kept ([`Context::adapter`]).
    fn build_on(adapter: &wgpu::Adapter, device: wgpu::Device, queue: wgpu::Queue, coop: CoopTiles) -> Self {
        let ctx = Self::build(
            device,
            queue,
            adapter.get_info(),
            (coop, adapter.cooperative_matrix_properties()),
        );
        let _ = ctx.inner.adapter.set(adapter.clone());
        ctx
    }

    /// [`Context::from_parts`] with the instance too: all four handles of a device another
    /// runtime made (burn's `WgpuSetup`), so that [`Context::instance`] can hand them on.
    pub fn from_instance_parts(
        instance: wgpu::Instance,
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Self {
        let ctx = Self::from_parts(adapter, device, queue);
        ctx.set_instance(instance);
        ctx
    }

    /// The instance this context's adapter came from: known to [`Context::new`],
    /// [`Context::devices`] and [`Context::from_instance_parts`] (`None` for the others). With
    /// [`Context::adapter`], [`Context::device`] and [`Context::queue`], what another runtime
    /// needs to share the device (burn's `WgpuSetup`).
    pub fn instance(&self) -> Option<&wgpu::Instance> {
        self.inner.instance.get()
    }

    /// The adapter this context's device came from (`None` for [`Context::from_device`], which
    /// is given no adapter).
    pub fn adapter(&self) -> Option<&wgpu::Adapter> {
        self.inner.adapter.get()
    }

    /// A wgpu instance for compute on `backends`, as [`Context::new`] makes it: wgpu's
    /// settings from the environment (`WGPU_DEBUG`, `WGPU_VALIDATION`, ...), and on Linux a
    /// Vulkan instance without the window systems' surface extensions (Wayland, X11), which a
    /// compute device never uses: with them, Mesa's device-selection layer connects to a
    /// Wayland display while it lists the GPUs, and prints an error on machines without one.
    /// Use it to make your own device the way the crate does; it cannot present to a window.
    pub fn compute_instance(backends: wgpu::Backends) -> wgpu::Instance {
        crate::device::instance::compute_instance(backends)
    }

    /// The instance's handle, set once right after the context is built.
    fn set_instance(&self, instance: wgpu::Instance) {
        let _ = self.inner.instance.set(instance);
    }

    /// The optional device features this crate uses when the device has them: request
    /// `adapter.features() & Context::wanted_features()` when you create your own device.
    pub fn wanted_features() -> wgpu::Features {
        wanted_features()
    }

    /// The experimental features this crate uses when the device has them: the matrix units
    /// (`EXPERIMENTAL_COOPERATIVE_MATRIX`, with `SHADER_F16` and `SUBGROUP`). wgpu grants
    /// them only to a device requested with `experimental_features:
    /// unsafe { wgpu::ExperimentalFeatures::enabled() }`; adopt it with
    /// [`Context::from_parts`], which reads the adapter's tiles.
    pub fn wanted_experimental_features() -> wgpu::Features {
        COOP
    }

    /// The same device without the matrix units: every kernel in its scalar forms (a pinned
    /// coop form is then an error). For comparing, or where f16 products are not wanted.
    pub fn without_matrix_units(&self) -> Context {
        Context {
            matrix_units: false,
            ..self.clone()
        }
    }

    /// Every cooperative-matrix configuration the adapter lists (m x n x k, operand and
    /// accumulator types), whether the kernels can use it or not; empty for a device adopted
    /// by [`Context::from_device`].
    pub fn cooperative_matrix_configurations(&self) -> &[wgpu::CooperativeMatrixProperties] {
        &self.inner.coop_list
    }

    /// The matrix units' tiles this context's kernels may use ([`CoopTiles`]; none, with the
    /// reason, where they may not).
    pub fn matrix_units(&self) -> CoopTiles {
        match self.matrix_units {
            true => self.inner.coop,
            false => CoopTiles::none("turned off for this context (Context::without_matrix_units)"),
        }
    }

    /// What an adopted device lacks for the fastest kernels on its adapter, as a list of
    /// readable items (empty when nothing is missing): features of
    /// [`Context::wanted_features`] the adapter offers but the device did not enable, and
    /// limits below the adapter's own that the kernels use (storage binding size, workgroup
    /// memory, invocations per workgroup, storage buffers per stage). Pass the adapter the
    /// device came from.
    pub fn missing(&self, adapter: &wgpu::Adapter) -> Vec<String> {
        let mut out = Vec::new();
        let lacking = (adapter.features() & wanted_features()) - self.features();
        if !lacking.is_empty() {
            out.push(format!("features not requested: {lacking:?}"));
        }
        if adapter_has_units(adapter) && !self.features().contains(COOP) {
            out.push(
                "experimental feature not requested: EXPERIMENTAL_COOPERATIVE_MATRIX (the matrix units; \
                 request it with experimental_features enabled, see Context::wanted_experimental_features)"
                    .into(),
            );
        }
        let (a, d) = (adapter.limits(), self.limits());
        let pairs: [(&str, u64, u64); 5] = [
            (
                "max_storage_buffer_binding_size",
                a.max_storage_buffer_binding_size,
                d.max_storage_buffer_binding_size,
            ),
            ("max_buffer_size", a.max_buffer_size, d.max_buffer_size),
            (
                "max_compute_workgroup_storage_size",
                a.max_compute_workgroup_storage_size as u64,
                d.max_compute_workgroup_storage_size as u64,
            ),
            (
                "max_compute_invocations_per_workgroup",
                a.max_compute_invocations_per_workgroup as u64,
                d.max_compute_invocations_per_workgroup as u64,
            ),
            (
                "max_storage_buffers_per_shader_stage",
                a.max_storage_buffers_per_shader_stage as u64,
                d.max_storage_buffers_per_shader_stage as u64,
            ),
        ];
        for (name, have, got) in pairs {
            if got < have {
                out.push(format!("limit {name}: device {got}, adapter {have}"));
            }
        }
        out
    }

    // On the web wgpu's handles are neither Send nor Sync (one thread); the Arc shares them
    // between clones of the context all the same.
    #[cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]
    fn build(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        (coop, coop_list): (CoopTiles, Vec<wgpu::CooperativeMatrixProperties>),
    ) -> Self {
        let lost = Arc::new(Mutex::new(None));
        let lost2 = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            *lost2.lock().unwrap() = Some(format!("{reason:?}: {msg}"));
        });
        // Forms pinned for tuning experiments, read once. A malformed value is reported and
        // ignored rather than failing every call.
        #[cfg(not(target_arch = "wasm32"))]
        let forms = match std::env::var("WGPU_ATTENTION_FORMS") {
            Ok(v) => Forms::parse(&v).unwrap_or_else(|e| {
                eprintln!("wgpu-attention: ignoring WGPU_ATTENTION_FORMS: {e}");
                Forms::default()
            }),
            Err(_) => Forms::default(),
        };
        #[cfg(target_arch = "wasm32")]
        let forms = Forms::default();
        let inner = Arc::new(Inner {
            limits: device.limits(),
            features: device.features(),
            device,
            queue,
            info,
            instance: Default::default(),
            adapter: Default::default(),
            coop,
            coop_list,
            pipelines: PipelineCache::default(),
            faults: Default::default(),
            lost,
            #[cfg(not(target_arch = "wasm32"))]
            subgroup: std::sync::OnceLock::new(),
            dummy: std::sync::OnceLock::new(),
            mod_maps: Mutex::new(Vec::new()),
            cache: Default::default(),
        });
        #[cfg(not(target_arch = "wasm32"))]
        at_exit::watch(&inner);
        Context {
            inner,
            forms,
            matrix_units: true,
            tuning: Tuning::from_env(),
        }
    }

    /// The same device, queue and pipeline cache with the kernels' forms pinned (for tests,
    /// benchmarks and tuning; [`Forms::default`] lets the plan choose again). A pinned form
    /// the device cannot run makes calls fail with [`Error::Unsupported`]. A [`FusedForm`] or
    /// [`DecodeForm`](crate::DecodeForm) pins that kernel's form alone.
    ///
    /// [`FusedForm`]: crate::FusedForm
    pub fn with_forms(&self, forms: impl Into<Forms>) -> Context {
        Context {
            forms: forms.into(),
            ..self.clone()
        }
    }

    /// The same device, queue and pipeline cache with the GPU forms' tuning knobs `tuning`
    /// (for sweeps over a knob in one process; a new context reads them from
    /// `WGPU_ATTENTION_TUNE`, [`Tuning::from_env`]). Pipelines differ by the code the knobs
    /// give, so contexts of different tunings share the cache safely.
    pub fn with_tuning(&self, tuning: Tuning) -> Context {
        Context {
            tuning,
            ..self.clone()
        }
    }

    /// The GPU forms' tuning knobs of this context.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// The forms pinned on this context.
    pub fn forms(&self) -> Forms {
        self.forms
    }

    /// What the device offers the kernels: the input of [`Plan`](crate::Plan).
    pub fn caps(&self) -> Caps {
        let max_subgroup = self.inner.info.subgroup_max_size.max(1);
        let mut caps = Caps::new(&self.inner.limits, self.is_cpu(), self.fixed_subgroup_size())
            .with_forms(self.forms)
            .with_coop(self.matrix_units(), max_subgroup)
            .with_tuning(self.tuning);
        // wgpu's GL backend serialises every device of the process on one GL context, and a
        // thread that waits for it over 6 s panics (wgpu-hal): a background compilation of a
        // large unrolled form would hold it that long on a CPU driver (llvmpipe). GL takes the
        // forms that compile quickly instead, as the web does.
        let gl = self.inner.info.backend == wgpu::Backend::Gl;
        caps.background_compile &= !gl;
        caps
    }

    /// The read-only placeholder bound where a kernel's optional input is absent, made once.
    pub(crate) fn dummy(&self) -> &wgpu::Buffer {
        self.inner.dummy.get_or_init(|| {
            // wgpu zero-initialises it.
            self.inner.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("wgpu-attention dummy"),
                size: 16,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        })
    }

    /// The cache of parameter buffers, small constant inputs and bind groups.
    pub(crate) fn cache(&self) -> &crate::device::cache::Cache {
        &self.inner.cache
    }

    /// Bound the cache that lets a repeated call create no buffer, bind group or pipeline
    /// (default [`CacheLimits::default`](crate::CacheLimits)): the kernels' parameter buffers
    /// and small constant inputs (key lengths, block tables, RoPE angles) keyed by their bytes,
    /// and bind groups keyed by the buffer ranges they bind. A cached bind group keeps the
    /// buffers it binds alive (your buffers too, after you drop them) until it is evicted,
    /// least recently used first, or [`release_cached`](Context::release_cached) is called.
    /// Only what a call asks for a second time is kept, so one-off calls hold nothing.
    /// Shared by the context's clones.
    ///
    /// ```no_run
    /// use wgpu_attention::{CacheLimits, Context};
    /// let ctx = Context::new_blocking()?;
    /// // A loop that allocates new buffers often: keep fewer of them alive through the cache.
    /// ctx.set_cache_limits(CacheLimits { entries: 1024, bytes: 64 << 20 });
    /// // ... calls ...
    /// println!("{:?}", ctx.cache_stats());
    /// ctx.release_cached(); // frees what only the cache kept alive
    /// # Ok::<(), wgpu_attention::Error>(())
    /// ```
    pub fn set_cache_limits(&self, limits: crate::device::cache::CacheLimits) {
        self.inner.cache.set_limits(limits);
    }

    /// Drop every cached parameter buffer, constant input and bind group (freeing the buffers
    /// only they kept alive; the next calls create them again). The crate's own calls
    /// (`run` and the other calls that submit themselves) forget what a failed call
    /// cached by themselves; after a device error that your own error scope caught around a
    /// `record` (an out-of-memory makes invalid buffers), call this.
    pub fn release_cached(&self) {
        self.inner.cache.release();
    }

    /// What the cache holds now.
    pub fn cache_stats(&self) -> crate::device::cache::CacheStats {
        let (bind_groups, buffers, bytes_held) = self.inner.cache.stats();
        crate::device::cache::CacheStats {
            bind_groups,
            buffers,
            bytes_held,
        }
    }

    /// The faults injected into this context.
    pub(crate) fn faults(&self) -> &crate::device::faults::Injector {
        &self.inner.faults
    }

    /// Make `fault` happen to this context (and its clones): the allocation chosen runs out of
    /// memory, or the next readback fails, as a device's would. For testing how an application
    /// copes; the call that meets the fault returns the error, frees what it allocated, and the
    /// context stays usable. See `tests/faults.rs`.
    pub fn inject_fault(&self, fault: crate::device::faults::Fault) {
        self.inner.faults.inject(fault);
    }

    /// Withdraw every fault [`Context::inject_fault`] made pending.
    pub fn clear_faults(&self) {
        self.inner.faults.clear();
    }

    /// The pipeline cache.
    pub(crate) fn pipelines(&self) -> &PipelineCache {
        &self.inner.pipelines
    }

    /// The device.
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    /// The queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    /// The adapter's information (from the adapter, or from an adopted device).
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.info
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
        self.inner.info.device_type == wgpu::DeviceType::Cpu
    }

    /// A one-line description of the adapter (name, backend, driver).
    pub fn describe(&self) -> String {
        let i = &self.inner.info;
        // Browsers leave the name and driver empty unless the page asks for more.
        let name = if i.name.is_empty() {
            "unnamed adapter"
        } else {
            &i.name
        };
        let driver = format!("{} {}", i.driver, i.driver_info);
        let driver = driver.trim();
        let mut s = format!("{name} ({:?}, {:?}", i.backend, i.device_type);
        if !driver.is_empty() {
            s += &format!(", driver {driver}");
        }
        s + ")"
    }

    /// The cached mask_mod block map under `key` (`kernels::mod_map`).
    pub(crate) fn mod_map(&self, key: u64) -> Option<wgpu::Buffer> {
        let maps = self.inner.mod_maps.lock().unwrap_or_else(|e| e.into_inner());
        maps.iter().find(|(k, _)| *k == key).map(|(_, b)| b.clone())
    }

    /// Keep a mask_mod block map under `key`, dropping the oldest beyond [`MOD_MAPS`].
    pub(crate) fn keep_mod_map(&self, key: u64, map: wgpu::Buffer) {
        let mut maps = self.inner.mod_maps.lock().unwrap_or_else(|e| e.into_inner());
        maps.retain(|(k, _)| *k != key);
        maps.push((key, map));
        if maps.len() > MOD_MAPS {
            maps.remove(0);
        }
    }

    /// Largest size of one storage binding, in bytes.
    pub(crate) fn max_binding(&self) -> u64 {
        crate::forms::max_binding(&self.inner.limits)
    }

    /// Return the device-lost reason if the device is gone.
    pub(crate) fn check_lost(&self) -> Result<()> {
        match self.inner.lost.lock().unwrap().as_ref() {
            Some(msg) => Err(Error::DeviceLost(msg.clone())),
            None => Ok(()),
        }
    }

    /// [`Context::check_lost`] after polling the device (without waiting) on native targets,
    /// which runs a device-lost callback still pending: for when a call has failed.
    fn check_lost_now(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        if let Err(e) = self.inner.device.poll(wgpu::PollType::Poll) {
            if !matches!(e, wgpu::PollError::Timeout) {
                let mut lost = self.inner.lost.lock().unwrap();
                lost.get_or_insert_with(|| e.to_string());
            }
        }
        self.check_lost()
    }

    /// Run `f` inside validation, out-of-memory and internal error scopes and return the
    /// first error captured, if any.
    pub(crate) async fn scoped<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check_lost()?;
        let device = &self.inner.device;
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mark = self.inner.cache.mark();
        let result = f();
        let v = validation.pop().await;
        let o = oom.pop().await;
        let i = internal.pop().await;
        if crate::device::faults::Injector::take_pending_oom() {
            // A buffer made in the scope may be invalid: nothing cached in it is kept.
            self.inner.cache.forget_since(mark);
            return Err(Error::OutOfMemory(
                "injected fault: a buffer allocation failed".into(),
            ));
        }
        // A buffer that could not be allocated is invalid, and so is every use of it: report
        // the out-of-memory, not the validation errors that follow from it.
        if let Some(e) = o.or(v).or(i) {
            self.inner.cache.forget_since(mark);
            // A lost device makes every command invalid: report the cause, not the symptom.
            self.check_lost_now()?;
            return Err(e.into());
        }
        self.check_lost()?;
        result
    }

    /// Record with `f` into a new command encoder labelled `label` and submit it, all inside
    /// [`Context::scoped`] (so buffers `f` creates and every validation error are covered).
    pub(crate) async fn submit<T>(
        &self,
        label: &str,
        f: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<T>,
    ) -> Result<T> {
        self.scoped(|| {
            let mut encoder = self
                .device()
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
            let out = f(&mut encoder)?;
            self.queue().submit([encoder.finish()]);
            Ok(out)
        })
        .await
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

    /// Wait until the queue is idle and every kernel being compiled in the background (on CPU
    /// adapters the fused kernel's fastest form is compiled on a thread after its first use, which
    /// a quicker-to-compile form serves) is ready. Call it before timing steady-state runs, or
    /// before the process exits so that no compilation is cut off.
    pub fn wait_idle(&self) -> Result<()> {
        self.inner.pipelines.join();
        self.wait()
    }

    /// Whether kernels read their params struct from a read-only storage buffer instead of a
    /// uniform buffer: on CPU adapters that allow the extra storage binding. Mesa's lavapipe
    /// inlines uniform-buffer values that feed loop bounds into the shader and recompiles it on
    /// every dispatch (seconds for the unrolled kernels); storage buffers are not inlined.
    pub(crate) fn params_in_storage(&self, bindings: usize) -> bool {
        self.is_cpu() && self.limits().max_storage_buffers_per_shader_stage as usize >= bindings
    }

    /// The subgroup size when subgroup operations are enabled, the adapter reports a single
    /// size (lavapipe: 8), and the subgroup operations give the right results at that size (a
    /// one-workgroup check run once per context, `src/subgroup_probe.rs`: Mesa's lavapipe gets
    /// them wrong at 32 lanes); `None` otherwise.
    pub(crate) fn fixed_subgroup_size(&self) -> Option<u32> {
        let info = self.adapter_info();
        let reported = (self.features().contains(wgpu::Features::SUBGROUP)
            && info.subgroup_min_size == info.subgroup_max_size)
            .then_some(info.subgroup_min_size)?;
        #[cfg(not(target_arch = "wasm32"))]
        {
            *self.inner.subgroup.get_or_init(|| {
                let ok = crate::device::subgroup_probe::subgroups_work(
                    &self.inner.device,
                    &self.inner.queue,
                    reported,
                );
                if !ok {
                    eprintln!(
                        "wgpu-attention: {}: subgroup operations give wrong results at the reported \
                         size {reported}; the subgroup forms are not used",
                        info.name
                    );
                }
                ok.then_some(reported)
            })
        }
        #[cfg(target_arch = "wasm32")]
        Some(reported)
    }

    /// The number of compute pipelines this context's cache holds (every kernel form built so
    /// far): a figure for long runs, where it must stay bounded however many shapes go through.
    pub fn cached_pipelines(&self) -> usize {
        self.inner.pipelines.len()
    }

    /// Bytes of buffer memory the device holds now, as wgpu's allocator counts them, the
    /// crate's small cached buffers included. `None` where nothing counts them: without this
    /// crate's `counters` feature (wgpu's internal counters, off by default), and on the web,
    /// whose backend keeps no counts.
    pub fn buffer_memory(&self) -> Option<u64> {
        if !cfg!(feature = "counters") || cfg!(target_arch = "wasm32") {
            return None;
        }
        let bytes = self.inner.device.get_internal_counters().hal.buffer_memory.read();
        Some(bytes.max(0) as u64)
    }
}

/// The adapter [`Context::new`] uses, with its instance: the primary backends first, then every
/// backend.
async fn default_adapter() -> Result<(wgpu::Instance, wgpu::Adapter)> {
    // Without WGPU_BACKEND, try the primary backends (Vulkan, Metal, DX12, WebGPU) first and
    // fall back to every backend (GL included) only when they find nothing.
    let from_env = wgpu::Backends::from_env();
    let mut tries = vec![from_env.unwrap_or(wgpu::Backends::PRIMARY)];
    if from_env.is_none() {
        tries.push(wgpu::Backends::all());
    }
    let mut last = None;
    for backends in tries {
        let instance = crate::device::instance::compute_instance(backends);
        match select_adapter(&instance).await {
            Ok(adapter) => return Ok((instance, adapter)),
            Err(e @ Error::AdapterNotFound { .. }) => return Err(e),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one attempt"))
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
