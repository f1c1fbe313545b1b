//! Rust benches of the core: `cargo bench --bench core`.
//!
//! Figures the contract asks for (DESIGN.md section 5): create + complete +
//! wait of one future under 1 us; `wait_all` over 100k futures; wake-up
//! latency across threads; pool submit-to-done throughput by worker count.

use async_array::future::{wait_all, Future, Outcome};
use async_array::pool::{Job, Pool};
use std::sync::Arc;

fn main() {
    divan::main();
}

type F = Future<u64, ()>;

#[divan::bench]
fn future_create_complete_wait() -> bool {
    let f = F::new();
    f.set_running();
    f.complete(Outcome::Value(divan::black_box(7)));
    f.wait_until(None)
}

#[divan::bench(args = [1_000, 100_000])]
fn wait_all_finished(bencher: divan::Bencher, n: usize) {
    let fs: Vec<F> = (0..n)
        .map(|i| {
            let f = F::new();
            f.complete(Outcome::Value(i as u64));
            f
        })
        .collect();
    bencher.bench(|| wait_all(&fs, 0, None));
}

#[divan::bench(sample_count = 200)]
fn wake_up_across_threads(bencher: divan::Bencher) {
    bencher.bench(|| {
        let f = F::new();
        let g = f.clone();
        let t = std::thread::spawn(move || g.wait_until(None));
        f.complete(Outcome::Value(1));
        t.join().unwrap()
    });
}

struct Done(F);

impl Job for Done {
    fn run(self: Box<Self>) {
        self.0.set_running();
        self.0.complete(Outcome::Value(1));
    }
    fn cancel(self: Box<Self>) {
        self.0.cancel();
    }
}

#[divan::bench(args = [1, 2, 4, 8], sample_count = 20)]
fn pool_submit_to_done_10k(bencher: divan::Bencher, workers: usize) {
    let pool = Arc::new(Pool::new("bench", workers));
    bencher.bench(|| {
        let fs: Vec<F> = (0..10_000)
            .map(|_| {
                let f = F::new();
                pool.submit(Box::new(Done(f.clone()))).unwrap();
                f
            })
            .collect();
        wait_all(&fs, 0, None)
    });
}
