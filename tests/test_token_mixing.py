"""token_mixing: the ops other than attention that read other tokens of the row, found by
following the token dim from the batch's per-token inputs (context parallelism the model does not
write refuses them: over one rank's tokens they would compute another answer). Each program below
is traced by Dynamo (one process, no collectives); the analysis reads the graph as the pass does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from expecttest import TestCase

from cp_inductor.passes.analysis import token_mixing

B, T, C = 2, 16, 16  # hidden width equal to the token count: a size alone cannot tell them apart
W = torch.randn(C, 1, 4)


def conv(x):  # a causal depthwise convolution over the sequence (LFM2's, Mamba's short conv)
    return F.conv1d(x.transpose(1, 2), W, groups=C, padding=3)[..., :T].transpose(1, 2)


def conv_kernel_1(x):
    return F.conv1d(x.transpose(1, 2), W[..., :1], groups=C).transpose(1, 2)


def cumsum(x):
    return x.cumsum(1)


def shift(x):  # each token reads its left neighbour
    return F.pad(x, (0, 0, 1, 0))[:, :T]


def roll(x):
    return torch.roll(x, 1, dims=1)


def softmax_over_tokens(x):
    return x.softmax(dim=1)


def token_mlp(x):  # MLP-Mixer: a linear layer across tokens
    return F.linear(x.transpose(1, 2), torch.randn(T, T)).transpose(1, 2)


def linear_attention(x):  # K^T V over the tokens, then Q of it
    heads = x.view(B, T, 4, C // 4).transpose(1, 2)
    return (heads @ (heads.transpose(-1, -2) @ heads)).transpose(1, 2).reshape(B, T, C)


def einsum_mix(x):
    return torch.einsum("btc,bsc->bsc", x, x)


def top_tokens(x):  # keep the 4 strongest tokens (a mixture-of-depths router)
    return x.topk(4, dim=1).values


def moe_dispatch(x):  # tokens sorted by expert and put back: a permutation, per token
    order = x[..., 0].flatten().argsort()
    return x.flatten(0, 1)[order][order.argsort()].view(B, T, C)


def cumsum_after_gpt2_conv1d(x):  # GPT-2's Conv1D (bias + x @ w over the flattened tokens), then a scan
    return torch.addmm(torch.zeros(C), x.view(-1, C), torch.randn(C, C)).view(B, T, C).cumsum(1)


def softmax_over_hidden(x):  # hidden == T: a size match, not the token dim
    return x.softmax(dim=-1)


def rms_norm_and_heads(x):  # a norm over the hidden dim, heads split and merged; the heads' product
    # with themselves is [T, T] token by token, cropped to the first keys: it reads other tokens
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    heads = x.view(B, T, 4, C // 4).transpose(1, 2)
    return (heads @ heads.transpose(-1, -2)[..., :C // 4]).transpose(1, 2).flatten(2)


def cumsum_over_hidden(x):
    return x.cumsum(-1)


def pad_hidden(x):
    return F.pad(x, (1, 0))[..., :C]


def loss_over_tokens(x):  # reductions over tokens are the loss's (combined across ranks by the user)
    return x.sum(1, keepdim=True).expand(B, T, C) + x.mean()


def mixing_of(program) -> str:
    found: list = []

    def backend(gm, example_inputs):
        found.append(token_mixing.first_mixing(gm, T))
        return gm

    torch._dynamo.reset()
    torch.compile(program, backend=backend, fullgraph=True)(torch.randn(B, T, C))
    return str(found[0]) if found[0] is not None else "-"


def outcomes(*programs) -> str:
    """One line per program: its name, then the op refused (``-``: none)."""
    return "\n".join(f"{p.__name__}: {mixing_of(p)}" for p in programs)


class TokenMixingTest(TestCase):
    def test_every_form_named_and_per_token_ops_left(self):
        got = outcomes(conv, conv_kernel_1, cumsum, shift, roll, softmax_over_tokens, token_mlp, linear_attention,
                       einsum_mix, top_tokens, cumsum_after_gpt2_conv1d, moe_dispatch, softmax_over_hidden,
                       rms_norm_and_heads, cumsum_over_hidden, pad_hidden, loss_over_tokens, shift_by_setitem,
                       crop_tokens, narrow_tokens, every_token_sliced)
        self.assertExpectedInline(got, """\
