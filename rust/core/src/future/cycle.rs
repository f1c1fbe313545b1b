//! Waits that would never end: a task that waits, directly or through other
//! tasks, for a future that only it can finish.
//!
//! Plain Rust. A future may record what must finish before it can
//! ([`BlockedOn`]): a task's own future while the task waits (for all of some
//! futures, or for any one of them), or a future that some task completes once
//! others are done (an `aa.jit` output needs its inputs, an `async_stream`
//! leaf needs its generator's task). Before a task waits, it records its wait
//! on its own future and asks [`find_cycle`] whether the wait can only end
//! once the task itself goes on.
//!
//! The graph is read one future at a time, each under its own lock, with no
//! lock over the whole: of two tasks that start waiting on each other at once,
//! each records its wait before it checks, so the later check sees both.

use super::{Future, WeakFuture};
use std::collections::HashMap;
use std::sync::Arc;

/// A wait that would never end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    /// Which of the waited-on futures (its position in `on`) leads back.
    pub index: usize,
    /// The labels from the waiting task, through the futures it waits on,
    /// back to the waiting task (first and last are the same).
    pub labels: Vec<Arc<str>>,
}

struct Node {
    label: Option<Arc<str>>,
    any: bool,
    /// Indices of the nodes this one waits on (distinct); empty when nothing
    /// holds it back (finished, running, queued, or of unknown producer).
    on: Vec<usize>,
}

/// Whether the wait that `me` has recorded (with [`Future::set_blocked_on`])
/// can only end once `me` itself goes on; then the cycle.
///
/// `me` is taken to be stuck. A future is stuck when it is not finished and
/// it needs a stuck future (all-of), or needs any of its futures and every
/// one of them is stuck (any-of); finished futures, and futures with nothing
/// recorded (a task that runs or is queued, which the pool will run), are not.
/// This is the least such set: futures stuck only among themselves, not
/// through `me`, do not count (their own wait found that cycle).
pub fn find_cycle<T, E>(me: &Future<T, E>) -> Option<Cycle> {
    let mine = me.blocked_on()?;
    // Every future reachable from `me`'s wait, breadth first, without recursion
    // (chains of pending outputs may be long). Node 0 is `me`.
    let mut nodes = vec![Node {
        label: mine.label.clone(),
        any: mine.any,
        on: Vec::new(),
    }];
    let mut ids: HashMap<usize, usize> = HashMap::from([(me.id(), 0)]);
    let mut frontier: Vec<(usize, Vec<WeakFuture<T, E>>)> = vec![(0, mine.on.clone())];
    // Position in `mine.on` of each of node 0's edges, for the answer's index.
    let mut my_edges: Vec<(usize, usize)> = Vec::new();
    while let Some((from, on)) = frontier.pop() {
        let mut edges = Vec::with_capacity(on.len());
        for (position, weak) in on.iter().enumerate() {
            // A future nobody holds any more is never waited on again.
            let Some(future) = weak.upgrade() else {
                continue;
            };
            let next = ids.len();
            let index = *ids.entry(future.id()).or_insert(next);
            if index == next {
                let blocked = if future.is_finished() {
                    None
                } else {
                    future.blocked_on()
                };
                nodes.push(Node {
                    label: blocked.as_ref().and_then(|b| b.label.clone()),
                    any: blocked.as_ref().is_some_and(|b| b.any),
                    on: Vec::new(),
                });
                if let Some(b) = blocked {
                    frontier.push((index, b.on));
                }
            }
            if from == 0 {
                my_edges.push((index, position));
            }
            if !edges.contains(&index) {
                edges.push(index);
            }
        }
        nodes[from].on = edges;
    }
    // Propagate "stuck" from `me` backwards along the edges.
    let mut waiting_on_me: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (j, node) in nodes.iter().enumerate().skip(1) {
        for &k in &node.on {
            waiting_on_me[k].push(j);
        }
    }
    let mut not_stuck_yet: Vec<usize> = nodes.iter().map(|n| n.on.len()).collect();
    // For each stuck node, the stuck node it needs (toward `me`).
    let mut cause: Vec<Option<usize>> = vec![None; nodes.len()];
    let mut stuck = vec![false; nodes.len()];
    stuck[0] = true;
    let mut work = vec![0usize];
    while let Some(k) = work.pop() {
        for &j in &waiting_on_me[k] {
            if stuck[j] {
                continue;
            }
            not_stuck_yet[j] -= 1;
            if !nodes[j].any || not_stuck_yet[j] == 0 {
                stuck[j] = true;
                cause[j] = Some(k);
                work.push(j);
            }
        }
    }
    let first_stuck = my_edges.iter().find(|(k, _)| stuck[*k]);
    let me_stuck = if nodes[0].any {
        !my_edges.is_empty() && my_edges.iter().all(|(k, _)| stuck[*k])
    } else {
        first_stuck.is_some()
    };
    if !me_stuck {
        return None;
    }
    let (mut k, index) = *first_stuck?;
    let mut labels: Vec<Arc<str>> = nodes[0].label.iter().cloned().collect();
    while k != 0 {
        labels.extend(nodes[k].label.iter().cloned());
        k = cause[k].expect("a stuck node other than me has a cause");
    }
    labels.extend(nodes[0].label.iter().cloned());
    Some(Cycle { index, labels })
}

