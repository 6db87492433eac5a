// The sliding window (HAS_WINDOW, with its sink tokens): which keys a row sees, and the key
// tiles worth visiting.

// The sliding window's diagonal of batch `b`: query i is aligned with key i + window_offset(b)
// (S - L; with key lengths, the batch's length - L).
fn window_offset(b: u32) -> i32 {
    if (p.m.has_lens != 0u) {
        return p.m.win_off + i32(kv_len(b));
    }
    return p.m.win_off;
}

// Whether the sliding window (HAS_WINDOW) lets query `i` of batch `b` see key `j`: within
// [c - left, c + right] around its diagonal c (a side -1: unbounded), or a sink token.
fn window_allows(b: u32, i: u32, j: u32) -> bool {
    let c = i32(i) + window_offset(b);
    let jj = i32(j);
    let inside = (p.m.win_left < 0 || jj >= c - p.m.win_left) && (p.m.win_right < 0 || jj <= c + p.m.win_right);
    return inside || j < p.m.win_sinks;
}

// The first key the window's left side lets query row `i` of batch `b` see (0 without one); the
// sink tokens before it stay visible. Grows with i: a tile of rows takes its first row's.
fn key_begin(b: u32, i: u32) -> u32 {
    if (!HAS_WINDOW || p.m.win_left < 0) {
        return 0u;
    }
    return u32(clamp(i32(i) + window_offset(b) - p.m.win_left, 0, i32(p.s)));
}

// The first key worth visiting at or after key `j` for query row `i` of batch `b`: past the
// sink tokens, keys before the window's first are skipped (j itself otherwise).
fn first_key(b: u32, i: u32, j: u32) -> u32 {
    if (HAS_WINDOW && j >= p.m.win_sinks) {
        return max(j, key_begin(b, i));
    }
    return j;
}

// The key tile to visit at or after tile start `j` (tiles of `tile` keys, `begin` the rows'
// smallest key_begin): the tiles past the sink tokens and wholly before `begin` are skipped.
fn next_tile(j: u32, begin: u32, tile: u32) -> u32 {
    let bt = begin / tile * tile;
    return select(j, bt, HAS_WINDOW && j >= p.m.win_sinks && j < bt);
}
