//! Ring attention: sequence parallelism over several devices, exact, forward and backward.
//!
//! The sequence is cut into `2N` chunks and dealt to N devices ([`Layout`]). Each device keeps
//! its query chunks; the key/value blocks travel round the ring, one hop per step, while each
//! device computes its queries against the block it holds (one [`Sdpa`] call per pair of a
//! query chunk and a key chunk, the causal mask shifted to the pair's place on the diagonal,
//! pairs above the diagonal skipped) and merges the partial results by the logsumexp rule on
//! the device (the `merge` kernel). The backward ([`Ring::backward`]) runs the same ring with
//! the global output and logsumexp: dQ is summed where its queries live, dK and dV travel
//! round with their block and arrive home complete.
//!
//! In one process ([`Ring`]) each device runs on its own thread and the links are channels;
//! across processes and machines the same per-device code runs with MPI messages
//! (`ring::mpi`, cargo feature `mpi`).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the API ([`Ring`], [`Layout`], the reports) and the plan every device shares |
//! | `shard.rs` | each device's part of the host inputs |
//! | `device.rs` | one device's ring: forward and backward |
//! | `link.rs` | sending to the next device, receiving from the previous one |
//! | `mpi.rs` | the ring over MPI ranks |

use std::ops::Range;
use std::time::Duration;

use ndarray::{Array3, Array4, ArrayD, IxDyn};

use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::problem::{Broadcast, Causal, Problem};
use crate::sdpa::backward::{Backward, Grads};
use crate::sdpa::{Output, Path, Sdpa};
use crate::storage::Storage;

pub(crate) mod device;
pub(crate) mod link;
#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod shard;

use device::{DeviceGrads, DeviceOutput};
use shard::{Global, Shard};

/// How the sequence is dealt to the devices: cut into `2N` chunks (sizes differ by at most
/// one; `L` and `S` each), device `r` holds two of them.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Layout {
    /// Device `r` holds chunks `r` and `2N-1-r`: under a causal mask every device has the
    /// same work (one chunk near the start of the diagonal, one near its end).
    #[default]
    Zigzag,
    /// Device `r` holds chunks `2r` and `2r+1`, one contiguous block: under a causal mask the
    /// last device does about `2N-1` times the work of the first. For comparison.
    Contiguous,
}

impl Layout {
    /// The name used by the CLI: `zigzag`, `contiguous`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Zigzag => "zigzag",
            Layout::Contiguous => "contiguous",
        }
    }
}

impl std::str::FromStr for Layout {
    type Err = Error;
    /// Parses the names [`Layout::name`] gives.
    fn from_str(s: &str) -> Result<Self> {
        [Layout::Zigzag, Layout::Contiguous]
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "layout",
                name: s.to_string(),
                expected: "zigzag, contiguous",
            })
    }
}

/// What one device did in a ring call.
#[derive(Debug, Clone, Default)]
pub struct DeviceReport {
    /// The device's rank in the ring.
    pub rank: usize,
    /// Query rows it owns (per batch and head).
    pub rows: usize,
    /// Score entries (query, key) its kernels computed, over every batch and head: the
    /// entries a causal mask allows in each pair it ran. The balance of the work.
    pub work: u64,
    /// Bytes it sent to its neighbour (key/value blocks; in the backward also dK/dV sums).
    pub bytes_sent: u64,
    /// Its peak device memory as planned: its query chunks, two key/value blocks (the one
    /// computed on and the one arriving), the merge buffers and the largest pair call's own
    /// temporaries.
    pub peak_memory: u64,
    /// Its peak device memory as measured: the most buffer memory the device held (wgpu's
    /// allocator count, [`Context::buffer_memory`]) at the points it was sampled (after each
    /// step's submission and each wait), above what it held before the ring started. `None`
    /// where the device does not count its buffers (without the `counters` feature, and on
    /// the web).
    pub measured_memory: Option<u64>,
    /// Wall time of its ring, from its first upload to its results on the host.
    pub total: Duration,
    /// Time it spent recording and submitting kernels, and waiting for them.
    pub compute: Duration,
    /// Time it spent exchanging with its neighbours (host staging included).
    pub exchange: Duration,
    /// Of [`DeviceReport::compute`], the waiting for kernels after each step's exchange: the
    /// compute the exchange ran alongside (with overlap on).
    pub wait_after_exchange: Duration,
}

/// What a ring call did, device by device.
#[derive(Debug, Clone, Default)]
pub struct RingReport {
    /// The layout used.
    pub layout: Layout,
    /// Whether exchanges overlapped compute ([`Ring::overlap`]).
    pub overlap: bool,
    /// One report per device, in rank order.
    pub devices: Vec<DeviceReport>,
}

