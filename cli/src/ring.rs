//! `--devices N` and `--mpi` of `run` and `backward`: the ring of devices in this process, or
//! this process as one rank of an MPI ring (feature `mpi`).

use std::time::{Duration, Instant};

use wgpu_attention::{Backward, Context, Grads, Layout, Output, Ring, RingReport, Sdpa};

use crate::input::InputArgs;
use crate::timing::ms;
use crate::CliResult;

/// Where a `run` or `backward` computes.
pub(crate) enum Target {
    /// One device.
    One,
    /// A ring of this many devices in this process.
    Devices(usize, Layout),
    /// This process is one rank of an MPI ring.
    #[cfg(feature = "mpi")]
    Mpi(Layout),
}

/// The target the options ask for.
pub(crate) fn target(a: &InputArgs) -> CliResult<Target> {
    #[cfg(feature = "mpi")]
    if a.mpi {
        return Ok(Target::Mpi(a.layout));
    }
    Ok(match a.devices {
        None => Target::One,
        Some(n) => Target::Devices(n, a.layout),
    })
}

/// What the ring did, in one line.
fn describe(what: &str, ctx: &Context, r: &RingReport, took: Duration, a: &InputArgs) -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    format!(
        "ran {what} on a ring of {} devices ({}), {} layout, path {}, storage {}, in {:.3} ms (incl. upload, shader compilation and readback); causal work balance (max/mean) {:.3}, peak device memory {:.2} MiB and {:.2} MiB sent per device at most",
        r.devices.len(),
        ctx.describe(),
        r.layout.name(),
        a.path.name(),
        a.storage,
        ms(took),
        r.balance(),
        mib(r.max_peak_memory()),
        mib(r.max_bytes_sent()),
    )
}

fn devices(n: usize) -> CliResult<Vec<Context>> {
    Context::devices_blocking(n).map_err(|e| format!("could not set up the GPU: {e}").into())
}

/// Wait for every device (no kernel compiling in the background is cut off at exit).
fn idle(ctxs: &[Context]) {
    for c in ctxs {
        let _ = c.wait_idle();
    }
}

impl Target {
    /// The forward on the ring, and what it did; `None` on an MPI rank other than 0 (rank 0
    /// writes the outputs).
    pub(crate) fn run(&self, sdpa: &Sdpa<'_>, a: &InputArgs) -> CliResult<Option<(Output, String)>> {
        let started = Instant::now();
        match self {
            Target::One => unreachable!("one device runs without the ring"),
            Target::Devices(n, layout) => {
                let ctxs = devices(*n)?;
                let r = Ring::new(&ctxs).layout(*layout).run_blocking(sdpa);
                idle(&ctxs);
                let r = r?;
                let how = describe("the attention", &ctxs[0], &r.report, started.elapsed(), a);
                Ok(Some((r.output, how)))
            }
            #[cfg(feature = "mpi")]
            Target::Mpi(layout) => mpi_rank(|world, ctx| {
                let r = wgpu_attention::ring::mpi::MpiRing::new(world, ctx)
                    .layout(*layout)
                    .run(sdpa)?;
                Ok(r.output.map(|o| {
                    let how = describe("the attention", ctx, &r.report, started.elapsed(), a);
                    (o, how)
                }))
            }),
        }
    }

    /// The backward on the ring, and what it did; `None` on an MPI rank other than 0.
    pub(crate) fn backward(&self, b: &Backward<'_>, a: &InputArgs) -> CliResult<Option<(Grads, String)>> {
        let started = Instant::now();
        match self {
            Target::One => unreachable!("one device runs without the ring"),
            Target::Devices(n, layout) => {
                let ctxs = devices(*n)?;
                let r = Ring::new(&ctxs).layout(*layout).backward_blocking(b);
                idle(&ctxs);
                let r = r?;
                let how = describe(
                    "the forward and the backward",
                    &ctxs[0],
                    &r.report,
                    started.elapsed(),
                    a,
                );
                Ok(Some((r.grads, how)))
            }
            #[cfg(feature = "mpi")]
            Target::Mpi(layout) => mpi_rank(|world, ctx| {
                let r = wgpu_attention::ring::mpi::MpiRing::new(world, ctx)
                    .layout(*layout)
                    .backward(b)?;
                Ok(r.grads.map(|g| {
                    let how = describe(
                        "the forward and the backward",
                        ctx,
                        &r.report,
                        started.elapsed(),
                        a,
                    );
                    (g, how)
                }))
            }),
        }
    }
}

/// Run `f` as this MPI rank with its own GPU context. A failure on any rank aborts the job
/// (after printing the error): a rank must not wait in MPI's finalisation for ranks that
/// will never arrive.
#[cfg(feature = "mpi")]
fn mpi_rank<T>(
    f: impl FnOnce(&mpi::topology::SimpleCommunicator, &Context) -> wgpu_attention::Result<Option<T>>,
) -> CliResult<Option<T>> {
    use wgpu_attention::ring::mpi::{abort_on_panic, fail};
    let universe = mpi::initialize().ok_or("MPI could not be initialised (start the command with mpirun)")?;
    let world = universe.world();
    abort_on_panic();
    let ctx = Context::new_blocking().unwrap_or_else(|e| fail(&world, &e));
    let r = f(&world, &ctx).unwrap_or_else(|e| fail(&world, &e));
    let _ = ctx.wait_idle();
    Ok(r)
}