conv: conv1d: conv1d over the token dim, kernel 4
conv_kernel_1: -
cumsum: cumsum: cumsum along the token dim
shift: pad: pad along the token dim
roll: roll: roll along the token dim
softmax_over_tokens: softmax: softmax along the token dim
token_mlp: linear: a linear layer over the token dim
linear_attention: matmul: a matmul contracting the token dim
einsum_mix: einsum: einsum contracting the token dim (t)
top_tokens: topk: topk along the token dim
cumsum_after_gpt2_conv1d: cumsum: cumsum along the token dim
moe_dispatch: -
softmax_over_hidden: -
rms_norm_and_heads: getitem: a slice of the token dim keeping some of its tokens (a shift or a crop: [..., :4])
cumsum_over_hidden: -
pad_hidden: -
loss_over_tokens: -
shift_by_setitem: getitem: a slice of the token dim keeping some of its tokens (a shift or a crop: [:, :-1])
crop_tokens: getitem: a slice of the token dim keeping some of its tokens (a shift or a crop: [:, 2:])
narrow_tokens: narrow: narrow of the token dim keeping some of its tokens (a shift or a crop)
every_token_sliced: -""")


def shift_by_setitem(x):  # BART's shift_tokens_right: a slice of the tokens written one place on
    y = torch.zeros_like(x)
    y[:, 1:] = x[:, :-1]
    return y


def crop_tokens(x):
    return x[:, 2:].sum()


def narrow_tokens(x):
    return x.narrow(1, 0, 4).sum()


def every_token_sliced(x):  # a slice that keeps every token (HF's logits_to_keep=0: [:, 0:])
    return x[:, 0:] * 2


def conv_after_mT(x):  # .mT is a transpose (Dynamo records it as getattr)
    return F.conv1d(x.mT, W, groups=C, padding=3)[..., :T].mT


def softmax_between_mT(x):  # per token: the softmax runs over the hidden dim, moved by .mT
    return F.softmax(x.mT, dim=1).mT


def cumsum_written_in_place(x):  # read by no user: the in-place add carries it into the output
    y = x.clone()
    y.add_(x.cumsum(1))
    return y


def cumsum_into_a_slice(x):  # copied into a view of the output (DeepSeek-V3's key assembly)
    y = torch.zeros(B, T, 2 * C)
    y[..., :C].copy_(x.cumsum(1))
    return y


def permute_and_cat_by_keyword(x):
    return torch.cat(tensors=[x.permute(dims=(0, 2, 1)), x.permute(dims=(0, 2, 1))], dim=1).cumsum(-1)


def centered_over_tokens(x):  # each token minus the row's mean token
    return x - x.mean(1, keepdim=True)


def scaled_by_the_tokens_max(x):  # a pooled value through value-wise ops, then read back
    return x * x.abs().amax(dim=1, keepdim=True).float().reciprocal()


def mean_over_hidden_read_back(x):  # a norm's statistics: over the hidden dim, per token
    return x - x.mean(-1, keepdim=True)


def centered_by_a_dropped_mean(x):  # the token dim dropped by the mean, put back by indexing
    return x - x.mean(1)[:, None]


def scaled_by_an_unsqueezed_sum(x):
    return x / x.sum(dim=1).unsqueeze(1)


def norm_over_hidden(x):  # QK-norm's: over the hidden dim, p given before dim
    return x / x.norm(2, -1, keepdim=True)


def max_pooled(x):  # a reduction over tokens that is not a share: no pass makes it the full row's
    return x.amax(dim=1).sum()


def per_row_loss_over_tokens(x):  # reductions over tokens not read back: a loss's, per row
    return (x.sum(dim=(1, 2)) / x.abs().sum(dim=(1, 2))).sum()


def capacity_by_one_hot_cumsum(x):  # capacity-limited MoE routing: each token's place in its expert's queue
    experts = x.view(-1, C)[:, :4].argmax(-1)
    return (F.one_hot(experts, 4).cumsum(0) * F.one_hot(experts, 4)).sum(-1)


def one_hot_per_token(x):  # the expert of each token, one-hot: per token
    return F.one_hot(x.view(-1, C)[:, :4].argmax(-1), 4).float() * 2


class TokenMixingTrailTest(TestCase):
    def test_pooled_over_tokens_and_read_back(self):
        """A reduction over tokens that keeps their dim, read back at every token: over one rank's
        tokens it pools other numbers; a max over tokens is another number at all (sums and means
        are shares, or made the full batch's)."""
        got = outcomes(centered_over_tokens, scaled_by_the_tokens_max, mean_over_hidden_read_back,
                       centered_by_a_dropped_mean, scaled_by_an_unsqueezed_sum, per_row_loss_over_tokens, max_pooled,
                       norm_over_hidden)
        self.assertExpectedInline(got, """\
centered_over_tokens: sub: mean over the token dim, read back at every token (sub)
scaled_by_the_tokens_max: amax: amax over the token dim (this rank's tokens' alone, which no pass makes the full row's)
mean_over_hidden_read_back: -
centered_by_a_dropped_mean: sub: mean over the token dim, read back at every token (sub)
scaled_by_an_unsqueezed_sum: truediv: sum over the token dim, read back at every token (truediv)
per_row_loss_over_tokens: -
max_pooled: amax: amax over the token dim (this rank's tokens' alone, which no pass makes the full row's)
norm_over_hidden: -""")

    def test_one_hot_keeps_the_token_dim(self):
        """``one_hot`` adds a trailing dim of classes: the token dim is followed through it, so a
        scan over tokens after it (an MoE router's places in each expert's queue) is named."""
        self.assertExpectedInline(outcomes(capacity_by_one_hot_cumsum, one_hot_per_token), """\
capacity_by_one_hot_cumsum: cumsum: cumsum along the token dim
one_hot_per_token: -""")

    def test_transposes_writes_and_keywords(self):
        got = outcomes(conv_after_mT, softmax_between_mT, cumsum_written_in_place, cumsum_into_a_slice,
                       permute_and_cat_by_keyword)
        self.assertExpectedInline(got, """\
conv_after_mT: conv1d: conv1d over the token dim, kernel 4
softmax_between_mT: -
cumsum_written_in_place: cumsum: cumsum along the token dim
cumsum_into_a_slice: cumsum: cumsum along the token dim
permute_and_cat_by_keyword: cumsum: cumsum along the token dim""")

    def test_a_parameter_with_the_token_count_is_not_a_token_input(self):
        """A projection to T features (a weight ``[C, T]``, GPT-2's Conv1D layout) then a softmax
        over those features, per token. Seeded by size alone, the weight's dim 1 would pass for
        tokens and the softmax be refused; the pass seeds the program's per-token inputs only."""
        proj = torch.nn.Parameter(torch.randn(C, T))

        def project_then_softmax(x):
            return torch.addmm(torch.zeros(T), x.view(-1, C), proj).view(B, T, T).softmax(-1)

        found: list = []

        def backend(gm, example_inputs):
            per_token = [n for n, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
                         if not isinstance(x, torch.nn.Parameter)]
            found.append((token_mixing.first_mixing(gm, T), token_mixing.first_mixing(gm, T, inputs=per_token)))
            return gm

        torch._dynamo.reset()
        torch.compile(project_then_softmax, backend=backend, fullgraph=True)(torch.randn(B, T, C))
        every_input, per_token = found[0]
        assert str(every_input) == "softmax: softmax along the token dim", every_input
        assert per_token is None
