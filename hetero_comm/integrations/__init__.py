"""hetero_comm hooks inside training frameworks. Each module imports its framework, so import
only the one you use; ``import hetero_comm`` never needs either.

* :mod:`hetero_comm.integrations.lightning`: :class:`~.lightning.CompressCallback` runs
  :func:`hetero_comm.compress` at the start of ``fit``; :class:`~.lightning.HeteroCommCallback`
  registers a hook of your choice on Lightning's DDP model on every device type (Lightning's own
  ``DDPStrategy(ddp_comm_hook=...)`` registers only on CUDA) and keeps the hook state in
  Lightning's checkpoints.
* :mod:`hetero_comm.integrations.accelerate`: :func:`~.accelerate.compress` (the recipe) or
  :func:`~.accelerate.register_comm_hook` (a hook of your choice), one call after
  ``accelerator.prepare()`` (Accelerate's ``DistributedDataParallelKwargs(comm_hook=)``
  takes only its own hooks), with the state in ``save_state`` / ``load_state``.

With torchrun and plain PyTorch: ``state = hetero_comm.compress(ddp_model, optimizer)`` (or
``ddp_model.register_comm_hook(state, hook)``), and save
``state.state_dict()`` (called on every rank) with the rest of the checkpoint.
"""
