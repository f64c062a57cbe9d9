"""Layer-skippable forward pass over a Hugging Face decoder-only model's own modules.

We do not fork modeling files or patch `forward`: we call the model's embedding, rotary
embedding, each decoder layer's norms / attention / MLP, the final norm and the lm_head from
outside, in the order the layer's own `forward` uses, and leave out the sublayers that the
`SkipSet` names (a skipped sublayer is the identity on the residual stream). Tests check that
with an empty skip set the logits equal the model's own `forward`.

Two layouts cover the supported families:
- pre-norm (Llama, Qwen2, Qwen3, Mistral):  h += attn(ln1(h));  h += mlp(ln2(h))
- sandwich (Gemma2/3): h += ln_post_attn(attn(ln1(h)));  h += ln_post_ff(mlp(ln_pre_ff(h)))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from spirit.model import attention
from spirit.model.attention import RowKeys
from spirit.model.exactness import Exactness, check_exactness
from spirit.model.fused import PassKeys, fused_decoder
from spirit.model.kv_cache import KVCache, PackedCaches
from spirit.model.lowbit import PackedLinear
from spirit.skipset import SkipSet


class UnsupportedModelError(ValueError):
    """The model's layout is not one the adapter knows how to drive."""


class Layout(Enum):
    PRE_NORM = "pre-norm"
    SANDWICH = "sandwich"


_PRE_NORM_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_SANDWICH_PARTS = _PRE_NORM_PARTS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class Segment:
    """One request's rows in a full-model pass: `input_ids` [q] in its cache's slots
    [start, start + q), at `positions` [q] (default the slots), seeing `visible` [q, start + q]
    (default causal by slot; token trees give their own)."""

    input_ids: torch.Tensor
    start: int
    cache: KVCache
    positions: torch.Tensor | None = None
    visible: torch.Tensor | None = None

    def slot_positions(self, device: torch.device) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        return torch.arange(self.start, self.start + len(self.input_ids), device=device)


def detect_layout(layer: nn.Module) -> Layout:
    if all(hasattr(layer, name) for name in _SANDWICH_PARTS):
        return Layout.SANDWICH
    if all(hasattr(layer, name) for name in _PRE_NORM_PARTS):
        return Layout.PRE_NORM
    missing = [n for n in _PRE_NORM_PARTS if not hasattr(layer, n)]
    raise UnsupportedModelError(
        f"decoder layer {type(layer).__name__} lacks {missing}: spirit drives layers with "
        "input_layernorm / self_attn / post_attention_layernorm / mlp (Llama, Qwen2/3, Mistral, Gemma)"
    )


