"""The two tracers behind ``fxpipe.frontend.trace``, each with what it needs to give a
graph fxpipe can cut and the shapes of its inputs:

    symbolic.py  torch.fx.symbolic_trace: refusing grad-mode regions it cannot record,
                 binding the inputs to placeholders, probing which dimensions may vary
    export.py    torch.export non-strict: every dimension free (Dim.AUTO), export's
                 checks removed, lifted constants turned back into ops, the ranges
                 export assumed
    repeats.py   export of a model whose layers repeat: two of them exported, the
                 second copied for the rest (two periods, the last copied in turn, where
                 layers alternate), where every later layer runs alike
    layer_runs.py the model's run recorded layer by layer on fake tensors, which says
                 whether and with what period its layers run alike (the whole model's
                 in a forked child, fxpipe/forked.py)
    functions.py the model's own torch.autograd.Functions, kept as one call each by both
                 tracers, named in a note where a tracer runs through them
    hooks.py     backward hooks: a hooked module kept as one call under symbolic_trace,
                 a note for each hook the stages would not run
    attention.py attention called as the model calls it eagerly where export records it
                 otherwise: is_causal for a causal mask of the sizes, enable_gqa
    checkpoints.py the model's own torch.utils.checkpoint calls, traced as plain calls
    records.py   InputShape and TraceError, which both report
    names.py     torch.fx made to print a child named like a keyword (``class``) as
                 ``getattr``, installed here: every graph it prints is then valid Python
"""

from fxpipe.tracing.names import install

install()
