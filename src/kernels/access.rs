//! Storage-format access for the kernels: the host generates each buffer's declaration and
//! its accessors for the buffer's [`Storage`], so a kernel reads and writes f32, f16 or bf16
//! through the same calls and accumulates in f32:
//!
//! - `NAME_get(i) -> f32`: element `i`;
//! - `NAME_get4(i) -> vec4<f32>`: elements `i .. i + 4` (`i` a multiple of 4 in the vec4 layout);
//! - `NAME_set4(i, x)`, `NAME_set2(i, x)`: store 4 (2) elements at `i`, a multiple of 4 (2);
//! - `NAME_set(i, x)`: store one element (f32, or a half format declared [`Access::Atomic`]).
//!
//! Layouts: f32 as `array<vec4<f32>>` (vec4 layout) or `array<f32>`; half formats two per
//! `u32` word, as `array<vec2<u32>>` (vec4 layout) or `array<u32>`. Half words are converted
//! with WGSL's core `unpack2x16float`/`pack2x16float` (f16; no `shader-f16` needed) or by
//! shifts (bf16, the upper half of an f32, rounded to nearest even on store). Two invocations
//! that store the two halves of one word race, so a half output whose stores are not whole
//! words is declared [`Access::Atomic`]: each element is stored by an `atomicAnd` clearing its
//! half and an `atomicOr` setting it, which commute with the other half's.

use crate::storage::{Formats, Storage};

/// How a kernel uses a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Read only.
    Read,
    /// Written in whole words (`set4`, `set2`; `set` for f32).
    Write,
    /// Written element by element (`set`): atomics for half formats.
    Atomic,
}

/// The WGSL helpers the half formats need (declared once per kernel).
pub(crate) const HELPERS: &str = "\
fn bf16_unpack2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}
fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u; // NaN stays a (quiet) NaN
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u; // round to nearest even
}
fn bf16_pack2(x: vec2<f32>) -> u32 {
    return bf16_bits(x.x) | (bf16_bits(x.y) << 16u);
}
";

/// The WGSL decoders of the 8-bit formats: four codes of a word (byte `c` of the word is code
/// `c`), unscaled. e4m3 goes through WGSL's core `unpack2x16float` (an e4m3 code's bits
/// placed in an f16 are its value times 2^-8, exact; no `shader-f16` needed), the NaN codes
/// made NaN on a rare branch. Measured on lavapipe (paged_d_fp8): the same decode from the
/// code's bit fields in f32 took 1.5x the time.
pub(crate) const QUANT_HELPERS: &str = "\
fn int8_decode4(w: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
fn fp8_decode4(w: u32) -> vec4<f32> {
    // Codes 0 and 2, then 1 and 3, as f16 pairs: sign to bit 15, exponent and mantissa to bits
    // 7-14 (an f16 of exponent e - 8 and the same mantissa: the e4m3 value times 2^-8, exact,
    // subnormals included), widened by unpack2x16float.
    let x = w & 0x00ff00ffu;
    let y = (w >> 8u) & 0x00ff00ffu;
    let a = unpack2x16float(((x & 0x00800080u) << 8u) | ((x & 0x007f007fu) << 7u));
    let b = unpack2x16float(((y & 0x00800080u) << 8u) | ((y & 0x007f007fu) << 7u));
    var v = vec4<f32>(a.x, b.x, a.y, b.y) * 256.0;
    // A NaN code (0x7f or 0xff): a byte of w & 0x7f7f7f7f equal to 0x7f. Rare: one test.
    let t = (w & 0x7f7f7f7fu) ^ 0x7f7f7f7fu;
    if (((t - 0x01010101u) & ~t & 0x80808080u) != 0u) {
        let c = (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0x7fu);
        // w & 0u keeps the NaN a runtime value (a constant NaN is not a WGSL constant).
        v = select(v, vec4<f32>(bitcast<f32>(0x7fc00000u | (w & 0u))), c == vec4<u32>(0x7fu));
    }
    return v;
}
";

