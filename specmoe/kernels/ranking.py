"""Rankings of experts on the device, the jit functions the cache step (`device_cache`) and the block selection
(`device_select`) share: `_order` (the position of each available expert in the order score, then raw score, then
lower index, up to a limit) and `_rank` (with DeepSeek-V3's group-limited choice, `_kept`), as the host's
`routing.kernels._ahead` and `_rank_groups` order them, ties included.

Up to PAIRWISE_MAX experts every rank is counted at once in one [E, E] comparison; past it a limit up to
ORDER_PICKS runs as picks in turn, and a larger one counts in [E, ORDER_TILE] tiles (docs/device-cache.md,
"Block selection on the device", has the three measured). A pick is a chain of reductions across the warps, as
few as the scores allow (`TIES`): three (best score, best raw score among the tied, lowest index among those)
where raw and score differ, two where the raw score is the score, one where the scores are also float32 values
(a softmax router's logits: one int64 key per expert, `_f32_key`).
"""

from __future__ import annotations

from specmoe.routing import RouterScoring

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

PAIRWISE_MAX = 64  # experts up to which `_order` compares every pair in one [E, E] tile (at E = 64 on one warp)
ORDER_PICKS = 24  # past PAIRWISE_MAX, the largest limit `_order` ranks by picks; above it, by tiles
ORDER_TILE = 8  # the width of `_order`'s [E, ORDER_TILE] tiles past PAIRWISE_MAX (a thread holds whole rows)
# what `_order`'s picks compare (the constexpr TIES; the order is the same): (score, raw, lower index); raw is the
# score: (score, lower index); and raw is the score and every score a float32 value (softmax logits): one int64 key
TIES_RAW, TIES_SCORE, TIES_F32 = 0, 1, 2


def score_ties(scoring: RouterScoring) -> int:
    """What `_order` may assume when it ranks a router's own selection scores (raw = score): TIES_F32 for a
    softmax router (the scores are its float32 logits), TIES_SCORE for a sigmoid one (sigmoid plus bias, in
    float64)."""
    return TIES_SCORE if scoring.kind == "sigmoid" else TIES_F32


