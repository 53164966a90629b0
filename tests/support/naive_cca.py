"""Deliberately naive CCA attention: one query, one head at a time, straight from CCA-SPEC.md.

Written independently of ``kernels/cca_reference.py`` (loops, no shared helpers) so that the
vectorised reference can be checked against it.
"""

import math

import torch


def _rope_at(x, cos, sin, b, pos):
    c = cos[b, pos] if cos.dim() == 3 else cos[pos]
    s = sin[b, pos] if sin.dim() == 3 else sin[pos]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[half:], x[:half]))
    return x * c + rotated * s


def naive_cca_attention(q, k, v, cos, sin, group_size, local_window, pooling="kv", scale=None):
    q, k, v, cos, sin = (t.double() for t in (q, k, v, cos, sin))
    bsz, n_heads, seq_len, head_dim = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    g, s = group_size, local_window
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(bsz):
        for h in range(n_heads):
            j = h // rep
            for t in range(seq_len):
                n_vis = max(0, (t + 1 - s) // g)
                q_t = _rope_at(q[b, h, t], cos, sin, b, t)
                logits, values = [], []
                for p in range(n_vis):
                    last = p * g + g - 1
                    heads = [h] if pooling == "query" else [j * rep + i for i in range(rep)]
                    a = torch.zeros(g, dtype=q.dtype)
                    for hh in heads:
                        q_last = _rope_at(q[b, hh, last], cos, sin, b, last)
                        for i in range(g):
                            a[i] += scale * torch.dot(q_last, _rope_at(k[b, j, p * g + i], cos, sin, b, p * g + i))
                    w = torch.softmax(a / len(heads), dim=0)
                    k_pool = sum(w[i] * k[b, j, p * g + i] for i in range(g))
                    v_pool = sum(w[i] * v[b, j, p * g + i] for i in range(g))
                    k_core = _rope_at(k_pool, cos, sin, b, p * g + g // 2)
                    logits.append(scale * torch.dot(q_t, k_core))
                    values.append(v_pool)
                for tau in range(n_vis * g, t + 1):
                    logits.append(scale * torch.dot(q_t, _rope_at(k[b, j, tau], cos, sin, b, tau)))
                    values.append(v[b, j, tau])
                probs = torch.softmax(torch.stack(logits), dim=0)
                out[b, h, t] = sum(p_i * v_i for p_i, v_i in zip(probs, values))
    return out
