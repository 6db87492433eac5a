//! Injected faults: make a context's next allocation run out of memory or its next readback
//! fail, so that an application (and this crate's tests) can check what happens then.
//!
//! A real device's out-of-memory and failed mappings cannot be provoked on demand (a software
//! adapter overcommits the host's memory; a mapping fails only on a dying device), so the
//! crate's allocations and readbacks pass through [`Injector`], which fails the one chosen. An
//! injected out-of-memory takes the path a real one takes: wgpu hands back an invalid buffer
//! and reports the error to the call's error scope, after the call has recorded its work; here
//! the buffer is made as usual and the call's error scope reports [`Error::OutOfMemory`]. In
//! both cases the call returns the error and drops every buffer it made.
//!
//! [`Error::OutOfMemory`]: crate::Error::OutOfMemory

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A fault for [`Context::inject_fault`](crate::Context::inject_fault) to make happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The buffer allocation `after` allocations from now (0: the next one) runs out of memory:
    /// the call making it returns [`Error::OutOfMemory`](crate::Error::OutOfMemory).
    OutOfMemory {
        /// Allocations to let through first.
        after: u64,
    },
    /// The next readback's mapping fails: the call returns
    /// [`Error::Readback`](crate::Error::Readback).
    Readback,
}

/// A context's pending faults (none most of the time: one atomic load per allocation).
#[derive(Debug, Default)]
pub(crate) struct Injector {
    /// Allocations to let through before failing one, plus one; 0 when none is pending.
    oom_countdown: AtomicU64,
    readback: AtomicBool,
}

thread_local! {
    /// An injected out-of-memory made on this thread, not yet reported by its error scope.
    static PENDING_OOM: Cell<bool> = const { Cell::new(false) };
}

impl Injector {
    pub(crate) fn inject(&self, fault: Fault) {
        match fault {
            Fault::OutOfMemory { after } => self
                .oom_countdown
                .store(after.saturating_add(1), Ordering::SeqCst),
            Fault::Readback => self.readback.store(true, Ordering::SeqCst),
        }
    }

    pub(crate) fn clear(&self) {
        self.oom_countdown.store(0, Ordering::SeqCst);
        self.readback.store(false, Ordering::SeqCst);
    }

    /// An allocation is being made: fail it (for the error scope to report) if it is the one.
    pub(crate) fn allocation(&self) {
        if self.oom_countdown.load(Ordering::Relaxed) == 0 {
            return;
        }
        let hit = self
            .oom_countdown
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok_and(|n| n == 1);
        if hit {
            PENDING_OOM.with(|p| p.set(true));
        }
    }

    /// Whether an injected out-of-memory is waiting for this thread's error scope (and clear it).
    pub(crate) fn take_pending_oom() -> bool {
        PENDING_OOM.with(|p| p.replace(false))
    }

    /// Whether this readback is to fail (and clear the fault).
    pub(crate) fn readback_fails(&self) -> bool {
        self.readback.load(Ordering::Relaxed) && self.readback.swap(false, Ordering::SeqCst)
    }
}