if triton is not None:
    _PAIRWISE_MAX = tl.constexpr(PAIRWISE_MAX)
    _ORDER_TILE = tl.constexpr(ORDER_TILE)
    _ORDER_PICKS = tl.constexpr(ORDER_PICKS)
    _TIES_RAW = tl.constexpr(TIES_RAW)
    _TIES_SCORE = tl.constexpr(TIES_SCORE)
    _TIES_F32 = tl.constexpr(TIES_F32)
    _NO_KEY = tl.constexpr(-2 ** 63)  # below every `_f32_key`

    @triton.jit
    def _pick_int(vec, idx, i):
        """vec[i] of an integer vector."""
        return tl.sum(tl.where(idx == i, vec, 0), axis=0)

    @triton.jit
    def _ahead_count(score, raw, avail, idx, s_f, r_f, a_f, i_f):
        """For each expert e of the vectors, how many of the experts f (s_f, r_f, a_f, i_f: their scores, raws,
        availability, indices; any length) are available and rank ahead of e: higher score, then higher raw, then
        lower index (`kernels._ahead`; the order is total)."""
        s_e, r_e, i_e = score[:, None], raw[:, None], idx[:, None]
        s_f, r_f, i_f = s_f[None, :], r_f[None, :], i_f[None, :]
        ahead = (s_f > s_e) | ((s_f == s_e) & ((r_f > r_e) | ((r_f == r_e) & (i_f < i_e))))
        return tl.sum((ahead & a_f[None, :]).to(tl.int32), axis=1)

    @triton.jit
    def _best(score, raw, avail, idx, BLOCK_E: tl.constexpr):
        """The expert ranking first among `avail` by (score, then raw, then lower index): `kernels._ahead`."""
        best = tl.max(tl.where(avail, score, float("-inf")), axis=0)
        tie = avail & (score == best)
        best_raw = tl.max(tl.where(tie, raw, float("-inf")), axis=0)
        return tl.min(tl.where(tie & (raw == best_raw), idx, BLOCK_E), axis=0)

    @triton.jit
    def _f32_key(score, idx, BLOCK_E: tl.constexpr):
        """One int64 per expert, larger = earlier in the order (score, then lower index), for scores that are
        float32 values held as float64: the float32 bits made monotone in the high word (-0.0 read as +0.0, as the
        comparisons see it), BLOCK_E - 1 - index in the low word. Distinct experts have distinct keys."""
        bits = score.to(tl.float32).to(tl.int32, bitcast=True)
        bits = tl.where(score == 0.0, 0, bits)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - idx).to(tl.int64)

    @triton.jit
    def _order(score, raw, avail, idx, limit, BLOCK_E: tl.constexpr, TIES: tl.constexpr):
        """rank[e] = the position (0 .. limit-1) of expert e of `avail` in `_best`'s order (score, then raw, then
        lower index), -1 for the others and past `limit`. The order is total, so an expert's position is the number
        of available experts ahead of it: up to PAIRWISE_MAX experts every rank is counted at once in one [E, E]
        comparison. Past that, `limit` dependent picks, or, for a limit above ORDER_PICKS (a block's extra
        candidates), the counts in [E, ORDER_TILE] tiles, the other experts' values gathered a tile's width at a
        time: a fixed cost, more than a top-K's picks and less than the extra candidates' (docs/device-cache.md,
        "Block selection on the device", has the two measured). A pick is a chain of reductions crossing the
        warps: three (`_best`) for TIES_RAW, two where raw is the score (TIES_SCORE: its best, then the lowest
        index at it) and one where the scores are also float32 values (TIES_F32: the largest `_f32_key`). The
        ranks are the same whatever TIES says, as long as it holds."""
        if BLOCK_E <= _PAIRWISE_MAX:
            count = _ahead_count(score, raw, avail, idx, score, raw, avail, idx)
            rank = tl.where(avail & (count < limit), count, -1)
        elif limit > _ORDER_PICKS:
            count = tl.zeros([BLOCK_E], tl.int32)
            avail_int = avail.to(tl.int32)
            for c in range(0, BLOCK_E, _ORDER_TILE):
                f = c + tl.arange(0, _ORDER_TILE)
                count += _ahead_count(score, raw, avail, idx, tl.gather(score, f, 0), tl.gather(raw, f, 0),
                                      tl.gather(avail_int, f, 0) != 0, f)
            rank = tl.where(avail & (count < limit), count, -1)
        else:
            rank = tl.full([BLOCK_E], -1, tl.int32)
            key = _f32_key(score, idx, BLOCK_E)  # read by TIES_F32's picks only (the compiler drops it otherwise)
            for j in range(limit):
                rank = tl.where(_next(score, raw, key, avail & (rank < 0), idx, BLOCK_E, TIES), j, rank)
        return rank

    @triton.jit
    def _next(score, raw, key, open, idx, BLOCK_E: tl.constexpr, TIES: tl.constexpr):
        """The mask of `_order`'s next pick among `open` (no expert when `open` is empty), in as few reductions as
        TIES allows: the largest `_f32_key` (TIES_F32), the lowest index at the best score (TIES_SCORE), or
        `_best` (TIES_RAW)."""
        if TIES == _TIES_F32:
            picked = open & (key == tl.max(tl.where(open, key, _NO_KEY), axis=0))
        elif TIES == _TIES_SCORE:
            best = tl.max(tl.where(open, score, float("-inf")), axis=0)
            picked = idx == tl.min(tl.where(open & (score == best), idx, BLOCK_E), axis=0)
        else:
            picked = idx == _best(score, raw, open, idx, BLOCK_E)
        return picked

    @triton.jit
    def _kept(score, valid, idx, E: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
              BLOCK_G: tl.constexpr):
        """The experts of the TOPK_GROUP best groups (`kernels.keep_groups`): a group scores the sum of its two
        best scores, ties to the lower group."""
        size = E // N_GROUP
        groups = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_G], float("-inf"), tl.float64)
        for grp in tl.static_range(N_GROUP):
            member = valid & ((idx // size) == grp)
            best1 = tl.max(tl.where(member, score, float("-inf")), axis=0)
            first = tl.min(tl.where(member & (score == best1), idx, E), axis=0)
            best2 = tl.max(tl.where(member & (idx != first), score, float("-inf")), axis=0)
            group_score = tl.where(groups == grp, best1 + best2, group_score)
        kept = tl.zeros([BLOCK_G], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            open_score = tl.where((kept == 0) & (groups < N_GROUP), group_score, float("-inf"))
            best = tl.max(open_score, axis=0)
            pick = tl.min(tl.where((open_score == best) & (kept == 0) & (groups < N_GROUP), groups, BLOCK_G), axis=0)
            kept = tl.where(groups == pick, 1, kept)
        keep = idx < 0
        for grp in tl.static_range(N_GROUP):
            keep = keep | (((idx // size) == grp) & (tl.sum(tl.where(groups == grp, kept, 0), axis=0) > 0))
        return keep

    @triton.jit
    def _rank(score, raw, valid, idx, COUNT: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
              N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TIES: tl.constexpr):
        """`kernels._rank_groups`: rank[e] = the position (0 .. COUNT-1) of expert e among the COUNT best by
        (score, raw, -index) inside the kept groups, then the others by (raw, -index); -1 past COUNT. TIES: what
        `_order` may assume of score and raw as given (the kept groups' mask makes score differ from raw)."""
        if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
            score = tl.where(_kept(score, valid, idx, E, N_GROUP, TOPK_GROUP, BLOCK_G), score, float("-inf"))
            rank = _order(score, raw, valid, idx, COUNT, BLOCK_E, _TIES_RAW)
        else:
            rank = _order(score, raw, valid, idx, COUNT, BLOCK_E, TIES)
        return rank
