"""The code predictor's 15 residual codebooks for a batch of frames, as one loop of layer calls.

transformers' path costs a `generate()` (or, in our earlier loop, 15 model forwards each
building masks, output records and a DynamicCache) per frame and per session. Here the whole
loop runs on the decoder's own layers with one tiny static cache shared by all batches: every row of the
batch is at the same position at every step (a frame always starts from the talker's hidden
state and codebook 0), so one write position and one key mask per step serve every row (no
per-row index). Positions, masks and RoPE tables are small tensors made once; every step reads
the cache's first 16 keys, the mask hiding those not written yet (the first step's two tokens
causal). Codes stay on the device until the loop is done: one host sync per
frame batch, and nothing in the loop that a CUDA graph could not capture. With graphs on, the
whole loop (15 steps, each code's choice and the embedding sums included: argmax, or the
seeded draw of agent/engine/ops/sampling.py from the rows' seeds and frame indices, graph inputs) is
one captured graph per batch bucket, and with compilation on one compiled function (agent/engine/compile/inductor.py).

Compiled, each step is a nested compile region (`CodeStep`): since positions and masks are
tensors, the 14 one-token steps are the same code, which inductor generates once and calls 14
times, instead of the unrolled loop's 15 x layers decoder layers (75 at real size), which made
the code predictor the longest compile of the engine's start-up. Measured on CPU
(scripts/bench_code_predictor.py --steps; bench/results/code-predictor-steps-cpu-2026-12-05.txt):
at real width and depth (5 layers) the cold compile takes 87 s against 322 s unrolled, for 977
scheduled kernels a loop against 963 (the region's inputs and outputs are materialised where the
unrolled loop fused across steps).

Launches are what the loop costs (15 steps x 5 layers at real size), so each layer's q/k/v
projections are one matmul and its gate/up projections another, over weights concatenated once
here (`FusedWeights`, owned by the engine: ~105 MB at real size in bf16; the transformers
modules keep theirs, untouched). Compiled, every projection is a reduction inductor generates
(agent/engine/ops/gemv.py) instead of a library matmul, so each layer's two RMSNorms, both residual
adds and the final norm before each head are fused into the projections' own kernels
(`GraphConfig.fused_gemv`). Results equal the separate projections up to float rounding
(tests/unit/test_compiled.py, test_streaming_exact.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from agent.decoding import GREEDY, Sampling
from agent.engine.compile.wiring import Graphing
from agent.engine.ops.gemv import check_norm, linear, normed_linear
from agent.engine.ops.sampling import CODE_PREDICTOR, RESIDUAL_GROUPS, choose, penalize, race_noise
from agent.engine.ops.slots import SlotKV, apply_rope
from agent.engine.quant.modules import Int4Linear, concat_rows, float_weight

# One step's inputs, made once: write positions [n], key mask [n, groups], RoPE cos and sin.
StepInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FusedWeights:
    """One layer's projections concatenated: q/k/v rows, then gate/up rows (float tensors, or
    4-bit ones for a quantized model: agent/engine/quant)."""

    qkv_rows: torch.Tensor | Int4Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    splits: tuple[int, int, int]
    gate_up_rows: torch.Tensor | Int4Linear  # [2 * intermediate, hidden]

    @property
    def qkv(self) -> torch.Tensor:
        return float_weight(self.qkv_rows)

    @property
    def gate_up(self) -> torch.Tensor:
        return float_weight(self.gate_up_rows)

    @classmethod
    def of(cls, layer: nn.Module) -> "FusedWeights":
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(m.bias is not None for m in projections):
            raise ValueError("the loop's projections assume bias-free linears (Qwen3)")
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cls(
            qkv_rows=concat_rows(parts),
            splits=tuple(p.out_features for p in parts),
            gate_up_rows=concat_rows((mlp.gate_proj, mlp.up_proj)),
        )


class CodePredictorOps:
    def __init__(
        self,
        talker: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        graphing: Graphing | None = None,
        sampling: Sampling = GREEDY,
    ) -> None:
        """sampling: how each residual code is chosen (compiled into the loop: a greedy loop and
        a sampling one are different graphs); default greedy."""
        predictor = talker.code_predictor
        self.sampling = sampling
        self.body = predictor.model
        self.heads = predictor.lm_head
        self.tables = self.body.codec_embedding
        self.talker_embed = talker.get_input_embeddings()
        self.num_groups = talker.config.num_code_groups
        self.device, self.dtype = device, dtype
        with torch.no_grad():
            self.fused = [FusedWeights.of(layer) for layer in self.body.layers]
        self.code_step = CodeStep(self.body, self.fused, sampling)
        # Compiled, the projections are reductions with the norms and residual adds fused in
        # (agent/engine/ops/gemv.py); eagerly, and with the option off, library matmuls.
        self.fused_gemv = graphing is not None and graphing.fuses_projections
        if self.fused_gemv:
            for layer, weights in zip(self.body.layers, self.fused):
                check_norm(layer.input_layernorm, weights.qkv)
                check_norm(layer.post_attention_layernorm, weights.gate_up)
            check_norm(self.body.norm, self.heads[0].weight)
            if any(head.bias is not None for head in self.heads):
                raise ValueError("fused projections assume bias-free codebook heads")
        self._kv: SlotKV | None = None
        # Per step: (the cache positions it writes [n], the keys it reads [n, 16], RoPE cos, sin).
        self._steps: list[StepInputs] = []
        # Pad rows: a zero hidden state, code 0, seed 0, frame 0 (their cache rows are rewritten
        # by every call). Outputs cloned: the codec sums are kept per reply until its next talker step.
        self._graph = (
            graphing.pool("code_predictor", self._run, (0.0, 0, 0, 0), clone_outputs=True, compiled=True)
            if graphing
            else None
        )
        if self._graph is not None:
            # The cache and RoPE tables now: a graph capture or a compiled trace must find them
            # made (an allocation inside either would be recorded, not done).
            self._plan(max(self._graph.batch_sizes))

    def capture_graphs(self) -> None:
        if self._graph is None:
            return
        hidden = self.talker_embed.embedding_dim

        def example(batch: int) -> tuple[torch.Tensor, ...]:
            rows = torch.zeros(batch, dtype=torch.long, device=self.device)
            return torch.zeros(batch, 1, hidden, device=self.device, dtype=self.dtype), rows, rows, rows

        self._graph.capture_all(example)

    def _plan(self, batch: int) -> tuple[SlotKV, list[StepInputs]]:
        """The cache (rows 0..batch-1 of it serve a call of `batch` rows: every call writes the
        positions it reads, so calls can share it) and each step's inputs: its write positions,
        key mask and RoPE (cos, sin) [1, n, dim], broadcast over the rows. Grown on demand
        eagerly; with pools it is made for the largest bucket up front, and a compiled loop then
        never depends on the batch beyond shapes."""
        if self._kv is None or self._kv.slots < batch:
            # Step 1 feeds [talker hidden, embed(c0)] at positions 0, 1; step k feeds code k-1 at k.
            self._kv = SlotKV(self.body, batch, self.num_groups + 1, self.device, self.dtype)
            self._kv.reserve(self.num_groups + 1)  # now, not inside a graph capture
        if not self._steps:
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)  # rotary_emb reads only its dtype
            keys = torch.arange(self.num_groups, device=self.device)  # 0..15: every step reads them all, masked
            for step in range(1, self.num_groups):
                start, n = (0, 2) if step == 1 else (step, 1)
                positions = torch.arange(start, start + n, device=self.device)
                cos, sin = self.body.rotary_emb(probe, positions.view(1, -1))
                self._steps.append((positions, keys.view(1, -1) <= positions.view(-1, 1), cos, sin))
        return self._kv, self._steps

    def run(
        self,
        last_hidden: torch.Tensor,
        code0: torch.Tensor,
        seeds: torch.Tensor | None = None,
        frames: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden [B, 1, hidden] (the talker's, for code0), code0 [B] -> all 16 codes
        [B, num_groups] (code0 first) and the next talker input's codec side: the sum of the 16
        codebook embeddings [B, 1, hidden]. Sampling, row b draws from the reply seeded
        seeds[b] at its frame frames[b] (both [B] int64; unused when greedy)."""
        if seeds is None or frames is None:
            seeds = frames = torch.zeros_like(code0)
        if self._graph is not None:
            return self._graph(last_hidden, code0, seeds, frames)
        return self._run(last_hidden, code0, seeds, frames)

    def _run(
        self, last_hidden: torch.Tensor, code0: torch.Tensor, seeds: torch.Tensor, frames: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = code0.shape[0]
        kv, steps = self._plan(batch)
        c0_embed = self.talker_embed(code0.view(batch, 1))
        inputs = torch.cat([last_hidden, c0_embed], dim=1)
        codes, pieces = [code0], [c0_embed]
        fused = self.fused_gemv and torch.compiler.is_compiling()
        # generate()'s code predictor starts each frame with no input_ids: a repetition penalty
        # there sees only the frame's own residual codes so far.
        penalty = self.sampling.repetition_penalty
        seen = (
            torch.zeros(batch, self.heads[0].out_features, dtype=torch.bool, device=code0.device)
            if penalty != 1.0
            else None
        )
        noise = None
        if self.sampling.do_sample:  # the frame's 15 draws' noise in one kernel (ops/sampling.py)
            draws = frames.view(-1, 1) * RESIDUAL_GROUPS + torch.arange(RESIDUAL_GROUPS, device=frames.device)
            noise = race_noise(seeds, draws, CODE_PREDICTOR, self.heads[0].out_features)
        for step, (positions, mask, cos, sin) in enumerate(steps, start=1):
            code, inputs, *penalized = self.code_step(
                kv.keys,
                kv.values,
                inputs,
                positions,
                mask,
                cos,
                sin,
                self.heads[step - 1],
                self.tables[step - 1],
                None if noise is None else noise[:, step - 1],
                seen,
                fused,
            )
            seen = penalized[0] if penalized else None
            codes.append(code)
            pieces.append(inputs)
        return torch.stack(codes, dim=1), torch.cat(pieces, dim=1).sum(1, keepdim=True)


class CodeStep(nn.Module):
    """One step of the loop: the decoder on the step's inputs (written into the cache), the
    step's head on the last position, the code chosen and its embedding, the next step's input.

    A module, its forward a nested compile region: compiled, the step's code is traced and
    generated once per input shape (two: the first step's two tokens, then the 14 one-token
    steps) and called at every step, where an unrolled loop made inductor generate 15 x layers
    decoder layers (the single longest start-up compile). Dynamo reuses a region only when
    its inputs are tensors, constants or modules, and its outputs tensors: hence a module
    holding the weights and the sampling, and no None among the outputs."""

    def __init__(self, body: nn.Module, weights: list[FusedWeights], sampling: Sampling) -> None:
        super().__init__()
        self.body = body
        self.weights = weights
        self.sampling = sampling

    def step(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        inputs: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head: nn.Module,
        table: nn.Module,
        noise: torch.Tensor | None,
        seen: torch.Tensor | None,
        fused: bool,
    ) -> tuple[torch.Tensor, ...]:
        """inputs [B, n, hidden] at cache positions `positions` [n], reading the keys `mask`
        [n, 16] allows; `noise` [B, vocab]: the race's draw (None: argmax); `seen` [B, vocab]
        bool: the repetition penalty's codes so far (None without one). Returns (code [B], its
        embedding [B, 1, hidden]) and, with a penalty, the updated `seen`."""
        batch = inputs.shape[0]
        body = self.body
        hidden = decoder_pass(body.layers, self.weights, keys, values, inputs, positions, mask, (cos, sin), fused)
        if fused:  # the final norm inside the head's reduction, the last position only
            logits = normed_linear(hidden[:, -1], body.norm, head.weight, True)
        else:  # the head on every fed position, then the last: the shapes transformers uses
            logits = head(body.norm(hidden))[:, -1]
        if seen is not None:
            logits = penalize(logits.float(), seen, self.sampling.repetition_penalty)
        if noise is not None:
            code = choose(logits.float(), self.sampling, None, None, CODE_PREDICTOR, noise)
        else:
            code = logits.argmax(-1)
        embedded = table(code.view(batch, 1))
        if seen is None:
            return code, embedded
        return code, embedded, seen.scatter(1, code.unsqueeze(1), True)

    # Compiled, every call one nested region (scripts/bench_code_predictor.py --steps compares
    # it with `step` itself, each call then inlined: the loop unrolled).
    forward = torch.compiler.nested_compile_region(step)


def decoder_pass(
    layers: nn.ModuleList,
    weights: list[FusedWeights],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    fused: bool,
) -> torch.Tensor:
    """The decoder on `hidden` [B, n, hidden], its tokens written at cache positions `positions`
    [n] of every row, attending to the keys `mask` [n, L] allows out of the cache's first L; the
    last layer's output, before the final norm. `fused`: projections as fused reductions."""
    batch, n_new, _ = hidden.shape
    cos, sin = rope
    read = mask.shape[-1]
    for i, (layer, w) in enumerate(zip(layers, weights)):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = normed_linear(hidden, layer.input_layernorm, w.qkv, fused).split(w.splits, dim=-1)
        d = attn.head_dim
        # Head counts from the weights (plain ints: the batch may be symbolic when compiled).
        heads, kv_heads = w.splits[0] // d, w.splits[1] // d
        q = apply_rope(attn.q_norm(q.view(batch, n_new, heads, d)).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_norm(k.view(batch, n_new, kv_heads, d)).transpose(1, 2), cos, sin)
        keys[i][:batch].index_copy_(2, positions, k)
        values[i][:batch].index_copy_(2, positions, v.view(batch, n_new, kv_heads, d).transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q,
            keys[i][:batch, :, :read],
            values[i][:batch, :, :read],
            attn_mask=mask,
            scale=attn.scaling,
            enable_gqa=heads != kv_heads,
        )
        hidden = hidden + linear(out.transpose(1, 2).reshape(batch, n_new, -1), attn.o_proj.weight, fused)
        gate, up = normed_linear(hidden, layer.post_attention_layernorm, w.gate_up, fused).chunk(2, dim=-1)
        hidden = hidden + linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, fused)
    return hidden
