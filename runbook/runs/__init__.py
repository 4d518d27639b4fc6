"""Real runs of the cases whose problem a compiled program does not show.

Some cases' problem is invisible to the compiler's analysis of one program: a host resident
set that grows over a loop (`recompilation`), device arrays kept alive step after step
(`live_references`), a compile that folds a table on the host (`constant_folding`), a
captured array held again by the executable (`closure_constant`). For these, what
``python -m runbook run <case>`` measures beyond the compile comes from a real run, here:
one module per case, holding the function its `Case.figures` names
(``"runbook.runs.<case>:<function>"``) and the fresh-process entry points and loop drivers
it uses. Each imports its case (``runbook.cases.<case>``) and the library; never the site,
whose page modules (``runbook.site.<case>``) import what they show from here.
"""
