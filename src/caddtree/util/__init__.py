"""Plumbing, importable from every layer: argument checks and the error types (``checks``,
``errors``), files and caches (``files``, ``defaults``), logging and Ctrl-C (``logs``), lazy
re-exports (``lazy``), devices and dtypes (``devices``), matplotlib (``plots``) and streamed text
(``streaming``). Nothing here imports another caddtree layer."""
