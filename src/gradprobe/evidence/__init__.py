"""The evidence layer: what every execution path passes through, the user's own paths included.

Collectors gather facts the same way whoever built the path, with mechanisms that need no cooperation
from it; ``causes/`` reads only what they gather:

* ``lineage``: which parameters each term's value depends on and where that dependence stops
  carrying gradient (a dispatch mode plus a function mode, under the ``force_eager`` stance);
* ``confirm``: finite-difference confirmation of dependence that left torch (``.item()``, NumPy);
* ``dynamo_events``: frames compiled, recompiles with dynamo's own guard-failure reasons, graph
  breaks, runs in which no compiled code ran, whoever called ``torch.compile``;
* ``graphlint``: facts of a traced graph a path hands over (sharpens, never required);
* ``locate``: the op whose backward makes NaN, and module reach;
* ``bisect``: one flip at a time, by a variant's knobs or, for a path without knobs, by the
  ``force_eager`` stance and backend overrides (``overrides``);
* ``collect``: runs the collectors inside a probe.
"""
