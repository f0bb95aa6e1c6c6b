"""CUDAGraphed / GraphPool: graph replay must be indistinguishable from calling the step function.

Pins, on CPU with a fake capture backend (so the static-buffer copy-in/replay/copy-out logic
really runs): warm-up calls are eager, then one capture and replays that give the plain
function's outputs for fresh inputs; outputs are static buffers overwritten by the next replay
unless `clone_outputs=True`; a new input signature gets its own graph or runs eagerly, never a
wrong graph; GraphPool pads a batch up to its bucket, slices the outputs back and refuses
batches above its largest bucket; `disabled=True` and CPU tensors with the real backend always
run eagerly; a graphed wrapper called from a second thread raises. On a CUDA machine
(`-m gpu`): real graphs of a small MLP and of a talker-like step with an in-place static KV
cache equal eager execution.
"""

from __future__ import annotations

import threading

import pytest
import torch

from agent.engine.compile.capture import CUDAGraphed, GraphPool

torch.set_num_threads(1)


class FakeGraph:
    """Replays by recomputing fn on the static inputs and copying into the static outputs."""

    def __init__(self, fn, static_in, static_out):
        self.fn, self.static_in, self.static_out = fn, static_in, static_out
        self.replays = 0

    def replay(self) -> None:
        out = self.fn(*self.static_in)
        for static, new in zip(self.static_out, (out,) if isinstance(out, torch.Tensor) else out):
            static.copy_(new)
        self.replays += 1


class FakeBackend:
    def __init__(self):
        self.warmups = 0
        self.captures: list[tuple[FakeGraph, object]] = []
        self._pools = 0

    def accepts(self, tensors) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    def new_pool(self):
        self._pools += 1
        return f"pool{self._pools}"

    def warmup(self, fn, args):
        self.warmups += 1
        return fn(*args)

    def capture(self, fn, static_args, pool):
        out = fn(*static_args)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        # A real capture leaves the outputs unwritten until replay: poison them so a wrapper
        # that forgot to replay (or to copy inputs in) returns NaNs, not plausible values.
        for o in outs:
            if isinstance(o, torch.Tensor):
                o.fill_(float("nan") if o.is_floating_point() else -12345)
        graph = FakeGraph(fn, static_args, outs)
        self.captures.append((graph, pool))
        return graph, out


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()


@torch.no_grad()
def test_warmup_then_one_capture_then_replays_equal_the_plain_function():
    mlp = _mlp()
    backend = FakeBackend()
    graphed = CUDAGraphed(mlp, warmup_iters=2, backend=backend)
    for _i in range(6):
        x = torch.randn(3, 8)
        torch.testing.assert_close(graphed(x), mlp(x), rtol=0, atol=0)
    assert backend.warmups == 2
    assert graphed.stats.captures == 1 and len(backend.captures) == 1
    assert graphed.stats.replays == 4 and backend.captures[0][0].replays == 4


@torch.no_grad()
def test_outputs_are_static_buffers_overwritten_by_the_next_replay_unless_cloned():
    def fn(x):
        return x * 2, x + 1

    for clone in (False, True):
        graphed = CUDAGraphed(fn, warmup_iters=0, clone_outputs=clone, backend=FakeBackend())
        a2, a1 = graphed(torch.ones(4))
        b2, _ = graphed(torch.full((4,), 5.0))
        assert torch.equal(b2, torch.full((4,), 10.0))
        if clone:
            assert torch.equal(a2, torch.full((4,), 2.0)) and torch.equal(a1, torch.full((4,), 2.0))
        else:
            assert a2.data_ptr() == b2.data_ptr()
            assert torch.equal(a2, torch.full((4,), 10.0))


@torch.no_grad()
def test_a_new_shape_or_dtype_gets_its_own_graph_and_never_a_wrong_one():
    mlp = _mlp()
    graphed = CUDAGraphed(lambda x: mlp(x.float()), warmup_iters=0, max_graphs=3, backend=FakeBackend())
    inputs = [torch.randn(2, 8), torch.randn(5, 8), torch.randn(2, 8).double(), torch.randn(2, 8)]
    for x in inputs:
        torch.testing.assert_close(graphed(x), mlp(x.float()), rtol=0, atol=0)
    assert graphed.num_graphs == 3 and graphed.stats.captures == 3
    assert graphed.stats.refused == 0


