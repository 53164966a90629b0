"""Compressed KV cache for CCA decoding (CCA-SPEC.md, "Decoding with a cache").

Per layer, for a batch of ``B`` sequences where sequence ``b`` has seen ``T_b`` real tokens:

- ``core_k, core_v`` (B, C, P_cap, d): the core tokens of its ``T_b // g`` complete groups, each pooled
  once when the group's last token is processed (``C = Hkv`` for pooling ``kv``, ``H`` for ``query``).
  ``core_k`` is RoPE-rotated at the group's middle position.
- ``win_k, win_v`` (B, Hkv, W, d), ``W = s + g - 1``: rotated keys and values of the last ``W`` positions,
  a ring buffer indexed by ``position % W``. A query at ``t`` sees raw ``[n(t)*g, t]``, at most ``s+g-1``
  positions, all inside the ring; the ring also always holds the group just completed (``W >= g``).
- ``grp_k`` (B, Hkv, g, d): pre-RoPE keys of the last ``g`` positions (ring, ``position % g``): pooling
  combines pre-RoPE keys and rotates the result at the group middle.
- ``mid_cos, mid_sin`` (B, 1, d): rotary tables of the current group's middle position.

Speculative decoding (``activate_past_recording``, which ``generate()`` calls for assisted and prompt-lookup
decoding, before the prefill, and for a deferred stopping check after it: a filled layer then re-lays its rings): the
rings keep ``SPECULATIVE_SLACK`` more positions (``W + slack``, ``g + slack``) and
the middles' tables of ``slack // g + 2`` groups (slot ``group % M``). A rejected draft token then overwrites only
slots that no later query reads, so dropping up to ``slack`` columns (``crop``) just counts them out of ``seen``, in
place: nothing is copied per step, nothing re-run, and captured steps stay valid. Passes of up to ``slack`` tokens run
on the decode kernels, each token with the numbers of its one-token step (a verification pass: what ``decode_graph.py``
captures).

Memory per layer and sequence: ``(T/g)*C*2 + (s+g-1)*Hkv*2 + g*Hkv`` vectors of ``d`` values, against
``2*T*Hkv`` for a full cache (``cache_bytes`` below computes it).

Padding: each sequence keeps its own count ``T_b`` (a tensor), so sequences of different lengths share
the tensors above without realignment: core slot ``p`` is group ``p`` of that sequence, ring slots are
indexed by that sequence's own positions. Pad columns (``attention_mask == 0``) are never written,
never pooled and never keys. ``get_seq_length()`` counts columns, pads included, as ``generate()`` expects.

The first call of a layer (prefill) runs the ordinary no-cache attention (Triton on CUDA) and keeps only
the compressed state; later calls run the decode kernels (one token), or pool the groups a chunk completes into the
core tokens and attend over those and ``[ring ++ chunk]`` (chunked prefill: the prefill's forward kernel with its
rows at the chunk's positions on the Triton path, ``cca_chunk_attention_reference`` otherwise). On the Triton path the
groups that start inside a chunk are pooled by the prefill's pooling kernel, each row from its first group border in
the chunk (so they are one pass's core tokens, bit for bit); a group that began before the chunk is pooled in torch
from the ring. A chunk on a group border in every row (no padding mask so far) has no such group.

A one-token step on the Triton path writes only in place into these tensors and reads positions from ``seen``, so
``decode_graph.py`` can replay it from a CUDA graph while they stay the same objects (``state_version``: assigning
one numbers it anew); the host-side counters (``cols``, ``max_seen``) are advanced outside the replay (``advance``).
"""

import itertools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .attention_cca import cca_attention, left_padding, shift_rows
from .attention_hooks import BatchOpsMixin, crop_length
from ..kernels.cca_reference import apply_rope, cca_chunk_attention_reference, pool_core_tokens, unapply_rope

try:
    from ..kernels.cca_decode_triton import cca_decode_append_triton, cca_decode_attention_triton
    from ..kernels.cca_pool_triton import pool_forward
    from ..kernels.cca_triton import cca_chunk_attention_triton
except ImportError:  # triton is optional
    cca_decode_append_triton = cca_decode_attention_triton = cca_chunk_attention_triton = pool_forward = None

CORE_SLACK = 64  # core slots added when the core buffer grows during decoding
GRAPH_RESERVE = 4096  # tokens of core capacity reserved at a time for captured decode steps (which cannot grow it)
ROLLBACK = 256  # columns of its last forward pass a cache can drop again (speculative / prompt-lookup decoding)
SPECULATIVE_SLACK = 32  # extra ring positions while transformers records the past: columns crop() drops in place
_VERSIONS = itertools.count(1)  # one number per state assignment, never reused: a state's version names it exactly


def _slot_positions(last: torch.Tensor, size: int) -> torch.Tensor:
    """(B, size): the position each slot of a ring of ``size`` slots (slot ``position % size``) holds, for rows whose
    latest position is ``last`` (B,): the latest position <= ``last`` with that slot."""
    last = last[:, None]
    return last - torch.remainder(last - torch.arange(size, device=last.device), size)


