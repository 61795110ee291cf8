"""The GRPO loss's settings, bound once: every scalar of the loss in one frozen, checked object.

    settings = GRPOLossSettings(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    loss, metrics = linear_grpo_loss(hidden, weight, ids, advantages, mask=mask, ref_logp=ref, settings=settings)

`GRPOLossSettings` is checked at construction (the ranges in lowmem_grpo/ranges.py, which the config also
checks; the loss_type and importance_sampling_level enums) and derives `terms`, the per-token term's part
(`TermParams`, in the custom ops' scalar order), once. The ops (grpo_token_terms, grpo_token_loss,
linear_grpo_loss), the trainer's PolicyLoss and the Liger drop-in take one; the ops' keyword form
(`linear_grpo_loss(..., beta=0.04)`) builds one per call. Only the check that needs a tensor (beta > 0
needs ref_logp) runs per call: `check_reference`.

Design notes: docs/kernels.md ("Loss settings")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum
from typing import Mapping, Optional, Type, TypeVar

from ..ranges import BETA, DELTA, EPSILON_HIGH, EPSILON_LOW, PROBABILITY, SAPO_TEMPERATURE, TEMPERATURE


class LossType(str, Enum):
    """How per-token losses are reduced over one micro-batch (TRL's `loss_type`)."""

    GRPO = "grpo"  # mean over sequences of each sequence's token mean
    BNPO = "bnpo"  # token mean over this micro-batch
    DAPO = "dapo"  # token sum / num_items_in_batch (the caller's global token count; default: this micro-batch's)
    DR_GRPO = "dr_grpo"  # token sum / (num_sequences * max_completion_length)
    CISPO = "cispo"  # clipped, detached ratio times logp; normalised as dapo
    SAPO = "sapo"  # a sigmoid gate in place of the clip; normalised as grpo
    LUSPO = "luspo"  # PPO-clip; each sequence's token sum, mean over sequences (its length weighs it)
    VESPO = "vespo"  # a detached per-sequence gamma weight times logp; normalised as dapo


class ISLevel(str, Enum):
    """Where the importance ratio lives (TRL's `importance_sampling_level`)."""

    TOKEN = "token"  # rho_t = exp(logp_t - old_t)
    SEQUENCE = "sequence"  # GSPO: rho_i = exp(mean_t (logp_t - old_t)) for every token of sequence i


E = TypeVar("E", bound=Enum)


def parse_enum(cls: Type[E], value, name: str) -> E:
    """`value` (a member or its value) as a member of `cls`, or ValueError listing the valid values."""
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown {name} {value!r}; valid: {valid}") from None


class Variant(IntEnum):
    """Which per-token policy-gradient term the ops compute (the loss types sharing a term share a code)."""

    PPO_CLIP = 0  # grpo, bnpo, dapo, dr_grpo, luspo
    CISPO = 1
    SAPO = 2
    VESPO = 3


VARIANT_OF_LOSS_TYPE = {"grpo": Variant.PPO_CLIP, "bnpo": Variant.PPO_CLIP, "dapo": Variant.PPO_CLIP,
                        "dr_grpo": Variant.PPO_CLIP, "luspo": Variant.PPO_CLIP, "cispo": Variant.CISPO,
                        "sapo": Variant.SAPO, "vespo": Variant.VESPO}


@dataclass(frozen=True)
class TermParams:
    """The scalar settings of the per-token terms, checked (GRPOLossSettings.terms); `delta` inf means no
    upper clamp. The custom ops take them as scalars (`op_args`) and rebuild this object inside."""

    variant: int = Variant.PPO_CLIP
    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float = math.inf
    beta: float = 0.0
    bias_kl: bool = False
    sapo_pos: float = 1.0
    sapo_neg: float = 1.05

    def op_args(self) -> tuple:
        """In the custom ops' (and the Triton kernels') argument order."""
        return (int(self.variant), self.eps_low, self.eps_high, self.delta, self.beta, self.bias_kl,
                self.sapo_pos, self.sapo_neg)


@dataclass(frozen=True)
class GRPOLossSettings:
    """Every scalar setting of the GRPO loss, TRL's names and meanings; checked at construction, then frozen.

    loss_type: a LossType or its name; importance_sampling_level: an ISLevel or its name ("sequence": GSPO).
    epsilon_low / epsilon_high: the clip range [1 - epsilon_low, 1 + epsilon_high]; epsilon_high None is
        stored as epsilon_low. beta: weight of the k3 KL penalty (> 0 needs ref_logp at each call).
    temperature: the logits are divided by it (the ops that compute log-probs; grpo_token_terms gets them).
    delta: caps the unclipped ratio (INTELLECT-2's two-sided clip); None: no cap.
    use_bias_correction_kl: k3 times the importance ratio (DeepSeek-V3.2).
    top_entropy_quantile: the policy term on the top-q tokens by entropy only (linear_grpo_loss); 1.0: all.
    sapo_temperature_pos / _neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: TRL's.
    max_completion_length: dr_grpo's per-sequence denominator (linear_grpo_loss; None: the call's T).
    terms: derived, the per-token term's TermParams.
    """

    loss_type: LossType = LossType.DAPO
    importance_sampling_level: ISLevel = ISLevel.TOKEN
    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    temperature: float = 1.0
    delta: Optional[float] = None
    use_bias_correction_kl: bool = False
    top_entropy_quantile: float = 1.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: Optional[int] = None
    terms: TermParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bind(name: str, value) -> None:
            object.__setattr__(self, name, value)

        bind("loss_type", parse_enum(LossType, self.loss_type, "loss_type"))
        bind("importance_sampling_level",
             parse_enum(ISLevel, self.importance_sampling_level, "importance_sampling_level"))
        bind("epsilon_low", EPSILON_LOW.check(self.epsilon_low, "epsilon_low"))
        bind("epsilon_high", self.epsilon_low if self.epsilon_high is None
             else EPSILON_HIGH.check(self.epsilon_high, "epsilon_high"))
        bind("beta", BETA.check(self.beta, "beta"))
        if self.delta is not None:
            bind("delta", DELTA.check(self.delta, "delta"))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            bind(name, SAPO_TEMPERATURE.check(getattr(self, name), name))
        bind("top_entropy_quantile", PROBABILITY.check(self.top_entropy_quantile, "top_entropy_quantile"))
        bind("temperature", TEMPERATURE.check(self.temperature, "temperature"))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            bind(name, float(getattr(self, name)))
        if self.max_completion_length is not None and not self.max_completion_length > 0:
            raise ValueError(f"max_completion_length must be > 0, got {self.max_completion_length}")
        bind("use_bias_correction_kl", bool(self.use_bias_correction_kl))
        bind("terms", TermParams(
            variant=VARIANT_OF_LOSS_TYPE[self.loss_type.value], eps_low=self.epsilon_low,
            eps_high=self.epsilon_high, delta=math.inf if self.delta is None else self.delta, beta=self.beta,
            bias_kl=self.use_bias_correction_kl, sapo_pos=self.sapo_temperature_pos,
            sapo_neg=self.sapo_temperature_neg))

    @property
    def variant(self) -> Variant:
        """The per-token term of `loss_type`."""
        return Variant(self.terms.variant)

    def check_reference(self, ref_logp) -> None:
        """The one per-call check: beta > 0 adds a KL penalty, which needs the reference log-probs."""
        if self.beta > 0.0 and ref_logp is None:
            raise ValueError(f"beta={self.beta} > 0 adds a KL penalty and needs ref_logp (reference-model "
                             "log-probs); pass ref_logp=... or set beta=0.0")


SETTING_NAMES = tuple(f.name for f in fields(GRPOLossSettings) if f.init)


def settings_of(settings: Optional[GRPOLossSettings], keywords: Mapping[str, object], op: str,
                accepted: tuple[str, ...], loss_type: str) -> GRPOLossSettings:
    """The settings an op runs with: `settings`, or one built from the op's keyword form (`keywords`, the
    names in `accepted`; `loss_type` is the op's default). Both at once, or an unknown keyword, is an error."""
    if settings is not None:
        if keywords:
            raise TypeError(f"{op}() got settings=... and the loss settings {', '.join(sorted(keywords))} as "
                            "keywords: pass one of the two (dataclasses.replace(settings, name=value) changes one)")
        if not isinstance(settings, GRPOLossSettings):
            raise TypeError(f"{op}(): settings must be a GRPOLossSettings, got {type(settings).__name__}")
        return settings
    unknown = sorted(set(keywords) - set(accepted))
    if unknown:
        raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r}; its loss settings are "
                        f"{', '.join(accepted)}")
    return GRPOLossSettings(**{"loss_type": loss_type, **keywords})


def check_grpo_hparams(epsilon_low: float, epsilon_high: Optional[float], beta: float,
                       ref_logp) -> tuple[float, float, float]:
    """The clip ranges and KL coefficient as floats, checked as GRPOLossSettings checks them (the ranges the
    config also checks, lowmem_grpo/ranges.py); epsilon_high None means epsilon_low."""
    settings = GRPOLossSettings(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta)
    settings.check_reference(ref_logp)
    return settings.epsilon_low, settings.epsilon_high, settings.beta


def term_params(loss_type: str, epsilon_low: float, epsilon_high: Optional[float], beta: float, ref_logp, *,
                delta: Optional[float] = None, use_bias_correction_kl: bool = False,
                sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> TermParams:
    """The per-token term's settings checked into one TermParams (GRPOLossSettings(...).terms)."""
    settings = GRPOLossSettings(loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                                delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                                sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg)
    settings.check_reference(ref_logp)
    return settings.terms
