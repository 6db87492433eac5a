//! The backward's plan (pure: the problem, the requested path and the device's caps): the
//! fused kernels' configuration, or the unfused path's chunks of scores.

use crate::device::buffers::fits;
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::forms::{Caps, Forms};
use crate::kernels::backward as kb;
use crate::problem::Problem;
use crate::sdpa::plan::ChunkPlan;
use crate::sdpa::Form;
use crate::sdpa::Path;

/// Where a backward cannot run.
const NO_DECODE: &str =
    "the backward has fused and unfused paths; use Path::Fused, Path::Unfused or Path::Auto";

/// The fused kernels' (tiles per head, workgroups): dK/dV over key tiles of every kv head,
/// dQ over query tiles of every query head.
pub(super) fn fused_grids(p: &Problem, cfg: &kb::Config) -> [(usize, usize); 2] {
    let k_tiles = p.seq_kv.div_ceil(cfg.key_tile() as usize);
    let q_tiles = p.seq_q.div_ceil(cfg.query_tile() as usize);
    [
        (k_tiles, k_tiles * p.batch * p.kv_heads),
        (q_tiles, q_tiles * p.batch_heads()),
    ]
}

pub(super) fn check_workgroups(ctx: &Context, n: usize) -> Result<()> {
    let max = ctx.limits().max_compute_workgroups_per_dimension as u64;
    fits(
        "backward workgroups",
        n as u64,
        max * max,
        "max_compute_workgroups_per_dimension (squared)",
    )
}

/// The backward's plan.
#[derive(Debug, Clone)]
pub(crate) enum Plan {
    Fused(Box<kb::Config>),
    Unfused(ChunkPlan),
}

impl Plan {
    pub(super) fn path(&self) -> Path {
        match self {
            Plan::Fused(_) => Path::Fused,
            Plan::Unfused(_) => Path::Unfused,
        }
    }

    pub(crate) fn form(&self) -> Form {
        match self {
            Plan::Fused(c) => Form::Backward(c.form),
            Plan::Unfused(c) => Form::Unfused(c.form),
        }
    }
}

pub(crate) fn plan(p: &Problem, path: Path, caps: &Caps) -> Result<Plan> {
    let fused = kb::Config::new(p, caps);
    // A pinned form that cannot run a problem the default form could: where the fused path
    // is chosen, an error, not a silent fallback to the unfused path.
    let pinned_refused = fused.is_err()
        && caps.forms.backward.is_some()
        && kb::Config::new(p, &caps.with_forms(Forms::default())).is_ok();
    let refused = |reason: String| Error::Unsupported {
        path: "fused",
        reason,
    };
    match path {
        Path::Auto | Path::Fused => match fused {
            Ok(cfg) => Ok(Plan::Fused(Box::new(cfg))),
            Err(reason) if pinned_refused => {
                Err(refused(format!("the pinned form cannot run here: {reason}")))
            }
            Err(reason) if path == Path::Fused => Err(refused(format!(
                "{reason}; Path::Auto falls back to Path::Unfused"
            ))),
            Err(_) => unfused(p, caps),
        },
        Path::Unfused => unfused(p, caps),
        Path::Decode => Err(Error::Unsupported {
            path: "decode",
            reason: NO_DECODE.into(),
        }),
    }
}

/// The unfused path's chunks: four score-sized chunks (S, dP/dS, Pᵀ, dSᵀ), each within a
/// binding; whole groups of query heads where they fit, so that one product sums a group.
fn unfused(p: &Problem, caps: &Caps) -> Result<Plan> {
    let mut c = ChunkPlan::new(p, caps.max_binding, caps)?;
    let g = p.group();
    if c.rows == p.seq_q && c.heads >= g {
        c.heads -= c.heads % g;
    }
    Ok(Plan::Unfused(c))
}
