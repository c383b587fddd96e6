"""Every benchmark: `triptych bench` (throughput, serve, layouts, multiturn) and the
kernel / connector / TP scripts (`python -m triptych.bench.kernels`)."""