#[cfg(test)]
mod tests {
    use super::super::BlockedOn;
    use super::*;

    type F = Future<u32, ()>;

    fn blocked(label: Option<&str>, any: bool, on: &[&F]) -> BlockedOn<u32, ()> {
        BlockedOn {
            label: label.map(Arc::from),
            any,
            on: on.iter().map(|f| f.downgrade()).collect(),
        }
    }

    fn waits(task: &F, label: &str, on: &[&F]) {
        task.set_blocked_on(Some(blocked(Some(label), false, on)));
    }

    fn labels(cycle: &Cycle) -> Vec<&str> {
        cycle.labels.iter().map(|l| &**l).collect()
    }

    #[test]
    fn no_record_no_cycle() {
        let me = F::new();
        assert_eq!(find_cycle(&me), None);
    }

    #[test]
    fn waiting_on_itself() {
        let me = F::new();
        waits(&me, "f", &[&me]);
        let cycle = find_cycle(&me).unwrap();
        assert_eq!((cycle.index, labels(&cycle)), (0, vec!["f", "f"]));
    }

    #[test]
    fn two_and_three_tasks_in_a_ring() {
        let (f, g, h) = (F::new(), F::new(), F::new());
        waits(&g, "g", &[&f]);
        waits(&f, "f", &[&g]);
        assert_eq!(labels(&find_cycle(&f).unwrap()), ["f", "g", "f"]);
        assert_eq!(labels(&find_cycle(&g).unwrap()), ["g", "f", "g"]);
        waits(&g, "g", &[&h]);
        waits(&h, "h", &[&f]);
        assert_eq!(labels(&find_cycle(&f).unwrap()), ["f", "g", "h", "f"]);
    }

    #[test]
    fn the_index_is_the_waited_future_that_leads_back() {
        let (me, free, other) = (F::new(), F::new(), F::new());
        waits(&other, "other", &[&me]);
        waits(&me, "me", &[&free, &other]);
        let cycle = find_cycle(&me).unwrap();
        assert_eq!(
            (cycle.index, labels(&cycle)),
            (1, vec!["me", "other", "me"])
        );
    }

    #[test]
    fn running_queued_or_finished_tasks_break_the_chain() {
        let (me, g, free) = (F::new(), F::new(), F::new());
        waits(&g, "g", &[&free]);
        waits(&me, "me", &[&g]);
        assert_eq!(find_cycle(&me), None);
        // g waits on me, but g is finished: nothing is stuck.
        waits(&g, "g", &[&me]);
        g.complete(crate::future::Outcome::Value(1));
        assert_eq!(find_cycle(&me), None);
    }

    #[test]
    fn unlabelled_futures_pass_through_to_their_producer() {
        // An async_stream leaf (no label) needs its generator's task, which waits on me.
        let (me, leaf, driver) = (F::new(), F::new(), F::new());
        leaf.set_blocked_on(Some(blocked(None, false, &[&driver])));
        waits(&driver, "stream", &[&me]);
        waits(&me, "me", &[&leaf]);
        assert_eq!(labels(&find_cycle(&me).unwrap()), ["me", "stream", "me"]);
    }

    #[test]
    fn any_of_is_stuck_only_when_every_one_is() {
        let (me, free, other) = (F::new(), F::new(), F::new());
        waits(&other, "other", &[&me]);
        me.set_blocked_on(Some(blocked(Some("me"), true, &[&free, &other])));
        assert_eq!(find_cycle(&me), None, "free may finish first");
        me.set_blocked_on(Some(blocked(Some("me"), true, &[&other, &me])));
        assert_eq!(labels(&find_cycle(&me).unwrap()), ["me", "other", "me"]);
        // Another task's any-of wait: stuck only if all its futures are.
        let (me, a, b, w) = (F::new(), F::new(), F::new(), F::new());
        w.set_blocked_on(Some(blocked(Some("w"), true, &[&a, &me])));
        waits(&me, "me", &[&w]);
        assert_eq!(find_cycle(&me), None);
        waits(&a, "a", &[&me]);
        // w's last future to be stuck names its way back.
        assert_eq!(labels(&find_cycle(&me).unwrap()), ["me", "w", "a", "me"]);
        drop(b);
    }

    #[test]
    fn a_cycle_among_others_is_not_mine() {
        let (me, g, h) = (F::new(), F::new(), F::new());
        waits(&g, "g", &[&h]);
        waits(&h, "h", &[&g]);
        waits(&me, "me", &[&g]);
        assert_eq!(find_cycle(&me), None);
    }

    #[test]
    fn a_long_chain_needs_no_deep_stack() {
        let me = F::new();
        let chain: Vec<F> = (0..100_000).map(|_| F::new()).collect();
        for pair in chain.windows(2) {
            pair[0].set_blocked_on(Some(blocked(None, false, &[&pair[1]])));
        }
        waits(chain.last().unwrap(), "last", &[&me]);
        waits(&me, "me", &[&chain[0]]);
        assert_eq!(labels(&find_cycle(&me).unwrap()), ["me", "last", "me"]);
    }

    #[test]
    fn dropped_futures_are_skipped() {
        let me = F::new();
        let gone = F::new();
        waits(&me, "me", &[&gone]);
        drop(gone);
        assert_eq!(find_cycle(&me), None);
    }
}
