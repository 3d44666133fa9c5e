"""Decoding on top of the models: one request (``requests``), the single-request loop
(``decoding``) and the continuously batched loop (``batching``)."""
