//! The checks of a user's source on naga's IR, before any kernel sees it: the capture names,
//! the signatures of what it defines, the capture-gradient calls, and whether its code is
//! proved safe to run without wgpu's runtime checks; then [`check_source`] assembles it.

use crate::error::{Error, Result};

use super::source::{
    module_scope_names, rename, split_fn, tokens, Checked, MASK_STUB, Q_POS_STUB, SCORE_DS_STUB, SCORE_STUB,
};

/// The most `d_NAME` calls `score_mod_dcapture` may make (each at most once per logit: none in
/// a loop).
pub const MAX_DCAPTURE_CALLS: usize = 8;

/// Whether the user's module has no loop and no dynamically indexed access (`a[i]` with `i`
/// not a constant) in any function: then it cannot spin or index out of bounds, and its
/// pipelines need none of wgpu's runtime checks. The user's functions name nothing of the
/// kernel's (they are checked standalone, with no module-scope variables), and the capture
/// readers clamp their indices.
fn proved_safe(module: &naga::Module) -> bool {
    fn has_loop(block: &naga::Block) -> bool {
        use naga::Statement as S;
        block.iter().any(|st| match st {
            S::Loop { .. } => true,
            S::Block(b) => has_loop(b),
            S::If { accept, reject, .. } => has_loop(accept) || has_loop(reject),
            S::Switch { cases, .. } => cases.iter().any(|c| has_loop(&c.body)),
            _ => false,
        })
    }
    module.functions.iter().all(|(_, f)| {
        !has_loop(&f.body)
            && !f
                .expressions
                .iter()
                .any(|(_, e)| matches!(e, naga::Expression::Access { .. }))
    })
}

/// Check `source` with captures `names` by naga, standalone (captures as stubs), and assemble
/// it renamed.
pub(super) fn check_source(source: &str, names: &[&str], vouched: bool) -> Result<Checked> {
    check_tokens(source, names)?;
    let module = parse_checked(source, names)?;
    let Defined {
        score,
        score_ds,
        mask,
        dcapture,
    } = signatures(&module)?;
    dcapture_calls(&module, names)?;
    // Every name the source declares at module scope, and the captures, get the u_ prefix.
    let mut declared: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    declared.extend(
        module
            .functions
            .iter()
            .filter_map(|(_, f)| f.name.clone())
            .filter(|n| n != "q_pos"),
    );
    declared.extend(module.constants.iter().filter_map(|(_, c)| c.name.clone()));
    declared.extend(module.overrides.iter().filter_map(|(_, o)| o.name.clone()));
    declared.extend(module.types.iter().filter_map(|(_, t)| t.name.clone()));
    // naga drops what it does not keep in its module (constants without a type, aliases):
    // the declarations at module scope from the source's own tokens too.
    declared.extend(module_scope_names(source));
    let (renamed, dcap_fn) = split_fn(&rename(source, &declared), "u_score_mod_dcapture");
    let dcapture = dcapture.then(|| {
        let mut w = format!("{}\n", dcap_fn.unwrap_or_default());
        for (k, n) in names.iter().enumerate() {
            w.push_str(&format!(
                "fn u_d_{n}(idx: u32, x: f32) {{\n    let t = p.m.cap_tab + {}u;\n    \
                 dcap_record(aux_word(t) - aux_word(p.m.cap_tab) + min(idx, max(aux_word(t + 1u), 1u) - 1u), x);\n}}\n",
                2 * k
            ));
        }
        w
    });
    // Without loops and dynamic indexing the user's code cannot index out of bounds or spin
    // (it names nothing of the crate's, and the capture readers clamp): its pipelines may run
    // without wgpu's runtime checks like the crate's own.
    let proved_safe = vouched || proved_safe(&module);
    let mut wgsl = String::new();
    for (k, n) in names.iter().enumerate() {
        wgsl.push_str(&format!(
            "fn u_{n}(idx: u32) -> f32 {{\n    let t = p.m.cap_tab + {}u;\n    \
             return bitcast<f32>(aux_word(aux_word(t) + min(idx, max(aux_word(t + 1u), 1u) - 1u)));\n}}\n",
            2 * k
        ));
    }
    wgsl.push_str(&renamed);
    wgsl.push('\n');
    for (given, stub) in [(score, SCORE_STUB), (score_ds, SCORE_DS_STUB), (mask, MASK_STUB)] {
        if !given {
            wgsl.push_str(stub);
        }
    }
    Ok(Checked {
        id: super::source::id_of(&wgsl, dcapture.as_deref()),
        score,
        mask,
        score_ds,
        wgsl,
        dcapture,
        proved_safe,
    })
}