impl RingReport {
    /// The largest device's work over the mean: 1 is perfect balance.
    pub fn balance(&self) -> f64 {
        let w: Vec<f64> = self.devices.iter().map(|d| d.work as f64).collect();
        let mean = w.iter().sum::<f64>() / w.len().max(1) as f64;
        if mean == 0.0 {
            1.0
        } else {
            w.iter().cloned().fold(0.0, f64::max) / mean
        }
    }

    /// The largest per-device planned peak memory.
    pub fn max_peak_memory(&self) -> u64 {
        self.devices.iter().map(|d| d.peak_memory).max().unwrap_or(0)
    }

    /// The largest measured peak memory of one device; `None` where a device did not count
    /// (see [`DeviceReport::measured_memory`]).
    pub fn max_measured_memory(&self) -> Option<u64> {
        self.devices
            .iter()
            .map(|d| d.measured_memory)
            .try_fold(0, |m, d| Some(m.max(d?)))
    }

    /// The largest bytes sent by one device.
    pub fn max_bytes_sent(&self) -> u64 {
        self.devices.iter().map(|d| d.bytes_sent).max().unwrap_or(0)
    }
}

/// A ring forward's results: the same [`Output`] one device gives, and the report.
#[derive(Debug, Clone)]
pub struct RingOutput {
    /// Output (and logsumexp and weights, when requested), as [`Sdpa::run`] returns them.
    pub output: Output,
    /// What each device did.
    pub report: RingReport,
}

/// A ring backward's results: the same [`Grads`] one device gives, and the report (of the
/// backward's ring; the forward it ran first is not in it).
#[derive(Debug, Clone)]
pub struct RingGrads {
    /// dQ, dK, dV, d(bias), and the forward's output and logsumexp when it ran it.
    pub grads: Grads,
    /// What each device did in the backward.
    pub report: RingReport,
}

/// Attention over a ring of devices in one process: each device a [`Context`] (several GPUs,
/// or several devices of one adapter, [`Context::devices`]), each on its own thread.
///
/// ```no_run
/// use ndarray::Array4;
/// use wgpu_attention::{Causal, Context, Ring, Sdpa};
/// let devices = Context::devices_blocking(4)?;
/// let q = Array4::<f32>::zeros((1, 8, 4096, 64));
/// let (k, v) = (q.clone(), q.clone());
/// let sdpa = Sdpa::new(&q, &k, &v).causal(Causal::TopLeft);
/// let out = Ring::new(&devices).run_blocking(&sdpa)?;        // equals sdpa.run_blocking(&one)
/// println!("balance {:.2}", out.report.balance());
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
///
/// Every option of [`Sdpa`] shards (causal top-left, bottom-right and diagonal, boolean mask
/// and bias sliced per pair, key lengths, grouped heads, storage formats, forced paths, the
/// logsumexp, the weights); the inputs are host data (the ring uploads each device's part),
/// and [`Sdpa::output_into`] is refused.
#[derive(Debug, Clone)]
pub struct Ring<'c> {
    contexts: &'c [Context],
    layout: Layout,
    overlap: bool,
    timeout: Duration,
}

/// How long a device waits for a neighbour before giving up, by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

