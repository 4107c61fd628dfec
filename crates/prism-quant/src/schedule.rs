//! Which CTA of the Hopper tile's persistent grid computes which share of which output tile
//! (`qgemm_wg_q8_0*` in `kernels/quant_gemm.cu`, launched by `cuda::matmul_with`). Plain arithmetic,
//! tested on the CPU: the kernel's `qw_job` is the same mapping as [`TileSchedule::job`].
//!
//! A *job* is one output tile's share of the contract's four parts over K: a whole tile (all four parts,
//! the CTA writes the outputs), or one of a tile's 2 or 4 split jobs (each writes its share of the part
//! tree, and the last to finish adds the shares in the contract's order). Whoever computes a part, its
//! runs are summed from +0 in order and the parts meet as (p0 + p1) + (p2 + p3): a schedule decides only
//! where and when, never the bits.

/// Jobs of a launch: the first `full` tiles whole, the rest split `splits` ways; CTA `b` of `ctas` takes
/// jobs `b`, `b + ctas`, `b + 2·ctas`, ….
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSchedule {
    /// CTAs launched (the grid).
    pub ctas: usize,
    /// Tiles computed whole, as jobs `0 .. full`.
    pub full: usize,
    /// How many jobs each of the other tiles is split into: 1, 2 or 4.
    pub splits: usize,
}

impl TileSchedule {
    /// The schedule for `tiles` output tiles on `sms` multiprocessors (one CTA each): whole tiles in
    /// rounds of `sms`, and the tiles left over after the last whole round split in quarters when those
    /// still fit one round (else whole), so no multiprocessor computes more than a round of whole tiles
    /// plus a quarter. With 136 tiles on 132 multiprocessors (the 27B's gate|up projection at 64 rows)
    /// that is 132 whole tiles and 4 tiles in 16 quarters; with 20 tiles (its 5,120-wide projections)
    /// 80 quarters. No halves: measured on an H200 (`docs/optimization-log.md`, 2026-12-04), the 65
    /// tiles of the DeltaNet input projection at 64 rows took 0.054 ms in 130 halves against 0.042 whole
    /// (a share's store and the join cost more than the second half of the multiprocessors gains).
    pub fn balanced(tiles: usize, sms: usize) -> Self {
        let sms = sms.max(1);
        let rounds = tiles / sms;
        let left = tiles - rounds * sms;
        let splits = if left > 0 && 4 * left <= sms { 4 } else { 1 };
        let ctas = if rounds == 0 { left * splits } else { sms };
        Self {
            ctas,
            full: rounds * sms,
            splits,
        }
    }

    /// Every tile split `splits` ways (1: whole), one CTA a job: the schedule of a plain grid, for the
    /// device checks and the benchmark's comparison.
    /// A plain grid, one CTA a job, for a GPU that holds `slots` CTAs at once: whole tiles for every
    /// full wave of `slots`, and the tiles left over split over K in 4 where they are a quarter of a
    /// wave or less (a short last wave instead of a few long jobs while most SMs idle), else whole.
    /// Measured on an H100 with the swapped tile (`docs/optimization-log.md`, 2026-12-07): the
    /// DeltaNet input projection's 258 tiles at 32 rows in 1,032 quarters took 0.056 ms against
    /// 0.049 whole; gate | up's 16 tiles past two waves in quarters gave 0.082 ms.
    pub fn waves(tiles: usize, slots: usize) -> Self {
        let slots = slots.max(1);
        let full = tiles / slots * slots;
        let left = tiles - full;
        let splits = if left > 0 && 4 * left <= slots { 4 } else { 1 };
        let jobs = full + (tiles - full) * splits;
        Self {
            ctas: jobs.max(1),
            full,
            splits,
        }
    }

    pub fn split(tiles: usize, splits: usize) -> Self {
        Self {
            ctas: tiles * splits,
            full: if splits == 1 { tiles } else { 0 },
            splits,
        }
    }

    /// Jobs over `tiles` tiles.
    pub fn jobs(&self, tiles: usize) -> usize {
        self.full + tiles.saturating_sub(self.full) * self.splits
    }

    /// Job `j`: `(tile, z, splits)` — the tile, which of its split jobs (0 for a whole tile) and into how
    /// many it is split (1 for a whole tile). `qw_job` in `kernels/quant_gemm.cu`.
    pub fn job(&self, j: usize) -> (usize, usize, usize) {
        if j < self.full {
            (j, 0, 1)
        } else {
            let rest = j - self.full;
            (
                self.full + rest / self.splits,
                rest % self.splits,
                self.splits,
            )
        }
    }

