// What Rust's runtime feature detection sees, for scripts/emulate-cpu.sh.
//
// Build: rustc -O -o /tmp/detect scripts/emulate-cpu/detect.rs
// Run:   scripts/emulate-cpu.sh -- /tmp/detect
//
// Prints is_x86_feature_detected! for the features the CPU kernels care
// about, and runs a VPDPBUSD through core::arch when avx512vnni is there.
// Exits 0 when avx512f, avx512bw, avx512vl and avx512vnni are all detected.
use std::arch::x86_64::*;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dpbusd() -> [i32; 16] {
    let a: [u8; 64] = std::array::from_fn(|i| 200u8.wrapping_add(i as u8));
    let b: [i8; 64] = std::array::from_fn(|i| if i % 2 == 1 { -(i as i8 + 1) } else { i as i8 + 1 });
    let acc: [i32; 16] = std::array::from_fn(|j| 1000 * j as i32);
    let mut out = [0i32; 16];
    unsafe {
        let r = _mm512_dpbusd_epi32(
            _mm512_loadu_si512(acc.as_ptr().cast()),
            _mm512_loadu_si512(a.as_ptr().cast()),
            _mm512_loadu_si512(b.as_ptr().cast()),
        );
        _mm512_storeu_si512(out.as_mut_ptr().cast(), r);
    }
    out
}

fn main() {
    macro_rules! show {
        ($($f:tt),*) => {{
            let mut all = true;
            $(
                let on = is_x86_feature_detected!($f);
                println!("is_x86_feature_detected!({:?}) = {}", $f, on);
                all &= on;
            )*
            all
        }};
    }
    let _ = show!("avx2", "fma", "avxvnni");
    let need = show!("avx512f", "avx512bw", "avx512vl", "avx512vnni");
    if !need {
        println!("avx512 vnni: not available");
        std::process::exit(2);
    }
    let out = unsafe { dpbusd() };
    println!("_mm512_dpbusd_epi32: {:?}", out);
}
