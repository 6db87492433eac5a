//! The plan of one call: which path runs, in which form of its kernel, with which tiles.
//! [`Plan`] is a pure function of the problem, the request (path, weights, score budget) and
//! the device's [`Caps`], computed once per call; tests check it without a GPU.

use crate::device::buffers::{f32_bytes, F32};
use crate::error::{Error, Result};
use crate::forms::{BackwardForm, Caps, DecodeForm, Forms, FusedForm, MatmulForm};
use crate::kernels::{decode, flash, matmul};
use crate::problem::Problem;

use super::Path;

/// The form of the kernel a plan runs.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Form {
    /// The unfused path's kernels (matmul, softmax, matmul): the matmul's form.
    Unfused(MatmulForm),
    /// The fused backward's form.
    Backward(BackwardForm),
    /// The fused kernel's form.
    Fused(FusedForm),
    /// The decode kernel's form.
    Decode(DecodeForm),
}

/// How a plan tiles the problem.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tiles {
    /// The unfused path materialises the scores `[B·Hq, L, S]` in chunks of `heads`
    /// batch-heads × `rows` query rows.
    Unfused {
        /// Batch-heads per chunk.
        heads: usize,
        /// Query rows per chunk.
        rows: usize,
    },
    /// The fused kernel: one workgroup of `invocations` per `invocations × rows` query rows,
    /// streaming `keys` keys per tile.
    Fused {
        /// Invocations per workgroup.
        invocations: u32,
        /// Query rows per invocation (the steady state: a first call on a CPU adapter may be
        /// served with one while the faster form compiles, with the same results).
        rows: u32,
        /// Keys per tile.
        keys: u32,
    },
    /// The decode kernel: one workgroup of `invocations` per (query row, split of
    /// `keys_per_split` keys).
    Decode {
        /// Invocations per workgroup.
        invocations: u32,
        /// Keys per split.
        keys_per_split: usize,
        /// Number of splits.
        splits: usize,
    },
}

/// What one call asks for, besides the problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub path: Path,
    pub weights: bool,
    pub max_scores_bytes: Option<u64>,
}

/// The plan of one call: which path runs, in which form of its kernel ([`Form`]), with which
/// [`Tiles`]. A pure function of the problem, the request (path, weights, score budget) and
/// the device's [`Caps`], computed once per call; from [`crate::Sdpa::plan`]. On CPU adapters
/// a large problem's first call may be served by the one-row form of the planned fused form
/// while the planned one compiles (same results; tiered compilation is described in `docs/paths.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub(crate) kernel: Kernel,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kernel {
    Unfused(ChunkPlan),
    Fused(flash::Config),
    Decode(decode::Config),
}

const NO_WEIGHTS: &str = "it never materialises the attention weights; use Path::Unfused or Path::Auto";