    /// The contract's parts (of four) that job share `z` of a tile split `splits` ways computes.
    pub fn parts(z: usize, splits: usize) -> std::ops::Range<usize> {
        z * 4 / splits..(z + 1) * 4 / splits
    }

    /// The most parts any CTA computes (the schedule's length in parts), over `tiles` tiles.
    pub fn longest(&self, tiles: usize) -> usize {
        let mut per_cta = vec![0usize; self.ctas.max(1)];
        for j in 0..self.jobs(tiles) {
            let (_, z, s) = self.job(j);
            per_cta[j % self.ctas.max(1)] += Self::parts(z, s).len();
        }
        per_cta.into_iter().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::TileSchedule;

    /// Every tile's four parts are computed exactly once, by jobs of one split count, and every job of
    /// the launch falls on a CTA of the grid.
    fn covers_every_part_once(s: &TileSchedule, tiles: usize) {
        let mut seen = vec![[0u8; 4]; tiles];
        let mut split_of = vec![0usize; tiles];
        for j in 0..s.jobs(tiles) {
            let (tile, z, splits) = s.job(j);
            assert!(tile < tiles, "{s:?}: job {j} is tile {tile} of {tiles}");
            assert!(z < splits && [1, 2, 4].contains(&splits), "{s:?}: job {j}");
            assert!(split_of[tile] == 0 || split_of[tile] == splits);
            split_of[tile] = splits;
            for p in TileSchedule::parts(z, splits) {
                seen[tile][p] += 1;
            }
        }
        assert!(
            seen.iter().all(|t| *t == [1; 4]),
            "{s:?} over {tiles} tiles"
        );
        assert!(s.ctas >= 1 && s.ctas <= s.jobs(tiles).max(1), "{s:?}");
    }

    #[test]
    fn balanced_schedules_cover_every_part_once() {
        for sms in [1, 3, 5, 7, 16, 132] {
            for tiles in 1..=3 * sms + 5 {
                let s = TileSchedule::balanced(tiles, sms);
                covers_every_part_once(&s, tiles);
                assert!(s.ctas <= sms, "{s:?}");
            }
        }
    }

    #[test]
    fn wave_schedules_cover_every_part_once() {
        for slots in [1, 3, 8, 264] {
            for tiles in 1..=2 * slots + 7 {
                let s = TileSchedule::waves(tiles, slots);
                covers_every_part_once(&s, tiles);
                assert_eq!(s.ctas, s.jobs(tiles), "{s:?}");
            }
        }
        // The 27B's down projection at a few dozen rows: 80 tiles of 64 outputs whole (more than a
        // quarter of a wave), and gate | up: two waves of whole tiles, the 16 left in quarters.
        assert_eq!(TileSchedule::waves(80, 264).jobs(80), 80);
        assert_eq!(TileSchedule::waves(60, 264).jobs(60), 240);
        let s = TileSchedule::waves(544, 264);
        assert_eq!((s.full, s.splits, s.jobs(544)), (528, 4, 592));
    }

    #[test]
    fn plain_grids_cover_every_part_once() {
        for tiles in 1..40 {
            for splits in [1, 2, 4] {
                let s = TileSchedule::split(tiles, splits);
                covers_every_part_once(&s, tiles);
                assert_eq!(s.ctas, s.jobs(tiles));
            }
        }
    }

    #[test]
    fn the_27b_products_at_64_rows() {
        // gate|up: 136 tiles of 64 × 256 on 132 SMs: a round of whole tiles, then 4 tiles in quarters.
        let s = TileSchedule::balanced(136, 132);
        assert_eq!(
            s,
            TileSchedule {
                ctas: 132,
                full: 132,
                splits: 4
            }
        );
        assert_eq!(s.longest(136), 5);
        assert_eq!(TileSchedule::split(136, 1).longest(136), 4); // but on 132 SMs: two rounds
                                                                 // ffn_down, the output projections: 20 tiles in quarters.
        assert_eq!(
            TileSchedule::balanced(20, 132),
            TileSchedule {
                ctas: 80,
                full: 0,
                splits: 4
            }
        );
        // The DeltaNet input projection (16,480 outputs): 65 whole tiles.
        let s = TileSchedule::balanced(65, 132);
        assert_eq!((s.ctas, s.full, s.splits), (65, 0, 1));
        assert_eq!(s.longest(65), 4);
        // Whole rounds only: no split.
        assert_eq!(TileSchedule::balanced(264, 132).splits, 1);
        // A leftover of more than half a round: whole tiles.
        assert_eq!(TileSchedule::balanced(132 + 100, 132).splits, 1);
    }
}