impl<'c> Ring<'c> {
    /// A ring over `contexts`, in that order.
    pub fn new(contexts: &'c [Context]) -> Self {
        Ring {
            contexts,
            layout: Layout::Zigzag,
            overlap: true,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The layout (default [`Layout::Zigzag`]).
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// Whether each step's exchange runs while its kernels run (default `true`); `false`
    /// waits for the kernels first, to measure what the overlap saves.
    pub fn overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// How long a device waits for a neighbour before failing with [`Error::RingPeer`]
    /// (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The plan every device follows for `sdpa`, validated (no GPU work).
    pub fn plan(&self, sdpa: &Sdpa<'_>) -> Result<RingPlan> {
        RingPlan::new(sdpa, self.contexts.len(), self.layout)
    }

    /// Run `sdpa` over the ring; the devices run on threads while the future waits.
    pub async fn run(&self, sdpa: &Sdpa<'_>) -> Result<RingOutput> {
        let plan = self.plan(sdpa)?;
        let g = plan.global(sdpa, None)?;
        let (parts, report) = self.spread(&plan, g, device::forward).await?;
        Ok(RingOutput {
            output: plan.assemble_output(&parts),
            report,
        })
    }

    /// Blocking version of [`Ring::run`].
    pub fn run_blocking(&self, sdpa: &Sdpa<'_>) -> Result<RingOutput> {
        pollster::block_on(self.run(sdpa))
    }

    /// The backward of `backward`'s attention over the ring: the ring forward first (unless
    /// [`Backward::saved`] gives the output and logsumexp), then the backward's ring.
    pub async fn backward(&self, backward: &Backward<'_>) -> Result<RingGrads> {
        backward.problem()?;
        let sdpa = &backward.sdpa;
        let plan = self.plan(sdpa)?.for_backward(backward)?;
        let fw = match &backward.saved {
            Some(_) => None,
            None => Some(self.run(&sdpa.clone().return_lse()).await?.output),
        };
        let g = plan.global(sdpa, Some((backward, fw.as_ref())))?;
        let (parts, report) = self.spread(&plan, g, device::backward).await?;
        let mut grads = plan.assemble_grads(&parts);
        if let Some(fw) = fw {
            grads.output = Some(fw.output);
            grads.lse = fw.lse;
        }
        Ok(RingGrads { grads, report })
    }

    /// Check every device's pairs (before any GPU work), deal `g` into shards and run `work`
    /// on every device, each on its thread; the parts in rank order and the report.
    async fn spread<T: Send + 'static>(
        &self,
        plan: &RingPlan,
        g: Global<'_>,
        work: DeviceWork<T>,
    ) -> Result<(Vec<T>, RingReport)> {
        plan.check_devices(self.contexts)?;
        let shards: Vec<Shard> = (0..plan.n).map(|r| Shard::new(plan, r, &g)).collect();
        drop(g);
        let (contexts, overlap) = (self.contexts.to_vec(), self.overlap);
        let links = link::Channels::ring(plan.n, self.timeout);
        let results = on_threads(
            plan.clone(),
            contexts,
            shards,
            links,
            move |ctx, plan, shard, link| work(ctx, plan, shard, link, overlap),
        )
        .await?;
        let (parts, devices): (Vec<_>, Vec<_>) = results.into_iter().unzip();
        Ok((
            parts,
            RingReport {
                layout: self.layout,
                overlap,
                devices,
            },
        ))
    }

    /// Blocking version of [`Ring::backward`].
    pub fn backward_blocking(&self, backward: &Backward<'_>) -> Result<RingGrads> {
        pollster::block_on(self.backward(backward))
    }
}

/// Run `work` for every device on its own thread (inside a coordinating thread, so the
/// caller's future only waits) and collect the results in rank order. When devices fail, the
/// error returned is the first that is not a neighbour's report of another's failure.
async fn on_threads<T: Send + 'static>(
    plan: RingPlan,
    contexts: Vec<Context>,
    shards: Vec<Shard>,
    links: Vec<link::Channels>,
    work: impl Fn(&Context, &RingPlan, Shard, &mut link::Channels) -> Result<T> + Send + Sync + 'static,
) -> Result<Vec<T>> {
    let (tx, rx) = futures_intrusive::channel::shared::oneshot_channel();
    std::thread::Builder::new()
        .name("wgpu-attention ring".into())
        .spawn(move || {
            let results: Vec<Result<T>> = std::thread::scope(|s| {
                let handles: Vec<_> = contexts
                    .iter()
                    .zip(shards)
                    .zip(links)
                    .map(|((ctx, shard), mut link)| {
                        let (plan, work) = (&plan, &work);
                        s.spawn(move || work(ctx, plan, shard, &mut link))
                    })
                    .collect();
                handles
                    .into_iter()
                    .enumerate()
                    .map(|(rank, h)| {
                        h.join().unwrap_or_else(|_| {
                            Err(Error::Internal(format!("ring device {rank}'s thread panicked")))
                        })
                    })
                    .collect()
            });
            let _ = tx.send(first_error(results));
        })
        .map_err(|e| Error::Internal(format!("could not start the ring's thread: {e}")))?;
    rx.receive().await.unwrap_or_else(|| {
        Err(Error::Internal(
            "the ring's thread stopped without a result".into(),
        ))
    })
}

/// All results, or the root cause among the errors: a failure that is not a neighbour's
/// report of another device's failure, when there is one.
pub(crate) fn first_error<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    if results.iter().all(|r| r.is_ok()) {
        return results.into_iter().collect();
    }
    let errors: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
    let root = errors
        .iter()
        .position(|e| !matches!(e, Error::RingPeer { .. }))
        .unwrap_or(0);
    Err(errors.into_iter().nth(root).expect("at least one error"))
}

/// One device's key/value block as it travels: for each of its key chunks, k and v at
/// 256-byte aligned offsets (the largest storage offset alignment wgpu allows).
#[derive(Debug, Clone)]
pub(crate) struct BlockLayout {
    pub parts: Vec<BlockPart>,
    pub bytes: u64,
}

/// One key chunk in a block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockPart {
    pub chunk: usize,
    pub k_off: u64,
    pub v_off: u64,
}

