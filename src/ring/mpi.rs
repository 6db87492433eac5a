//! The ring over MPI ranks (cargo feature `mpi`, rsmpi on the system's MPI): each rank owns
//! one GPU context and runs the same per-device code as the in-process ring, its neighbours
//! reached by nonblocking sends and receives.
//!
//! Every rank passes the same problem (read from the same files, or generated from the same
//! seed) and keeps its shards. Before any GPU work the ranks compare a digest of the plan and
//! of the inputs: a rank whose shapes, options, formats, layout or data differ makes every
//! rank fail with [`Error::RingMismatch`]. A message not completed within the timeout fails
//! with [`Error::RingPeer`] instead of waiting forever. A rank that returns an error must not
//! let MPI finalise normally (that waits for the others): call [`fail`], which prints the
//! error and aborts the job, and install [`abort_on_panic`] so that a panic does the same.
//!
//! ```no_run
//! use wgpu_attention::ring::mpi::{abort_on_panic, fail, MpiRing};
//! use wgpu_attention::{Causal, Context, Sdpa};
//! let universe = mpi::initialize().expect("MPI");
//! let world = universe.world();
//! abort_on_panic();
//! let ctx = Context::new_blocking().unwrap_or_else(|e| fail(&world, &e));
//! let q = ndarray::Array4::<f32>::zeros((1, 1, 16384, 64));
//! let sdpa = Sdpa::new(&q, &q, &q).causal(Causal::TopLeft);
//! let out = MpiRing::new(&world, &ctx).run(&sdpa).unwrap_or_else(|e| fail(&world, &e));
//! if let Some(full) = out.output {
//!     // rank 0: the whole output
//!     assert_eq!(full.output.shape(), &[1, 1, 16384, 64]);
//! }
//! ```

use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::time::{Duration, Instant};

use mpi::request::StaticScope;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use ndarray::{Array3, Array4};

use super::device::{self, DeviceGrads, DeviceOutput};
use super::link::{check_len, Link, Tag};
use super::shard::Shard;
use super::{DeviceReport, Layout, RingPlan, RingReport, DEFAULT_TIMEOUT};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::sdpa::backward::{Backward, Grads};
use crate::sdpa::{Output, Sdpa};

/// The tag of the results sent to rank 0 (the ring's own messages use [`Tag`]).
const RESULTS: i32 = 16;

/// Attention over a ring of MPI ranks, one GPU context per rank.
pub struct MpiRing<'w> {
    world: &'w SimpleCommunicator,
    ctx: &'w Context,
    layout: Layout,
    overlap: bool,
    timeout: Duration,
}

/// One rank's results of [`MpiRing::run`].
#[derive(Debug, Clone)]
pub struct MpiOutput {
    /// On rank 0: the whole output, as one device gives it. `None` on the other ranks.
    pub output: Option<Output>,
    /// The query positions this rank owns, chunk by chunk.
    pub rows: Vec<Range<usize>>,
    /// This rank's output rows `[B, Hq, rows, Ev]`, its chunks one after the other.
    pub local_output: Array4<f32>,
    /// This rank's logsumexp rows `[B, Hq, rows]`.
    pub local_lse: Array3<f32>,
    /// What every rank did (the same on every rank).
    pub report: RingReport,
}

/// One rank's results of [`MpiRing::backward`].
#[derive(Debug, Clone)]
pub struct MpiGrads {
    /// On rank 0: the gradients (and the forward's output and logsumexp when it ran it), as
    /// one device gives them. `None` on the other ranks.
    pub grads: Option<Grads>,
    /// What every rank did in the backward (the same on every rank).
    pub report: RingReport,
}

