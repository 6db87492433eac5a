//! Params structs shared with WGSL, declared once in Rust.
//!
//! `wgsl_struct!` declares a `#[repr(C)]` + `bytemuck::Pod` struct of
//! 4-byte scalars (and nested structs declared the same way) and derives its WGSL declaration
//! from the same field list, so a field added in Rust is in the shader too: the kernels' WGSL
//! files never spell out their `Params`; [`crate::kernels::source`] prepends the generated one.
//! A test parses every kernel with naga and compares each field's name and offset.

/// A type that has a WGSL spelling: `u32`, `i32`, `f32`, or a [`WgslStruct`].
pub(crate) trait WgslType {
    /// The type's name in WGSL.
    fn wgsl_name() -> &'static str;
    /// Declarations this type needs before it can be used (a struct's own, with its members').
    fn wgsl_decls() -> String {
        String::new()
    }
}

impl WgslType for u32 {
    fn wgsl_name() -> &'static str {
        "u32"
    }
}

impl WgslType for i32 {
    fn wgsl_name() -> &'static str {
        "i32"
    }
}

impl WgslType for f32 {
    fn wgsl_name() -> &'static str {
        "f32"
    }
}

/// A struct declared by `wgsl_struct!`.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) trait WgslStruct: bytemuck::Pod + WgslType {
    /// Field names with their byte offsets in the Rust struct, in order.
    fn fields() -> Vec<(&'static str, usize)>;
}

/// Declare a params struct in Rust and WGSL at once (see the module docs). Every field is a
/// 4-byte scalar or a struct declared by this macro; the size must be a multiple of 16 bytes
/// and a nested struct must sit at a multiple of 16 (WGSL's uniform layout; checked by tests).
macro_rules! wgsl_struct {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[$fmeta])* pub $field: $ty),*
        }

        impl $crate::kernels::wgsl::WgslType for $name {
            fn wgsl_name() -> &'static str {
                stringify!($name)
            }
            fn wgsl_decls() -> String {
                let mut decls = String::new();
                let mut body = String::new();
                $(
                    let d = <$ty as $crate::kernels::wgsl::WgslType>::wgsl_decls();
                    if !decls.contains(&d) {
                        decls.push_str(&d);
                    }
                    body.push_str(&format!(
                        "    {}: {},\n",
                        stringify!($field),
                        <$ty as $crate::kernels::wgsl::WgslType>::wgsl_name()
                    ));
                )*
                format!("{decls}struct {} {{\n{body}}}\n", stringify!($name))
            }
        }

        impl $crate::kernels::wgsl::WgslStruct for $name {
            fn fields() -> Vec<(&'static str, usize)> {
                vec![$((stringify!($field), std::mem::offset_of!($name, $field))),*]
            }
        }
    };
}