const ALIGN: u64 = 256;

/// The plan every device of a ring follows: the global problem, the layout's chunks, the
/// blocks and the pairs. Built the same on every device (and every MPI rank) from the same
/// inputs; validated before any GPU work.
#[derive(Debug, Clone)]
pub struct RingPlan {
    pub(crate) n: usize,
    pub(crate) layout: Layout,
    /// The global problem, its storage formats included (`out`: the output's format; for a
    /// backward, dO's).
    pub(crate) p: Problem,
    /// The user functions with their captures (copied), for the pairs' calls.
    pub(crate) user_mod: Option<crate::user_mod::UserMod<'static>>,
    pub(crate) scale: Option<f64>,
    pub(crate) path: Path,
    pub(crate) lse: bool,
    pub(crate) weights: bool,
    pub(crate) max_scores_bytes: Option<u64>,
    /// The format of the forward's output (the backward's `p.storage.out` is dO's).
    pub(crate) out_storage: Storage,
    pub(crate) q_bounds: Vec<usize>,
    pub(crate) kv_bounds: Vec<usize>,
    /// The bias's own shape (rank 1 to 4), for d(bias).
    pub(crate) bias_shape: Option<Vec<usize>>,
    /// Whether this is a backward's plan (its pairs plan as backward calls).
    pub(crate) backward: bool,
}

/// Where one key chunk's dK and dV sit in a block's travelling f32 sums (elements).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GradsPart {
    pub(crate) chunk: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) end: usize,
}

impl RingPlan {
    pub(crate) fn new(sdpa: &Sdpa<'_>, n: usize, layout: Layout) -> Result<Self> {
        let p = sdpa.problem()?;
        let refuse = |reason: &str| {
            Err(Error::Ring {
                devices: n,
                reason: reason.into(),
            })
        };
        if n == 0 {
            return refuse("a ring needs at least one device");
        }
        crate::sdpa::quant::refuse("the ring", &[p.storage.k, p.storage.v])?;
        if p.paged.is_some() || p.rope.is_some() {
            return refuse(
                "the ring splits contiguous keys: paged K/V caches and RoPE on q are for Sdpa alone",
            );
        }
        // A softcap acts per logit and document ids travel with their positions: both split
        // with the keys, as do user functions (each pair's sees its global positions,
        // `pos_offset`). A window and ALiBi measure distances from the diagonal, which each
        // pair shifts to the global one (`pair_shift`); under key lengths the diagonal is each
        // batch's, which a key chunk cuts differently per batch.
        if (p.window.is_some() || p.alibi.is_some()) && p.kv_lens.is_some() {
            return refuse(
                "a sliding window or ALiBi with key lengths (each batch's diagonal at its own length) is not split over devices yet: run it on one device",
            );
        }
        if n > p.seq_q || n > p.seq_kv {
            return refuse(&format!(
                "more devices than sequence positions (L = {}, S = {}): each device needs at least one query and one key",
                p.seq_q, p.seq_kv
            ));
        }
        if sdpa.out.is_some() {
            return refuse(
                "output_into: the ring's output is assembled on the host from every device's rows",
            );
        }
        let p = one_diagonal(p, n)?;
        let bounds = |len: usize| (0..=2 * n).map(|c| c * len / (2 * n)).collect::<Vec<_>>();
        let plan = RingPlan {
            n,
            layout,
            out_storage: p.storage.out,
            scale: sdpa.options.scale,
            path: sdpa.path,
            lse: sdpa.lse,
            weights: sdpa.weights,
            max_scores_bytes: sdpa.max_scores_bytes,
            q_bounds: bounds(p.seq_q),
            kv_bounds: bounds(p.seq_kv),
            bias_shape: sdpa.options.bias.as_ref().map(|b| b.shape.clone()),
            backward: false,
            user_mod: sdpa.options.user_mod.as_ref().map(|m| m.to_owned_mod()),
            p,
        };
        // The sink logit joins each row's softmax once: in the pair of its query chunk with
        // the first key chunk, which every query chunk must then compute.
        if plan.p.sink_logits.is_some() && (0..2 * n).any(|qc| plan.pair_causal(qc, 0).is_none()) {
            return refuse(
                "sink logits where the causal mask hides the first keys from some queries are not split over devices yet: run them on one device",
            );
        }
        Ok(plan)
    }

    /// The plan of the backward of `b`: dO's format and the backward's path.
    pub(crate) fn for_backward(mut self, b: &Backward<'_>) -> Result<Self> {
        self.p = one_diagonal(b.problem()?, self.n)?;
        self.path = b.path;
        self.backward = true;
        if self.weights {
            return Err(Error::Ring {
                devices: self.n,
                reason: "return_weights: the backward returns gradients, not weights".into(),
            });
        }
        Ok(self)
    }

