"""partrain.scratch: a small NumPy engine with hand-written forward/backward and parallelism.

A teaching engine, not a framework: every gradient is a line of NumPy one can check against
a textbook, and every parallel mode is a few lines of threads or messages, so the effect of
each parallelization is visible without a framework's own optimizations.

    layers.py     Linear, ReLU, Sigmoid, softmax cross-entropy; He and Xavier init
    net.py        a network over two flat vectors (weights, gradients); the MLP; SGD with momentum
    local.py      one process's gradient: in one thread, or split over threads; the phase timeline
    comm.py       spawning processes; allreduce, send, receive on NumPy arrays (gloo)
    strategies.py serial, threads, ddp, hybrid (one class) and local SGD
    pipeline.py   model parallel: layers on processes, micro-batches pipelined
    train.py      the configuration, the loop, the result
    cli.py        ``partrain train --engine scratch``

    from partrain.scratch import ScratchConfig, run
    run(ScratchConfig(dataset="mnist", strategy="ddp", workers=2, epochs=1)).summary()
"""

__all__ = ["STRATEGIES", "MICRO_BATCHED", "ScratchConfig", "ScratchResult", "run", "run_many"]

# here, not in train.py: the suite reader checks names against them without importing NumPy or torch
STRATEGIES = ("serial", "threads", "ddp", "hybrid", "model-parallel", "local-sgd")
MICRO_BATCHED = ("model-parallel",)  # the strategies that cut a batch into micro-batches


def __getattr__(name: str):
    # lazy: the CLI imports partrain.scratch.cli at every start and must not pay for numpy/torch here
    if name in __all__:
        from partrain.scratch import train

        return getattr(train, name)
    raise AttributeError(f"module 'partrain.scratch' has no attribute {name!r}")
