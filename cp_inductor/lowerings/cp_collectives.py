"""Ulysses' all-to-alls of heads as differentiable functions of the functional collectives (and the
device checks of tables the context-parallel pass reads, ``ids_checked``, ``row_places``):
``parallel/ulysses`` runs them, and the context-parallel pass emits them into the Dynamo graph."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

# ``funcol.all_to_all_single``, not its ``_autograd`` twin: the op is differentiable itself (torch
# 2.11 on), and torch 2.11's twin wraps the result in an autograd.Function, which AOTAutograd's
# cache refuses: every restarted Ulysses job would compile again.


def scatter_heads(x: torch.Tensor, layout: str, cp: int, group) -> torch.Tensor:
    """Sequence-sharded ``x`` -> all heads' full sequence for this rank's head block, BHSD."""
    if layout == "bshd":
        b, s_l, h, d = x.shape
        # [cp, B, S_l, H/cp, D]: chunk j holds head block j, sent to rank j.
        send = x.reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = funcol.all_to_all_single(send, None, None, group)
        # recv chunk j is source rank j's sequence slice: sequence = (rank, local position).
        return recv.permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d)
    b, h, s_l, d = x.shape
    send = x.reshape(b, cp, h // cp, s_l, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_l, d)


def gather_heads(out: torch.Tensor, layout: str, cp: int, group) -> torch.Tensor:
    """BHSD output for this rank's head block -> sequence-sharded output in ``layout``."""
    b, h_l, s, d = out.shape
    s_l = s // cp
    if layout == "bshd":
        send = out.reshape(b, h_l, cp, s_l, d).permute(2, 0, 3, 1, 4).contiguous()
        recv = funcol.all_to_all_single(send, None, None, group)
        # recv chunk j is head block j of this rank's sequence slice.
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s_l, cp * h_l, d)
    send = out.reshape(b, h_l, cp, s_l, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single(send, None, None, group)
    return recv.transpose(0, 1).reshape(b, cp * h_l, s_l, d)


def tokens_at(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` with token ``t`` of each row taken from slot ``slots[b, t]`` (``[B, T]``):
    Ulysses' tokens, gathered rank after rank, put in row order and back."""
    b, h, t, d = x.shape
    return x.gather(2, slots[:, None, :, None].expand(b, h, t, d))


@torch.library.custom_op("cp_inductor::ids_checked", mutates_args=())
def ids_checked(doc_ids: torch.Tensor, positions: torch.Tensor, id_tables: list[torch.Tensor],
                position_tables: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``doc_ids``, once it is asserted on device that each of ``id_tables`` labels the
    runs of ``positions [B, T]`` that step by one (HF transformers' packed-sequence ids: rising,
    and changing exactly where the positions do not step by one) and each of
    ``position_tables`` holds the positions (HF's causal over positions remapped to them). The
    context-parallel pass reads such tables as "the documents of the position ids" and "causal"
    where the graph does not compute them (they come in from before a graph break). That reading
    is the single-device model's where the tables are functions of the position ids alone, as
    HF's are; tables that are anything else fail the step on device, never a different answer.
    An op of its own (Inductor does not compile its asserts away), whose output the plan reads:
    the check runs before the plan."""
    breaks = torch.diff(positions, dim=-1) != 1
    for table in id_tables:
        step = torch.diff(table, dim=-1)
        torch._assert_async(torch.all((step >= 0) & ((step != 0) == breaks)),
                            "context_parallel: a flex mask_mod's document table is not the runs of the position ids")
    for table in position_tables:
        torch._assert_async(torch.all(table == positions),
                            "context_parallel: a flex mask_mod's position table is not the position ids")
    return doc_ids.clone()


@ids_checked.register_fake
def _(doc_ids, positions, id_tables, position_tables):
    return torch.empty_like(doc_ids)


@torch.library.custom_op("cp_inductor::row_places", mutates_args=())
def row_places(places: torch.Tensor, start: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T]`` in ``dtype``: ``start + step * p`` for the place ``p`` in the full row of each of this
    rank's tokens (``places [B, T]``, the layout's), once it is asserted on device that every row
    of the batch was cut alike. The context-parallel pass reads a position the model makes from
    the token index (``arange(start, start + T, step)``, one for all rows) as this row of places;
    a batch whose rows were cut differently (packed rows: each row's documents balanced on their
    own) fails the step on device instead of placing some rows' tokens by another row's places.
    An op of its own: Inductor does not compile its assert away."""
    torch._assert_async(torch.all(places == places[:1]),
                        "context_parallel: the model gives every row the same positions (an arange over its "
                        "tokens) but shard_batch cut the rows differently (their documents differ): pass the "
                        "position_ids shard_batch makes to the model, or one row per batch")
    return (places[0] * step + start).to(dtype)


@row_places.register_fake
def _(places, start, step, dtype):
    return places.new_empty(places.shape[1:], dtype=dtype)


@torch.library.custom_op("cp_inductor::cu_seqlens_ids", mutates_args=())
def cu_seqlens_ids(cu_seqlens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: the document of each place of the full rows (``like``: a ``[B, T]`` table
    of them), from a varlen call's ``cu_seqlens`` over the rows flattened (document ``i`` covers
    ``cu_seqlens[i]:cu_seqlens[i + 1]``), once it is asserted on device that they are bounds of
    the whole flattened batch: from 0 to ``B * T``, rising, every row's end a bound (no document
    crosses rows). The context-parallel pass reads a varlen call's ``cu_seqlens`` input as the
    documents of the rows ``shard_batch`` cut; bounds over anything else (this rank's tokens, a
    pack of another length) fail the step on device, never a different answer. An op of its own
    (Inductor does not compile its asserts away), whose output the plan reads."""
    rows, tokens = like.shape
    cu = cu_seqlens.long()
    total = rows * tokens
    torch._assert_async(torch.all(torch.diff(cu) >= 0) & (cu[0] == 0) & (cu[-1] == total),
                        "context_parallel: a varlen call's cu_seqlens are not bounds of the full batch's tokens")
    row_ends = torch.arange(1, rows, device=cu.device) * tokens
    torch._assert_async(torch.all(torch.isin(row_ends, cu)),
                        "context_parallel: a varlen call's document crosses the end of a row")
    place = torch.arange(total, device=cu.device)
    return (torch.searchsorted(cu, place, right=True) - 1).view(rows, tokens)


@cu_seqlens_ids.register_fake
def _(cu_seqlens, like):
    return like.new_empty(like.shape, dtype=torch.int64)
