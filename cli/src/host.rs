//! The machine a benchmark or fault run happened on, recorded beside its numbers (CPUs differ from one run to
//! the next, and a shared machine's load skews timings).

use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The machine a run happened on.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Host {
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// The SIMD flags strata's kernels care about, as /proc/cpuinfo lists them.
    pub cpu_flags: Vec<String>,
    /// Logical CPUs this process may use.
    pub cpus: usize,
    /// `git rev-parse --short HEAD` (with `-dirty` for local changes), if in a checkout.
    pub commit: Option<String>,
    /// UTC date and time of the run.
    pub date: String,
    /// The 1, 5 and 15 minute load averages when the run started (other work skews a timing).
    pub load_average: String,
    /// Median microseconds from one thread's send to a sleeping thread running ([`wake_up_micros`]); only the
    /// benchmarks that count hand-offs between threads measure it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wake_up_micros: Option<f64>,
    /// What one small message over loopback TCP costs, hot and after a compute step ([`loopback_micros`]);
    /// measured beside `wake_up_micros`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loopback: Option<Loopback>,
}

/// Median microseconds to send one 40-byte message over a loopback TCP connection and read it on the other end,
/// from one thread: back to back (`hot_micros`), and each after 5 ms spent in user space (`after_compute_micros`),
/// as a stage's I/O follows a decode step. On the development VMs the second is ~10x the first: every system call
/// after a few milliseconds in user space starts cold, and a pipeline hop needs at least a send and a receive.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Loopback {
    /// Back to back.
    pub hot_micros: f64,
    /// Each after 5 ms of user-space work.
    pub after_compute_micros: f64,
}

/// Measures [`Loopback`]; an error if this machine cannot open a loopback connection.
pub fn loopback_micros() -> std::io::Result<Loopback> {
    use std::io::{Read, Write};
    const ROUNDS: usize = 101;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut client = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (mut server, _) = listener.accept()?;
    client.set_nodelay(true)?;
    let message = [7u8; 40];
    let mut received = [0u8; 40];
    let mut round = |work: Duration| -> std::io::Result<f64> {
        let busy = Instant::now();
        while busy.elapsed() < work {
            std::hint::spin_loop();
        }
        let start = Instant::now();
        client.write_all(&message)?;
        server.read_exact(&mut received)?;
        Ok(start.elapsed().as_secs_f64() * 1e6)
    };
    let mut median = |work: Duration| -> std::io::Result<f64> {
        let mut samples = (0..ROUNDS).map(|_| round(work)).collect::<std::io::Result<Vec<f64>>>()?;
        Ok(crate::stats::percentile(&mut samples, 0.5).unwrap_or(0.0))
    };
    let hot_micros = median(Duration::ZERO)?;
    let after_compute_micros = median(Duration::from_millis(5))?;
    Ok(Loopback { hot_micros, after_compute_micros })
}

/// Median microseconds a thread blocked on a channel takes to run once another thread sends to it, each time after
/// the sender computed for 1 ms (as an executor does before it hands a batch on, so the woken thread usually runs
/// on another, idle CPU): what each hand-off between threads costs on this machine, of which a pipeline hop has
/// several (tens of microseconds on virtual machines, whose idle CPUs halt; a few on bare metal).
pub fn wake_up_micros() -> f64 {
    const ROUNDS: usize = 101;
    let (to_echo, from_main) = sync_channel::<Instant>(1);
    let (to_main, from_echo) = sync_channel::<Duration>(1);
    let echo = std::thread::spawn(move || {
        while let Ok(sent) = from_main.recv() {
            if to_main.send(sent.elapsed()).is_err() {
                break;
            }
        }
    });
    let mut samples = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let busy = Instant::now();
        while busy.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
        if to_echo.send(Instant::now()).is_err() {
            break;
        }
        match from_echo.recv() {
            Ok(took) => samples.push(took.as_secs_f64() * 1e6),
            Err(_) => break,
        }
    }
    drop(to_echo);
    let _ = echo.join();
    crate::stats::percentile(&mut samples, 0.5).unwrap_or(0.0)
}

/// Gigabytes per second that `threads` threads read from one buffer of `bytes` (at least 64 MiB, so it comes from
/// memory, not a cache), the best of five passes: the memory bandwidth a decode step, which streams every weight
/// once per token, is bound by. Each thread sums its own contiguous share.
pub fn memory_read_gb_per_s(bytes: usize, threads: usize) -> f64 {
    let words = bytes.max(64 << 20) / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads.max(1));
    let pass = || {
        let t = Instant::now();
        std::thread::scope(|s| {
            for part in buffer.chunks(share) {
                s.spawn(move || std::hint::black_box(part.iter().fold(0u64, |a, &x| a.wrapping_add(x))));
            }
        });
        t.elapsed().as_secs_f64()
    };
    pass();
    let best = (0..5).map(|_| pass()).fold(f64::INFINITY, f64::min);
    (words * 8) as f64 / best / 1e9
}