/// A read-only 8-bit K or V cache `name` at `binding` (four codes per `u32`; `wide`: declared
/// as `array<vec4<u32>>`, 16 codes per load, for rows of a multiple of 16 codes from 16-code
/// boundaries) and its f32 scales `NAME_scales` at `scales`, with `get`, `get4` and `get8`
/// returning the scaled values. The scale of element `i`: int8, its row's, `NAME_scales[i /
/// row]` (`row` the head dim, a constant expression: rows start at multiples of it); fp8, its
/// kv head's, `NAME_scales[(i / p.x.NAME_hs) % p.x.kv_heads]`, found once per row (the last
/// row's kept in private memory: the kernels read a row in several loads).
pub(crate) fn quantized_array(
    name: &str,
    binding: u32,
    scales: u32,
    s: Storage,
    row: &str,
    wide: bool,
    fp8_rows: Option<(usize, usize)>,
) -> String {
    let n = name;
    let (dec, scale) = match (s, fp8_rows) {
        (Storage::Int8, _) => (
            "int8_decode4",
            format!("fn {n}_scale(i: u32) -> f32 {{ return {n}_scales[i / ({row})]; }}\n"),
        ),
        // Paged: the head of row r is (r / rows per head block) % Hkv, constants (a multiply
        // and a shift, no division).
        (_, Some((heads, per))) => (
            "fp8_decode4",
            format!("fn {n}_scale(i: u32) -> f32 {{ return {n}_scales[((i / ({row})) / {per}u) % {heads}u]; }}\n"),
        ),
        _ => (
            "fp8_decode4",
            format!(
                "var<private> {n}_srow: u32 = 0xffffffffu;\nvar<private> {n}_sval: f32 = 0.0;\n\
                 fn {n}_scale(i: u32) -> f32 {{\n    let r = i / ({row});\n    if (r != {n}_srow) {{\n        \
                 {n}_srow = r;\n        {n}_sval = {n}_scales[(i / p.x.{n}_hs) % p.x.kv_heads];\n    }}\n    return {n}_sval;\n}}\n"
            ),
        ),
    };
    let (ty, word, word8) = if wide {
        (
            "vec4<u32>",
            format!("{n}[i >> 4u][(i >> 2u) & 3u]"),
            format!("let w = {n}[i >> 4u];\n    let h = select(w.xy, w.zw, (i & 8u) != 0u);"),
        )
    } else {
        (
            "u32",
            format!("{n}[i >> 2u]"),
            format!("let h = vec2<u32>({n}[i >> 2u], {n}[(i >> 2u) + 1u]);"),
        )
    };
    format!(
        "@group(0) @binding({binding}) var<storage, read> {n}: array<{ty}>;\n\
         @group(0) @binding({scales}) var<storage, read> {n}_scales: array<f32>;\n\
         {scale}\
         fn {n}_get4(i: u32) -> vec4<f32> {{ return {dec}({word}) * {n}_scale(i); }}\n\
         fn {n}_get(i: u32) -> f32 {{ return {n}_get4(i & ~3u)[i & 3u]; }}\n\
         fn {n}_get8(i: u32) -> array<vec4<f32>, 2> {{\n    {word8}\n    let sc = {n}_scale(i);\n    \
         return array<vec4<f32>, 2>({dec}(h.x) * sc, {dec}(h.y) * sc);\n}}\n"
    )
}

fn unpack(s: Storage) -> &'static str {
    match s {
        Storage::F16 => "unpack2x16float",
        _ => "bf16_unpack2",
    }
}

fn pack(s: Storage) -> &'static str {
    match s {
        Storage::F16 => "pack2x16float",
        _ => "bf16_pack2",
    }
}

