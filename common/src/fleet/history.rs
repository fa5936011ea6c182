//! Whether the etcd a reader reconnects to still holds the history it was following.
//!
//! Watches resume "from the last revision seen + 1". That is only right while etcd's history
//! only grows. An etcd whose data was wiped, or restored from an older backup, comes back at a
//! *lower* revision (and, for a wipe or a snapshot restore, a lower raft term; for a different
//! cluster, another cluster id): a watch from the old revision + 1 then sees nothing until the
//! new history happens to reach that number — the reader is blind while everything looks
//! healthy. So after reconnecting, a reader compares where it was ([`ClusterMark`], folded over
//! every header it saw) with where the cluster is now (a linearizable read,
//! [`ClusterMark::current`]), and re-reads everything when [`history_reset`] says the history
//! it knew is gone.
//!
//! What this cannot see: a wiped cluster that has already been written past the old revision,
//! in the same raft term and under the same cluster id. Raft terms make that unlikely (a wiped
//! or restored single-member cluster starts again at term 2, below any term a restart reached),
//! but a cluster wiped before its first restart and then written heavily while every reader was
//! away is indistinguishable from the old one by its headers.

use etcd_client::{Client, GetOptions, ResponseHeader};

/// Where a reader stands in one etcd cluster's history (0: unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterMark {
    pub cluster_id: u64,
    pub raft_term: u64,
    pub revision: i64,
}

impl ClusterMark {
    /// The mark of one response (all zeros without a header).
    pub fn of(header: Option<&ResponseHeader>) -> ClusterMark {
        header.map_or_else(ClusterMark::default, |h| ClusterMark {
            cluster_id: h.cluster_id(),
            raft_term: h.raft_term(),
            revision: h.revision(),
        })
    }

    /// Folds in a later response: the highest revision and term seen, the latest cluster id.
    pub fn observe(&mut self, header: Option<&ResponseHeader>) {
        self.observe_mark(ClusterMark::of(header));
    }

    /// [`ClusterMark::observe`] of a mark.
    pub fn observe_mark(&mut self, now: ClusterMark) {
        if now.cluster_id != 0 {
            self.cluster_id = now.cluster_id;
        }
        self.raft_term = self.raft_term.max(now.raft_term);
        self.revision = self.revision.max(now.revision);
    }

    /// The cluster's mark now, from a linearizable count-only read of `key`: unlike a watch's
    /// or a serializable read's header, it cannot come from a member lagging behind the
    /// cluster, so a revision lower than one seen before means the history went back.
    pub async fn current(client: &mut Client, key: &str) -> Result<ClusterMark, etcd_client::Error> {
        let resp = client.get(key, Some(GetOptions::new().with_count_only())).await?;
        Ok(ClusterMark::of(resp.header()))
    }
}

/// Why a reader that last saw `seen` must re-read everything instead of resuming its watch on a
/// cluster now at `now`; `None` when resuming is safe as far as etcd's headers tell. Unknown
/// (zero) fields are not compared.
pub fn history_reset(seen: &ClusterMark, now: &ClusterMark) -> Option<String> {
    if seen.cluster_id != 0 && now.cluster_id != 0 && seen.cluster_id != now.cluster_id {
        return Some(format!(
            "etcd's cluster id changed from {:x} to {:x} (another cluster, or one rebuilt from a backup)",
            seen.cluster_id, now.cluster_id
        ));
    }
    if now.revision < seen.revision {
        return Some(format!(
            "etcd's revision went back from {} to {} (its data was lost or restored from an older backup)",
            seen.revision, now.revision
        ));
    }
    if now.raft_term != 0 && now.raft_term < seen.raft_term {
        return Some(format!(
            "etcd's raft term went back from {} to {} (its data was wiped or restored from a backup)",
            seen.raft_term, now.raft_term
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(cluster_id: u64, raft_term: u64, revision: i64) -> ClusterMark {
        ClusterMark { cluster_id, raft_term, revision }
    }

    #[test]
    fn resumes_while_history_only_grew() {
        let seen = mark(7, 3, 100);
        assert_eq!(history_reset(&seen, &mark(7, 3, 100)), None, "nothing happened meanwhile");
        assert_eq!(history_reset(&seen, &mark(7, 4, 150)), None, "a restart: new term, history kept");
        assert_eq!(history_reset(&ClusterMark::default(), &mark(7, 2, 1)), None, "nothing seen yet");
        assert_eq!(history_reset(&seen, &mark(0, 0, 100)), None, "unknown fields are not compared");
    }

    #[test]
    fn re_reads_when_history_went_back_or_the_cluster_changed() {
        let seen = mark(7, 3, 100);
        let wiped = history_reset(&seen, &mark(7, 2, 5)).unwrap();
        assert!(wiped.contains("revision went back from 100 to 5"), "{wiped}");
        let restored = history_reset(&seen, &mark(7, 3, 99)).unwrap();
        assert!(restored.contains("older backup"), "{restored}");
        // Wiped, then written past the old revision before the reader came back: the term
        // still gives it away.
        let regrown = history_reset(&seen, &mark(7, 2, 500)).unwrap();
        assert!(regrown.contains("raft term went back from 3 to 2"), "{regrown}");
        let other = history_reset(&seen, &mark(8, 9, 900)).unwrap();
        assert!(other.contains("cluster id changed from 7 to 8"), "{other}");
    }

    #[test]
    fn observing_keeps_the_highest_revision_and_term() {
        let mut m = ClusterMark::default();
        m.observe(None);
        assert_eq!(m, ClusterMark::default(), "a response without a header changes nothing");
        m.observe_mark(mark(7, 3, 100));
        assert_eq!(m, mark(7, 3, 100));
        // A watch header from a member a little behind: the highest values stay.
        m.observe_mark(mark(7, 3, 90));
        assert_eq!(m, mark(7, 3, 100));
        m.observe_mark(mark(0, 4, 120));
        assert_eq!(m, mark(7, 4, 120), "an unknown cluster id keeps the known one");
    }
}
