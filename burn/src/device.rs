//! One device for burn and the kernels: burn's runtime made on a context, or a context adopted
//! from a device burn made; and the registry that finds a tensor's context.

use std::sync::Mutex;

use burn::backend::wgpu::{WgpuDevice, WgpuSetup};
use burn::tensor::Device;
use wgpu_attention::Context;

use crate::{Error, Result};

/// The contexts of the wgpu devices made here, by burn's device id.
static CONTEXTS: Mutex<Vec<(WgpuDevice, Context)>> = Mutex::new(Vec::new());

/// The features burn's runtime compiles for: every feature of the adapter but
/// `MAPPABLE_PRIMARY_BUFFERS` (burn's kernels use 64-bit integers where the adapter has them,
/// for one).
pub fn burn_features() -> wgpu_attention::wgpu::Features {
    use wgpu_attention::wgpu::Features;
    Features::all().difference(Features::MAPPABLE_PRIMARY_BUFFERS)
}

/// A context to share with burn: [`Context::new`] (wgpu's default adapter, its own limits, the
/// features the kernels use), its device also requesting every feature of the adapter that
/// burn's runtime compiles for ([`burn_features`]). Then [`device_on`].
pub fn new_context() -> Result<Context> {
    Ok(pollster::block_on(Context::new_with_features(burn_features()))?)
}

/// burn's wgpu runtime on `ctx`'s device and queue: tensors made on the returned device live in
/// the same device memory as the crate's buffers, and both submit to one queue. Call it once
/// per context and clone the device (each call registers a new runtime with burn). For autodiff,
/// `.autodiff()` on the result.
///
/// burn compiles its kernels for the adapter's features, not the device's: the device must have
/// every feature of its adapter that burn uses. Make the context with [`new_context`], or with
/// [`Context::from_instance_parts`] on a device requested with `adapter.features()` (minus
/// `MAPPABLE_PRIMARY_BUFFERS`) and `adapter.limits()`, as burn requests its own. A device that
/// lacks some ([`Context::new`]'s requests only what the kernels use) and a context made by
/// `Context::from_device` (no adapter or instance) are [`Error::Setup`], before burn is given
/// anything.
pub fn device_on(ctx: &Context) -> Result<Device> {
    let (Some(instance), Some(adapter)) = (ctx.instance(), ctx.adapter()) else {
        return Err(Error::Setup(
            "the context knows no instance and adapter (Context::from_device); use Context::new or \
             Context::from_instance_parts"
                .into(),
        ));
    };
    let lacking = (adapter.features() & burn_features()).difference(ctx.device().features());
    if !lacking.is_empty() {
        return Err(Error::Setup(format!(
            "the device lacks features of its adapter that burn's kernels are compiled for: \
             {lacking:?} (make the context with wgpu_attention_burn::new_context)"
        )));
    }
    let setup = WgpuSetup {
        instance: instance.clone(),
        adapter: adapter.clone(),
        device: ctx.device().clone(),
        queue: ctx.queue().clone(),
        backend: adapter.get_info().backend,
    };
    let device = Device::wgpu_options()
        .setup(setup)
        .init()
        .map_err(|e| Error::Setup(format!("{e:?}")))?;
    register(&device, ctx.clone())?;
    Ok(device)
}

/// A device burn makes (its default wgpu adapter and settings), and this crate's context on it:
/// the other way round from [`device_on`], for applications that let burn choose.
pub fn new_device() -> Result<(Device, Context)> {
    let (device, setup) = Device::wgpu_options()
        .init_with_setup()
        .map_err(|e| Error::Setup(format!("{e:?}")))?;
    let ctx = Context::from_instance_parts(setup.instance, &setup.adapter, setup.device, setup.queue);
    register(&device, ctx.clone())?;
    Ok((device, ctx))
}

/// The context of a device made by [`device_on`] or [`new_device`] (autodiff or not).
pub fn context_of(device: &Device) -> Result<Context> {
    let wgpu = wgpu_device(device, "device")?;
    lookup(&wgpu, "device")
}

fn register(device: &Device, ctx: Context) -> Result<()> {
    let wgpu = wgpu_device(device, "device")?;
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(d, _)| *d != wgpu);
    all.push((wgpu, ctx));
    Ok(())
}

/// The context of burn's wgpu device `device`.
pub(crate) fn lookup(device: &WgpuDevice, name: &'static str) -> Result<Context> {
    let all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .find(|(d, _)| d == device)
        .map(|(_, c)| c.clone())
        .ok_or_else(|| Error::UnknownDevice {
            name,
            device: format!("{device:?}"),
        })
}

/// burn's wgpu device behind a (dispatch) device.
pub(crate) fn wgpu_device(device: &Device, name: &'static str) -> Result<WgpuDevice> {
    let plain = device.clone().without_autodiff();
    match plain.as_dispatch() {
        burn::backend::DispatchDevice::Cube(burn_cubecl::CubeDevice::Wgpu(d)) => Ok(d.clone()),
        other => Err(Error::NotWgpu {
            name,
            detail: format!("on {other:?}"),
        }),
    }
}