def cca_decode_attention_torch(q, core_k, core_v, n_core, win_k, win_v, pos, win_lo, scale):
    """One query per sequence over its visible core tokens and raw ring slots (twin of the Triton kernel).

    ``q`` (B, H, d) rotated; ``core_k/v`` (B, C, P, d) with ``C`` = Hkv or H; ``n_core`` (B,) core tokens
    visible; ``win_k/v`` (B, Hkv, W, d) ring indexed by position % W; ``pos`` (B,) the query position
    (already written to the ring); raw slots holding positions ``>= win_lo`` (B,) are visible.
    Returns (B, H, d) in ``q.dtype``; softmax in fp32.
    """
    bsz, n_heads, head_dim = q.shape
    n_kv, window = win_k.shape[1], win_k.shape[2]
    rep = n_heads // n_kv
    qf = q.float().view(bsz, n_kv, rep, head_dim)
    if core_k.shape[1] == n_kv:
        core_s = torch.einsum("bjrd,bjpd->bjrp", qf, core_k.float())
    else:
        core_s = torch.einsum("bhd,bhpd->bhp", q.float(), core_k.float()).view(bsz, n_kv, rep, -1)
    slot_pos = _slot_positions(pos, window)
    core_ok = torch.arange(core_k.shape[2], device=q.device)[None] < n_core[:, None]
    raw_ok = slot_pos >= win_lo[:, None]
    scores = torch.cat(
        (
            (core_s * scale).masked_fill(~core_ok[:, None, None], float("-inf")),
            (torch.einsum("bjrd,bjwd->bjrw", qf, win_k.float()) * scale).masked_fill(~raw_ok[:, None, None], float("-inf")),
        ),
        dim=-1,
    )
    probs = scores.softmax(-1)
    n_core_slots = core_k.shape[2]
    pc, pw = probs[..., :n_core_slots], probs[..., n_core_slots:]
    if core_k.shape[1] == n_kv:
        out = torch.einsum("bjrp,bjpd->bjrd", pc, core_v.float())
    else:
        out = torch.einsum("bhp,bhpd->bhd", pc.reshape(bsz, n_heads, -1), core_v.float()).view(bsz, n_kv, rep, -1)
    out = out + torch.einsum("bjrw,bjwd->bjrd", pw, win_v.float())
    return out.reshape(bsz, n_heads, head_dim).to(q.dtype)


