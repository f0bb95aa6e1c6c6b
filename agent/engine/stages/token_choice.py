"""A stage's token choice as a step of its own: compiled and graphed like the engine's others.

The thinker's and the talker's decode steps end in logits, which the host needs anyway (the
thinker's token is detokenized, the talker's tested for codec EOS). Choosing the token is a
small step of its own over those logits: repetition penalty, suppressed ids, then argmax, or
temperature, top-k, top-p, softmax and the seeded race (agent/engine/ops/sampling.py). Sampled, that
is ~30 kernels over the vocabulary, so with graphs on it is compiled (fused) and captured per
batch bucket like the decode steps, its per-row inputs (the seen mask, the rows' seeds and
draw indices) graph inputs: one replay, no host sync, no RNG state. Greedy, it stays one argmax.
"""

from __future__ import annotations

import torch

from agent.decoding import Sampling
from agent.engine.compile.wiring import Graphing
from agent.engine.ops.sampling import choose, penalize


class TokenChoice:
    def __init__(
        self,
        name: str,
        sampling: Sampling,
        stage: int,
        vocab: int,
        device: torch.device,
        graphing: Graphing | None = None,
        suppress: torch.Tensor | None = None,
    ) -> None:
        """suppress: [vocab] bool, ids never chosen (generate()'s suppress_tokens)."""
        self.sampling, self.stage, self.vocab, self.device = sampling, stage, vocab, device
        self.suppress = suppress
        self.penalizes = sampling.repetition_penalty != 1.0
        # Pad rows: zero scores, nothing seen, seed and draw 0.
        self._graph = (
            graphing.pool(name, self._choose, (0.0, 0, 0, 0), clone_outputs=True, compiled=True)
            if graphing is not None and sampling.do_sample
            else None
        )

    def capture_graphs(self) -> None:
        if self._graph is None:
            return

        def example(batch: int) -> tuple[torch.Tensor, ...]:
            rows = torch.zeros(batch, dtype=torch.long, device=self.device)
            scores = torch.zeros(batch, self.vocab, dtype=torch.float32, device=self.device)
            return scores, self.no_seen(batch) if not self.penalizes else scores.bool(), rows, rows

        self._graph.capture_all(example)

    def no_seen(self, batch: int) -> torch.Tensor:
        """The seen mask of a stage without a repetition penalty: never read, one column."""
        return torch.zeros(batch, 1, dtype=torch.bool, device=self.device)

    def __call__(
        self, scores: torch.Tensor, seen: torch.Tensor | None, seeds: torch.Tensor, draws: torch.Tensor
    ) -> torch.Tensor:
        """Tokens [B] from float32 scores [B, vocab]; `seen` [B, vocab] bool (None without a
        repetition penalty); row b draws `draws[b]` of the reply seeded `seeds[b]`."""
        if seen is None:
            if self.penalizes:
                raise ValueError("a repetition penalty needs the seen ids")
            seen = self.no_seen(scores.shape[0])
        if self._graph is not None:
            return self._graph(scores, seen, seeds, draws)
        return self._choose(scores, seen, seeds, draws)

    def _choose(
        self, scores: torch.Tensor, seen: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor
    ) -> torch.Tensor:
        if self.penalizes:
            scores = penalize(scores, seen, self.sampling.repetition_penalty)
        if self.suppress is not None:
            scores = scores.masked_fill(self.suppress, float("-inf"))
        return choose(scores, self.sampling, seeds, draws, self.stage)
