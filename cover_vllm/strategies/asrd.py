"""`asrd`: Anchor Supervised Revocable Decoding (arXiv 2606.16847; ALGORITHMS.md §2.6).

The paper's abstract fixes the parts; everything below it is a reconstruction [RECON], with every
constant in `ASRDParams`. No official code exists.

* Drafting: the block's [MASK] slots with p(candidate) >= `draft_threshold` are revealed (float64
  softmax), the most confident always, at most `max_draft` [RECON: Fast-dLLM/COVER-style rule].
* Anchors by temporal consistency [PAPER idea; RECON test]: a committed slot is an anchor when its
  row's argmax equals its token and has been the same for `anchor_steps` consecutive forwards
  (the masked-view forwards that drafted it count) and p(token) >= `anchor_threshold` in the
  latest forward. It stops being one as soon as that fails. The Anchor Tokens Cache (ATC) holds
  the current block's anchors plus those of finished blocks (BlockState.memory), each with the
  weight w_a = 1 − H_a / log|V| (normalised entropy H at its latest forward).
* Anchor-guided generation [PAPER idea; RECON formula]: before each forward, every [MASK] slot i
  of the block gets e_i <- e_MASK + α (1 − H_i / log|V|) Σ_a ω_ia e_{y_a} over its
  `guide_anchors` nearest anchors, ω_ia ∝ w_a exp(−|i − a| / λ) normalised to 1 (α =
  `guide_strength`, λ = `guide_distance`; H_i from the previous forward). The paper's attention-
  based anchor relevance is replaced by this distance decay (the strategy never sees the model).
* Anchor-perturbed verification [PAPER idea; RECON rule]: up to `max_verify` committed non-anchor
  slots with p(token) < `uncertain_threshold` (least sure first) get e_c <- e_c + ε |e_c| u,
  u ⟂ e_c a random unit vector (ε = `perturb_scale`), in the same forward that drafts. A slot
  whose argmax flips or whose p(token) drops below `verify_threshold` is remasked, the least
  likely first, at most (drafted − 1) per step (progress guard); the others are Keeps.
* Directions u depend only on (`perturb_seed`, block start, step), so a request decodes the same
  alone or batched.

Engine support: `embed_edits` returns an EmbedEdit the runner applies after `model.embed`.
KV cache: edited positions are in the current block, which every cache mode recomputes in every
forward, and the next block starts with a refresh, so no edited K/V outlives its block; anchors'
stable inputs are the natural reuse set (§3) but no extra reuse is attempted here.
Metrics follow COVER: `verified` = perturbed slots, `keeps` = verified − remasked; remasks and
flip-flops are counted by the engine. ASRD never replaces in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cover_vllm.step_plan import EmbedEdit
from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.llada import propose
from cover_vllm.strategies.sampling import finite, on_device, topk_mask

NEG_INF = float("-inf")


@dataclass(frozen=True)
class ASRDParams(StrategyParams):
    draft_threshold: float = 0.7      # τ_d: reveal [MASK] slots at least this sure (best always)
    max_draft: int | None = None      # cap on reveals per step (None: no cap)
    anchor_steps: int = 2             # m: forwards with the same argmax before a slot anchors
    anchor_threshold: float = 0.9     # τ_a: p(token) an anchor needs in the latest forward
    guide_strength: float = 0.2       # α: size of the anchor signal on [MASK] embeddings (0: off)
    guide_distance: float = 8.0       # λ: anchor weight decays as exp(−|i − a| / λ)
    guide_anchors: int = 8            # anchors mixed into one slot's signal (nearest first)
    uncertain_threshold: float = 0.9  # committed non-anchors below this p(token) may be perturbed
    max_verify: int = 4               # perturbed slots per forward (0: no verification)
    perturb_scale: float = 0.2        # ε: perturbation size relative to |e_c|
    verify_threshold: float = 0.5     # τ_v: remask when p(token) under perturbation drops below
    perturb_seed: int = 0             # seeds the perturbation directions

    def __post_init__(self) -> None:
        for name in ("draft_threshold", "anchor_threshold", "uncertain_threshold",
                     "verify_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"decoding_params.{name} must be in [0, 1], "
                                 f"got {getattr(self, name)}")
        for name in ("anchor_steps", "guide_anchors", "max_verify"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"decoding_params.{name} must be an integer >= 0, got {value!r}")
        if self.max_draft is not None and self.max_draft < 1:
            raise ValueError("decoding_params.max_draft must be >= 1 or null")
        if self.guide_strength < 0 or self.perturb_scale < 0 or self.guide_distance <= 0:
            raise ValueError("decoding_params needs guide_strength >= 0, perturb_scale >= 0 and "
                             "guide_distance > 0")


class ASRD(Strategy):
    name = "asrd"
    params_cls = ASRDParams

    # ---- before the forward ----------------------------------------------------------------
    def embed_edits(self, state: BlockState, canvas: torch.Tensor,
                    block: tuple[int, int]) -> EmbedEdit | None:
        p, (start, end) = self.params, block
        atc = _fold_finished_block(state.memory, start)
        mem = state.extra
        if mem.get("ent") is None:
            return None                          # first forward of the block: nothing known yet
        tokens = canvas[start:end]
        masked = tokens == self.spec.mask_token_id                           # [B]
        cur = state.memory.get("block") or {}
        anchor = cur.get("anchor", torch.zeros_like(masked))
        a_pos = torch.cat([atc["pos"], start + anchor.nonzero().flatten()])  # [A] ATC positions
        a_tok = torch.cat([atc["tok"], tokens[anchor]])
        a_w = torch.cat([atc["w"], cur.get("w", torch.zeros(masked.shape))[anchor]])
        guided = masked.nonzero().flatten()                                  # [G]
        k = min(p.guide_anchors, int(a_pos.numel())) if p.guide_strength > 0 else 0
        if k and guided.numel():
            dist = ((start + guided)[:, None] - a_pos[None, :]).abs().double()   # [G, A]
            near = dist.argsort(dim=-1, stable=True)[:, :k]                      # [G, k]
            omega = a_w[near].double() * torch.exp(-dist.gather(1, near) / p.guide_distance)
            omega = omega / omega.sum(-1, keepdim=True).clamp(min=1e-12)
            mix_ids = a_tok[near]
            mix_w = p.guide_strength * (1.0 - mem["ent"][guided])[:, None] * omega
        else:
            guided = guided[:0]
            mix_ids, mix_w = torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0)
        conf = mem["conf"].masked_fill(masked | anchor | (mem["conf"] >= p.uncertain_threshold),
                                       float("inf"))
        num = min(p.max_verify, int(torch.isfinite(conf).sum()))
        pick = conf.argsort(stable=True)[:num].sort().values                 # least sure first
        mem["perturbed"] = pick
        if guided.numel() + pick.numel() == 0:
            return None
        width = mix_ids.shape[1]
        return EmbedEdit(
            positions=start + torch.cat([guided, pick]),
            mix_ids=torch.cat([mix_ids, torch.zeros(num, width, dtype=torch.long)]),
            mix_weights=torch.cat([mix_w.float(), torch.zeros(num, width)]),
            perturb=torch.cat([torch.zeros(guided.numel()), torch.full((num,),
                                                                       p.perturb_scale)]),
            seed=p.perturb_seed * 1_000_003 + start * 1_009 + state.step)

    # ---- after the forward -----------------------------------------------------------------
    def decide(self, batch: StepBatch) -> Decision:
        p = self.params
        draft_tokens, logits = propose(batch)
        probs = torch.softmax(logits.to(torch.float64), dim=-1)              # [n, W, V]
        best_p, arg = probs.max(dim=-1)                                      # [n, W]
        ent = -(probs * probs.clamp(min=1e-300).log()).sum(-1) / math.log(probs.shape[-1])
        cand_p = probs.gather(-1, draft_tokens[..., None])[..., 0]
        cand_p = cand_p.masked_fill(~batch.candidates, NEG_INF)
        draft = topk_mask(cand_p, 1)
        draft |= finite(cand_p) & (cand_p >= p.draft_threshold)
        if p.max_draft is not None:
            draft &= topk_mask(cand_p, p.max_draft)
        own = probs.gather(-1, batch.tokens.clamp(max=probs.shape[-1] - 1)[..., None])[..., 0]
        perturbed = on_device(self._perturbed(batch), own)
        fails = perturbed & ((arg != batch.tokens) | (own < p.verify_threshold))
        allowed = (draft.sum(-1) - 1).clamp(min=0)                           # progress guard
        remask = topk_mask((-own).masked_fill(~fails, NEG_INF), allowed)
        keep = perturbed & ~remask
        return Decision(commit=draft, tokens=draft_tokens, remask=remask,
                        keeps=keep.sum(-1), verified=perturbed.sum(-1),
                        state={"arg": arg, "ent": ent, "cand_p": cand_p, "own": own})

    @staticmethod
    def _perturbed(batch: StepBatch) -> torch.Tensor:
        """[n, W] bool (host): view columns perturbed in this forward (from `embed_edits`)."""
        host = batch.host
        out = torch.zeros_like(host.valid)
        first = host.in_block.long().argmax(-1)
        for i, st in enumerate(batch.states):
            pick = st.extra.pop("perturbed", None)
            if pick is not None and pick.numel():
                out[i, first[i] + pick] = True
        return out & host.in_block & ~host.masked

    def absorb(self, batch: StepBatch, decision: Decision) -> None:
        """Advance the per-slot memory of every request's block (block-relative [B] tensors)."""
        p = self.params
        arg, ent, cand_p, own = (decision.state[k] for k in ("arg", "ent", "cand_p", "own"))
        draft, draft_tokens, remask = decision.commit, decision.tokens, decision.remask
        host = batch.host
        blk = host.in_block & host.valid
        committed = (~host.masked | draft) & ~remask & blk
        token = torch.where(draft, draft_tokens, host.tokens)
        p_tok = torch.where(draft, cand_p, own)
        for i, st in enumerate(batch.states):
            b = blk[i]
            mem = st.extra
            if mem.get("ent") is None:
                size = int(b.sum())
                mem.update(arg=torch.full((size,), -1), streak=torch.zeros(size, dtype=torch.long),
                           conf=torch.zeros(size, dtype=torch.float64))
            same = arg[i][b] == mem["arg"]
            streak = torch.where(same, mem["streak"] + 1, 1).masked_fill(remask[i][b], 0)
            conf = torch.where(committed[i][b], p_tok[i][b], mem["conf"])
            anchor = (committed[i][b] & (token[i][b] == arg[i][b]) & (streak >= p.anchor_steps)
                      & (p_tok[i][b] >= p.anchor_threshold))
            mem.update(arg=arg[i][b], streak=streak, conf=conf.masked_fill(remask[i][b], 0.0),
                       ent=ent[i][b])
            st.memory["block"] = {"anchor": anchor, "tok": token[i][b], "w": 1.0 - ent[i][b]}


def _fold_finished_block(memory: dict, start: int) -> dict:
    """The ATC of finished blocks (absolute positions, tokens, weights); on entering a new block,
    the previous block's final anchors join it."""
    atc = memory.setdefault("atc", {"pos": torch.zeros(0, dtype=torch.long),
                                    "tok": torch.zeros(0, dtype=torch.long),
                                    "w": torch.zeros(0, dtype=torch.float64)})
    prev, last = memory.get("block_start"), memory.get("block")
    if prev is not None and prev != start and last is not None:
        idx = last["anchor"].nonzero().flatten()
        atc["pos"] = torch.cat([atc["pos"], prev + idx])
        atc["tok"] = torch.cat([atc["tok"], last["tok"][idx]])
        atc["w"] = torch.cat([atc["w"], last["w"][idx]])
        memory["block"] = None
    memory["block_start"] = start
    return atc
