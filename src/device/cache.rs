//! What a repeated call reuses instead of creating: the kernels' parameter buffers and small
//! read-only inputs (key lengths, block tables, RoPE angles), keyed by their bytes, and bind
//! groups, keyed by the pipeline and the exact buffer ranges they bind.
//!
//! Why it is safe:
//! - A cached parameter or input buffer is never written again: a call whose values differ
//!   gets another buffer. So two calls recorded into one encoder (and `queue.write_buffer`
//!   lands at submit, before every command of the encoder) each read their own values.
//! - A bind group holds a clone of every buffer it binds, so a buffer the caller dropped
//!   cannot be replaced by a new one at the same identity: a new buffer is a new key.
//!
//! Only what is asked for a second time is kept (a key seen once is remembered as a hash,
//! holding nothing), so a call's own fresh output buffers are never held alive by the cache.
//! The cache is bounded by entries and by the bytes of the buffers its bind groups keep alive
//! (each buffer counted once), evicting the least recently used; [`Context::release_cached`]
//! empties it. Limits: [`CacheLimits`].
//!
//! [`Context::release_cached`]: crate::Context::release_cached

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use super::pipelines::Pipeline;

/// The bounds of a context's cache of parameter buffers and bind groups
/// ([`Context::set_cache_limits`](crate::Context::set_cache_limits)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// Bind groups kept at most (and as many parameter and small input buffers).
    pub entries: usize,
    /// Bytes of buffers the cached bind groups may keep alive (each buffer counted once, at
    /// its full size). A caller's buffer bound by a cached bind group is not freed until the
    /// entry is evicted or the cache released.
    pub bytes: u64,
}

impl Default for CacheLimits {
    /// 4096 entries, 256 MiB.
    fn default() -> Self {
        CacheLimits {
            entries: 4096,
            bytes: 256 << 20,
        }
    }
}

/// What a context's cache holds ([`Context::cache_stats`](crate::Context::cache_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Bind groups.
    pub bind_groups: usize,
    /// Parameter buffers and constant inputs.
    pub buffers: usize,
    /// Bytes of the buffers the cached bind groups keep alive (each counted once).
    pub bytes_held: u64,
}

/// One bound range: the buffer, offset and size.
type Range = (wgpu::Buffer, u64, Option<u64>);

#[derive(Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    /// The pipeline's address; the entry holds the `Arc`, so it is not reused while cached.
    pipeline: usize,
    ranges: Vec<Range>,
}

struct Group {
    group: wgpu::BindGroup,
    _pipeline: Arc<Pipeline>,
    used: u64,
    /// The tick it was cached at ([`Cache::forget_since`]).
    made: u64,
}

struct Init {
    buffer: wgpu::Buffer,
    used: u64,
    made: u64,
}