    /// The number of devices.
    pub fn devices(&self) -> usize {
        self.n
    }

    /// The query positions device `rank` owns, chunk by chunk.
    pub fn query_rows(&self, rank: usize) -> Vec<Range<usize>> {
        self.chunks(rank).iter().map(|&c| self.q_range(c)).collect()
    }

    /// The key positions of device `rank`'s block, chunk by chunk.
    pub fn key_rows(&self, rank: usize) -> Vec<Range<usize>> {
        self.chunks(rank).iter().map(|&c| self.kv_range(c)).collect()
    }

    /// Query rows over every batch and head (`B·Hq·len`) of each of device `rank`'s chunks.
    pub(crate) fn q_rows(&self, rank: usize) -> Vec<usize> {
        let bh = self.p.batch_heads();
        self.query_rows(rank).iter().map(|r| bh * r.len()).collect()
    }

    /// Key rows over every batch and kv head (`B·Hkv·len`) of each of block `rank`'s chunks.
    pub(crate) fn kv_rows(&self, rank: usize) -> Vec<usize> {
        let bh = self.p.batch * self.p.kv_heads;
        self.key_rows(rank).iter().map(|r| bh * r.len()).collect()
    }

    /// The two chunks device `rank` holds (queries and keys alike), in order.
    pub(crate) fn chunks(&self, rank: usize) -> [usize; 2] {
        match self.layout {
            Layout::Zigzag => [rank, 2 * self.n - 1 - rank],
            Layout::Contiguous => [2 * rank, 2 * rank + 1],
        }
    }

    pub(crate) fn q_range(&self, c: usize) -> Range<usize> {
        self.q_bounds[c]..self.q_bounds[c + 1]
    }

    pub(crate) fn kv_range(&self, c: usize) -> Range<usize> {
        self.kv_bounds[c]..self.kv_bounds[c + 1]
    }

    /// Block `b` (device `b`'s keys and values) as it travels.
    pub(crate) fn block(&self, b: usize) -> BlockLayout {
        let f = self.p.storage;
        let rows = |c: usize| self.p.batch * self.p.kv_heads * self.kv_range(c).len();
        let mut at = 0u64;
        let mut parts = vec![];
        for c in self.chunks(b) {
            let k_off = at;
            let v_off = (k_off + f.k.bytes(rows(c) * self.p.head_dim)).next_multiple_of(ALIGN);
            at = (v_off + f.v.bytes(rows(c) * self.p.head_dim_v)).next_multiple_of(ALIGN);
            parts.push(BlockPart {
                chunk: c,
                k_off,
                v_off,
            });
        }
        BlockLayout {
            parts,
            bytes: at.max(ALIGN),
        }
    }

    /// Where each key chunk's dK and dV sit in the f32 sums of block `b` travelling in the
    /// backward (per chunk dK then dV), in elements.
    pub(crate) fn grads_layout(&self, b: usize) -> Vec<GradsPart> {
        let (e, ev) = (self.p.head_dim, self.p.head_dim_v);
        let mut at = 0;
        self.chunks(b)
            .into_iter()
            .zip(self.kv_rows(b))
            .map(|(chunk, rows)| {
                let part = GradsPart {
                    chunk,
                    dk: at,
                    dv: at + rows * e,
                    end: at + rows * (e + ev),
                };
                at = part.end;
                part
            })
            .collect()
    }

    /// The number of f32 values in block `b`'s travelling dK/dV sums.
    pub(crate) fn grads_len(&self, b: usize) -> usize {
        self.grads_layout(b).last().map_or(0, |x| x.end)
    }

    /// The causal alignment of the pair (query chunk, key chunk), or `None` when the causal
    /// mask hides all of it (or either chunk is empty): the pair is skipped.
    pub(crate) fn pair_causal(&self, qc: usize, kc: usize) -> Option<Causal> {
        let (q, k) = (self.q_range(qc), self.kv_range(kc));
        if q.is_empty() || k.is_empty() {
            return None;
        }
        let Some(d) = self.p.causal.offset(self.p.seq_q, self.p.seq_kv) else {
            return Some(Causal::None);
        };
        let dl = q.start as i64 - k.start as i64 + d;
        let (lq, sk) = (q.len() as i64, k.len() as i64);
        if lq - 1 + dl < 0 {
            None
        } else if dl >= sk - 1 {
            Some(Causal::None)
        } else {
            Some(Causal::Diagonal(dl))
        }
    }

