// Document ids (HAS_DOCS).

// Document ids (HAS_DOCS): query i of batch b sees key j only if their documents are equal.
// The ids are auxiliary words from p.m.doc_q ([B, L]) and p.m.doc_k ([B, S]); the (min, max)
// of each block of DOC_BLOCK queries and keys follow (p.m.doc_qb, p.m.doc_kb), for skipping
// key tiles that hold none of a query tile's documents.
const DOC_BLOCK: u32 = 16u;

fn docs_allow(b: u32, i: u32, j: u32) -> bool {
    let qd = aux_word(p.m.doc_q + b * p.m.doc_l + min(i, p.m.doc_l - 1u));
    let kd = aux_word(p.m.doc_k + b * p.s + min(j, p.s - 1u));
    return qd == kd;
}

// The (min, max) document id of rows [a, e) (a < e <= n) of batch b's n ids, from the block
// pairs at word `off`: of the blocks covering the rows, so a superset's range.
fn doc_span(off: u32, n: u32, b: u32, a: u32, e: u32) -> vec2<i32> {
    let nb = (n + DOC_BLOCK - 1u) / DOC_BLOCK;
    var lo = bitcast<i32>(0x7fffffffu);
    var hi = bitcast<i32>(0x80000000u);
    for (var t = a / DOC_BLOCK; t <= (e - 1u) / DOC_BLOCK; t++) {
        let w = off + (b * nb + t) * 2u;
        lo = min(lo, bitcast<i32>(aux_word(w)));
        hi = max(hi, bitcast<i32>(aux_word(w + 1u)));
    }
    return vec2<i32>(lo, hi);
}

// The document range of query rows [i0, i1) of batch b (clamped into L; HAS_DOCS).
fn query_docs(b: u32, i0: u32, i1: u32) -> vec2<i32> {
    let e = min(i1, p.m.doc_l);
    return doc_span(p.m.doc_qb, p.m.doc_l, b, min(i0, e - 1u), e);
}

// Whether keys [j0, j0 + n) of batch b may hold a document in range `qd` (HAS_DOCS; true
// without document ids).
fn key_docs_meet(b: u32, j0: u32, n: u32, qd: vec2<i32>) -> bool {
    if (!HAS_DOCS || j0 >= p.s) {
        return true;
    }
    let kd = doc_span(p.m.doc_kb, p.s, b, j0, min(j0 + n, p.s));
    return kd.x <= qd.y && qd.x <= kd.y;
}