/// Flags worth printing (the kernels dispatch on these); the rest of /proc/cpuinfo's list is noise here.
const FLAGS: [&str; 13] = [
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "gfni",
    "amx_tile",
];

/// The model name and relevant flags of the first CPU in `cpuinfo`.
pub fn parse_cpuinfo(cpuinfo: &str) -> (String, Vec<String>) {
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    let flags = field("flags").unwrap_or_default();
    let have: Vec<&str> = flags.split_whitespace().collect();
    let wanted = FLAGS.iter().filter(|f| have.contains(f)).map(|f| (*f).to_owned()).collect();
    (field("model name").unwrap_or_else(|| "unknown".into()), wanted)
}

impl Host {
    /// Reads /proc/cpuinfo, git and the clock.
    pub fn detect() -> Self {
        let (cpu_model, cpu_flags) = parse_cpuinfo(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default());
        let run = |args: &[&str]| {
            std::process::Command::new(args[0])
                .args(&args[1..])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        let commit = run(&["git", "rev-parse", "--short", "HEAD"]).map(|c| {
            let dirty = run(&["git", "status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        });
        Self {
            cpu_model,
            cpu_flags,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            commit,
            date: run(&["date", "-u", "+%Y-%m-%d %H:%M:%SZ"]).unwrap_or_default(),
            load_average: std::fs::read_to_string("/proc/loadavg")
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
                .unwrap_or_default(),
            wake_up_micros: None,
            loopback: None,
        }
    }

    /// One line for a report's header: CPU, flags, load, commit, date and, when measured, the wake-up time.
    pub fn describe(&self) -> String {
        let wake = self.wake_up_micros.map(|us| format!(", thread wake-up {us:.0} µs (p50)")).unwrap_or_default();
        let loopback = self
            .loopback
            .map(|l| {
                format!(
                    ", loopback message {:.0} µs hot, {:.0} µs after 5 ms of compute (p50)",
                    l.hot_micros, l.after_compute_micros
                )
            })
            .unwrap_or_default();
        format!(
            "{} ({} CPUs; {}), load average {}, commit {}, {}{wake}{loopback}",
            self.cpu_model,
            self.cpus,
            self.cpu_flags.join(" "),
            self.load_average,
            self.commit.as_deref().unwrap_or("unknown"),
            self.date
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_gives_the_model_and_the_kernel_flags() {
        let info = "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f\n\nprocessor\t: 1\n";
        let (model, flags) = parse_cpuinfo(info);
        assert_eq!(model, "AMD EPYC 9654 96-Core Processor");
        assert_eq!(flags, ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f"]);
        assert_eq!(parse_cpuinfo("").0, "unknown");
    }

    #[test]
    fn memory_reads_at_a_finite_positive_rate() {
        let gb = memory_read_gb_per_s(1 << 20, 2);
        // Anything from a slow shared VM to many-channel servers; never zero, never infinite.
        assert!(gb > 0.1 && gb < 10_000.0, "{gb} GB/s");
    }

    #[test]
    fn a_wake_up_takes_some_time_and_is_reported() {
        let us = wake_up_micros();
        // A send and a context switch are never free; a busy test machine may take long, but not 100 ms.
        assert!(us > 0.0 && us < 100_000.0, "{us} µs");
        let host = Host { wake_up_micros: Some(us), ..Host::default() };
        assert!(host.describe().ends_with(&format!("thread wake-up {us:.0} µs (p50)")), "{}", host.describe());
    }

    #[test]
    fn a_loopback_message_takes_some_time_and_is_reported() -> std::io::Result<()> {
        let l = loopback_micros()?;
        for us in [l.hot_micros, l.after_compute_micros] {
            assert!(us > 0.0 && us < 100_000.0, "{us} µs");
        }
        let host = Host { loopback: Some(l), ..Host::default() };
        let expected = format!(
            "loopback message {:.0} µs hot, {:.0} µs after 5 ms of compute (p50)",
            l.hot_micros, l.after_compute_micros
        );
        assert!(host.describe().ends_with(&expected), "{}", host.describe());
        Ok(())
    }
}
