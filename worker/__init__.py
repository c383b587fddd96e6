"""What every pool worker process runs: the loop, its wire contract, the ``ModelWorker``
base of the engine-running workers, the data endpoint, thread and allocator policy, the
remote `triptych worker` command."""