def _ring_gather(x: torch.Tensor, seen: torch.Tensor, size: int, start: int = 0) -> torch.Tensor:
    """Ring of ``size`` slots holding the last ``size`` positions of rows that have seen ``seen_b`` tokens, slot
    ``position % size`` (as the decode steps index it), from ``x[:, :, i]`` = position ``start + i``."""
    src = (_slot_positions(seen - 1, size) - start).clamp(0, x.shape[2] - 1)  # (B, size)
    return x.gather(2, src[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _reringed(ring: torch.Tensor, seen: torch.Tensor, size: int) -> torch.Tensor:
    """A ring of ``size`` >= its own slots holding the same last positions of rows that have seen ``seen_b`` tokens,
    slot ``position % size`` (the slots for positions older than the old ring's: stale values no query reads)."""
    return _rows(ring, torch.remainder(_slot_positions(seen - 1, size), ring.shape[2]), 2)


def _unit_last_stride(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` as the kernels index it (unit stride in its last dim); other strides, including a batch stride of 0, stay."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _rows(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` gathered per batch row along ``dim`` at indices ``idx`` (B, n)."""
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = idx.shape[1]
    expand = list(x.shape)
    expand[dim] = idx.shape[1]
    return x.gather(dim, idx.view(shape).expand(expand))


class CCALayerCache(BatchOpsMixin, CacheLayerMixin):
    """Compressed state of one attention layer (see the module docstring)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # the last forward pass only (up to ROLLBACK columns): see crop()
    supports_early_init = False
    force_triton = False  # tests: run the Triton decode kernels on CPU tensors (TRITON_INTERPRET=1)

    TENSORS = ("seen", "core_k", "core_v", "win_k", "win_v", "grp_k", "mid_cos", "mid_sin")
    _VERSIONED = frozenset(TENSORS + ("record_past",))

    def __setattr__(self, name, value):
        # A captured decode step (decode_graph.py) is valid while no state tensor was replaced: one comparison of
        # versions per step instead of one identity check per tensor.
        if name in self._VERSIONED:
            super().__setattr__("version", next(_VERSIONS))
        super().__setattr__(name, value)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.cols = 0  # columns processed, pads included (what generate() calls the sequence length)
        self.max_seen = 0  # host-side upper bound of max_b T_b (sizes buffers without a device sync)
        self.seen = None  # (B,) real tokens per sequence
        self.record_past = False  # transformers asks this of caches it may crop after a one-token step
        self._undo = None  # how to go back to the start of the last forward pass (see crop)
        self.slack = 0  # ring positions kept beyond the spec's window: columns crop() drops in place
        self._tail = []  # (columns, their attention-mask columns or None) of the last passes, >= slack columns
        self.all_real = True  # every pass so far came without a padding mask: every row has seen exactly ``cols``

    # --- transformers Cache layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("CCALayerCache stores pooled state; attention goes through CCACache.cca_attention")

    def get_seq_length(self) -> int:
        return self.cols

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cols + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _tensors(self):
        return self.TENSORS

    def reset(self):
        for name in self._tensors():
            setattr(self, name, None)
        self.cols = self.max_seen = self.slack = 0
        self._tail = []
        self.all_real = True

    def _map(self, fn):
        if self.seen is not None:
            for name in self._tensors():
                setattr(self, name, fn(getattr(self, name)))

    def offload(self):
        self._map(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        pass

    def activate_past_recording(self, **kwargs):
        """Crops of up to ``SPECULATIVE_SLACK`` columns of what comes next are done in place from now on: a filled
        layer re-lays its rings with the slack (generate()'s deferred stopping check announces its crops after the
        prefill). The visible positions, and so the decode kernel's numbers, stay the same. ``kwargs``: what newer
        transformers pass for recurrent layers (5.25: ``recurrent_states_to_keep``); a CCA layer keeps no such state."""
        self.record_past = True
        if self.seen is not None and not self.slack:
            slack, g = SPECULATIVE_SLACK, self.config.group_size
            self.win_k, self.win_v, self.grp_k = (_reringed(x, self.seen, x.shape[2] + slack)
                                                  for x in (self.win_k, self.win_v, self.grp_k))
            # one middle was kept (the current group's, or the last one's until it is reached): every slot gets it,
            # and a later group's slot is written at its middle before the group is pooled
            self.mid_cos, self.mid_sin = (x.expand(-1, slack // g + 2, -1).clone() for x in (self.mid_cos, self.mid_sin))
            self.slack, self._tail = slack, []

    def _state(self, clone: bool) -> dict:
        names = ("seen", "win_k", "win_v", "grp_k", "mid_cos", "mid_sin", "core_k", "core_v")
        state = {n: getattr(self, n).clone() if clone and n not in ("core_k", "core_v") else getattr(self, n)
                 for n in names}
        state.update(cols=self.cols, max_seen=self.max_seen)
        return state

    def _note(self, n: int, mask):
        """Remember the last passes' columns (and their mask columns) that an in-place crop may count out."""
        if self.slack:
            tail = self._tail
            tail.append((n, mask))
            total = sum(cols for cols, _ in tail)
            while total - tail[0][0] >= self.slack:
                total -= tail.pop(0)[0]

    def dropped_in_place(self, keep: int):
        """The real tokens per row (an int where every dropped column is real, else a (B,) tensor) that an in-place
        crop to ``keep`` columns counts out of ``seen``, and the fewest of them (an int: one sync where the columns
        have a mask); None where the crop cannot be done in place."""
        drop = self.cols - keep
        if not 0 < drop <= self.slack or sum(n for n, _ in self._tail) < drop:
            return None
        count, need = 0, drop
        for n, mask in reversed(self._tail):
            take = min(n, need)
            count = count + (take if mask is None else (mask[:, n - take:] != 0).sum(-1))
            need -= take
            if not need:
                return count, count if isinstance(count, int) else int(count.min())
        return None

    def crop(self, tokens_to_remove: int, dropped=None):
        """Drop the last columns again (rejected draft tokens): ``-n`` drops ``n``, 0 is a no-op (transformers >=
        5.18), a positive value is the length to keep (older versions).

        With the speculative slack (see the module docstring), up to ``slack`` columns are counted out of ``seen`` in
        place (``dropped``: ``dropped_in_place``'s counts, computed once for all layers by ``CCACache.crop``).
        Otherwise pooled groups cannot be un-pooled, so this goes back at most to the start of the last forward pass
        (the verification pass of assisted or prompt-lookup decoding), at most ROLLBACK columns: it restores the state
        from before that pass and re-runs the pass's kept columns. Either way the state is exactly that of a run that
        never saw the dropped columns."""
        keep = crop_length(self.cols, tokens_to_remove)
        if keep == self.cols:
            return
        dropped = self.dropped_in_place(keep) if dropped is None else dropped
        if dropped is not None:
            (count, fewest), drop = dropped, self.cols - keep
            self.seen.sub_(count)  # (in place: a captured step reads it)
            self.cols = keep
            self.max_seen -= fewest  # (still an upper bound of every row's count)
            while drop:  # forget the dropped columns' masks
                n, mask = self._tail.pop()
                if n > drop:
                    self._tail.append((n - drop, None if mask is None else mask[:, : n - drop]))
                drop = max(0, drop - n)
            self._undo = None
            return
        undo = self._undo
        if undo is None or keep < undo["cols"]:
            raise RuntimeError(  # as transformers' sliding-window layers refuse a crop they cannot undo
                f"a CCA cache can drop only columns of its last forward pass (at most {ROLLBACK}, and after a "
                "one-token step only once transformers called activate_past_recording): pooled groups cannot be "
                f"un-pooled. Asked to keep {keep} of {self.cols} columns; the last pass started at "
                f"{undo['cols'] if undo else 'an unknown column'}")
        self._undo = None
        if "tail" in undo:  # the prefill: its pooled groups stay, its rings are rebuilt from the kept prompt tail
            self._rings_from(*undo["tail"], self.seen - (self.cols - keep), keep, self.slack)
            self._tail = []
            return
        for name, value in undo["state"].items():
            setattr(self, name, value)
        n = keep - undo["cols"]
        if n:
            q, k, v, cos, sin, mask, scale, given_rotated = undo["inputs"]
            mask = None if mask is None else mask[:, :n]
            q, k, v, cos, sin = (None if x is None else x[..., :n, :] for x in (q, k, v, cos, sin))
            if n == 1 and q is not None:
                self._decode(q, k, v, cos, sin, mask, scale)
            else:  # several columns, or one of a pass whose q came rotated only: as a chunk (the same state)
                self._extend(q, k, v, cos, sin, mask, scale, *(x[..., :n, :] for x in given_rotated or (None, None)))
            self._undo = None

    def nbytes(self) -> int:
        """Bytes held by this layer's state tensors."""
        if self.seen is None:
            return 0
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._tensors())

    # --- attention -------------------------------------------------------------------------------
    def decodes_rotated(self, q) -> bool:
        """Whether this one-token step can take transformers' post-RoPE q/k as they are (the Triton decode kernels
        undo RoPE themselves where pooling needs pre-RoPE keys: no un-rotation kernels per layer)."""
        return self.seen is not None and self._token_steps(q)

    def _token_steps(self, q) -> bool:
        """Whether this pass runs the decode kernels, each token as its one-token step: one token, or a verification
        pass within the speculative slack (a crop of it is done in place)."""
        return (q.shape[2] == 1 or q.shape[2] <= self.slack) and self._on_kernels(q)

    def attend(self, q, k, v, cos, sin, attention_mask, scale, rotated=False, given_rotated=None):
        """CCA attention of the new tokens (pre-RoPE q/k; ``rotated``: post-RoPE, where ``decodes_rotated``; ``"eager"``:
        pre-RoPE there, rotated by the decode kernel as the family's eager RoPE rounds) against the cached state;
        updates the state. ``given_rotated``: for a prompt or a chunk of several tokens that is not a decode pass,
        (q_rot, k_rot) as the model's RoPE gave them, used as given (``q`` may then be None, and ``k`` too: the
        pre-RoPE keys the state keeps are then ``unapply_rope(k_rot)``)."""
        n = v.shape[2]
        mask = attention_mask[:, -n:] if attention_mask is not None and attention_mask.dim() == 2 else None
        one = n == 1
        token_steps = self.seen is not None and self._token_steps(v)
        if given_rotated is not None and self.seen is not None and (one or token_steps or rotated):
            raise ValueError("given_rotated is for a prompt or a chunk of several tokens, not a decode pass")
        self.all_real = self.all_real and mask is None  # (transformers passes None where no column is a pad)
        if mask is not None and not token_steps:
            mask = mask.bool()  # (the decode kernels read any 0/1 dtype: no conversion launch in a captured step)
        if self.seen is None:
            return self._prefill(q, k, v, cos, sin, mask, scale, *(given_rotated or (None, None)))
        cos, sin = cos.expand(v.shape[0], -1, -1), sin.expand(v.shape[0], -1, -1)  # (B, q_len, d)
        # what crop() needs to undo this pass, unless it can drop it in place (the slack): the state before it (a
        # one-token step writes in place: copies, only when transformers announced a crop; a longer pass replaces the
        # rings: references) and its inputs
        rollback = n > self.slack and n <= ROLLBACK and (self.record_past or not one)
        undo = {"cols": self.cols, "state": self._state(clone=one)} if rollback else None
        if rotated or one or token_steps:
            out = self._decode(q, k, v, cos, sin, mask, scale, rotated=rotated)
        else:
            out = self._extend(q, k, v, cos, sin, mask, scale, *(given_rotated or (None, None)))
        if undo is not None:  # (a one-token pass is never re-run: crop keeps none or all of it)
            undo["inputs"] = (q, k, v, cos, sin, mask, scale, given_rotated)
        self._undo = undo
        self._note(n, mask)
        return out

    def uses_decode_kernels(self, head_dim: int) -> bool:
        """Whether one-token steps run the Triton decode kernels (in-place writes only: what a CUDA graph can replay)."""
        cfg = self.config
        return (cca_decode_attention_triton is not None and cfg.attn_backend in ("auto", "triton")
                and head_dim >= 16 and head_dim & (head_dim - 1) == 0)

    def _on_kernels(self, q) -> bool:
        return self.uses_decode_kernels(q.shape[-1]) and (q.is_cuda or self.force_triton)

    def reserve(self, steps: int, group_size: int | None = None):
        """Core capacity for the next ``steps`` one-token steps; when short, GRAPH_RESERVE more tokens' worth at once
        (growing replaces the core tensors, which invalidates captured steps)."""
        g = group_size or self.config.group_size
        if self.core_k.shape[2] < (self.max_seen + steps) // g + 1:
            self._grow_core((self.max_seen + steps + GRAPH_RESERVE) // g + 1)

    def _grow_core(self, needed: int):
        have = self.core_k.shape[2]
        if have < needed:
            pad = needed + CORE_SLACK - have
            z = self.core_k.new_zeros(self.core_k.shape[0], self.core_k.shape[1], pad, self.core_k.shape[3])
            self.core_k, self.core_v = torch.cat((self.core_k, z), 2), torch.cat((self.core_v, z), 2)

    def _prefill(self, q, k, v, cos, sin, mask, scale, q_rot=None, k_rot=None):
        cfg = self.config
        bsz, _, seq_len, _ = v.shape
        slack = SPECULATIVE_SLACK if self.record_past else 0
        window = cfg.local_window + cfg.group_size - 1 + slack
        cos, sin = cos.expand(bsz, -1, -1), sin.expand(bsz, -1, -1)
        n_pad = left_padding(mask)
        if n_pad is not None:  # real tokens first, as in the no-cache path
            q, k, v, q_rot, k_rot = (None if x is None else shift_rows(x, n_pad, 2) for x in (q, k, v, q_rot, k_rot))
            cos, sin = (shift_rows(x, n_pad, 1) for x in (cos, sin))
        out, self.core_k, self.core_v = cca_attention(q, k, v, cos, sin, cfg, scale, return_core=True, q_rot=q_rot,
                                                      k_rot=k_rot)
        if n_pad is not None:
            out = shift_rows(out, seq_len - n_pad, 2)

        seen = mask.sum(-1) if mask is not None else torch.full((bsz,), seq_len, device=v.device)
        # crop() may drop up to ROLLBACK columns of this pass: keep the prompt's tail (real tokens first) that the
        # rings would then be rebuilt from
        start = max(0, (int(seen.min()) if mask is not None else seq_len) - window - ROLLBACK)  # one sync
        # copies, not views: a view would keep the layer's whole prompt k/v alive until the next pass
        cos, sin = cos[:, start:].clone(), sin[:, start:].clone()
        k_rot = None if k_rot is None else k_rot[:, :, start:].clone()
        k = unapply_rope(k_rot, cos, sin).to(v.dtype) if k is None else k[:, :, start:].clone()
        tail = (k, v[:, :, start:].clone(), cos, sin, start, k_rot)
        self._tail = []
        self._rings_from(*tail, seen, seq_len, slack)
        self._undo = {"cols": max(0, seq_len - ROLLBACK), "tail": tail}
        self._note(seq_len, mask)
        return out

    def _rings_from(self, k, v, cos, sin, start, k_rot, seen, cols, slack):
        """The rings and group-middle tables of rows that have seen ``seen`` real tokens (real tokens first),
        from their keys/values/tables at columns ``start ..`` (``k_rot``: the keys as the model rotated them, or None);
        ``slack``: the speculative slack (module docstring)."""
        g = self.config.group_size
        window, n_mid = self.config.local_window + g - 1 + slack, slack // g + 2 if slack else 1
        if k_rot is not None:  # the keys the prompt attended to, as they are (a chunk's ring update keeps those too)
            self.win_k = _ring_gather(k_rot, seen, window, start).to(v.dtype)
        else:  # only the window's keys are kept rotated: rotate those rows, not the whole prompt again
            cos_w, sin_w = (_ring_gather(x[:, None], seen, window, start) for x in (cos, sin))
            self.win_k = apply_rope(_ring_gather(k, seen, window, start), cos_w, sin_w)
        self.win_v = _ring_gather(v, seen, window, start)
        self.grp_k = _ring_gather(k, seen, g + slack, start)
        # the middles of the current group and the n_mid - 1 before it (those not seen yet: overwritten when seen)
        group = (seen // g)[:, None] - (n_mid - 1) + torch.arange(n_mid, device=seen.device)  # (B, n_mid)
        mid = (group * g + g // 2 - start).clamp(0, cos.shape[1] - 1)
        slot = (group % n_mid)[..., None].expand(-1, -1, cos.shape[-1])
        self.mid_cos, self.mid_sin = (x.new_empty(x.shape[0], n_mid, x.shape[-1]).scatter_(1, slot, _rows(x, mid, 1))
                                      for x in (cos, sin))
        self.seen, self.cols, self.max_seen, self.slack = seen, cols, cols, slack

    def _decode(self, q, k, v, cos, sin, mask, scale, rotated=False):
        cfg = self.config
        g, s, pooling = cfg.group_size, cfg.local_window, cfg.pooling
        bsz, _, _, head_dim = q.shape
        window = self.win_k.shape[2]
        t = self.seen  # position of the new token, per sequence
        n = q.shape[2]
        if self._on_kernels(q):
            # two launches per layer, all writes in place (a CUDA graph can replay the step: decode_graph.py). A
            # verification pass appends its tokens one after another (the speculative slack keeps every key its
            # tokens see in the ring), then attends once: each token's numbers are those of its one-token step.
            self._grow_core((self.max_seen + n) // g + 1)
            q_rot = cca_decode_append_triton(q, k, v, cos, sin, mask, t, self.win_k, self.win_v, self.grp_k,
                                             self.mid_cos, self.mid_sin, self.core_k, self.core_v, g, scale,
                                             rotated=rotated)  # (B, n, H, d)
            # the attention also counts the pass's real tokens into ``seen`` in place: where the next step reads
            out = cca_decode_attention_triton(q_rot, self.core_k, self.core_v, None, self.win_k, self.win_v, t, None,
                                              scale, group_size=g, local_window=s,
                                              advance=True if mask is None else mask)
            self.cols += n
            self.max_seen += n
            return out.transpose(1, 2)
        if rotated:
            raise RuntimeError("post-RoPE q/k reach CCA's decode only on the Triton path (see decodes_rotated)")
        if n != 1:
            raise RuntimeError("several tokens reach the PyTorch decode step only through _extend")
        real = mask[:, 0] if mask is not None else torch.ones_like(t, dtype=torch.bool)
        q_rot, k_rot = apply_rope(q, cos, sin)[:, :, 0], apply_rope(k, cos, sin)[:, :, 0]
        rows = torch.arange(bsz, device=q.device)

        def put(buf, slot, val):  # buf[b, :, slot_b] = val[b] where the token is real
            buf[rows, :, slot] = torch.where(real[:, None, None], val, buf[rows, :, slot])

        gw, mid = self.grp_k.shape[2], (t // g) % self.mid_cos.shape[1]  # ring sizes: see the speculative slack
        put(self.win_k, t % window, k_rot)
        put(self.win_v, t % window, v[:, :, 0])
        put(self.grp_k, t % gw, k[:, :, 0])
        is_mid = (real & (t % g == g // 2))[:, None]
        self.mid_cos[rows, mid] = torch.where(is_mid, cos[:, 0], self.mid_cos[rows, mid])
        self.mid_sin[rows, mid] = torch.where(is_mid, sin[:, 0], self.mid_sin[rows, mid])

        n_core = torch.div(t + 1 - s, g, rounding_mode="floor").clamp_min(0)
        win_k, win_v = self.win_k, self.win_v
        if window > s + g - 1:  # the speculative slack: the spec's ring of s + g - 1 slots, so the step rounds alike
            win_k, win_v = (_reringed(x, t + 1, s + g - 1) for x in (win_k, win_v))
        out = cca_decode_attention_torch(q_rot, self.core_k, self.core_v, n_core, win_k, win_v, t, n_core * g, scale)
        out = torch.where(real[:, None, None], out, torch.zeros_like(out))[:, :, None]

        # Pool the group ending at t (for every row; only rows whose group completed keep the result:
        # the others write an unused slot past their core count).
        grp = t[:, None] - (g - 1) + torch.arange(g, device=q.device)  # (B, g) positions t-g+1 .. t
        k_rot_g = _rows(self.win_k, grp % window, 2)
        v_g = _rows(self.win_v, grp % window, 2)
        k_g = _rows(self.grp_k, grp % gw, 2)
        cos_g = self.mid_cos[rows, mid][:, None].expand(-1, g, -1)
        sin_g = self.mid_sin[rows, mid][:, None].expand(-1, g, -1)
        q_g = q_rot[:, :, None].expand(-1, -1, g, -1)
        ck, cv = pool_core_tokens(q_g, k_rot_g, k_g, v_g, cos_g, sin_g, g, pooling, scale)  # (B, C, 1, d)
        self._grow_core(self.max_seen // g + 1)
        slot = t // g
        self.core_k[rows, :, slot] = ck[:, :, 0]
        self.core_v[rows, :, slot] = cv[:, :, 0]

        self.seen.add_(real.to(t.dtype))
        self.cols += 1
        self.max_seen += 1
        return out

    def _pool_across(self, q_rot, k_rot, k, v, cos, sin, T, scale):
        """The core tokens of the groups that complete inside a chunk whose rows start at ``T`` (any offset in a
        group; real tokens first): each row's sequence from the start of its current group, i.e. the g-1 positions
        before the chunk (from the rings) ++ the chunk. (B, C, (g - 1 + q_len) // g, d); row b's first
        (T_b % g + n_new_b) // g are real."""
        g, pooling = self.config.group_size, self.config.pooling
        bsz, n_heads, q_len, head_dim = q_rot.shape
        window, dev = self.win_k.shape[2], v.device
        # fp32, as the kernels pool a prompt's un-rotated keys (a bf16 copy would round the chunk's core tokens
        # otherwise than one pass does); the group ring keeps them in the cache's dtype
        k = unapply_rope(k_rot, cos, sin) if k is None else k
        old = T[:, None] - (g - 1) + torch.arange(g - 1, device=dev)  # (B, g-1)
        gw, n_mid, rows = self.grp_k.shape[2], self.mid_cos.shape[1], torch.arange(bsz, device=dev)
        k_rot_x = torch.cat((_rows(self.win_k, old % window, 2), k_rot), 2)
        v_x = torch.cat((_rows(self.win_v, old % window, 2), v), 2)
        k_x = torch.cat((_rows(self.grp_k, old % gw, 2).to(k.dtype), k), 2)
        cur = (T // g) % n_mid  # the current group's middle tables
        cos_x = torch.cat((self.mid_cos[rows, cur][:, None].expand(-1, g - 1, -1), cos), 1)
        sin_x = torch.cat((self.mid_sin[rows, cur][:, None].expand(-1, g - 1, -1), sin), 1)
        ext = g - 1 + q_len
        align = (torch.arange(ext, device=dev)[None] + (g - 1) - (T % g)[:, None]).clamp(max=ext - 1)
        # pooling reads only each group's last query (always a chunk column): gather those rows, not the chunk's q
        q_al = q_rot.new_zeros(bsz, n_heads, ext, head_dim)
        q_al[:, :, g - 1 :: g] = _rows(q_rot, align[:, g - 1 :: g] - (g - 1), 2)
        return pool_core_tokens(q_al, _rows(k_rot_x, align, 2), _rows(k_x, align, 2), _rows(v_x, align, 2),
                                _rows(cos_x, align, 1), _rows(sin_x, align, 1), g, pooling, scale)

    def _store_core(self, ck, cv, first):
        """Core tokens (B, C, n, d) of row b at its slots ``first_b ..``."""
        self._grow_core(self.max_seen // self.config.group_size + 1 + ck.shape[2])  # (first_b <= max_seen // g + 1)
        dest = (first[:, None] + torch.arange(ck.shape[2], device=ck.device))[:, None, :, None]
        self.core_k.scatter_(2, dest.expand(-1, ck.shape[1], -1, ck.shape[3]), ck)
        self.core_v.scatter_(2, dest.expand(-1, cv.shape[1], -1, cv.shape[3]), cv)

    def _extend(self, q, k, v, cos, sin, mask, scale, q_rot=None, k_rot=None):
        """A chunk of several tokens after a prefill: exact, from the compressed state (no full-length state kept).
        ``q_rot``/``k_rot``: q and k as the model's RoPE rotated them, used as given (``q`` may then be None)."""
        cfg = self.config
        g, s, pooling = cfg.group_size, cfg.local_window, cfg.pooling
        bsz, n_heads, q_len, head_dim = (q if q_rot is None else q_rot).shape
        window = self.win_k.shape[2]
        dev, dtype = v.device, v.dtype
        if mask is not None:  # real tokens of the chunk first (left padding: they are its suffix)
            lead = (~mask).long().cumprod(-1).sum(-1)
            n_new = mask.sum(-1)
            idx = (torch.arange(q_len, device=dev)[None] + lead[:, None]) % q_len
            q, k, v, q_rot, k_rot = (None if x is None else _rows(x, idx, 2) for x in (q, k, v, q_rot, k_rot))
            cos, sin = _rows(cos, idx, 1), _rows(sin, idx, 1)
        else:
            lead, n_new = None, torch.full((bsz,), q_len, device=dev)
        T = self.seen
        col = torch.arange(q_len, device=dev)
        pos = T[:, None] + col  # (B, q_len) positions of the (aligned) chunk columns
        real = col[None] < n_new[:, None]
        q_rot = apply_rope(q, cos, sin) if q_rot is None else q_rot
        k_rot = apply_rope(k, cos, sin) if k_rot is None else k_rot
        kernel = cca_chunk_attention_triton is not None and cfg.attn_backend in ("auto", "triton") and (
            v.is_cuda or self.force_triton) and head_dim % 2 == 0 and head_dim <= 256 and not (
            torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, q_rot, k_rot)))

        # 1. Pool the groups that complete inside the chunk, and 2. store them: the attention reads every core token a
        #    query sees from the cache (row b's new groups land at its own slots; slots past its complete groups hold
        #    values no query reads, until overwritten).
        if kernel:
            # The groups that start inside the chunk are its own: the prefill's pooling kernel pools them straight from
            # the chunk's q_rot/k_rot/v (k None: from k_rot, un-rotated in registers), no gathered copies. Chunks on a
            # group border in every row (known on the host while no pass had a padding mask) are all such groups:
            # their core tokens are one pass's, bit for bit. Otherwise the group a row's chunk finishes (it began
            # before the chunk) is pooled in torch from the ring, and the kernel starts each row at its next border.
            on_border = self.all_real and self.cols % g == 0
            if not on_border and g > 1:
                m = min(q_len, g - 1)  # the columns that may finish a row's current group
                edge = self._pool_across(q_rot[:, :, :m], k_rot[:, :, :m], None if k is None else k[:, :, :m],
                                         v[:, :, :m], cos[:, :m], sin[:, :m], T, scale)
                self._store_core(*edge, T // g)  # one group (m < g); on a border the kernel's group overwrites it
            start = None if on_border else torch.remainder(-T, g).to(torch.int32)
            new_ck, new_cv = pool_forward(*map(_unit_last_stride, (q_rot, k_rot, k, v, cos, sin)), g, pooling, scale,
                                          start=start)
            self._store_core(new_ck, new_cv, torch.div(T + g - 1, g, rounding_mode="floor"))
        else:
            new_ck, new_cv = self._pool_across(q_rot, k_rot, k, v, cos, sin, T, scale)
            self._store_core(new_ck, new_cv, T // g)

        # 3. Attention: one softmax over the core tokens and the raw keys [the ring's last s + g - 1 positions (all
        #    that the chunk may see raw, in position order: the same keys with the speculative slack as without) ++
        #    the chunk].
        n_ring = s + g - 1
        ring = torch.remainder(T[:, None] - n_ring + torch.arange(n_ring, device=dev), window)
        k_raw = torch.cat((_rows(self.win_k, ring, 2).to(dtype), k_rot.to(dtype)), 2)
        v_raw = torch.cat((_rows(self.win_v, ring, 2).to(dtype), v), 2)
        attend = cca_chunk_attention_triton if kernel else cca_chunk_attention_reference  # (the kernel: forward only)
        out = attend(q_rot.to(dtype), k_raw, v_raw, self.core_k.to(dtype), self.core_v.to(dtype), T, n_ring, g, s,
                     scale)
        if lead is not None:  # back to the caller's column order; pad columns give zeros
            out = torch.where(real[:, None, :, None], out, torch.zeros_like(out))
            out = _rows(out, (col[None] - lead[:, None]) % q_len, 2)

        # 4. Update the rings and middles.
        T_new = T + n_new
        gw, n_mid = self.grp_k.shape[2], self.mid_cos.shape[1]
        for name, size, src in (("win_k", window, k_rot), ("win_v", window, v), ("grp_k", gw, k)):
            ring = getattr(self, name)
            slot_pos = _slot_positions(T_new - 1, size)
            from_chunk = (slot_pos >= T[:, None])[:, None, :, None]
            cols = (slot_pos - T[:, None]).clamp(0, q_len - 1)
            if src is None:  # the pre-RoPE keys of the ring's columns only: un-rotated from k_rot (fp32, as pooled)
                fresh = unapply_rope(_rows(k_rot, cols, 2), _rows(cos, cols, 1), _rows(sin, cols, 1))
            else:
                fresh = _rows(src, cols, 2)
            setattr(self, name, torch.where(from_chunk, fresh.to(ring.dtype), ring))
        # each ring slot of middle tables: the newest middle of the chunk's groups that map to it, if any
        is_mid = real & (pos % g == g // 2)
        mids = [torch.where(is_mid & ((pos // g) % n_mid == m), col, -1).amax(-1) for m in range(n_mid)]
        last_mid = torch.stack(mids, 1)  # (B, n_mid) chunk columns, -1: none
        has_mid = (last_mid >= 0)[..., None]
        self.mid_cos = torch.where(has_mid, _rows(cos, last_mid.clamp_min(0), 1), self.mid_cos)
        self.mid_sin = torch.where(has_mid, _rows(sin, last_mid.clamp_min(0), 1), self.mid_sin)
        self.seen = T_new
        self.cols += q_len
        self.max_seen += q_len
        return out


class CCACache(Cache):
    """Per-layer compressed CCA state (see the module docstring). Reads ``group_size``, ``local_window``
    and ``pooling`` from the model's config, so load-time overrides apply."""

    step_real = None  # (B, 1): the real-token column of a decode step being captured (decode_graph.py), else None

    stop_check_option = "cca_defer_stop_checks"  # (decode_graph.defer_stop_checks)

    def __init__(self, config, **kwargs):
        super().__init__(layers=[CCALayerCache(config) for _ in range(config.num_hidden_layers)])
        self.config = config

    def cca_attention(self, layer_idx, q, k, v, cos, sin, attention_mask, scale, rotated=False, given_rotated=None):
        """CCA attention of ``q`` (B, H, q_len, d) (pre-RoPE, like ``k``; ``rotated``: post-RoPE, where
        ``decodes_rotated``; ``given_rotated``: see ``CCALayerCache.attend``) for layer ``layer_idx``."""
        if attention_mask is None and self.step_real is not None:  # a captured step reads its pad column on device
            attention_mask = self.step_real
        return self.layers[layer_idx].attend(q, k, v, cos, sin, attention_mask, scale, rotated, given_rotated)

    def prompts(self, layer_idx) -> bool:
        """Whether the next pass of layer ``layer_idx`` is its first (a prompt, not a chunk or step after one)."""
        return self.layers[layer_idx].seen is None

    def decodes_rotated(self, layer_idx, q) -> bool:
        layer = self.layers[layer_idx]
        return isinstance(layer, CCALayerCache) and layer.decodes_rotated(q)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def crop(self, tokens_to_remove: int):
        """Every layer's ``crop``; an in-place crop's count of dropped real tokens is computed once, for all."""
        first = next((x for x in self.layers if isinstance(x, CCALayerCache) and x.seen is not None), None)
        dropped = None if first is None else first.dropped_in_place(crop_length(first.cols, tokens_to_remove))
        for layer in self.layers:
            if isinstance(layer, CCALayerCache):
                layer.crop(tokens_to_remove, dropped)
            else:
                layer.crop(tokens_to_remove)

    def token_steps(self) -> int:
        """The most tokens a pass may hold to run on the decode kernels (1, or the speculative slack): what a
        captured step may hold."""
        first = next((x for x in self.layers if isinstance(x, CCALayerCache)), None)
        return max(1, first.slack) if first is not None else 1

    # --- what a CUDA-graph decode step (decode_graph.py) needs ----------------------------------------------------
    def graphable(self, head_dim: int) -> bool:
        """Whether a one-token step may be replayed from a CUDA graph: every layer is a filled CCA layer on the
        Triton decode path and no crop was announced, or crops are done in place (the speculative slack; else assisted
        decoding keeps per-step undo copies). Checked when a step is captured; replays check ``state_version``
        (``record_past`` is versioned like the tensors)."""
        return (all(isinstance(layer, CCALayerCache) and layer.seen is not None and layer.seen.is_cuda
                    and (layer.slack or not layer.record_past) for layer in self.layers)
                and bool(self.layers) and self.layers[0].uses_decode_kernels(head_dim))

    def graph_step_allowed(self, real, extended=False) -> bool:
        return True  # (pad columns in a step are read on the device: any mask replays)

    def reserve(self, steps: int):
        """Core capacity in every layer for the next ``steps`` one-token steps (a captured step cannot grow it)."""
        group_size = self.config.group_size
        for layer in self.layers:
            layer.reserve(steps, group_size)

    def state_version(self) -> tuple:
        """Names the state tensors' objects: it changes whenever a layer replaces one (a captured decode step reads
        and writes fixed addresses, so it is valid exactly while this stays the same)."""
        return tuple(getattr(layer, "version", None) for layer in self.layers)

    def replay_limit(self) -> int:
        """The largest first-layer ``max_seen`` at which a one-token step still fits every layer's core capacity."""
        g, first = self.config.group_size, self.layers[0].max_seen
        return min(layer.core_k.shape[2] * g - 1 - (layer.max_seen - first) for layer in self.layers)

    def host_counters(self) -> list:
        return [(layer.cols, layer.max_seen, layer._undo, list(layer._tail)) for layer in self.layers]

    def set_host_counters(self, counters: list):
        for layer, (cols, max_seen, undo, tail) in zip(self.layers, counters):
            layer.cols, layer.max_seen, layer._undo, layer._tail = cols, max_seen, undo, tail

    def advance(self, tokens: int, real=None):
        """What a replayed step of ``tokens`` columns (``real``: their mask columns, or None) does on the host: count
        them."""
        for layer in self.layers:
            counters = layer.__dict__  # host counters only: past the versioning __setattr__ (32 layers, every step)
            counters["cols"] += tokens
            counters["max_seen"] += tokens
            counters["_undo"] = None
            if counters["slack"]:
                layer._note(tokens, real)

    @staticmethod
    def prepare(config, past_key_values):
        """The cache a forward with ``use_cache`` should use: the given one, or a fresh one. An empty
        non-CCA cache (``generate()`` creates a DynamicCache) is replaced by a CCACache for CCA backends."""
        if config.attn_backend == "full":
            return DynamicCache(config=config) if past_key_values is None else past_key_values
        if past_key_values is None or (not isinstance(past_key_values, CCACache) and past_key_values.get_seq_length() == 0):
            return CCACache(config)
        if not isinstance(past_key_values, CCACache):
            raise TypeError(f"CCA attention needs a CCACache, got a non-empty {type(past_key_values).__name__}")
        return past_key_values


def cache_bytes(seq_len, num_layers, n_heads, n_kv, head_dim, group_size, local_window, pooling="kv", dtype_bytes=2, batch=1):
    """Analytic bytes of a CCA cache at ``seq_len`` tokens, and of transformers' full DynamicCache."""
    core_heads = n_heads if pooling == "query" else n_kv
    per_layer = (
        2 * (seq_len // group_size) * core_heads * head_dim  # core K, V
        + 2 * (local_window + group_size - 1) * n_kv * head_dim  # ring of raw K~, V
        + group_size * n_kv * head_dim  # pre-RoPE keys of the current group
        + 2 * head_dim  # rotary tables of the group middle
    ) * dtype_bytes + 8  # per-sequence count
    full = 2 * seq_len * n_kv * head_dim * dtype_bytes
    return batch * num_layers * per_layer, batch * num_layers * full
