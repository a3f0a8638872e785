//! How many layers each node of a pipeline order gets. While the model fits resident, layers follow speed
//! ([`apportion`]); when it does not, nodes that can offload ([`Room::offload_seconds`] > 0) also take layers they
//! keep in a slower tier (the mapped file on a CPU, host memory on a GPU), and the split minimises the slowest
//! stage's time ([`offload_shares`]), counting an offloaded layer at its measured offloaded speed.

/// One node's room at its position in the pipeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Room {
    /// The node's memory.
    pub memory: u64,
    /// What the stage costs besides its layers at this position (overhead, embeddings, head).
    pub fixed: u64,
    /// Weight bytes of one layer.
    pub layer_bytes: u64,
    /// KV bytes one layer reserves.
    pub kv_bytes: u64,
    /// Seconds of a resident layer.
    pub seconds: f64,
    /// Seconds of an offloaded layer (0: the node cannot offload).
    pub offload_seconds: f64,
    /// Seconds the stage takes besides its layers at this position (the head on the last stage).
    pub fixed_seconds: f64,
}

impl Room {
    /// Layers that fit resident.
    pub fn resident_cap(&self) -> usize {
        layers_fitting(self.memory, self.fixed, self.layer_bytes.saturating_add(self.kv_bytes))
    }

    /// How many of `layers` stay resident when the node holds them, or `None` when they do not fit even with
    /// offload: every layer keeps its KV in memory, and offloaded ones pass through two slots of a layer's size.
    /// The same inequality the stage worker plans its offload with (`strata_engine::offload::plan_offload`).
    pub fn resident_of(&self, layers: usize) -> Option<usize> {
        if layers <= self.resident_cap() {
            return Some(layers);
        }
        if self.offload_seconds <= 0.0 {
            return None;
        }
        let kv = self.kv_bytes.saturating_mul(layers as u64);
        let slots = self.layer_bytes.saturating_mul(2);
        let needed = self.fixed.saturating_add(kv).saturating_add(slots);
        let room = self.memory.checked_sub(needed)?;
        let resident = room.checked_div(self.layer_bytes).unwrap_or(u64::MAX);
        Some(usize::try_from(resident).unwrap_or(usize::MAX).min(layers))
    }

    /// Seconds the stage takes with `layers` layers, `None` when they do not fit.
    fn stage_seconds(&self, layers: usize) -> Option<f64> {
        let resident = self.resident_of(layers)?;
        // An offloaded layer is never counted faster than a resident one, so the time never falls as layers
        // are added (which makes the greedy split below optimal).
        let offloaded = self.offload_seconds.max(self.seconds);
        Some(self.fixed_seconds + resident as f64 * self.seconds + (layers - resident) as f64 * offloaded)
    }
}

/// Layers of `layer_cost` bytes that fit in `memory` beside `extras`.
pub(super) fn layers_fitting(memory: u64, extras: u64, layer_cost: u64) -> usize {
    let Some(room) = memory.checked_sub(extras) else {
        return 0;
    };
    match room.checked_div(layer_cost) {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => usize::MAX,
    }
}

/// Splits `n` layers over `rooms` so that the slowest stage is as fast as it can be, offloading where memory
/// runs out; `None` when they do not fit even so. Each layer goes, one at a time, to the node whose stage would
/// then take the least time: every node's time only grows with its layers, so the `n` smallest increments
/// chosen this way are the best bottleneck there is. Ties go to the earlier node.
pub(super) fn offload_shares(n: usize, rooms: &[Room]) -> Option<Vec<usize>> {
    greedy(vec![0; rooms.len()], n, |i, c| rooms[i].stage_seconds(c))
}

/// Splits `n` layers over `rooms`, all resident within `caps` (which hold `n` between them), so that the slowest
/// stage, counting its fixed time, is as fast as it can be: the greedy split of [`offload_shares`] without
/// offloading. Every node that can hold a layer gets at least one first (when there are enough layers): a head
/// measured slow must not leave a node that joined without a stage.
pub(super) fn resident_shares(n: usize, rooms: &[Room], caps: &[usize]) -> Option<Vec<usize>> {
    let first: Vec<usize> = caps.iter().map(|&c| usize::from(c > 0 && n >= rooms.len())).collect();
    greedy(first, n, |i, c| (c <= caps[i]).then(|| rooms[i].fixed_seconds + c as f64 * rooms[i].seconds))
}

