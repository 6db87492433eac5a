// Grouped-query attention's head mapping, and the query-tile prologue of the fused forward and
// the dQ kernel (every form). Needs the kernel's params `p` (heads, group, l) and
// common/masks.wgsl's key_end and key_begin.

// The K/V head that query head `h` of batch `b` reads: query heads share K/V heads in groups
// of `p.group` consecutive heads (1: multi-head attention).
fn kv_head(b: u32, h: u32) -> u32 {
    return b * (p.heads / p.group) + h / p.group;
}

// Query head `hh` (0 .. p.group) of K/V head `hk`'s group, within its batch.
fn group_head(hk: u32, hh: u32) -> u32 {
    return hk * p.group + hh;
}

// A query tile's workgroup: its tile, (batch, head) row `bh`, batch, head and K/V head.
struct QueryTile {
    qt: u32,
    bh: u32,
    b: u32,
    h: u32,
    kvh: u32,
}

// Workgroup `wid` of `tiles` query tiles per (batch, head). The heaviest tiles (the last,
// under a causal mask) go first: better balance at the end.
fn query_tile(wid: u32, tiles: u32) -> QueryTile {
    let qt = tiles - 1u - wid % tiles;
    let bh = wid / tiles;
    let b = bh / p.heads;
    let h = bh % p.heads;
    return QueryTile(qt, bh, b, h, kv_head(b, h));
}

var<workgroup> wg_end: u32;
var<workgroup> wg_begin: u32;

// Keys [x, y) that can matter to some row of the `rows` query rows from `i0` of batch `b`:
// later key tiles are skipped whole, and keys before x (past the sink tokens) are outside
// every row's window. The same for every invocation; call it in uniform control flow.
fn tile_keys(b: u32, i0: u32, rows: u32, tid: u32) -> vec2<u32> {
    if (tid == 0u) {
        wg_end = key_end(b, min(i0 + rows, p.l) - 1u);
        wg_begin = key_begin(b, min(i0, p.l - 1u));
    }
    return vec2<u32>(workgroupUniformLoad(&wg_begin), workgroupUniformLoad(&wg_end));
}
