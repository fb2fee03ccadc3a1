"""Adapting a planned run while it trains (``tangram-launch --adapt``): detect, decide, switch, report.

The data flow, one module each:

* :mod:`.detect` turns the workers' per-step stage timings into per-GPU rates and flags stragglers (pure);
* :mod:`.decide` re-plans with those rates and switches only when the gain over the horizon pays for the measured
  cost of switching (pure; the planner is passed in);
* :mod:`.handshake` is the worker's side: a switch request names the step to checkpoint at, and saves are timed;
* :mod:`.switch` is the launcher's side: it watches a running segment, asks for the checkpoint, and relaunches the
  workers under the new plan, which resume through the layout-agnostic checkpoint;
* :mod:`.history` records each adaptation in ``run-report.json`` (``tangram-launch report`` prints it).
"""
