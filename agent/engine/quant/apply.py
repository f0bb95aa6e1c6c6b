"""Which layers become 4-bit, and the swap itself (`quantize_model`).

Quantized: every large linear, i.e. the thinker's and talker's attention projections, their MoE
expert stacks (~85 % of the bf16 bytes), the talker's shared-expert down projection, the code
predictor's layers and its 15 codebook heads, the thinker's and talker's output heads
(`QuantScheme.heads`), and the linears of the audio and vision encoders and of code2wav's
transformer (`QuantScheme.encoders`: 2.4 GiB of bf16 together, the largest part left once the
decoders are 4-bit; biases stay float).

Kept in the model's dtype, and why (docs/quantization.md has the byte counts):
- the embeddings but the thinker's (`QuantScheme.embeddings`: its 0.58 GiB table is the largest
  float tensor left, and a lookup unpacks only the rows it reads); the talker's, the code
  predictor's and code2wav's tables are 0.13 GiB together, read inside the per-frame loop;
- norms, the routers, the talker's shared-expert gate and up projections and its one-row gate:
  they are one concatenated matmul with the router (ops/moe.py `entry`), tiny next to the
  experts, and routing decides which experts run, so its precision is worth its bytes;
- the talker's two projection MLPs (small, read per text token);
- convolutions (the encoders' stems, code2wav's upsampler: 0.3 GiB);
A row whose inputs do not split into groups (int4.group_for) also stays, and the report says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from torch import nn

from agent.engine.quant.int4 import GROUPS, group_for
from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear

CONFIG_KEY = "omni_agent_quantization"  # config.json field of a quantized checkpoint
METHODS = ("int4",)
# Sub-models whose linears are considered (module-name prefixes of the composite model).
SCOPES = ("thinker.model.language_model.", "thinker.lm_head", "talker.")
ENCODERS = ("thinker.model.audio_tower.", "thinker.model.visual.", "code2wav.")
# The talker's projections from the thinker (biased, small, read per text token).
TALKER_PROJECTIONS = ("talker.text_projection.", "talker.hidden_projection.")
# Linears kept even inside those scopes (see the module docstring).
KEPT_SUFFIXES = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")
HEADS = ("thinker.lm_head", "talker.codec_head")
EMBEDDINGS = ("thinker.model.language_model.embed_tokens",)


@dataclass(frozen=True)
class QuantScheme:
    """How a model is quantized: written into a quantized checkpoint's config.json."""

    method: Literal["int4"] = "int4"
    group: int = 128
    # The smallest group a layer whose inputs `group` does not divide may fall back to (int4.GROUPS);
    # checkpoints written before 16 existed say nothing and mean 32 (they kept such layers float).
    smallest_group: int = 16
    heads: bool = True  # the thinker's and talker's output heads too
    encoders: bool = True  # the audio and vision encoders' and code2wav's linears too
    embeddings: bool = True  # the thinker's token embedding table too

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization {self.method!r} (known: {', '.join(METHODS)})")
        if self.smallest_group not in GROUPS or self.group < self.smallest_group or self.group % 2:
            raise ValueError(
                f"group {self.group} / smallest_group {self.smallest_group}: the smallest must be one of {GROUPS}"
                " and the group an even number no smaller"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "QuantScheme":
        # A field a checkpoint's config does not name is False: its writer did not quantize it.
        return cls(
            method=data["method"],
            group=data.get("group", 128),
            smallest_group=data.get("smallest_group", 32),
            heads=data.get("heads", False),
            encoders=data.get("encoders", False),
            embeddings=data.get("embeddings", False),
        )

    @classmethod
    def of_config(cls, config: Any) -> "QuantScheme | None":
        """The scheme a checkpoint's config carries, or None for a float checkpoint."""
        data = getattr(config, CONFIG_KEY, None)
        if isinstance(data, str):
            data = json.loads(data)
        return cls.from_json(data) if data else None


@dataclass
class QuantReport:
    quantized: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (module, why)


def _in_scope(name: str, scheme: QuantScheme) -> bool:
    if name in EMBEDDINGS:
        return scheme.embeddings
    if name.startswith(ENCODERS):
        return scheme.encoders
    if not name.startswith(SCOPES) or name.endswith(KEPT_SUFFIXES) or name.startswith(TALKER_PROJECTIONS):
        return False
    return scheme.heads or name not in HEADS


def quantize_model(model: nn.Module, scheme: QuantScheme) -> QuantReport:
    """Swap the scheme's layers of a Qwen3OmniMoeForConditionalGeneration for 4-bit ones, in
    place, one module at a time (the float weight of a module is freed once its swap is done:
    peak extra memory is one module's float temporaries). On the meta device only the structure
    changes (what a quantized checkpoint is loaded into). Idempotent."""
    report = QuantReport()
    targets = [
        (name, parent, child_name, child)
        for parent_name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        for name in [f"{parent_name}.{child_name}" if parent_name else child_name]
        if _in_scope(name, scheme)
    ]
    for name, parent, child_name, child in targets:
        swapped = _swap(child, scheme, name, report)
        if swapped is not None:
            setattr(parent, child_name, swapped)
            report.quantized.append(name)
    return report


def _swap(module: nn.Module, scheme: QuantScheme, name: str, report: QuantReport) -> nn.Module | None:
    if type(module) is nn.Linear:
        group = group_for(module.in_features, scheme.group, scheme.smallest_group)
        if group is None:
            report.kept.append((name, f"{module.in_features} inputs do not split into groups"))
            return None
        return Int4Linear.from_linear(module, group)
    if type(module) is nn.Embedding:
        if name not in EMBEDDINGS:  # (the talker's scope holds its own tables: kept)
            return None
        group = group_for(module.embedding_dim, scheme.group, scheme.smallest_group)
        if group is None:
            report.kept.append((name, f"{module.embedding_dim} dims do not split into groups"))
            return None
        return Int4Embedding.from_embedding(module, group)
    if type(module).__name__.endswith("TextExperts") and hasattr(module, "gate_up_proj"):
        up, down = (
            group_for(module.gate_up_proj.shape[-1], scheme.group, scheme.smallest_group),
            group_for(module.down_proj.shape[-1], scheme.group, scheme.smallest_group),
        )
        if up is None or down is None:
            report.kept.append((name, "expert inputs do not split into groups"))
            return None
        return Int4Experts.from_experts(module, up, down)
    return None


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Int4Linear, Int4Experts, Int4Embedding)) for m in model.modules())
