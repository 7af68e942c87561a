"""One detector per CP style. Each module exposes

* ``STYLE``: the style's name in the report,
* ``find(graph, graph_kind, cfg, log=None) -> list[match]``: every region of that style, in graph
  order; ``log(attention_node, reason)`` hears why an attention op is not one,
* ``match_at(attention_node, graph_kind, cfg) -> match | None``: the region of one attention op on
  the graph as it is now (after an earlier rewrite replaced nodes it was found through),

where a match is a :class:`~cp_inductor.passes.match.CPMatch`. ``a2a`` (Ulysses) exists; all-gather,
ring and packed (THD) layouts come next.
"""
