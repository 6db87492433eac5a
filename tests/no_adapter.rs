//! Without a usable adapter, `Context::new` returns a typed error that says how to get one.
//! (A test binary of its own: it changes the process environment.)

use wgpu_attention::{Context, Error};

#[test]
fn missing_adapter_errors_explain_the_fix() {
    // An adapter name that matches nothing.
    std::env::set_var("WGPU_ADAPTER_NAME", "no-such-adapter-xyz");
    match Context::new_blocking() {
        Err(Error::AdapterNotFound { wanted, .. }) => assert_eq!(wanted, "no-such-adapter-xyz"),
        other => panic!("expected AdapterNotFound, got {other:?}"),
    }
    std::env::remove_var("WGPU_ADAPTER_NAME");
    // A backend this machine does not have (Metal off Apple, Vulkan on Apple).
    let backend = if cfg!(target_vendor = "apple") {
        "vulkan"
    } else {
        "metal"
    };
    std::env::set_var("WGPU_BACKEND", backend);
    match Context::new_blocking() {
        Err(e @ Error::NoAdapter { .. }) => assert!(e.to_string().contains("mesa-vulkan-drivers"), "{e}"),
        other => panic!("expected NoAdapter, got {other:?}"),
    }
}
