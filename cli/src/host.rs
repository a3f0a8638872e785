//! The machine a benchmark or fault run happened on, recorded beside its numbers (CPUs differ from one run to
//! the next, and a shared machine's load skews timings).

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
}

/// Flags worth printing (the kernels dispatch on these); the rest of /proc/cpuinfo's list is noise here.
const FLAGS: [&str; 12] = [
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
        }
    }

    /// One line for a report's header: CPU, flags, load, commit and date.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} CPUs; {}), load average {}, commit {}, {}",
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
}