impl Plan {
    /// The plan for `p` and `req` on a device with `caps`, or why the requested path (or a
    /// pinned form) cannot run it.
    pub(crate) fn new(p: &Problem, req: &Request, caps: &Caps) -> Result<Plan> {
        let fused = flash::Config::new(p, caps);
        // A pinned fused form that cannot run a problem the default form could: where the
        // fused path is chosen, an error, not a silent fallback to the unfused path.
        let pinned_refused = fused.is_err()
            && caps.forms.fused.is_some()
            && flash::Config::new(p, &caps.with_forms(Forms::default())).is_ok();
        // One query row on a GPU: the decode kernel whatever the key length (the fused
        // kernel's tile of 16-64 rows would compute one; H200, 64 sequences of 32 heads over
        // 64 keys each: 0.65 ms fused against a few µs).
        let decode_shape = (p.seq_q <= decode::MAX_ROWS && p.seq_kv >= decode::MIN_KEYS)
            || (p.seq_q == 1 && !caps.cpu && decode::Config::new(p, caps).is_ok());
        // 8-bit caches, paged caches and RoPE on q are read by the fused and decode kernels only.
        let quantized = p.storage.k.is_quantized() || p.storage.v.is_quantized();
        if quantized && (req.weights || req.path == Path::Unfused) {
            return Err(Error::Quantized {
                reason: "8-bit K/V caches are read by the fused and decode kernels, which never materialise the attention weights (Path::Unfused and weights are not available)".into(),
            });
        }
        let kernels_only = p.paged.is_some() || p.rope.is_some() || quantized;
        if kernels_only && (req.weights || req.path == Path::Unfused) {
            return Err(Error::Unsupported {
                path: req.path.name(),
                reason: "paged K/V caches and RoPE on q are read by the fused and decode kernels, which never materialise the attention weights".into(),
            });
        }
        let path = match req.path {
            Path::Auto if !req.weights && decode_shape => Path::Decode,
            // No unfused path for these: the fused kernel's reason is the error.
            Path::Auto if kernels_only => Path::Fused,
            Path::Auto if !req.weights && (fused.is_ok() || pinned_refused) => Path::Fused,
            Path::Auto => Path::Unfused,
            Path::Fused | Path::Decode if req.weights => {
                return Err(Error::Unsupported {
                    path: req.path.name(),
                    reason: NO_WEIGHTS.into(),
                })
            }
            other => other,
        };
        let kernel = match path {
            Path::Unfused => {
                let budget = req
                    .max_scores_bytes
                    .unwrap_or(caps.max_binding)
                    .min(caps.max_binding);
                Kernel::Unfused(ChunkPlan::new(p, budget, caps)?)
            }
            Path::Fused => Kernel::Fused(fused.map_err(|reason| Error::Unsupported {
                path: "fused",
                reason: if pinned_refused {
                    format!("the pinned form cannot run here: {reason}")
                } else {
                    format!("{reason}; Path::Auto falls back to Path::Unfused")
                },
            })?),
            Path::Decode | Path::Auto => {
                Kernel::Decode(decode::Config::new(p, caps).map_err(|reason| Error::Unsupported {
                    path: "decode",
                    reason,
                })?)
            }
        };
        Ok(Plan { kernel })
    }

    /// The concrete path.
    pub fn path(&self) -> Path {
        match self.kernel {
            Kernel::Unfused(_) => Path::Unfused,
            Kernel::Fused(_) => Path::Fused,
            Kernel::Decode(_) => Path::Decode,
        }
    }

    /// The form of the path's kernel.
    pub fn form(&self) -> Form {
        match &self.kernel {
            Kernel::Unfused(c) => Form::Unfused(c.form),
            Kernel::Fused(c) => Form::Fused(c.form),
            Kernel::Decode(c) => Form::Decode(c.form),
        }
    }

    /// The variant of the path's kernel: the kernel and the prelude it is assembled with (its
    /// typed constants name it: [`crate::kernels::consts::Prelude::label`]). The unfused path
    /// picks its products' forms as it records (none here). [`crate::Sdpa::prepare`] tells its
    /// forms apart by it, and the GPU-free kernel tests enumerate the attention kernels'
    /// variants through it (`kernels::variants`).
    pub(crate) fn variant(
        &self,
    ) -> Option<(
        &'static crate::kernels::KernelSpec,
        crate::kernels::consts::Prelude,
    )> {
        match &self.kernel {
            Kernel::Fused(c) => Some((c.spec(), c.prelude())),
            Kernel::Decode(c) => Some((c.spec(), c.prelude())),
            Kernel::Unfused(_) => None,
        }
    }

    /// The tiles.
    pub fn tiles(&self) -> Tiles {
        match &self.kernel {
            Kernel::Unfused(c) => Tiles::Unfused {
                heads: c.heads,
                rows: c.rows,
            },
            Kernel::Fused(c) => Tiles::Fused {
                invocations: c.wg,
                rows: c.rq,
                keys: c.bk,
            },
            Kernel::Decode(c) => Tiles::Decode {
                invocations: c.wg,
                keys_per_split: c.chunk,
                splits: c.splits,
            },
        }
    }
}

/// How the unfused path splits the score matrix `[B·Hq, L, S]` so one chunk fits a binding:
/// whole heads at a time when `L·S` fits, else row blocks of one head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Batch-heads per chunk.
    pub heads: usize,
    /// Query rows per chunk (`L` unless `heads == 1`).
    pub rows: usize,
    /// The matmul's form.
    pub form: MatmulForm,
}