/// Adds layers to `counts` one at a time until they hold `n`: each goes to the node whose time `time(node,
/// layers)` would then be least, ties to the earlier node; `None` when no node can take another.
fn greedy(mut counts: Vec<usize>, n: usize, time: impl Fn(usize, usize) -> Option<f64>) -> Option<Vec<usize>> {
    for _ in counts.iter().sum::<usize>()..n {
        let (best, _) = (0..counts.len())
            .filter_map(|i| Some((i, time(i, counts[i] + 1)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))?;
        counts[best] += 1;
    }
    Some(counts)
}

/// The most layers each room can hold, offloading if it can (for the error when the model does not fit).
pub(super) fn most_layers(room: &Room, n: usize) -> usize {
    let mut c = room.resident_cap().min(n);
    while c < n && room.resident_of(c + 1).is_some() {
        c += 1;
    }
    c
}

/// Splits `n` items proportionally to `weights` without exceeding `caps` (largest remainder, water-filling
/// over the capped ones). Requires `sum(caps) >= n`.
pub(super) fn apportion(n: usize, weights: &[f64], caps: &[usize]) -> Vec<usize> {
    let k = weights.len();
    let mut counts = vec![0usize; k];
    let mut fixed = vec![false; k];
    let mut left = n;
    loop {
        let open: Vec<usize> = (0..k).filter(|&i| !fixed[i]).collect();
        let total: f64 = open.iter().map(|&i| weights[i]).sum();
        if open.is_empty() || left == 0 || total <= 0.0 {
            break;
        }
        let ideal: Vec<(usize, f64)> = open.iter().map(|&i| (i, left as f64 * weights[i] / total)).collect();
        let over: Vec<usize> = ideal.iter().filter(|(i, x)| *x >= caps[*i] as f64).map(|(i, _)| *i).collect();
        if !over.is_empty() {
            for i in over {
                counts[i] = caps[i];
                fixed[i] = true;
                left -= caps[i];
            }
            continue;
        }
        let mut given = 0;
        for &(i, x) in &ideal {
            counts[i] = x.floor() as usize;
            given += counts[i];
        }
        let mut order: Vec<(usize, f64)> = ideal.iter().map(|&(i, x)| (i, x - x.floor())).collect();
        // Largest remainder first; ties go to the earlier node so equal nodes stay in a stable order.
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut rest = left.saturating_sub(given);
        for (i, _) in order {
            if rest == 0 {
                break;
            }
            if counts[i] < caps[i] {
                counts[i] += 1;
                rest -= 1;
            }
        }
        left = rest;
        break;
    }
    // Floating-point slack: hand any remainder to whoever has room, in order.
    for i in 0..k {
        let room = caps[i] - counts[i];
        let give = room.min(left);
        counts[i] += give;
        left -= give;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(memory: u64, seconds: f64, offload_seconds: f64) -> Room {
        Room { memory, fixed: 50, layer_bytes: 100, kv_bytes: 10, seconds, offload_seconds, fixed_seconds: 0.0 }
    }

    #[test]
    fn offloaded_layers_keep_their_kv_and_two_slots_in_memory() {
        let r = room(600, 1.0, 4.0);
        // (600 - 50) / 110: 5 resident.
        assert_eq!(r.resident_cap(), 5);
        assert_eq!(r.resident_of(5), Some(5));
        // 6 layers: 600 - 50 - 60 KV - 200 slots = 290 -> 2 resident, 4 offloaded.
        assert_eq!(r.resident_of(6), Some(2));
        assert_eq!(r.stage_seconds(6), Some(2.0 + 4.0 * 4.0));
        // KV and the slots fill the memory at 35 layers: 50 + 350 + 200 = 600, none resident; 36 do not fit.
        assert_eq!(r.resident_of(35), Some(0));
        assert_eq!(r.resident_of(36), None);
        assert_eq!(most_layers(&r, 100), 35);
        // A node that cannot offload holds its resident layers only.
        assert_eq!(room(600, 1.0, 0.0).resident_of(6), None);
        assert_eq!(most_layers(&room(600, 1.0, 0.0), 100), 5);
    }

    #[test]
    fn layers_go_where_the_slowest_stage_gains_least() -> Result<(), String> {
        // Two equal nodes of 5 resident layers each, 12 layers: one offloaded layer each.
        let equal = [room(600, 1.0, 4.0), room(600, 1.0, 4.0)];
        assert_eq!(offload_shares(12, &equal).ok_or("fits")?, [6, 6]);
        // A node whose offloaded layers are cheap takes them; the other stays resident.
        let cheap = [room(600, 1.0, 20.0), room(600, 1.0, 1.5)];
        let counts = offload_shares(12, &cheap).ok_or("fits")?;
        assert_eq!(counts.iter().sum::<usize>(), 12);
        assert!(counts[1] > counts[0], "{counts:?}");
        // Without offload on either, 12 layers do not fit in 10 resident places.
        assert_eq!(offload_shares(12, &[room(600, 1.0, 0.0), room(600, 1.0, 0.0)]), None);
        Ok(())
    }

    #[test]
    fn apportion_follows_weights_within_caps() {
        assert_eq!(apportion(12, &[1.0, 2.0], &[12, 12]), [4, 8]);
        assert_eq!(apportion(10, &[100.0, 1.0], &[2, 10]), [2, 8]);
        assert_eq!(layers_fitting(270, 50, 110), 2);
        assert_eq!(layers_fitting(40, 50, 110), 0);
        assert_eq!(layers_fitting(40, 0, 0), usize::MAX);
    }
}
