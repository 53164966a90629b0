"""DCA's checks of its reference (``cca_convert/kernels/dca_reference.py``), which exported repos do not need: the spec's
per-query loop, the ChunkLlama/vLLM three-softmax merge, plain RoPE attention, and the spec's parameter resolution."""

import torch

from cca_convert.kernels.dca_params import check_params, default_sizes
from cca_convert.kernels.dca_reference import _batch_length, _scores, _visible, rope_at, temperature

QWEN_SPARSE_KEYS = ("sparse_attention_config", "sparse_attention_enabled", "sparse_attention_threshold",
                    "sparse_attention_last_q")  # vLLM's optional MInference prefill: out of scope, ignored



def resolve_params(dca_config: dict | None, trained_context: int) -> tuple[int, int, int]:
    """``(C, w, c_orig)`` from a ``dual_chunk_attention_config`` (used verbatim) or, without one, the ChunkLlama
    default ``C = 3c/4, w = c/8`` with the temperature off. ValueError for values the spec rejects."""
    if dca_config:
        chunk, local = dca_config.get("chunk_size"), dca_config.get("local_size")
        c_orig = dca_config.get("original_max_position_embeddings") or 0
    else:
        (chunk, local), c_orig = default_sizes(trained_context), 0
    check_params(chunk, local, trained_context)
    return chunk, local, c_orig


def dca_attention_naive(q, k, v, qpos, kpos, kvalid, qvalid, chunk_size, local_size, inv_freq, scale,
                        c_orig=0, attention_factor=1.0):
    """The spec's per-query loop, literally (small shapes only): every rotation, part and distance checked."""
    check_params(chunk_size, local_size)
    s = chunk_size - local_size
    bsz, n_heads, q_len, _ = q.shape
    rep = n_heads // k.shape[1]
    out = torch.zeros_like(q)
    lengths = _batch_length(kpos, kvalid)
    for b in range(bsz):
        t_mult = float(temperature(int(lengths[b]), c_orig))
        for h in range(n_heads):
            g = h // rep
            for t in range(q_len):
                if not qvalid[b, t]:
                    continue
                i = int(qpos[b, t])
                logits, vals = [], []
                for u in range(k.shape[2]):
                    if not kvalid[b, u] or int(kpos[b, u]) > i:
                        continue
                    j = int(kpos[b, u])
                    if i // s == j // s:
                        pq = i % s
                    elif i // s == j // s + 1:
                        pq = min(i % s + s, chunk_size)
                    else:
                        pq = min(2 * s - 1, chunk_size)
                    pk = j % s
                    assert 0 <= pq - pk <= chunk_size and pq <= chunk_size and pk <= s - 1
                    qi = rope_at(q[b, h, t][None], torch.tensor([pq]), inv_freq, attention_factor)[0]
                    kj = rope_at(k[b, g, u][None], torch.tensor([pk]), inv_freq, attention_factor)[0]
                    logits.append(scale * t_mult * torch.dot(qi.double(), kj.double()))
                    vals.append(v[b, g, u].double())
                p = torch.softmax(torch.stack(logits), 0)
                out[b, h, t] = (p[:, None] * torch.stack(vals)).sum(0).to(q.dtype)
    return out



def dca_attention_lse_merge(q, k, v, qpos, kpos, kvalid, qvalid, chunk_size, local_size, inv_freq, scale,
                            c_orig=0, attention_factor=1.0):
    """The ChunkLlama/vLLM formulation: a softmax per part (intra, succ, inter), merged by their log-sum-exps in
    fp32, not detached. Equal to ``dca_attention_reference`` (an empty part has LSE -inf and weight 0)."""
    scores, diff = _scores(q, k, qpos, kpos, chunk_size, local_size, inv_freq, scale, attention_factor)
    t_mult = temperature(_batch_length(kpos, kvalid), c_orig).to(scores.dtype)[:, None, None, None]
    visible = _visible(qpos, kpos, kvalid, qvalid)[:, None]
    scores = scores * t_mult
    rep = q.shape[1] // v.shape[1]
    vals = v.to(scores.dtype).repeat_interleave(rep, 1)
    outs, lses = [], []
    for part in (diff == 0, diff == 1, diff >= 2):
        s_p = scores.masked_fill(~(visible & part), float("-inf"))
        lse = torch.logsumexp(s_p, -1)  # -inf for an empty part
        probs = torch.nan_to_num(torch.exp(s_p - lse[..., None]), nan=0.0)
        outs.append(torch.einsum("bhqk,bhkd->bhqd", probs, vals))
        lses.append(lse)
    lse = torch.stack(lses)  # (3, B, H, Lq)
    weights = torch.nan_to_num(torch.softmax(lse, 0), nan=0.0)  # all-empty (pad) rows: 0
    out = sum(w[..., None] * o for w, o in zip(weights, outs))
    return out.to(q.dtype)


def plain_rope_attention(q, k, v, qpos, kpos, kvalid, qvalid, inv_freq, scale, attention_factor=1.0):
    """The base model's causal attention with RoPE at the true positions (what DCA degenerates to)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qr = rope_at(q, qpos[:, None].expand(-1, n_heads, -1), inv_freq, attention_factor).to(dtype)
    kr = rope_at(k, kpos[:, None].expand(-1, n_kv, -1), inv_freq, attention_factor).to(dtype)
    rep = n_heads // n_kv
    scores = torch.einsum("bhqd,bhkd->bhqk", qr, kr.repeat_interleave(rep, 1)) * scale
    scores = scores.masked_fill(~_visible(qpos, kpos, kvalid, qvalid)[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.to(dtype).repeat_interleave(rep, 1)).to(q.dtype)
