//! The wgpu instance the crate makes for compute.
//!
//! wgpu's Vulkan backend enables every window system's surface extension it finds (Wayland,
//! Xlib, XCB). Mesa's implicit device-selection layer (`VK_LAYER_MESA_device_select`) then
//! connects to a Wayland display while the GPUs are listed, and on a machine without one
//! libwayland prints `error: XDG_RUNTIME_DIR is invalid or not set in the environment.`. A
//! compute context presents nothing, so on Linux its Vulkan instance is made without those
//! extensions.

/// A wgpu instance for `backends` with wgpu's settings from the environment; see
/// [`Context::compute_instance`](crate::Context::compute_instance).
pub(crate) fn compute_instance(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = backends;
    #[cfg(all(target_os = "linux", feature = "vulkan"))]
    if let Some(instance) = vulkan_without_surfaces(&desc) {
        return instance;
    }
    wgpu::Instance::new(desc)
}

/// The Vulkan instance without window-system surface extensions, where `desc` asks for Vulkan
/// alone among the backends Linux has (GL too: wgpu's own instance, which holds both) with
/// wgpu's default flags. `None`
/// when Vulkan is not asked for, or its loader is missing or refuses (wgpu's own instance then
/// reports the same, as it would have).
#[cfg(all(target_os = "linux", feature = "vulkan"))]
fn vulkan_without_surfaces(desc: &wgpu::InstanceDescriptor) -> Option<wgpu::Instance> {
    use wgpu::hal;
    let on_linux = desc.backends & (wgpu::Backends::VULKAN | wgpu::Backends::GL);
    // wgpu-core keeps its default flags for an instance made from wgpu-hal's: where the
    // environment sets others (WGPU_STRICT_WEBGPU_COMPLIANCE, WGPU_VALIDATION, ...), wgpu's own
    // instance keeps them.
    if on_linux != wgpu::Backends::VULKAN || desc.flags != wgpu::InstanceFlags::default() {
        return None;
    }
    let hal_desc = hal::InstanceDescriptor {
        name: "wgpu-attention",
        flags: desc.flags,
        memory_budget_thresholds: desc.memory_budget_thresholds,
        backend_options: desc.backend_options.clone(),
        telemetry: None,
        display: None,
    };
    // wgpu-hal asks callers not to remove extensions from its list, so that nothing it relies
    // on goes missing. These three are used only to make surfaces from windows
    // (`create_surface_from_{wayland,xlib,xcb}`), which this instance is never asked to do:
    // wgpu makes surfaces only through `Instance::create_surface`, and the crate never calls it.
    let surfaces = [
        c"VK_KHR_wayland_surface",
        c"VK_KHR_xlib_surface",
        c"VK_KHR_xcb_surface",
    ];
    let callback: Box<hal::vulkan::CreateInstanceCallback> = Box::new(move |args| {
        args.extensions.retain(|e| !surfaces.contains(e));
    });
    // SAFETY: as above; nothing else about the instance changes.
    let raw = unsafe { <hal::vulkan::Instance>::init_with_callback(&hal_desc, Some(callback)) }.ok()?;
    // SAFETY: `raw` is a valid Vulkan instance that wgpu now owns.
    Some(unsafe { wgpu::Instance::from_hal::<hal::api::Vulkan>(raw) })
}