/// The declaration of `name` at `binding` in format `s` and its accessors. `vec4`: the vec4
/// layout (every `get4`/`set4` index a multiple of 4; the binding's size a multiple of 16
/// bytes for f32, 8 for half formats).
pub(crate) fn array(name: &str, binding: u32, s: Storage, vec4: bool, access: Access) -> String {
    let mode = if access == Access::Read {
        "read"
    } else {
        "read_write"
    };
    let n = name;
    let mut w = String::new();
    let decl = |ty: &str| format!("@group(0) @binding({binding}) var<storage, {mode}> {n}: array<{ty}>;\n");
    match (s, vec4) {
        (Storage::F32, true) => {
            w += &decl("vec4<f32>");
            w += &format!("fn {n}_get(i: u32) -> f32 {{ return {n}[i >> 2u][i & 3u]; }}\n");
            w += &format!("fn {n}_get4(i: u32) -> vec4<f32> {{ return {n}[i >> 2u]; }}\n");
            if access != Access::Read {
                w += &format!("fn {n}_set(i: u32, x: f32) {{ {n}[i >> 2u][i & 3u] = x; }}\n");
                w += &format!(
                    "fn {n}_set2(i: u32, x: vec2<f32>) {{ {n}_set(i, x.x); {n}_set(i + 1u, x.y); }}\n"
                );
                w += &format!("fn {n}_set4(i: u32, x: vec4<f32>) {{ {n}[i >> 2u] = x; }}\n");
            }
        }
        (Storage::F32, false) => {
            w += &decl("f32");
            w += &format!("fn {n}_get(i: u32) -> f32 {{ return {n}[i]; }}\n");
            w += &format!(
                "fn {n}_get4(i: u32) -> vec4<f32> {{ return vec4<f32>({n}[i], {n}[i + 1u], {n}[i + 2u], {n}[i + 3u]); }}\n"
            );
            if access != Access::Read {
                w += &format!("fn {n}_set(i: u32, x: f32) {{ {n}[i] = x; }}\n");
                w += &format!("fn {n}_set2(i: u32, x: vec2<f32>) {{ {n}[i] = x.x; {n}[i + 1u] = x.y; }}\n");
                w += &format!(
                    "fn {n}_set4(i: u32, x: vec4<f32>) {{ {n}[i] = x.x; {n}[i + 1u] = x.y; {n}[i + 2u] = x.z; {n}[i + 3u] = x.w; }}\n"
                );
            }
        }
        (_, _) if access == Access::Atomic => {
            let pk = pack(s);
            w += &decl("atomic<u32>");
            w += &format!(
                "fn {n}_get(i: u32) -> f32 {{ return {}(atomicLoad(&{n}[i >> 1u]))[i & 1u]; }}\n",
                unpack(s)
            );
            w += &format!(
                "fn {n}_set(i: u32, x: f32) {{\n    let sh = (i & 1u) * 16u;\n    let h = ({pk}(vec2<f32>(x, x)) & 0xffffu) << sh;\n    \
                 atomicAnd(&{n}[i >> 1u], ~(0xffffu << sh));\n    atomicOr(&{n}[i >> 1u], h);\n}}\n"
            );
            w += &format!("fn {n}_set2(i: u32, x: vec2<f32>) {{ {n}_set(i, x.x); {n}_set(i + 1u, x.y); }}\n");
            w += &format!(
                "fn {n}_set4(i: u32, x: vec4<f32>) {{ {n}_set2(i, x.xy); {n}_set2(i + 2u, x.zw); }}\n"
            );
        }
        (_, true) => {
            let (up, pk) = (unpack(s), pack(s));
            w += &decl("vec2<u32>");
            w += &format!(
                "fn {n}_get(i: u32) -> f32 {{ return {up}({n}[i >> 2u][(i >> 1u) & 1u])[i & 1u]; }}\n"
            );
            w += &format!(
                "fn {n}_get4(i: u32) -> vec4<f32> {{ let w = {n}[i >> 2u]; return vec4<f32>({up}(w.x), {up}(w.y)); }}\n"
            );
            if access != Access::Read {
                w += &format!(
                    "fn {n}_set2(i: u32, x: vec2<f32>) {{ {n}[i >> 2u][(i >> 1u) & 1u] = {pk}(x); }}\n"
                );
                w += &format!(
                    "fn {n}_set4(i: u32, x: vec4<f32>) {{ {n}[i >> 2u] = vec2<u32>({pk}(x.xy), {pk}(x.zw)); }}\n"
                );
            }
        }
        (_, false) => {
            let (up, pk) = (unpack(s), pack(s));
            w += &decl("u32");
            w += &format!("fn {n}_get(i: u32) -> f32 {{ return {up}({n}[i >> 1u])[i & 1u]; }}\n");
            w += &format!(
                "fn {n}_get4(i: u32) -> vec4<f32> {{ return vec4<f32>({n}_get(i), {n}_get(i + 1u), {n}_get(i + 2u), {n}_get(i + 3u)); }}\n"
            );
            if access != Access::Read {
                w += &format!("fn {n}_set2(i: u32, x: vec2<f32>) {{ {n}[i >> 1u] = {pk}(x); }}\n");
                w += &format!(
                    "fn {n}_set4(i: u32, x: vec4<f32>) {{ {n}_set2(i, x.xy); {n}_set2(i + 2u, x.zw); }}\n"
                );
            }
        }
    }
    w
}