impl<'w> MpiRing<'w> {
    /// The ring of `world`'s ranks in rank order, this rank computing on `ctx`.
    pub fn new(world: &'w SimpleCommunicator, ctx: &'w Context) -> Self {
        MpiRing {
            world,
            ctx,
            layout: Layout::Zigzag,
            overlap: true,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The layout (default [`Layout::Zigzag`]); every rank must pass the same.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// Whether each step's exchange runs while its kernels run (default `true`).
    pub fn overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// How long a message may take before the rank fails with [`Error::RingPeer`] (default
    /// [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn link(&self) -> MpiLink<'_> {
        MpiLink {
            world: self.world,
            rank: self.rank(),
            size: self.world.size() as usize,
            timeout: self.timeout,
        }
    }

    /// Run `sdpa` (the same on every rank) over the ranks; rank 0 gets the whole output.
    pub fn run(&self, sdpa: &Sdpa<'_>) -> Result<MpiOutput> {
        let (plan, part, report) = self.forward(sdpa)?;
        let rank = self.rank();
        let p = &plan.p;
        let rows = plan.query_rows(rank);
        // The chunks of each (batch, head) are apart in the parts: put them side by side.
        let local_output = concat_rows(&part.out, p.batch, p.q_heads, &rows, p.head_dim_v);
        let local_lse =
            concat_rows(&part.lse, p.batch, p.q_heads, &rows, 1).index_axis_move(ndarray::Axis(3), 0);
        let parts = self.gather(&plan, part.flatten(), |r| DeviceOutput::len(&plan, r))?;
        Ok(MpiOutput {
            output: parts.map(|parts| {
                let parts: Vec<DeviceOutput> = parts
                    .iter()
                    .enumerate()
                    .map(|(r, d)| DeviceOutput::unflatten(&plan, r, d))
                    .collect();
                plan.assemble_output(&parts)
            }),
            rows,
            local_output,
            local_lse,
            report,
        })
    }

    /// The backward of `backward`'s attention (the same on every rank) over the ranks: the
    /// ring forward first (unless [`Backward::saved`] gives the output and logsumexp), then the
    /// backward's ring; rank 0 gets the gradients.
    pub fn backward(&self, backward: &Backward<'_>) -> Result<MpiGrads> {
        let rank = self.rank();
        let sdpa = &backward.sdpa;
        let fw = match backward.saved {
            Some(_) => None,
            None => Some(self.forward(&sdpa.clone().return_lse())?),
        };
        let checked = RingPlan::new(sdpa, self.world.size() as usize, self.layout)
            .and_then(|plan| plan.for_backward(backward))
            .and_then(|plan| {
                backward.problem()?;
                let g = plan.global(sdpa, Some((backward, None)))?;
                plan.check_device(self.ctx, rank)?;
                let digest = digest(&plan, &g);
                Ok((plan, g, digest))
            });
        let (plan, g, _) = self.agree(checked)?;
        let mut shard = Shard::new(&plan, rank, &g);
        drop(g);
        if let Some((_, part, _)) = &fw {
            // This rank's rows of the forward it just ran.
            shard.saved = part.out.iter().cloned().zip(part.lse.iter().cloned()).collect();
        }
        let (part, mine) = device::backward(self.ctx, &plan, shard, &mut self.link(), self.overlap)?;
        let report = self.reports(mine)?;
        let parts = self.gather(&plan, part.flatten(), |r| DeviceGrads::len(&plan, r))?;
        let grads = parts.map(|parts| {
            let parts: Vec<DeviceGrads> = parts
                .iter()
                .enumerate()
                .map(|(r, d)| DeviceGrads::unflatten(&plan, r, d))
                .collect();
            plan.assemble_grads(&parts)
        });
        let fw_out = match fw {
            Some((fw_plan, part, _)) => {
                let parts = self.gather(&fw_plan, part.flatten(), |r| DeviceOutput::len(&fw_plan, r))?;
                parts.map(|parts| {
                    let parts: Vec<DeviceOutput> = parts
                        .iter()
                        .enumerate()
                        .map(|(r, d)| DeviceOutput::unflatten(&fw_plan, r, d))
                        .collect();
                    fw_plan.assemble_output(&parts)
                })
            }
            None => None,
        };
        Ok(MpiGrads {
            grads: grads.map(|mut g| {
                if let Some(fw) = fw_out {
                    g.output = Some(fw.output);
                    g.lse = fw.lse;
                }
                g
            }),
            report,
        })
    }

    /// This rank's forward: plan, agree, run. Returns the plan, this rank's part and every
    /// rank's report.
    fn forward(&self, sdpa: &Sdpa<'_>) -> Result<(RingPlan, DeviceOutput, RingReport)> {
        let rank = self.rank();
        let checked = RingPlan::new(sdpa, self.world.size() as usize, self.layout).and_then(|plan| {
            let g = plan.global(sdpa, None)?;
            plan.check_device(self.ctx, rank)?;
            let digest = digest(&plan, &g);
            Ok((plan, g, digest))
        });
        let (plan, g, _) = self.agree(checked)?;
        let shard = Shard::new(&plan, rank, &g);
        drop(g);
        let (part, mine) = device::forward(self.ctx, &plan, shard, &mut self.link(), self.overlap)?;
        let report = self.reports(mine)?;
        Ok((plan, part, report))
    }

    /// Every rank learns whether every other rank could plan the problem and whether the
    /// plans and the inputs are the same; all fail together if not.
    fn agree<T>(&self, checked: Result<(RingPlan, T, [u64; 2])>) -> Result<(RingPlan, T, [u64; 2])> {
        let rank = self.rank();
        let mine = match &checked {
            Ok((_, _, d)) => [1, d[0], d[1]],
            Err(_) => [0, 0, 0],
        };
        let all = all_gather(self.world, rank, &mine, self.timeout)?;
        let all: Vec<&[u64]> = all.chunks(3).collect();
        let checked = checked?;
        if let Some(other) = all.iter().position(|d| d[0] == 0) {
            return Err(Error::RingPeer {
                rank,
                peer: other,
                reason: "refused the problem before any GPU work (its own error says why)".into(),
            });
        }
        for (other, d) in all.iter().enumerate() {
            if d[1] != mine[1] {
                return Err(Error::RingMismatch {
                    rank,
                    other,
                    what: "the problem (shapes, options, storage formats, layout or path)".into(),
                });
            }
            if d[2] != mine[2] {
                return Err(Error::RingMismatch {
                    rank,
                    other,
                    what: "the input data".into(),
                });
            }
        }
        Ok(checked)
    }

    /// Every rank's report, on every rank.
    fn reports(&self, mine: DeviceReport) -> Result<RingReport> {
        let secs = |d: Duration| d.as_secs_f64();
        let row = [
            mine.rows as f64,
            mine.work as f64,
            mine.bytes_sent as f64,
            mine.peak_memory as f64,
            // -1: not counted.
            mine.measured_memory.map_or(-1.0, |m| m as f64),
            secs(mine.total),
            secs(mine.compute),
            secs(mine.exchange),
            secs(mine.wait_after_exchange),
        ];
        let all = all_gather(self.world, self.rank(), &row, self.timeout)?;
        let d = Duration::from_secs_f64;
        Ok(RingReport {
            layout: self.layout,
            overlap: self.overlap,
            devices: all
                .chunks(row.len())
                .enumerate()
                .map(|(rank, r)| DeviceReport {
                    rank,
                    rows: r[0] as usize,
                    work: r[1] as u64,
                    bytes_sent: r[2] as u64,
                    peak_memory: r[3] as u64,
                    measured_memory: (r[4] >= 0.0).then_some(r[4] as u64),
                    total: d(r[5]),
                    compute: d(r[6]),
                    exchange: d(r[7]),
                    wait_after_exchange: d(r[8]),
                })
                .collect(),
        })
    }

    /// Every rank's `data` (of `len(rank)` values) on rank 0; `None` elsewhere.
    fn gather(
        &self,
        plan: &RingPlan,
        data: Vec<f32>,
        len: impl Fn(usize) -> usize,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let rank = self.rank();
        let bytes = bytemuck::cast_slice::<f32, u8>(&data);
        if rank != 0 {
            transfer(self.world, rank, Some((0, bytes)), None, RESULTS, self.timeout)?;
            return Ok(None);
        }
        let mut parts = vec![data.clone()];
        for r in 1..plan.n {
            let got = transfer(self.world, 0, None, Some((r, len(r) * 4)), RESULTS, self.timeout)?;
            parts.push(crate::storage::Storage::F32.decode(&got, len(r)));
        }
        Ok(Some(parts))
    }
}

/// `parts` (per chunk `[B, H, rows_c, d]`) side by side along the rows: `[B, H, Σ rows_c, d]`.
fn concat_rows(parts: &[Vec<f32>], b: usize, h: usize, rows: &[Range<usize>], d: usize) -> Array4<f32> {
    let views: Vec<ndarray::ArrayView4<f32>> = parts
        .iter()
        .zip(rows)
        .map(|(x, r)| ndarray::ArrayView4::from_shape((b, h, r.len(), d), x).expect("rows"))
        .collect();
    ndarray::concatenate(ndarray::Axis(2), &views).expect("same heads")
}

/// Digests of the plan (shapes, options, formats, layout, path) and of the input data.
fn digest(plan: &RingPlan, g: &super::shard::Global<'_>) -> [u64; 2] {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{plan:?}").hash(&mut h);
    let a = h.finish();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let floats = [
        Some(&g.q),
        Some(&g.k),
        Some(&g.v),
        g.bias.as_ref(),
        g.dout.as_ref(),
    ];
    for x in floats.into_iter().flatten() {
        for v in x.iter() {
            v.to_bits().hash(&mut h);
        }
    }
    g.mask.hash(&mut h);
    if let Some((o, l)) = &g.saved {
        for v in o.iter().chain(l.iter()) {
            v.to_bits().hash(&mut h);
        }
    }
    [a, h.finish().max(1)]
}

/// A rank's link to its neighbours.
struct MpiLink<'w> {
    world: &'w SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
}

