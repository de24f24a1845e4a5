"""Modifiers in the chunked kernel: which blocks to compute, and each block's modified scores and gradients.

Block skipping. A mask modifier that is a
:class:`attnkit.functional.MaskModifier` may give a *block rule*: from the
first and last positions of a block of queries and of keys alone (interval
arithmetic, nothing evaluated) it says NONE (nothing visible: the block is
skipped), ALL (everything visible: the mask is not evaluated), SOME
(something visible) or None (unknown). The built-ins are exact where they can
be (the band, key prefixes, document ids) and and_masks / or_masks
combine their members' verdicts soundly; a subclass that overrides
``__call__`` but not the rule it inherits has no rule (it is a plain
function to the kernel). Where the verdict is SOME or None, the mask
modifier is evaluated on that block alone, (Tb, Sb), never on (T, S);
after a None, a block whose mask hides everything is skipped too (and one that
hides nothing skips the masking), except under torch.compile and torch.func,
which cannot branch on data. A plain function (FlexAttention's form) thus gets
exact skipping at the cost of evaluating its mask on every block once per
pass; a built-in gets it for free.

Gradients through a score modifier: the backward pass recomputes each block's
raw scores, runs the score modifier on them with autograd on, and takes dscore
back through it with ``torch.autograd.grad``, to the raw scores (then to q and
k as usual) and to every tensor the modifier closes over that requires grad.
Those tensors are found once per call by :func:`captured_tensors` and handed
to the autograd Function as inputs, so their gradients reach them.

Legend: B batch, H query heads, G key/value heads, R = H // G, Tb / Sb a
block of queries / keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from attnkit.functional.masks import Visibility
from attnkit.functional.modifiers import BlockRule, MaskMod, ScoreMod, ScoreModifier, block_rule_of

from .modifiers import apply_mask_mod, apply_score_mod, can_branch_on_data, declares, index_grid

# (key columns, visibility, whether some row may see nothing, the mask modifier on the block or None)
Block = tuple[range, Visibility, bool, "Tensor | None"]


@dataclass(frozen=True)
class BlockMods:
    """The modifiers of one (queries, keys) pair, for the block kernel.

    ``mask_mod`` is the whole visibility (a causal / window band included) and
    ``rule`` its block rule (None: evaluate every block that is not skipped).
    ``key_start`` is the position of key 0; query i is at ``key_start +
    offset + i`` (the plan's offset). ``b`` (B, 1, 1, 1) and ``h`` (1, H, 1, 1)
    are the batch and head indices. With explicit positions, ``q_pos``
    (B, 1, T, 1) and ``k_pos`` (B, 1, 1, S) give every query's and key's
    position instead (and there is no block rule: ranges do not describe them).
    ``shape``: the call's scores (B, H, T, S), which errors name (None: the block's own shape).
    """

    score_mod: ScoreMod | None
    mask_mod: MaskMod | None
    rule: BlockRule | None
    b: Tensor
    h: Tensor
    key_start: int = 0
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    in_place: bool = False  # score_mod has its own in-place form (ScoreModifier.modify_): found once, not per block
    shape: tuple[int, ...] | None = None

    def positions(self, rows: range, cols: range, offset: int) -> tuple[range, range]:
        first_q = self.key_start + offset
        return (range(first_q + rows.start, first_q + rows.stop),
                range(self.key_start + cols.start, self.key_start + cols.stop))

    def indices(self, rows: range, cols: range, offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(b, h, q_idx (1, 1, Tb, 1), kv_idx (1, 1, 1, Sb)) of one block; (B, 1, Tb, 1) and (B, 1, 1, Sb)
        with explicit positions."""
        if self.q_pos is not None and self.k_pos is not None:
            q_idx = self.q_pos[:, :, rows.start:rows.stop]  # (B, 1, T, 1) -> (B, 1, Tb, 1)
            return self.b, self.h, q_idx, self.k_pos[..., cols.start:cols.stop]  # (B, 1, 1, S) -> (B, 1, 1, Sb)
        qs, ks = self.positions(rows, cols, offset)
        device = self.b.device
        q_idx = torch.arange(qs.start, qs.stop, device=device).view(1, 1, -1, 1)  # (1, 1, Tb, 1)
        kv_idx = torch.arange(ks.start, ks.stop, device=device).view(1, 1, 1, -1)  # (1, 1, 1, Sb)
        return self.b, self.h, q_idx, kv_idx

    def visibility(self, rows: range, cols: range, offset: int) -> Visibility | None:
        """What the rule knows of this block without evaluating the mask (None: nothing)."""
        if self.mask_mod is None:
            return Visibility.ALL
        return None if self.rule is None else self.rule(*self.positions(rows, cols, offset))

    def blocks(self, rows: range, key_blocks: list[range], offset: int, masked: bool) -> Iterator[Block]:
        """The key blocks that query rows ``rows`` see something of (a generator: one block's mask at a time).

        ``masked``: the call's own mask may hide keys anywhere. A score
        modifier may too (-inf, as FlexAttention allows), so with one every
        block may have rows that see nothing.
        """
        masked = masked or self.score_mod is not None
        for cols in key_blocks:
            state = self.visibility(rows, cols, offset)
            if state is Visibility.NONE:
                continue
            keep = None
            if state is not Visibility.ALL and self.mask_mod is not None:
                idx = self.indices(rows, cols, offset)
                keep = apply_mask_mod(self.mask_mod, idx, self.shape)  # (B?, H?, Tb, Sb)
                if state is None and can_branch_on_data(keep):  # the rule could not tell: the mask does
                    if not keep.any():
                        continue
                    if keep.all():
                        keep = None
            yield cols, Visibility.SOME if keep is not None else Visibility.ALL, masked or keep is not None, keep

    def modify(self, s: Tensor, mask: Tensor | None, rows: range, cols: range, offset: int, keep: Tensor | None,
               *, inplace: bool) -> Tensor:
        """Raw scaled scores (B, G, R*Tb, Sb) of one block through score_mod, then every mask (-inf).

        ``mask`` is the call's own mask on this block, (B?, H?, Tb?, Sb?);
        ``inplace`` lets the masks overwrite ``s`` when no score modifier ran.
        """
        b, g, rt, sb = s.shape
        s4 = s.view(b, self.h.shape[1], len(rows), sb)  # (B, G, R*Tb, Sb) -> (B, H, Tb, Sb)
        if inplace and self.in_place:  # a built-in writes into s4
            s4 = self.score_mod.modify_(s4, *self.indices(rows, cols, offset))  # type: ignore[union-attr]
        elif self.score_mod is not None:
            s4 = apply_score_mod(self.score_mod, s4, self.indices(rows, cols, offset), self.shape)
            inplace = False  # its result may be expanded, or saved for its backward
        if mask is not None and mask.dtype == torch.bool:
            keep = mask if keep is None else keep & mask
        elif mask is not None:
            s4 = s4.add_(mask.to(s4.dtype)) if inplace else s4 + mask.to(s4.dtype)
        if keep is not None:
            s4 = s4.masked_fill_(~keep, -torch.inf) if inplace else s4.masked_fill(~keep, -torch.inf)
        return s4.reshape(b, g, rt, sb)  # (B, H, Tb, Sb) -> (B, G, R*Tb, Sb)

    def weights(self, raw: Tensor, mask: Tensor | None, rows: range, cols: range, offset: int,
                keep: Tensor | None, lse: Tensor, captured: tuple[Tensor, ...], grads: list[Tensor | None]
                ) -> tuple[Tensor, Callable[[Tensor], Tensor] | None]:
        """For the backward: the weights exp(s - lse) (B, G, R*Tb, Sb) of one block from its raw scores
        ``raw``, and the step that takes dscore back through score_mod (None without one).

        ``lse`` (B, G, R*Tb, 1) covers the whole row (+inf where it sees
        nothing); the step adds the captured tensors' gradients into ``grads``.
        """
        if self.score_mod is None:
            return torch.exp(self.modify(raw, mask, rows, cols, offset, keep, inplace=True) - lse), None
        with torch.enable_grad():
            raw.requires_grad_()
            s = self.modify(raw, mask, rows, cols, offset, keep, inplace=False)

        def through(ds: Tensor) -> Tensor:
            if not s.requires_grad:  # the modifier ignored the scores and read nothing that requires grad
                return torch.zeros_like(ds)
            got = torch.autograd.grad(s, (raw, *captured), ds, allow_unused=True)
            for i, grad in enumerate(got[1:]):
                if grad is not None:
                    grads[i] = grad if grads[i] is None else grads[i] + grad  # type: ignore[operator]
            return torch.zeros_like(ds) if got[0] is None else got[0]
        return torch.exp(s.detach() - lse), through


