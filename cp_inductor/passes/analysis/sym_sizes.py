"""Sizes that may be symbolic, in a form the passes can compare without adding guards.

Under dynamic shapes (automatic dynamic, ``mark_dynamic``, ``dynamic=True``) a graph's sizes are
``SymInt``s over the shape environment's symbols. Comparing two SymInts in Python asks the shape
environment, which may record a guard (and so specialize the user's program), so the passes never
do: every size is read once into a :data:`Size`, an ``int`` where static, else a sympy expression,
and compared structurally. A floor division the environment knows to be exact (``h // cp`` after
the program checked ``h % cp == 0``) becomes a true division, so that ``cp * (h // cp)`` is ``h``.

Divisibility is proved, never guessed from the example sizes: a whole quotient of polynomials, or
a remainder the environment already knows to be zero. Example sizes (hints) only order things
that are ordered for every value anyway, and feed cost models, which say so.
"""

from __future__ import annotations

import math
import weakref

import sympy
import torch
import torch.fx
from torch.utils._sympy.functions import FloorDiv, Mod

Size = int  # or sympy.Expr: the annotation names the common case

_env_ref = None  # the shape environment of the last symbolic size read (one per compile)


def _remember(env) -> None:
    global _env_ref
    if env is not None and (_env_ref is None or _env_ref() is not env):
        _env_ref = weakref.ref(env)


def _env():
    return _env_ref() if _env_ref is not None else None


def _known_zero(env, expr) -> bool:
    """Whether the environment proves ``expr == 0`` without recording a guard."""
    if env is None:
        return False
    try:
        return bool(env._maybe_evaluate_static(sympy.Eq(expr, 0)) == sympy.true)
    except Exception:  # a private API across torch versions: unknown means not proved
        return False


def _normal(env, expr) -> Size:
    if env is not None:
        expr = env.simplify(expr)
    exact = {a: a.args[0] / a.args[1] for a in expr.atoms(FloorDiv) if _known_zero(env, Mod(*a.args))}
    expr = sympy.expand(expr.xreplace(exact)) if exact else expr
    return int(expr) if expr.is_number else expr


class NotASize(Exception):
    """The value is no size the passes can read (the caller skips the match)."""


def size_of(x) -> Size:
    """An ``int``, or a sympy expression in the shape environment's symbols, for a size given as
    an int, a SymInt, a sympy expression or a graph node computing one."""
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.SymInt):
        known = x.node.maybe_as_int()
        if known is not None:
            return int(known)
        _remember(x.node.shape_env)
        return _normal(x.node.shape_env, x.node.expr)
    if isinstance(x, sympy.Basic):
        return int(x) if x.is_number else _normal(_env(), x)
    if isinstance(x, (int, bool)) and not isinstance(x, torch.fx.Node):
        return int(x)
    raise NotASize(f"size {x!r}")


def sizes_of(shape) -> tuple:
    return tuple(size_of(s) for s in shape)


def exact_div(b: Size, a: Size) -> Size | None:
    """``b / a`` where it is provably a whole number for every value of the symbols, else None."""
    if isinstance(a, int) and isinstance(b, int):
        return b // a if a and b % a == 0 else None
    a, b = size_of(a), size_of(b)  # the environment's replacements since either was read
    if a == 1:
        return b
    q = sympy.cancel(sympy.sympify(b) / sympy.sympify(a))
    if q.is_number:
        return int(q) if q.is_Integer and q > 0 else None
    num, den = sympy.fraction(sympy.together(q))
    if not den.is_Integer or den < 1:
        return None
    if den == 1 or _known_zero(_env(), Mod(num, den)):
        return q
    return None


def less(a: Size, b: Size) -> bool:
    """``a < b`` where that holds, or fails, for every value of the symbols; NotASize where it
    depends on them."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    a, b = size_of(a), size_of(b)
    d = sympy.expand(sympy.sympify(b) - sympy.sympify(a))
    if d.is_number:
        return bool(d > 0)
    for claim, answer in ((sympy.Gt(d, 0), True), (sympy.Le(d, 0), False)):
        env = _env()
        try:
            if env is not None and env._maybe_evaluate_static(claim) == sympy.true:
                return answer
        except Exception:  # a private API across torch versions: unknown means not proved
            pass
    raise NotASize(f"{a} < {b} depends on the sizes")


def equal(a, b, *, guard: bool = False) -> bool:
    """Whether two sizes are equal for every value of the symbols. With ``guard``, two symbolic
    sizes that are equal at the traced sizes are made equal by a guard, as Dynamo's own shape
    checks do: a later call where they differ recompiles. Only a forward (or inference) graph
    may guard: its guards reach Dynamo's; a backward graph compiles too late for that, and sees
    the forward's guards as the shape environment's replacements."""
    a, b = size_of(a), size_of(b)
    if a == b:
        return True
    if not guard or (isinstance(a, int) and isinstance(b, int)) or hint(a) != hint(b):
        return False
    _guard(sympy.Eq(a, b))
    return size_of(a) == size_of(b)


def specialize(x: Size) -> Size:
    """``x`` guarded to its traced value (a forward graph's choice; see :func:`equal`), or ``x``
    where the environment refuses."""
    if isinstance(x, int):
        return x
    _guard(sympy.Eq(x, hint(x)))
    return size_of(x)


def _guard(claim) -> None:
    """Record ``claim`` (true at the traced sizes) as a guard; nothing where the environment
    refuses (a private API across torch versions: the caller then sees no equality)."""
    if _env() is not None:
        try:
            _env().evaluate_expr(claim)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def may_guard(graph: torch.fx.Graph) -> bool:
    """Whether :func:`equal` may guard in ``graph``: not in a backward graph (AOTAutograd names
    its gradient inputs ``tangents_*``)."""
    for n in graph.nodes:
        if n.op != "placeholder":
            return True
        if str(n.target).startswith("tangents"):
            return False
    return True


def hint(x: Size) -> int:
    """The size at the example inputs the graph was traced with."""
    if isinstance(x, int):
        return x
    env = _env()
    vals = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {}) if env is not None else {}
    value = sympy.sympify(x).xreplace({s: vals[s] for s in x.free_symbols if s in vals})
    if not value.is_number:
        raise NotASize(f"no example value for {x}")
    return int(value)


def prod(sizes) -> Size:
    out = math.prod(sizes)
    return int(out) if isinstance(out, sympy.Basic) and out.is_number else out