#[derive(Default)]
struct State {
    limits: Option<CacheLimits>,
    tick: u64,
    /// Hashes of keys asked for once.
    seen: HashSet<u64>,
    inits: HashMap<(u32, Vec<u8>), Init>,
    /// Scratch buffers by role and size (see [`Cache::scratch`]).
    scratch: HashMap<(&'static str, u64), Init>,
    groups: HashMap<GroupKey, Group>,
    /// Buffers the cached bind groups bind, with how many groups bind each.
    held: HashMap<wgpu::Buffer, usize>,
    held_bytes: u64,
}

/// A context's cache (see the module docs).
#[derive(Default)]
pub(crate) struct Cache {
    state: Mutex<State>,
}

/// Scratch sizes kept at most.
const SCRATCH: usize = 32;

/// Keys remembered as seen once, at most (then forgotten all at once).
const SEEN: usize = 1 << 14;

fn hash_of(x: &impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

impl State {
    fn limits(&self) -> CacheLimits {
        self.limits.unwrap_or_default()
    }

    /// Whether `key` was asked for before (remembering it now).
    fn second(&mut self, key: u64) -> bool {
        if self.seen.contains(&key) {
            return true;
        }
        if self.seen.len() >= SEEN {
            self.seen.clear();
        }
        self.seen.insert(key);
        false
    }

    fn evict(&mut self) {
        let lim = self.limits();
        while self.groups.len() > lim.entries || (self.held_bytes > lim.bytes && !self.groups.is_empty()) {
            let Some(key) = oldest(&self.groups, |g| g.used) else {
                break;
            };
            self.drop_group(&key);
        }
        while self.scratch.len() > SCRATCH {
            let Some(k) = oldest(&self.scratch, |i| i.used) else {
                break;
            };
            self.scratch.remove(&k);
        }
        while self.inits.len() > lim.entries {
            let Some(k) = oldest(&self.inits, |i| i.used) else {
                break;
            };
            self.inits.remove(&k);
        }
    }

    /// Remove a cached bind group, releasing its hold on the buffers it binds.
    fn drop_group(&mut self, key: &GroupKey) {
        if self.groups.remove(key).is_some() {
            for b in distinct(&key.ranges) {
                if let Some(n) = self.held.get_mut(b) {
                    *n -= 1;
                    if *n == 0 {
                        self.held.remove(b);
                        self.held_bytes -= b.size();
                    }
                }
            }
        }
    }

    /// Hold the buffers a newly cached bind group binds.
    fn hold(&mut self, ranges: &[Range]) {
        for b in distinct(ranges) {
            let n = self.held.entry(b.clone()).or_insert(0);
            if *n == 0 {
                self.held_bytes += b.size();
            }
            *n += 1;
        }
    }
}

/// The key of `map`'s least recently used entry.
fn oldest<K: Clone, V>(map: &HashMap<K, V>, used: impl Fn(&V) -> u64) -> Option<K> {
    map.iter().min_by_key(|(_, v)| used(v)).map(|(k, _)| k.clone())
}

/// The buffers of `ranges`, each once.
fn distinct(ranges: &[Range]) -> Vec<&wgpu::Buffer> {
    let mut out: Vec<&wgpu::Buffer> = Vec::new();
    for (b, ..) in ranges {
        if !out.contains(&b) {
            out.push(b);
        }
    }
    out
}

impl Cache {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A read-only buffer of `usage` holding `contents` (see [`crate::device::buffers::init`]): a
    /// cached one when these bytes were asked for before, else a new one (cached from the
    /// second time on).
    pub(crate) fn init(
        &self,
        make: impl FnOnce() -> wgpu::Buffer,
        contents: &[u8],
        usage: wgpu::BufferUsages,
    ) -> wgpu::Buffer {
        let mut s = self.lock();
        s.tick += 1;
        let tick = s.tick;
        let key = (usage.bits(), contents.to_vec());
        if let Some(i) = s.inits.get_mut(&key) {
            i.used = tick;
            return i.buffer.clone();
        }
        let again = s.second(hash_of(&key));
        drop(s);
        let buffer = make();
        if again {
            let mut s = self.lock();
            s.inits.insert(
                key,
                Init {
                    buffer: buffer.clone(),
                    used: tick,
                    made: tick,
                },
            );
            s.evict();
        }
        buffer
    }

    /// The bind group of `pipeline` over `entries` (buffer bindings in order): cached when
    /// asked for before.
    pub(crate) fn bind_group(
        &self,
        device: &wgpu::Device,
        label: &str,
        pipeline: &Arc<Pipeline>,
        entries: &[wgpu::BufferBinding<'_>],
    ) -> wgpu::BindGroup {
        let key = GroupKey {
            pipeline: Arc::as_ptr(pipeline) as usize,
            ranges: entries
                .iter()
                .map(|b| (b.buffer.clone(), b.offset, b.size.map(|s| s.get())))
                .collect(),
        };
        let mut s = self.lock();
        s.tick += 1;
        let tick = s.tick;
        if let Some(g) = s.groups.get_mut(&key) {
            g.used = tick;
            return g.group.clone();
        }
        let again = s.second(hash_of(&key));
        drop(s);
        let bind: Vec<wgpu::BindGroupEntry> = entries
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: wgpu::BindingResource::Buffer(b.clone()),
            })
            .collect();
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &pipeline.layout,
            entries: &bind,
        });
        // Another thread may have cached the same key meanwhile: its group stays (holding the
        // buffers once).
        let mut s = self.lock();
        if again && !s.groups.contains_key(&key) {
            s.hold(&key.ranges);
            s.groups.insert(
                key,
                Group {
                    group: group.clone(),
                    _pipeline: pipeline.clone(),
                    used: tick,
                    made: tick,
                },
            );
            s.evict();
        }
        group
    }

    /// A GPU-only scratch buffer of `bytes` (`STORAGE`) whose contents do not outlive the call
    /// that writes and then reads them (a split decode's partial results): one buffer per role
    /// (two scratch buffers of one dispatch never share one) and size, shared by every call.
    /// Safe because the GPU runs one queue's commands in order, and wgpu orders a dispatch's
    /// writes after the reads of the dispatches before it; so a call's
    /// write-then-read of the scratch cannot interleave with another call's.
    pub(crate) fn scratch(
        &self,
        role: &'static str,
        bytes: u64,
        make: impl FnOnce() -> wgpu::Buffer,
    ) -> wgpu::Buffer {
        let mut s = self.lock();
        s.tick += 1;
        let tick = s.tick;
        if let Some(i) = s.scratch.get_mut(&(role, bytes)) {
            i.used = tick;
            return i.buffer.clone();
        }
        drop(s);
        let buffer = make();
        let mut s = self.lock();
        s.scratch.insert(
            (role, bytes),
            Init {
                buffer: buffer.clone(),
                used: tick,
                made: tick,
            },
        );
        s.evict();
        buffer
    }

    /// The tick now: what is cached from here on can be forgotten with
    /// [`forget_since`](Cache::forget_since).
    pub(crate) fn mark(&self) -> u64 {
        self.lock().tick + 1
    }

    /// Forget what was cached since `mark` (a call that failed may have made invalid buffers:
    /// an allocation that ran out of memory gives an invalid buffer, not an error, until its
    /// error scope is popped). What was cached before stays.
    pub(crate) fn forget_since(&self, mark: u64) {
        let mut s = self.lock();
        s.inits.retain(|_, i| i.made < mark);
        s.scratch.retain(|_, i| i.made < mark);
        let gone: Vec<GroupKey> = s
            .groups
            .iter()
            .filter(|(_, g)| g.made >= mark)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            s.drop_group(&k);
        }
    }

    /// Set the bounds (evicting down to them).
    pub(crate) fn set_limits(&self, limits: CacheLimits) {
        let mut s = self.lock();
        s.limits = Some(limits);
        s.evict();
    }

    /// Drop everything cached.
    pub(crate) fn release(&self) {
        let mut s = self.lock();
        let limits = s.limits;
        *s = State {
            limits,
            ..State::default()
        };
    }

    /// Bind groups and buffers cached, and the bytes of the buffers the bind groups keep alive.
    pub(crate) fn stats(&self) -> (usize, usize, u64) {
        let s = self.lock();
        (s.groups.len(), s.inits.len(), s.held_bytes)
    }
}
