//! Summaries of timing samples, shared by the benchmarks and the fault runs.

/// Nearest-rank percentile (`q` in 0..=1) of `v`, which it sorts; `None` without samples.
pub fn percentile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), Some(50.0));
        assert_eq!(percentile(&mut v, 0.99), Some(99.0));
        assert_eq!(percentile(&mut [3.0], 0.99), Some(3.0));
        // An odd count's median is its middle sample.
        let mut odd: Vec<f64> = (0..101).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut odd, 0.5), Some(50.0));
        assert_eq!(percentile(&mut [], 0.5), None);
    }
}