    /// Score entries the pair computes over every batch and head (causal-allowed entries).
    pub(crate) fn pair_work(&self, qc: usize, kc: usize) -> u64 {
        let (lq, sk) = (self.q_range(qc).len() as i64, self.kv_range(kc).len() as i64);
        let per_head: i64 = match self.pair_causal(qc, kc) {
            None => 0,
            Some(Causal::Diagonal(d)) => (0..lq).map(|i| (i + d + 1).clamp(0, sk)).sum(),
            Some(_) => lq * sk,
        };
        per_head as u64 * self.p.batch_heads() as u64
    }

    /// The pair's problem (the global one cut to the chunks, its masks sliced), with the
    /// output format `out`.
    pub(crate) fn pair_problem(&self, qc: usize, kc: usize, causal: Causal, out: Storage) -> Problem {
        let (q, k) = (self.q_range(qc), self.kv_range(kc));
        let mut p = self.p.clone();
        p.seq_q = q.len();
        p.seq_kv = k.len();
        p.causal = causal;
        let cut = |b: Broadcast| Broadcast {
            shape: shard::sliced_shape(b.shape, q.len(), k.len()),
        };
        p.mask = p.mask.map(cut);
        p.bias = p.bias.map(cut);
        p.kv_lens = p
            .kv_lens
            .map(|lens| lens.iter().map(|&l| pair_len(l as usize, &k) as u32).collect());
        p.storage.out = out;
        p.diag_shift = self.pair_shift(qc, kc);
        p.pos_offset = self.pair_positions(qc, kc);
        p.window = self.pair_window(kc);
        p.sink_logits = self.pair_sink_logits(kc);
        p
    }

    /// Where the pair's queries and keys start in the sequence: added to the positions its
    /// user functions see.
    pub(crate) fn pair_positions(&self, qc: usize, kc: usize) -> [usize; 2] {
        [self.q_range(qc).start, self.kv_range(kc).start]
    }

    /// The window of a pair with key chunk `kc`: the same sides; its sink tokens are the
    /// sequence's first keys, `n - k0` of the chunk's.
    pub(crate) fn pair_window(&self, kc: usize) -> Option<crate::problem::Window> {
        let k0 = self.kv_range(kc).start;
        self.p.window.map(|w| crate::problem::Window {
            sink_tokens: w.sink_tokens.saturating_sub(k0),
            ..w
        })
    }

    /// The sink logits of a pair with key chunk `kc`: each row's joins its softmax once, in
    /// its pair with the first key chunk.
    pub(crate) fn pair_sink_logits(&self, kc: usize) -> Option<Vec<f32>> {
        self.p.sink_logits.clone().filter(|_| kc == 0)
    }

    /// The lengths of the backward's d(sink logits) (`Hq`) and packed capture gradients, when
    /// the problem has them: each device sums its pairs' shares, the host the devices'.
    pub(crate) fn extra_grad_lens(&self) -> [Option<usize>; 2] {
        let caps = self.p.user_fns.as_ref().filter(|u| u.dcapture);
        [
            self.p.sink_logits.as_ref().map(Vec::len),
            caps.map(|u| u.capture_len()),
        ]
    }

    /// The shift that moves the pair's diagonal `S_p - L_p` (its chunks' lengths) onto the
    /// global problem's `S - L` at the chunks' starts, for the window and ALiBi (without key
    /// lengths: the plan refuses them there).
    pub(crate) fn pair_shift(&self, qc: usize, kc: usize) -> i64 {
        let (q, k) = (self.q_range(qc), self.kv_range(kc));
        let global = self.p.seq_kv as i64 - self.p.seq_q as i64;
        let local = k.len() as i64 - q.len() as i64;
        q.start as i64 - k.start as i64 + global - local
    }

