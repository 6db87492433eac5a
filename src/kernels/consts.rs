//! Specialisation constants, declared once in Rust and typed, and the prelude that carries them.
//!
//! A kernel's form is chosen by constants its prelude declares (`const BK: u32 = 32u;`): tile
//! sizes, which optional inputs are bound, which modifiers are compiled in. `wgsl_consts!`
//! declares a group of them as a Rust struct whose field names are the WGSL names, so a value
//! is built with every field named and typed, and its WGSL declarations are generated from the
//! same list. A [`Prelude`] is the text a kernel is assembled with and the typed constants it
//! declares: the pipeline's label names the variant by them, and the GPU-free tests parse
//! every enumerated variant with naga and compare each declared constant's type and value
//! with the Rust value ([`check_module`]), as they compare the params structs.
//!
//! The matmul's override constants (`override TRANS_B: bool`) are declared the same way and
//! handed to the pipeline as overrides ([`overrides`]).

/// A specialisation constant's value: WGSL `u32` or `bool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ConstValue {
    /// `u32`.
    U32(u32),
    /// `bool`.
    Bool(bool),
}

impl From<u32> for ConstValue {
    fn from(v: u32) -> Self {
        ConstValue::U32(v)
    }
}

impl From<bool> for ConstValue {
    fn from(v: bool) -> Self {
        ConstValue::Bool(v)
    }
}

impl ConstValue {
    /// Its WGSL type.
    pub(crate) fn wgsl_type(self) -> &'static str {
        match self {
            ConstValue::U32(_) => "u32",
            ConstValue::Bool(_) => "bool",
        }
    }

    /// Its WGSL literal.
    pub(crate) fn literal(self) -> String {
        match self {
            ConstValue::U32(v) => format!("{v}u"),
            ConstValue::Bool(b) => b.to_string(),
        }
    }

    /// As a pipeline override constant (wgpu takes every override as an `f64`).
    pub(crate) fn as_f64(self) -> f64 {
        match self {
            ConstValue::U32(v) => v as f64,
            ConstValue::Bool(b) => b as u32 as f64,
        }
    }
}

/// A group of constants declared by `wgsl_consts!`.
pub(crate) trait WgslConsts {
    /// Each constant's WGSL name and value, in declaration order.
    fn items(&self) -> Vec<(&'static str, ConstValue)>;
}

/// Declare a group of specialisation constants (see the module docs): a struct whose fields
/// are named as in WGSL and typed `u32` or `bool`.
macro_rules! wgsl_consts {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        #[allow(non_snake_case)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis struct $name {
            $($(#[$fmeta])* pub $field: $ty),*
        }

        impl $crate::kernels::consts::WgslConsts for $name {
            fn items(&self) -> Vec<(&'static str, $crate::kernels::consts::ConstValue)> {
                vec![$((stringify!($field), self.$field.into())),*]
            }
        }
    };
}

/// The pipeline override constants of `c`, as wgpu takes them.
pub(crate) fn overrides(c: &impl WgslConsts) -> Vec<(&'static str, f64)> {
    c.items().into_iter().map(|(n, v)| (n, v.as_f64())).collect()
}

/// The prelude a kernel is assembled with: generated constant declarations and chosen WGSL
/// snippets, in order, and the typed constants among them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prelude {
    text: String,
    consts: Vec<(&'static str, ConstValue)>,
    tags: Vec<String>,
    /// Read-only storage bindings the snippets declare after the kernel's own (before its
    /// params): an 8-bit K or V cache's scales.
    extra: u32,
}

impl Prelude {
    /// An empty prelude.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Append the declarations of `c`.
    pub(crate) fn consts(mut self, c: &impl WgslConsts) -> Self {
        for (name, v) in c.items() {
            debug_assert!(
                !self.consts.iter().any(|(n, _)| *n == name),
                "constant {name} declared twice"
            );
            self.text
                .push_str(&format!("const {name}: {} = {};\n", v.wgsl_type(), v.literal()));
            self.consts.push((name, v));
        }
        self
    }

    /// Append WGSL code (a chosen snippet, generated accessors).
    pub(crate) fn code(mut self, wgsl: &str) -> Self {
        self.text.push_str(wgsl);
        self
    }

    /// Append another prelude (its text, constants and tags).
    pub(crate) fn then(mut self, other: Prelude) -> Self {
        self.text.push_str(&other.text);
        self.consts.extend(other.consts);
        self.tags.extend(other.tags);
        self.extra += other.extra;
        self
    }

    /// Declare `n` more read-only storage bindings after the kernel's own.
    pub(crate) fn extra_bindings(mut self, n: u32) -> Self {
        self.extra += n;
        self
    }

    /// The read-only storage bindings declared after the kernel's own.
    pub(crate) fn extra(&self) -> usize {
        self.extra as usize
    }

    /// Name a choice the constants do not show (a storage format, a snippet) in the label.
    pub(crate) fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tags.push(tag.into());
        self
    }

