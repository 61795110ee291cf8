"""Shared-prompt packing: a micro-batch's completions of one prompt run as one sequence.

Each run of consecutive rows with the same prompt becomes one row `[prompt | c_1 | c_2 | ...]`
(padding removed, right-padded to L), with a block attention mask (completions see the prompt and
their own earlier tokens) and position ids that restart after the prompt, so every completion token
sees the keys and positions it sees unpacked: the same log-probs, and the prompt's gradient summed
over its completions. `packed_completion_hidden` returns the same (B, C, H) as the unpacked pass.
Only sdpa, eager and flex_attention take the mask; `packing_supported`, `probe_packing` and
`resolve_pack_prompts` decide where packing runs, `packing_pays` whether it saves work.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .batch import Batch
from .model import decoder_of, position_ids_for

log = logging.getLogger(__name__)

PAD_SEGMENT = -1  # segment id of right padding; 0 is the prompt, b + 1 is the completion of row b
MASKED_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")  # attention that takes an arbitrary 4D mask
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")
_FIX = "set train.pack_prompts=false, or model.attn_implementation=sdpa"


class PackingError(ValueError):
    """Shared-prompt packing was asked for where the model cannot take its mask or positions."""


@dataclass
class Packed:
    """A micro-batch packed one prompt group per row (all on the CPU until `to`)."""

    input_ids: Tensor  # (R, L) long, right-padded by repeating the row's last token
    position_ids: Tensor  # (R, L) long: prompt 0..p-1, each completion p..p+n-1, padding 0
    segment_ids: Tensor  # (R, L) long: 0 prompt, b + 1 completion of row b, -1 padding
    gather: Tensor  # (B, C) long: flat index into (R * L) of the hidden state predicting each token

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to(self, device: torch.device) -> "Packed":
        return Packed(*(t.to(device, non_blocking=True) for t in
                        (self.input_ids, self.position_ids, self.segment_ids, self.gather)))

    def visible(self) -> Tensor:
        """(R, 1, L, L) bool: query token q may attend to key token k."""
        seg = self.segment_ids
        L = seg.shape[1]
        idx = torch.arange(L, device=seg.device)
        causal = idx[:, None] >= idx[None, :]  # (L, L)
        sq, sk = seg[:, :, None], seg[:, None, :]  # (R, L, 1), (R, 1, L)
        see = causal & ((sk == 0) | (sk == sq)) & (sq != PAD_SEGMENT) & (sk != PAD_SEGMENT)  # (R, L, L)
        see |= torch.eye(L, dtype=torch.bool, device=seg.device)  # padding attends to itself: no empty row
        return see[:, None]

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> Union[Tensor, BlockMask]:
        """The mask in the form `attn_implementation` takes it, built on the tensors' device."""
        if attn_implementation == "sdpa":
            return self.visible()  # (R, 1, L, L) bool
        if attn_implementation == "eager":  # eager adds the mask to the scores
            return torch.zeros((), dtype=dtype, device=self.segment_ids.device).masked_fill(
                ~self.visible(), torch.finfo(dtype).min)  # (R, 1, L, L) additive
        if attn_implementation == "flex_attention":
            return self.block_mask()
        raise PackingError(f"attention implementation {attn_implementation!r} cannot take the packed "
                           f"(block) attention mask; {_FIX}")

    def block_mask(self) -> BlockMask:
        """The same mask as a flex_attention BlockMask (fully masked blocks are skipped)."""
        seg = self.segment_ids
        R, L = seg.shape

        def mask_mod(b, h, q, k):
            sq, sk = seg[b, q], seg[b, k]
            keep = (k <= q) & ((sk == 0) | (sk == sq)) & (sq != PAD_SEGMENT) & (sk != PAD_SEGMENT)
            return keep | (q == k)

        return create_block_mask(mask_mod, B=R, H=None, Q_LEN=L, KV_LEN=L, device=seg.device)

    def gather_hidden(self, hidden: Tensor) -> Tensor:
        """(R, L, H) packed hidden states -> (B, C, H) at the positions predicting each completion token."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # (R * L, H)
        B, C = self.gather.shape
        return flat.index_select(0, self.gather.reshape(-1)).view(B, C, -1)  # backward sums shared rows


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """(B,) long: group index of each row; a new group starts where the prompt differs from the row above."""
    mask = prompt_mask.bool()
    same = (mask[1:] == mask[:-1]).all(1) & ((prompt_ids[1:] == prompt_ids[:-1]) | ~mask[1:]).all(1)  # (B - 1,)
    return torch.cat([same.new_zeros(1, dtype=torch.long), (~same).long().cumsum(0)])


def pack(mb: Batch) -> Packed:
    """Pack a micro-batch (rows of one prompt consecutive); the layout is built on the CPU.

    Only completion tokens under completion_mask are packed, which must therefore be a prefix of each
    row (as eos_mask makes it). Tokens beyond it gather the prompt's last hidden state: any valid
    row does, since their loss is masked; the (B, C, H) shape stays that of the unpacked pass.
    """
    prompt_ids, prompt_mask = mb.prompt_ids.cpu(), mb.prompt_mask.cpu().bool()  # (B, P)
    completion_ids, completion_mask = mb.completion_ids.cpu(), mb.completion_mask.cpu().bool()  # (B, C)
    B, C = completion_ids.shape
    lengths = completion_mask.sum(1)  # (B,)
    if not torch.equal(completion_mask, torch.arange(C)[None, :] < lengths[:, None]):
        raise PackingError("packing needs completion_mask to be a prefix of each row (tokens up to EOS); "
                           "got holes in it. Set train.pack_prompts=false")
    if not prompt_mask.any(1).all():
        raise PackingError("packing needs at least one prompt token per row (the last prompt token "
                           "predicts the first completion token). Set train.pack_prompts=false")
    groups = prompt_groups(prompt_ids, prompt_mask).tolist()
    rows: list[tuple[list[Tensor], list[Tensor], list[Tensor]]] = []  # per packed row: ids, positions, segments
    local = torch.empty(B, C, dtype=torch.long)  # index inside the packed row
    row_of = torch.empty(B, dtype=torch.long)
    cursor = p = 0
    for b in range(B):
        if b == 0 or groups[b] != groups[b - 1]:
            prompt = prompt_ids[b][prompt_mask[b]]
            p = len(prompt)
            rows.append(([prompt], [torch.arange(p)], [torch.zeros(p, dtype=torch.long)]))
            cursor = p
        n = int(lengths[b])
        ids, pos, seg = rows[-1]
        ids.append(completion_ids[b, :n])
        pos.append(torch.arange(p, p + n))
        seg.append(torch.full((n,), b + 1, dtype=torch.long))
        local[b] = p - 1  # token 0 and the unpacked tail: the last prompt token
        if n > 1:
            local[b, 1:n] = cursor + torch.arange(n - 1)  # token j: token j - 1 of c_b
        row_of[b] = len(rows) - 1
        cursor += n
    L = max(sum(len(t) for t in ids) for ids, _, _ in rows)
    R = len(rows)
    input_ids = torch.zeros(R, L, dtype=torch.long)
    position_ids = torch.zeros(R, L, dtype=torch.long)
    segment_ids = torch.full((R, L), PAD_SEGMENT, dtype=torch.long)
    for r, (ids, pos, seg) in enumerate(rows):
        n = sum(len(t) for t in ids)
        input_ids[r, :n], position_ids[r, :n], segment_ids[r, :n] = torch.cat(ids), torch.cat(pos), torch.cat(seg)
        input_ids[r, n:] = input_ids[r, n - 1]  # any valid id; padding attends only to itself
    gather = row_of[:, None] * L + local  # (B, C)
    return Packed(input_ids, position_ids, segment_ids, gather)


def packed_completion_hidden(decoder: nn.Module, mb: Batch, *, device: Optional[torch.device] = None,
                             embed_on_cpu: bool = False) -> Tensor:
    """Hidden states at the positions that predict the completion tokens, packed: (B, C, H).

    The same tensor as the unpacked `completion_hidden` (up to rounding). `device` is where the
    decoder runs (default: the batch's); `embed_on_cpu` looks the tokens up in a CPU-resident
    embedding table and sends the embeddings (the streamed reference model).
    """
    impl = check_packing_supported(decoder.config)
    packed = pack(mb)
    window = sliding_window(decoder.config)
    if window is not None and int(packed.position_ids.max()) >= window:
        raise PackingError(f"a sequence reaches the sliding window ({window} tokens), which the packed mask "
                           "does not apply; set train.pack_prompts=false")
    device = device or mb.completion_ids.device
    embed = decoder.get_input_embeddings()
    mask_dtype = embed.weight.dtype  # transformers builds eager masks in the embeddings' dtype
    on_device = packed.to(device)
    if embed_on_cpu:
        inputs = dict(inputs_embeds=embed(packed.input_ids).to(device))  # (R, L, H)
    else:
        inputs = dict(input_ids=on_device.input_ids)
    hidden = decoder(**inputs, attention_mask=on_device.attention_mask(impl, mask_dtype),
                     position_ids=on_device.position_ids, use_cache=False).last_hidden_state  # (R, L, H)
    return on_device.gather_hidden(hidden)  # (B, C, H)


@dataclass
class TokenCounts:
    """Decoder positions of one micro-batch, unpacked and packed (for logs, the profiler and the planner)."""

    rows: int  # B unpacked rows
    length: int  # P + C
    packed_rows: int  # R
    packed_length: int  # L

    @property
    def unpacked(self) -> int:
        return self.rows * self.length

    @property
    def packed(self) -> int:
        return self.packed_rows * self.packed_length

    @property
    def unpacked_pairs(self) -> int:
        """(query, key) scores sdpa computes unpacked: a padded batch gets a dense mask, so B * (P + C)^2."""
        return self.rows * self.length ** 2

    @property
    def packed_pairs(self) -> int:
        """The same packed: R * L^2 (sdpa and eager compute the masked-out blocks too)."""
        return self.packed_rows * self.packed_length ** 2

    def mask_bytes(self, element_size: int = 1) -> int:
        """Bytes of the packed (R, 1, L, L) mask: 1 per element for sdpa (bool), 2 or 4 for eager."""
        return self.packed_rows * self.packed_length ** 2 * element_size


def token_counts(mb: Batch) -> TokenCounts:
    """What packing saves on this micro-batch (the layout only; nothing runs)."""
    R, L = pack(mb).shape
    B = mb.completion_ids.shape[0]
    return TokenCounts(B, mb.prompt_ids.shape[1] + mb.completion_ids.shape[1], R, L)


def planned_token_counts(micro_batch: int, num_generations: int, prompt_length: int,
                         completion_length: int) -> TokenCounts:
    """Worst case for `micro_batch` consecutive completions (G = num_generations per prompt), all at full
    length, anywhere in the batch: spanning r prompts, the longest row holds min(G, b - r + 1)
    completions; r runs from ceil(b / G) (aligned) to ceil((b - 1) / G) + 1."""
    b, G, P, C = micro_batch, num_generations, prompt_length, completion_length
    spans = range(-(-b // G), min(b, -(-(b - 1) // G) + 1) + 1)
    r = max(spans, key=lambda r: r * (P + min(G, b - r + 1) * C))
    return TokenCounts(b, P + C, r, P + min(G, b - r + 1) * C)


def packing_pays(counts: TokenCounts, layer_weights: int, attention_width: int, attn_implementation: str) -> bool:
    """Whether packing does less decoder work than not, per layer, for these counts (auto mode).

    The linear maps cost ~2 x layer_weights FLOPs per position; sdpa and eager attention cost
    ~4 x attention_width (heads x head_dim) per (query, key) pair, masked-out pairs included, so long
    completions packed G to a row can cost more in attention than the repeated prompt saves.
    flex_attention skips the empty blocks: there, fewer positions always pays.
    """
    if counts.packed >= counts.unpacked:
        return False
    if attn_implementation == "flex_attention":
        return True
    work = lambda positions, pairs: 2 * layer_weights * positions + 4 * attention_width * pairs  # noqa: E731
    return work(counts.packed, counts.packed_pairs) < work(counts.unpacked, counts.unpacked_pairs)


def _layer_shape(config) -> tuple[int, int]:
    """(weights of one decoder layer's linear maps, heads x head_dim) from a transformers config."""
    config = _text_config(config)
    H, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or H // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or 4 * H
    return 2 * H * heads * head_dim + 2 * H * kv * head_dim + 3 * H * inter, heads * head_dim  # q, o, k, v, MLP


class Packing(enum.Enum):
    """Where the log-prob passes run each prompt once for its completions (train.pack_prompts, resolved)."""
    OFF = "off"  # never: pack_prompts=false, or the model cannot take it
    ALWAYS = "always"  # every micro-batch: pack_prompts=true
    AUTO = "auto"  # each micro-batch where it does less work (packing_pays): pack_prompts unset

    @classmethod
    def resolve(cls, setting: Optional[bool], model: nn.Module, max_length: Optional[int] = None) -> "Packing":
        """train.pack_prompts on `model` -> the mode (resolve_pack_prompts says which models can pack)."""
        if not resolve_pack_prompts(setting, model, max_length=max_length):
            return cls.OFF
        return cls.ALWAYS if setting else cls.AUTO


def should_pack(packing: Packing, mb: Batch, decoder: nn.Module) -> bool:
    """Whether to pack this micro-batch."""
    if not isinstance(packing, Packing):
        raise TypeError(f"packing must be a Packing (OFF, ALWAYS or AUTO), not {packing!r}")
    if packing is Packing.AUTO:
        impl = _text_config(decoder.config)._attn_implementation or "eager"
        return packing_pays(token_counts(mb), *_layer_shape(decoder.config), impl)
    return packing is Packing.ALWAYS


# ----- which models can take it --------------------------------------------------------------------

def _text_config(config):
    return getattr(config, "text_config", None) or config


def packing_supported(model_or_config, max_length: Optional[int] = None) -> tuple[bool, str]:
    """(supported, reason) from the config alone: the attention implementation and the layer types.

    `max_length` (prompt + completion) lets a sliding-window model pack when no sequence reaches the
    window (the window is then a no-op in both layouts); without it such models are refused.
    """
    config = _text_config(getattr(model_or_config, "config", model_or_config))
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_IMPLEMENTATIONS:
        return False, (f"attention implementation {impl!r} cannot take the packed (block) attention mask "
                       f"(only {', '.join(MASKED_IMPLEMENTATIONS)} can); {_FIX}")
    if getattr(config, "is_encoder_decoder", False):
        return False, f"{config.model_type} is an encoder-decoder model; set train.pack_prompts=false"
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted(set(layer_types) - set(_ATTENTION_LAYERS))
    if other:
        return False, (f"{config.model_type} has {', '.join(other)} layers, which do not attend through the "
                       "mask (packed completions would see each other); set train.pack_prompts=false")
    if getattr(config, "attention_chunk_size", None):
        return False, f"{config.model_type} uses chunked attention; set train.pack_prompts=false"
    window = sliding_window(config)
    if window is not None and (max_length is None or max_length > window):
        return False, (f"{config.model_type} has sliding-window attention (window {window}), which a ready 4D "
                       "mask replaces" + ("" if max_length is None else f" and sequences of {max_length} reach")
                       + "; set train.pack_prompts=false")
    return True, ""


def sliding_window(config) -> Optional[int]:
    """The attention window of a model with sliding-window layers, else None."""
    config = _text_config(config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        slides = "sliding_attention" in layer_types
    else:
        slides = getattr(config, "use_sliding_window", True) is not False
    return int(window) if slides and window else None


def check_packing_supported(config) -> str:
    """The attention implementation, or PackingError if packing cannot run on `config`."""
    ok, reason = packing_supported(config, max_length=0)  # the caller checks a window against its lengths
    if not ok:
        raise PackingError(reason)
    return _text_config(config)._attn_implementation or "eager"


@torch.no_grad()
def probe_packing(decoder: nn.Module) -> str:
    """'' if a tiny packed batch gives the unpacked hidden states through this decoder, else why not.

    Two prompts of different lengths (left padding), three completions of different lengths: about
    twenty tokens, on the decoder's own device and dtype. Catches decoders that ignore position_ids
    or rebuild their own mask; the tolerance allows bf16 rounding, not a wrong mask.
    """
    param = next(decoder.parameters())
    vocab = decoder.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(vocab, 3), vocab, (3, 8), generator=g)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    prompt_ids = torch.cat([ids[:1, :4].expand(2, 4), ids[2:, :4]])
    mb = Batch(prompt_ids, prompt_mask, ids[:, 4:], completion_mask, torch.zeros(3, dtype=torch.bool)).to(param.device)
    was_training = decoder.training
    decoder.eval()
    try:
        attention = torch.cat([mb.prompt_mask, mb.completion_mask], 1)  # (3, 8)
        full = decoder(input_ids=torch.cat([mb.prompt_ids, mb.completion_ids], 1), attention_mask=attention,
                       position_ids=position_ids_for(attention), use_cache=False).last_hidden_state[:, 3:7]
        packed = packed_completion_hidden(decoder, mb)  # (3, 4, H)
    finally:
        decoder.train(was_training)
    keep = mb.completion_mask
    diff = (packed[keep].float() - full[keep].float()).norm(dim=-1) / full[keep].float().norm(dim=-1).clamp(min=1e-6)
    tol = 1e-3 if param.dtype == torch.float32 else 5e-2
    err = diff.max().item()
    if not err <= tol:
        return (f"{type(decoder).__name__} gives different hidden states packed than unpacked (relative error "
                f"{err:.2e} > {tol:.0e}): it does not honour the packed mask or position ids")
    return ""


def resolve_pack_prompts(setting: Optional[bool], model: nn.Module, max_length: Optional[int] = None,
                         probe: bool = True) -> bool:
    """train.pack_prompts -> whether to pack. None: wherever supported; True: PackingError where not.

    `model` is the causal LM (or its decoder) where it will run; `max_length` is max_prompt_length +
    max_completion_length. With `probe` a ~20-token packed-vs-unpacked forward confirms the decoder
    honours the mask and positions.
    """
    if setting is False:
        return False
    ok, reason = packing_supported(model, max_length)
    probed = ok and probe
    if probed:
        decoder = decoder_of(model) or model
        reason = probe_packing(decoder)
        ok = not reason
    if ok:
        return True
    if setting:
        raise PackingError(f"train.pack_prompts=true: {reason}")
    # a config we accept whose decoder still fails the probe is news; an unsupported kernel is not
    (log.warning if probed else log.info)("shared-prompt packing off: %s", reason)
    return False