@torch.no_grad()
def test_signatures_beyond_max_graphs_run_eagerly():
    mlp = _mlp()
    backend = FakeBackend()
    graphed = CUDAGraphed(mlp, warmup_iters=0, max_graphs=1, backend=backend)
    x1, x7 = torch.randn(1, 8), torch.randn(7, 8)
    torch.testing.assert_close(graphed(x1), mlp(x1), rtol=0, atol=0)
    torch.testing.assert_close(graphed(x7), mlp(x7), rtol=0, atol=0)
    assert graphed.num_graphs == 1 and graphed.stats.refused == 1
    # The captured graph still serves its own shape afterwards.
    torch.testing.assert_close(graphed(x1 + 1), mlp(x1 + 1), rtol=0, atol=0)
    assert backend.captures[0][0].replays == 2


@torch.no_grad()
def test_disabled_and_cpu_inputs_with_the_real_backend_run_eagerly():
    mlp = _mlp()
    backend = FakeBackend()
    disabled = CUDAGraphed(mlp, warmup_iters=0, disabled=True, backend=backend)
    real = CUDAGraphed(mlp, warmup_iters=0)  # CudaBackend: CPU tensors are never graphed
    for _ in range(3):
        x = torch.randn(2, 8)
        torch.testing.assert_close(disabled(x), mlp(x), rtol=0, atol=0)
        torch.testing.assert_close(real(x), mlp(x), rtol=0, atol=0)
    assert backend.warmups == 0 and not backend.captures
    assert disabled.stats.eager == 3 and real.stats.eager == 3
    assert real.num_graphs == 0


@torch.no_grad()
def test_graphed_calls_are_bound_to_the_first_thread():
    graphed = CUDAGraphed(lambda x: x + 1, warmup_iters=0, backend=FakeBackend())
    graphed(torch.zeros(2))
    errors: list[BaseException] = []

    def other():
        try:
            graphed(torch.zeros(2))
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "thread" in str(errors[0])
    # Eager paths are not bound: a disabled wrapper works from any thread.
    eager = CUDAGraphed(lambda x: x + 1, disabled=True)
    eager(torch.zeros(1))
    t = threading.Thread(target=lambda: errors.append(eager(torch.zeros(1))))
    t.start()
    t.join()
    assert torch.equal(errors[-1], torch.ones(1))


def test_rejects_non_tensor_arguments_and_outputs():
    graphed = CUDAGraphed(lambda x: [x, 3], warmup_iters=0, backend=FakeBackend())
    with pytest.raises(TypeError):
        graphed(torch.zeros(1), 3)
    with pytest.raises(TypeError):
        graphed(torch.zeros(1))


@torch.no_grad()
def test_graph_pool_pads_to_the_bucket_and_slices_back():
    mlp = _mlp()
    backend = FakeBackend()

    def step(x, pos):
        return mlp(x) + pos.unsqueeze(-1), pos + 1

    pool = GraphPool(step, (1, 2, 4, 8), pad_values=(0.0, 99), warmup_iters=1, backend=backend)
    for batch in (3, 3, 1, 1, 4, 2, 2, 3, 8, 8):
        x, pos = torch.randn(batch, 8), torch.arange(batch)
        out, nxt = pool(x, pos)
        assert out.shape == (batch, 8) and nxt.shape == (batch,)
        ref_out, ref_nxt = step(x, pos)
        # Padding changes the matmul's row blocking: equal up to rounding, not bitwise.
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        assert torch.equal(nxt, ref_nxt)
    # Buckets used: 4 (for 3 and 4), 1, 2, 8; all in one shared pool.
    assert sorted(k[0][0][0] for k in pool._state.graphs) == [1, 2, 4, 8]
    assert len({p for _, p in backend.captures}) == 1
    # A batch of 3 in the bucket-4 graph: the 4th row holds the pad values, not stale data.
    graph4 = next(g for g, _ in backend.captures if g.static_in[0].shape[0] == 4)
    pool(torch.randn(4, 8), torch.arange(4))
    pool(torch.randn(3, 8), torch.arange(3))
    assert torch.equal(graph4.static_in[0][3], torch.zeros(8)) and graph4.static_in[1][3].item() == 99


@torch.no_grad()
def test_graph_pool_runs_batches_above_its_largest_bucket_eagerly():
    backend = FakeBackend()
    pool = GraphPool(lambda x: x * 3, (1, 2), warmup_iters=0, backend=backend)
    x = torch.randn(5, 2)
    torch.testing.assert_close(pool(x), x * 3)
    assert pool.stats.refused == 1 and not backend.captures
    with pytest.raises(ValueError):
        pool(torch.zeros(2, 1), torch.zeros(3, 1))