impl Link for MpiLink<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn exchange(&mut self, tag: Tag, data: &[u8], len: usize) -> Result<Vec<u8>> {
        let n = self.size;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        transfer(
            self.world,
            self.rank,
            Some((next, data)),
            Some((prev, len)),
            tag as i32,
            self.timeout,
        )
    }
}

/// Send `send = (to, data)` and receive `recv = (from, len)` with nonblocking requests,
/// polled until both complete or `timeout` passes. On a timeout the requests are abandoned
/// with their buffers (MPI may still write to them, so they are never freed) and the rank
/// fails with [`Error::RingPeer`].
fn transfer(
    world: &SimpleCommunicator,
    rank: usize,
    send: Option<(usize, &[u8])>,
    recv: Option<(usize, usize)>,
    tag: i32,
    timeout: Duration,
) -> Result<Vec<u8>> {
    // 'static buffers, so that a request can outlive this call if it must be abandoned.
    let sbuf: Option<&'static [u8]> = send.map(|(_, d)| &*Box::leak(d.to_vec().into_boxed_slice()));
    let rbuf: Option<&'static mut [u8]> = recv.map(|(_, n)| Box::leak(vec![0u8; n].into_boxed_slice()));
    let rraw = rbuf.as_ref().map(|b| (b.as_ptr() as *mut u8, b.len()));
    let mut sreq = send.zip(sbuf).map(|((to, _), b)| {
        world
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, b, tag)
    });
    let mut rreq = recv.zip(rbuf).map(|((from, _), b)| {
        world
            .process_at_rank(from as i32)
            .immediate_receive_into_with_tag(StaticScope, b, tag)
    });
    let deadline = Instant::now() + timeout;
    let mut received = None;
    while sreq.is_some() || rreq.is_some() {
        if let Some(r) = sreq.take() {
            sreq = r.test().err();
        }
        if let Some(r) = rreq.take() {
            match r.test() {
                Ok(status) => received = Some(status.count(u8::equivalent_datatype()) as usize),
                Err(r) => rreq = Some(r),
            }
        }
        if (sreq.is_some() || rreq.is_some()) && Instant::now() > deadline {
            let peer = if rreq.is_some() {
                recv.map(|r| r.0)
            } else {
                send.map(|s| s.0)
            };
            std::mem::forget(sreq);
            std::mem::forget(rreq);
            return Err(Error::RingPeer {
                rank,
                peer: peer.unwrap_or(rank),
                reason: format!("did not complete a message within {timeout:?}"),
            });
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    // Both requests are complete: MPI no longer holds the buffers.
    if let Some(b) = sbuf {
        // SAFETY: leaked above from a Box<[u8]>; the send request that used it has completed.
        drop(unsafe { Box::from_raw(b as *const [u8] as *mut [u8]) });
    }
    match (rraw, recv) {
        (Some((ptr, n)), Some((from, len))) => {
            // SAFETY: leaked above from a Box<[u8]> of n bytes; its receive has completed.
            let got = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) }.into_vec();
            let count = received.unwrap_or(0);
            check_len(rank, from, &got[..count.min(n)], len)?;
            Ok(got)
        }
        _ => Ok(vec![]),
    }
}