pub(super) fn user_err(line: Option<usize>, message: String) -> Error {
    Error::UserMod { line, message }
}

/// The capture names (identifiers, distinct, not the functions', each named by the source),
/// and what naga accepts in a module of its own but the kernels cannot take: barriers (the
/// functions run in non-uniform control flow) and directives (they must open a module).
fn check_tokens(source: &str, names: &[&str]) -> Result<()> {
    let err = |m: String| user_err(None, m);
    for (i, n) in names.iter().enumerate() {
        let ident = n
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !n.starts_with("__");
        if !ident {
            return Err(err(format!("capture name {n:?} is not a WGSL identifier")));
        }
        if names[..i].contains(n) {
            return Err(err(format!("capture name {n:?} is given twice")));
        }
        if ["score_mod", "mask_mod", "score_mod_ds", "score_mod_dcapture"].contains(n) {
            return Err(err(format!("capture name {n:?} is the function's own")));
        }
        if !tokens(source).any(|t| t == *n) {
            return Err(err(format!(
                "capture {n:?} is not used by the source (unknown capture name)"
            )));
        }
    }
    for t in tokens(source) {
        let why = match t {
            "workgroupBarrier" | "storageBarrier" | "textureBarrier" | "workgroupUniformLoad" => {
                "a barrier (the functions run per logit, in non-uniform control flow)"
            }
            "enable" | "requires" | "diagnostic" => "a directive (the kernels declare their own)",
            _ => continue,
        };
        return Err(err(format!("the source uses {t}: {why} is not allowed")));
    }
    Ok(())
}

/// `source` parsed and validated by naga with the captures as stubs before it: naga's message
/// with the user's line (quoted) on failure; functions and constants only.
fn parse_checked(source: &str, names: &[&str]) -> Result<naga::Module> {
    let mut header: String = names
        .iter()
        .map(|n| format!("fn {n}(idx: u32) -> f32 {{ return f32(idx); }}\nfn d_{n}(idx: u32, x: f32) {{}}\n"))
        .collect();
    // The kernels' own `q_pos` (common/masks.wgsl), which the source may call.
    header.push_str(Q_POS_STUB);
    let header_lines = 2 * names.len() + 1;
    let full = format!("{header}{source}");
    let user_line = |line: u32| (line as usize).checked_sub(header_lines).filter(|&l| l > 0);
    let quote = |line: Option<usize>, msg: &str| {
        let text = line
            .and_then(|l| source.lines().nth(l - 1))
            .map(|t| format!(": `{}`", t.trim()))
            .unwrap_or_default();
        user_err(line, format!("{msg}{text}"))
    };
    let module = naga::front::wgsl::parse_str(&full).map_err(|e| {
        let line = e.location(&full).and_then(|l| user_line(l.line_number));
        quote(line, e.message())
    })?;
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::empty(),
    );
    if let Err(e) = validator.validate(&module) {
        let line = e.location(&full).and_then(|l| user_line(l.line_number));
        let mut msg = e.as_inner().to_string();
        let mut src: &dyn std::error::Error = e.as_inner();
        while let Some(next) = src.source() {
            msg.push_str(&format!(": {next}"));
            src = next;
        }
        return Err(quote(line, &msg));
    }
    if !module.entry_points.is_empty() {
        return Err(user_err(
            None,
            "the source declares an entry point: give functions only".into(),
        ));
    }
    if module.global_variables.iter().next().is_some() {
        return Err(user_err(
            None,
            "the source declares a module-scope variable: give functions and constants only".into(),
        ));
    }
    Ok(module)
}

/// Which of the user functions a source defines.
struct Defined {
    score: bool,
    score_ds: bool,
    mask: bool,
    dcapture: bool,
}