/// A read-only `name` in the vec8 layout (8 consecutive elements per load: `array<vec4<u32>>`
/// for half formats, so a half load moves 16 bytes; `array<vec4<f32>>` for f32): `get4(i)` (`i`
/// a multiple of 4) and `get8(i) -> array<vec4<f32>, 2>` (`i` a multiple of 8). The binding's
/// size must be a multiple of 16 bytes.
pub(crate) fn array8(name: &str, binding: u32, s: Storage) -> String {
    let n = name;
    let mut w = String::new();
    if s == Storage::F32 {
        w += &format!("@group(0) @binding({binding}) var<storage, read> {n}: array<vec4<f32>>;\n");
        w += &format!("fn {n}_get4(i: u32) -> vec4<f32> {{ return {n}[i >> 2u]; }}\n");
        w += &format!(
            "fn {n}_get8(i: u32) -> array<vec4<f32>, 2> {{ return array<vec4<f32>, 2>({n}[i >> 2u], {n}[(i >> 2u) + 1u]); }}\n"
        );
    } else {
        let up = unpack(s);
        w += &format!("@group(0) @binding({binding}) var<storage, read> {n}: array<vec4<u32>>;\n");
        w += &format!(
            "fn {n}_get4(i: u32) -> vec4<f32> {{\n    let w = {n}[i >> 3u];\n    \
             let h = select(w.xy, w.zw, (i & 4u) != 0u);\n    return vec4<f32>({up}(h.x), {up}(h.y));\n}}\n"
        );
        w += &format!(
            "fn {n}_get8(i: u32) -> array<vec4<f32>, 2> {{\n    let w = {n}[i >> 3u];\n    \
             return array<vec4<f32>, 2>(vec4<f32>({up}(w.x), {up}(w.y)), vec4<f32>({up}(w.z), {up}(w.w)));\n}}\n"
        );
    }
    w
}

/// The attention kernels' q, k, v (bindings 3-5) and out (binding 6) in their formats, with
/// `load_q`/`load_k`/`load_v(row, c4) -> vec4<f32>` (column block `c4` of a row, zero padded
/// past the head dim) and `store_out(row, c4, x)`. `vec4`: E and Ev are multiples of 4 (one
/// load per block; `E4`/`EV4` are the dims in vec4s), and so are the offsets and strides of
/// every view; else every element is bounds-checked against `p.e` / `p.ev`. `out` is
/// `out_fmt` (f32 scratch for the decode kernel's partials). `vec8` (E and Ev multiples of 8,
/// with `vec4`, views aligned to 8): k and v in the vec8 layout ([`array8`]), and
/// `load_k8`/`load_v8(row, c8) -> array<vec4<f32>, 2>` read 8 elements in one load for half
/// formats (elsewhere they are two `load_*` calls). `views`: the tensors read (written)
/// through views (`p.x`), the others dense.
/// Whether [`attention_io`] stores the output element by element with atomics: a half format
/// whose rows are not vec4s and either of odd length or through a view whose pairs are not
/// whole words.
pub(crate) fn out_is_atomic(out_fmt: Storage, vec4: bool, ev_odd: bool, views: &crate::view::Views) -> bool {
    let out_pairs = views.out.is_none_or(|v| v.aligned(2));
    out_fmt.is_half() && !vec4 && (ev_odd || !out_pairs)
}