impl ChunkPlan {
    pub(crate) fn new(p: &Problem, budget_bytes: u64, caps: &Caps) -> Result<Self> {
        // The score product's size class (its chunks are as large unless L S exceeds the
        // budget, which only large problems do).
        let flops = 2.0 * (p.batch_heads() * p.seq_q * p.seq_kv * p.head_dim) as f64;
        let form = matmul::form_for_size(caps, flops, [p.storage.q, p.storage.k]).map_err(|reason| {
            Error::Unsupported {
                path: "unfused",
                reason,
            }
        })?;
        let max_grid = caps.max_workgroups as usize;
        let tile = matmul::TILE as usize;
        let budget = (budget_bytes / F32) as usize;
        let (l, s) = (p.seq_q, p.seq_kv);
        if s > max_grid * tile {
            return Err(Error::TooLargeForDevice {
                what: format!("key length S = {s}"),
                bytes: f32_bytes(s),
                limit_name: "max_compute_workgroups_per_dimension",
                limit: f32_bytes(max_grid * tile),
                hint: " (S may be at most 64 x max_compute_workgroups_per_dimension)",
            });
        }
        if s > budget {
            return Err(Error::TooLargeForDevice {
                what: format!("one row of scores (S = {s})"),
                bytes: f32_bytes(s),
                limit_name: "max_storage_buffer_binding_size",
                limit: budget_bytes,
                hint: "; even the smallest chunk of the unfused path does not fit",
            });
        }
        let max_rows = (max_grid * tile).min(l);
        if l * s <= budget && l <= max_rows {
            let heads = (budget / (l * s)).min(p.batch_heads()).min(max_grid);
            Ok(ChunkPlan { heads, rows: l, form })
        } else {
            Ok(ChunkPlan {
                heads: 1,
                rows: (budget / s).min(max_rows),
                form,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(cpu: bool, subgroup: Option<u32>) -> Caps {
        Caps::new(&wgpu::Limits::default(), cpu, subgroup)
    }

    fn req(path: Path) -> Request {
        Request {
            path,
            weights: false,
            max_scores_bytes: None,
        }
    }

    /// Auto: decode for few rows over many keys, else fused, else unfused (weights asked
    /// for, head dims beyond 256); forced paths run or are refused with a typed error.
    #[test]
    fn auto_and_forced_paths() {
        let lavapipe = caps(true, Some(8));
        let decode = Problem::new(&[1, 32, 1, 128], &[1, 32, 4096, 128], &[1, 32, 4096, 128]).unwrap();
        let plan = Plan::new(&decode, &req(Path::Auto), &lavapipe).unwrap();
        assert_eq!(plan.path(), Path::Decode);
        assert_eq!(plan.form(), Form::Decode(DecodeForm::Subgroup));
        let small = Problem::new(&[1, 4, 128, 64], &[1, 4, 128, 64], &[1, 4, 128, 64]).unwrap();
        let plan = Plan::new(&small, &req(Path::Auto), &lavapipe).unwrap();
        assert_eq!(plan.form(), Form::Fused(FusedForm::Subgroup { rows: 1 }));
        assert_eq!(
            plan.tiles(),
            Tiles::Fused {
                invocations: 8,
                rows: 1,
                keys: 8
            }
        );
        let weights = Request {
            weights: true,
            ..req(Path::Auto)
        };
        assert_eq!(
            Plan::new(&small, &weights, &lavapipe).unwrap().path(),
            Path::Unfused
        );
        let forced = Request {
            weights: true,
            ..req(Path::Decode)
        };
        assert!(matches!(
            Plan::new(&small, &forced, &lavapipe),
            Err(Error::Unsupported { path: "decode", .. })
        ));
        // A forced decode path runs whatever the shape.
        assert_eq!(
            Plan::new(&small, &req(Path::Decode), &lavapipe).unwrap().path(),
            Path::Decode
        );
        let wide = Problem::new(&[1, 1, 4, 300], &[1, 1, 4, 300], &[1, 1, 4, 8]).unwrap();
        assert_eq!(
            Plan::new(&wide, &req(Path::Auto), &lavapipe).unwrap().path(),
            Path::Unfused
        );
        assert!(matches!(
            Plan::new(&wide, &req(Path::Fused), &lavapipe),
            Err(Error::Unsupported { path: "fused", .. })
        ));
        // GPUs: the GPU forms.
        let gpu = caps(false, Some(32));
        assert_eq!(
            Plan::new(&small, &req(Path::Auto), &gpu).unwrap().form(),
            Form::Fused(FusedForm::Gpu)
        );
        assert_eq!(
            Plan::new(&decode, &req(Path::Auto), &gpu).unwrap().form(),
            Form::Decode(DecodeForm::GpuTiles)
        );
        // One query row over few keys: the decode kernel on GPUs, the fused one on CPUs.
        let short = Problem::new(&[64, 32, 1, 128], &[64, 8, 64, 128], &[64, 8, 64, 128]).unwrap();
        assert_eq!(
            Plan::new(&short, &req(Path::Auto), &gpu).unwrap().path(),
            Path::Decode
        );
        assert_eq!(
            Plan::new(&short, &req(Path::Auto), &lavapipe).unwrap().path(),
            Path::Fused
        );
        let two = Problem::new(&[64, 32, 2, 128], &[64, 8, 64, 128], &[64, 8, 64, 128]).unwrap();
        assert_eq!(
            Plan::new(&two, &req(Path::Auto), &gpu).unwrap().path(),
            Path::Fused
        );
    }

    /// A pinned form that the device cannot run is refused, not silently replaced; a pinned
    /// form is what runs.
    #[test]
    fn pinned_forms_run_or_are_refused() {
        let small = Problem::new(&[1, 4, 128, 64], &[1, 4, 128, 64], &[1, 4, 128, 64]).unwrap();
        let no_subgroups = caps(true, None).with_forms(FusedForm::Subgroup { rows: 2 });
        assert!(matches!(
            Plan::new(&small, &req(Path::Auto), &no_subgroups),
            Err(Error::Unsupported { path: "fused", .. })
        ));
        // ... but only where the fused kernel would run: decoding and the weights do not need it.
        let decode = Problem::new(&[1, 32, 1, 128], &[1, 32, 4096, 128], &[1, 32, 4096, 128]).unwrap();
        assert_eq!(
            Plan::new(&decode, &req(Path::Auto), &no_subgroups)
                .unwrap()
                .path(),
            Path::Decode
        );
        let weights = Request {
            weights: true,
            ..req(Path::Auto)
        };
        assert_eq!(
            Plan::new(&small, &weights, &no_subgroups).unwrap().path(),
            Path::Unfused
        );
        let pinned = caps(true, Some(8)).with_forms(Forms {
            fused: Some(FusedForm::Loop { rows: 3 }),
            decode: Some(DecodeForm::Gpu),
            ..Forms::default()
        });
        let plan = Plan::new(&small, &req(Path::Auto), &pinned).unwrap();
        assert_eq!(plan.form(), Form::Fused(FusedForm::Loop { rows: 3 }));
        let plan = Plan::new(&small, &req(Path::Decode), &pinned).unwrap();
        assert_eq!(plan.form(), Form::Decode(DecodeForm::Gpu));
        // The unfused path's matmul: the subgroup form with a subgroup of 8 (for products of
        // 1e7 FLOPs and up; smaller ones tiled: quicker to compile), pinnable, and refused where
        // the subgroup size is not 8.
        let plan = Plan::new(&small, &req(Path::Unfused), &pinned).unwrap();
        assert_eq!(plan.form(), Form::Unfused(MatmulForm::Tiled));
        let big = Problem::new(&[1, 4, 512, 64], &[1, 4, 512, 64], &[1, 4, 512, 64]).unwrap();
        assert!(
            2.0 * (big.batch_heads() * 512 * 512 * big.head_dim) as f64 >= matmul::CPU_SMALL_PRODUCT_FLOPS
        );
        let plan = Plan::new(&big, &req(Path::Unfused), &pinned).unwrap();
        assert_eq!(plan.form(), Form::Unfused(MatmulForm::Subgroup));
        let plan = Plan::new(
            &small,
            &req(Path::Unfused),
            &pinned.with_forms(MatmulForm::Subgroup),
        )
        .unwrap();
        assert_eq!(plan.form(), Form::Unfused(MatmulForm::Subgroup));
        let gpu_tiles = pinned.with_forms(MatmulForm::GpuTiles);
        let plan = Plan::new(&small, &req(Path::Unfused), &gpu_tiles).unwrap();
        assert_eq!(plan.form(), Form::Unfused(MatmulForm::GpuTiles));
        let sixteen = caps(true, Some(16)).with_forms(MatmulForm::Subgroup);
        assert!(matches!(
            Plan::new(&small, &req(Path::Unfused), &sixteen),
            Err(Error::Unsupported { path: "unfused", .. })
        ));
        let plan = Plan::new(&small, &req(Path::Unfused), &caps(false, Some(32))).unwrap();
        assert_eq!(plan.form(), Form::Unfused(MatmulForm::GpuTiles));
    }

    /// The backward's plan: the default forms (GPU; CPU with and without a subgroup, one row
    /// below the forward's threshold), pinned forms, and a pinned form the device cannot run
    /// refused rather than replaced by the unfused path.
    #[test]
    fn backward_forms_by_device_and_pinned() {
        use crate::sdpa::backward::plan as bplan;
        let small = Problem::new(&[1, 4, 70, 40], &[1, 2, 130, 40], &[1, 2, 130, 24]).unwrap();
        let large = Problem::new(&[1, 8, 1024, 64], &[1, 8, 1024, 64], &[1, 8, 1024, 64]).unwrap();
        let form = |p: &Problem, path, c: &Caps| bplan(p, path, c).map(|b| b.form());
        assert_eq!(
            form(&small, Path::Auto, &caps(false, Some(32))),
            Ok(Form::Backward(BackwardForm::Gpu))
        );
        assert_eq!(
            form(&small, Path::Auto, &caps(true, Some(8))),
            Ok(Form::Backward(BackwardForm::Subgroup { rows: 1 }))
        );
        assert_eq!(
            form(&large, Path::Auto, &caps(true, Some(8))),
            Ok(Form::Backward(BackwardForm::Subgroup { rows: 4 }))
        );
        assert_eq!(
            form(&large, Path::Auto, &caps(true, None)),
            Ok(Form::Backward(BackwardForm::Tiled { rows: 4 }))
        );
        let tiled = caps(true, Some(8)).with_forms(BackwardForm::Tiled { rows: 3 });
        assert_eq!(
            form(&small, Path::Fused, &tiled),
            Ok(Form::Backward(BackwardForm::Tiled { rows: 3 }))
        );
        // The unfused backward's products: tiled below 1e7 FLOPs, else the subgroup form.
        assert_eq!(
            form(&small, Path::Unfused, &tiled),
            Ok(Form::Unfused(MatmulForm::Tiled))
        );
        assert_eq!(
            form(&large, Path::Unfused, &tiled),
            Ok(Form::Unfused(MatmulForm::Subgroup))
        );
        // A subgroup form without a fixed subgroup size: refused on the fused and automatic
        // paths, not run unfused in its place.
        let sg = caps(true, None).with_forms(BackwardForm::Subgroup { rows: 1 });
        for path in [Path::Auto, Path::Fused] {
            assert!(matches!(
                form(&small, path, &sg),
                Err(Error::Unsupported { path: "fused", reason }) if reason.contains("pinned")
            ));
        }
        assert!(matches!(
            form(&small, Path::Decode, &sg),
            Err(Error::Unsupported { .. })
        ));
    }

    /// The unfused path's chunks fit the budget: whole heads when L·S fits, else row blocks.
    #[test]
    fn unfused_chunks_fit_the_budget() {
        let p = Problem::new(&[2, 3, 50, 8], &[2, 1, 45, 8], &[2, 1, 45, 12]).unwrap();
        let c = caps(true, Some(8));
        let plan = |budget| {
            let r = Request {
                max_scores_bytes: Some(budget),
                ..req(Path::Unfused)
            };
            Plan::new(&p, &r, &c).unwrap().tiles()
        };
        assert_eq!(plan(20_000), Tiles::Unfused { heads: 2, rows: 50 });
        assert_eq!(plan(4096), Tiles::Unfused { heads: 1, rows: 22 });
        assert!(matches!(
            Plan::new(
                &p,
                &Request {
                    max_scores_bytes: Some(100),
                    ..req(Path::Unfused)
                },
                &c
            ),
            Err(Error::TooLargeForDevice { .. })
        ));
    }
}
