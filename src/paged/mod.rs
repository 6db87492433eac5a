//! Paged KV caches and the attention over them (docs/paged.md), above the attention calls
//! they are made of:
//!
//! - `pages.rs`: [`Pages`] and [`PagedLayout`], [`Sdpa::paged`](crate::Sdpa::paged) and its
//!   checks (the caches' shapes and layout, the block table);
//! - `attention.rs`: [`PagedAttention`], a ragged batch as one call per run of sequences
//!   with the same query count;
//! - `cascade.rs`: the shared prefixes read once and merged by logsumexp;
//! - `cache.rs`: [`KvCache`]: pages, block tables, forks, the free list, reserve and append.
//!
//! Its reference (f64) is `reference/paged.rs`.

mod attention;
mod cache;
mod cascade;
mod pages;

pub use attention::{GpuPagedOutput, PagedAttention, PagedOutput};
pub use cache::{KvCache, KvCacheConfig, SeqId, Step};
pub use cascade::{SharedPrefix, MIN_SHARED_KEYS};
pub(crate) use pages::check_block_table;
pub use pages::{PagedLayout, Pages};
