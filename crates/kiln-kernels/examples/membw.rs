//! Read bandwidth of this machine, the bound on batch-1 decode:
//! `cargo run --release -p kiln-kernels --example membw -- [threads] [MiB]`.
//! Sums a buffer far larger than the last-level cache with the kernel thread pool and prints
//! the best of 10 passes in GB/s.

use kiln_kernels::ThreadPool;
use kiln_kernels::probe::read_bandwidth;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads = args.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mib: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2048);
    let pool = ThreadPool::new(threads);
    let bw = read_bandwidth(&pool, mib, 10);
    println!(
        "read bandwidth: {:.1} GB/s ({} threads, {mib} MiB buffer, best of 10)",
        bw / 1e9,
        pool.num_threads()
    );
}