def block_mods(score_mod: ScoreMod | None, mask_mod: MaskMod | None, *, batch: int, num_heads: int,
               q_positions: range, kv_positions: range, device: torch.device,
               explicit: tuple[Tensor, Tensor] | None = None, shape: tuple[int, ...] | None = None) -> BlockMods:
    """The :class:`BlockMods` of a call whose queries and keys sit at these positions.

    ``explicit``: (queries (B, T), keys (B, S)) positions, long, that replace the ranges.
    ``shape``: the call's scores (B, H, T, S), for the modifiers' errors to name.
    """
    b, h, _, _ = index_grid(batch, num_heads, range(0), range(0), device)
    # compiled, the out-of-place form: Inductor fuses it as well, and its lowering of in-place writes through a
    # block's (B, H, Tb, Sb) view spends most of the compile simplifying indices (BENCHMARKS.md, round sixteen);
    # decided here once per call, never per block
    in_place = (isinstance(score_mod, ScoreModifier) and declares(score_mod, "modify_")
                and not torch.compiler.is_compiling())
    if explicit is not None:
        q_pos, k_pos = explicit
        q4, k4 = q_pos[:, None, :, None], k_pos[:, None, None, :]  # (B, T) -> (B, 1, T, 1), (B, S) -> (B, 1, 1, S)
        return BlockMods(score_mod, mask_mod, None, b, h, 0, q4, k4, in_place, shape)
    rule = block_rule_of(mask_mod, batch, q_positions, kv_positions)  # None for a mask that is opaque to it
    return BlockMods(score_mod, mask_mod, rule, b, h, kv_positions.start, in_place=in_place, shape=shape)


