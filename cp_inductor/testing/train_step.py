"""A small CP training step: norm, QKV projection, CP attention, output projection, MLP, loss,
backward, gradient all-reduce and an SGD update, all in one function that torch.compile
captures with ``fullgraph=True``.

    model = TransformerBlock(StepConfig(), group)
    step = make_step(model, cfg, group)
    compiled = compile_step(step, backend="cp_inductor")      # mode="reduce-overhead" on GPUs
    loss = compiled(x_local, y_local)

The backward is traced in-graph (``torch.autograd.grad`` under Dynamo's ``trace_autograd_ops``),
so the whole step is one graph: forward and backward attention regions sit side by side in it.
Optimizer.step() is not used because it graph-breaks on purpose; the update is a foreach SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from .. import parallel

STYLES = ("a2a", "allgather", "ring")


@dataclass(frozen=True)
class StepConfig:
    style: str = "a2a"
    layout: str = "bshd"  # layout q/k/v have when they enter CP attention
    batch: int = 2
    seq: int = 64  # whole sequence; each rank holds seq/cp tokens
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    causal: bool = True
    lr: float = 0.1
    head_groups: int | None = None  # all-gather style: the helper's head_groups

    @property
    def load_balanced(self) -> bool:
        """All-gather and ring causal attention take the two-chunk layout (rank r: chunks r, 2cp-1-r)."""
        return self.style in ("allgather", "ring") and self.causal


class TransformerBlock(nn.Module):
    def __init__(self, cfg: StepConfig, group=None):
        super().__init__()
        if cfg.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}")
        self.cfg, self.group = cfg, group
        self.head_dim = cfg.dim // cfg.heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.wqkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def attention(self, x):  # x: [B, S/cp, dim]
        c = self.cfg
        b, s_l, _ = x.shape
        qkv = self.wqkv(self.norm1(x)).view(b, s_l, c.heads + 2 * c.kv_heads, self.head_dim)
        q, k, v = qkv.split([c.heads, c.kv_heads, c.kv_heads], dim=2)
        if c.layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if c.style == "a2a":
            o = parallel.ulysses_attention(q, k, v, group=self.group, layout=c.layout, is_causal=c.causal)
        elif c.style == "ring":
            o = parallel.ring_attention(q, k, v, group=self.group, layout=c.layout, is_causal=c.causal)
        else:
            o = parallel.allgather_attention(
                q, k, v, group=self.group, layout=c.layout, is_causal=c.causal, load_balanced=c.load_balanced,
                head_groups=c.head_groups,
            )
        if c.layout == "bhsd":
            o = o.transpose(1, 2)
        return self.wo(o.flatten(2))

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.mlp(self.norm2(x))


def make_step(model: TransformerBlock, cfg: StepConfig, group=None):
    """``step(x, y) -> loss``: one SGD step on the mean-squared error over the whole sequence."""
    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)
    params = list(model.parameters())

    def step(x, y):
        loss = F.mse_loss(model(x), y)  # this rank's slice; the global loss is the mean over ranks
        grads = torch.autograd.grad(loss, params)
        # Each rank's weight gradient covers its own tokens only: average them.
        grads = [funcol.all_reduce(g, "sum", group) / cp for g in grads]
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-cfg.lr)
        return funcol.all_reduce(loss.detach(), "sum", group) / cp

    return step


def compile_step(step, mode=None, options=None, **compile_kwargs):
    """torch.compile the step with the backward traced in-graph (fullgraph). ``mode`` and
    ``options`` may come together: torch.compile refuses both, so the mode's Inductor settings
    are merged into the options (what the backend does with a mode anyway)."""
    if mode is not None and options:
        options, mode = {**torch._inductor.list_mode_options(mode), **options}, None
    compiled = torch.compile(step, fullgraph=True, mode=mode, options=options, **compile_kwargs)

    def run(*args):
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args)

    return run


def step_inputs(cfg: StepConfig, rank: int, cp: int, seed: int = 0, device="cpu"):
    """This rank's slice of a full-sequence input and target, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g)
    y = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g)
    return tuple(parallel.shard_sequence(t, 1, rank, cp, load_balanced=cfg.load_balanced).to(device) for t in (x, y))


def compare_with_eager(
    rank: int, cp: int, cfg: StepConfig, steps=3, device="cpu", backend="cp_inductor", mode=None, options=None,
    dtype=torch.float32,
):
    """Run ``steps`` compiled steps and the same steps eagerly from the same weights; return the
    losses of both, the largest parameter difference and the report."""
    import cp_inductor
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    eager_model = TransformerBlock(cfg).to(device=device, dtype=dtype)
    compiled_model = TransformerBlock(cfg).to(device=device, dtype=dtype)
    compiled_model.load_state_dict(eager_model.state_dict())
    x, y = (t.to(dtype) for t in step_inputs(cfg, rank, cp, device=device))
    eager_step = make_step(eager_model, cfg)
    compiled_step = compile_step(make_step(compiled_model, cfg), backend=backend, mode=mode, options=options)
    cp_inductor.clear_report()
    eager_losses = [float(eager_step(x, y)) for _ in range(steps)]
    compiled_losses = [float(compiled_step(x, y)) for _ in range(steps)]
    with torch.no_grad():
        diff = max(
            float((a - b).abs().max()) for a, b in zip(eager_model.parameters(), compiled_model.parameters())
        )
    return {
        "eager": eager_losses, "compiled": compiled_losses, "max_param_diff": diff,
        "report": cp_inductor.report(), "rewritten": dict(counters["cp_inductor"]),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraphs_recorded": _cudagraphs_recorded(device),
    }


def _cudagraphs_recorded(device) -> int:
    """How many CUDA graphs Inductor's cudagraph trees recorded on this device (0 off CUDA)."""
    if torch.device(device).type != "cuda":
        return 0
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else next(manager.graph_counter)