    /// Every pair `rank` computes: (index of its query chunk, key chunk, causal), for each
    /// block in the order the blocks arrive.
    pub(crate) fn steps(&self, rank: usize) -> Vec<Step> {
        (0..self.n)
            .map(|t| {
                let b = (rank + self.n - t) % self.n;
                let own = self.chunks(rank);
                let pairs = own
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &qc)| {
                        self.chunks(b)
                            .into_iter()
                            .filter_map(move |kc| Some((i, kc, self.pair_causal(qc, kc)?)))
                    })
                    .collect();
                (b, pairs)
            })
            .collect()
    }

    /// Every pair of every device plans on `contexts` (the path runs it, the sizes fit):
    /// before any GPU work.
    pub(crate) fn check_devices(&self, contexts: &[Context]) -> Result<()> {
        for (rank, ctx) in contexts.iter().enumerate() {
            self.check_device(ctx, rank)?;
        }
        Ok(())
    }

    /// [`RingPlan::check_devices`] for one device; returns its planned peak memory.
    pub(crate) fn check_device(&self, ctx: &Context, rank: usize) -> Result<u64> {
        let caps = ctx.caps();
        let own = self.chunks(rank);
        let mut transient = 0u64;
        for (_, pairs) in self.steps(rank) {
            for (i, kc, causal) in pairs {
                if self.backward {
                    let pp = self.pair_problem(own[i], kc, causal, self.p.storage.out);
                    crate::sdpa::backward::plan(&pp, self.path, &caps)?;
                }
                let fw = self.pair_problem(own[i], kc, causal, Storage::F32);
                let request = crate::sdpa::plan::Request {
                    path: if self.backward { Path::Auto } else { self.path },
                    weights: self.weights,
                    max_scores_bytes: self.max_scores_bytes,
                };
                let plan = crate::sdpa::plan::Plan::new(&fw, &request, &caps)?;
                let io = fw.storage.q.bytes(fw.q_shape().iter().product())
                    + fw.storage.k.bytes(fw.k_shape().iter().product())
                    + fw.storage.v.bytes(fw.v_shape().iter().product());
                let mem = crate::sdpa::memory_of(&fw, &plan, self.weights).saturating_sub(io);
                transient = transient.max(mem);
            }
        }
        let p = &self.p;
        let mut resident = 2 * (0..self.n).map(|b| self.block(b).bytes).max().unwrap_or(0);
        for &c in &own {
            let rows = p.batch_heads() * self.q_range(c).len();
            resident += p.storage.q.bytes(rows * p.head_dim);
            // Merge parts (2 slots), merged output and logsumexp, f32.
            resident += 4 * (3 * rows * p.head_dim_v + 3 * rows) as u64;
        }
        Ok(resident + transient)
    }

    /// The inputs on the host (and, for a backward, dO and the saved or computed forward).
    pub(crate) fn global<'x>(
        &self,
        sdpa: &'x Sdpa<'_>,
        backward: Option<(&'x Backward<'_>, Option<&'x Output>)>,
    ) -> Result<Global<'x>> {
        let n = self.n;
        let (dout, saved) = match backward {
            None => (None, None),
            Some((b, fw)) => {
                let dout = shard::host(n, "dout", &b.dout)?;
                let saved = match (&b.saved, fw) {
                    (Some((o, l)), _) => Some((shard::host(n, "output", o)?, shard::host(n, "lse", l)?)),
                    (None, Some(fw)) => Some((
                        fw.output.as_slice().expect("standard layout").into(),
                        fw.lse
                            .as_ref()
                            .expect("requested")
                            .as_slice()
                            .expect("standard layout")
                            .into(),
                    )),
                    // Over MPI each rank fills in the rows of its own forward.
                    (None, None) => None,
                };
                (Some(dout), saved)
            }
        };
        Ok(Global {
            q: shard::host(n, "q", &sdpa.q)?,
            k: shard::host(n, "k", &sdpa.k)?,
            v: shard::host(n, "v", &sdpa.v)?,
            mask: sdpa.options.mask.as_ref().map(|m| &*m.data),
            bias: sdpa
                .options
                .bias
                .as_ref()
                .map(|b| shard::host(n, "bias", b))
                .transpose()?,
            dout,
            saved,
        })
    }

    /// The output from every device's rows.
    pub(crate) fn assemble_output(&self, parts: &[DeviceOutput]) -> Output {
        let p = &self.p;
        let (b, h) = (p.batch, p.q_heads);
        let (l, s, ev) = (p.seq_q, p.seq_kv, p.head_dim_v);
        let mut out = Array4::<f32>::zeros((b, h, l, ev));
        let mut lse = Array3::<f32>::zeros((b, h, l));
        let mut weights = self.weights.then(|| Array4::<f32>::zeros((b, h, l, s)));
        for (rank, part) in parts.iter().enumerate() {
            for (i, r) in self.query_rows(rank).into_iter().enumerate() {
                let rows = r.len();
                let sl = ndarray::s![.., .., r.clone(), ..];
                out.slice_mut(sl)
                    .assign(&ndarray::ArrayView4::from_shape((b, h, rows, ev), &part.out[i]).expect("rows"));
                lse.slice_mut(ndarray::s![.., .., r.clone()])
                    .assign(&ndarray::ArrayView3::from_shape((b, h, rows), &part.lse[i]).expect("rows"));
                if let (Some(w), Some(pw)) = (weights.as_mut(), part.weights.as_ref()) {
                    w.slice_mut(sl)
                        .assign(&ndarray::ArrayView4::from_shape((b, h, rows, s), &pw[i]).expect("rows"));
                }
            }
        }
        Output {
            output: out,
            weights,
            lse: self.lse.then_some(lse),
        }
    }

    /// The gradients from every device's parts (d(bias) summed over the devices).
    pub(crate) fn assemble_grads(&self, parts: &[DeviceGrads]) -> Grads {
        let p = &self.p;
        let (b, hq, hkv) = (p.batch, p.q_heads, p.kv_heads);
        let (l, s) = (p.seq_q, p.seq_kv);
        let (e, ev) = (p.head_dim, p.head_dim_v);
        let mut dq = Array4::<f32>::zeros((b, hq, l, e));
        let mut dk = Array4::<f32>::zeros((b, hkv, s, e));
        let mut dv = Array4::<f32>::zeros((b, hkv, s, ev));
        let mut dbias = p.bias.map(|bc| ArrayD::<f32>::zeros(IxDyn(&bc.shape)));
        let [mut dsink, mut dcaps] = self.extra_grad_lens().map(|n| n.map(|n| vec![0.0f32; n]));
        for (rank, part) in parts.iter().enumerate() {
            for (i, r) in self.query_rows(rank).into_iter().enumerate() {
                dq.slice_mut(ndarray::s![.., .., r.clone(), ..]).assign(
                    &ndarray::ArrayView4::from_shape((b, hq, r.len(), e), &part.dq[i]).expect("rows"),
                );
            }
            for (i, r) in self.key_rows(rank).into_iter().enumerate() {
                dk.slice_mut(ndarray::s![.., .., r.clone(), ..]).assign(
                    &ndarray::ArrayView4::from_shape((b, hkv, r.len(), e), &part.dk[i]).expect("rows"),
                );
                dv.slice_mut(ndarray::s![.., .., r.clone(), ..]).assign(
                    &ndarray::ArrayView4::from_shape((b, hkv, r.len(), ev), &part.dv[i]).expect("rows"),
                );
            }
            if let (Some(d), Some(pd)) = (dbias.as_mut(), part.dbias.as_ref()) {
                d.iter_mut().zip(pd).for_each(|(a, x)| *a += x);
            }
            for (acc, pd) in [(&mut dsink, &part.dsink), (&mut dcaps, &part.dcaptures)] {
                if let (Some(a), Some(pd)) = (acc.as_mut(), pd) {
                    a.iter_mut().zip(pd).for_each(|(a, x)| *a += x);
                }
            }
        }
        // The bias's own shape (rank 1 to 4), not its 4-D broadcast.
        let dbias = dbias.map(|d| {
            let shape = self.bias_shape.clone().unwrap_or_else(|| d.shape().to_vec());
            d.into_shape_with_order(IxDyn(&shape)).expect("same length")
        });
        Grads {
            dq: dq.mapv(|x| p.storage.q.round(x)),
            dk: dk.mapv(|x| p.storage.k.round(x)),
            dv: dv.mapv(|x| p.storage.v.round(x)),
            dbias: dbias.map(|d| d.mapv(|x| p.storage.bias.round(x))),
            dsink: dsink.map(ndarray::Array1::from),
            dcaptures: dcaps.and_then(|d| p.user_fns.as_ref().map(|u| u.split(&d))),
            output: None,
            lse: None,
        }
    }
}