#[allow(clippy::too_many_arguments)] // the I/O's independent choices
pub(crate) fn attention_io(
    f: &Formats,
    out_fmt: Storage,
    vec4: bool,
    ev_odd: bool,
    vec8: bool,
    views: &crate::view::Views,
    dims: (usize, usize),
    fp8_rows: Option<(usize, usize)>,
) -> super::consts::Prelude {
    let mut rope = None;
    let out_access = if out_is_atomic(out_fmt, vec4, ev_odd, views) {
        Access::Atomic
    } else {
        Access::Write
    };
    let mut s = String::new();
    let vec8 = vec8 && vec4;
    s += &array("q", 3, f.q, vec4, Access::Read);
    let (kv, extra) = kv_arrays(f, vec4, vec8, views, dims, fp8_rows);
    s += &kv;
    s += &array("out", 6, out_fmt, vec4, out_access);
    for (x, dim, view) in [
        ("q", Dim::E, views.q),
        ("k", Dim::E, views.k),
        ("v", Dim::EV, views.v),
    ] {
        match views.paged {
            Some(bs) if x != "q" => s += &paged_row_base(x, x, bs),
            _ => s += &row_base(x, dim, vec4, view.map(|_| x), ""),
        }
        match views.q_rope {
            Some((d, half)) if x == "q" => {
                s += &row_loader("q_raw", dim, vec4).replace("q_raw_", "q_");
                s += &rope_loader(half);
                rope = Some(RopeConsts {
                    ROPE_D: d as u32,
                    HD: (d / 2) as u32,
                });
            }
            _ => s += &row_loader(x, dim, vec4),
        }
        if x != "q" {
            s += &key_row_loaders(x, dim, vec4, vec8, views.paged.is_some());
        }
    }
    s += &row_base("out", Dim::EV, vec4, views.out.map(|_| "o"), "");
    s += &row_storer(
        "out",
        "out",
        Dim::EV,
        vec4,
        out_fmt.is_half() && out_access == Access::Write,
    );
    let rope_form = match views.q_rope {
        Some((_, true)) => " rope-halves",
        Some((_, false)) => " rope-pairs",
        None => "",
    };
    let tag = format!(
        "q={} k={} v={} o={}{}{}{}{rope_form}{}",
        f.q,
        f.k,
        f.v,
        out_fmt,
        if vec4 { " vec4" } else { "" },
        if vec8 { " vec8" } else { "" },
        if views.paged.is_some() { " paged" } else { "" },
        viewed(&[("q", views.q), ("k", views.k), ("v", views.v), ("o", views.out)]),
    );
    let p = super::consts::Prelude::new().extra_bindings(extra);
    match rope {
        Some(r) => p.consts(&r),
        None => p,
    }
    .code(&s)
    .tag(tag)
}

/// A paged problem's kv heads and rows per head in a block (BS head-major, 1 token-major): how
/// an fp8 cache's scale is found by constants ([`quantized_array`]).
pub(crate) fn fp8_rows(p: &crate::problem::Problem) -> Option<(usize, usize)> {
    p.paged
        .as_ref()
        .map(|pg| (p.kv_heads, if pg.head_major { pg.block_size } else { 1 }))
}

