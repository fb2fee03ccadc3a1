"""The launcher: torchrun with plan-driven rank placement (``torchrun``), planning at launch time (``planning``),
and each worker's start-up shim (``boot``).

Kept free of imports: ``python -m tangram_launch.launch.boot`` starts every worker, and must not pay for
``torch.distributed.run``. ``python -m tangram_launch.launch`` is the launcher itself (``__main__``).
"""
