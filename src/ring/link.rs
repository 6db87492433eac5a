//! How a device talks to its neighbours: it sends to the next device of the ring and receives
//! from the previous one. In one process the links are channels between the devices' threads
//! ([`Channels`]); across processes they are MPI messages (`ring::mpi`, feature `mpi`).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use crate::error::{Error, Result};

/// What a message carries; messages of different tags never overtake each other's receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    /// A key/value block on its way round.
    Kv = 0,
    /// The dK/dV sums of a block, travelling with it (backward).
    Grads = 1,
}

/// The two neighbours of one device.
pub(crate) trait Link {
    /// This device's rank, `0..size`.
    fn rank(&self) -> usize;
    /// Send `data` to the next device and receive `len` bytes from the previous one; fails
    /// (never hangs) when a neighbour fails, goes away or does not answer in time.
    fn exchange(&mut self, tag: Tag, data: &[u8], len: usize) -> Result<Vec<u8>>;
}

/// A link of the in-process ring: a channel per tag to the next device's thread and from the
/// previous one's. A thread that fails drops its ends, which fails its neighbours' exchanges,
/// and theirs fail theirs: an error goes round the ring instead of leaving it waiting.
pub(crate) struct Channels {
    rank: usize,
    size: usize,
    next: [Sender<Vec<u8>>; 2],
    prev: [Receiver<Vec<u8>>; 2],
    timeout: Duration,
}

impl Channels {
    /// The links of a ring of `n` devices.
    pub(crate) fn ring(n: usize, timeout: Duration) -> Vec<Channels> {
        let (mut senders, mut receivers): (Vec<_>, Vec<_>) = (0..n)
            .map(|_| {
                let (a, b) = (channel(), channel());
                ([a.0, b.0], [a.1, b.1])
            })
            .unzip();
        // Device r sends on channel r + 1 (to the next) and receives on channel r.
        senders.rotate_left(1 % n.max(1));
        senders
            .drain(..)
            .zip(receivers.drain(..))
            .enumerate()
            .map(|(rank, (next, prev))| Channels {
                rank,
                size: n,
                next,
                prev,
                timeout,
            })
            .collect()
    }
}

impl Link for Channels {
    fn rank(&self) -> usize {
        self.rank
    }

    fn exchange(&mut self, tag: Tag, data: &[u8], len: usize) -> Result<Vec<u8>> {
        let (n, rank) = (self.size, self.rank);
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        self.next[tag as usize]
            .send(data.to_vec())
            .map_err(|_| Error::RingPeer {
                rank,
                peer: next,
                reason: "has stopped (it failed or gave up)".into(),
            })?;
        let got = self.prev[tag as usize]
            .recv_timeout(self.timeout)
            .map_err(|e| Error::RingPeer {
                rank,
                peer: prev,
                reason: match e {
                    RecvTimeoutError::Timeout => format!("sent nothing within {:?}", self.timeout),
                    RecvTimeoutError::Disconnected => "has stopped (it failed or gave up)".into(),
                },
            })?;
        check_len(rank, prev, &got, len)?;
        Ok(got)
    }
}

/// A received message must have the length the plan gives it.
pub(crate) fn check_len(rank: usize, peer: usize, got: &[u8], len: usize) -> Result<()> {
    if got.len() != len {
        return Err(Error::RingPeer {
            rank,
            peer,
            reason: format!("sent {} bytes where the plan gives {len}", got.len()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_pass_round_the_ring_and_report_a_stopped_peer() {
        let mut links = Channels::ring(3, Duration::from_secs(5));
        // Each sends its rank; each receives its previous device's.
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .iter_mut()
                .map(|l| s.spawn(move || l.exchange(Tag::Kv, &[l.rank() as u8], 1).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![vec![2], vec![0], vec![1]]);
        // Device 1 goes away: device 2 (its next) is told, not left waiting.
        let mut links = Channels::ring(3, Duration::from_secs(30));
        drop(links.remove(1));
        let e = links[1].exchange(Tag::Kv, &[0], 1).unwrap_err();
        assert!(matches!(e, Error::RingPeer { rank: 2, peer: 1, .. }), "{e}");
        // A neighbour that stays but sends nothing: a timeout, not a hang.
        let mut links = Channels::ring(2, Duration::from_millis(50));
        let e = links[0].exchange(Tag::Grads, &[0], 1).unwrap_err();
        assert!(e.to_string().contains("sent nothing within"), "{e}");
    }
}