/// K and V (bindings 4, 5) in their formats, with `load_k8`/`load_v8`: an 8-bit K's (V's)
/// scales take the next bindings after the kernel's own 8 (how many: the second value).
fn kv_arrays(
    f: &Formats,
    vec4: bool,
    vec8: bool,
    views: &crate::view::Views,
    dims: (usize, usize),
    fp8_rows: Option<(usize, usize)>,
) -> (String, u32) {
    let mut s = String::new();
    let mut extra = 0;
    // 16 codes per load where the rows are whole vec4<u32>s (E a multiple of 16, views aligned).
    let wide = |dim: usize| vec4 && dim.is_multiple_of(16) && views.aligned(16);
    if f.k.is_quantized() || f.v.is_quantized() {
        s += QUANT_HELPERS;
    }
    for (x, binding, st, row, dim) in [
        ("k", 4, f.k, "E4 * 4u", dims.0),
        ("v", 5, f.v, "EV4 * 4u", dims.1),
    ] {
        if st.is_quantized() {
            s += &quantized_array(x, binding, 8 + extra, st, row, wide(dim), fp8_rows);
            extra += 1;
        } else if vec8 {
            s += &array8(x, binding, st);
        } else {
            s += &array(x, binding, st, vec4, Access::Read);
        }
    }
    for x in ["k", "v"] {
        s += &if vec8 {
            format!(
                "fn load_{x}8(row: u32, c8: u32) -> array<vec4<f32>, 2> {{ return {x}_get8({x}_base(row) + 8u * c8); }}\n"
            )
        } else {
            format!(
                "fn load_{x}8(row: u32, c8: u32) -> array<vec4<f32>, 2> {{ return array<vec4<f32>, 2>(load_{x}(row, 2u * c8), load_{x}(row, 2u * c8 + 1u)); }}\n"
            )
        };
    }
    (s, extra)
}

/// The label tag of the tensors read through views: ` q-view k-view` (empty when dense).
pub(crate) fn viewed(views: &[(&str, Option<crate::view::View>)]) -> String {
    views
        .iter()
        .filter(|(_, v)| v.is_some())
        .map(|(n, _)| format!(" {n}-view"))
        .collect()
}

wgsl_consts! {
    /// RoPE applied to the queries as they are loaded: over the first `ROPE_D` elements of each
    /// row, `HD` pairs.
    pub(crate) struct RopeConsts {
        ROPE_D: u32,
        HD: u32,
    }
}

/// `fn NAME_base(row: u32) -> u32`: the element where row `row` of a tensor with rows of `dim`
/// elements starts. Dense: `at row·dim` (`at` a WGSL expression ending in `+`, or empty).
/// Through the view `p.x.SLOT` (`view`: the slot, [`super::TensorViews`]): the row index
/// `(b·heads + h)·n + s` is split and the view's offset and strides applied.
pub(crate) fn row_base(name: &str, dim: Dim, vec4: bool, view: Option<&str>, at: &str) -> String {
    match view {
        None if vec4 => format!(
            "fn {name}_base(row: u32) -> u32 {{ return {at}row * ({} * 4u); }}\n",
            dim.vec4s
        ),
        None => format!(
            "fn {name}_base(row: u32) -> u32 {{ return {at}row * {}; }}\n",
            dim.size
        ),
        Some(slot) => format!(
            "fn {name}_base(row: u32) -> u32 {{\n    let v = p.x.{slot};\n    let bh = row / v.n;\n    \
             return v.off + (bh / v.heads) * v.b + (bh % v.heads) * v.h + (row - bh * v.n) * v.s;\n}}\n"
        ),
    }
}

