"""The algorithm, in numpy and without model code: draft trees and their budgets (``tree``,
``candidates``, ``rows``), the cost model (``cost``, ``cost_fit``) and how it is measured
(``profiling``), and the lossless tree walk (``sampling``)."""