/// Which of `score_mod`, `score_mod_ds`, `score_mod_dcapture` and `mask_mod` the module
/// defines, each with its signature checked; at least one of `score_mod` and `mask_mod`.
fn signatures(module: &naga::Module) -> Result<Defined> {
    let (f32t, u32t, boolt) = (
        naga::TypeInner::Scalar(naga::Scalar::F32),
        naga::TypeInner::Scalar(naga::Scalar::U32),
        naga::TypeInner::Scalar(naga::Scalar::BOOL),
    );
    let signature = |name: &str, args: &[&naga::TypeInner], ret: Option<&naga::TypeInner>, text: &str| {
        let Some((_, f)) = module
            .functions
            .iter()
            .find(|(_, f)| f.name.as_deref() == Some(name))
        else {
            return Ok(false);
        };
        let ok = f.arguments.len() == args.len()
            && f.arguments
                .iter()
                .zip(args)
                .all(|(a, t)| module.types[a.ty].inner == **t)
            && f.result.as_ref().map(|r| &module.types[r.ty].inner) == ret;
        if ok {
            Ok(true)
        } else {
            Err(user_err(None, format!("{name} must be `{text}`")))
        }
    };
    let score_args = [&f32t, &u32t, &u32t, &u32t, &u32t];
    let score = signature(
        "score_mod",
        &score_args,
        Some(&f32t),
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32",
    )?;
    let score_ds = signature(
        "score_mod_ds",
        &score_args,
        Some(&f32t),
        "fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32",
    )?;
    let dcapture = signature(
        "score_mod_dcapture",
        &[&f32t, &u32t, &u32t, &u32t, &u32t, &f32t],
        None,
        "fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32)",
    )?;
    for (given, what) in [(score_ds, "score_mod_ds"), (dcapture, "score_mod_dcapture")] {
        if given && !score {
            return Err(user_err(None, format!("{what} is given without score_mod")));
        }
    }
    let mask = signature(
        "mask_mod",
        &[&u32t, &u32t, &u32t, &u32t],
        Some(&boolt),
        "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool",
    )?;
    if !score && !mask {
        return Err(user_err(
            None,
            "the source defines neither score_mod nor mask_mod".into(),
        ));
    }
    Ok(Defined {
        score,
        score_ds,
        mask,
        dcapture,
    })
}

/// The `d_NAME` accumulators are called by `score_mod_dcapture` alone, outside loops (so each
/// call runs at most once per logit: WGSL has no recursion), at most [`MAX_DCAPTURE_CALLS`]
/// times.
fn dcapture_calls(module: &naga::Module, names: &[&str]) -> Result<()> {
    let stubs: Vec<String> = names.iter().map(|n| format!("d_{n}")).collect();
    let is_stub = |h: naga::Handle<naga::Function>| {
        module.functions[h]
            .name
            .as_ref()
            .is_some_and(|n| stubs.contains(n))
    };
    let is_dcapture =
        |h: naga::Handle<naga::Function>| module.functions[h].name.as_deref() == Some("score_mod_dcapture");
    for (_, f) in module.functions.iter() {
        let name = f.name.as_deref().unwrap_or("");
        let mut calls = Vec::new();
        block_calls(&f.body, false, &is_dcapture, &mut calls);
        if !calls.is_empty() {
            return Err(user_err(
                None,
                format!("{name} calls score_mod_dcapture: the backward alone calls it"),
            ));
        }
        if stubs.iter().any(|s| s == name) {
            continue;
        }
        let mut calls = Vec::new();
        block_calls(&f.body, false, &is_stub, &mut calls);
        if calls.is_empty() {
            continue;
        }
        if name != "score_mod_dcapture" {
            return Err(user_err(
                None,
                format!("{name} calls a d_NAME accumulator: only score_mod_dcapture may"),
            ));
        }
        if calls.iter().any(|&in_loop| in_loop) {
            return Err(user_err(
                None,
                "score_mod_dcapture calls a d_NAME accumulator in a loop: call it at most once per element it adds to"
                    .into(),
            ));
        }
        if calls.len() > MAX_DCAPTURE_CALLS {
            return Err(user_err(
                None,
                format!(
                    "score_mod_dcapture calls the d_NAME accumulators {} times: at most {MAX_DCAPTURE_CALLS}",
                    calls.len()
                ),
            ));
        }
    }
    Ok(())
}

/// The calls in `block` to functions `is_stub` accepts, each as whether it is in a loop.
fn block_calls(
    block: &naga::Block,
    in_loop: bool,
    is_stub: &dyn Fn(naga::Handle<naga::Function>) -> bool,
    out: &mut Vec<bool>,
) {
    use naga::Statement as S;
    for st in block.iter() {
        match st {
            S::Block(b) => block_calls(b, in_loop, is_stub, out),
            S::If { accept, reject, .. } => {
                block_calls(accept, in_loop, is_stub, out);
                block_calls(reject, in_loop, is_stub, out);
            }
            S::Switch { cases, .. } => {
                for c in cases {
                    block_calls(&c.body, in_loop, is_stub, out);
                }
            }
            S::Loop { body, continuing, .. } => {
                block_calls(body, true, is_stub, out);
                block_calls(continuing, true, is_stub, out);
            }
            S::Call { function, .. } if is_stub(*function) => out.push(in_loop),
            _ => {}
        }
    }
}