/// `fn NAME_base(row: u32) -> u32` of a paged cache `[NB, BS, Hkv, E]` (or head-major `[NB,
/// Hkv, BS, E]`: the view's token and head strides `s` and `h` say which; a block is the larger
/// of `BS·s` and `Hkv·h`) through the view
/// `p.x.SLOT` ([`super::RowView`]'s paged fields): the row index `(b·heads + h)·n + t` is
/// split, and key `t` of sequence `b` found in its block through the block table in the
/// auxiliary words (`aux_word`; every entry a block of the cache, checked by the host).
/// Key j of kv head kvh (`X_row`; a paged cache's comes with [`paged_row_base`]) and loads
/// from a row's first element (`load_Xb`, `load_Xb8`): the kernels find a key's row once for
/// all of its loads. `vec8`: X is declared in the vec8 layout ([`array8`]).
pub(crate) fn key_row_loaders(x: &str, dim: Dim, vec4: bool, vec8: bool, paged: bool) -> String {
    let mut s = String::new();
    if !paged {
        s += &format!(
            "fn {x}_head(kvh: u32) -> vec2<u32> {{ return vec2<u32>(kvh * p.s, 0u); }}\n\
             fn {x}_at(hd: vec2<u32>, j: u32) -> u32 {{ return {x}_base(hd.x + j); }}\n\
             fn {x}_row(kvh: u32, j: u32) -> u32 {{ return {x}_at({x}_head(kvh), j); }}\n"
        );
    }
    s += &row_loader(x, dim, vec4)
        .replace(
            &format!("fn load_{x}(row: u32,"),
            &format!("fn load_{x}b(base0: u32,"),
        )
        .replace(&format!("{x}_base(row)"), "base0");
    if vec8 {
        s += &format!(
            "fn load_{x}b8(base: u32, c8: u32) -> array<vec4<f32>, 2> {{ return {x}_get8(base + 8u * c8); }}\n"
        );
    } else {
        s += &format!(
            "fn load_{x}b8(base: u32, c8: u32) -> array<vec4<f32>, 2> {{ return array<vec4<f32>, 2>(load_{x}b(base, 2u * c8), load_{x}b(base, 2u * c8 + 1u)); }}\n"
        );
    }
    s
}

/// The last row's base is kept in private memory: kernels that read a row in several loads
/// (one per vec4 of the head dim) pay the divisions and the table's read once per row.
/// `X_row(kvh, j)`, key `j` of kv head `kvh`, needs no division by S and a constant block
/// size `bs` (a shift when it is a power of two), with the kv head's parts invariant across
/// a kernel's key loop: what the decode and fused kernels use.
pub(crate) fn paged_row_base(name: &str, slot: &str, bs: usize) -> String {
    format!(
        "var<private> {name}_memo_row: u32 = 0xffffffffu;\nvar<private> {name}_memo_base: u32 = 0u;\n\
         fn {name}_base(row: u32) -> u32 {{\n    if (row == {name}_memo_row) {{ return {name}_memo_base; }}\n    \
         let bh = row / p.x.{slot}.n;\n    {name}_memo_row = row;\n    \
         {name}_memo_base = {name}_row(bh, row - bh * p.x.{slot}.n);\n    \
         return {name}_memo_base;\n}}\n\
         fn {name}_head(kvh: u32) -> vec2<u32> {{\n    let v = p.x.{slot};\n    \
         return vec2<u32>(v.tab + (kvh / v.heads) * v.b, v.off + (kvh % v.heads) * v.h);\n}}\n\
         fn {name}_at(hd: vec2<u32>, j: u32) -> u32 {{\n    let v = p.x.{slot};\n    \
         let blk = aux_word(hd.x + j / {bs}u);\n    \
         return hd.y + blk * max({bs}u * v.s, v.heads * v.h) + (j % {bs}u) * v.s;\n}}\n\
         fn {name}_row(kvh: u32, j: u32) -> u32 {{ return {name}_at({name}_head(kvh), j); }}\n"
    )
}

/// `load_q(row, c4)` rotated by RoPE (`crate::Rope`) over the first `d` elements (pairs
/// `(k, k + d/2)` when `half`, else `(2k, 2k + 1)`), from `load_q_raw` and the element
/// reads of the partners; the (cos, sin) of row `(b, i)`'s pair `k` are auxiliary words at
/// `p.m.rope_off + 2 ((b L + i) d/2 + k)`. Rows are `(b·heads + h)·L + i` (`p.l`, `p.heads`).
/// `d` and `d/2` are the constants `ROPE_D` and `HD` ([`RopeConsts`]).
pub(crate) fn rope_loader(half: bool) -> String {
    let (k, partner, first) = if half {
        (
            "select(e - HD, e, e < HD)",
            "select(e - HD, e + HD, e < HD)",
            "e < HD",
        )
    } else {
        ("e / 2u", "e ^ 1u", "(e & 1u) == 0u")
    };
    format!(
        "fn load_q(row: u32, c4: u32) -> vec4<f32> {{
    var x = load_q_raw(row, c4);
             if (c4 * 4u >= ROPE_D) {{ return x; }}
    let bh = row / p.l;
             let a0 = p.m.rope_off + 2u * (((bh / p.heads) * p.l + row - bh * p.l) * HD);
             let base = q_base(row);
    let y = x;
             for (var c = 0u; c < 4u; c++) {{ // unroll
        let e = c4 * 4u + c;
                 if (e < ROPE_D) {{
            let k = {k};
                     let cs = bitcast<f32>(aux_word(a0 + 2u * k));
                     let sn = bitcast<f32>(aux_word(a0 + 2u * k + 1u));
                     let other = q_get(base + {partner});
                     x[c] = select(y[c] * cs + other * sn, y[c] * cs - other * sn, {first});
        }}
    }}
             return x;
}}
"
    )
}