    /// The WGSL text.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The typed constants declared, in order.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn declared(&self) -> &[(&'static str, ConstValue)] {
        &self.consts
    }

    /// The variant's label: the kernel's name, its tags, its numeric constants and the names of
    /// its true boolean ones, e.g. `flash q=f16 E4=16 BK=32 WG=64 HAS_MASK`.
    pub(crate) fn label(&self, kernel: &str) -> String {
        let mut s = kernel.to_string();
        for t in &self.tags {
            s.push(' ');
            s.push_str(t);
        }
        for (name, v) in &self.consts {
            match v {
                ConstValue::U32(v) => s.push_str(&format!(" {name}={v}")),
                ConstValue::Bool(true) => s.push_str(&format!(" {name}")),
                ConstValue::Bool(false) => {}
            }
        }
        s
    }
}

impl From<&str> for Prelude {
    fn from(wgsl: &str) -> Self {
        Prelude::new().code(wgsl)
    }
}

impl From<String> for Prelude {
    fn from(wgsl: String) -> Self {
        Prelude::new().code(&wgsl)
    }
}

/// Check, in the naga module of a kernel assembled with `prelude` (its overrides `overrides`),
/// that every typed constant is declared with its type and value, every override with its
/// type, and that the prelude declares no top-level constant outside its typed ones.
#[cfg(test)]
pub(crate) fn check_module(
    label: &str,
    module: &naga::Module,
    prelude: &Prelude,
    overrides: &[(&'static str, ConstValue)],
) {
    use naga::{Expression, Literal, Scalar, TypeInner};
    let scalar = |ty: naga::Handle<naga::Type>, v: ConstValue| match (&module.types[ty].inner, v) {
        (TypeInner::Scalar(s), ConstValue::U32(_)) => *s == Scalar::U32,
        (TypeInner::Scalar(s), ConstValue::Bool(_)) => *s == Scalar::BOOL,
        _ => false,
    };
    for &(name, v) in prelude.declared() {
        let (_, c) = module
            .constants
            .iter()
            .find(|(_, c)| c.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{label}: constant {name} is not in the module"));
        assert!(
            scalar(c.ty, v),
            "{label}: constant {name} is not a {}",
            v.wgsl_type()
        );
        let value = match module.global_expressions[c.init] {
            Expression::Literal(Literal::U32(x)) => Some(ConstValue::U32(x)),
            Expression::Literal(Literal::Bool(b)) => Some(ConstValue::Bool(b)),
            _ => None,
        };
        assert_eq!(value, Some(v), "{label}: constant {name}");
    }
    for &(name, v) in overrides {
        let (_, o) = module
            .overrides
            .iter()
            .find(|(_, o)| o.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{label}: override {name} is not in the module"));
        assert!(
            scalar(o.ty, v),
            "{label}: override {name} is not a {}",
            v.wgsl_type()
        );
    }
    for line in prelude.text().lines() {
        if let Some(rest) = line.strip_prefix("const ") {
            let name = rest.split(':').next().unwrap_or("").trim();
            assert!(
                prelude.declared().iter().any(|(n, _)| *n == name),
                "{label}: the prelude declares {name} outside its typed constants"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    wgsl_consts! {
        struct Two {
            N: u32,
            ON: bool,
        }
    }

    fn module(prelude_text: &str) -> naga::Module {
        let src = format!("{prelude_text}@compute @workgroup_size(1) fn main() {{ if (ON) {{ _ = N; }} }}\n");
        naga::front::wgsl::parse_str(&src).unwrap()
    }

    #[test]
    fn declared_constants_are_found_with_their_types_and_values() {
        let p = Prelude::new().consts(&Two { N: 7, ON: true }).code("fn f() {}\n");
        check_module("two", &module(p.text()), &p, &[]);
        assert_eq!(p.label("k"), "k N=7 ON");
        let items = Two { N: 3, ON: false }.items();
        assert_eq!(
            items,
            vec![("N", ConstValue::U32(3)), ("ON", ConstValue::Bool(false))]
        );
        assert_eq!(overrides(&Two { N: 3, ON: true }), vec![("N", 3.0), ("ON", 1.0)]);
    }

    #[test]
    #[should_panic(expected = "constant N")]
    fn a_constant_of_another_value_fails() {
        let p = Prelude::new().consts(&Two { N: 7, ON: true });
        check_module(
            "two",
            &module("const N: u32 = 8u;\nconst ON: bool = true;\n"),
            &p,
            &[],
        );
    }

    #[test]
    #[should_panic(expected = "is not a u32")]
    fn a_constant_of_another_type_fails() {
        let p = Prelude::new().consts(&Two { N: 7, ON: true });
        check_module(
            "two",
            &module("const N: i32 = 7i;\nconst ON: bool = true;\n"),
            &p,
            &[],
        );
    }

    #[test]
    #[should_panic(expected = "outside its typed constants")]
    fn a_hand_written_constant_fails() {
        let p = Prelude::new()
            .consts(&Two { N: 7, ON: true })
            .code("const EXTRA: u32 = 1u;\n");
        check_module("two", &module(p.text()), &p, &[]);
    }
}
