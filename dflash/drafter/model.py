"""The DFlash drafter: Qwen3-style decoder layers conditioned on the target's hidden states by KV injection.

Follows DFlash (arXiv 2602.06036, section 3) and the serving implementations it must match: vLLM
``qwen3_dflash.py``, SGLang ``models/dflash.py``, z-lab/dflash ``DFlashDraftModel``.

* Fusion: ``c = hidden_norm(fc([h^(l1); ...; h^(ln)]))``, bias-free ``fc: n*H -> H``, shared by every layer.
* Every layer: queries from the block tokens only; keys/values ``[k_proj(c); k_proj(x)]`` / ``[v_proj(c); v_proj(x)]``
  (k_norm on both, RoPE on both: context at its absolute positions, block at ``anchor + 0..B-1``). Only the
  block's hidden states go through ``input_layernorm``, the residual stream and the MLP.
* Output: the drafter's final ``norm``, then the TARGET's frozen LM head; inputs embedded by the target's frozen
  embedding. Both are attached with :meth:`DFlashDrafter.attach_target` and never stored in ``state_dict()``.

Speed: the elementwise parts of a layer (norms, q/k norm + RoPE, SwiGLU) come from :mod:`dflash.drafter.fused`
(compiled fused kernels in eager mode on CUDA, the same math as plain ops elsewhere); key RoPE is concatenated once
per step and the BlockMask built once per step, both shared by every layer. Which kernels run FlexAttention
(flash-attn-4's or inductor's Triton ones) is :mod:`dflash.drafter.attention_kernels`'s choice.

Legend: T packed tokens, A anchors, B block size, Q = A*B queries, H hidden, n taps, V vocab, D head_dim.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import dflash.drafter.fused as fused
from dflash.drafter.attention_kernels import (  # re-exported: documented as dflash.drafter.model.*
    attention_kernel_options,
    flex_kernel_options,
    set_flex_kernel_options,
)
from dflash.drafter.config import DFlashConfig
from dflash.drafter.masks import AttentionLayout, attention_layout, dense_attention_mask, flex_block_mask
from dflash.errors import ConfigError, MismatchError

if TYPE_CHECKING:
    from dflash.batches.packed import PackedBatch

__all__ = [
    "DFlashDrafter",
    "RMSNorm",
    "tensor_hash",
    "set_flex_kernel_options",
    "flex_kernel_options",
    "attention_kernel_options",
    "set_train_shortcuts",
]

#: Exact rewrites of the training forward (same math, less work); see :func:`set_train_shortcuts`.
_SHORTCUTS = {"shared_first_layer": True, "skip_anchor_rows": True}


def set_train_shortcuts(**switches: bool) -> dict[str, bool]:
    """Turn the training forward's exact rewrites on or off (all on by default); returns the previous settings.

    * ``shared_first_layer``: the first layer's inputs are the block's token embeddings, which are the same MASK
      embedding at block positions 1..B-1 of every block: its q/k/v projections run on the ``A + 1`` distinct
      rows (A anchors, one MASK row) and are broadcast, and no input gradient is formed (the frozen embedding
      needs none): layer 0's q/k/v GEMMs (forward and weight gradient) shrink from A*B to A + 1 rows and its
      input-gradient GEMMs for them disappear. The first layer gets its own compiled graph.
    * ``skip_anchor_rows``: in the last layer, block position 0 (the anchor) feeds the other positions only
      through its keys/values; its attention output, o_proj, MLP and final norm are skipped
      (``forward_train(..., predictions_only=True)``, as the loss calls it). The last layer gets its own graph.

    Measured on one H200 (``benchmarks/drafter_step.py --shortcuts none all``, compiled, batch 4): 511.5 -> 497.8 ms
    per step. (One GEMM over concatenated q/k/v and gate/up weights inside compiled layers was tried too: 5 ms
    slower per step, so it is not offered.)

    Raises:
        ConfigError: an unknown switch name.
    """
    unknown = sorted(set(switches) - set(_SHORTCUTS))
    if unknown:
        raise ConfigError(f"unknown training shortcut(s) {unknown}; known: {sorted(_SHORTCUTS)}")
    previous = dict(_SHORTCUTS)
    _SHORTCUTS.update({name: bool(value) for name, value in switches.items()})
    return previous


def _broadcast_blocks(rows: torch.Tensor, num_anchors: int, block_size: int) -> torch.Tensor:
    """``[A + 1, C]`` (A anchor rows, then the MASK row) -> ``[A*B, C]`` block rows: row 0 of block j is anchor row
    j, rows 1..B-1 are the MASK row. Its backward sums the MASK row's gradient (a reduction, no atomics)."""
    anchor_rows = rows[:num_anchors, None, :]
    mask_rows = rows[num_anchors:, None, :].expand(num_anchors, block_size - 1, rows.shape[-1])
    return torch.cat([anchor_rows, mask_rows], dim=1).reshape(num_anchors * block_size, rows.shape[-1])