/// One device's part of a ring call (`device::forward` or `device::backward`): its context,
/// the plan, its shard, its link, whether to overlap; its results and report.
type DeviceWork<T> = fn(&Context, &RingPlan, Shard, &mut dyn link::Link, bool) -> Result<(T, DeviceReport)>;

/// `p` with bottom-right causal under key lengths (each batch aligned to its own length) as the
/// one diagonal `kv_len - L` the ring's pairs take, which needs every batch's length equal:
/// unequal lengths are refused. Other problems are returned as they are.
fn one_diagonal(mut p: Problem, devices: usize) -> Result<Problem> {
    if let (Causal::BottomRight, Some(lens)) = (p.causal, &p.kv_lens) {
        if lens.windows(2).any(|w| w[0] != w[1]) {
            return Err(Error::Ring {
                devices,
                reason: "bottom-right causal with unequal key lengths (each batch aligned to its own length): run the batches apart, or use one device".into(),
            });
        }
        p.causal = Causal::Diagonal(lens[0] as i64 - p.seq_q as i64);
    }
    Ok(p)
}

/// A pair a device computes: the index of its query chunk, the key chunk, the causal alignment.
pub(crate) type PairId = (usize, usize, Causal);

/// One step of a device's ring: the block it holds and the pairs it computes.
pub(crate) type Step = (usize, Vec<PairId>);

/// The key length of batch `len` within the key chunk `k`.
fn pair_len(len: usize, k: &Range<usize>) -> usize {
    len.saturating_sub(k.start).min(k.len())
}