/// Every rank's `mine` (the same length on each), on every rank, by a nonblocking all-gather
/// polled against `timeout` (a rank that never arrives fails the others with
/// [`Error::RingPeer`] instead of holding them in a collective forever).
fn all_gather<T>(world: &SimpleCommunicator, rank: usize, mine: &[T], timeout: Duration) -> Result<Vec<T>>
where
    T: Equivalence + Copy + Default + 'static,
{
    let n = world.size() as usize;
    let send: &'static [T] = Box::leak(mine.to_vec().into_boxed_slice());
    let recv: &'static mut [T] = Box::leak(vec![T::default(); mine.len() * n].into_boxed_slice());
    let (rptr, rlen) = (recv.as_mut_ptr(), recv.len());
    let mut req = Some(world.immediate_all_gather_into(StaticScope, send, recv));
    let deadline = Instant::now() + timeout;
    while let Some(r) = req.take() {
        match r.test() {
            Ok(_) => break,
            Err(r) if Instant::now() > deadline => {
                std::mem::forget(r);
                return Err(Error::RingPeer {
                    rank,
                    peer: rank,
                    reason: format!("(the all-gather of every rank) did not complete within {timeout:?}: a rank is missing"),
                });
            }
            Err(r) => req = Some(r),
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    // SAFETY: both leaked above from boxes of these lengths; the collective has completed.
    drop(unsafe { Box::from_raw(send as *const [T] as *mut [T]) });
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(rptr, rlen)) }.into_vec())
}

/// Make a panic on this rank abort the whole MPI job (after the panic message is printed)
/// instead of hanging it: unwinding would finalise MPI, which waits for the other ranks.
pub fn abort_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        // SAFETY: MPI_Abort on the world communicator; it does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
        }
    }));
}

/// Print `error` with this rank's number and abort the job with exit status 2: a rank that
/// fails must not finalise MPI normally (that waits for the others). An
/// [`Error::RingMismatch`] reaches every rank at once: they all print it before the job ends.
pub fn fail(world: &SimpleCommunicator, error: &Error) -> ! {
    eprintln!("wgpu-attention: rank {}: error: {error}", world.rank());
    if matches!(error, Error::RingMismatch { .. }) {
        world.barrier();
    }
    world.abort(2)
}