/// A head dim: its vec4 count (a prelude constant) and its size (a params field).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dim {
    /// The constant holding the dim in vec4s.
    pub(crate) vec4s: &'static str,
    /// The params field holding the dim.
    pub(crate) size: &'static str,
}

impl Dim {
    /// E: `E4`, `p.e`.
    pub(crate) const E: Dim = Dim {
        vec4s: "E4",
        size: "p.e",
    };
    /// Ev: `EV4`, `p.ev`.
    pub(crate) const EV: Dim = Dim {
        vec4s: "EV4",
        size: "p.ev",
    };
}

/// `load_X(row, c4) -> vec4<f32>`: column block `c4` of row `row` of the declared array `x`
/// with rows of `dim` elements starting at `X_base(row)` ([`row_base`]), zero padded past the
/// dim (the vec4 layout: one load).
pub(crate) fn row_loader(x: &str, dim: Dim, vec4: bool) -> String {
    let d = dim.size;
    if vec4 {
        format!(
            "fn load_{x}(row: u32, c4: u32) -> vec4<f32> {{ return {x}_get4({x}_base(row) + c4 * 4u); }}\n"
        )
    } else {
        format!(
            "fn load_{x}(row: u32, c4: u32) -> vec4<f32> {{\n    var x = vec4<f32>(0.0);\n    \
             let base = {x}_base(row);\n    \
             for (var c = 0u; c < 4u; c++) {{ // unroll\n        if (c4 * 4u + c < {d}) {{\n            \
             x[c] = {x}_get(base + c4 * 4u + c);\n        }}\n    }}\n    return x;\n}}\n"
        )
    }
}

/// `store_NAME(row, c4, x)`: column block `c4` of row `row` of the declared array `arr` (rows of
/// `dim` elements starting at `NAME_base(row)`, [`row_base`]), the elements past the dim
/// dropped. `pairs`: a half format whose rows start at even elements and hold an even count
/// (stored as whole words).
pub(crate) fn row_storer(name: &str, arr: &str, dim: Dim, vec4: bool, pairs: bool) -> String {
    let d = dim.size;
    if vec4 {
        format!("fn store_{name}(row: u32, c4: u32, x: vec4<f32>) {{ {arr}_set4({name}_base(row) + c4 * 4u, x); }}\n")
    } else if pairs {
        format!(
            "fn store_{name}(row: u32, c4: u32, x: vec4<f32>) {{\n    let base = {name}_base(row);\n    \
             if (c4 * 4u < {d}) {{ {arr}_set2(base + c4 * 4u, x.xy); }}\n    \
             if (c4 * 4u + 2u < {d}) {{ {arr}_set2(base + c4 * 4u + 2u, x.zw); }}\n}}\n"
        )
    } else {
        format!(
            "fn store_{name}(row: u32, c4: u32, x: vec4<f32>) {{\n    let base = {name}_base(row);\n    \
             for (var c = 0u; c < 4u; c++) {{ // unroll\n        if (c4 * 4u + c < {d}) {{\n            \
             {arr}_set(base + c4 * 4u + c, x[c]);\n        }}\n    }}\n}}\n"
        )
    }
}

/// The bias binding (1) of the masked kernels in format `s`.
pub(crate) fn bias(s: Storage) -> String {
    array("bias", 1, s, false, Access::Read)
}
