"""Rankings over the experts of one layer inside a Triton program, by pairwise comparison: the device side of
`routing.kernels._rank_groups`, `keep_groups` and `_victim`'s order, shared by the device cache
(`device_cache`) and block selection on the device (`device_select`).

A vector over E (BLOCK_E lanes, the lanes past E masked) is ranked in one reduction: rank[i] = the number of
experts j ahead of i, from a [BLOCK_E, RANK_J] comparison tile summed over j, RANK_J experts j at a time
(RANK_J = BLOCK_E: one tile; smaller: the j chunks are gathered from the vector, so that a large E need not hold
a [BLOCK_E, BLOCK_E] tile). "Ahead" is a strict lexicographic order on a key (a, b, c) compared with float64
`>` and `==` as the host compares (+0 == -0, so a tie; the keys hold no NaN), so the top COUNT are the experts
of rank < COUNT, the host's insertion ranking exactly.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

if triton is not None:

    @triton.jit
    def _pick_int(vec, idx, i):
        """vec[i] of an integer vector."""
        return tl.sum(tl.where(idx == i, vec, 0), axis=0)

    @triton.jit
    def _best(score, raw, avail, idx, BLOCK_E: tl.constexpr):
        """The expert ranking first among `avail` by (score, then raw, then lower index): `kernels._ahead`."""
        best = tl.max(tl.where(avail, score, float("-inf")), axis=0)
        tie = avail & (score == best)
        best_raw = tl.max(tl.where(tie, raw, float("-inf")), axis=0)
        return tl.min(tl.where(tie & (raw == best_raw), idx, BLOCK_E), axis=0)

    @triton.jit
    def _chunk(vec, lo, BLOCK_E: tl.constexpr, RANK_J: tl.constexpr):
        """vec[lo : lo + RANK_J] as a vector (the whole vector where RANK_J = BLOCK_E)."""
        if RANK_J == BLOCK_E:
            out = vec
        else:
            out = tl.gather(vec, lo + tl.arange(0, RANK_J), 0)
        return out

    @triton.jit
    def _count_ahead(a, b, c, avail, BLOCK_E: tl.constexpr, RANK_J: tl.constexpr):
        """n[i] = the number of j with avail[j] whose key (a[j], b[j], c[j]) is lexicographically greater than
        i's (a, b float64, c integer): one reduction over j."""
        n = tl.zeros([BLOCK_E], tl.int32)
        live = avail.to(tl.int32)
        for lo in tl.static_range(0, BLOCK_E, RANK_J):
            aj = _chunk(a, lo, BLOCK_E, RANK_J)[None, :]
            bj = _chunk(b, lo, BLOCK_E, RANK_J)[None, :]
            cj = _chunk(c, lo, BLOCK_E, RANK_J)[None, :]
            vj = _chunk(live, lo, BLOCK_E, RANK_J)[None, :] != 0
            ai, bi, ci = a[:, None], b[:, None], c[:, None]
            ahead = (aj > ai) | ((aj == ai) & ((bj > bi) | ((bj == bi) & (cj > ci))))
            n += tl.sum((ahead & vj).to(tl.int32), axis=1)
        return n

    @triton.jit
    def _match(key, keys, payload, avail, BLOCK_E: tl.constexpr, RANK_J: tl.constexpr):
        """out[i] = payload[j] of the j with avail[j] and keys[j] == key[i] (at most one such j; payload >= 0),
        -1 where there is none: one reduction over j."""
        out = tl.full([BLOCK_E], -1, tl.int32)
        live = avail.to(tl.int32)
        for lo in tl.static_range(0, BLOCK_E, RANK_J):
            kj = _chunk(keys, lo, BLOCK_E, RANK_J)[None, :]
            pj = _chunk(payload, lo, BLOCK_E, RANK_J)[None, :]
            vj = _chunk(live, lo, BLOCK_E, RANK_J)[None, :] != 0
            out = tl.maximum(out, tl.max(tl.where(vj & (kj == key[:, None]), pj, -1), axis=1))
        return out

    @triton.jit
    def _kept(score, valid, idx, E: tl.constexpr, BLOCK_E: tl.constexpr, N_GROUP: tl.constexpr,
              TOPK_GROUP: tl.constexpr, RANK_J: tl.constexpr):
        """The experts of the TOPK_GROUP best groups (`kernels.keep_groups`): a group of E // N_GROUP consecutive
        experts scores the sum of its two best scores; groups rank by that score, ties to the lower group. Where E
        and N_GROUP are powers of two, by a tile of groups (`_kept_blocked`), otherwise over pairs of experts."""
        if (E == BLOCK_E) and (N_GROUP & (N_GROUP - 1) == 0):
            keep = _kept_blocked(score, idx, E, N_GROUP, TOPK_GROUP)
        else:
            keep = _kept_pairs(score, valid, idx, E, BLOCK_E, N_GROUP, TOPK_GROUP, RANK_J)
        return keep

    @triton.jit
    def _kept_blocked(score, idx, E: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
        """`_kept` where E and N_GROUP are powers of two: the experts as an [N_GROUP, E // N_GROUP] tile, each group
        ranked inside itself ([N_GROUP, size, size] comparisons) and the groups among themselves."""
        size: tl.constexpr = E // N_GROUP
        s2 = tl.reshape(score, [N_GROUP, size])
        i2 = tl.reshape(idx, [N_GROUP, size])
        si, sj, ii, ij = s2[:, :, None], s2[:, None, :], i2[:, :, None], i2[:, None, :]
        place = tl.sum(((sj > si) | ((sj == si) & (ij < ii))).to(tl.int32), axis=2)
        gs = tl.sum(tl.where(place < 2, s2, 0.0), axis=1)  # best + second best, and exact zeros
        if size < 2:
            gs = tl.full([N_GROUP], float("-inf"), tl.float64)  # the host's best2 stays -inf
        g = tl.arange(0, N_GROUP)
        ahead = (gs[None, :] > gs[:, None]) | ((gs[None, :] == gs[:, None]) & (g[None, :] < g[:, None]))
        kept = (tl.sum(ahead.to(tl.int32), axis=1) < TOPK_GROUP).to(tl.int32)
        return tl.reshape(tl.broadcast_to(kept[:, None], [N_GROUP, size]), [E]) != 0

    @triton.jit
    def _kept_pairs(score, valid, idx, E: tl.constexpr, BLOCK_E: tl.constexpr, N_GROUP: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, RANK_J: tl.constexpr):
        """`_kept` for any E and N_GROUP, by pairwise comparison over all experts."""
        size = E // N_GROUP
        member = valid & (idx < N_GROUP * size)
        grp = tl.where(member, idx // size, N_GROUP)
        # the place of each expert in its group by (score, lower index): the experts of higher groups come first
        place = _count_ahead(grp.to(tl.float64), score, -idx, member, BLOCK_E, RANK_J) - (N_GROUP - 1 - grp) * size
        top2 = member & (place < 2)
        # the group's score (best + second best: two terms, the rest adds exact zeros) at each of its experts
        gs = tl.zeros([BLOCK_E], tl.float64)
        top2_i = top2.to(tl.int32)
        for lo in tl.static_range(0, BLOCK_E, RANK_J):
            gj = _chunk(grp, lo, BLOCK_E, RANK_J)[None, :]
            sj = _chunk(score, lo, BLOCK_E, RANK_J)[None, :]
            tj = _chunk(top2_i, lo, BLOCK_E, RANK_J)[None, :] != 0
            gs += tl.sum(tl.where(tj & (gj == grp[:, None]), sj, 0.0), axis=1)
        if E // N_GROUP < 2:
            gs = tl.full([BLOCK_E], float("-inf"), tl.float64)  # the host's best2 stays -inf
        # groups ahead of each expert's group: by score, then lower group (one representative per group)
        ahead = _count_ahead(gs, -grp.to(tl.float64), tl.zeros_like(idx), member & (place == 0), BLOCK_E, RANK_J)
        return member & (ahead < TOPK_GROUP)

    @triton.jit
    def _rank(score, raw, valid, idx, COUNT: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
              N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, RANK_J: tl.constexpr):
        """`kernels._rank_groups`: rank[e] = the position (0 .. COUNT-1) of expert e among the COUNT best by
        (score, raw, -index) inside the kept groups, then the others by (raw, -index); -1 past COUNT and outside
        valid."""
        if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
            score = tl.where(_kept(score, valid, idx, E, BLOCK_E, N_GROUP, TOPK_GROUP, RANK_J), score,
                             float("-inf"))
        n = _count_ahead(score, raw, -idx, valid, BLOCK_E, RANK_J)
        return tl.where(valid & (n < COUNT), n, -1)


def rank_chunk(block_e: int) -> int:
    """The default RANK_J of a ranking over BLOCK_E lanes: one [BLOCK_E, BLOCK_E] tile up to 256 lanes, chunks of
    256 beyond. Compiled for sm_90 (ptxas -v, not run), the cache step at E = 256 spilled a few KB with whole
    tiles and about 90 KB with gathered chunks of 64 or 128."""
    return min(block_e, 256)
