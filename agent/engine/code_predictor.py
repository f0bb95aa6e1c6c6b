"""The code predictor's 15 residual codebooks for a batch of frames, as one loop of layer calls.

transformers' path costs a `generate()` (or, in our earlier loop, 15 model forwards each
building masks, output records and a DynamicCache) per frame and per session. Here the whole
loop runs on the decoder's own layers with a tiny static cache per batch size: every row of the
batch is at the same position at every step (a frame always starts from the talker's hidden
state and codebook 0), so one set of positions and cache indices serves all rows and is
made once. Codes stay on the device until the loop is done: one host sync per frame batch,
and nothing in the loop that a CUDA graph could not capture. With graphs on, the whole loop
(15 steps, argmax and embedding sums included) is one captured graph per batch bucket.
"""

from __future__ import annotations

import torch
from torch import nn

from agent.engine.graphing import Graphing
from agent.engine.slots import Rows, SlotKV, decoder_forward


class CodePredictorOps:
    def __init__(
        self, talker: nn.Module, device: torch.device, dtype: torch.dtype, graphing: Graphing | None = None
    ) -> None:
        predictor = talker.code_predictor
        self.body = predictor.model
        self.heads = predictor.lm_head
        self.tables = self.body.codec_embedding
        self.talker_embed = talker.get_input_embeddings()
        self.num_groups = talker.config.num_code_groups
        self.device, self.dtype = device, dtype
        # batch size -> (cache, rows per step, RoPE (cos, sin) per step); made on first use.
        self._plans: dict[int, tuple[SlotKV, list[Rows], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # Pad rows: a zero hidden state and code 0, each batch bucket has its own cache anyway.
        # Outputs cloned: the codec sums are kept per reply until its next talker step.
        self._graph = graphing.pool("code_predictor", self._run, (0.0, 0), clone_outputs=True) if graphing else None
        if self._graph is not None:
            # Every bucket's cache and plan now: a graph capture or a compiled trace must find
            # them made (an allocation inside either would be recorded, not done).
            for batch in self._graph.batch_sizes:
                self._plan(batch)

    def capture_graphs(self) -> None:
        if self._graph is None:
            return
        hidden = self.talker_embed.embedding_dim

        def example(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.zeros(batch, 1, hidden, device=self.device, dtype=self.dtype),
                torch.zeros(batch, dtype=torch.long, device=self.device),
            )

        self._graph.capture_all(example)

    def _plan(self, batch: int) -> tuple[SlotKV, list[Rows], list[tuple[torch.Tensor, torch.Tensor]]]:
        plan = self._plans.get(batch)
        if plan is None:
            # Step 1 feeds [talker hidden, embed(c0)] at positions 0, 1; step k feeds code k-1 at k.
            kv = SlotKV(self.body, batch, self.num_groups + 1, self.device, self.dtype)
            kv.reserve(self.num_groups + 1)  # now, not inside a graph capture
            rows, ropes = [], []
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)  # rotary_emb reads only its dtype
            for step in range(1, self.num_groups):
                start, n = (0, 2) if step == 1 else (step, 1)
                rows.append(Rows.make(range(batch), [start] * batch, n, self.device))
                positions = torch.arange(start, start + n, device=self.device).view(1, -1).expand(batch, -1)
                ropes.append(self.body.rotary_emb(probe, positions))
            plan = self._plans[batch] = (kv, rows, ropes)
        return plan

    def run(self, last_hidden: torch.Tensor, code0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden [B, 1, hidden] (the talker's, for code0), code0 [B] -> all 16 codes
        [B, num_groups] (code0 first) and the next talker input's codec side: the sum of the 16
        codebook embeddings [B, 1, hidden]."""
        if self._graph is not None:
            return self._graph(last_hidden, code0)
        return self._run(last_hidden, code0)

    def _run(self, last_hidden: torch.Tensor, code0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = code0.shape[0]
        kv, rows, ropes = self._plan(batch)
        c0_embed = self.talker_embed(code0.view(batch, 1))
        inputs = torch.cat([last_hidden, c0_embed], dim=1)
        codes, pieces = [code0], [c0_embed]
        for step in range(1, self.num_groups):
            hidden, _ = decoder_forward(self.body, kv, rows[step - 1], inputs, None, rope=ropes[step - 1])
            # The head on every fed position, then the last: the shapes transformers uses.
            code = self.heads[step - 1](hidden)[:, -1].argmax(-1)
            codes.append(code)
            inputs = self.tables[step - 1](code.view(batch, 1))
            pieces.append(inputs)
        return torch.stack(codes, dim=1), torch.cat(pieces, dim=1).sum(1, keepdim=True)