class SkippableModel:
    """Wraps a `*ForCausalLM` and runs it with any skip set against a `KVCache`."""

    def __init__(self, causal_lm: nn.Module, exactness: Exactness | None = None) -> None:
        """`exactness`: what this machine's kernels guarantee for this model; measured here
        (model/exactness.py; 1.6-3 s for a 1.5b model once its per-shape results are kept) unless given."""
        base = getattr(causal_lm, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(causal_lm, "lm_head"):
            raise UnsupportedModelError(
                f"{type(causal_lm).__name__} does not have the standard decoder-only layout "
                "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head)"
            )
        self.hf_model = causal_lm
        self.config = causal_lm.config
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers[: self.config.num_hidden_layers])
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = causal_lm.lm_head
        self.layout = detect_layout(self.layers[0])
        self._rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self.layer_types: list[str] = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        )
        window = getattr(self.config, "sliding_window", None)
        self._windows: list[int | None] = [
            window if (t == "sliding_attention" or (not getattr(self.config, "layer_types", None) and window)) else None
            for t in self.layer_types
        ]
        self._softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        attn0 = self.layers[0].self_attn
        # transformers 5.x renamed the attention's cache argument; accept either spelling.
        attn_params = inspect.signature(attn0.forward).parameters
        self._cache_kw = "cache" if "cache" in attn_params else "past_key_values"
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=getattr(attn0, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads,
            hidden_size=self.config.hidden_size,
            vocab_size=self.lm_head.out_features,
            max_positions=getattr(self.config, "max_position_embeddings", 2048),
        )
        # Row-wise attention for exact passes is selected by name through transformers'
        # registry; without the adapter's `rows` keyword it is SDPA, so prefill, drafts and
        # transformers' own `generate` run as before.
        causal_lm.set_attn_implementation(attention.register())
        # a low-bit target's layers as a few calls into spirit's kernels (model/fused.py), where it can
        self.fused, self.fused_reason = fused_decoder(causal_lm, self.dtype)
        if self.fused is not None and isinstance(self.lm_head, PackedLinear):
            self.lm_head.keep_tile_panels()  # batched and verifying passes run it over many rows
        self.exactness = exactness if exactness is not None else check_exactness(self)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the embedding's, which stays unpacked in a low-bit target."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def head_rows(self) -> torch.Tensor:
        """The lm_head as a float [vocab, hidden] weight whose rows the reduced draft head
        gathers: the head's own weight, or for a packed head the weight it was packed from."""
        source = getattr(self.lm_head, "row_source", None)
        return source if source is not None else self.lm_head.weight

    def new_cache(self, capacity: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def _allowed(
        self, start: int, positions: torch.Tensor, window: int | None, visible: torch.Tensor | None
    ) -> torch.Tensor:
        """Boolean [q, start+q] over cache slots (True = attend).

        Slots [0, start) hold committed tokens at positions equal to their slot; the q new
        tokens sit in slots [start, start+q) at `positions` [q]. `visible` [q, start+q]
        overrides which slots each new token sees (token trees, teacher-forced probes);
        by default it is causal by slot. A sliding window is applied on positions.
        """
        q = positions.shape[0]
        kv = start + q
        key_pos = torch.cat([torch.arange(start, device=self.device), positions])  # [kv]
        if visible is None:
            slot = torch.arange(kv, device=self.device)
            allowed = slot[None, :] <= slot[start:, None]
        else:
            allowed = visible.clone()
        if window is not None:
            allowed &= key_pos[None, :] > positions[:, None] - window
        return allowed

    def _mask(
        self, start: int, positions: torch.Tensor, window: int | None, visible: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`_allowed` as the [1, 1, q, kv] mask attention modules take; None where every query
        may see every key, so SDPA takes its fastest path."""
        q = positions.shape[0]
        if visible is None and q == 1 and (window is None or start + q <= window):
            return None
        return self._allowed(start, positions, window, visible)[None, None]

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._rotary_takes_layer_type:
            return {t: self.rotary_emb(hidden, positions, t) for t in set(self.layer_types)}
        pe = self.rotary_emb(hidden, positions)
        return {t: pe for t in set(self.layer_types)}

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        start: int,
        cache: KVCache,
        skip: SkipSet,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        mlps: Sequence[nn.Module] | None = None,
        exact: bool = False,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Run q tokens in cache slots [start, start + q); return final-normed hidden [1, q, hidden].

        input_ids: [1, q]. positions: [q], defaults to the slots. visible: [q, start + q]
        bool, defaults to causal. mlps: one module per layer to run instead of the layer's own
        MLP (a draft's quantized copies). exact: attend row by row (model/attention.py), so each row
        gets the bits it would get alone; a row that sees no slot is padding and gets zeros.
        prefill: a prompt chunk (not exact), whose products may take faster kernels that are
        not row-invariant (model/fused.py). Writes KV for those slots in every attention layer it runs.
        """
        q = input_ids.shape[1]
        cache.begin(start, q)
        if positions is None:
            positions = torch.arange(start, start + q, device=self.device)

        def attention(window: int | None) -> tuple[torch.Tensor | None, dict[str, RowKeys]]:
            if exact:  # the rows say what each query sees
                return None, {"rows": RowKeys.from_mask(self._allowed(start, positions, window, visible))}
            return self._mask(start, positions, window, visible), {}

        return self._run(input_ids, positions, cache, skip, attention, mlps, rowwise=exact, prefill=prefill and not exact)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | PackedCaches,
        skip: SkipSet,
        attention: Callable[[int | None], tuple[torch.Tensor | None, dict[str, RowKeys]]],
        mlps: Sequence[nn.Module] | None = None,
        rowwise: bool = False,
        prefill: bool = False,
    ) -> torch.Tensor:
        """The layers over [1, q] tokens at `positions`; `attention(window)` gives the mask
        and the extra keywords (row-wise keys) of the layers with that sliding window.
        `rowwise`: an exact pass (its rows must get the bits of one-token steps). `prefill`: a
        prompt chunk (hidden_states)."""
        hidden = self.embed_tokens(input_ids)  # [1, q, hidden]
        rotary = self._rotary(hidden, positions[None])
        if self.fused is not None:
            return self._run_fused(hidden[0], rotary, cache, skip, attention, mlps, rowwise, prefill)[None]
        by_window: dict[int | None, tuple[torch.Tensor | None, dict[str, RowKeys]]] = {}
        sandwich = self.layout is Layout.SANDWICH
        for i, layer in enumerate(self.layers):
            if i not in skip.attn:
                window = self._windows[i]
                if window not in by_window:
                    by_window[window] = attention(window)
                mask, row_keys = by_window[window]
                attn_out, _ = layer.self_attn(
                    hidden_states=layer.input_layernorm(hidden),
                    position_embeddings=rotary[self.layer_types[i]],
                    attention_mask=mask,
                    **{self._cache_kw: cache},
                    **row_keys,
                )
                if sandwich:
                    attn_out = layer.post_attention_layernorm(attn_out)
                hidden = hidden + attn_out
            if i not in skip.mlp:
                mlp = layer.mlp if mlps is None else mlps[i]
                if sandwich:
                    hidden = hidden + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(hidden)))
                else:
                    hidden = hidden + mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def _run_fused(
        self,
        hidden: torch.Tensor,  # [q, hidden]
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        cache: KVCache | PackedCaches,
        skip: SkipSet,
        attention: Callable[[int | None], tuple[torch.Tensor | None, dict[str, RowKeys]]],
        mlps: Sequence[nn.Module] | None,
        rowwise: bool,
        prefill: bool,
    ) -> torch.Tensor:
        """`_run` on the fused layers: the same sublayers, masks and cache slots. A prefill
        chunk's products may take faster ways that are not row-invariant (FusedDecoder.prefill_how)."""
        fused = self.fused
        writes = cache.row_writes(hidden.shape[0])
        how = fused.prefill_how(hidden.shape[0]) if prefill and not rowwise else "kernel"  # bf16 only: prefill_products
        keys: dict[int | None, PassKeys] = {}
        for i in range(len(self.layers)):
            if i not in skip.attn:
                window = self._windows[i]
                if window not in keys:
                    mask, row_keys = attention(window)
                    rows = row_keys.get("rows")
                    keys[window] = PassKeys.rowwise(rows, writes) if rows is not None else PassKeys(mask=mask, end=writes.end)
                cos, sin = rotary[self.layer_types[i]]
                hidden = hidden + fused.attention(i, fused.input_norm(i, hidden), cos[0], sin[0], writes, keys[window], how)
            if i not in skip.mlp:
                normed = fused.post_norm(i, hidden)
                hidden = hidden + (fused.mlp(i, normed, how) if mlps is None else mlps[i](normed[None])[0])
        return self.norm(hidden)

    @torch.inference_mode()
    def forward_packed(self, segments: Sequence[Segment], exact: bool = False) -> list[torch.Tensor]:
        """Full-model logits [q_i, vocab] for each segment, all in one pass (continuous batching).

        One segment is `forward` itself. Several: their rows go through the linear layers
        together and each row attends, row by row, to its own request's cache only; with
        `exact`, every row's logits are then the bits that request would get decoding alone
        (the pass must stay within `exactness.max_rows`, where the linear layers are
        row-invariant). Writes each segment's KV into its own cache.
        """
        if len(segments) == 1:
            one = segments[0]
            return [self.forward(one.input_ids[None], one.start, one.cache, SkipSet(), positions=one.positions,
                                 visible=one.visible, exact=exact)]
        hidden = self.hidden_packed(segments, SkipSet())
        return list(self.logits(hidden).split([len(segment.input_ids) for segment in segments]))

    @torch.inference_mode()
    def hidden_packed(self, segments: Sequence[Segment], skip: SkipSet,
                      mlps: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """Final-normed hidden [sum of q_i, hidden] of several requests' rows in one pass
        through the sublayers `skip` leaves (and `mlps` instead of the model's MLPs, as
        `hidden_states`): the rows go through the linear layers together, each row attends
        row by row to its own request's cache. forward_packed's full pass, and a batch's draft
        step for requests that draft with the same configuration (proposers/self_draft.py).
        Writes each segment's KV, in the layers it runs, into its own cache."""
        positions = [segment.slot_positions(self.device) for segment in segments]
        input_ids = torch.cat([segment.input_ids for segment in segments])[None]
        caches = PackedCaches([(segment.cache, segment.start, len(segment.input_ids)) for segment in segments])

        def attention(window: int | None) -> tuple[None, dict[str, RowKeys]]:
            keys = [RowKeys.from_mask(self._allowed(segment.start, pos, window, segment.visible)).reading(segment.cache)
                    for segment, pos in zip(segments, positions)]
            return None, {"rows": sum(keys[1:], keys[0])}

        return self._run(input_ids, torch.cat(positions), caches, skip, attention, mlps, rowwise=True)[0]

    def _pad(
        self, input_ids: torch.Tensor, start: int, positions: torch.Tensor | None, visible: torch.Tensor | None, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append rows that repeat the last token, see no slot and are seen by no real row."""
        q = input_ids.shape[1]
        pad = rows - q
        if positions is None:
            positions = torch.arange(start, start + q, device=self.device)
        if visible is None:
            visible = self._allowed(start, positions, None, None)  # causal by slot
        padded_visible = torch.zeros(rows, start + rows, dtype=torch.bool, device=self.device)
        padded_visible[:q, : start + q] = visible
        padded_ids = torch.cat([input_ids, input_ids[:, -1:].expand(1, pad)], dim=1)
        padded_positions = torch.cat([positions, positions[-1] + 1 + torch.arange(pad, device=self.device)])
        return padded_ids, padded_positions, padded_visible

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab] (with Gemma's final soft-capping)."""
        return self.capped(self.lm_head(hidden).float())

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits after the model's final soft-capping (Gemma), if it has one: what
        any head over this model's hidden states must apply."""
        if self._softcap:
            return torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        cache: KVCache,
        skip: SkipSet,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        exact: bool = False,
        min_rows: int | None = None,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Logits [q, vocab] for the q tokens in slots [start, start+q) (last row if last_only).

        exact: each row's logits are bit-identical to a one-token exact pass of that token
        where `self.exactness.exact` holds: attention is row-wise, and a pass shorter than
        `min_rows` (default `exactness.min_rows`) is padded with rows that attend to nothing
        (their KV lands in the spare slots after the pass, which the next pass overwrites).
        prefill: a prompt chunk (see hidden_states).
        """
        q = input_ids.shape[1]
        if exact and min_rows is None:
            min_rows = self.exactness.min_rows
        if exact and q < min_rows:
            input_ids, positions, visible = self._pad(input_ids, start, positions, visible, min_rows)
        hidden = self.hidden_states(input_ids, start, cache, skip, positions, visible, exact=exact,
                                    prefill=prefill)[0]  # [rows, hidden]
        if last_only:
            return self.logits(hidden[q - 1 : q])
        return self.logits(hidden)[:q]  # the lm_head sees the padded rows too: it is a linear layer