@torch.no_grad()
def test_graph_pool_capture_all_captures_largest_first():
    backend = FakeBackend()
    pool = GraphPool(lambda x: x * 3, (1, 2, 4), warmup_iters=2, backend=backend)
    pool.capture_all(lambda b: (torch.zeros(b, 2),))
    assert [g.static_in[0].shape[0] for g, _ in backend.captures] == [4, 2, 1]
    assert backend.warmups == 6
    x = torch.randn(2, 2)
    torch.testing.assert_close(pool(x), x * 3)
    assert pool.stats.captures == 3 and pool.stats.warmup == 6


def test_graph_pool_refuses_outputs_without_the_batch_on_dim_0():
    pool = GraphPool(lambda x: x.sum(0), (1, 2, 4), warmup_iters=0, backend=FakeBackend())
    with pytest.raises(ValueError):
        pool(torch.randn(2, 3))


# ---------------------------------------------------------------------------------------------
# Real CUDA graphs (skipped without a GPU).

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_gpu_mlp_graph_equals_eager():
    mlp = _mlp().cuda()
    graphed = CUDAGraphed(mlp, warmup_iters=2)
    for _ in range(6):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(graphed(x), mlp(x), rtol=1e-6, atol=1e-6)
    assert graphed.stats.captures == 1 and graphed.stats.replays == 4


class TalkerLikeStep(torch.nn.Module):
    """One decode step with a static KV cache written in place at a position tensor."""

    def __init__(self, hidden=64, vocab=96, max_len=32, batch=2):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden) for _ in range(3))
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.SiLU(), torch.nn.Linear(4 * hidden, hidden)
        )
        self.head = torch.nn.Linear(hidden, vocab)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.register_buffer("k_cache", torch.zeros(batch, max_len, hidden))
        self.register_buffer("v_cache", torch.zeros(batch, max_len, hidden))

    def forward(self, token, pos):  # token, pos: [B] long
        x = self.embed(token)
        rows = torch.arange(token.shape[0], device=token.device)
        self.k_cache[rows, pos] = self.k(x)
        self.v_cache[rows, pos] = self.v(x)
        mask = torch.arange(self.k_cache.shape[1], device=pos.device)[None, :] <= pos[:, None]
        attn = torch.nn.functional.scaled_dot_product_attention(
            self.q(x)[:, None, None], self.k_cache[:, None], self.v_cache[:, None], attn_mask=mask[:, None, None]
        )[:, 0, 0]
        h = x + attn
        h = h + self.mlp(h)
        logits = self.head(h)
        return logits, logits.argmax(-1)


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_gpu_talker_like_step_graph_equals_eager():
    torch.manual_seed(0)
    eager = TalkerLikeStep().cuda().eval()
    graphed_model = TalkerLikeStep().cuda().eval()
    graphed_model.load_state_dict(eager.state_dict())
    step = CUDAGraphed(graphed_model, warmup_iters=2, clone_outputs=True)
    tok_e = tok_g = torch.tensor([1, 2], device="cuda")
    for t in range(12):
        pos = torch.full((2,), t, device="cuda")
        logits_e, tok_e = eager(tok_e, pos)
        logits_g, tok_g = step(tok_g, pos)
        torch.testing.assert_close(logits_g, logits_e, rtol=1e-5, atol=1e-5)
        assert torch.equal(tok_g, tok_e)
    torch.testing.assert_close(graphed_model.k_cache, eager.k_cache, rtol=1e-5, atol=1e-5)
    assert step.stats.captures == 1 and step.stats.replays == 10


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_gpu_graph_pool_per_batch_size_equals_eager():
    mlp = _mlp().cuda()
    pool = GraphPool(mlp, (1, 2, 4, 8), warmup_iters=1)
    pool.capture_all(lambda b: (torch.zeros(b, 8, device="cuda"),))
    assert pool.stats.captures == 4
    for batch in (1, 3, 8, 5, 2):
        x = torch.randn(batch, 8, device="cuda")
        torch.testing.assert_close(pool(x), mlp(x), rtol=1e-6, atol=1e-6)
    # capture_all's capturing calls replay once each, then the five calls above.
    assert pool.stats.captures == 4 and pool.stats.replays == 4 + 5