def _drop_anchor_rows(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[A*B, C]`` -> ``[A*(B-1), C]``: block positions 1..B-1."""
    return rows.view(-1, block_size, rows.shape[-1])[:, 1:].reshape(-1, rows.shape[-1])


@functools.cache
def _flex_attention():
    """FlexAttention compiled once per process (eager flex_attention is a slow reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def tensor_hash(tensor: torch.Tensor) -> str:
    """``"sha256:..."`` of a tensor's shape, dtype and bytes (used to recognise the target's embedding/LM head)."""
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{tuple(data.shape)}|{data.dtype}".encode())
    digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")  # the buffer itself: no copy of its bytes
    return f"sha256:{digest.hexdigest()}"


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; the output keeps the input dtype (bf16 activations stay bf16 under autocast
    even with float32 master weights, as the serving engines run it in bf16)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype``: cast the result (e.g. to the compute dtype) inside the same fused kernel."""
        return fused.rms_norm(hidden_states, self.weight, self.eps, out_dtype)


def _compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class DFlashAttention(nn.Module):
    """Grouped-query attention with per-head q_norm/k_norm (Qwen3) and context KV injection."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.kernel_options: dict | None = None  # FlexAttention kernel_options (see attention_kernel_options)

    def forward(
        self,
        block_states: torch.Tensor,  # [Q, H] (or [A+1, H] with num_anchors), already input_layernorm'ed
        context: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [T, H] fused context features, or this
        # layer's (keys, values) [T, kv_heads, D] of them (keys_values: normed and rotated)
        block_rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin [Q, D]
        key_rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos/sin [T+Q, D]: context positions then block
        # positions (not used with precomputed context keys)
        mask: object,  # BlockMask, dense bool [Q, T+Q], or None (no mask: serving path)
        num_anchors: int = 0,  # > 0: block_states are the A anchor rows then the MASK row (_broadcast_blocks)
        drop_anchor_rows: bool = False,  # return block positions 1..B-1 only ([A*(B-1), H])
    ) -> torch.Tensor:
        num_queries = block_rope[0].shape[0]
        q, k_block, v_block = self.q_proj(block_states), self.k_proj(block_states), self.v_proj(block_states)
        if num_anchors:
            q, k_block, v_block = (_broadcast_blocks(t, num_anchors, self.block_size) for t in (q, k_block, v_block))
        if isinstance(context, tuple):  # the context's keys and values, computed once per row (keys_values)
            context_keys, context_values = context
            k_block, v_block = self._normed_keys(k_block, v_block, block_rope)
            k, v = torch.cat([context_keys, k_block], dim=0), torch.cat([context_values, v_block], dim=0)
        else:
            # Same k/v projections for the injected context and the block; concatenated after projection (the
            # projected keys are narrower than the hidden states, so this moves less memory than concatenating
            # inputs), then one norm + RoPE kernel over both.
            assert key_rope[0].shape[0] == context.shape[0] + num_queries
            k, v = self._normed_keys(torch.cat([self.k_proj(context), k_block], dim=0),
                                     torch.cat([self.v_proj(context), v_block], dim=0), key_rope)
        # v comes straight out of a Linear, so it carries the compute dtype (bf16 under autocast); q/k match it.
        q = fused.norm_rope(q.reshape(num_queries, self.num_heads, self.head_dim),
                            self.q_norm.weight, self.q_norm.eps, *block_rope, v.dtype)
        # [1, heads, len, D]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        gqa = self.num_kv_heads != self.num_heads
        if mask is None or isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            options = self.kernel_options  # set by DFlashDrafter.forward_train, outside any compiled region
            if torch.compiler.is_compiling():  # inside a compiled layer: trace flex_attention directly
                from torch.nn.attention.flex_attention import flex_attention

                out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
            else:
                out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
        out = out.squeeze(0).transpose(0, 1).reshape(num_queries, self.num_heads * self.head_dim)
        if drop_anchor_rows:
            out = _drop_anchor_rows(out, self.block_size)
        return self.o_proj(out)

    def keys_values(self, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """This layer's keys (k_norm'ed, rotated) and values ``[T, kv_heads, D]`` of the fused context features
        ``[T, H]`` at the positions of ``rope`` (cos/sin ``[T, D]``): per row, so they can be computed once per
        context row and kept (serving-style drafting over a growing context)."""
        return self._normed_keys(self.k_proj(context), self.v_proj(context), rope)

    def _normed_keys(self, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Projected keys/values ``[N, kv_heads*D]`` -> keys after k_norm + RoPE (one fused kernel on CUDA) and
        values, both ``[N, kv_heads, D]`` in the values' dtype."""
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k = fused.norm_rope(k.view(-1, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps,
                            *rope, v.dtype)
        return k, v


class DFlashMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.swiglu(self.gate_proj(x), self.up_proj(x)))


class DFlashDecoderLayer(nn.Module):
    """Pre-RMSNorm decoder layer; the context enters only as injected keys/values."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden_states, context, block_rope, key_rope, mask, num_anchors: int = 0,
                drop_anchor_rows: bool = False):
        """``hidden_states`` ``[Q, H]``, or with ``num_anchors`` the ``[A + 1, H]`` distinct rows (anchors, then the
        MASK row) of a first layer; ``drop_anchor_rows``: return block positions 1..B-1 only. Returns ``[Q, H]``
        (``[A*(B-1), H]`` with ``drop_anchor_rows``)."""
        # The residual stream keeps its dtype (DFlashDrafter.residual_in_compute_dtype); normed inputs are cast once
        # to the compute dtype (instead of once per consuming Linear by autocast), inside the norm's fused kernel.
        compute_dtype = _compute_dtype_of(hidden_states)
        normed = self.input_layernorm(hidden_states, compute_dtype)
        attention = self.self_attn(normed, context, block_rope, key_rope, mask, num_anchors, drop_anchor_rows)
        block_size = self.self_attn.block_size
        if num_anchors:
            hidden_states = _broadcast_blocks(hidden_states, num_anchors, block_size)
        if drop_anchor_rows:
            hidden_states = _drop_anchor_rows(hidden_states, block_size)
        norm = self.post_attention_layernorm
        hidden_states, normed = fused.add_rms_norm(hidden_states, attention, norm.weight, norm.eps, compute_dtype)
        return hidden_states + self.mlp(normed)


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter (trainable parameters named exactly as the serving engines load them).

    Raises (at use): ``ConfigError`` when the target's embedding / LM head were not attached.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_taps * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = _make_rotary(config)
        # Frozen target tensors: non-persistent buffers (move with .to(), never in state_dict()).
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("_lm_head_weight", None, persistent=False)
        self._lm_head_tied = False
        self._compiled_layers: list | None = None
        #: Input signatures the compiled layers have run on (see :attr:`compiled_graphs`).
        self._compile_signatures: set[tuple] = set()
        #: The block tokens' residual stream in the compute dtype (bf16 under bf16 autocast), as the serving engines
        #: run the drafter and as Megatron-LM trains by default (``fp32_residual_connection=False``); False keeps it
        #: in the parameter dtype (float32 master weights). Norms compute in float32 either way. No effect without
        #: autocast (compute dtype = parameter dtype). bf16 halves the residual's memory traffic: batch-4 step of
        #: ``benchmarks/drafter_step.py`` on an H200, compiled, 490.1 -> 486.4 ms (``--residual-dtype float32 compute``).
        self.residual_in_compute_dtype = True
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for projections, ones for norms (transformers' Qwen3 init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
        """Share the target's frozen token embedding ``[V, H]`` and LM head ``[V, H]`` (None or the same tensor =
        tied). They are kept as non-persistent buffers: excluded from ``state_dict()`` and from parameters.

        Raises:
            MismatchError: shapes differ from ``(vocab_size, hidden_size)``.
        """
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, weight in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if weight is not None and tuple(weight.shape) != expected:
                raise MismatchError(
                    f"target {name} has shape {tuple(weight.shape)}, the drafter config expects {expected} "
                    "(vocab_size, hidden_size); load the target this drafter was configured for"
                )
        tied = lm_head_weight is None or lm_head_weight is embed_weight
        device = self.fc.weight.device
        self.embed_weight = embed_weight.detach().to(device)
        self._lm_head_weight = None if tied else lm_head_weight.detach().to(device)
        self._lm_head_tied = tied

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's LM head ``[V, H]`` (the embedding when tied)."""
        self._require_target()
        return self.embed_weight if self._lm_head_tied else self._lm_head_weight

    def target_weight_hashes(self) -> dict[str, str]:
        """``{"embed_tokens": sha256, "lm_head": sha256}`` of the attached target tensors (lm_head = embedding hash
        when tied), recorded in checkpoints so a different target is caught at load."""
        self._require_target()
        embed = tensor_hash(self.embed_weight)
        return {"embed_tokens": embed, "lm_head": embed if self._lm_head_tied else tensor_hash(self._lm_head_weight)}

    def _require_target(self) -> None:
        if self.embed_weight is None:
            raise ConfigError(
                "the drafter has no target embedding / LM head; call drafter.attach_target(embed_weight, "
                "lm_head_weight) with the target's tensors first"
            )

    def compile_layers(self, **compile_kwargs) -> None:
        """torch.compile each decoder layer (torchtitan style) for the fixed-shape path.

        Graphs per distinct shape (length bucket x anchor slots): one shared by the middle layers and, with the
        training shortcuts (:func:`set_train_shortcuts`), one for the first and one for the last layer; validation
        (no grad) doubles that. Compiles are thus bounded by a small multiple of the number of buckets.
        ``compile_kwargs`` go to ``torch.compile`` (default ``dynamic=False``)."""
        import torch._dynamo

        compile_kwargs.setdefault("dynamic", False)
        # All layers share one code object, hence one recompile limit: up to 6 graphs per bucket (3 layer variants,
        # with and without grad); the default limit (8) would silently fall back to eager after one bucket, and 256
        # leaves room for ~40 buckets.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        self._compiled_layers = [torch.compile(layer, **compile_kwargs) for layer in self.layers]

    @property
    def compiled_graphs(self) -> int:
        """Graphs the compiled layers have needed so far: distinct (layer variant, input shapes, dtypes,
        requires_grad, grad mode, autocast) signatures they ran on, each of which ``dynamic=False`` compiles once
        (the guards dynamo checks for these layers; counted here because torch has no public recompile counter).
        0 without :meth:`compile_layers`. A count still rising late in a run is a recompile storm: new shapes."""
        return len(self._compile_signatures)

    # ------------------------------------------------------------------ forward
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, device=positions.device, dtype=dtype)
        cos, sin = self.rotary_emb(probe, positions[None].to(torch.int64))
        return cos[0], sin[0]

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.fc.weight.dtype

    def _embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The block's token embeddings in the residual stream's dtype (see ``residual_in_compute_dtype``)."""
        return F.embedding(block_ids, self.embed_weight).to(
            self._compute_dtype(block_ids.device) if self.residual_in_compute_dtype else self.fc.weight.dtype)

    def fuse_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, n*H]`` tapped target states -> ``[T, H]`` context features ``hidden_norm(fc(h))`` in the compute dtype
        (cast once here: every layer's key/value projections read them).

        Raises:
            MismatchError: ``hidden`` is not ``n*H`` wide (other taps or another target)."""
        if hidden.shape[-1] != self.fc.in_features:
            raise MismatchError(
                f"hidden states have width {hidden.shape[-1]}, the drafter expects {self.fc.in_features} "
                f"({self.config.num_taps} taps x hidden {self.config.hidden_size}); the cache was extracted "
                "with other target_layer_ids or another target"
            )
        # Cast straight to the compute dtype: under bf16 autocast a float32 copy of the [T, n*H] input (the widest
        # activation of the step) would be written and read again only to be cast back to bf16 by the Linear.
        compute_dtype = self._compute_dtype(hidden.device)
        return self.hidden_norm(self.fc(hidden.to(compute_dtype))).to(compute_dtype)

    def _run_layers(self, block_states, context, block_rope, context_rope, mask, *,
                    num_anchors: int = 0, drop_anchor_rows: bool = False) -> torch.Tensor:
        """``block_states`` ``[Q, H]`` (or the first layer's ``[A + 1, H]`` distinct rows with ``num_anchors``) through
        every layer and the final norm; ``drop_anchor_rows``: the last layer returns block positions 1..B-1."""
        layers = self._compiled_layers if self._compiled_layers is not None else self.layers
        # With num_anchors the first layer has its own graph and forms no input gradient (the embedding is frozen).
        if not num_anchors and layers is self._compiled_layers and torch.is_grad_enabled() and not block_states.requires_grad:
            # The frozen embedding output needs no grad, later layers' inputs do: without this, dynamo builds a
            # second graph for the first layer at every shape (compile time doubles; the extra input-grad GEMMs of
            # layer 0 cost ~0.5% of a step).
            block_states = block_states.detach().requires_grad_(True)
        # Key RoPE (context positions, then block positions) concatenated once per step, shared by every layer.
        key_rope = (torch.cat([context_rope[0], block_rope[0]], dim=0), torch.cat([context_rope[1], block_rope[1]], dim=0))
        last = len(layers) - 1
        compiled = layers is self._compiled_layers
        for index, layer in enumerate(layers):
            if compiled:  # shapes are Python ints here: no device sync
                self._compile_signatures.add((
                    "first" if index == 0 and num_anchors else "last" if drop_anchor_rows and index == last else "mid",
                    num_anchors if index == 0 else 0, tuple(block_states.shape), block_states.dtype,
                    block_states.requires_grad, tuple(context.shape), context.dtype, torch.is_grad_enabled(),
                    torch.is_autocast_enabled(block_states.device.type)))  # fmt: skip
            block_states = layer(block_states, context, block_rope, key_rope, mask, num_anchors if index == 0 else 0,
                                 drop_anchor_rows and index == last)
        return self.norm(block_states)

    def build_mask(self, anchors: torch.Tensor, position_ids: torch.Tensor) -> tuple[AttentionLayout, object]:
        """Attention layout and mask for one step: a FlexAttention BlockMask on CUDA, a dense ``[Q, T+Q]`` bool
        mask elsewhere. Built once per step and shared by every layer."""
        layout = attention_layout(anchors, position_ids, self.config.block_size)
        mask = flex_block_mask(layout) if anchors.is_cuda else dense_attention_mask(layout)
        return layout, mask

    def forward_train(self, batch: PackedBatch, anchors: torch.Tensor, *, mask: object = None,
                      predictions_only: bool = False) -> torch.Tensor:
        """Training forward of every block of a packed batch at once.

        Args:
            batch: packed batch (``input_ids [T]``, ``hidden [T, n*H]``, ``position_ids [T]``) on the model's device.
            anchors: ``[A]`` int64 flat indices into T (from :func:`sample_anchors`); ``-1`` marks a padding slot
                (fixed-shape path) whose block sees only itself and must get zero loss weight.
            mask: optional precomputed mask from :meth:`build_mask` (e.g. built ahead of time).
            predictions_only: return block positions 1..B-1 only (the ones the loss scores). With the
                ``skip_anchor_rows`` shortcut (:func:`set_train_shortcuts`) the last layer then skips position 0's
                attention output, o_proj and MLP; the result equals ``forward_train(...)[:, 1:]``.

        Returns:
            ``[A, B, H]`` (``[A, B-1, H]`` with ``predictions_only``) hidden states after the final norm, before the
            LM head.
        """
        self._require_target()
        block_size = self.config.block_size
        num_anchors = anchors.shape[0]
        if mask is None:
            _, mask = self.build_mask(anchors, batch.position_ids)
        safe = anchors.clamp(min=0)
        offsets = torch.arange(block_size, device=anchors.device)
        block_positions = (batch.position_ids[safe][:, None] + offsets).reshape(-1)  # [Q]
        mask_id = torch.full((1,), self.config.mask_token_id, dtype=torch.int64, device=anchors.device)
        shared_first_layer = _SHORTCUTS["shared_first_layer"] and num_anchors > 0  # A is a Python int: no sync
        if shared_first_layer:  # the A + 1 distinct input rows: anchor tokens, then MASK (see set_train_shortcuts)
            block_ids = torch.cat([batch.input_ids[safe].to(torch.int64), mask_id])
        else:
            block_ids = torch.cat([batch.input_ids[safe].to(torch.int64)[:, None],
                                   mask_id.expand(num_anchors, block_size - 1)], dim=1).reshape(-1)
        context = self.fuse_context(batch.hidden)
        block_states = self._embed_block(block_ids)
        rope_dtype = context.dtype
        block_rope = self._rope(block_positions, rope_dtype)
        context_rope = self._rope(batch.position_ids, rope_dtype)
        if not isinstance(mask, torch.Tensor):
            options = attention_kernel_options(anchors.device, rope_dtype, self.config.head_dim)
            for layer in self.layers:
                if layer.self_attn.kernel_options != options:
                    layer.self_attn.kernel_options = options
        skip = predictions_only and _SHORTCUTS["skip_anchor_rows"]
        out = self._run_layers(block_states, context, block_rope, context_rope, mask,
                               num_anchors=num_anchors if shared_first_layer else 0, drop_anchor_rows=skip)
        if skip:
            return out.view(num_anchors, block_size - 1, self.config.hidden_size)
        out = out.view(num_anchors, block_size, self.config.hidden_size)
        return out[:, 1:] if predictions_only else out

    @torch.no_grad()
    def context_keys_values(self, context_hidden: torch.Tensor,
                            context_positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the context rows ``context_hidden`` ``[T, n*H]`` (tapped target states)
        at ``context_positions`` ``[T]``: ``[(keys, values)]`` per layer, each ``[T, kv_heads, D]`` in the compute
        dtype. A row's keys and values depend on that row alone, so a decoding loop computes them once per accepted
        token and keeps them (:class:`dflash.decoding.drafter_cache.GraphedDrafter`), as the serving engines keep
        the drafter's context in a KV cache."""
        context = self.fuse_context(context_hidden)
        rope = self._rope(context_positions, context.dtype)
        return [layer.self_attn.keys_values(context, rope) for layer in self.layers]

    @torch.no_grad()
    def draft_block(
        self,
        context_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        block_input_ids: torch.Tensor,
        block_start: int | torch.Tensor,
    ) -> torch.Tensor:
        """Serving-style drafting of one block, as vLLM / SGLang run it: the whole context, no attention mask.

        Args:
            context_hidden: ``[Lc, n*H]`` tapped target states of every accepted token before the block.
            context_positions: ``[Lc]`` their absolute positions.
            block_input_ids: ``[B]`` ``[last accepted token, MASK, ..., MASK]``.
            block_start: absolute position of the block's first token (an int, or a 0-dim int64 device tensor).

        Returns:
            ``[B, V]`` float32 logits (position k predicts the token at ``block_start + k``).
        """
        return self.draft_block_cached(self.context_keys_values(context_hidden, context_positions), block_input_ids,
                                       block_start)

    @torch.no_grad()
    def draft_block_cached(
        self,
        context_keys_values: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_input_ids: torch.Tensor,
        block_start: int | torch.Tensor,
        *,
        context_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`draft_block` over context keys and values computed before (:meth:`context_keys_values`).

        Args:
            context_keys_values: per layer, ``(keys, values)`` ``[Lc, kv_heads, D]`` of the context rows.
            block_input_ids: ``[B]`` ``[last accepted token, MASK, ..., MASK]``.
            block_start: absolute position of the block's first token (an int, or a 0-dim int64 device tensor).
            context_valid: ``[Lc]`` bool, the context rows the block attends (None: all). With it, the context can
                be a fixed-size buffer whose rows past the accepted tokens are ignored: one shape for every cycle,
                what a captured graph needs (:class:`dflash.decoding.drafter_cache.GraphedDrafter`). Rows it
                excludes must hold finite values (they are weighted by zero).

        Returns:
            ``[B, V]`` float32 logits.

        Raises:
            ConfigError: the target's embedding / LM head were not attached.
            ValueError: not one ``(keys, values)`` pair per layer.
        """
        self._require_target()
        if len(context_keys_values) != len(self.layers):
            raise ValueError(f"context_keys_values: expected one (keys, values) pair per layer ({len(self.layers)}), "
                             f"got {len(context_keys_values)}")
        block_ids = block_input_ids.to(torch.int64)
        device = block_ids.device
        block_states = self._embed_block(block_ids)
        positions = block_start + torch.arange(block_ids.shape[0], device=device)
        block_rope = self._rope(positions, self._compute_dtype(device))
        mask = None
        if context_valid is not None:  # [B, Lc + B]: the valid context rows, and the whole block (no mask inside it)
            block = torch.ones((block_ids.shape[0], block_ids.shape[0]), dtype=torch.bool, device=device)
            mask = torch.cat([context_valid[None, :].expand(block.shape[0], -1), block], dim=1)
        for layer, keys_values in zip(self.layers, context_keys_values, strict=True):
            block_states = layer(block_states, tuple(keys_values), block_rope, None, mask)
        out = self.norm(block_states)
        return F.linear(out, self.lm_head_weight.to(out.dtype)).float()


def _make_rotary(config: DFlashConfig) -> nn.Module:
    """transformers' Qwen3 rotary embedding built from the drafter config (every ``rope_type`` transformers
    supports, with the same scaling the target and the exported config use)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    qwen_config = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=config.rope_parameters,
        vocab_size=config.vocab_size,
        num_hidden_layers=config.num_hidden_layers,
    )
    return Qwen3RotaryEmbedding(qwen_config)