class _Captures(TorchFunctionMode):
    """Records the tensors that require grad which a function reads but did not make."""

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        super().__init__()
        self.made = {id(t) for t in inputs}
        self.alive: list[Any] = list(inputs)  # keeps the recorded ids from being reused
        self.found: dict[int, Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, Tensor) and id(t) not in self.made and t.requires_grad:
                self.found.setdefault(id(t), t)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.made.add(id(t))
                self.alive.append(t)
        return out


def captured_tensors(score_mod: ScoreMod, probe: Tensor, mods: BlockMods, offset: int) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` closes over that require grad, in the order it reads them.

    A built-in names them (:meth:`ScoreModifier.tensors`) and is not run.
    Any other modifier is run once on ``probe`` (B, H, 1, 1) scores at the
    first query and key (under no_grad: no graph is built; an error names
    the call's scores, ``mods.shape``), and every tensor is kept that it
    passes to a torch function, that requires grad, and that neither the
    arguments nor the modifier itself made. Closures, globals, module
    parameters and bound objects are found alike; a tensor read only on
    some other branch of the modifier's own control flow would be missed.
    """
    if isinstance(score_mod, ScoreModifier) and declares(score_mod, "tensors"):
        return tuple(t for t in score_mod.tensors() or () if t.requires_grad)
    b, h, q_idx, kv_idx = mods.indices(range(1), range(1), offset)
    inputs = (probe, b, h, q_idx, kv_idx)
    with torch.no_grad(), _Captures(inputs) as mode:
        apply_score_mod(score_mod, probe, inputs[1:], mods.shape)  # what it returns is checked here first
    return tuple(mode.found.values())
